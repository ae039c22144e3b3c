"""Several models in one `floe serve` (docs/SERVER.md, "Several models"): each model its own engine core
(floe.server.core.ServeCore: engine, engine loop, session store) made when a request first names it
and closed after its idle time or to make room; a request's `model` picks the core.

`ModelRouter` answers the engine core's socket (floe.server.core_socket) as one ServeCore does. Each
model keeps its sessions' snapshot store while it is not loaded (its sessions frozen there), so a
session is bound to its model: naming it on another model is a 409, never a silent mix.
"""

from __future__ import annotations

import gc
import logging
import math
import re
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from floe.memory import rss_bytes, trim_heap
from floe.server.core import ServeCore, failure
from floe.server.protocol import ServeError
from floe.server.records import SESSION_ID, NotASession, session_key, split_key
from floe.server.sessions import SessionError, UnknownSession
from floe.server.sessions.registry import SessionRegistry
from floe.server.sessions.session import checked_id
from floe.snapshot import SnapshotError
from floe.snapshot.store import SnapshotStore

log = logging.getLogger("floe.serve")
MODEL_NAME = SESSION_ID  # letters, digits, `_ . -`, the first a letter or digit, at most 128: never a path
SHOWN = 64  # the most characters of a name a message repeats (a 10 KB name is not echoed whole)
DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h)?")
UNITS = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


class ModelLoadFailed(ServeError):
    def __init__(self, name: str, e: BaseException) -> None:
        super().__init__(500, f"the model {name!r} could not be loaded: {type(e).__name__}: {e}",
                         "server_error", "model_load_failed")


@dataclass(frozen=True)
class ModelSpec:
    """A model `floe serve` offers: the name requests use, and its GGUF file or Hugging Face folder
    (None: the default model)."""

    name: str
    path: str | None


def model_specs(values: Iterable[str]) -> list[ModelSpec]:
    """`--model NAME=PATH` values (a bare PATH is named by its file or folder). Raises ValueError
    naming a name that is not one or is given twice."""
    specs = []
    for value in values:
        name, sep, path = value.partition("=")
        if not sep:
            name, path = Path(value).stem, value
        specs.append(ModelSpec(checked_name(name), path or None))
    names = [s.name for s in specs]
    if len(set(names)) < len(names):
        raise ValueError(f"a model name given twice: {sorted(n for n in names if names.count(n) > 1)[0]!r}")
    return specs


def models_in(folder: str | Path) -> list[ModelSpec]:
    """`--models DIR`: every GGUF file (named by its stem) and Hugging Face folder (a folder with
    config.json, named by the folder) in `folder`, by name."""
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise ValueError(f"{folder} is not a folder")
    specs = [ModelSpec(p.stem if p.is_file() else p.name, str(p)) for p in sorted(folder.iterdir())
             if (p.is_file() and p.suffix == ".gguf") or (p.is_dir() and (p / "config.json").is_file())]
    return [ModelSpec(checked_name(s.name), s.path) for s in specs]


def checked_name(name: str) -> str:
    if not MODEL_NAME.fullmatch(name):
        raise ValueError(f"model name {shown(name)}: letters, digits and `_ . -` (the first a letter or "
                         "digit), at most 128")
    return name


def shown(name) -> str:
    """A name as a message repeats it: its first SHOWN characters, control characters escaped."""
    text = str(name)
    return repr(text[:SHOWN]) + ("…" if len(text) > SHOWN else "")


def weights_bytes(path: str | None) -> int:
    """The bytes of a model's weights files (a GGUF file, a folder's safetensors; None: the default
    model's): what its load will take at least, before it was measured."""
    from floe.model import default_model_path

    p = Path(path).expanduser() if path is not None else default_model_path()
    if p.is_dir():
        return sum(f.stat().st_size for f in p.glob("*.safetensors"))
    return p.stat().st_size if p.exists() else 0


def keep_alive_seconds(value) -> float:
    """A request's `keep_alive` (Ollama's): seconds, or a duration ("30s", "5m", "1h"); negative: for
    ever (math.inf). Raises a 400 for anything else."""
    if isinstance(value, bool):
        value = "?"
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str) and (m := DURATION.fullmatch(value.strip())):
        seconds = float(m[1]) * UNITS[m[2]]
    elif isinstance(value, str) and value.strip().startswith("-"):
        seconds = -1.0
    else:
        raise ServeError(400, f"keep_alive {shown(value)}: seconds, or a duration such as \"5m\"",
                         param="keep_alive")
    return math.inf if seconds < 0 else seconds


class ServedModel:
    """One model of the server: its core while loaded, its sessions' store always, and its use."""

    def __init__(self, spec: ModelSpec, snapshots: SnapshotStore) -> None:
        self.spec, self.snapshots = spec, snapshots
        self._reader = SessionRegistry(snapshots)  # reads its sessions' records while it is not loaded
        self.core: ServeCore | None = None
        self.lock = threading.Lock()  # one load or unload of this model at a time
        self.users = 0  # requests and calls holding the core now (never unloaded under them)
        self.last_used = time.monotonic()
        self.keep_alive: float | None = None  # the last request's keep_alive, seconds (None: the server's)
        self.load_seconds = 0.0  # the last load's
        self.nbytes: int | None = None  # what its last load took (the router's footprint: RAM or device)
        self.loads = 0
        self.tokens = {"prompt": 0, "generated": 0}  # of its answered requests, across its loads

    @property
    def name(self) -> str:
        return self.spec.name

    def registered(self, owner: str, sid: str) -> bool:
        """Whether `owner`'s session `sid` is registered in this model's loaded core (no I/O)."""
        core = self.core
        if core is None:
            return False
        with core.store.lock:
            return session_key(owner, sid) in core.store.sessions

    def holds(self, owner: str, sid: str) -> bool:
        """Whether `owner`'s session `sid` is this model's (registered while loaded, or in its store)."""
        return self.registered(owner, sid) or self.snapshots.has(session_key(owner, sid))

    def stored_sessions(self, owner: str) -> list[dict]:
        """`owner`'s sessions in this model's store, described from their snapshots' headers (while the
        model is not loaded: all of them are frozen)."""
        found = []
        for entry in sorted(self.snapshots.home.entries(), key=lambda e: e.key):
            named = split_key(entry.key)
            if named is None or named[0] != owner:
                continue
            try:
                session = self._reader.read(entry.key)
            except (SnapshotError, NotASession):
                continue  # (named in the log when the model loads)
            session.snapshot_bytes = entry.nbytes
            session.last_used = time.monotonic() - max(0.0, time.time() - entry.used_at)
            found.append(session.describe())
        return found

    def describe(self) -> dict:
        core = self.core
        return {"id": self.name, "object": "model", "owned_by": "floe", "loaded": core is not None,
                "load_seconds": self.load_seconds if self.loads else None, "bytes": self.nbytes,
                "sessions": None if core is None else core.store.counts()}


@dataclass
class Routed:
    """A chat or completion opened on one model's core (ModelRouter.open), until ModelRouter.run."""

    chat: object  # the core's Chat or Completion
    model: ServedModel

    @property
    def session(self):
        return self.chat.session

    @property
    def constraint(self):
        return self.chat.constraint

    @property
    def stops(self) -> tuple[str, ...]:
        return self.chat.stops


class ModelMetrics:
    """The router's /metrics (a prometheus_client collector): each model's state (loaded, load time,
    loads, sessions, tokens: floe_model_*), and each loaded model's core metrics labelled `model`."""

    def __init__(self, router: ModelRouter) -> None:
        self.router = router

    def collect(self) -> Iterator[Metric]:
        models = list(self.router.models.values())
        families: dict[str, Metric] = {}
        for m in models:  # the cores' own (floe_ttft_seconds, ...), one family a name across models
            if (core := m.core) is not None:
                for family in core.metrics.registry.collect():
                    into = families.setdefault(family.name, Metric(family.name, family.documentation,
                                                                   family.type, family.unit))
                    into.samples += [s._replace(labels={"model": m.name, **s.labels}) for s in family.samples]
        yield from families.values()
        loaded = GaugeMetricFamily("floe_model_loaded", "Whether the model's engine is loaded",
                                   labels=["model"])
        load_s = GaugeMetricFamily("floe_model_load_seconds", "The model's last load (reading its weights, "
                                   "building and warming its engine and core)", labels=["model"])
        loads = CounterMetricFamily("floe_model_loads", "Times the model was loaded", labels=["model"])
        sessions = GaugeMetricFamily("floe_model_sessions", "The loaded model's sessions by state",
                                     labels=["model", "state"])
        tokens = CounterMetricFamily("floe_model_tokens", "Tokens of the model's answered requests, across "
                                     "its loads", labels=["model", "kind"])
        for m in models:
            core = m.core
            loaded.add_metric([m.name], float(core is not None))
            load_s.add_metric([m.name], m.load_seconds)
            loads.add_metric([m.name], m.loads)
            if core is not None:
                counts = core.store.counts()
                for state in ("live", "frozen"):
                    sessions.add_metric([m.name, state], counts[state])
            for kind, n in m.tokens.items():
                tokens.add_metric([m.name, kind], n)
        yield from (loaded, load_s, loads, sessions, tokens)


class ModelRouter:
    """ServeCore's surface over several models, each loaded by `load(spec, snapshots)` when a request
    first names it (the first model at start). keep_alive: seconds a loaded model with no live
    sessions and no request stays loaded (None: for ever; a request's keep_alive sets its model's);
    max_loaded: models loaded at once (None: any), loading one more unloads the least recently used
    idle one (its live sessions frozen into its store first; every loaded one in use: the load waits
    for one, at most wait_seconds, then a 503); memory_budget: the same for the loaded models' bytes,
    each model's measured by `footprint()` (the process's RSS; on a GPU its allocated bytes) before and
    after its load (at least its weights files' size). say(text): progress for the server's log.
    """

    def __init__(self, models: list[tuple[ModelSpec, SnapshotStore]],
                 load: Callable[[ModelSpec, SnapshotStore], ServeCore], *, keep_alive: float | None = None,
                 max_loaded: int | None = None, memory_budget: int | None = None,
                 footprint: Callable[[], int] = rss_bytes, wait_seconds: float = 30.0,
                 say: Callable[[str], None] = log.info) -> None:
        if not models:
            raise ValueError("no models to serve")
        if max_loaded is not None and max_loaded < 1:
            raise ValueError(f"max_loaded must be >= 1, not {max_loaded}")
        self.models = {spec.name: ServedModel(spec, store) for spec, store in models}
        self.first = next(iter(self.models.values()))
        self.load_core, self.keep_alive, self.max_loaded, self.say = load, keep_alive, max_loaded, say
        self.lock = threading.Lock()  # guards each model's users and core across models
        self.idle = threading.Condition(self.lock)  # notified when a model's last user lets it go
        self.wait_seconds, self.memory_budget, self.footprint = wait_seconds, memory_budget, footprint
        self.started = time.time()
        self._ids_ok: dict[str, bool] = {}  # per model: its tokens are the front's vocab's (streams ids)
        self.take(self.first)
        self.release(self.first)
        self._vocab = self.first.core._vocab  # the front's table ("vocab"), whichever models load later
        self._pool_threads = self.first.core.pool_threads
        self.registry = CollectorRegistry()
        self.registry.register(ModelMetrics(self))
        self._released: list[weakref.ref] = []  # engines unloaded and not yet collected
        self._closed = threading.Event()
        self._unloader = threading.Thread(target=self._unload_loop, name="floe-unload", daemon=True)
        self._unloader.start()

    # ---- which model -------------------------------------------------------------------------------

    def model(self, name) -> ServedModel:
        """The model a request names: a 404 naming the ones there are (a name echoed cut short)."""
        served = self.models.get(name) if isinstance(name, str) else None
        if served is None:
            raise ServeError(404, f"the model {shown(name)} does not exist; this server serves "
                                  f"{', '.join(map(repr, self.models))}", code="model_not_found",
                             param="model")
        return served

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
                self.release(served)
                if isinstance(e, ServeError):
                    raise
                log.exception("loading model %s failed", served.name)
                raise ModelLoadFailed(served.name, e) from None
            served.load_seconds, served.loads = time.perf_counter() - started, served.loads + 1
            with self.lock:
                served.core = core
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
        wanted = loading.nbytes if loading.nbytes is not None else weights_bytes(loading.spec.path)
        return sum(m.nbytes or 0 for m in loaded) + wanted <= self.memory_budget

    def _make_room(self, loading: ServedModel) -> None:
        """Unload the least recently used idle models until `loading` fits (_fits; every loaded model in
        use: wait for one to be let go, at most wait_seconds, then a 503)."""
        deadline = time.monotonic() + self.wait_seconds
        while True:
            with self.lock:
                while True:
                    loaded = [m for m in self.models.values() if m.core is not None and m is not loading]
                    if self._fits(loading, loaded):
                        return
                    victim = min((m for m in loaded if not m.users), key=lambda m: m.last_used, default=None)
                    if victim is not None:
                        break
                    if not self.idle.wait(deadline - time.monotonic()):
                        raise ServeError(503, f"every loaded model ({len(loaded)}) is running requests; "
                                              f"{loading.name!r} loads once one is idle (--max-loaded, "
                                              "--memory-budget)", "server_error", "server_busy")
            self.unload(victim, "to make room for " + loading.name)

    def unload(self, served: ServedModel, why: str) -> bool:
        """Close `served`'s core (its live sessions frozen into its store first) unless a request holds
        it; whether it was unloaded."""
        with served.lock:
            with self.lock:
                core = served.core
                if core is None or served.users:
                    return False
                served.core = None
            started = time.perf_counter()
            core.close()  # freezes every live session into the model's store, stops its evictor
            self._released.append(weakref.ref(core.engine))  # (its memory: _collect)
            self.say(f"model {served.name} unloaded ({why}) in {time.perf_counter() - started:.2f} s")
            return True

    def _collect(self) -> None:
        """Collect unloaded engines (cycles hold them; the engine loop's thread lets go after its idle
        exit, floe.actor.loop.IDLE_EXIT_S) and hand their freed heap pages back: the RSS falls back."""
        gc.collect()
        alive = [ref for ref in self._released if ref() is not None]
        if len(alive) < len(self._released):
            trim_heap()
        self._released = alive

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

    # ---- ServeCore's surface (floe.server.core_socket) ----------------------------------------------

    @property
    def pool_threads(self) -> int:
        """Threads the socket's pool needs: every loaded model's running and waiting chats."""
        return len(self.models) * self._pool_threads

    def open(self, request: dict) -> Routed:
        served = self.model(request.get("model"))
        if "keep_alive" in request:
            served.keep_alive = keep_alive_seconds(request["keep_alive"])
        sid = request.get("session_id")
        if isinstance(sid, str) and MODEL_NAME.fullmatch(sid):
            self._refuse_elsewhere(served, request.get("owner"), sid)
        core = self.take(served)
        try:
            return Routed(core.open(request), served)
        except BaseException:
            self.release(served)
            raise

    def _refuse_elsewhere(self, served: ServedModel, owner, sid: str) -> None:
        """A 409 if `owner`'s session `sid` belongs to another model than `served`."""
        if not isinstance(owner, str) or served.registered(owner, sid):
            return  # (the core refuses a bad owner); a session registered here is this model's: the
            # other models' stores are asked only for a session this model has not seen (no I/O a turn)
        others = [m for m in self.models.values() if m is not served]
        for other in sorted(others, key=lambda m: not m.registered(owner, sid)):  # (no I/O first)
            if other.holds(owner, sid):
                raise ServeError(409, f"session {sid!r} belongs to the model {other.name!r}; ask that "
                                      f"model (or use a new session for {served.name!r})",
                                 code="session_model_mismatch", param="model")

    def run(self, routed: Routed, on_text=None, should_stop=lambda: False, tokens=None) -> dict:
        served = routed.model
        try:
            result = served.core.run(routed.chat, on_text, should_stop, tokens)
        finally:
            self.release(served)
        with self.lock:
            served.tokens["prompt"] += result["usage"]["prompt_tokens"]
            served.tokens["generated"] += result["usage"]["completion_tokens"]
        return result

    def streams_ids(self, routed: Routed) -> bool:
        """Whether the chat's reply can go to the front as token ids: its model's tokens are the front's
        table's (models with another tokenizer stream text)."""
        name = routed.model.name
        if name not in self._ids_ok:
            self._ids_ok[name] = routed.model.core._vocab == self._vocab
        return self._ids_ok[name]

    def keep_spares(self) -> None:
        for served in self.models.values():
            if (core := served.core) is not None:
                core.keep_spares()

    def call(self, name: str, arg=None, owner=None):
        if name == "hello":
            return {"model_id": self.first.name, "aliases": [], "models": list(self.models),
                    "started": self.started,
                    "max_text_bytes": None}  # (each model's own: its core checks it)
        if name == "vocab":
            return self._vocab
        if name == "models":
            return [m.describe() | {"created": int(self.started)} for m in self.models.values()]
        if name in ("load", "unload"):
            return self._load_or_unload(name, self.model(arg))
        if name in ("health", "metrics"):
            return self._health(arg, owner) if name == "health" else self._metrics()
        if name == "sessions":  # a model not loaded: its frozen sessions, from its store's headers
            return [s | {"model": m.name} for m in self.models.values()
                    for s in (m.core.call(name, arg, owner) if m.core else m.stored_sessions(owner))]
        if name == "session" and isinstance(arg, str) and isinstance(owner, str):
            # Answered in the socket's reading thread (core_socket.INLINE_CALLS): no model's lock, no load
            served = self._session_model(arg, owner)
            if (core := served.core) is not None:
                return core.call(name, arg, owner)
            if served.holds(owner, arg):  # (read, not loaded for a look)
                return next(s for s in served.stored_sessions(owner) if s["id"] == arg)
        sid = arg
        if name == "fork" and isinstance(arg, dict):
            sid, new_id = arg.get("id"), arg.get("new_id")
            if isinstance(new_id, str) and isinstance(owner, str) and MODEL_NAME.fullmatch(new_id):
                if held := next((m for m in self.models.values() if m.holds(owner, new_id)), None):
                    raise ServeError(409, f"session {new_id!r} exists (a session of the model "
                                          f"{held.name!r}); fork into a new id", code="session_exists")
        return self._on_session_model(sid, owner, lambda core: core.call(name, arg, owner))

    def _load_or_unload(self, call: str, served: ServedModel) -> dict:
        """POST /v1/models/{id}/load or /unload: the model loaded now (as a request would load it), or
        unloaded now (its live sessions frozen; a 409 while it runs a request)."""
        if call == "load":
            self.take(served)
            self.release(served)
        elif not self.unload(served, "asked") and served.core is not None:
            raise ServeError(409, f"the model {served.name!r} is running requests; unload it once they "
                                  "end", code="model_busy")
        return served.describe() | {"created": int(self.started)}

    def _session_model(self, sid, owner, makes: bool = False) -> ServedModel:
        """The model that holds `owner`'s session `sid`. None holds it: the first, if it is loaded or
        the call `makes` the session (an import), whose core answers (a 404 or 400 if it makes none);
        else that 404 or 400 without loading a model for it."""
        if isinstance(sid, str) and isinstance(owner, str) and MODEL_NAME.fullmatch(sid):
            held = next((m for m in self.models.values() if m.holds(owner, sid)), None)
            if held is not None:
                return held
        if makes or self.first.core is not None:
            return self.first
        try:
            checked_id(sid)
        except SessionError as e:
            raise failure(e, None) from None
        raise failure(UnknownSession(f"no session {sid!r}"), None)

    def _on_session_model(self, sid, owner, work: Callable[[ServeCore], object], makes: bool = False):
        """`work` on the core of the model that holds `owner`'s session `sid` (loaded for it)."""
        served = self._session_model(sid, owner, makes)
        core = self.take(served)
        try:
            return work(core)
        finally:
            self.release(served)

    def _loaded(self) -> list[ServedModel]:
        return [m for m in self.models.values() if m.core is not None]

    def _health(self, arg, owner) -> dict:
        full = not (isinstance(arg, dict) and not arg.get("full", True))
        models = {}
        for m in self.models.values():
            core = m.core
            models[m.name] = {"loaded": core is not None}
            if core is not None:
                models[m.name] |= core.call("health", arg, owner) if full else {
                    "sessions": core.call("health", arg, owner)["sessions"]}
        return {"status": "ok", "model": self.first.name, "uptime_s": time.time() - self.started,
                "models": models}

    def _metrics(self) -> str:
        return generate_latest(self.registry).decode()

    def export(self, sid, owner) -> Iterator[memoryview]:
        """The session's snapshot bytes; its model stays loaded until they are sent (or dropped)."""
        served = self._session_model(sid, owner)
        core = self.take(served)
        try:
            chunks = core.export(sid, owner)
        except BaseException:
            self.release(served)
            raise

        def held() -> Iterator[memoryview]:
            try:
                yield from chunks
            finally:
                self.release(served)
        return held()

    def import_(self, sid, owner, chunks: Iterable) -> dict:
        return self._on_session_model(sid, owner, lambda core: core.import_(sid, owner, chunks), makes=True)

    def close(self) -> None:
        """Stop unloading and close every loaded model (their live sessions frozen)."""
        if not self._closed.is_set():
            self._closed.set()
            self._unloader.join(30)
            for served in self.models.values():
                core, served.core = served.core, None
                if core is not None:
                    core.close()


__all__ = ["ModelRouter", "ModelSpec", "ServedModel", "model_specs", "models_in"]
