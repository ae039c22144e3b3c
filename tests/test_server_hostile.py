"""A hostile-client campaign against a real `floe serve` front and core on loopback (issue 17, item 5):
malformed JSON, wrong types, huge and non-finite numbers, unicode edge cases, hostile session ids on
every session route, slow senders, clients that leave mid-reply, 32 sessions on 8 slots. What must
hold: no response is a 500, every request gets a response (or its client hung up first), every
session stores exactly what its client saw, and the server is healthy afterwards."""

from __future__ import annotations

import json
import logging
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from test_server import CONTEXT, MODEL_ID, ThreadServer, folder_state

from floe.engine import Engine
from floe.server.app import create_app

SLOTS = 8
CHAT = "/v1/chat/completions"
BASE = {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}
HEADER_TIMEOUT_S, BODY_TIMEOUT_S = 2.0, 3.0  # floe serve's are longer; the test's slow senders wait these
BUSY: list[str] = []  # sessions refused with 503 (every slot running a request; there is no wait queue)
LONG = "Count from 1 to 500, one per line."  # a reply far longer than a client waits for


class Errors(logging.Handler):
    """ERROR records of the server's loggers (a traceback behind a response, or one that never came)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


# The later rounds' loggers: an ERROR record in any is a failure
LOGGERS = ("floe", "uvicorn", "uvicorn.error", "asyncio")


@contextmanager
def logged_errors(loggers: tuple[str, ...] = LOGGERS) -> Iterator[Errors]:
    """The ERROR records of `loggers` while the block runs (an Errors handler on each)."""
    errors = Errors()
    for name in loggers:
        logging.getLogger(name).addHandler(errors)
    try:
        yield errors
    finally:
        for name in loggers:
            logging.getLogger(name).removeHandler(errors)


@pytest.fixture(scope="module")
def server(default_checkpoint, tmp_path_factory):
    errors = Errors()
    for name in ("floe", "uvicorn", "uvicorn.error"):
        logging.getLogger(name).addHandler(errors)
    engine = Engine(default_checkpoint, max_seq_len=CONTEXT, n_slots=SLOTS, weights="native")
    folder = tmp_path_factory.mktemp("sessions")
    s = ThreadServer(create_app(engine, snapshots=folder, model_id=MODEL_ID, idle_seconds=3600),
                     header_timeout_s=HEADER_TIMEOUT_S, body_timeout_s=BODY_TIMEOUT_S)
    s.folder, s.errors = folder, errors
    yield s
    s.stop()
    for name in ("floe", "uvicorn", "uvicorn.error"):
        logging.getLogger(name).removeHandler(errors)


def post(url: str, body, path: str = CHAT, **kwargs) -> httpx.Response:
    """POST a body as it is: bytes raw, anything else as JSON (NaN and lone surrogates as Python writes)."""
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(url + path, content=content, timeout=120,
                      headers={"content-type": "application/json"} | kwargs.pop("headers", {}), **kwargs)


def refused(r: httpx.Response) -> None:
    """A 4xx in OpenAI's shape, with a message and no traceback."""
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:500])
    assert r.json()["error"]["message"] and "Traceback" not in r.text


def stored(url: str, sid: str) -> list[dict]:
    """The conversation the server keeps for a session, read from its exported snapshot."""
    from floe.snapshot import header

    r = httpx.get(f"{url}/v1/sessions/{sid}/snapshot", timeout=120)
    assert r.status_code == 200, r.text
    with tempfile.NamedTemporaryFile(suffix=".safetensors") as f:
        f.write(r.content)
        f.flush()
        return json.loads(header(Path(f.name))["app"])["floe_server"]["messages"]


def metric(url: str, prefix: str) -> float:
    line = next((x for x in httpx.get(f"{url}/metrics").text.splitlines() if x.startswith(prefix)), None)
    return float(line.split()[-1]) if line else 0.0


MALFORMED = [
    b"", b"{", b'{"model": "x", "messages": [', b"not json", b"[]", b'"a string"', b"null", b"1e999",
    b"\xff\xfe{}", b"[" * 100_000 + b"]" * 100_000, b'{"a": ' * 50_000 + b"1" + b"}" * 50_000,
    json.dumps(BASE).encode()[:-1] + b', "max_tokens": 1' + b"0" * 5000 + b"}",  # past int's digit limit
    json.dumps(BASE).encode()[:-1] + b', "temperature": NaN}',
    json.dumps(BASE).encode()[:-1] + b', "temperature": Infinity}',
    json.dumps(BASE).encode()[:-1] + b', "top_p": -Infinity}',
    json.dumps(BASE).encode()[:-1] + b', "seed": NaN}',
    b'{"model": "' + MODEL_ID.encode() + b'", "messages": [{"role": "user", "content": "\xed\xa0\x80"}]}',
]

WRONG = [  # each a change to a valid request; every one is a 400 naming what is wrong
    {"model": 5}, {"model": None}, {"messages": "hi"}, {"messages": [1]}, {"messages": [[]]},
    {"messages": [{"role": "user", "content": 5}]},
    {"messages": [{"role": "user", "content": {"text": "hi"}}]}, {"messages": [{"content": "hi"}]},
    {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
    {"messages": [{"role": "user"}]},
    {"messages": [{"role": "system", "content": None}, {"role": "user", "content": "hi"}]},
    {"max_tokens": "5"}, {"max_tokens": 5.0}, {"max_tokens": True}, {"top_k": "3"}, {"seed": 1.5}, {"n": "1"},
    {"stream": "yes"}, {"stream": 1}, {"max_tokens": 1.5}, {"max_tokens": -1}, {"max_tokens": 0},
    {"max_tokens": 2**63},
    {"max_tokens": -2**63}, {"max_completion_tokens": 2**63}, {"temperature": "hot"}, {"temperature": 1e308},
    {"temperature": -1e308}, {"top_p": 1e308}, {"top_p": -1}, {"top_p": []}, {"top_k": 2**31},
    {"top_k": -1}, {"top_k": 2**64}, {"seed": 2**64}, {"seed": -2**63 - 1}, {"seed": "x"}, {"n": 2**31},
    {"n": 0}, {"stream": 2}, {"stream_options": 5}, {"stop": 5}, {"stop": ["a"] * 5},
    {"stop": [""]}, {"stop": "x" * 10_000}, {"session_id": 5}, {"session_id": ["a"]}, {"logprobs": "x"},
    {"presence_penalty": 1e308}, {"logit_bias": {"x": 1}}, {"response_format": 5}, {"tools": 5},
    {"stream_options": {"include_usage": "yes"}}, {"stream_options": {"include_usage": 1}},
]


def test_malformed_bodies_get_a_400(server):
    for body in MALFORMED:
        for path in (CHAT, "/v1/completions"):
            refused(post(server.url, body, path))


@pytest.mark.parametrize("change", WRONG, ids=lambda c: json.dumps(c)[:40])
def test_wrong_types_and_hostile_numbers_get_a_400_naming_the_field(server, change):
    r = post(server.url, BASE | change)
    refused(r)
    field = next(iter(change))
    assert field.split("_")[0] in r.json()["error"]["message"] or field == "messages", r.text


def test_a_completion_with_hostile_numbers_gets_a_400(server):
    for change in ({"max_tokens": -1}, {"max_tokens": 2**63}, {"temperature": 1e308}, {"top_k": 2**31},
                   {"prompt": 5}, {"prompt": [1, 2]}, {"prompt": ["a", "b"]}, {"prompt": "\ud800"}):
        body = {"model": MODEL_ID, "prompt": "hi", "max_tokens": 2} | change
        refused(post(server.url, body, "/v1/completions"))


@pytest.mark.parametrize("text", ["NUL \x00 inside", "\u202eRTL override\u202c and \u200f marks",
                                  "e\u0301\u0301\u0301 combining, \U0001f600 astral, \ufeff BOM",
                                  "\uffff\ufffe noncharacters"], ids=["nul", "rtl", "combining", "nonchar"])
def test_unicode_edge_cases_are_text_the_session_keeps_exactly(server, text):
    sid = f"unicode-{abs(hash(text)) % 10**8}"
    r = post(server.url, BASE | {"messages": [{"role": "user", "content": text}], "session_id": sid})
    assert r.status_code == 200, r.text
    reply = r.json()["choices"][0]["message"]["content"]
    assert stored(server.url, sid) == [{"role": "user", "content": text},
                                       {"role": "assistant", "content": reply}]


@pytest.mark.parametrize("text", ["\ud800", "tail \udfff", "\udc00\ud800 reversed pair"])
def test_lone_surrogates_get_a_400(server, text):
    refused(post(server.url, BASE | {"messages": [{"role": "user", "content": text}]}))


def test_a_1mb_message_is_a_400_and_the_server_answers_others_meanwhile(server):
    with ThreadPoolExecutor(1) as pool:
        huge = [{"role": "user", "content": "word " * 200_000}]  # 1 MB
        big = pool.submit(post, server.url, BASE | {"messages": huge})
        assert httpx.get(f"{server.url}/health", timeout=120).status_code == 200
        r = big.result()
    refused(r)
    assert r.json()["error"]["code"] == "context_length_exceeded"


HOSTILE_IDS = ["..", ".", "abc\n", "\n", "x" * 10_240, "caf\u00e9", "\u202eabc", "a\x00b", "%2e%2e",
               " ", "a b", "\ud800"[:0] + "\U0001f600", "a:b", "a*b", "-", "CON"[:0] + "~x"]


def encoded(sid: str) -> str:
    return "".join(f"%{b:02X}" for b in sid.encode())  # every byte: nothing is normalized on the way


@pytest.mark.parametrize("sid", HOSTILE_IDS, ids=lambda s: repr(s)[:20])
def test_hostile_session_ids_are_refused_on_every_route(server, sid):
    before = folder_state(server.folder.parent)
    routes = [("GET", ""), ("POST", "/freeze"), ("POST", "/thaw"), ("DELETE", ""), ("GET", "/snapshot"),
              ("PUT", "/snapshot")]
    for method, path in routes:
        r = httpx.request(method, f"{server.url}/v1/sessions/{encoded(sid)}{path}", content=b"not a snapshot",
                          timeout=60)
        refused(r)
        assert r.status_code == 400 and "session id" in r.json()["error"]["message"], (method, path, r.text)
    for url in (f"{server.url}/v1/sessions/{encoded(sid)}/fork", f"{server.url}/v1/sessions/any/fork"):
        r = httpx.post(url, json={"id": sid} if url.endswith("any/fork") else None, timeout=60)
        refused(r)
        assert r.status_code == 400 and "session id" in r.json()["error"]["message"], (url, r.text)
    for path in (CHAT, "/v1/completions"):
        body = BASE | {"session_id": sid} if path == CHAT else {"model": MODEL_ID, "prompt": "hi",
                                                                 "max_tokens": 2, "session_id": sid}
        r = post(server.url, body, path)
        assert r.status_code == 400, (path, r.text)  # a completion has no session: any id is refused
        assert "session id" in r.json()["error"]["message"] if path == CHAT else (
            r.json()["error"]["param"] == "session_id"), (path, r.text)
        raw = sid.encode("utf-8")
        if raw.strip() == raw and b"\n" not in raw and b"\x00" not in raw:  # what a header can carry
            r = post(server.url, body | {"session_id": None}, path, headers={"X-Floe-Session": raw})
            assert r.status_code == 400, (path, r.text)
    assert folder_state(server.folder.parent) == before


def raw_request(port: int, data: bytes) -> bytes:
    """Send bytes as they are and read the answer until the server closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=120) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


def test_broken_http_gets_a_4xx_or_a_clean_close(server):
    for data in (b"GARBAGE\r\n\r\n", b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                 b"Content-Length: -5\r\n\r\n", b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                 b"Content-Length: 10\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
                 b"GET /v1/sessions/a%00b HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
                 b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                 b"X-Floe-Session: \xff\xfe\r\nContent-Length: 2\r\n\r\n{}"):
        answer = raw_request(server.port, data)
        status = int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else None
        assert status is None and answer == b"" or 400 <= status < 500, answer[:300]


def flood(port: int, start: bytes, piece: bytes) -> tuple[int, bytes]:
    """Send `start`, then `piece` again and again (up to 64 MB) until the server closes: (bytes sent,
    what it answered)."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(start)
        sent, answer = 0, b""
        try:
            while sent < 64 << 20:  # (the server refuses long before)
                s.sendall(piece)
                sent += len(piece)
        except OSError:  # it closed the connection as we sent
            pass
        s.settimeout(10)
        try:
            while chunk := s.recv(65536):
                answer += chunk
        except OSError:  # (a reset: what it answered may be lost with it)
            pass
    return sent, answer


def test_a_head_past_its_bound_gets_a_431_and_others_are_served_meanwhile(server):
    """Headers streamed as fast as a client can (uvicorn's httptools protocol keeps them all: ~0.9 GB a
    second into the front for the 10 s they may take), a chunked body's trailers (kept too, for the 30 s
    its next bytes may take) or a chunk's endless extension, a URL of 1 MB, one header of 1 MB: each
    gets a 431 and its connection closes, within one read of the bound; a head just under it is served,
    and so is a request whose head and 1 MB body come in one write, and a body of 16,384 one-byte chunks
    (80 KB of framing: allowed by the chunks' count, not by the bound alone)."""
    chunked = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    for start, piece in ((b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n", b"X-Filler: " + b"a" * 1000),
                         (chunked + b"2\r\n{}\r\n0\r\n", b"X-Trailer: " + b"t" * 1000),
                         (chunked + b"2;", b"e=" + b"x" * 1000 + b";")):
        sent, answer = flood(server.port, start, (piece + b"\r\n" * piece.startswith(b"X")) * 64)
        assert sent < 8 << 20, (start, sent)  # refused within a few reads of the bound, not after 64 MB
        assert answer == b"" or answer.startswith(b"HTTP/1.1 431"), answer[:300]
    for data in (b"GET /" + b"a" * (1 << 20) + b" HTTP/1.1\r\nHost: x\r\n\r\n",
                 b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"b" * (1 << 20) + b"\r\n\r\n"):
        try:
            answer = raw_request(server.port, data)
        except ConnectionResetError:  # (refused and closed before all of it was read)
            continue
        assert answer.startswith(b"HTTP/1.1 431"), answer[:300]
        assert json.loads(answer.partition(b"\r\n\r\n")[2])["error"]["code"] == "headers_too_large"
    under = b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\nX-Big: " + b"c" * 30000 + b"\r\n\r\n"
    assert raw_request(server.port, under).startswith(b"HTTP/1.1 200"), "a 30 KB head was refused"
    body = json.dumps(BASE | {"messages": [{"role": "user", "content": "hi"}], "padding": "p" * (1 << 20)})
    head = (f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    answer = raw_request(server.port, head + body.encode())
    assert not answer.startswith(b"HTTP/1.1 431"), answer[:300]  # (the padding: a 400 of its own)
    body = json.dumps(BASE).encode()
    tiny = b"".join(b"1\r\n%c\r\n" % byte for byte in body.ljust(16384))  # (JSON ends in spaces)
    with socket.create_connection(("127.0.0.1", server.port), timeout=120) as s:
        s.sendall(chunked.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n"
                                                 b"Content-Type: application/json\r\n\r\n"))
        time.sleep(0.3)  # (the chunks in reads of their own, after the head: counted as the body's)
        for at in range(0, len(tiny), 8192):
            s.sendall(tiny[at:at + 8192])
            time.sleep(0.002)
        s.sendall(b"0\r\n\r\n")
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 200"), answer[:300]
    assert post(server.url, BASE).status_code == 200


def test_a_request_whose_head_comes_in_the_read_that_ends_the_last_body_is_not_a_431(server):
    """A keep-alive connection's next request whose head arrives in the same read as the end of the
    last one's body (pipelined; or a client sending its next request right after an upload the server
    refused before reading all of it): the next request's body count started again from 0 while the
    read's bytes were taken from the last one's, so more than 32 KiB of the last body looked like chunk
    framing: a 431 'chunks' extensions and trailers' and the connection closed. Both are answered."""
    body = json.dumps(BASE).encode().ljust(100_000)  # (JSON may end in spaces)
    request = (f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(body)}\r\n\r\n").encode() + body
    last = request.replace(b"Host: x\r\n", b"Host: x\r\nConnection: close\r\n")
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as s:
        s.sendall(request[:50_000])
        time.sleep(0.3)  # (the first body's start in reads of its own)
        s.sendall(request[50_000:] + last)
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    # (a 431's status line, not the digits: a session id may hold "431")
    assert answer.count(b"HTTP/1.1 200") == 2 and b"HTTP/1.1 431" not in answer, answer[:300]


def test_a_pipelined_request_past_its_bound_closes_the_connection_under_the_answer_before_it(server):
    """A chat pipelined with a chunked request whose trailers pass the bound while the chat is still
    being answered: the 431 was written where the chat's answer goes (after its first bytes, or as its
    status line), and the chat's answer was then written on the closed connection ('internal error',
    two tracebacks). Now the connection closes with no 431 inside the chat's answer and nothing logged."""
    errors = len(server.errors.records)
    long = json.dumps(BASE | {"max_tokens": 400, "messages": [{"role": "user", "content": LONG}]})
    chat = (f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(long)}\r\n\r\n{long}").encode()
    chunked = f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n".encode()
    chunked += b"2\r\n{}\r\n0\r\n"  # (its trailers follow)
    sent, answer = flood(server.port, chat + chunked, b"X-Trailer: " + b"t" * 1000 + b"\r\n")
    assert sent < 8 << 20 and b"HTTP/1.1 431" not in answer, answer[-300:]
    time.sleep(3.0)  # (the chat ends meanwhile, its answer going nowhere)
    assert [r.getMessage() for r in server.errors.records[errors:]] == []
    assert post(server.url, BASE).status_code == 200


def test_a_connection_pipelining_past_its_bound_is_closed_once_its_answer_is_written(server):
    """HTTP/1.1 pipelining: 20 requests in one write get 20 answers, in order; 100,000 (uvicorn's
    httptools protocol parsed every one a read held and read more after each answer: 200,000 took the
    server from 566 to 1,040 MB) get the one being answered, then the connection closes; others are
    served meanwhile."""
    get = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as s:
        s.sendall(get * 19 + get.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n"))
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    assert answer.count(b"HTTP/1.1 200") == 20, answer[-300:]
    sent, answer = flood(server.port, b"", get * 4096)
    assert sent < 16 << 20, sent  # (closed long before 64 MB)
    assert answer.count(b"HTTP/1.1 ") <= 1 + 32, answer[-300:]  # (a reset may lose even that one)
    assert b"HTTP/1.1 400" not in answer, answer[-300:]
    assert post(server.url, BASE).status_code == 200


def test_an_upgrade_to_websocket_is_answered_as_plain_http(server):
    """floe serves no WebSocket: a handshake is answered as the plain request it also is, not switched
    to a WebSocket protocol (with its own timeouts) for the app to refuse."""
    answer = raw_request(server.port, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, close\r\n"
                                      b"Upgrade: websocket\r\nSec-WebSocket-Version: 13\r\n"
                                      b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 200"), answer[:300]


def test_slow_senders_are_dropped_and_others_are_served_meanwhile(server):
    """A client sending its headers a byte at a time, one whose body trickles in, and one that sends
    nothing: the server answers a normal request meanwhile, and ends each slow one within its timeouts."""
    body = json.dumps(BASE).encode()
    head = (f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    ended: dict[str, bytes] = {}

    def slow(name: str, before: bytes, trickled: bytes) -> None:
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
            s.sendall(before)
            deadline = time.monotonic() + 3 * max(HEADER_TIMEOUT_S, BODY_TIMEOUT_S) + 30
            for byte in trickled or b"\0" * 10**6:  # nothing to send: wait
                try:
                    if trickled:
                        s.sendall(bytes([byte]))
                    s.settimeout(0.25)
                    answer = s.recv(65536)
                    ended[name] = answer  # the server answered (a 408) or closed (b"")
                    return
                except TimeoutError:
                    pass
                except OSError:  # the server closed as we sent
                    ended[name] = b""
                    return
                assert time.monotonic() < deadline, f"{name}: never dropped"
            ended[name] = b"sent it all"

    threads = [threading.Thread(target=slow, args=a) for a in
               (("headers", b"", head * 50), ("body", head, body * 50), ("silent", b"", b""))]
    for t in threads:
        t.start()
    r = post(server.url, BASE)
    assert r.status_code == 200, r.text
    for t in threads:
        t.join()
    assert set(ended) == {"headers", "body", "silent"}
    for name, answer in ended.items():
        assert answer == b"" or answer.startswith(b"HTTP/1.1 408"), (name, answer[:200])


def leave(url: str, sid: str, history: list[dict], streamed: bool) -> list[dict]:
    """Ask for a long reply in a session and hang up before it ends; what the client saw of it."""
    body = BASE | {"messages": [*history, {"role": "user", "content": LONG}], "max_tokens": 300,
                   "session_id": sid, "stream": streamed}
    for _ in range(60):  # a 503 says when to come back
        if streamed:
            with httpx.stream("POST", url + CHAT, json=body, timeout=120) as r:
                if r.status_code == 200:
                    for line in r.iter_lines():
                        chunk = json.loads(line[6:]) if line.startswith("data: {") else None
                        if chunk and chunk["choices"][0]["delta"].get("content"):
                            return history  # hung up at its first text: nothing of the turn was received
                    raise AssertionError("the stream ended before its first text")
                r.read()
                status, retry = r.status_code, r.headers.get("retry-after")
        else:
            seen = hang_up(url, body)
            if not seen:
                return history
            head, reply = seen.split(b"\r\n\r\n", 1)
            if head.startswith(b"HTTP/1.1 200"):  # it was quick: the client saw the reply
                text = json.loads(reply)["choices"][0]["message"]["content"]
                return [*history, {"role": "user", "content": LONG}, {"role": "assistant", "content": text}]
            status = int(head.split(b" ", 2)[1])
            retry = next((x.split(b":", 1)[1].strip().decode() for x in head.split(b"\r\n")
                          if x.lower().startswith(b"retry-after:")), None)
        assert status == 503 and retry, status
        BUSY.append(sid)
        time.sleep(float(retry))
    raise AssertionError(f"{sid}: busy for a minute")


def hang_up(url: str, body: dict) -> bytes:
    """Send a request, leave half a second later without reading: what had arrived by then."""
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    with socket.create_connection((host, int(port)), timeout=120) as s:
        s.sendall(f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        time.sleep(0.5)  # the request is running (or was refused)
        s.setblocking(False)
        try:
            return s.recv(1 << 20)
        except BlockingIOError:
            return b""


def turn(url: str, sid: str, history: list[dict], text: str, streamed: bool = False) -> list[dict]:
    """One turn that the client reads to its end: the history it has seen afterwards."""
    body = BASE | {"messages": [*history, {"role": "user", "content": text}], "max_tokens": 6,
                   "session_id": sid, "stream": streamed}
    for _ in range(60):  # a 503 says when to come back
        if streamed:
            with httpx.stream("POST", url + CHAT, json=body, timeout=120) as r:
                if r.status_code == 200:
                    pieces = [json.loads(x[6:])["choices"] for x in r.iter_lines() if x.startswith("data: {")]
                    assert r.is_stream_consumed
                    reply = "".join(c[0]["delta"].get("content") or "" for c in pieces if c)
                    break
                r.read()
        else:
            r = httpx.post(url + CHAT, json=body, timeout=120)
            if r.status_code == 200:
                reply = r.json()["choices"][0]["message"]["content"]
                break
        assert r.status_code == 503 and r.headers["retry-after"], (r.status_code, r.text)
        BUSY.append(sid)
        time.sleep(float(r.headers["retry-after"]))
    else:
        raise AssertionError(f"{sid}: busy for a minute")
    return [*history, {"role": "user", "content": text}, {"role": "assistant", "content": reply}]


def test_32_sessions_on_8_slots_with_30_disconnects_keep_what_their_clients_saw(server):
    """32 named sessions at once on 8 KV slots; 30 of them hang up in their second turn (half mid-stream,
    half before a plain reply) and then retry it: every session stores exactly what its client saw."""

    def client(i: int) -> tuple[str, list[dict]]:
        sid = f"crowd-{i}"
        seen = turn(server.url, sid, [], f"Say a word about the number {i}.", streamed=i % 2 == 0)
        if i < 30:
            before = seen
            seen = leave(server.url, sid, seen, streamed=i % 2 == 0)
            kept = stored(server.url, sid)
            if kept != seen and i % 2 and seen == before:
                # A plain reply that ended as its client hung up, before the front saw it go: the turn is
                # kept whole (the reply was sent), never in part; the client goes on from what it saw.
                assert kept[:-2] == seen and kept[-2] == {"role": "user", "content": LONG}, sid
                assert kept[-1]["role"] == "assistant", sid
            else:
                assert kept == seen, sid
        return sid, turn(server.url, sid, seen, "And one more?", streamed=i % 3 == 0)

    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(client, range(32)))
    for sid, seen in results:
        assert stored(server.url, sid) == seen, sid
    print(f"{len(BUSY)} requests were refused with 503 and retried after Retry-After")


def test_the_server_is_healthy_after_the_campaign(server):
    """Runs last: no 500 was counted or logged, and a normal request answers."""
    assert httpx.get(f"{server.url}/health", timeout=60).json()["status"] == "ok"
    r = post(server.url, BASE | {"max_tokens": 4})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
    assert metric(server.url, 'floe_requests_total{status="500"}') == 0
    assert [r.getMessage() for r in server.errors.records] == []
