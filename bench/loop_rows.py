"""The host's work per decode row in the engine loop: each row's on_token call (the guest and the host
calls it makes), for a guest that takes the host's choice from its memory and lets the host stream
(floe's chat guest) against one that calls sample, detokenize and emit (the same answer). A tiny
random model on the CPU, so the forward costs next to nothing beside it.

    python bench/loop_rows.py [--actors 32] [--tokens 64] [--temperature 0.7]

Prints µs per row (median of 3 rounds of every actor's turn at once).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))

from guests_wat import v2_chooser  # noqa: E402
from models import tiny_engine  # noqa: E402

from floe.actor import Actor, EngineLoop  # noqa: E402
from floe.bench import together  # noqa: E402
from floe.engine import SamplingParams  # noqa: E402


def per_row_us(engine, guest, n: int, tokens: int, params: SamplingParams) -> float:
    loop = EngineLoop(engine)
    spent = [0.0, 0]
    ask = loop._ask_guest

    def timed(turn):
        t = time.perf_counter()
        ask(turn)
        spent[0] += time.perf_counter() - t
        spent[1] += 1

    loop._ask_guest = timed
    actors = [Actor(engine, guest, loop=loop, seed=i) for i in range(n)]
    rounds = []
    for _ in range(4):
        spent[:] = [0.0, 0]
        together([lambda a=a, i=i: a.send(f"Tell me about number {i}", max_tokens=tokens, params=params)
                  for i, a in enumerate(actors)])
        rounds.append(1e6 * spent[0] / spent[1])
    for a in actors:
        a.close()
    return statistics.median(rounds[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--actors", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    args = ap.parse_args()
    engine = tiny_engine(n_slots=args.actors)
    params = SamplingParams(args.temperature)
    for name, guest in (("sample + detokenize + emit", v2_chooser(choice=False, stream=False)),
                        ("choice in memory + host streams", v2_chooser(choice=True, stream=True)),
                        ("floe's chat guest", None)):
        print(f"{name:>32}: {per_row_us(engine, guest, args.actors, args.tokens, params):6.1f} µs a row",
              flush=True)


if __name__ == "__main__":
    main()
