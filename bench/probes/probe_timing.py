"""The probes' one timer: median wall time of `fn` (ms, after a device synchronize), recorded in
`results` under `name` and printed."""

import statistics
import time

import torch


def timed(results: dict, name: str, fn, n: int = 7, skip_first: bool = False) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    results[name] = round(statistics.median(times[1:] if skip_first else times), 3)
    print(name, results[name], flush=True)
    return results[name]
