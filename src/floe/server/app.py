"""`floe serve`'s HTTP front: an OpenAI-compatible API whose conversations are stateful Wasm actors.

Routes: POST /v1/chat/completions (plain and SSE streaming), GET /v1/models, GET /health,
GET /metrics (Prometheus), GET /v1/sessions, GET /v1/sessions/{id}, POST /v1/sessions/{id}/freeze,
POST /v1/sessions/{id}/thaw, DELETE /v1/sessions/{id}. A request names its session with the
`X-Floe-Session` header or a `session_id` field in the body; every response says which session it
used (the same header, and `session_id` in the body). Errors are OpenAI-shaped JSON:
{"error": {"message", "type", "param", "code"}}, 4xx for bad requests. With API keys
(floe.server.auth) every route but /health needs one, and a request sees only its key's sessions.

The front holds no engine: it checks requests, and talks to the engine core (floe.server.core) over
a Unix socket (floe.server.protocol). `floe serve` runs it in a process of its own
(`python -m floe.server.app --socket PATH`), so that HTTP and SSE work never takes the GIL from the
engine loop; `create_app` runs both in one process (tests, embedding). This module imports no torch.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import logging
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from floe.server.auth import ApiKeys, api_keys
from floe.server.protocol import HEADER, ROLES, ProtocolError, ServeError, frame_length, pack, unpack
from floe.server.stops import checked_stops

if TYPE_CHECKING:
    from floe.engine import Engine

log = logging.getLogger("floe.serve")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None


class StreamOptions(BaseModel):
    include_usage: bool = False


class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # OpenAI clients send more than floe uses
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    session_id: str | None = None


def _error(status: int, message: str, type_: str, code: str | None = None, param: str | None = None):
    # A 503 is a busy server: say when to come back (clients such as openai's honour Retry-After).
    # A 4xx but 408 and 429 fails the same way again: the openai client retries 409 unless told not to.
    headers = {"Retry-After": "1"} if status == 503 else None
    if 400 <= status < 500 and status not in (408, 429):
        headers = {"x-should-retry": "false"}
    if status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": code}},
                        status_code=status, headers=headers)


def _text(m: ChatMessage) -> str:
    if m.content is None:
        return ""
    if isinstance(m.content, str):
        return m.content
    parts = []
    for part in m.content:
        if part.get("type") != "text":
            raise ServeError(400, f"content part of type {part.get('type')!r} is not supported (text only)",
                             param="messages")
        parts.append(str(part.get("text", "")))
    return "".join(parts)


class CoreClient:
    """The front's end of the socket to the engine core. Its methods run on the event loop; one task
    reads the core's frames and hands each to the call or chat it answers."""

    GONE = ServeError(503, "the engine core is not running", "server_error", "engine_gone")

    def __init__(self, path: str, on_lost: Callable[[], None] = lambda: None) -> None:
        self.path, self.on_lost = path, on_lost
        self._ids = itertools.count(1)
        self._calls: dict[int, asyncio.Future] = {}
        self._chats: dict[int, asyncio.Queue] = {}
        self._ended: dict[int, asyncio.Event] = {}  # set when a chat's last event is queued
        self.streams = 0  # streamed replies being sent
        self.gone = False
        self._task: asyncio.Task | None = None

    async def connect(self) -> None:
        self._reader, self._writer = await asyncio.open_unix_connection(self.path)
        self._task = asyncio.create_task(self._read_loop())

    async def close(self) -> None:
        if self._task is not None:
            self._writer.close()
            await asyncio.gather(self._task, return_exceptions=True)

    def _send(self, value) -> None:
        if self.gone:
            raise self.GONE
        self._writer.write(pack(value))

    async def call(self, name: str, arg=None, owner: str | None = None):
        """A call's answer; `owner`: whose sessions a session call sees (protocol.OWNER)."""
        rid = next(self._ids)
        self._calls[rid] = future = asyncio.get_running_loop().create_future()
        self._send({"op": "call", "id": rid, "name": name, "arg": arg, "owner": owner})
        return await future

    def chat(self, request: dict) -> tuple[int, asyncio.Queue, asyncio.Event]:
        """Start a chat: its id, the queue of its events (("started", session id), then ("text",
        piece)s when streamed, then ("done", result) or ("error", payload) at any point) and an
        event set once its last one is queued."""
        rid = next(self._ids)
        self._chats[rid], self._ended[rid] = queue, ended = asyncio.Queue(), asyncio.Event()
        self._send({"op": "chat", "id": rid, "request": request})
        return rid, queue, ended

    def cancel(self, rid: int) -> None:
        """The chat's client left: its row stops at its next token (nothing if it has ended)."""
        self._ended.pop(rid, None)
        if self._chats.pop(rid, None) is not None and not self.gone:
            self._send({"op": "cancel", "id": rid})

    async def _read_loop(self) -> None:
        try:
            while True:
                header = await self._reader.readexactly(HEADER.size)
                self._dispatch(unpack(await self._reader.readexactly(frame_length(header))))
        except (asyncio.IncompleteReadError, ConnectionError, ProtocolError) as e:
            if not isinstance(e, asyncio.IncompleteReadError):
                log.error("the engine core's connection broke: %s", e)
        finally:
            self.gone = True
            for future in self._calls.values():
                if not future.done():
                    future.set_exception(self.GONE)
            for queue in self._chats.values():
                queue.put_nowait(("error", self.GONE.payload()))
            for ended in self._ended.values():
                ended.set()
            self._calls.clear()
            self._chats.clear()
            self._ended.clear()
            self.on_lost()

    def _dispatch(self, message: list) -> None:
        kind = message[0]
        if kind == "text":
            for rid, piece in message[1]:
                queue = self._chats.get(rid)
                if queue is not None:
                    queue.put_nowait(("text", piece))
            return
        rid, value = message[1], message[2]
        future = self._calls.pop(rid, None)
        if future is not None:
            if not future.done():
                if kind == "ok":
                    future.set_result(value)
                else:
                    future.set_exception(ServeError.from_payload(value))
            return
        queue = self._chats.get(rid)
        if queue is not None:
            queue.put_nowait((kind, value))
            if kind in ("done", "error"):
                del self._chats[rid]
                self._ended.pop(rid).set()


# OpenAI fields floe does not implement: a request that sets one to anything but these values gets a
# 400 naming it rather than a reply that silently ignored it (tools and response_format: the grammar
# guest's issue; logprobs and penalties: not yet).
UNSUPPORTED = {"tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []),
               "function_call": (None, "none"), "parallel_tool_calls": (None,),
               "response_format": (None, {"type": "text"}), "logprobs": (None, False),
               "top_logprobs": (None, 0), "presence_penalty": (None, 0, 0.0),
               "frequency_penalty": (None, 0, 0.0), "logit_bias": (None, {}), "prediction": (None,),
               "audio": (None,), "modalities": (None, ["text"])}

BUSY_STREAMS = 8  # more streams than this: a stream's text is handed over in intervals, STREAM_INTERVAL_S
STREAM_INTERVAL_S = 0.02  # at BUSY_STREAMS streams, growing with their number up to 0.1 s


def create_front(socket_path: str, *, keys: tuple[str, ...] = (), cors_origins: tuple[str, ...] = (),
                 on_shutdown: Callable[[], None] = lambda: None,
                 on_lost: Callable[[], None] = lambda: None) -> FastAPI:
    """The ASGI app of the HTTP front, talking to the engine core at `socket_path`.

    keys: API keys (floe.server.auth; none: open). cors_origins: web origins whose pages may call it
    (none: CORS off). on_shutdown: run (in a thread) when the app stops. on_lost: called when the
    core's connection ends.
    """
    client = CoreClient(socket_path, on_lost)
    registry = CollectorRegistry()
    requests = Counter("floe_requests", "HTTP requests to the chat API (and those refused for their API "
                       "key, 401)", ["status"], registry=registry)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await client.connect()
        hello = await client.call("hello")
        app.state.model_id, app.state.started = hello["model_id"], hello["started"]
        app.state.aliases = tuple(hello["aliases"])
        try:
            yield
        finally:
            await client.close()
            await asyncio.to_thread(on_shutdown)

    app = FastAPI(title="floe", lifespan=lifespan)
    app.state.client = client

    def unauthorized(message: str) -> Response:
        requests.labels("401").inc()
        return _error(401, message, "invalid_request_error", "invalid_api_key")

    app.add_middleware(ApiKeys, keys=keys, reject=unauthorized)
    if cors_origins:  # outside the keys: a browser's preflight carries none, and a 401 needs CORS too
        app.add_middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["*"],
                           allow_headers=["*"], expose_headers=["X-Floe-Session"])

    @app.exception_handler(ServeError)
    async def api_error(request: Request, e: ServeError):
        return _error(e.status, e.message, e.type, e.code, e.param)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        if first.get("type") == "json_invalid":
            return _error(400, f"the request body is not valid JSON: {first.get('msg')}",
                          "invalid_request_error", "invalid_json")
        return _error(400, f"{where or 'body'}: {first.get('msg', 'invalid request')}",
                      "invalid_request_error", "invalid_value", where or None)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        return _error(e.status_code, str(e.detail), "invalid_request_error", "not_found"
                      if e.status_code == 404 else None)

    @app.exception_handler(Exception)
    async def internal(request: Request, e: Exception):
        log.exception("internal error")
        return _error(500, f"internal error: {type(e).__name__}: {e}", "server_error", "internal_error")

    @app.get("/health")
    async def health(request: Request):
        if request.state.owner is None:  # no key on a server with keys: up, and nothing more
            return {"status": "ok"}
        return await client.call("health")

    def _model(name: str) -> dict:
        known = (app.state.model_id, *app.state.aliases)
        if name not in known and "*" not in known:
            raise ServeError(404, f"the model {name!r} does not exist; this server serves "
                                  f"{', '.join(map(repr, known))}", code="model_not_found", param="model")
        return {"id": name, "object": "model", "created": int(app.state.started), "owned_by": "floe"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [_model(name) for name in (app.state.model_id, *app.state.aliases)
                                           if name != "*"]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        return _model(name)

    @app.get("/metrics")
    async def prometheus():
        core = await client.call("metrics")
        return Response(generate_latest(registry) + core.encode(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/sessions")
    async def sessions(request: Request):
        return {"object": "list", "data": await client.call("sessions", None, request.state.owner)}

    @app.get("/v1/sessions/{sid}")
    async def session(sid: str, request: Request):
        return await client.call("session", sid, request.state.owner)

    @app.post("/v1/sessions/{sid}/freeze")
    async def freeze(sid: str, request: Request):
        return await client.call("freeze", sid, request.state.owner)

    @app.post("/v1/sessions/{sid}/thaw")
    async def thaw(sid: str, request: Request):
        return await client.call("thaw", sid, request.state.owner)

    @app.delete("/v1/sessions/{sid}")
    async def delete(sid: str, request: Request):
        return await client.call("delete", sid, request.state.owner)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        try:
            response = await _chat(body, request)
        except ServeError as e:
            requests.labels(str(e.status)).inc()
            raise
        requests.labels("200").inc()
        return response

    def _messages(body: ChatRequest) -> list[dict]:
        """What the front checks without the engine (the core checks sampling and the context)."""
        _model(body.model)
        for name, value in (body.model_extra or {}).items():
            if name in UNSUPPORTED and value not in UNSUPPORTED[name]:
                raise ServeError(400, f"{name} is not supported by this server (it would be ignored)",
                                 code="unsupported_parameter", param=name)
        if body.n != 1:
            raise ServeError(400, "only n=1 is supported", param="n")
        messages = []
        for i, m in enumerate(body.messages):
            role = "system" if m.role == "developer" else m.role  # OpenAI's newer name for it
            if role not in ROLES:
                raise ServeError(400, f"message role {m.role!r} is not supported ({', '.join(ROLES)}, "
                                      "developer)", param="messages")
            text = _text(m)
            try:
                text.encode()
            except UnicodeEncodeError as e:
                raise ServeError(400, f"messages[{i}].content is not valid Unicode text ({e.reason} at "
                                      f"{e.start})", param="messages") from None
            messages.append({"role": role, "content": text})
        if messages[-1]["role"] != "user":
            raise ServeError(400, "the last message must be from the user", param="messages")
        return messages

    async def _chat(body: ChatRequest, request: Request):
        rid, queue, ended = client.chat({
            "messages": _messages(body), "max_tokens": body.max_completion_tokens or body.max_tokens,
            "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k, "seed": body.seed,
            "session_id": request.headers.get("x-floe-session") or body.session_id,
            "stream": body.stream, "owner": request.state.owner, "stop": list(checked_stops(body.stop))})
        try:
            kind, value = await queue.get()  # its session, or why it has none
        except asyncio.CancelledError:
            client.cancel(rid)
            raise
        if kind == "error":
            raise ServeError.from_payload(value)
        sid = value
        headers = {"X-Floe-Session": sid}
        base = {"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "created": int(time.time()),
                "model": body.model, "session_id": sid}  # the name it was asked by (an alias too)

        if not body.stream:
            kind, value = await queue.get()
            if kind == "error":
                raise ServeError.from_payload(value)
            return JSONResponse(base | {
                "object": "chat.completion",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": value["text"]},
                             "finish_reason": value["finish_reason"], "logprobs": None}],
                "usage": value["usage"]}, headers=headers)

        def chunk(delta: dict, reason: str | None = None, usage: dict | None = None) -> str:
            payload = base | {"object": "chat.completion.chunk",
                              "choices": [{"index": 0, "delta": delta, "finish_reason": reason,
                                           "logprobs": None}] if usage is None else []}
            if usage is not None:
                payload["usage"] = usage
            return f"data: {json.dumps(payload)}\n\n"

        async def events():
            # The core sends a stream's text as it comes (one frame carries every stream's pieces);
            # each piece waiting in the queue goes in one chunk. With more than BUSY_STREAMS streams,
            # a stream's chunks after its first wait an interval (as vLLM's stream interval; 20 ms at
            # 8 streams, 0.1 s from 40; cut short by the stream's end, which never waits): every chunk
            # costs JSON, a write and the client's parsing.
            client.streams += 1
            try:
                yield chunk({"role": "assistant", "content": ""})
                handed = False  # the first text never waits: time to first token
                while True:
                    kind, value = await queue.get()
                    if kind == "text":
                        if handed and client.streams > BUSY_STREAMS and not ended.is_set():
                            interval = min(0.1, STREAM_INTERVAL_S * client.streams / BUSY_STREAMS)
                            with contextlib.suppress(TimeoutError):
                                await asyncio.wait_for(ended.wait(), interval)
                        handed, texts, end = True, [value], None
                        while end is None and not queue.empty():
                            k, v = queue.get_nowait()
                            if k == "text":
                                texts.append(v)
                            else:
                                end = (k, v)
                        yield chunk({"content": "".join(texts)})
                        if end is None:
                            continue
                        kind, value = end
                    if kind == "error":
                        e = ServeError.from_payload(value)
                        error = {"message": e.message, "type": e.type, "code": e.code}
                        yield f"data: {json.dumps({'error': error})}\n\n"
                        break
                    yield chunk({}, value["finish_reason"])
                    if body.stream_options and body.stream_options.include_usage:
                        yield chunk({}, usage=value["usage"])
                    break
                yield "data: [DONE]\n\n"
            finally:
                client.streams -= 1
                client.cancel(rid)  # a client that hung up: the guest stops at its next token

        return StreamingResponse(events(), media_type="text/event-stream", headers=headers)

    return app


def create_app(engine: Engine, *, snapshots: Path, model_id: str, idle_seconds: float = 300.0,
               guest: str | None = None, batching: bool | None = None, aliases: tuple[str, ...] = (),
               keys: tuple[str, ...] = (), cors_origins: tuple[str, ...] = (),
               max_anonymous: int = 64) -> FastAPI:
    """The front and the engine core of `engine` in this process (the core's socket in a private
    temporary folder): what `floe serve` runs in two, for tests and embedding. Sessions freeze into
    `snapshots`, which a restart reads back; the app's shutdown freezes the live ones."""
    from floe.server.core import CoreServer, ServeCore

    core = ServeCore(engine, snapshots=snapshots, model_id=model_id, idle_seconds=idle_seconds,
                     guest=guest, batching=batching, aliases=aliases, max_anonymous=max_anonymous)
    core.keep_spares()
    server = CoreServer(core)  # its socket in a private temporary folder

    def shutdown() -> None:
        server.close()
        core.close()

    app = create_front(server.path, keys=api_keys(keys, {}), cors_origins=cors_origins, on_shutdown=shutdown)
    app.state.core = core
    return app


def main(argv: list[str] | None = None) -> None:
    """The HTTP front of `floe serve`, started by it: serves until its engine core goes away."""
    import uvicorn

    ap = argparse.ArgumentParser(prog="python -m floe.server.app", description=main.__doc__)
    ap.add_argument("--socket", required=True, help="the engine core's Unix socket")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    ap.add_argument("--cors-origin", action="append", default=[], help="a web origin that may call it")
    args = ap.parse_args(argv)  # its API keys: FLOE_API_KEYS (never in argv, which `ps` shows)
    logging.basicConfig(level=args.log_level.upper(), format="floe serve (http): %(message)s")
    server: uvicorn.Server | None = None

    def lost() -> None:
        server.should_exit = True

    app = create_front(args.socket, keys=api_keys(), cors_origins=tuple(args.cors_origin), on_lost=lost)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level))
    server.run()


if __name__ == "__main__":
    main()
