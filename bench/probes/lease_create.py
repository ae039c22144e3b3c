"""A new session's lease on a local disk: hard-linked into place without a lock (FileLeases' create,
floe.snapshot.atomic.create_exclusive) vs the compare-and-swap under the lease's lock (what a
filesystem without hard links gets: `links` off), taking turns, from 1 thread and from a burst of
--threads at once, each lease a new key.

    python bench/probes/lease_create.py [--leases 256] [--threads 64] [--rounds 4] [--folder DIR]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from floe.snapshot.lease import FileLeases


def run(folder: Path, links: bool, n: int, threads: int) -> tuple[float, float]:
    """(seconds of wall a lease, median seconds of one acquire) for n new keys from `threads` threads."""
    leases = FileLeases(folder)
    leases.links = links

    def one(i: int) -> float:
        t = time.perf_counter()
        leases.acquire(f"s{i}", "server", 60)
        return time.perf_counter() - t

    t = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        each = list(pool.map(one, range(n)))
    return (time.perf_counter() - t) / n, statistics.median(each)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--leases", type=int, default=256)
    ap.add_argument("--threads", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--folder", default=None, help="where the leases go (default: a temporary folder)")
    args = ap.parse_args()
    base = Path(args.folder or tempfile.mkdtemp(prefix="floe-leases-"))
    results: dict[tuple[bool, int], list[tuple[float, float]]] = {}
    for r in range(args.rounds):
        for threads in (1, args.threads):
            for links in (True, False):
                folder = base / f"r{r}-t{threads}-{'link' if links else 'lock'}"
                folder.mkdir(parents=True)
                results.setdefault((links, threads), []).append(run(folder, links, args.leases, threads))
    for (links, threads), runs in results.items():
        walls = ", ".join(f"{1e6 * w:.0f}" for w, _ in runs)
        p50s = ", ".join(f"{1e6 * p:.0f}" for _, p in runs)
        print(f"{'link (lock-free)' if links else 'lock (CAS)':17s} threads {threads:3d}: µs a lease (wall) "
              f"{walls}; acquire p50 {p50s}")


if __name__ == "__main__":
    main()
