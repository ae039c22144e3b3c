"""Token sampling: greedy, or seeded temperature / top-k / top-p with a saveable RNG state."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from floe.errors import InvalidSamplingParams

FLOAT32_MAX = 3.4028234663852886e38


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: no limit
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        # The guest ABI carries them as float32 and int32 (floe.actor.abi's REQUEST and SAMPLING).
        if not (math.isfinite(self.temperature) and 0 <= self.temperature <= FLOAT32_MAX):
            raise InvalidSamplingParams(f"temperature must be in [0, {FLOAT32_MAX:.4g}], "
                                        f"got {self.temperature}")
        if not 0 <= self.top_k < 2**31:
            raise InvalidSamplingParams(f"top_k must be in [0, 2**31) (0 = no limit), got {self.top_k}")
        if not (0 < self.top_p <= 1):
            raise InvalidSamplingParams(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.seed < 2**63:
            raise InvalidSamplingParams(f"seed must be in [0, 2**63), got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class Sampler:
    """Chooses the next token from logits. Its RNG lives on the CPU, so its state is portable."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.generator = torch.Generator(device="cpu")
        self.generator.manual_seed(params.seed)

    def get_state(self) -> Tensor:
        """The RNG state as a uint8 tensor (to snapshot)."""
        return self.generator.get_state()

    def set_state(self, state: Tensor) -> None:
        self.generator.set_state(state)

    def sample(self, logits: Tensor) -> int:
        """One token id from float logits [vocab]."""
        return int(sample_token(logits, self.params, self.generator))


def sample_token(logits: Tensor, p: SamplingParams, generator: torch.Generator) -> Tensor:
    if p.greedy:
        return _argmax(logits)
    x = logits.float().cpu() / p.temperature
    if p.top_k and p.top_k < x.shape[-1]:
        kth = torch.topk(x, p.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Drop a token when the mass before it already reaches top_p (the first always stays).
        drop = (sorted_probs.cumsum(-1) - sorted_probs) >= p.top_p
        probs = probs.scatter(-1, order, sorted_probs.masked_fill(drop, 0.0))
    # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p without a host sync.
    race = torch.empty_like(probs).exponential_(1.0, generator=generator)
    return (probs / race).argmax()


def _argmax(logits: Tensor) -> Tensor:
    if logits.is_cuda and logits.dtype == torch.float32 and logits.ndim == 1:
        try:
            from floe.engine import triton_kernels
        except ImportError:  # no Triton: PyTorch's reduction is still right, only slower
            return logits.argmax()
        return triton_kernels.argmax(logits)[0]
    return logits.argmax()
