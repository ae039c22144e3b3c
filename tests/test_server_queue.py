"""The wait queue of `floe serve`: while every KV slot runs a request, new ones wait their turn (first
come, first served) instead of a 503 at once; a 503 with Retry-After only when the queue is full."""

from __future__ import annotations

import threading

import httpx
import pytest
from test_server import CONTEXT, MODEL_ID, ThreadServer

from floe.engine import Engine
from floe.server.app import create_app


@pytest.fixture(scope="module")
def engine(default_checkpoint):
    return Engine(default_checkpoint, max_seq_len=CONTEXT, n_slots=2, weights="native")


def at_once(url: str, n: int) -> list[httpx.Response]:
    """n requests of their own sessions sent together; their responses."""
    out: list[httpx.Response | None] = [None] * n
    start = threading.Barrier(n)

    def one(i: int) -> None:
        body = {"model": MODEL_ID, "max_tokens": 24, "temperature": 0, "session_id": f"q{i}-{id(out)}",
                "messages": [{"role": "user", "content": f"Write a sentence about the number {i}."}]}
        start.wait()
        out[i] = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_requests_beyond_the_slots_wait_their_turn(engine, tmp_path):
    s = ThreadServer(create_app(engine, snapshots=tmp_path, model_id=MODEL_ID, max_waiting=8,
                                wait_seconds=300))
    try:
        responses = at_once(s.url, 6)  # 2 slots, 6 running requests: 4 wait
        assert [r.status_code for r in responses] == [200] * 6, [r.text for r in responses]
        assert all(r.json()["choices"][0]["message"]["content"] for r in responses)
        assert httpx.get(f"{s.url}/health").status_code == 200
    finally:
        s.stop()


def test_a_full_queue_answers_503_with_retry_after(engine, tmp_path):
    s = ThreadServer(create_app(engine, snapshots=tmp_path, model_id=MODEL_ID, max_waiting=1,
                                wait_seconds=300))
    try:
        responses = at_once(s.url, 6)  # 2 run, 1 waits: at least 3 are refused at once
        refused = [r for r in responses if r.status_code == 503]
        assert len(refused) >= 3 and all(r.headers.get("retry-after") for r in refused)
        assert all(r.status_code in (200, 503) for r in responses)
        assert sum(r.status_code == 200 for r in responses) >= 3
    finally:
        s.stop()
