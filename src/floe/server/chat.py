"""The chat service of `floe serve`'s HTTP front: OpenAI chat completions and text completions checked,
handed to the engine core (floe.server.client), and answered as one JSON body or as one stream of
server-sent events (the one streaming bridge: `ChatService.stream`).

/v1/completions continues its prompt as raw text, as OpenAI's and llama.cpp's do: no chat template,
no session; the core runs it on a one-shot actor of the complete guest (floe.server.completions;
docs/SERVER.md, "Text completions").
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from json.encoder import encode_basestring_ascii as encode_string
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from floe.model.template_vars import TemplateKwargsError, check_template_kwargs
from floe.server import structured
from floe.server.client import CoreClient
from floe.server.hints import FrontHints
from floe.server.limits import check_text
from floe.server.protocol import ROLES, ServeError
from floe.server.stops import checked_stops
from floe.server.structured import Constraint, ToolStream


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None


class StreamOptions(BaseModel):
    include_usage: bool = Field(default=False, strict=True)  # ("yes": a 400, as the other flags)


class Sampling(BaseModel):
    """What both kinds of request share."""

    model_config = ConfigDict(extra="allow")  # OpenAI clients send more than floe uses
    model: str
    # Strict: "5" or 5.0 for a count and "yes" for a flag are a client's mistake, a 400 (as OpenAI's).
    max_tokens: int | None = Field(default=None, ge=1, strict=True)
    # Strict: true for a number is a mistake (lax, pydantic took it as 1.0); an integer is still a number.
    temperature: float = Field(default=1.0, strict=True)
    top_p: float = Field(default=1.0, strict=True)
    top_k: int = Field(default=0, strict=True)
    seed: int | None = Field(default=None, strict=True)
    n: int = Field(default=1, strict=True)
    stream: bool = Field(default=False, strict=True)
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    session_id: str | None = None
    keep_alive: float | str | None = None  # Ollama's: how long its model stays loaded idle (server.models)


class ChatRequest(Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, strict=True)
    response_format: dict[str, Any] | None = None  # these four: floe.server.structured
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = Field(default=None, strict=True)  # None: true, as OpenAI's default
    chat_template_kwargs: dict[str, Any] | None = None  # the chat template's variables (vLLM's field)


class CompletionRequest(Sampling):
    prompt: str | list[str]


# OpenAI fields floe does not implement: a request that sets one to anything but these values gets a
# 400 naming it rather than a reply that silently ignored it (logprobs and penalties: not yet). A
# completion takes no tools or response_format; a chat's are the grammar guest's (floe.server.structured).
UNSUPPORTED = {"functions": (None, []), "function_call": (None, "none"), "logprobs": (None, False),
               "top_logprobs": (None, 0), "presence_penalty": (None, 0, 0.0),
               "frequency_penalty": (None, 0, 0.0), "logit_bias": (None, {}), "prediction": (None,),
               "audio": (None,), "modalities": (None, ["text"]), "reasoning_effort": (None,)}
STRUCTURED = {"tools": (None, []), "tool_choice": (None, "none"), "parallel_tool_calls": (None,),
              "response_format": (None, {"type": "text"})}
COMPLETION_UNSUPPORTED = UNSUPPORTED | STRUCTURED | {"logprobs": (None, 0), "echo": (None, False),
                                                     "suffix": (None, ""), "best_of": (None, 1),
                                                     "chat_template_kwargs": (None, {}),
                                                     # a chat's (a completion's length is max_tokens)
                                                     "max_completion_tokens": (None,), "messages": (None,)}

BUSY_STREAMS = 8  # more streams than this: a stream's text is handed over in intervals, STREAM_INTERVAL_S
STREAM_INTERVAL_S = 0.02  # at BUSY_STREAMS streams, growing with their number up to 0.1 s


class ClientGone(Exception):
    """The client closed its connection before its reply: nobody to answer."""


def _text(i: int, m: ChatMessage) -> str:
    if m.content is None:
        return ""
    if isinstance(m.content, str):
        return _unicode(m.content, f"messages[{i}].content")
    parts = []
    for part in m.content:
        if part.get("type") != "text" or not isinstance(part.get("text", ""), str):
            raise ServeError(400, f"content part of type {str(part.get('type'))[:40]!r} is not supported "
                             "(text only)", param="messages")
        parts.append(part.get("text", ""))
    return _unicode("".join(parts), f"messages[{i}].content")


def _conversation(given: list[ChatMessage]) -> list[dict]:
    """The request's messages as the text messages the guests hold: developer as system, an assistant's
    tool calls as their text (structured.call_text), a tool's result as a user message naming the
    function whose call it answers."""
    messages, called = [], {}  # called: function names by call id, from earlier assistant messages
    for i, m in enumerate(given):
        role = "system" if m.role == "developer" else m.role  # OpenAI's newer name for it
        extra = m.model_extra or {}
        if role == "tool":
            call = extra.get("tool_call_id")
            name = called.get(call) if isinstance(call, str) else None
            if name is None:
                raise ServeError(400, f"messages[{i}]: a tool message answers a tool call of an earlier "
                                      "assistant message (its tool_call_id)", param="messages")
            messages.append({"role": "user", "content": structured.tool_result_text(name, _text(i, m))})
            continue
        if role not in ROLES:
            raise ServeError(400, f"message role {m.role[:40]!r} is not supported ({', '.join(ROLES)}, "
                                  "developer, tool)", param="messages")
        if m.content is None and role != "assistant":  # only a reply that made tool calls may have none
            raise ServeError(400, f"messages[{i}].content: a {role} message needs its text",
                             param=f"messages[{i}].content")
        content = _text(i, m)
        if role == "assistant" and extra.get("tool_calls"):
            calls, names = structured.assistant_calls_text(i, extra["tool_calls"])
            called |= names
            content = "\n".join(filter(None, (content, calls)))
        messages.append({"role": role, "content": content})
    return messages


def _unicode(text: str, where: str) -> str:
    try:
        text.encode()
    except UnicodeEncodeError as e:
        raise ServeError(400, f"{where} is not valid Unicode text ({e.reason} at {e.start})",
                         param=where.split("[")[0]) from None
    return text


def _session_named(request: Request, in_body: str | None) -> str | None:
    """The session id a request names by its X-Floe-Session header (as UTF-8: Starlette reads a header
    as latin-1, which garbled a non-ASCII id in the 400 saying it is not one) or its body's
    session_id (an empty header: none, as before); a 400 where they name two (the header repeated with
    different values, or header and body differing), which the first or the header silently won."""
    sent = list(dict.fromkeys(v for k, v in request.scope["headers"] if k == b"x-floe-session" and v))
    if len(sent) > 1:
        raise ServeError(400, f"X-Floe-Session was sent {len(sent)} times with different values "
                              f"({', '.join(repr(_utf8(v)[:200]) for v in sent[:4])}): send one session id",
                         code="invalid_value", param="session_id")
    if not sent:
        return in_body
    sid = _utf8(sent[0])
    if in_body is not None and in_body != sid:
        raise ServeError(400, f"X-Floe-Session {sid[:200]!r} and the body's session_id {in_body[:200]!r} "
                              "name different sessions: send one, or the same in both",
                         code="invalid_value", param="session_id")
    return sid


def _utf8(raw: bytes) -> str:
    """A header's value as UTF-8 (bytes that are not: as \\x escapes, which no session id has)."""
    return raw.decode("utf-8", "backslashreplace")


def _refuse_unsupported(body: Sampling, unsupported: dict) -> None:
    for name, value in (body.model_extra or {}).items():
        if name in unsupported and value not in unsupported[name]:
            raise ServeError(400, f"{name} is not supported by this server (it would be ignored)",
                             code="unsupported_parameter", param=name)
    if body.n != 1:
        raise ServeError(400, "only n=1 is supported", param="n")


class Shape:
    """How a chat completion is written: a whole body, and a stream's chunks."""

    object, chunk_object, prefix = "chat.completion", "chat.completion.chunk", "chatcmpl"

    def choice(self, text: str, reason: str) -> dict:
        return {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason,
                "logprobs": None}

    def opening(self) -> dict | None:
        return self.delta({"role": "assistant", "content": ""})

    def pieces(self, text: str) -> list[dict]:
        return [self.delta({"content": text})]

    def ending(self, reason: str) -> list[dict]:
        return [self.delta({}, reason)]

    @staticmethod
    def delta(delta: dict, reason: str | None = None) -> dict:
        return {"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}


class CompletionShape(Shape):
    """How a text completion is written (/v1/completions)."""

    object, chunk_object, prefix = "text_completion", "text_completion", "cmpl"

    def choice(self, text: str, reason: str) -> dict:
        return {"index": 0, "text": text, "finish_reason": reason, "logprobs": None}

    def opening(self) -> dict | None:
        return None

    def pieces(self, text: str) -> list[dict]:
        return [{"index": 0, "text": text, "finish_reason": None, "logprobs": None}]

    def ending(self, reason: str) -> list[dict]:
        return [{"index": 0, "text": "", "finish_reason": reason, "logprobs": None}]


class ToolShape(Shape):
    """How a reply to a request with tools is written: its calls as `tool_calls` (streamed as OpenAI's
    deltas: each call's index, id and name, then its arguments in pieces), a text answer as content."""

    def __init__(self) -> None:
        self.stream = ToolStream()

    def choice(self, text: str, reason: str) -> dict:
        read = structured.outcome(Constraint("tools"), text)
        message = {"role": "assistant", "content": read.content}
        if read.calls:
            message["tool_calls"] = structured.tool_calls(read.calls)
        return {"index": 0, "message": message, "finish_reason": reason, "logprobs": None}

    def pieces(self, text: str) -> list[dict]:
        return [self.delta(d) for d in self.stream.feed(text)]

    def ending(self, reason: str) -> list[dict]:
        return [*(self.delta(d) for d in self.stream.end()), self.delta({}, reason)]


class ChatService:
    """Answers chat and text completion requests through the engine core.

    check_model(name): raises the 404 for a model name this server does not serve. max_text_bytes(): the
    most bytes of text a conversation may have, context(): the most messages (its tokens)
    (floe.server.limits.check_text; None: no bound known).
    several(): whether the server has several models (floe.server.models): a reply's token ids are
    made into text with its model's table (CoreClient.table). hints: the prompt hints it sends with
    plain chats (floe.server.hints; loaded at the front's start).
    """

    def __init__(self, client: CoreClient, check_model: Callable[[str], Any],
                 max_text_bytes: Callable[[], int | None] = lambda: None,
                 several: Callable[[], bool] = lambda: False,
                 context: Callable[[], int | None] = lambda: None) -> None:
        self.client, self.check_model, self.max_text_bytes = client, check_model, max_text_bytes
        self.context = context
        self.several = several
        self.hints = FrontHints()

    async def chat(self, body: ChatRequest, request: Request) -> Response:
        self.check_model(body.model)
        _refuse_unsupported(body, UNSUPPORTED)
        constraint = structured.constraint(body.response_format, body.tools, body.tool_choice,
                                           body.parallel_tool_calls)
        if constraint is not None and body.stop:
            raise ServeError(400, "stop cannot end a structured reply (it would cut the JSON value)",
                             code="unsupported_parameter", param="stop")
        messages = _conversation(body.messages)
        if messages[-1]["role"] != "user":
            raise ServeError(400, "the last message must be from the user (or a tool)", param="messages")
        asked = {"messages": messages}
        if body.chat_template_kwargs:
            try:
                asked["chat_template_kwargs"] = check_template_kwargs(body.chat_template_kwargs)
            except TemplateKwargsError as e:
                raise ServeError(400, f"chat_template_kwargs: {e}", param="chat_template_kwargs") from None
            structured.check_nesting(body.chat_template_kwargs, "chat_template_kwargs")  # (a lone surrogate)
        shape = Shape() if constraint is None or constraint.mode == "json" else ToolShape()
        return await self._answer(body, asked, body.max_completion_tokens or body.max_tokens, shape, request,
                                  constraint)

    async def complete(self, body: CompletionRequest, request: Request) -> Response:
        self.check_model(body.model)
        _refuse_unsupported(body, COMPLETION_UNSUPPORTED)
        prompt = body.prompt
        if isinstance(prompt, list):
            if len(prompt) != 1:
                raise ServeError(400, "prompt: one string (a batch of prompts is not supported)",
                                 param="prompt")
            prompt = prompt[0]
        if body.session_id is not None or request.headers.get("x-floe-session") is not None:
            raise ServeError(400, "a text completion has no session (it is stateless): send no session_id "
                                  "or X-Floe-Session", code="unsupported_parameter", param="session_id")
        prompt = _unicode(prompt, "prompt")
        check_text([{"role": "user", "content": prompt}], self.max_text_bytes())
        return await self._answer(body, {"prompt": prompt}, body.max_tokens, CompletionShape(), request)

    async def _answer(self, body: Sampling, asked: dict, max_tokens: int | None, shape: Shape,
                      request: Request, constraint: Constraint | None = None) -> Response:
        """asked: {"messages": the conversation} for a chat (and its "chat_template_kwargs", checked, if
        any), {"prompt": text} for a text completion."""
        core_request = asked | {
            "max_tokens": max_tokens, "temperature": body.temperature,
            "top_p": body.top_p, "top_k": body.top_k, "seed": body.seed, "stream": body.stream,
            "session_id": _session_named(request, body.session_id),
            "owner": request.state.owner, "stop": list(checked_stops(body.stop)), "model": body.model}
        if body.keep_alive is not None:
            core_request["keep_alive"] = body.keep_alive
        if constraint is not None:
            core_request["structured"] = constraint.wire()
        if "messages" in asked:
            check_text(asked["messages"], self.max_text_bytes(), self.context())
            hint = None if constraint is not None else await self.hints.make(
                asked["messages"], asked.get("chat_template_kwargs"))
            if hint is not None:
                core_request["hint"] = hint
        if self.several():  # (its model loads here if it is not loaded: the request waits for it anyway)
            await self.client.table(body.model)
            core_request["table"] = body.model
        rid, queue, ended = self.client.chat(core_request)
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            kind, value = await _next(queue, gone)  # its session, or why it has none
            if kind == "error":
                raise ServeError.from_payload(value)
            sid = value  # (None: a text completion, which has no session)
            base = {"id": f"{shape.prefix}-{uuid.uuid4().hex[:24]}", "created": int(time.time()),
                    "model": body.model}  # the name it was asked by (an alias too)
            headers = {} if sid is None else {"X-Floe-Session": sid}
            if sid is not None:
                base["session_id"] = sid
            if body.stream:  # the stream goes on watching for its client's departure
                include_usage = bool(body.stream_options and body.stream_options.include_usage)
                events = self.stream(rid, queue, ended, base, shape, include_usage)
                response, gone = EventStream(events, headers, gone), None
                return response
            kind, value = await _next(queue, gone)
            if kind == "error":
                raise ServeError.from_payload(value)
            return JSONResponse(base | {"object": shape.object,
                                        "choices": [shape.choice(value["text"], value["finish_reason"])],
                                        "usage": value["usage"]}, headers=headers)
        except (ClientGone, asyncio.CancelledError):
            self.client.cancel(rid)  # its row stops at its next token; the session keeps nothing of it
            raise
        finally:
            if gone is not None:
                gone.cancel()

    async def stream(self, rid: int, queue: asyncio.Queue, ended: asyncio.Event, base: dict, shape: Shape,
                     include_usage: bool) -> AsyncIterator[bytes]:
        """A chat's events as server-sent events, ending with [DONE].

        The core sends a stream's text as it comes (one frame carries every stream's pieces); each piece
        waiting in the queue goes in one chunk, and the events ready at once (text and the end, the end
        and the usage and [DONE]) in one write. With more than BUSY_STREAMS streams, a stream's chunks
        after its first wait an interval (as vLLM's stream interval; 20 ms at 8 streams, 0.1 s from 40;
        cut short by the stream's end, which never waits): every chunk costs JSON, a write and the
        client's parsing."""
        client = self.client
        chunk = _Chunks(base, shape)
        client.streams += 1
        try:
            opening = shape.opening()
            if opening is not None and queue.empty():  # (else it goes with what is there already)
                yield chunk(opening).encode()
                opening = None
            handed = False  # the first text never waits: time to first token
            while True:
                kind, value = await queue.get()
                events = [] if opening is None else [chunk(opening)]
                opening = None
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
                    events.extend(chunk.text("".join(texts)))
                    if end is None:
                        yield "".join(events).encode()
                        continue
                    kind, value = end
                if kind == "error":  # after the stream began: the status is sent already
                    e = ServeError.from_payload(value)
                    error = {"message": e.message, "type": e.type, "code": e.code}
                    events.append(f"data: {json.dumps({'error': error})}\n\n")
                else:
                    events.extend(chunk(piece) for piece in shape.ending(value["finish_reason"]))
                    if include_usage:
                        events.append(chunk(None, value["usage"]))
                events.append(DONE.decode())
                yield "".join(events).encode()
                break
        finally:
            client.streams -= 1
            client.cancel(rid)  # a client that hung up: the guest stops at its next token


class _Chunks:
    """A stream's chunk events (`data: JSON`): its `base` fields, its object and a choice (and usage).
    From its second text piece on, a shape's whose pieces are one choice around the text is written
    from the choice's JSON made once, the text's alone dumped (the same bytes as the whole dict's: one
    encoder); a one-piece reply (a burst's short answers) makes none."""

    MARK = "\x00piece\x00"  # (in JSON: "\u0000piece\u0000", which no other field of a chunk holds)

    def __init__(self, base: dict, shape: Shape) -> None:
        self.base, self.shape = base, shape
        self.around: tuple[str, str] | None = None
        self.plain = type(shape).pieces in (Shape.pieces, CompletionShape.pieces)  # (a template fits)
        self.texts = 0

    def __call__(self, choice: dict | None, usage: dict | None = None) -> str:
        choices = [] if choice is None else [choice]
        payload = self.base | {"object": self.shape.chunk_object, "choices": choices}
        if usage is not None:
            payload["usage"] = usage
        return f"data: {json.dumps(payload)}\n\n"

    def text(self, text: str) -> list[str]:
        """The events of a text piece."""
        self.texts += 1
        if self.around is None and self.plain and self.texts == 2:
            made, mark = self(self.shape.pieces(self.MARK)[0]), json.dumps(self.MARK)
            if made.count(mark) == 1:
                before, _, after = made.partition(mark)
                self.around = before, after
        if self.around is None:
            return [self(piece) for piece in self.shape.pieces(text)]
        return [f"{self.around[0]}{encode_string(text)}{self.around[1]}"]


class EventStream(StreamingResponse):
    """A StreamingResponse of server-sent events (bytes, the last one `data: [DONE]`), cut short when
    `gone` (a task that ends when the client has closed its connection) ends: the same stream as
    Starlette's, which watches with an anyio task group for servers of ASGI spec < 2.4 (uvicorn's),
    for less of the front's CPU a request: no task group, the watch the request's own, and the last
    event sent with the body's end."""

    def __init__(self, content: AsyncIterator[bytes], headers: dict[str, str], gone: asyncio.Future) -> None:
        super().__init__(content, media_type="text/event-stream", headers=headers)
        self.gone = gone

    async def __call__(self, scope, receive, send) -> None:
        streaming = asyncio.ensure_future(self.stream_response(send))
        try:
            await asyncio.wait((streaming, self.gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            self.gone.cancel()
            if not streaming.done():
                streaming.cancel()  # (the body's iterator is cancelled at its await: its finally runs)
                with contextlib.suppress(asyncio.CancelledError):
                    await streaming
        if not streaming.cancelled():
            streaming.result()  # (its error, if it failed)

    async def stream_response(self, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        ended = False
        async for chunk in self.body_iterator:  # (to its end: the iterator's finally runs here)
            ended = chunk.endswith(DONE)
            await send({"type": "http.response.body", "body": chunk, "more_body": not ended})
        if not ended:
            await send({"type": "http.response.body", "body": b"", "more_body": False})


DONE = b"data: [DONE]\n\n"


async def _disconnected(request: Request) -> None:
    """Returns when the client has closed its connection (the request's body was read already: the
    server's next message is the disconnect)."""
    with contextlib.suppress(Exception):  # a receive that fails: the connection is as good as gone
        while (await request.receive())["type"] != "http.disconnect":
            pass


async def _next(queue: asyncio.Queue, gone: asyncio.Future):
    """The chat's next event; ClientGone if its client leaves first."""
    if not queue.empty():
        return queue.get_nowait()
    get = asyncio.ensure_future(queue.get())
    await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
    if get.done():
        return get.result()
    get.cancel()
    raise ClientGone
