"""What making one actor costs its thread, in CPU time: the chat guest instantiated beside a one-layer
64-wide model (bench/probes/tiny.py), without a KV slot (Actor kv_slot="later", as a spare is made), then
closed. A session that finds no spare actor (a server whose engine loop is never idle, so that none is
made ahead; a thaw; a burst past the spares) pays this in its request, under the core's GIL.

    python bench/probes/actor_new.py [--tokenizer DIR] [--actors 100] [--batches 7] [--stages]

Prints the median over --batches of each batch's mean (thread CPU per actor made, and per close);
--stages: where one actor's making goes (wall time of its parts, wrapped; adds ~1 µs a wrapped call).
A/B: run it from each tree (PYTHONPATH=OTHER/src), taking turns.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent))
sys.path.insert(0, str(Path(__file__).parent))
from smoke import host  # noqa: E402
from tiny import tiny_engine, tokenizer  # noqa: E402

from floe.actor import Actor  # noqa: E402

STAGES = (("floe.wasm.runtime", "GuestInstance", "__init__"),
          ("floe.wasm.runtime", "GuestInstance", "function"),
          ("floe.wasm.runtime", "GuestInstance", "prepared"),
          ("floe.wasm.raw", "HostFunctions", "define_all"),
          ("floe.wasm.raw", "Exports", "get"), ("floe.actor.abi", "HostABI", "functions"),
          ("floe.actor.native_imports", None, "attach"), ("wasmtime", "Linker", "instantiate"),
          ("floe.actor.actor", "Actor", "_call"))


def staged(made: dict[str, list[float]]) -> None:
    """Wrap each of STAGES to add its wall time to made[its name]."""
    import importlib

    for module, cls, name in STAGES:
        owner = importlib.import_module(module)
        owner = owner if cls is None else getattr(owner, cls)
        f, label = getattr(owner, name), f"{cls or module.rsplit('.', 1)[-1]}.{name}"

        def timed(*a, _f=f, _label=label, **k):
            t = time.perf_counter()
            try:
                return _f(*a, **k)
            finally:
                made[_label].append(time.perf_counter() - t)

        setattr(owner, name, timed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the default model's)")
    ap.add_argument("--actors", type=int, default=100, help="actors a batch")
    ap.add_argument("--batches", type=int, default=7)
    ap.add_argument("--stages", action="store_true")
    ap.add_argument("--json", default=None, help="write the figures here too")
    args = ap.parse_args()
    engine = tiny_engine(tokenizer(args.tokenizer), 64)
    rows: list[tuple[float, float]] = []
    made: dict[str, list[float]] = collections.defaultdict(list)
    whole = [0.0]  # --stages: the wrapped batch's wall time

    def work() -> None:
        for _ in range(5):  # (the module compiled, the first calls' paths warm)
            Actor(engine, kv_slot="later").close()
        for _ in range(args.batches):
            new = close = 0.0
            for _ in range(args.actors):
                t0 = time.thread_time()
                actor = Actor(engine, kv_slot="later")
                t1 = time.thread_time()
                actor.close()
                new, close = new + t1 - t0, close + time.thread_time() - t1
            rows.append((1e3 * new / args.actors, 1e3 * close / args.actors))
        if args.stages:
            staged(made)
            wall = time.perf_counter()
            for _ in range(args.actors):
                Actor(engine, kv_slot="later").close()
            whole[0] = time.perf_counter() - wall

    thread = threading.Thread(target=work, name="chat")  # (not the main thread, as the core's are)
    thread.start()
    thread.join()
    machine = host()
    new = statistics.median(r[0] for r in rows)
    close = statistics.median(r[1] for r in rows)
    print(f"host: {machine['cpu']}, Python {machine['python']} ({machine['python_us']:.0f} µs a fixed "
          "workload)")
    print(f"an actor's CPU in its thread, median of {len(rows)} batches of {args.actors}: new {new:.3f} ms, "
          f"close {close:.3f} ms (new by batch: {', '.join(f'{r[0]:.3f}' for r in rows)})")
    if args.stages:
        print(f"  wrapped, new and close: {1e6 * whole[0] / args.actors:.1f} µs an actor (wall), of which")
    for label, times in sorted(made.items(), key=lambda kv: -sum(kv[1])):
        n = len(times) / args.actors
        print(f"  {label:28s} {1e6 * sum(times) / args.actors:8.1f} µs an actor ({n:.1f} calls)")
    if args.json:
        Path(args.json).write_text(json.dumps({"new_ms": new, "close_ms": close, "batches": rows,
                                               "stages_us": {k: 1e6 * sum(v) / args.actors
                                                             for k, v in made.items()},
                                               "args": vars(args), "host": machine}, indent=1))


if __name__ == "__main__":
    main()
