"""The registry's sessions by store key, indexed as they change, so that an arrival's choices cost
the same with 60 sessions as with 60,000: which sessions are live (a KV slot's holders: admission
counts them, picks the idle one to freeze), which ones a request that names no session may continue
(by owner and first message), and each owner's anonymous sessions (bounded per owner), least
recently used first: an arrival past the bound counts them and takes the first of them, not the least
of a list built of them all (64 sessions: ~140 calls an arrival under the store's lock; a burst's
arrivals took turns at it).

Scanning every session under the registry's lock for each of these took 2.4 ms an arrival with
10,000 sessions in the store (0.3 ms with 1,000), and a burst's arrivals took turns at that lock.

A Session tells its table when its actor, its messages, its anonymity, its last use or its doom
change (Session.actor, .messages, .anonymous, .last_used and .doomed are properties; an import makes
an anonymous session named); its owner and id never change. Each owner's sessions are indexed too (a
key's listing and its counts). The indexes are read as copies, or walked, under the table's own lock:
sessions change outside the registry's lock (a freeze sets `actor`, a turn appends messages under the
session's own lock), so a reader never iterates a dict another thread changes.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from floe.server.sessions.session import Session


def opening(owner: str, message: dict) -> tuple[str, str, str]:
    """The index key of a conversation that starts with `message`: only a session of the same owner
    and first message (role and content, as is_prefix compares them) can be its prefix."""
    content = message["content"]
    if not isinstance(content, str):
        content = json.dumps(content, sort_keys=True, default=str)
    return owner, message["role"], content


class SessionTable(dict):
    """dict: store key -> Session, and its indexes (see the module)."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._live: dict[int, Session] = {}  # by id(session)
        self._openings: dict[tuple[str, str, str], dict[int, Session]] = {}
        # By owner, those that count toward its bound (not doomed): least recently used first, once
        # sorted (a session filed out of order, one loaded from the store, marks its owner's unsorted).
        self._anonymous: dict[str, dict[int, Session]] = {}
        self._unsorted: set[str] = set()
        self._owned: dict[str, dict[int, Session]] = {}  # every session, by owner

    # ---- what the registry reads ------------------------------------------------------------------

    def live(self) -> list[Session]:
        with self._lock:
            return list(self._live.values())

    def live_count(self) -> int:
        return len(self._live)

    def continuing(self, owner: str, history: list[dict]) -> list[Session]:
        """`owner`'s sessions whose first message is `history`'s (the candidates of is_prefix)."""
        if not history:
            return []
        with self._lock:
            return list(self._openings.get(opening(owner, history[0]), {}).values())

    def anonymous(self, owner: str) -> list[Session]:
        """`owner`'s anonymous sessions but those being forgotten (doomed), least recently used first."""
        with self._lock:
            return list(self._in_order(owner).values())

    def anonymous_count(self, owner: str) -> int:
        """How many `anonymous(owner)` lists (without listing them)."""
        return len(self._anonymous.get(owner, ()))  # (one read of a dict: no lock needed)

    def least_recent(self, owner: str, take: Callable[[Session], bool]) -> Session | None:
        """The first of `anonymous(owner)` that holds a conversation (one just made is never forgotten)
        and that take(session) accepts, asked in that order under the table's lock (take must change
        no session). Nearly always the first asked: the walk costs the same with 60 sessions as 600."""
        with self._lock:
            for session in self._in_order(owner).values():
                if session.messages and take(session):
                    return session
        return None

    def owned(self, owner: str) -> list[Session]:
        with self._lock:
            return list(self._owned.get(owner, {}).values())

    # ---- the dict's changes -----------------------------------------------------------------------

    def __setitem__(self, key: str, session: Session) -> None:
        if key != session.key:  # (indexed by its own key: another would leave it out of every index)
            raise KeyError(f"a session is kept under its own key {session.key!r}, not {key!r}")
        old = self.get(key)
        super().__setitem__(key, session)
        if old is not None and old is not session:
            old.watch(None)
        session.watch(self)

    def __delitem__(self, key: str) -> None:
        session = self[key]
        super().__delitem__(key)
        session.watch(None)

    def pop(self, key: str, *default):
        if key not in self:
            if default:
                return default[0]
            raise KeyError(key)
        session = self[key]
        del self[key]
        return session

    def setdefault(self, key: str, default: Session) -> Session:
        if key not in self:
            self[key] = default
        return self[key]

    def popitem(self):
        raise TypeError("SessionTable.popitem: remove a session by its key")

    def update(self, *args, **kwargs) -> None:
        for key, session in dict(*args, **kwargs).items():
            self[key] = session

    def __ior__(self, other):
        self.update(other)
        return self

    def clear(self) -> None:
        for key in list(self):
            del self[key]

    # ---- what a session tells it ------------------------------------------------------------------

    def noted(self, session: Session) -> None:
        """Index `session` as it is now, or drop it if this table no longer holds it. Everything (the
        session's state read, the indexes, the opening it is filed under) under the table's lock: of
        two threads changing one session, the later call sees both changes."""
        ident = id(session)
        with self._lock:
            held = self.get(session.key) is session
            before = session.filed_under
            now = opening(session.owner, session.messages[0]) if held and session.messages else None
            if held and session.actor is not None:
                self._live[ident] = session
            else:
                self._live.pop(ident, None)
            if before != now:
                if before is not None:
                    _drop(self._openings, before, ident)
                if now is not None:
                    self._openings.setdefault(now, {})[ident] = session
                session.filed_under = now
            self._count(session, ident, held)
            if held:
                self._owned.setdefault(session.owner, {})[ident] = session
            else:
                _drop(self._owned, session.owner, ident)


    def doomed(self, session: Session) -> None:
        """`session`'s doom changed: counted toward its owner's bound again, or no longer."""
        with self._lock:
            self._count(session, id(session), self.get(session.key) is session)

    def _count(self, session: Session, ident: int, held: bool) -> None:
        """`session` in its owner's anonymous sessions if it counts toward the bound (caller holds the
        table's lock)."""
        if held and session.anonymous and not session.doomed:
            group = self._anonymous.setdefault(session.owner, {})
            if ident not in group:
                self._file(group, session, ident)
        else:
            _drop(self._anonymous, session.owner, ident)

    def used(self, session: Session) -> None:
        """`session`'s last use changed: filed last in its owner's least recently used order."""
        with self._lock:
            ident = id(session)
            group = self._anonymous.get(session.owner)
            if group is not None and group.pop(ident, None) is not None:
                self._file(group, session, ident)

    def _file(self, group: dict[int, Session], session: Session, ident: int) -> None:
        """`session` filed last in its owner's group (caller holds the table's lock): in order unless one
        there was used later (two requests' ends racing, a session loaded from the store)."""
        if group and next(reversed(group.values())).last_used > session.last_used:
            self._unsorted.add(session.owner)
        group[ident] = session

    def _in_order(self, owner: str) -> dict[int, Session]:
        """`owner`'s anonymous sessions, least recently used first (caller holds the table's lock)."""
        group = self._anonymous.get(owner, {})
        if owner in self._unsorted:
            self._unsorted.discard(owner)
            if group:
                group = self._anonymous[owner] = dict(sorted(group.items(), key=_last_used))
        return group


def _last_used(item: tuple[int, Session]) -> float:
    return item[1].last_used


def _drop(index: dict, key, ident: int) -> None:
    group = index.get(key)
    if group is not None:
        group.pop(ident, None)
        if not group:
            del index[key]
