"""Page-aligned shared memory regions: zero-copy numpy/torch views, device registration, probes.

A Region reserves address space once (PROT_NONE, so it costs no memory) and opens pages for reading
and writing as it grows. Its base address never moves, so every view, a guest's linear memory and a
device mapping all see the same bytes at the same address.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import threading
import weakref

import numpy as np
import torch

from floe.errors import FloeError

PAGE = mmap.PAGESIZE
_PROT_NONE, _PROT_RW = 0, mmap.PROT_READ | mmap.PROT_WRITE
_MAP_PRIVATE_ANON_NORESERVE = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x4000  # MAP_NORESERVE
_MAP_FAILED = ctypes.c_void_p(-1).value

_denials = threading.local()  # regions whose growth was refused, by the thread that asked (take_denied)


def _denied_here() -> weakref.WeakSet:
    refused = getattr(_denials, "regions", None)
    if refused is None:
        refused = _denials.regions = weakref.WeakSet()
    return refused


def take_denied() -> list:
    """The regions whose growth was refused on this thread since the last take (their denied_size set),
    for a caller that resets them before its next guest calls (floe.wasm.rows). (A weak set: a thread
    that never takes them holds no region alive, and each at most once.)"""
    refused = getattr(_denials, "regions", None)
    if not refused:
        return []
    _denials.regions = weakref.WeakSet()
    return list(refused)


_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                       ctypes.c_long]
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_MADV_DONTNEED = 4


class RegionError(FloeError):
    """A region could not be mapped, grown or registered."""


class OutOfBounds(FloeError):
    """A (offset, length) pair falls outside a region's accessible bytes."""


def _round_up(n: int, to: int = PAGE) -> int:
    return (n + to - 1) // to * to


class Region:
    """Anonymous, page-aligned memory: `size` bytes readable and writable at `base`, growable in
    place up to `capacity` bytes (the reservation)."""

    def __init__(self, size: int, capacity: int | None = None) -> None:
        capacity = _round_up(max(capacity or size, size, PAGE))
        addr = _libc.mmap(None, capacity, _PROT_NONE, _MAP_PRIVATE_ANON_NORESERVE, -1, 0)
        if addr in (None, _MAP_FAILED):
            raise RegionError(f"cannot reserve {capacity} bytes: {os.strerror(ctypes.get_errno())}")
        self.base: int = addr
        self.capacity = capacity
        self.limit = capacity  # growth past this is refused (a guest's memory cap)
        self.max_size = capacity  # the largest size its owner declares (a wasm memory's maximum)
        self.denied_size = 0  # the largest refused growth, for error reports
        self.size = 0
        # The accessible size in a C word too, for native readers of the region (floe.actor.native_imports).
        self._size_word = (ctypes.c_int64 * 1)(0)
        self.size_at = ctypes.addressof(self._size_word)
        self._lock = threading.Lock()
        self._devices: list[_DeviceMapping] = []
        self.closed = False
        # Bytes of the whole reservation for read/write: a slice copies in C, where a ctypes memmove
        # would release and retake the GIL at every small host call (only checked ranges are touched).
        self._bytes = memoryview((ctypes.c_ubyte * capacity).from_address(addr)).cast("B")
        self.grow(size)

    def grow(self, new_size: int) -> None:
        """Make the first new_size bytes accessible (new pages read as zero); never moves."""
        with self._lock:
            self._check_open()
            if new_size < self.size:
                raise RegionError(f"a region only grows: {new_size} < {self.size}")
            if new_size > min(self.capacity, self.limit):
                self.denied_size = max(self.denied_size, new_size)
                _denied_here().add(self)
                raise RegionError(
                    f"cannot grow to {new_size} bytes: limit is {min(self.capacity, self.limit)}"
                )
            old_open, new_open = _round_up(self.size), _round_up(new_size)
            if new_open > old_open:
                if _libc.mprotect(self.base + old_open, new_open - old_open, _PROT_RW) != 0:
                    raise RegionError(f"mprotect failed: {os.strerror(ctypes.get_errno())}")
                for mapping in self._devices:
                    mapping.extend(self.base + old_open, new_open - old_open)
            self.size = self._size_word[0] = new_size

    def check(self, offset: int, length: int) -> None:
        """Raise OutOfBounds unless [offset, offset + length) lies in the accessible bytes."""
        if offset < 0 or length < 0 or offset + length > self.size:
            raise OutOfBounds(
                f"[{offset}, {offset}+{length}) is outside the {self.size} accessible bytes"
            )

    def holds(self, t: torch.Tensor) -> bool:
        """Whether a CPU tensor's bytes lie inside this region's accessible bytes (is a view of it)."""
        if t.device.type != "cpu":
            return False
        start = t.data_ptr()
        return self.base <= start and start + t.numel() * t.element_size() <= self.base + self.size

    def buffer(self, offset: int = 0, length: int | None = None) -> ctypes.Array:
        """A ctypes byte array aliasing [offset, offset + length): no copy."""
        length = self.size - offset if length is None else length
        self._check_open()
        self.check(offset, length)
        return (ctypes.c_ubyte * length).from_address(self.base + offset)

    def numpy(self, offset: int, count: int, dtype=np.uint8) -> np.ndarray:
        """A numpy view of `count` elements of `dtype` at byte `offset`: no copy. (Made from the
        reservation's bytes at an offset, not from a ctypes array of the view's length: a new length
        made a new ctypes array type, ~4 us, at every host call with a buffer of its own size.)"""
        dt = np.dtype(dtype)
        self._check_open()
        self.check(offset, count * dt.itemsize)
        return np.frombuffer(self._bytes, dtype=dt, count=count, offset=offset)

    def torch(self, offset: int, count: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """A CPU tensor view of `count` elements at byte `offset`: its data_ptr is base + offset."""
        self._check_open()
        self.check(offset, count * dtype.itemsize)
        if count == 0:
            return torch.empty(0, dtype=dtype)
        return torch.frombuffer(self._bytes, dtype=dtype, count=count, offset=offset)

    def cuda_tensor(self, offset: int, count: int, dtype: torch.dtype, device: torch.device | str,
                    shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """A CUDA tensor aliasing [offset, ...) of a registered region: the device reads and writes
        these host pages in place over the bus. Its data_ptr is the mapped device pointer."""
        device = torch.device(device)
        mapping = next((m for m in self._devices if m.device == device), None)
        if mapping is None:
            raise RegionError(f"region is not registered with {device}; call register() first")
        itemsize = dtype.itemsize
        self.check(offset, count * itemsize)
        ptr = mapping.device_pointer(self.base + offset)
        typestr = {torch.float32: "<f4", torch.float16: "<f2", torch.int32: "<i4", torch.int64: "<i8",
                   torch.uint8: "|u1", torch.bfloat16: "<V2"}[dtype]
        iface = {"shape": shape or (count,), "typestr": typestr, "data": (ptr, False), "version": 3,
                 "strides": None}
        holder = type("MappedArray", (), {"__cuda_array_interface__": iface})()
        with torch.cuda.device(device):
            return torch.as_tensor(holder, device=device)

    def read(self, offset: int, length: int) -> bytes:
        """A copy of [offset, offset + length) as bytes."""
        self._check_open()
        self.check(offset, length)
        return self._bytes[offset:offset + length].tobytes()

    def write(self, offset: int, data: bytes) -> None:
        self._check_open()
        self.check(offset, len(data))
        self._bytes[offset:offset + len(data)] = data

    def zero(self) -> None:
        """Drop every page's contents (they read as zero again and leave resident memory)."""
        with self._lock:
            self._check_open()
            _libc.madvise(self.base, _round_up(self.size), _MADV_DONTNEED)

    def register(self, device: torch.device | str) -> int:
        """Map the region into a CUDA device as pinned host memory; returns the device pointer.

        Growth is followed (each new range is registered as it opens); close() unregisters.
        """
        device = torch.device(device)
        if device.type == "cpu":
            return self.base
        if device.type != "cuda":
            raise RegionError(f"cannot register a region with device {device}")
        if not torch.cuda.is_available():
            raise RegionError("cannot register a region with cuda: this machine has no usable CUDA device")
        with self._lock:
            mapping = _DeviceMapping(device)
            mapping.extend(self.base, _round_up(self.size))
            self._devices.append(mapping)
        return mapping.device_pointer(self.base)

    def close(self) -> None:
        """Unregister from devices and unmap. Views made earlier must not be used afterwards."""
        with self._lock:
            if self.closed:
                return
            for mapping in self._devices:
                mapping.release()
            self._devices.clear()
            self.closed = True  # first: read and write refuse from here on
            self._size_word[0] = 0  # (native readers see no accessible byte)
            self._bytes.release()
            _libc.munmap(self.base, self.capacity)

    def _check_open(self) -> None:
        if self.closed:
            raise RegionError("region is closed")

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        return f"Region(base=0x{self.base:x}, size={self.size}, capacity={self.capacity})"


class _DeviceMapping:
    """Ranges of a region registered with one CUDA device (cudaHostRegister, mapped)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.ranges: list[int] = []

    def extend(self, addr: int, length: int) -> None:
        if length == 0:
            return
        cudart = torch.cuda.cudart()
        # cudaHostRegisterMapped (2) | cudaHostRegisterPortable (1)
        with torch.cuda.device(self.device):
            err = cudart.cudaHostRegister(addr, length, 3)
        if int(err) != 0:
            raise RegionError(f"cudaHostRegister({length} bytes) failed with error {int(err)}")
        self.ranges.append(addr)

    def device_pointer(self, addr: int) -> int:
        from cuda.bindings import runtime as rt

        err, ptr = rt.cudaHostGetDevicePointer(addr, 0)
        if int(err) != 0:
            raise RegionError(f"cudaHostGetDevicePointer failed with error {int(err)}")
        return int(ptr)

    def release(self) -> None:
        cudart = torch.cuda.cudart()
        for addr in self.ranges:
            cudart.cudaHostUnregister(addr)
        self.ranges.clear()


def rss_bytes() -> int:
    """Resident set size of this process, from /proc/self/statm."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def trim_heap() -> None:
    """Hand the C heap's free pages back to the system (glibc's malloc_trim; elsewhere nothing). Loading
    native weights frees a temporary copy per matrix (stacked, then interleaved) inside the heap,
    where glibc keeps it: ~80 MB of a 1B-shape model's peak resident memory, measured."""
    trim = getattr(_libc, "malloc_trim", None)
    if trim is not None:
        trim(0)

