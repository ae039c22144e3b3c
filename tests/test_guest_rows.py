"""floe.wasm.rows: one export of many guests called in one native loop (the engine loop's on_token for
every turn of a step). Each row's answer is what GuestInstance.call gives for it: its i32, or its own
failure (a trap, its deadline, a result that is not an i32), the rows after a failure still called."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
import pytest

from floe.wasm import (
    GuestDeadlineExceeded,
    GuestInstance,
    GuestLoadError,
    GuestModule,
    GuestTrap,
    default_runtime,
    start_guest_thread,
)
from floe.wasm import rows as guest_rows
from floe.wasm.rows import NONE, Col

MIB = 1 << 20


class Judge(NamedTuple):
    """call_rows' judgement inputs, per row: the vocabulary's size, the token of the turn's row in flight
    (NONE: none), the tokens generated so far and max_tokens (Col)."""

    vocab: Sequence[int]
    speculated: Sequence[int]
    generated: Sequence[int]
    max_tokens: Sequence[int]


def call_rows(guests: Sequence[GuestInstance], name: str, choice_at: Sequence[int], choices: Sequence[int],
              deadlines: Sequence[float], bound: float,
              pendings: Sequence[Callable[[], BaseException | None]],
              judge: Judge | None = None) -> tuple[list, list[int]]:
    """guest_rows.call_slots of rows made for this call (the engine loop keeps its rows in a table):
    guest i's choices[i] (NONE: none) stored at choice_at[i] (0: none), its call before deadlines[i]
    and within `bound` of its start. For each: the i32 it returned or the exception GuestInstance.call
    would have raised; and the native judgement of each returned token (with `judge`; else 0s)."""
    n = len(guests)
    table = np.zeros((n, guest_rows.WIDTH), np.int64)
    table[:, Col.CONTEXT:Col.WHEN_AT + 1] = guest_rows.heads(guests, name, choice_at)
    table[:, Col.CHOICE] = choices
    table.view(np.float64)[:, Col.DEADLINE] = deadlines
    table[:, [Col.SPECULATED, Col.NEXT_TOKEN]] = NONE
    if judge is not None:
        judged = (Col.VOCAB, Col.SPECULATED, Col.GENERATED, Col.MAX_TOKENS)
        for col, values in zip(judged, judge, strict=True):
            table[:, col] = values
    failed = guest_rows.call_slots(table, np.arange(n, dtype=np.int64), guests, name, bound,
                                   lambda k: pendings[k]())
    answers = table[:, Col.RESULT].tolist()
    for k, e in failed.items():
        answers[k] = e
    return answers, table[:, Col.JUDGED].tolist()


def guest(body: str, result: str = "i32") -> GuestInstance:
    """A guest whose on_token runs `body` (memory: 1 page; the host's choice is stored at 64)."""
    wat = f"""(module (memory (export "memory") 1)
      (func (export "on_token") (result {result}) {body}))"""
    return GuestInstance(GuestModule(default_runtime(), wat.encode()), "floe", [], memory_cap=16 * MIB)


def on_a_guest_thread(fn):
    """fn() on a thread as the engine loop's (not the main thread, a guest-sized stack)."""
    out: list = []
    thread = threading.Thread(target=lambda: out.append(fn()))
    start_guest_thread(thread)
    thread.join()
    return out[0]


def choice_address(g: GuestInstance) -> int:
    return g.region.numpy(64, 1, np.int32).ctypes.data


def test_each_row_gets_its_own_choice_and_answer():
    echo = [guest("(i32.add (i32.load (i32.const 64)) (i32.const 1))") for _ in range(5)]
    if not on_a_guest_thread(lambda: guest_rows.usable(echo)):
        pytest.skip("no native loop here (no C++ compiler, or epochs not ticking natively)")
    answers = on_a_guest_thread(lambda: call_rows(
        echo, "on_token", [choice_address(g) for g in echo], [10, 20, 30, 40, -5], [math.inf] * 5,
        1.0, [lambda: None] * 5))[0]
    assert answers == [11, 21, 31, 41, -4]
    assert [int(g.region.numpy(64, 1, np.int32)[0]) for g in echo] == [10, 20, 30, 40, -5]


@pytest.mark.parametrize("bad, error, message", [
    ("(unreachable)", GuestTrap, "trapped"),
    ("(loop $f (br $f)) (i32.const 0)", GuestDeadlineExceeded, "deadline"),
    ("(i64.const 7)", GuestLoadError, "i64"),
], ids=["trap", "runaway", "not-an-i32"])
def test_a_failing_row_fails_alone_and_the_rows_after_it_are_called(bad, error, message):
    good = "(i32.const 5)"
    guests = [guest(good), guest(bad, "i64" if "i64" in bad else "i32"), guest(good), guest(good)]
    if not on_a_guest_thread(lambda: guest_rows.usable(guests)):
        pytest.skip("no native loop here")
    answers = on_a_guest_thread(lambda: call_rows(
        guests, "on_token", [0] * 4, [0] * 4, [math.inf] * 4, 0.3, [lambda: None] * 4))[0]
    assert answers[0] == 5 and answers[2:] == [5, 5]
    assert isinstance(answers[1], error) and message in str(answers[1]), answers[1]
    # and the row-by-row call says the same of the same guest
    alone = on_a_guest_thread(lambda: _raised(lambda: guests[1].call("on_token", deadline_s=0.3,
                                                                     pending=lambda: None, hold_gil=True)))
    assert type(alone) is type(answers[1]) and str(alone) == str(answers[1])


def test_the_native_loop_judges_each_token_as_the_engine_loop_would():
    """PLAIN: a token in the vocabulary, not the turn's last, with no row in flight or one of this
    very token (CONFIRMED); TAKES: the host's choice. Anything else (stop, out of the vocabulary, the
    last token, a refused row in flight, a failed call) is left to the engine loop's Python path."""
    returns = [7, 7, -1, 100, 7, 7, 8, 7]
    guests = [guest(f"(i32.const {t})") if t >= 0 else guest("(i32.const -1)") for t in returns]
    guests[7] = guest("(unreachable)")
    if not on_a_guest_thread(lambda: guest_rows.usable(guests)):
        pytest.skip("no native loop here")
    none = guest_rows.NONE
    choices = [7, 3, 7, 7, 7, none, 8, 7]
    judge = Judge(vocab=[100] * 8, speculated=[none, none, none, none, none, 7, 7, none],
                             generated=[0, 0, 0, 0, 9, 0, 0, 0], max_tokens=[10] * 8)
    answers, judged = on_a_guest_thread(lambda: call_rows(
        guests, "on_token", [0] * 8, choices, [math.inf] * 8, 1.0, [lambda: None] * 8, judge))
    assert answers[:7] == returns[:7] and isinstance(answers[7], GuestTrap)
    P, T, C = guest_rows.PLAIN, guest_rows.TAKES, guest_rows.CONFIRMED
    assert judged == [P | T,  # the host's choice, appended next
                      P,  # the guest's own token
                      0,  # stop
                      0,  # outside the vocabulary
                      T,  # the turn's last token (max_tokens): not appended
                      P | C,  # the row in flight had it
                      T,  # the row in flight had another (refused), the host's choice
                      0]  # the call failed


def _raised(fn):
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 - handed to the test's thread
        return e
    return None


def test_not_usable_on_the_main_thread():
    g = guest("(i32.const 1)")
    assert not guest_rows.usable([g])  # (the main thread takes Ctrl-C through Python's handler)


SPIN = """(local $i i64) (local.set $i (i64.const 0))
    (loop $l (local.set $i (i64.add (local.get $i) (i64.const 1)))
             (br_if $l (i64.lt_u (local.get $i) (i64.load (i32.const 128)))))
    (i32.const 1)"""  # counts to the i64 at 128 (0.6 s of an i32 count overflowed it on a Zen 4: 2.5e9)


def test_each_row_gets_its_whole_bound_from_its_own_start():
    """The bound is armed natively before each row's call (from that row's start), so rows that each
    take under a third of it all finish: armed once for the batch, the fourth row here would have run
    out of it. (Each row has 3x its time to spare: on a loaded machine rows of 0.4 s against a bound
    of 1 s ran out. Eight rows: four of a calibrated 0.6 s once ran in 1.9 s together, the machine
    faster than when it was calibrated, not past the one bound.)"""
    probe = guest(SPIN)
    if not on_a_guest_thread(lambda: guest_rows.usable([probe])):
        pytest.skip("no native loop here")
    probe.region.numpy(128, 1, np.int64)[0] = 1 << 24

    def seconds_of_one() -> float:
        t = time.perf_counter()
        assert call_rows([probe], "on_token", [0], [0], [math.inf], 60.0, [lambda: None])[0] == [1]
        return time.perf_counter() - t

    one = min(on_a_guest_thread(seconds_of_one) for _ in range(3))
    guests = [guest(SPIN) for _ in range(8)]
    for g in guests:  # ~0.6 s a call
        g.region.numpy(128, 1, np.int64)[0] = int((1 << 24) * 0.6 / one)
    t = time.perf_counter()
    answers, _ = on_a_guest_thread(lambda: call_rows(
        guests, "on_token", [0] * 8, [0] * 8, [math.inf] * 8, 2.0, [lambda: None] * 8))
    took = time.perf_counter() - t
    assert answers == [1] * 8, (answers, took)
    assert took > 2.0  # (together they ran past one bound)


def test_rows_not_called_keep_no_judgement_of_an_earlier_call():
    """A row the native loop did not call this time (every guest stopped: the process exiting) says
    nothing: its judgement word is cleared, and its answer is the refusal."""
    from floe.wasm import runtime

    g = guest("(i32.const 5)")
    if not on_a_guest_thread(lambda: guest_rows.usable([g])):
        pytest.skip("no native loop here")
    table = np.zeros((1, guest_rows.WIDTH), np.int64)
    table[0, :5] = guest_rows.heads([g], "on_token", [0])[0]
    table[0, [guest_rows.Col.SPECULATED, guest_rows.Col.NEXT_TOKEN]] = guest_rows.NONE
    table[0, guest_rows.Col.VOCAB], table[0, guest_rows.Col.MAX_TOKENS] = 100, 10
    table.view(np.float64)[0, guest_rows.Col.DEADLINE] = math.inf
    slots = np.zeros(1, np.int64)

    def call() -> dict:
        return guest_rows.call_slots(table, slots, [g], "on_token", 1.0, lambda k: None)

    first = on_a_guest_thread(call)
    assert first == {} and table[0, guest_rows.Col.JUDGED] == guest_rows.PLAIN
    runtime._stopped = "a test stopped every guest"
    try:
        again = on_a_guest_thread(call)
    finally:
        runtime._stopped = None
    assert set(again) == {0} and "a test stopped every guest" in str(again[0])
    assert table[0, guest_rows.Col.JUDGED] == 0


def test_a_plain_token_is_decoded_and_streamed_natively_within_the_budgets_room():
    """A row with a decoded-ids buffer and a TokenStream's buffer: each plain token goes into both,
    charged CALL_OVERHEAD + its reply bytes (a special token: none, and no text) and counted; the token
    that would go past the budget's room is not taken (Python's stream raises the budget's error)."""
    from floe.actor.budget import CALL_OVERHEAD
    from floe.actor.stream import TokenStream

    # Each call returns its counter (2, 3, 4, ...): token 3 has no reply bytes, the others 5 each.
    g = guest("(i32.store (i32.const 0) (i32.add (i32.load (i32.const 0)) (i32.const 1)))"
              "(i32.add (i32.load (i32.const 0)) (i32.const 1))")
    if not on_a_guest_thread(lambda: guest_rows.usable([g])):
        pytest.skip("no native loop here")
    lengths = np.full(16, 5, np.int32)
    lengths[3] = 0
    decoded, stream = np.zeros(16, np.int32), TokenStream()
    stream.reserve(16)
    table = np.zeros((1, guest_rows.WIDTH), np.int64)
    table[0, Col.CONTEXT:Col.WHEN_AT + 1] = guest_rows.heads([g], "on_token", [0])[0]
    table[0, [Col.CHOICE, Col.SPECULATED, Col.NEXT_TOKEN]] = NONE
    table.view(np.float64)[0, Col.DEADLINE] = math.inf
    table[0, [Col.VOCAB, Col.GENERATED, Col.MAX_TOKENS]] = 16, 0, 16
    table[0, Col.DECODED_AT], table[0, Col.REPLY_LEN_AT] = decoded.ctypes.data, lengths.ctypes.data
    table[0, Col.STREAM_IDS_AT], table[0, Col.STREAM_N_AT] = stream.ids.ctypes.data, stream.count.ctypes.data
    table[0, Col.DECODED_CAP], table[0, Col.STREAM_CAP] = len(decoded), len(stream.ids)
    table[0, Col.ROOM] = 3 * CALL_OVERHEAD + 10  # tokens 2 (5 bytes), 3 (none) and 4 (5): not 5
    judged = []
    for _ in range(4):
        on_a_guest_thread(lambda: guest_rows.call_slots(table, np.zeros(1, np.int64), [g], "on_token", 1.0,
                                                        lambda k: None))
        judged.append(int(table[0, Col.JUDGED]) & guest_rows.PLAIN)
    assert judged == [guest_rows.PLAIN] * 3 + [0] and int(table[0, Col.RESULT]) == 5
    assert decoded[:table[0, Col.N_DECODED]].tolist() == stream.items == [2, 3, 4]
    assert table[0, Col.STREAMED] == 3 * CALL_OVERHEAD + 10 and table[0, Col.GENERATED] == 3
    assert (table[0, Col.EMIT_CALLS], table[0, Col.EMITS]) == (3, 2)
    first, last = table.view(np.float64)[0, [Col.FIRST_TEXT, Col.LAST_TEXT]]
    assert 0 < first <= last <= time.perf_counter()
    # Room in the budget, none in a buffer: not taken either (Python's path grows it), nothing written.
    table[0, Col.ROOM] = 1 << 30
    for cap in (Col.DECODED_CAP, Col.STREAM_CAP):
        full, table[0, cap] = int(table[0, cap]), 3
        on_a_guest_thread(lambda: guest_rows.call_slots(table, np.zeros(1, np.int64), [g], "on_token", 1.0,
                                                        lambda k: None))
        assert int(table[0, Col.JUDGED]) & guest_rows.PLAIN == 0 and stream.items == [2, 3, 4]
        table[0, cap] = full


def test_a_call_goes_unchecked_once_wasmtime_has_checked_its_type():
    """An export's first call goes through Wasmtime's type check; once it returned an i32 the type is
    known and later calls skip the check (raw values), in Python and in the native loop alike, with the
    same answers. One that returned something else is checked (and refused) at every call."""
    from floe.wasm.raw import RAW_RESULTS

    echo = guest("(i32.add (i32.load (i32.const 64)) (i32.const 1))")
    call = echo.prepared("on_token", 0)
    assert not call.raw and not call.row[2] & RAW_RESULTS
    answers = []
    for choice in (41, -7, 2**31 - 1):
        echo.region.numpy(64, 1, np.int32)[0] = choice
        answers.append(on_a_guest_thread(lambda: echo.call("on_token", deadline_s=1.0, pending=lambda: None,
                                                           hold_gil=True)))
        assert call.raw and call.row[2] & RAW_RESULTS
    assert answers == [42, -6, -(2**31)]  # (an i32's wrap, as before)

    wide = guest("(i64.const 7)", "i64")
    for _ in range(2):
        e = on_a_guest_thread(lambda: _raised(lambda: wide.call("on_token", deadline_s=1.0,
                                                                pending=lambda: None)))
        assert isinstance(e, GuestLoadError) and "i64" in str(e)
        assert not wide.prepared("on_token", 0).raw

    fresh = [guest("(i32.add (i32.load (i32.const 64)) (i32.const 1))") for _ in range(2)]
    if not on_a_guest_thread(lambda: guest_rows.usable(fresh)):
        pytest.skip("no native loop here")
    table = np.zeros((2, guest_rows.WIDTH), np.int64)
    table[:, Col.CONTEXT:Col.WHEN_AT + 1] = guest_rows.heads(fresh, "on_token",
                                                             [choice_address(g) for g in fresh])
    table.view(np.float64)[:, Col.DEADLINE] = math.inf
    table[:, [Col.SPECULATED, Col.NEXT_TOKEN]] = NONE
    slots = np.arange(2, dtype=np.int64)
    for choices in ([10, 20], [30, -40]):
        table[:, Col.CHOICE] = choices
        failed = on_a_guest_thread(lambda: guest_rows.call_slots(table, slots, fresh, "on_token", 1.0,
                                                                 lambda k: None))
        assert failed == {} and table[:, Col.RESULT].tolist() == [c + 1 for c in choices]
        assert (table[:, Col.RESULTS] & RAW_RESULTS).all()  # (learned at the first call)
