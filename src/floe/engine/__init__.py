"""The compute plane: transformer forward (prefill, decode), KV cache slots, sampling."""

from floe.engine.engine import DTYPES, Engine, bound_kernel_caches, parse_device, parse_dtype
from floe.engine.generate import Generation, generate, generate_step
from floe.engine.kvcache import KVCache
from floe.engine.sampling import Sampler, SamplingParams

__all__ = [
    "DTYPES",
    "Engine",
    "Generation",
    "KVCache",
    "Sampler",
    "SamplingParams",
    "bound_kernel_caches",
    "generate",
    "generate_step",
    "parse_device",
    "parse_dtype",
]
