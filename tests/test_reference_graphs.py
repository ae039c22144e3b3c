"""The engine's and the engine loop's CUDA host side on the CPU: Engine(reference_graphs=True) runs the
batched graph step's contract (floe.engine.reference_graph) with the model's own forward, so what the
engine does around CUDA's steps — rows launched before the step computing their token is finished,
speculation, feeding, undoing, prompts riding in decode steps, the step's own draws — is tested without
a GPU. These are tests/test_cuda.py's tests of that side, on the default model (its dense float32 weights)."""

from __future__ import annotations

import pytest
import torch
from graph_steps import (
    QUESTIONS,
    arrivals_beside_fed_rows_answer_as_unfed,
    fed_rows_equal_host_fed,
    greedy_steps,
    prompts_ride_as_prefilled_alone,
    replies,
    sampled_turns_answer_as_plain_steps,
)

from floe.actor import Actor, EngineLoop
from floe.engine import Engine
from floe.errors import FloeError


@pytest.fixture(scope="module")
def batching(default_checkpoint):
    engine = Engine(default_checkpoint, max_seq_len=512, n_slots=4, reference_graphs=True)
    assert engine.batched_decode and engine.overlaps and engine.feeds
    return engine


def test_only_the_cpu_runs_the_reference(default_checkpoint):
    with pytest.raises(FloeError, match="reference_graphs"):
        Engine(default_checkpoint, device="webgpu", max_seq_len=64, reference_graphs=True)


def test_batched_decode_matches_each_slot_decoded_alone_and_the_cpus_own_step(batching, default_checkpoint):
    engine = batching
    slots = [engine.claim_slot() for _ in range(3)]
    try:
        prompts = [list(range(100, 105)), list(range(7, 47)), list(range(300, 600))]
        alone_tokens, alone_logits = greedy_steps(engine, slots, prompts, 6, batched=False)
        tokens, logits = greedy_steps(engine, slots, prompts, 6, batched=True)
        assert tokens == alone_tokens
        for a, b in zip(alone_logits, logits, strict=True):
            torch.testing.assert_close(torch.stack(b), torch.stack(a))
        cpu = Engine(default_checkpoint, max_seq_len=512, n_slots=4)  # the CPU's own batched step
        assert greedy_steps(cpu, slots, prompts, 6, batched=True)[0] == tokens
    finally:
        for s in slots:
            engine.release_slot(s)


def test_fed_rows_launched_before_their_token_is_known_equal_steps_fed_from_the_host(batching):
    fed_rows_equal_host_fed(batching, [list(range(100, 105)), list(range(7, 47)), list(range(300, 420))], n=6)


def test_prompts_riding_along_decode_rows_equal_their_own_prefill(batching):
    prompts_ride_as_prefilled_alone(batching)  # (the CPU's forward: exactly)


def test_actors_through_the_loop_overlapped_and_fed_answer_as_one_by_one(batching):
    """Four chat actors at once through one engine loop that speculates and feeds, as on CUDA: each
    answers, token for token and cache for cache, as when the loop steps its rows one by one."""
    def run_together(loop):
        return replies(batching, [Actor(batching, loop=loop) for _ in QUESTIONS], QUESTIONS, max_tokens=12)

    alone = run_together(EngineLoop(batching, batch=False))
    assert all(ids for ids, _ in alone)
    sizes = []
    fed = EngineLoop(batching, on_step=sizes.append)
    assert fed.overlap and fed.feed
    assert run_together(fed) == alone
    assert max(sizes) > 1 and fed.fed > 0


def test_sampled_turns_speculate_with_the_steps_own_draw_and_answer_as_plain_steps(batching):
    sampled_turns_answer_as_plain_steps(batching, max_tokens=12)


def test_prompts_arriving_while_others_decode_leave_the_decode_rows_beside_them_fed(batching):
    # (the default model's first reply long enough for three arrivals, 3 pieces apart)
    arrivals_beside_fed_rows_answer_as_unfed(batching, ("Tell me a long story about a dragon.",
                                                        "What is two plus two?", "x", "Name a river."))
