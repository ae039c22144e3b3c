"""Token sampling: greedy, or seeded temperature / top-k / top-p with a saveable RNG state."""

from __future__ import annotations

import math
from collections.abc import Sequence
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
    """One token id from float logits [vocab]: the argmax if greedy, else a draw (sample_rows)."""
    if p.greedy:
        return _argmax(logits)
    return sample_rows(logits[None], [p], draw_uniforms([generator]))[0]


def draw_uniforms(generators: Sequence[torch.Generator]) -> Tensor:
    """One uniform in [0, 1) from each generator (CPU, float64): all that a draw of sample_rows
    consumes, so a generator's state after n draws is the same whatever the vocabulary, device or batch."""
    return torch.cat([torch.rand(1, generator=g, dtype=torch.float64) for g in generators])


def sample_rows(logits: Tensor, params: Sequence[SamplingParams], uniforms: Tensor) -> Tensor:
    """One token for each row of logits [B, vocab], drawn with its row's (non-greedy) parameters by
    inverting the row's cumulative distribution at its uniform (uniforms: [B], from draw_uniforms).
    The distribution is softmax(logits / temperature), restricted to the top_k highest tokens, then to
    the nucleus (highest first, a token is kept while the mass before it is < top_p), renormalized.
    One batched pass on the logits' device: a few kernels and one readback for every row."""
    rows, vocab = logits.shape
    device = logits.device
    temps = torch.tensor([p.temperature for p in params], dtype=torch.float32).to(device)
    # Scaled after subtracting each row's maximum: <= 0, so no temperature overflows it.
    weights = torch.exp((logits.float() - logits.float().amax(-1, keepdim=True)) / temps[:, None])
    u = uniforms.to(device)
    cut = [p.top_p < 1.0 or 0 < p.top_k < vocab for p in params]
    if not any(cut):
        return _invert(weights, u)
    if all(cut):
        return _sample_truncated(weights, params, u)
    tokens = torch.empty(rows, dtype=torch.long, device=device)
    whole = [i for i in range(rows) if not cut[i]]
    some = [i for i in range(rows) if cut[i]]
    tokens[whole] = _invert(weights[whole], u[whole])
    tokens[some] = _sample_truncated(weights[some], [params[i] for i in some], u[some])
    return tokens


# A top_p row first looks only at tokens at least this fraction as likely as its most likely one; if
# their mass falls short of top_p (a flat distribution), at all of its tokens.
NUCLEUS_FLOOR = 2.0**-16


def _sample_truncated(weights: Tensor, params: Sequence[SamplingParams], u: Tensor,
                      everything: bool = False) -> Tensor:
    """sample_rows for rows with top_k and/or top_p (weights: exp of the scaled logits, max 1), among
    each row's K highest tokens, sorted."""
    vocab = weights.shape[-1]
    device = weights.device
    ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    k = torch.tensor(ks, device=device)[:, None]
    if everything:
        k_max = vocab
    else:  # every row's top k, and the likely tokens of rows without top_k
        likely = (weights >= NUCLEUS_FLOOR).sum(-1)
        k_max = max(1, int(torch.where(k[:, 0] < vocab, k[:, 0], likely).max()))
    values, order = torch.topk(weights, k_max, dim=-1)  # highest first
    values = values.masked_fill(torch.arange(k_max, device=device)[None, :] >= k, 0.0).double()
    # Each row's distribution over its allowed tokens: its top k, or (no top_k) its whole row.
    total = torch.where(k[:, 0] < vocab, values.sum(-1), weights.sum(-1, dtype=torch.float64))
    probs = values / total[:, None]
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float64, device=device)[:, None]
    kept = probs * ((probs.cumsum(-1) - probs) < top_p)
    tokens = order.gather(-1, _invert(kept, u)[:, None])[:, 0]
    if k_max < vocab:  # a row without top_k whose nucleus reaches past its likely tokens: all of them
        wider = ((k[:, 0] >= vocab) & (probs.sum(-1) < top_p[:, 0])).nonzero()[:, 0].tolist()
        if wider:
            tokens[wider] = _sample_truncated(weights[wider], [params[i] for i in wider], u[wider], True)
    return tokens


def _invert(weights: Tensor, u: Tensor) -> Tensor:
    """Per row, position j with probability weights[j] / the row's total: the first position whose
    cumulative weight (float64) passes u x total (a zero weight never does; u < 1 keeps it below)."""
    cdf = weights.cumsum(-1, dtype=torch.float64)
    total = cdf[:, -1]
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target[:, None], right=True)[:, 0]


def _argmax(logits: Tensor) -> Tensor:
    if logits.is_cuda and logits.dtype == torch.float32 and logits.ndim == 1:
        try:
            from floe.engine import triton_kernels
        except ImportError:  # no Triton: PyTorch's reduction is still right, only slower
            return logits.argmax()
        return triton_kernels.argmax(logits)[0]
    return logits.argmax()
