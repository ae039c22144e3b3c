"""Timing device work with CUDA events (shared by the CUDA benchmarks)."""

from __future__ import annotations

import statistics

import torch


def events_time(fn, repeats: int, warmup: int = 3) -> float:
    """Median seconds of fn() measured with CUDA events, after `warmup` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)
