"""A guest's wall-clock deadline and its cancellation, checked at each epoch tick of its store.

Wasmtime interrupts guest code only at epoch ticks: an `EpochTimer` ticks the engine from a native
POSIX timer (no Python, so ticks go on while a guest call holds the GIL), and each store's `Watchdog`
is the epoch-deadline callback that, at every tick, checks the deadline against the wall clock and
whether another thread cancelled the call, and stops the guest if so. Like floe.wasm.raw's callbacks,
its callback catches everything and answers Wasmtime with an error (a Ctrl-C arrives there while a
guest runs on the main thread: floe.wasm.raw.signals)."""

from __future__ import annotations

import ctypes
import sys
import time

from wasmtime import _ffi as ffi

from floe.wasm.raw import _dll, describe, error_new, native_tick_address, signals

_DEADLINE_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p,
                                      ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint8))
_install_deadline_callback = ctypes.CFUNCTYPE(
    None, ctypes.c_void_p, _DEADLINE_CALLBACK, ctypes.c_void_p, ctypes.c_void_p,
)(("wasmtime_store_epoch_deadline_callback", _dll))
_install_native_callback = ctypes.CFUNCTYPE(  # (a C function's address: floe_tick)
    None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
)(("wasmtime_store_epoch_deadline_callback", _dll))


class _SigEvent(ctypes.Structure):
    """Linux's struct sigevent (64 bytes on every 64-bit ABI), its SIGEV_THREAD members."""

    _fields_ = [("value", ctypes.c_void_p), ("signo", ctypes.c_int), ("notify", ctypes.c_int),
                ("function", ctypes.c_void_p), ("attribute", ctypes.c_void_p), ("pad", ctypes.c_byte * 32)]


class _TimeSpec(ctypes.Structure):
    _fields_ = [("sec", ctypes.c_long), ("nsec", ctypes.c_long)]


class _ITimerSpec(ctypes.Structure):
    _fields_ = [("interval", _TimeSpec), ("value", _TimeSpec)]


_CLOCK_MONOTONIC, _SIGEV_THREAD = 1, 2


class EpochTimer:
    """Increments a Wasmtime engine's epoch every `period` seconds with no Python in the way: a POSIX
    timer whose notification (SIGEV_THREAD) the C library runs on a thread of its own, calling
    wasmtime_engine_increment_epoch(engine) directly (its one pointer argument is the sigval). Ticks
    go on while a thread holds the GIL through a guest call. Linux only: `EpochTimer.start` answers
    None elsewhere, or if the C library refuses (the caller then ticks from a Python thread).

    The timer ticks its own clone of the engine (wasmtime_engine_clone: a reference to the same
    engine), which is never deleted: a notification thread the C library has already started may run
    after timer_delete, and the Python engine object is freed while the interpreter shuts down with
    the timer still going — ticking a freed engine crashed the process at exit. One timer a runtime,
    one runtime a process; a fork's child has no timer (POSIX timers are not inherited)."""

    def __init__(self, timer: ctypes.c_void_p, libc, engine_clone) -> None:
        self._timer, self._libc, self._engine = timer, libc, engine_clone

    def stop(self) -> None:
        """No more ticks (the engine clone stays: see the class)."""
        if self._timer is not None:
            self._libc.timer_delete(self._timer)
            self._timer = None

    @classmethod
    def start(cls, engine_ptr, period: float) -> EpochTimer | None:
        if not sys.platform.startswith("linux") or ctypes.sizeof(_SigEvent) != 64:
            return None
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            create, settime = libc.timer_create, libc.timer_settime
        except (OSError, AttributeError):
            return None
        create.argtypes = [ctypes.c_int, ctypes.POINTER(_SigEvent), ctypes.POINTER(ctypes.c_void_p)]
        settime.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(_ITimerSpec), ctypes.c_void_p]
        libc.timer_delete.argtypes = [ctypes.c_void_p]
        engine = ffi.wasmtime_engine_clone(engine_ptr)  # (deliberately never deleted: see the class)
        event = _SigEvent(value=ctypes.cast(engine, ctypes.c_void_p).value, notify=_SIGEV_THREAD,
                          function=ctypes.cast(_dll.wasmtime_engine_increment_epoch, ctypes.c_void_p).value)
        timer = ctypes.c_void_p()
        if create(_CLOCK_MONOTONIC, ctypes.byref(event), ctypes.byref(timer)) != 0:
            return None
        sec, nsec = int(period), int(round((period % 1) * 1e9))
        spec = _ITimerSpec(_TimeSpec(sec, nsec), _TimeSpec(sec, nsec))
        if settime(timer, 0, ctypes.byref(spec), None) != 0:
            libc.timer_delete(timer)
            return None
        return cls(timer, libc, engine)


# Called with the GIL held (ctypes.PyDLL of the same library): it only sets a field of the store, and
# through wasmtime's CDLL each guest call's arm let the GIL go and waited to take it back behind every
# other thread (a burst's chats: ~0.1-0.4 ms a call on a 2-core CPU, bench/probes/arrival_timeline.py).
_set_epoch_deadline = ctypes.PyDLL(_dll._name).wasmtime_context_set_epoch_deadline
_set_epoch_deadline.argtypes = _dll.wasmtime_context_set_epoch_deadline.argtypes  # (wasmtime's bindings')
_set_epoch_deadline.restype = _dll.wasmtime_context_set_epoch_deadline.restype


class Watchdog:
    """Stops a store's running guest code when its wall-clock deadline passes or someone cancels it.

    Wasmtime calls `_on_tick` on the guest's thread at each epoch tick while guest code runs; it
    answers "one more tick" until the deadline or a cancellation, then an error that ends the call.
    `reason` says which ("deadline" or the cancellation's reason), for the caller's error.
    """

    __slots__ = ("_when", "when_at", "reason", "cancelled", "interrupt", "_callback", "_context",
                 "native_tick")

    def __init__(self, store) -> None:
        # The deadline (time.monotonic()) in a C double: floe.wasm.rows arms it natively (when_at).
        self._when = (ctypes.c_double * 1)(float("inf"))
        self.when_at = ctypes.addressof(self._when)
        self.reason: str | None = None
        self.cancelled: str | None = None
        self.interrupt: BaseException | None = None  # a Ctrl-C that arrived while guest code ran
        self._callback = _DEADLINE_CALLBACK(self._on_tick)  # kept alive with the store
        # Through floe_tick where the native library is loaded (HOLD_TO_A_TICK's calls let the GIL go
        # at a tick there), else _on_tick itself.
        tick = native_tick_address()
        self.native_tick = tick is not None
        store_ptr = ctypes.cast(store.ptr(), ctypes.c_void_p)
        if self.native_tick:
            _install_native_callback(store_ptr, tick, ctypes.cast(self._callback, ctypes.c_void_p), None)
        else:
            _install_deadline_callback(store_ptr, self._callback, None, None)
        self._context = store._context()
        store.set_epoch_deadline(1)

    @property
    def deadline(self) -> float:
        return self._when[0]

    @deadline.setter
    def deadline(self, when: float) -> None:
        self._when[0] = when

    def arm(self, seconds: float) -> None:
        """Before a call: its deadline, and the store's epoch deadline the next tick from now (a store
        left idle past its last one would call _on_tick, a Python callback, at the call's start)."""
        self.deadline = time.monotonic() + seconds
        self.reason = self.interrupt = None
        _set_epoch_deadline(self._context, 1)

    def cancel(self, reason: str) -> None:
        """From any thread: the guest stops at its next tick (≤ one tick, ~10 ms)."""
        self.cancelled = reason

    def shorten(self, seconds: float) -> None:
        """From any thread: the running call's deadline comes at most `seconds` from now."""
        self.deadline = min(self.deadline, time.monotonic() + seconds)

    def expired(self) -> str | None:
        """Why the guest must stop now ("deadline", a cancellation), or None."""
        if self.cancelled is not None:
            return self.cancelled
        return "deadline" if time.monotonic() > self.deadline else None

    def _on_tick(self, context, data, delta, kind) -> int:
        try:
            signals.deliver()  # Ctrl-C arrives here while guest code runs on the main thread
            reason = self.expired()
            if reason is None:
                delta[0] = 1
                kind[0] = 0  # continue
                return 0
            self.reason = reason
            return error_new(f"floe stopped the guest: {reason}")
        except BaseException as e:  # noqa: BLE001 - a signal handler's (Ctrl-C): re-raised by the call
            self.interrupt, self.reason = e, "interrupted"
            return error_new(f"floe stopped the guest: interrupted ({describe(e)})")
