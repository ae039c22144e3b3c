"""Batch-1 decode on CUDA as captured graphs: one replay per token.

The step reads its token and position from device buffers fed from pinned host memory inside the
graph, so a replay needs no argument and allocates nothing. One graph per KV-length bucket keeps
attention from reading the whole static cache at short contexts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from floe.engine.transformer import Transformer, apply_rotary


class GraphDecoder:
    """Decode steps of one KV cache slot, replayed from CUDA graphs."""

    def __init__(self, model: Transformer, cache, slot: int, min_bucket: int = 256,
                 compile: bool = False, fused: bool = False) -> None:
        self.model, self.cache, self.slot = model, cache, slot
        dev = model.tok_embeddings.weight.device
        c = model.config
        self.device = dev
        # Host-side inputs and outputs live in pinned memory; the graph copies them in and out.
        self.host_in = torch.zeros(2, dtype=torch.long, pin_memory=True)  # token, position
        self.dev_in = torch.zeros(2, dtype=torch.long, device=dev)
        self.logits = torch.zeros(c.vocab_size, dtype=torch.float32, device=dev)
        self.positions = torch.arange(cache.max_seq_len, device=dev)
        self.buckets = []
        b = min(min_bucket, cache.max_seq_len)
        while b < cache.max_seq_len:
            self.buckets.append(b)
            b *= 2
        self.buckets.append(cache.max_seq_len)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None
        self.done = torch.cuda.Event()  # the last replay finished reading host_in
        # Inductor fuses the step's elementwise ops (norms, rotary, residuals) into fewer kernels;
        # the graph below is still ours, so replay and I/O are the same either way.
        core = self._core_fused if fused else self._core_eager
        self._core = torch.compile(core, fullgraph=True, dynamic=False) if compile else core

    def bucket_for(self, length: int) -> int:
        return next(b for b in self.buckets if b >= length)

    @torch.inference_mode()
    def _forward(self, bucket: int) -> None:
        self.dev_in.copy_(self.host_in, non_blocking=True)
        self.logits.copy_(self._core(self.dev_in, bucket))

    def _core_eager(self, dev_in: Tensor, bucket: int) -> Tensor:
        m, c, slot = self.model, self.model.config, self.slot
        token, pos = dev_in[:1], dev_in[1:]
        x = m.tok_embeddings(token)  # [1, dim]
        cos, sin = m.cos.index_select(0, pos), m.sin.index_select(0, pos)
        group = c.n_heads // c.n_kv_heads
        mask = self.positions[:bucket] > pos  # True where not yet written
        q_size, kv_size = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        for i, layer in enumerate(m.layers):
            att = layer.attention
            q, k, v = att.wqkv(layer.attention_norm(x)).split([q_size, kv_size, kv_size], dim=-1)
            q = apply_rotary(q.view(c.n_heads, 1, c.head_dim), cos, sin)
            k = apply_rotary(k.view(c.n_kv_heads, 1, c.head_dim), cos, sin)
            k_cache, v_cache = self.cache.k[i, slot], self.cache.v[i, slot]
            k_cache.index_copy_(1, pos, k)
            v_cache.index_copy_(1, pos, v.view(c.n_kv_heads, 1, c.head_dim))
            keys, values = k_cache[:, :bucket], v_cache[:, :bucket]
            scores = torch.matmul(q.view(c.n_kv_heads, group, c.head_dim), keys.transpose(1, 2)).float()
            scores = (scores * c.head_dim**-0.5).masked_fill(mask, float("-inf"))
            probs = torch.softmax(scores, dim=-1).to(values.dtype)
            y = torch.matmul(probs, values).reshape(1, q_size)
            x = x + att.wo(y)
            x = x + layer.feed_forward(layer.ffn_norm(x))
        return F.linear(m.norm(x), m.output_weight())[0].float()

    def _core_fused(self, dev_in: Tensor, bucket: int) -> Tensor:
        """The same step with Triton kernels: 9 launches a layer instead of ~49."""
        from floe.engine import triton_kernels as tk

        m, c, slot = self.model, self.model.config, self.slot
        token, pos = dev_in[:1], dev_in[1:]
        layers = m.layers
        x = m.tok_embeddings(token)  # [1, dim], the residual stream
        h, _ = tk.rmsnorm(x, layers[0].attention_norm.weight, c.norm_eps)
        for i, layer in enumerate(layers):
            k_cache, v_cache = self.cache.k[i, slot], self.cache.v[i, slot]
            qkv = layer.attention.wqkv(h)
            q = tk.rope_kv_write(qkv, m.cos, m.sin, pos, k_cache, v_cache,
                                 c.n_heads, c.n_kv_heads, c.head_dim)
            y = tk.decode_attention(q, k_cache, v_cache, pos, c.n_kv_heads, bucket)
            h, x = tk.rmsnorm(layer.attention.wo(y), layer.ffn_norm.weight, c.norm_eps, residual=x)
            d = layer.feed_forward.w2(tk.swiglu(layer.feed_forward.w13(h)))
            next_norm = layers[i + 1].attention_norm if i + 1 < len(layers) else m.norm
            h, x = tk.rmsnorm(d, next_norm.weight, c.norm_eps, residual=x)
        return F.linear(h, m.output_weight())[0].float()

    def _capture(self, bucket: int) -> torch.cuda.CUDAGraph:
        # Warm up on a side stream (cuBLAS handles, workspaces), then capture.
        # Both run the step for real, writing the same token at the same position the replay will.
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._forward(bucket)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self._forward(bucket)
        self.pool = graph.pool()
        return graph

    def step(self, token: int, position: int) -> Tensor:
        """Write `token` at `position` of the slot's cache and compute the next logits.

        Returns the graph's logits buffer (device, float32): valid until the next step.
        """
        bucket = self.bucket_for(position + 1)
        self.done.synchronize()  # the previous replay has read host_in
        self.host_in[0], self.host_in[1] = token, position
        graph = self.graphs.get(bucket)
        if graph is None:
            graph = self.graphs[bucket] = self._capture(bucket)
        graph.replay()
        self.done.record()
        return self.logits
