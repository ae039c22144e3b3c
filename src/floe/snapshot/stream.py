"""Checking a snapshot's bytes as they stream past: the one check every tier of the store runs on what
it reads from below, imports and exports (floe.snapshot.store).

`StreamCheck` takes the bytes in chunks of any size, in order, and checks them as `Snapshot` checks a
file: the header as soon as it has arrived (layout.parse_header: structure, format, version, header
checksum, schema), each tensor's bytes against its digest as they pass (xxh3-128, streamed: the same
digest as one pass over the tensor), the small tensors' values, and the length (nothing missing,
nothing after the last tensor). Format 2 only (format 1 hashed the whole file in one digest: thaw and
freeze such a file once to rewrite it). Nothing is kept but the header and the small tensors, so a writer can
pass each chunk on (to a temporary file, a multipart upload) and commit only once `finish` returns.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
import xxhash

from floe.snapshot.errors import SnapshotTooLarge, SnapshotVersionMismatch
from floe.snapshot.layout import FORMAT_VERSION, Header, check_values, corrupt, header_length, parse_header

SMALL = ("tokens", "guest.globals", "guest.memory.pages", "sampler.rng")  # kept for check_values


class StreamCheck:
    """A snapshot's bytes checked chunk by chunk; `finish()` raises unless they were one whole,
    intact snapshot (a SnapshotError: SnapshotCorrupt naming what is wrong, SnapshotVersionMismatch)."""

    def __init__(self, name: str | Path, max_bytes: int | None = None) -> None:
        self.path, self.max_bytes = Path(name), max_bytes
        self.header: Header | None = None
        self.received = 0
        self._prefix = bytearray()  # the first 8 + n bytes, until the header is parsed
        self._order: list[tuple[str, int, int]] = []  # (name, start, end) in file offsets, by offset
        self._at = 0  # index into _order of the tensor being hashed
        self._hash = xxhash.xxh3_128()
        self._small: dict[str, bytearray] = {}
        self._expected: dict[str, str] = {}  # the header's per-tensor digests

    def update(self, chunk) -> None:
        """Take the next bytes (bytes, bytearray, memoryview, numpy array)."""
        view = memoryview(chunk).cast("B")
        start = self.received
        self.received += len(view)
        if self.max_bytes is not None and self.received > self.max_bytes:
            raise SnapshotTooLarge(f"{self.path}: more than {self.max_bytes} bytes, the most this store "
                                   "accepts for one snapshot")
        if self.header is None:
            view, start = self._take_header(view, start)
            if self.header is None:
                return
        if self.received > self.header.file_bytes:
            raise corrupt(self.path, f"more than the {self.header.file_bytes} bytes its header describes "
                                     "(bytes after the last tensor)")
        self._hash_tensors(view, start)

    def _take_header(self, view: memoryview, start: int) -> tuple[memoryview, int]:
        """Collect the header's bytes; once whole, parse it. Returns the rest of the chunk."""
        if len(self._prefix) < 8:
            take = min(len(view), 8 - len(self._prefix))
            self._prefix += view[:take]
            view, start = view[take:], start + take
            if len(self._prefix) < 8:
                return view, start
        need = 8 + header_length(bytes(self._prefix[:8]), None, self.path)
        take = min(len(view), need - len(self._prefix))
        self._prefix += view[:take]
        view, start = view[take:], start + take
        if len(self._prefix) < need:
            return view, start
        header = parse_header(bytes(self._prefix[8:]), None, self.path)
        if header.metadata["format_version"] == "1":
            raise SnapshotVersionMismatch(f"{self.path} is a format 1 snapshot; the store holds format "
                                          f"{FORMAT_VERSION}: thaw it and freeze it again to rewrite it")
        if self.max_bytes is not None and header.file_bytes > self.max_bytes:
            raise SnapshotTooLarge(f"{self.path}: its header describes {header.file_bytes} bytes, more than "
                                   f"the {self.max_bytes} this store accepts for one snapshot")
        self.header, self._expected = header, json.loads(header.metadata["checksums"])
        d = header.data_offset
        self._order = sorted(((name, d + t.start, d + t.end) for name, t in header.tensors.items()),
                             key=lambda e: e[1])
        self._skip_empty()
        return view, start

    def _skip_empty(self) -> None:
        while self._at < len(self._order) and self._order[self._at][1] == self._order[self._at][2]:
            self._finish_tensor()

    def _hash_tensors(self, view: memoryview, start: int) -> None:
        """Feed `view` (file offsets start..) to the digests of the tensors it covers."""
        while len(view) and self._at < len(self._order):
            name, _, end = self._order[self._at]
            take = min(len(view), end - start)
            part = view[:take]
            self._hash.update(part)
            if name in SMALL:
                self._small.setdefault(name, bytearray()).extend(part)
            view, start = view[take:], start + take
            if start == end:
                self._finish_tensor()
                self._skip_empty()

    def _finish_tensor(self) -> None:
        name = self._order[self._at][0]
        expected, actual = self._expected[name], self._hash.hexdigest()
        if actual != expected:
            raise corrupt(self.path, f"checksum mismatch in tensor {name} (file says {expected}, its "
                                     f"bytes hash to {actual}): the bytes were damaged after they were "
                                     "written")
        self._hash.reset()
        self._at += 1

    def finish(self) -> Header:
        """The checked header, once every byte has arrived and every check passed."""
        if self.header is None or self.received < self.header.file_bytes:
            wanted = self.header.file_bytes if self.header is not None else "a header's"
            raise corrupt(self.path, f"cut short: {self.received} bytes of {wanted}")
        tensors = {}
        for name in SMALL:
            info = self.header.tensors[name]
            raw = self._small.get(name, bytearray())
            tensors[name] = (torch.frombuffer(raw, dtype=info.dtype, count=math.prod(info.shape))
                             if raw else torch.empty(0, dtype=info.dtype)).view(info.shape)
        check_values(tensors, self.header.metadata, self.path)
        return self.header


def checked(chunks: Iterable[bytes], check: StreamCheck | None) -> Iterator[bytes]:
    """`chunks`, each through `check` before it is passed on, and check.finish() after the last: a
    writer that stores what it is given commits only once the loop ended without raising."""
    for chunk in chunks:
        if check is not None:
            check.update(chunk)
        yield chunk
    if check is not None:
        check.finish()


def check_bytes(data, name: str | Path, max_bytes: int | None = None) -> Header:
    """Check a whole snapshot held in memory (StreamCheck in one chunk); its header."""
    check = StreamCheck(name, max_bytes)
    check.update(data)
    return check.finish()
