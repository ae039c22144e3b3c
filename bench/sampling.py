"""What one draw costs: floe's sampler (inverse CDF at one uniform, every row in one batched pass)
against the one it replaced (a CPU copy of the logits, an exponential per vocabulary entry, a full
sort for top_p), B rows at once.

    python bench/sampling.py [--device cuda] [--vocab 128256] [--rows 1 16 64]

Prints ms per batch of rows (median of 10, after 3 to warm up) for temperature only, top_p and top_k.
"""

from __future__ import annotations

import argparse

import torch

from floe.bench import wall_time
from floe.engine.sampling import SamplingParams, draw_uniforms, sample_rows


def replaced_sample_token(logits, p: SamplingParams, generator) -> torch.Tensor:
    """The sampler before issue 16's sampling change, verbatim."""
    x = logits.float().cpu() / p.temperature
    if p.top_k and p.top_k < x.shape[-1]:
        kth = torch.topk(x, p.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        drop = (sorted_probs.cumsum(-1) - sorted_probs) >= p.top_p
        probs = probs.scatter(-1, order, sorted_probs.masked_fill(drop, 0.0))
    race = torch.empty_like(probs).exponential_(1.0, generator=generator)
    return (probs / race).argmax()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    for rows in args.rows:
        # LLM-like rows: a few strong tokens over a long tail
        logits = (torch.randn(rows, args.vocab) * 2.5).to(args.device)
        logits[:, :50] += 8
        for p in (SamplingParams(0.7), SamplingParams(0.7, top_p=0.9), SamplingParams(1.0, top_k=40)):
            def replaced(p=p, x=logits, n=rows):
                return [int(replaced_sample_token(x[i], p, g)) for i in range(n)]

            def floe(p=p, x=logits, n=rows):
                return sample_rows(x, [p] * n, draw_uniforms([g] * n))

            old, new = 1e3 * wall_time(replaced, repeats=10), 1e3 * wall_time(floe, repeats=10)
            print(f"{args.device} vocab {args.vocab} rows {rows:>3} T={p.temperature} top_p={p.top_p} "
                  f"top_k={p.top_k}: replaced {old:8.2f} ms, floe {new:6.2f} ms ({old / new:.0f}x)",
                  flush=True)


if __name__ == "__main__":
    main()
