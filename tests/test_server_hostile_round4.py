"""The fourth hostile round: a server of several models (floe.server.models) on loopback, front and core
as `floe serve` runs them, attacked through its sessions, snapshots and model routes. What must hold: no
500, a clear 4xx that changes nothing, every other session and key unaffected, healthy afterwards."""

from __future__ import annotations

import contextlib
import json
import signal
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
import pytest
from gguf import GGMLQuantizationType as Q
from models import write_gguf
from test_server import MODEL_ID, ThreadServer, free_port, start_serve
from test_server_hostile import logged_errors, refused

from floe.engine import Engine
from floe.model import load_checkpoint
from floe.server.app import app_of
from floe.server.core import ServeCore
from floe.server.models import ModelRouter, ModelSpec
from floe.server.sessions import snapshot_store

CONTEXT = 256
CHAT = "/v1/chat/completions"
KEYS = ("key-a" * 4, "key-b" * 4)
OPERATOR = "operator" * 3
A, B, OP = ({"Authorization": f"Bearer {k}"} for k in (*KEYS, OPERATOR))


@pytest.fixture(scope="module")
def models(default_checkpoint, tmp_path_factory):
    """A router over the default model ("smol") and a tiny random one ("tiny"), each its own engine and
    store; API keys A and B, the operator's OP."""
    with logged_errors() as errors:
        tiny = str(write_gguf(tmp_path_factory.mktemp("models") / "tiny.gguf", [Q.F32], seed=1, dim=64))
        router = router_of(default_checkpoint, tiny, tmp_path_factory.mktemp("sessions"))
        s = ThreadServer(app_of(router, keys=(*KEYS, OPERATOR), operator_keys=(OPERATOR,)))
        s.tiny = tiny
        s.errors, s.router = errors, router
        yield s
        s.stop()


def router_of(default_checkpoint, tiny: str, folder: Path, **options) -> ModelRouter:
    """A router over "smol" (the default model) and "tiny", each model's sessions in `folder`/its name."""
    def load(spec: ModelSpec, store) -> ServeCore:
        checkpoint = default_checkpoint if spec.path is None else load_checkpoint(spec.path)
        return ServeCore(Engine(checkpoint, max_seq_len=CONTEXT, n_slots=2, weights="native"),
                         snapshots=store, model_id=spec.name, idle_seconds=3600)

    return ModelRouter([(ModelSpec(name, path), snapshot_store(folder / name))
                        for name, path in (("smol", None), ("tiny", tiny))], load, **options)


def chat(url: str, model: str, sid: str, headers: dict, text: str = "hi",
         max_tokens: int = 3) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "temperature": 0, "session_id": sid}
    return httpx.post(url + CHAT, json=body, headers=headers, timeout=120)


def exported(url: str, sid: str, headers: dict) -> bytes:
    r = httpx.get(f"{url}/v1/sessions/{sid}/snapshot", headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    return r.content


def made_of(data: bytes) -> tuple[str, list[dict]]:
    """A snapshot file's model fingerprint and conversation."""
    from floe.snapshot import header

    with tempfile.NamedTemporaryFile(suffix=".safetensors") as f:
        f.write(data)
        f.flush()
        metadata = header(Path(f.name))
    return metadata["model_fingerprint"], json.loads(metadata["app"])["floe_server"]["messages"]


def test_a_snapshot_of_another_model_uploaded_over_a_session_is_refused_and_changes_nothing(models):
    """A's session `x` on smol, B's `x` on tiny: each one's snapshot uploaded over the other's session was
    stored (200 or a 500), and then every request of the session was `500 thaw_failed`
    (SnapshotModelMismatch) and a restart skipped it: the session was lost."""
    url = models.url
    for model, headers in (("smol", A), ("tiny", B)):
        assert chat(url, model, "x", headers).status_code == 200
    before = {k: exported(url, "x", h) for k, h in (("A", A), ("B", B))}
    for headers, foreign in ((A, before["B"]), (B, before["A"])):
        r = httpx.put(f"{url}/v1/sessions/x/snapshot", headers=headers, content=foreign, timeout=60)
        refused(r)
        assert r.status_code == 400 and r.json()["error"]["code"] == "snapshot_invalid", r.text
        assert "model" in r.json()["error"]["message"]
    assert made_of(exported(url, "x", A)) == made_of(before["A"])
    assert made_of(exported(url, "x", B)) == made_of(before["B"])
    for model, headers in (("smol", A), ("tiny", B)):
        assert chat(url, model, "x", headers, "again").status_code == 200
    # A new id: the upload goes to the model the snapshot names, as before
    r = httpx.put(f"{url}/v1/sessions/y/snapshot", headers=A, content=before["B"], timeout=60)
    assert r.status_code == 200, r.text
    assert chat(url, "tiny", "y", A).status_code == 200
    assert not models.errors.records


def test_a_live_session_stays_found_while_its_model_is_unloaded(models):
    """An unload drops the model's core first and then freezes its live sessions: meanwhile the session was
    in neither (GET /v1/sessions/{id}: 404 session_not_found, or a 500 StopIteration while the model was
    not loaded; a request of another model could make a second session of the same id). A look at a live
    session while a freeze closed its actor was a 500 (TypeError: its KV slot already given back)."""
    url, answers = models.url, Counter()
    stop = threading.Event()

    def look() -> None:
        with httpx.Client(timeout=60, headers=A) as c:
            while not stop.is_set():
                answers[c.get(f"{url}/v1/sessions/held-0").status_code] += 1

    assert chat(url, "smol", "held-0", A).status_code == 200
    pollers = [threading.Thread(target=look) for _ in range(2)]
    for t in pollers:
        t.start()
    try:
        for _ in range(6):
            for i in range(2):  # (both slots: two sessions to freeze at the unload)
                assert chat(url, "smol", f"held-{i}", A).status_code == 200
            r = httpx.post(f"{url}/v1/models/smol/unload", headers=OP, timeout=60)
            assert r.status_code == 200 and r.json()["loaded"] is False, r.text
    finally:
        stop.set()
        for t in pollers:
            t.join()
    assert set(answers) == {200}, (answers, [r.getMessage() for r in models.errors.records])
    assert not models.errors.records


def test_a_fork_or_upload_and_a_chat_of_another_model_never_both_make_one_id(models):
    """A fork into a new id (waiting for its source, busy), or an upload under a new id (its header still
    arriving), while a request of another model makes a session of that id: both were made (the id a
    session of two models: its requests went to whichever model the router found first, the other's state
    unreachable). The fork holds the id for its model (the other model's request: a 409); the upload is
    refused where the id became another model's meanwhile."""
    url = models.url
    assert chat(url, "smol", "source", A).status_code == 200
    snapshot = exported(url, "source", A)

    def held_upload(pool, sid: str, at: int):
        """An upload of `snapshot` to `sid` whose body stops after `at` bytes until the event returned is
        set."""
        sent_head, go_on = threading.Event(), threading.Event()

        def body():
            yield snapshot[:at]
            sent_head.set()
            go_on.wait(60)
            yield snapshot[at:]

        upload = pool.submit(httpx.put, f"{url}/v1/sessions/{sid}/snapshot", content=body(), headers=A,
                             timeout=120)
        assert sent_head.wait(60)
        time.sleep(0.3)
        return upload, go_on

    with ThreadPoolExecutor(3) as pool:
        busy, go_on = held_upload(pool, "source", len(snapshot) // 2)  # (held by its upload: a fork waits)
        fork = pool.submit(httpx.post, f"{url}/v1/sessions/source/fork", json={"id": "forked"}, headers=A,
                           timeout=120)
        time.sleep(0.5)
        r = chat(url, "tiny", "forked", A)
        go_on.set()
        refused(r)
        assert r.json()["error"]["code"] == "session_model_mismatch", r.text
        assert busy.result().status_code == 200 and fork.result().status_code == 200
        upload, go_on = held_upload(pool, "uploaded", 4)  # (its model not known yet)
        assert chat(url, "tiny", "uploaded", A).status_code == 200
        go_on.set()
        refused(upload.result())
        assert upload.result().json()["error"]["code"] == "session_model_mismatch", upload.result().text
    sessions = httpx.get(f"{url}/v1/sessions", headers=A, timeout=60).json()["data"]
    assert sorted((s["id"], s["model"]) for s in sessions if s["id"] in ("forked", "uploaded")) == [
        ("forked", "smol"), ("uploaded", "tiny")]
    assert chat(url, "smol", "forked", A).status_code == 200
    assert not models.errors.records


def test_model_routes_refuse_a_key_that_is_not_the_operators_saying_what_was_refused(models):
    """B's load of a model was refused as if it had asked for the metrics."""
    for call in ("load", "unload"):
        r = httpx.post(f"{models.url}/v1/models/tiny/{call}", headers=B, timeout=60)
        refused(r)
        assert r.status_code == 403 and r.json()["error"]["code"] == "operator_only"
        assert call in r.json()["error"]["message"] and "metrics" not in r.json()["error"]["message"]


def test_a_session_id_is_not_remembered_once_its_requests_end(models):
    """The router kept a claim (its model) of every session id ever named, deleted or not: memory that
    grew with every id a client made up. A claim now lasts while the id's requests run; the binding of a
    session to its model holds without it."""
    ids = [f"gone-{i}" for i in range(20)]
    for sid in ids:
        assert chat(models.url, "tiny", sid, B).status_code == 200
    assert not any(key.endswith(ids[0]) for key in models.router._claims)
    r = chat(models.url, "smol", ids[0], B)  # (still tiny's)
    refused(r)
    assert r.json()["error"]["code"] == "session_model_mismatch"
    for sid in ids:
        assert httpx.delete(f"{models.url}/v1/sessions/{sid}", headers=B, timeout=60).status_code == 200
    assert chat(models.url, "smol", ids[0], B).status_code == 200  # (deleted: the id is free again)
    assert not models.router._claims
    assert not models.errors.records


def test_models_loaded_at_once_keep_to_max_loaded(models, default_checkpoint, tmp_path):
    """--max-loaded 1, both models asked for at once (the operator's load, or any key's chat): each load
    found room for itself beside the loaded ones only, not beside the other being loaded, and both were
    loaded (with large models: past the memory --max-loaded and --memory-budget keep to)."""
    s = ThreadServer(app_of(router_of(default_checkpoint, models.tiny, tmp_path, max_loaded=1)))
    try:
        with ThreadPoolExecutor(2) as pool:
            for _ in range(2):
                for name in ("smol", "tiny"):
                    assert httpx.post(f"{s.url}/v1/models/{name}/unload", timeout=60).status_code == 200
                loads = [pool.submit(httpx.post, f"{s.url}/v1/models/{name}/load", timeout=120)
                         for name in ("smol", "tiny")]
                assert [r.result().status_code for r in loads] == [200, 200]
                listed = httpx.get(f"{s.url}/v1/models", timeout=60).json()["data"]
                assert sum(m["loaded"] for m in listed) == 1, listed
            chats = [pool.submit(chat, s.url, name, f"at-once-{name}", {}) for name in ("smol", "tiny")]
            assert [r.result().status_code for r in chats] == [200, 200]
        assert sum(m["loaded"] for m in httpx.get(f"{s.url}/v1/models", timeout=60).json()["data"]) == 1
    finally:
        s.stop()
    assert not models.errors.records


def test_a_key_sees_its_own_sessions_counts_in_the_models_list(models):
    """GET /v1/models (and /v1/models/{id}) gave every key each loaded model's session counts over all
    keys (how many sessions the others have, live and frozen), which /health shows only the operator."""
    for i in range(2):
        assert chat(models.url, "tiny", f"counted-{i}", A).status_code == 200
    assert chat(models.url, "tiny", "counted-b", B).status_code == 200
    counts = {}
    for who, headers in (("A", A), ("B", B), ("operator", OP)):
        listed = httpx.get(f"{models.url}/v1/models", headers=headers, timeout=60).json()["data"]
        one = httpx.get(f"{models.url}/v1/models/tiny", headers=headers, timeout=60).json()
        counts[who] = next(m for m in listed if m["id"] == "tiny")["sessions"]
        assert one["sessions"] == counts[who]
    mine = {k: len([s for s in httpx.get(f"{models.url}/v1/sessions", headers=h, timeout=60).json()["data"]
                    if s["model"] == "tiny"]) for k, h in (("A", A), ("B", B))}
    for who in ("A", "B"):
        assert counts[who]["live"] + counts[who]["frozen"] == mine[who], (who, counts)
        assert "spare_actors" not in counts[who]
    assert counts["operator"]["live"] + counts["operator"]["frozen"] >= mine["A"] + mine["B"]
    assert not models.errors.records


def test_a_look_at_a_session_of_an_unloaded_model_loads_nothing(models):
    """GET /v1/sessions/{id} of a one-shot session (made without an id: its snapshot in RAM only) of an
    unloaded model was a 500 (StopIteration: only the store's home was read), then loaded the model to
    answer, in the core's thread that reads every request of that front (a large model: seconds of
    every stream of the front held, and another model unloaded under --max-loaded)."""
    r = httpx.post(models.url + CHAT, headers=A, timeout=60, json={
        "model": "tiny", "messages": [{"role": "user", "content": "a one-shot question"}], "max_tokens": 2})
    assert r.status_code == 200, r.text
    sid = r.json()["session_id"]
    assert httpx.post(f"{models.url}/v1/models/tiny/unload", headers=OP, timeout=60).status_code == 200
    r = httpx.get(f"{models.url}/v1/sessions/{sid}", headers=A, timeout=60)
    assert r.status_code == 200 and r.json()["anonymous"] and r.json()["state"] == "frozen", r.text
    listed = httpx.get(f"{models.url}/v1/sessions", headers=A, timeout=60).json()["data"]
    assert sid in [s["id"] for s in listed]
    refused(httpx.get(f"{models.url}/v1/sessions/{sid}", headers=B, timeout=60))  # (A's)
    listed = httpx.get(f"{models.url}/v1/models/tiny", headers=OP, timeout=60).json()
    assert listed["loaded"] is False, listed
    assert not models.errors.records


def test_a_slow_look_at_an_unloaded_models_sessions_holds_no_other_request_of_its_front(models, monkeypatch):
    """GET /v1/sessions reads an unloaded model's sessions from their snapshots' headers (on S3 a round
    trip each), and did so in the core's thread that reads every request of that front: a chat's, a
    cancel's, a /health behind it waited for all of them. Those looks now have threads of their own."""
    from floe.server.models.served import ServedModel

    assert httpx.post(f"{models.url}/v1/models/tiny/unload", headers=OP, timeout=60).status_code == 200
    stored, reading, read = ServedModel.stored_sessions, threading.Event(), threading.Event()

    def slow(self, owner, sid=None):
        reading.set()
        time.sleep(3.0)  # (a slow store)
        read.set()
        return stored(self, owner, sid)

    monkeypatch.setattr(ServedModel, "stored_sessions", slow)
    with ThreadPoolExecutor(1) as pool:
        look = pool.submit(httpx.get, f"{models.url}/v1/sessions", headers=A, timeout=60)
        assert reading.wait(30)
        r = httpx.get(f"{models.url}/health", headers=A, timeout=60)
        assert r.status_code == 200 and not read.is_set()  # answered while the look still reads
        assert look.result().status_code == 200
    assert not models.errors.records


def test_a_slow_store_asked_of_a_new_session_id_holds_no_chat_of_another_id(models, monkeypatch):
    """A chat naming an id its model has not registered asks the other models' stores whether one holds
    it (on S3 a round trip each), and did so under one lock of the router's: every named chat of every
    model waited for it. The ask is now the id's own: a chat of another id goes on meanwhile; one of
    the same id on another model waits for the answer and is refused (409) as before."""
    from floe.server.models.served import ServedModel

    assert chat(models.url, "smol", "known-1", A).status_code == 200
    holds, asking, answer = ServedModel.holds, threading.Event(), threading.Event()

    def slow(self, owner, sid):
        if sid == "new-slow-1":
            asking.set()
            answer.wait(60)  # (a slow store)
        return holds(self, owner, sid)

    monkeypatch.setattr(ServedModel, "holds", slow)
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(chat, models.url, "smol", "new-slow-1", A)
        assert asking.wait(60)
        same = pool.submit(chat, models.url, "tiny", "new-slow-1", A)
        body = {"model": "smol", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                "temperature": 0, "session_id": "known-1"}
        try:
            r = httpx.post(models.url + CHAT, json=body, headers=A, timeout=30)
            assert r.status_code == 200 and not answer.is_set()  # (answered while the ask still waits)
        finally:
            answer.set()
        assert first.result().status_code == 200
        assert same.result().status_code == 409
    assert not models.router._claims and not models.errors.records


@pytest.mark.slow  # two `floe serve` starts
def test_a_front_killed_mid_stream_ends_floe_serve_as_a_failure_and_loses_no_answered_turn(tmp_path):
    """`floe serve --fronts 2`, one front SIGKILLed while it streams: the other front and the core stop
    (a non-zero exit, for a supervisor to restart: docs/SERVER.md, "Several fronts") within a bound, and
    the sessions' answered turns are in the store for the restarted server."""
    port = free_port()
    proc = start_serve(tmp_path, port, "--fronts", "2")
    url = f"http://127.0.0.1:{port}"
    try:
        for sid in ("kept-0", "kept-1"):
            r = httpx.post(url + CHAT, timeout=120, json={
                "model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                "session_id": sid})
            assert r.status_code == 200, r.text

        def stream() -> None:
            with contextlib.suppress(httpx.HTTPError), httpx.stream("POST", url + CHAT, timeout=120, json={
                    "model": MODEL_ID, "messages": [{"role": "user", "content": "Count to 100"}],
                    "max_tokens": 150, "stream": True, "session_id": "streaming"}) as r:
                for _ in r.iter_bytes():
                    pass

        streams = [threading.Thread(target=stream) for _ in range(2)]
        for t in streams:
            t.start()
        time.sleep(1.0)
        psutil.Process(proc.pid).children()[0].kill()
        assert proc.wait(60) != 0
        for t in streams:
            t.join(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    proc = start_serve(tmp_path, port)
    try:
        for sid in ("kept-0", "kept-1"):
            r = httpx.get(f"{url}/v1/sessions/{sid}", timeout=60)
            assert r.status_code == 200 and r.json()["messages"] == 2, r.text
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
