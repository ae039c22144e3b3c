"""A replica: one engine with its sessions (floe.server.core.ServeCore), or several models' engines
loaded on demand (floe.server.models.ModelRouter), as a Ray actor, its sessions in the store every
replica shares (floe.snapshot.store). The front (floe.cluster.router) calls it.

Every answer is a plain value: errors come back as {"error": ServeError.payload()} rather than raised,
so what crosses Ray is data, never an exception to unpickle; a chat streams its events as a generator
(("started", {"session_id", "had", "loaded"}), ("text", piece), ..., ("done", result)). Its pieces are
text, made on the replica by its model's own tokenizer (so the front needs no model's token table).

Every answer also says which models the replica has loaded now and how many free KV slots each has
(`loaded`, {model: free}; {} with one model): the front places a new session of a model where it is
loaded (floe.cluster.router) from what it already receives, with no call of its own per request.
"""

from __future__ import annotations

import logging
import queue
import threading

from floe.server.heap import settle_heap
from floe.server.protocol import ServeError

log = logging.getLogger("floe.cluster")


class Replica:
    """An engine core on one Ray worker (engine_core's, of `options`)."""

    def __init__(self, name: str, snapshots: str, **options) -> None:
        self.name = name
        self.slots = options.get("slots", 4)  # (engine_core's default)
        self._cancelled: set[str] = set()
        self._lock = threading.Lock()
        try:
            self.core = engine_core(snapshots, **options)
            settle_heap()  # (this worker is the core's process, as floe serve's: its collector so too)
        except Exception as e:  # (a ServeError does not unpickle on the other side: its message does)
            raise RuntimeError(f"{type(e).__name__}: {e}") from None

    def _cores(self) -> list:
        """Its loaded engine cores (one model's; several: each loaded one's)."""
        models = getattr(self.core, "models", None)
        if models is None:
            return [self.core]
        return [core for core in (m.core for m in models.values()) if core is not None]

    def loaded(self) -> dict[str, int]:
        """Its loaded models, each with its free KV slots (its slots less its live sessions); {}: a
        replica of one model (always loaded)."""
        models = getattr(self.core, "models", None) or {}
        return {name: self.slots - core.store.counts()["live"]
                for name, core in ((name, m.core) for name, m in models.items()) if core is not None}

    def ping(self) -> dict:
        """Who and where it is: its name, Ray node, session counts, loaded models (`loaded`)."""
        import ray

        counts: dict[str, int] = {}
        cores = self._cores()
        for core in cores:
            for state, n in core.store.counts().items():
                counts[state] = counts.get(state, 0) + n
        return {"name": self.name, "node": ray.get_runtime_context().get_node_id(), "sessions": counts,
                "owner": cores[0].snapshots.owner if cores else None, "loaded": self.loaded()}

    def _answer(self, work) -> dict:
        """{"ok": work()} or {"error": payload}, with `loaded` (what is loaded after it)."""
        try:
            answer = {"ok": work()}
        except ServeError as e:
            answer = {"error": e.payload()}
        return answer | {"loaded": self.loaded()}

    def call(self, name: str, arg=None, owner=None) -> dict:
        """A core call (floe.server.protocol.CALLS): {"ok": value} or {"error": payload}, and `loaded`."""
        return self._answer(lambda: self.core.call(name, arg, owner))

    def chat(self, rid: str, request: dict):
        """A chat's events, as they happen (a Ray streaming generator)."""
        try:
            chat = self.core.open(request)
        except ServeError as e:
            yield ("error", e.payload())
            return
        session = chat.session  # (None: a text completion)
        yield ("started", {"session_id": None if session is None else session.id,
                           "had": 0 if session is None else len(session.messages), "loaded": self.loaded()})
        pieces: queue.Queue = queue.Queue()
        end = object()

        def run() -> None:
            try:
                result = ("done", self.core.run(chat, pieces.put if request.get("stream") else None,
                                                lambda: rid in self._cancelled))
            except ServeError as e:
                result = ("error", e.payload())
            except Exception as e:  # noqa: BLE001 - answered; the replica goes on
                log.exception("a chat failed")
                result = ("error", ServeError(500, f"internal error: {type(e).__name__}: {e}",
                                              "server_error", "internal_error").payload())
            pieces.put((end, result))

        threading.Thread(target=run, name="floe-replica-chat", daemon=True).start()
        try:
            while True:
                item = pieces.get()
                batch = [item]
                while not pieces.empty():  # what gathered meanwhile goes in one event
                    batch.append(pieces.get_nowait())
                text = "".join(p for p in batch if isinstance(p, str))
                if text:
                    yield ("text", text)
                ends = [p for p in batch if isinstance(p, tuple) and p[0] is end]
                if ends:
                    yield ends[0][1]
                    return
        finally:
            self._cancelled.discard(rid)

    def cancel(self, rid: str) -> None:
        """The chat's client left: its row stops at its next token."""
        self._cancelled.add(rid)

    def export(self, sid: str, owner: str) -> dict:
        return self._answer(lambda: b"".join(bytes(c) for c in self.core.export(sid, owner)))

    def import_(self, sid: str, owner: str, data: bytes) -> dict:
        return self._answer(lambda: self.core.import_(sid, owner, [data]))

    def drain(self) -> list[str]:
        """Freeze every session and give up its lease: they continue on other replicas."""
        return [key for core in self._cores() for key in core.store.drain()]

    def close(self) -> None:
        self.core.close()


def _footprint(device: str):
    """What a model's load takes, measured around it (floe.server.models.Residency): the process's RSS,
    on a GPU its allocated bytes."""
    from floe.memory import rss_bytes

    if device == "cpu":
        return rss_bytes
    import torch

    return lambda: torch.cuda.memory_allocated(torch.device(device))


def engine_core(snapshots: str, *, model: str | None = None, models: list | None = None, context: int = 2048,
                slots: int = 4, threads: int = 1, lease_s: float = 30.0, device: str = "cpu",
                keep_alive: float | None = None, max_loaded: int | None = None,
                memory_budget: int | None = None, **options):
    """A replica's engine core: one model's (`model`: a path, None the default model: a ServeCore), or
    several models' (`models`: ModelSpecs, each loaded when a request first names it, as one `floe
    serve` of several models loads them: floe.server.models.ModelRouter, with keep_alive, max_loaded and
    memory_budget; each model's sessions under `snapshots`/its name). `options`: ServeCore's
    (durability: freeze_every_turn...)."""
    import torch

    from floe.engine import Engine, bound_kernel_caches
    from floe.model import load_checkpoint
    from floe.server.core import ServeCore
    from floe.server.sessions import snapshot_store

    bound_kernel_caches()
    torch.set_num_threads(threads)
    cpu = device == "cpu"

    def engine(checkpoint) -> Engine:
        made = Engine(checkpoint, device=device, dtype="float32" if cpu else "bfloat16",
                      max_seq_len=context, n_slots=slots, weights="native" if cpu else "dense")
        made.warm_up()
        return made

    def store(where: str):
        return snapshot_store(where, idle_seconds=options.get("idle_seconds", 300.0), lease_s=lease_s)

    if models is None:
        checkpoint = load_checkpoint(model)
        model_id = options.pop("model_id", checkpoint.source.stem)
        return ServeCore(engine(checkpoint), snapshots=store(snapshots), model_id=model_id, **options)
    from floe.server.models import ModelRouter

    def load(spec, snapshots) -> ServeCore:
        return ServeCore(engine(load_checkpoint(spec.path)), snapshots=snapshots, model_id=spec.name,
                         **options)

    stores = [(spec, store(f"{snapshots.rstrip('/')}/{spec.name}")) for spec in models]
    return ModelRouter(stores, load, keep_alive=keep_alive, max_loaded=max_loaded,
                       memory_budget=memory_budget, footprint=_footprint(device))
