"""A loaded model: config, canonical weights, tokenizer and fingerprint, whatever file it came from."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from floe.model.config import ModelConfig
from floe.model.quant import QuantizedWeight
from floe.model.tokenizer import Tokenizer

# Called after each tensor is read: (tensors done, tensors total, name).
Progress = Callable[[int, int, str], None]

# Canonical weight names (gpt-fast's, HF rotary order). Loaders translate to these; the engine fuses.
LAYER_WEIGHTS = (
    "attention_norm.weight",
    "attention.wq.weight",
    "attention.wk.weight",
    "attention.wv.weight",
    "attention.wo.weight",
    "ffn_norm.weight",
    "feed_forward.w1.weight",  # gate
    "feed_forward.w3.weight",  # up
    "feed_forward.w2.weight",  # down
)
QKV_BIASES = ("attention.wq.bias", "attention.wk.bias", "attention.wv.bias")


@dataclass
class Checkpoint:
    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    fingerprint: str
    source: Path
    file_type: str  # what the file stores: "Q4_1", "bfloat16", ...
    # The file's own bytes of each block-quantized 2-D weight, by canonical name (rows in the same
    # order as `weights`); an engine may run these natively instead of the dequantized tensors.
    quantized: dict[str, QuantizedWeight] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.config.name or self.source.stem

    def expected_weight_names(self) -> set[str]:
        names = {"tok_embeddings.weight", "norm.weight"}
        if not self.config.tie_embeddings:
            names.add("output.weight")
        per_layer = LAYER_WEIGHTS + (QKV_BIASES if self.config.qkv_bias else ())
        for i in range(self.config.n_layers):
            names.update(f"layers.{i}.{w}" for w in per_layer)
        return names


class Fingerprint:
    """Stable SHA-256 of a model's config and the exact bytes of its stored tensors."""

    def __init__(self, config_json: str) -> None:
        self._h = hashlib.sha256(b"floe-model-v1\0")
        self._h.update(config_json.encode())

    def add(self, name: str, kind: str, shape: tuple[int, ...], data: np.ndarray) -> None:
        self._h.update(f"\0{name}\0{kind}\0{shape}\0".encode())
        self._h.update(memoryview(np.ascontiguousarray(data).reshape(-1).view(np.uint8)))

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def unpermute_rotary_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation: adjacent rotary pairs back to HF half-split order."""
    out = w.shape[0]
    head_dim = out // n_heads
    rest = w.shape[1:]
    return w.reshape(n_heads, head_dim // 2, 2, *rest).swapaxes(1, 2).reshape(out, *rest)


def permute_rotary_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp's converter permutation (HF half-split -> adjacent pairs); inverse of the above."""
    out = w.shape[0]
    head_dim = out // n_heads
    rest = w.shape[1:]
    return w.reshape(n_heads, 2, head_dim // 2, *rest).swapaxes(1, 2).reshape(out, *rest)
