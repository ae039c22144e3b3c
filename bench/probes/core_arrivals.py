"""Where a burst's time goes in `floe serve`'s engine core, without HTTP: S threads open and run a chat
each at once (ServeCore.open, then ServeCore.run, as the core's connection does), several rounds on one
core, each phase timed per request: open (validate, take the session: new, forget the owner's oldest
anonymous ones past --max-anonymous, go live: a spare actor, a free slot or an idle session frozen),
then the turn until its first text, then the rest. A one-layer 64-wide model, so the forward costs
little and the host's share shows.

    python bench/probes/core_arrivals.py [--device cpu|cuda] [--sessions 64] [--slots 64] [--rounds 4]
        [--max-anonymous 64] [--tokens 16] [--tokenizer DIR] [--pause S] [--hints] [--stored N]

--hints: each request carries its prompt hint (floe.server.hints), made before the burst as the HTTP
fronts make them (in their own processes): after a first round (a warm-up, not counted), rounds
alternate with and without them.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent))
from cpu_batch import message  # noqa: E402
from tiny import tiny_engine, tokenizer  # noqa: E402

from floe.server import hints  # noqa: E402
from floe.server.core import ServeCore  # noqa: E402
from floe.server.sessions.session import Session  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--sessions", type=int, default=64)
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--max-anonymous", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the default model's)")
    ap.add_argument("--pause", type=float, default=2.0,
                    help="seconds idle before each round (spare actors are made, forgotten ones closed)")
    ap.add_argument("--hints", action="store_true", help="alternate rounds without and with prompt hints")
    ap.add_argument("--stored", type=int, default=0,
                    help="frozen sessions the core knows before the rounds (as one restarted over a store "
                         "holding them; registered, their files not written): half named ones of the open "
                         "owner, half other keys' anonymous ones; none is one a request continues")
    args = ap.parse_args()
    tok = tokenizer(args.tokenizer)
    engine = tiny_engine(tok, args.slots, args.device)
    core = ServeCore(engine, snapshots=tempfile.mkdtemp(prefix="floe-arrivals-"), model_id="tiny",
                     max_anonymous=args.max_anonymous, max_waiting=args.sessions, wait_seconds=60)
    core.keep_spares()  # as floe serve does
    known(core, args.stored)
    try:
        for r in range(args.rounds):
            hinted = args.hints and r % 2 == 1  # (round 1, the cold one, unhinted: a warm-up with --hints)
            texts = [message(tok, 1000 * r + i, 64) for i in range(args.sessions)]
            made = [hints.wire(engine.tokenizer.hint([{"role": "user", "content": t}])) if hinted else None
                    for t in texts]
            time.sleep(args.pause)
            rows = burst(core, texts, args.tokens, made)
            errors = [x["error"] for x in rows if "error" in x]
            if errors:
                print(f"round {r + 1}: {len(errors)} errors, e.g. {errors[0]}")
            opened = sorted(x["open"] for x in rows if "open" in x)
            first = sorted(x["first"] for x in rows if x.get("first") is not None)
            label = " (hinted)" if hinted else " (warm-up)" if args.hints and r == 0 else ""
            print(f"round {r + 1}{label}: {args.sessions} at once into {args.slots} slots: "
                  f"open p50 "
                  f"{1e3 * statistics.median(opened):.1f} ms (max {1e3 * opened[-1]:.1f}), first text p50 "
                  f"{1e3 * statistics.median(first):.1f} ms (max {1e3 * first[-1]:.1f}); core: "
                  f"{core.store.counts()}",
                  flush=True)
    finally:
        core.close()


def known(core: ServeCore, n: int) -> None:
    """n frozen sessions in the core's registry (see --stored)."""
    sessions = core.store.registry.sessions
    for i in range(n):
        owner = "" if i % 2 == 0 else f"{i % 97:016x}"
        session = Session(f"stored-{i}", messages=[{"role": "user", "content": f"an earlier chat {i}"},
                                                   {"role": "assistant", "content": "its answer"}],
                          owner=owner, anonymous=bool(owner), stored=True)
        sessions[session.key] = session


def burst(core: ServeCore, texts: list[str], tokens: int, made: list[dict | None]) -> list[dict]:
    """Every text as a chat of its own, all at once (with its prompt hint, where `made` has one): per
    request its seconds to open and to first text."""
    rows = [{} for _ in texts]
    start = threading.Barrier(len(texts))

    def one(i: int) -> None:
        start.wait()
        t0 = time.perf_counter()
        try:
            run(i, t0)
        except Exception as e:  # noqa: BLE001 - counted, the round goes on
            rows[i]["error"] = f"{type(e).__name__}: {e}"

    def run(i: int, t0: float) -> None:
        request = {"model": "tiny", "messages": [{"role": "user", "content": texts[i]}],
                   "max_tokens": tokens, "stream": True, "owner": ""}
        if made[i] is not None:
            request["hint"] = made[i]
        chat = core.open(request)
        rows[i]["open"] = time.perf_counter() - t0
        rows[i]["first"] = None

        def on_text(piece: str) -> None:
            if rows[i]["first"] is None:
                rows[i]["first"] = time.perf_counter() - t0

        core.run(chat, on_text)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(texts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return rows


if __name__ == "__main__":
    main()
