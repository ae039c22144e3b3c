"""Copy tensors' bytes into place and hash each one (XXH3-128) as it lands, on several threads.

Snapshots are checked while they load: every KV tensor is copied out of the file's page cache (into
pinned memory for the bus, or straight into a CPU cache slot) and hashed in the same pass, while the
bytes are still in the core's cache. Python threads could not do it: on the H200's 16-core host,
eight threads handing the GIL around made every small step ~100× slower (7.8 ms instead of 2.2 for
3.9 MB; bench/results/thaw_stream_probe_h200.json). So the work is one C++ call (csrc/copy_hash.cpp,
built on first use with the machine's compiler and cached like the CPU decode kernel) that runs its
own threads and never touches Python; `done` flags let the caller send each tensor on as soon as it
is in place. Where it cannot be built, the same work runs on Python threads (correct, slower).

The digests equal `xxhash.xxh3_128_hexdigest` of each tensor's bytes (tested).
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
import xxhash

from floe.engine import cbuild

SOURCE = Path(__file__).parent / "csrc" / "copy_hash.cpp"

Piece = tuple[np.ndarray, np.ndarray | None]  # (source bytes, destination bytes or None: hash only)

_lock = threading.Lock()
_state: dict[str, object] = {}


def threads() -> int:
    return min(8, os.cpu_count() or 1)


def library() -> ctypes.CDLL | None:
    """The built library (built once per machine), or None where it cannot be (see `unavailable_reason`)."""
    with _lock:
        if "lib" not in _state:
            _state["lib"], _state["reason"] = _build()
        return _state["lib"]  # type: ignore[return-value]


def unavailable_reason() -> str:
    return str(_state.get("reason", ""))


def _build() -> tuple[ctypes.CDLL | None, str]:
    try:
        lib = ctypes.CDLL(str(cbuild.build("floe_copy_hash", [SOURCE], ["-O3", "-march=native"],
                                           what="the snapshot copy-and-hash routine")))
    except Exception as e:  # noqa: BLE001 - no compiler...: Python threads do the same work
        return None, f"building {SOURCE.name} failed: {type(e).__name__}: {str(e)[:300]}"
    p = ctypes.c_void_p
    lib.floe_copy_hash_start.argtypes = [ctypes.c_int64, p, p, p, p, ctypes.c_int, p, p, ctypes.c_int]
    lib.floe_copy_hash_start.restype = p
    lib.floe_copy_hash_join.argtypes = [p]
    lib.floe_copy_hash_join.restype = None
    return lib, ""


def _contiguous(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """Whether a tensor of this shape and these strides is contiguous, as Tensor.is_contiguous says
    (dimensions of size 1 may have any stride; an empty tensor is)."""
    if 0 in shape:
        return True
    expected = 1
    for n, stride in zip(reversed(shape), reversed(strides), strict=True):
        if n != 1:
            if stride != expected:
                return False
            expected *= n
    return True


def _address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


class Job:
    """One copy-and-hash of `tensors` (each a list of pieces, in hash order), running on its own
    threads from construction on. `wait(t)`: tensor t is in place; `digests()`: all of them, hex.
    Every piece must be a contiguous uint8 array; a destination must be as long as its source.
    Job.heads: the pieces as addresses computed from tensors' strides, not an array a piece."""

    _handle: int | None = None  # the native job, until joined
    _thread: threading.Thread | None = None  # the Python fallback's

    def __init__(self, tensors: list[list[Piece]], *, hash: bool = True) -> None:
        pieces = [p for tensor in tensors for p in tensor]
        for src, dst in pieces:
            if src.dtype != np.uint8 or not src.flags.c_contiguous or (dst is not None and (
                    dst.dtype != np.uint8 or not dst.flags.c_contiguous or dst.nbytes != src.nbytes
                    or not dst.flags.writeable)):
                raise ValueError("copy-and-hash pieces must be contiguous uint8 arrays of equal length")
        first = np.zeros(len(tensors) + 1, dtype=np.int64)
        first[1:] = np.cumsum([len(t) for t in tensors])
        self._run(first, np.array([_address(s) for s, _ in pieces], dtype=np.uint64),
                  np.array([0 if d is None else _address(d) for _, d in pieces], dtype=np.uint64),
                  np.array([s.nbytes for s, _ in pieces], dtype=np.uint64), tensors, hash)

    @classmethod
    def heads(cls, src: list[torch.Tensor], dst: list[torch.Tensor], *, hash: bool = True) -> Job:
        """Copy each src[j] into dst[j] (same shape and dtype; a src contiguous, a dst [H, ...] whose
        dst[j][h] each are) piece by piece along the first dimension, each tensor hashed over its
        pieces in order: what Job([[(as_bytes(s[h]), as_bytes(d[h])) for h in heads] ...]) does,
        with every piece's address computed at once from the tensors' strides (a thaw's 180 pieces
        cost ~1.5 ms of views otherwise). The tensors stay referenced while the threads run."""
        if not src:
            return cls([], hash=hash)
        heads, sizes, src_ptr, dst_ptr, dst_step = [], [], [], [], []  # (one pass: 60 tensors' checks and
        for s, d in zip(src, dst, strict=True):  # addresses were ~0.2 ms of a small thaw)
            shape = s.shape
            if (shape != d.shape or s.dtype != d.dtype or not s.is_cpu or not d.is_cpu
                    or not s.is_contiguous() or not shape or not _contiguous(shape[1:], d.stride()[1:])):
                raise ValueError("copy-and-hash heads need CPU tensors of one shape and dtype, each source "
                                 "contiguous and each destination's heads contiguous")
            n, size = shape[0], s.element_size()
            heads.append(n)
            sizes.append(s.numel() // n * size if n else 0)
            src_ptr.append(s.data_ptr())
            dst_ptr.append(d.data_ptr())
            dst_step.append(d.stride(0) * size)
        heads = np.array(heads, dtype=np.int64)
        first = np.zeros(len(src) + 1, dtype=np.int64)
        first[1:] = np.cumsum(heads)

        def each(values: list[int]) -> np.ndarray:  # a tensor's value, once for each of its heads
            return np.repeat(np.array(values, dtype=np.uint64), heads)

        k = (np.arange(first[-1]) - np.repeat(first[:-1], heads)).astype(np.uint64)  # a piece's head
        size = each(sizes)
        src_at = each(src_ptr) + k * size
        dst_at = each(dst_ptr) + k * each(dst_step)
        job = cls.__new__(cls)
        job._run(first, src_at, dst_at, size, (src, dst), hash)
        return job

    def _run(self, first: np.ndarray, src: np.ndarray, dst: np.ndarray, length: np.ndarray, keep: object,
             hash: bool) -> None:
        """Start the threads on the pieces at these addresses (tensor t: pieces first[t]:first[t+1];
        a destination 0: hash only). `keep` holds the memory alive while they run."""
        self._keep = keep  # the arrays stay alive while the threads use their memory
        self._hash = hash
        self.first, self.src, self.dst, self.len = first, src, dst, length
        self.raw = np.zeros(2 * (len(first) - 1), dtype=np.uint64)
        self.done = np.zeros(len(first) - 1, dtype=np.int32)
        self._error: BaseException | None = None
        lib = library()
        if lib is not None:  # runs on the library's own threads from here on, without the GIL
            self._handle = lib.floe_copy_hash_start(
                len(self.done), _address(self.first), _address(self.src), _address(self.dst),
                _address(self.len), int(hash), _address(self.raw), _address(self.done), threads())
        else:
            self._thread = threading.Thread(target=self._python_guarded, name="floe-copy-hash", daemon=True)
            self._thread.start()

    def _python_guarded(self) -> None:
        try:
            self._python()
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits
            self._error = e
            self.done[:] = 1

    def _python(self) -> None:
        def at(address: int, n: int) -> np.ndarray:  # (the bytes at a piece's address, as the C++ reads them)
            return np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(address)) \
                if n else np.zeros(0, np.uint8)

        def one(t: int) -> None:
            h = xxhash.xxh3_128()
            for i in range(int(self.first[t]), int(self.first[t + 1])):
                n = int(self.len[i])
                src = at(int(self.src[i]), n)
                if self.dst[i]:
                    dst = at(int(self.dst[i]), n)
                    np.copyto(dst, src)
                    src = dst
                if self._hash:
                    h.update(src)
            d = h.intdigest()
            self.raw[2 * t], self.raw[2 * t + 1] = d >> 64, d & ((1 << 64) - 1)
            self.done[t] = 1

        with ThreadPoolExecutor(threads(), thread_name_prefix="floe-copy-hash") as pool:
            list(pool.map(one, range(len(self.done))))

    def wait(self, t: int) -> None:
        """Until tensor t is copied and hashed (or the job failed)."""
        while not self.done[t]:
            time.sleep(0)
        if self._error is not None:
            raise self._error

    def digests(self) -> list[str]:
        """Every tensor's XXH3-128 digest, hex (as xxhash.xxh3_128_hexdigest writes it), once all
        are done."""
        self.join()
        if self._error is not None:
            raise self._error
        return [f"{int(self.raw[2 * t]):016x}{int(self.raw[2 * t + 1]):016x}" for t in range(len(self.done))]

    def join(self) -> None:
        """Until the threads are done (digests or not)."""
        if self._handle is not None:
            lib = library()
            assert lib is not None
            lib.floe_copy_hash_join(self._handle)
            self._handle = None
        if self._thread is not None:
            self._thread.join()

    def __del__(self) -> None:  # never free the arrays under running threads
        self.join()


def as_bytes(t: torch.Tensor | np.ndarray) -> np.ndarray:
    """A host tensor's (or array's) bytes as a flat uint8 view; it must be contiguous."""
    if isinstance(t, torch.Tensor):
        if not t.is_contiguous():
            raise ValueError("only a contiguous tensor's bytes can be viewed flat")
        t = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else np.zeros(0, np.uint8)
    return np.asarray(t).reshape(-1).view(np.uint8)


def digests(tensors: list[torch.Tensor | np.ndarray]) -> list[str]:
    """XXH3-128 of each tensor's bytes: on several threads, or (a few MB in all) on this one."""
    data = [as_bytes(t) for t in tensors]
    if sum(a.nbytes for a in data) < SMALL:
        return [xxhash.xxh3_128_hexdigest(a) for a in data]
    return Job([[(a, None)] for a in data]).digests()


SMALL = 4 << 20  # fewer bytes than this are hashed faster than threads start
