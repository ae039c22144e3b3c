"""Which of a process's threads ran when: each thread's time on a CPU (/proc/PID/task/TID/schedstat,
nanoseconds) read every --every-ms by this separate process (it needs no GIL of the one it watches), so
that a burst through `floe serve`'s core shows, window by window, how much the engine loop ran against
the chat threads, the spare maker, the epoch ticker... A Python thread runs only while it holds its
process's GIL (or inside C code that let it go), so the CPU shares of a core's Python threads in a
window are its GIL's shares there, near enough.

    python bench/probes/thread_timeline.py --pid PID --out timeline.json [--every-ms 1]
        (until SIGTERM or SIGINT; --names FILE: {native thread id: name} written by the watched process)
    python bench/probes/thread_timeline.py --show timeline.json [--bin-ms 10] [--marks marks.json]

`bench/serve_load.py --server-process --timeline DIR` runs the sampler against its core and writes the
names (its core's threads, every 0.2 s) and the load's marks (when the burst was sent, its first and last
first tokens, its first and last ends: time.monotonic, one clock for every process of a machine).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import signal
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path


class Threads:
    """Each thread's CPU time of one process (children: and of its child processes, e.g. `floe serve`'s
    HTTP fronts, their threads named "child PID: NAME"), its schedstat files kept open (pread again
    each sample: ~2 µs a thread instead of an open and a close), the lists of threads read again every
    RELIST samples (a pool's new threads)."""

    RELIST = 20

    def __init__(self, pid: int, children: bool = False) -> None:
        self.pid, self.children, self.fds, self.names, self.reads = pid, children, {}, {}, 0

    def _pids(self) -> list[int]:
        pids = [self.pid]
        if self.children:
            for tid in os.listdir(f"/proc/{self.pid}/task"):
                try:
                    with open(f"/proc/{self.pid}/task/{tid}/children") as f:
                        pids += map(int, f.read().split())
                except OSError:
                    continue
        return pids

    def _list(self) -> None:
        for pid in self._pids():
            task = f"/proc/{pid}/task"
            try:
                tids = list(map(int, os.listdir(task)))
            except OSError:  # (a child that ended)
                continue
            for tid in tids:
                if tid not in self.fds:
                    try:
                        self.fds[tid] = os.open(f"{task}/{tid}/schedstat", os.O_RDONLY)
                        with open(f"{task}/{tid}/comm") as f:
                            name = f.read().strip()
                    except OSError:
                        continue
                    self.names[tid] = name if pid == self.pid else f"child {pid}: {name}"

    def read(self) -> dict[int, int]:
        """{tid: ns on a CPU so far} of every live thread (one that ended is closed and left out)."""
        if self.reads % self.RELIST == 0:
            self._list()
        self.reads += 1
        out = {}
        for tid, fd in list(self.fds.items()):
            try:
                out[tid] = int(os.pread(fd, 128, 0).split(None, 1)[0])
            except (OSError, ValueError, IndexError):  # (the thread ended: ESRCH)
                os.close(fd)
                del self.fds[tid]
        return out


def sample(pid: int, every_s: float, stop: threading.Event, children: bool = False) -> dict:
    """Samples until `stop` (or the process ends): {"t": [monotonic s], "cpu": {tid: [ns or None]},
    "comm": {tid: name}}."""
    times: list[float] = []
    cpu: dict[int, list[int | None]] = {}
    threads = Threads(pid, children)
    next_at = time.monotonic()
    while not stop.is_set():
        try:
            now_ns = threads.read()
        except (FileNotFoundError, ProcessLookupError):
            break
        if not now_ns:
            break
        t = time.monotonic()
        k = len(times)
        times.append(t)
        for tid, ns in now_ns.items():
            if tid not in cpu:
                cpu[tid] = [None] * k
            cpu[tid].append(ns)
        for row in cpu.values():
            if len(row) <= k:
                row.append(None)
        next_at += every_s
        delay = next_at - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        else:
            next_at = time.monotonic()
    return {"pid": pid, "t": times, "cpu": {str(k): v for k, v in cpu.items()},
            "comm": {str(k): v for k, v in threads.names.items()}}


def group(name: str) -> str:
    """A thread's group: its name less the numbers a pool adds (floe-chat_12 -> floe-chat), a child
    process's threads as one group per name whatever the child (child 1234: python3 -> child: python3)."""
    name = re.sub(r"^child \d+: ", "child: ", name)
    return re.sub(r"(?<=[_-])\d+$|[_-]\d+$", "", re.sub(r" \(.*\)$", "", name)).rstrip("_-") or name


def ms_by_group(data: dict, names: dict[str, str], start: float, end: float) -> dict[str, float]:
    """CPU ms each thread group ran in [start, end] (the samples nearest its ends)."""
    t = data["t"]
    first = next((i for i, x in enumerate(t) if x >= start), len(t) - 1)
    last = max(first, max((i for i, x in enumerate(t) if x <= end), default=first))
    out: dict[str, float] = defaultdict(float)
    for tid, row in data["cpu"].items():
        a = next((row[i] for i in range(first, last + 1) if row[i] is not None), None)
        b = next((row[i] for i in range(last, first - 1, -1) if row[i] is not None), None)
        if a is not None and b is not None and b > a:
            out[group(names.get(tid) or data["comm"].get(tid, "?"))] += (b - a) / 1e6
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def show(path: Path, bin_ms: float, marks_path: Path | None, top: int) -> None:
    data = json.loads(path.read_text())
    names = data.get("names", {})
    t = data["t"]
    if len(t) < 2:
        sys.exit("fewer than two samples")
    gaps = sorted(b - a for a, b in itertools.pairwise(t))
    print(f"{len(t)} samples over {t[-1] - t[0]:.2f} s, gap p50 {1e3 * gaps[len(gaps) // 2]:.2f} ms, "
          f"p99 {1e3 * gaps[int(0.99 * (len(gaps) - 1))]:.2f} ms")
    marks_path = marks_path or path.with_name("marks.json")
    marks = json.loads(marks_path.read_text()) if marks_path.exists() else {}
    start = marks.get("sent", t[0])
    end = marks.get("last_end", t[-1])
    if marks:
        print("marks (ms after the burst was sent): " + ", ".join(
            f"{k} {1e3 * (v - start):.1f}" for k, v in sorted(marks.items(), key=lambda kv: kv[1])))
        cuts = [(k, v) for k, v in sorted(marks.items(), key=lambda kv: kv[1]) if start <= v <= end]
        for (a_name, a), (b_name, b) in itertools.pairwise(cuts):
            if b - a < 1e-4:
                continue
            spent = ms_by_group(data, names, a, b)
            print(f"  {a_name} -> {b_name} ({1e3 * (b - a):.1f} ms): " + ", ".join(
                f"{k} {v:.1f}" for k, v in list(spent.items())[:top]) + " (CPU ms)")
    whole = ms_by_group(data, names, start, end)
    groups = list(whole)[:top]
    print(f"\nCPU ms a {bin_ms:g} ms bin, from the burst's send (whole window: "
          + ", ".join(f"{k} {whole[k]:.1f}" for k in groups) + ")")
    print("   ms  " + "".join(f"{g[:14]:>15}" for g in groups))
    edge = start
    while edge < end:
        spent = ms_by_group(data, names, edge, min(end, edge + bin_ms / 1e3))
        print(f"{1e3 * (edge - start):5.0f}  " + "".join(f"{spent.get(g, 0.0):15.1f}" for g in groups))
        edge += bin_ms / 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pid", type=int)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--names", type=Path, default=None, help="{tid: name} written by the watched process")
    ap.add_argument("--every-ms", type=float, default=1.0)
    ap.add_argument("--children", action="store_true",
                    help="the child processes' threads too (floe serve's fronts), named 'child PID: NAME'")
    ap.add_argument("--show", type=Path, default=None, help="a timeline this wrote: its tables")
    ap.add_argument("--marks", type=Path, default=None,
                    help="with --show: {name: monotonic s} (default: marks.json beside the timeline)")
    ap.add_argument("--bin-ms", type=float, default=10.0)
    ap.add_argument("--top", type=int, default=6, help="thread groups shown")
    args = ap.parse_args()
    if args.show:
        show(args.show, args.bin_ms, args.marks, args.top)
        return
    if args.pid is None or args.out is None:
        ap.error("--pid and --out (or --show)")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    data = sample(args.pid, args.every_ms / 1e3, stop, args.children)
    if args.names and args.names.exists():
        data["names"] = json.loads(args.names.read_text())
    args.out.write_text(json.dumps(data))


if __name__ == "__main__":
    main()
