"""Where each request of a burst spends its time before its first token, inside `floe serve`'s engine
core: the real core and CoreServer in this process, the real HTTP front as its own process, and the load
from bench/serve_load.py --url (raw client, 8 processes). Each chat's moments are recorded by wrappers:
received (the core's reading thread), its chat thread started, ServeCore.open done, its turn handed to
the engine loop (on_message done: EngineLoop.run), its first token id sent to the front (the ids frame).

    python bench/probes/arrival_timeline.py --device cuda --shape llama-3.2-1b --tokenizer DIR
        [--sessions 64] [--prompt-tokens 64] [--rounds 2] [--anonymous] [--ride-rows N]
    python bench/probes/arrival_timeline.py --device cpu --sessions 16     (the default model)
    python bench/probes/arrival_timeline.py --device cpu --tiny --sessions 64 [--tokenizer DIR]
        (a one-layer 64-wide model, bench/probes/tiny.py: its forward costs next to nothing, so the
        host's own admission path shows on a CPU as it does beside an H200)

Prints per round, for each stage, p50 and max over the requests (ms), and each stage's start relative
to the burst's first arrival: whether the requests are admitted together or one after another.
`--profile N`: cProfile of each chat thread from its start to its turn's hand-off (open and on_message,
the part of a burst that takes the core's GIL one chat after another), the top N functions over the
last round's chats, µs a chat. `--steps`: the engine loop's steps while the burst comes in, one a line (its
start after the first arrival, its wall, its engine launch's, live turns, prompts riding in it): whether the
loop's intake of the prompts, not the admission, sets the first tokens.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import faulthandler
import gc
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--shape", default=None)
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--sessions", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--anonymous", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--fronts", type=int, default=1, help="HTTP front processes (floe serve --fronts)")
    ap.add_argument("--tiny", action="store_true",
                    help="the probes' one-layer 64-wide model over --tokenizer's (or the default model's) "
                         "vocabulary: the host's share alone")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="the top N functions of the chat threads' admission (cProfile, the last round)")
    ap.add_argument("--cpu-profile", action="store_true",
                    help="--profile in each chat thread's own CPU time (time.thread_time), not wall time")
    ap.add_argument("--steps", action="store_true",
                    help="the engine loop's steps while the burst comes in, one a line")
    ap.add_argument("--ride-rows", type=int, default=None,
                    help="prompt rows a CUDA decode step takes along (loop.RIDE_ROWS, graphs' MIXED_ROWS)")
    ap.add_argument("--serial-open", action="store_true",
                    help="ServeCore.open one chat at a time (a lock around it): what the burst's opens cost "
                         "when they do not interleave")
    ap.add_argument("--gate", type=int, default=0, metavar="N",
                    help="at most N chats in their admission at once (from their thread's start to their "
                         "turn's hand-off), the rest waiting in turn: fewer threads wanting the GIL beside "
                         "the engine loop's")
    ap.add_argument("--switch-ms", type=float, default=None,
                    help="the core's GIL switch interval (sys.setswitchinterval; Python's default 5 ms)")
    ap.add_argument("--stuck-s", type=float, default=150.0,
                    help="past this many seconds, every thread's stack to stderr (then again each as long)")
    args = ap.parse_args()
    faulthandler.dump_traceback_later(args.stuck_s, repeat=True)  # (a probe that hangs says where)
    if args.switch_ms is not None:
        sys.setswitchinterval(args.switch_ms / 1e3)
    import serve_load

    if args.ride_rows:
        from floe.actor import loop as engine_loop
        from floe.engine.cuda_graph import BatchGraphDecoder

        engine_loop.RIDE_ROWS = BatchGraphDecoder.MIXED_ROWS = args.ride_rows

    from floe.server import core_socket
    from floe.server.core import ServeCore
    from floe.server.core_socket import CoreServer
    from floe.server.fronts import front_environment, listen
    from floe.server.heap import settle_heap

    ns = argparse.Namespace(switch_interval_ms=None, threads=args.threads, device=args.device, weights=None,
                            shape=args.shape, tokenizer=args.tokenizer, sessions=args.sessions * args.rounds,
                            probe=0)
    if args.tiny:
        from tiny import tiny_engine, tokenizer

        engine = tiny_engine(tokenizer(args.tokenizer), ns.sessions, args.device)
        model_id, folder = "tiny", Path(tempfile.mkdtemp(prefix="floe-arrivals-"))
    else:
        engine, model_id, folder, _ = serve_load.make_engine(ns)
    core = ServeCore(engine, snapshots=folder, model_id=model_id, idle_seconds=3600)
    print(f"the core's cyclic collector: its start-up heap frozen, thresholds {settle_heap()} (as floe "
          "serve's; FLOE_GC_THRESHOLD sets them)")
    core.keep_spares()
    passes: list[tuple[int, float]] = []  # the core's cyclic collector's passes in a round: (generation, s)
    gc.callbacks.append(collector_watch(passes))
    times: dict[tuple[int, int], dict[str, float]] = {}  # (connection, rid) -> stage -> perf_counter
    cpu: dict[tuple[int, int], dict[str, float]] = {}  # ... -> stage -> its chat thread's CPU s (thread_time)
    local = threading.local()
    lock = threading.Lock()
    profiles: list[cProfile.Profile] = []  # (--profile) each chat's, from its thread's start to its hand-off

    def mark(key, stage: str, thread_cpu: bool = False) -> None:
        if key is not None:
            with lock:
                times.setdefault(key, {}).setdefault(stage, time.perf_counter())
                if thread_cpu:  # (a stage in the chat's own thread)
                    cpu.setdefault(key, {}).setdefault(stage, time.thread_time())

    dispatch, chat = CoreServer._dispatch, CoreServer._chat
    write_parts = core_socket._Connection._write_parts
    open_, run_ = ServeCore.open, type(core.loop).run

    def w_dispatch(self, conn, message):
        if isinstance(message, dict) and message.get("op") == "chat":
            mark((id(conn), message.get("id")), "received")
        return dispatch(self, conn, message)

    def w_chat(self, conn, rid, request):
        local.key = key = (id(conn), rid)
        mark(key, "thread", True)
        if gate is not None:
            gate.acquire()
            local.gated = True
        if args.profile:
            local.profile = cProfile.Profile(time.thread_time) if args.cpu_profile else cProfile.Profile()
            try:
                local.profile.enable()
            except ValueError:  # (Python 3.12: one profiler at a time across threads) this chat unprofiled
                local.profile = None
        try:
            return chat(self, conn, rid, request)
        finally:
            ungate()
            stop_profile()
            mark(key, "done", True)
            local.key = None

    gate = threading.Semaphore(args.gate) if args.gate else None

    def ungate() -> None:
        if getattr(local, "gated", False):
            local.gated = False
            gate.release()

    def stop_profile() -> None:
        profile, local.profile = getattr(local, "profile", None), None
        if profile is not None:
            profile.disable()
            with lock:
                profiles.append(profile)

    serial = threading.Lock() if args.serial_open else contextlib.nullcontext()

    def w_open(self, request, *a, **k):
        try:
            with serial:
                return open_(self, request, *a, **k)
        finally:
            mark(getattr(local, "key", None), "opened", True)

    def w_run(self, actor, *a, **k):
        stop_profile()
        ungate()
        mark(getattr(local, "key", None), "handed", True)
        try:
            return run_(self, actor, *a, **k)
        finally:
            mark(getattr(local, "key", None), "returned", True)

    def w_write_parts(self, kind, parts, *a, **k):
        if kind == "ids":  # (a request id is its front connection's: each front numbers its own)
            for rid, _ in parts:
                if (id(self), rid) in times:
                    mark((id(self), rid), "first_id")
        return write_parts(self, kind, parts, *a, **k)

    started_fronts = threading.Semaphore(0)  # a front's start-up calls answered (its last: "tokenizer")
    call_ = CoreServer._call

    def w_call(self, conn, rid, name, arg, owner):
        try:
            return call_(self, conn, rid, name, arg, owner)
        finally:
            if name == "tokenizer":
                started_fronts.release()

    steps: list[tuple] = []  # (--steps) start, wall, each phase's share (loop.phase_s), live, riding
    step_, launch_ = type(core.loop)._step, type(core.engine).launch_batch

    def w_step(self):
        riding.clear()
        start = time.perf_counter()
        before = dict(self.phase_s)
        try:
            return step_(self)
        finally:
            steps.append((start, time.perf_counter() - start,
                          {k: v - before.get(k, 0.0) for k, v in self.phase_s.items()}, len(self._active),
                          sum(riding)))

    riding: list[int] = []

    def w_launch(self, tokens, slots, prompts=(), *a, **k):
        riding.append(len(prompts))
        return launch_(self, tokens, slots, prompts, *a, **k)

    if args.steps:
        type(core.loop)._step, type(core.engine).launch_batch = w_step, w_launch
    CoreServer._call = w_call
    CoreServer._dispatch, CoreServer._chat, ServeCore.open = w_dispatch, w_chat, w_open
    type(core.loop).run = w_run
    core_socket._Connection._write_parts = w_write_parts
    server = CoreServer(core)
    port = serve_load.free_port()
    listeners = listen("127.0.0.1", port, args.fronts)  # (as floe serve: a socket a front)
    environment = front_environment((), args.fronts)
    env = environment.__enter__()
    stamps = Path(tempfile.mkdtemp(prefix="floe-timeline-")) / "fronts.txt"  # (bench/probes/front_stamps.py)
    fronts = [subprocess.Popen([sys.executable, str(HERE / "front_stamps.py"), str(stamps), "--", "--socket",
                                server.path, "--fd", str(listener.fileno())], env=os.environ | env,
                               pass_fds=(listener.fileno(),))
              for listener in (listeners[k % len(listeners)] for k in range(args.fronts))]
    for listener in listeners:
        listener.close()
    try:
        import urllib.request

        for _ in range(300):  # until every front has connected to the core
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if json.loads(r.read()).get("fronts", 1) >= args.fronts:
                        break
            except OSError:
                pass
            time.sleep(0.2)
        # ... and has its start-up answers (the token table and the tokenizer, JSON-encoded in the core:
        # ~25 ms of its GIL a front on the H200 host), which /health's count of connections does not wait for;
        # a front that takes no tokenizer (its model's vocabulary is not the tokenizer's: random weights of
        # a shape) asks none: 20 s in all, not a minute a front
        print("the fronts are connected", file=sys.stderr, flush=True)
        ready = time.monotonic() + 20
        for _ in range(args.fronts):
            started_fronts.acquire(timeout=max(0.0, ready - time.monotonic()))
        for r in range(args.rounds):
            times.clear()
            cpu.clear()
            profiles.clear()
            steps.clear()
            passes.clear()
            fronts_cpu = [process_cpu_s(front.pid) for front in fronts]
            cmd = [sys.executable, str(HERE.parent / "serve_load.py"), "--url", f"http://127.0.0.1:{port}",
                   "--device", args.device, "--sessions", str(args.sessions), "--turns", "1", "--max-tokens",
                   str(args.max_tokens), "--prompt-tokens", str(args.prompt_tokens), "--client-processes",
                   str(max(1, args.sessions // 8)), "--tag", f"r{r}-", "--out", os.devnull]
            loaded = stamps.parent / f"load_{r}.json"
            cmd[cmd.index(os.devnull)] = str(loaded)
            started = time.perf_counter()
            print(f"round {r + 1}: the load starts", file=sys.stderr, flush=True)
            try:
                out = subprocess.run(cmd + ["--anonymous"] * args.anonymous, capture_output=True, text=True,
                                     timeout=args.stuck_s)
            except subprocess.TimeoutExpired as e:
                err = e.stderr or b""
                err = err.decode(errors="replace") if isinstance(err, bytes) else err
                print(f"round {r + 1}: the load ran past {args.stuck_s:g} s; its stderr:",
                      *err.splitlines()[-20:], sep="\n", file=sys.stderr)
                raise
            print(f"round {r + 1}: " + " ".join(line for line in out.stdout.splitlines() if "TTFT" in line))
            if out.returncode:
                print(f"  the load failed (exit {out.returncode}):", *out.stderr.splitlines()[-12:], sep="\n")
            timed = sorted((v for v in times.values() if "first_id" in v and "received" in v),
                           key=lambda v: v["received"])
            rows = json.loads(loaded.read_text())["rows"] if loaded.exists() else []
            front = [line.split() for line in stamps.read_text().splitlines()] if stamps.exists() else []
            front = [(what, float(t)) for _, what, t in front if float(t) > started]
            outside = {"client connects": [x["connecting_at"] for x in rows if "connecting_at" in x],
                       "client sends": [x["sent_at"] for x in rows if "sent_at" in x],
                       "front gets": [t for what, t in front if what == "request"],
                       "front to core": [t for what, t in front if what == "to_core"],
                       "front sends first token": [t for what, t in front if what == "first_token"],
                       "client's first token": [x["sent_at"] + x["ttft_s"] for x in rows
                                                if x.get("ttft_s") is not None and "sent_at" in x]}
            report(timed[-args.sessions:], {k: sorted(v)[-args.sessions:] for k, v in outside.items()})
            report_cpu(list(cpu.values()))
            report_gc(passes, args.sessions)
            fronts_gc = [(int(what[2]), float(what.split(":")[1])) for what, _ in front
                         if what.startswith("gc")]
            report_gc(fronts_gc, args.sessions, "the fronts' cyclic collectors")
            used = [process_cpu_s(f.pid) - before for f, before in zip(fronts, fronts_cpu, strict=True)]
            print(f"  the fronts' CPU over the round: {1e3 * sum(used):.1f} ms in all, "
                  f"{1e3 * sum(used) / args.sessions:.2f} ms a request (its intake and its {args.max_tokens} "
                  f"tokens' stream; per front: {', '.join(f'{1e3 * u:.0f}' for u in used)} ms)")
            if args.steps and timed:
                burst = timed[-args.sessions:]  # (not the load's warm-up requests before it)
                report_steps(steps, burst[0]["received"], max(v["first_id"] for v in burst))
        if profiles:
            report_profile(profiles, args.profile)
    finally:
        for front in fronts:
            front.terminate()
        for front in fronts:
            front.wait(30)
        environment.__exit__(None, None, None)
        server.close()
        core.close()


def process_cpu_s(pid: int) -> float:
    """A process's CPU seconds so far, user and system, all its threads (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def collector_watch(passes: list[tuple[int, float]]):
    """A gc.callbacks entry recording each pass of the cyclic collector: (its generation, its seconds)."""
    began = [0.0]

    def watch(phase: str, info: dict) -> None:
        if phase == "start":
            began[0] = time.perf_counter()
        else:
            passes.append((info["generation"], time.perf_counter() - began[0]))

    return watch


def report_gc(passes: list[tuple[int, float]], requests: int,
              whose: str = "the core's cyclic collector") -> None:
    """A cyclic collector's passes over a round (the core's; the fronts'), by generation."""
    by = [[s for g, s in passes if g == gen] for gen in range(3)]
    total = sum(s for _, s in passes)
    print(f"  {whose} over the round: {1e3 * total:.1f} ms in all, "
          f"{1e3 * total / requests:.3f} ms a request; " + "; ".join(
              f"gen{gen} {len(b)} passes, {1e3 * sum(b):.1f} ms (longest {1e3 * max(b, default=0):.1f})"
              for gen, b in enumerate(by)))


def report_profile(profiles: list[cProfile.Profile], top: int) -> None:
    """The chats' admission profiles together: the top functions by own time (SORT=cum: cumulative),
    µs a chat."""
    stats = pstats.Stats(profiles[0])
    for profile in profiles[1:]:
        stats.add(profile)
    n = len(profiles)
    print(f"the chat threads' admission (start to hand-off), cProfile over {n} chats, µs a chat:")
    by = 3 if os.environ.get("SORT") == "cum" else 2  # (SORT=cum: by cumulative time)
    ranked = sorted(stats.stats.items(), key=lambda kv: -kv[1][by])[:top]
    for (file, line, name), (_, calls, own, cum, _) in ranked:
        print(f"  {1e6 * own / n:7.1f} own {1e6 * cum / n:7.1f} cum  {calls / n:6.1f} calls  "
              f"{Path(file).name}:{line}({name})")


def report_steps(steps: list[tuple], first: float, last: float) -> None:
    """The loop's steps from the burst's first arrival to its last first token id, one a line."""
    window = [s for s in steps if first <= s[0] <= last]
    if not window:
        return
    names = list(window[0][2])
    print(f"  the engine loop's {len(window)} steps from the first arrival to the last first id "
          f"(start ms, wall ms, its phases' ms: {', '.join(names)}; live turns, prompts riding):")
    for start, wall, phases, live, riding in window:
        shares = " ".join(f"{1e3 * phases.get(k, 0.0):7.2f}" for k in names)
        print(f"    {1e3 * (start - first):8.1f} {1e3 * wall:7.2f} | {shares} | {live:4d} {riding:3d}")
    sums = " ".join(f"{1e3 * sum(s[2].get(k, 0.0) for s in window):7.1f}" for k in names)
    print(f"    {'in all':>8} {1e3 * sum(s[1] for s in window):7.1f} | {sums} | (ms)")


def report_cpu(rows: list[dict[str, float]]) -> None:
    """Each chat thread's CPU by stage (time.thread_time: its own, not the GIL's waits), p50 / sum."""
    stages = [("thread", "opened", "open"), ("opened", "handed", "its turn to the loop (on_message)"),
              ("handed", "returned", "in the loop"), ("returned", "done", "after the loop (on_end, reply)")]
    parts = []
    for a, b, name in stages:
        spans = [1e3 * (r[b] - r[a]) for r in rows if a in r and b in r]
        if spans:
            parts.append(f"{name} {statistics.median(spans):.3f} / {sum(spans):.1f}")
    whole = [1e3 * (r["done"] - r["thread"]) for r in rows if "done" in r and "thread" in r]
    if whole:
        print(f"  chat threads' CPU ms, p50 / sum over {len(whole)}: whole {statistics.median(whole):.3f} / "
              f"{sum(whole):.1f}; " + "; ".join(parts))


def report(rows: list[dict[str, float]], outside: dict[str, list[float]]) -> None:
    """Each stage's span and start (from the core's first receipt) over the requests; then the
    moments outside the core (outside: the clients' and the fronts', by name), from the first client's
    send: whether the requests leave the clients, reach the fronts and the core together or spread."""
    if not rows:
        print("  no request was timed")
        return
    t0 = min(r["received"] for r in rows)
    stages = [("received", "thread"), ("thread", "opened"), ("opened", "handed"), ("handed", "first_id")]
    print(f"  {len(rows)} requests; stage: p50 / max ms (its start after the first arrival: p50 / max ms)")
    for a, b in stages:
        spans = [1e3 * (r[b] - r[a]) for r in rows if a in r and b in r]
        starts = [1e3 * (r[a] - t0) for r in rows if a in r]
        print(f"  {a:>9} → {b:<9} {statistics.median(spans):7.1f} / {max(spans):7.1f}    "
              f"(from {statistics.median(starts):6.1f} / {max(starts):6.1f})")
    ends = [1e3 * (r["first_id"] - t0) for r in rows]
    print(f"  first token id sent: p50 {statistics.median(ends):.1f} ms, max {max(ends):.1f} ms after the "
          "first arrival")
    sends = outside.get("client sends") or []
    if not sends:
        return
    t1 = min(sends)
    later = ("front sends first token", "client's first token")  # (after the core's moments)
    moments = ({k: v for k, v in outside.items() if k not in later}
               | {"core receives": [r["received"] for r in rows],
                  "core sends first id": [r["first_id"] for r in rows]}
               | {k: outside.get(k, []) for k in later})
    print(f"  moments after the first client's send (ms): first / p50 / max of {len(rows)} requests")
    for name, ts in moments.items():
        if ts:
            ms = sorted(1e3 * (t - t1) for t in ts)
            print(f"  {name:>23} {ms[0]:7.1f} / {statistics.median(ms):7.1f} / {ms[-1]:7.1f}  ({len(ms)})")


if __name__ == "__main__":
    main()
