"""One export of many guests called in one native loop: the engine loop's on_token for every turn of a
step (csrc/call_rows.cpp, a plain shared library built on first use). A row costs the store of the
host's choice in the guest's memory, an epoch deadline and the Wasmtime call; the Python layers that
GuestInstance.call puts around one call (arming, context managers, ctypes conversions) are paid once
a batch. What a row's failure raises is exactly what GuestInstance.call raises for it.

Used where GuestInstance.call would hold the GIL (hold_gil): off the main thread, with epochs ticking
natively; `call_rows` says None where it cannot run (no compiler: the caller calls row by row).
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from floe.wasm import runtime
from floe.wasm.raw import I32, _dll, raw_call_error, signals
from floe.wasm.runtime import GuestCancelled, GuestInstance, guest_stack

log = logging.getLogger("floe.wasm")
SOURCE = Path(__file__).parent / "csrc" / "call_rows.cpp"
_lock = threading.Lock()
_native: Callable | None = None
_tried = False


def native() -> Callable | None:
    """floe_call_rows, built on first use (a second or two), or None where it cannot be built."""
    global _native, _tried
    with _lock:
        if not _tried:
            _tried = True
            try:
                from floe.engine.cbuild import BuildError, build_plain

                library = ctypes.PyDLL(str(build_plain("floe_call_rows", [SOURCE], [],
                                                       what="the engine loop's native guest calls")))
                fn = library.floe_call_rows
                fn.restype = ctypes.c_int64
                fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                               ctypes.c_int64]
                call = ctypes.cast(_dll.wasmtime_func_call, ctypes.c_void_p).value
                deadline = ctypes.cast(_dll.wasmtime_context_set_epoch_deadline, ctypes.c_void_p).value
                _native = lambda rows, n: fn(rows, n, call, deadline, I32)  # noqa: E731
            except (BuildError, OSError) as e:
                log.warning("guest calls go row by row (the native loop is not available: %s)", e)
    return _native


def usable(guests: Sequence[GuestInstance]) -> bool:
    """Whether call_rows can run these guests' calls on this thread (as GuestInstance.call with
    hold_gil would hold it: off the main thread, epochs ticking natively)."""
    return (threading.get_ident() != signals.main and all(g.module.runtime.native_ticks for g in guests)
            and native() is not None)


def call_rows(guests: Sequence[GuestInstance], name: str, choice_at: Sequence[int], choices: Sequence[int],
              seconds: Sequence[float], pendings: Sequence[Callable[[], BaseException | None]]) -> list:
    """Call export `name` (no arguments, one i32 result) of each guest in turn, first storing choices[i]
    as an int32 at address choice_at[i] (0: none), each call within seconds[i] of its start: for each,
    the i32 it returned or the exception GuestInstance.call would have raised. Check usable() first."""
    n = len(guests)
    out: list = [None] * n
    if runtime._stopped is not None:
        return [GuestCancelled(f"the guest was not run: {runtime._stopped}") for _ in guests]
    rows = np.zeros((n, 8), np.int64)
    rows[:, :3] = [g.prepared(name, 0).row for g in guests]
    rows[:, 3] = choice_at
    rows[:, 4] = choices
    for g in guests:
        g._before_call()
        runtime._running[id(g.watchdog)] = g.watchdog
    call = native()
    start = 0
    try:
        with guest_stack:
            while start < n:
                now = time.monotonic()
                for i in range(start, n):  # (GuestInstance.call's watchdog.arm, the epoch set natively)
                    w = guests[i].watchdog
                    w.deadline, w.reason, w.interrupt = now + seconds[i], None, None
                done = start + call(rows[start:].ctypes.data, n - start)
                out[start:done] = rows[start:done, 7].tolist()
                if done == n:
                    break
                g = guests[done]
                try:
                    g._raise_failure(name, raw_call_error(int(rows[done, 5]), int(rows[done, 6]),
                                                          int(rows[done, 2])), seconds[done], pendings[done])
                except BaseException as e:  # noqa: BLE001 - this row's answer
                    out[done] = e
                start = done + 1
    except BaseException as e:  # noqa: BLE001 - the thread's stack refused them (ThreadStackTooSmall)
        return [e if r is None else r for r in out]
    finally:
        for g in guests:
            runtime._running.pop(id(g.watchdog), None)
    return out
