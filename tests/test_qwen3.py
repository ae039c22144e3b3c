"""Qwen3 (per-head q/k RMSNorm, explicit head_dim, no q/k/v bias) gives transformers' logits and greedy
tokens, from a Hugging Face folder and from the same weights as llama.cpp writes them in GGUF; CUDA's
and WebGPU's steps give the CPU's."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize
from models import CUDA_STEPS, assert_cuda_matches_the_cpu, convert_to_gguf, save_hf_folder
from models import assert_matches_transformers as assert_matches
from safetensors import safe_open
from safetensors.torch import save_file

from floe.engine import Engine
from floe.engine.weights import check_backend
from floe.errors import NotAModel
from floe.model import load_checkpoint

IDS = [1, 504, 3575, 282, 4649, 314, 7042, 30, 17, 42, 9000, 31000] * 4  # 48 positions
PROMPT, N_NEW = IDS[:20], 8


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_hf_folder(tmp_path_factory.mktemp("qwen3"), "qwen3", tie=False)


@pytest.fixture(scope="module")
def reference(folder):
    """transformers' Qwen3 on the folder's weights."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def test_qwen3_config_from_an_hf_folder(folder):
    c = load_checkpoint(folder).config
    assert (c.arch, c.head_dim, c.qk_norm, c.qkv_bias) == ("qwen3", 32, True, False)
    assert c.head_dim != c.dim // c.n_heads  # the explicit head_dim is the one used


def test_qwen3_hf_folder_matches_transformers(folder, reference):
    assert len(list(folder.glob("*.safetensors"))) > 1  # sharded
    assert_matches(folder, reference)


def test_qwen3_gguf_matches_transformers(folder, reference, tmp_path):
    path = convert_to_gguf(folder, tmp_path / "qwen3.gguf")
    c = load_checkpoint(path).config
    assert (c.arch, c.head_dim, c.qk_norm, c.tie_embeddings) == ("qwen3", 32, True, False)
    assert_matches(path, reference)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0], ids=lambda q: q.name)
def test_quantized_qwen3_gguf_matches_transformers_on_the_same_values(folder, tmp_path, qtype):
    """transformers runs the values the file's blocks stand for (dequantized by gguf); floe's dense
    engine the same, from the blocks."""
    from transformers import AutoModelForCausalLM

    path = convert_to_gguf(folder, tmp_path / "q.gguf", qtype)
    assert load_checkpoint(path).file_type == qtype.name
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                w = p.numpy()
                p.copy_(torch.from_numpy(dequantize(quantize(w, qtype), qtype).reshape(w.shape)))
    assert_matches(path, model)


def test_native_quantized_qwen3_tracks_the_dense_engine(folder, tmp_path):
    ckpt = load_checkpoint(convert_to_gguf(folder, tmp_path / "q.gguf", Q.Q8_0))
    dense, native = Engine(ckpt, max_seq_len=64), Engine(ckpt, max_seq_len=64, weights="native")
    assert sum(native.packed.values()) >= 2 * 4  # every layer's projections run as the file stores them
    full = dense.prefill(PROMPT, all_logits=True)  # the module forward, checked against transformers above
    steps = [native.prefill(PROMPT[:14])] + [native.decode_step(t) for t in PROMPT[14:]]
    for position, b in zip(range(13, len(PROMPT)), steps, strict=True):
        a = full[position]
        # int8 inputs (floe's kernels) add ~5e-3 per product (see test_native)
        assert (a - b).norm() / a.norm() < 4e-2, position


def test_qwen3_decode_steps_equal_one_shot_prefill(folder):
    engine = Engine(load_checkpoint(folder), max_seq_len=128, n_slots=2)
    full = engine.prefill(IDS, all_logits=True)
    engine.kv_truncate(0)
    engine.prefill(IDS[:10])
    engine.prefill(IDS[10:30])  # appending a chunk to an existing prefix
    steps = [engine.decode_step(t) for t in IDS[30:]]
    torch.testing.assert_close(torch.stack(steps), full[30:], atol=1e-5, rtol=0)
    # two slots' rows in one lean step (the q/k norm per row)
    engine.kv_truncate(30)
    engine.prefill(IDS[:30], slot=1)
    assert engine.batched_decode
    for row in engine.decode_batch([IDS[30], IDS[30]], [0, 1]):
        torch.testing.assert_close(row, full[30], atol=1e-5, rtol=0)


def test_qwen3_bf16_tracks_fp32(folder):
    fp32 = Engine(load_checkpoint(folder), max_seq_len=64)
    bf16 = Engine(load_checkpoint(folder, torch.bfloat16), dtype="bfloat16", max_seq_len=64)
    for step in range(4):
        a = fp32.prefill(PROMPT) if step == 0 else fp32.decode_step(PROMPT[step])
        b = bf16.prefill(PROMPT) if step == 0 else bf16.decode_step(PROMPT[step])
        assert b.dtype == torch.float32 and (a - b).norm() / a.norm() < 2e-2, step


def _rewrite(folder, name: str, change) -> None:
    for shard in folder.glob("*.safetensors"):
        with safe_open(str(shard), framework="pt") as f:
            if name not in f.keys():
                continue
            tensors, meta = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
        tensors = change(tensors)
        save_file(tensors, str(shard), metadata=meta)


def test_the_fingerprint_and_the_logits_cover_the_qk_norm_weights(tmp_path):
    folder = save_hf_folder(tmp_path, "qwen3", tie=True)
    before = load_checkpoint(folder)
    logits = Engine(before, max_seq_len=64).prefill(PROMPT)
    name = "model.layers.0.self_attn.k_norm.weight"
    _rewrite(folder, name, lambda ts: {**ts, name: ts[name] * 1.5})
    after = load_checkpoint(folder)
    assert after.fingerprint != before.fingerprint
    assert (Engine(after, max_seq_len=64).prefill(PROMPT) - logits).abs().max() > 1e-3


def test_a_qwen3_folder_without_its_qk_norms_is_not_a_model(tmp_path):
    folder = save_hf_folder(tmp_path, "qwen3", tie=True)
    name = "model.layers.1.self_attn.q_norm.weight"
    _rewrite(folder, name, lambda ts: {k: v for k, v in ts.items() if k != name})
    with pytest.raises(NotAModel, match="q_norm"):
        load_checkpoint(folder)


@pytest.mark.parametrize("backend", ["cuda", "webgpu"])
def test_no_backend_refuses_qwen3(folder, backend):
    check_backend(load_checkpoint(folder).config, backend, 128)  # before needing the device


def test_qwen3_on_webgpu_matches_the_cpu(folder):
    """The WGSL steps (prompt chunks, decode rows) apply the q/k norm as the CPU does: logits and
    greedy tokens, on a folder as transformers writes it (head_dim 32, not hidden_size / heads)."""
    from floe.engine.webgpu import WebGPUUnavailable, adapter

    try:
        adapter()
    except WebGPUUnavailable as e:
        pytest.skip(f"no WebGPU adapter: {e}")
    ckpt = load_checkpoint(folder)
    full = Engine(ckpt, max_seq_len=128).prefill(IDS, all_logits=True)
    webgpu = Engine(ckpt, device="webgpu", max_seq_len=128)
    got = torch.stack([webgpu.prefill(IDS[:30])] + [webgpu.decode_step(t) for t in IDS[30:-1]])
    assert (got - full[29:-1]).abs().max().item() <= 1e-5  # 4.8e-7 on lavapipe; logits below 1
    assert torch.equal(got.argmax(-1), full[29:-1].argmax(-1))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("steps", list(CUDA_STEPS))
def test_qwen3_on_cuda_matches_the_cpu(folder, steps):
    """Each CUDA step (the module forward, its graph, the fused Triton graphs: a prompt graph past
    PREFILL_ROWS, decode rows, two slots at once) applies the q/k norm as the CPU does."""
    assert_cuda_matches_the_cpu(load_checkpoint(folder), CUDA_STEPS[steps], IDS * 7)  # 336 positions


def test_llama_configs_keep_their_json(folder):
    """The q/k norm is the architecture's, not a field: the config JSON (and so every existing
    model's fingerprint) is what it was."""
    c = load_checkpoint(folder).config
    assert "qk_norm" not in c.to_json() and np.isclose(c.norm_eps, 1e-5)
