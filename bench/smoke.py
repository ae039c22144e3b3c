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
