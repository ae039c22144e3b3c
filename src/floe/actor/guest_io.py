"""The host ABI's reads and writes of guest memory (floe.actor.abi: HostABI is a GuestIO): each pointer
checked against the guest's memory (a GuestPointerError otherwise), each byte charged to the message's
budget and counted in its ledger."""

from __future__ import annotations

import struct
import time
from typing import Protocol

import numpy as np
import torch

from floe.memory import OutOfBounds
from floe.wasm import GuestPointerError

MASK32 = 0xFFFFFFFF  # an i32 word as the raw calling convention carries it


def as_i32(word: int) -> int:
    word &= MASK32
    return word - (1 << 32) if word & 0x80000000 else word


class GuestIO:
    """Guest memory through the host ABI's MessageContext (its region and ledger) and message budget."""

    def _length(self, value: int) -> int | None:
        """An i32 length or count; None (the call answers ERR_BAD_ARGUMENT) when negative."""
        value = as_i32(value)
        return None if value < 0 else value

    def _struct(self, ptr: int, layout: struct.Struct, align: int, what: str) -> bytes:
        if ptr % align:
            raise GuestPointerError(f"{what}: pointer {ptr} is not {align}-byte aligned")
        return self._bytes(ptr, layout.size, what)

    def _bytes(self, ptr: int, length: int, what: str) -> bytes:
        self.budget.spend(length, what)
        t = time.perf_counter()
        try:
            data = self.context.region.read(ptr, length)
        except OutOfBounds as e:
            raise GuestPointerError(f"{what}: guest pointer {e}") from None
        self.context.ledger.copy(f"guest→host {what}", length, seconds=time.perf_counter() - t)
        return data

    def _view(self, ptr: int, count: int, dtype: torch.dtype, what: str) -> torch.Tensor:
        itemsize = dtype.itemsize
        if ptr % itemsize:
            raise GuestPointerError(f"{what}: pointer {ptr} is not {itemsize}-byte aligned")
        try:
            return self.context.region.torch(ptr, count, dtype)
        except OutOfBounds as e:
            raise GuestPointerError(f"{what}: guest pointer {e}") from None

    def _write(self, ptr: int, cap: int, data: bytes, what: str) -> None:
        n = min(cap, len(data))
        self.budget.spend(n, what)
        t = time.perf_counter()
        try:
            self.context.region.check(ptr, cap)
            self.context.region.write(ptr, data[:n])
        except OutOfBounds as e:
            raise GuestPointerError(f"{what}: guest pointer {e}") from None
        self.context.ledger.copy(f"host→guest {what}", n, seconds=time.perf_counter() - t)

    def _write_ids(self, ptr: int, cap: int, ids: list[int], what: str) -> int:
        self.budget.spend(4 * min(cap, len(ids)), what)
        t = time.perf_counter()
        if ptr % 4:
            raise GuestPointerError(f"{what}: pointer {ptr} is not 4-byte aligned")
        try:
            out = self.context.region.numpy(ptr, cap, np.int32)
        except OutOfBounds as e:
            raise GuestPointerError(f"{what}: guest pointer {e}") from None
        n = min(cap, len(ids))
        if n:  # numpy fills from the list in one C loop (a tensor of the list first costs ~3x more)
            out[:n] = ids[:n]
        self.context.ledger.copy(f"host→guest {what}", 4 * n, seconds=time.perf_counter() - t)
        return len(ids)


class NativeAnswers(Protocol):
    """What HostABI asks of the imports answered natively (floe.actor.native_imports.NativeImports, which
    imports the host ABI: named here, not imported): around each Python import of a staged call, their
    effects folded in first and the budget's room staged again after."""

    staged: bool

    def fold(self) -> None: ...

    def room(self) -> None: ...
