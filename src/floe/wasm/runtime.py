"""Wasmtime set-up for floe guests: guest memory backed by Regions, deadlines, memory caps, traps."""

from __future__ import annotations

import functools
import hashlib
import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import numpy as np
import wasmtime
from wasmtime import FuncType, Instance, Linker, Module, Store, Trap, ValType, WasmtimeError

from floe.errors import FloeError
from floe.memory import Region
from floe.wasm import compiled, shape
from floe.wasm.process import thread_stack_bytes
from floe.wasm.raw import (
    NUMERIC,
    Exports,
    HostCallback,
    HostFunctions,
    MemoryCreator,
    NativeHost,
    PreparedCall,
    RawCallError,
    describe,
    global_bits,
    global_kind,
    memory_address,
    set_global_bits,
    signals,
    trap_reason,
)
from floe.wasm.watchdog import EpochTimer, Watchdog

EPOCH_TICK_S = 0.01  # deadline granularity
# Guest code runs on the calling thread's native stack, and Wasmtime traps a guest that uses more than
# WASM_STACK_BYTES of it; the host functions it calls run below that, and a host function may call
# another guest (an on_text callback sending to another actor), which gets WASM_STACK_BYTES of its own.
# A thread whose stack is smaller than all of that overflows its guard page in guest code: a segfault,
# not a trap (Wasmtime cannot see the thread's stack). So each guest call checks its thread's stack
# against the guest calls it is nested in; floe's own threads get GUEST_THREAD_STACK.
WASM_STACK_BYTES = 512 << 10
HOST_STACK_BYTES = 1 << 20  # host functions under the deepest guest frame (~150 KiB measured), and callers
GUEST_THREAD_STACK = 8 << 20


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


class GuestBudgetExceeded(GuestError):
    """The guest asked the host for more work in one message than its budget allows."""


class GuestCancelled(GuestError):
    """The guest's message was stopped by its host (the actor was closed during it)."""


class GuestHostCallError(GuestError):
    """A host function the guest called failed for a reason that is not a bad pointer or budget."""


class GuestResultError(GuestError):
    """A guest export returned what the ABI does not allow (on_token: a token outside the vocabulary or
    a negative value other than stop; alloc: 0 for a message that needs bytes)."""


class GuestReportedError(GuestError):
    """A guest export returned a non-zero status (on_message, on_end, on_history): the guest's own report
    that it failed, kept as `status`."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class ThreadStackTooSmall(FloeError):
    """A guest was to run on a thread whose native stack cannot hold it (and the host calls it makes)."""


TABLES = 4  # per instance


def table_elements(memory_cap: int) -> int:
    """The most elements one of a guest's tables may hold: its tables' 8-byte elements within its memory
    cap, between 4,096 and 2**20 each."""
    return max(1 << 12, min(1 << 20, memory_cap // (8 * TABLES)))


class _GuestStack(threading.local):
    """This thread's native stack and the guest calls running on it, nested: `with` around each one
    (raises ThreadStackTooSmall where the stack cannot hold one more)."""

    def __init__(self) -> None:
        size = thread_stack_bytes()
        self.size = (1 << 62) if size is None else size
        self.depth = 0

    def __enter__(self) -> None:
        per_call = WASM_STACK_BYTES + HOST_STACK_BYTES
        if (self.depth + 1) * per_call > self.size:
            nested = f", inside {self.depth} other guest calls" if self.depth else ""
            raise ThreadStackTooSmall(
                f"thread {threading.current_thread().name!r} has a {self.size >> 10} KiB native stack: too "
                f"small for another guest call{nested} ({WASM_STACK_BYTES >> 10} KiB of guest frames and "
                f"{HOST_STACK_BYTES >> 10} KiB for the host calls below them each): run it on a thread "
                "started by floe.wasm.start_guest_thread (or after threading.stack_size(8 << 20)), and "
                "not from inside other actors' messages")
        self.depth += 1

    def __exit__(self, *exc) -> None:
        self.depth -= 1


guest_stack = _GuestStack()


# Guest calls in flight (by their watchdog's id), and why every new one is refused (stop_all_guests).
_running: dict[int, Watchdog] = {}
_stopped: str | None = None


def stop_all_guests(reason: str) -> None:
    """From any thread: every guest call in flight stops at its next epoch tick or host call, and every
    later one is refused (GuestCancelled with `reason`). For the interpreter's exit: Python stops a
    daemon thread when it next wants the GIL, and one stopped in a callback below guest code, or in a
    host call's C++, unwinds through frames that cannot be unwound: the process aborts."""
    global _stopped
    _stopped = reason  # first: a call registered after the cancellations below sees it
    for watchdog in list(_running.values()):
        watchdog.cancel(reason)


def guest_calls_running() -> int:
    """How many guest calls are in flight in the process, in every thread."""
    return len(_running)


class _Running:
    """`with` around a guest call: registered in flight, refused after stop_all_guests()."""

    __slots__ = ("watchdog",)

    def __init__(self, watchdog: Watchdog) -> None:
        self.watchdog = watchdog

    def __enter__(self) -> None:
        _running[id(self.watchdog)] = self.watchdog
        if _stopped is not None:
            del _running[id(self.watchdog)]
            raise GuestCancelled(f"the guest was not run: {_stopped}")

    def __exit__(self, *exc) -> None:
        _running.pop(id(self.watchdog), None)


_thread_start_lock = threading.Lock()


def start_guest_thread(thread: threading.Thread) -> None:
    """Start `thread` (not started yet) with a GUEST_THREAD_STACK native stack, whatever
    threading.stack_size() the process set for others."""
    with _thread_start_lock:  # stack_size() is process-wide: set for this start only
        previous = threading.stack_size(GUEST_THREAD_STACK)
        try:
            thread.start()
        finally:
            threading.stack_size(previous)


@dataclass(frozen=True)
class HostFunction:
    """An import the host provides: all parameters and results are i32."""

    name: str
    n_params: int
    n_results: int
    fn: HostCallback
    native: NativeHost | None = None  # a C callback answering it, fn its fallback (HostFunctions.define_all)


class WasmRuntime:
    """One Wasmtime engine for every guest in the process, with an epoch ticker for deadlines."""

    def __init__(self) -> None:
        config = wasmtime.Config()
        config.epoch_interruption = True
        # Copy-on-write init would have Wasmtime map data segments itself: our memories are Regions.
        config.memory_init_cow = False
        config.cranelift_opt_level = "speed"
        # The ABI is wasm32 with one memory: a memory64 or multi-memory module is refused at compile.
        config.wasm_memory64 = False
        config.wasm_multi_memory = False
        config.max_wasm_stack = WASM_STACK_BYTES  # explicit: guest_stack relies on it
        # GC objects (struct, array) would be guest state outside memory and globals, which a snapshot
        # does not hold, in a second heap: refused at compile. Exceptions still work (a small GC heap).
        config.wasm_gc = False
        self.memory_creator = MemoryCreator()
        self.memory_creator.install(config)
        self.engine = wasmtime.Engine(config)
        self.host_functions = HostFunctions()
        self._ticker: EpochTimer | threading.Thread | None = None
        self.native_ticks = False  # epochs tick from a native timer (EpochTimer), not a Python thread
        self._ticker_lock = threading.Lock()
        self._modules: dict[str, GuestModule] = {}  # sha256 -> compiled module
        self._modules_lock = threading.Lock()
        self._func_types: dict[tuple[int, int], FuncType] = {}
        self._forked = False  # this is a fork's child: epochs tick from a Python thread
        if hasattr(os, "register_at_fork"):  # a fork's child has neither the ticker thread nor the timer
            os.register_at_fork(after_in_child=self._ticker_after_fork)

    def _ticker_after_fork(self) -> None:
        """In a fork's child, also subprocess's child before its exec (preexec_fn): start nothing
        here. The next guest call starts a ticker thread; never a timer: timer_create in a fork's
        child can wait forever for a lock of the C library's that the parent's timer thread held."""
        self._ticker, self.native_ticks, self._forked = None, False, True
        self._ticker_lock = threading.Lock()

    def func_type(self, n_params: int, n_results: int) -> FuncType:
        """(i32 × n_params) -> (i32 × n_results), made once (linkers copy it; making one is ~100
        calls into Wasmtime, which every new actor paid for each of its host functions)."""
        key = (n_params, n_results)
        ty = self._func_types.get(key)
        if ty is None:
            ty = self._func_types.setdefault(key, FuncType([ValType.i32()] * n_params,
                                                           [ValType.i32()] * n_results))
        return ty

    def deadline_ticks(self, seconds: float) -> int:
        self._start_ticker()
        return max(1, math.ceil(seconds / EPOCH_TICK_S))

    def _start_ticker(self) -> None:
        with self._ticker_lock:
            if self._ticker is None:
                self._ticker = None if self._forked else EpochTimer.start(self.engine.ptr(), EPOCH_TICK_S)
                self.native_ticks = self._ticker is not None
                if self._ticker is None:  # (a guest call may then not hold the GIL: see GuestInstance.call)
                    self._ticker = threading.Thread(target=self._tick, name="floe-epoch", daemon=True)
                    self._ticker.start()

    def _tick(self) -> None:
        # Ticks only wake each store's watchdog, which compares the wall clock: a tick that comes
        # late (this thread waits for the GIL) delays a stop by that much, never stretches a deadline.
        while True:
            time.sleep(EPOCH_TICK_S)
            self.engine.increment_epoch()

    def compile(self, wasm: bytes | str | Path) -> GuestModule:
        """The compiled module for these bytes; compiled once per process (Cranelift takes ms)."""
        data, name = _read_wasm(wasm)
        digest = hashlib.sha256(data).hexdigest()
        with self._modules_lock:
            module = self._modules.get(digest)
        if module is None:  # compiled outside the lock: a huge module does not hold up others
            module = GuestModule(self, data, name)
            with self._modules_lock:
                module = self._modules.setdefault(digest, module)
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
        too_big = shape.refusal(wasm)
        if too_big is None and not wasm.startswith(b"\0asm"):  # WAT text: counted once it is binary
            try:
                wasm = wasmtime.wat2wasm(wasm)
            except WasmtimeError as e:
                raise GuestLoadError(f"{self.name} is not a valid WebAssembly module: {e}") from e
            too_big = shape.refusal(wasm)
        if too_big is not None:
            raise GuestLoadError(f"{self.name} {too_big}")
        self.module = compiled.load(runtime.engine, self.sha256) or self._compile(runtime.engine, wasm)
        # Learnt by its first instances, true of all: exports' shapes checked (GuestInstance.function),
        # calls' types known (PreparedCall), its exported mutable globals' names (all numeric: a snapshot's).
        self.checked, self.typed = set(), set()
        self.mutable_globals: tuple[str, ...] | None = None

    def _compile(self, engine: wasmtime.Engine, wasm: bytes) -> Module:
        """Compile with Cranelift, and keep the result on disk for later processes (floe.wasm.compiled)."""
        try:
            module = Module(engine, wasm)
        except WasmtimeError as e:
            raise GuestLoadError(f"{self.name} is not a valid WebAssembly module: {e}") from e
        compiled.keep(module, self.sha256)
        return module

    @functools.cached_property
    def _imports(self) -> tuple[tuple[str, str], ...]:
        return tuple((i.module, i.name) for i in self.module.imports)

    @functools.cached_property
    def _exports(self) -> tuple[str, ...]:
        return tuple(e.name for e in self.module.exports)

    def imports(self) -> list[tuple[str, str]]:
        return list(self._imports)  # read once: each read makes a wrapper per import through ctypes

    def exports(self) -> list[str]:
        return list(self._exports)


class GuestInstance:
    """One instance of a guest module in its own Store, its linear memory a Region.

    Its start function (if any) runs under `deadline_s` and `memory_cap` like any call, and holds no
    lock another instantiation waits for."""

    def __init__(self, module: GuestModule, import_module: str, functions: Sequence[HostFunction],
                 memory_cap: int, deadline_s: float = 60.0) -> None:
        runtime = module.runtime
        self.module = module
        self.memory_cap = memory_cap
        self.store = Store(runtime.engine)
        # The memory cap is enforced by the Region (a refused grow is recorded there, so a trap that
        # follows it can be reported as GuestMemoryLimit); the store still bounds everything else, and
        # its tables (host memory, 8 bytes an element) to the cap too: all 4 together within it.
        self.store.set_limits(table_elements=table_elements(memory_cap), instances=1, tables=TABLES,
                              memories=1)
        runtime.deadline_ticks(deadline_s)  # starts the epoch ticker
        self.watchdog = Watchdog(self.store)
        provided = {f.name: f for f in functions}
        for mod, name in module.imports():
            if mod != import_module or name not in provided:
                raise GuestLoadError(f"{module.name} imports {mod}.{name}, which floe does not provide")
        linker = Linker(runtime.engine)
        runtime.host_functions.define_all(linker, import_module, [
            (f.name, runtime.func_type(f.n_params, f.n_results), f.fn, f.native) for f in functions])
        self.watchdog.arm(deadline_s)
        # (the start function runs in instantiate)
        with (runtime.memory_creator.creating(memory_cap) as created, signals.held(), guest_stack,
              _Running(self.watchdog)):
            try:
                self.instance: Instance = linker.instantiate(self.store, module.module)
            except (Trap, WasmtimeError) as e:
                if self.watchdog.interrupt is not None:
                    raise self.watchdog.interrupt from None
                raise self._instantiate_error(e, created, deadline_s) from None
            self.exports = Exports(self.store, self.instance)
            memory = self.exports.get("memory")
            # Wasmtime may make other memories through the creator too (a GC heap for reference types):
            # the guest's is the one at the exported memory's address.
            base = memory_address(memory, self.store) if isinstance(memory, wasmtime.Memory) else None
        regions = [r for r in created if r.base == base]
        if len(regions) != 1:
            raise GuestLoadError(f"{module.name} must define and export exactly one memory, named 'memory'")
        self.region: Region = regions[0]
        self.regions = list(created)  # its memory, and the GC heap of exception objects if it has one
        self.memory: wasmtime.Memory = memory
        self._calls: dict[tuple[str, int], PreparedCall] = {}  # (export, arguments) -> call
        if module.mutable_globals is None:
            found = self.mutable_globals()
            for name, g in found:
                kind = global_kind(self.store, g)
                if kind not in NUMERIC.values():
                    raise GuestLoadError(
                        f"{module.name} exports a mutable {kind} global {name!r}: a snapshot can hold only "
                        "i32, i64, f32 and f64 globals (keep other state unexported or in memory)")
            module.mutable_globals = tuple(name for name, _ in found)

    def _instantiate_error(self, e: BaseException, created: list[Region], deadline_s: float) -> GuestError:
        name = self.module.name
        if self.watchdog.reason == "deadline":
            return GuestDeadlineExceeded(f"{name}'s start function ran past its {deadline_s:g} s deadline")
        if any(r.denied_size for r in created):
            denied = max(r.denied_size for r in created)
            return GuestMemoryLimit(f"{name}'s start function asked for {_mib(denied)} of memory, "
                                    f"over its cap of {_mib(self.memory_cap)}")
        return GuestLoadError(f"cannot instantiate {name}: {trap_reason(e)}")

    def has_function(self, name: str) -> bool:
        return isinstance(self.exports.get(name), wasmtime.Func)

    def function(self, name: str, n_params: int | None = None) -> wasmtime.Func:
        """The exported function `name`; with n_params, checked to take that many values and return
        one (the kinds are checked by Wasmtime at each call)."""
        f = self.exports.get(name)
        if not isinstance(f, wasmtime.Func):
            raise GuestLoadError(f"{self.module.name} does not export function {name!r}")
        if n_params is not None and (name, n_params) not in self.module.checked:
            ty = f.type(self.store)
            if len(ty.params) != n_params or len(ty.results) != 1:
                raise GuestLoadError(
                    f"{self.module.name} exports {name} with {len(ty.params)} parameters and "
                    f"{len(ty.results)} results; the ABI wants ({', '.join(['i32'] * n_params)}) -> i32")
            self.module.checked.add((name, n_params))
        return f

    def call(self, name: str, *args: int, deadline_s: float, pending: Callable[[], BaseException | None],
             hold_gil: bool | str = False):
        """Call an export (i32s in, one i32 out); traps become GuestError subclasses, a host-side error
        found by `pending` (raised inside a host function during the call) is re-raised as itself.
        hold_gil: True, the guest's own code runs without releasing the GIL (its host calls still may),
        for short calls on a thread that others must not delay (the engine loop's); HOLD_TO_A_TICK, the
        same until the call's first epoch tick, then released (an actor's calls: short ones hand the GIL
        over nowhere, a long one lets others run; released from the start where the native library was
        not loaded when the guest was made). Either only off the main thread, where epochs tick natively
        (else the deadline could not stop a runaway that holds it)."""
        call = self.prepared(name, len(args))
        self._before_call()
        self.watchdog.arm(deadline_s)
        if hold_gil and not (self.module.runtime.native_ticks
                             and (hold_gil is True or self.watchdog.native_tick)):
            hold_gil = False
        try:
            with guest_stack, _Running(self.watchdog):
                if threading.get_ident() != signals.main:
                    return call(args, hold_gil)
                with signals.held():
                    return call(args)
        except RawCallError as e:
            self._raise_failure(name, e, deadline_s, pending)

    def prepared(self, name: str, n_args: int) -> PreparedCall:
        """The prepared call of export `name` with n_args i32 arguments (made at its first use)."""
        call = self._calls.get((name, n_args))
        if call is None:
            call = self._calls[name, n_args] = PreparedCall(self.store, self.function(name), n_args,
                                                            self.module.typed, (name, n_args))
        return call

    def _before_call(self) -> None:
        for region in self.regions:
            region.denied_size = 0
        runtime = self.module.runtime
        if runtime._ticker is None:  # (a fork's child: its guests copied from the parent)
            runtime._start_ticker()

    def _raise_failure(self, name: str, e: RawCallError, deadline_s: float,
                       pending: Callable[[], BaseException | None]) -> NoReturn:
        """Raise what a failed call of `name` is: a host-side error found by `pending` (or a Ctrl-C) as
        itself, a host function's escaped failure, else the GuestError of the trap or refusal."""
        host_error = pending() or self.watchdog.interrupt
        if host_error is not None:  # (its own cause kept: a wrapped host-side error)
            raise host_error from host_error.__cause__
        escaped = self.module.runtime.host_functions.take_failure()
        if escaped is not None:  # a host function failed without saying how (its own error handling did)
            raise GuestHostCallError(f"guest {self.module.name}: a host function it called failed: "
                                     f"{describe(escaped)}") from escaped
        raise self._call_error(name, e, deadline_s) from None

    def _call_error(self, name: str, e: RawCallError, deadline_s: float) -> GuestError:
        guest = self.module.name
        if self.watchdog.reason == "deadline":
            return GuestDeadlineExceeded(f"guest {guest} ran past its {deadline_s:g} s deadline and was "
                                         "stopped")
        if self.watchdog.reason is not None:
            return GuestCancelled(f"guest {guest} was stopped: {self.watchdog.reason}")
        denied = max(self.regions, key=lambda r: r.denied_size)
        if denied.denied_size:  # a GC heap that cannot grow fails the call with an error, not a trap
            what = "memory" if denied is self.region else "GC heap (exception objects)"
            return GuestMemoryLimit(
                f"guest {guest} failed after asking for {_mib(denied.denied_size)} of {what}, over its cap "
                f"of {_mib(self.memory_cap)} ({trap_reason(e)})")
        if not e.trap:
            return GuestLoadError(f"guest {guest} cannot be called as the ABI says ({name}: "
                                  f"{trap_reason(e)})")
        return GuestTrap(f"guest {guest} trapped: {trap_reason(e)}")

    def cancel(self, reason: str) -> None:
        """From any thread: stop the running call at its next epoch tick (GuestCancelled)."""
        self.watchdog.cancel(reason)

    def wind_down(self, seconds: float) -> None:
        """From any thread: the running call gets at most `seconds` more (then its deadline error)."""
        self.watchdog.shorten(seconds)

    # ---- state capture and restore (between calls only) ---------------------------------------------

    def mutable_globals(self) -> list[tuple[str, wasmtime.Global]]:
        """Exported mutable globals, by name (listed once a module: GuestModule). (Unexported ones, like
        clang's __stack_pointer, are back at their initial values between calls in a well-formed guest.)"""
        if self.module.mutable_globals is not None:
            return [(name, self.exports.get(name)) for name in self.module.mutable_globals]
        return [(name, ext) for name, ext in self.exports.items()  # listed once: each listing walks them
                if isinstance(ext, wasmtime.Global) and ext.type(self.store).mutable]

    def capture_globals(self) -> list[tuple[str, str, int]]:
        """(name, wasm type, raw bit pattern) of each exported mutable global (numeric: checked at load)."""
        return [(name, *global_bits(self.store, g)) for name, g in self.mutable_globals()]

    def restore_globals(self, saved: list[tuple[str, str, int]]) -> None:
        mine = dict(self.mutable_globals())
        for name, kind, bits in saved:
            g = mine.get(name)
            if g is None or global_kind(self.store, g) != kind:
                raise GuestLoadError(f"guest has no mutable global {name!r} of type {kind}")
            set_global_bits(self.store, g, kind, int(bits))

    def capture_memory(self, page: int = 4096) -> tuple[int, np.ndarray, np.ndarray]:
        """(size in bytes, indices of the pages that are not all zero, those pages' bytes)."""
        size = self.region.size
        words = self.region.numpy(0, size // 8, np.uint64).reshape(-1, page // 8)
        index = np.flatnonzero(words.any(axis=1)).astype(np.int32)
        return size, index, words[index].reshape(-1).view(np.uint8)

    def restore_memory(self, size: int, index: np.ndarray, data: np.ndarray, page: int = 4096) -> None:
        """Make guest memory exactly `size` bytes: zero everywhere but the given pages."""
        if size < self.region.size or size % 65536:
            raise GuestLoadError(f"saved memory ({size} bytes) is not a whole number of wasm pages at "
                                 f"least the module's initial memory ({self.region.size} bytes)")
        if size > self.memory_cap:
            raise GuestMemoryLimit(f"saved memory ({size >> 20} MiB) is over the cap of "
                                   f"{self.memory_cap >> 20} MiB")
        index = np.asarray(index, dtype=np.int64)
        if len(index) and (index.min() < 0 or index.max() >= size // page or np.any(np.diff(index) <= 0)):
            raise GuestLoadError(f"saved memory pages must be distinct, in order and below {size // page}")
        if np.asarray(data).nbytes != len(index) * page:
            raise GuestLoadError(f"saved memory holds {np.asarray(data).nbytes} bytes for {len(index)} pages")
        grow_pages = (size - self.region.size) // 65536
        if grow_pages:
            with signals.held():  # Wasmtime calls the memory creator back
                self.memory.grow(self.store, grow_pages)
        self.region.zero()
        words = self.region.numpy(0, size // 8, np.uint64).reshape(-1, page // 8)
        words[index] = np.asarray(data).view(np.uint64).reshape(len(index), page // 8)

    @property
    def memory_base(self) -> int:
        """The guest memory's base address as Wasmtime reports it."""
        with signals.held():  # Wasmtime asks the memory creator
            return memory_address(self.memory, self.store)

    def close(self) -> None:
        self.region.close()
        self._calls.clear()  # (their pointers are into the store)
        with signals.held():  # dropping the store calls the memory and host-function finalizers
            self.exports = None  # type: ignore[assignment]
            self.instance = None  # type: ignore[assignment]
            self.store = None  # type: ignore[assignment]


def _mib(n: int) -> str:
    return f"{n / 2**20:.3g} MiB"
