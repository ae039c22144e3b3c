"""A snapshot write into a folder that already holds many files (a server's folder of sessions):
floe.snapshot.atomic.replace_file of a small file, ms a write, by how many other files the folder holds.
Each writer looked for killed writers' temporaries of its path by scanning every name in the folder;
now a process scans a folder at its first write there, and afterwards looks at its path's one
temporary name (under a real flock). The first write (the scan) is in the median's repeats.

    python bench/probes/folder_write.py [--files 0 2000 20000 100000] [--writes 50] [--durable]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from floe.snapshot.atomic import replace_file


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, nargs="+", default=[0, 2000, 20000, 100000])
    ap.add_argument("--writes", type=int, default=50)
    ap.add_argument("--durable", action="store_true", help="fsync the file and the folder (a snapshot's)")
    args = ap.parse_args()
    for n in args.files:
        folder = Path(tempfile.mkdtemp(prefix="floe-folder-write-"))
        try:
            for i in range(n):
                (folder / f"s{i:06d}.safetensors").touch()
            times, target = [], folder / "x.safetensors"
            for _ in range(args.writes):
                t = time.perf_counter()
                replace_file(target, lambda p: p.write_bytes(b"x" * 100), durable=args.durable)
                times.append(time.perf_counter() - t)
            median, mean = statistics.median(times), statistics.mean(times)
            print(f"{n:7d} files: first write {1e3 * times[0]:7.2f} ms, median {1e3 * median:6.2f} ms, "
                  f"mean {1e3 * mean:6.2f} ms a write")
        finally:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
