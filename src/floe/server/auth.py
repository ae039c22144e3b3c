"""API keys of `floe serve` (docs/SERVER.md, "API keys and owners"): who a request is for.

With keys, every route but /health needs `Authorization: Bearer KEY` (what the official openai client
sends); the request is then for the key's *owner*, a slow keyed hash of it (never the key itself),
which is stored with every session the key makes, so a freeze, a thaw and a restart keep it. Without
keys the server is open: every request is for one owner, OPEN. This module imports nothing heavy: the
HTTP front checks keys, the engine core only ever sees owners.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Callable, Iterable
from pathlib import Path

from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

OPEN = ""  # the one owner of a server without keys
KEYS_ENV = "FLOE_API_KEYS"  # comma-separated keys, added to --api-key's
# The operator's keys (also API keys): with keys, only they see the server's /metrics and whole /health
OPERATOR_KEYS_ENV = "FLOE_OPERATOR_KEYS"
PUBLIC_PATHS = ("/health",)  # answered without a key (a load balancer's probe): then with no details
# PBKDF2's salt and rounds: the same key is the same owner on every server (a restart, another machine
# thawing the snapshots); ~70 ms a key, once at start, makes guessing a short key from a snapshot slow.
OWNER_SALT, OWNER_ROUNDS = b"floe serve: the owner of a session", 100_000


class BadApiKey(ValueError):
    """An API key that cannot travel in an HTTP header or in FLOE_API_KEYS."""


def owner_of(key: str) -> str:
    """The owner id of `key`'s sessions: 32 hex digits of PBKDF2-HMAC-SHA256 (protocol.OWNER)."""
    return hashlib.pbkdf2_hmac("sha256", key.encode(), OWNER_SALT, OWNER_ROUNDS, dklen=16).hex()


def api_keys(given: Iterable[str] = (), environ: dict[str, str] | None = None,
             files: Iterable[str | os.PathLike] = (), variable: str = KEYS_ENV) -> tuple[str, ...]:
    """The server's keys: `given` (--api-key), FLOE_API_KEYS' comma-separated ones and each of `files`'
    (--api-key-file: one a line; blank lines and lines starting with # skipped), each checked:
    printable ASCII without spaces or commas. Empty: the server is open. The environment and files
    are the way to give them: a command line's arguments are shown to every user by `ps`.
    variable: the environment's (FLOE_OPERATOR_KEYS for the operator's keys)."""
    listed = (environ if environ is not None else os.environ).get(variable, "")
    keys = [*given, *(k.strip() for k in listed.split(",") if k.strip())]
    for path in files:
        try:
            lines = Path(path).read_text(encoding="ascii").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise BadApiKey(f"cannot read API keys from {path}: {e}") from None
        keys += [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    for key in keys:
        if not key or not all("!" <= c <= "~" for c in key) or "," in key:
            raise BadApiKey("an API key must be printable ASCII without spaces or commas (e.g. "
                            "`openssl rand -hex 32`)")
    return tuple(dict.fromkeys(keys))


class ApiKeys:
    """ASGI middleware: sets `request.state.owner` to the caller's owner id (OPEN without keys; None on
    a public path called without a valid key) and `request.state.operator` (the key is one of
    `operators`, or the server is open), and answers every other request without a valid key with
    `reject(message)`. Keys are compared in constant time (as digests: lengths leak nothing).
    `operators` are keys too (each its own owner)."""

    def __init__(self, app: ASGIApp, keys: Iterable[str], reject: Callable[[str], Response],
                 operators: Iterable[str] = ()) -> None:
        self.app, self.reject = app, reject
        operators = tuple(operators)
        self.owners = [(hashlib.sha256(k.encode()).digest(), owner_of(k))
                       for k in dict.fromkeys((*keys, *operators))]
        self.operators = {owner_of(k) for k in operators}

    def owner(self, authorization: bytes | None) -> str | None:
        """The owner of a request with this Authorization header, or None if it names no key."""
        if not self.owners:
            return OPEN
        scheme, _, token = (authorization or b"").partition(b" ")
        digest = hashlib.sha256(token.strip()).digest()
        found = None
        for key, owner in self.owners:  # every key, whatever matched: the time says nothing
            if hmac.compare_digest(digest, key) and scheme.lower() == b"bearer":
                found = owner
        return found

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            return await self.app(scope, receive, send)
        authorization = next((v for k, v in scope["headers"] if k == b"authorization"), None)
        owner = self.owner(authorization)
        if owner is None and scope["path"] not in PUBLIC_PATHS:
            message = ("this server needs an API key: send `Authorization: Bearer KEY`" if authorization
                       is None else "the API key is not one of this server's")
            return await self.reject(message)(scope, receive, send)
        state = scope.setdefault("state", {})
        state["owner"] = owner
        state["operator"] = owner is not None and (not self.owners or owner in self.operators)
        await self.app(scope, receive, send)
