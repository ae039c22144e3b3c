"""Mistral (Llama's layers, attention limited to a sliding window of the last W positions) gives
transformers' logits and greedy tokens, from a Hugging Face folder and from the same weights as
llama.cpp writes them in GGUF (general.architecture llama, Q/K permuted); the window changes what a
prompt longer than it computes; CUDA's reference graph, which attends over the whole context, refuses it
by name."""

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from models import CUDA_STEPS, assert_cuda_matches_the_cpu, convert_to_gguf, save_hf_folder
from models import assert_matches_transformers as assert_matches

from floe.engine import Engine
from floe.engine.weights import check_backend
from floe.errors import UnsupportedModel
from floe.model import load_checkpoint

WINDOW = 8
IDS = [1, 504, 3575, 282, 4649, 314, 7042, 30, 17, 42, 9000, 31000] * 4  # 48 positions: 6 windows
PROMPT, N_NEW = IDS[:20], 8


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_hf_folder(tmp_path_factory.mktemp("mistral"), "mistral", tie=False, sliding_window=WINDOW)


@pytest.fixture(scope="module")
def reference(folder):
    """transformers' Mistral on the folder's weights."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def test_mistral_config_from_an_hf_folder(folder):
    c = load_checkpoint(folder).config
    assert (c.arch, c.sliding_window, c.window_limits(128), c.window_limits(WINDOW)) == (
        "mistral", WINDOW, True, False)
    assert f'"sliding_window":{WINDOW}' in c.to_json()  # the window is part of the fingerprint


def test_mistral_hf_folder_matches_transformers(folder, reference):
    assert len(list(folder.glob("*.safetensors"))) > 1  # sharded
    assert_matches(folder, reference)


def test_the_window_matters_past_its_length(folder, tmp_path):
    """Same weights without a window: the same logits for the first WINDOW positions, others after."""
    whole = save_hf_folder(tmp_path, "mistral", tie=False, sliding_window=None)
    assert load_checkpoint(whole).config.sliding_window is None
    windowed = Engine(load_checkpoint(folder), max_seq_len=128).prefill(IDS, all_logits=True)
    unwindowed = Engine(load_checkpoint(whole), max_seq_len=128).prefill(IDS, all_logits=True)
    torch.testing.assert_close(windowed[:WINDOW], unwindowed[:WINDOW], atol=1e-5, rtol=0)
    assert ((windowed - unwindowed)[WINDOW:].abs().amax(-1) > 1e-2).all()


def test_mistral_gguf_matches_transformers(folder, reference, tmp_path):
    path = convert_to_gguf(folder, tmp_path / "mistral.gguf")
    c = load_checkpoint(path).config
    assert (c.arch, c.sliding_window, c.tie_embeddings) == ("llama", WINDOW, False)
    assert_matches(path, reference)


def test_mistral_decode_steps_equal_one_shot_prefill(folder):
    """The lean step's rows, a chunk appended past the window and two slots at once all see the
    window as the one-shot prompt does."""
    engine = Engine(load_checkpoint(folder), max_seq_len=128, n_slots=2)
    full = engine.prefill(IDS, all_logits=True)
    engine.kv_truncate(0)
    engine.prefill(IDS[:10])
    engine.prefill(IDS[10:30])  # a chunk whose first query's window starts past position 0
    steps = [engine.decode_step(t) for t in IDS[30:]]
    torch.testing.assert_close(torch.stack(steps), full[30:], atol=1e-5, rtol=0)
    engine.kv_truncate(30)
    engine.prefill(IDS[:30], slot=1)
    assert engine.batched_decode
    for row in engine.decode_batch([IDS[30], IDS[30]], [0, 1]):
        torch.testing.assert_close(row, full[30], atol=1e-5, rtol=0)


def test_native_quantized_mistral_tracks_the_dense_engine(folder, tmp_path):
    """floe's kernels for the projections, PyTorch's ops for the windowed attention."""
    ckpt = load_checkpoint(convert_to_gguf(folder, tmp_path / "q.gguf", Q.Q8_0))
    dense, native = Engine(ckpt, max_seq_len=64), Engine(ckpt, max_seq_len=64, weights="native")
    assert sum(native.packed.values()) >= 2 * 4
    full = dense.prefill(PROMPT, all_logits=True)
    steps = [native.prefill(PROMPT[:14])] + [native.decode_step(t) for t in PROMPT[14:]]
    for position, b in zip(range(13, len(PROMPT)), steps, strict=True):
        a = full[position]
        assert (a - b).norm() / a.norm() < 4e-2, position  # int8 inputs: ~5e-3 per product


def test_cudas_reference_graph_refuses_the_window_by_name(folder):
    c = load_checkpoint(folder).config
    with pytest.raises(UnsupportedModel, match=f"mistral.*sliding-window.*{WINDOW}.*fused_kernels=True"):
        check_backend(c, "cuda-graph", 128)
    check_backend(c, "cuda-graph", WINDOW)  # a context no longer than the window: the window never applies
    for backend in ("cuda", "webgpu", "cpu"):  # CUDA's fused step and module forward, WebGPU's shaders
        check_backend(c, backend, 128)  # mask it (tests/test_webgpu.py: its greedy tokens are the CPU's)


def test_a_qwen_folder_with_its_partial_sliding_window_is_refused_by_name():
    from floe.model.hf_folder import config_from_hf

    cfg = {"model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
           "intermediate_size": 160, "vocab_size": 100, "sliding_window": 8}
    assert config_from_hf(cfg, "q").sliding_window is None  # unused without use_sliding_window
    with pytest.raises(UnsupportedModel, match="qwen2 with use_sliding_window"):
        config_from_hf({**cfg, "use_sliding_window": True}, "q")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("steps", ["eager", "fused"])
def test_the_window_on_cuda_matches_the_cpu(folder, steps):
    """A window of 8 over 336 positions on CUDA's module forward and its fused Triton graphs (a prompt
    graph's flash attention, decode rows, a short prompt in the rows' graph, two slots at once)."""
    assert_cuda_matches_the_cpu(load_checkpoint(folder), CUDA_STEPS[steps], IDS * 7)
