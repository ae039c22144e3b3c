"""What a request asks of sampling, checked: no torch here, so that a command line's mistake is said
before anything heavy is imported (floe.engine.sampling samples with them)."""

from __future__ import annotations

import math
from dataclasses import dataclass

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
