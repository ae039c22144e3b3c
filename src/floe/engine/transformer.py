"""The Llama-family transformer (Llama, Llama-3, SmolLM2, Mistral, Phi-3, Qwen2, Qwen3, Gemma 2 and 3) in
plain PyTorch, gpt-fast style."""

from __future__ import annotations

import os
import re
import weakref
from collections.abc import Callable, Iterator, Mapping
from functools import partial
from itertools import accumulate

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from floe.engine.kvcache import KVCache
from floe.engine.prefill import project
from floe.model.config import ModelConfig
from floe.model.quant import QuantizedWeight

Segment = tuple[int, int, int]  # (rows, first position, KV slot): one slot's consecutive rows of a forward


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # Normalise in fp32 as the reference does, then return to the activation dtype.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Half-split (HF / NeoX) rotary embedding; x [..., T, head_dim], cos/sin [T, head_dim] fp32."""
    half = x.shape[-1] // 2
    xf = x.float()
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


def prompt_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, start: int, window: int | None = None,
                     scale: float | None = None, softcap: float | None = None) -> Tensor:
    """Causal attention of T queries q [n_heads, T, hd] at positions start.. over one slot's cache
    (k_cache/v_cache [n_kv, S, hd], its first start + T positions written): [T, n_heads * hd].
    window: each query sees only the last `window` positions, itself included (None: all); scale:
    the factor on q·k (None: hd ** -0.5); softcap: the scores soft-capped (Gemma 2)."""
    t, end = q.shape[1], start + q.shape[1]
    first = 0 if window is None else max(0, start - window + 1)  # the first key any query sees
    keys, values = k_cache[None, :, first:end], v_cache[None, :, first:end]
    if softcap is None and start == 0 and (window is None or end <= window):
        y = F.scaled_dot_product_attention(q[None], keys, values, is_causal=True, enable_gqa=True,
                                           scale=scale)
    else:  # query i (position start + i) sees keys start + i - window < j <= start + i
        mask = torch.ones(t, end - first, dtype=torch.bool, device=q.device).tril(diagonal=start - first)
        if window is not None:
            mask = mask.triu(diagonal=start - first - window + 1)
        if softcap is None:
            y = F.scaled_dot_product_attention(q[None], keys, values, attn_mask=mask, enable_gqa=True,
                                               scale=scale)
        else:  # SDPA has no soft-capping
            y = softcapped_attention(q[None], keys, values, mask, scale or q.shape[-1] ** -0.5, softcap)
    return y[0].transpose(0, 1).reshape(t, q.shape[0] * q.shape[2])


def softcapped_attention(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor, scale: float,
                         softcap: float) -> Tensor:
    """Attention of q [1, H, T, hd] over keys/values [1, n_kv, S, hd] where mask [T, S] allows, its
    scores softcap * tanh(scores / softcap) before the fp32 softmax, as transformers' Gemma 2 does."""
    group = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    scores = torch.matmul(q, keys.transpose(-1, -2)) * scale
    scores = (torch.tanh(scores / softcap) * softcap).float().masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1).to(values.dtype), values)


def norm_heads(qkv: Tensor, weight: Tensor, eps: float, heads: int, head_dim: int) -> None:
    """RMSNorm of each of the first `heads` heads of the qkv rows [B, (heads + n_kv) head_dim], in
    place, times weight [heads, head_dim] (the q and k norms stacked: qk_norm_weight): fp32
    statistics, the product in qkv's dtype, as RMSNorm rounds. The fused steps' form of the q/k norm."""
    qk = qkv.narrow(1, 0, heads * head_dim).view(qkv.shape[0], heads, head_dim)
    qf = qk.float()
    normed = qf * torch.rsqrt(qf.pow(2).mean(-1, keepdim=True) + eps)
    qk.copy_(weight * normed.to(qk.dtype))


def qk_norm_weight(attention: Attention) -> Tensor | None:
    """The attention's q and k norm weights stacked per head [n_heads + n_kv, head_dim] (a few KB,
    made once), as norm_heads takes them; None without a q/k norm."""
    if attention.q_norm is None:
        return None
    return torch.cat((attention.q_norm.weight.detach().expand(attention.n_heads, attention.head_dim),
                      attention.k_norm.weight.detach().expand(attention.n_kv_heads, attention.head_dim)))


class Attention(nn.Module):
    def __init__(self, c: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = c.n_heads, c.n_kv_heads, c.head_dim
        qkv_out = (c.n_heads + 2 * c.n_kv_heads) * c.head_dim
        self.wqkv = nn.Linear(c.dim, qkv_out, bias=c.qkv_bias)
        self.wo = nn.Linear(c.n_heads * c.head_dim, c.dim, bias=False)
        # Qwen3: q and k each RMS-normalised per head before rotary (one weight [head_dim] each).
        self.q_norm = RMSNorm(c.head_dim, c.norm_eps) if c.qk_norm else None
        self.k_norm = RMSNorm(c.head_dim, c.norm_eps) if c.qk_norm else None
        # Mistral: a query sees the last `window` positions only (Gemma: on some layers)
        self.window = c.layer_window(layer)
        # Gemma's query scale; None: head_dim ** -0.5 (SDPA's own, so other models' bits are as before)
        self.scale = c.attention_scale
        self.softcap = c.attn_softcap
        self.local_rope = c.layer_rope_theta(layer) != c.rope_theta  # Gemma 3's windowed layers

    def forward(self, x: Tensor, rope: list[tuple[Tensor, Tensor]], k_layer: Tensor, v_layer: Tensor,
                segments: list[Segment]) -> Tensor:
        """x [T, dim]: the rows of `segments` one after another, each (n, start, slot) n rows at
        positions start.. of its slot; rope: each segment's (cos, sin); k_layer/v_layer the layer's
        cache [n_slots, n_kv, max_seq, head_dim]."""
        q_size, kv_size = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        # Computed in the cache's dtype (a no-op unless the projection runs in another one).
        splits = [t for t, _, _ in segments]
        qkv = project(self.wqkv, x, splits).to(k_layer.dtype)
        ys, row = [], 0
        for (t, start, slot), (cos, sin) in zip(segments, rope, strict=True):
            q, k, v = qkv[row:row + t].split([q_size, kv_size, kv_size], dim=-1)
            row += t
            q, k = q.view(t, self.n_heads, self.head_dim), k.view(t, self.n_kv_heads, self.head_dim)
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q = apply_rotary(q.transpose(0, 1), cos, sin)
            k = apply_rotary(k.transpose(0, 1), cos, sin)
            end = start + t
            k_cache, v_cache = k_layer[slot], v_layer[slot]
            k_cache[:, start:end] = k
            v_cache[:, start:end] = v.view(t, self.n_kv_heads, self.head_dim).transpose(0, 1)
            if t == 1:
                first = 0 if self.window is None else max(0, end - self.window)
                ys.append(self._decode_attention(q, k_cache[:, first:end], v_cache[:, first:end]))
            else:
                ys.append(prompt_attention(q, k_cache, v_cache, start, self.window, self.scale, self.softcap))
        y = ys[0] if len(ys) == 1 else torch.cat(ys)
        return project(self.wo, y, splits)

    def _decode_attention(self, q: Tensor, keys: Tensor, values: Tensor) -> Tensor:
        """One query position, grouped heads as a batched matmul: no K/V repeat, softmax in fp32.

        On CPU this beats SDPA's flash kernel 1.5-8x at batch 1 (bf16, 300-2000 positions).
        """
        group = self.n_heads // self.n_kv_heads
        qg = q.reshape(self.n_kv_heads, group, self.head_dim)
        scores = torch.matmul(qg, keys.transpose(1, 2)).float() * (self.scale or self.head_dim**-0.5)
        if self.softcap is not None:
            scores = torch.tanh(scores / self.softcap) * self.softcap
        probs = torch.softmax(scores, dim=-1).to(values.dtype)
        return torch.matmul(probs, values).reshape(1, self.n_heads * self.head_dim)


class FeedForward(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.ffn_dim = c.ffn_dim
        # Gemma's GeGLU: GELU (tanh approximation) on the gate where Llama has SiLU
        self.activation = F.silu if c.activation == "silu" else partial(F.gelu, approximate="tanh")
        self.w13 = nn.Linear(c.dim, 2 * c.ffn_dim, bias=False)  # gate and up, fused
        self.w2 = nn.Linear(c.ffn_dim, c.dim, bias=False)

    def forward(self, x: Tensor, splits: list[int] | None = None) -> Tensor:
        gate, up = project(self.w13, x, splits).split(self.ffn_dim, dim=-1)
        return project(self.w2, self.activation(gate) * up, splits)


class Block(nn.Module):
    def __init__(self, c: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(c.dim, c.norm_eps)
        self.attention = Attention(c, layer)
        self.ffn_norm = RMSNorm(c.dim, c.norm_eps)
        self.feed_forward = FeedForward(c)
        # Gemma: each sub-layer's output normalised again before it joins the residual stream
        self.post_attention_norm = RMSNorm(c.dim, c.norm_eps) if c.post_norms else None
        self.post_ffn_norm = RMSNorm(c.dim, c.norm_eps) if c.post_norms else None

    def forward(self, x: Tensor, rope: list[tuple[Tensor, Tensor]], k_layer: Tensor, v_layer: Tensor,
                segments: list[Segment]) -> Tensor:
        a = self.attention(self.attention_norm(x), rope, k_layer, v_layer, segments)
        h = x + (a if self.post_attention_norm is None else self.post_attention_norm(a))
        f = self.feed_forward(self.ffn_norm(h), [t for t, _, _ in segments])
        return h + (f if self.post_ffn_norm is None else self.post_ffn_norm(f))


class QuantizedEmbedding(nn.Module):
    """The token embedding table as the file stores it (block-quantized): a lookup reads and
    dequantizes only the rows asked for, as llama.cpp's get_rows does, so the table costs no
    memory of its own. CPU only."""

    def __init__(self, table: QuantizedWeight, dtype: torch.dtype) -> None:
        super().__init__()
        self.table, self.dtype = table, dtype
        self.num_embeddings, self.embedding_dim = table.shape
        # Opened once: rows come from the file loaded, even if a new one is renamed over its path.
        self._fd = None if table.file is None else os.open(table.file[0], os.O_RDONLY)
        if self._fd is not None:
            weakref.finalize(self, os.close, self._fd)

    @property
    def row_nbytes(self) -> int:
        """Bytes one lookup reads from the file."""
        return self.table.blocks.shape[1]

    def forward(self, tokens: Tensor) -> Tensor:
        rows = self.table.read_rows(tokens.reshape(-1).cpu().numpy(), self._fd).dequantize(self.dtype)
        return rows.reshape(*tokens.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.table.qtype} rows of the file"


class Transformer(nn.Module):
    def __init__(self, c: ModelConfig, max_seq_len: int) -> None:
        super().__init__()
        self.config = c
        # Given its tensor, the table skips its random init: on the meta device that init would
        # import torch._dynamo (~40 MB of Python objects and ~1 s) only to be overwritten.
        self.tok_embeddings = nn.Embedding(c.vocab_size, c.dim, _weight=torch.empty(c.vocab_size, c.dim))
        self.layers = nn.ModuleList(Block(c, i) for i in range(c.n_layers))
        self.norm = RMSNorm(c.dim, c.norm_eps)
        self.output = None if c.tie_embeddings else nn.Linear(c.dim, c.vocab_size, bias=False)
        # A module that replaces the plain projection to the vocabulary (e.g. packed int4 weights).
        self.head: nn.Module | None = None
        with torch.device("cpu"):  # computed, even when the module is made on meta (the engine does)
            cos, sin = self.rotary_tables(c, max_seq_len)
            local = (None if c.rope_local_theta is None
                     else self.rotary_tables(c, max_seq_len, c.rope_local_theta))
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        # Gemma 3's windowed layers' tables (their own base); None where every layer shares cos, sin
        self.register_buffer("cos_local", None if local is None else local[0], persistent=False)
        self.register_buffer("sin_local", None if local is None else local[1], persistent=False)

    @staticmethod
    def rotary_tables(c: ModelConfig, max_seq_len: int, theta: float | None = None) -> tuple[Tensor, Tensor]:
        """cos and sin [max_seq_len, head_dim], float32, computed in float64; the rotating dimensions'
        times LongRoPE's attention factor where the model has one (a partial rotary's others pass
        through: cos 1, sin 0). theta: the rotary base (None: the config's)."""
        angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), c.inv_freq(max_seq_len, theta))
        angles = torch.cat((angles, angles), dim=-1)
        if c.rotary_scale == 1.0:
            return angles.cos().float(), angles.sin().float()
        half, rotating = c.head_dim // 2, (c.rotary_dim or c.head_dim) // 2
        scale = torch.ones(half, dtype=torch.float64)
        scale[:rotating] = c.rotary_scale
        scale = torch.cat((scale, scale))
        return (angles.cos() * scale).float(), (angles.sin() * scale).float()

    def output_weight(self) -> Tensor:
        return self.tok_embeddings.weight if self.output is None else self.output.weight

    def forward(self, tokens: Tensor, start: int, cache: KVCache, slot: int,
                all_logits: bool = False, out: Tensor | None = None) -> Tensor:
        """Run tokens [T] at positions start.. through the model, writing the KV cache of `slot`.

        Returns float32 logits [vocab] of the last position ([T, vocab] with all_logits). With
        `out` (float32 [vocab]) the last position's logits are written there, in place.
        """
        x = self._layers(tokens, [(tokens.shape[0], start, slot)], cache)
        return self._logits(x if all_logits else x[-1], out)

    def _logits(self, x: Tensor, out: Tensor | None = None) -> Tensor:
        """Float32 logits of the final norm of x ([dim] or [T, dim]), soft-capped where the model
        caps them (Gemma 2); see forward for `out`."""
        logits, cap = self._head(x, out), self.config.logit_softcap
        if cap is None:
            return logits
        if out is None:
            return torch.tanh(logits / cap) * cap
        return out.div_(cap).tanh_().mul_(cap)  # logits is out

    def _head(self, x: Tensor, out: Tensor | None) -> Tensor:
        x = self.norm(x)
        if self.head is not None:
            logits = self.head(x[None] if x.ndim == 1 else x)
            logits = logits[0] if x.ndim == 1 else logits
            return logits.float() if out is None else out.copy_(logits)
        if out is None:
            return F.linear(x, self.output_weight()).float()
        if x.dtype == torch.float32 and out.device == x.device:
            # The projection's result lands in `out` directly: no staging tensor.
            return torch.mv(self.output_weight(), x, out=out)
        return out.copy_(F.linear(x, self.output_weight()))

    def forward_segments(self, tokens: Tensor, segments: list[Segment], cache: KVCache) -> Tensor:
        """Several slots' prompts in one forward (their rows share each weight pass): tokens [T] the
        segments' tokens one after another, each segment (n, start, slot) n tokens appended at
        positions start.. of its slot. Float32 logits [len(segments), vocab] of each one's last
        position, each row as forward() would give it."""
        x = self._layers(tokens, segments, cache)
        # Each last row through the head alone, as forward() does (the head's kernel for one row).
        return torch.stack([self._logits(x[end - 1]) for end in accumulate(n for n, _, _ in segments)])

    def forward_rows(self, tokens: Tensor, segments: list[Segment], cache: KVCache) -> Tensor:
        """forward_segments' pass, float32 logits [T, vocab] of every row, each row's as forward() gives
        a last row's (the head on that row alone)."""
        x = self._layers(tokens, segments, cache)
        return torch.stack([self._logits(row) for row in x])

    def _layers(self, tokens: Tensor, segments: list[Segment], cache: KVCache) -> Tensor:
        """The layers over the segments' rows (the residual stream out, before the final norm)."""
        rope = [(self.cos[start:start + n], self.sin[start:start + n]) for n, start, _ in segments]
        local = rope if self.cos_local is None else [
            (self.cos_local[start:start + n], self.sin_local[start:start + n]) for n, start, _ in segments]
        x = self.tok_embeddings(tokens)
        if self.config.embedding_scale != 1.0:  # rounded to x's dtype first, as transformers' Gemma does
            x = x * torch.tensor(self.config.embedding_scale, dtype=x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, local if layer.attention.local_rope else rope, cache.k[i], cache.v[i], segments)
        return x


# This module's fused projections and the canonical weights each one stacks, by rows.
FUSED = {
    "attention.wqkv": ("attention.wq", "attention.wk", "attention.wv"),
    "attention.wo": ("attention.wo",),
    "feed_forward.w13": ("feed_forward.w1", "feed_forward.w3"),
    "feed_forward.w2": ("feed_forward.w2",),
}


_LAYER_PART = re.compile(r"(layers\.\d+\.)(.+)\.(weight|bias)")


def stacked_names(name: str) -> list[str]:
    """The canonical weights that module weight `name` stacks by rows (itself, if none):
    'layers.0.attention.wqkv.weight' -> its wq, wk and wv weights."""
    m = _LAYER_PART.fullmatch(name)
    if m and m.group(2) in FUSED:
        return [f"{m.group(1)}{part}.{m.group(3)}" for part in FUSED[m.group(2)]]
    return [name]


def stacked(get: Callable[[str], Tensor], name: str) -> Tensor:
    """Module weight `name`, its canonical parts read by `get` and concatenated once."""
    parts = [get(part) for part in stacked_names(name)]
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def head_weight(c: ModelConfig) -> str:
    """The canonical name of the projection to the vocabulary's weight (the embedding table if tied)."""
    return "tok_embeddings.weight" if c.tie_embeddings else "output.weight"


def module_weight(path: str, c: ModelConfig) -> str:
    """The weight a projection path of quantized_paths names ("output": the head's)."""
    return head_weight(c) if path == "output" else f"{path}.weight"


def quantized_paths(quantized: Mapping, c: ModelConfig) -> list[str]:
    """The projections (module paths, no ".weight") whose canonical weights the file stores all
    block-quantized, decided from the names alone: the head as "output" (the embedding table when
    tied), then each layer's fused projections."""
    paths = ["output"] if head_weight(c) in quantized else []
    for i in range(c.n_layers):
        for fused in FUSED:
            path = f"layers.{i}.{fused}"
            if all(part in quantized for part in stacked_names(f"{path}.weight")):
                paths.append(path)
    return paths


def fused_quantized(quantized: Mapping, path: str, c: ModelConfig) -> QuantizedWeight | None:
    """The file's quantized weight of projection `path` (a path of quantized_paths), its parts
    stacked by rows like fused_state_dict's; None if they differ in type or width."""
    return QuantizedWeight.cat([quantized[name] for name in stacked_names(module_weight(path, c))])


def fused_state_dict(get: Callable[[str], Tensor], c: ModelConfig,
                     skip: set[str] | frozenset[str] = frozenset()) -> Iterator[tuple[str, Tensor]]:
    """This module's weights from canonical ones, one at a time (Q/K/V and gate/up concatenated
    once), each read by `get` only when it comes; names in `skip` are left out."""
    names = ["tok_embeddings.weight", "norm.weight"] + ([] if c.tie_embeddings else ["output.weight"])
    for i in range(c.n_layers):
        p = f"layers.{i}."
        names += [p + "attention_norm.weight", p + "ffn_norm.weight"]
        names += [f"{p}{fused}.weight" for fused in FUSED]
        names += [p + "attention.wqkv.bias"] if c.qkv_bias else []
        names += [p + "attention.q_norm.weight", p + "attention.k_norm.weight"] if c.qk_norm else []
        names += [p + "post_attention_norm.weight", p + "post_ffn_norm.weight"] if c.post_norms else []
    for name in names:
        if name not in skip:
            yield name, stacked(get, name)
