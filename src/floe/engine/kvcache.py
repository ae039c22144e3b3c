"""A static, pre-allocated KV cache with one slot per conversation (actor)."""

from __future__ import annotations

import threading

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
        self._staging: list[torch.Tensor] | None = None  # pinned buffers for loads onto a GPU
        self._staged: list = []
        self._staging_lock = threading.Lock()

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
        pairs = [(self.k[i, slot, :, :n], ki) for i, ki in enumerate(k)]
        pairs += [(self.v[i, slot, :, :n], vi) for i, vi in enumerate(v)]
        if self.k.device.type == "cuda" and n and not k[0].is_pinned():
            self._staged_upload(pairs)
        else:
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
        self.lengths[slot] = n
        self.tokens[slot] = list(tokens)

    def _staged_upload(self, pairs: list) -> None:
        """Host tensors to the device through two pinned buffers: layer i+1 is copied into one
        while layer i goes over the bus from the other. A host-to-device copy from pageable memory
        (e.g. a memory-mapped snapshot) ran at 5.5 GB/s on the H200's host; pinned, at ~44."""
        need = max(src.numel() * src.element_size() for _, src in pairs)
        with self._staging_lock:  # one upload at a time through the shared buffers
            if self._staging is None or self._staging[0].numel() < need:
                self._staging = [torch.empty(need, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
                self._staged = [torch.cuda.Event(), torch.cuda.Event()]
            self._upload(pairs)

    def _upload(self, pairs: list) -> None:
        stream = torch.cuda.current_stream(self.k.device)
        for j, (dst, src) in enumerate(pairs):
            buf, done = self._staging[j % 2], self._staged[j % 2]
            done.synchronize()  # the copy that last read this buffer has finished
            staged = buf[: src.numel() * src.element_size()].view(src.dtype).view(src.shape)
            staged.copy_(src)
            dst.copy_(staged, non_blocking=True)
            done.record(stream)
        stream.synchronize()
