"""`floe serve`'s HTTP front: an OpenAI-compatible API whose conversations are stateful Wasm actors.

Routes: POST /v1/chat/completions and POST /v1/completions (plain and SSE streaming; the chat service,
floe.server.chat), GET /v1/models, GET /v1/models/{id}, GET /health,
GET /metrics (Prometheus), GET /v1/sessions, GET /v1/sessions/{id}, POST /v1/sessions/{id}/freeze,
POST /v1/sessions/{id}/thaw, POST /v1/sessions/{id}/fork (a new session with this one's state),
DELETE /v1/sessions/{id}, GET and PUT /v1/sessions/{id}/snapshot (a
session's snapshot file out and in, streamed, checked on the way in). A request names its session with the
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
import logging
import math
import os
import socket
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect

from floe.server.auth import OPERATOR_KEYS_ENV, ApiKeys, api_keys
from floe.server.chat import ChatRequest, ChatService, ClientGone, CompletionRequest
from floe.server.client import CoreClient
from floe.server.fastpath import FastPath, Route
from floe.server.limits import MAX_REQUEST_BYTES, BodyLimit, check_text
from floe.server.protocol import METRICS_ENV, ServeError

if TYPE_CHECKING:
    from floe.engine import Engine
    from floe.server.core import ServeCore
    from floe.server.models import ModelRouter
    from floe.snapshot.store import SnapshotStore

log = logging.getLogger("floe.serve")
EXIT_CORE_LOST = 3  # the front's status when its engine core went away (floe serve exits with it)
CHAT_PATHS = ("/v1/chat/completions", "/v1/completions")  # the chat API: floe_requests counts them


FORK_DESCRIPTION = """A new session of the caller's whose conversation and state (KV cache, guest memory,
generator) are this session's now: the two continue independently (a chat branched). The body names
the new session (`{"id": "new-id"}`; letters, digits and `_ . -`); without a body, or without `id`, a
fresh id is made. A running turn of the session is waited for, as a freeze waits; a frozen session is
thawed to be copied. The fork is stored (frozen, in the snapshot store's durable home) before the answer:
its `id`, `state`, `messages`, `snapshot_bytes`, and `forked_from`. 404 `session_not_found`: no such
session of the caller's; 409 `session_exists`: the caller has a session of the new id; 400: an id that
is not one."""


class ForkRequest(BaseModel):
    """The body of POST /v1/sessions/{id}/fork."""

    model_config = ConfigDict(extra="forbid")
    id: str | None = Field(None, description="the new session's id (absent or null: a fresh one)")


def _error(status: int, message: str, type_: str, code: str | None = None, param: str | None = None,
           retry_after: float | None = None):
    # A 503 is a busy server: say when to come back (clients such as openai's honour Retry-After).
    # A 4xx but 408 and 429 fails the same way again: the openai client retries 409 unless told not to
    # (a session another server holds, too: its lease is renewed while that server keeps it, so a
    # retry a second later would fail the same way; Retry-After says when the lease ends if it is not).
    headers = {"Retry-After": "1"} if status == 503 else None
    if 400 <= status < 500 and status not in (408, 429):
        headers = {"x-should-retry": "false"}
        if retry_after is not None:
            headers["Retry-After"] = str(max(1, math.ceil(retry_after)))
    if status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": code}},
                        status_code=status, headers=headers)


def _not_json(request: Request) -> str | None:
    """Why a request's body was not read as JSON, if its headers say: a compressed body, or a content
    type other than JSON's (`curl -d` sends application/x-www-form-urlencoded)."""
    encoding = request.headers.get("content-encoding", "identity")
    if encoding.lower() != "identity":
        return f"Content-Encoding {encoding[:40]!r} is not supported (send the body uncompressed)"
    kind = request.headers.get("content-type")
    media = (kind or "application/json").split(";")[0].strip().lower()
    if media != "application/json" and not (media.startswith("application/") and media.endswith("+json")):
        return f"send it with Content-Type: application/json (this request's is {kind[:60]!r})"
    return None


def create_front(socket_path: str | None = None, *, keys: tuple[str, ...] = (),
                 cors_origins: tuple[str, ...] = (), on_shutdown: Callable[[], None] = lambda: None,
                 on_lost: Callable[[], None] = lambda: None, client=None,
                 max_request_bytes: int = MAX_REQUEST_BYTES, operator_keys: tuple[str, ...] = (),
                 prompt_hints: bool = True) -> FastAPI:
    """The ASGI app of the HTTP front, talking to the engine core at `socket_path` (or through
    `client`, an object with CoreClient's methods: floe.cluster.router's, which routes over replicas).

    keys: API keys (floe.server.auth; none: open). cors_origins: web origins whose pages may call it
    (none: CORS off). prompt_hints: the front renders and tokenizes each plain chat's conversation for
    the core (floe.server.hints). on_shutdown: run (in a thread) when the app stops. on_lost: called when the
    core's connection ends. max_request_bytes: the largest request body but a snapshot upload's
    (floe.server.limits). operator_keys: keys (API keys too) that see the server's /metrics and its
    whole /health; other keys see their own sessions' counts (without keys everyone is the operator).
    """
    client = client if client is not None else CoreClient(socket_path, on_lost)
    registry = CollectorRegistry()
    several = METRICS_ENV in os.environ  # floe serve --fronts N: each counts in files; /metrics sums them
    if several:
        from prometheus_client import multiprocess

        multiprocess.MultiProcessCollector(registry)
    requests = Counter("floe_requests", "HTTP requests to the chat API (and those refused for their API "
                       "key, 401)", ["status"], registry=None if several else registry)

    def refused(path: str, status: int) -> None:
        """A chat API request refused before its handler ran (its body too large, not JSON, not a valid
        request, too many messages) is counted too, by its status."""
        if path in CHAT_PATHS:
            requests.labels(str(status)).inc()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await client.connect()
        hello = await client.call("hello")
        app.state.model_id, app.state.started = hello["model_id"], hello["started"]
        app.state.aliases = tuple(hello["aliases"])
        app.state.models = tuple(hello.get("models", ()))  # several models (floe.server.models): their names
        app.state.max_text_bytes = hello.get("max_text_bytes")  # a router's replicas may not say
        app.state.context = hello.get("context")  # (nor this)
        if prompt_hints and not app.state.models:
            await service.hints.load(client)
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

    def too_large(text: str, path: str) -> Response:
        refused(path, 413)
        return _error(413, text, "invalid_request_error", "request_too_large")

    app.add_middleware(BodyLimit, max_bytes=max_request_bytes, reject=too_large)  # inside the keys: 401 first
    app.add_middleware(ApiKeys, keys=keys, reject=unauthorized, operators=operator_keys)
    if cors_origins:  # outside the keys: a browser's preflight carries none, and a 401 needs CORS too
        app.add_middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["*"],
                           allow_headers=["*"], expose_headers=["X-Floe-Session"])

    @app.exception_handler(ServeError)
    async def api_error(request: Request, e: ServeError):
        return _error(e.status, e.message, e.type, e.code, e.param, e.retry_after)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError):
        refused(request.url.path, 400)
        first = e.errors()[0] if e.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        sent = _not_json(request)
        if first.get("type") == "json_invalid":
            return _error(400, f"the request body is not valid JSON: {sent or first.get('msg')}",
                          "invalid_request_error", "invalid_json")
        if not where and sent:  # (FastAPI reads a body as JSON only for a JSON content type)
            return _error(400, f"the request body must be a JSON object: {sent}", "invalid_request_error",
                          "invalid_json")
        return _error(400, f"{where or 'body'}: {first.get('msg', 'invalid request')}",
                      "invalid_request_error", "invalid_value", where or None)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        refused(request.url.path, 400 if isinstance(e.__cause__, RecursionError) else e.status_code)
        if isinstance(e.__cause__, RecursionError):  # FastAPI's "There was an error parsing the body"
            return _error(400, "the request body is JSON nested too deep to read (past ~1,000 levels; "
                               "floe takes at most 512)", "invalid_request_error", "invalid_json")
        if isinstance(e.__cause__, UnicodeDecodeError):  # FastAPI's "There was an error parsing the body"
            why = _not_json(request) or "not UTF-8 text"
            return _error(400, f"the request body is not valid JSON: {why}", "invalid_request_error",
                          "invalid_json")
        return _error(e.status_code, str(e.detail), "invalid_request_error",
                      {404: "not_found", 413: "request_too_large"}.get(e.status_code))

    @app.exception_handler(Exception)
    async def internal(request: Request, e: Exception):
        log.exception("internal error")
        return _error(500, f"internal error: {type(e).__name__}: {e}", "server_error", "internal_error")

    @app.api_route("/health", methods=["GET", "HEAD"])  # (HEAD: a load balancer's probe, the same status)
    async def health(request: Request):
        if request.state.owner is None:  # no key on a server with keys: up, and nothing more
            return {"status": "ok"}
        # A key sees its own sessions' counts; the operator (or anyone, on an open server), everything
        return await client.call("health", {"full": request.state.operator}, request.state.owner)

    def operator_only(request: Request, what: str = "the server's metrics are") -> None:
        if not request.state.operator:
            raise ServeError(403, f"{what} its operator's: call with a key of FLOE_OPERATOR_KEYS or "
                                  "--operator-key-file", code="operator_only")

    def _model(name: str) -> dict:
        known = app.state.models or (app.state.model_id, *app.state.aliases)
        if name not in known and "*" not in known:
            shown = repr(name[:64]) + ("…" if len(name) > 64 else "")  # a 10 KB name is not echoed whole
            raise ServeError(404, f"the model {shown} does not exist; this server serves "
                                  f"{', '.join(map(repr, known))}", code="model_not_found", param="model")
        return {"id": name, "object": "model", "created": int(app.state.started), "owned_by": "floe"}

    @app.get("/v1/models")
    async def models(request: Request):
        if app.state.models:  # several: each with whether it is loaded now (a key: its own sessions)
            return {"object": "list", "data": await described_models(request)}
        return {"object": "list", "data": [_model(name) for name in (app.state.model_id, *app.state.aliases)
                                           if name != "*"]}

    async def described_models(request: Request) -> list[dict]:
        return await client.call("models", {"full": request.state.operator}, request.state.owner)

    @app.get("/v1/models/{name:path}")
    async def model(name: str, request: Request):
        # The whole path's: Starlette's match ends before a final newline ("tiny\n" matched "tiny")
        name = request.scope["path"].partition("/v1/models/")[2]
        described = _model(name)
        if app.state.models:
            return next(m for m in await described_models(request) if m["id"] == name)
        return described

    @app.post("/v1/models/{name}/load")
    async def load_model(name: str, request: Request):
        return await model_call("load", name, request)

    @app.post("/v1/models/{name}/unload")
    async def unload_model(name: str, request: Request):
        return await model_call("unload", name, request)

    async def model_call(call: str, name: str, request: Request):
        operator_only(request, f"a model's {call} is")  # (a model loaded or unloaded is every owner's)
        if not app.state.models:
            raise ServeError(400, "this server runs one model, loaded at its start (several: floe serve "
                                  "--model NAME=PATH ...)", code="one_model")
        _model(name)
        return await client.call(call, name)

    @app.get("/metrics")
    async def prometheus(request: Request):
        operator_only(request)  # (every owner's requests, sessions and tokens, summed)
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

    @app.post("/v1/sessions/{sid}/fork", summary="Fork a session", description=FORK_DESCRIPTION)
    async def fork(sid: str, request: Request, body: ForkRequest | None = None):
        new_id = None if body is None else body.id
        return await client.call("fork", {"id": sid, "new_id": new_id}, request.state.owner)

    @app.delete("/v1/sessions/{sid}")
    async def delete(sid: str, request: Request):
        return await client.call("delete", sid, request.state.owner)

    @app.get("/v1/sessions/{sid}/snapshot")
    async def export(sid: str, request: Request):
        chunks = await client.export(sid, request.state.owner)  # every byte checked before the first
        return StreamingResponse(chunks, media_type="application/octet-stream",
                                 headers={"X-Floe-Session": sid,
                                          "Content-Disposition": f'attachment; filename="{sid}.safetensors"'})

    @app.put("/v1/sessions/{sid}/snapshot")
    async def import_(sid: str, request: Request):
        try:
            return await client.upload(sid, request.state.owner, request.stream())
        except ClientDisconnect:
            return Response(status_code=499)  # nobody reads it; nothing was stored

    service = ChatService(client, _model, lambda: app.state.max_text_bytes, lambda: bool(app.state.models),
                          lambda: app.state.context)

    async def counted(answer) -> Response:
        """A chat service call's response, counted by its status (a client that left: 499)."""
        try:
            response = await answer
        except ServeError as e:
            requests.labels(str(e.status)).inc()
            raise
        except ClientGone:
            requests.labels("499").inc()
            return Response(status_code=499)  # nobody reads it
        requests.labels(str(response.status_code)).inc()
        return response

    def few_enough(messages: list) -> None:
        """More messages than the context has tokens: refused (and counted) before pydantic makes a model
        of each. 200,000 empty messages (6.6 MB) held the front's event loop ~1 s to be refused: json.loads
        0.1 s, pydantic the rest."""
        try:
            check_text(messages, None, app.state.context)  # (their count only)
        except ServeError as e:
            refused(CHAT_PATHS[0], e.status)
            raise

    async def few_enough_messages(request: Request) -> None:
        """few_enough, as the chat route's dependency (FastAPI validates the body after it)."""
        parsed = getattr(request, "_json", None)  # FastAPI's parse of the body (Starlette keeps it there)
        if isinstance(parsed, dict) and isinstance(parsed.get("messages"), list):
            few_enough(parsed["messages"])

    @app.post("/v1/chat/completions", dependencies=[Depends(few_enough_messages)])
    async def chat(body: ChatRequest, request: Request):
        return await counted(service.chat(body, request))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await counted(service.complete(body, request))

    # A valid chat API request's short way past FastAPI's routing and handler (floe.server.fastpath), the
    # innermost middleware: inside the API keys and the body limit, as the routes are
    chat_path, completions_path = CHAT_PATHS
    routes = {chat_path: Route(ChatRequest, lambda body, request: counted(service.chat(body, request)),
                               few_enough),
              completions_path: Route(CompletionRequest,
                                      lambda body, request: counted(service.complete(body, request)))}
    app.user_middleware.append(Middleware(FastPath, routes=routes, error=lambda e: _error(
        e.status, e.message, e.type, e.code, e.param, e.retry_after)))
    return app


def create_app(engine: Engine, *, snapshots: Path | str | SnapshotStore, model_id: str,
               idle_seconds: float = 300.0, guest: str | None = None, batching: bool | None = None,
               aliases: tuple[str, ...] = (), keys: tuple[str, ...] = (), cors_origins: tuple[str, ...] = (),
               max_anonymous: int = 64, max_request_bytes: int = MAX_REQUEST_BYTES,
               operator_keys: tuple[str, ...] = (), prompt_hints: bool = True, **core_options) -> FastAPI:
    """The front and the engine core of `engine` in this process (the core's socket in a private
    temporary folder): what `floe serve` runs in two, for tests and embedding. Sessions freeze into
    `snapshots` (a folder, a URL, or a SnapshotStore), which a restart reads back; the app's shutdown
    freezes the live ones. core_options: ServeCore's (kv_dtype, persist_anonymous, ...)."""
    from floe.server.core import ServeCore

    core = ServeCore(engine, snapshots=snapshots, model_id=model_id, idle_seconds=idle_seconds,
                     guest=guest, batching=batching, aliases=aliases, max_anonymous=max_anonymous,
                     **core_options)
    return app_of(core, keys=keys, cors_origins=cors_origins, max_request_bytes=max_request_bytes,
                  operator_keys=operator_keys, prompt_hints=prompt_hints)


def app_of(core: ServeCore | ModelRouter, *, keys: tuple[str, ...] = (), cors_origins: tuple[str, ...] = (),
           max_request_bytes: int = MAX_REQUEST_BYTES, operator_keys: tuple[str, ...] = (),
           prompt_hints: bool = True) -> FastAPI:
    """The front and an engine core (one model's, or several models' router: floe.server.models) in
    this process; the app's shutdown closes the core (create_app's)."""
    from floe.server.core_socket import CoreServer

    core.keep_spares()
    server = CoreServer(core)  # its socket in a private temporary folder

    def shutdown() -> None:
        server.close()
        core.close()

    app = create_front(server.path, keys=api_keys(keys, {}), cors_origins=cors_origins, on_shutdown=shutdown,
                       max_request_bytes=max_request_bytes, prompt_hints=prompt_hints,
                       operator_keys=api_keys(operator_keys, {}, variable=OPERATOR_KEYS_ENV))
    app.state.core = core
    return app


def main(argv: list[str] | None = None) -> None:
    """The HTTP front of `floe serve`, started by it: serves until its engine core goes away."""
    import uvicorn

    from floe.server.deadlines import uvicorn_config
    from floe.server.heap import settle_heap

    ap = argparse.ArgumentParser(prog="python -m floe.server.app", description=main.__doc__)
    ap.add_argument("--socket", required=True, help="the engine core's Unix socket")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--fd", type=int, default=None, help="serve on this listening socket (floe serve's, "
                    "shared by its fronts) instead of binding --host and --port")
    ap.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    ap.add_argument("--cors-origin", action="append", default=[], help="a web origin that may call it")
    ap.add_argument("--max-request-bytes", type=int, default=MAX_REQUEST_BYTES)
    ap.add_argument("--no-prompt-hints", dest="prompt_hints", action="store_false")
    args = ap.parse_args(argv)  # its API keys: FLOE_API_KEYS (never in argv, which `ps` shows)
    logging.basicConfig(level=args.log_level.upper(), format="floe serve (http): %(message)s")
    server: uvicorn.Server | None = None
    lost_core = threading.Event()

    def lost() -> None:
        lost_core.set()
        server.should_exit = True

    app = create_front(args.socket, keys=api_keys(), cors_origins=tuple(args.cors_origin), on_lost=lost,
                       max_request_bytes=args.max_request_bytes, prompt_hints=args.prompt_hints,
                       operator_keys=api_keys(variable=OPERATOR_KEYS_ENV))
    server = uvicorn.Server(uvicorn_config(app, host=args.host, port=args.port, log_level=args.log_level))
    settle_heap()  # (FastAPI's and pydantic's start-up objects out of the collector's passes, as the core's)
    server.run(sockets=None if args.fd is None else [socket.socket(fileno=args.fd)])
    if lost_core.is_set():  # the core went away: a failure (a stop ends the front first), never status 0
        log.error("the engine core's connection ended; the HTTP front exits with status %d", EXIT_CORE_LOST)
        sys.exit(EXIT_CORE_LOST)


if __name__ == "__main__":
    main()
