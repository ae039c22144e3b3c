"""Batched decode on CUDA: aggregate tokens/s of Engine.decode_batch over B slots vs B = 1.

    python bench/batch_decode.py [--shape llama-3.2-1b] [--context 512] [--steps 64] [--sizes 1 2 4 8 16]
                                 [--actors 16 --actor-tokens 128]

Seeded random weights at a real shape (bf16). Engine: every slot is prefilled with --context tokens,
then --steps greedy steps run; each step's tokens are chosen on the GPU (argmax per row) and read
back, as actors do. Device time by CUDA events, median of --repeats. B = 1 is decode_step (the
batch-1 graph). Actors (with --actors N): N Wasm actors (the built-in chat guest) answer at once, each
in its own thread, with and without the DecodeScheduler; aggregate generated tokens/s over the wall
time, and the scheduler's rows per forward. Writes bench/results/batch_decode_<shape>.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from floe.bench import together
from floe.engine import Engine
from floe.model.synthetic import random_checkpoint


def run(engine: Engine, slots: list[int], steps: int) -> float:
    """Seconds for `steps` batched steps over `slots` (all at the same context length)."""
    tokens = [1] * len(slots)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        rows = engine.decode_batch(tokens, slots)
        tokens = torch.stack([r.argmax() for r in rows]).tolist()  # readback: a sync, as actors do
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def run_actors(engine: Engine, n: int, max_tokens: int, gather_s: float | None) -> dict:
    """n actors answering one message each at once (greedy); aggregate tokens/s. With gather_s, through
    a DecodeScheduler with that gather window; else taking turns."""
    from floe.actor import Actor, DecodeScheduler
    from floe.engine import SamplingParams

    stamps: list[tuple[float, int]] = []
    batched = gather_s is not None
    scheduler = DecodeScheduler(engine, gather_s, lambda r: stamps.append((time.perf_counter(), r))) \
        if batched else None
    actors = [Actor(engine, scheduler=scheduler) for _ in range(n)]
    replies, wall = together([lambda a=a, i=i: a.send(f"Write a long story about topic number {i}.",
                                                      max_tokens=max_tokens, params=SamplingParams(0.0))
                              for i, a in enumerate(actors)])
    for a in actors:
        a.close()
    generated = sum(r.stats.generated_tokens for r in replies)
    row = {"actors": n, "batched": batched, "gather_ms": 1e3 * gather_s if batched else None,
           "wall_s": wall, "generated": generated, "tok_s": generated / wall,
           "engine_s_per_message": statistics.median(r.stats.forward_s for r in replies),
           "outside_engine_s_per_message": statistics.median(r.stats.outside_engine_s for r in replies)}
    if stamps:
        gaps = [b[0] - a[0] for a, b in zip(stamps, stamps[1:], strict=False)]
        row |= {"forwards": len(stamps), "rows_per_forward": sum(r for _, r in stamps) / len(stamps),
                "forward_interval_ms_p50": 1e3 * statistics.median(gaps) if gaps else None}
    print(f"{n} actors, {f'scheduler ({1e3 * gather_s:g} ms gather)' if batched else 'in turns'}: "
          f"{row['tok_s']:.0f} tok/s "
          + (f"({row['rows_per_forward']:.1f} rows/forward, a forward every "
             f"{row['forward_interval_ms_p50']:.2f} ms)" if stamps else ""), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama-3.2-1b")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--actors", type=int, default=0, help="also run this many concurrent actors")
    ap.add_argument("--actor-tokens", type=int, default=128)
    ap.add_argument("--gather-ms", type=float, nargs="+", default=[5.0],
                    help="the scheduler's gather window(s) to run the actors with")
    args = ap.parse_args()
    from floe.cli import _tokenizer

    checkpoint = random_checkpoint(args.shape, _tokenizer(args.tokenizer), dtype=torch.bfloat16,
                                   device="cuda")
    n_slots = max(max(args.sizes), 2, args.actors)
    engine = Engine(checkpoint, device="cuda", dtype="bfloat16", n_slots=n_slots,
                    max_seq_len=args.context + args.steps * (args.repeats + 2) + 8)
    prompt = [(7 * i) % 1000 + 1 for i in range(args.context)]
    rows = []
    for size in args.sizes:
        slots = list(range(size))
        times = []
        for repeat in range(args.repeats + 1):  # the first run captures the graphs
            for s in slots:
                engine.kv_truncate(0, s)
                engine.prefill(prompt, s)
            t = run(engine, slots, args.steps)
            if repeat:
                times.append(t)
        median = statistics.median(times)
        rows.append({"batch": size, "step_ms": 1e3 * median / args.steps,
                     "tok_s": size * args.steps / median, "runs_s": times})
        print(f"B={size:3d}: {rows[-1]['step_ms']:.3f} ms/step, {rows[-1]['tok_s']:8.1f} tok/s "
              f"({rows[-1]['tok_s'] / rows[0]['tok_s']:.2f}× B=1)", flush=True)
    result = {"device": torch.cuda.get_device_name(), "shape": args.shape, "dtype": "bfloat16",
              "context": args.context, "steps": args.steps, "repeats": args.repeats, "rows": rows}
    if args.actors:
        for s in range(engine.cache.n_slots):
            engine.kv_truncate(0, s)
        result["actors"] = [run_actors(engine, args.actors, args.actor_tokens, None)]
        for gather in args.gather_ms * 2:  # alternated, twice
            result["actors"].append(run_actors(engine, args.actors, args.actor_tokens, gather / 1e3))
    out = Path(__file__).parent / "results" / f"batch_decode_{args.shape}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
