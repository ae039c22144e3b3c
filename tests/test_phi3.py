"""Phi-3 (fused qkv_proj and gate_up_proj, a partial rotary, a sliding window, LongRoPE) gives
transformers' logits and greedy tokens, from a Hugging Face folder and from the same weights as
llama.cpp writes them in GGUF (general.architecture phi3, attn_qkv and ffn_up fused,
rope.dimension_count, rope_factors_short/long). The fused tensors are split at load and the partial
rotary is a reordering of each head's Q/K rows, so every engine's half-split rotary runs it."""

import math

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from models import CUDA_STEPS, assert_cuda_matches_the_cpu, convert_to_gguf, reference_logits, save_hf_folder
from models import assert_matches_transformers as assert_matches

from floe.engine import Engine
from floe.engine.weights import check_backend
from floe.errors import UnsupportedModel
from floe.model import load_checkpoint
from floe.model.config import partial_rotary_order

WINDOW = 8
IDS = [1, 504, 3575, 282, 4649, 314, 7042, 30, 17, 42, 9000, 31000] * 4  # 48 positions
PROMPT, N_NEW = IDS[:20], 8


def transformers_model(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """Half of each head rotates, as in Phi-4-mini (0.75); attention sees the last WINDOW positions."""
    return save_hf_folder(tmp_path_factory.mktemp("phi3"), "phi3", tie=False, sliding_window=WINDOW,
                          partial_rotary=0.5)


@pytest.fixture(scope="module")
def long_folder(tmp_path_factory):
    """LongRoPE: pretrained on 32 positions, extended to 512; no window."""
    return save_hf_folder(tmp_path_factory.mktemp("phi3-long"), "phi3", tie=False, partial_rotary=0.5,
                          long_rope=True, seed=1)


def test_phi3_config_from_an_hf_folder(folder, long_folder):
    c = load_checkpoint(folder).config
    assert (c.arch, c.head_dim, c.rotary_dim, c.sliding_window, c.long_rope) == ("phi3", 16, 8, WINDOW, None)
    r = load_checkpoint(long_folder).config.long_rope
    assert (len(r.short_factor), r.original_max_position_embeddings) == (4, 32)
    assert r.attention_factor == pytest.approx(math.sqrt(1 + math.log(512 / 32) / math.log(32)))


def test_the_partial_rotary_order_pairs_rotary_dims_and_passes_the_rest():
    order = partial_rotary_order(16, 8).tolist()
    assert order == [0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15]
    assert sorted(order) == list(range(16))


def test_phi3_hf_folder_matches_transformers(folder):
    assert len(list(folder.glob("*.safetensors"))) > 1  # sharded
    assert_matches(folder, transformers_model(folder))


def test_phi3_gguf_matches_transformers(folder, tmp_path):
    path = convert_to_gguf(folder, tmp_path / "phi3.gguf")
    c = load_checkpoint(path).config
    assert (c.arch, c.rotary_dim, c.sliding_window) == ("phi3", 8, WINDOW)
    assert_matches(path, transformers_model(folder))


@pytest.mark.parametrize("source", ["folder", "gguf"])
def test_long_rope_short_factors_within_the_pretraining_length(long_folder, tmp_path, source):
    """A context no longer than the pretraining length (32) runs the short factors, as transformers
    does for sequences that short (prompt and greedy tokens: 28 positions)."""
    path = long_folder if source == "folder" else convert_to_gguf(long_folder, tmp_path / "long.gguf")
    assert_matches(path, transformers_model(long_folder), max_seq_len=32)


@pytest.mark.parametrize("source", ["folder", "gguf"])
def test_long_rope_long_factors_past_the_pretraining_length(long_folder, tmp_path, source):
    """A longer context runs the long factors (llama.cpp's choice, by context): transformers runs
    them for a 48-position forward."""
    path = long_folder if source == "folder" else convert_to_gguf(long_folder, tmp_path / "long.gguf")
    ours = Engine(load_checkpoint(path), max_seq_len=128).prefill(IDS, all_logits=True)
    ref = reference_logits(transformers_model(long_folder), IDS)
    assert (ours - ref).abs().max().item() <= 1e-4
    short = Engine(load_checkpoint(path), max_seq_len=32).prefill(IDS[:32], all_logits=True)
    assert (short - ours[:32]).abs().max() > 1e-3  # 10x the tolerance: the two factor sets differ


def test_phi3_decode_steps_equal_one_shot_prefill(folder):
    engine = Engine(load_checkpoint(folder), max_seq_len=128, n_slots=2)
    full = engine.prefill(IDS, all_logits=True)
    engine.kv_truncate(0)
    engine.prefill(IDS[:10])
    engine.prefill(IDS[10:30])
    steps = [engine.decode_step(t) for t in IDS[30:]]
    torch.testing.assert_close(torch.stack(steps), full[30:], atol=1e-5, rtol=0)
    engine.kv_truncate(30)
    engine.prefill(IDS[:30], slot=1)
    for row in engine.decode_batch([IDS[30], IDS[30]], [0, 1]):
        torch.testing.assert_close(row, full[30], atol=1e-5, rtol=0)


def test_native_quantized_phi3_tracks_the_dense_engine(long_folder, tmp_path):
    """No window: floe's own attend operator (its half-split rotary over the reordered rows) and
    kernels for the split Q8_0 parts of the fused tensors."""
    ckpt = load_checkpoint(convert_to_gguf(long_folder, tmp_path / "q.gguf", Q.Q8_0))
    dense, native = Engine(ckpt, max_seq_len=64), Engine(ckpt, max_seq_len=64, weights="native")
    assert sum(native.packed.values()) >= 2 * 4
    full = dense.prefill(PROMPT, all_logits=True)
    steps = [native.prefill(PROMPT[:14])] + [native.decode_step(t) for t in PROMPT[14:]]
    for position, b in zip(range(13, len(PROMPT)), steps, strict=True):
        a = full[position]
        assert (a - b).norm() / a.norm() < 4e-2, position  # int8 inputs: ~5e-3 per product


def test_backends_run_phi3_and_cudas_reference_graph_refuses_a_short_window_by_name(folder, long_folder):
    for backend in ("cuda-graph", "webgpu"):
        check_backend(load_checkpoint(long_folder).config, backend, 128)
    with pytest.raises(UnsupportedModel, match=f"phi3.*sliding-window.*{WINDOW}"):
        check_backend(load_checkpoint(folder).config, "cuda-graph", 128)
    check_backend(load_checkpoint(folder).config, "webgpu", 128)  # (its shaders mask a window; CUDA's fused
    # step and its module forward too)


def test_an_unknown_phi3_rope_scaling_is_refused_by_name():
    from floe.model.hf_folder import config_from_hf

    cfg = {"model_type": "phi3", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
           "intermediate_size": 160, "vocab_size": 100, "rope_scaling": {"type": "dynamic", "factor": 2.0}}
    with pytest.raises(UnsupportedModel, match="'dynamic'"):
        config_from_hf(cfg, "p")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("steps", list(CUDA_STEPS))
def test_phi3_on_cuda_matches_the_cpu(long_folder, steps):
    """The partial rotary and LongRoPE are the tables' and the rows' order: CUDA's steps run them."""
    assert_cuda_matches_the_cpu(load_checkpoint(long_folder), CUDA_STEPS[steps], IDS * 7,  # 336 positions
                                two_slots=False)
