"""floe's WebGPU backend (`Engine(checkpoint, device="webgpu")`): the Llama step as WGSL compute
shaders through wgpu-py, on Vulkan (lavapipe on a CPU; NVIDIA's driver), Metal or D3D12 from one
code path. wgpu is imported only when a WebGPU engine is made."""

from __future__ import annotations

from floe.engine.webgpu.device import WebGPUUnavailable, adapter, adapter_description, gpu
from floe.engine.webgpu.kvcache import WebGPUKVCache
from floe.engine.weights import check_backend
from floe.model.config import ModelConfig


def webgpu_cache(config: ModelConfig, max_seq_len: int, n_slots: int) -> WebGPUKVCache:
    """A KV cache in the process's WebGPU device's buffers (raises WebGPUUnavailable without one;
    UnsupportedModel for an architecture the shaders do not compute)."""
    check_backend(config, "webgpu", max_seq_len)
    return WebGPUKVCache(gpu(), config, max_seq_len, n_slots)


__all__ = ["WebGPUKVCache", "WebGPUUnavailable", "adapter", "adapter_description", "webgpu_cache"]
