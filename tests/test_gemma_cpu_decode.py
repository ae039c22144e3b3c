"""The CPU's lean decode step (floe.engine.cpu_decode) computes Gemma 2's and Gemma 3's layers as the module
forward does (which matches transformers: test_gemma.py): soft-capped scores and logits, the query scale,
(1 + w) and post norms, GeGLU, scaled embeddings, the window on some layers, Gemma 3's q/k norms, local
rotary base and linearly scaled global rotary; one row or several slots' rows at once, through the
engine loop, and on every native weights kernel this CPU runs."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from models import convert_to_gguf, save_hf_folder
from test_cpu_batch import attend_lanes  # noqa: F401 (a fixture)
from test_engine_loop import alone, concurrently
from test_qgemv import runnable

from floe.engine import Engine, qgemv
from floe.engine.cpu_decode import CpuDecoder, _compiled
from floe.engine.transformer import apply_rotary
from floe.model import load_checkpoint

WINDOW = 8
IDS = [1, 504, 3575, 282, 4649, 314, 7042, 30, 17, 42, 9000, 31000] * 4  # 48 positions: 6 windows
FIRST = 10  # positions prefilled before the decode steps
KERNELS = [*qgemv.VARIANTS, "int4pack"]


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory):
    """Gemma 2 with soft-capping strong enough to bend scores and logits, a query scale (24) that is
    not its head_dim's (32), a window on its first layer."""
    return save_hf_folder(tmp_path_factory.mktemp("gemma2"), "gemma2", tie=True, sliding_window=WINDOW,
                          query_pre_attn_scalar=24, softcaps=(1.0, 3.0))


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    """Gemma 3 (4B-27B style: its global layer's rotary scaled linearly), a window on 5 layers of 6."""
    return save_hf_folder(tmp_path_factory.mktemp("gemma3"), "gemma3_text", tie=True, sliding_window=WINDOW,
                          query_pre_attn_scalar=24, rope_linear=8.0)


@pytest.fixture(scope="module")
def gemma3_wide(tmp_path_factory):
    """Gemma 3 whose window (64) is the engines' whole context: no layer's window applies."""
    return save_hf_folder(tmp_path_factory.mktemp("gemma3w"), "gemma3_text", tie=True, sliding_window=64,
                          query_pre_attn_scalar=24)


@pytest.fixture(params=["gemma2", "gemma3"])
def folder(request, gemma2, gemma3):
    return {"gemma2": gemma2, "gemma3": gemma3}[request.param]


def module_logits(checkpoint, **engine) -> torch.Tensor:
    """The module forward's logits [len(IDS), vocab] of every position, a step at a time after FIRST."""
    module = Engine(checkpoint, max_seq_len=64, fused_kernels=False, **engine)
    rows = [module.prefill(IDS[:FIRST])] + [module.decode_step(t) for t in IDS[FIRST:]]
    return torch.stack(rows)


def assert_same(lean: torch.Tensor, module: torch.Tensor, tolerance: float = 1e-4) -> None:
    assert (lean - module).abs().max() <= tolerance * max(1.0, float(module.abs().max()))
    assert torch.equal(lean.argmax(-1), module.argmax(-1))


def test_gemma_runs_the_lean_step_by_default(folder):
    c = load_checkpoint(folder).config
    # (CUDA's fused step and WebGPU's shaders have them too; CUDA's reference graph does not)
    assert c.llama_step_lacks() == c.llama_step_lacks("cuda") == c.llama_step_lacks("webgpu") == []
    assert c.llama_step_lacks("cuda-graph") == c.beyond_llama() != []
    engine = Engine(load_checkpoint(folder), max_seq_len=64)
    assert engine.fused_kernels
    engine.prefill(IDS[:FIRST])
    engine.decode_step(IDS[FIRST])
    assert isinstance(engine._batch, CpuDecoder)
    assert isinstance(_compiled()["decode_layers"], torch.jit.ScriptFunction)  # the hooks script


def test_the_lean_step_equals_the_module_forward(folder):
    """Past several windows: each decode row within 1e-4 of the module forward's, the same greedy token."""
    checkpoint = load_checkpoint(folder)
    module = module_logits(checkpoint)
    lean = Engine(checkpoint, max_seq_len=64)
    steps = [lean.prefill(IDS[:FIRST])] + [lean.decode_step(t) for t in IDS[FIRST:]]
    assert_same(torch.stack(steps)[1:], module[1:])


def test_bf16_weights_through_the_lean_step_track_fp32_as_the_module_forward_does(folder):
    """bf16 weights and cache (the residual stream stays fp32 in the lean step): within 3e-2 of the
    fp32 logits, as the bf16 module forward is (measured: 0.9e-2 / 1.7e-2 against its 1.1e-2 / 1.8e-2)."""
    checkpoint = load_checkpoint(folder)
    fp32 = module_logits(checkpoint)[1:]
    lean = Engine(checkpoint, max_seq_len=64, dtype="bfloat16")
    assert lean.fused_kernels
    steps = torch.stack([lean.prefill(IDS[:FIRST])] + [lean.decode_step(t) for t in IDS[FIRST:]])[1:]
    assert isinstance(lean._batch, CpuDecoder) and steps.dtype == torch.float32
    assert (steps - fp32).norm() / fp32.norm() < 3e-2


def prefilled(engine: Engine, n: int) -> list[int]:
    """Slots 0..n-1 emptied and filled with prompts of different lengths (some past the window)."""
    for slot in range(n):
        engine.kv_truncate(0, slot)
        engine.prefill(IDS[slot:slot + FIRST + 7 * slot], slot)
    return list(range(n))


def test_several_slots_rows_in_one_lean_step_equal_the_module_forward_alone(folder):
    checkpoint = load_checkpoint(folder)
    lean = Engine(checkpoint, max_seq_len=64, n_slots=3)
    module = Engine(checkpoint, max_seq_len=64, n_slots=3, fused_kernels=False)
    assert lean.batched_decode and not module.batched_decode
    slots = prefilled(lean, 3)
    prefilled(module, 3)
    calls = []
    step = lean._batch_decoder().step
    lean._batch.step = lambda tokens, *a, **k: calls.append(len(tokens)) or step(tokens, *a, **k)
    for t in range(12):
        tokens = [IDS[20 + 3 * s + t] for s in slots]
        together = torch.stack(lean.decode_batch(tokens, slots))
        each = torch.stack([module.decode_step(token, s) for token, s in zip(tokens, slots, strict=True)])
        assert_same(together, each)
    assert calls == [3] * 12  # one lean step a turn, over the three rows


@pytest.mark.parametrize("arch,caps", [("gemma2", (1.0, 3.0)), ("gemma3_text", (None, None))])
def test_actors_through_the_engine_loop_answer_as_the_module_forward_alone(tmp_path, arch, caps):
    """Concurrent actors share the loop's lean steps (several rows a step) and each answers what it
    would alone through the module forward (greedy)."""
    from floe.actor import EngineLoop

    folder = save_hf_folder(tmp_path, arch, tie=True, sliding_window=WINDOW, softcaps=caps)
    (folder / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}\n{% endfor %}")
    checkpoint = load_checkpoint(folder)
    prompts = ["Hello there.", "Name a colour, any colour you like.", "What is two plus two?"]
    module = Engine(checkpoint, max_seq_len=128, fused_kernels=False)
    expected = [alone(module, p, 16) for p in prompts]
    engine = Engine(checkpoint, max_seq_len=128, n_slots=3)
    rows_per_step: list[int] = []
    loop = EngineLoop(engine, on_step=rows_per_step.append)
    replies = concurrently(engine, loop, [(None, p, 16) for p in prompts])
    assert [r.stats.token_ids for r in replies] == expected and all(len(r) == 16 for r in expected)
    assert isinstance(engine._batch, CpuDecoder) and max(rows_per_step) > 1


@pytest.mark.usefixtures("attend_lanes")
@pytest.mark.parametrize(("window", "softcap"), [(8, 0.0), (0, 1.5), (8, 1.5)])
def test_the_attention_operator_windows_and_caps_as_the_module_does(window, softcap):
    """torch.ops.floe.attend with a window and soft-capping (Gemma's head_dim 256, one KV head for 4 query
    heads, rows of distinct slots at positions before, at and past the window), at 8 lanes and at 16,
    writes the cache and the output that the module's rotary and attention arithmetic gives."""
    gen = torch.Generator().manual_seed(0)
    n_heads, hd, seq, slots, positions = 4, 256, 40, [2, 0, 1, 3], [0, 5, 8, 39]
    cos, sin = torch.randn(seq, hd, generator=gen), torch.randn(seq, hd, generator=gen)
    k, v = (torch.randn(4, 1, seq, hd, generator=gen) for _ in range(2))
    qkv = torch.randn(4, (n_heads + 2) * hd, generator=gen)
    k_ref, v_ref, out = k.clone(), v.clone(), torch.full((4, n_heads * hd), float("nan"))
    torch.ops.floe.attend(qkv, cos, sin, k, v, slots, positions, n_heads, out, window, softcap)
    for b, (slot, at) in enumerate(zip(slots, positions, strict=True)):
        q, key, value = qkv[b].view(n_heads + 2, 1, hd).split([n_heads, 1, 1])
        q, key = (apply_rotary(t, cos[at:at + 1], sin[at:at + 1]) for t in (q, key))
        k_ref[slot, :, at], v_ref[slot, :, at] = key[:, 0], value[:, 0]
        first = max(0, at + 1 - window) if window else 0
        scores = q[:, 0] @ k_ref[slot, 0, first:at + 1].T * hd**-0.5
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        expected = torch.softmax(scores, dim=-1) @ v_ref[slot, 0, first:at + 1]
        torch.testing.assert_close(out[b], expected.reshape(-1), rtol=0, atol=1e-5)
        if (window and at >= window) or (softcap and at > 0):  # what this row sees changes
            keys, values = k_ref[slot, 0, :at + 1], v_ref[slot, 0, :at + 1]
            plain = torch.softmax(q[:, 0] @ keys.T * hd**-0.5, dim=-1) @ values
            assert (out[b] - plain.reshape(-1)).abs().max() > 1e-3
    torch.testing.assert_close(k, k_ref, rtol=0, atol=1e-5)
    assert torch.equal(v, v_ref)


@pytest.fixture(params=KERNELS)
def kernel(request) -> str:
    """Each native kernel this machine can run (floe's variants: those its CPU flags allow)."""
    return request.param if request.param == "int4pack" else runnable(request.param)


@pytest.fixture(scope="module")
def quantized(tmp_path_factory, gemma2, gemma3, gemma3_wide):
    """(folder name, GGUF type) -> that folder as a GGUF of that type, made once."""
    made, folders = {}, {"gemma2": gemma2, "gemma3": gemma3, "gemma3_wide": gemma3_wide}

    def get(name: str, qtype: Q):
        if (name, qtype) not in made:
            path = tmp_path_factory.mktemp("q") / f"{name}-{qtype.name}.gguf"
            made[name, qtype] = load_checkpoint(convert_to_gguf(folders[name], path, qtype))
        return made[name, qtype]

    return get


def steps_both_ways(engine: Engine) -> tuple[torch.Tensor, torch.Tensor]:
    """(module forward, lean step) logits of each position past FIRST, each computed from the same
    cache: the module's row, then its position truncated and run again by the lean step."""
    engine.kv_truncate(0)
    engine.prefill(IDS[:FIRST])
    module, lean = [], []
    for position in range(FIRST, len(IDS)):
        module.append(engine.prefill([IDS[position]]))
        engine.kv_truncate(position)
        lean.append(engine.decode_step(IDS[position]))
    return torch.stack(module), torch.stack(lean)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q8_0], ids=lambda t: t.name)
@pytest.mark.parametrize("name", ["gemma2", "gemma3", "gemma3_wide"])
def test_the_lean_step_on_native_weights_equals_the_module_forward(quantized, name, qtype, kernel):
    """The same packed weights through both steps (floe's kernels: with floe's attend operator, its window,
    cap, query scale and local rotary tables; gemma3_wide: its window spans the context, so none applies):
    within 1e-4, the same greedy token. floe's kernels round each
    input row to int8 (per block of 32), and the lean step's RMSNorm rounds differently from the
    module's in the last bit, which can move one activation across a rounding step: a row or two of
    38 here and there (Q4_0: gemma2 on every variant, gemma3 on portable) then differ by 2e-3 to 1.2e-2
    (logits up to ~0.8), within 3e-2. On an AVX2-only CPU (a 2-core Zen 3) the operators' sums run in
    8 lanes, not 16, and PyTorch's packed int4 kernel is its AVX2 one: there three rows of gemma3_wide
    Q8_0 on portable and one of gemma3 on packed int4 cross such a step (up to 9.5e-3); the rest stay
    within 1e-5."""
    if kernel == "int4pack" and qtype != Q.Q4_0:
        pytest.skip("PyTorch's packed int4 kernel runs 4-bit types")
    engine = Engine(quantized(name, qtype), max_seq_len=64, n_slots=3, weights="native", native_kernel=kernel)
    assert sum(engine.packed.values()) >= engine.config.n_layers * 4
    module, lean = steps_both_ways(engine)
    assert engine._batch.native_ops == (kernel != "int4pack")  # floe's operators with floe's kernels
    assert torch.equal(lean.argmax(-1), module.argmax(-1))
    off = (lean - module).abs().amax(-1)
    assert int((off > 1e-4).sum()) <= 3 and float(off.max()) < 3e-2


@pytest.mark.parametrize("name", ["gemma2", "gemma3", "gemma3_wide"])
def test_native_rows_stepped_together_get_the_bits_of_each_alone(quantized, name, kernel):
    """Three slots at different positions (some past the window), stepped alone then together: floe's
    kernels compute each input row alone, so every row's logits are bitwise its own step's; the packed
    int4 kernel sums in another order for several rows (float rounding)."""
    engine = Engine(quantized(name, Q.Q4_0), max_seq_len=64, n_slots=3, weights="native",
                    native_kernel=kernel)
    slots = prefilled(engine, 3)
    lengths = [engine.kv_len(s) for s in slots]
    tokens = [[IDS[30 + 3 * s + t] for s in slots] for t in range(3)]
    alone = [[None] * 3 for _ in tokens]
    for s in slots:
        for t in range(3):
            alone[t][s] = engine.decode_step(tokens[t][s], s).clone()
        engine.kv_truncate(lengths[s], s)
    for t in range(3):
        together = engine.decode_batch(tokens[t], slots)
        for a, b in zip(alone[t], together, strict=True):
            if kernel == "int4pack":
                assert_same(b, a)
            else:
                assert torch.equal(a, b), (t, name)
