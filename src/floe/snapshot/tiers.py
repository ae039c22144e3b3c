"""The store's local tiers: pinned host RAM and a local disk folder (the object store: tiers_remote).

Every tier holds whole snapshot files, byte for byte what `floe.snapshot.encode`/`freeze` made, under
a key (`owner/session` or `session`). A tier only stores and returns bytes; the store
(floe.snapshot.store) checks them: on the way in, and on every read from the disk or the object store.
Each tier has a byte budget and a TTL (seconds since its last use); the store applies them.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from floe.snapshot.atomic import path_lock, replace_file
from floe.snapshot.errors import (
    SnapshotKeyInvalid,
    SnapshotNotFound,
    SnapshotTooLarge,
    StoreUnavailable,
)
from floe.snapshot.layout import Header, open_regular, read_header
from floe.snapshot.lease import FileLeases
from floe.snapshot.stream import StreamCheck, checked

SUFFIX = ".safetensors"
_SEGMENT = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")


def check_key(key: str) -> str:
    """`key` if it names an entry: 1-4 segments of letters, digits, _ . - joined by / (never a path
    that leaves the tier's folder or prefix)."""
    parts = key.split("/") if isinstance(key, str) else []
    if not 1 <= len(parts) <= 4 or not all(_SEGMENT.fullmatch(p) and not p.endswith(".lease")
                                           for p in parts):
        raise SnapshotKeyInvalid(f"store key {str(key)[:200]!r} is not 1-4 segments of letters, digits, "
                                 "_ . - (each at most 128, not starting with . or -) joined by /")
    return key


@dataclass
class Entry:
    """What a tier holds under a key: its size, when it was last used (wall-clock seconds), and
    whether it may move down (a one-shot entry is never persisted: it is dropped instead)."""

    key: str
    nbytes: int
    used_at: float
    persist: bool = True


class PinnedTier:
    """Snapshots in host RAM under a byte budget, least recently used first out. Page-locked
    (torch pin_memory) where CUDA exists, so a thaw's host-to-device copies run at the bus's speed;
    plain RAM on the CPU, where the bytes are kept as they came (no copy)."""

    name = "pinned"
    durable = False

    def __init__(self, budget_bytes: int, ttl_s: float | None = None) -> None:
        self.budget_bytes, self.ttl_s = budget_bytes, ttl_s
        self.pinned = torch.cuda.is_available()
        self._held: OrderedDict[str, tuple[object, Entry]] = OrderedDict()  # oldest use first
        self._lock = threading.Lock()

    def _buffer(self, data) -> object:
        if not self.pinned:
            return data if isinstance(data, bytes) else bytes(memoryview(data).cast("B"))
        view = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
        host = torch.empty(len(view), dtype=torch.uint8, pin_memory=True)
        host.numpy()[:] = view
        return host.numpy()  # keeps `host` (and its pinned allocation) alive

    def put(self, key: str, data, persist: bool = True) -> list[tuple[Entry, object]]:
        """Hold `data` (checked by the caller); returns what it pushed out to stay in budget
        (entry, bytes), least recently used first, for the store to move down or drop."""
        n = memoryview(data).nbytes
        if n > self.budget_bytes:
            raise SnapshotTooLarge(f"a snapshot of {n} bytes is larger than the pinned tier's whole budget "
                                   f"({self.budget_bytes} bytes)")
        buffer = self._buffer(data)
        with self._lock:
            self._held.pop(key, None)
            self._held[key] = (buffer, Entry(key, n, time.time(), persist))
            return self._over_budget()

    def _over_budget(self) -> list[tuple[Entry, object]]:
        out = []
        while sum(e.nbytes for _, e in self._held.values()) > self.budget_bytes:
            _, (buffer, entry) = self._held.popitem(last=False)
            out.append((entry, buffer))
        return out

    def get(self, key: str) -> tuple[object, Entry] | None:
        """(bytes, entry) and marks it used, or None."""
        with self._lock:
            held = self._held.get(key)
            if held is not None:
                self._held.move_to_end(key)
                held[1].used_at = time.time()
            return held

    def has(self, key: str) -> bool:
        return key in self._held

    def entries(self) -> list[Entry]:
        with self._lock:
            return [entry for _, entry in self._held.values()]

    def take(self, key: str) -> tuple[object, Entry] | None:
        """Remove and return (bytes, entry)."""
        with self._lock:
            return self._held.pop(key, None)

    def remove(self, key: str) -> None:
        self.take(key)

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries())


class DiskTier:
    """Snapshot files in a local folder, `{key}.safetensors`, each written atomically (a killed
    writer leaves the previous file whole: floe.snapshot.atomic). As the store's last tier it also
    holds the sessions' leases (`{key}.lease`, FileLeases) for the processes sharing the folder."""

    name = "disk"
    durable = True

    def __init__(self, folder: str | Path, budget_bytes: int | None = None,
                 ttl_s: float | None = None) -> None:
        self.folder, self.budget_bytes, self.ttl_s = Path(folder), budget_bytes, ttl_s
        self.folder.mkdir(parents=True, exist_ok=True)
        self.leases = FileLeases(self.folder)

    def path(self, key: str) -> Path:
        return self.folder / f"{key}{SUFFIX}"

    def put(self, key: str, data) -> None:
        """Write `data` (checked by the caller) atomically."""
        self.write(key, [data], None)

    def write(self, key: str, chunks: Iterable, check: StreamCheck | None) -> None:
        """Write `chunks` as the entry, each checked by `check` on its way to the temporary file; the
        file replaces the entry only once `check.finish()` passed (else the entry is as it was)."""
        path = self.path(key)
        path.parent.mkdir(parents=True, exist_ok=True)

        def save(tmp: Path) -> None:
            with open(tmp, "wb") as f:
                for chunk in checked(chunks, check):
                    f.write(chunk)

        try:
            replace_file(path, save)
        except OSError as e:
            raise StoreUnavailable(f"cannot write {path}: {e}") from e

    def source(self, key: str) -> Path | None:
        """The entry's file (marked used), or None."""
        path = self.path(key)
        try:
            os.utime(path)  # its mtime is its last use: what the TTL and the budget go by
        except FileNotFoundError:
            return None
        return path

    def has(self, key: str) -> bool:
        return self.path(key).is_file()

    def header(self, key: str) -> Header | None:
        """The entry's checked header (its tensors not read), or None if there is none (SnapshotUnreadable
        if what is there is no regular file)."""
        if not os.path.lexists(self.path(key)):
            return None
        fd = open_regular(self.path(key))
        try:
            return read_header(fd, self.path(key))
        finally:
            os.close(fd)

    def entries(self) -> list[Entry]:
        out = []
        # os.walk, not rglob: a writer's temporary folder (a dot-name) is left out before it is entered, and
        # a folder that goes away during the walk is passed over (rglob raised FileNotFoundError into the
        # server's upkeep when a temporary folder vanished under it); links are not followed.
        for root, folders, files in os.walk(self.folder):
            folders[:] = [f for f in folders if not f.startswith(".")]
            for name in (*files, *folders):  # (a folder named *.safetensors is listed: a reader refuses it)
                if name.startswith(".") or not name.endswith(SUFFIX):
                    continue
                path = Path(root) / name
                try:
                    st = path.stat()
                except FileNotFoundError:
                    continue
                out.append(Entry(str(path.relative_to(self.folder))[: -len(SUFFIX)], st.st_size, st.st_mtime))
        return out

    def remove(self, key: str) -> None:
        path = self.path(key)
        if not os.path.lexists(path):  # (nothing to remove; its folder may not even exist)
            return
        with path_lock(path):  # (a writer's turn: the entry and its lock's sidecar go together)
            path.unlink(missing_ok=True)

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries())


def not_found(key: str) -> SnapshotNotFound:
    return SnapshotNotFound(f"no snapshot under {key!r} in any tier of the store")

