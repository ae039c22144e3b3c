"""One model of a server of several (floe.server.models): its engine core while loaded, its sessions'
snapshot store always, and what it did (loads, bytes, tokens)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from floe.server.models.specs import ModelSpec
from floe.server.protocol import OWNER, ServeError
from floe.server.records import NotASession, session_key, split_key
from floe.server.sessions.registry import SessionRegistry
from floe.snapshot import SnapshotError
from floe.snapshot.store import SnapshotStore

if TYPE_CHECKING:
    from floe.server.core import ServeCore


class ModelLoadFailed(ServeError):
    def __init__(self, name: str, e: BaseException) -> None:
        super().__init__(500, f"the model {name!r} could not be loaded: {type(e).__name__}: {e}",
                         "server_error", "model_load_failed")



class ServedModel:
    """One model of the server: its core while loaded, its sessions' store always, and its use."""

    def __init__(self, spec: ModelSpec, snapshots: SnapshotStore) -> None:
        self.spec, self.snapshots = spec, snapshots
        self._reader = SessionRegistry(snapshots)  # reads its sessions' records while it is not loaded
        self.core: ServeCore | None = None
        # Its core while an unload closes it (Residency.unload): its live sessions are in neither the core
        # nor the store until each is frozen, so a look-up asks this core's registry meanwhile
        self.unloading: ServeCore | None = None
        self.lock = threading.Lock()  # one load or unload of this model at a time
        self.users = 0  # requests and calls holding the core now (never unloaded under them)
        self.last_used = time.monotonic()
        self.keep_alive: float | None = None  # the last request's keep_alive, seconds (None: the server's)
        self.load_seconds = 0.0  # the last load's
        self.nbytes: int | None = None  # what its last load took (the router's footprint: RAM or device)
        self.loads = 0
        self.tokens = {"prompt": 0, "generated": 0}  # of its answered requests, across its loads
        self.fingerprint: str | None = None  # its checkpoint's, once loaded (what its snapshots name)

    def names_snapshot(self, metadata: dict) -> bool:
        """Whether a snapshot's header metadata names this model: its fingerprint (once loaded), else
        its checkpoint's name (a GGUF's or a folder's, as the model was loaded or its file is named)."""
        if self.fingerprint is not None:
            return metadata.get("model_fingerprint") == self.fingerprint
        return self.spec.path is not None and metadata.get("model_name") in (
            Path(self.spec.path).stem, Path(self.spec.path).name)

    @property
    def name(self) -> str:
        return self.spec.name

    def registered(self, owner: str, sid: str) -> bool:
        """Whether `owner`'s session `sid` is registered in this model's loaded core, or the one an unload
        closes (no I/O)."""
        core = self.core or self.unloading
        if core is None:
            return False
        with core.store.lock:
            return session_key(owner, sid) in core.store.sessions

    def holds(self, owner: str, sid: str) -> bool:
        """Whether `owner`'s session `sid` is this model's (registered while loaded, or in its store)."""
        return self.registered(owner, sid) or self.snapshots.has(session_key(owner, sid))

    def stored_sessions(self, owner: str, sid: str | None = None) -> list[dict]:
        """`owner`'s sessions (or its session `sid`) in this model's store, in RAM (one-shot sessions) or
        its home, described from their snapshots' headers (while the model is not loaded: all of them
        are frozen). Only the headers of those asked for are read (a look at one read every one of the
        owner's, in the core's socket-reading thread)."""
        found, tiers = [], [self.snapshots.home, *([self.snapshots.pinned] if self.snapshots.pinned else [])]
        entries = {e.key: e for tier in reversed(tiers) for e in tier.entries()}  # (where both: the home's)
        for entry in sorted(entries.values(), key=lambda e: e.key):
            named = split_key(entry.key)
            if named is None or named[0] != owner or sid not in (None, named[1]):
                continue
            try:
                session = self._reader.read(entry.key)
            except (SnapshotError, NotASession):
                continue  # (named in the log when the model loads)
            session.snapshot_bytes = entry.nbytes
            session.last_used = time.monotonic() - max(0.0, time.time() - entry.used_at)
            found.append(session.describe())
        return found

    def describe(self, owner: str | None = None) -> dict:
        """The model for GET /v1/models: its sessions' counts every owner's, or (owner) that owner's."""
        core = self.core
        if owner is not None and not (isinstance(owner, str) and OWNER.fullmatch(owner)):
            raise ServeError(400, f"owner {str(owner)[:40]!r} is not an owner id (protocol.OWNER)")
        return {"id": self.name, "object": "model", "owned_by": "floe", "loaded": core is not None,
                "load_seconds": self.load_seconds if self.loads else None, "bytes": self.nbytes,
                "sessions": None if core is None else core.store.counts(owner)}

