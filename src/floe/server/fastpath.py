"""The HTTP front's short way for a valid request of the chat API (FastPath): a POST to /v1/chat/completions
or /v1/completions with a JSON body that is a valid request of its route goes straight to the chat service,
without FastAPI's route matching, request handler, dependency solving and exception wrappers (about a third
of the front's CPU a request: docs/PERF_HISTORY.md, "The front's short way for a valid chat"). Whatever is
not such a request (another route, a body that is not JSON, not a valid request, a body past the limit, a
client gone before its body's end) goes on to the app with its body as it came, and is answered there
exactly as before; a route's check of the conversation's size refuses as the route's dependency does. Only
answers the app would have given the same way take the short way."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import NamedTuple

from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from floe.server.protocol import ServeError


class Route(NamedTuple):
    """A POST route the short way takes: its body's model (the route's parameter), the route's own call
    answer(body, request), and check(messages), its dependency on a conversation's size (raises
    ServeError, the answer then, as the route's own refusal; None: it has none)."""

    model: type[BaseModel]
    answer: Callable[[BaseModel, Request], Awaitable[Response]]
    check: Callable[[list], None] | None = None


class FastPath:
    """ASGI middleware, the innermost of the front's (inside its API keys and body limit: a request here is
    authorised and within the limit as it is read), for the POST `routes` by path. error(e): the response
    to a ServeError (the app's handler's). `answered`: requests it answered (the rest went on to the app)."""

    def __init__(self, app: ASGIApp, routes: dict[str, Route],
                 error: Callable[[ServeError], Response]) -> None:
        self.app, self.routes, self.error = app, routes, error
        self.answered = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = self.routes.get(scope["path"]) if scope["type"] == "http" else None
        if route is None or scope["method"] != "POST" or not _json(scope):
            await self.app(scope, receive, send)
            return
        messages: list[Message] = []
        try:
            while True:
                message = await receive()
                messages.append(message)
                if message["type"] != "http.request" or not message.get("more_body", False):
                    break
        except Exception as e:  # (the body limit's): raised again where the app reads that far
            await self.app(scope, _replay(messages, e, receive), send)
            return
        try:
            body = _valid(messages, route)
        except ServeError as e:  # (its dependency's refusal, before the body's model: as the route's)
            self.answered += 1
            await self.error(e)(scope, receive, send)
            return
        if body is None:
            await self.app(scope, _replay(messages, None, receive), send)
            return
        self.answered += 1
        request = Request(scope, receive, send)
        try:
            response = await route.answer(body, request)
        except ServeError as e:
            response = self.error(e)
        await response(scope, receive, send)


def _json(scope: Scope) -> bool:
    """Whether the request says its body is JSON as FastAPI reads one (a Content-Type of application/json
    or application/*+json, none missing) and is sent uncompressed."""
    kind = encoding = None
    for name, value in scope["headers"]:
        if name == b"content-type":
            kind = value
        elif name == b"content-encoding":
            encoding = value
    if kind is None or (encoding is not None and encoding.strip().lower() != b"identity"):
        return False
    media = kind.split(b";")[0].strip().lower()
    return media == b"application/json" or (media.startswith(b"application/") and media.endswith(b"+json"))


def _valid(messages: list[Message], route: Route) -> BaseModel | None:
    """The request of a whole body that the app would take as it is on `route`, or None; the ServeError of
    the route's check where it refuses the body's messages."""
    if messages[-1]["type"] != "http.request" or messages[-1].get("more_body", False):
        return None  # (the client left before its body's end)
    raw = b"".join(m.get("body", b"") for m in messages)
    if not raw:
        return None
    try:
        parsed = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    if not isinstance(parsed, dict):
        return None
    if route.check is not None and isinstance(parsed.get("messages"), list):
        route.check(parsed["messages"])  # (a refusal: the route's dependency's, before the model's)
    try:
        return route.model.model_validate(parsed)
    except (ValueError, ValidationError, RecursionError, TypeError):
        return None


def _replay(messages: list[Message], error: Exception | None, receive: Receive) -> Receive:
    """A receive that gives `messages` again, then raises `error` if any, then is `receive`."""
    left = list(messages)

    async def replay() -> Message:
        if left:
            return left.pop(0)
        if error is not None:
            raise error
        return await receive()

    return replay
