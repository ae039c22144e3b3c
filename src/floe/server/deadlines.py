"""The HTTP front's deadlines for slow senders, which uvicorn lacks: it times out only an idle
keep-alive connection, so a client that sends its headers a byte at a time, trickles its body, or
connects and sends nothing holds a connection (and its request's memory) for ever.

`DeadlineH11Protocol` is uvicorn's HTTP/1.1 protocol with two more timers: a request's headers must
have arrived `HEADER_TIMEOUT_S` after the connection opened or the request's first byte came; while its
body arrives, every `BODY_CHUNK` bytes (or the rest) must come within `BODY_TIMEOUT_S` (about 2 KB/s
at least: a snapshot upload of any size passes, a trickle does not). A request past its deadline gets
`408` (nothing has answered it yet) and its connection is closed; the app, if it was reading the body,
sees its client leave. Once a request is complete, a reply may stream for minutes; but one whose client
reads none of it (the socket's buffers full, uvicorn waits to write) for `SEND_TIMEOUT_S` has its
connection closed: uvicorn waits for ever, holding what the reply had ready (a snapshot export's chunks)
and keeping a stop of the server waiting.
"""

from __future__ import annotations

import asyncio
import json

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

HEADER_TIMEOUT_S = 10.0
BODY_TIMEOUT_S = 30.0
BODY_CHUNK = 64 * 1024
SEND_TIMEOUT_S = 60.0


class DeadlineH11Protocol(H11Protocol):
    """uvicorn's h11 protocol whose requests must arrive in time (see the module's docstring)."""

    header_timeout_s = HEADER_TIMEOUT_S
    body_timeout_s = BODY_TIMEOUT_S
    send_timeout_s = SEND_TIMEOUT_S

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._timer: asyncio.TimerHandle | None = None
        self._stalled: asyncio.TimerHandle | None = None  # the reply's client has read nothing since
        self._phase: h11.Sentinel | None = None
        self._body_bytes = 0
        self._rearm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._phase is h11.SEND_BODY:
            self._body_bytes += len(data)
        self._rearm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel()
        self._unstall()
        super().connection_lost(exc)

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

    def _rearm(self) -> None:
        """Start the deadline of the phase the request is in, if it changed (or a body chunk came)."""
        phase = self.conn.their_state if self.conn.their_state in (h11.IDLE, h11.SEND_BODY) else None
        if phase is self._phase and not (phase is h11.SEND_BODY and self._body_bytes >= BODY_CHUNK):
            return
        self._cancel()
        self._phase, self._body_bytes = phase, 0
        if phase is not None and not self.transport.is_closing():
            timeout = self.header_timeout_s if phase is h11.IDLE else self.body_timeout_s
            self._timer = self.loop.call_later(timeout, self._expired)

    def _expired(self) -> None:
        self._timer = None
        if self._phase is h11.SEND_BODY and self.flow.read_paused:  # the app is not reading: not the client
            self._timer = self.loop.call_later(self.body_timeout_s, self._expired)
            return
        if self.cycle is None or not self.cycle.response_started:
            self._send_408()
        if self.cycle is not None:
            self.cycle.disconnected = True  # what the app sends now goes nowhere
        self.transport.close()

    def _send_408(self) -> None:
        what = "headers" if self._phase is h11.IDLE else "body"
        timeout = self.header_timeout_s if self._phase is h11.IDLE else self.body_timeout_s
        body = json.dumps({"error": {"message": f"the request's {what} did not arrive within {timeout:g} s",
                                     "type": "invalid_request_error", "param": None,
                                     "code": "request_timeout"}}).encode()
        headers = [(b"content-type", b"application/json"), (b"connection", b"close"),
                   (b"content-length", str(len(body)).encode())]
        try:
            for event in (h11.Response(status_code=408, headers=headers, reason=b"Request Timeout"),
                          h11.Data(data=body), h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
        except h11.LocalProtocolError:  # h11 cannot answer in this state: the close says it
            pass


def uvicorn_config(app, *, host: str, port: int, log_level: str = "warning",
                   header_timeout_s: float = HEADER_TIMEOUT_S, body_timeout_s: float = BODY_TIMEOUT_S,
                   send_timeout_s: float = SEND_TIMEOUT_S) -> uvicorn.Config:
    """How `floe serve` runs its HTTP front under uvicorn: HTTP/1.1 with the deadlines above (in s)."""
    protocol = type("DeadlineH11Protocol", (DeadlineH11Protocol,),
                    {"header_timeout_s": header_timeout_s, "body_timeout_s": body_timeout_s,
                     "send_timeout_s": send_timeout_s})
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, http=protocol)
