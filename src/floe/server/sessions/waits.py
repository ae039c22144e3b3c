"""Requests waiting for a busy session (one that runs another request's turn, a freeze, an import),
bounded in number and in time: each waiter holds a thread of the engine core's socket, and unbounded
they held all of them (25 requests at one session running long turns held the 20 threads of a
4-slot server, and every other user's request waited behind them, for minutes). Between API keys the
places are shared as the slot queue's are (floe.server.sessions.admission): a key with no waiter takes
the place of the newest waiter of the key with the most."""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from floe.server.sessions.errors import ClientLeft, SessionBusy
from floe.server.sessions.session import Session

POLL_S = 0.05  # a waiter looks this often whether it gave its place up (a session's lock has no signal)


@dataclass
class _Waiter:
    owner: str
    bumped: bool = False  # its place went to another owner's request


class LockWaits:
    """At most `most` requests at once wait for a busy session's lock, each at most `seconds`; past
    either, SessionBusy (503, Retry-After) instead of a wait."""

    def __init__(self, most: int, seconds: float) -> None:
        self.most, self.seconds = most, seconds
        self._waiters: list[_Waiter] = []  # oldest first (a bumped one until it has seen it)
        self._count = threading.Lock()

    @property
    def waiting(self) -> int:
        return sum(not w.bumped for w in self._waiters)

    def take(self, session: Session, gone: Callable[[], bool] = lambda: False) -> None:
        """Lock `session` for a request, waiting as above if it is busy (ClientLeft once `gone()`: its
        client left, and its place goes to another's)."""
        if session.lock.acquire(blocking=False):
            return
        waiter = self._enter(session)
        try:
            deadline = time.monotonic() + self.seconds
            while not session.lock.acquire(timeout=min(POLL_S, max(0.0, deadline - time.monotonic()))):
                if gone():
                    raise ClientLeft(f"the client left while its request waited for session {session.id!r}")
                if waiter.bumped:
                    raise SessionBusy(f"session {session.id!r} is busy (running another request), and this "
                                      "request's place among those waiting for busy sessions went to another "
                                      "API key's (each key gets a share of them); send it once that one has "
                                      "answered")
                if time.monotonic() >= deadline:
                    raise SessionBusy(f"session {session.id!r} stayed busy (running another request, a "
                                      f"freeze or an import) for the {self.seconds:g} s this request may "
                                      "wait; send it once that one has answered")
        finally:
            with self._count:
                self._waiters.remove(waiter)

    def _enter(self, session: Session) -> _Waiter:
        """A place among the waiters for a request of the session's owner (refused: SessionBusy)."""
        with self._count:
            waiting = [w for w in self._waiters if not w.bumped]
            if len(waiting) >= self.most:
                counts = Counter(w.owner for w in waiting)
                most, n = counts.most_common(1)[0] if counts else ("", 0)
                if counts[session.owner] or n < 2:
                    raise SessionBusy(f"session {session.id!r} is busy (running another request, a freeze or "
                                      f"an import) and {len(waiting)} requests wait for busy sessions "
                                      "already (the most that may); send this one once it has answered")
                next(w for w in reversed(waiting) if w.owner == most).bumped = True
            waiter = _Waiter(session.owner)
            self._waiters.append(waiter)
            return waiter

    @contextlib.contextmanager
    def holding(self, session: Session) -> Iterator[None]:
        """`session` locked for the block (take), released after it."""
        self.take(session)
        try:
            yield
        finally:
            session.lock.release()
