"""A decode peer outside floe's engine: plain PyTorch, static KV cache, `torch.compile`.

The way gpt-fast writes batch-1 decode: one module, KV cache buffers attended in full with a mask,
SDPA attention, every op plain PyTorch, compiled with mode="reduce-overhead" (Inductor kernels
replayed from CUDA graphs). It reads the same weight tensors as a floe Engine (no copy) and shares
no decode code with floe, so `floe bench decode` can put the two side by side in one run.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class PlainDecoder(nn.Module):
    def __init__(self, engine, max_len: int) -> None:
        super().__init__()
        m, c = engine.model, engine.config
        self.c, self.max_len = c, max_len
        dev, dt = engine.device, engine.dtype
        self.register_buffer("k_cache", torch.zeros(c.n_layers, 1, c.n_kv_heads, max_len, c.head_dim,
                                                    device=dev, dtype=dt))
        self.register_buffer("v_cache", torch.zeros_like(self.k_cache))
        self.register_buffer("cos", m.cos[:max_len])
        self.register_buffer("sin", m.sin[:max_len])
        self.register_buffer("positions", torch.arange(max_len, device=dev))
        self.layers = [(b.attention_norm.weight, b.attention.wqkv.weight, b.attention.wo.weight,
                        b.ffn_norm.weight, b.feed_forward.w13.weight, b.feed_forward.w2.weight)
                       for b in m.layers]
        self.emb, self.norm_w, self.head = m.tok_embeddings.weight, m.norm.weight, m.output_weight()

    def _rms(self, x: Tensor, w: Tensor) -> Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), eps=self.c.norm_eps).to(x.dtype) * w

    def _rope(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return (x.float() * cos + rotated.float() * sin).to(x.dtype)

    def forward(self, token: Tensor, pos: Tensor) -> Tensor:
        """token, pos: int64 [1] on the device. Logits [vocab] float32."""
        c = self.c
        nh, nkv, hd = c.n_heads, c.n_kv_heads, c.head_dim
        x = self.emb[token]
        cos, sin = self.cos[pos], self.sin[pos]
        mask = (self.positions <= pos).view(1, 1, 1, -1)
        for i, (an, wqkv, wo, fn, w13, w2) in enumerate(self.layers):
            q, k, v = F.linear(self._rms(x, an), wqkv).split([nh * hd, nkv * hd, nkv * hd], dim=-1)
            q = self._rope(q.view(1, nh, 1, hd), cos, sin)
            k = self._rope(k.view(1, nkv, 1, hd), cos, sin)
            self.k_cache[i].index_copy_(2, pos, k)
            self.v_cache[i].index_copy_(2, pos, v.view(1, nkv, 1, hd))
            y = F.scaled_dot_product_attention(q, self.k_cache[i], self.v_cache[i], attn_mask=mask,
                                               enable_gqa=True)
            x = x + F.linear(y.view(1, nh * hd), wo)
            gate, up = F.linear(self._rms(x, fn), w13).split(c.ffn_dim, dim=-1)
            x = x + F.linear(F.silu(gate) * up, w2)
        return F.linear(self._rms(x, self.norm_w), self.head)[0].float()


@torch.inference_mode()
def plain_compiled_row(engine, context: int, steps: int = 128) -> dict:
    """tok/s of the compiled plain decoder at `context` positions, and its logits against floe's."""
    dev = engine.device
    peer = PlainDecoder(engine, context + steps + 8)
    step = torch.compile(peer, mode="reduce-overhead", fullgraph=True)
    ids = list(range(100, 100 + context))
    t0 = time.perf_counter()
    for p, t in enumerate(ids):  # fills the peer's cache with the same prompt, one token at a time
        logits = step(torch.tensor([t], device=dev), torch.tensor([p], device=dev)).clone()
    torch.cuda.synchronize(dev)
    warm_s = time.perf_counter() - t0
    engine.kv_truncate(0)
    ours = engine.prefill(ids).float()
    engine.kv_truncate(0)
    agreement = {"rel_error": float((logits - ours).norm() / ours.norm()),
                 "same_argmax": int(logits.argmax()) == int(ours.argmax())}
    tok, pos = torch.tensor([300], device=dev), torch.tensor([context], device=dev)
    for _ in range(3):
        step(tok, pos)
    torch.cuda.synchronize(dev)
    t = time.perf_counter()
    for i in range(steps):
        pos.fill_(context + i)
        step(tok, pos)
    torch.cuda.synchronize(dev)
    s = (time.perf_counter() - t) / steps
    return {"ms_per_token": s * 1e3, "tok_s": 1 / s, "compile_and_prompt_s": warm_s,
            "kernels_per_token": float("nan"), "agreement_with_floe": agreement}
