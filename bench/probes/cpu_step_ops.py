"""Where a CPU decode step goes, by operator, at several row counts: the default model (native
weights), B slots each prefilled with a 64-token prompt, then --steps steps of Engine.decode_batch
under torch.profiler; per row count the step's milliseconds and each operator's milliseconds a step
(floe's kernels appear as floe::gemv_q, floe::attend, floe::top_candidates, ...).

    python bench/probes/cpu_step_ops.py [--rows 1 4 8] [--steps 30] [--threads 2] [--top 8]

What it answered (AVX2 Zen 3, 2 threads, 2026-12-06): gemv_q 4.5 / 9.3 / 13.9 ms a step at 1 / 4 / 8
rows: each row past the first adds ~1.2 ms of int8 products, ~225 GOP/s, about what AVX2's maddubs
path peaks at on 2 cores, so the engine alone's 8 / 1 ratio stays below 3x on such a CPU.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from floe.engine import Engine
from floe.model import load_checkpoint


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--top", type=int, default=8, help="operators shown a row count")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    engine = Engine(load_checkpoint(), max_seq_len=64 + 2 * args.steps + 32, n_slots=max(args.rows),
                    weights="native")
    for rows in args.rows:
        slots, tokens = list(range(rows)), []
        for slot in slots:
            engine.kv_truncate(0, slot)
            tokens.append(int(engine.prefill(list(range(100 + slot, 164 + slot)), slot).argmax()))
        for _ in range(5):  # warm
            tokens = [int(r.argmax()) for r in engine.decode_batch(tokens, slots)]
        plain = time.perf_counter()
        for _ in range(args.steps // 2):
            tokens = [int(r.argmax()) for r in engine.decode_batch(tokens, slots)]
        plain = (time.perf_counter() - plain) / (args.steps // 2)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.steps):
                tokens = [int(r.argmax()) for r in engine.decode_batch(tokens, slots)]
        ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:args.top]
        print(f"{rows} rows: {1e3 * plain:.2f} ms a step unprofiled ({rows / plain:.1f} tok/s); a step's ms "
              "by operator (self): " + ", ".join(f"{e.key} {e.self_cpu_time_total / 1e3 / args.steps:.2f}"
                                              for e in ops), flush=True)


if __name__ == "__main__":
    main()
