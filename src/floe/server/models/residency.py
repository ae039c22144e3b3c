"""Which of a server's models are loaded (floe.server.models): a model loads when it is first taken,
and is unloaded when idle past its keep-alive or to make room for another (--max-loaded,
--memory-budget); its live sessions are frozen into its store first, and its memory handed back."""

from __future__ import annotations

import gc
import logging
import math
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

from floe.memory import rss_bytes, trim_heap
from floe.server.models.served import ModelLoadFailed, ServedModel
from floe.server.models.specs import ModelSpec, weights_bytes
from floe.server.protocol import ServeError
from floe.snapshot.store import SnapshotStore

if TYPE_CHECKING:
    from floe.server.core import ServeCore

log = logging.getLogger("floe.serve")
COLLECT_S = 60.0  # how long after an unload the residency collects (4 times a second) for its engine


class Residency:
    """Loads `models` by `load(spec, snapshots)` when taken (take/release: a model is never unloaded
    while taken). keep_alive: seconds a loaded model with no live sessions and nobody holding it stays
    loaded (None: for ever; a model's own keep_alive, a request's, wins); max_loaded: models loaded at
    once (None: any), loading one more unloads the least recently used idle one (every loaded one in
    use: the load waits for one, at most wait_seconds, then a 503); memory_budget: the same for the
    loaded models' bytes, each model's measured by `footprint()` (the process's RSS; on a GPU its
    allocated bytes) before and after its load (at least its weights files' size). say(text):
    progress for the server's log."""

    def __init__(self, models: dict[str, ServedModel], load: Callable[[ModelSpec, SnapshotStore], ServeCore],
                 *, keep_alive: float | None = None, max_loaded: int | None = None,
                 memory_budget: int | None = None, footprint: Callable[[], int] = rss_bytes,
                 wait_seconds: float = 30.0, say: Callable[[str], None] = log.info) -> None:
        if max_loaded is not None and max_loaded < 1:
            raise ValueError(f"max_loaded must be >= 1, not {max_loaded}")
        self.models = models
        self.load_core, self.keep_alive, self.max_loaded, self.say = load, keep_alive, max_loaded, say
        self.lock = threading.Lock()  # guards each model's users and core across models
        self.idle = threading.Condition(self.lock)  # notified when a model's last user lets it go
        self.wait_seconds, self.memory_budget, self.footprint = wait_seconds, memory_budget, footprint
        # Engines unloaded and not yet collected: (the engine, its model's name, when to stop looking)
        self._released: list[tuple[weakref.ref, str, float]] = []
        # Models being loaded, counted as loaded by _make_room: two loads at once each found room for one
        # (--max-loaded 2, two models loading beside a loaded one: all three loaded)
        self._loading: set[ServedModel] = set()
        self._closed = threading.Event()
        self._unloader = threading.Thread(target=self._unload_loop, name="floe-unload", daemon=True)
        self._unloader.start()

    def take(self, served: ServedModel) -> ServeCore:
        """`served`'s core, loaded if it is not (making room under max_loaded), held until release()."""
        with served.lock:
            with self.lock:
                served.users += 1
                served.last_used = time.monotonic()
                core = served.core
            if core is not None:
                return core
            try:
                self._make_room(served)
                started, before = time.perf_counter(), self.footprint()
                self.say(f"loading model {served.name} ({served.spec.path or 'the default model'}) …")
                core = self.load_core(served.spec, served.snapshots)
                core.keep_spares()
                # (at least its weights' size: the growth misses memory an unloaded model freed and the
                # heap had not handed back yet)
                served.nbytes = max(self.footprint() - before, weights_bytes(served.spec.path))
            except BaseException as e:
                with self.lock:
                    self._loading.discard(served)
                self.release(served)
                if isinstance(e, ServeError):
                    raise
                log.exception("loading model %s failed", served.name)
                raise ModelLoadFailed(served.name, e) from None
            served.load_seconds, served.loads = time.perf_counter() - started, served.loads + 1
            with self.lock:
                served.core = core
                served.fingerprint = core.engine.checkpoint.fingerprint  # (an import finds it by it)
                self._loading.discard(served)
            self.say(f"model {served.name} loaded in {served.load_seconds:.2f} s ({served.nbytes >> 20} MiB)")
            return core

    def release(self, served: ServedModel) -> None:
        with self.lock:
            served.users -= 1
            served.last_used = time.monotonic()
            if not served.users:
                self.idle.notify_all()

    def _fits(self, loading: ServedModel, loaded: list[ServedModel]) -> bool:
        """Whether `loading` fits beside `loaded`: max_loaded, and memory_budget (the loaded models'
        measured bytes and `loading`'s: measured at its last load, else its weights' size); alone, a
        model always loads."""
        if self.max_loaded is not None and len(loaded) >= self.max_loaded:
            return False
        if self.memory_budget is None or not loaded:
            return True
        return sum(map(self._bytes, loaded)) + self._bytes(loading) <= self.memory_budget

    @staticmethod
    def _bytes(served: ServedModel) -> int:
        """A model's bytes: measured at its last load, else its weights' size (one being loaded)."""
        return served.nbytes if served.nbytes is not None else weights_bytes(served.spec.path)

    def _make_room(self, loading: ServedModel) -> None:
        """Unload the least recently used idle models until `loading` fits beside the loaded models and
        those being loaded (_fits; every loaded model in use: wait for one to be let go, at most
        wait_seconds, then a 503); then it counts as being loaded (_loading) until take() has loaded it."""
        deadline = time.monotonic() + self.wait_seconds
        while True:
            with self.lock:
                while True:
                    loaded = [m for m in self.models.values()
                              if (m.core is not None or m in self._loading) and m is not loading]
                    if self._fits(loading, loaded):
                        self._loading.add(loading)
                        return
                    victim = min((m for m in loaded if not m.users and m.core is not None),
                                 key=lambda m: m.last_used, default=None)
                    if victim is not None:
                        break
                    if not self.idle.wait(deadline - time.monotonic()):
                        raise ServeError(503, f"every loaded model ({len(loaded)}, those loading too) is "
                                              f"running requests; {loading.name!r} loads once one is idle "
                                              "(--max-loaded, --memory-budget)", "server_error",
                                         "server_busy")
            self.unload(victim, "to make room for " + loading.name)

    def unload(self, served: ServedModel, why: str) -> bool:
        """Close `served`'s core (its live sessions frozen into its store first) unless a request holds
        it; whether it was unloaded."""
        with served.lock:
            with self.lock:
                core = served.core
                if core is None or served.users:
                    return False
                served.core, served.unloading = None, core
            started = time.perf_counter()
            try:
                core.close()  # freezes every live session into the model's store, stops its evictor
            finally:
                with self.lock:
                    served.unloading = None
            self._released.append((weakref.ref(core.engine), served.name, time.monotonic() + COLLECT_S))
            self.say(f"model {served.name} unloaded ({why}) in {time.perf_counter() - started:.2f} s")
            return True

    def _collect(self) -> None:
        """Collect unloaded engines (cycles hold them; the engine loop's thread lets go after its idle
        exit, floe.actor.loop.IDLE_EXIT_S) and hand their freed heap pages back: the RSS falls back."""
        gc.collect()
        alive = [r for r in self._released if r[0]() is not None]
        if len(alive) < len(self._released):
            trim_heap()
        now = time.monotonic()
        for _, name, _ in (r for r in alive if r[2] < now):  # (a leak: say so, and stop collecting for it)
            log.warning("the engine of model %s is still referenced %g s after its unload: its memory "
                        "stays", name, COLLECT_S)
        self._released = [r for r in alive if r[2] >= now]

    def _unload_loop(self) -> None:
        while not self._closed.wait(0.25):
            if self._released:
                self._collect()
            now = time.monotonic()
            for served in list(self.models.values()):
                keep = served.keep_alive if served.keep_alive is not None else self.keep_alive
                core = served.core
                if (keep is None or keep == math.inf or core is None or served.users
                        or now - served.last_used < keep or core.store.counts()["live"]):
                    continue
                try:
                    self.unload(served, f"idle {keep:g} s")
                except Exception:  # noqa: BLE001 - keep unloading the others; the error is logged
                    log.exception("unloading model %s failed", served.name)

    def close(self) -> None:
        """Stop unloading and close every loaded model (their live sessions frozen)."""
        if not self._closed.is_set():
            self._closed.set()
            self._unloader.join(30)
            for served in self.models.values():
                core, served.core = served.core, None
                if core is not None:
                    core.close()
