"""What streaming costs `floe serve`'s engine core: S streamed chats at once through a real CoreServer
(its socket, its flusher; the reading front is another process speaking the wire), a one-layer 64-wide
model so the host's share shows. Per run: the engine loop's host time outside the engine's calls per
row-token (EngineLoop.stats: step - launch - wait - prefill), the core process's CPU time per token,
the tokens' rate and the frames the front read.

    python bench/probes/core_stream_cost.py [--sessions 64] [--tokens 64] [--rounds 3] [--tokenizer DIR]
        [--stop]    (a stop string that never matches: the reply streams as text, cut in the core)
        [--profile] (the loop's steps under cProfile in the last round: the top functions by own time)
        [--named]   (each chat a named session: session_id)
        [--connections N] (N reading fronts at once, each its own connection, the sessions shared out:
                    as `floe serve --fronts N`, the core's per-step sends one a connection)

Run it against older code with PYTHONPATH=OLD/src (the front's process inherits it).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).parent


def front(path: str, sessions: int, tokens: int, stop: bool, tag: int, named: bool) -> None:
    """The reading front: every chat at once, then read to every one's end; a JSON line of counts."""
    from floe.server.protocol import HEADER, frame_length, pack, unpack

    sock = socket.socket(socket.AF_UNIX)
    sock.connect(path)
    sock.settimeout(600)
    buf = sock.makefile("rb")
    t0 = time.perf_counter()
    for i in range(sessions):
        content = f"Story {tag}-{i}: tell me about owls number {i}."
        request = {"messages": [{"role": "user", "content": content}], "max_tokens": tokens,
                   "temperature": 0, "stream": True, "owner": ""}
        if stop:
            request["stop"] = ["\u2603never\u2603"]
        if named:
            request["session_id"] = f"named-{tag}-{i}"
        sock.sendall(pack({"op": "chat", "id": i + 1, "request": request}))
    left, frames, kinds = sessions, 0, {}
    first: dict[int, float] = {}
    while left:
        data = buf.read(frame_length(buf.read(HEADER.size)))
        frame = unpack(data)
        frames += 1
        kinds[frame[0]] = kinds.get(frame[0], 0) + 1
        if frame[0] in ("ids", "text"):
            now = time.perf_counter() - t0
            for rid, _ in frame[1]:
                first.setdefault(rid, now)
        if frame[0] in ("done", "error"):
            left -= 1
    ttft = sorted(first.values())
    print(json.dumps({"seconds": time.perf_counter() - t0, "first_s": ttft[len(ttft) // 2], "frames": frames,
                      "kinds": kinds}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--stop", action="store_true")
    ap.add_argument("--named", action="store_true", help="each chat a named session (session_id)")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--connections", type=int, default=1, help="reading fronts at once (own connections)")
    ap.add_argument("--front", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--tag", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.front:
        return front(args.front, args.sessions, args.tokens, args.stop, args.tag, args.named)
    sys.path.insert(0, str(HERE))
    from tiny import tiny_engine, tokenizer

    from floe.server.core import ServeCore
    from floe.server.core_socket import CoreServer

    engine = tiny_engine(tokenizer(args.tokenizer), args.sessions)
    folder = tempfile.mkdtemp(prefix="floe-sc-")
    core = ServeCore(engine, snapshots=Path(folder) / "s", model_id="tiny", max_anonymous=4 * args.sessions,
                     max_waiting=args.sessions)
    server = CoreServer(core, Path(folder) / "core.sock")
    try:
        for r in range(args.rounds + 1):  # (the first warms up)
            before = dict(core.loop.stats())
            profile = profiled(core.loop) if args.profile and r == args.rounds else None
            cpu0, t0 = time.process_time(), time.perf_counter()
            shares = [args.sessions // args.connections + (j < args.sessions % args.connections)
                      for j in range(args.connections)]
            fronts = [subprocess.Popen([sys.executable, __file__, "--front", server.path, "--sessions",
                                        str(n), "--tokens", str(args.tokens), "--tag", str(1000 * r + j)]
                                       + ["--stop"] * args.stop + ["--named"] * args.named,
                                       stdout=subprocess.PIPE, text=True, env=os.environ)
                      for j, n in enumerate(shares)]
            outs = [f.communicate()[0] for f in fronts]
            if any(f.returncode for f in fronts):
                raise SystemExit(f"a reading front failed: {[f.returncode for f in fronts]}")
            cpu, wall = time.process_time() - cpu0, time.perf_counter() - t0
            after = core.loop.stats()
            rows = after["rows"] - before["rows"]
            host = ((after["step_s"] - before["step_s"]) - (after["wait_s"] - before["wait_s"])
                    - (after["launch_s"] - before["launch_s"])
                    - (after["phase_s"]["prefill"] - before["phase_s"]["prefill"]))
            each = [json.loads(out.strip().splitlines()[-1]) for out in outs]
            kinds: dict[str, int] = {}
            for g in each:
                for k, v in g["kinds"].items():
                    kinds[k] = kinds.get(k, 0) + v
            got = {"frames": sum(g["frames"] for g in each), "kinds": kinds,
                   "first_s": sorted(g["first_s"] for g in each)[len(each) // 2]}
            if r == 0:
                continue
            print(f"round {r}: {rows} row-tokens in {wall:.2f} s ({rows / wall:,.0f} tok/s); loop host "
                  f"{1e6 * host / rows:.1f} µs a row-token; core CPU {1e6 * cpu / rows:.1f} µs a token; "
                  f"front read {got['frames']} frames {got['kinds']}, TTFT p50 {1e3 * got['first_s']:.0f} ms",
                  flush=True)
            steps = after["steps"] - before["steps"]
            print(f"  {steps} steps; phases, µs a row-token: " + ", ".join(
                f"{k} {1e6 * (v - before['phase_s'][k]) / rows:.1f}" for k, v in after["phase_s"].items())
                + f"; wait {1e6 * (after['wait_s'] - before['wait_s']) / rows:.1f}, launch "
                f"{1e6 * (after['launch_s'] - before['launch_s']) / rows:.1f}", flush=True)
            if profile is not None:
                top(profile, rows)
    finally:
        server.close()
        core.close()


def profiled(loop):
    """cProfile around each of `loop`'s steps from now on."""
    import cProfile

    profile, step = cProfile.Profile(), type(loop)._step

    def stepped() -> None:
        profile.enable()
        try:
            step(loop)
        finally:
            profile.disable()

    loop._step = stepped
    return profile


def top(profile, rows: int, n: int = 25) -> None:
    import pstats

    print(f"cProfile of the loop's steps (µs a row-token = tottime / {rows} rows):")
    stats = sorted(pstats.Stats(profile).stats.items(), key=lambda kv: -kv[1][2])
    for (file, line, name), (_, calls, tottime, cumtime, _) in stats[:n]:
        print(f"  {1e6 * tottime / rows:7.2f} own {1e6 * cumtime / rows:7.2f} cum  {calls:7d}  "
              f"{Path(file).name}:{line}({name})")


if __name__ == "__main__":
    main()
