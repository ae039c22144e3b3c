"""The wire between `floe serve`'s HTTP front and its engine core (docs/SERVER.md).

The front (FastAPI, uvicorn, SSE) and the core (the engine loop, the actors, the session store) run
in two processes, so the front's event loop never competes with the engine loop for one GIL. They
talk over a Unix socket in a private folder: frames of a 4-byte big-endian length and a JSON value
(JSON, not pickle: the front faces the network, and a front that misbehaves must not run code in the
core). This module imports nothing heavy: the front process never imports torch.

Front to core, objects:
  {"op": "chat", "id": N, "request": {...}}     a chat completion (core.ServeCore.open's fields, with
                                                 "owner": the caller's OWNER id, and "structured": a
                                                 structured.Constraint's wire() for response_format
                                                 or tools; or a text completion: "prompt", no
                                                 "messages"; several models: "model", and "table":
                                                 the model whose vocab makes its ids' text; "hint":
                                                 the conversation rendered and tokenized by the
                                                 front, floe.server.hints.wire(); with the
                                                 "chat_template_kwargs", if any, it renders)
  {"op": "cancel", "id": N}                      the client left: its row stops at the next token
  {"op": "call", "id": N, "name": NAME, "arg": A, "owner": O}
                                                 hello, vocab (each token's reply bytes: {"bytes": B64
                                                 of them all, "lengths": [...]}, by id; A: a model's
                                                 name, several models, else null),
                                                 tokenizer (the core's Tokenizer.wire(), for the
                                                 prompt hints; null: none), health, sessions,
                                                 session, freeze, thaw, fork (A:
                                                 {"id": SID, "new_id": NEW or null}), let_go, delete,
                                                 metrics, models (a server of several models: each
                                                 one's id and whether it is loaded; floe.server.models),
                                                 load, unload (A: a model's name)
                                                 (the session calls see O's sessions only)
  {"op": "export", "id": N, "arg": SID, "owner": O}   session SID's snapshot: "started", "data"s, "done";
  {"op": "more", "id": N}                             a "data" taken by its client (the core sends
                                                      at most a few ahead: core_socket.EXPORT_WINDOW)
  {"op": "import", "id": N, "arg": SID, "owner": O}   a snapshot for session SID follows: "data"s, then
  {"op": "data", "id": N, "data": B64}                "end" (or "cancel": the upload stopped); answered
  {"op": "end", "id": N}                              "ok" (or "error") once it was checked and stored
Core to front, lists:
  ["ok", N, value]             a call's answer
  ["error", N, error]          a call's or a chat's failure: ServeError.payload()
  ["started", N, session_id]   a chat holds its session; its text follows (a structured chat's is
                               sent with its first text: a refused schema is an error before it);
                               a text completion's session_id is null (it has none)
  ["text", [[N, text], ...]]   streamed text of every chat since the last frame (one frame a flush)
  ["ids", [[N, [T, ...]], ...]]  the same for chats streamed as token ids (floe.actor.stream: no stop
                               strings, no constraint): T a token id, whose text is its bytes in the
                               "vocab" call's table, or a string of bytes (latin-1) a guest emitted;
                               a chat's items are one UTF-8 byte stream ("replace" errors), ended by
                               its "done" or "error"
  ["data", N, B64]             an export's next bytes (base64: frames are JSON)
  ["more", N]                  an import's "data" taken: the front sends at most a few ahead of what the
                               import has taken (client.UPLOAD_WINDOW), so that an import waiting for its
                               session holds no more of its body than that
  ["done", N, result]          a chat's end: {"text", "finish_reason", "usage"} (an export's: {})
"""

from __future__ import annotations

import base64
import ctypes
import errno
import json
import os
import re
import socket
import struct

HEADER = struct.Struct("!I")
MAX_FRAME = 64 << 20  # a frame longer than this is a broken peer, not a message
MAX_REQUEST_BYTES = 8 << 20  # the front's default for a request body (floe.server.limits): 128k tokens
# of text are ~0.5 MB, tools and schemas far less; well under MAX_FRAME
METRICS_ENV = "PROMETHEUS_MULTIPROC_DIR"  # floe serve --fronts N: where the fronts count their requests
ROLES = ("system", "user", "assistant")
CALLS = ("hello", "vocab", "tokenizer", "health", "sessions", "session", "freeze", "thaw", "fork", "let_go",
         "delete", "metrics", "models", "load", "unload")
# Who a request is for (floe.server.auth): "" on a server without API keys (one owner, everyone), else
# a hash of the caller's key. Sessions belong to one owner; a request sees only its owner's.
OWNER = re.compile(r"|[0-9a-f]{32}")  # fullmatch


class ServeError(Exception):
    """A request the server answers with an error: HTTP status and OpenAI's error fields."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type_, code, param
        self.retry_after = retry_after  # seconds after which the same request may succeed (a lease's)

    def payload(self) -> dict:
        return {"status": self.status, "message": self.message, "type": self.type, "code": self.code,
                "param": self.param, "retry_after": self.retry_after}

    @classmethod
    def from_payload(cls, p: dict) -> ServeError:
        return cls(p["status"], p["message"], p["type"], p.get("code"), p.get("param"), p.get("retry_after"))

    def __reduce__(self):  # whole across a pickle (a Ray actor's answer), not just its message
        return (type(self), (self.status, self.message, self.type, self.code, self.param, self.retry_after))


class ProtocolError(Exception):
    """A frame that is not one: the peer is broken and the connection is closed."""


def pack(value) -> bytes:
    """One frame of `value`. A value past MAX_FRAME raises a 413 ServeError and nothing is sent: a frame
    that long would end the connection, and with it every other request on it."""
    return _framed(encode(value))


def encode(value) -> bytes:
    """`value` as a frame's JSON (pack's, without the frame)."""
    try:  # text as UTF-8, not escaped: 24 MB of emoji as \ud83d escapes would be 72 MB
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()
    except UnicodeEncodeError:  # a lone surrogate (JSON allows one): escaped, as the peer reads it back
        return json.dumps(value, separators=(",", ":")).encode()


def pack_ok(rid: int, answer: bytes) -> bytes:
    """The frame of ["ok", rid, value] for a value encode() made already (an answer sent many times)."""
    return _framed(b'["ok",%d,%b]' % (rid, answer))


def _framed(data: bytes) -> bytes:
    if len(data) > MAX_FRAME:
        raise ServeError(413, f"the message is {len(data)} bytes between floe's HTTP front and its engine "
                         f"core; the most is {MAX_FRAME}", code="request_too_large")
    return HEADER.pack(len(data)) + data


def frame_length(header: bytes) -> int:
    (n,) = HEADER.unpack(header)
    if n > MAX_FRAME:
        raise ProtocolError(f"a frame of {n} bytes (the limit is {MAX_FRAME})")
    return n


def unpack(data: bytes):
    try:
        return json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ProtocolError(f"a frame that is not JSON: {e}") from None


def vocab_table(answer: dict) -> list[bytes]:
    """The "vocab" call's answer as each token's reply bytes, by id."""
    data, table, at = base64.b64decode(answer["bytes"]), [], 0
    for n in answer["lengths"]:
        table.append(data[at:at + n])
        at += n
    return table


def send_now(sock: socket.socket, data: bytes) -> int:
    """Send as much of `data` as `sock` takes now, without waiting (0 where it takes nothing), keeping the
    GIL: libc's send through ctypes.PyDLL, where socket.send lets the GIL go and then waits to take it
    back, in the engine loop's thread behind a burst's chat threads (bench/probes/gil_handoff.py: 5 such
    calls 13 ms a step under 64 threads of Python, 19 us held). Raises OSError where the peer is gone."""
    if _send is None:  # (not Linux: the socket's own, letting the GIL go)
        try:
            return sock.send(data, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return 0
    while True:
        sent = _send(sock.fileno(), data, len(data), socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
        if sent >= 0:
            return sent
        code = ctypes.get_errno()
        if code in (errno.EAGAIN, errno.EWOULDBLOCK):
            return 0
        if code != errno.EINTR:
            raise OSError(code, os.strerror(code))


def _libc_send():
    """libc's send(2), called with the GIL held (ctypes.PyDLL), or None where there is no MSG_NOSIGNAL."""
    if not hasattr(socket, "MSG_NOSIGNAL"):
        return None
    fn = ctypes.PyDLL(None, use_errno=True).send
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_ssize_t
    return fn


_send = _libc_send()
