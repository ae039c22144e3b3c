"""What runs at the end of every engine loop step, in the loop's thread: readers of what the steps
stream (the serve core's connections: floe.server.core_socket), called by floe.actor.loop."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger("floe.actor")

_WATCHERS: tuple[Callable[[], None], ...] = ()  # (replaced whole: each step reads it without a lock)
_FAILED: set[int] = set()
_LOCK = threading.Lock()


def watch_steps(watcher: Callable[[], None]) -> Callable[[], None]:
    """Call watcher() at the end of every step of every engine loop in this process, in the loop's
    thread (on a GPU while the forward the step launched computes): for a reader of what the steps
    stream that otherwise polls from a thread of its own, which took the GIL from the loop at every
    poll (each release in a launch waited to take it back). It must be quick and never block. Returns
    the function that stops it."""
    global _WATCHERS
    with _LOCK:
        _WATCHERS = (*_WATCHERS, watcher)

    def unwatch() -> None:
        global _WATCHERS
        with _LOCK:
            _WATCHERS = tuple(w for w in _WATCHERS if w is not watcher)
    return unwatch


def stepped() -> None:
    """A step has ended: every watcher called (one that raises is logged once, and called again at the
    next step; the turns go on)."""
    for watcher in _WATCHERS:
        try:
            watcher()
        except Exception:  # noqa: BLE001 - a reader's bug must not fail the turns
            if id(watcher) not in _FAILED:  # (said once, not at every step)
                _FAILED.add(id(watcher))
                log.exception("a step watcher failed (said once; it is still called)")
