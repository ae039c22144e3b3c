"""The engine loop's host cost per row-token: a one-layer 64-wide model on the CPU (its forward costs
little), S chat-guest actors through one EngineLoop, the loop's phases per step, and where the
loop thread's time goes (cProfile of its steps, the top functions by own time).

    python bench/probes/loop_host_cost.py [--sessions 64] [--tokens 64] [--tokenizer DIR] [--rounds 3]
        [--ids | --on-text] [--device cuda --shape llama-3.2-1b]

--shape: seeded random weights of that shape (dense, bfloat16 off the CPU) instead of the tiny model:
where a real step's host time goes (its launch, its results) on the device it runs on.

--ids: each reply streamed as token ids (a TokenStream, as `floe serve` streams), not as text. --on-text:
its text handed piece by piece to its caller's on_text (in the caller's thread). Neither: its text at the end.

--overlap: the loop's speculation and feeding (floe.actor.speculation) forced on, as on CUDA, where the
CPU's step is not asynchronous: the Python a CUDA step pays for them, measured on a CPU.

--reference: the tiny model's engine runs CUDA's batched graph step's host side on the CPU
(Engine(reference_graphs=True): overlap, feeding, the engine's CUDA bookkeeping, each step's forward
the module's): the Python a CUDA step pays a row, measured without a GPU.

First, asking the guests alone (GuestCalls.ask: host choices, on_token, what it returned),
µs a row, with the step's calls in one native loop (floe.wasm.rows) and row by row, taking turns.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent))
from cpu_batch import actors_run, message  # noqa: E402
from tiny import tiny_engine, tokenizer  # noqa: E402

from floe.actor import loop as engine_loop  # noqa: E402
from floe.actor.calls import GuestCalls  # noqa: E402

SORT = {"own": 2, "cum": 3, "calls": 1}[os.environ.get("SORT", "own")]  # the profile's order
TOP = int(os.environ.get("TOP", "20"))
from floe.engine import Engine  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the default model's)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the native / row-by-row comparison")
    ap.add_argument("--ids", action="store_true", help="replies streamed as token ids, not text")
    ap.add_argument("--on-text", action="store_true", help="each reply's text handed to its caller's on_text")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--shape", default=None, help="a real shape's seeded random weights (e.g. llama-3.2-1b)")
    ap.add_argument("--overlap", action="store_true", help="speculation and feeding forced on (as on CUDA)")
    ap.add_argument("--reference", action="store_true",
                    help="CUDA's batched graph step's host side on the CPU (Engine(reference_graphs=True))")
    args = ap.parse_args()
    options = {"overlap": True, "feed": True} if args.overlap else {}
    tok = tokenizer(args.tokenizer)
    engine = (shaped_engine(tok, args) if args.shape
              else tiny_engine(tok, args.sessions, args.device, reference_graphs=args.reference))
    texts = [message(tok, i, 64) for i in range(args.sessions)]
    actors_run(engine, texts[:2], 4, batch=True, ids=args.ids, on_text=args.on_text, **options)
    asking_ab(engine, texts, args)
    profile = cProfile.Profile()
    device = device_work(profile) if args.reference else [0.0, False]
    streams = {"ids": args.ids, "on_text": args.on_text}
    s = actors_run(engine, texts, args.tokens, batch=True, **streams, **options)["engine_loop"]
    steps = s["steps"]
    print(f"{args.sessions} actors: {steps} steps, {1e3 * s['step_s'] / steps:.2f} ms a step, "
          f"{1e6 * s['step_s'] / s['rows']:.1f} µs a row-token; phases (ms a step): "
          + ", ".join(f"{k} {1e3 * v / steps:.2f}" for k, v in s["phase_s"].items()))
    host = s["step_s"] - s["wait_s"] - s["launch_s"] - s["phase_s"]["prefill"]
    print(f"the loop's host time outside the engine's calls (step - launch - wait - prefill): "
          f"{1e6 * host / s['rows']:.1f} µs a row-token")
    if args.reference:
        print(f"the host side of CUDA's step (the loop's and the engine's; the reference's forwards and "
              f"draws left out): {1e6 * (s['step_s'] - device[0]) / s['rows']:.1f} µs a row-token")
    step = engine_loop.EngineLoop._step

    def profiled(self) -> None:
        device[1] = True
        profile.enable()
        try:
            step(self)
        finally:
            profile.disable()
            device[1] = False

    engine_loop.EngineLoop._step = profiled
    try:
        run = actors_run(engine, texts, args.tokens, batch=True, **streams, **options)
        rows = run["engine_loop"]["rows"]
    finally:
        engine_loop.EngineLoop._step = step
    stats = pstats.Stats(profile)
    calls = sum(v[1] for v in stats.stats.values())
    python = sum(v[1] for (file, _, _), v in stats.stats.items() if not file.startswith("~"))
    # (a count, not a time: the same on a busy machine as on an idle one)
    print(f"calls a row-token in the loop's steps: {calls / rows:.1f} (Python functions {python / rows:.1f})")
    print(f"cProfile of the loop's steps ({rows} row-tokens; µs a row-token = tottime / rows):")
    for (file, line, name), (_, calls, tottime, cumtime, _) in sorted(
            stats.stats.items(), key=lambda kv: -kv[1][SORT])[:TOP]:
        print(f"  {1e6 * tottime / rows:7.1f} own {1e6 * cumtime / rows:7.1f} cum  {calls:7d}  "
              f"{Path(file).name}:{line}({name})")


def device_work(profile: cProfile.Profile) -> list:
    """With --reference: the reference's forwards and draws (what a GPU computes) timed into [0] and left
    out of `profile` while [1] (the profiled steps) is set, so the profile is the host side's alone."""
    from floe.engine.reference_graph import ReferenceGraphDecoder

    device = [0.0, False]

    def apart(method):
        def run(self, *args):
            profiling = device[1]
            if profiling:
                profile.disable()
            t = time.perf_counter()
            try:
                return method(self, *args)
            finally:
                device[0] += time.perf_counter() - t
                if profiling:
                    profile.enable()
        return run

    ReferenceGraphDecoder._forward = apart(ReferenceGraphDecoder._forward)
    ReferenceGraphDecoder._draw = apart(ReferenceGraphDecoder._draw)
    return device


def shaped_engine(tok, args) -> Engine:
    """An engine of args.shape's seeded random weights on args.device (as bench/sessions.py makes it)."""
    import torch

    from floe.model.synthetic import random_checkpoint

    device = torch.device(args.device)
    cpu = device.type == "cpu"
    checkpoint = random_checkpoint(args.shape, tok, dtype=torch.bfloat16, device=device)
    engine = Engine(checkpoint, device=device, dtype="float32" if cpu else "bfloat16", max_seq_len=1024,
                    n_slots=args.sessions, weights="native" if cpu else "dense")
    engine.warm_up()
    return engine


def asking_ab(engine: Engine, texts: list[str], args) -> None:
    """µs a row of GuestCalls.ask, native loop vs row by row, `args.rounds` rounds each (0: none)."""
    from floe.wasm import rows as guest_rows

    if not args.rounds:
        return
    ask, usable = GuestCalls.ask, guest_rows.usable
    spent = {"native": [], "row by row": []}

    def timed(self, turns, *roster) -> None:
        t = time.perf_counter()
        ask(self, turns, *roster)
        timed.seconds += time.perf_counter() - t
        timed.rows += len(turns)

    GuestCalls.ask = timed
    try:
        for _ in range(args.rounds):
            for way in spent:
                guest_rows.usable = usable if way == "native" else (lambda guests: False)
                timed.seconds, timed.rows = 0.0, 0
                actors_run(engine, texts, args.tokens, batch=True, ids=args.ids, on_text=args.on_text,
                           **({"overlap": True, "feed": True} if args.overlap else {}))
                spent[way].append(1e6 * timed.seconds / max(timed.rows, 1))
    finally:
        GuestCalls.ask, guest_rows.usable = ask, usable
    for way, us in spent.items():
        print(f"asking the guests, {way}: " + ", ".join(f"{u:.1f}" for u in us) + " µs a row")


if __name__ == "__main__":
    main()
