"""The engine's contract: KV cache bookkeeping, sampling, generation and its stopping rules."""

import pytest
import torch

from floe.engine import Generation, Sampler, SamplingParams, generate, generate_step
from floe.engine.generate import TextStream
from floe.errors import ContextOverflow, InvalidSamplingParams

PROMPT = [{"role": "user", "content": "Tell me a short story about a lighthouse."}]


@pytest.fixture
def engine(default_engine):
    default_engine.kv_truncate(0)
    yield default_engine
    default_engine.kv_truncate(0)


def sampled(engine, params, n=24, ids=None):
    ids = ids or engine.tokenizer.encode_chat(PROMPT)
    engine.kv_truncate(0)
    steps = generate_step(engine, ids, Sampler(params))
    tokens = [next(steps) for _ in range(n)]
    steps.close()
    return tokens


def test_same_seed_same_tokens_other_seed_other_tokens(engine):
    p = SamplingParams(temperature=1.0, top_p=0.95, seed=7)
    assert sampled(engine, p) == sampled(engine, p)
    assert sampled(engine, p) != sampled(engine, SamplingParams(temperature=1.0, top_p=0.95, seed=8))


def test_restored_rng_state_continues_identically():
    logits = torch.randn(1000)
    sampler = Sampler(SamplingParams(temperature=0.8, seed=3))
    for _ in range(5):
        sampler.sample(logits)
    state = sampler.get_state().clone()
    expected = [sampler.sample(logits) for _ in range(20)]
    other = Sampler(SamplingParams(temperature=0.8, seed=99))
    other.set_state(state)
    assert [other.sample(logits) for _ in range(20)] == expected


def test_top_k_1_and_tiny_top_p_are_greedy():
    logits = torch.randn(5000)
    best = int(logits.argmax())
    for params in (SamplingParams(temperature=2.0, top_k=1, seed=1),
                   SamplingParams(temperature=2.0, top_p=1e-6, seed=1)):
        sampler = Sampler(params)
        assert {sampler.sample(logits) for _ in range(50)} == {best}


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([0.7, 0.2, 0.1]))
    sampler = Sampler(SamplingParams(temperature=1.0, seed=0))
    counts = torch.bincount(torch.tensor([sampler.sample(logits) for _ in range(4000)]), minlength=3)
    assert torch.allclose(counts / 4000, torch.tensor([0.7, 0.2, 0.1]), atol=0.03)


@pytest.mark.parametrize("kwargs", [dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=1.5),
                                    dict(top_k=-1), dict(temperature=float("nan")), dict(seed=-1)])
def test_invalid_sampling_params_are_rejected(kwargs):
    with pytest.raises(InvalidSamplingParams):
        SamplingParams(**kwargs)


def test_generate_stops_on_eos_and_reports(engine):
    ids = engine.tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    result = Generation()
    text = "".join(generate(engine, ids, SamplingParams(), 64, result=result))
    assert result.finish_reason == "stop"
    assert "Paris" in text and text == result.text
    assert engine.tokenizer.decode(result.token_ids) == text
    assert not set(result.token_ids) & set(engine.tokenizer.eos_ids)
    assert engine.kv_len() == len(ids) + result.generated_tokens  # every shown token fed, EOS not
    assert result.ttft_s > 0 and result.decode_tokens_per_s > 0


def test_generate_stops_at_max_tokens(engine):
    ids = engine.tokenizer.encode_chat(PROMPT)
    result = Generation()
    list(generate(engine, ids, SamplingParams(), 5, result=result))
    assert result.finish_reason == "length" and result.generated_tokens == 5


def test_context_overflow_leaves_the_cache_as_it_was(engine):
    engine.prefill([17] * 100)
    with pytest.raises(ContextOverflow, match="exceed the context of 2048"):
        engine.prefill([17] * 2000)
    assert engine.kv_len() == 100
    engine.kv_truncate(40)
    assert engine.kv_len() == 40
    with pytest.raises(ValueError):
        engine.kv_truncate(41)


def test_out_of_range_token_ids_are_rejected(engine):
    from floe.errors import FloeError

    with pytest.raises(FloeError, match="out of range"):
        engine.prefill([1, 49152])
    assert engine.kv_len() == 0


def test_text_stream_holds_back_partial_utf8(default_checkpoint):
    tok = default_checkpoint.tokenizer
    ids = tok.encode("snow ☃ and 👨‍👩‍👧 done")
    stream = TextStream(tok)
    deltas = [stream.push(i) for i in ids] + [stream.flush()]
    assert "".join(deltas) == "snow ☃ and 👨‍👩‍👧 done"
    assert all("\ufffd" not in d for d in deltas)


def test_random_checkpoint_is_seeded_and_runs(default_checkpoint):
    from floe.engine import Engine
    from floe.model.synthetic import random_checkpoint

    a = random_checkpoint("smollm2-135m", default_checkpoint.tokenizer, seed=1, dtype=torch.float32)
    b = random_checkpoint("smollm2-135m", default_checkpoint.tokenizer, seed=1, dtype=torch.float32)
    c = random_checkpoint("smollm2-135m", default_checkpoint.tokenizer, seed=2, dtype=torch.float32)
    assert a.fingerprint == b.fingerprint != c.fingerprint
    assert a.expected_weight_names() == set(a.weights)
    assert torch.equal(a.weights["layers.3.attention.wq.weight"], b.weights["layers.3.attention.wq.weight"])
    logits = Engine(a, max_seq_len=64).prefill([1, 2, 3])
    assert logits.shape == (49152,) and torch.isfinite(logits).all()


def test_token_ids_past_the_tokenizer_stand_for_no_bytes(default_checkpoint):
    tok = default_checkpoint.tokenizer
    assert tok.token_bytes(100_000) == b"" and tok.token_bytes(-1) == b""
    assert tok.token_bytes(504) == tok.decode([504]).encode()


def test_warm_up_leaves_every_slot_empty_and_free(default_checkpoint):
    from floe.engine import Engine

    engine = Engine(default_checkpoint, max_seq_len=64, n_slots=3, weights="native")
    held = engine.claim_slot()
    engine.prefill([5, 6, 7], held)
    seen = []
    engine.warm_up(lambda done, total: seen.append((done, total)))
    assert seen == [(1, 1)]  # one free slot (the CPU's step is every slot's), not the held one
    assert engine.kv_len(held) == 3 and [engine.kv_len(s) for s in (1, 2)] == [0, 0]
    assert sorted(engine.claim_slot() for _ in range(2)) == [1, 2]
    for slot in (1, 2):  # and every slot answers as a fresh engine's
        engine.prefill([5, 6, 7], slot)
    fresh = Engine(default_checkpoint, max_seq_len=64, n_slots=1, weights="native")
    fresh.prefill([5, 6, 7], 0)
    expected = fresh.decode_step(9, 0).argmax()
    assert all(engine.decode_step(9, slot).argmax() == expected for slot in (1, 2))


def test_the_plain_pytorch_peer_computes_what_floe_computes(default_checkpoint):
    """The bench's independent peer (gpt-fast style decode) agrees with floe in fp32, so comparing
    their speed compares implementations of one function."""
    import torch

    from floe.engine import Engine
    from floe.peer import PlainDecoder

    engine = Engine(default_checkpoint, max_seq_len=64)
    peer = PlainDecoder(engine, 32)
    ids = [5, 17, 300, 42, 9]
    with torch.inference_mode():
        for p, t in enumerate(ids):
            theirs = peer(torch.tensor([t]), torch.tensor([p]))
    torch.testing.assert_close(theirs, engine.prefill(ids), rtol=1e-4, atol=1e-4)


def test_a_server_bounds_onednns_kernel_cache_unless_told(monkeypatch):
    """bound_kernel_caches (floe serve, a Ray replica) caps oneDNN's per-shape kernel cache, which grew a
    server's RSS with every new prompt length; a capacity the environment sets is kept."""
    import os

    from floe.engine import bound_kernel_caches
    from floe.engine.engine import ONEDNN_PRIMITIVES

    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    bound_kernel_caches()
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == str(ONEDNN_PRIMITIVES)
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "1024")
    bound_kernel_caches()
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "1024"
