"""What one chat request costs the engine core's own thread, in CPU time, with nothing else waiting: R
requests one after another through ServeCore.open and ServeCore.run (as the core's socket runs them, on a
thread that is not the main one), each an anonymous one-shot chat with its prompt hint (as floe serve's
HTTP fronts make them), over a one-layer 64-wide model (bench/probes/tiny.py: its forward costs next to
nothing). The chat thread's CPU (time.thread_time) for open and for run, per request: the median of
--batches batches, each the mean of --requests. This is what a burst of arrivals queues for behind the
GIL, one request after another (bench/probes/arrival_timeline.py shows the burst itself).

    python bench/probes/request_cpu.py [--tokenizer DIR] [--requests 100] [--batches 5] [--tokens 4]
        [--max-anonymous 64] [--at-once S] [--named] [--profile N]

--profile N: then one more batch under cProfile (thread CPU), its N costliest functions by their own time
and by cumulative time. A/B: run it from each tree (PYTHONPATH=OTHER/src), taking turns.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent))
sys.path.insert(0, str(Path(__file__).parent))
from cpu_batch import message  # noqa: E402
from smoke import host  # noqa: E402
from tiny import tiny_engine, tokenizer  # noqa: E402

from floe.actor import native_imports  # noqa: E402
from floe.server import hints  # noqa: E402
from floe.server.core import ServeCore  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the default model's)")
    ap.add_argument("--requests", type=int, default=100, help="requests per batch")
    ap.add_argument("--batches", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=4, help="max_tokens of each reply")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-anonymous", type=int, default=64, help="as floe serve's default")
    ap.add_argument("--at-once", type=int, default=1, metavar="S",
                    help="S chat threads at once (a burst), each request's CPU in its own thread: what the "
                         "burst's contention adds to a request's own cost")
    ap.add_argument("--named", action="store_true",
                    help="each request a new named session (its session_id: a lease, an entry), not one-shot")
    ap.add_argument("--profile", type=int, default=0, metavar="N")
    ap.add_argument("--native-imports", choices=["on", "off", "alternate"], default="on",
                    help="host imports answered natively (floe.actor.native_imports) or all in Python; "
                         "alternate: batches taking turns, each way's median (an A/B in one process)")
    ap.add_argument("--json", default=None, help="write the figures here too")
    args = ap.parse_args()
    tok = tokenizer(args.tokenizer)
    engine = tiny_engine(tok, 64)
    core = ServeCore(engine, snapshots=tempfile.mkdtemp(prefix="floe-request-cpu-"), model_id="tiny",
                     max_anonymous=args.max_anonymous, max_waiting=64, wait_seconds=60)
    core.keep_spares()  # as floe serve does
    made = [0]

    def request() -> dict:
        made[0] += 1
        text = message(tok, made[0], args.prompt_tokens)
        return {"model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": args.tokens,
                "stream": True, "owner": "",
                **({"session_id": f"s{made[0]}"} if args.named else {}),
                "hint": hints.wire(engine.tokenizer.hint([{"role": "user", "content": text}]))}

    rows: list[dict] = []

    def burst(requests: list[dict]) -> tuple[float, float]:
        """The requests in len(requests) threads at once: the sums of their opens' and runs' CPU (s)."""
        start, times = threading.Barrier(len(requests)), []

        def one(r: dict) -> None:
            start.wait()
            t0 = time.thread_time()
            chat = core.open(r)
            t1 = time.thread_time()
            core.run(chat, lambda piece: None)
            times.append((t1 - t0, time.thread_time() - t1))

        threads = [threading.Thread(target=one, args=(r,)) for r in requests]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return sum(o for o, _ in times), sum(r for _, r in times)

    def batch(profile: cProfile.Profile | None = None) -> None:
        requests = [request() for _ in range(args.requests)]  # (their hints: the fronts' work, not timed)
        opened = ran = 0.0
        if args.named:  # (the last batch's sessions deleted: each open a new session's, none frozen for it)
            for sid in [r["session_id"] for r in batch.last]:
                core.store.delete(sid)
            batch.last = requests
        ways.append(way := (args.native_imports == "on" or args.native_imports == "alternate"
                            and len(ways) % 2 == 0))
        native_imports.enabled = way
        if args.at_once > 1 and profile is None:
            for i in range(0, len(requests), args.at_once):
                o, r = burst(requests[i:i + args.at_once])
                opened, ran = opened + o, ran + r
                time.sleep(0.2)  # (spare actors made again, as between a server's bursts)
            rows.append({"open_ms": 1e3 * opened / len(requests), "run_ms": 1e3 * ran / len(requests)})
            return
        for r in requests:
            if profile is not None:
                profile.enable()
            t0 = time.thread_time()
            chat = core.open(r)
            t1 = time.thread_time()
            core.run(chat, lambda piece: None)
            t2 = time.thread_time()
            if profile is not None:
                profile.disable()
            opened, ran = opened + t1 - t0, ran + t2 - t1
        rows.append({"open_ms": 1e3 * opened / len(requests), "run_ms": 1e3 * ran / len(requests)})

    batch.last = []
    ways: list[bool] = []  # each batch's: native imports on

    def work() -> None:
        batch()  # warm-up: spare actors made, the anonymous sessions past the bound forgotten from here on
        rows.clear()
        for _ in range(args.batches):
            time.sleep(0.5)  # (spare actors made again between batches, as between a server's bursts)
            batch()
        if args.profile:
            profile = cProfile.Profile(time.thread_time)
            time.sleep(0.5)
            batch(profile)
            rows.pop()
            stats = pstats.Stats(profile)
            stats.sort_stats("tottime").print_stats(args.profile)
            stats.sort_stats("cumulative").print_stats(args.profile)

    thread = threading.Thread(target=work, name="chat")  # (not the main thread, as the core's are)
    thread.start()
    thread.join()
    core.close()
    if args.native_imports == "alternate":  # (the warm-up's and the profile's batches not in rows)
        taken = ways[1:1 + len(rows)]
        for on in (True, False):
            mine = [r for r, w in zip(rows, taken, strict=True) if w == on]
            print(f"native imports {'on ' if on else 'off'}: a request's CPU, median of {len(mine)} batches: "
                  f"open {statistics.median(r['open_ms'] for r in mine):.3f} ms, run "
                  f"{statistics.median(r['run_ms'] for r in mine):.3f} ms, whole "
                  f"{statistics.median(r['open_ms'] + r['run_ms'] for r in mine):.3f} ms")
    opened = statistics.median(r["open_ms"] for r in rows)
    ran = statistics.median(r["run_ms"] for r in rows)
    wholes = [r["open_ms"] + r["run_ms"] for r in rows]
    whole = statistics.median(wholes)
    machine = host()
    print(f"host: {machine['cpu']}, Python {machine['python']} ({machine['python_us']:.0f} µs a fixed "
          "workload)")
    print(f"a request's CPU in its chat thread, median of {len(rows)} batches of {args.requests}: open "
          f"{opened:.3f} ms, run {ran:.3f} ms, whole {whole:.3f} ms (batches: "
          f"{', '.join(f'{w:.3f}' for w in wholes)})")
    if args.json:
        Path(args.json).write_text(json.dumps({"open_ms": opened, "run_ms": ran, "whole_ms": whole,
                                               "batches": rows, "args": vars(args),
                                               "host": machine}, indent=1))


if __name__ == "__main__":
    main()
