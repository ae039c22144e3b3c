"""What a burst of arriving sessions costs the host before its first tokens: one message's on_message
(the chat guest renders and tokenizes its prompt and queues it) timed alone, and with a prompt hint (its
render and ids made ahead, as floe serve's HTTP front makes them: floe.server.hints), profiled by host call,
then S actors sending at once through one engine loop (TTFT, on_message's wall time) with 1, 2 and 4
arrivals let in at once (floe.actor.loop.ARRIVALS). A one-layer 64-wide model, so the forward costs
little and the host's share shows.

    python bench/probes/arrival_cost.py [--device cpu|cuda] [--sessions 64] [--tokens 16] [--rounds 3]
        [--arrivals 1 2 4] [--switch-ms 5]

--switch-ms: the interpreter's switch interval (sys.setswitchinterval, 5 ms by default): the longest a
thread that wants the GIL waits for one that holds it without blocking.
--gil tick release hold: the actors' guest calls (Actor._call: on_message, alloc) as floe makes them,
holding the GIL until their first epoch tick (tick: floe.wasm.raw.HOLD_TO_A_TICK); releasing it at each
of an on_message's ~14 crossings into and out of Wasmtime (release: floe before it); or holding it
throughout, as the engine loop's calls do (hold: an experiment only: a runaway guest's call would let
other threads have it once a tick, slowing each to that), rounds taking turns.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import pstats
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent))
from cpu_batch import actors_run, message  # noqa: E402
from tiny import tiny_engine, tokenizer  # noqa: E402

from floe.actor import Actor, EngineLoop  # noqa: E402
from floe.actor import loop as engine_loop  # noqa: E402
from floe.engine import Engine  # noqa: E402
from floe.wasm import start_guest_thread  # noqa: E402
from floe.wasm.raw import HOLD_TO_A_TICK  # noqa: E402

GIL = {"tick": HOLD_TO_A_TICK, "release": False, "hold": True}  # --gil: GuestInstance.call's hold_gil


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--sessions", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--arrivals", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--switch-ms", type=float, nargs="+", default=[5.0])
    ap.add_argument("--gil", nargs="+", choices=tuple(GIL), default=["tick"])
    ap.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the default model's)")
    args = ap.parse_args()
    tok = tokenizer(args.tokenizer)
    engine = tiny_engine(tok, args.sessions, args.device)
    texts = [message(tok, i, 64) for i in range(args.sessions)]
    alone(engine, texts)
    actors_run(engine, texts[:2], 2, batch=True)
    for switch_ms in args.switch_ms:
        sys.setswitchinterval(switch_ms / 1e3)
        for arrivals in args.arrivals:
            engine_loop.ARRIVALS = arrivals
            runs: dict[str, list[dict]] = {gil: [] for gil in args.gil}
            for _ in range(args.rounds):  # (the GIL's ways taking turns)
                for gil in args.gil:
                    with _holding_gil(GIL[gil]):
                        runs[gil].append(actors_run(engine, texts, args.tokens, batch=True))
            for gil, made in runs.items():
                print(f"{args.sessions} at once, {arrivals} arriving at a time, switch {switch_ms:g} ms, "
                      f"guest calls {gil}: TTFT p50 "
                      + ", ".join(f"{r['ttft_ms']:.1f}" for r in made) + " ms; on_message p50 "
                      + ", ".join(f"{r['prepare_ms']:.1f}" for r in made) + " ms, last "
                      + ", ".join(f"{r['prepare_max_ms']:.1f}" for r in made) + " ms; tok/s "
                      + ", ".join(f"{r['tok_s']:.0f}" for r in made), flush=True)


@contextlib.contextmanager
def _holding_gil(hold: bool | str):
    """The actors' guest calls (Actor._call: on_message, alloc) made with GuestInstance.call's
    hold_gil=`hold` while in it (HOLD_TO_A_TICK: as they are)."""
    call = Actor._call

    def holding(self, name: str, *args: int, deadline: float | None = None) -> int:
        own_budget = self.abi.budget is None
        if own_budget:
            self.abi.begin(self.guest.watchdog, self.guest.memory_cap)
        seconds = self.deadline_s if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            return self.guest.call(name, *args, deadline_s=seconds, pending=self.take_pending, hold_gil=hold)
        finally:
            if own_budget:
                self.abi.budget = None

    if hold != HOLD_TO_A_TICK:
        Actor._call = holding
    try:
        yield
    finally:
        Actor._call = call


def alone(engine: Engine, texts: list[str]) -> None:
    """Each message's on_message, one at a time (the loop idle), on a thread as a server's: its wall
    time without a profiler, then again under cProfile, and the profile."""
    for hinted in (False, True):
        out: list = []
        thread = threading.Thread(target=lambda out=out, hinted=hinted: out.append(
            _alone(engine, texts, False, hinted)))
        start_guest_thread(thread)
        thread.join()
        print(f"one message's on_message alone, on a guest thread{', with prompt hints' * hinted}: "
              f"p50 {1e3 * statistics.median(out[0]):.3f} ms (min {1e3 * min(out[0]):.3f})")
    profile = cProfile.Profile()
    prepare = _alone(engine, texts, profile)
    n = len(prepare)
    print(f"the same under cProfile (the main thread): p50 {1e3 * statistics.median(prepare):.3f} ms "
          f"(min {1e3 * min(prepare):.3f}); ms a message (cumulative, own, calls):")
    stats = pstats.Stats(profile)
    top = sorted(stats.stats.items(), key=lambda kv: -kv[1][3])
    for (file, line, name), (_, calls, tottime, cumtime, _) in top[:30]:
        print(f"  {1e3 * cumtime / n:7.3f} {1e3 * tottime / n:7.3f} {calls / n:5.1f}  "
              f"{Path(file).name}:{line}({name})")



def _alone(engine: Engine, texts: list[str], profiled: cProfile.Profile | bool,
           hinted: bool = False) -> list[float]:
    """Seconds of each on_message (the first message, which warms up, not counted); hinted: each with
    its conversation's prompt hint, made before it (as the front makes it, in its own process)."""
    tokenizer = engine.tokenizer
    loop = EngineLoop(engine)
    actors = [Actor(engine, loop=loop, seed=i) for i in range(len(texts))]
    actors[0].send(texts[0], max_tokens=1)
    prepare = []
    for actor, text in zip(actors[1:], texts[1:], strict=True):
        hint = tokenizer.hint([{"role": "user", "content": text}]) if hinted else None
        if profiled:
            profiled.enable()
        with tokenizer.hinted(hint):
            stats = actor.send(text, max_tokens=1).stats
        assert hint is None or hint.used == 2, "the guest's render and tokenize took the hint"
        if profiled:
            profiled.disable()
        prepare.append(stats.prepared - stats.started)
    for actor in actors:
        actor.close()
    return prepare

if __name__ == "__main__":
    main()
