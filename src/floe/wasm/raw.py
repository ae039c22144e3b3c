"""The raw Wasmtime C API pieces wasmtime-py has no Python wrapper for, in one place.

- A host memory creator (`wasmtime_config_host_memory_creator_set`): every linear memory Wasmtime
  makes is a floe Region, so guest memory *is* a region the engine reads and writes in place.
- "Unchecked" host functions (`wasmtime_linker_define_func_unchecked`): arguments arrive as raw
  16-byte slots, no Python objects are built per call (~0.5 µs instead of ~3 µs).
- Calls into the guest and reads/writes of its globals through `wasmtime_val_t` directly: wasmtime-py
  asks the C API for each value's type (`wasm_valtype_kind`), which aborts the whole process on a
  `v128` ("support for v128 is not implemented"), so a guest could kill the host with one signature.

A Python exception escaping a ctypes callback is printed and the callback returns garbage (a bad
pointer, a lost error), so every callback here catches everything and answers Wasmtime with an error or
a trap — and, since a callback's first line comes before its `try`, Python's signal handlers (Ctrl-C's
KeyboardInterrupt) are deferred while floe calls into Wasmtime on the main thread (`SignalDeferral`).
"""

from __future__ import annotations

import _signal  # signal's own functions wrap these in enums: 70x slower, and this runs per guest call
import collections
import ctypes
import ctypes.util
import functools
import re
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import NamedTuple

from wasmtime import Trap
from wasmtime import _ffi as ffi
from wasmtime._extern import wrap_extern

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
_define_native = ctypes.CFUNCTYPE(  # (a native host function: its callback and finalizer as pointers)
    ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_char_p,
    ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
)(("wasmtime_linker_define_func_unchecked", _dll))

# Raw values are 16-byte unions; viewed as u64 pairs, slot i's low word is at index 2 * i.
RawArgs = "ctypes._Pointer[ctypes.c_uint64]"
# A native host function's maker: its Python twin's key -> (callback, env, finalizer) addresses.
NativeHost = "Callable[[int], tuple[int, int, int]]"
HostCallback = Callable[[RawArgs], int]


def trap_new(message: str) -> int:
    """A wasm_trap_t* (as an int) that traps the calling guest with `message`."""
    data = message.encode()
    return _dll.wasmtime_trap_new(data, len(data))


def error_new(message: str) -> int:
    return _dll.wasmtime_error_new(message.encode())


def describe(e: BaseException) -> str:
    """`Type: message` of an exception, even one whose __str__ raises (inside a callback's except)."""
    try:
        return f"{type(e).__name__}: {e}"
    except BaseException:  # noqa: BLE001 - whatever its __str__ does, the callback must answer
        return type(e).__name__


def trap_reason(e: BaseException) -> str:
    """The line of a Wasmtime trap that says what happened ("wasm trap: ..."), else its first."""
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    for line in lines:
        if "wasm trap:" in line or "host function failed" in line:
            return re.sub(r"^\d+:\s*", "", line)
    if isinstance(e, Trap) and e.trap_code is not None:
        return e.trap_code.name.lower().replace("_", " ")
    if not lines:  # Wasmtime says nothing of a WebAssembly exception that nothing caught
        return "a trap with no message (a WebAssembly exception that nothing caught does this)"
    return lines[-1]


# ---- signals while floe is inside Wasmtime on the main thread ------------------------------------

class SignalDeferral:
    """Python runs signal handlers in the main thread at the next bytecode boundary: while a guest runs
    there, the first line of one of the callbacks below, before its `try`. An exception a handler
    raises there (KeyboardInterrupt) escapes into Wasmtime: printed, lost, and the callback's answer is
    garbage. So while floe is inside Wasmtime on the main thread, each Python handler is replaced by
    one that only records the signal; the real handlers run at the guest's next epoch tick or host
    call (inside the callback's `try`: what they raise stops the guest and is re-raised by the call),
    else when floe leaves Wasmtime."""

    def __init__(self) -> None:
        self.main = threading.main_thread().ident
        self._depth = 0
        self._handlers: dict[int, object] = {}
        self._pending: collections.deque[tuple[int, object]] = collections.deque()
        self._record = self._recorder  # one bound method, installed and recognised as ours

    @contextmanager
    def held(self) -> Iterator[None]:
        """Within the block (on the main thread; elsewhere a no-op), Python signal handlers are deferred."""
        if threading.get_ident() != self.main:
            yield
            return
        if self._depth == 0:
            for signum in range(1, _signal.NSIG):
                handler = _signal.getsignal(signum)
                if callable(handler) and handler is not self._record:
                    self._handlers[signum] = handler
                    _signal.signal(signum, self._record)
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                handlers, self._handlers = self._handlers, {}
                for signum, handler in handlers.items():
                    if _signal.getsignal(signum) is self._record:  # (not one a callback installed since)
                        _signal.signal(signum, handler)
                self._deliver(handlers)

    def deliver(self) -> None:
        """Run the handlers of the signals recorded so far (what they raise propagates); call it where an
        exception is caught: inside a callback's `try`. A no-op off the main thread."""
        if self._pending and threading.get_ident() == self.main:
            self._deliver(self._handlers)

    def _deliver(self, handlers: dict) -> None:
        while self._pending:
            signum, frame = self._pending.popleft()
            handler = handlers.get(signum)
            if callable(handler):
                handler(signum, frame)

    def _recorder(self, signum: int, frame) -> None:
        self._pending.append((signum, frame))


signals = SignalDeferral()


# ---- host memory creator -------------------------------------------------------------------------

class MemoryCreator:
    """Hands Wasmtime a Region for each new linear memory, and the Region to whoever instantiates.

    new_memory runs inside instantiation, on the instantiating thread: `creating(cap)` collects the
    regions made by this thread's instantiation and caps them from their first byte (a start function
    cannot grow past the actor's cap), so instantiations in different threads need no common lock.
    """

    def __init__(self) -> None:
        self._regions: dict[int, Region] = {}
        self._next = 1
        self._lock = threading.Lock()
        self._local = threading.local()
        self._new_memory = ffi.wasmtime_new_memory_callback_t(self._on_new_memory)
        self._get_memory = ffi.wasmtime_memory_get_callback_t(self._on_get_memory)
        self._grow_memory = ffi.wasmtime_memory_grow_callback_t(self._on_grow_memory)
        self._finalize_memory = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(self._on_finalize_memory)
        self._finalize_creator = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(lambda env: None)
        self.struct = ffi.wasmtime_memory_creator_t(None, self._new_memory, self._finalize_creator)

    def install(self, config) -> None:
        ffi.wasmtime_config_host_memory_creator_set(config.ptr(), ctypes.byref(self.struct))

    @contextmanager
    def creating(self, cap: int) -> Iterator[list[Region]]:
        """Within the block, memories this thread creates are capped at `cap` bytes and listed in
        the yielded list."""
        created: list[Region] = []
        self._local.created, self._local.cap = created, cap
        try:
            yield created
        finally:
            self._local.created, self._local.cap = None, None

    def _on_new_memory(self, env, ty, minimum, maximum, reserved, guard, memory_ret) -> int:
        try:
            created, cap = getattr(self._local, "created", None), getattr(self._local, "cap", None)
            if created is None:
                return error_new("floe creates guest memory only while instantiating a guest")
            if minimum > cap:
                return error_new(f"the module's initial memory ({minimum} bytes) is over the guest's "
                                 f"memory cap ({cap} bytes)")
            capacity = max(reserved, minimum) + guard if reserved else max(maximum, minimum)
            region = Region(minimum, capacity=capacity)
            region.max_size = min(maximum, reserved) if reserved else maximum
            region.limit = cap
            with self._lock:
                key = self._next
                self._next += 1
                self._regions[key] = region
            out = memory_ret.contents
            out.env = key
            out.get_memory = self._get_memory
            out.grow_memory = self._grow_memory
            out.finalizer = self._finalize_memory
            created.append(region)
            return 0
        except BaseException as e:  # noqa: BLE001 - must not escape into Wasmtime
            return error_new(f"floe could not create guest memory: {describe(e)}")

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
            return error_new(f"guest memory cannot grow to {new_size} bytes: {describe(e)}")

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
        self._failed = threading.local()
        self._trampoline = _UNCHECKED(self._call)
        self._finalize = _FINALIZER(self._forget)
        self._finalize_ptr = ctypes.cast(self._finalize, ctypes.c_void_p)

    def define_all(self, linker, module: str,
                   functions: Sequence[tuple[str, object, HostCallback, NativeHost | None]]) -> None:
        """Each (name, functype, fn, native) as an import of `module` in `linker`, the linker's and the
        module's parts made once and the keys taken at once (an actor's 19 one by one: ~80 µs of its
        making). fn(raw) reads arguments from raw[2*i], writes results to raw[2*i], returns 0 or a trap.
        native(key): (a C callback, its env, its finalizer) answering the import instead, which calls
        this trampoline with `key` (fn's) for what it does not answer and whose finalizer forgets `key`
        (floe.actor.native_imports)."""
        with self._lock:
            first = self._next
            self._next += len(functions)
            for i, f in enumerate(functions):
                self._table[first + i] = f[2]
        m = module.encode()
        head = (ctypes.cast(linker.ptr(), ctypes.c_void_p), m, len(m))
        types: dict[int, ctypes.c_void_p] = {}
        for i, (name, functype, _, native) in enumerate(functions):
            key, n = first + i, name.encode()
            ty = types.get(id(functype))
            if ty is None:
                ty = types[id(functype)] = ctypes.cast(functype.ptr(), ctypes.c_void_p)
            try:
                if native is None:
                    err = _define_unchecked(*head, n, len(n), ty, self._trampoline, key, self._finalize_ptr)
                else:
                    err = _define_native(*head, n, len(n), ty, *native(key))
            except BaseException:
                self._forget_from(key, first + len(functions))
                raise
            if err:
                from wasmtime import WasmtimeError

                self._forget_from(key, first + len(functions))
                raise WasmtimeError._from_ptr(ctypes.cast(err, ctypes.POINTER(ffi.wasmtime_error_t)))

    def _forget_from(self, key: int, end: int) -> None:
        """Forget keys key..end-1: not defined (a failed define_all; those before have finalizers)."""
        with self._lock:
            for k in range(key, end):
                self._table.pop(k, None)

    @property
    def pointers(self) -> tuple[int, int]:
        """The trampoline's and the finalizer's addresses (a native host function's way back here)."""
        return ctypes.cast(self._trampoline, ctypes.c_void_p).value, self._finalize_ptr.value

    def _call(self, env, caller, raw, n) -> int:
        try:
            return self._table[env](raw)
        except BaseException as e:  # noqa: BLE001 - must not escape into Wasmtime
            self._failed.error = e
            return trap_new(f"host function failed: {describe(e)}")

    def take_failure(self) -> BaseException | None:
        """What escaped a host function (not kept by it for its caller) in this thread's last call."""
        error, self._failed.error = getattr(self._failed, "error", None), None
        return error

    def _forget(self, env) -> None:
        with self._lock:
            self._table.pop(env, None)


# ---- an instance's exports ----------------------------------------------------------------------

_export_get = _dll.wasmtime_instance_export_get  # (typed by wasmtime's bindings)


class Exports:
    """An instance's exports by name, each looked up and wrapped at its first use: wasmtime-py's
    Instance.exports wraps every one at once (~40 µs an actor of the chat guest, which uses a few)."""

    __slots__ = ("_store", "_instance", "_got")

    def __init__(self, store, instance) -> None:
        self._store, self._instance = store, instance
        self._got: dict[str, object] = {}

    def get(self, name: str, default=None):
        got = self._got
        if name in got:
            found = got[name]
        else:
            item, n = ffi.wasmtime_extern_t(), name.encode()
            found = got[name] = (wrap_extern(item) if _export_get(
                self._store._context(), ctypes.byref(self._instance._instance), n, len(n),
                ctypes.byref(item)) else None)
        return default if found is None else found

    def items(self):
        """(name, extern) of every export, in the module's order."""
        return self._instance.exports(self._store).items()


def memory_address(memory, store) -> int:
    """Where a wasmtime.Memory's bytes start (0 if it has none)."""
    return ctypes.cast(memory.data_ptr(store), ctypes.c_void_p).value or 0


# ---- calls and globals through raw values --------------------------------------------------------

I32, I64, F32, F64, V128 = (int(k.value) for k in (ffi.WASMTIME_I32, ffi.WASMTIME_I64, ffi.WASMTIME_F32,
                                                   ffi.WASMTIME_F64, ffi.WASMTIME_V128))
KIND_NAMES = {I32: "i32", I64: "i64", F32: "f32", F64: "f64", V128: "v128", 5: "funcref", 6: "externref",
              7: "anyref", 8: "exnref"}
NUMERIC = {I32: "i32", I64: "i64", F32: "f32", F64: "f64"}  # what a snapshot captures, as raw bits
_BITS = {"i32": 32, "i64": 64, "f32": 32, "f64": 64}


class RawCallError(Exception):
    """wasmtime_func_call refused the call (a signature mismatch) or trapped; `trap` tells which."""

    def __init__(self, message: str, trap: bool) -> None:
        super().__init__(message)
        self.trap = trap


def _message(ptr, free, to_bytes) -> str:
    vec = ffi.wasm_byte_vec_t()
    to_bytes(ptr, ctypes.byref(vec))
    try:
        return ctypes.string_at(vec.data, vec.size).decode("utf-8", "replace").rstrip("\x00")  # (C's NUL)
    finally:
        ffi.wasm_byte_vec_delete(ctypes.byref(vec))
        free(ptr)


_func_call = _dll.wasmtime_func_call  # (typed by wasmtime's bindings; their wrapper is one frame more)
# The same call without releasing the GIL (PYFUNCTYPE). A call that releases it hands it to any thread
# waiting for it, and gets it back only when that thread lets go: up to sys.getswitchinterval() (5 ms)
# later. The engine loop calls every row's guest once a step, while the server's other threads run
# Python; only safe where epochs tick without Python (EpochTimer), or a runaway guest would hang them.
_func_call_holding_gil = ctypes.PYFUNCTYPE(_func_call.restype, *_func_call.argtypes)(
    ("wasmtime_func_call", _dll))
# A call of a function whose type is known to be the call's (PreparedCall learns it from its first
# checked call): Wasmtime's checked call looks the function's type up and compares it with the
# arguments' each time (~250 ns a call on a Xeon VM; unchecked ~20 ns: bench/probes/wasm_call_cost.py).
_func_call_unchecked = _dll.wasmtime_func_call_unchecked
_func_call_unchecked_holding_gil = ctypes.PYFUNCTYPE(
    _func_call_unchecked.restype, *_func_call_unchecked.argtypes)(("wasmtime_func_call_unchecked", _dll))
# PreparedCall.row's results address | this: its function's type is known, () -> i32; call_rows.cpp
# calls it unchecked, its raw result at that address (what a checked call's result buffer holds room for)
RAW_RESULTS = 1
# PreparedCall's hold_gil: held until the call's first epoch tick, then let go for the rest of it
# (csrc/hold_gil.cpp: floe_call_holding): an actor's calls (its on_message) hold the GIL while short
# and let other threads run once long. Where the native library is not loaded: released, as False.
HOLD_TO_A_TICK = "tick"


class _Holding(NamedTuple):
    """csrc/hold_gil.cpp's functions (the checked and unchecked calls bound to Wasmtime's)."""

    to_a_tick: Callable  # floe_call_holding: HOLD_TO_A_TICK's calls
    to_a_tick_unchecked: Callable
    held: Callable  # floe_call_held: hold_gil=True's, never let go at a tick (made from a host call of a
    held_unchecked: Callable  # HOLD_TO_A_TICK call, a tick inside one must not let go of the GIL)
    tick: int  # floe_tick's address: every store's deadline callback from then on
    let_go: Callable[[], int]  # floe_gil_let_go


_holding: _Holding | None = None  # set by floe.wasm.rows once it loads the library (use_native_holding)


def use_native_holding(library: ctypes.PyDLL) -> None:
    """Call with HOLD_TO_A_TICK through `library`'s floe_call_holding (csrc/hold_gil.cpp), in stores
    whose watchdog is made from now on."""
    global _holding
    api = ctypes.pythonapi
    library.floe_gil_functions.argtypes = [ctypes.c_void_p] * 3
    library.floe_gil_functions(*(ctypes.cast(f, ctypes.c_void_p) for f in (
        api.PyEval_SaveThread, api.PyEval_RestoreThread, api.PyGILState_Check)))
    calls = []
    for checked, unchecked in ((library.floe_call_holding, library.floe_call_holding_unchecked),
                               (library.floe_call_held, library.floe_call_held_unchecked)):
        checked.restype, unchecked.restype = _func_call.restype, _func_call_unchecked.restype
        checked.argtypes = [ctypes.c_void_p, *_func_call.argtypes]
        unchecked.argtypes = [ctypes.c_void_p, *_func_call_unchecked.argtypes]
        calls.append((functools.partial(checked, ctypes.cast(_func_call, ctypes.c_void_p)),
                      functools.partial(unchecked, ctypes.cast(_func_call_unchecked, ctypes.c_void_p))))
    library.floe_gil_let_go.restype = ctypes.c_int64
    _holding = _Holding(*calls[0], *calls[1], ctypes.cast(library.floe_tick, ctypes.c_void_p).value,
                        library.floe_gil_let_go)


def gil_let_go() -> int:
    """Calls made with HOLD_TO_A_TICK that let the GIL go at a tick so far (0 without the library)."""
    return 0 if _holding is None else _holding.let_go()


def native_tick_address() -> int | None:
    """floe_tick's address, every store's epoch-deadline callback once the native library is loaded
    (use_native_holding): a HOLD_TO_A_TICK call lets the GIL go at a tick there; None without it."""
    return None if _holding is None else _holding.tick


class PreparedCall:
    """Calls of one export with n_args i32 arguments, expecting exactly one i32 result (a function of
    another signature is refused by Wasmtime: RawCallError, trap=False). Its C arrays and pointers are
    made once: the engine loop calls each row's on_token once a step, and building them each time was
    a third of that call. Valid while its store lives (GuestInstance drops them when it closes).
    Once a call went through Wasmtime's type check and returned an i32, the export's type is known
    ((i32 x n_args) -> i32: a type never changes) and later calls are unchecked (`raw`): arguments and
    result in one array of raw values. (Its type is not asked of Wasmtime: the C API aborts the process
    on a v128 in it.)"""

    __slots__ = ("_func", "_context", "_ref", "_n", "_params", "_results", "_trap", "_trap_ref", "row",
                 "raw", "_raw", "_typed", "_key")

    def __init__(self, store, func, n_args: int, typed: set | None = None, key: object = None) -> None:
        """typed: the keys of calls whose type is known (its module's: GuestModule.typed), `key` this
        call's: known there, it is unchecked from its first call; learnt, it is added."""
        self._func = func  # (kept alive: _ref points into it)
        self._context = store._context()
        self._ref = ctypes.byref(func._func)
        self._n = n_args
        self._params = (ffi.wasmtime_val_t * max(1, n_args))()
        for param in self._params:
            param.kind = I32
        self._results = (ffi.wasmtime_val_t * 1)()
        self._new_trap()
        self.raw = False
        self._raw = (ffi.wasmtime_val_raw_t * max(1, n_args))()
        # (context, function, results) addresses: a row of floe_call_rows (floe.wasm.rows), which calls
        # an export of no arguments without Python in between (unchecked once its type is known)
        self.row = (ctypes.cast(self._context, ctypes.c_void_p).value, ctypes.addressof(func._func),
                    ctypes.addressof(self._results))
        self._typed, self._key = typed, key
        if typed is not None and key in typed:
            self._known()

    def _known(self) -> None:
        """Its type is the call's: unchecked from now on."""
        self.raw = True
        context, func, out = self.row
        self.row = (context, func, out | RAW_RESULTS)

    def _new_trap(self) -> None:
        self._trap = ctypes.POINTER(ffi.wasm_trap_t)()
        self._trap_ref = ctypes.byref(self._trap)

    def __call__(self, args: tuple[int, ...], hold_gil: bool | str = False) -> int:
        """The call; hold_gil: True, without releasing the GIL (see _func_call_holding_gil);
        HOLD_TO_A_TICK, holding it until the call's first epoch tick (its store's watchdog made with
        the native library: Watchdog.native_tick)."""
        if len(args) != self._n:
            raise RawCallError(f"called with {len(args)} arguments, prepared for {self._n}", False)
        if not hold_gil:
            checked, unchecked = _func_call, _func_call_unchecked
        elif _holding is None:  # (no store ticks through floe_tick: a tick lets nothing go)
            checked, unchecked = ((_func_call_holding_gil, _func_call_unchecked_holding_gil)
                                  if hold_gil is True else (_func_call, _func_call_unchecked))
        elif hold_gil == HOLD_TO_A_TICK:
            checked, unchecked = _holding.to_a_tick, _holding.to_a_tick_unchecked
        else:
            checked, unchecked = _holding.held, _holding.held_unchecked
        if self.raw:
            raw = self._raw
            for i, a in enumerate(args):
                raw[i].i32 = a  # (a ctypes int32 field wraps, as the guest's i32 would)
            error = unchecked(self._context, self._ref, raw, max(1, self._n), self._trap_ref)
        else:
            params = self._params
            for i, a in enumerate(args):
                params[i].of.i32 = a
            error = checked(self._context, self._ref, params, self._n, self._results, 1, self._trap_ref)
        if error:
            raise RawCallError(_message(error, ffi.wasmtime_error_delete, ffi.wasmtime_error_message), False)
        if self._trap:
            trap = self._trap
            self._new_trap()  # (the next call's starts null)
            raise RawCallError(_message(trap, ffi.wasm_trap_delete, ffi.wasm_trap_message), True)
        if self.raw:
            return self._raw[0].i32
        results = self._results
        if results[0].kind != I32:
            raise RawCallError(f"returned a {KIND_NAMES.get(results[0].kind, results[0].kind)}, not an i32",
                               False)
        self._known()  # (checked by Wasmtime just now)
        if self._typed is not None:
            self._typed.add(self._key)
        return results[0].of.i32


def raw_call_error(error: int, trap: int, results: int) -> RawCallError:
    """The RawCallError of a call made natively (floe.wasm.rows) that returned `error` or `trap` (owned
    pointers, freed here), or whose result at `results` is not an i32."""
    if error:
        return RawCallError(_message(ctypes.cast(error, ctypes.POINTER(ffi.wasmtime_error_t)),
                                     ffi.wasmtime_error_delete, ffi.wasmtime_error_message), False)
    if trap:
        return RawCallError(_message(ctypes.cast(trap, ctypes.POINTER(ffi.wasm_trap_t)),
                                     ffi.wasm_trap_delete, ffi.wasm_trap_message), True)
    if results & RAW_RESULTS:  # (an unchecked call returns what its type says: an i32)
        return RawCallError("failed without an error or a trap", False)
    kind = ffi.wasmtime_val_t.from_address(results).kind
    return RawCallError(f"returned a {KIND_NAMES.get(kind, kind)}, not an i32", False)


def global_kind(store, g) -> str:
    """The value type of a global ("i32", "v128", "funcref", ...), read from its value."""
    val = ffi.wasmtime_val_t()
    ffi.wasmtime_global_get(store._context(), ctypes.byref(g._global), ctypes.byref(val))
    try:
        return KIND_NAMES.get(int(val.kind), f"type {int(val.kind)}")
    finally:
        ffi.wasmtime_val_unroot(ctypes.byref(val))


def global_bits(store, g) -> tuple[str, int]:
    """(kind, raw bit pattern) of a numeric global: floats keep their exact bits (a signalling NaN
    stays signalling, which a round trip through a Python float would not)."""
    val = ffi.wasmtime_val_t()
    ffi.wasmtime_global_get(store._context(), ctypes.byref(g._global), ctypes.byref(val))
    kind = NUMERIC.get(int(val.kind))
    if kind is None:
        ffi.wasmtime_val_unroot(ctypes.byref(val))
        raise TypeError(f"a {KIND_NAMES.get(int(val.kind), val.kind)} global has no raw bits")
    raw = ctypes.string_at(ctypes.addressof(val.of), 8)
    return kind, int.from_bytes(raw[: _BITS[kind] // 8], "little")


def set_global_bits(store, g, kind: str, bits: int) -> None:
    """Set a numeric global from its raw bit pattern (the inverse of global_bits)."""
    code = {v: k for k, v in NUMERIC.items()}[kind]
    val = ffi.wasmtime_val_t()
    val.kind = code
    raw = (bits & ((1 << _BITS[kind]) - 1)).to_bytes(8, "little")
    ctypes.memmove(ctypes.addressof(val.of), raw, 8)
    error = ffi.wasmtime_global_set(store._context(), ctypes.byref(g._global), ctypes.byref(val))
    if error:
        raise RawCallError(_message(error, ffi.wasmtime_error_delete, ffi.wasmtime_error_message), False)
