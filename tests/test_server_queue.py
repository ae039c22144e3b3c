"""The wait queue of `floe serve`: while every KV slot runs a request, new ones wait their turn (first
come, first served) instead of a 503 at once; a 503 with Retry-After only when the queue is full."""

from __future__ import annotations

import json
import threading
import time

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


def test_one_key_cannot_keep_another_out_of_the_queue_or_behind_all_its_requests(engine, tmp_path):
    """Key A fills both slots and the whole queue with long requests; key B's short one still gets a
    place (A's newest waiting request gives it up: a 503 that says why) and the next free slot (B holds
    none, A holds two), not the place behind every request of A's."""
    s = ThreadServer(create_app(engine, snapshots=tmp_path, model_id=MODEL_ID, max_waiting=3,
                                wait_seconds=300, keys=("key-a", "key-b")))
    store = s.server.config.app.state.core.store
    done: list[str] = []
    answers: dict[str, httpx.Response] = {}
    lock = threading.Lock()

    def ask(name: str, key: str, tokens: int) -> None:
        body = {"model": MODEL_ID, "max_tokens": tokens, "temperature": 0, "session_id": name,
                "messages": [{"role": "user", "content": "Count from 1 to 500, one number per line."}]}
        r = httpx.post(f"{s.url}/v1/chat/completions", json=body, timeout=300,
                       headers={"Authorization": f"Bearer {key}"})
        with lock:
            done.append(name)
            answers[name] = r

    try:
        threads = [threading.Thread(target=ask, args=(f"a{i}", "key-a", 48)) for i in range(5)]
        for t in threads:
            t.start()
        deadline = time.time() + 120
        while store.waiting < 3:  # 2 run, 3 wait: the queue is full
            assert time.time() < deadline, "key A's requests never filled the queue"
            time.sleep(0.01)
        b = threading.Thread(target=ask, args=("b", "key-b", 2))
        b.start()
        for t in [*threads, b]:
            t.join()
        assert answers["b"].status_code == 200, answers["b"].text
        bumped = [n for n, r in answers.items() if r.status_code == 503]
        assert len(bumped) == 1 and bumped[0].startswith("a"), {n: r.status_code for n, r in answers.items()}
        assert "another API key" in answers[bumped[0]].json()["error"]["message"]
        assert answers[bumped[0]].headers.get("retry-after")
        # B went next: before the two of A's that were still waiting when it came
        served_a = [n for n in done if n.startswith("a") and answers[n].status_code == 200]
        assert done.index("b") < done.index(served_a[-2]), done
    finally:
        s.stop()


BAD_SCHEMA = {"type": "json_schema", "json_schema": {"name": "x",
                                                     "schema": {"type": "string", "maxLength": -1}}}
CITY = {"type": "json_schema", "json_schema": {"name": "city", "schema": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}}}


LONG_CONTEXT = 2048  # room for streams that run for seconds (~100 tokens/s each on the CPU)


@pytest.fixture(scope="module")
def long_engine(default_checkpoint):
    return Engine(default_checkpoint, max_seq_len=LONG_CONTEXT, n_slots=2, weights="native")


class RunningStreams:
    """Streamed requests of sessions `names`, each running (its first text arrived) until `leave(name)`:
    its client hangs up and its turn stops."""

    def __init__(self, url: str, names: list[str]) -> None:
        self.started = {n: threading.Event() for n in names}
        self.left = {n: threading.Event() for n in names}
        self.threads = [threading.Thread(target=self._run, args=(url, n)) for n in names]
        for t in self.threads:
            t.start()
        for n, e in self.started.items():
            assert e.wait(120), f"stream {n} never started"

    def _run(self, url: str, name: str) -> None:
        body = {"model": MODEL_ID, "max_tokens": LONG_CONTEXT - 64, "temperature": 0, "session_id": name,
                "stream": True, "messages": [{"role": "user", "content": "Write the numbers from 1 to 1000 "
                                              "separated by commas."}]}
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=300) as r:
            for line in r.iter_lines():  # read on (a client that stops reading is one that left)
                chunk = json.loads(line[6:]) if line.startswith("data: {") else None
                if chunk and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    self.started[name].set()
                if self.left[name].is_set():
                    break  # hangs up
        self.started[name].set()  # (also a stream that ended or failed: the test sees it is not running)

    def leave(self, name: str) -> None:
        self.left[name].set()

    def close(self) -> None:
        for n in self.left:
            self.leave(n)
        for t in self.threads:
            t.join()


def structured(url: str, response_format: dict, max_tokens: int = 32,
               sid: str | None = None) -> httpx.Response:
    body = {"model": MODEL_ID, "max_tokens": max_tokens, "temperature": 0, "response_format": response_format,
            "messages": [{"role": "user", "content": "Name a city in France."}]}
    return httpx.post(f"{url}/v1/chat/completions", json=body | ({"session_id": sid} if sid else {}),
                      timeout=300)


def test_a_schema_that_cannot_be_used_is_a_400_also_while_every_slot_runs_a_stream(long_engine, tmp_path):
    """With every slot running, a hostile schema was a 503: its grammar actor asked for a slot before
    the guest could call the schema invalid. It is checked before it takes anything now."""
    s = ThreadServer(create_app(long_engine, snapshots=tmp_path, model_id=MODEL_ID, max_waiting=8,
                                wait_seconds=300))
    store = s.server.config.app.state.core.store
    try:
        idle = [structured(s.url, BAD_SCHEMA), structured(s.url, CITY, max_tokens=2)]
        assert [r.status_code for r in idle] == [400, 400], [r.text for r in idle]
        assert [r.json()["error"]["code"] for r in idle] == ["unsupported_schema", "max_tokens_too_small"]
        before = store.counts()
        streams = RunningStreams(s.url, ["s0", "s1"])
        try:
            busy = [structured(s.url, BAD_SCHEMA), structured(s.url, CITY, max_tokens=2)]
            assert [r.status_code for r in busy] == [400, 400], [r.text for r in busy]
            assert all(store.get(n).lock.locked() for n in ("s0", "s1")), "a stream ended before the check"
            assert [r.json() for r in busy] == [r.json() for r in idle]
            # Refused before taking anything: no session made, no place in the queue.
            assert store.counts()["frozen"] == before["frozen"] and store.waiting == 0
        finally:
            streams.close()
    finally:
        s.stop()


def test_a_valid_schema_while_every_slot_runs_a_stream_waits_for_its_slots(long_engine, tmp_path):
    """A structured turn needs two slots (its session's and its grammar actor's): while every slot runs
    a stream it waits for the first in the queue, then for the second, as any request waits, and is
    answered."""

    s = ThreadServer(create_app(long_engine, snapshots=tmp_path, model_id=MODEL_ID, max_waiting=8,
                                wait_seconds=300))
    store = s.server.config.app.state.core.store
    answer: list[httpx.Response] = []
    streams = RunningStreams(s.url, ["s0", "s1"])
    try:
        asking = threading.Thread(target=lambda: answer.append(structured(s.url, CITY, sid="city")))
        asking.start()

        def until(done, what: str) -> None:
            deadline = time.time() + 120
            while not done():
                assert time.time() < deadline, what
                time.sleep(0.01)

        until(lambda: store.waiting == 1, "the structured request never waited for its session's slot")
        streams.leave("s0")  # its slot goes to the structured request's session; its grammar actor waits
        until(lambda: "city" in {x.id for x in store.sessions.values() if x.live} and store.waiting == 1,
              "the structured turn never waited for its grammar actor's slot")
        assert store.get("s1").lock.locked() and not answer
        streams.leave("s1")
        asking.join()
        (r,) = answer
        assert r.status_code == 200, r.text
        assert set(json.loads(r.json()["choices"][0]["message"]["content"])) == {"city"}
    finally:
        streams.close()
        s.stop()
