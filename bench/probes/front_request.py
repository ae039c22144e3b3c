"""What one chat request costs `floe serve`'s HTTP front in CPU, the front alone: its ASGI app
(floe.server.app.create_front, every middleware) driven in this process without sockets, against a core
client that answers at once (a session id, one text piece, the end), with the server's prompt hints (the
default model's tokenizer, or --tokenizer's). Two apps taking turns by batch: the front as it is, and the
same without its short way for a valid chat (floe.server.fastpath: FastAPI's route and handler instead).
Prints each way's CPU per request (time.process_time over a batch, the median of the batches).

    python bench/probes/front_request.py [--requests 500] [--batches 7] [--tokenizer DIR] [--plain]
        [--pieces N]

--plain: not streamed (a JSON answer) instead of an SSE stream. --pieces N: a streamed reply's text in N
chunks, each its own turn of the event loop (a streamed token's path through the front, from the core
client's queue to the ASGI send: (CPU at N - CPU at 1) / (N - 1)). A/B against other code:
PYTHONPATH=OTHER/src (an older tree without floe.server.fastpath runs its front alone, as "app").
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[2] / "tests"))
from test_server_fastpath import InstantCore  # noqa: E402
from tiny import tokenizer  # noqa: E402

from floe.server.app import create_front  # noqa: E402


class HintedCore(InstantCore):
    """tests/test_server_fastpath.py's core client (its chats end at once), with the tokenizer of the
    server's prompt hints."""

    def __init__(self, tok, pieces: int = 1) -> None:
        super().__init__()
        self.tok, self.pieces = tok, pieces

    async def call(self, name: str, arg=None, owner=None):
        return self.tok.wire() if name == "tokenizer" else await super().call(name, arg, owner)

    def chat(self, request: dict):
        """With pieces > 1: the reply's text in that many pieces, each queued two turns of the event loop
        after the one before (the stream sends each in a chunk of its own, as tokens a step apart)."""
        if self.pieces <= 1 or not request.get("stream"):
            return super().chat(request)
        self.asked.append(request)
        queue, ended, loop = asyncio.Queue(), asyncio.Event(), asyncio.get_running_loop()
        queue.put_nowait(("started", "s1"))

        def feed(i: int, again: bool) -> None:
            if again:
                loop.call_soon(feed, i, False)
            elif i < self.pieces:
                queue.put_nowait(("text", " owl"))
                loop.call_soon(feed, i + 1, True)
            else:
                n = self.pieces
                usage = {"prompt_tokens": 20, "completion_tokens": n, "total_tokens": 20 + n}
                queue.put_nowait(("done", {"text": "", "finish_reason": "stop", "usage": usage}))
                ended.set()

        loop.call_soon(feed, 0, True)
        return len(self.asked), queue, ended


def fast_path_of(app):
    """The app's short way's middleware entry (FastPath; 9f73427's ChatFastPath), if the front has one."""
    return next((m for m in app.user_middleware
                 if getattr(m.cls, "__name__", "") in ("FastPath", "ChatFastPath")), None)


chunks = [0]  # the bodies the apps sent


async def request(app, body: bytes) -> int:
    """One POST /v1/chat/completions through the app; its status."""
    sent = {"body": False}
    never = asyncio.get_running_loop().create_future()

    async def receive():
        if not sent["body"]:
            sent["body"] = True
            return {"type": "http.request", "body": body, "more_body": False}
        await never  # (no disconnect: the client reads to the end)

    status = [0]

    async def send(message):
        if message["type"] == "http.response.start":
            status[0] = message["status"]
        elif message["type"] == "http.response.body":
            chunks[0] += 1

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/chat/completions", "raw_path":
             b"/v1/chat/completions", "query_string": b"", "root_path": "", "client": ("127.0.0.1", 5000),
             "server": ("127.0.0.1", 8000), "headers": [(b"host", b"127.0.0.1:8000"),
                                                        (b"content-type", b"application/json"),
                                                        (b"content-length", str(len(body)).encode())]}
    await app(scope, receive, send)
    never.cancel()
    return status[0]


async def main_async(args) -> None:
    tok = tokenizer(args.tokenizer)
    apps = {}
    for way in ("fast", "app"):
        app = create_front(client=HintedCore(tok, args.pieces))
        if way == "app" and (entry := fast_path_of(app)) is not None:
            app.user_middleware.remove(entry)
        if way == "fast" and fast_path_of(app) is None:
            continue  # (an older front: no short way)
        apps[way] = app
    contexts = [app.router.lifespan_context(app) for app in apps.values()]
    for c in contexts:
        await c.__aenter__()
    bodies = [json.dumps({"model": "m", "max_tokens": 8, "stream": not args.plain,
                          "messages": [{"role": "user", "content": f"Tell me about owls, {i}."}]}).encode()
              for i in range(args.requests)]
    per: dict[str, list[float]] = {way: [] for way in apps}
    for app in apps.values():  # (warm-up)
        for body in bodies[:20]:
            assert await request(app, body) == 200
    chunks[0] = 0
    for _ in range(args.batches):
        for way, app in apps.items():
            t = time.process_time()
            for body in bodies:
                status = await request(app, body)
                if status != 200:
                    raise SystemExit(f"{way}: status {status}")
            per[way].append((time.process_time() - t) / len(bodies))
    for c in contexts:
        await c.__aexit__(None, None, None)
    print(f"{chunks[0] / (len(apps) * args.batches * len(bodies)):.1f} bodies sent a request")
    for way, runs in per.items():
        print(f"{way}: {1e6 * statistics.median(runs):.0f} µs of CPU a request (median of {len(runs)} "
              f"batches of {args.requests}; batches {', '.join(f'{1e6 * r:.0f}' for r in runs)})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=500)
    ap.add_argument("--batches", type=int, default=7)
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--plain", action="store_true", help="not streamed")
    ap.add_argument("--pieces", type=int, default=1, help="a streamed reply's text in this many chunks (a "
                    "token's path through the front: (CPU at N - CPU at 1) / (N - 1))")
    asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    main()
