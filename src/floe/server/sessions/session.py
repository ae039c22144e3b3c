"""One session of `floe serve` (a conversation, its actor when live, its lock) and what a message
returned to its client."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Protocol

from floe.actor import Actor, MessageStats
from floe.server.records import SESSION_ID, make_record, session_key, split_key
from floe.server.sessions.errors import SessionError


class Indexes(Protocol):
    """What a session tells of its changes (floe.server.sessions.table.SessionTable)."""

    def noted(self, session: Session) -> None:
        """Index `session` as it is now (drop it, if no longer held)."""

    def used(self, session: Session) -> None:
        """`session`'s last_used changed."""

    def doomed(self, session: Session) -> None:
        """`session`'s doomed changed."""


@dataclass
class Answer:
    """A message's outcome as its client received it (SessionStore.run)."""

    text: str  # the reply, cut before a stop string
    stats: MessageStats
    stopped: bool  # a stop string ended it
    left: bool  # its client left before its end: the session did not keep the turn


class Session:
    """A conversation of `floe serve`: its messages, its actor while live, the lock a request holds
    while it runs in it. Its table (the registry's SessionTable) is told when its actor or messages
    change (its actor, messages, anonymity, last use, doom; its owner and id never do), for the indexes
    an arrival's choices read."""

    def __init__(self, id: str, messages: list[dict] | None = None, actor: Actor | None = None, *,
                 seed: int = 0, owner: str = "", anonymous: bool = False, persist: bool = True,
                 stored: bool = False) -> None:
        self.id = id
        self.owner = owner  # whose it is (protocol.OWNER; "": a server without API keys)
        self._anonymous = anonymous
        self._table: Indexes | None = None
        self.filed_under: tuple | None = None  # (its table's: the opening it is indexed under)
        self._messages: list[dict] = [] if messages is None else messages  # what the actor holds
        self._actor = actor
        self._last_used = time.monotonic()
        self.lock = threading.Lock()
        self.seed = seed
        self._doomed = False
        self.persist = persist  # its snapshots go to the store's durable home (a one-shot's: RAM only)
        self.stored = stored  # the store holds a snapshot of it (as far as this server knows)
        # A snapshot of it may be in the store: found there, or this server put (or tried to put) one
        # (SessionLifecycle.freeze_locked). A one-shot session never frozen is in no tier: forgetting it
        # asks no tier (a stat of the disk's on a burst's every arrival).
        self.may_be_stored = stored
        self.snapshot_bytes: int | None = None

    def __repr__(self) -> str:
        return (f"Session({self.id!r}, owner={self.owner!r}, messages={len(self._messages)}, "
                f"live={self.live}, stored={self.stored})")

    @property
    def actor(self) -> Actor | None:
        return self._actor

    @actor.setter
    def actor(self, actor: Actor | None) -> None:
        self._actor = actor
        if self._table is not None:
            self._table.noted(self)

    @property
    def anonymous(self) -> bool:
        """Made for a request that named no session (kept per owner up to a bound); an import makes it
        named."""
        return self._anonymous

    @anonymous.setter
    def anonymous(self, anonymous: bool) -> None:
        self._anonymous = anonymous
        if self._table is not None:
            self._table.noted(self)

    @property
    def last_used(self) -> float:
        """When a request last used it (time.monotonic(), s): anonymous ones are forgotten least
        recently used first."""
        return self._last_used

    @last_used.setter
    def last_used(self, when: float) -> None:
        self._last_used = when
        if self._table is not None:
            self._table.used(self)

    @property
    def doomed(self) -> bool:
        """Claimed to be forgotten (SessionStore._bound_anonymous): no longer counted toward its owner's
        bound of anonymous sessions."""
        return self._doomed

    @doomed.setter
    def doomed(self, doomed: bool) -> None:
        self._doomed = doomed
        if self._table is not None:
            self._table.doomed(self)

    @property
    def messages(self) -> list[dict]:
        return self._messages

    @messages.setter
    def messages(self, messages: list[dict]) -> None:  # (`+=` extends in place, then sets: noted too)
        self._messages = messages
        if self._table is not None:
            self._table.noted(self)

    def watch(self, table: Indexes | None) -> None:
        """Be indexed by `table` (None: by none; the table it was in drops it)."""
        old, self._table = self._table, table
        if old is not None and old is not table:
            old.noted(self)
        if table is not None:
            table.noted(self)

    @property
    def live(self) -> bool:
        return self._actor is not None

    @property
    def key(self) -> str:
        return session_key(self.owner, self.id)

    def record(self) -> dict:
        return make_record(self.id, self.owner, self.anonymous, self.messages, self.seed)

    def describe(self) -> dict:
        """What a client may know of it (not where its snapshot lies)."""
        actor = self.actor  # once: a freeze may close it meanwhile (a look takes no session's lock)
        slot = None if actor is None else actor.slot  # (None once closed: its slot given back)
        return {"id": self.id, "state": "live" if actor else "frozen", "messages": len(self.messages),
                "kv_tokens": None if slot is None else actor.engine.kv_len(slot),
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
