"""Where one chat's tokens cost CPU through `floe serve` on the CPU: the engine core's process, its HTTP
front's process and the client (this process, http.client, one connection), per token, for the same chat
streamed and not streamed, taking turns. On a machine of few cores the front's and the client's share comes
out of the engine's: a streamed token's front and client time stalls the step its cores were computing.

    python bench/probes/serve_cpu_split.py [--rounds 3] [--max-tokens 256] [--threads 2] [--model PATH]

Starts `floe serve` (one front) on a free loopback port and stops it at the end.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import time

CLK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """A process's user + system CPU (s), from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK


def own_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def chat(port: int, model: str, stream: bool, max_tokens: int) -> int:
    """One chat; its completion tokens."""
    c = http.client.HTTPConnection("127.0.0.1", port)
    messages = [{"role": "user", "content": "Write a long story about a cat."}]
    body = json.dumps({"model": model, "messages": messages, "max_tokens": max_tokens, "stream": stream,
                       "temperature": 0,
                       **({"stream_options": {"include_usage": True}} if stream else {})})
    c.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        raise SystemExit(f"the server answered {r.status}: {r.read()[:300]!r}")
    if not stream:
        return json.loads(r.read())["usage"]["completion_tokens"]
    tokens = 0
    for line in r:
        if line.startswith(b"data: {"):
            usage = json.loads(line[6:]).get("usage")
            if usage:
                tokens = usage["completion_tokens"]
    return tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default=None, help="a model path (default: the embedded default)")
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "floe.cli", "serve", "--port", str(port), "--threads", str(args.threads),
               *(["--model", args.model] if args.model else [])]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        model, deadline = None, time.monotonic() + 300
        while model is None:
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"floe serve did not start:\n{server.stdout.read()[-2000:]}")
            try:
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
                c.request("GET", "/v1/models")
                model = json.loads(c.getresponse().read())["data"][0]["id"]
            except OSError:
                time.sleep(0.5)
        fronts = subprocess.check_output(["pgrep", "-P", str(server.pid), "-f", "floe.server.app"])
        front = int(fronts.split()[0])
        chat(port, model, True, 8)  # (warm: the first request's one-time costs out of the figures)
        rows: dict[bool, list[dict]] = {True: [], False: []}
        for _ in range(args.rounds):
            for stream in (True, False):
                core0, front0, me0, t0 = cpu_s(server.pid), cpu_s(front), own_cpu_s(), time.perf_counter()
                n = chat(port, model, stream, args.max_tokens)
                wall = time.perf_counter() - t0
                rows[stream].append({"tok_s": n / wall, "core_ms": 1e3 * (cpu_s(server.pid) - core0) / n,
                                     "front_ms": 1e3 * (cpu_s(front) - front0) / n,
                                     "client_ms": 1e3 * (own_cpu_s() - me0) / n, "tokens": n})
        for stream, runs in rows.items():
            med = {k: statistics.median(r[k] for r in runs)
                   for k in ("tok_s", "core_ms", "front_ms", "client_ms")}
            each = ", ".join(f"{r['tok_s']:.1f}" for r in runs)
            print(f"{'streamed    ' if stream else 'not streamed'}: {med['tok_s']:.1f} tok/s ({each}); CPU a "
                  f"token: core {med['core_ms']:.2f} ms, front {med['front_ms']:.3f} ms, client "
                  f"{med['client_ms']:.3f} ms (medians of {len(runs)})")
        print(f"{model}, {args.threads} threads, {os.cpu_count()} CPUs")
    finally:
        server.terminate()
        server.wait(30)


if __name__ == "__main__":
    main()
