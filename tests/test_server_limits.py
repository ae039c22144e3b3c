"""Limits where a request's bytes arrive (issue 41): no request can end `floe serve`'s engine core or
make it tokenize what could never fit, and a front that loses its core exits as a failure."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
from test_server import CONTEXT, MODEL_ID, ThreadServer, free_port, requests_counted

from floe.engine import Engine
from floe.server import protocol
from floe.server.app import EXIT_CORE_LOST, create_app
from floe.server.limits import MAX_REQUEST_BYTES
from floe.server.protocol import ServeError, pack

CHAT = "/v1/chat/completions"


def body(content: str, **extra) -> dict:
    return {"model": MODEL_ID, "messages": [{"role": "user", "content": content}], "max_tokens": 2,
            "temperature": 0} | extra


class Broken(logging.Handler):
    """Records that say a connection between the front and the core broke."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record.getMessage())


@pytest.fixture
def engine(default_checkpoint):
    """An engine of its own (a server's spare actors hold its free KV slots)."""
    return Engine(default_checkpoint, max_seq_len=CONTEXT, n_slots=2, weights="native")


@pytest.fixture(scope="module")
def server(default_checkpoint, tmp_path_factory):
    engine = Engine(default_checkpoint, max_seq_len=CONTEXT, n_slots=2, weights="native")
    broken = Broken()
    logging.getLogger("floe").addHandler(broken)
    app = create_app(engine, snapshots=tmp_path_factory.mktemp("sessions"), model_id=MODEL_ID,
                     idle_seconds=3600)
    s = ThreadServer(app)
    s.core, s.broken = app.state.core, broken
    yield s
    s.stop()
    logging.getLogger("floe").removeHandler(broken)


def still_serves(url: str) -> None:
    r = httpx.post(url + CHAT, json=body("Say hi."), timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"]


def refused(r: httpx.Response, status: int, code: str) -> dict:
    assert r.status_code == status, r.text[:300]
    error = r.json()["error"]
    assert error["code"] == code and error["message"] and "Traceback" not in r.text
    assert r.headers["x-should-retry"] == "false"  # the openai client would send it again otherwise
    return error


def test_a_70_mb_chat_body_is_413_naming_the_limit_and_the_server_goes_on(server):
    big = json.dumps(body("a" * (70 << 20))).encode()
    r = httpx.post(server.url + CHAT, content=big, headers={"content-type": "application/json"}, timeout=120)
    error = refused(r, 413, "request_too_large")
    assert str(MAX_REQUEST_BYTES) in error["message"]
    still_serves(server.url)
    assert server.broken.records == []


def test_chat_requests_refused_before_their_handler_are_counted(server):
    """floe_requests counts a chat API request refused before its handler runs, by status, as it counts
    those its handler refuses: a body past the limit (declared, and streamed without a length), one not
    JSON, one not a valid request, and more messages than the context has tokens; a refusal elsewhere
    (the sessions API) is not a chat request."""
    before = {status: requests_counted(server.url, status) for status in ("400", "413")}
    json_body = {"content-type": "application/json"}
    big = b'{"messages": "' + b"a" * (MAX_REQUEST_BYTES + 1) + b'"}'
    refused(httpx.post(server.url + CHAT, content=big, headers=json_body, timeout=120), 413,
            "request_too_large")
    refused(httpx.post(server.url + CHAT, content=iter([big]), headers=json_body, timeout=120), 413,
            "request_too_large")
    refused(httpx.post(server.url + CHAT, content=b"{not json", headers=json_body, timeout=60), 400,
            "invalid_json")
    refused(httpx.post(server.url + CHAT, json=body("Hi", temperature="hot"), timeout=60), 400,
            "invalid_value")
    many = {"model": MODEL_ID, "messages": [{"role": "user", "content": ""}] * (CONTEXT + 1)}
    refused(httpx.post(server.url + CHAT, json=many, timeout=60), 400, "context_length_exceeded")
    refused(httpx.post(server.url + "/v1/completions", content=b"[", headers=json_body, timeout=60), 400,
            "invalid_json")
    r = httpx.post(server.url + "/v1/sessions/x/fork", content=b"{not json", headers=json_body, timeout=60)
    assert r.status_code == 400  # (not a chat request: not counted)
    assert requests_counted(server.url, "413") == before["413"] + 2
    assert requests_counted(server.url, "400") == before["400"] + 4


def test_a_streamed_body_without_a_length_is_cut_off_at_the_limit(server):
    def chunks():  # chunked transfer: no Content-Length says how much is coming
        yield b'{"model": "' + MODEL_ID.encode() + b'", "messages": [{"role": "user", "content": "'
        for _ in range(12):
            yield b"b" * (1 << 20)
        yield b'"}]}'

    r = httpx.post(server.url + CHAT, content=chunks(), headers={"content-type": "application/json"},
                   timeout=120)
    refused(r, 413, "request_too_large")
    still_serves(server.url)


def test_24_mb_of_emoji_under_a_raised_limit_never_reaches_the_core_as_an_oversized_frame(
        engine, tmp_path):
    """Escaped as JSON's \\ud83d\\ude00, 24 MB of emoji became a 72 MB frame past the core's 64 MiB: the
    core dropped the front and `floe serve` exited. Now frames carry UTF-8 and the text is refused
    for the context it could never fit, in the front."""
    app = create_app(engine, snapshots=tmp_path, model_id=MODEL_ID, max_request_bytes=100 << 20)
    s = ThreadServer(app)
    try:
        r = httpx.post(s.url + CHAT, json=body("\U0001F600" * (6 << 20)), timeout=120)
        error = refused(r, 400, "context_length_exceeded")
        assert str(app.state.core.max_text_bytes) in error["message"]
        still_serves(s.url)
    finally:
        s.stop()


def test_a_request_whose_frame_would_pass_the_limit_is_413_and_the_connection_stays(server, monkeypatch):
    monkeypatch.setattr(protocol, "MAX_FRAME", 1 << 20)
    r = httpx.post(server.url + CHAT, json=body("hi", session_id="s" * (2 << 20)), timeout=120)
    refused(r, 413, "request_too_large")
    still_serves(server.url)
    assert server.broken.records == []


def test_frames_carry_text_as_utf8_and_refuse_what_would_not_fit(monkeypatch):
    emoji = "\U0001F600" * 1000
    assert len(pack(["text", [[1, emoji]]])) < 4100  # not 12,000 bytes of \\u escapes
    lone = pack({"s": "\ud800"})  # a lone surrogate (valid JSON, not UTF-8) is escaped, not lost
    assert protocol.unpack(lone[protocol.HEADER.size:]) == {"s": "\ud800"}
    monkeypatch.setattr(protocol, "MAX_FRAME", 100)
    with pytest.raises(ServeError) as e:
        pack({"text": "x" * 200})
    assert e.value.status == 413 and e.value.code == "request_too_large"


def test_an_answer_too_large_for_a_frame_fails_its_request_only(monkeypatch):
    from floe.server.core_socket import _Connection

    monkeypatch.setattr(protocol, "MAX_FRAME", 1000)
    ours, theirs = socket.socketpair()
    conn = _Connection(ours)
    conn.send(["done", 7, {"text": "x" * 5000}])
    conn.send(["ok", 8, "fine"])
    peer = _Connection(theirs)
    kind, rid, payload = peer.read()
    assert (kind, rid, payload["status"], payload["code"]) == ("error", 7, 500, "answer_too_large")
    assert peer.read() == ["ok", 8, "fine"]
    ours.close()
    theirs.close()


def test_the_cores_reader_takes_every_frame_however_the_bytes_arrive(monkeypatch):
    """The core reads its socket in large pieces and takes each frame that came whole: frames split
    anywhere (a header over two reads, a body over many), several in one read, one larger than a read,
    all come out in order; a connection that ends inside a frame is a ProtocolError, at a frame's end
    the end."""
    import random
    import threading

    from floe.server import core_socket
    from floe.server.core_socket import _Connection
    from floe.server.protocol import ProtocolError

    monkeypatch.setattr(core_socket, "RECV_BYTES", 64)  # (reads much smaller than the frames)
    values = [["chat", k, {"text": "é" * random.Random(k).randrange(0, 400)}] for k in range(60)]
    values.append(["data", 99, "x" * 5000])  # past 16 reads
    wire = b"".join(pack(v) for v in values)
    ours, theirs = socket.socketpair()

    def send() -> None:
        rng, at = random.Random(1), 0
        while at < len(wire):
            n = rng.choice([1, 3, 4, 5, 50, 700, 3000])
            theirs.sendall(wire[at:at + n])
            at += n
        theirs.close()

    writer = threading.Thread(target=send)
    writer.start()
    conn = _Connection(ours)
    assert [conn.read() for _ in values] == values
    assert conn.read() is None
    writer.join(10)
    ours.close()
    ours, theirs = socket.socketpair()
    theirs.sendall(pack(values[0]) + pack(values[1])[:9])
    theirs.close()
    conn = _Connection(ours)
    assert conn.read() == values[0]
    with pytest.raises(ProtocolError, match="ended inside a frame"):
        conn.read()
    ours.close()


def test_a_conversation_longer_than_the_context_could_hold_is_refused_without_tokenizing(server, monkeypatch):
    core = server.core
    tokenizer = core.engine.tokenizer

    def forbidden(*args, **kwargs):
        raise AssertionError("the tokenizer ran for a text that cannot fit")

    text = "z" * (core.max_text_bytes + 1)
    for name in ("encode", "encode_chat", "render_chat", "encode_many", "encode_plain"):
        monkeypatch.setattr(tokenizer, name, forbidden)
    with pytest.raises(ServeError) as e:  # the core's own check (it trusts no front)
        core._validate({"messages": [{"role": "user", "content": text}], "max_tokens": 2})
    assert e.value.status == 400 and e.value.code == "context_length_exceeded"
    monkeypatch.undo()
    r = httpx.post(server.url + CHAT, json=body(text), timeout=120)  # and the front's
    refused(r, 400, "context_length_exceeded")
    # The bound is sound: the context's tokens at the most bytes a token can stand for.
    longest = max(len(tokenizer.token_bytes(i)) for i in range(tokenizer.vocab_size))
    assert core.max_text_bytes >= CONTEXT * longest


@contextlib.contextmanager
def front_process(engine: Engine, folder):
    """A real engine core in this process and `floe serve`'s HTTP front as its own process, started."""
    from floe.server.core import ServeCore
    from floe.server.core_socket import CoreServer

    core = ServeCore(engine, snapshots=folder, model_id=MODEL_ID)
    server = CoreServer(core)
    port = free_port()
    front = subprocess.Popen([sys.executable, "-m", "floe.server.app", "--socket", server.path,
                              "--port", str(port)], env=os.environ | {"FLOE_API_KEYS": ""},
                             stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 60
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.time() < deadline and front.poll() is None, "the front did not start"
            time.sleep(0.1)
        yield front, server
    finally:
        if front.poll() is None:
            front.kill()
        server.close()
        core.close()


def test_a_front_that_loses_its_engine_core_exits_as_a_failure(engine, tmp_path):
    """`floe serve` exits with its front's status: 0 only after a stop, so a supervisor restarts it."""
    with front_process(engine, tmp_path) as (front, server):
        server.close()  # the core goes away
        assert front.wait(60) == EXIT_CORE_LOST
        assert "engine core" in front.stderr.read()


def test_a_front_told_to_stop_does_not_exit_as_a_lost_core(engine, tmp_path):
    """Its own close of the core's connection is not the core's loss (uvicorn ends by the signal)."""
    with front_process(engine, tmp_path) as (front, _):
        front.terminate()
        assert front.wait(60) in (0, -signal.SIGTERM)
