"""Host imports answered natively (floe.actor.native_imports): the same answers, errors, budget and ledger
as their Python methods, which answer everything but the plain case; staged only off the main thread."""

import threading

import numpy as np
import pytest
import wasmtime
from guests_wat import import_decls
from models import tiny_engine

from floe.actor import Actor, native_imports
from floe.actor.abi import HostABI
from floe.wasm import GuestBudgetExceeded, GuestDeadlineExceeded, GuestPointerError

pytestmark = pytest.mark.skipif(native_imports.library() is None, reason="no C++ compiler")

OUT = 8192  # where the guests below keep what they saw (an i32 a call)


@pytest.fixture(scope="module")
def engine():
    return tiny_engine(n_slots=4)


@pytest.fixture
def both_ways():
    """Run fn() with the native imports staged and with every import in Python: both results."""
    def run(fn):
        out = {}
        for on in (True, False):
            native_imports.enabled = on
            try:
                out[on] = in_thread(fn)
            finally:
                native_imports.enabled = True
        return out[True], out[False]
    return run


def in_thread(fn):
    """fn() off the main thread (where calls are staged), its result or what it raised."""
    box = {}

    def work():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - compared by the test
            box["value"] = e
    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    return box["value"]


def v1(body: str, pages: int = 2) -> bytes:
    """An ABI v1 guest calling any import in on_message (`body`: returns its i32 status)."""
    return wasmtime.wat2wasm(f"""(module
      {import_decls(skip=())}
      (memory (export "memory") {pages})
      (func (export "floe_abi_version") (result i32) (i32.const 1))
      (func (export "alloc") (param i32) (result i32) (i32.const 1024))
      (func (export "on_message") (param $ptr i32) (param $len i32) (result i32) {body}))""")


def outcome(engine, guest: bytes, words: int = 8):
    """The message's error (its type and text) or the words the guest kept at OUT."""
    def fn():
        with Actor(engine, guest) as actor:
            try:
                actor.send("hi", max_tokens=2)
            except Exception as e:  # noqa: BLE001
                return type(e).__name__, str(e)
            return actor.context.region.numpy(OUT, words, np.int32).tolist()
    return fn


def test_a_chat_turn_is_the_same_and_costs_the_same_with_its_imports_answered_natively(engine, both_ways,
                                                                                      monkeypatch):
    asked = []
    for name in native_imports.NATIVE:  # the Python twins, counted
        method = getattr(HostABI, name)
        monkeypatch.setattr(HostABI, name,
                            lambda self, *a, _m=method, _n=name: asked.append(_n) or _m(self, *a))

    tok = engine.tokenizer

    def turn():
        asked.clear()
        with Actor(engine, seed=3, system_prompt="Be brief.") as actor:
            # the first message with the prompt hint floe serve's front sends (its render and ids made
            # ahead: chat_render and tokenize answered from it), the second without one
            hint = tok.hint([{"role": "system", "content": "Be brief."},
                             {"role": "user", "content": "Hello"}])
            with tok.hinted(hint):
                first = actor.send("Hello", max_tokens=6)
            ledgers = [{b.name: (b.calls, b.copies, b.bytes_copied, b.bytes_shared)
                        for b in actor.ledger.boundaries.values()}]
            first_asked = sorted(set(asked))
            second = actor.send("And then?", max_tokens=6)
            ledgers.append({b.name: (b.calls, b.copies, b.bytes_copied, b.bytes_shared)
                            for b in actor.ledger.boundaries.values()})
            return first.text, second.text, second.stats.generated_tokens, ledgers, hint.used, first_asked

    native, python = both_ways(turn)
    assert native[:5] == python[:5] and native[4] == 2  # (the hint answered a render and an encode)
    assert native[5] == [] and python[5] == sorted(native_imports.NATIVE)


def test_each_native_import_answers_its_bad_arguments_as_python_does(engine, both_ways):
    def store(call: str) -> str:
        return f"(i32.store (i32.const {OUT}) {call})"
    cases = [
        store("(call $request (i32.const 4096))"),
        store("(call $request (i32.const 4100))"),  # misaligned
        store("(call $request (i32.const 131068))"),  # past the memory's end
        store("(call $system (i32.const 4096) (i32.const -1))"),
        store("(call $system (i32.const 131070) (i32.const 64))"),
        store("(call $eos_ids (i32.const 4096) (i32.const 0))"),
        store("(call $eos_ids (i32.const 4098) (i32.const 4))"),
        store("(call $eos_ids (i32.const 4096) (i32.const -5))"),
        store("(call $choice_at (i32.const 4096))"),  # ABI v1: not an option it has
        # detokenize: ids 1, 2, 3 at 4096; out at 5000
        "(i32.store (i32.const 4096) (i32.const 1)) (i32.store (i32.const 4100) (i32.const 200))"
        "(i32.store (i32.const 4104) (i32.const 3))"
        + store("(call $detokenize (i32.const 4096) (i32.const 3) (i32.const 5000) (i32.const 64))")
        + f"(i32.store (i32.const {OUT + 4}) (i32.load (i32.const 5000)))"
        + f"(i32.store (i32.const {OUT + 8}) "
        "(call $detokenize (i32.const 4096) (i32.const 3) (i32.const 5000) (i32.const 1)))",
        "(i32.store (i32.const 4096) (i32.const 99999))"
        + store("(call $detokenize (i32.const 4096) (i32.const 1) (i32.const 5000) (i32.const 64))"),
        "(i32.store (i32.const 4096) (i32.const -1))"
        + store("(call $detokenize (i32.const 4096) (i32.const 1) (i32.const 5000) (i32.const 64))"),
        store("(call $detokenize (i32.const 4098) (i32.const 1) (i32.const 5000) (i32.const 64))"),
        store("(call $detokenize (i32.const 131000) (i32.const 100) (i32.const 5000) (i32.const 64))"),
        store("(call $detokenize (i32.const 4096) (i32.const 1) (i32.const 131070) (i32.const 64))"),
        store("(call $detokenize (i32.const 4096) (i32.const 70000) (i32.const 5000) (i32.const 64))"),
    ]
    for body in cases:
        native, python = both_ways(outcome(engine, v1(body + " (i32.const 0)")))
        assert native == python, body
    bad = both_ways(outcome(engine, v1(store("(call $request (i32.const 4100))") + " (i32.const 0)")))[0]
    assert bad[0] == GuestPointerError.__name__ and "8-byte aligned" in bad[1]


def test_the_budget_runs_out_at_the_same_call_natively(engine, both_ways):
    # small calls, again and again, so that each call's overhead counts: a detokenize of one id (token 1,
    # its bytes into 8 bytes of room), then an eos_ids; the guest counts its rounds at OUT until the
    # budget (4x the memory cap) ends the message
    guest = v1(f"""
      (i32.store (i32.const 4096) (i32.const 1))
      (loop $again
        (i32.store (i32.const {OUT}) (i32.add (i32.load (i32.const {OUT})) (i32.const 1)))
        (drop (call $detokenize (i32.const 4096) (i32.const 1) (i32.const 5000) (i32.const 8)))
        (drop (call $eos_ids (i32.const 6000) (i32.const 4)))
        (br $again))
      (i32.const 0)""")

    def fn():
        with Actor(engine, guest, memory_cap=1 << 20) as actor:
            try:
                actor.send("hi", max_tokens=2)
            except GuestBudgetExceeded as e:
                return str(e), int(actor.context.region.numpy(OUT, 1, np.int32)[0])
    native, python = both_ways(fn)
    assert native == python and native[1] > 1000


def test_a_guest_asking_native_imports_without_end_meets_its_deadline(engine):
    guest = v1("(loop $again (drop (call $request (i32.const 4096))) (br $again)) (i32.const 0)")

    def fn():
        with Actor(engine, guest, deadline_s=0.3) as actor:
            actor.send("hi", max_tokens=2)
    assert isinstance(in_thread(fn), GuestDeadlineExceeded)


def test_the_native_detokenize_table_is_the_tokenizers_bytes(engine):
    tok = engine.tokenizer
    table = native_imports._token_table(tok, engine.config.vocab_size)
    rng = np.random.default_rng(0)
    for ids in [list(range(300)), rng.integers(0, engine.config.vocab_size, 500).tolist(),
                sorted(tok.special_ids)]:
        got = b"".join(bytes(table.data[(table.ends[i - 1] if i else 0):table.ends[i]]) for i in ids)
        assert got == tok.ids_bytes(ids)


def test_on_the_main_thread_every_import_is_answered_in_python(engine, monkeypatch):
    asked = []
    method = HostABI.eos_ids
    monkeypatch.setattr(HostABI, "eos_ids", lambda self, *a: asked.append(1) or method(self, *a))
    with Actor(engine) as actor:
        actor.send("Hi", max_tokens=2)
    assert asked == [1]


def v2(body: str) -> bytes:
    """An ABI v2 guest: on_message runs `body` (its i32 status); each on_token takes the host's sample."""
    return wasmtime.wat2wasm(f"""(module
      {import_decls(skip=())}
      (memory (export "memory") 2)
      (func (export "floe_abi_version") (result i32) (i32.const 2))
      (func (export "alloc") (param i32) (result i32) (i32.const 1024))
      (func (export "on_message") (param $ptr i32) (param $len i32) (result i32) {body})
      (func (export "on_token") (result i32) (call $sample (i32.const 0)))
      (func (export "on_end") (param i32) (result i32) (i32.const 0)))""")


def turn_outcome(engine, guest: bytes):
    """The v2 message's error, or the words the guest kept at OUT and the turn's tokens."""
    def fn():
        with Actor(engine, guest) as actor:
            try:
                reply = actor.send("hi", max_tokens=3)
            except Exception as e:  # noqa: BLE001
                return type(e).__name__, str(e)
            return actor.context.region.numpy(OUT, 4, np.int32).tolist(), reply.stats.token_ids
    return fn


def test_a_turns_prompt_queued_natively_runs_as_one_queued_in_python(engine, both_ways):
    ids = "(i32.store (i32.const 4096) (i32.const 17)) (i32.store (i32.const 4100) (i32.const 300))"

    def at(k: int, call: str) -> str:
        return f"(i32.store (i32.const {OUT + 4 * k}) {call})"
    prefill = "(call $prefill (i32.const 4096) (i32.const 2) (i32.const 0))"
    cases = [
        ids + at(0, "(call $kv_truncate (i32.const 0))") + at(1, prefill) + "(i32.const 0)",
        ids + at(0, prefill) + at(1, "(call $kv_truncate (i32.const 0))") + "(i32.const 0)",  # queued: -3
        ids + at(0, "(call $kv_truncate (i32.const 5))") + at(1, "(call $kv_truncate (i32.const -1))")
        + at(2, prefill) + "(i32.const 0)",
        ids + at(0, prefill) + at(1, "(call $prefill (i32.const 4100) (i32.const 1) (i32.const 0))")
        + "(i32.const 0)",  # a second prefill: queued after the first
        "(i32.store (i32.const 4096) (i32.const 99999))" + at(0, prefill) + at(1, "(call $prefill "
        "(i32.const 4096) (i32.const 0) (i32.const 0))") + at(2, "(call $prefill (i32.const 4096) "
        "(i32.const -1) (i32.const 0))") + ids + at(3, prefill) + "(i32.const 0)",
        ids + at(0, "(call $prefill (i32.const 4098) (i32.const 2) (i32.const 0))") + "(i32.const 0)",
        ids + at(0, "(call $prefill (i32.const 4096) (i32.const 2) (i32.const 131000))") + "(i32.const 0)",
        ids + at(0, "(call $prefill (i32.const 4096) (i32.const 2) (i32.const 65536))") + "(i32.const 0)",
        ids + at(0, "(call $prefill (i32.const 4096) (i32.const 600) (i32.const 0))") + "(i32.const 0)",
        ids + at(0, "(call $choice_at (i32.const 66))") + "(i32.const 0)",
        ids + at(0, "(call $stream_tokens (i32.const 2))") + at(1, prefill) + "(i32.const 0)",
    ]
    for body in cases:
        native, python = both_ways(turn_outcome(engine, v2(body)))
        assert native == python, body
    queued_twice = both_ways(turn_outcome(engine, v2(cases[3])))[0]
    assert queued_twice[0][:2] == [0, 0] and len(queued_twice[1]) == 3


def test_a_hint_of_another_conversation_is_not_used_natively_either(engine, both_ways):
    tok = engine.tokenizer

    def fn():
        hint = tok.hint([{"role": "user", "content": "Hi"}])
        with Actor(engine) as actor, tok.hinted(hint):
            reply = actor.send("Hello", max_tokens=4)
            return reply.stats.token_ids, hint.used
    native, python = both_ways(fn)
    assert native == python and native[1] == 0


def test_a_kv_truncate_answered_natively_truncates_the_slot(engine, both_ways):
    # message 1 queues 3 ids; message 2 keeps only the first of the KV cache's tokens and queues one:
    # its reply is the model's continuation of [17, 500], not of everything the first turn left
    guest = v2("""
      (i32.store (i32.const 4096) (i32.const 17)) (i32.store (i32.const 4100) (i32.const 300))
      (i32.store (i32.const 4104) (i32.const 400)) (i32.store (i32.const 4108) (i32.const 500))
      (if (result i32) (i32.load (i32.const 8000))
        (then (drop (call $kv_truncate (i32.const 1)))
              (call $prefill (i32.const 4108) (i32.const 1) (i32.const 0)))
        (else (i32.store (i32.const 8000) (i32.const 1))
              (call $prefill (i32.const 4096) (i32.const 3) (i32.const 0))))""")

    def fn():
        with Actor(engine, guest) as actor:
            first = actor.send("a", max_tokens=6).stats.token_ids
            return first, actor.send("b", max_tokens=6).stats.token_ids, engine.kv_len(actor.slot)

    alone = v2("(i32.store (i32.const 4096) (i32.const 17)) (i32.store (i32.const 4100) (i32.const 500))"
               "(call $prefill (i32.const 4096) (i32.const 2) (i32.const 0))")

    def fresh():
        with Actor(engine, alone) as actor:
            return actor.send("c", max_tokens=6).stats.token_ids
    native, python = both_ways(fn)
    assert native == python and native[1] == in_thread(fresh)


def test_a_served_chat_with_its_fronts_hint_asks_no_python_import(engine, both_ways, monkeypatch, tmp_path):
    from floe.model.tokenizer import Hint
    from floe.server import hints
    from floe.server.core import ServeCore

    asked = []
    for name in native_imports.NATIVE:
        method = getattr(HostABI, name)
        monkeypatch.setattr(HostABI, name,
                            lambda self, *a, _m=method, _n=name: asked.append(_n) or _m(self, *a))
    core = ServeCore(engine, snapshots=tmp_path, model_id="tiny")
    tok = engine.tokenizer
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    truth, other = tok.hint(messages), tok.hint([{"role": "user", "content": "Name a colour, any colour."}])
    forged = hints.wire(Hint(messages, truth.rendered, other.ids))  # this text, another prompt's ids
    try:
        def chat(hint):
            def fn():
                asked.clear()
                out = core.run(core.open({"messages": messages, "max_tokens": 3, "temperature": 0.0,
                                          "owner": "", "hint": hint}))
                return out["text"], out["usage"]["prompt_tokens"], sorted(set(asked))
            return fn
        native, python = both_ways(chat(hints.wire(truth)))
        assert native[:2] == python[:2] and native[1] == len(truth.ids)
        assert native[2] == [] and python[2] == sorted(native_imports.NATIVE)
        native, python = both_ways(chat(forged))  # (the guest takes the hint's ids, either way)
        assert native[:2] == python[:2] and native[1] == len(other.ids)
    finally:
        core.close()
