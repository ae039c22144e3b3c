"""A second Python thread that once ran a parallel op slows the CPU decode of the first while it lives.

    python bench/probes/cpu_second_thread.py [--threads 2] [--steps 30]

Decode tok/s of the default model (native weights, one row, `Engine.decode_batch`) from the main
thread: alone; after another thread ran one decode step and ended; while a thread that ran one lives
(idle, waiting on an event); after it ended. An engine loop's thread, a server's chat threads and the
main thread are such threads. The suspected mechanism: each thread that enters an OpenMP parallel
region gets a team of its own, and once libgomp manages more threads than the process has CPUs it
stops spinning between regions (its throttled spin count), so every one of a token's ~120 parallel
regions waits for its workers to wake.
"""

from __future__ import annotations

import argparse
import threading
import time

import torch

from floe.engine import Engine
from floe.model import load_checkpoint


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    checkpoint = load_checkpoint()
    engine = Engine(checkpoint, max_seq_len=1024, n_slots=2, weights="native")
    engine.warm_up()
    prompt = checkpoint.tokenizer.encode("The lighthouse keeper climbed the spiral stairs " * 6)

    def rate() -> float:
        engine.kv_truncate(0, 0)
        engine.prefill(prompt, 0)
        for _ in range(3):
            engine.decode_batch([5], [0])
        started = time.perf_counter()
        for _ in range(args.steps):
            engine.decode_batch([5], [0])
        return args.steps / (time.perf_counter() - started)

    print(f"alone: {rate():.1f} tok/s")
    other = threading.Thread(target=lambda: engine.decode_batch([5], [1]))
    other.start()
    other.join()
    print(f"after a thread ran one step and ended: {rate():.1f} tok/s")
    release = threading.Event()

    def stays() -> None:
        engine.decode_batch([5], [1])
        release.wait()

    other = threading.Thread(target=stays)
    other.start()
    time.sleep(0.5)
    print(f"while a thread that ran one step lives (idle): {rate():.1f} tok/s")
    release.set()
    other.join()
    print(f"after it ended: {rate():.1f} tok/s")


if __name__ == "__main__":
    main()
