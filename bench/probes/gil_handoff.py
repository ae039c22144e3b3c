"""What a thread's GIL-releasing calls cost while other threads run Python (issue 40): the engine loop's
launch in `floe serve`'s core makes ~5 such calls a step (PyTorch's lets go of the GIL around each CUDA
call), and a burst's chat threads run Python meanwhile. Here one thread makes 5 calls of a trivial C
function (getpid) per "step" through ctypes.CDLL (the GIL let go, as PyTorch's bindings do) or
ctypes.PyDLL (held, as floe.engine.cuda_launch's driver calls are), a millisecond apart, while N threads
each run Python for --work-ms then sleep --rest-ms.

    python bench/probes/gil_handoff.py [--threads 0 8 64] [--work-ms 0.5] [--rest-ms 4] [--steps 300]
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import threading
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[0, 8, 64])
    ap.add_argument("--work-ms", type=float, default=0.5)
    ap.add_argument("--rest-ms", type=float, default=4.0)
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args()
    libs = {"CDLL (the GIL let go)": ctypes.CDLL("libc.so.6"),
            "PyDLL (the GIL held)": ctypes.PyDLL("libc.so.6")}
    for n in args.threads:
        stop = threading.Event()
        busy = [threading.Thread(target=python_work, args=(stop, args.work_ms / 1e3, args.rest_ms / 1e3),
                                 daemon=True) for _ in range(n)]
        for t in busy:
            t.start()
        time.sleep(0.2)
        for name, lib in libs.items():
            s = sorted(steps(lib, args.steps))
            p50, p90, mean = statistics.median(s), s[int(0.9 * len(s))], statistics.mean(s)
            print(f"{n:3d} threads running Python, {name:22s}: 5 calls p50 {1e6 * p50:8.1f} µs, "
                  f"p90 {1e6 * p90:8.1f} µs, mean {1e6 * mean:8.1f} µs", flush=True)
        stop.set()
        for t in busy:
            t.join()


def python_work(stop: threading.Event, work_s: float, rest_s: float) -> None:
    while not stop.is_set():
        t = time.perf_counter()
        while time.perf_counter() - t < work_s:
            pass
        time.sleep(rest_s)


def steps(lib, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        for _ in range(5):
            lib.getpid()
        out.append(time.perf_counter() - t)
        time.sleep(0.001)  # (the step's device time)
    return out


if __name__ == "__main__":
    main()
