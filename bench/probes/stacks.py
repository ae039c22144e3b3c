"""Where a sampled process's time goes: py-spy's raw stacks (`py-spy record --format raw`, one
"frame;frame;… count" line per stack) summed per function, own and inclusive, for the stacks that pass
through a given frame (default: the engine loop's thread, `EngineLoop._loop (floe/actor/loop.py…)`).

    python bench/probes/stacks.py OUT/serve64_pyspy.txt [--top 40]
        [--through "EngineLoop._loop (floe/actor/loop.py"]

Prints each function's share of the selected samples: own (the innermost frame) and inclusive (anywhere
in the stack, counted once a stack).
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("raw", type=Path)
    ap.add_argument("--through", default="EngineLoop._loop (floe/actor/loop.py",
                    help="keep the stacks with a frame starting with this (py-spy's 'name (file:line)')")
    ap.add_argument("--top", type=int, default=40)
    args = ap.parse_args()
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = kept = 0
    for line in args.raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = [_function(f) for f in stack.split(";")]
        if not any(f.startswith(args.through) for f in stack.split(";")):
            continue
        kept += n
        own[frames[-1]] += n
        for f in set(frames):
            inclusive[f] += n
    print(f"{kept} of {total} samples pass through {args.through!r}")
    if not kept:
        return
    print("inclusive:")
    for f, n in inclusive.most_common(args.top):
        print(f"  {100 * n / kept:5.1f} %  {f}")
    print("own:")
    for f, n in own.most_common(args.top):
        print(f"  {100 * n / kept:5.1f} %  {f}")


def _function(frame: str) -> str:
    """'name (path/to/file.py:123)' -> 'name (file.py)': one entry per function, not per line."""
    name, _, where = frame.partition(" (")
    file = where.rstrip(")").rsplit(":", 1)[0]
    return f"{name} ({file.rsplit('/', 2)[-1] if '/' in file else file})" if where else name


if __name__ == "__main__":
    main()
