"""Wasmtime set-up for floe guests: guest memory backed by Regions, deadlines, memory caps, traps."""

from __future__ import annotations

import hashlib
import math
import re
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import wasmtime
from wasmtime import FuncType, Instance, Linker, Module, Store, Trap, TrapCode, ValType, WasmtimeError

from floe.errors import FloeError
from floe.memory import Region
from floe.wasm.raw import HostCallback, HostFunctions, MemoryCreator

EPOCH_TICK_S = 0.01  # deadline granularity


class GuestError(FloeError):
    """A guest could not finish what the host asked of it."""


class GuestLoadError(GuestError):
    """The guest module is not valid WebAssembly, or does not speak floe's ABI."""


class GuestTrap(GuestError):
    """The guest trapped (unreachable, out-of-bounds access, stack overflow, ...)."""


class GuestDeadlineExceeded(GuestError):
    """The guest ran past its deadline and was stopped."""


class GuestMemoryLimit(GuestError):
    """The guest tried to grow its memory past its cap."""


class GuestPointerError(GuestError):
    """The guest passed the host a (pointer, length) outside its memory."""


@dataclass(frozen=True)
class HostFunction:
    """An import the host provides: all parameters and results are i32."""

    name: str
    n_params: int
    n_results: int
    fn: HostCallback


class WasmRuntime:
    """One Wasmtime engine for every guest in the process, with an epoch ticker for deadlines."""

    def __init__(self) -> None:
        config = wasmtime.Config()
        config.epoch_interruption = True
        # Copy-on-write init would have Wasmtime map data segments itself: our memories are Regions.
        config.memory_init_cow = False
        config.cranelift_opt_level = "speed"
        self.memory_creator = MemoryCreator()
        self.memory_creator.install(config)
        self.engine = wasmtime.Engine(config)
        self.host_functions = HostFunctions()
        self._ticker: threading.Thread | None = None
        self._ticker_lock = threading.Lock()
        self._modules: dict[str, GuestModule] = {}  # sha256 -> compiled module
        self._modules_lock = threading.Lock()

    def deadline_ticks(self, seconds: float) -> int:
        self._start_ticker()
        return max(1, math.ceil(seconds / EPOCH_TICK_S))

    def _start_ticker(self) -> None:
        with self._ticker_lock:
            if self._ticker is None:
                self._ticker = threading.Thread(target=self._tick, name="floe-epoch", daemon=True)
                self._ticker.start()

    def _tick(self) -> None:
        while True:
            time.sleep(EPOCH_TICK_S)
            self.engine.increment_epoch()

    def compile(self, wasm: bytes | str | Path) -> GuestModule:
        """The compiled module for these bytes; compiled once per process (Cranelift takes ms)."""
        data, name = _read_wasm(wasm)
        digest = hashlib.sha256(data).hexdigest()
        with self._modules_lock:
            module = self._modules.get(digest)
            if module is None:
                module = self._modules[digest] = GuestModule(self, data, name)
            return module


def _read_wasm(wasm: bytes | str | Path) -> tuple[bytes, str]:
    if isinstance(wasm, (str, Path)):
        path = Path(wasm)
        try:
            return path.read_bytes(), path.name
        except OSError as e:
            raise GuestLoadError(f"cannot read guest module {path}: {e}") from e
    return bytes(wasm), "guest.wasm"


_RUNTIME: WasmRuntime | None = None
_RUNTIME_LOCK = threading.Lock()


def default_runtime() -> WasmRuntime:
    global _RUNTIME
    with _RUNTIME_LOCK:
        if _RUNTIME is None:
            _RUNTIME = WasmRuntime()
        return _RUNTIME


class GuestModule:
    """A compiled guest module and the SHA-256 of its bytes (snapshots record it)."""

    def __init__(self, runtime: WasmRuntime, wasm: bytes, name: str = "guest.wasm") -> None:
        self.name = name
        self.runtime = runtime
        self.sha256 = hashlib.sha256(wasm).hexdigest()
        self.size = len(wasm)
        try:
            self.module = Module(runtime.engine, wasm)
        except WasmtimeError as e:
            raise GuestLoadError(f"{self.name} is not a valid WebAssembly module: {e}") from e

    def imports(self) -> list[tuple[str, str]]:
        return [(i.module, i.name) for i in self.module.imports]

    def exports(self) -> list[str]:
        return [e.name for e in self.module.exports]


class GuestInstance:
    """One instance of a guest module in its own Store, its linear memory a Region."""

    def __init__(self, module: GuestModule, import_module: str, functions: Sequence[HostFunction],
                 memory_cap: int) -> None:
        runtime = module.runtime
        self.module = module
        self.memory_cap = memory_cap
        self.store = Store(runtime.engine)
        # The memory cap is enforced by the Region (a refused grow is recorded there, so a trap that
        # follows it can be reported as GuestMemoryLimit); the store still bounds everything else.
        self.store.set_limits(table_elements=1 << 20, instances=1, tables=4, memories=1)
        self.store.set_epoch_deadline(runtime.deadline_ticks(60.0))
        provided = {f.name for f in functions}
        for mod, name in module.imports():
            if mod != import_module or name not in provided:
                raise GuestLoadError(f"{module.name} imports {mod}.{name}, which floe does not provide")
        linker = Linker(runtime.engine)
        for f in functions:
            ty = FuncType([ValType.i32()] * f.n_params, [ValType.i32()] * f.n_results)
            runtime.host_functions.define(linker, import_module, f.name, ty, f.fn)
        with _INSTANTIATE_LOCK:
            runtime.memory_creator.take_created()
            try:
                self.instance: Instance = linker.instantiate(self.store, module.module)
            except (Trap, WasmtimeError) as e:
                raise GuestLoadError(f"cannot instantiate {module.name}: {e}") from e
            finally:
                created = runtime.memory_creator.take_created()
        self.exports = self.instance.exports(self.store)
        if not isinstance(self.exports.get("memory"), wasmtime.Memory) or len(created) != 1:
            raise GuestLoadError(f"{module.name} must define and export exactly one memory")
        self.region: Region = created[0]
        if self.region.size > memory_cap:
            raise GuestLoadError(f"{module.name} starts with {self.region.size} bytes of memory, "
                                 f"over its cap of {memory_cap}")
        self.region.limit = memory_cap
        self.memory: wasmtime.Memory = self.exports["memory"]

    def has_function(self, name: str) -> bool:
        return isinstance(self.exports.get(name), wasmtime.Func)

    def function(self, name: str) -> wasmtime.Func:
        f = self.exports.get(name)
        if not isinstance(f, wasmtime.Func):
            raise GuestLoadError(f"{self.module.name} does not export function {name!r}")
        return f

    def call(self, name: str, *args: int, deadline_s: float, pending: Callable[[], BaseException | None]):
        """Call an export; traps become GuestError subclasses, a host-side error found by `pending`
        (raised inside a host function during the call) is re-raised as itself."""
        func = self.function(name)
        self.region.denied_size = 0
        self.store.set_epoch_deadline(self.module.runtime.deadline_ticks(deadline_s))
        try:
            return func(self.store, *args)
        except (Trap, WasmtimeError) as e:
            host_error = pending()
            if host_error is not None:
                raise host_error from None
            if isinstance(e, Trap) and e.trap_code == TrapCode.INTERRUPT:
                raise GuestDeadlineExceeded(
                    f"guest {self.module.name} ran past its {deadline_s:g} s deadline and was stopped"
                ) from None
            if self.region.denied_size:
                raise GuestMemoryLimit(
                    f"guest {self.module.name} trapped after asking for {self.region.denied_size >> 20}"
                    f" MiB of memory, over its cap of {self.memory_cap >> 20} MiB ({_trap_reason(e)})"
                ) from None
            raise GuestTrap(f"guest {self.module.name} trapped: {_trap_reason(e)}") from None

    # ---- state capture and restore (between calls only) ---------------------------------------------

    def mutable_globals(self) -> list[tuple[str, wasmtime.Global]]:
        """Exported mutable globals, by name. (Unexported ones, like clang's __stack_pointer, are
        back at their initial values between calls in a well-formed guest.)"""
        return [(name, ext) for name, ext in self.instance.exports(self.store).items()
                if isinstance(ext, wasmtime.Global) and ext.type(self.store).mutable]

    def capture_globals(self) -> list[tuple[str, str, int]]:
        """(name, wasm type, raw 64-bit pattern) of each exported mutable global."""
        out = []
        for name, g in self.mutable_globals():
            kind = str(g.type(self.store).content)
            out.append((name, kind, _to_bits(kind, g.value(self.store))))
        return out

    def restore_globals(self, saved: list[tuple[str, str, int]]) -> None:
        mine = dict(self.mutable_globals())
        for name, kind, bits in saved:
            g = mine.get(name)
            if g is None or str(g.type(self.store).content) != kind:
                raise GuestLoadError(f"guest has no mutable global {name!r} of type {kind}")
            g.set_value(self.store, _val(kind, _from_bits(kind, bits)))

    def capture_memory(self, page: int = 4096) -> tuple[int, np.ndarray, np.ndarray]:
        """(size in bytes, indices of the pages that are not all zero, those pages' bytes)."""
        size = self.region.size
        words = self.region.numpy(0, size // 8, np.uint64).reshape(-1, page // 8)
        index = np.flatnonzero(words.any(axis=1)).astype(np.int32)
        return size, index, words[index].reshape(-1).view(np.uint8)

    def restore_memory(self, size: int, index: np.ndarray, data: np.ndarray, page: int = 4096) -> None:
        """Make guest memory exactly `size` bytes: zero everywhere but the given pages."""
        if size < self.region.size:
            raise GuestLoadError(f"saved memory ({size} bytes) is smaller than the module's initial "
                                 f"memory ({self.region.size} bytes): not this guest's state")
        if size > self.memory_cap:
            raise GuestMemoryLimit(f"saved memory ({size >> 20} MiB) is over the cap of "
                                   f"{self.memory_cap >> 20} MiB")
        grow_pages = (size - self.region.size) // 65536
        if grow_pages:
            self.memory.grow(self.store, grow_pages)
        self.region.zero()
        words = self.region.numpy(0, size // 8, np.uint64).reshape(-1, page // 8)
        words[index.astype(np.int64)] = data.view(np.uint64).reshape(len(index), page // 8)

    @property
    def memory_base(self) -> int:
        """The guest memory's base address as Wasmtime reports it."""
        return _address(self.memory, self.store)

    def close(self) -> None:
        self.region.close()
        self.exports = None  # type: ignore[assignment]
        self.instance = None  # type: ignore[assignment]
        self.store = None  # type: ignore[assignment]


_INSTANTIATE_LOCK = threading.Lock()


def _address(memory: wasmtime.Memory, store: Store) -> int:
    import ctypes

    return ctypes.cast(memory.data_ptr(store), ctypes.c_void_p).value or 0


def _to_bits(kind: str, value) -> int:
    if kind == "f32":
        return struct.unpack("<I", struct.pack("<f", value))[0]
    if kind == "f64":
        return struct.unpack("<Q", struct.pack("<d", value))[0]
    return int(value)


def _from_bits(kind: str, bits: int):
    if kind == "f32":
        return struct.unpack("<f", struct.pack("<I", bits & 0xFFFFFFFF))[0]
    if kind == "f64":
        return struct.unpack("<d", struct.pack("<Q", bits & 0xFFFFFFFFFFFFFFFF))[0]
    return int(bits)


def _val(kind: str, value) -> wasmtime.Val:
    return {"i32": wasmtime.Val.i32, "i64": wasmtime.Val.i64, "f32": wasmtime.Val.f32,
            "f64": wasmtime.Val.f64}[kind](value)


def _trap_reason(e: BaseException) -> str:
    """The line of a Wasmtime trap that says what happened ("wasm trap: ..."), else its first."""
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    for line in lines:
        if "wasm trap:" in line or "host function failed" in line:
            return re.sub(r"^\d+:\s*", "", line)
    if isinstance(e, Trap) and e.trap_code is not None:
        return e.trap_code.name.lower().replace("_", " ")
    return lines[-1] if lines else type(e).__name__
