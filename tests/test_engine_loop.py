"""ABI v2: one engine loop steps every actor's turn; guests choose each token in place. Failures stay
inside the turn that caused them, and concurrent actors answer exactly as each would alone (greedy)."""

import threading
import time

import pytest
import torch
from guests_wat import v2_chooser, v2_guest

from floe.actor import Actor, EngineLoop
from floe.actor import loop as engine_loop
from floe.engine import SamplingParams
from floe.wasm import (
    GuestDeadlineExceeded,
    GuestError,
    GuestPointerError,
    GuestReportedError,
    GuestResultError,
    GuestTrap,
)

PROMPTS = ["Hello there.", "Name a colour.", "What is two plus two?", "Tell me about owls.",
           "Write a haiku.", "Say something kind."]
GREEDY = SamplingParams(0.0)


def alone(engine, prompt: str, max_tokens: int) -> list[int]:
    with Actor(engine) as actor:
        return actor.send(prompt, max_tokens=max_tokens, params=GREEDY).stats.token_ids


def concurrently(engine, loop, jobs: list[tuple[object, str, int]], take=lambda actor, reply: reply,
                 params: SamplingParams = GREEDY) -> list:
    """Each (guest, prompt, max_tokens) as its own actor (seeded by its place) in its own thread,
    started together; for each, take(actor, its Reply) or the exception it raised."""
    out: list = [None] * len(jobs)
    start = threading.Barrier(len(jobs))

    def work(i, guest, prompt, max_tokens):
        with Actor(engine, guest, loop=loop, seed=i) as actor:
            start.wait()
            try:
                out[i] = take(actor, actor.send(prompt, max_tokens=max_tokens, params=params))
            except Exception as e:  # noqa: BLE001 - the test looks at it
                out[i] = e

    threads = [threading.Thread(target=work, args=(i, *job)) for i, job in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_concurrent_actors_share_steps_and_answer_exactly_as_alone(tiny_engine):
    expected = [alone(tiny_engine, p, 24) for p in PROMPTS]
    loop = EngineLoop(tiny_engine)
    replies = concurrently(tiny_engine, loop, [(None, p, 24) for p in PROMPTS])
    assert [r.stats.token_ids for r in replies] == expected
    assert all(r.stats.finish_reason in ("stop", "length") for r in replies)
    # Together, not in turns: far fewer decode steps than rows, and no turn waited for another to end.
    # (a turn's last token is appended only if the turn goes on: not at max_tokens)
    appended = [len(r.stats.token_ids) - (r.stats.finish_reason == "length") for r in replies]
    assert loop.rows == sum(appended) and loop.steps <= max(appended) + len(PROMPTS)  # joins may lag


def test_turns_ending_one_by_one_leave_the_others_answering_as_alone(tiny_engine):
    """Turns of staggered lengths end at different steps (each end makes the loop's roster of live
    turns again: floe.actor.turn.Roster); the turns left go on as each alone, and every step's rows are
    exactly the live turns' (none asked or run after its end)."""
    lengths = [3, 6, 9, 13, 18, 24]
    expected = [alone(tiny_engine, p, n) for p, n in zip(PROMPTS, lengths, strict=True)]
    loop = EngineLoop(tiny_engine)
    replies = concurrently(tiny_engine, loop, [(None, p, n) for p, n in zip(PROMPTS, lengths, strict=True)])
    assert [r.stats.token_ids for r in replies] == expected
    appended = [len(r.stats.token_ids) - (r.stats.finish_reason == "length") for r in replies]
    assert loop.rows == sum(appended)


def test_a_turn_tells_its_table_when_it_ends_and_when_it_is_done(tiny_engine):
    """Turn.end set and Turn.set_done move the table's changes (what the loop's roster is keyed by);
    before it is bound a turn tells no table."""
    from floe.actor.turn import END_STOP, Turn, TurnTable

    with Actor(tiny_engine) as actor:
        turn = Turn(actor, max_tokens=2, deadline=time.monotonic() + 60)
        turn.end = None  # (its own row yet: nothing to tell)
        table = TurnTable(tiny_engine.cache.n_slots)
        turn.bind(table)
        assert table.changes == 0
        turn.end = END_STOP
        assert table.changes == 1 and turn.end == END_STOP
        turn.set_done()
        assert table.changes == 2 and turn.over


@pytest.mark.parametrize("arrivals", [1, 2, 4])
def test_arrivals_let_in_together_answer_exactly_as_alone(tiny_engine, monkeypatch, arrivals):
    """Arriving turns' on_message ARRIVALS at once (floe.actor.loop.ARRIVALS, by the machine's cores):
    each concurrent actor's reply is still its reply alone, and no arrival turn is left held."""
    monkeypatch.setattr(engine_loop, "ARRIVALS", arrivals)
    expected = [alone(tiny_engine, p, 12) for p in PROMPTS]
    loop = EngineLoop(tiny_engine)
    replies = concurrently(tiny_engine, loop, [(None, p, 12) for p in PROMPTS])
    assert [r.stats.token_ids for r in replies] == expected
    assert loop.arriving_now == 0


@pytest.mark.parametrize("bad, error", [("(unreachable)", GuestTrap),
                                        ("(loop $f (br $f))", GuestDeadlineExceeded)])
def test_a_guest_failing_in_on_token_fails_only_its_own_turn(tiny_engine, bad, error):
    expected = [alone(tiny_engine, p, 16) for p in PROMPTS[:3]]
    loop = EngineLoop(tiny_engine, token_call_s=1.0)
    jobs = [(None, p, 16) for p in PROMPTS[:3]] + [(v2_guest(bad), "x", 16)]
    *replies, failed = concurrently(tiny_engine, loop, jobs)
    assert isinstance(failed, error), failed
    assert [r.stats.token_ids for r in replies] == expected


def test_once_warm_a_slow_on_token_holds_the_loop_for_the_step_bound_not_the_cold_one(tiny_engine):
    """A guest that spends almost the whole per-call bound in each on_token held every other session
    that long per token (13.6 s for a 0.15 s reply at 5 s). Once the loop has seen an on_token through
    (the first sample's kernels loaded), a call has STEP_CALL_S, not TOKEN_CALL_S."""
    from floe.actor.loop import STEP_CALL_S, TOKEN_CALL_S

    assert STEP_CALL_S <= TOKEN_CALL_S / 10
    expected = [alone(tiny_engine, p, 8) for p in PROMPTS[:2]]
    loop = EngineLoop(tiny_engine, token_call_s=30.0, step_call_s=0.3)
    assert not loop.warm
    concurrently(tiny_engine, loop, [(None, PROMPTS[0], 2)])  # warms it
    assert loop.warm
    *replies, failed = concurrently(tiny_engine, loop, [(None, p, 8) for p in PROMPTS[:2]]
                                    + [(v2_guest("(loop $f (br $f))"), "x", 8)])
    assert isinstance(failed, GuestDeadlineExceeded) and "on_token ran past 0.3 s" in str(failed), failed
    assert [r.stats.token_ids for r in replies] == expected


def test_a_turn_joins_and_leaves_while_another_runs(tiny_engine):
    long_expected, short_expected = alone(tiny_engine, PROMPTS[0], 120), alone(tiny_engine, PROMPTS[1], 4)
    loop = EngineLoop(tiny_engine)
    first_text = threading.Event()
    result = {}

    def long_turn():
        with Actor(tiny_engine, loop=loop) as actor:
            result["long"] = actor.send(PROMPTS[0], max_tokens=120, params=GREEDY,
                                        on_text=lambda text: first_text.set())

    thread = threading.Thread(target=long_turn)
    thread.start()
    first_text.wait(60)
    with Actor(tiny_engine, loop=loop) as actor:  # joins mid-turn, leaves before the long one ends
        short = actor.send(PROMPTS[1], max_tokens=4, params=GREEDY)
    short_done_while_long_ran = thread.is_alive()
    thread.join()
    assert short.stats.token_ids == short_expected and result["long"].stats.token_ids == long_expected
    assert short_done_while_long_ran or len(long_expected) < 120


def test_a_client_that_leaves_stops_its_row_and_the_actor_goes_on(tiny_engine):
    loop = EngineLoop(tiny_engine)
    with Actor(tiny_engine, loop=loop) as actor:
        pieces = []
        for piece in actor.stream(PROMPTS[3], max_tokens=200, params=GREEDY):
            pieces.append(piece)
            if len(pieces) == 2:
                break
        assert loop.stats()["active"] == 0  # the row left at the next step
        # (how many tokens ran before the loop saw the client leave depends on how busy the CPU is)
        assert actor.stats.finish_reason == "cancelled" and actor.stats.generated_tokens < 200
        assert actor.send(PROMPTS[4], max_tokens=3, params=GREEDY).stats.generated_tokens == 3


def test_the_host_counts_max_tokens_whatever_the_guest_does(tiny_engine):
    never_stops = v2_guest(after=1 << 30)  # on_token never returns stop by itself
    with Actor(tiny_engine, never_stops) as actor:
        reply = actor.send("x", max_tokens=7)
    assert reply.stats.finish_reason == "length" and reply.stats.generated_tokens == 7



# A v2 guest that takes the host's sample except on every third token, where it takes the next id:
# a speculated row (the forward's greedy choice launched before the guest chose) it must undo.
REFUSES = v2_guest("(if (i32.eqz (i32.rem_u (global.get $n) (i32.const 3))) (then (return (i32.rem_u "
                   "(i32.add (call $sample (i32.const 0)) (i32.const 1)) (i32.const 1000)))))", after=1)
STOPS = v2_guest("(return (i32.const -1))", after=6)  # stops at its sixth token, speculated or not


def contexts(engine, loop, jobs, params: SamplingParams = GREEDY):
    """concurrently(): each actor's tokens, end, and KV cache tokens once its turn ended."""
    return concurrently(engine, loop, jobs, lambda actor, reply: (
        reply.stats.token_ids, reply.stats.finish_reason, list(engine.cache.tokens[actor.slot])), params)


@pytest.mark.parametrize("feed", [False, True], ids=["speculated", "fed"])
def test_overlapped_steps_answer_and_cache_exactly_as_plain_steps(tiny_engine, feed):
    """With overlap (speculated greedy rows; forced on here, where the CPU's step is not async) the
    tokens, the ends and every KV cache are those of plain steps, for guests that always take the
    greedy choice, refuse it now and then, or stop while a speculated row is in flight. Fed: the next
    forward is launched before the one in flight is finished whenever every turn in it takes the
    host's choice (two forwards in flight)."""
    jobs = [(None, PROMPTS[0], 24), (REFUSES, "x", 20), (STOPS, "x", 20), (None, PROMPTS[1], 9)]
    plain = EngineLoop(tiny_engine, overlap=False)
    expected = contexts(tiny_engine, plain, jobs)
    overlapped = EngineLoop(tiny_engine, overlap=True, feed=feed)
    assert contexts(tiny_engine, overlapped, jobs) == expected
    assert expected[2][1] == "stop" and len(expected[2][0]) == 5
    assert overlapped.undone > 0 and plain.undone == 0  # the refusals were speculated and undone
    assert overlapped.rows > plain.rows  # ...which cost rows, not answers
    assert (overlapped.fed > 0) == feed


def test_a_fed_row_whose_token_the_engine_did_not_keep_is_undone_and_the_answers_stay(tiny_engine,
                                                                                   monkeypatch):
    """A fed row whose token the engine kept no record of (fed_tokens: None) is refused: undone, its
    guest asked as any; the rows beside it in the same step keep theirs. Every answer and cache as
    plain steps'."""
    jobs = [(None, PROMPTS[0], 16), (None, PROMPTS[1], 12), (None, "x", 12)]  # (none refuses a row)
    expected = contexts(tiny_engine, EngineLoop(tiny_engine, overlap=False), jobs)
    fed_tokens, forgotten = type(tiny_engine).fed_tokens, []

    def forgetful(self, slots):
        tokens = fed_tokens(self, slots)
        if len(slots) > 1 and len(forgotten) < 3:  # the first of a step's rows, three times
            forgotten.append(slots[0])
            tokens[0] = None
        return tokens

    monkeypatch.setattr(type(tiny_engine), "fed_tokens", forgetful)
    fed = EngineLoop(tiny_engine, overlap=True, feed=True)
    assert contexts(tiny_engine, fed, jobs) == expected
    assert len(forgotten) == 3 and fed.undone == 3 and fed.fed > 0


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(1.0, top_p=0.95)], ids=["greedy", "sampled"])
def test_fed_rows_answer_and_cache_exactly_as_plain_steps(tiny_engine, params):
    """Chat guests that take the host's choice, all at once with feeding forced on: after their first
    tokens every forward is launched fed, before the one in flight is finished; tokens, ends, caches
    and generators are plain steps'."""
    jobs = [(None, PROMPTS[0], 24), (None, PROMPTS[1], 17), (None, PROMPTS[2], 30)]

    def run(loop):
        return concurrently(tiny_engine, loop, jobs, lambda actor, reply: (
            reply.stats.token_ids, reply.stats.finish_reason, list(tiny_engine.cache.tokens[actor.slot]),
            actor.generator.get_state().tolist()), params)

    expected = run(EngineLoop(tiny_engine, overlap=False))
    fed = EngineLoop(tiny_engine, overlap=True, feed=True)
    assert run(fed) == expected
    assert fed.fed > 20


@pytest.mark.parametrize("feed", [False, True], ids=["speculated", "fed"])
def test_overlapped_sampled_steps_answer_and_cache_exactly_as_plain_steps(tiny_engine, feed):
    """Sampling with overlap (forced on): the chat guest takes the host's draw, which its step made
    right after the forward, so its next row is speculated with it; a guest calling sample() is
    speculated with the argmax and mostly refused. Tokens, ends and caches are plain steps' either way."""
    sampled = SamplingParams(1.0, top_p=0.95)
    jobs = [(None, PROMPTS[0], 24), (v2_chooser(choice=False, stream=False), "x", 16), (None, PROMPTS[1], 12)]
    expected = contexts(tiny_engine, EngineLoop(tiny_engine, overlap=False), jobs, sampled)
    overlapped = EngineLoop(tiny_engine, overlap=True, feed=feed)
    assert contexts(tiny_engine, overlapped, jobs, sampled) == expected
    assert overlapped.rows > overlapped.undone > 0  # the sample() guest's rows were refused


# Takes the host's choice from its memory, except every third token, where it takes the next id: a
# speculated row (launched with the step's draw) it refuses, and whose draw must be given back.
CHOOSY = v2_chooser(choice=True, stream=True, on_token_first=(
    "(global.set $n (i32.add (global.get $n) (i32.const 1)))"
    "(if (i32.eqz (i32.rem_u (global.get $n) (i32.const 3))) (then (return (i32.rem_u "
    "(i32.add (i32.load (i32.const 64)) (i32.const 1)) (i32.const 1000)))))"), counter=True)


@pytest.mark.parametrize("feed", [False, True], ids=["speculated", "fed"])
def test_a_refused_speculated_draw_is_given_back_to_the_generator(tiny_engine, feed):
    """Overlap (forced on) with a guest that takes the host's draw but refuses it every third token:
    those rows were speculated with the draw and are undone, and their uniforms given back — tokens,
    caches and each actor's generator end as with plain steps."""
    sampled = SamplingParams(1.0)
    jobs = [(CHOOSY, "x", 20), (CHOOSY, "y", 14)]

    def run(loop):
        return concurrently(tiny_engine, loop, jobs, lambda actor, reply: (
            reply.stats.token_ids, list(tiny_engine.cache.tokens[actor.slot]),
            actor.generator.get_state().tolist()), sampled)

    expected = run(EngineLoop(tiny_engine, overlap=False))
    overlapped = EngineLoop(tiny_engine, overlap=True, feed=feed)
    assert run(overlapped) == expected
    assert overlapped.undone > 0


# Takes the host's choice, except its first token, where it takes the next id.
REFUSES_FIRST = v2_chooser(choice=True, stream=True, on_token_first=(
    "(global.set $n (i32.add (global.get $n) (i32.const 1)))"
    "(if (i32.eq (global.get $n) (i32.const 1)) (then (return (i32.rem_u "
    "(i32.add (i32.load (i32.const 64)) (i32.const 1)) (i32.const 1000)))))"), counter=True)


def staggered(engine, loop, jobs, params: SamplingParams, every: int = 6) -> list:
    """Like contexts(), but job i (i > 0) arrives once job 0 has streamed every * i pieces of text, so
    prompts come while others decode; each actor's tokens, end, KV cache tokens and generator."""
    arrive = [threading.Event() for _ in jobs]
    pieces = [0]

    def streamed(_piece):  # (in the loop's thread)
        pieces[0] += 1
        for i in range(1, len(jobs)):
            if pieces[0] >= every * i:
                arrive[i].set()

    out: list = [None] * len(jobs)

    def work(i, guest, prompt, max_tokens):
        with Actor(engine, guest, loop=loop, seed=i) as actor:
            if i:
                assert arrive[i].wait(60)
            reply = actor.send(prompt, max_tokens=max_tokens, params=params,
                               on_text=streamed if i == 0 else None)
            out[i] = (reply.stats.token_ids, reply.stats.finish_reason, list(engine.cache.tokens[actor.slot]),
                      actor.generator.get_state().tolist())

    threads = [threading.Thread(target=work, args=(i, *job)) for i, job in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return out


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_prompts_arriving_while_others_decode_leave_the_rows_beside_them_fed(tiny_engine, sampled):
    """Actors arriving one after another while the first decodes (overlap and feeding forced on): the
    decode rows beside a prompt riding in the forward in flight are still fed (fed_past_prompts), the
    prompt's first token joins a later launch; tokens, ends, caches and generators are plain steps'
    — also for guests refusing the host's first choice, or its draw every third token."""
    params = SamplingParams(1.0) if sampled else GREEDY
    jobs = [(None, PROMPTS[0], 64), (CHOOSY if sampled else None, PROMPTS[1], 40),
            (REFUSES_FIRST, "x", 12), (CHOOSY if sampled else REFUSES, "x", 10), (None, PROMPTS[2], 16),
            (None, PROMPTS[3], 8)]
    expected = staggered(tiny_engine, EngineLoop(tiny_engine, overlap=False), jobs, params)
    assert all(expected)
    fed_past = []
    for _ in range(3):  # (whether an arrival meets a fed step is timing: a few runs make it certain)
        fed = EngineLoop(tiny_engine, overlap=True, feed=True)
        assert staggered(tiny_engine, fed, jobs, params) == expected
        assert fed.stats()["fed_past_prompts"] == fed.fed_past_prompts
        fed_past.append(fed.fed_past_prompts)
        if fed.fed_past_prompts:
            break
    assert max(fed_past) > 0, fed_past


def test_a_greedy_draw_is_from_the_logits_the_guest_left_in_its_memory(tiny_engine):
    """A guest that has the logits written into its memory and masks all but token 5 gets 5 from a
    greedy sample(), although the batched step computed its own (unmasked) greedy choice."""
    import wasmtime

    vocab = tiny_engine.config.vocab_size
    masks = wasmtime.wat2wasm(f"""
(module
  (import "floe" "prefill" (func $prefill (param i32 i32 i32) (result i32)))
  (import "floe" "sample" (func $sample (param i32) (result i32)))
  (memory (export "memory") 8)
  (func (export "floe_abi_version") (result i32) (i32.const 2))
  (func (export "alloc") (param i32) (result i32) (i32.const 1024))
  (func (export "on_message") (param i32 i32) (result i32)
    (i32.store (i32.const 4096) (i32.const 17))
    (call $prefill (i32.const 4096) (i32.const 1) (i32.const 65536)))
  (func (export "on_token") (result i32) (local $i i32)
    (loop $l
      (f32.store (i32.add (i32.const 65536) (i32.shl (local.get $i) (i32.const 2))) (f32.const -inf))
      (local.set $i (i32.add (local.get $i) (i32.const 1)))
      (br_if $l (i32.lt_u (local.get $i) (i32.const {vocab}))))
    (f32.store (i32.const 65556) (f32.const 0))
    (call $sample (i32.const 0))))""")
    for overlap in (False, True):
        out = contexts(tiny_engine, EngineLoop(tiny_engine, overlap=overlap), [(masks, "x", 4)] * 3)
        assert all(tokens == [5, 5, 5, 5] for tokens, _, _ in out), out


def test_a_guest_stuck_in_on_message_does_not_hold_up_others_arriving(tiny_engine):
    """Arrivals take turns (EngineLoop.arriving), but a turn waits at most ARRIVAL_WAIT_S for the one
    before it: an actor whose on_message spins until its deadline does not keep another from
    arriving and finishing first; the spinning one fails with its deadline only."""
    import time

    import wasmtime

    spins = wasmtime.wat2wasm("""
(module
  (memory (export "memory") 2)
  (func (export "floe_abi_version") (result i32) (i32.const 2))
  (func (export "alloc") (param i32) (result i32) (i32.const 1024))
  (func (export "on_message") (param i32 i32) (result i32) (loop $l (br $l)) (i32.const 0))
  (func (export "on_token") (result i32) (i32.const -1)))""")
    loop = EngineLoop(tiny_engine)
    ended: dict[str, float] = {}

    def stuck():
        with Actor(tiny_engine, spins, loop=loop, deadline_s=3.0) as actor:
            with pytest.raises(GuestDeadlineExceeded):
                actor.send("spin", max_tokens=4)
        ended["stuck"] = time.monotonic()

    thread = threading.Thread(target=stuck)
    thread.start()
    while not loop.arriving_now:  # the stuck guest holds the arrival turn
        time.sleep(0.01)
    with Actor(tiny_engine, loop=loop) as actor:
        assert actor.send(PROMPTS[0], max_tokens=3, params=GREEDY).stats.generated_tokens == 3
    ended["other"] = time.monotonic()
    thread.join()
    assert ended["other"] < ended["stuck"]


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(0.9), SamplingParams(1.2, top_k=50),
                                    SamplingParams(0.8, top_p=0.9)], ids=str)
def test_the_hosts_choice_in_memory_and_streamed_tokens_equal_sample_and_emit(tiny_engine, params):
    """choice_at + stream_tokens (no host call a token) answer exactly as sample + detokenize + emit:
    the same tokens (one uniform of the actor's generator a step either way), the same text. Several
    such turns at once take their draws in one batch: greedy ones answer as each alone, and each
    sampled turn took exactly one uniform of its own actor's generator a step."""
    def reply(guest):
        with Actor(tiny_engine, guest, seed=3) as actor:
            r = actor.send("x", max_tokens=20, params=params)
            return r.text, r.stats.token_ids, actor.stats.emit_calls

    text, tokens, _ = reply(v2_chooser(choice=False, stream=False))
    assert reply(v2_chooser(choice=True, stream=True)) == (text, tokens, len(tokens))
    assert reply(v2_chooser(choice=True, stream=False))[:2] == (text, tokens)
    loop = EngineLoop(tiny_engine)
    guests = [v2_chooser(choice=True, stream=True, prompt=17 + i) for i in range(4)]
    out = [None] * 4

    def work(i):
        with Actor(tiny_engine, guests[i], seed=3 + i, loop=loop) as actor:
            r = actor.send("x", max_tokens=20, params=params)
            steps = len(r.stats.token_ids) + (r.stats.finish_reason == "stop")
            expected = torch.Generator().manual_seed(3 + i)
            for _ in range(steps if not params.greedy else 0):
                torch.rand(1, generator=expected, dtype=torch.float64)
            same = torch.equal(actor.generator.get_state(), expected.get_state())
            out[i] = (r.text, r.stats.token_ids, same)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert all(generator_ok for _, _, generator_ok in out)
    assert loop.steps < sum(len(tokens) for _, tokens, _ in out)  # together, in shared steps
    if params.greedy:
        assert [o[:2] for o in out] == [reply(g)[:2] for g in guests]


def test_turn_options_are_for_on_message_and_a_bad_choice_pointer_traps(tiny_engine):
    with Actor(tiny_engine, v2_chooser(choice=True, stream=True, choice_ptr=65_537)) as actor:
        with pytest.raises(GuestPointerError, match="aligned"):
            actor.send("x", max_tokens=4)
    with Actor(tiny_engine, v2_chooser(choice=True, stream=True, choice_ptr=2 * 65_536)) as actor:
        with pytest.raises(GuestPointerError, match="out of bounds|outside|past"):  # past the memory's end
            actor.send("x", max_tokens=4)
    # From on_token they answer -3, which this guest returns as its token: its turn fails, clearly.
    late = v2_chooser(choice=False, stream=False,
                      on_token_first="(return (call $stream_tokens (i32.const 1)))")
    with Actor(tiny_engine, late) as actor:
        with pytest.raises(GuestError, match="on_token returned -3"):
            actor.send("x", max_tokens=4)


def test_a_token_outside_the_vocabulary_fails_only_its_turn(tiny_engine):
    huge = v2_chooser(choice=False, stream=True, on_token_first="(return (i32.const 1000000))")
    expected = [alone(tiny_engine, p, 8) for p in PROMPTS[:2]]
    *replies, failed = concurrently(tiny_engine, EngineLoop(tiny_engine),
                                    [(None, p, 8) for p in PROMPTS[:2]] + [(huge, "x", 8)])
    assert isinstance(failed, GuestError) and "outside the vocabulary" in str(failed), failed
    assert [r.stats.token_ids for r in replies] == expected


def test_streamed_special_tokens_carry_no_text(tiny_engine):
    """A guest that returns a special token (here <|im_start|>, then an ordinary one) through
    stream_tokens: the caller sees the ordinary token's text only; the cache holds both."""
    start = tiny_engine.tokenizer.backend.token_to_id("<|im_start|>")
    word = tiny_engine.tokenizer.encode(" hello", add_bos=False)[0]
    guest = v2_chooser(choice=False, stream=True, counter=True, on_token_first=(
        "(global.set $n (i32.add (global.get $n) (i32.const 1)))"
        f"(if (i32.eq (global.get $n) (i32.const 1)) (then (return (i32.const {start}))))"
        f"(return (i32.const {word}))"))
    with Actor(tiny_engine, guest) as actor:
        reply = actor.send("x", max_tokens=3)
        held = list(tiny_engine.cache.tokens[actor.slot])
    assert reply.text == " hello hello" and start in held[1:]


def test_a_guest_looping_in_on_end_fails_only_its_own_message_within_the_loops_call_bound(tiny_engine):
    """on_end keeps on_token's bound (the loop's step_call_s once warm), not its message's deadline,
    though it runs in the caller's thread once the turn's rows are done. Here the message could run
    10 s; the other turns answer as each alone."""
    loops_at_end = v2_guest(on_end="(loop $l (br $l)) (i32.const 0)")
    expected = [alone(tiny_engine, p, 8) for p in PROMPTS[:2]]
    loop = EngineLoop(tiny_engine, token_call_s=0.5, step_call_s=0.3)  # warm once on_token returned
    with Actor(tiny_engine, loops_at_end, loop=loop, deadline_s=10) as actor:
        with pytest.raises(GuestDeadlineExceeded, match="on_end ran past 0.3 s"):
            actor.send("x", max_tokens=2)
    *replies, failed = concurrently(tiny_engine, loop, [(None, p, 8) for p in PROMPTS[:2]]
                                    + [(loops_at_end, "x", 2)])
    assert isinstance(failed, GuestDeadlineExceeded) and "on_end ran past" in str(failed), failed
    assert [r.stats.token_ids for r in replies] == expected


@pytest.mark.parametrize("on_token, on_end, status, error", [
    ("(i32.const -2)", "(i32.const 0)", 0, GuestResultError),
    ("(i32.const 0x80000000)", "(i32.const 0)", 0, GuestResultError),
    ("(i32.const 1000000)", "(i32.const 0)", 0, GuestResultError),
    ("(i32.const -1)", "(i32.const 7)", 0, GuestReportedError),
    ("(i32.const -1)", "(i32.const 0)", 5, GuestReportedError),
], ids=["negative", "int-min", "past-vocab", "on_end-status", "on_message-status"])
def test_a_guest_whose_results_break_the_abi_fails_only_its_own_message_with_a_specific_error(
        tiny_engine, on_token, on_end, status, error):
    import wasmtime

    wasm = wasmtime.wat2wasm(f"""
(module
  (import "floe" "prefill" (func $prefill (param i32 i32 i32) (result i32)))
  (memory (export "memory") 2)
  (func (export "floe_abi_version") (result i32) (i32.const 2))
  (func (export "alloc") (param i32) (result i32) (i32.const 1024))
  (func (export "on_message") (param i32 i32) (result i32)
    (i32.store (i32.const 4096) (i32.const 17))
    (drop (call $prefill (i32.const 4096) (i32.const 1) (i32.const 0))) (i32.const {status}))
  (func (export "on_token") (result i32) {on_token})
  (func (export "on_end") (param i32) (result i32) {on_end}))""")
    expected = alone(tiny_engine, PROMPTS[0], 6)
    jobs = [(None, PROMPTS[0], 6), (wasm, "x", 4)]
    *replies, failed = concurrently(tiny_engine, EngineLoop(tiny_engine), jobs)
    assert type(failed) is error, failed
    if error is GuestReportedError:
        assert failed.status in (5, 7)
    assert replies[0].stats.token_ids == expected


def test_a_loop_whose_own_failure_handling_fails_still_ends_every_turn_and_goes_on(tiny_engine, monkeypatch):
    """A bug in a step and then in its clean-up (_abort) ends the waiting turn with the step's error
    instead of leaving its caller waiting for ever, and the loop's thread lives on for the next."""
    loop = EngineLoop(tiny_engine)

    def broken_step():
        raise RuntimeError("a bug in the step")

    def broken_abort(error):
        raise RuntimeError("a bug in its clean-up")

    with Actor(tiny_engine, loop=loop) as actor:
        monkeypatch.setattr(loop, "_step", broken_step)
        monkeypatch.setattr(loop, "_abort", broken_abort)
        outcome = {}
        caller = threading.Thread(target=lambda: outcome.update(
            error=pytest.raises(RuntimeError, actor.send, PROMPTS[0], max_tokens=3, params=GREEDY)))
        caller.start()
        caller.join(60)
        assert not caller.is_alive(), "the caller still waits on a turn nothing will end"
        assert "a bug in the step" in str(outcome["error"].value)
        monkeypatch.undo()  # the same loop thread, alive, steps the next message
        assert actor.send(PROMPTS[4], max_tokens=3, params=GREEDY).stats.generated_tokens == 3


def test_a_callers_blocking_on_text_holds_its_own_turn_only(tiny_engine):
    """on_text runs in its caller's thread: one that blocks (here until the other turn has ended) held
    the engine loop, and every other turn with it, when it ran on the loop's thread."""
    expected = alone(tiny_engine, PROMPTS[1], 12)
    loop = EngineLoop(tiny_engine)
    other_done, out = threading.Event(), {}

    def blocked(piece: str) -> None:
        assert other_done.wait(60), "the other turn never ended while this callback blocked"

    def first() -> None:
        with Actor(tiny_engine, loop=loop) as actor:
            out["first"] = actor.send(PROMPTS[0], max_tokens=12, params=GREEDY, on_text=blocked)

    def second() -> None:
        with Actor(tiny_engine, loop=loop) as actor:
            out["second"] = actor.send(PROMPTS[1], max_tokens=12, params=GREEDY)
        other_done.set()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert out["second"].stats.token_ids == expected
    assert out["first"].stats.token_ids == alone(tiny_engine, PROMPTS[0], 12)


def test_a_callers_failing_on_text_fails_its_message_only(tiny_engine):
    from floe.wasm import GuestHostCallError

    class Refused(Exception):
        pass

    def refuse(piece: str) -> None:
        raise Refused("no more text")

    loop = EngineLoop(tiny_engine)
    with Actor(tiny_engine, loop=loop) as actor:
        with pytest.raises(GuestHostCallError, match="on_text failed: .*no more text"):
            actor.send(PROMPTS[0], max_tokens=12, params=GREEDY, on_text=refuse)
        assert actor.send(PROMPTS[1], max_tokens=4, params=GREEDY).stats.token_ids
