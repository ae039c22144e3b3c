"""The Llama-family transformer (Llama, Llama-3, SmolLM2, Qwen2) in plain PyTorch, gpt-fast style."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from floe.engine.kvcache import KVCache
from floe.model.config import ModelConfig


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


class Attention(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = c.n_heads, c.n_kv_heads, c.head_dim
        qkv_out = (c.n_heads + 2 * c.n_kv_heads) * c.head_dim
        self.wqkv = nn.Linear(c.dim, qkv_out, bias=c.qkv_bias)
        self.wo = nn.Linear(c.n_heads * c.head_dim, c.dim, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor,
                start: int) -> Tensor:
        """x [T, dim] for positions start..start+T-1; k_cache/v_cache [n_kv, max_seq, head_dim]."""
        t = x.shape[0]
        q_size, kv_size = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        # Computed in the cache's dtype (a no-op unless the projection runs in another one).
        q, k, v = self.wqkv(x).to(k_cache.dtype).split([q_size, kv_size, kv_size], dim=-1)
        q = apply_rotary(q.view(t, self.n_heads, self.head_dim).transpose(0, 1), cos, sin)
        k = apply_rotary(k.view(t, self.n_kv_heads, self.head_dim).transpose(0, 1), cos, sin)
        end = start + t
        k_cache[:, start:end] = k
        v_cache[:, start:end] = v.view(t, self.n_kv_heads, self.head_dim).transpose(0, 1)
        keys, values = k_cache[None, :, :end], v_cache[None, :, :end]
        if t == 1:
            return self.wo(self._decode_attention(q, k_cache[:, :end], v_cache[:, :end]))
        if start == 0:
            y = F.scaled_dot_product_attention(q[None], keys, values, is_causal=True, enable_gqa=True)
        else:  # appending to an existing prefix: query i sees keys 0..start+i
            mask = torch.ones(t, end, dtype=torch.bool, device=x.device).tril(diagonal=start)
            y = F.scaled_dot_product_attention(q[None], keys, values, attn_mask=mask, enable_gqa=True)
        return self.wo(y[0].transpose(0, 1).reshape(t, q_size))


    def _decode_attention(self, q: Tensor, keys: Tensor, values: Tensor) -> Tensor:
        """One query position, grouped heads as a batched matmul: no K/V repeat, softmax in fp32.

        On CPU this beats SDPA's flash kernel 1.5-8x at batch 1 (bf16, 300-2000 positions).
        """
        group = self.n_heads // self.n_kv_heads
        qg = q.reshape(self.n_kv_heads, group, self.head_dim)
        scores = torch.matmul(qg, keys.transpose(1, 2)).float() * self.head_dim**-0.5
        probs = torch.softmax(scores, dim=-1).to(values.dtype)
        return torch.matmul(probs, values).reshape(1, self.n_heads * self.head_dim)


class FeedForward(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.ffn_dim = c.ffn_dim
        self.w13 = nn.Linear(c.dim, 2 * c.ffn_dim, bias=False)  # gate and up, fused
        self.w2 = nn.Linear(c.ffn_dim, c.dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.w13(x).split(self.ffn_dim, dim=-1)
        return self.w2(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, c: ModelConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(c.dim, c.norm_eps)
        self.attention = Attention(c)
        self.ffn_norm = RMSNorm(c.dim, c.norm_eps)
        self.feed_forward = FeedForward(c)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor,
                start: int) -> Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, k_cache, v_cache, start)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, c: ModelConfig, max_seq_len: int) -> None:
        super().__init__()
        self.config = c
        self.tok_embeddings = nn.Embedding(c.vocab_size, c.dim)
        self.layers = nn.ModuleList(Block(c) for _ in range(c.n_layers))
        self.norm = RMSNorm(c.dim, c.norm_eps)
        self.output = None if c.tie_embeddings else nn.Linear(c.dim, c.vocab_size, bias=False)
        # A module that replaces the plain projection to the vocabulary (e.g. packed int4 weights).
        self.head: nn.Module | None = None
        cos, sin = self.rotary_tables(c, max_seq_len)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    @staticmethod
    def rotary_tables(c: ModelConfig, max_seq_len: int) -> tuple[Tensor, Tensor]:
        """cos and sin [max_seq_len, head_dim], float32, computed in float64."""
        angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), c.inv_freq())
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos().float(), angles.sin().float()

    def output_weight(self) -> Tensor:
        return self.tok_embeddings.weight if self.output is None else self.output.weight

    def forward(self, tokens: Tensor, start: int, cache: KVCache, slot: int,
                all_logits: bool = False, out: Tensor | None = None) -> Tensor:
        """Run tokens [T] at positions start.. through the model, writing the KV cache of `slot`.

        Returns float32 logits [vocab] of the last position ([T, vocab] with all_logits). With
        `out` (float32 [vocab]) the last position's logits are written there, in place.
        """
        end = start + tokens.shape[0]
        cos, sin = self.cos[start:end], self.sin[start:end]
        x = self.tok_embeddings(tokens)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, cache.k[i, slot], cache.v[i, slot], start)
        x = self.norm(x if all_logits else x[-1])
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


# This module's fused projections and the canonical weights each one stacks, by rows.
FUSED = {
    "attention.wqkv": ("attention.wq", "attention.wk", "attention.wv"),
    "attention.wo": ("attention.wo",),
    "feed_forward.w13": ("feed_forward.w1", "feed_forward.w3"),
    "feed_forward.w2": ("feed_forward.w2",),
}


def fused_quantized(quantized: dict, c: ModelConfig) -> dict:
    """The file's quantized weights stacked like fused_state_dict's, by module path (no ".weight");
    the head under "output" (the embedding table when tied). A projection is left out when one of
    its parts is not quantized or the parts differ in type."""
    from floe.model.quant import QuantizedWeight

    out = {}
    head = "tok_embeddings.weight" if c.tie_embeddings else "output.weight"
    if head in quantized:
        out["output"] = quantized[head]
    for i in range(c.n_layers):
        for fused, parts in FUSED.items():
            names = [f"layers.{i}.{p}.weight" for p in parts]
            if all(n in quantized for n in names):
                stacked = QuantizedWeight.cat([quantized[n] for n in names])
                if stacked is not None:
                    out[f"layers.{i}.{fused}"] = stacked
    return out


def fused_state_dict(weights: dict[str, Tensor], c: ModelConfig) -> dict[str, Tensor]:
    """Canonical checkpoint weights -> this module's names, Q/K/V and gate/up concatenated once."""
    out: dict[str, Tensor] = {"tok_embeddings.weight": weights["tok_embeddings.weight"],
                              "norm.weight": weights["norm.weight"]}
    if not c.tie_embeddings:
        out["output.weight"] = weights["output.weight"]
    for i in range(c.n_layers):
        p = f"layers.{i}."
        w = {k[len(p):]: v for k, v in weights.items() if k.startswith(p)}
        out[p + "attention_norm.weight"] = w["attention_norm.weight"]
        out[p + "ffn_norm.weight"] = w["ffn_norm.weight"]
        for fused, parts in FUSED.items():
            stacked = [w[f"{part}.weight"] for part in parts]
            out[f"{p}{fused}.weight"] = torch.cat(stacked) if len(stacked) > 1 else stacked[0]
        if c.qkv_bias:
            biases = [w[f"{part}.bias"] for part in FUSED["attention.wqkv"]]
            out[p + "attention.wqkv.bias"] = torch.cat(biases)
    return out
