"""The KV cache's slots as a pool: one per conversation, claimed and given back from any thread."""

from __future__ import annotations

import threading

from floe.errors import FloeError


class SlotPool:
    """Slots 0..n-1; `free` is a snapshot of the unclaimed ones, lowest first."""

    def __init__(self, n: int) -> None:
        self.n = n
        self._free = list(range(n))
        self._lock = threading.Lock()

    @property
    def free(self) -> tuple[int, ...]:
        with self._lock:
            return tuple(self._free)

    def claim(self) -> int:
        """The lowest free slot, now claimed."""
        with self._lock:
            if not self._free:
                raise FloeError(f"all {self.n} KV cache slots are in use: each actor holds one until "
                                "closed; create the Engine with n_slots=N to run N actors at once")
            return self._free.pop(0)

    def claim_free(self, slots: tuple[int, ...] | list[int] | None = None) -> list[int]:
        """Claim those of `slots` (default: all) that are free now; the ones claimed."""
        with self._lock:
            taken = [s for s in (self._free if slots is None else slots) if s in self._free]
            for s in taken:
                self._free.remove(s)
            return taken

    def release(self, slot: int) -> None:
        """Give `slot` back (again: nothing)."""
        with self._lock:
            if slot not in self._free:
                self._free.append(slot)
                self._free.sort()
