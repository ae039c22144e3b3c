"""The shape of a Llama-family transformer, independent of the file it came from."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field

import torch

ARCHITECTURES = ("gemma2", "gemma3", "llama", "mistral", "phi3", "qwen2", "qwen3")
# Architectures that RMS-normalise each head's q and k (over head_dim, before rotary): Qwen3, Gemma 3.
QK_NORM_ARCHITECTURES = frozenset({"qwen3", "gemma3"})
# Gemma's RMSNorms scale by (1 + w): their files store w, and the readers add the 1 at load (as
# llama.cpp's converter does), so every canonical norm weight is the multiplier itself.
UNIT_OFFSET_NORM_ARCHITECTURES = frozenset({"gemma2", "gemma3"})
ACTIVATIONS = ("silu", "gelu_tanh")


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency-dependent RoPE scaling (rope_type "llama3")."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class LongRope:
    """Phi-3's LongRoPE ("longrope", formerly "su"): per-frequency divisors, one set for contexts up
    to the pretraining length and one beyond it, and a factor on cos and sin."""

    short_factor: tuple[float, ...]
    long_factor: tuple[float, ...]
    original_max_position_embeddings: int
    attention_factor: float


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab_size: int
    context_length: int
    head_dim: int = 0
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    qkv_bias: bool = False
    tie_embeddings: bool = False
    name: str = ""
    # Per-dimension divisors of the rotary frequencies, when the file ships them (GGUF rope_freqs).
    rope_freq_factors: tuple[float, ...] | None = field(default=None, repr=False)
    # Sliding-window attention (Mistral): a query sees the last `sliding_window` positions, itself
    # included. None: the whole context.
    sliding_window: int | None = None
    # Partial rotary (Phi-3 with partial_rotary_factor): only each head's first rotary_dim dimensions
    # rotate (0: all of head_dim). The readers reorder Q/K rows so the engines' half-split rotary
    # does it (partial_rotary_order).
    rotary_dim: int = 0
    long_rope: LongRope | None = None
    # Gemma 2 and 3 (each left out of the config JSON when unset; see _LATER_FIELDS):
    # the gate's activation (gelu_tanh: GeGLU with GELU's tanh approximation),
    activation: str = "silu"
    # the factor on the embedding rows (Gemma: sqrt(dim); the tied head reads the table unscaled),
    embedding_scale: float = 1.0
    # a norm after attention and one after the feed-forward, before each joins the residual stream,
    post_norms: bool = False
    # the factor on q·k (None: head_dim ** -0.5; Gemma: query_pre_attn_scalar ** -0.5),
    attention_scale: float | None = None
    # tanh soft-capping, cap * tanh(x / cap), of the attention scores and of the final logits,
    attn_softcap: float | None = None
    logit_softcap: float | None = None
    # the window on every n-th layer but one: layer i is global when (i + 1) % n == 0 (Gemma 2: 2,
    # Gemma 3: 6; 0: every layer has the window),
    sliding_window_pattern: int = 0
    # and the rotary base of the windowed layers (Gemma 3; None: rope_theta).
    rope_local_theta: float | None = None
    # Linear rope scaling (Gemma 3 4B-27B): the global layers' frequencies divided by this factor
    # (the windowed layers' base, rope_local_theta, is not scaled).
    rope_linear_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation {self.activation!r}: floe computes {', '.join(ACTIVATIONS)}")

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer `layer` (None: it attends over the whole context)."""
        n = self.sliding_window_pattern
        return None if n and (layer + 1) % n == 0 else self.sliding_window

    def layer_rope_theta(self, layer: int) -> float:
        """The rotary base of layer `layer` (Gemma 3's windowed layers have their own)."""
        local = self.rope_local_theta is not None and self.layer_window(layer) is not None
        return self.rope_local_theta if local else self.rope_theta

    def beyond_llama(self) -> list[str]:
        """What this model computes beyond a Llama layer with q/k norm, bias and window hooks: none for
        Llama, Mistral, Phi-3 and Qwen; Gemma's extras (GeGLU, scaled embeddings, post-norms, its query
        scale, soft-capping, a window on some layers, a rotary base per layer)."""
        lacks = [f"{self.activation} gate"] if self.activation != "silu" else []
        lacks += ["scaled embeddings"] if self.embedding_scale != 1.0 else []
        lacks += ["post-attention and post-feed-forward norms"] if self.post_norms else []
        lacks += ["a query scale other than head_dim ** -0.5"] if self.attention_scale is not None else []
        lacks += ["attention soft-capping"] if self.attn_softcap else []
        lacks += ["logit soft-capping"] if self.logit_softcap else []
        if self.sliding_window and self.sliding_window_pattern:
            lacks.append("a window on some layers only")
        lacks += ["a rotary base per layer"] if self.rope_local_theta is not None else []
        return lacks

    def llama_step_lacks(self, backend: str = "cpu") -> list[str]:
        """What the decode step of `backend` lacks for this model: "cpu" (its lean step), "cuda" (the
        fused Triton graphs; the module forward without graphs) and "webgpu" (its shaders) have Gemma's
        hooks too (nothing); "cuda-graph" (CUDA's reference graph of one slot, without the fused
        kernels) computes Llama's layer with the q/k norm and bias hooks only (`beyond_llama`: Gemma's
        list; nor does it mask a window: floe.engine.weights.check_backend)."""
        return [] if backend in ("cpu", "cuda", "webgpu") else self.beyond_llama()

    def window_limits(self, max_seq_len: int) -> bool:
        """Whether the sliding window is shorter than a context of max_seq_len positions (else every
        query sees every earlier position anyway)."""
        return self.sliding_window is not None and self.sliding_window < max_seq_len

    @property
    def qk_norm(self) -> bool:
        """Whether each head's q and k go through an RMSNorm of their own (weights [head_dim])."""
        # Decided by the architecture, not a field: the config's JSON (the fingerprint) is unchanged.
        return self.arch in QK_NORM_ARCHITECTURES

    def qk_norm_weights(self) -> list[str]:
        """The canonical names of the q/k norm weights the architecture calls for (none: [])."""
        if not self.qk_norm:
            return []
        return [f"layers.{i}.attention.{w}_norm.weight" for i in range(self.n_layers) for w in "qk"]

    @property
    def n_params(self) -> int:
        """Parameter count (embeddings counted once when tied)."""
        attn = self.dim * self.head_dim * (2 * self.n_heads + 2 * self.n_kv_heads)
        if self.qkv_bias:
            attn += self.head_dim * (self.n_heads + 2 * self.n_kv_heads)
        if self.qk_norm:
            attn += 2 * self.head_dim
        layer = attn + 3 * self.dim * self.ffn_dim + (4 if self.post_norms else 2) * self.dim
        emb = self.vocab_size * self.dim * (1 if self.tie_embeddings else 2)
        return self.n_layers * layer + emb + self.dim

    def to_json(self) -> str:
        """Canonical JSON (sorted keys), the config part of the model fingerprint."""
        fields = dataclasses.asdict(self)
        for name, unset in _LATER_FIELDS.items():
            if fields[name] == unset:  # absent, as before the field: earlier fingerprints hold
                del fields[name]
        return json.dumps(fields, sort_keys=True, separators=(",", ":"))

    def inv_freq(self, max_seq_len: int = 0, theta: float | None = None) -> torch.Tensor:
        """Rotary inverse frequencies, float64, shape [head_dim // 2], for a context of max_seq_len
        positions (LongRoPE's long factors past its pretraining length, as llama.cpp chooses by its
        context). With a partial rotary, the first rotary_dim // 2 rotate and the rest are 0 (cos 1,
        sin 0: dimensions that pass through). theta: the base (None: rope_theta, with the linear
        factor; a windowed layer's own base: without)."""
        rotary = self.rotary_dim or self.head_dim
        exponents = torch.arange(0, rotary // 2, dtype=torch.float64) * 2 / rotary
        inv = 1.0 / ((theta or self.rope_theta) ** exponents)
        if theta is None and self.rope_linear_factor != 1.0:
            inv = inv / self.rope_linear_factor
        if self.rope_freq_factors is not None:
            inv = inv / torch.tensor(self.rope_freq_factors, dtype=torch.float64)
        elif self.rope_scaling is not None:
            inv = _llama3_scale(inv, self.rope_scaling)
        elif self.long_rope is not None:
            r = self.long_rope
            long = max_seq_len > r.original_max_position_embeddings
            inv = inv / torch.tensor(r.long_factor if long else r.short_factor, dtype=torch.float64)
        return torch.cat((inv, inv.new_zeros(self.head_dim // 2 - rotary // 2)))

    @property
    def rotary_scale(self) -> float:
        """The factor on the rotary tables' cos and sin (LongRoPE's attention factor; else 1)."""
        return 1.0 if self.long_rope is None else self.long_rope.attention_factor


# Fields added after fingerprints were first recorded, and their unset values: left out of to_json
# when unset.
_LATER_FIELDS = {"sliding_window": None, "rotary_dim": 0, "long_rope": None, "activation": "silu",
                 "embedding_scale": 1.0, "post_norms": False, "attention_scale": None, "attn_softcap": None,
                 "logit_softcap": None, "sliding_window_pattern": 0, "rope_local_theta": None,
                 "rope_linear_factor": 1.0}


def partial_rotary_order(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """The order of a head's Q/K rows that makes a partial rotary a half-split one: the rotary pairs
    (i, i + rotary_dim/2) of the first rotary_dim rows moved to (i, i + head_dim/2), the rows that
    pass through paired with each other (frequency 0). Q and K reordered alike keep every q·k."""
    half, rest = rotary_dim // 2, (head_dim - rotary_dim) // 2
    return torch.cat((torch.arange(half), torch.arange(rotary_dim, rotary_dim + rest),
                      torch.arange(half, rotary_dim), torch.arange(rotary_dim + rest, head_dim)))


def _llama3_scale(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    # Same rule as Meta's reference and transformers' _compute_llama3_parameters.
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


_LLAMA3_SCALING = RopeScaling(32.0, 1.0, 4.0, 8192)


def _gemma3(dim: int, n_layers: int, n_heads: int, n_kv_heads: int, ffn_dim: int, vocab_size: int,
            context_length: int, *, window: int, name: str, rope_linear_factor: float = 1.0) -> ModelConfig:
    """A Gemma 3 text model's config as the readers make it (head_dim 256, query_pre_attn_scalar 256, a
    window on 5 layers of 6, local base 10000)."""
    return ModelConfig(
        "gemma3", dim, n_layers, n_heads, n_kv_heads, ffn_dim, vocab_size, context_length, head_dim=256,
        norm_eps=1e-6, rope_theta=1000000.0, tie_embeddings=True, name=name, sliding_window=window,
        activation="gelu_tanh", embedding_scale=dim**0.5, post_norms=True, attention_scale=256**-0.5,
        sliding_window_pattern=6, rope_local_theta=10000.0, rope_linear_factor=rope_linear_factor,
    )


# Real architectures, for benchmarks with seeded random weights (no download needed).
KNOWN_SHAPES: dict[str, ModelConfig] = {
    "smollm2-135m": ModelConfig(
        "llama", 576, 30, 9, 3, 1536, 49152, 8192, norm_eps=1e-5, rope_theta=100000.0,
        tie_embeddings=True, name="smollm2-135m",
    ),
    "llama-3.2-1b": ModelConfig(
        "llama", 2048, 16, 32, 8, 8192, 128256, 131072, norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=_LLAMA3_SCALING, tie_embeddings=True, name="llama-3.2-1b",
    ),
    "llama-3-8b": ModelConfig(
        "llama", 4096, 32, 32, 8, 14336, 128256, 8192, norm_eps=1e-5, rope_theta=500000.0,
        name="llama-3-8b",
    ),
    "qwen2.5-0.5b": ModelConfig(
        "qwen2", 896, 24, 14, 2, 4864, 151936, 32768, norm_eps=1e-6, rope_theta=1000000.0,
        qkv_bias=True, tie_embeddings=True, name="qwen2.5-0.5b",
    ),
    # Qwen3: q/k norms, head_dim 128 whatever dim / heads
    "qwen3-0.6b": ModelConfig(
        "qwen3", 1024, 28, 16, 8, 3072, 151936, 40960, head_dim=128, norm_eps=1e-6, rope_theta=1000000.0,
        tie_embeddings=True, name="qwen3-0.6b",
    ),
    "qwen3-1.7b": ModelConfig(
        "qwen3", 2048, 28, 16, 8, 6144, 151936, 40960, head_dim=128, norm_eps=1e-6, rope_theta=1000000.0,
        tie_embeddings=True, name="qwen3-1.7b",
    ),
    "qwen3-8b": ModelConfig(
        "qwen3", 4096, 36, 32, 8, 12288, 151936, 40960, head_dim=128, norm_eps=1e-6, rope_theta=1000000.0,
        name="qwen3-8b",
    ),
    "gemma-3-1b": _gemma3(1152, 26, 4, 1, 6912, 262144, 32768, window=512, name="gemma-3-1b"),
    "gemma-3-4b": _gemma3(2560, 34, 8, 4, 10240, 262208, 131072, window=1024, rope_linear_factor=8.0,
                          name="gemma-3-4b"),
}
