"""Where a CPU decode token goes: the whole step against its projections alone (the same gemv_q calls
on the same weights, back to back) and the head's exact-top pass, on the default model's native
weights, one kernel variant at a time.

    python bench/probes/cpu_step_breakdown.py [--threads 2] [--kernels avx2,vnni] [--tokens 64]

Medians over --tokens steps (a 64-token prompt first); "other" = step - projections - exact top: the
ops between the projections (norms, attention, SwiGLU, residual adds) and their dispatch.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from floe.engine import Engine
from floe.engine.qgemv import QLinear, runnable
from floe.model import load_checkpoint


def median_ms(fn, n: int) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def one_kernel(checkpoint, kernel: str, prompt: list[int], tokens: int) -> str:
    """One line: the step, its projections alone, the exact-top pass and the rest, ms."""
    engine = Engine(checkpoint, max_seq_len=512, weights="native", native_kernel=kernel)
    engine.prefill(prompt)
    token = [prompt[-1]]

    def step():
        engine.decode_step(token[0])

    step()
    step_ms = median_ms(step, tokens)
    model = engine.model
    layers = [(m, m.in_features) for layer in model.layers
              for m in (layer.attention.wqkv, layer.attention.wo, layer.feed_forward.w13,
                        layer.feed_forward.w2)]
    head = model.head
    xs = {k: torch.randn(1, k) for k in {k for _, k in layers} | {head.in_features}}

    def projections():
        for m, k in layers:
            torch.ops.floe.gemv_q(xs[k], m.blocks, m.number)
        if isinstance(head, QLinear):
            torch.ops.floe.gemv_q(xs[head.in_features], head.blocks, head.number)

    projections()
    proj_ms = median_ms(projections, tokens)
    top_ms = 0.0
    if isinstance(head, QLinear) and head.rounding_bound is not None:
        x = xs[head.in_features]
        y = torch.ops.floe.gemv_q(x, head.blocks, head.number)
        top_ms = median_ms(lambda: head.exact_top(x, y.clone()), tokens)
    return (f"{kernel:>9}: step {step_ms:6.2f} ms ({1e3 / step_ms:5.1f} tok/s)  projections "
            f"{proj_ms:6.2f} ms ({len(layers) + 1} calls)  exact top {top_ms:5.2f} ms  other "
            f"{step_ms - proj_ms - top_ms:5.2f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kernels", default=None, help="comma-separated variants (default: every one here)")
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    checkpoint = load_checkpoint()
    kernels = args.kernels.split(",") if args.kernels else runnable()
    prompt = checkpoint.tokenizer.encode("The lighthouse keeper climbed the spiral stairs " * 6)[:64]
    for kernel in kernels:
        print(one_kernel(checkpoint, kernel, prompt, args.tokens), flush=True)


if __name__ == "__main__":
    main()
