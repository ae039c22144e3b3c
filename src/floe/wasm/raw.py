"""The raw Wasmtime C API pieces wasmtime-py has no Python wrapper for, in one place.

- A host memory creator (`wasmtime_config_host_memory_creator_set`): every linear memory Wasmtime
  makes is a floe Region, so guest memory *is* a region the engine reads and writes in place.
- "Unchecked" host functions (`wasmtime_linker_define_func_unchecked`): arguments arrive as raw
  16-byte slots, no Python objects are built per call (~0.5 µs instead of ~3 µs).

A Python exception escaping a ctypes callback would abort the process, so every callback here
catches everything and answers Wasmtime with an error or a trap.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable

from wasmtime import _ffi as ffi

from floe.memory import Region

_dll = ffi.dll
_dll.wasmtime_trap_new.restype = ctypes.c_void_p
_dll.wasmtime_trap_new.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
_dll.wasmtime_error_new.restype = ctypes.c_void_p
_dll.wasmtime_error_new.argtypes = [ctypes.c_char_p]

# The unchecked callback, typed so arguments arrive as u64 words (no per-call cast), and a private
# handle on the define function that accepts it.
_UNCHECKED = ctypes.CFUNCTYPE(ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p,
                              ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t)
_define_unchecked = ctypes.CFUNCTYPE(
    ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_char_p,
    ctypes.c_size_t, ctypes.c_void_p, _UNCHECKED, ctypes.c_void_p, ctypes.c_void_p,
)(("wasmtime_linker_define_func_unchecked", _dll))
_FINALIZER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)

# Raw values are 16-byte unions; viewed as u64 pairs, slot i's low word is at index 2 * i.
RawArgs = "ctypes._Pointer[ctypes.c_uint64]"
HostCallback = Callable[[RawArgs], int]


def trap_new(message: str) -> int:
    """A wasm_trap_t* (as an int) that traps the calling guest with `message`."""
    data = message.encode()
    return _dll.wasmtime_trap_new(data, len(data))


def error_new(message: str) -> int:
    return _dll.wasmtime_error_new(message.encode())


# ---- host memory creator -------------------------------------------------------------------------

class MemoryCreator:
    """Hands Wasmtime a Region for each new linear memory, and the Region to whoever instantiates.

    new_memory runs inside instantiation; instantiations are serialised by the caller, which
    collects the regions made during its own with `take_created()` right after.
    """

    def __init__(self) -> None:
        self._regions: dict[int, Region] = {}
        self._next = 1
        self._lock = threading.Lock()
        self._created: list[Region] = []
        self._new_memory = ffi.wasmtime_new_memory_callback_t(self._on_new_memory)
        self._get_memory = ffi.wasmtime_memory_get_callback_t(self._on_get_memory)
        self._grow_memory = ffi.wasmtime_memory_grow_callback_t(self._on_grow_memory)
        self._finalize_memory = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(self._on_finalize_memory)
        self._finalize_creator = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(lambda env: None)
        self.struct = ffi.wasmtime_memory_creator_t(None, self._new_memory, self._finalize_creator)

    def install(self, config) -> None:
        ffi.wasmtime_config_host_memory_creator_set(config.ptr(), ctypes.byref(self.struct))

    def take_created(self) -> list[Region]:
        created, self._created = self._created, []
        return created

    def _on_new_memory(self, env, ty, minimum, maximum, reserved, guard, memory_ret) -> int:
        try:
            capacity = max(reserved, minimum) + guard if reserved else max(maximum, minimum)
            region = Region(minimum, capacity=capacity)
            region.max_size = min(maximum, reserved) if reserved else maximum
            with self._lock:
                key = self._next
                self._next += 1
                self._regions[key] = region
            out = memory_ret.contents
            out.env = key
            out.get_memory = self._get_memory
            out.grow_memory = self._grow_memory
            out.finalizer = self._finalize_memory
            self._created.append(region)
            return 0
        except BaseException as e:  # noqa: BLE001 - must not escape into Wasmtime
            return error_new(f"floe could not create guest memory: {e}")

    def _on_get_memory(self, env, byte_size, max_byte_size) -> int:
        try:
            region = self._regions[env]
            byte_size[0] = region.size
            max_byte_size[0] = region.max_size
            return region.base
        except BaseException:  # noqa: BLE001
            byte_size[0] = 0
            max_byte_size[0] = 0
            return 0

    def _on_grow_memory(self, env, new_size) -> int:
        try:
            self._regions[env].grow(new_size)
            return 0
        except BaseException as e:  # noqa: BLE001
            return error_new(f"guest memory cannot grow to {new_size} bytes: {e}")

    def _on_finalize_memory(self, env) -> None:
        try:
            with self._lock:
                region = self._regions.pop(env, None)
            if region is not None:
                region.close()
        except BaseException:  # noqa: BLE001
            pass


# ---- unchecked host functions --------------------------------------------------------------------

class HostFunctions:
    """Python callables registered as raw Wasmtime host functions, looked up by an integer env."""

    def __init__(self) -> None:
        self._table: dict[int, Callable[[RawArgs], int]] = {}
        self._next = 1
        self._lock = threading.Lock()
        self._trampoline = _UNCHECKED(self._call)
        self._finalize = _FINALIZER(self._forget)
        self._finalize_ptr = ctypes.cast(self._finalize, ctypes.c_void_p)

    def define(self, linker, module: str, name: str, functype, fn: HostCallback) -> None:
        """fn(raw) reads arguments from raw[2*i], writes results to raw[2*i], returns 0 or a trap."""
        with self._lock:
            key = self._next
            self._next += 1
            self._table[key] = fn
        m, n = module.encode(), name.encode()
        err = _define_unchecked(
            ctypes.cast(linker.ptr(), ctypes.c_void_p), m, len(m), n, len(n),
            ctypes.cast(functype.ptr(), ctypes.c_void_p), self._trampoline, key, self._finalize_ptr,
        )
        if err:
            from wasmtime import WasmtimeError

            raise WasmtimeError._from_ptr(ctypes.cast(err, ctypes.POINTER(ffi.wasmtime_error_t)))

    def _call(self, env, caller, raw, n) -> int:
        try:
            return self._table[env](raw)
        except BaseException as e:  # noqa: BLE001 - must not escape into Wasmtime
            return trap_new(f"host function failed: {type(e).__name__}: {e}")

    def _forget(self, env) -> None:
        with self._lock:
            self._table.pop(env, None)
