"""A burst of N streaming chat requests at once against a running `floe serve`, from one light client
(asyncio and raw HTTP/1.1, no client library: its own work per chunk is a line read), so that the
server's admission is what is timed, not the client's parsing (the official `openai` client kept each
of bench/serve_load.py's client processes ~95 % busy at 8 streams on the H200 host).

    python bench/probes/burst_ttft.py --port 8000 [--sessions 64] [--max-tokens 128] [--rounds 3] [--pause S]

Prints per round the TTFT p50 / p95 / max (request sent → first content chunk), the last stream's
end and the aggregate tok/s (completion tokens from each stream's usage chunk over the round's wall).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time


async def model_id(host: str, port: int, key: str | None) -> str:
    """The server's model (GET /v1/models)."""
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(f"GET /v1/models HTTP/1.1\r\nHost: {host}\r\n{auth}Connection: close\r\n\r\n".encode())
    data = await reader.read()
    writer.close()
    return json.loads(data.partition(b"\r\n\r\n")[2])["data"][0]["id"]


async def chat(host: str, port: int, model: str, i: int, max_tokens: int,
               key: str | None) -> tuple[float, int]:
    """One streamed request: (seconds to its first content chunk, completion tokens)."""
    body = json.dumps({"model": model, "stream": True, "max_tokens": max_tokens,
                       "stream_options": {"include_usage": True},
                       "messages": [{"role": "user", "content": f"Request {i}: write a long story about a "
                                     f"lighthouse keeper and the number {i}."}]}).encode()
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"{auth}Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    reader, writer = await asyncio.open_connection(host, port)
    sent = time.perf_counter()
    writer.write(head + body)
    await writer.drain()
    first, tokens = None, 0
    status = await reader.readline()
    if b" 200 " not in status:
        raise RuntimeError(f"request {i}: {status.decode().strip()}")
    async for line in reader:
        if not line.startswith(b"data: {"):
            continue
        if first is None and b'"content"' in line:
            first = time.perf_counter()
        if b'"usage"' in line:
            usage = json.loads(line[6:]).get("usage") or {}
            tokens = usage.get("completion_tokens", tokens)
    writer.close()
    return (first or time.perf_counter()) - sent, tokens


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--sessions", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--pause", type=float, default=0.0,
                    help="seconds between rounds (the server idle: what it does ahead of a burst)")
    args = ap.parse_args()
    model = await model_id(args.host, args.port, args.api_key)
    await chat(args.host, args.port, model, -1, 2, args.api_key)  # (the server's first request: warm)
    for r in range(args.rounds):
        if r:
            await asyncio.sleep(args.pause)
        t0 = time.perf_counter()
        results = await asyncio.gather(*[chat(args.host, args.port, model, i, args.max_tokens, args.api_key)
                                         for i in range(args.sessions)])
        wall = time.perf_counter() - t0
        ttft = sorted(t for t, _ in results)
        tokens = sum(n for _, n in results)
        print(f"round {r + 1}: {args.sessions} at once, TTFT p50 {1e3 * statistics.median(ttft):.0f} ms, "
              f"p95 {1e3 * ttft[int(0.95 * (len(ttft) - 1))]:.0f} ms, max {1e3 * ttft[-1]:.0f} ms; "
              f"{tokens} tokens in {wall:.2f} s: {tokens / wall:,.0f} tok/s", flush=True)


if __name__ == "__main__":
    asyncio.run(main())
