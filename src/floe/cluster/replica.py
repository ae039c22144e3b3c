"""A replica: one engine with its sessions (floe.server.core.ServeCore) as a Ray actor, its sessions
in the store every replica shares (floe.snapshot.store). The front (floe.cluster.router) calls it.

Every answer is a plain value: errors come back as {"error": ServeError.payload()} rather than raised,
so what crosses Ray is data, never an exception to unpickle; a chat streams its events as a generator
(("started", {"session_id", "had"}), ("text", piece), ..., ("done", result)).
"""

from __future__ import annotations

import logging
import queue
import threading

from floe.server.protocol import ServeError

log = logging.getLogger("floe.cluster")


class Replica:
    """An engine core on one Ray worker. `options`: ServeCore's (durability: freeze_every_turn...)."""

    def __init__(self, name: str, snapshots: str, *, model: str | None = None, context: int = 2048,
                 slots: int = 4, threads: int = 1, lease_s: float = 30.0, device: str = "cpu",
                 **options) -> None:
        import torch

        from floe.engine import Engine, bound_kernel_caches
        from floe.model import load_checkpoint
        from floe.server.core import ServeCore
        from floe.server.sessions import snapshot_store

        bound_kernel_caches()
        torch.set_num_threads(threads)
        self.name = name
        checkpoint = load_checkpoint(model)
        cpu = device == "cpu"
        engine = Engine(checkpoint, device=device, dtype="float32" if cpu else "bfloat16",
                        max_seq_len=context, n_slots=slots, weights="native" if cpu else "dense")
        engine.warm_up()
        store = snapshot_store(snapshots, idle_seconds=options.get("idle_seconds", 300.0), lease_s=lease_s)
        model_id = options.pop("model_id", checkpoint.source.stem)
        self.core = ServeCore(engine, snapshots=store, model_id=model_id, **options)
        self._cancelled: set[str] = set()
        self._lock = threading.Lock()

    def ping(self) -> dict:
        """Who and where it is: its name, Ray node, session counts."""
        import ray

        return {"name": self.name, "node": ray.get_runtime_context().get_node_id(),
                "sessions": self.core.store.counts(), "owner": self.core.snapshots.owner}

    def call(self, name: str, arg=None, owner=None) -> dict:
        """A core call (floe.server.protocol.CALLS): {"ok": value} or {"error": payload}."""
        try:
            return {"ok": self.core.call(name, arg, owner)}
        except ServeError as e:
            return {"error": e.payload()}

    def chat(self, rid: str, request: dict):
        """A chat's events, as they happen (a Ray streaming generator)."""
        try:
            chat = self.core.open(request)
        except ServeError as e:
            yield ("error", e.payload())
            return
        if chat.session is None:  # a text completion: no session
            yield ("started", {"session_id": None, "had": 0})
        else:
            yield ("started", {"session_id": chat.session.id, "had": len(chat.session.messages)})
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
        try:
            return {"ok": b"".join(bytes(c) for c in self.core.export(sid, owner))}
        except ServeError as e:
            return {"error": e.payload()}

    def import_(self, sid: str, owner: str, data: bytes) -> dict:
        try:
            return {"ok": self.core.import_(sid, owner, [data])}
        except ServeError as e:
            return {"error": e.payload()}

    def drain(self) -> list[str]:
        """Freeze every session and give up its lease: they continue on other replicas."""
        return self.core.store.drain()

    def close(self) -> None:
        self.core.close()
