"""`floe bench decode`'s shapes (config.KNOWN_SHAPES): Qwen3-0.6B/1.7B/8B and Gemma-3-1B/4B beside the
Llama ones. Each builds at its real size on the meta device (no memory) with the parameter count of
the real model, and at a tiny width (the real head layout, heads, window pattern and rotary) from seeded
random weights runs a decode step on the CPU's lean step, equal to the module forward and to the
benchmark's transformers peer on the same weights."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from floe.bench import agreement, decode_bytes, hf_model
from floe.cli import KNOWN_SHAPE_NAMES
from floe.engine import Engine
from floe.engine.cpu_decode import CpuDecoder
from floe.engine.transformer import Transformer
from floe.model.config import KNOWN_SHAPES, ModelConfig
from floe.model.synthetic import random_checkpoint, weight_shapes

NEW = {"qwen3-0.6b": 0.60e9, "qwen3-1.7b": 1.72e9, "qwen3-8b": 8.19e9, "gemma-3-1b": 1.00e9,
       "gemma-3-4b": 3.88e9}  # parameters (the published counts; Gemma 3 4B's text model alone)


def test_the_cli_offers_every_known_shape():
    from floe.cli import build_parser

    assert set(KNOWN_SHAPE_NAMES) == set(KNOWN_SHAPES) >= set(NEW)
    args = build_parser().parse_args(["bench", "decode", "--shape", "qwen3-0.6b", "--shape", "gemma-3-4b"])
    assert args.shape == ["qwen3-0.6b", "gemma-3-4b"]


@pytest.mark.parametrize("shape", NEW)
def test_each_new_shape_builds_at_its_real_size_on_meta(shape):
    c = KNOWN_SHAPES[shape]
    with torch.device("meta"):
        model = Transformer(c, 256)
    params = sum(p.numel() for p in model.parameters())
    assert params == c.n_params == sum(torch.Size(s).numel() for s in weight_shapes(c).values())
    assert params == pytest.approx(NEW[shape], rel=0.02)
    assert c.qk_norm and c.head_dim == (256 if c.arch == "gemma3" else 128)
    if c.arch == "gemma3":
        assert [c.layer_window(i) is None for i in range(6)] == [False] * 5 + [True]
        # (the CPU's and CUDA's fused steps, WebGPU's shaders; not CUDA's reference graph)
        assert c.llama_step_lacks() == c.llama_step_lacks("cuda") == c.llama_step_lacks("webgpu") == []
        assert "a rotary base per layer" in c.llama_step_lacks("cuda-graph")


def tiny(shape: str) -> ModelConfig:
    """The shape at a tiny width (dim 64, ffn 128, a vocabulary of 1024, 6 layers: a Gemma 3 global
    layer among them) with its heads, head_dim, window and rotary."""
    c = KNOWN_SHAPES[shape]
    fields = dict(dim=64, ffn_dim=128, vocab_size=1024, n_layers=6, name=f"tiny-{shape}")
    if c.arch == "gemma3":
        fields.update(embedding_scale=8.0, sliding_window=16)  # sqrt(dim); windows past the prompt
    return dataclasses.replace(c, **fields)


@pytest.mark.parametrize("shape", NEW)
def test_each_new_shape_runs_a_lean_cpu_step_equal_to_the_module_forward_and_the_peer(shape):
    checkpoint = random_checkpoint(tiny(shape), None, dtype=torch.float32, scale=0.1)
    lean, module = (Engine(checkpoint, max_seq_len=128, fused_kernels=fused) for fused in (True, False))
    ids = list(range(100, 140))
    for engine in (lean, module):
        engine.prefill(ids)
    a, b = lean.decode_step(300), module.decode_step(300)
    assert isinstance(lean._batch, CpuDecoder) and a.shape == (1024,)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-4 * float(b.abs().max()))
    assert int(a.argmax()) == int(b.argmax())
    c = checkpoint.config  # fp32, every weight once: one embedding row but where the table is the head
    assert decode_bytes(lean) == 4 * (c.n_params - (0 if c.tie_embeddings else (c.vocab_size - 1) * c.dim))
    peer = agreement(lean, hf_model(lean))  # 64 positions: past Gemma's window of 16
    assert peer["rel_error"] < 1e-5 and peer["same_argmax"], peer
