"""ABI v2: one engine loop steps every actor's turn; guests choose each token in place. Failures stay
inside the turn that caused them, and concurrent actors answer exactly as each would alone (greedy)."""

import threading

import pytest
from guests_wat import v2_guest

from floe.actor import Actor, EngineLoop
from floe.engine import SamplingParams
from floe.wasm import GuestDeadlineExceeded, GuestTrap

PROMPTS = ["Hello there.", "Name a colour.", "What is two plus two?", "Tell me about owls.",
           "Write a haiku.", "Say something kind."]
GREEDY = SamplingParams(0.0)


def alone(engine, prompt: str, max_tokens: int) -> list[int]:
    with Actor(engine) as actor:
        return actor.send(prompt, max_tokens=max_tokens, params=GREEDY).stats.token_ids


def concurrently(engine, loop, jobs: list[tuple[object, str, int]]) -> list:
    """Each (guest, prompt, max_tokens) as its own actor in its own thread, started together; each
    one's Reply or the exception it raised."""
    out: list = [None] * len(jobs)
    start = threading.Barrier(len(jobs))

    def work(i, guest, prompt, max_tokens):
        with Actor(engine, guest, loop=loop) as actor:
            start.wait()
            try:
                out[i] = actor.send(prompt, max_tokens=max_tokens, params=GREEDY)
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


@pytest.mark.parametrize("bad, error", [("(unreachable)", GuestTrap),
                                        ("(loop $f (br $f))", GuestDeadlineExceeded)])
def test_a_guest_failing_in_on_token_fails_only_its_own_turn(tiny_engine, bad, error):
    expected = [alone(tiny_engine, p, 16) for p in PROMPTS[:3]]
    loop = EngineLoop(tiny_engine, token_call_s=1.0)
    jobs = [(None, p, 16) for p in PROMPTS[:3]] + [(v2_guest(bad), "x", 16)]
    *replies, failed = concurrently(tiny_engine, loop, jobs)
    assert isinstance(failed, error), failed
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
        assert actor.stats.generated_tokens <= 3
        assert actor.send(PROMPTS[4], max_tokens=3, params=GREEDY).stats.generated_tokens == 3


def test_the_host_counts_max_tokens_whatever_the_guest_does(tiny_engine):
    never_stops = v2_guest(after=1 << 30)  # on_token never returns stop by itself
    with Actor(tiny_engine, never_stops) as actor:
        reply = actor.send("x", max_tokens=7)
    assert reply.stats.finish_reason == "length" and reply.stats.generated_tokens == 7

