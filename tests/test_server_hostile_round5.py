"""The fifth hostile round against a real `floe serve` front and core on loopback: what the earlier
rounds (tests/test_server_hostile*.py) do not cover. Session routes racing on one session id (a delete
while thaws, freezes, exports and forks wait for it), every OpenAI field mixing valid and invalid
values, clients that leave in every phase of a request, pipelining and many small connections. What
must hold: no 500, a clear 4xx, no KV slot or session lost or leaked, other clients answered meanwhile,
and the server healthy afterwards."""

from __future__ import annotations

import gzip
import json
import re
import socket
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from test_server import MODEL_ID, ThreadServer
from test_server_hostile import logged_errors, metric

from floe.engine import Engine
from floe.server.app import create_app

SLOTS = 4
CHAT = "/v1/chat/completions"
LONG = "Count from 1 to 500, one number per line."
STORY = "Write a very long story about a dragon, at least 2000 words."  # (greedy: 1,500 tokens and more)


@pytest.fixture(scope="module")
def server(default_checkpoint, tmp_path_factory):
    with logged_errors() as errors:
        engine = Engine(default_checkpoint, max_seq_len=2048, n_slots=SLOTS, weights="native")
        folder = tmp_path_factory.mktemp("sessions")
        app = create_app(engine, snapshots=folder, model_id=MODEL_ID, idle_seconds=3600, wait_seconds=5.0)
        s = ThreadServer(app, header_timeout_s=2.0, body_timeout_s=3.0, send_timeout_s=3.0)
        s.errors, s.app, s.folder = errors, app, folder
        yield s
        s.stop()


def chat(url: str, sid: str | None, text: str = "hi", max_tokens: int = 2, **fields) -> httpx.Response:
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "temperature": 0} | ({"session_id": sid} if sid else {}) | fields
    return httpx.post(url + CHAT, json=body, timeout=120)


def streaming(url: str, sid: str, started: threading.Event, max_tokens: int = 80) -> int:
    """A long streamed turn of session `sid` read to its end, `started` set at its first line (the
    session is held by it then)."""
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": LONG}], "max_tokens": max_tokens,
            "temperature": 0, "session_id": sid, "stream": True}
    with httpx.stream("POST", url + CHAT, json=body, timeout=120) as r:
        for _ in r.iter_lines():
            started.set()
    return r.status_code


def every_slot_answers(url: str, tag: str) -> None:
    """As many new sessions as the server has KV slots, one after another, each answered: no slot is
    held by an actor the server no longer knows of."""
    for i in range(SLOTS):
        r = chat(url, f"{tag}-{i}")
        assert r.status_code == 200, (i, r.text)


def test_requests_waiting_for_a_session_a_delete_removes_never_bring_it_back_or_hold_a_slot(server):
    """A live session running a turn; a DELETE and thaws, freezes, exports and forks of it wait for it.
    Those the delete went before held a session the server no longer knew of: a thaw made it live
    again in a KV slot nothing would ever free (four such and no new session could start: every chat
    a 500 'all 4 KV cache slots are in use'), a freeze or an export was a 400 'no state yet'. Now each
    is 404 session_not_found (or ran before the delete), the session stays deleted, and every slot
    takes a new session afterwards."""
    routes = [("DELETE", "")] + [("POST", "/thaw")] * 4 + [("POST", "/freeze"), ("GET", "/snapshot"),
                                                           ("POST", "/fork")]
    with ThreadPoolExecutor(len(routes) + 1) as pool:
        for round_ in range(3):
            sid = f"doomed-{round_}"
            assert chat(server.url, sid).status_code == 200
            started = threading.Event()
            turn = pool.submit(streaming, server.url, sid, started)
            assert started.wait(60)
            waiting = []
            for method, path in routes:
                waiting.append(pool.submit(httpx.request, method, f"{server.url}/v1/sessions/{sid}{path}",
                                           timeout=120))
                time.sleep(0.05)  # (the delete waits first)
            assert turn.result() == 200
            answers = [f.result() for f in waiting]
            assert answers[0].status_code == 200, answers[0].text
            for (method, path), r in zip(routes, answers, strict=True):
                assert r.status_code in (200, 404), (method, path, r.status_code, r.text)
                if r.status_code == 404:
                    assert r.json()["error"]["code"] == "session_not_found", r.text
            assert httpx.get(f"{server.url}/v1/sessions/{sid}", timeout=60).status_code == 404
    every_slot_answers(server.url, "after-delete")


@pytest.mark.parametrize("path", [CHAT, "/v1/completions", "/v1/sessions/typed/fork"])
def test_a_json_body_sent_as_a_form_text_or_compressed_is_a_400_saying_so(server, path):
    """`curl -d '{...}'` sends its JSON as application/x-www-form-urlencoded, which FastAPI does not read
    as JSON: the answer was `body: Input should be a valid dictionary or object to extract fields from`;
    a gzip body 'There was an error parsing the body'. Now each 400 says what to send; the same body
    as JSON (a charset too) is answered."""
    assert chat(server.url, "typed").status_code == 200
    bodies = {CHAT: {"model": MODEL_ID, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
              "/v1/completions": {"model": MODEL_ID, "max_tokens": 2, "prompt": "hi"},
              "/v1/sessions/typed/fork": {"id": "typed-fork"}}
    data = json.dumps(bodies[path]).encode()
    for kind in ("application/x-www-form-urlencoded", "text/plain"):
        r = httpx.post(server.url + path, content=data, headers={"content-type": kind}, timeout=120)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", r.text
        assert "Content-Type: application/json" in r.json()["error"]["message"] and kind in r.text, r.text
    r = httpx.post(server.url + path, content=gzip.compress(data), timeout=120,
                   headers={"content-type": "application/json", "content-encoding": "gzip"})
    assert r.status_code == 400 and "Content-Encoding 'gzip'" in r.json()["error"]["message"], r.text
    r = httpx.post(server.url + path, content=data, timeout=120,
                   headers={"content-type": "application/json; charset=utf-8"})
    assert r.status_code == 200, r.text


def hog(url: str, sid: str, started: threading.Event, stop: threading.Event) -> None:
    """A long streamed turn that holds its KV slot until `stop` (then its client leaves)."""
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": STORY}], "max_tokens": 1500,
            "temperature": 0, "session_id": sid, "stream": True}
    with httpx.stream("POST", url + CHAT, json=body, timeout=120) as r:
        for _ in r.iter_lines():
            started.set()
            if stop.is_set():
                return


@pytest.mark.parametrize("waits_for", ["slot", "session"])
def test_requests_whose_clients_left_while_waiting_give_their_places_up(server, waits_for):
    """Every slot runs a turn (or one session does); eight chats (of that session) are sent and their
    clients leave at once (a client with a short timeout, retrying). They kept their places among the
    waiters until their wait ended or a slot (the session) freed, and every other client's request was
    a 503 ('all 4 KV slots are busy ... and 8 more wait', 'session_busy') meanwhile; then each ran a
    turn for nobody. Now a request whose client left gives its place up: the next client's request
    waits its turn and is answered."""
    sid = "busy-one" if waits_for == "session" else None
    data = json.dumps({"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
                      | ({"session_id": sid} if sid else {})).encode()
    ghost = (f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
             f"Content-Length: {len(data)}\r\n\r\n").encode() + data
    stop = threading.Event()
    with ThreadPoolExecutor(SLOTS + 1) as pool:
        starts = [threading.Event() for _ in range(SLOTS if sid is None else 1)]
        hogs = [pool.submit(hog, server.url, sid or f"hog-{i}", started, stop)
                for i, started in enumerate(starts)]
        try:
            assert all(started.wait(60) for started in starts)
            for _ in range(8):
                with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
                    s.sendall(ghost)
                    time.sleep(0.05)
            time.sleep(1.0)  # (the front has seen them leave)
            waiting = pool.submit(chat, server.url, sid or "patient")
            time.sleep(0.5)
            assert not waiting.done(), waiting.result().text  # it waits its turn, not a 503
        finally:
            stop.set()
        for f in hogs:
            f.result()
        r = waiting.result()
    assert r.status_code == 200, r.text
    assert metric(server.url, "floe_waiting_requests") == 0


def stored_in(data: bytes) -> list[dict]:
    """The conversation a snapshot file holds."""
    from floe.snapshot import header

    with tempfile.NamedTemporaryFile(suffix=".safetensors") as f:
        f.write(data)
        f.flush()
        return json.loads(header(Path(f.name))["app"])["floe_server"]["messages"]


def stored(url: str, sid: str) -> list[dict]:
    """The conversation the server keeps for a session, read from its exported snapshot."""
    r = httpx.get(f"{url}/v1/sessions/{sid}/snapshot", timeout=60)
    assert r.status_code == 200, r.text
    return stored_in(r.content)


def nested_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def rf(schema) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}


F = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
REFUSED = [  # each a change to a valid chat: a 4xx naming the field (param or message), never a 500
    ({"n": 2}, "n"), ({"n": -1}, "n"), ({"n": None}, "n"), ({"n": True}, "n"),
    ({"logit_bias": {"99999999999999999999": 100}}, "logit_bias"),
    ({"logit_bias": {"-1": -100}}, "logit_bias"),
    ({"logit_bias": {"1.5": 1}}, "logit_bias"), ({"logit_bias": []}, "logit_bias"),
    ({"stop": ["\ud800"]}, "stop"), ({"stop": [None]}, "stop"), ({"stop": ["a", ["b"]]}, "stop"),
    ({"stop": {"a": 1}}, "stop"), ({"stop": ["x" * 257]}, "stop"), ({"stop": ["a"] * 5}, "stop"),
    ({"seed": -2}, "seed"), ({"seed": 2**63}, "seed"), ({"seed": -2**63}, "seed"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"max_completion_tokens": "3"}, "max_completion_tokens"),
    ({"max_completion_tokens": 100_000, "max_tokens": 3}, "max_tokens"),
    ({"tools": [None]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "a" * 65}}]}, "tools"),
    ({"tools": [F, F]}, "tools"), ({"tools": [F], "tool_choice": 5}, "tool_choice"),
    ({"tools": [F], "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ({"tools": [F], "tool_choice": ["required"]}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [F], "response_format": {"type": "json_object"}}, "response_format"),
    (rf(nested_schema(300)), "response_format"), (rf(nested_schema(100)), "response_format"),
    (rf({"$ref": "#"}), "response_format"), (rf({"$ref": "http://example.com/s.json"}), "response_format"),
    (rf({"type": "object", "properties": {"a": {"$ref": "#/properties/a"}}, "required": ["a"]}),
     "response_format"),
    (rf({"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(3000)}}),
     "conversation"),
    (rf({"anyOf": [{"anyOf": [{"type": "null"}] * 50}] * 50}), "conversation"),
    (rf({"type": "string", "pattern": "a{99999999999999999999}"}), "response_format"),
    (rf({"type": "string", "minLength": 10**30}), "response_format"), (rf({"enum": []}), "response_format"),
    ({"stream_options": []}, "stream_options"), ({"stream_options": "x"}, "stream_options"),
    ({"stream_options": {"include_usage": None}}, "stream_options"),
]
ANSWERED = [  # valid values at the edges: answered
    {"n": 1}, {"logit_bias": {}}, {"logit_bias": None}, {"stop": []}, {"stop": ["a", "b", "c", "d"]},
    {"stop": ["\U0001f600"]}, {"stop": ["\u0301"]}, {"stop": ["\x00"]}, {"stop": ["<|im_end|>"]},
    {"seed": -1}, {"seed": 2**63 - 1}, {"max_completion_tokens": 3, "max_tokens": 100_000}, {"tools": []},
    {"tool_choice": "none"},
    {"stream_options": {"include_usage": True, "other": 1}}, {"stream": True, "stream_options": None},
]


def test_every_openai_field_with_a_hostile_value_is_a_4xx_naming_it_and_edge_values_are_answered(server):
    for change, field in REFUSED:
        for stream in (False, True):
            body = {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                    "temperature": 0, "stream": stream} | change
            r = httpx.post(server.url + CHAT, content=json.dumps(body).encode(), timeout=120,
                           headers={"content-type": "application/json"})  # (a lone surrogate escaped)
            assert 400 <= r.status_code < 500, (change, stream, r.status_code, r.text[:300])
            error = r.json()["error"]
            assert field in f"{error['param']} {error['message']}", (change, r.text[:300])
    for change in ANSWERED:
        body = {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                "temperature": 0} | change
        r = httpx.post(server.url + CHAT, json=body, timeout=120)
        assert r.status_code == 200 and "error" not in r.text, (change, r.text[:300])


def test_a_completion_refuses_a_chats_fields_rather_than_ignore_them(server):
    """/v1/completions took a chat's `max_completion_tokens` (and `messages`) and ignored them: 100,000
    asked, 16 written, 0 taken. Now each is a 400 unsupported_parameter naming it; max_tokens is its
    length."""
    for change in ({"max_completion_tokens": 3}, {"max_completion_tokens": 0},
                   {"max_completion_tokens": 100_000, "max_tokens": 3},
                   {"messages": [{"role": "user", "content": "hi"}]}):
        body = {"model": MODEL_ID, "prompt": "Once upon a time", "max_tokens": 2} | change
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_parameter", (change, r.text)
        assert r.json()["error"]["param"] == next(iter(change)), r.text
    r = httpx.post(server.url + "/v1/completions", timeout=120, json={
        "model": MODEL_ID, "prompt": "Once upon a time", "max_tokens": 3, "max_completion_tokens": None})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 3, r.text


@pytest.mark.parametrize("sid", ["a.lease", "x.y.lease", "\u0430dmin", "a\u200bb", "a%2e%2e", "a\\..\\b"],
                         ids=["lease", "lease2", "cyrillic", "zero-width", "percent", "backslashes"])
def test_a_session_id_the_store_cannot_name_is_a_400_on_every_route(server, sid):
    """An id ending in `.lease` (a lease record's name beside a snapshot), a confusable letter, a
    zero-width space, a percent sign or a backslash: a 400 naming the session id on every route that
    takes one, and nothing is made."""
    path = "".join(f"%{b:02X}" for b in sid.encode())
    for method, route, body in [("GET", "", None), ("POST", "/freeze", None), ("POST", "/thaw", None),
                                ("DELETE", "", None), ("GET", "/snapshot", None), ("PUT", "/snapshot", b"x"),
                                ("POST", "/fork", None)]:
        r = httpx.request(method, f"{server.url}/v1/sessions/{path}{route}", content=body, timeout=60)
        assert r.status_code == 400 and "session id" in r.json()["error"]["message"], (method, route, r.text)
    assert chat(server.url, "fork-source").status_code == 200
    r = httpx.post(f"{server.url}/v1/sessions/fork-source/fork", json={"id": sid}, timeout=60)
    assert r.status_code == 400 and "session id" in r.json()["error"]["message"], r.text
    r = chat(server.url, sid)
    assert r.status_code == 400 and "session id" in r.json()["error"]["message"], r.text


def test_uploads_cut_short_padded_or_bent_change_nothing(server):
    """A session's exported snapshot uploaded cut short (by one byte, to its header, to nothing),
    padded, doubled, with a flipped last byte or a lying header length, over its own session and as a
    new one: each a 400 snapshot_invalid; the session is as it was and no new one is made."""
    assert chat(server.url, "upload-source", max_tokens=3).status_code == 200
    data = httpx.get(f"{server.url}/v1/sessions/upload-source/snapshot", timeout=60).content
    before = httpx.get(f"{server.url}/v1/sessions/upload-source", timeout=60).json()
    header = 8 + int.from_bytes(data[:8], "little")
    bent = {"empty": b"", "one-byte": data[:1], "header": data[:header], "half": data[:len(data) // 2],
            "less-one": data[:-1], "padded": data + b"x" * 1000, "doubled": data + data,
            "flipped": data[:-1] + bytes([data[-1] ^ 1]),
            "header-length": (2**63).to_bytes(8, "little") + data[8:]}
    for name, body in bent.items():
        for sid in ("upload-source", f"upload-{name}"):
            r = httpx.put(f"{server.url}/v1/sessions/{sid}/snapshot", content=body, timeout=60)
            assert r.status_code == 400 and r.json()["error"]["code"] == "snapshot_invalid", (name, r.text)
            if sid != "upload-source":
                assert httpx.get(f"{server.url}/v1/sessions/{sid}", timeout=60).status_code == 404, name
    after = httpx.get(f"{server.url}/v1/sessions/upload-source", timeout=60).json()
    assert (after["messages"], after["snapshot_bytes"]) == (before["messages"], len(data))
    assert stored(server.url, "upload-source") == stored_in(data)


def leave_in(port: int, phase: str, request: bytes) -> None:
    """Send part of a request and hang up (half of them with a reset): `phase` says where."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        if phase.endswith("reset"):
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        head, _, body = request.partition(b"\r\n\r\n")
        if phase.startswith("head"):
            s.sendall(head[: len(head) // 2])
        elif phase.startswith("headers"):
            s.sendall(head + b"\r\n\r\n")
        elif phase.startswith("half-body"):
            s.sendall(head + b"\r\n\r\n" + body[: len(body) // 2])
        else:  # the whole request; leave at once, or at the first event of a stream
            s.sendall(request)
            if phase.startswith("first-event"):
                seen = b""
                while b"data: {" not in seen and (chunk := s.recv(4096)):
                    seen += chunk
        time.sleep(0.05)


def test_clients_leaving_in_every_phase_leave_nothing_and_others_stream_meanwhile(server):
    """Chats, streams, uploads and exports whose clients hang up (closing or resetting) after half the
    head, after the headers, after half the body, after the whole request, after a stream's first
    event, while two other clients stream: those streams end whole; no upload made or changed a
    session; the session uploaded over is as it was; every KV slot takes a new session afterwards."""
    assert chat(server.url, "kept", max_tokens=3).status_code == 200
    kept = httpx.get(f"{server.url}/v1/sessions/kept/snapshot", timeout=60).content

    def request(i: int, stream: bool) -> bytes:
        data = json.dumps({"model": MODEL_ID, "messages": [{"role": "user", "content": LONG}],
                           "max_tokens": 40, "session_id": f"gone-{i}", "stream": stream}).encode()
        return (f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(data)}\r\n\r\n").encode() + data

    def upload(sid: str) -> bytes:
        return (f"PUT /v1/sessions/{sid}/snapshot HTTP/1.1\r\nHost: x\r\n"
                f"Content-Length: {len(kept)}\r\n\r\n").encode() + kept

    export = b"GET /v1/sessions/kept/snapshot HTTP/1.1\r\nHost: x\r\n\r\n"
    phases = [f"{p}{end}" for p in ("head", "headers", "half-body", "whole", "first-event")
              for end in ("", "-reset")]
    jobs = [(p, request(i, p.startswith("first-event"))) for i, p in enumerate(phases)]
    jobs += [(p, upload(f"gone-upload-{i}")) for i, p in enumerate(phases[:6])]
    jobs += [(p, upload("kept")) for p in ("half-body", "half-body-reset")] + [("whole", export)]

    def bystander(i: int) -> str:
        body = {"model": MODEL_ID, "messages": [{"role": "user", "content": "Name some colours."}],
                "max_tokens": 30, "temperature": 0, "stream": True, "session_id": f"bystander-{i}"}
        with httpx.stream("POST", server.url + CHAT, json=body, timeout=120) as r:
            return [line for line in r.iter_lines() if line][-1]

    with ThreadPoolExecutor(8) as pool:
        streams = [pool.submit(bystander, i) for i in range(2)]
        list(pool.map(lambda job: leave_in(server.port, *job), jobs))
        assert [f.result() for f in streams] == ["data: [DONE]"] * 2
    time.sleep(1.0)  # (the core has seen them all leave)
    listed = httpx.get(f"{server.url}/v1/sessions", timeout=60).json()["data"]
    assert not [s["id"] for s in listed if s["id"].startswith("gone-upload")]
    assert stored(server.url, "kept") == stored_in(kept)
    assert metric(server.url, "floe_waiting_requests") == 0
    every_slot_answers(server.url, "after-leaving")


def test_forks_into_one_id_and_chats_making_it_make_it_once(server):
    """Four forks into one new id and two chats that make a session of that id, at once: one fork
    makes it (the others 409 session_exists, or it is the chats' and every fork is a 409); the chats
    are answered; the id is one session afterwards."""
    assert chat(server.url, "twin-source", max_tokens=3).status_code == 200
    with ThreadPoolExecutor(6) as pool:
        forks = [pool.submit(httpx.post, f"{server.url}/v1/sessions/twin-source/fork", json={"id": "twin"},
                             timeout=120) for _ in range(4)]
        chats = [pool.submit(chat, server.url, "twin", "make me") for _ in range(2)]
        forked = [f.result() for f in forks]
        assert [c.result().status_code for c in chats] == [200, 200]
    statuses = sorted(r.status_code for r in forked)
    assert statuses in ([200, 409, 409, 409], [409] * 4), [r.text for r in forked]
    assert all(r.json()["error"]["code"] == "session_exists" for r in forked if r.status_code == 409)
    listed = httpx.get(f"{server.url}/v1/sessions", timeout=60).json()["data"]
    assert [s["id"] for s in listed].count("twin") == 1


def test_many_small_connections_at_once_are_answered_or_timed_out_and_others_served(server):
    """600 connections at once: health checks pipelined five deep, session listings, chats of one
    token, and connections that say nothing: each answered (a chat maybe 503) or, saying nothing,
    closed with a 408 by the header deadline; a chat meanwhile is answered."""
    data = json.dumps({"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
    requests = [b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n" * 4 + b"GET /health HTTP/1.1\r\nHost: x\r\n"
                b"Connection: close\r\n\r\n",
                b"GET /v1/sessions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
                (f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n{data}").encode(), b""]

    def one(i: int) -> list[int]:
        with socket.create_connection(("127.0.0.1", server.port), timeout=60) as s:
            s.sendall(requests[i % 4])
            answer = b""
            while chunk := s.recv(65536):
                answer += chunk
        return [int(status) for status in re.findall(rb"HTTP/1\.1 (\d{3}) ", answer)]

    with ThreadPoolExecutor(200) as pool:
        answers = list(pool.map(one, range(600)))
    for i, statuses in enumerate(answers):
        expected = {0: [200] * 5, 1: [200], 3: [408]}.get(i % 4)
        assert statuses == expected if expected else statuses in ([200], [503]), (i, statuses)
    assert chat(server.url, "after-crowd").status_code == 200


def test_an_upload_that_waited_for_a_session_a_delete_removed_is_not_lost_to_its_ids_next_session(
        server, monkeypatch):
    """An upload waits for session X while a DELETE holds it; the delete drops X, and a chat makes a
    new X before the upload goes on. The upload wrote its snapshot under the dropped X (answered 200)
    while the new X, live, stayed what the chat made and overwrote it at its next freeze: the upload
    was lost. Now the upload goes to the X there is then, and it is what X holds afterwards (the delete
    is held open here, between its drop and its end, for the chat to come in)."""
    lifecycle = server.app.state.core.store.lifecycle
    forget = lifecycle.forget_locked
    holding, dropped, go_on = threading.Event(), threading.Event(), threading.Event()

    def slow_forget(session):
        holding.set()
        time.sleep(0.5)  # (the upload comes in and waits for the session)
        try:
            return forget(session)
        finally:
            dropped.set()
            go_on.wait(30)

    assert chat(server.url, "upload-src", "Say something about the sea.", max_tokens=3).status_code == 200
    data = httpx.get(f"{server.url}/v1/sessions/upload-src/snapshot", timeout=60).content
    assert chat(server.url, "contested", max_tokens=3).status_code == 200
    monkeypatch.setattr(lifecycle, "forget_locked", slow_forget)
    with ThreadPoolExecutor(2) as pool:
        deleted = pool.submit(httpx.delete, f"{server.url}/v1/sessions/contested", timeout=60)
        assert holding.wait(30)
        uploaded = pool.submit(httpx.put, f"{server.url}/v1/sessions/contested/snapshot", content=data,
                               timeout=60)
        assert dropped.wait(30)
        try:
            assert chat(server.url, "contested", "made after the delete").status_code == 200
        finally:
            go_on.set()
        assert deleted.result().status_code == 200
        assert uploaded.result().status_code == 200, uploaded.result().text
    monkeypatch.undo()
    assert stored(server.url, "contested") == stored_in(data)
    assert httpx.get(f"{server.url}/v1/sessions/contested", timeout=60).json()["messages"] == 2


HI = {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}


def test_a_request_naming_two_sessions_is_a_400_naming_both_and_one_named_twice_is_answered(server):
    """Two X-Floe-Session headers of different values: the first was used, silently; a header and a
    body's session_id that differ: the header. Now each is a 400 naming the header and both ids, and
    nothing is made; the same id twice (or in the header and the body) is that one session."""
    twice = [("X-Floe-Session", "twice-a"), ("X-Floe-Session", "twice-b")]
    for headers, extra in [(twice, {}), (twice[:1], {"session_id": "twice-b"})]:
        for stream in (False, True):
            r = httpx.post(server.url + CHAT, json=HI | extra | {"stream": stream}, headers=headers,
                           timeout=120)
            assert r.status_code == 400 and r.json()["error"]["param"] == "session_id", r.text
            message = r.json()["error"]["message"]
            assert "X-Floe-Session" in message and "'twice-a'" in message and "'twice-b'" in message, message
    for sid in ("twice-a", "twice-b"):
        assert httpx.get(f"{server.url}/v1/sessions/{sid}", timeout=60).status_code == 404
    for headers, extra in [(twice[:1] * 2, {}), (twice[:1], {"session_id": "twice-a"})]:
        r = httpx.post(server.url + CHAT, json=HI | extra, headers=headers, timeout=120)
        assert r.status_code == 200 and r.json()["session_id"] == "twice-a", r.text
        assert r.headers["x-floe-session"] == "twice-a"
    assert httpx.get(f"{server.url}/v1/sessions/twice-a", timeout=60).status_code == 200


@pytest.mark.parametrize("sid", ["\u0430dmin", "caf\u00e9", "a\U0001f600"],
                         ids=["cyrillic", "accent", "emoji"])
def test_a_non_ascii_session_id_in_the_header_is_refused_as_the_same_id_in_the_body(server, sid):
    """The header's UTF-8 was read as latin-1: 'caf\u00e9' was refused as 'cafÃ©'. Now its 400 is the
    body's for the same id, showing it as sent; bytes that are not UTF-8 show as escapes."""
    in_body = chat(server.url, sid)
    in_header = httpx.post(server.url + CHAT, json=HI, headers={"X-Floe-Session": sid.encode()}, timeout=120)
    assert in_body.status_code == in_header.status_code == 400, (in_body.text, in_header.text)
    assert in_header.json()["error"] == in_body.json()["error"], (in_header.text, in_body.text)
    assert repr(sid) in in_header.json()["error"]["message"], in_header.text
    r = httpx.post(server.url + CHAT, json=HI, headers={"X-Floe-Session": sid.encode()[:-1] + b"\xff"},
                   timeout=120)
    assert r.status_code == 400 and "\\\\xff" in r.json()["error"]["message"], r.text


def test_the_server_is_healthy_after_the_round(server):
    """Runs last: no 500 was counted or logged, and a normal request answers."""
    assert httpx.get(f"{server.url}/health", timeout=60).json()["status"] == "ok"
    assert chat(server.url, "last", max_tokens=4).status_code == 200
    assert metric(server.url, 'floe_requests_total{status="500"}') == 0
    assert [r.getMessage() for r in server.errors.records] == []
