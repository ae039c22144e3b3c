"""Seeded random weights at real architectures' shapes, for benchmarks where no weights file is
present (GPU-scale shapes such as Llama-3.2-1B, Llama-3-8B, Qwen3-8B and Gemma-3-4B). Never a download."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from floe.model.checkpoint import LAYER_WEIGHTS, POST_NORMS, QKV_BIASES, Checkpoint
from floe.model.config import KNOWN_SHAPES, ModelConfig
from floe.model.tokenizer import Tokenizer


def weight_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Canonical weight name -> shape for a config."""
    q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    per_layer = {
        "attention_norm.weight": (c.dim,), "attention.wq.weight": (q, c.dim),
        "attention.wk.weight": (kv, c.dim), "attention.wv.weight": (kv, c.dim),
        "attention.wo.weight": (c.dim, q), "ffn_norm.weight": (c.dim,),
        "feed_forward.w1.weight": (c.ffn_dim, c.dim), "feed_forward.w3.weight": (c.ffn_dim, c.dim),
        "feed_forward.w2.weight": (c.dim, c.ffn_dim),
        "attention.wq.bias": (q,), "attention.wk.bias": (kv,), "attention.wv.bias": (kv,),
        "attention.q_norm.weight": (c.head_dim,), "attention.k_norm.weight": (c.head_dim,),
        "post_attention_norm.weight": (c.dim,), "post_ffn_norm.weight": (c.dim,),
    }
    names = LAYER_WEIGHTS + (QKV_BIASES if c.qkv_bias else ()) + (POST_NORMS if c.post_norms else ()) + (
        ("attention.q_norm.weight", "attention.k_norm.weight") if c.qk_norm else ())
    shapes = {"tok_embeddings.weight": (c.vocab_size, c.dim), "norm.weight": (c.dim,)}
    if not c.tie_embeddings:
        shapes["output.weight"] = (c.vocab_size, c.dim)
    for i in range(c.n_layers):
        shapes.update({f"layers.{i}.{n}": per_layer[n] for n in names})
    return shapes


def random_checkpoint(shape: str | ModelConfig, tokenizer: Tokenizer, *, seed: int = 0,
                      dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu",
                      scale: float = 0.02) -> Checkpoint:
    """A Checkpoint of N(0, scale²) weights (norms near 1) at `shape`, generated on `device`.

    The same (shape, seed) gives the same weights on any device of one kind; its fingerprint names
    the shape and seed.
    """
    config = KNOWN_SHAPES[shape] if isinstance(shape, str) else shape
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    weights = {}
    for name, dims in weight_shapes(config).items():
        w = torch.randn(dims, generator=gen, device=device, dtype=torch.float32)
        w = 1.0 + 0.1 * w if name.endswith("norm.weight") else w * scale
        weights[name] = w.to(dtype)
    digest = hashlib.sha256(f"floe-random-v1\0{config.to_json()}\0{seed}\0{scale}".encode())
    return Checkpoint(config=config, weights=weights, tokenizer=tokenizer, fingerprint=digest.hexdigest(),
                      source=Path(f"random:{config.name or 'custom'}:seed{seed}"),
                      file_type=f"random {str(dtype).removeprefix('torch.')}")
