"""What a durable small-file replace costs on this machine's disk (the lease's write before it was
made not durable): median µs of write + fsync + rename + fsync(dir), and of write + rename alone.

    python bench/probes/fsync_cost.py [--folder DIR] [--n 50]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path


def replace(folder: Path, durable: bool) -> float:
    t = time.perf_counter()
    tmp = folder / ".tmp"
    with open(tmp, "wb") as f:
        f.write(b'{"owner": "x", "token": "0123456789abcdef", "expires_at": 1.0}')
        if durable:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, folder / "k.lease")
    if durable:
        fd = os.open(folder, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--folder", default=None)
    ap.add_argument("--n", type=int, default=50)
    args = ap.parse_args()
    folder = Path(args.folder or tempfile.mkdtemp())
    for durable in (True, False):
        times = [replace(folder, durable) for _ in range(args.n)]
        print(f"{'durable' if durable else 'atomic only'}: median {1e6 * statistics.median(times):.0f} us, "
              f"max {1e6 * max(times):.0f} us ({folder})")


if __name__ == "__main__":
    main()
