"""A prompt's prefill on the CPU in the main thread and in an engine loop's thread, under this process's
OpenMP settings (issue 40): libgomp keeps a team of threads for each thread that runs parallel regions,
and once it keeps more threads than the machine has CPUs it spins only briefly at the end of each region
unless OMP_WAIT_POLICY is ACTIVE (floe.cli.machine.polite_openmp). The main thread loads and warms up
the model (its team), then every actor's prompt runs in the engine loop's thread (a second team).

    python bench/probes/omp_threads.py [--prompt-tokens 64] [--repeats 9] [--threads 2]
    GOMP_SPINCOUNT=3000 python bench/probes/omp_threads.py        # (the user's own: no wait policy)

Prints the settings libgomp read and, per place, the median prefill time (Engine.prefill's own, in the
thread that ran it) with the spread, of the default model's native weights: the main thread's first
(only its team exists), another thread's (the same prompt), the engine loop's (each a one-token turn of
a fresh actor, as a `floe serve` request: the chat template around the same text makes its prompt
longer, its length printed), and the main thread's again while the loop's thread (and team) lives.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent))

from floe.cli.machine import polite_openmp  # noqa: E402

polite_openmp()  # as every floe command, before torch is imported (a value set outside is kept)

import torch  # noqa: E402

from floe.actor import Actor  # noqa: E402
from floe.actor.loop import EngineLoop  # noqa: E402
from floe.engine import Engine  # noqa: E402
from floe.model import load_checkpoint  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None, help="write the figures here too")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    engine = Engine(load_checkpoint(), device="cpu", dtype="float32", max_seq_len=1024, n_slots=2,
                    weights="native")
    engine.warm_up()
    words = " ".join(f"word{i}" for i in range(4 * args.prompt_tokens))
    ids = engine.tokenizer.encode_plain(words)[: args.prompt_tokens]
    text = engine.tokenizer.decode(ids)
    timed: list[tuple[float, str]] = []
    prefill = engine.prefill

    def recorded(*a, **k):
        t = time.perf_counter()
        try:
            return prefill(*a, **k)
        finally:
            lengths.append(len(a[0]))
            timed.append((time.perf_counter() - t, threading.current_thread().name))

    engine.prefill = recorded

    def in_main() -> list[float]:
        out = []
        for _ in range(args.repeats + 1):
            engine.kv_truncate(0, 0)
            t = time.perf_counter()
            prefill(ids, 0)
            out.append(time.perf_counter() - t)
        return out[1:]

    def in_thread() -> list[float]:
        out: list[list[float]] = []
        thread = threading.Thread(target=lambda: out.append(in_main()), name="another")
        thread.start()
        thread.join()
        return out[0]

    main_first = in_main()
    other = in_thread()
    lengths = []
    loop = EngineLoop(engine, batch=True)
    for r in range(args.repeats + 1):
        actor = Actor(engine, loop=loop, seed=r)
        actor.send(text, max_tokens=1)
        actor.close()
    in_loop = [s for s, name in timed[1:] if name == "floe-engine-loop"]
    main_again = in_main()
    figures = {"GOMP_SPINCOUNT": os.environ.get("GOMP_SPINCOUNT"),
               "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY"), "threads": args.threads}
    looped = f"engine loop's thread ({lengths[-1]} tokens)"
    places = (("main thread, first", main_first), ("another thread", other), (looped, in_loop),
              ("main thread, the loop's alive", main_again))
    for name, runs in places:
        ms = sorted(1e3 * s for s in runs)
        figures[name] = {"median_ms": statistics.median(ms), "min_ms": ms[0], "max_ms": ms[-1]}
    print(f"GOMP_SPINCOUNT={figures['GOMP_SPINCOUNT']} OMP_WAIT_POLICY={figures['OMP_WAIT_POLICY']}, "
          f"{args.threads} threads, a {len(ids)}-token prefill (ms, median [min-max] of {args.repeats}):")
    for name, _ in places:
        f = figures[name]
        print(f"  {name:<32} {f['median_ms']:6.1f}  [{f['min_ms']:.1f}-{f['max_ms']:.1f}]")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
