"""A static, pre-allocated KV cache with one slot per conversation (actor)."""

from __future__ import annotations

import math
import mmap
import threading

import numpy as np
import torch

from floe.engine import copyhash
from floe.errors import ContextOverflow, FloeError
from floe.model.config import ModelConfig


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """Zeros; on the CPU in fresh anonymous pages, which cost no resident memory until written
    (torch.zeros writes every byte: a model's full context, 377 MB for SmolLM2 at 8192, at once)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    pages = np.frombuffer(mmap.mmap(-1, max(nbytes, 1)), dtype=np.uint8)[:nbytes]
    return torch.from_numpy(pages).view(dtype).view(shape)


class KVCache:
    """k and v of every layer in two tensors [n_layers, n_slots, n_kv_heads, max_seq_len, head_dim].

    Allocated once; the decode step only writes into it. `lengths[slot]` is how many positions of
    that slot are filled. Untouched pages of a CPU allocation cost no resident memory.
    """

    def __init__(self, c: ModelConfig, max_seq_len: int, n_slots: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        shape = (c.n_layers, n_slots, c.n_kv_heads, max_seq_len, c.head_dim)
        self.k = _zeros(shape, dtype, device)
        self.v = _zeros(shape, dtype, device)
        self._init_slots(max_seq_len, n_slots)
        self._staging: torch.Tensor | None = None  # pinned buffer for loads onto a GPU
        self._staged = None  # the event after the last copy out of it
        self._staging_lock = threading.Lock()

    def _init_slots(self, max_seq_len: int, n_slots: int) -> None:
        """Every slot empty (the bookkeeping each cache's storage shares)."""
        self.max_seq_len = max_seq_len
        self.lengths = [0] * n_slots
        self.tokens: list[list[int]] = [[] for _ in range(n_slots)]  # the ids behind each slot
        # An emptied slot's ids whose K and V it still holds (hold(): a slot handed to a new actor), until
        # anything writes the slot: reuse() gives the new actor back the start its prompt shares.
        self.held: list[list[int] | None] = [None] * n_slots

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
            raise self.overflow(slot, n)
        self.held[slot] = None
        self.lengths[slot] = start + n
        return start

    def reserve_each(self, slots: list[int]) -> list[int]:
        """reserve(slot, 1) of each of several distinct slots in one call (a decode step's rows: not a
        call a row): the position claimed for each, or -1 where the slot is full (nothing claimed)."""
        lengths, limit, held, starts = self.lengths, self.max_seq_len, self.held, []
        for slot in slots:
            start = lengths[slot]
            if start < limit:
                held[slot] = None
                lengths[slot] = start + 1
                starts.append(start)
            else:
                starts.append(-1)
        return starts

    def overflow(self, slot: int, n: int) -> ContextOverflow:
        """The error of n more positions of `slot` past the context."""
        return ContextOverflow(f"{self.lengths[slot]} tokens in context + {n} new exceed the context of "
                               f"{self.max_seq_len} tokens")

    def truncate(self, slot: int, n: int) -> None:
        """Forget all but the first n positions of `slot`."""
        if not 0 <= n <= self.lengths[slot]:
            raise ValueError(f"cannot truncate slot {slot} of length {self.lengths[slot]} to {n}")
        self.lengths[slot] = n
        del self.tokens[slot][n:]

    def hold(self, slot: int) -> None:
        """Empty `slot` but keep its ids: its K and V are still there for reuse() until anything writes
        the slot (a slot handed to a new actor, floe.actor.Actor.adopt_slot). An empty slot keeps what it
        holds (handed on again before anything wrote it)."""
        if self.lengths[slot] == 0:
            return
        held = self.tokens[slot][:self.lengths[slot]]
        self.truncate(slot, 0)
        self.drop_held(slot)
        self.held[slot] = held or None

    def reuse(self, slot: int, ids: list[int] | np.ndarray) -> int:
        """Before the first prompt `ids` goes into an emptied slot that holds ids (hold()): the longest
        start they share, at most all but the last id (whose logits are asked for), is the slot's again
        (its K and V were computed for exactly those ids); how many. The held ids are gone after this."""
        held = self.held[slot]
        self.drop_held(slot)
        if held is None or self.lengths[slot] != 0:
            return 0
        n = min(len(held), len(ids) - 1)
        differ = np.flatnonzero(np.asarray(ids[:n], dtype=np.int64) != np.asarray(held[:n], dtype=np.int64))
        start = int(differ[0]) if len(differ) else n
        self.lengths[slot], self.tokens[slot] = start, held[:start]
        return start

    def drop_held(self, slot: int) -> None:
        """`slot` is written (or claimed, or loaded): what it held is not there now."""
        self.held[slot] = None

    def export(self, slot: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Views of the filled prefix of `slot`, per layer: k and v [n_kv_heads, length, head_dim]."""
        n = self.lengths[slot]
        return _layers(self.k, slot, n), _layers(self.v, slot, n)

    def load(self, slot: int, k: list[torch.Tensor], v: list[torch.Tensor], tokens: list[int],
             digests: list[str] | None = None) -> None:
        """Replace `slot`'s contents with k/v per layer [n_kv_heads, length, head_dim] and their ids.

        `digests`, if given: the XXH3-128 (hex) of each tensor of `k + v`, checked against the bytes
        as they landed in host memory on their way in (copied and hashed in one pass by several
        threads, floe.engine.copyhash); a tensor that differs raises KVDigestMismatch and leaves the
        slot empty.
        """
        self.start_load(k, v, digests).into(slot, tokens)

    def start_load(self, k: list[torch.Tensor], v: list[torch.Tensor],
                   digests: list[str] | None = None) -> PendingLoad:
        """Begin `load` before the slot is known: onto a GPU, the host tensors start going into pinned
        memory (and being hashed) now, on threads of their own; `into(slot, tokens)` finishes. A
        thaw creates its actor meanwhile. Until `into` or `close`, other loads onto this GPU wait."""
        return PendingLoad(self, list(k) + list(v), digests)


STAGING_BYTES = 256 << 20  # the most pinned memory a load onto a GPU stages at once


class PendingLoad:
    """Host KV tensors on their way into a cache slot (KVCache.start_load)."""

    def __init__(self, cache: KVCache, src: list[torch.Tensor], digests: list[str] | None) -> None:
        self.cache, self.src, self.digests = cache, src, digests
        on_host = src[0].device.type == "cpu" if src else True
        if digests is not None and not (on_host and all(s.is_contiguous() for s in src)):
            raise ValueError("only contiguous tensors in host memory are checked on their way into the cache")
        self.sizes = [s.numel() * s.element_size() for s in src]
        to_gpu = cache.k.device.type == "cuda" and on_host and sum(self.sizes) > 0
        # Checked tensors already in pinned memory (the store's pinned tier): hashed where they lie while
        # the bus takes them from there, their digests compared before the slot is theirs (a copy into
        # the staging buffer first made a 4,080-token thaw's load 4.1 ms against a 2.4 ms bus floor).
        self.direct = to_gpu and digests is not None and all(s.is_pinned() for s in src)
        self.staged = to_gpu and not self.direct and (digests is not None or not src[0].is_pinned())
        self._locked = False
        self._job: copyhash.Job | None = None
        self.copies: list[tuple[str, int]] = []  # after `into`: (boundary, bytes) of each copy made
        if self.direct or self.staged:
            self._groups = _groups(self.sizes, max(STAGING_BYTES, max(self.sizes)))
            cache._staging_lock.acquire()  # one load onto this GPU at a time (its pinned buffer; each
            self._locked = True  # group's device buffer is up to STAGING_BYTES)
            try:
                if self.direct:  # (hashing from now on)
                    self._job = copyhash.Job([[(copyhash.as_bytes(s), None)] for s in src])
                else:
                    need = max(sum(self.sizes[j] for j in g) for g in self._groups)
                    if cache._staging is None or cache._staging.numel() < need:
                        with torch.cuda.device(cache.k.device):
                            cache._staging = torch.empty(need, dtype=torch.uint8, pin_memory=True)
                            cache._staged = torch.cuda.Event()
                    self._views = self._start(self._groups[0])
            except BaseException:
                self.close()
                raise

    def _start(self, group: list[int]) -> list[torch.Tensor]:
        """Copy (and hash) `group`'s tensors into the pinned buffer, on the copy threads."""
        self.cache._staged.synchronize()  # the copies that last read the buffer have finished
        at, views = 0, []
        for j in group:
            views.append(self.cache._staging[at:at + self.sizes[j]])
            at += self.sizes[j]
        pieces = [[(copyhash.as_bytes(self.src[j]), view.numpy())]
                  for j, view in zip(group, views, strict=True)]
        self._job = copyhash.Job(pieces, hash=self.digests is not None)
        return views

    def into(self, slot: int, tokens: list[int]) -> None:
        """Finish: `slot` holds the tensors and `tokens`, or (on any error) nothing."""
        cache, n = self.cache, len(tokens)
        try:
            if n > cache.max_seq_len:
                raise ContextOverflow(f"{n} tokens do not fit a context of {cache.max_seq_len}")
            cache.lengths[slot], cache.tokens[slot] = 0, []  # empty until every tensor is in and checked
            cache.drop_held(slot)
            if not n:
                return
            total = sum(self.sizes)
            hashed = " (hashed in the same pass)" if self.digests is not None else ""
            if self.direct or self.staged:
                landed = self._upload(slot, n)
                device = cache.k.device.type
                self.copies = [
                    *([(f"KV pinned→{device} (DMA; hashed where it lies)", total)] if self.direct else
                      [(f"KV host→pinned{hashed}", total), (f"KV pinned→{device} (DMA)", total)]),
                    (f"KV {device} staging→cache slot", total)]
            else:
                dst = _layers(cache.k, slot, n) + _layers(cache.v, slot, n)
                if self.digests is not None:  # a CPU cache: copied into the slot head by head, hashed there
                    landed = copyhash.Job.heads(self.src, dst).digests()
                    self.copies = [(f"KV host→cache slot{hashed}", total)]
                else:
                    for d, s in zip(dst, self.src, strict=True):
                        d.copy_(s, non_blocking=True)
                    self.copies = [(f"KV {self.src[0].device.type}→{cache.k.device.type} cache slot", total)]
            if self.digests is not None:
                for j, (want, got) in enumerate(zip(self.digests, landed, strict=True)):
                    if want != got:
                        raise KVDigestMismatch(j, want, got)
            cache.lengths[slot] = n
            cache.tokens[slot] = list(tokens)
        finally:
            self.close()

    def _upload(self, slot: int, n: int) -> list[str]:
        """Each tensor over the bus as soon as it is in the pinned buffer, into one contiguous device
        buffer (a strided destination would cost each copy a temporary and a kernel); then one
        kernel per run of K or V layers puts them into the slot; then the next group. Returns the
        tensors' digests (meaningless when not hashing)."""
        cache, layers, landed = self.cache, len(self.src) // 2, []
        with torch.cuda.device(cache.k.device):
            try:
                for g, group in enumerate(self._groups):
                    views = None if self.direct else self._views if g == 0 else self._start(group)
                    assert self._job is not None
                    dtype, shape = self.src[group[0]].dtype, tuple(self.src[group[0]].shape)
                    device = torch.empty((len(group), *shape), dtype=dtype, device=cache.k.device)
                    for i, j in enumerate(group):
                        if views is None:  # (direct: sent before its hash is done; compared below)
                            device[i].copy_(self.src[j], non_blocking=True)
                        else:
                            self._job.wait(i)
                            device[i].copy_(views[i].view(dtype).view(shape), non_blocking=True)
                    if views is not None:
                        self.cache._staged.record()
                    for whole, lo, hi in ((cache.k, 0, layers), (cache.v, layers, 2 * layers)):
                        run = [i for i, j in enumerate(group) if lo <= j < hi]
                        if run:
                            first = group[run[0]] - lo
                            whole[first:first + len(run), slot, :, :n].copy_(device[run[0]:run[-1] + 1])
                    if views is not None:
                        landed += self._job.digests()  # also waits for the copy threads to leave the job
                if self.direct:
                    landed = self._job.digests()
            finally:
                if self.direct:  # the sources (a tier's pinned memory, which may go once this returns) read
                    torch.cuda.current_stream(cache.k.device.index).synchronize()
        return landed

    def __del__(self) -> None:
        self.close()

    def close(self) -> None:
        """Let go of the pinned buffer (after the copy threads are done with it)."""
        if self._job is not None:
            self._job.join()
            self._job = None
        if self._locked:
            self._locked = False
            self.cache._staging_lock.release()


def _layers(whole: torch.Tensor, slot: int, n: int) -> list[torch.Tensor]:
    """Each layer's view of `slot`'s first n positions of a cache tensor [layers, slots, heads, seq, dim]:
    one unbind (a layer's own indexing, 60 of them, was ~0.3 ms of a small thaw)."""
    return list(whole[:, slot, :, :n].unbind(0))


def _groups(sizes: list[int], cap: int) -> list[list[int]]:
    """Consecutive indices in groups of at most `cap` bytes (a bigger one alone)."""
    groups: list[list[int]] = [[]]
    room = 0
    for j, size in enumerate(sizes):
        if groups[-1] and room + size > cap:
            groups.append([])
            room = 0
        groups[-1].append(j)
        room += size
    return groups




class KVDigestMismatch(FloeError):
    """A tensor loaded into the cache did not hash to the digest it was given."""

    def __init__(self, index: int, expected: str, actual: str) -> None:
        super().__init__(f"KV tensor {index} hashes to {actual}, not {expected}")
        self.index, self.expected, self.actual = index, expected, actual
