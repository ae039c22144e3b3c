"""The boundary ledger: for every place data crosses a boundary, how many copies, bytes and seconds.

Every layer records into a Ledger it is handed; this module imports none of them. A zero-copy
crossing records copies=0 with the bytes it *shared*; a crossing that materialises data (a copy
out of guest memory, a dtype conversion, a device transfer) records each copy and its bytes.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Boundary:
    name: str
    calls: int = 0
    copies: int = 0
    bytes_copied: int = 0
    bytes_shared: int = 0
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return {"name": self.name, "calls": self.calls, "copies": self.copies,
                "bytes": self.bytes_copied + self.bytes_shared, "bytes_copied": self.bytes_copied,
                "bytes_shared": self.bytes_shared, "seconds": self.seconds}


class Ledger:
    """Accumulates Boundary records by name. A disabled ledger records nothing."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.boundaries: dict[str, Boundary] = {}

    def copy(self, name: str, nbytes: int, copies: int = 1, seconds: float = 0.0) -> None:
        """`copies` materialisations of `nbytes` bytes each crossed boundary `name`."""
        if self.enabled:
            b = self._get(name)
            b.calls += 1
            b.copies += copies
            b.bytes_copied += nbytes * copies
            b.seconds += seconds

    def share(self, name: str, nbytes: int, seconds: float = 0.0) -> None:
        """`nbytes` crossed boundary `name` without a copy (a view of the same memory)."""
        if self.enabled:
            b = self._get(name)
            b.calls += 1
            b.bytes_shared += nbytes
            b.seconds += seconds

    def _get(self, name: str) -> Boundary:
        b = self.boundaries.get(name)
        if b is None:
            b = self.boundaries[name] = Boundary(name)
        return b

    def rows(self) -> list[dict]:
        return [b.as_dict() for b in self.boundaries.values()]

    def total_copies(self) -> int:
        return sum(b.copies for b in self.boundaries.values())
