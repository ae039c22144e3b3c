"""Batched decode on the CPU: one step runs every row's projections at once, and each row still gets
what it would alone — bitwise on floe's quantized kernel, within float rounding on PyTorch's dense
products; a row whose token or context is bad fails alone; concurrent actors batch their steps."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize
from models import write_gguf
from test_qgemv import runnable

from floe.engine import Engine, SamplingParams, qgemv
from floe.engine.cpu_decode import CpuDecoder, attend_ops, rms_norm
from floe.errors import ContextOverflow, FloeError
from floe.model import load_checkpoint
from floe.model.quant import GROUP, QuantizedWeight

PROMPT_LENGTHS = (5, 17, 40, 9)  # rows at different positions


@pytest.fixture(params=list(qgemv.VARIANTS))
def variant(request) -> str:
    return runnable(request.param)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0], ids=lambda t: t.name)
def test_gemv_q_over_rows_equals_each_row_alone(qtype, variant):
    """4-bit and 8-bit codes, several blocks of output rows, 19 groups a row (a tail): B input rows in
    one call give each row the bits of its own call."""
    rng = np.random.default_rng(5)
    w = rng.standard_normal((300, 19 * GROUP)).astype(np.float32)
    layer = qgemv.QLinear(QuantizedWeight(qtype.name, w.shape, quantize(w, qtype)), dense=False,
                          kernel=variant)
    x = torch.from_numpy(rng.standard_normal((6, w.shape[1])).astype(np.float32))
    x *= torch.logspace(-2, 2, 6).unsqueeze(1)  # rows of different scales: their int8 steps differ
    together = layer(x)
    alone = torch.cat([layer(x[b : b + 1]) for b in range(x.shape[0])])
    assert together.shape == (6, 300) and torch.equal(together, alone)


@pytest.fixture(scope="module", params=[Q.Q4_0, Q.Q8_0], ids=lambda t: t.name)
def tiny_q(request, tmp_path_factory):
    """A tiny GGUF of 4-bit or 8-bit weights."""
    return load_checkpoint(write_gguf(tmp_path_factory.mktemp("batch") / "t.gguf", [request.param]))


def prefilled(engine: Engine, lengths=PROMPT_LENGTHS) -> list[int]:
    """Slots 0.. emptied and filled with prompts of `lengths`; the slots."""
    slots = list(range(len(lengths)))
    for slot, n in zip(slots, lengths, strict=True):
        engine.kv_truncate(0, slot)
        engine.prefill([(37 * slot + 11 * j) % 4000 + 3 for j in range(n)], slot)
    return slots


def alone_then_together(engine: Engine, steps: int = 3) -> tuple[list, list]:
    """Each slot stepped alone (decode_step), then the same steps for every slot at once
    (decode_batch) from the same contexts: per step, the logits of each."""
    slots = prefilled(engine)
    lengths = [engine.kv_len(s) for s in slots]
    tokens = [[100 + 7 * s + 3 * t for s in slots] for t in range(steps)]
    alone = [[None] * len(slots) for _ in range(steps)]
    for s in slots:
        for t in range(steps):
            alone[t][s] = engine.decode_step(tokens[t][s], s).clone()
        engine.kv_truncate(lengths[s], s)
    together = [[row.clone() for row in engine.decode_batch(tokens[t], slots)] for t in range(steps)]
    assert [engine.kv_len(s) for s in slots] == [n + steps for n in lengths]
    return alone, together


def test_a_batched_step_gives_every_row_the_bits_of_its_step_alone(tiny_q, variant):
    """floe's kernel computes each input row alone, and so does every other op of the step: rows at
    different positions, three steps running (each row's K/V written where its next step reads)."""
    engine = Engine(tiny_q, max_seq_len=64, n_slots=4, weights="native", native_kernel=variant)
    assert engine.batched_decode and sum(engine.packed.values()) == 2 * 4 + 1  # every projection
    alone, together = alone_then_together(engine)
    for t, (a, b) in enumerate(zip(alone, together, strict=True)):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), t


def test_dense_rows_match_their_step_alone_within_float_rounding(tiny_engine):
    """A dense weight's product is a GEMV for one row and a GEMM for several (sums in another order):
    close, with the same greedy token, not bitwise."""
    assert tiny_engine.batched_decode
    alone, together = alone_then_together(tiny_engine)
    for a, b in zip(alone, together, strict=True):
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(y, x, rtol=0, atol=1e-5 * float(x.abs().max()))
            assert int(y.argmax()) == int(x.argmax())


def test_bf16_weights_and_cache_step_over_rows(tiny_q):
    """bf16 weights keep a bf16 KV cache, whose attention output is bf16: the rows' step runs (it
    raised on a float32 output buffer) and matches each row alone within bf16 rounding."""
    engine = Engine(tiny_q, dtype="bfloat16", max_seq_len=64, n_slots=4)
    assert engine.cache.k.dtype == torch.bfloat16 and engine.batched_decode
    alone, together = alone_then_together(engine)
    for a, b in zip(alone, together, strict=True):
        for x, y in zip(a, b, strict=True):
            assert y.dtype == torch.float32
            torch.testing.assert_close(y, x, rtol=0, atol=2e-2 * float(x.abs().max()))


def test_the_packed_int4_kernel_rows_match_their_step_alone(tiny_q):
    engine = Engine(tiny_q, max_seq_len=64, n_slots=4, weights="native", native_kernel="int4pack")
    alone, together = alone_then_together(engine, steps=2)
    for a, b in zip(alone, together, strict=True):
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(y, x, rtol=0, atol=1e-4 * float(x.abs().max()))
            assert int(y.argmax()) == int(x.argmax())


def test_a_full_context_or_a_bad_token_fails_only_its_row(tiny_q):
    engine = Engine(tiny_q, max_seq_len=48, n_slots=4, weights="native")
    slots = prefilled(engine, (5, 48, 9, 12))  # slot 1's context is full
    lengths = [engine.kv_len(s) for s in slots]
    expect = {}
    for s in (0, 3):
        expect[s] = engine.decode_step(50 + s, s).clone()
        engine.kv_truncate(lengths[s], s)
    results = engine.decode_batch([50, 51, engine.config.vocab_size, 53], slots)
    assert isinstance(results[1], ContextOverflow)
    assert isinstance(results[2], FloeError) and "out of range" in str(results[2])
    assert torch.equal(results[0], expect[0]) and torch.equal(results[3], expect[3])
    assert [engine.kv_len(s) for s in slots] == [lengths[0] + 1, 48, lengths[2], lengths[3] + 1]


def test_a_failure_inside_the_step_takes_every_row_back(tiny_engine, monkeypatch):
    slots = prefilled(tiny_engine)
    lengths = [tiny_engine.kv_len(s) for s in slots]

    def broken(self, tokens, positions, slots, out=None):
        raise RuntimeError("the step broke")

    monkeypatch.setattr(CpuDecoder, "step", broken)
    with pytest.raises(RuntimeError, match="the step broke"):
        tiny_engine.decode_batch([1, 2, 3, 4], slots)
    assert [tiny_engine.kv_len(s) for s in slots] == lengths
    assert [len(tiny_engine.cache.tokens[s]) for s in slots] == lengths


@pytest.fixture(params=[8, 16])
def attend_lanes(request):
    """The attention operator held to 8 lanes (AVX2's registers) or 16 (AVX-512's; skipped where the CPU
    has none) for the test, then back to the CPU's own."""
    runnable("portable")
    qgemv.load("portable")  # loads the operator
    try:
        torch.ops.floe.attend_lanes(request.param)
    except RuntimeError:
        pytest.skip("16 lanes need AVX-512, which this CPU does not have")
    yield request.param
    torch.ops.floe.attend_lanes(0)


@pytest.mark.parametrize(("n_heads", "n_kv", "head_dim"), [(9, 3, 64), (4, 4, 32), (8, 2, 128), (4, 1, 256)])
def test_the_attention_operator_is_the_step_in_pytorchs_ops(n_heads, n_kv, head_dim, attend_lanes):
    """torch.ops.floe.attend (rotary, the K/V write, attention, for rows of distinct slots at their own
    positions, the first at position 0, lengths that are and are not a multiple of its 8- or 16-position
    tiles; grouped and plain heads, each head_dim the operator is compiled for and one it is not), at
    8 lanes and at 16, writes the cache and the output PyTorch's ops do."""
    gen = torch.Generator().manual_seed(0)
    seq, slots, positions = 48, [2, 0, 1], [0, 17, 47]
    cos, sin = torch.randn(seq, head_dim, generator=gen), torch.randn(seq, head_dim, generator=gen)
    k, v = (torch.randn(3, n_kv, seq, head_dim, generator=gen) for _ in range(2))
    qkv = torch.randn(3, (n_heads + 2 * n_kv) * head_dim, generator=gen)
    out = torch.full((3, n_heads * head_dim), float("nan"))
    k_ops, v_ops, out_ops = k.clone(), v.clone(), torch.empty_like(out)
    torch.ops.floe.attend(qkv, cos, sin, k, v, slots, positions, n_heads, out)

    sin_signed = torch.cat([-sin[:, : head_dim // 2], sin[:, head_dim // 2 :]], 1)
    roll = torch.roll(torch.eye(head_dim), head_dim // 2, dims=1)
    at = torch.tensor(positions)
    rotary = torch.diag_embed(cos[at]) + roll * sin_signed[at].unsqueeze(1)
    row_scale = torch.ones(n_heads + n_kv, 1)
    row_scale[:n_heads] = head_dim**-0.5
    att_rows = [row.view(n_kv, n_heads // n_kv, head_dim) for row in out_ops.unbind()]
    attend_ops(qkv, rotary, row_scale, att_rows, slots, positions, k_ops, v_ops, n_heads, n_kv, head_dim)
    assert torch.equal(v, v_ops)
    torch.testing.assert_close(k, k_ops, rtol=0, atol=1e-5)
    torch.testing.assert_close(out, out_ops, rtol=0, atol=1e-5)


def test_the_attention_operators_lanes_give_the_same_bits():
    """8 lanes (a 16-lane word in two registers) compute the sums 16 do, in the same order: a CPU's
    vector width never changes an attention output (on a CPU without AVX-512 only 8 run)."""
    runnable("portable")
    qgemv.load("portable")  # loads the operator
    try:
        torch.ops.floe.attend_lanes(16)
    except RuntimeError:
        pytest.skip("16 lanes need AVX-512, which this CPU does not have")

    def attend(lanes: int, head_dim: int, softcap: float) -> torch.Tensor:
        gen = torch.Generator().manual_seed(head_dim)
        seq, positions = 80, [0, 15, 16, 47, 79]  # 4 query heads on one KV head, 5 slots
        qkv = torch.randn(5, 6 * head_dim, generator=gen)
        cos, sin = (torch.randn(seq, head_dim, generator=gen) for _ in range(2))
        k, v = (torch.randn(5, 1, seq, head_dim, generator=gen) for _ in range(2))
        out = torch.empty(5, 4 * head_dim)
        torch.ops.floe.attend_lanes(lanes)
        torch.ops.floe.attend(qkv, cos, sin, k, v, list(range(5)), positions, 4, out, 0, softcap)
        return out

    try:
        for head_dim, softcap in ((64, 0.0), (128, 2.0), (256, 0.0)):
            assert torch.equal(attend(16, head_dim, softcap), attend(8, head_dim, softcap))
    finally:
        torch.ops.floe.attend_lanes(0)


def test_the_rms_norm_operator_is_the_steps_rms_norm():
    runnable("portable")
    qgemv.load("portable")  # loads the operator
    gen = torch.Generator().manual_seed(0)
    x, weight = torch.randn(3, 576, generator=gen) * 10, torch.randn(576, generator=gen)
    out, ops = torch.full_like(x, float("nan")), torch.empty_like(x)
    torch.ops.floe.rms_norm_rows(x, weight, 1e-5, out)
    rms_norm(x, list(x.unbind()), weight, 1e-5, torch.zeros(1), ops)
    torch.testing.assert_close(out, ops, rtol=1e-6, atol=0)


def test_the_scripted_step_over_rows_equals_the_eager_one(tiny_q):
    engine = Engine(tiny_q, max_seq_len=64, n_slots=4, weights="native")
    slots = prefilled(engine)
    positions = [engine.kv_len(s) for s in slots]
    decoder = CpuDecoder(engine.model, engine.cache)
    assert decoder.native_ops  # floe's attention and RMSNorm operators, with floe's kernels and float32
    scripted = decoder.step([7, 8, 9, 10], positions, slots).clone()
    eager = CpuDecoder(engine.model, engine.cache, script=False).step([7, 8, 9, 10], positions, slots)
    assert torch.equal(scripted, eager)


def test_concurrent_actors_batch_their_cpu_steps_and_answer_as_alone(tiny_q, monkeypatch):
    from floe.actor import Actor, EngineLoop

    engine = Engine(tiny_q, max_seq_len=256, n_slots=4, weights="native")
    prompts = ["Hello there.", "Name a colour.", "What is two plus two?", "Tell me about owls."]
    greedy = SamplingParams(0.0)

    def alone(prompt: str) -> list[int]:
        with Actor(engine) as actor:
            return actor.send(prompt, max_tokens=12, params=greedy).stats.token_ids

    expected = [alone(p) for p in prompts]
    rows_per_step: list[int] = []
    step = CpuDecoder.step

    def counted(self, tokens, positions, slots, out=None):
        rows_per_step.append(len(tokens))
        return step(self, tokens, positions, slots, out)

    monkeypatch.setattr(CpuDecoder, "step", counted)
    loop, replies = EngineLoop(engine), [None] * len(prompts)
    start = threading.Barrier(len(prompts))

    def work(i: int) -> None:
        with Actor(engine, loop=loop) as actor:
            start.wait()
            replies[i] = actor.send(prompts[i], max_tokens=12, params=greedy).stats.token_ids

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert replies == expected
    assert max(rows_per_step) > 1  # the loop's steps ran several actors' rows as one forward


@pytest.mark.parametrize("weights,dtype", [("native", "float32"), ("dense", "float32"),
                                           ("dense", "bfloat16")])
def test_prompts_of_several_slots_prefill_in_one_forward_each_as_alone(tiny_q, weights, dtype,
                                                                        monkeypatch):
    """Prompts handed to one launch run as one forward over all their rows (the CPU), and each gets
    the bits of its own prefill — logits, cache and token record; a prompt with a bad id fails alone,
    and one shorter than the dense product's rows runs its own prefill (its kernel differs)."""
    from floe.engine.int4 import DENSE_FROM_ROWS
    from floe.engine.transformer import Transformer

    engine = Engine(tiny_q, max_seq_len=128, n_slots=5, weights=weights, dtype=dtype)
    ids = [[(37 * s + 11 * j) % 4000 + 3 for j in range(n)] for s, n in enumerate((40, 9, 64, 3, 12))]
    ids[4][5] = engine.config.vocab_size  # out of range
    alone = {}
    for slot in (0, 1, 2, 3):
        engine.kv_truncate(0, slot)
        logits = engine.prefill(ids[slot], slot).clone()
        alone[slot] = (logits, engine.cache.k[:, slot, :, :len(ids[slot])].clone())
        engine.kv_truncate(0, slot)
    forwards = []
    together = Transformer.forward_segments

    def counted(self, tokens, segments, cache):
        forwards.append([n for n, _, _ in segments])
        return together(self, tokens, segments, cache)

    monkeypatch.setattr(Transformer, "forward_segments", counted)
    step = engine.launch_batch([], [], [(ids[s], s) for s in range(5)])
    engine.finish_batch(step)
    assert forwards == [[40, 9, 64]] and min(forwards[0]) >= DENSE_FROM_ROWS
    for slot in (0, 1, 2, 3):
        logits, keys = alone[slot]
        assert torch.equal(step.prompt_results[slot], logits)
        assert torch.equal(engine.cache.k[:, slot, :, :len(ids[slot])], keys)
        assert engine.cache.tokens[slot] == ids[slot]
    assert isinstance(step.prompt_results[4], FloeError) and "out of range" in str(step.prompt_results[4])
    assert engine.kv_len(4) == 0
