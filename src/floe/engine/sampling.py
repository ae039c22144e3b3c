"""Token sampling: greedy, or seeded temperature / top-k / top-p with a saveable RNG state."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from floe.sampling_params import FLOAT32_MAX, SamplingParams  # noqa: F401 - theirs, re-exported here


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


def sample_token(logits: Tensor, p: SamplingParams, generator: torch.Generator) -> int:
    """One token id from float logits [vocab]: the argmax if greedy, else a draw (sample_rows)."""
    if p.greedy:
        return int(_argmax(logits))
    return sample_rows(logits[None], [p], draw_uniforms([generator]))[0]


def draw_uniforms(generators: Sequence[torch.Generator]) -> Tensor:
    """One uniform in [0, 1) from each generator (CPU, float64): all that a draw of sample_rows
    consumes, so a generator's state after n draws is the same whatever the vocabulary, device or batch."""
    return torch.cat([torch.rand(1, generator=g, dtype=torch.float64) for g in generators])


def sample_rows(logits: Tensor, params: Sequence[SamplingParams], uniforms: Tensor) -> list[int]:
    """One token for each row of logits [B, vocab], drawn with its row's (non-greedy) parameters by
    inverting the row's cumulative distribution at its uniform (uniforms: [B], from draw_uniforms).
    The distribution is softmax(logits / temperature), restricted to the top_k highest tokens, then to
    the nucleus (highest first, a token is kept while the mass before it is < top_p), renormalized.
    A row nothing can be drawn from (NaN, +inf, every logit -inf) gets -3 (ERR_BAD_ARGUMENT).
    start_draw + finish_draw: a few batched kernels and one readback for every row."""
    return finish_draw(start_draw(logits, params, uniforms))


class Draw(NamedTuple):
    """A draw start_draw launched: the rows' tokens on the device, and what a row needs to be drawn
    again over its whole vocabulary (a nucleus wider than the candidates looked at first)."""

    tokens: Tensor  # [B] long, on the logits' device
    wider: Tensor | None  # [B] bool, or None: no row can need it
    logits: Tensor
    params: Sequence[SamplingParams]
    uniforms: Tensor


NO_DRAW = -3  # a row whose logits allow no draw (the ABI's ERR_BAD_ARGUMENT)


def top_ks(params: Sequence[SamplingParams], vocab: int) -> list[int]:
    """Each row's top_k as the draws take it: the vocabulary for none (0) or one at least as large."""
    return [p.top_k if 0 < p.top_k < vocab else vocab for p in params]


def start_draw(logits: Tensor, params: Sequence[SamplingParams], uniforms: Tensor) -> Draw:
    """sample_rows' kernels, launched on the logits' device without waiting for them: no host sync on
    CUDA (the candidates a top_p row looks at first are a fixed number there, and the rows' parameters
    go over in one copy from pinned memory — a copy from pageable memory waits for the device's queue,
    the forward just launched included). Host logits (HOST_DRAWS) are drawn at once, in numpy."""
    rows, vocab = logits.shape
    ks = top_ks(params, vocab)
    if logits.device.type in HOST_DRAWS:
        tokens = torch.from_numpy(_host_draw(logits, params, ks, uniforms))
        return Draw(tokens, None, logits, params, uniforms)
    cut = [p.top_p < 1.0 or k < vocab for p, k in zip(params, ks, strict=True)]
    some = [i for i in range(rows) if cut[i]]
    whole = [i for i in range(rows) if not cut[i]]
    table = _to_device([[p.temperature for p in params], [p.top_p for p in params], ks, uniforms.tolist(),
                        some + whole], logits.device)
    temps, top_p, k, u, order = table[0], table[1], table[2].long(), table[3], table[4].long()
    top, weights = _weights(logits, temps)
    wider = None
    if not some:
        tokens = _invert(weights, u)
    elif not whole:
        tokens, wider = _sample_truncated(weights, ks, k, top_p, u)
    else:
        tokens = torch.empty(rows, dtype=torch.long, device=logits.device)
        cut_rows, whole_rows = order[:len(some)], order[len(some):]
        tokens[whole_rows] = _invert(weights[whole_rows], u[whole_rows])
        tokens[cut_rows], wider_some = _sample_truncated(weights[cut_rows], [ks[i] for i in some],
                                                         k[cut_rows], top_p[cut_rows], u[cut_rows])
        if wider_some is not None:
            wider = torch.zeros(rows, dtype=torch.bool, device=logits.device)
            wider[cut_rows] = wider_some
    tokens = torch.where(torch.isfinite(top[:, 0]), tokens, NO_DRAW)
    return Draw(tokens, wider, logits, params, uniforms)


def finish_draw(draw: Draw) -> list[int]:
    """The tokens of a started draw (waits for it); rows whose nucleus reached past the candidates
    looked at first are drawn again over all of their tokens (rare: a flat distribution). The draw's
    logits must be unchanged since start_draw."""
    tokens = draw.tokens.tolist()
    flagged = [] if draw.wider is None else draw.wider.nonzero()[:, 0].tolist()
    again = [i for i in flagged if tokens[i] != NO_DRAW]  # a row nothing can be drawn from stays -3
    if again:
        params = [draw.params[i] for i in again]
        vocab = draw.logits.shape[-1]
        ks = top_ks(params, vocab)
        u = draw.uniforms[again].tolist()
        table = [[p.temperature for p in params], [p.top_p for p in params], ks, u]
        temps, top_p, k, u = _to_device(table, draw.logits.device)
        _, weights = _weights(draw.logits[again], temps)
        redrawn, _ = _sample_truncated(weights, ks, k.long(), top_p, u, everything=True)
        for i, token in zip(again, redrawn.tolist(), strict=True):
            tokens[i] = token
    return tokens


def _to_device(rows: list[list[float]], device: torch.device) -> Tensor:
    """Per-row values as one float64 table [len(rows), B] on `device`, in one copy (from pinned memory
    to CUDA, which does not wait for the device's queue)."""
    table = torch.tensor(rows, dtype=torch.float64)
    if device.type == "cuda":
        table = table.pin_memory()
    return table.to(device, non_blocking=True)


def _weights(logits: Tensor, temps: Tensor) -> tuple[Tensor, Tensor]:
    """Each row's maximum logit, and exp((logits - maximum) / temperature): scaled after subtracting
    the maximum, so <= 0 before exp and no temperature overflows it."""
    top = logits.float().amax(-1, keepdim=True)
    # A temperature below float32's smallest normal (~1.2e-38) is that: still a greedy draw, not 0/0.
    temps = temps.float().clamp_min(torch.finfo(torch.float32).tiny)
    return top, torch.exp((logits.float() - top) / temps[:, None])


# A top_p row first looks only at its tokens at least this fraction as likely as its most likely one
# (on the host: a count it knows at once), or at its CANDIDATES most likely ones (CUDA: no sync to
# count); if their mass falls short of top_p, it is drawn again over all of its tokens.
NUCLEUS_FLOOR = 2.0**-16
CANDIDATES = 1024
# Devices whose logits are drawn from on the host, row by row in numpy (_host_draw), not by PyTorch's
# batched kernels, which on the CPU are not vectorized where numpy is: [8, 49152] at temperature 0.8
# and top_p 0.95 took 56 ms on one thread (bench/probes/host_draw.py).
HOST_DRAWS = ("cpu",)


def _host_draw(logits: Tensor, params: Sequence[SamplingParams], ks: list[int],
               uniforms: Tensor) -> np.ndarray:
    """start_draw's tokens for host logits, by the kernels' rule: weights exp((logits - max) /
    temperature) in float32, cut to the top k, then to the nucleus (the likely tokens ranked first,
    every token where those fall short of top_p), the cumulative distribution in float64 inverted at
    the row's uniform. Tied tokens rank by id (_ranked: the same on every machine, so a session thawed
    on another draws the same); sums are grouped differently from the kernels' (rounding only). NO_DRAW
    for a row without a finite maximum."""
    x = logits.detach().float().numpy()
    vocab = x.shape[-1]
    top = x.max(-1)
    tokens = np.full(len(x), NO_DRAW, np.int64)
    tiny = np.finfo(np.float32).tiny
    for i, (p, k, u) in enumerate(zip(params, ks, uniforms.tolist(), strict=True)):
        if not np.isfinite(top[i]):
            continue
        with np.errstate(over="ignore"):  # (a tiny temperature: -inf, a weight of 0, as the kernels')
            w = np.exp((x[i] - top[i]) / np.float32(max(p.temperature, tiny)))
        if k >= vocab and p.top_p >= 1.0:
            tokens[i] = _invert_weights(w, u)
            continue
        ranked = _ranked(w, None, k) if k < vocab else _ranked(w, np.flatnonzero(w >= NUCLEUS_FLOOR))
        values = w[ranked].astype(np.float64)
        probs = values / (values.sum() if k < vocab else w.sum(dtype=np.float64))
        if k >= vocab and probs.sum() < p.top_p:  # the nucleus reaches past the likely tokens (rare)
            ranked = _ranked(w, None)
            probs = w[ranked].astype(np.float64) / w.sum(dtype=np.float64)
        kept = probs * ((np.cumsum(probs) - probs) < p.top_p)
        tokens[i] = ranked[_invert_row(np.cumsum(kept), u)]
    return tokens


_LOW = np.uint64(0xFFFFFFFF)


def _ranked(w: np.ndarray, ids: np.ndarray | None, k: int | None = None) -> np.ndarray:
    """Token ids (of `ids`, None: all) by weight, highest first, ties by id; k: only the k first. Each
    id's key is unique (its weight's bits inverted above the id), so any sort or partition (numpy's
    differ by the CPU's vector instructions, and leave ties as they fall) orders them alike."""
    ids = np.arange(len(w), dtype=np.uint64) if ids is None else ids.astype(np.uint64)
    keys = ((_LOW - w[ids].view(np.uint32).astype(np.uint64)) << np.uint64(32)) | ids  # (w >= 0)
    if k is not None and k < len(keys):
        keys = np.partition(keys, k - 1)[:k]
    keys.sort()
    return (keys & _LOW).astype(np.int64)


BLOCK = 1024  # _invert_weights' blocks


def _invert_weights(w: np.ndarray, u: float) -> int:
    """_invert of one row's weights (float32, >= 0, some > 0) without their whole cumulative sum (a
    serial pass): the block the target falls in by the blocks' sums (float64), then within it."""
    sums = np.add.reduceat(w, np.arange(0, len(w), BLOCK), dtype=np.float64)
    ends = np.cumsum(sums)
    target = _target(u, ends[-1])
    b = min(int(np.searchsorted(ends, target, side="right")), len(ends) - 1)
    block = w[b * BLOCK:(b + 1) * BLOCK]
    cdf = np.cumsum(block, dtype=np.float64) + (ends[b - 1] if b else 0.0)
    at = int(np.searchsorted(cdf, target, side="right"))
    if at < len(block) and block[at] > 0:
        return b * BLOCK + at
    return _invert_row(np.cumsum(w, dtype=np.float64), u)  # (a block's sum rounded past its own cumsum)


def _invert_row(cdf: np.ndarray, u: float) -> int:
    """_invert of one row's cumulative weights (float64): the first position whose weight passes u x
    total."""
    return min(int(np.searchsorted(cdf, _target(u, cdf[-1]), side="right")), len(cdf) - 1)


def _target(u: float, total: float) -> float:
    """Where a uniform u in [0, 1) falls among cumulative weights up to `total`: below the total."""
    return min(u * total, np.nextafter(total, 0.0))


def _sample_truncated(weights: Tensor, ks: list[int], k: Tensor, top_p: Tensor, u: Tensor,
                      everything: bool = False) -> tuple[Tensor, Tensor | None]:
    """Rows with top_k (ks: each row's, the vocabulary for none; k: the same on the device) and/or
    top_p, drawn among each row's K highest tokens, sorted (weights: exp of the scaled logits, max 1);
    and which rows' nuclei reach past those (None: none can)."""
    vocab = weights.shape[-1]
    if everything:
        k_max = vocab
    else:
        k_max = min(vocab, max([CANDIDATES, *(k for k in ks if k < vocab)]))  # every top k fits
    tokens, mass = _draw_among(weights, k_max, k, top_p, u)
    wider = None if k_max == vocab else (k >= vocab) & (mass < top_p)
    return tokens, wider


def _draw_among(weights: Tensor, k_max: int, k: Tensor, top_p: Tensor, u: Tensor) -> tuple[Tensor, Tensor]:
    """Each row's draw among its k_max highest tokens: cut to its top k (k: per row; the vocabulary
    for none), then to its nucleus; and the mass of those candidates in the row's distribution (less
    than top_p: the nucleus reaches past them)."""
    vocab = weights.shape[-1]
    # highest first (a whole row: a sort, which CUDA's top-k is many times slower than at k = vocab)
    values, order = (torch.sort(weights, dim=-1, descending=True) if k_max == vocab
                     else torch.topk(weights, k_max, dim=-1))
    values = values.masked_fill(torch.arange(k_max, device=weights.device)[None, :] >= k[:, None], 0.0)
    values = values.double()
    # Each row's distribution over its allowed tokens: its top k, or (no top_k) its whole row.
    whole = weights.sum(-1, dtype=torch.float64)
    probs = values / torch.where(k < vocab, values.sum(-1), whole)[:, None]
    kept = probs * ((probs.cumsum(-1) - probs) < top_p[:, None])
    return order.gather(-1, _invert(kept, u)[:, None])[:, 0], probs.sum(-1)


def draw_rows(logits: Tensor, temps: Tensor, top_p: Tensor, k: Tensor, u: Tensor) -> tuple[Tensor, Tensor]:
    """sample_rows with every shape fixed and no host sync (what a CUDA graph can hold): per row its
    token, and whether it must be drawn again (finish_draw's wider rows: a nucleus past the CANDIDATES
    looked at, or a top_k larger than them). Rows' parameters as device tensors (k: the vocabulary for
    no top_k). Both draws are made for every row — over the whole vocabulary and among the candidates —
    and each row keeps the one its parameters call for."""
    vocab = logits.shape[-1]
    top, weights = _weights(logits, temps)
    k_max = min(vocab, CANDIDATES)
    among, mass = _draw_among(weights, k_max, k, top_p, u)
    cut = (top_p < 1.0) | (k < vocab)
    tokens = torch.where(cut, among, _invert(weights, u))
    finite = torch.isfinite(top[:, 0])
    wider = cut & finite & (((k >= vocab) & (mass < top_p)) | ((k < vocab) & (k > k_max)))
    return torch.where(finite, tokens, NO_DRAW), wider


def _invert(weights: Tensor, u: Tensor) -> Tensor:
    """Per row, position j with probability weights[j] / the row's total: the first position whose
    cumulative weight (float64) passes u x total (a zero weight never does; u < 1 keeps it below).
    A row of NaN gets some position in range (its token is replaced by NO_DRAW): never an index past
    the row, which on CUDA would fail the whole device."""
    cdf = weights.cumsum(-1, dtype=torch.float64)
    total = cdf[:, -1]
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target[:, None], right=True)[:, 0].clamp_(0, weights.shape[-1] - 1)


def _argmax(logits: Tensor) -> Tensor | np.integer:
    if logits.is_cuda and logits.dtype == torch.float32 and logits.ndim == 1:
        try:
            from floe.engine import triton_kernels
        except ImportError:  # no Triton: PyTorch's reduction is still right, only slower
            return logits.argmax()
        return triton_kernels.argmax(logits)[0]
    return host_argmax(logits)


def host_argmax(logits: Tensor) -> np.ndarray | np.integer | Tensor:
    """The argmax of host logits' last dimension (the first maximum; a NaN counts as the largest, as in
    torch.argmax): numpy's for float32 and float16, vectorized where PyTorch's CPU reduction is not
    (a 49,152-wide row: 2.7 vs 77 us on one thread, [8, 49152]: 24 vs 670 us; PyTorch's two threads on a
    busy 2-core VM took 5 ms for the 8 rows: bench/probes/host_argmax.py). Other dtypes: PyTorch's."""
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float16):
        return logits.detach().float().numpy().argmax(-1)  # (numpy's float16 argmax is not vectorized)
    return logits.argmax(-1)
