"""Checks of the batched graph step's host side, shared by tests/test_cuda.py (CUDA's graphs) and
tests/test_reference_graphs.py (their CPU reference: Engine(reference_graphs=True))."""

from __future__ import annotations

import threading

import torch

from floe.engine import SamplingParams


def greedy_steps(engine, slots, prompts, n, batched):
    """n greedy decode steps of each slot after its prompt: the tokens and each step's logits."""
    firsts = [int(engine.prefill(p, s).argmax()) for p, s in zip(prompts, slots, strict=True)]
    tokens, logits = [[t] for t in firsts], [[] for _ in slots]
    for _ in range(n):
        if batched:
            out = engine.decode_batch([t[-1] for t in tokens], slots)
        else:
            out = [engine.decode_step(t[-1], s) for t, s in zip(tokens, slots, strict=True)]
        for i, row in enumerate(out):
            logits[i].append(row.float().cpu().clone())
            tokens[i].append(int(row.argmax()))
            # the batched step (for one row too) chose each row's greedy token on the device, the same
            assert engine.greedy_token(slots[i]) == tokens[i][-1]
    for s in slots:
        engine.kv_truncate(0, s)
    return tokens, logits


def fed_rows_equal_host_fed(engine, prompts, n=8):
    """Device-fed rows (launch_batch's None tokens): each step is launched before the one computing its
    tokens is finished (two in flight), reading each slot's argmax on the device — or its draw, for
    a row whose step drew. Tokens, logits, the cache's ids and fed_token equal steps fed from the host."""
    slots = [engine.claim_slot() for _ in prompts]
    drawn = SamplingParams(0.9, top_k=20)  # never drawn again on the host (a top_k within the candidates)
    try:
        host_tokens, host_logits = greedy_steps(engine, slots, prompts, n, batched=True)
        firsts = [int(engine.prefill(p, s).argmax()) for p, s in zip(prompts, slots, strict=True)]
        tokens, logits = [[t] for t in firsts], [[] for _ in slots]
        launched = engine.launch_batch(firsts, slots)
        for _ in range(n):
            ahead = engine.launch_batch([None] * len(slots), slots)  # before `launched` is finished
            for i, row in enumerate(engine.finish_batch(launched)):
                logits[i].append(row.float().cpu().clone())
                tokens[i].append(engine.greedy_token(slots[i]))
                assert engine.fed_token(slots[i]) == tokens[i][-1]
            launched = ahead
        engine.finish_batch(launched)
        assert tokens == host_tokens
        for a, b in zip(host_logits, logits, strict=True):
            torch.testing.assert_close(torch.stack(b), torch.stack(a))
        for s, p, t in zip(slots, prompts, tokens, strict=True):
            assert engine.cache.tokens[s] == p + t  # each fed row's id filled in once it was known
        # a row fed from a step that drew for its slot takes the draw, as the device made it
        for s in slots:
            engine.kv_truncate(len(engine.cache.tokens[s]) - 1, s)
        params = [(s, drawn, u) for s, u in zip(slots, (0.1, 0.5, 0.9), strict=True)]
        first = engine.launch_batch([t[-1] for t in tokens], slots, draws=params)
        second = engine.launch_batch([None] * len(slots), slots)
        engine.finish_batch(first)
        draws = [engine.drawn_token(s) for s in slots]
        engine.finish_batch(second)
        assert [engine.fed_token(s) for s in slots] == draws
        assert [engine.cache.tokens[s][-1] for s in slots] == draws
    finally:
        for s in slots:
            engine.kv_truncate(0, s)
            engine.release_slot(s)


def prompts_ride_as_prefilled_alone(engine, **tolerance):
    """A decode step that takes two prompts along (one step, rows of three slots) gives each prompt the
    logits and greedy choice its own prefill gives, and the decode row its own step's."""
    slots = [engine.claim_slot() for _ in range(3)]
    try:
        a, b, c = slots
        first = int(engine.prefill(list(range(100, 130)), a).argmax())
        p, q = list(range(7, 47)), list(range(300, 317))
        step = engine.launch_batch([first], [a], [(p, b), (q, c)])
        assert [k for k, _ in step.chunks] == [0, 1]  # both ride in the step
        together = [r.float().cpu().clone() for r in engine.finish_batch(step) + step.prompt_results]
        greedy = [engine.greedy_token(s) for s in slots]
        assert engine.kv_len(a) == 31 and engine.kv_len(b) == len(p) and engine.kv_len(c) == len(q)
        for s in slots:
            engine.kv_truncate(0, s)
        first = int(engine.prefill(list(range(100, 130)), a).argmax())
        alone = [engine.decode_step(first, a).float().cpu().clone(),
                 engine.prefill(p, b).float().cpu().clone(), engine.prefill(q, c).float().cpu().clone()]
        for got, want in zip(together, alone, strict=True):
            torch.testing.assert_close(got, want, **tolerance)
        assert greedy == [int(x.argmax()) for x in alone]
    finally:
        for s in slots:
            engine.kv_truncate(0, s)
            engine.release_slot(s)


QUESTIONS = ["Hello there.", "What is two plus two?", "Name a river.", "Tell me a story."]


def sampled_turns_answer_as_plain_steps(engine, max_tokens=16):
    """Chat guests that take the host's draw (made by the step, on the device) one after another through
    a loop without overlap, one that speculates with the draw, and one that also feeds it: tokens and
    caches equal (one actor at a time: a row's logits may differ in the last bits with the batch's size,
    and a draw with them). The overlapping and the feeding loops, for their counts."""
    from floe.actor import Actor, EngineLoop

    params = SamplingParams(0.8, top_p=0.9)

    def run(loop):
        out = []
        for i, question in enumerate(QUESTIONS):
            with Actor(engine, loop=loop, seed=i) as actor:
                reply = actor.send(question, max_tokens=max_tokens, params=params)
                out.append((reply.stats.token_ids, list(engine.cache.tokens[actor.slot])))
        return out

    plain = run(EngineLoop(engine, overlap=False))
    overlapped = EngineLoop(engine, feed=False)
    assert overlapped.overlap
    assert run(overlapped) == plain
    # Fed: the next step launched before the draw is finished reads the draw on the device; where the
    # host draws a row again (a nucleus past the candidates) the guest refuses the fed row and it is
    # undone. Answers and caches are the same.
    fed = EngineLoop(engine, feed=True)
    assert fed.feed
    assert run(fed) == plain
    assert fed.fed > 0
    return overlapped, fed


def replies(engine, actors, questions, max_tokens=32, arrive=None, on_text=None):
    """Each actor sends its question at once in a thread of its own (actor i > 0 once arrive[i] is set,
    where given; actor 0 with on_text), greedily: each reply's token ids and its slot's cache ids.
    The actors are closed after."""
    from floe.engine import SamplingParams

    out = [None] * len(questions)

    def work(i):
        if i and arrive is not None:
            assert arrive[i].wait(60)
        reply = actors[i].send(questions[i], max_tokens=max_tokens, params=SamplingParams(0.0),
                               on_text=on_text if i == 0 else None)
        out[i] = (reply.stats.token_ids, list(engine.cache.tokens[actors[i].slot]))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(questions))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for a in actors:
        a.close()
    return out


def arrivals_beside_fed_rows_answer_as_unfed(engine, questions=("Hello there.", "What is two plus two?", "x",
                                                                   "Tell me a story.")):
    """Actors arriving one after another while the first decodes: the decode rows beside a prompt
    riding in the forward in flight are still fed (EngineLoop.fed_past_prompts), the prompts' own
    first tokens join a later launch, and every answer and cache equals the loop's without feeding
    (also for a guest that refuses the host's first choice: the question "x"). The first question's
    reply must stream at least 3 pieces an arrival."""
    from test_engine_loop import REFUSES_FIRST

    from floe.actor import Actor, EngineLoop

    def run(loop):
        actors = [Actor(engine, REFUSES_FIRST if q == "x" else None, loop=loop) for q in questions]
        arrive = [threading.Event() for _ in questions]
        pieces = [0]

        def first_streams(_piece):  # (in the loop's thread) the next actor arrives every 3 tokens
            pieces[0] += 1
            for i in range(1, len(questions)):
                if pieces[0] >= 3 * i:
                    arrive[i].set()

        return replies(engine, actors, questions, arrive=arrive, on_text=first_streams)

    plain = run(EngineLoop(engine, feed=False))
    assert all(plain)
    fed_past = []
    for _ in range(3):  # (whether an arrival meets a fed step is timing: a few runs make it certain)
        fed = EngineLoop(engine, feed=True)
        assert run(fed) == plain
        fed_past.append(fed.stats()["fed_past_prompts"])
        if fed_past[-1]:
            break
    assert max(fed_past) > 0, fed_past
