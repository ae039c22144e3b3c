"""A static, pre-allocated KV cache with one slot per conversation (actor)."""

from __future__ import annotations

import torch

from floe.errors import ContextOverflow
from floe.model.config import ModelConfig


class KVCache:
    """k and v of every layer in two tensors [n_layers, n_slots, n_kv_heads, max_seq_len, head_dim].

    Allocated once; the decode step only writes into it. `lengths[slot]` is how many positions of
    that slot are filled. Untouched pages of a CPU allocation cost no resident memory.
    """

    def __init__(self, c: ModelConfig, max_seq_len: int, n_slots: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        shape = (c.n_layers, n_slots, c.n_kv_heads, max_seq_len, c.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_seq_len = max_seq_len
        self.lengths = [0] * n_slots
        self.tokens: list[list[int]] = [[] for _ in range(n_slots)]  # the ids behind each slot

    @property
    def n_slots(self) -> int:
        return len(self.lengths)

    @property
    def bytes_per_token(self) -> int:
        """Bytes of K and V one position of one slot occupies, all layers."""
        n_layers, _, n_kv, _, head_dim = self.k.shape
        return 2 * n_layers * n_kv * head_dim * self.k.element_size()

    def reserve(self, slot: int, n: int) -> int:
        """Claim n more positions of `slot`; returns the first. Raises ContextOverflow if full."""
        start = self.lengths[slot]
        if start + n > self.max_seq_len:
            raise ContextOverflow(
                f"{start} tokens in context + {n} new exceed the context of {self.max_seq_len} tokens"
            )
        self.lengths[slot] = start + n
        return start

    def truncate(self, slot: int, n: int) -> None:
        """Forget all but the first n positions of `slot`."""
        if not 0 <= n <= self.lengths[slot]:
            raise ValueError(f"cannot truncate slot {slot} of length {self.lengths[slot]} to {n}")
        self.lengths[slot] = n
        del self.tokens[slot][n:]

    def export(self, slot: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Views of the filled prefix of `slot`, per layer: k and v [n_kv_heads, length, head_dim]."""
        n = self.lengths[slot]
        return ([self.k[i, slot, :, :n] for i in range(self.k.shape[0])],
                [self.v[i, slot, :, :n] for i in range(self.v.shape[0])])

    def load(self, slot: int, k: list[torch.Tensor], v: list[torch.Tensor], tokens: list[int]) -> None:
        """Replace `slot`'s contents with k/v per layer [n_kv_heads, length, head_dim] and their ids."""
        n = len(tokens)
        if n > self.max_seq_len:
            raise ContextOverflow(f"{n} tokens do not fit a context of {self.max_seq_len}")
        for i, (ki, vi) in enumerate(zip(k, v, strict=True)):
            self.k[i, slot, :, :n].copy_(ki, non_blocking=True)
            self.v[i, slot, :, :n].copy_(vi, non_blocking=True)
        self.lengths[slot] = n
        self.tokens[slot] = list(tokens)
