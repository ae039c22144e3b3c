"""The machine a command runs on: its idle CPUs and the threads a model gets, its devices, and a model
loaded onto it with progress shown."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import MutableMapping


def _check_device(device: str) -> None:
    """Raise FloeError now if `device` cannot run here (no CUDA; no WebGPU adapter)."""
    if device == "webgpu":
        from floe.engine.webgpu import adapter

        adapter()
        return
    from floe.engine import parse_device

    parse_device(device)


# How long an OpenMP thread spins at the end of a parallel region before it sleeps (libgomp's
# GOMP_SPINCOUNT; its default is 300,000 spins, ~0.1-1 ms).
GOMP_SPINS = "3000"
# ... also in a thread other than the first to run parallel regions (libgomp's OMP_WAIT_POLICY: see
# polite_openmp).
OMP_WAIT = "ACTIVE"


def polite_openmp(env: MutableMapping[str, str] | None = None) -> None:
    """Before torch is imported: PyTorch's intra-op threads (OpenMP: a prompt's matrix products and
    element-wise ops, 3,211 parallel regions in a 64-token prefill of the default model) spin briefly,
    not ~0.1-1 ms, while the others finish a region. On a machine whose cores are busy with other work
    (a server's HTTP front and clients beside its engine, another job) a thread that spins holds the
    core its descheduled partner needs to finish the region. A 64-token prefill on 2 threads of the
    2-core VM, quiet / beside one busy process (`yes`): 74-76 / 475 ms by default (up to seconds with
    more load), 76-77 / 170 ms at 3,000 spins (1,000: 112 / 122; 30,000: 80 / 800).

    The same spins in every thread: libgomp keeps a team of threads for each thread that runs
    parallel regions (the main thread loading and warming up the model, then the engine loop's), and
    once it keeps more threads than there are CPUs it spins only 100 times (its "throttled" count)
    unless the wait policy is ACTIVE, where GOMP_SPINCOUNT holds there too. Each region's workers
    then slept and were woken by the kernel: a 64-token prefill in the engine loop's thread (every
    actor's, every `floe serve` request's) took 72-76 ms against 46-50 ms in the main thread on a
    2-core Zen 4; with ACTIVE, 51-54 ms (bench/probes/omp_threads.py). Results do not change (the
    same threads do the same work); decode's operators run on floe's own pool (no parallel region a
    decode token). Values the environment sets are kept, both (a user who set either has taken the
    runtime's waits into their own hands); once torch is imported its OpenMP runtime has read them
    already. env: a child process's environment to set them in instead (`floe serve`'s processes
    inherit this one's)."""
    if env is None:
        if "torch" in sys.modules:
            return
        env = os.environ
    if "GOMP_SPINCOUNT" in env or "OMP_WAIT_POLICY" in env:
        return
    env["GOMP_SPINCOUNT"] = GOMP_SPINS
    env["OMP_WAIT_POLICY"] = OMP_WAIT


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
    from floe.engine import parse_dtype
    from floe.model import load_checkpoint

    torch_dtype = parse_dtype(dtype)
    if quiet or not sys.stderr.isatty():
        return load_checkpoint(model, torch_dtype)  # rich not imported: 2.8 MB of resident memory
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("loading {task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())
    with Progress(*columns, transient=True, console=_stderr_console()) as bar:
        task = bar.add_task(model or "default model (SmolLM2-135M-Instruct)", total=None)

        def progress(done: int, total: int, name: str) -> None:
            bar.update(task, completed=done, total=total)

        return load_checkpoint(model, torch_dtype, progress)


def import_torch_holding_ctrl_c() -> None:
    """Import torch with a Ctrl-C held until the import is done, then raised. Raised inside torch's
    C++ start-up (pybind11 calling back into Python), a KeyboardInterrupt ended the process by
    std::terminate ("terminate called after throwing an instance of 'pybind11::error_already_set'",
    SIGABRT) instead of "floe: interrupted" and 130: tests/test_cli.py's Ctrl-C 0.5 s after `floe run`
    started did so once in three runs of the suite on a busy 2-core VM. The import takes ~1-3 s."""
    import signal
    import threading

    previous = signal.getsignal(signal.SIGINT)
    if ("torch" in sys.modules or threading.current_thread() is not threading.main_thread()
            or previous in (signal.SIG_IGN, signal.SIG_DFL, None)):  # (ignored, or not Python's to raise)
        import torch  # noqa: F401
        return
    held: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    try:
        import torch  # noqa: F401
    finally:
        signal.signal(signal.SIGINT, previous)
    if held:
        raise KeyboardInterrupt
