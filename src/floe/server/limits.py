"""What one request may bring to `floe serve`, enforced in the HTTP front where its bytes arrive: before
any JSON is parsed, any text tokenized or any frame sent to the engine core (docs/SERVER.md, "Limits").

- A request body (but a snapshot upload's, which streams in chunks and is checked by the store) of at
  most `--max-request-bytes`: past it, 413 `request_too_large` naming the limit, the rest unread.
- A conversation's text of at most what the context could hold: `max_text_bytes`, the context's
  tokens times the most bytes of text one token can stand for (Tokenizer.most_text_bytes_per_token):
  past it, 400 `context_length_exceeded` without tokenizing (a 10 MB message took the core 9-14 s of
  tokenizing to refuse). So are more messages than the context has tokens (each takes at least one:
  200,000 empty messages took the front's event loop 4 s to render, every other request waiting). The
  core checks both again (it trusts no peer).
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from floe.server.protocol import MAX_REQUEST_BYTES, ServeError

__all__ = ["MAX_REQUEST_BYTES", "BodyLimit", "BodyTooLarge", "check_text"]


class BodyTooLarge(HTTPException):
    """A request body past the limit, found while it streams in: answered by the app's 413 handler.
    An HTTPException, so that FastAPI's body reading passes it on rather than calling it a parse error."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, too_large_message(limit))


def too_large_message(limit: int) -> str:
    return f"the request body is larger than this server's limit of {limit} bytes (--max-request-bytes)"


class BodyLimit:
    """ASGI middleware: a request whose body is past `max_bytes` is refused with `reject(message, path)`
    (a 413 in OpenAI's error shape) when its Content-Length says so, else as soon as its bytes pass the
    limit (BodyTooLarge). Starlette's RequestBodyLimitMiddleware answers a bare "Content Too Large"
    in plain text, which OpenAI clients show without the limit; this one says what the limit is."""

    def __init__(self, app: ASGIApp, max_bytes: int, reject: Callable[[str, str], Response]) -> None:
        self.app, self.max_bytes, self.reject = app, max_bytes, reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or is_snapshot_upload(scope):
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await self.reject(too_large_message(self.max_bytes), scope["path"])(scope, receive, send)
            return
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
            return message

        await self.app(scope, counted, send)


def is_snapshot_upload(scope: Scope) -> bool:
    return scope["method"] == "PUT" and scope["path"].startswith("/v1/sessions/") and \
        scope["path"].endswith("/snapshot")


def check_text(messages: list[dict], max_text_bytes: int | None, context: int | None = None) -> None:
    """Refuse (400 context_length_exceeded) a conversation whose text is more than the context could
    hold, counted in bytes, or that has more messages than the `context` has tokens: no template or
    tokenizer runs for it."""
    if context is not None and len(messages) > context:
        raise ServeError(400, f"the conversation has {len(messages)} messages; this server's context holds "
                         f"{context} tokens (each message takes at least one)",
                         code="context_length_exceeded", param="messages")
    if max_text_bytes is None:
        return
    size = sum(len(m["content"].encode("utf-8", "surrogatepass")) for m in messages)
    if size > max_text_bytes:
        raise ServeError(400, f"the conversation's text is {size} bytes; this server's context holds at "
                         f"most {max_text_bytes} bytes of text", code="context_length_exceeded",
                         param="messages")
