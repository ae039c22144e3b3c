"""`floe serve`: an OpenAI-compatible HTTP API whose conversations are stateful Wasm actors.

Routes: POST /v1/chat/completions (plain and SSE streaming), GET /v1/models, GET /health,
GET /metrics (Prometheus), GET /v1/sessions, POST /v1/sessions/{id}/freeze, POST
/v1/sessions/{id}/thaw, DELETE /v1/sessions/{id}. A request names its session with the
`X-Floe-Session` header or a `session_id` field in the body; every response says which session it
used (the same header, and `session_id` in the body). Errors are OpenAI-shaped JSON:
{"error": {"message", "type", "param", "code"}}, 4xx for bad requests.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from floe.engine import Engine, SamplingParams
from floe.errors import FloeError, InvalidSamplingParams
from floe.server.sessions import ROLES, SessionError, SessionStore
from floe.wasm import GuestError

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


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param


def _error(status: int, message: str, type_: str, code: str | None = None, param: str | None = None):
    # A 503 is a busy server: say when to come back (clients such as openai's honour Retry-After).
    headers = {"Retry-After": "1"} if status == 503 else None
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": code}},
                        status_code=status, headers=headers)


class Metrics:
    def __init__(self, store: SessionStore) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("floe_requests", "HTTP requests to the chat API", ["status"], registry=r)
        self.prompt_tokens = Counter("floe_prompt_tokens", "Prompt tokens of chat requests", registry=r)
        self.prefilled_tokens = Counter("floe_prefilled_tokens",
                                        "Prompt tokens actually prefilled (the rest was cached)", registry=r)
        self.generated_tokens = Counter("floe_generated_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("floe_ttft_seconds", "Time to first token", registry=r,
                              buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
        self.decode_rate = Histogram("floe_decode_tokens_per_second", "Decode speed of a reply",
                                     registry=r, buckets=(5, 10, 20, 50, 100, 200, 500, 1000, 2000))
        self.thaw = Histogram("floe_thaw_seconds", "Thawing a frozen session", registry=r,
                              buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5))
        self.freeze = Histogram("floe_freeze_seconds", "Freezing a session", registry=r,
                                buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5))
        self.batch_rows = Histogram("floe_decode_batch_rows", "Sessions advanced by one batched decode "
                                    "forward", registry=r, buckets=(1, 2, 4, 8, 16, 32, 64))
        turns = Gauge("floe_engine_loop_turns", "Turns in the engine loop: stepping, or arrived and "
                      "waiting for the next step", ["state"], registry=r)
        turns.labels("active").set_function(lambda: store.loop.stats()["active"] if store.loop else 0)
        turns.labels("waiting").set_function(lambda: store.loop.stats()["waiting"] if store.loop else 0)
        sessions = Gauge("floe_sessions", "Sessions by state", ["state"], registry=r)
        sessions.labels("live").set_function(lambda: store.counts()["live"])
        sessions.labels("frozen").set_function(lambda: store.counts()["frozen"])


def _text(m: ChatMessage) -> str:
    if m.content is None:
        return ""
    if isinstance(m.content, str):
        return m.content
    parts = []
    for part in m.content:
        if part.get("type") != "text":
            raise APIError(400, f"content part of type {part.get('type')!r} is not supported (text only)",
                           param="messages")
        parts.append(str(part.get("text", "")))
    return "".join(parts)


BUSY_STREAMS = 8  # more streams than this: a stream's text is handed over in intervals, STREAM_INTERVAL_S
STREAM_INTERVAL_S = 0.02  # at BUSY_STREAMS streams, growing with their number up to 0.1 s


def create_app(engine: Engine, *, snapshots: Path, model_id: str, idle_seconds: float = 300.0,
               guest: str | None = None, batching: bool | None = None) -> FastAPI:
    """The ASGI app serving `engine`; sessions freeze into `snapshots`, which a restart reads back.

    batching: concurrent sessions' decode steps run as one batched forward (default: where the engine
    has one, i.e. CUDA graphs of the fused step); off, they take turns.
    """
    if batching and not engine.batched_decode:
        raise FloeError("decode batching needs the CUDA engine with graphs and fused kernels and more "
                        "than one slot; on the CPU, sessions take turns")
    from floe.actor import DecodeScheduler, EngineLoop

    batched = engine.batched_decode if batching is None else batching
    # ABI v2 guests (floe's own) are stepped by one engine loop; v1 guests batch through the scheduler.
    scheduler = DecodeScheduler(engine) if batched else None
    loop = EngineLoop(engine, batch=batched)
    store = SessionStore(engine, snapshots, idle_seconds=idle_seconds, guest=guest, scheduler=scheduler,
                         loop=loop)
    metrics = Metrics(store)
    loop.on_step = metrics.batch_rows.observe
    if scheduler is not None:
        scheduler.on_batch = metrics.batch_rows.observe
    store.on_thaw, store.on_freeze = metrics.thaw.observe, metrics.freeze.observe
    store.load_folder()
    store.warm_up()
    started = time.time()
    streams = [0]  # streamed replies being generated

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        # Every running request holds a worker thread for its whole reply (the guest drives the
        # engine synchronously); asyncio's default pool has cpu_count + 4 of them (6 on 2 cores).
        workers = engine.cache.n_slots + 8
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(workers, "floe-session"))
        async def evict_loop():
            while True:
                await asyncio.sleep(max(0.05, min(1.0, idle_seconds / 4)))
                try:
                    frozen = await asyncio.to_thread(store.evict_idle)
                    if frozen:
                        log.info("froze idle sessions %s", frozen)
                except Exception:  # noqa: BLE001 - keep evicting; the error is logged
                    log.exception("idle eviction failed")

        task = asyncio.create_task(evict_loop())
        try:
            yield
        finally:
            task.cancel()
            await asyncio.to_thread(store.close)

    app = FastAPI(title="floe", lifespan=lifespan)
    app.state.store, app.state.metrics = store, metrics
    app.state.batching = scheduler is not None

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
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
    async def health():
        return {"status": "ok", "model": model_id, "device": str(engine.device),
                "decode_batching": scheduler is not None,
                "uptime_s": time.time() - started, "sessions": store.counts(),
                "skipped_snapshots": store.skipped}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_id, "object": "model", "created": int(started),
                                            "owned_by": "floe"}]}

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/sessions")
    async def sessions():
        with store.lock:
            items = list(store.sessions.values())
        return {"object": "list", "data": [s.describe() for s in items]}

    async def session_call(fn, sid: str):
        try:
            return await asyncio.to_thread(fn, sid)
        except SessionError as e:
            raise _failure(e, sid) from None

    @app.post("/v1/sessions/{sid}/freeze")
    async def freeze(sid: str):
        return await session_call(store.freeze, sid)

    @app.post("/v1/sessions/{sid}/thaw")
    async def thaw(sid: str):
        return await session_call(store.thaw, sid)

    @app.delete("/v1/sessions/{sid}")
    async def delete(sid: str):
        await session_call(store.delete, sid)
        return {"id": sid, "object": "session", "deleted": True}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        try:
            response = await _chat(body, request)
        except APIError as e:
            metrics.requests.labels(str(e.status)).inc()
            raise
        metrics.requests.labels("200").inc()
        return response

    def _validate(body: ChatRequest) -> tuple[list[dict], int, SamplingParams]:
        if body.model != model_id:
            raise APIError(404, f"the model {body.model!r} does not exist; this server serves {model_id!r}",
                           code="model_not_found", param="model")
        if body.n != 1:
            raise APIError(400, "only n=1 is supported", param="n")
        if body.stop:
            raise APIError(400, "stop sequences are not supported", param="stop")
        messages = []
        for m in body.messages:
            if m.role not in ROLES:
                raise APIError(400, f"message role {m.role!r} is not supported ({', '.join(ROLES)})",
                               param="messages")
            messages.append({"role": m.role, "content": _text(m)})
        if messages[-1]["role"] != "user":
            raise APIError(400, "the last message must be from the user", param="messages")
        try:
            params = SamplingParams(body.temperature, body.top_k, body.top_p, body.seed or 0)
        except InvalidSamplingParams as e:
            raise APIError(400, str(e), param="temperature") from None
        prompt = len(engine.tokenizer.encode_chat(messages))
        room = engine.max_seq_len - prompt
        if room < 1:
            raise APIError(400, f"the conversation is {prompt} tokens; this server's context holds "
                           f"{engine.max_seq_len}", code="context_length_exceeded", param="messages")
        max_tokens = body.max_completion_tokens or body.max_tokens or min(room, 1024)
        if max_tokens > room:
            raise APIError(400, f"max_tokens {max_tokens} + the conversation's {prompt} tokens exceed this "
                           f"server's context of {engine.max_seq_len}", code="context_length_exceeded",
                           param="max_tokens")
        return messages, max_tokens, params

    async def _chat(body: ChatRequest, request: Request):
        messages, max_tokens, params = _validate(body)
        sid = request.headers.get("x-floe-session") or body.session_id
        try:
            session, history = await asyncio.to_thread(store.acquire, sid, messages, body.seed or 0)
        except SessionError as e:
            raise _failure(e, sid) from None
        cid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        headers = {"X-Floe-Session": session.id}
        base = {"id": cid, "created": created, "model": model_id, "session_id": session.id}

        def finish(reply) -> tuple[str, dict]:
            s = reply.stats
            generated = s.generated_tokens
            metrics.prompt_tokens.inc(s.context_tokens)
            metrics.prefilled_tokens.inc(s.first_forward_tokens)
            metrics.generated_tokens.inc(generated)
            if s.ttft_s:
                metrics.ttft.observe(s.ttft_s)
            if s.decode_tokens_per_s:
                metrics.decode_rate.observe(s.decode_tokens_per_s)
            usage = {"prompt_tokens": s.context_tokens, "completion_tokens": generated,
                     "total_tokens": s.context_tokens + generated,
                     "prompt_tokens_details": {"cached_tokens": s.context_tokens - s.first_forward_tokens},
                     "prefilled_tokens": s.first_forward_tokens}
            return ("length" if generated >= max_tokens else "stop"), usage

        def run(on_text=None, should_stop=lambda: False):
            try:
                return store.run(session, history, messages[-1]["content"], max_tokens=max_tokens,
                                 params=params, on_text=on_text, should_stop=should_stop)
            finally:
                store.release(session)

        if not body.stream:
            try:
                reply = await asyncio.to_thread(run)
            except (GuestError, FloeError) as e:
                raise _failure(e, session.id) from None
            reason, usage = finish(reply)
            return JSONResponse(base | {
                "object": "chat.completion",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": reply.text},
                             "finish_reason": reason, "logprobs": None}],
                "usage": usage}, headers=headers)

        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        gone = False

        def chunk(delta: dict, reason: str | None = None, usage: dict | None = None) -> str:
            payload = base | {"object": "chat.completion.chunk",
                              "choices": [{"index": 0, "delta": delta, "finish_reason": reason,
                                           "logprobs": None}] if usage is None else []}
            if usage is not None:
                payload["usage"] = usage
            return f"data: {json.dumps(payload)}\n\n"

        # Text from the engine loop's thread is handed over in batches: a piece joins the pending
        # ones, and the event loop is woken only if no wake-up is already on its way, so a busy
        # server sends several tokens a chunk instead of falling behind one wake-up per token. With
        # more than BUSY_STREAMS streams, a stream's hand-overs after its first wait an interval (as
        # vLLM's stream interval; 20 ms at 8 streams, 0.1 s from 40): each chunk's JSON and write cost
        # the event loop's share of the GIL, which the engine loop's thread needs for the next step.
        pending: list[str] = []  # appended by the engine loop's thread, taken from the front here
        wake = threading.Lock()  # held while a wake-up is on its way to the event loop
        handed = False  # the first piece went out (it never waits: time to first token)

        def schedule() -> None:
            nonlocal handed
            if handed and streams[0] > BUSY_STREAMS:  # the busier, the longer: up to 0.1 s a chunk
                loop.call_later(min(0.1, STREAM_INTERVAL_S * streams[0] / BUSY_STREAMS), hand_over)
            else:
                handed = True
                hand_over()

        def take_pending() -> None:
            n = len(pending)
            if n:
                text = "".join(pending[:n])
                del pending[:n]
                queue.put_nowait(("text", text))

        def hand_over() -> None:
            wake.release()  # first: a piece appended from here on schedules its own wake-up
            take_pending()

        def on_text(piece: str) -> None:
            pending.append(piece)
            if wake.acquire(blocking=False):
                loop.call_soon_threadsafe(schedule)

        async def work():
            streams[0] += 1
            try:
                reply = await asyncio.to_thread(run, on_text, lambda: gone)
                take_pending()  # no piece comes after the reply: none is left behind
                queue.put_nowait(("done", finish(reply)))  # counted even if the client has left
            except BaseException as e:  # noqa: BLE001 - handed to the stream
                queue.put_nowait(("error", e))
            finally:
                streams[0] -= 1

        # Started now, not when the response body is first pulled: the session's lock is released
        # by `run` whatever the client does.
        task = asyncio.create_task(work())

        async def events():
            nonlocal gone
            try:
                yield chunk({"role": "assistant", "content": ""})
                while True:
                    kind, value = await queue.get()
                    if kind == "text":
                        yield chunk({"content": value})
                    elif kind == "error":
                        e = _failure(value, session.id)
                        error = {"message": e.message, "type": e.type, "code": e.code}
                        yield f"data: {json.dumps({'error': error})}\n\n"
                        break
                    else:
                        reason, usage = value
                        yield chunk({}, reason)
                        if body.stream_options and body.stream_options.include_usage:
                            yield chunk({}, usage=usage)
                        break
                yield "data: [DONE]\n\n"
            finally:
                gone = True  # the client left (or we are done): the guest stops at its next token
                # Shielded: a client that hangs up cancels this generator, not the worker, which
                # still records the (shortened) reply and releases the session.
                await asyncio.shield(task)

        return StreamingResponse(events(), media_type="text/event-stream", headers=headers)

    return app


def _failure(e: BaseException, sid: str) -> APIError:
    if isinstance(e, SessionError):
        return APIError(e.status, str(e), "server_error" if e.status >= 500 else "invalid_request_error",
                        e.code)
    if isinstance(e, GuestError):
        return APIError(500, f"session {sid!r}: the guest failed on this message ({type(e).__name__}: {e}); "
                             "the session was returned to its last snapshot", "server_error", "guest_error")
    return APIError(500, f"session {sid!r}: {e}", "server_error", "engine_error")
