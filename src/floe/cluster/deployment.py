"""floe as a Ray Serve application, for those who compose their own (docs/RAY.md, "Composing your own
Ray Serve application"): `app(snapshots=..., replicas=N)` in Python, or `build` from a Serve config
file or `serve run floe.cluster.deployment:build snapshots=... replicas=N`.

The application is one Serve deployment, `FloeFront`: the OpenAI endpoint of `floe serve --ray`
(floe.cluster.serve.create_cluster_app: floe.server.app's front with floe.cluster.router's client) as
its ingress, in front of N floe replicas (floe.cluster.replica's Ray actors, which it starts: each an
engine with its sessions, the sessions in the shared store `snapshots` names). floe's replicas are not
Serve replicas because a live session must go to the replica that holds its KV cache (session
affinity), which Serve's routing does not do; Serve's proxy, route prefixes, config files and
composition with other applications work as for any ingress. The front keeps which session lives
where, so it runs as one Serve replica (it only routes: the engines' work is in floe's replicas).

Another deployment calls it through a DeploymentHandle as well as over HTTP: `chat` (an answer's JSON)
and `chat_stream` (its chunks', with handle.options(stream=True)) go through the same front, in its
process, as a POST /v1/chat/completions does.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Literal

from pydantic import BaseModel, ConfigDict
from ray import serve
from ray.serve import Application

from floe.cluster.serve import close_replicas, create_cluster_app, start_replicas
from floe.server.models.specs import ModelSpec

# The front only routes (admission is each floe replica's: a full one answers 503 with Retry-After), so
# Serve's queue in front of it is made wide enough never to be the limit a client meets.
MAX_ONGOING_REQUESTS = 1024


class Options(BaseModel):
    """What the application takes: `floe serve --ray`'s flags (docs/SERVER.md), by the same names."""

    model_config = ConfigDict(extra="forbid")

    snapshots: str  # the shared session store: an object-store URL, or a folder every node mounts
    replicas: int = 1
    model: str | None = None  # a GGUF file or Hugging Face folder (None: the default model)
    models: dict[str, str | None] | None = None  # several: name -> path, each loaded on demand
    keep_alive: float | None = None  # (several models) seconds a model stays loaded idle
    max_loaded: int | None = None
    memory_budget: int | None = None  # bytes
    device: str = "cpu"
    context: int = 2048  # tokens
    max_sessions: int = 4  # KV slots per replica (per model)
    threads: int = 1
    durability: Literal["turn", "idle"] = "turn"
    idle_seconds: float = 300.0
    lease_seconds: float = 30.0
    api_keys: list[str] = []
    operator_keys: list[str] = []
    cors_origins: list[str] = []

    def replica_options(self) -> dict:
        """floe.cluster.serve.start_replicas's keywords."""
        models = ({"model": self.model} if self.models is None else
                  {"models": [ModelSpec(name, path) for name, path in self.models.items()],
                   "keep_alive": self.keep_alive, "max_loaded": self.max_loaded,
                   "memory_budget": self.memory_budget})
        return models | {"context": self.context, "slots": self.max_sessions, "threads": self.threads,
                         "lease_s": self.lease_seconds, "device": self.device,
                         "gpus": 0 if self.device == "cpu" else 1, "idle_seconds": self.idle_seconds,
                         "freeze_every_turn": self.durability == "turn"}


@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0},
                  max_ongoing_requests=MAX_ONGOING_REQUESTS)
@serve.ingress()
class FloeFront:
    """floe's OpenAI endpoint in front of its replicas (Ray actors it starts and closes)."""

    async def __init__(self, options: Options) -> None:
        self.options = options
        # (start_replicas waits for every replica's model load with ray.get: not on Serve's loop)
        self.replicas = await asyncio.to_thread(start_replicas, options.replicas, options.snapshots,
                                                **options.replica_options())

    def __serve_build_asgi_app__(self):
        o = self.options
        return create_cluster_app(self.replicas, keys=tuple(o.api_keys), cors_origins=tuple(o.cors_origins),
                                  operator_keys=tuple(o.operator_keys))

    async def chat(self, body: dict, api_key: str | None = None) -> dict:
        """A chat completion (`body` as POST /v1/chat/completions takes it, not streamed): its answer.
        api_key: whose sessions (needed where the application has api_keys). Raises ChatRefused."""
        pieces = posted(self.app, "/v1/chat/completions", body | {"stream": False}, api_key)
        status = await anext(pieces)
        answer = json.loads(b"".join([piece async for piece in pieces]))
        if status != 200:
            raise ChatRefused(status, answer.get("error", answer))
        return answer

    async def chat_stream(self, body: dict, api_key: str | None = None) -> AsyncIterator[dict]:
        """A streamed chat completion's chunks, as the server-sent events of POST /v1/chat/completions
        carry them (an error there is a chunk {"error": ...}). Raises ChatRefused before the first."""
        pieces = posted(self.app, "/v1/chat/completions", body | {"stream": True}, api_key)
        status, events = await anext(pieces), b""
        if status != 200:
            answer = json.loads(b"".join([piece async for piece in pieces]))
            raise ChatRefused(status, answer.get("error", answer))
        async for piece in pieces:
            *whole, events = (events + piece).split(b"\n\n")
            for event in whole:
                data = event.removeprefix(b"data: ")
                if data != b"[DONE]":
                    yield json.loads(data)

    async def __del__(self) -> None:
        """At the application's end: each replica freezes its live sessions into the shared store."""
        replicas = getattr(self, "replicas", {})  # (none: its start failed)
        await asyncio.to_thread(close_replicas, replicas)


def build(args: dict) -> Application:
    """The application of a Serve config's `args` (or `serve run floe.cluster.deployment:build KEY=VALUE
    ...`: strings), checked and converted by Options (pydantic.ValidationError names a bad one)."""
    return FloeFront.bind(Options.model_validate(args))


def app(**options) -> Application:
    """The application of Options' keywords: serve.run(app(snapshots=..., replicas=2), route_prefix=...)."""
    return build(options)


class ChatRefused(Exception):
    """A chat the front refused or failed: its HTTP status and OpenAI error object."""

    def __init__(self, status: int, error: dict) -> None:
        super().__init__(status, error)
        self.status, self.error = status, error

    def __str__(self) -> str:
        return f"{self.status}: {self.error.get('message', self.error)}"


async def posted(app, path: str, body: dict, api_key: str | None) -> AsyncIterator:
    """An ASGI `app`'s answer to a POST of `body` (JSON) at `path`, as it comes: its status, then each
    piece of its body. Closed early, the app sees its client leave (a stream stops its generation)."""
    headers = [(b"content-type", b"application/json")]
    if api_key is not None:
        headers.append((b"authorization", f"Bearer {api_key}".encode()))
    request = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]
    left, sent = asyncio.Event(), asyncio.Queue()

    async def receive() -> dict:
        if request:
            return request.pop()
        await left.wait()
        return {"type": "http.disconnect"}

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "", "query_string": b"",
             "headers": headers, "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0)}

    async def call_app() -> None:
        try:
            await app(scope, receive, sent.put)
        finally:
            sent.put_nowait(None)  # (an app that failed before its answer ends too)

    call = asyncio.ensure_future(call_app())
    try:
        while (message := await sent.get()) is not None:
            if message["type"] == "http.response.start":
                yield message["status"]
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield message["body"]
                if not message.get("more_body"):
                    break
        await call
    finally:
        left.set()
        if not call.done():
            await asyncio.wait([call], timeout=30)
