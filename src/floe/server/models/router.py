"""ServeCore's surface over several models (floe.server.models): a request's `model` picks the engine
core it runs on, a session's calls go to the model that holds it (loaded for them by the residency)."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest

from floe.memory import rss_bytes
from floe.server.core import ServeCore, failure
from floe.server.models.metrics import ModelMetrics
from floe.server.models.residency import Residency
from floe.server.models.served import ServedModel
from floe.server.models.specs import MODEL_NAME, ModelSpec, keep_alive_seconds, shown
from floe.server.protocol import ServeError
from floe.server.records import session_key
from floe.server.sessions import SessionError, UnknownSession
from floe.server.sessions.session import checked_id
from floe.snapshot import SnapshotError
from floe.snapshot.layout import header_length, parse_header
from floe.snapshot.store import SnapshotStore

log = logging.getLogger("floe.serve")


@dataclass
class Routed:
    """A chat or completion opened on one model's core (ModelRouter.open), until ModelRouter.run."""

    chat: object  # the core's Chat or Completion
    model: ServedModel
    claim: str | None = None  # the named session's store key, claimed for this request (ModelRouter._claim)
    table: bool = False  # the front makes its text of ids with its model's table (CoreClient.table)

    @property
    def session(self):
        return self.chat.session

    @property
    def constraint(self):
        return self.chat.constraint

    @property
    def stops(self) -> tuple[str, ...]:
        return self.chat.stops


@dataclass
class Claim:
    """A named session's model, as requests routed it, and its requests running now; `checking` while
    its first request asks the other models' stores whether one holds the id (set when that is told)."""

    model: ServedModel
    running: int = 0
    checking: threading.Event | None = None


def mismatch(sid: str, owner: ServedModel, asked: ServedModel) -> ServeError:
    return ServeError(409, f"session {sid!r} belongs to the model {owner.name!r}; ask that model (or use a "
                           f"new session for {asked.name!r})", code="session_model_mismatch", param="model")


class ModelRouter:
    """ServeCore's surface over several models, each loaded by `load(spec, snapshots)` when a request
    first names it (the first model at start); which are loaded: Residency (its options: keep_alive,
    max_loaded, memory_budget, footprint, wait_seconds, say). A request's keep_alive sets its model's."""

    def __init__(self, models: list[tuple[ModelSpec, SnapshotStore]],
                 load: Callable[[ModelSpec, SnapshotStore], ServeCore], *, keep_alive: float | None = None,
                 max_loaded: int | None = None, memory_budget: int | None = None,
                 footprint: Callable[[], int] = rss_bytes, wait_seconds: float = 30.0,
                 say: Callable[[str], None] = log.info) -> None:
        if not models:
            raise ValueError("no models to serve")
        self.models = {spec.name: ServedModel(spec, store) for spec, store in models}
        self.first = next(iter(self.models.values()))
        self.started = time.time()
        self.residency = Residency(self.models, load, keep_alive=keep_alive, max_loaded=max_loaded,
                                   memory_budget=memory_budget, footprint=footprint,
                                   wait_seconds=wait_seconds, say=say)
        self._claims: dict[str, Claim] = {}  # named sessions' models, by store key (_claim)
        self._claims_lock = threading.Lock()
        self._ids_ok: dict[str, bool] = {}  # per model: its tokens are the front's vocab's (streams ids)
        core = self.residency.take(self.first)
        self.residency.release(self.first)
        self._vocab = core._vocab  # the front's table ("vocab"), whichever models load later
        self._pool_threads = core.pool_threads
        self.registry = CollectorRegistry()
        self.registry.register(ModelMetrics(lambda: list(self.models.values())))

    # ---- which model -------------------------------------------------------------------------------

    def model(self, name) -> ServedModel:
        """The model a request names: a 404 naming the ones there are (a name echoed cut short)."""
        served = self.models.get(name) if isinstance(name, str) else None
        if served is None:
            raise ServeError(404, f"the model {shown(name)} does not exist; this server serves "
                                  f"{', '.join(map(repr, self.models))}", code="model_not_found",
                             param="model")
        return served

    # ---- ServeCore's surface (floe.server.core_socket) ----------------------------------------------

    fixed_calls = ()  # (each model's "vocab" answer is its own: asked by name)
    # Looks that may read a store (an unloaded model's sessions, from their headers): answered on the core
    # socket's own threads, not in the thread that reads every request of a front (core_socket.LOOKS)
    reads_stores = ("sessions", "session")

    @property
    def pool_threads(self) -> int:
        """Threads the socket's pool needs: every loaded model's running and waiting chats."""
        return len(self.models) * self._pool_threads

    def open(self, request: dict, gone: Callable[[], bool] = lambda: False) -> Routed:
        served = self.model(request.get("model"))
        if "keep_alive" in request:
            served.keep_alive = keep_alive_seconds(request["keep_alive"])
        claim = self._claim(served, request.get("owner"), request.get("session_id"))
        try:
            core = self.residency.take(served)
        except BaseException:
            self._unclaim(claim)
            raise
        try:
            return Routed(core.open(request, gone), served, claim, request.get("table") == served.name)
        except BaseException:
            self.residency.release(served)
            self._unclaim(claim)
            raise

    def _claim(self, served: ServedModel, owner, sid) -> str | None:
        """Claim `owner`'s named session `sid` for `served` for a request (its store key, for _unclaim;
        None: no named session): a 409 if it belongs to another model. Checked and claimed in one step,
        so two requests that make a session of the same id on two models at once cannot both run."""
        if not (isinstance(owner, str) and isinstance(sid, str) and MODEL_NAME.fullmatch(sid)):
            return None  # (the core refuses what is not an id or an owner)
        key = session_key(owner, sid)
        while True:
            with self._claims_lock:
                claim = self._claims.get(key)
                if claim is None:  # (a claim lives while a request of it runs: _unclaim)
                    # The other models' stores are asked outside the lock (on S3 a round trip each): a
                    # request naming another id never waits for it; one naming this id waits for this answer.
                    claim = self._claims[key] = Claim(served, checking=threading.Event())
                    break
                if claim.checking is None:
                    if claim.model is not served:  # (one of its requests runs)
                        raise mismatch(sid, claim.model, served)
                    claim.running += 1
                    return key
                told = claim.checking
            told.wait()
        try:
            self._refuse_elsewhere(served, owner, sid)
        except BaseException:
            with self._claims_lock:
                del self._claims[key]
                claim.checking, told = None, claim.checking
            told.set()  # (a request waiting for it asks again)
            raise
        with self._claims_lock:
            claim.running += 1
            claim.checking, told = None, claim.checking
        told.set()
        return key

    def _unclaim(self, key: str | None) -> None:
        """A request of the claim ended; the claim goes with its last (a claim kept for good held every id
        ever named in memory; the next request's _refuse_elsewhere finds the model that holds it)."""
        if key is not None:
            with self._claims_lock:
                claim = self._claims[key]
                claim.running -= 1
                if not claim.running:
                    del self._claims[key]

    def _refuse_elsewhere(self, served: ServedModel, owner, sid: str) -> None:
        """A 409 if `owner`'s session `sid` belongs to another model than `served`."""
        if not isinstance(owner, str) or served.registered(owner, sid):
            return  # (the core refuses a bad owner); a session registered here is this model's: the
            # other models' stores are asked only for a session this model has not seen (no I/O a turn)
        others = [m for m in self.models.values() if m is not served]
        for other in sorted(others, key=lambda m: not m.registered(owner, sid)):  # (no I/O first)
            if other.holds(owner, sid):
                raise mismatch(sid, other, served)

    def run(self, routed: Routed, on_text=None, should_stop=lambda: False, tokens=None) -> dict:
        served = routed.model
        try:
            result = served.core.run(routed.chat, on_text, should_stop, tokens)
        finally:
            self.residency.release(served)
            self._unclaim(routed.claim)
        with self.residency.lock:
            served.tokens["prompt"] += result["usage"]["prompt_tokens"]
            served.tokens["generated"] += result["usage"]["completion_tokens"]
        return result

    def streams_ids(self, routed: Routed) -> bool:
        """Whether the chat's reply can go to the front as token ids: its model's tokens are the front's
        table's (models with another tokenizer stream text)."""
        if routed.table:
            return True
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
        if name == "vocab" and isinstance(arg, str):  # a model's own table (loaded for it)
            served = self.model(arg)
            core = self.residency.take(served)
            self.residency.release(served)
            return core._vocab
        if name == "vocab":
            return self._vocab
        if name == "tokenizer":  # (no prompt hints: each model's chats are rendered by its core)
            return None
        if name == "models":  # (another key than the operator's: its own sessions' counts, as /health)
            mine = isinstance(arg, dict) and not arg.get("full", True)
            return [m.describe(owner if mine else None) | {"created": int(self.started)}
                    for m in self.models.values()]
        if name in ("load", "unload"):
            return self._load_or_unload(name, self.model(arg))
        if name in ("health", "metrics"):
            return self._health(arg, owner) if name == "health" else self._metrics()
        if name == "sessions":  # a model not loaded: its frozen sessions, from its store's headers
            cores = {m: m.core or m.unloading for m in self.models.values()}  # (each read once)
            return [s | {"model": m.name} for m, core in cores.items()
                    for s in (core.call(name, arg, owner) if core else m.stored_sessions(owner))]
        if name == "session" and isinstance(arg, str) and isinstance(owner, str):
            # Answered at once (core_socket's looking threads, reads_stores): no model's lock, no load
            served = self._session_model(arg, owner)
            if (core := served.core or served.unloading) is not None:
                return core.call(name, arg, owner)
            # Read, never loaded for a look (a model's load here held every request of the front's)
            if found := served.stored_sessions(owner, arg):
                return found[0]
            raise failure(UnknownSession(f"no session {arg!r}"), None)  # (gone meanwhile, or unreadable)
        if name == "fork" and isinstance(arg, dict):
            return self._fork(arg, owner)
        return self._on_session_model(arg, owner, lambda core: core.call(name, arg, owner))

    def _fork(self, arg: dict, owner):
        """A fork on the model of its source, its new id claimed for that model while it is made (as a
        chat's: a request of another model that makes a session of that id meanwhile is refused)."""
        sid, new_id = arg.get("id"), arg.get("new_id")
        served = self._session_model(sid, owner)
        claim = None
        if isinstance(new_id, str) and isinstance(owner, str) and MODEL_NAME.fullmatch(new_id):
            held = next((m for m in self.models.values() if m.holds(owner, new_id)), None)
            try:
                claim = self._claim(served, owner, new_id) if held is None else None
            except ServeError as e:  # (another model's request makes it now)
                held = e
            if held is not None:
                model = f" (a session of the model {held.name!r})" if isinstance(held, ServedModel) else ""
                raise ServeError(409, f"session {new_id!r} exists{model}; fork into a new id",
                                 code="session_exists")
        try:
            return self._on_session_model(sid, owner, lambda core: core.call("fork", arg, owner),
                                          served=served)
        finally:
            self._unclaim(claim)

    def _load_or_unload(self, call: str, served: ServedModel) -> dict:
        """POST /v1/models/{id}/load or /unload: the model loaded now (as a request would load it), or
        unloaded now (its live sessions frozen; a 409 while it runs a request)."""
        if call == "load":
            self.residency.take(served)
            self.residency.release(served)
        elif not self.residency.unload(served, "asked") and served.core is not None:
            raise ServeError(409, f"the model {served.name!r} is running requests; unload it once they "
                                  "end", code="model_busy")
        return served.describe() | {"created": int(self.started)}

    def _session_model(self, sid, owner, makes: bool = False) -> ServedModel:
        """The model that holds `owner`'s session `sid`. None holds it: the first, if it is loaded or
        the call `makes` the session (an import), whose core answers (a 404 or 400 if it makes none);
        else that 404 or 400 without loading a model for it."""
        held = self._holder(sid, owner)
        if held is not None:
            return held
        if makes or self.first.core is not None:
            return self.first
        try:
            checked_id(sid)
        except SessionError as e:
            raise failure(e, None) from None
        raise failure(UnknownSession(f"no session {sid!r}"), None)

    def _holder(self, sid, owner) -> ServedModel | None:
        """The model that holds `owner`'s session `sid`, if one does."""
        if isinstance(sid, str) and isinstance(owner, str) and MODEL_NAME.fullmatch(sid):
            return next((m for m in self.models.values() if m.holds(owner, sid)), None)
        return None

    def _on_session_model(self, sid, owner, work: Callable[[ServeCore], object], makes: bool = False,
                          served: ServedModel | None = None):
        """`work` on the core of `served`, else of the model that holds `owner`'s session `sid` (loaded
        for it)."""
        served = served or self._session_model(sid, owner, makes)
        core = self.residency.take(served)
        try:
            return work(core)
        finally:
            self.residency.release(served)

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
        core = self.residency.take(served)
        try:
            chunks = core.export(sid, owner)
        except BaseException:
            self.residency.release(served)
            raise

        def held() -> Iterator[memoryview]:
            try:
                yield from chunks
            finally:
                self.residency.release(served)
        return held()

    def import_(self, sid, owner, chunks: Iterable) -> dict:
        """Make or replace `owner`'s session `sid` from a snapshot's bytes: in the model that holds it,
        else in the model the snapshot's header names (its fingerprint, or a model not loaded yet by
        its checkpoint's name), else the first (whose core refuses what it cannot thaw)."""
        served = self._holder(sid, owner)
        if served is None:
            metadata, chunks = snapshot_metadata(chunks)
            served = None if metadata is None else next(
                (m for m in self.models.values() if m.names_snapshot(metadata)), None)
        served = served or self._session_model(sid, owner, makes=True)
        # Claimed as a chat claims its session: a request of another model that makes a session of this
        # id meanwhile is refused (each made one: the id was a session of two models)
        claim = self._claim(served, owner, sid)
        try:
            return self._on_session_model(sid, owner, lambda core: core.import_(sid, owner, chunks),
                                          served=served)
        finally:
            self._unclaim(claim)

    def close(self) -> None:
        """Stop unloading and close every loaded model (their live sessions frozen)."""
        self.residency.close()


def snapshot_metadata(chunks: Iterable) -> tuple[dict | None, Iterator]:
    """A snapshot upload's header metadata, read from its first bytes (None: not a header floe reads:
    the core's import refuses it with its reason), and the upload's chunks whole again."""
    head, it = bytearray(), iter(chunks)
    metadata = None
    try:
        for chunk in it:
            head += chunk
            if len(head) >= 8:
                n = header_length(bytes(head[:8]), None, UPLOAD)
                if n > PEEK_BYTES:  # (not held in memory here: the core's import reads it as it streams)
                    break
                if len(head) >= 8 + n:
                    metadata = parse_header(bytes(head[8:8 + n]), None, UPLOAD).metadata
                    break
    except SnapshotError:
        pass
    return metadata, itertools.chain([bytes(head)] if head else [], it)


UPLOAD = Path("the uploaded snapshot")
PEEK_BYTES = 16 << 20  # the most of a header an import reads ahead to find its model
