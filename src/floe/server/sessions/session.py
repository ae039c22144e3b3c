"""One session of `floe serve` (a conversation, its actor when live, its lock) and what a message
returned to its client."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from floe.actor import Actor, MessageStats
from floe.server.records import SESSION_ID, make_record, session_key, split_key
from floe.server.sessions.errors import SessionError


@dataclass
class Answer:
    """A message's outcome as its client received it (SessionStore.run)."""

    text: str  # the reply, cut before a stop string
    stats: MessageStats
    stopped: bool  # a stop string ended it
    left: bool  # its client left before its end: the session did not keep the turn


@dataclass
class Session:
    id: str
    messages: list[dict] = field(default_factory=list)  # what the actor holds: role, content
    actor: Actor | None = None
    last_used: float = field(default_factory=time.monotonic)
    lock: threading.Lock = field(default_factory=threading.Lock)
    seed: int = 0
    owner: str = ""  # whose it is (protocol.OWNER; "": a server without API keys)
    anonymous: bool = False  # made for a request that named no session (kept per owner up to a bound)
    doomed: bool = False  # claimed to be forgotten (SessionStore._bound_anonymous)
    persist: bool = True  # its snapshots go to the store's durable home (a one-shot's: RAM only)
    stored: bool = False  # the store holds a snapshot of it (as far as this server knows)
    snapshot_bytes: int | None = None

    @property
    def live(self) -> bool:
        return self.actor is not None

    @property
    def key(self) -> str:
        return session_key(self.owner, self.id)

    def record(self) -> dict:
        return make_record(self.id, self.owner, self.anonymous, self.messages, self.seed)

    def describe(self) -> dict:
        """What a client may know of it (not where its snapshot lies)."""
        actor = self.actor  # once: a freeze may close it meanwhile
        return {"id": self.id, "state": "live" if actor else "frozen", "messages": len(self.messages),
                "kv_tokens": actor.engine.kv_len(actor.slot) if actor else None,
                "idle_seconds": round(time.monotonic() - self.last_used, 3),
                "snapshot_bytes": self.snapshot_bytes if self.stored else None,
                "anonymous": self.anonymous, "persisted": self.persist}


def is_prefix(prefix: list[dict], messages: list[dict]) -> bool:
    return len(prefix) <= len(messages) and common_start(prefix, messages) == len(prefix)


def common_start(a: list[dict], b: list[dict]) -> int:
    """How many messages two conversations share from their start (role and content)."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x["role"] != y["role"] or x["content"] != y["content"]:
            break
        n += 1
    return n


def owner_of_key(key: str) -> str:
    """The owner a store key's session belongs to ("" for an open server's, or a key of no session)."""
    found = split_key(key)
    return found[0] if found is not None else ""


def checked_id(sid: str) -> str:
    """A session id as given, if it is one: never a path (no / or \\, no leading dot, no control
    characters), so its snapshot lies under the store's prefix."""
    if not isinstance(sid, str) or not SESSION_ID.fullmatch(sid) or sid.endswith(".lease"):
        raise SessionError(f"session id {str(sid)[:200]!r} is not valid (letters, digits, _ . -; at most "
                           "128; not ending in .lease)")
    return sid
