"""The fifth hostile round against a real `floe serve` front and core on loopback: what the earlier
rounds (tests/test_server_hostile*.py) do not cover. Session routes racing on one session id (a delete
while thaws, freezes, exports and forks wait for it), every OpenAI field mixing valid and invalid
values, clients that leave in every phase of a request, pipelining and many small connections. What
must hold: no 500, a clear 4xx, no KV slot or session lost or leaked, other clients answered meanwhile,
and the server healthy afterwards."""

from __future__ import annotations

import gzip
import json
import logging
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from test_server import MODEL_ID, ThreadServer
from test_server_hostile import Errors, metric

from floe.engine import Engine
from floe.server.app import create_app

SLOTS = 4
CHAT = "/v1/chat/completions"
LOGGERS = ("floe", "uvicorn", "uvicorn.error", "asyncio")  # an ERROR record in any: a failure
LONG = "Count from 1 to 500, one number per line."
STORY = "Write a very long story about a dragon, at least 2000 words."  # (greedy: 1,500 tokens and more)


@pytest.fixture(scope="module")
def server(default_checkpoint, tmp_path_factory):
    errors = Errors()
    for name in LOGGERS:
        logging.getLogger(name).addHandler(errors)
    engine = Engine(default_checkpoint, max_seq_len=2048, n_slots=SLOTS, weights="native")
    folder = tmp_path_factory.mktemp("sessions")
    app = create_app(engine, snapshots=folder, model_id=MODEL_ID, idle_seconds=3600, wait_seconds=5.0)
    s = ThreadServer(app, header_timeout_s=2.0, body_timeout_s=3.0, send_timeout_s=3.0)
    s.errors, s.app, s.folder = errors, app, folder
    yield s
    s.stop()
    for name in LOGGERS:
        logging.getLogger(name).removeHandler(errors)


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


def test_the_server_is_healthy_after_the_round(server):
    """Runs last: no 500 was counted or logged, and a normal request answers."""
    assert httpx.get(f"{server.url}/health", timeout=60).json()["status"] == "ok"
    assert chat(server.url, "last", max_tokens=4).status_code == 200
    assert metric(server.url, 'floe_requests_total{status="500"}') == 0
    assert [r.getMessage() for r in server.errors.records] == []
