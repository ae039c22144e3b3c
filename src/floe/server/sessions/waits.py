"""Requests waiting for a busy session (one that runs another request's turn, a freeze, an import),
bounded in number and in time: each waiter holds a thread of the engine core's socket, and unbounded
they held all of them (25 requests at one session running long turns held the 20 threads of a
4-slot server, and every other user's request waited behind them, for minutes)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from floe.server.sessions.errors import SessionBusy
from floe.server.sessions.session import Session


class LockWaits:
    """At most `most` requests at once wait for a busy session's lock, each at most `seconds`; past
    either, SessionBusy (503, Retry-After) instead of a wait."""

    def __init__(self, most: int, seconds: float) -> None:
        self.most, self.seconds = most, seconds
        self.waiting = 0
        self._count = threading.Lock()

    def take(self, session: Session) -> None:
        """Lock `session` for a request, waiting as above if it is busy."""
        if session.lock.acquire(blocking=False):
            return
        with self._count:
            if self.waiting >= self.most:
                raise SessionBusy(f"session {session.id!r} is busy (running another request, a freeze or an "
                                  f"import) and {self.waiting} requests wait for busy sessions already; "
                                  "send this one once it has answered")
            self.waiting += 1
        try:
            if not session.lock.acquire(timeout=self.seconds):
                raise SessionBusy(f"session {session.id!r} stayed busy (running another request, a freeze or "
                                  f"an import) for the {self.seconds:g} s this request may wait; send it "
                                  "once that one has answered")
        finally:
            with self._count:
                self.waiting -= 1

    @contextlib.contextmanager
    def holding(self, session: Session) -> Iterator[None]:
        """`session` locked for the block (take), released after it."""
        self.take(session)
        try:
            yield
        finally:
            session.lock.release()
