"""A CPU draw (temperature, top_p): floe.engine.sampling's host path (numpy, row by row) against its
batched PyTorch kernels (the CUDA path, run on the CPU), µs a call, on 1 and 2 PyTorch threads.

    python bench/probes/host_draw.py [--vocab 49152] [--rows 1 8] [--top-p 1.0 0.95]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from floe.engine import sampling
from floe.engine.sampling import SamplingParams, sample_rows

sys.path.insert(0, str(Path(__file__).parent))
from host_argmax import timed  # noqa: E402  (one timer for both probes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--top-p", type=float, nargs="+", default=[1.0, 0.95])
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for rows in args.rows:
            logits = torch.randn(rows, args.vocab, generator=g) * 3  # (~1,800 tokens likely at 0.8)
            uniforms = torch.rand(rows, generator=g, dtype=torch.float64)
            for top_p in args.top_p:
                params = [SamplingParams(args.temperature, top_p=top_p)] * rows
                spent = {}
                for way, host in (("numpy", ("cpu",)), ("kernels", ())):
                    sampling.HOST_DRAWS = host
                    spent[way] = timed(lambda params=params, logits=logits, uniforms=uniforms:
                                       sample_rows(logits, params, uniforms), args.reps)
                sampling.HOST_DRAWS = ("cpu",)
                numpy, kernels = spent["numpy"], spent["kernels"]
                print(f"{threads} thread(s), [{rows}, {args.vocab}], top_p {top_p}: numpy {numpy:8.0f} µs, "
                      f"kernels {kernels:8.0f} µs ({kernels / numpy:.1f}x)", flush=True)


if __name__ == "__main__":
    main()
