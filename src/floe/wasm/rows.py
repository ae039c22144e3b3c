"""One export of many guests called in one native loop: the engine loop's on_token for every turn of a
step (csrc/call_rows.cpp, a plain shared library built on first use). Each call's state is a row of
int64 words (Col: the engine loop keeps one per KV slot, floe.actor.turn.TurnTable). A row costs the
store of the host's choice in the guest's memory, its watchdog's deadline, an epoch deadline and the
Wasmtime call; the Python layers that GuestInstance.call puts around one call (arming, context
managers, ctypes conversions) are paid once a batch. What the guest returned is judged natively (the
engine loop's plain case) and taken into the row. What a row's failure raises is exactly what
GuestInstance.call raises for it.

Used where GuestInstance.call would hold the GIL (hold_gil): off the main thread, with epochs ticking
natively; `native` says None where it cannot run (no compiler: the caller calls row by row).
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from floe import memory
from floe.wasm import runtime
from floe.wasm.raw import I32, _dll, raw_call_error, signals, use_native_holding
from floe.wasm.runtime import GuestCancelled, GuestInstance, guest_stack

log = logging.getLogger("floe.wasm")
SOURCE = Path(__file__).parent / "csrc" / "call_rows.cpp"
HOLDING = Path(__file__).parent / "csrc" / "hold_gil.cpp"  # (floe.wasm.raw.HOLD_TO_A_TICK's calls)
_lock = threading.Lock()
_native: Callable | None = None
_tried = False

NONE = -(1 << 63)  # a word that holds no token (csrc/call_rows.cpp)
PLAIN, TAKES, CONFIRMED = 1, 2, 4  # Col.JUDGED: what the native loop judged a returned token to be


class Col:
    """The words of a row (csrc/call_rows.cpp's Row, in its order)."""

    CONTEXT, FUNC, RESULTS, CHOICE_AT, WHEN_AT = 0, 1, 2, 3, 4  # the call (heads())
    CHOICE = 5  # the host's choice, stored at CHOICE_AT before the call (NONE: none)
    DEADLINE = 6  # the message's deadline (a double: time.monotonic())
    # The judgement's inputs (VOCAB 0: none): the token of the row in flight (NONE: none), tokens
    # generated so far (+1 for a plain token), max_tokens.
    VOCAB, SPECULATED, GENERATED, MAX_TOKENS = 7, 8, 9, 10
    ERROR, TRAP, RESULT, JUDGED = 11, 12, 13, 14  # out
    # Taken into the row for a plain token: its next token (unless the row in flight had it), whether
    # it was the host's choice (and no draw of the guest's own: SAMPLED, DRAWS), no refusal.
    NEXT_TOKEN, TAKES_CHOICE, REFUSED = 15, 16, 17
    FRESH = 18  # 0 once asked
    DRAWS, SAMPLED, STREAMS = 19, 20, 21  # SAMPLED: 0 before each call, 1 by the guest's sample()
    CHOICES = 22  # +1 a call that stored a choice
    # The engine loop's own (not read here): its decode rows' forwards and their seconds (a double),
    # the transfers they made (calls and bytes, host→device and device→host: TurnTable.moved_names),
    # their logits computed in place in the guest's buffer or copied there.
    ROWS, ROWS_S, IN_CALLS, IN_BYTES, OUT_CALLS, OUT_BYTES, IN_PLACE, COPIED = 23, 24, 25, 26, 27, 28, 29, 30
    # A plain token taken natively (0 / null: not): where the turn's decoded ids go and how many there
    # are; where its reply's streamed ids go (a TokenStream's buffer and count) and each token's reply
    # bytes; the budget's room for them and what they were charged; their count, those with text, and
    # the first and last of these (doubles, time.perf_counter()).
    DECODED_AT, N_DECODED, STREAM_IDS_AT, STREAM_N_AT, REPLY_LEN_AT = 32, 33, 34, 35, 36
    ROOM, STREAMED, EMIT_CALLS, EMITS, FIRST_TEXT, LAST_TEXT = 37, 38, 39, 40, 41, 42
    DECODED_CAP, STREAM_CAP = 43, 44  # the room of the decoded ids and the stream's ids (full: Python's)
    FLYING = 45  # the engine loop's own: the turn's rows in launched forwards not yet finished (two when fed)


WIDTH = 48  # words a row


def native() -> Callable | None:
    """floe_call_slots, built on first use (a second or two), or None where it cannot be built."""
    global _native, _tried
    with _lock:
        if not _tried:
            _tried = True
            try:
                from floe.engine.cbuild import BuildError, build_plain

                library = ctypes.PyDLL(str(build_plain("floe_call_rows", [SOURCE, HOLDING], [],
                                                       what="the engine loop's native guest calls")))
                use_native_holding(library)  # (and an actor's calls: hold_gil=HOLD_TO_A_TICK)
                fn = library.floe_call_slots
                fn.restype = ctypes.c_int64
                fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                               ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_double]
                call = ctypes.cast(_dll.wasmtime_func_call, ctypes.c_void_p).value
                unchecked = ctypes.cast(_dll.wasmtime_func_call_unchecked, ctypes.c_void_p).value
                deadline = ctypes.cast(_dll.wasmtime_context_set_epoch_deadline, ctypes.c_void_p).value
                _native = lambda table, slots, n, bound: fn(  # noqa: E731
                    table, slots, n, call, unchecked, deadline, I32, bound)
            except (BuildError, OSError) as e:
                log.warning("guest calls go row by row (the native loop is not available: %s)", e)
    return _native


def usable(guests: Sequence[GuestInstance]) -> bool:
    """Whether the native loop can run these guests' calls on this thread (as GuestInstance.call with
    hold_gil would hold it: off the main thread, epochs ticking natively)."""
    return (threading.get_ident() != signals.main and all(g.module.runtime.native_ticks for g in guests)
            and native() is not None)


class _Batch:
    """The guests of one call_slots, registered as one call in flight (runtime._running): stop_all_guests
    cancels each."""

    __slots__ = ("guests",)

    def __init__(self, guests: Sequence[GuestInstance]) -> None:
        self.guests = guests

    def cancel(self, reason: str) -> None:
        for g in self.guests:
            g.watchdog.cancel(reason)


def heads(guests: Sequence[GuestInstance], name: str, choice_at: Sequence[int]) -> list[tuple]:
    """Each row's call words (Col.CONTEXT to Col.WHEN_AT): its prepared call (context, function,
    results), where its host choice goes, and its watchdog's deadline."""
    return [(*g.prepared(name, 0).row, at, g.watchdog.when_at)
            for g, at in zip(guests, choice_at, strict=True)]


def fresh(g: GuestInstance) -> None:
    """Before a guest's first row of a turn (as GuestInstance.call before each call): no memory growth
    refused yet (a later failure's report), no earlier stop's reason."""
    for region in g.regions:
        region.denied_size = 0
    w = g.watchdog
    w.reason = w.interrupt = None


def call_slots(table: np.ndarray, slots: np.ndarray, guests: Sequence[GuestInstance], name: str,
               bound: float, pending: Callable[[int], BaseException | None]) -> dict[int, BaseException]:
    """Call export `name` (no arguments, one i32 result) of guests[k] with row table[slots[k]] (an
    int64 (rows, WIDTH) table; slots: int64), each within `bound` seconds of its own start and before
    its row's deadline; each row's result, judgement and the plain token's effects are in its row.
    The rows whose call failed: {k: the exception GuestInstance.call would have raised}; pending(k):
    row k's host-side error, if any (Actor.take_pending). Each guest's regions and watchdog are as
    fresh() leaves them (the caller's part: once a turn). Check usable() first."""
    n = len(guests)
    failed: dict[int, BaseException] = {}
    table[slots, Col.JUDGED] = 0  # (a row not called says nothing)
    for region in memory.take_denied():  # refused on this thread since (fresh(): none before a turn)
        region.denied_size = 0
    batch = _Batch(guests)
    runtime._running[id(batch)] = batch
    call = native()
    start = 0
    try:
        if runtime._stopped is not None:  # (after registering: as runtime._Running)
            return {k: GuestCancelled(f"the guest was not run: {runtime._stopped}") for k in range(n)}
        with guest_stack:
            while start < n:
                done = start + call(table.ctypes.data, slots[start:].ctypes.data, n - start, bound)
                if done == n:
                    break
                row = table[slots[done]]
                seconds = max(0.0, min(bound, float(row[Col.DEADLINE:Col.DEADLINE + 1].view(np.float64)[0])
                                       - time.monotonic()))
                error = raw_call_error(int(row[Col.ERROR]), int(row[Col.TRAP]), int(row[Col.RESULTS]))
                try:
                    guests[done]._raise_failure(name, error, seconds or bound, lambda k=done: pending(k))
                except BaseException as e:  # noqa: BLE001 - this row's answer
                    failed[done] = e
                start = done + 1
    except BaseException as e:  # noqa: BLE001 - the thread's stack refused them (ThreadStackTooSmall)
        return {k: failed.get(k, e) for k in range(n)}
    finally:
        runtime._running.pop(id(batch), None)
    return failed
