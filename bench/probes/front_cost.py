"""What `floe serve`'s HTTP front costs in CPU: per request of a burst, and per streamed token (issue 40).

Starts `floe serve` (the default model unless --model; the serve options after `--` are passed on),
and from this process, one asyncio raw-HTTP/1.1 client (no client library: its work a chunk is a
line read), runs per round:

- a burst: `--sessions` streamed chat requests at once, max_tokens 1 (admission: parse, validate,
  hint, open the stream, one chunk, [DONE]);
- a long reply: one streamed chat of up to `--tokens` tokens (temperature 0; the model may end it
  sooner: the tokens are the usage's completion_tokens; the prompt and they must fit `--context`);
  `--streams N`: N such replies at once (each its own prompt), as many sessions stream through one
  front (each step's token of every stream: the front's work a token where a GPU core steps 64 rows).

Each process's CPU seconds (the scheduler's run time of its threads, /proc/PID/task/*/schedstat, in
ns; elsewhere psutil's user + system) are read before and after each phase: the fronts'
(summed over `--fronts N`) and the core's (the `floe serve` process itself). Prints per round the
front's CPU ms a request and the core's, then µs a streamed token for both; `--out F` writes the rounds
as JSON; `--spy DIR` records each front with py-spy (raw stacks, 1 kHz) during the phases.

    python bench/probes/front_cost.py [--sessions 64] [--tokens 960] [--streams 1] [--rounds 3] \\
        [--fronts 1] [-- --max-sessions 64 --context 1024]

A thread that ends during a phase takes its time with it (the fronts' threads live on). Other work on
the machine changes a process's CPU seconds less than its wall time, but some (caches, frequency,
preemption): say what else was running, and compare runs that took turns.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time

import psutil

NATIVE: list[str] = []  # ["--native"] with --spy-native: C frames too (uvloop's, the kernel calls' callers)
TEXT = "Background notes: rivers, mountains, harbours, markets, libraries, gardens, railways, festivals. " * 2


async def request(port: int, body: dict, path: str = "/v1/chat/completions") -> bytes:
    """One request over its own connection (Connection: close): the whole response, headers too."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    data = json.dumps(body).encode()
    writer.write(b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                 b"connection: close\r\n\r\n" % (path.encode(), len(data)) + data)
    await writer.drain()
    answer = await reader.read()
    writer.close()
    return answer


async def get(port: int, path: str) -> tuple[int, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET %s HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n" % path.encode())
    answer = await reader.read()
    writer.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


def chat(model: str, content: str, max_tokens: int) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}


async def burst(port: int, model: str, n: int) -> int:
    """n streamed one-token chats at once: how many ended with [DONE]."""
    answers = await asyncio.gather(*(request(port, chat(model, f"{i}: {TEXT} Tell me about bees.", 1))
                                     for i in range(n)))
    failed = [a for a in answers if b"data: [DONE]" not in a]
    if failed:  # (what the first failure was: a full server's 503 says so)
        print(f"  {len(failed)} of the burst failed; the first: {failed[0][-300:]!r}")
    return n - len(failed)


async def long_replies(port: int, model: str, tokens: int, streams: int = 1) -> tuple[int, int]:
    """`streams` streamed chats of up to `tokens` each, at once: (completion tokens, content chunks), all."""
    done = await asyncio.gather(*(long_reply(port, model, tokens, k) for k in range(streams)))
    return sum(t for t, _ in done), sum(c for _, c in done)


async def long_reply(port: int, model: str, tokens: int, k: int = 0) -> tuple[int, int]:
    """One streamed chat of up to `tokens`: (completion tokens, content chunks)."""
    subject = "a lighthouse keeper and the sea" if k == 0 else f"traveller number {k} and the mountains"
    answer = await request(port, chat(model, f"Write a long story about {subject}.", tokens))
    head, _, body = answer.partition(b"\r\n\r\n")
    if b" 200 " not in head.partition(b"\r\n")[0]:
        sys.exit(f"the long reply failed: {body[:300].decode(errors='replace')}")
    usage, chunks = {}, 0
    for line in answer.split(b"\n"):
        if line.startswith(b"data: {"):
            event = json.loads(line[6:])
            chunks += bool(event.get("choices"))
            usage = event.get("usage") or usage
    return usage.get("completion_tokens", 0), chunks


def processes(server: psutil.Process) -> tuple[list[psutil.Process], psutil.Process]:
    """The server's fronts (python -m floe.server.app) and its core (the server process)."""
    fronts = [p for p in server.children(recursive=True) if "floe.server.app" in " ".join(p.cmdline())]
    return fronts, server


def cpu(p: psutil.Process) -> float:
    """Seconds `p` has run on a CPU: the scheduler's nanoseconds summed over its threads (Linux), else
    psutil's user + system (in the kernel's 10 ms ticks: too coarse for one burst)."""
    try:
        return sum(int(open(f"/proc/{p.pid}/task/{t}/schedstat").read().split()[0])
                   for t in os.listdir(f"/proc/{p.pid}/task")) / 1e9
    except (OSError, ValueError):
        t = p.cpu_times()
        return t.user + t.system


class Phase:
    """CPU seconds of the fronts (summed) and the core over a `with` block (py-spy on the fronts if asked)."""

    def __init__(self, fronts: list[psutil.Process], core: psutil.Process, spy: str | None, name: str):
        self.fronts, self.core, self.spy, self.name = fronts, core, spy, name

    def __enter__(self) -> Phase:
        self.spies = []
        if self.spy:
            os.makedirs(self.spy, exist_ok=True)
            self.spies = [subprocess.Popen(["py-spy", "record", "-r", "1000", "-f", "raw", *NATIVE, "-o",
                                            f"{self.spy}/{self.name}_{p.pid}.txt", "-p", str(p.pid)],
                                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                          for p in self.fronts]
            time.sleep(1.5)  # (py-spy attaches)
        self.before = [sum(map(cpu, self.fronts)), cpu(self.core)]
        return self

    def __exit__(self, *exc) -> None:
        time.sleep(0.3)  # (the last writes and cancels)
        self.front_s = sum(map(cpu, self.fronts)) - self.before[0]
        self.core_s = cpu(self.core) - self.before[1]
        for spy in self.spies:
            spy.send_signal(signal.SIGINT)
            spy.wait()


def start(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    """`floe serve` on args.port, up with all its fronts: (its process, its model's id)."""
    command = ["floe", "serve", "--port", str(args.port), "--log-level", "error",
               "--fronts", str(args.fronts), "--max-anonymous", "1000",
               *(["--model", args.model] if args.model else []), *args.serve]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + args.start_timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            sys.exit(f"floe serve exited with status {server.returncode}")
        try:
            status, body = asyncio.run(get(args.port, "/health"))
            health = json.loads(body)
            if status == 200 and health.get("fronts", 1) >= args.fronts:
                return server, health["model"]
        except (OSError, ValueError, IndexError):
            pass
        time.sleep(0.25)
    server.terminate()
    sys.exit(f"floe serve did not answer /health within {args.start_timeout:g} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--port", type=int, default=8771)
    ap.add_argument("--model", default=None, help="floe serve's --model (default: its default model)")
    ap.add_argument("--fronts", type=int, default=1, help="floe serve's --fronts")
    ap.add_argument("--sessions", type=int, default=64, help="requests in a burst")
    ap.add_argument("--tokens", type=int, default=960, help="max_tokens of the long reply")
    ap.add_argument("--streams", type=int, default=1, help="long replies streamed at once")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--start-timeout", type=float, default=180.0)
    ap.add_argument("--spy", default=None, help="a folder for py-spy's raw stacks of each front, each phase")
    ap.add_argument("--spy-native", action="store_true", help="py-spy with --native (C frames too)")
    ap.add_argument("--out", default=None, help="write the rounds as JSON here")
    ap.add_argument("serve", nargs="*", help="after --: more options of floe serve")
    args = ap.parse_args()
    NATIVE[:] = ["--native"] if args.spy_native else []
    server, model = start(args)
    try:
        fronts, core = processes(psutil.Process(server.pid))
        asyncio.run(burst(args.port, model, args.sessions))  # warm: first requests, connections, caches
        asyncio.run(long_replies(args.port, model, 32, args.streams))
        rounds = []
        print(f"{len(fronts)} front(s); burst of {args.sessions}, {args.streams} reply(ies) at once of up to "
              f"{args.tokens} tokens")
        print("round  burst ok  front ms/req  core ms/req  wall s | "
              "tokens  chunks  front µs/tok  core µs/tok")
        for r in range(args.rounds):
            time.sleep(0.5)
            with Phase(fronts, core, args.spy, f"burst{r}") as b:
                t = time.perf_counter()
                ok = asyncio.run(burst(args.port, model, args.sessions))
                wall = time.perf_counter() - t
            with Phase(fronts, core, args.spy, f"stream{r}") as s:
                tokens, chunks = asyncio.run(long_replies(args.port, model, args.tokens, args.streams))
            row = {"ok": ok, "burst_wall_s": wall, "front_ms_per_request": 1e3 * b.front_s / args.sessions,
                   "core_ms_per_request": 1e3 * b.core_s / args.sessions, "tokens": tokens, "chunks": chunks,
                   "front_us_per_token": 1e6 * s.front_s / max(tokens, 1),
                   "core_us_per_token": 1e6 * s.core_s / max(tokens, 1)}
            rounds.append(row)
            print(f"{r:5d}  {ok:4d}/{args.sessions:<3d} {row['front_ms_per_request']:12.2f}  "
                  f"{row['core_ms_per_request']:11.2f}  {wall:6.2f} | {tokens:6d}  {chunks:6d}  "
                  f"{row['front_us_per_token']:12.0f}  {row['core_us_per_token']:11.0f}")
        median = {k: statistics.median(r[k] for r in rounds) for k in
                  ("front_ms_per_request", "core_ms_per_request", "front_us_per_token", "core_us_per_token")}
        print("median: front {front_ms_per_request:.2f} ms/request, {front_us_per_token:.0f} µs/token; core "
              "{core_ms_per_request:.2f} ms/request, {core_us_per_token:.0f} µs/token".format(**median))
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"args": vars(args), "rounds": rounds, "median": median}, f, indent=1)
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
