"""A client streaming one request's headers (or a chunked body's trailers, or pipelined requests) as
fast as it can at floe's HTTP front (uvicorn with floe.server.deadlines' protocol, a one-route app: no
engine): what the front's process grows by, and how much the client got to send before the front closed
the connection.

    python bench/probes/head_flood.py [--trailers | --pipelined] [--seconds 4] [--max-head-bytes N]
        [--max-pipelined N] [--port 8799]

--max-head-bytes, --max-pipelined: the protocol's bounds on a request's head and on the requests a
connection may pipeline (default floe's; a huge value shows uvicorn's httptools protocol without it,
which keeps every header it is sent and parses every request a read holds).
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import threading
import time

import psutil

from floe.server.deadlines import MAX_HEAD_BYTES, MAX_PIPELINED

SERVER = """
import uvicorn
from floe.server import deadlines
deadlines.DeadlineHttpProtocol.max_head_bytes = {limit}
deadlines.DeadlineHttpProtocol.max_pipelined = {pipelined}
async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    await send({{"type": "http.response.start", "status": 200, "headers": []}})
    await send({{"type": "http.response.body", "body": b"ok"}})
uvicorn.Server(deadlines.uvicorn_config(app, host="127.0.0.1", port={port}, log_level="error")).run()
"""


def drain(s: socket.socket) -> None:
    try:
        while s.recv(1 << 20):
            pass
    except OSError:
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--max-head-bytes", type=int, default=MAX_HEAD_BYTES)
    ap.add_argument("--port", type=int, default=8799)
    ap.add_argument("--max-pipelined", type=int, default=MAX_PIPELINED)
    what = ap.add_mutually_exclusive_group()
    what.add_argument("--trailers", action="store_true", help="a chunked body's trailers, not headers")
    what.add_argument("--pipelined", action="store_true", help="pipelined GET requests, not headers")
    args = ap.parse_args()
    code = SERVER.format(limit=args.max_head_bytes, pipelined=args.max_pipelined, port=args.port)
    server = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                s = socket.create_connection(("127.0.0.1", args.port))
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    sys.exit("the front did not start")
                time.sleep(0.1)
        time.sleep(0.5)
        front = psutil.Process(server.pid)
        before = peak = front.memory_info().rss
        if not args.pipelined:
            s.sendall(b"POST / HTTP/1.1\r\nHost: x\r\n" + (
                b"Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n" if args.trailers else b""))
        lines = (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" * 2048 if args.pipelined
                 else (b"X-Filler: " + b"a" * 1000 + b"\r\n") * 64)
        if args.pipelined:  # a client that reads its answers (else the front's writes wait for it)
            threading.Thread(target=drain, args=(s,), daemon=True).start()
        sent, closed, t0 = 0, "no", time.monotonic()
        try:
            while time.monotonic() - t0 < args.seconds:
                s.sendall(lines)
                sent += len(lines)
                if sent % (64 * len(lines)) == 0:
                    peak = max(peak, front.memory_info().rss)
        except OSError as e:
            closed = f"yes ({type(e).__name__})"
        peak = max(peak, front.memory_info().rss)
        what = "trailers" if args.trailers else "pipelined requests" if args.pipelined else "headers"
        bound = (f"max pipelined {args.max_pipelined}" if args.pipelined
                 else f"max head bytes {args.max_head_bytes}")
        print(f"{what}, {bound}: sent {sent / 2**20:.1f} MiB in "
              f"{time.monotonic() - t0:.1f} s; closed by the front: {closed}; its RSS "
              f"+{(peak - before) / 2**20:.0f} MiB (from {before / 2**20:.0f})")
        s.close()
    finally:
        server.kill()
        server.wait()


if __name__ == "__main__":
    main()
