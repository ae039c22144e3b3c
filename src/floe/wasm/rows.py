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
from typing import NamedTuple

import numpy as np

from floe import memory
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
                               ctypes.c_int64, ctypes.c_double]
                call = ctypes.cast(_dll.wasmtime_func_call, ctypes.c_void_p).value
                deadline = ctypes.cast(_dll.wasmtime_context_set_epoch_deadline, ctypes.c_void_p).value
                _native = lambda rows, n, bound: fn(rows, n, call, deadline, I32, bound)  # noqa: E731
            except (BuildError, OSError) as e:
                log.warning("guest calls go row by row (the native loop is not available: %s)", e)
    return _native


def usable(guests: Sequence[GuestInstance]) -> bool:
    """Whether call_rows can run these guests' calls on this thread (as GuestInstance.call with
    hold_gil would hold it: off the main thread, epochs ticking natively)."""
    return (threading.get_ident() != signals.main and all(g.module.runtime.native_ticks for g in guests)
            and native() is not None)


NONE = -(1 << 63)  # Judgement inputs: no host choice / no row in flight (csrc/call_rows.cpp)
PLAIN, TAKES, CONFIRMED = 1, 2, 4  # what the native loop judged a returned token to be (see Judge)
WIDTH = 16  # int64s a row (csrc/call_rows.cpp's Row)


class Judge(NamedTuple):
    """What the native loop judges each returned token against (the engine loop's plain case,
    floe.actor.loop._took): per row, the vocabulary's size, the token of the turn's row in flight
    (NONE: none), the tokens generated so far and max_tokens. Its answer, per row: PLAIN (a token in
    the vocabulary, not the turn's last, and either no row in flight or one with this very token:
    CONFIRMED), TAKES (it is the host's choice); 0 for anything else (stop, a bad token, the last, a
    refused row in flight): the caller's own path judges those."""

    vocab: Sequence[int]
    speculated: Sequence[int]
    generated: Sequence[int]
    max_tokens: Sequence[int]


class _Batch:
    """The guests of one call_rows, registered as one call in flight (runtime._running): stop_all_guests
    cancels each."""

    __slots__ = ("guests",)

    def __init__(self, guests: Sequence[GuestInstance]) -> None:
        self.guests = guests

    def cancel(self, reason: str) -> None:
        for g in self.guests:
            g.watchdog.cancel(reason)


def heads(guests: Sequence[GuestInstance], name: str, choice_at: Sequence[int]) -> list[tuple]:
    """Each row's fixed part for call_rows: its prepared call (context, function, results), where its
    host choice goes, and its watchdog's deadline (the engine loop keeps one per turn: Turn.head)."""
    return [(*g.prepared(name, 0).row, at, g.watchdog.when_at)
            for g, at in zip(guests, choice_at, strict=True)]


def fresh(g: GuestInstance) -> None:
    """Before a guest's first row of a turn (as GuestInstance.call before each call): no memory growth
    refused yet (a later failure's report), no earlier stop's reason."""
    for region in g.regions:
        region.denied_size = 0
    w = g.watchdog
    w.reason = w.interrupt = None


def call_rows(guests: Sequence[GuestInstance], name: str, choice_at: Sequence[int], choices: Sequence[int],
              deadlines: Sequence[float], bound: float,
              pendings: Sequence[Callable[[], BaseException | None]], judge: Judge | None = None,
              head: Sequence[tuple] | None = None) -> tuple[list, list[int]]:
    """Call export `name` (no arguments, one i32 result) of each guest in turn, first storing choices[i]
    (NONE: none) as an int32 at address choice_at[i] (0: none), each call within `bound` seconds of its
    own start and before deadlines[i] (time.monotonic()): for each, the i32 it returned or the exception
    GuestInstance.call would have raised; and, with `judge`, the native loop's judgement of each
    returned token (Judge; 0 for a failed call). head: heads(guests, name, choice_at), where the
    caller keeps them. Each guest's regions and watchdog are as fresh() leaves them (the caller's
    part: once a turn). Check usable() first."""
    n = len(guests)
    out: list = [None] * n
    rows = np.zeros((n, WIDTH), np.int64)
    rows[:, :5] = heads(guests, name, choice_at) if head is None else head
    rows[:, 5] = choices
    rows.view(np.float64)[:, 6] = deadlines
    if judge is not None:
        rows[:, 7:11] = np.array(judge, np.int64).T
    for region in memory.take_denied():  # refused on this thread since (fresh(): none before a turn)
        region.denied_size = 0
    batch = _Batch(guests)
    runtime._running[id(batch)] = batch
    call = native()
    start = 0
    try:
        if runtime._stopped is not None:  # (after registering: as runtime._Running)
            return [GuestCancelled(f"the guest was not run: {runtime._stopped}") for _ in guests], [0] * n
        with guest_stack:
            while start < n:
                done = start + call(rows[start:].ctypes.data, n - start, bound)
                out[start:done] = rows[start:done, 13].tolist()
                if done == n:
                    break
                g = guests[done]
                seconds = max(0.0, min(bound, deadlines[done] - time.monotonic()))
                try:
                    error = raw_call_error(int(rows[done, 11]), int(rows[done, 12]), int(rows[done, 2]))
                    g._raise_failure(name, error, seconds or bound, pendings[done])
                except BaseException as e:  # noqa: BLE001 - this row's answer
                    out[done] = e
                rows[done, 14] = 0
                start = done + 1
    except BaseException as e:  # noqa: BLE001 - the thread's stack refused them (ThreadStackTooSmall)
        return [e if r is None else r for r in out], [0] * n
    finally:
        runtime._running.pop(id(batch), None)
    return out, rows[:, 14].tolist()
