"""The machine a command runs on: its idle CPUs and the threads a model gets, its devices, and a model
loaded onto it with progress shown."""

from __future__ import annotations

import argparse
import os
import sys
import time


def _check_device(device: str) -> None:
    """Raise FloeError now if `device` cannot run here (no CUDA; no WebGPU adapter)."""
    if device == "webgpu":
        from floe.engine.webgpu import adapter

        adapter()
        return
    from floe.engine import parse_device

    parse_device(device)


def _threads(args: argparse.Namespace, device: str, reserve: int = 0) -> int | None:
    """Set PyTorch's CPU threads for a CPU run: --threads, else the cores idle right now (less
    `reserve`). A thread on a core another process keeps busy makes every parallel op wait for it
    (decode ~50x slower on 2 cores), so busy cores are left out. Returns the count (None: not CPU)."""
    if not device.startswith("cpu"):
        return None
    import torch

    n = args.threads or max(1, idle_cpus() - reserve)
    torch.set_num_threads(n)
    return n


def idle_cpus(window_s: float = 0.1) -> int:
    """CPUs (of those this process may run on) that were mostly idle over the last `window_s`."""

    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    try:
        first = _cpu_times()
        time.sleep(window_s)
        second = _cpu_times()
    except OSError:  # no /proc/stat: every allowed core
        return max(1, len(allowed) or (os.cpu_count() or 1))
    idle = 0
    for cpu in allowed or second:
        if cpu in first and cpu in second:
            busy0, total0 = first[cpu]
            busy1, total1 = second[cpu]
            if total1 > total0 and (busy1 - busy0) / (total1 - total0) < 0.5:
                idle += 1
    return max(1, idle)


def _cpu_times() -> dict[int, tuple[int, int]]:
    """cpu index -> (busy jiffies, total jiffies), from /proc/stat."""
    out = {}
    with open("/proc/stat") as f:
        for line in f:
            name, *fields = line.split()
            if name.startswith("cpu") and name[3:].isdigit():
                values = [int(v) for v in fields]
                total = sum(values[:8])
                out[int(name[3:])] = (total - values[3] - values[4], total)  # idle, iowait
    return out


def _stderr_console():
    from rich.console import Console

    return Console(stderr=True, soft_wrap=True)


def _load_with_progress(model: str | None, dtype: str, quiet: bool):
    """Load a checkpoint, showing a progress bar on stderr while tensors are read."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from floe.engine import parse_dtype
    from floe.model import load_checkpoint

    torch_dtype = parse_dtype(dtype)
    if quiet or not sys.stderr.isatty():
        return load_checkpoint(model, torch_dtype)
    columns = (TextColumn("loading {task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())
    with Progress(*columns, transient=True, console=_stderr_console()) as bar:
        task = bar.add_task(model or "default model (SmolLM2-135M-Instruct)", total=None)

        def progress(done: int, total: int, name: str) -> None:
            bar.update(task, completed=done, total=total)

        return load_checkpoint(model, torch_dtype, progress)
