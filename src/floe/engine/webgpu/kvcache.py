"""The KV cache in WebGPU buffers: per layer one K and one V buffer [n_slots, n_kv_heads, max_seq_len,
head_dim] float32, the layout of floe.engine.kvcache.KVCache's tensors. The host keeps the
bookkeeping (lengths, token ids); a snapshot's KV crosses the boundary by copies (a WebGPU buffer
cannot wrap host memory): export reads the filled prefix back, a load writes it in."""

from __future__ import annotations

import numpy as np
import torch

from floe.engine import copyhash
from floe.engine.kvcache import KVCache, KVDigestMismatch
from floe.engine.webgpu.device import Gpu
from floe.errors import ContextOverflow, FloeError
from floe.model.config import ModelConfig


class WebGPUKVCache(KVCache):
    """KVCache whose k and v live in GPU buffers (`k_buffers`, `v_buffers`, one per layer)."""

    def __init__(self, gpu: Gpu, c: ModelConfig, max_seq_len: int, n_slots: int) -> None:
        self.gpu = gpu
        self.shape = (c.n_layers, n_slots, c.n_kv_heads, max_seq_len, c.head_dim)
        layer_bytes = n_slots * c.n_kv_heads * max_seq_len * c.head_dim * 4
        if layer_bytes > gpu.max_binding:
            raise FloeError(f"a layer's KV cache ({layer_bytes >> 20} MiB for {n_slots} slots × "
                            f"{max_seq_len} tokens) exceeds this WebGPU adapter's largest buffer binding "
                            f"({gpu.max_binding >> 20} MiB): choose a shorter --context or fewer slots")
        self.k_buffers = [gpu.buffer(layer_bytes, label=f"k{i}") for i in range(c.n_layers)]
        self.v_buffers = [gpu.buffer(layer_bytes, label=f"v{i}") for i in range(c.n_layers)]
        self.k = self.v = None  # no host tensors: see export and start_load
        self.dtype = torch.float32
        self._init_slots(max_seq_len, n_slots)

    @property
    def bytes_per_token(self) -> int:
        n_layers, _, n_kv, _, head_dim = self.shape
        return 2 * n_layers * n_kv * head_dim * 4

    def _runs(self, slot: int, n: int) -> list[tuple[object, int, int]]:
        """(buffer, byte offset, bytes) of every contiguous run of `slot`'s first n positions: per
        layer, K then V, per KV head, in export's order."""
        n_layers, _, n_kv, seq, hd = self.shape
        row = hd * 4
        runs = []
        for buffers in (self.k_buffers, self.v_buffers):
            for layer in range(n_layers):
                for h in range(n_kv):
                    runs.append((buffers[layer], ((slot * n_kv + h) * seq) * row, n * row))
        return runs

    def export(self, slot: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Copies (read back from the GPU, one map) of `slot`'s filled prefix, per layer: k and v
        [n_kv_heads, length, head_dim] float32."""
        n_layers, _, n_kv, _, hd = self.shape
        n = self.lengths[slot]
        if n == 0:
            empty = [torch.empty(n_kv, 0, hd) for _ in range(n_layers)]
            return empty, [t.clone() for t in empty]
        runs = self._runs(slot, n)
        total = sum(size for _, _, size in runs)
        u = self.gpu.wgpu.BufferUsage
        staging = self.gpu.device.create_buffer(size=total, usage=u.MAP_READ | u.COPY_DST, label="kv export")
        encoder = self.gpu.device.create_command_encoder()
        at = 0
        for buffer, offset, size in runs:
            encoder.copy_buffer_to_buffer(buffer, offset, staging, at, size)
            at += size
        self.gpu.queue.submit([encoder.finish()])
        staging.map_sync(self.gpu.wgpu.MapMode.READ)
        try:
            host = torch.from_numpy(np.frombuffer(staging.read_mapped(copy=False), dtype=np.float32).copy())
        finally:
            staging.unmap()
            staging.destroy()
        tensors = list(host.view(2 * n_layers, n_kv, n, hd).unbind())
        return tensors[:n_layers], tensors[n_layers:]

    def start_load(self, k: list[torch.Tensor], v: list[torch.Tensor],
                   digests: list[str] | None = None) -> WebGPULoad:
        return WebGPULoad(self, list(k) + list(v), digests)


class WebGPULoad:
    """Host KV tensors on their way into a slot of a WebGPUKVCache (KVCache.start_load's contract):
    hashed on the host first where digests are given, then written by the queue."""

    def __init__(self, cache: WebGPUKVCache, src: list[torch.Tensor], digests: list[str] | None) -> None:
        self.cache, self.src, self.digests = cache, src, digests
        self.copies: list[tuple[str, int]] = []

    def into(self, slot: int, tokens: list[int]) -> None:
        cache, n = self.cache, len(tokens)
        if n > cache.max_seq_len:
            raise ContextOverflow(f"{n} tokens do not fit a context of {cache.max_seq_len}")
        cache.lengths[slot], cache.tokens[slot] = 0, []  # empty until every tensor is in and checked
        cache.drop_held(slot)
        if not n:
            return
        src = [s.to(torch.float32).contiguous() for s in self.src]
        if self.digests is not None:
            for j, (want, got) in enumerate(zip(self.digests, copyhash.digests(self.src), strict=True)):
                if want != got:
                    raise KVDigestMismatch(j, want, got)
        _, _, n_kv, _, hd = cache.shape
        queue, total = cache.gpu.queue, 0
        for (buffer, offset, size), tensor in zip(cache._runs(slot, n), _heads(src, n_kv), strict=True):
            data = tensor.numpy()
            assert data.nbytes == size, (data.shape, size)
            queue.write_buffer(buffer, offset, data)
            total += size
        hashed = " (hashed on the host first)" if self.digests is not None else ""
        self.copies = [(f"KV host→webgpu cache slot (queue.write_buffer){hashed}", total)]
        cache.lengths[slot] = n
        cache.tokens[slot] = list(tokens)

    def close(self) -> None:
        """Nothing is held between start_load and into."""


def _heads(tensors: list[torch.Tensor], n_kv: int) -> list[torch.Tensor]:
    """Each [n_kv, length, head_dim] tensor's heads, in _runs' order."""
    return [t[h] for t in tensors for h in range(n_kv)]
