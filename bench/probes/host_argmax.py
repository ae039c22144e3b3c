"""The argmax of host logits (the engine's greedy choice on the CPU, once a step for every row): PyTorch's
CPU reduction against numpy's (floe.engine.sampling.host_argmax), µs a call, on 1 and 2 PyTorch threads.

    python bench/probes/host_argmax.py [--vocab 49152 128256] [--rows 1 8 64]
"""

from __future__ import annotations

import argparse
import time

import torch


def timed(fn, reps: int) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return 1e6 * (time.perf_counter() - t) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, nargs="+", default=[49152, 128256])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for vocab in args.vocab:
            for rows in args.rows:
                logits = torch.randn(rows, vocab)
                ours = logits.numpy()
                theirs = timed(lambda logits=logits: logits.argmax(-1), args.reps)
                mine = timed(lambda ours=ours: ours.argmax(-1), args.reps)
                print(f"{threads} thread(s), [{rows}, {vocab}]: torch.argmax {theirs:9.1f} µs, "
                      f"numpy {mine:7.1f} µs ({theirs / mine:.0f}x)", flush=True)


if __name__ == "__main__":
    main()
