"""A loaded model: config, canonical weights, tokenizer and fingerprint, whatever file it came from."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import xxhash

from floe.errors import NotAModel
from floe.model.config import ModelConfig, partial_rotary_order
from floe.model.quant import QuantizedWeight
from floe.model.tokenizer import Tokenizer

# Called after each tensor is read: (tensors done, tensors total, name).
Progress = Callable[[int, int, str], None]
# A file's stored tensors as the fingerprint sees them: (name in the file, stored type, shape, bytes).
StoredTensors = Callable[[], Iterator[tuple[str, str, tuple[int, ...], np.ndarray]]]

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
POST_NORMS = ("post_attention_norm.weight", "post_ffn_norm.weight")  # Gemma's


# Smaller tensors are copied out of a file's mapping: touching a mapped byte maps the page cache's
# whole folio around it (up to 2 MB on Linux 6.x) into this process's resident memory, so a mapped
# norm of a few KB could cost 2 MB.
MAPPED_FROM = 1 << 21


def mapped(t: torch.Tensor) -> torch.Tensor:
    """`t`, a view of a file's mapping, kept as the view if it is large enough to pay for it
    (MAPPED_FROM bytes), else copied (and the mapping let go)."""
    return t if t.nbytes >= MAPPED_FROM else t.clone()


class Lazy(Mapping):
    """Values made by their loader when asked for and never kept (e.g. a file's quantized weights:
    views of its memory map, rows reordered where the file permutes them)."""

    def __init__(self, loaders: dict[str, Callable]) -> None:
        self._loaders = loaders

    def __getitem__(self, name: str):
        return self._loaders[name]()

    def __contains__(self, name: object) -> bool:
        return name in self._loaders

    def __iter__(self) -> Iterator[str]:
        return iter(self._loaders)

    def __len__(self) -> int:
        return len(self._loaders)


class LazyWeights(Lazy):
    """A file's weights by canonical name, each read when asked for and never kept: every access
    returns a new tensor, or a view of the file's memory map where the file stores it as asked.
    `weights[name]` gives the checkpoint's dtype; `weights.load(name, dtype)` any other, without a
    float32 copy of the whole tensor on the way."""

    def __init__(self, loaders: dict[str, Callable[[torch.dtype], torch.Tensor]], dtype: torch.dtype) -> None:
        super().__init__(loaders)
        self.dtype = dtype

    def load(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        return self._loaders[name](dtype)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.load(name, self.dtype)


@dataclass
class Checkpoint:
    """A model as read from its file. A file's `weights` and `quantized` are lazy (LazyWeights,
    Lazy): an engine takes each tensor once, and holding the checkpoint pins nothing but the
    file's mapping. Synthetic checkpoints hold plain dicts."""

    config: ModelConfig
    weights: Mapping[str, torch.Tensor]
    tokenizer: Tokenizer
    fingerprint: str
    source: Path
    file_type: str  # what the file stores: "Q4_1", "bfloat16", ...
    # The file's own bytes of each block-quantized 2-D weight, by canonical name (rows in the same
    # order as `weights`); an engine may run these natively instead of the dequantized tensors.
    quantized: Mapping[str, QuantizedWeight] = field(default_factory=dict)
    # The file's tensors for the fingerprint (None: not from a file); see legacy_fingerprint.
    stored: StoredTensors | None = field(default=None, repr=False)
    v1_fingerprint: str | None = field(default=None, repr=False)  # once legacy_fingerprint() ran

    @property
    def name(self) -> str:
        return self.config.name or self.source.stem

    def check_complete(self) -> None:
        """Raise NotAModel naming what the file lacks of the weights its config calls for."""
        missing = sorted(self.expected_weight_names() - set(self.weights))
        if missing:
            more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
            raise NotAModel(f"{self.source} lacks weight {missing[0]}{more} that its config calls for")

    def weight(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """Canonical weight `name` in `dtype`, read now (a view of the file where it stores it so)."""
        if isinstance(self.weights, LazyWeights):
            return self.weights.load(name, dtype)
        return self.weights[name].to(dtype)

    def legacy_fingerprint(self) -> str | None:
        """The fingerprint floe gave this model before model scheme v2 (a SHA-256 of every stored
        byte: ~0.6 GB/s, so computed only when asked, e.g. to thaw a snapshot made then); None for a
        checkpoint not read from a file, whose fingerprint never changed."""
        if self.stored is not None and self.v1_fingerprint is None:
            self.v1_fingerprint = model_fingerprint(self.config, self.stored(), legacy=True)
        return self.v1_fingerprint

    def expected_weight_names(self) -> set[str]:
        names = {"tok_embeddings.weight", "norm.weight"}
        if not self.config.tie_embeddings:
            names.add("output.weight")
        per_layer = LAYER_WEIGHTS + (QKV_BIASES if self.config.qkv_bias else ()) + (
            POST_NORMS if self.config.post_norms else ())
        for i in range(self.config.n_layers):
            names.update(f"layers.{i}.{w}" for w in per_layer)
        return names


def model_fingerprint(config: ModelConfig, tensors, legacy: bool = False,
                      progress: Progress | None = None, total: int = 0) -> str:
    """SHA-256 over the canonical config JSON and, per stored tensor (name, type, shape, bytes), its
    name, type, shape and the XXH3-128 of its exact bytes (scheme v2: XXH3 runs at memory speed and
    releases the GIL; SHA-256 of every byte, scheme v1, took ~28 s for 16 GB). `legacy`: scheme v1,
    the bytes themselves into the SHA-256. Each tensor's bytes are read once and let go."""
    h = hashlib.sha256(b"floe-model-v1\0" if legacy else b"floe-model-v2\0")
    h.update(config.to_json().encode())
    for done, (name, kind, shape, data) in enumerate(tensors, 1):
        h.update(f"\0{name}\0{kind}\0{shape}\0".encode())
        view = memoryview(np.ascontiguousarray(data).reshape(-1).view(np.uint8))
        h.update(view if legacy else xxhash.xxh3_128_digest(view))
        if progress:
            progress(done, total, name)
    return h.hexdigest()


# Fused tensors a file may store (Phi-3's qkv_proj and gate_up_proj): the canonical weights they
# stack by rows, in order. Readers split them at load; the engine stacks its own fusions again.
FUSED_PARTS = {
    "qkv": ("attention.wq.weight", "attention.wk.weight", "attention.wv.weight"),
    "gate_up": ("feed_forward.w1.weight", "feed_forward.w3.weight"),
}


# The canonical weights whose rows rotary reads (each head's q or k dimensions).
ROTARY_WEIGHTS = ("wq.weight", "wk.weight", "wq.bias", "wk.bias")


def weight_rows(c: ModelConfig, name: str) -> int:
    """Rows of canonical layer weight `name`, a projection's (a part of FUSED_PARTS, or a Q/K bias)."""
    module = name.rsplit(".", 1)[0]
    if module.endswith("wq"):
        return c.n_heads * c.head_dim
    if module.endswith(("wk", "wv")):
        return c.n_kv_heads * c.head_dim
    return c.ffn_dim


def rotary_rows(c: ModelConfig, name: str, rows: torch.Tensor) -> torch.Tensor:
    """The stored rows `rows` (indices) of canonical weight `name` in the order the engine runs them:
    with a partial rotary, each Q and K head's rows in partial_rotary_order; else as they are."""
    if not c.rotary_dim or not name.endswith(ROTARY_WEIGHTS):
        return rows
    order = partial_rotary_order(c.head_dim, c.rotary_dim)
    return rows.view(-1, c.head_dim)[:, order].reshape(-1)


def fused_part_rows(c: ModelConfig, kind: str, layer: int) -> list[tuple[str, torch.Tensor]]:
    """(canonical name, the stored rows it takes) of each part of layer `layer`'s fused `kind`
    tensor (FUSED_PARTS), its rotary rows reordered (rotary_rows)."""
    parts, start = [], 0
    for part in FUSED_PARTS[kind]:
        name, n = f"layers.{layer}.{part}", weight_rows(c, part)
        parts.append((name, rotary_rows(c, name, torch.arange(start, start + n))))
        start += n
    return parts


def take_rows(w: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """Rows `rows` of w (None: w): a view where they are consecutive, else a copy."""
    if rows is None:
        return w
    first = int(rows[0])
    if torch.equal(rows, torch.arange(first, first + len(rows))):
        return w.narrow(0, first, len(rows))
    return w.index_select(0, rows)


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
