"""The HTTP front's deadlines for slow senders, which uvicorn lacks: it times out only an idle
keep-alive connection, so a client that sends its headers a byte at a time, trickles its body, or
connects and sends nothing holds a connection (and its request's memory) for ever.

`DeadlineHttpProtocol` is uvicorn's HTTP/1.1 protocol (its httptools one: llhttp's C parser, ~18 % less of
the front's CPU a request than its h11 one, bench/probes/front_cost.py) with two more timers: a request's
headers must have arrived `HEADER_TIMEOUT_S` after the connection opened or the request's first byte came;
while its body arrives, every `BODY_CHUNK` bytes (or the rest) must come within `BODY_TIMEOUT_S` (about 2
KB/s at least: a snapshot upload of any size passes, a trickle does not). A request past its deadline gets
`408` (nothing has answered it yet) and its connection is closed; the app, if it was reading the body, sees
its client leave. Once a request is complete, a reply may stream for minutes; but one whose client reads
none of it (the socket's buffers full, uvicorn waits to write) for `SEND_TIMEOUT_S` has its connection
closed: uvicorn waits for ever, holding what the reply had ready (a snapshot export's chunks) and keeping a
stop of the server waiting.

A request's head (its request line and headers) may have at most `MAX_HEAD_BYTES`, and so may a chunked
body's framing beyond `CHUNK_FRAMING` bytes a chunk (its chunk extensions and trailers): past either it gets
`431` and its connection is closed. uvicorn's h11 protocol bounded a head (h11's 16 KiB); its httptools one
does not, and keeps every trailer too: a client streaming headers for the 10 s they may take, or trailers for
the 30 s a body's next bytes may, grew the front by ~0.9 GB a second (bench/probes/head_flood.py), and each
piece of a long URL, header or trailer is appended to what came before (time quadratic in its length).

A connection may have at most `MAX_PIPELINED` requests waiting behind the one being answered (HTTP/1.1
pipelining): past them it is closed once the one being answered is. h11 parsed one request at a time;
httptools parses every request a read holds, and uvicorn read more after each answer, so the requests
waiting grew with what the client sent (200,000 `GET /health` in one write, 6.6 MB: `floe serve` from 566
to 1,040 MB). While requests wait, nothing more is read.

A stop (uvicorn's shutdown, which waited for every open request: a trickling snapshot upload or an
export nobody read held `floe serve`'s SIGTERM ~30 s) ends each connection in bounded time: a request
whose body is still arriving gets `503 server_stopping` and is closed at once (the app sees its client
leave: an upload stores nothing), as is a reply whose client reads none of it; a reply under way (a
chat's stream) has `STOP_GRACE_S` to end, then its connection is closed (a request not yet answered gets
the 503). uvicorn's `timeout_graceful_shutdown` cancels what is left a second later.
"""

from __future__ import annotations

import asyncio
import json

import uvicorn
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

HEADER_TIMEOUT_S = 10.0
BODY_TIMEOUT_S = 30.0
BODY_CHUNK = 64 * 1024
# A request line and headers: past this, 431 (and a chunked body's framing). nginx's 4 × 8 KiB: what a
# connection may hold while its head arrives (20,000 connections, a common descriptor limit: 640 MiB).
MAX_HEAD_BYTES = 32 * 1024
CHUNK_FRAMING = 32  # bytes a chunk's size line and line ends may take (a 16-digit size, CRLFs)
MAX_PIPELINED = 32  # requests a connection may have waiting behind the one being answered
SEND_TIMEOUT_S = 60.0
STOP_GRACE_S = 5.0  # at a stop, what a reply under way has to end (s)
HEADERS, BODY = "headers", "body"  # the phases of a request that has a deadline


class PipelinedTooDeep(Exception):
    """A connection pipelined past DeadlineHttpProtocol.max_pipelined (it is closed)."""


class DeadlineHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol whose requests must arrive in time (see the module's docstring).
    A request's phase: HEADERS from the connection's start or its next request's first byte until its
    headers are complete; BODY until its body is; then none (its reply may take its time)."""

    header_timeout_s = HEADER_TIMEOUT_S
    body_timeout_s = BODY_TIMEOUT_S
    max_head_bytes = MAX_HEAD_BYTES
    max_pipelined = MAX_PIPELINED
    send_timeout_s = SEND_TIMEOUT_S
    stop_grace_s = STOP_GRACE_S

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._timer: asyncio.TimerHandle | None = None
        self._stalled: asyncio.TimerHandle | None = None  # the reply's client has read nothing since
        self._grace: asyncio.TimerHandle | None = None  # a stop: the end of this reply's grace
        self._phase: str | None = None
        self._body_bytes = 0
        self._head_bytes = 0  # bytes received while its head was incomplete (HEADERS)
        self._body_seen = self._chunks = self._framing = 0  # its body's bytes, chunks, and the rest
        self._began = False  # a request began within the read being parsed
        self._too_deep = False  # it pipelined past max_pipelined: closed, not answered with a 400
        self._answering = None  # the request being answered (uvicorn's cycle)
        self._enter(HEADERS)

    def data_received(self, data: bytes) -> None:
        """As uvicorn's, but a head still incomplete past max_head_bytes is refused: it is counted by
        the reads (at most 256 KiB each) that found it incomplete, from the one after its first byte;
        and so is a body whose reads bring more than its bytes and their chunks' framing allow."""
        phase, seen, self._began = self._phase, self._body_seen, False
        if phase is HEADERS:  # (a read that completes the head may hold its body too: counted only
            self._head_bytes += len(data)  # if the head is still incomplete after it)
        super().data_received(data)
        if self.transport.is_closing():
            return
        if self._phase is HEADERS and self._head_bytes > self.max_head_bytes:
            self._too_large("line and headers")
        elif phase is BODY and self._phase is BODY and not self._began:  # (all of the read was this body's;
            # one that ended a body and began the next request's is neither's framing: its bytes are not
            # told apart, and the last body's counted as the next's framing made a 431 of a keep-alive
            # connection's next request past 32 KiB of body)
            self._framing += len(data) - (self._body_seen - seen)
            if self._framing > self.max_head_bytes + CHUNK_FRAMING * self._chunks:
                self._too_large("chunks' extensions and trailers")

    def _too_large(self, what: str) -> None:
        self._cancel()
        if not self._abandon_earlier() and (self.cycle is None or not self.cycle.response_started):
            self._refuse(431, f"the request's {what} are over {self.max_head_bytes} bytes",
                         "invalid_request_error", "headers_too_large")
        if self.cycle is not None:
            self.cycle.disconnected = True  # (an app reading the body sees its client leave)
        self.transport.close()

    def _abandon_earlier(self) -> bool:
        """Whether an earlier request of this connection (pipelined) is still being answered as it is
        closed under it: its answer goes nowhere now (it wrote on the closed transport: 'internal error'
        and a traceback), and a refusal of this one is not written inside it."""
        earlier = self._answering
        if earlier is None or earlier is self.cycle or earlier.response_complete:
            return False
        earlier.disconnected = True
        return True

    def on_chunk_header(self) -> None:  # (httptools calls it where the protocol has it)
        self._chunks += 1

    # (the parser's callbacks, within data_received)
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._began = True
        if self._phase is not HEADERS:  # a keep-alive connection's next request: from its first byte
            self._enter(HEADERS)

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        self._enter(BODY)
        if len(self.pipeline) > self.max_pipelined:  # (raised through the parser, which stops there:
            self._too_deep = True  # uvicorn's data_received takes it for a bad request, send_400_response)
            raise PipelinedTooDeep(f"more than {self.max_pipelined} requests pipelined")

    def send_400_response(self, msg: str) -> None:
        if not self._too_deep:
            return super().send_400_response(msg)
        self.logger.warning("a connection pipelined more than %d requests: closed once the one being "
                            "answered is", self.max_pipelined)
        self._cancel()
        self.pipeline.clear()  # (not answered)
        self.flow.pause_reading()
        answering = self._answering
        if answering is not None and not answering.response_complete:
            answering.keep_alive = False  # uvicorn closes the connection once it is answered
        else:
            self.transport.close()

    def _start_asgi_task(self, cycle, app) -> None:  # (the request answered now)
        self._answering = cycle
        super()._start_asgi_task(cycle, app)

    def on_response_complete(self) -> None:
        super().on_response_complete()  # (it reads again: not while requests are still waiting)
        if self.pipeline and not self.transport.is_closing():
            self.flow.pause_reading()

    def on_body(self, body: bytes) -> None:
        super().on_body(body)
        self._body_seen += len(body)
        self._body_bytes += len(body)
        if self._body_bytes >= BODY_CHUNK:  # a chunk in time: the next one's deadline
            self._enter(BODY)

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._enter(None)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel()
        self._unstall()
        if self._grace is not None:
            self._grace.cancel()
        super().connection_lost(exc)

    def shutdown(self) -> None:
        """The server stops (uvicorn's shutdown calls this on every connection): see the module's
        docstring. uvicorn's own waits for every request under way, however slow its client."""
        cycle = self.cycle
        if cycle is None or cycle.response_complete or self.transport.is_closing():
            super().shutdown()
        elif self._phase is BODY or self._stalled is not None:
            self._stopped()
        else:
            super().shutdown()  # (keep-alive off: the connection closes after this reply)
            self._grace = self.loop.call_later(self.stop_grace_s, self._stopped)

    def _stopped(self) -> None:
        """The stop's end of this connection: a request not yet answered gets 503, and it is closed
        (what the app sends now goes nowhere; it sees its client leave)."""
        self._grace = None
        if self.transport.is_closing() or self.cycle is None:
            return
        answered = self.cycle.response_started
        if not answered:
            self._refuse(503, "the server is stopping; send the request again once it is back",
                         "server_error", "server_stopping")
        self.cycle.disconnected = True
        if answered:  # (its client may read nothing: what is buffered is dropped, not waited for)
            self.transport.abort()
        else:
            self.transport.close()

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._stalled is None:
            self._stalled = self.loop.call_later(self.send_timeout_s, self._stuck)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._unstall()

    def _unstall(self) -> None:
        if self._stalled is not None:
            self._stalled.cancel()
            self._stalled = None

    def _stuck(self) -> None:
        """The reply's client has read nothing for send_timeout_s: its connection is closed (the app
        sees its client leave)."""
        self._stalled = None
        if self.cycle is not None:
            self.cycle.disconnected = True
        self.transport.abort()

    def _cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _enter(self, phase: str | None) -> None:
        """Start `phase`'s deadline (HEADERS, BODY, or none), from now."""
        self._cancel()
        if phase is HEADERS and self._phase is not HEADERS:  # (a request's start)
            self._head_bytes = self._body_seen = self._chunks = self._framing = 0
        self._phase, self._body_bytes = phase, 0
        if phase is not None and not self.transport.is_closing():
            timeout = self.header_timeout_s if phase is HEADERS else self.body_timeout_s
            self._timer = self.loop.call_later(timeout, self._expired)

    def _expired(self) -> None:
        self._timer = None
        if self._phase is BODY and self.flow.read_paused:  # the app is not reading: not the client
            self._timer = self.loop.call_later(self.body_timeout_s, self._expired)
            return
        if not self._abandon_earlier() and (self.cycle is None or not self.cycle.response_started):
            self._send_408()
        if self.cycle is not None:
            self.cycle.disconnected = True  # what the app sends now goes nowhere
        self.transport.close()

    def _send_408(self) -> None:
        what = "headers" if self._phase is HEADERS else "body"
        timeout = self.header_timeout_s if self._phase is HEADERS else self.body_timeout_s
        self._refuse(408, f"the request's {what} did not arrive within {timeout:g} s",
                     "invalid_request_error", "request_timeout")

    def _refuse(self, status: int, message: str, type_: str, code: str) -> None:
        """Answer the request (none has yet) with an OpenAI-shaped error; the caller closes."""
        error = {"message": message, "type": type_, "param": None, "code": code}
        body = json.dumps({"error": error}).encode()
        self.transport.write(b"".join([
            STATUS_LINE[status], b"content-type: application/json\r\nconnection: close\r\n",
            b"content-length: ", str(len(body)).encode(), b"\r\n\r\n", body]))


def uvicorn_config(app, *, host: str, port: int, log_level: str = "warning",
                   header_timeout_s: float = HEADER_TIMEOUT_S, body_timeout_s: float = BODY_TIMEOUT_S,
                   send_timeout_s: float = SEND_TIMEOUT_S,
                   stop_grace_s: float = STOP_GRACE_S) -> uvicorn.Config:
    """How `floe serve` runs its HTTP front under uvicorn: HTTP/1.1 with the deadlines above (in s)."""
    protocol = type("DeadlineHttpProtocol", (DeadlineHttpProtocol,),
                    {"header_timeout_s": header_timeout_s, "body_timeout_s": body_timeout_s,
                     "send_timeout_s": send_timeout_s, "stop_grace_s": stop_grace_s})
    # (past the grace every connection is closed; a request that still runs then is cancelled)
    # ws="none": floe serves no WebSocket; an `Upgrade: websocket` request is answered as plain HTTP,
    # not handed to the websockets library's protocol (past these deadlines) for the app to refuse.
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, http=protocol, ws="none",
                          timeout_graceful_shutdown=stop_grace_s + 1)
