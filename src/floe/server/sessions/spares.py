"""Actors kept off a request's path: spare ones made ahead while the engine loop is idle (a new session
takes one instead of making its own as it arrives), and forgotten sessions' actors closed later."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor

from floe.actor import Actor
from floe.errors import FloeError
from floe.server.sessions.actors import ActorMaker

log = logging.getLogger("floe.serve")

# Forgotten sessions' actors are closed here (~1-2 ms each: their guests torn down), not by the request
# that forgot them (a burst's arrivals each forget an idle session of their owner's).
_CLOSER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="floe-close")
CLOSE_LATER_MOST = 256  # forgotten actors waiting for an idle loop to be closed; past it, closed at once
CLOSE_LATER_S = 5.0  # the longest one waits
SPARE_CHECK_S = 0.05  # how often the spare-actor maker looks for free slots and an idle engine loop
SPARE_RETRY_S = 1.0  # after a spare actor could not be made


class SpareActors:
    """Spare actors (without KV slots) and actors waiting to be closed, both guarded by `lock` (the
    session registry's: a spare is taken in the slot its caller counted under it)."""

    def __init__(self, actors: ActorMaker, lock: threading.Lock) -> None:
        self.actors, self.lock = actors, lock
        self.ready: list[Actor] = []  # actors made ahead in free slots (keep); guarded by lock
        self._wanted = 0
        self._closing_later: deque[Actor] = deque()  # forgotten sessions' actors (close_later)
        self._closing = threading.Event()
        self._maker: threading.Thread | None = None

    def close_later(self, actor: Actor) -> None:
        """Close an actor that gave up its slot once the engine loop is idle (its guest's teardown, ~1-2
        ms of the core's GIL, is not a burst's: 64 arrivals each forgetting a session paid 64 of them
        while they arrived), or at once past CLOSE_LATER_MOST waiting or CLOSE_LATER_S."""
        with self.lock:
            self._closing_later.append(actor)
            if len(self._closing_later) <= CLOSE_LATER_MOST:
                if len(self._closing_later) == 1:
                    _CLOSER.submit(self._close_waiting)
                return
            actor = self._closing_later.popleft()
        actor.close()

    def _close_waiting(self) -> None:
        loop = self.actors.loop
        end = time.monotonic() + CLOSE_LATER_S
        while (loop is not None and loop.busy and time.monotonic() < end
               and not self._closing.is_set()):
            time.sleep(SPARE_CHECK_S)
        while True:
            with self.lock:
                if not self._closing_later:
                    return
                actor = self._closing_later.popleft()
            actor.close()

    def keep(self, wanted: int) -> None:
        """Keep up to `wanted` actors made ahead, without KV slots (Actor kv_slot="later"), made while the
        engine loop has no turn: a new session takes one (and the slot it was counted) instead of making
        its actor as it arrives (~1 ms of the core's GIL time each, which a burst of arrivals pays one
        after another). Held slots do not keep them from being made: a burst into slots idle sessions
        hold (forgotten or frozen for it) finds them too."""
        self._wanted = wanted
        if self._maker is None and wanted > 0:
            self._maker = threading.Thread(target=self._make, name="floe-spares", daemon=True)
            self._maker.start()

    def fresh(self) -> Actor | None:
        """A spare actor in the KV slot its caller counted (SlotAdmission.reserve), if there is one: a
        new session's, or one a thaw restores (floe.snapshot.thaw's into)."""
        with self.lock:
            if not self.ready:
                return None
            actor = self.ready.pop()
        try:
            actor.attach_slot()
        except FloeError:  # (no slot after all: a slot held outside the store's count) it makes its own
            log.warning("a spare actor found no free KV slot", exc_info=True)
            actor.close()
            return None
        return actor

    def _make(self) -> None:
        loop = self.actors.loop
        while not self._closing.wait(SPARE_CHECK_S):
            while len(self.ready) < self._wanted and not self._closing.is_set() and not (
                    loop is not None and loop.busy):
                actor, failed = None, False
                try:
                    actor = self.actors.new(kv_slot="later")
                except Exception:  # noqa: BLE001 - sessions make their own meanwhile, as without spares
                    log.exception("could not make a spare actor (trying again in %g s)", SPARE_RETRY_S)
                    failed = True
                with self.lock:
                    if actor is not None and not self._closing.is_set():
                        self.ready.append(actor)
                        actor = None
                if actor is not None:  # made as the store closed
                    actor.close()
                    return
                if failed:
                    self._closing.wait(SPARE_RETRY_S)
                    break

    def close(self) -> None:
        """Stop making spares and close every actor held (at shutdown)."""
        self._closing.set()
        if self._maker is not None:
            self._maker.join(30)
        with self.lock:
            spares, self.ready = self.ready, []
            spares += self._closing_later
            self._closing_later.clear()
        for actor in spares:
            actor.close()
