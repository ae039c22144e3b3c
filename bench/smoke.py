"""FLOE_BENCH_SMOKE=1: a benchmark runs its whole path at sizes that take seconds, and writes its results
under a temporary folder instead of bench/results/ (tests/test_perf_commands.py runs docs/PERF.md's CPU
commands so: each still runs as written). Its figures mean nothing."""

from __future__ import annotations

import os
import tempfile
from argparse import Namespace
from pathlib import Path

SMOKE = os.environ.get("FLOE_BENCH_SMOKE") == "1"


def shrink(args: Namespace, **small) -> Namespace:
    """`args` with `small`'s values in smoke mode (unchanged otherwise)."""
    if SMOKE:
        for name, value in small.items():
            setattr(args, name, value)
    return args


def results(path: str | Path) -> Path:
    """Where a run writes its results file `path`: in smoke mode a file of that name in a temporary folder
    ($FLOE_BENCH_OUT, else the system's), so a smoke run leaves bench/results/ as it was."""
    if not SMOKE:
        return Path(path)
    folder = Path(os.environ.get("FLOE_BENCH_OUT") or tempfile.gettempdir()) / "floe-bench-smoke"
    folder.mkdir(parents=True, exist_ok=True)
    return folder / Path(path).name


def host() -> dict:
    """The host a run's figures came from: its CPU's model, the cores this process may use, Python's version,
    and `python_us`: a fixed pure-Python workload's time (the median of 5, µs) — serve's share of the
    engine goes with the host's Python speed (a request's CPU in the core differed 2x between two lent
    hosts), so runs on different hosts compare through it."""
    import platform
    import statistics
    import time

    cpu = "?"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")
    except OSError:
        pass

    def workload() -> float:
        t = time.perf_counter()
        table, total = {}, 0
        for i in range(20_000):  # dict, attribute-free arithmetic, calls: a core's admission's mix
            table[i & 255] = table.get(i & 255, 0) + i
            total += len(str(i)) + abs(-i)
        return time.perf_counter() - t

    workload()
    python_us = 1e6 * statistics.median(workload() for _ in range(5))
    return {"cpu": cpu, "cores": len(os.sched_getaffinity(0)), "python": platform.python_version(),
            "python_us": round(python_us, 1)}
