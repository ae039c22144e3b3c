"""A `floe serve` session as the snapshot store holds it: its key (`[owner/]id`) and the conversation
record stored inside its snapshot (the `app` metadata entry, checksummed with the state)."""

from __future__ import annotations

import json
import re

from floe.server.protocol import OWNER

SESSION_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")  # fullmatch: "$" would let a final "\n" in
ROLES = ("system", "user", "assistant")
SEED_LIMIT = 2**63  # a session's seed is below it (floe.sampling_params.SamplingParams)


class NotASession(ValueError):
    """A snapshot without a well-formed conversation record of floe serve's."""


def session_key(owner: str, sid: str) -> str:
    """A session's store key: its id, under its owner's (ids are per owner)."""
    return f"{owner}/{sid}" if owner else sid


def split_key(key: str) -> tuple[str, str] | None:
    """(owner, id) of a store key that names a session, else None."""
    parts = key.split("/")
    if len(parts) == 1 and SESSION_ID.fullmatch(parts[0]):
        return "", parts[0]
    if len(parts) == 2 and parts[0] and OWNER.fullmatch(parts[0]) and SESSION_ID.fullmatch(parts[1]):
        return parts[0], parts[1]
    return None


def make_record(sid: str, owner: str, anonymous: bool, messages: list[dict], seed: int) -> dict:
    """The `app` record a session's snapshot carries."""
    return {"floe_server": {"id": sid, "owner": owner, "anonymous": anonymous, "messages": messages,
                            "seed": seed}}


def app_record(metadata: dict[str, str]) -> dict:
    """The snapshot's conversation record: messages of a known role with text, and an integer seed."""
    record = json.loads(metadata.get("app", "{}")).get("floe_server")  # "app" is checked to be an object
    messages = record.get("messages") if isinstance(record, dict) else None
    if not isinstance(messages, list) or not all(
            isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)
            for m in messages):
        raise NotASession("not a floe serve session (no conversation record of role and content messages)")
    seed, owner, anonymous = record.get("seed", 0), record.get("owner", ""), record.get("anonymous", False)
    if type(seed) is not int or not 0 <= seed < SEED_LIMIT:  # (2**64 was a 500 at every thaw: torch's
        # generator takes 64 bits; floe writes a request's seed, [0, 2**63), or 63 random bits)
        raise NotASession(f"not a floe serve session (its seed {str(seed)[:20]!r} is not an integer in "
                          "[0, 2**63))")
    if not (isinstance(owner, str) and OWNER.fullmatch(owner)) or type(anonymous) is not bool:
        raise NotASession("not a floe serve session (its owner is not an owner id or 'anonymous' not a "
                          "boolean)")
    return {"messages": messages, "seed": seed, "owner": owner, "anonymous": anonymous}
