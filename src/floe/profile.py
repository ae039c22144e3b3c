"""The boundary ledger: for every place data crosses a boundary, how many copies, bytes and seconds.

Every layer records into a Ledger it is handed; this module imports none of them. Also here: the
dispatch counter and the roofline arithmetic that `floe profile` and `floe bench` report. A zero-copy
crossing records copies=0 with the bytes it *shared*; a crossing that materialises data (a copy
out of guest memory, a dtype conversion, a device transfer) records each copy and its bytes.
"""

from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch


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

    def copied(self, name: str, calls: int, copies: int, nbytes: int, seconds: float = 0.0) -> None:
        """What `calls` records of copy() would add, at once: `copies` copies of `nbytes` bytes in all
        (the engine loop counts its rows' crossings and records them when their turn ends)."""
        if self.enabled and calls:
            b = self._get(name)
            b.calls += calls
            b.copies += copies
            b.bytes_copied += nbytes
            b.seconds += seconds

    def shared(self, name: str, calls: int, nbytes: int) -> None:
        """What `calls` records of share() would add, at once (`nbytes` in all)."""
        if self.enabled and calls:
            b = self._get(name)
            b.calls += calls
            b.bytes_shared += nbytes

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

    def overhead_per_record_s(self, n: int = 20000) -> float:
        """What one record costs when the ledger is enabled (measured on a scratch ledger)."""
        scratch = Ledger()
        t = time.perf_counter()
        for _ in range(n):
            scratch.copy("x", 8, seconds=0.0)
        return (time.perf_counter() - t) / n


# ---- dispatches ------------------------------------------------------------------------------------


def count_dispatches(fn, device: torch.device | str, steps: int = 5) -> dict:
    """What one call of fn() dispatches, averaged over `steps` calls after a warm-up call.

    `framework_ops`: PyTorch operators as called (aten ops not nested in another aten op; those of a
    TorchScript function count, its own record does not). `device_kernels`: kernels the GPU ran
    (CUDA graph replays included; memcpy/memset not counted), None on the CPU.
    """
    from torch.profiler import ProfilerActivity, profile

    device = torch.device(device)
    fn()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with _quiet_native_stderr():  # Kineto prints a line to fd 2 at every profiler start and stop
        prof = profile(activities=activities)
        prof.__enter__()
    try:
        for _ in range(steps):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
    finally:
        with _quiet_native_stderr():
            prof.__exit__(None, None, None)
    events = prof.events()
    ops = [e for e in events if e.name.startswith("aten::") and e.device_type == torch.autograd.DeviceType.CPU
           and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))]
    kernels = None
    if device.type == "cuda":
        kernels = len([e for e in events if e.device_type == torch.autograd.DeviceType.CUDA
                       and "memcpy" not in e.name.lower() and "memset" not in e.name.lower()]) / steps
    return {"framework_ops": len(ops) / steps, "device_kernels": kernels}


@contextmanager
def _quiet_native_stderr():
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


# ---- the roofline ----------------------------------------------------------------------------------


def linear_params(c) -> tuple[int, int]:
    """(weights of every layer's projections, weights of the vocabulary head) of a ModelConfig."""
    per_layer = c.dim * (c.n_heads + 2 * c.n_kv_heads) * c.head_dim + c.n_heads * c.head_dim * c.dim
    per_layer += 3 * c.dim * c.ffn_dim
    return c.n_layers * per_layer, c.vocab_size * c.dim


def prefill_flops(c, n: int) -> int:
    """FLOPs of prefilling n tokens from an empty cache: every projection for each token, causal
    attention (QKᵀ and PV, n²/2 pairs each), and the head for the last token only."""
    layers, head = linear_params(c)
    return 2 * layers * n + 2 * head + 2 * c.n_layers * c.n_heads * c.head_dim * n * n


def roofline(decode_bytes_per_token: int, decode_s_per_token: float, bandwidth_b_s: float,
             prefill_tokens: int, prefill_s: float, prefill_flop: int, matmul_flop_s: float) -> dict:
    """Decode against the memory-bandwidth ceiling, prefill against the matmul-rate ceiling."""
    decode_ceiling_s = decode_bytes_per_token / bandwidth_b_s
    prefill_ceiling_s = prefill_flop / matmul_flop_s
    return {
        "decode_bytes_per_token": decode_bytes_per_token,
        "bandwidth_gb_s": bandwidth_b_s / 1e9,
        "decode_tok_s": 1 / decode_s_per_token,
        "decode_ceiling_tok_s": 1 / decode_ceiling_s,
        "decode_achieved_gb_s": decode_bytes_per_token / decode_s_per_token / 1e9,
        "decode_pct_of_ceiling": 100 * decode_ceiling_s / decode_s_per_token,
        "prefill_tokens": prefill_tokens,
        "prefill_flops": prefill_flop,
        "matmul_tflop_s": matmul_flop_s / 1e12,
        "prefill_achieved_tflop_s": prefill_flop / prefill_s / 1e12,
        "prefill_pct_of_ceiling": 100 * prefill_ceiling_s / prefill_s,
    }
