"""Whether a serving process's RSS grows with the prompts it sees: rounds of 32 one-shot actors (made,
one message of a random 50-300-word prompt answered with 48 sampled tokens, closed) through one engine
loop on the default model, the C heap's free pages handed back after each round (as the server's
upkeep does), RSS printed per round. --fixed: the same prompt every time (no new shapes).

    python bench/probes/rss_churn.py [--rounds 4] [--fixed] [--bound]

--bound: floe.engine.bound_kernel_caches() first, as `floe serve` does (oneDNN's per-shape kernels
and ideep's matmul descriptors capped). On the 2-core VM: ~95 MB a round without it; ~33 MB with
oneDNN's cap alone (before 5fa7d94); flat with both (475, 471, 471, 475 MB); none with --fixed.
"""

from __future__ import annotations

import argparse
import random

from floe.actor import Actor, EngineLoop
from floe.engine import Engine, SamplingParams, bound_kernel_caches
from floe.memory import rss_bytes, trim_heap
from floe.model import load_checkpoint

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--fixed", action="store_true", help="the same prompt every time")
    ap.add_argument("--bound", action="store_true", help="cap oneDNN's kernel cache first (floe serve)")
    args = ap.parse_args()
    if args.bound:
        bound_kernel_caches()
    engine = Engine(load_checkpoint(), max_seq_len=512, n_slots=8, weights="native")
    loop = EngineLoop(engine, batch=False)
    for r in range(args.rounds):
        for i in range(r * 32, (r + 1) * 32):
            rng = random.Random(i)
            text = ("hello there " * 150 if args.fixed
                    else " ".join(rng.choice(WORDS) for _ in range(rng.randint(50, 300))))
            with Actor(engine, loop=loop) as actor:
                actor.send(text, max_tokens=48, params=SamplingParams(0.7))
        trim_heap()
        print(f"round {r}: rss {rss_bytes() >> 20} MB", flush=True)


if __name__ == "__main__":
    main()
