"""`floe serve` driven by the official `openai` client over loopback: completions, streaming,
sessions that prefill only new tokens, idle freezing and a server restart, concurrency, bad requests."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn

from floe.engine import Engine
from floe.server.app import create_app
from floe.server.deadlines import uvicorn_config

MODEL_ID = "SmolLM2-135M-Instruct.Q4_1"
CONTEXT = 512
TURNS = ["What is the capital of France?", "And of Italy?", "Which of the two is larger?"]


def folder_state(folder: Path) -> list[Path]:
    """What a store's folder holds, less its leases' writers'-lock sidecars: a new lease is made without
    that lock (floe.snapshot.atomic.create_exclusive), so its sidecar appears at the lease's first renewal
    or release, which a server's upkeep does in the background, whatever the test's requests do."""
    return sorted(p.relative_to(folder) for p in folder.rglob("*")
                  if not p.name.endswith(".lease.cas.floe-lock"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ThreadServer:
    """The real app under uvicorn on a loopback port, in this process, configured as `floe serve`'s front
    (deadlines: floe.server.deadlines.uvicorn_config's)."""

    def __init__(self, app, **deadlines: float) -> None:
        self.port = free_port()
        config = uvicorn_config(app, host="127.0.0.1", port=self.port, log_level="error", **deadlines)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            assert time.time() < deadline, "server did not start"
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


@pytest.fixture(scope="module")
def server(default_checkpoint, tmp_path_factory):
    yield from serving_engine(Engine(default_checkpoint, max_seq_len=CONTEXT, n_slots=16, weights="native"),
                              tmp_path_factory.mktemp("sessions"))


def serving_engine(engine: Engine, folder: Path):
    """A server of `engine` in this process, its snapshots in `folder` (a fixture's body)."""
    s = ThreadServer(create_app(engine, snapshots=folder, model_id=MODEL_ID, idle_seconds=3600))
    s.folder = folder
    yield s
    s.stop()


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)


def ask(c: openai.OpenAI, messages: list[dict], **kwargs):
    kwargs = {"model": MODEL_ID, "temperature": 0, "max_tokens": 24} | kwargs
    return c.chat.completions.create(messages=messages, **kwargs)


def conversation(c: openai.OpenAI, session: str | None = None, turns=TURNS) -> tuple[list[str], list]:
    messages, replies, usages = [], [], []
    extra = {"session_id": session} if session else {}
    for text in turns:
        messages.append({"role": "user", "content": text})
        r = ask(c, messages, extra_body=extra)
        replies.append(r.choices[0].message.content)
        usages.append(r.usage)
        messages.append({"role": "assistant", "content": replies[-1]})
    return replies, usages


def test_models_health_and_a_plain_completion(server):
    c = client(server.url)
    assert [m.id for m in c.models.list().data] == [MODEL_ID]
    assert httpx.get(f"{server.url}/health").json()["status"] == "ok"
    head = httpx.head(f"{server.url}/health")  # (a load balancer's probe: the status, no body)
    assert head.status_code == 200 and head.content == b""
    r = ask(c, [{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens > 0
    assert r.model_extra["session_id"]


def test_streamed_completion_equals_the_plain_one(server):
    c = client(server.url)
    messages = [{"role": "user", "content": "Name three colours."}]
    plain = ask(c, messages).choices[0].message.content
    pieces, usage = [], None
    for chunk in ask(c, messages, stream=True, stream_options={"include_usage": True}):
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        usage = chunk.usage or usage
    assert len(pieces) > 1 and "".join(pieces) == plain
    assert usage is not None and usage.completion_tokens > 0


def test_many_streams_at_once_each_get_the_plain_reply(server, monkeypatch):
    """More streams than BUSY_STREAMS: text is handed over in intervals, several tokens a chunk, and
    every stream still carries exactly its plain reply, in order."""
    from concurrent.futures import ThreadPoolExecutor

    import floe.server.chat as app_module

    monkeypatch.setattr(app_module, "BUSY_STREAMS", 2)
    c = client(server.url)
    questions = [[{"role": "user", "content": f"Count from {i} to {i + 5}."}] for i in range(6)]
    plain = [ask(c, m).choices[0].message.content for m in questions]

    def streamed(messages) -> str:
        return "".join(chunk.choices[0].delta.content or "" for chunk in ask(c, messages, stream=True)
                       if chunk.choices)

    with ThreadPoolExecutor(len(questions)) as pool:
        assert list(pool.map(streamed, questions)) == plain


def test_a_session_prefills_only_the_new_tokens(server):
    c = client(server.url)
    replies, usages = conversation(c, "three-turns")
    assert all(replies)
    first, *later = usages
    assert first.model_extra["prefilled_tokens"] == first.prompt_tokens
    for u in later:
        cached = u.prompt_tokens_details.cached_tokens
        assert cached > first.prompt_tokens and u.model_extra["prefilled_tokens"] < 25, u
        assert cached + u.model_extra["prefilled_tokens"] == u.prompt_tokens
    # Without a session id the server finds the cached conversation by its prefix.
    history = [m for text, reply in zip(TURNS, replies, strict=True)
               for m in ({"role": "user", "content": text}, {"role": "assistant", "content": reply})]
    r = ask(c, [*history, {"role": "user", "content": "Thanks!"}])
    assert r.model_extra["session_id"] == "three-turns"
    assert r.usage.prompt_tokens_details.cached_tokens > later[-1].prompt_tokens


def test_session_freeze_thaw_and_delete_endpoints(server):
    c = client(server.url)
    conversation(c, "lifecycle", TURNS[:1])
    frozen = httpx.post(f"{server.url}/v1/sessions/lifecycle/freeze").json()
    path = server.folder / "lifecycle.safetensors"
    assert frozen["state"] == "frozen" and frozen["bytes"] == path.stat().st_size > 0
    listing = httpx.get(f"{server.url}/v1/sessions")
    assert str(server.folder) not in listing.text  # no paths for clients
    listed = {s["id"]: s for s in listing.json()["data"]}["lifecycle"]
    assert listed["state"] == "frozen" and listed["snapshot_bytes"] == frozen["bytes"]
    assert httpx.get(f"{server.url}/v1/sessions/lifecycle").json()["state"] == "frozen"
    assert httpx.post(f"{server.url}/v1/sessions/lifecycle/thaw").json()["state"] == "live"
    metrics = httpx.get(f"{server.url}/metrics").text
    assert "floe_thaw_seconds_count 1.0" in metrics and 'floe_sessions{state="live"}' in metrics
    assert 'floe_engine_loop_turns{state="active"} 0.0' in metrics  # the loop's queue, between requests
    assert httpx.delete(f"{server.url}/v1/sessions/lifecycle").status_code == 200
    assert not path.exists()
    gone = httpx.post(f"{server.url}/v1/sessions/lifecycle/freeze")
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "session_not_found"


def test_sixteen_concurrent_sessions_are_all_answered(server):
    c = client(server.url)

    def one(i: int) -> str:
        return ask(c, [{"role": "user", "content": f"Say the number {i}."}], max_tokens=8,
                   extra_body={"session_id": f"concurrent-{i}"}).choices[0].message.content

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(one, range(16)))
    assert len(answers) == 16 and all(answers)


@pytest.mark.parametrize("body, status, code", [
    ({"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}, 404, "model_not_found"),
    ({"model": MODEL_ID, "messages": []}, 400, "invalid_value"),
    ({"model": MODEL_ID, "messages": [{"role": "wizard", "content": "hi"}]}, 400, None),
    ({"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 100000}, 400,
     "context_length_exceeded"),
    ({"model": MODEL_ID, "messages": [{"role": "user", "content": "hi " * 2000}]}, 400,
     "context_length_exceeded"),
    ({"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "temperature": -1}, 400, None),
    ({"model": MODEL_ID, "session_id": "never-seen", "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "again"}]}, 404, "session_not_found"),
])
def test_bad_requests_get_openai_style_4xx(server, body, status, code):
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"] and "Traceback" not in r.text
    if code:
        assert error["code"] == code


def test_malformed_json_and_an_unknown_model(server):
    r = httpx.post(f"{server.url}/v1/chat/completions", content=b'{"model": "x", "messages": [',
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    with pytest.raises(openai.NotFoundError):
        client(server.url).chat.completions.create(model="not-this-one",
                                                   messages=[{"role": "user", "content": "hi"}])


@pytest.fixture(scope="module")
def dense_server(default_checkpoint, tmp_path_factory):
    """A server on float32 weights: a prompt's products and a decode step's agree to ~1e-5 there."""
    yield from serving_engine(Engine(default_checkpoint, max_seq_len=CONTEXT, n_slots=4, weights="dense"),
                              tmp_path_factory.mktemp("dense_sessions"))


def test_a_regenerated_or_edited_turn_branches_the_session(dense_server):
    """A named session whose history the request changes (a client regenerating its last turn, or
    editing an earlier one) rolls back to the common start, whose K and V it keeps (cached_tokens: the
    first turn and its reply at least), and goes on from there as a request with that whole
    conversation does in a fresh session: never a 409. (Float32 weights: the kept reply's K and V,
    computed by decode steps, agree with a prompt's to ~1e-5. floe's native int8 decode steps differ
    from a prompt's products by ~1e-2, which can flip a near-tie: there a branch goes on from the
    session's own numbers, as the conversation did, and may differ from a fresh session's.)"""
    server = dense_server
    c = client(server.url)
    turns = ["Name a colour.", "And a fruit?", "And an animal?"]
    replies, usages = conversation(c, "branching", turns)
    edited = [{"role": "user", "content": turns[0]}, {"role": "assistant", "content": replies[0]},
              {"role": "user", "content": "And a vegetable?"}]
    before = metric(server.url, "floe_session_rollbacks")
    r = ask(c, edited, extra_body={"session_id": "branching"})
    branched = r.choices[0].message.content
    shared = usages[0].prompt_tokens + usages[0].completion_tokens  # the first turn and its reply
    assert r.usage.prompt_tokens_details.cached_tokens >= shared
    fresh = ask(c, edited)  # the same conversation in a new session
    assert branched == fresh.choices[0].message.content
    assert fresh.usage.prompt_tokens_details.cached_tokens == 0
    assert metric(server.url, "floe_session_rollbacks") == before + 1
    from floe.snapshot import header

    # Frozen, its snapshot holds the branch (the longer conversation it rolled back from is gone).
    assert httpx.post(f"{server.url}/v1/sessions/branching/freeze", timeout=60).status_code == 200
    kept = json.loads(header(server.folder / "branching.safetensors")["app"])["floe_server"]["messages"]
    assert kept == [*edited, {"role": "assistant", "content": branched}]
    again = ask(c, [*kept, {"role": "user", "content": "Thanks."}], extra_body={"session_id": "branching"})
    assert again.usage.prompt_tokens_details.cached_tokens > 0  # goes on from the branch: no rollback
    assert metric(server.url, "floe_session_rollbacks") == before + 1
    # Regenerating the last reply (the request `again` made, sent again: the session holds its reply):
    # all of the prompt but its last token comes from the cache, and greedy decoding answers the same.
    thanks = [*kept, {"role": "user", "content": "Thanks."}]
    regenerated = ask(c, thanks, extra_body={"session_id": "branching"})
    assert regenerated.choices[0].message.content == again.choices[0].message.content
    assert regenerated.usage.prompt_tokens_details.cached_tokens == regenerated.usage.prompt_tokens - 1
    assert metric(server.url, "floe_session_rollbacks") == before + 2


def start_serve(folder: Path, port: int, *flags: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-m", "floe.cli", "serve", "--port", str(port), "--snapshots", str(folder),
         "--idle-seconds", "0.5", "--context", str(CONTEXT), "--max-sessions", "4", *flags],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    return serving(proc, port)


def serving(proc: subprocess.Popen, port: int) -> subprocess.Popen:
    """The `floe serve` process once it answers /health (killed, with its stderr, if it never does)."""
    deadline = time.time() + 300  # a 2-core CI box loading the native engine under load: minutes
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            raise AssertionError(f"floe serve did not start: {proc.stderr.read()}")
        time.sleep(0.1)


def test_an_idle_session_survives_a_server_restart(server, tmp_path):
    """Turn 1, idle until frozen, the server killed (SIGKILL) and started again on the same folder:
    turns 2 and 3 are the tokens an uninterrupted server produces (greedy)."""
    reference, _ = conversation(client(server.url), "uninterrupted")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_serve(tmp_path, port)
    try:
        first, _ = conversation(client(url), "restarted", TURNS[:1])
        deadline = time.time() + 30
        while httpx.get(f"{url}/v1/sessions").json()["data"][0]["state"] != "frozen":
            assert time.time() < deadline, "the idle session was not frozen"
            time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    assert (tmp_path / "restarted.safetensors").is_file()
    # The HTTP front (the killed core's child) saw its core go and exited: the port is free again.
    deadline = time.time() + 30
    while True:
        try:
            httpx.get(f"{url}/health", timeout=1)
        except httpx.ConnectError:
            break
        except httpx.TransportError:  # the front is going (a reset or an unanswered request): ask again
            pass
        assert time.time() < deadline, "the HTTP front outlived its engine core"
        time.sleep(0.1)
    proc = start_serve(tmp_path, port)
    try:
        sessions = httpx.get(f"{url}/v1/sessions").json()["data"]
        assert [(s["id"], s["state"]) for s in sessions] == [("restarted", "frozen")]
        messages = [{"role": "user", "content": TURNS[0]}, {"role": "assistant", "content": first[0]}]
        rest = []
        for text in TURNS[1:]:
            messages.append({"role": "user", "content": text})
            r = ask(client(url), messages, extra_body={"session_id": "restarted"})
            assert r.usage.prompt_tokens_details.cached_tokens > 0  # thawed, not re-prefilled
            rest.append(r.choices[0].message.content)
            messages.append({"role": "assistant", "content": rest[-1]})
        assert [first[0], *rest] == reference
        assert "floe_thaw_seconds_count 1.0" in httpx.get(f"{url}/metrics").text
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    assert os.path.getsize(tmp_path / "restarted.safetensors") > 0


def test_a_guest_trap_fails_only_that_request(default_checkpoint, tmp_path):
    """A guest that traps on messages starting with "t": that client gets a JSON 500 naming the
    trap; the other sessions, before and after, are answered."""
    from guests_wat import guest

    traps_on_t = guest("(if (i32.eq (i32.load8_u (local.get $ptr)) (i32.const 116)) (then unreachable)) "
                       "(drop (call $emit (i32.const 16) (i32.const 2))) (i32.const 0)")
    engine = Engine(default_checkpoint, max_seq_len=64, n_slots=4)
    s = ThreadServer(create_app(engine, snapshots=tmp_path, model_id=MODEL_ID, guest=traps_on_t))
    try:
        c = client(s.url)
        with ThreadPoolExecutor(3) as pool:
            futures = [pool.submit(ask, c, [{"role": "user", "content": text}],
                                   extra_body={"session_id": f"s{i}"})
                       for i, text in enumerate(["hello", "trap now", "hi"])]
            ok0 = futures[0].result()
            with pytest.raises(openai.InternalServerError) as failed:
                futures[1].result()
            ok2 = futures[2].result()
        assert ok0.choices[0].message.content == ok2.choices[0].message.content == "ok"
        error = failed.value.response.json()["error"]
        assert error["code"] == "guest_error" and "Traceback" not in failed.value.response.text
        assert ask(c, [{"role": "user", "content": "again"}]).choices[0].message.content == "ok"
        ids = {x["id"] for x in httpx.get(f"{s.url}/v1/sessions").json()["data"]}
        assert "s1" not in ids and {"s0", "s2"} <= ids
    finally:
        s.stop()


def test_a_client_that_leaves_a_stream_stops_the_generation(server):
    """The guest stops soon after the client hangs up, and the session keeps nothing of that turn (the
    client's retry of it is not a 409)."""
    def generated() -> float:
        line = next(x for x in httpx.get(f"{server.url}/metrics").text.splitlines()
                    if x.startswith("floe_generated_tokens_total"))
        return float(line.split()[-1])

    first, _ = conversation(client(server.url), "left-early", TURNS[:1])
    kept = [{"role": "user", "content": TURNS[0]}, {"role": "assistant", "content": first[0]}]
    before = generated()
    prompt = [*kept, {"role": "user", "content": "Count from 1 to 500, one per line."}]
    body = {"model": MODEL_ID, "messages": prompt, "max_tokens": 400, "temperature": 0, "stream": True,
            "session_id": "left-early"}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if '"content": "' in line and '"content": ""' not in line:
                break  # first piece of text: hang up
    # The freeze waits for the session's lock: the turn has ended when it answers.
    assert httpx.post(f"{server.url}/v1/sessions/left-early/freeze", timeout=60).status_code == 200
    from floe.snapshot import header

    record = json.loads(header(server.folder / "left-early.safetensors")["app"])["floe_server"]
    tokens = generated() - before
    assert 1 <= tokens < 100, tokens  # stopped long before 400 tokens
    assert record["messages"] == kept
    retried = ask(client(server.url), prompt, max_tokens=4, extra_body={"session_id": "left-early"})
    assert retried.choices[0].message.content


def test_a_busy_server_says_when_to_retry():
    from floe.server.app import _error

    busy = _error(503, "all slots busy", "server_error", "server_busy")
    assert busy.status_code == 503 and busy.headers["retry-after"] == "1"
    assert "retry-after" not in _error(400, "bad", "invalid_request_error").headers


def test_the_http_front_imports_no_torch():
    """`floe serve`'s front process (python -m floe.server.app) stays light: no engine, no torch."""
    probe = "import sys, floe.server.app; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", probe], timeout=120).returncode == 0


def frames(sock: socket.socket, *values) -> None:
    from floe.server.protocol import pack

    for value in values:
        sock.sendall(pack(value))


def reply(sock: socket.socket):
    from floe.server.protocol import HEADER, frame_length, unpack

    def exactly(n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = sock.recv(n - len(data))
            if not chunk:
                return b""
            data += chunk
        return data

    header = exactly(HEADER.size)
    return unpack(exactly(frame_length(header))) if header else None


def test_a_broken_front_connection_never_harms_the_core(default_checkpoint):
    """Frames that are not requests (not JSON, a huge length, no id, a list) close that connection
    only; bad requests on a good connection get errors; a front whose core went away answers 503."""
    import tempfile

    from floe.server.app import create_front
    from floe.server.core import ServeCore
    from floe.server.core_socket import CoreServer
    from floe.server.protocol import HEADER

    folder = Path(tempfile.mkdtemp(prefix="floe-test-"))  # short: a Unix socket's path has ~100 bytes
    engine = Engine(default_checkpoint, max_seq_len=64, n_slots=2)
    core = ServeCore(engine, snapshots=folder / "sessions", model_id=MODEL_ID)
    server = CoreServer(core, folder / "core.sock")
    try:
        for garbage in (HEADER.pack(5) + b"hello", HEADER.pack(1 << 30), b"\x00\x00\x00\x02{}",
                        HEADER.pack(7) + b"[1,2,3]"):
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(server.path)
                s.sendall(garbage)
                s.settimeout(30)
                assert reply(s) is None  # the core hung up on it
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(server.path)
            s.settimeout(60)
            frames(s, {"op": "call", "id": 1, "name": "health"}, {"op": "call", "id": 2, "name": "shutdown"},
                   {"op": "chat", "id": 3, "request": {"messages": "not a list"}},
                   {"op": "chat", "id": 4, "request": {"messages": [{"role": "user", "content": "hi"}],
                                                       "temperature": "hot"}},
                   {"op": "call", "id": 5, "name": "freeze", "arg": ["not", "an", "id"]})
            answers = {r[1]: r for r in (reply(s) for _ in range(5))}
        assert answers[1][0] == "ok" and answers[1][2]["status"] == "ok"
        assert all(answers[i][0] == "error" and answers[i][2]["status"] == 400 for i in (2, 3, 4, 5))
        front = ThreadServer(create_front(server.path))
        try:
            assert httpx.get(f"{front.url}/health", timeout=60).status_code == 200
            server.close()
            deadline = time.time() + 30
            while (r := httpx.get(f"{front.url}/health", timeout=60)).status_code == 200:
                assert time.time() < deadline
                time.sleep(0.05)
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_gone"
        finally:
            front.stop()
    finally:
        server.close()
        core.close()


def test_requests_without_a_seed_are_random_and_with_one_repeat(server):
    """As OpenAI (and llama.cpp's seed -1): no seed draws a fresh one; the same seed, the same reply."""
    c = client(server.url)
    story = [{"role": "user", "content": "Invent a name for a new colour."}]
    free = {ask(c, story, temperature=1.5, max_tokens=24).choices[0].message.content for _ in range(3)}
    assert len(free) > 1, free
    seeded = {ask(c, story, temperature=1.5, max_tokens=24, seed=7).choices[0].message.content
              for _ in range(2)}
    assert len(seeded) == 1, seeded


def requests_counted(url: str, status: str, headers: dict[str, str] | None = None) -> float:
    line = next((x for x in httpx.get(f"{url}/metrics", headers=headers).text.splitlines()
                 if x.startswith(f'floe_requests_total{{status="{status}"}}')), None)
    return float(line.split()[-1]) if line else 0.0


def metric(url: str, name: str) -> float:
    line = next((x for x in httpx.get(f"{url}/metrics").text.splitlines() if x.startswith(f"{name} ")), None)
    return float(line.split()[-1]) if line else 0.0


def test_a_request_that_cannot_succeed_is_not_retried(server):
    """The official client retries 409 and 5xx by default; a deterministic error says
    x-should-retry: false, so the server sees it once (a 409 of a session another server holds:
    tests/test_server_store.py)."""
    retrying = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=300)  # 2 retries
    before = requests_counted(server.url, "404")
    with pytest.raises(openai.NotFoundError) as e:
        ask(retrying, [{"role": "user", "content": "Not what was said"},
                       {"role": "assistant", "content": "x"}, {"role": "user", "content": "next"}],
            extra_body={"session_id": "no-retry-never-made"})
    assert e.value.response.headers["x-should-retry"] == "false"
    assert requests_counted(server.url, "404") == before + 1


@pytest.mark.parametrize("change, param", [
    ({"temperature": 1e308}, "temperature"), ({"top_k": 2**31}, "top_k"),
    ({"session_id": "abc\n"}, "session"), ({"session_id": "../../etc/passwd"}, "session"),
    ({"messages": [{"role": "user", "content": "half a pair: \ud800"}]}, "Unicode"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "role"),
    ({"messages": [{"role": "tool", "content": "hi"}]}, "tool_call_id"),  # answers no earlier call
])
def test_hostile_values_get_a_400_naming_them(server, change, param):
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2} | change
    r = httpx.post(f"{server.url}/v1/chat/completions", content=json.dumps(body),  # \ud800 escaped
                   headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 400, r.text
    assert param in r.json()["error"]["message"] and r.headers["x-should-retry"] == "false"


def test_the_developer_role_is_a_system_message(server):
    c = client(server.url)
    messages = [{"role": "developer", "content": "Answer in one word."},
                {"role": "user", "content": "What is the capital of France?"}]
    as_system = [{"role": "system", "content": messages[0]["content"]}, messages[1]]
    assert ask(c, messages).choices[0].message.content == ask(c, as_system).choices[0].message.content


@pytest.mark.parametrize("field, value", [  # (tools and response_format: tests/test_server_structured.py)
    ("logprobs", True), ("presence_penalty", 0.5), ("frequency_penalty", 1.0), ("logit_bias", {"17": 5}),
])
def test_a_field_floe_would_ignore_gets_a_400_naming_it(server, field, value):
    with pytest.raises(openai.BadRequestError) as e:
        ask(client(server.url), [{"role": "user", "content": "hi"}], max_tokens=2, **{field: value})
    assert e.value.response.json()["error"]["param"] == field
    # Their neutral values, as clients send by default, are accepted.
    neutral = {"presence_penalty": 0, "frequency_penalty": 0, "logprobs": False, "tools": None}
    assert ask(client(server.url), [{"role": "user", "content": "hi"}], max_tokens=2, **neutral).choices


def test_one_model_by_its_id(server):
    c = client(server.url)
    assert c.models.retrieve(MODEL_ID).id == MODEL_ID
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("gpt-4o")


def test_a_full_server_answers_a_stream_with_503_and_forgets_the_new_session(default_checkpoint, tmp_path):
    """Every KV slot busy past the wait queue's wait: a new session's streamed request gets HTTP 503
    with Retry-After before any stream starts (not a 200 carrying an error), and the session it would
    have made is not listed."""
    from guests_wat import v2_guest

    engine = Engine(default_checkpoint, max_seq_len=256, n_slots=1, weights="native")  # (floe serve's)
    # A guest that never stops by itself: its request holds the one slot until max_tokens, far longer
    # than the 0.3 s a request may wait for it.
    s = ThreadServer(create_app(engine, snapshots=tmp_path, model_id=MODEL_ID, guest=v2_guest(after=10**6),
                                wait_seconds=0.3))
    try:
        body = {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 150,
                "temperature": 0, "session_id": "holder"}
        with ThreadPoolExecutor(1) as pool:
            holder = pool.submit(httpx.post, f"{s.url}/v1/chat/completions", json=body, timeout=300)
            deadline = time.time() + 60
            while httpx.get(f"{s.url}/health").json()["engine_loop"]["active"] == 0:
                assert time.time() < deadline and not holder.done(), "the holder never ran"
                time.sleep(0.01)
            busy = httpx.post(f"{s.url}/v1/chat/completions", timeout=60,
                              json=body | {"session_id": "late", "stream": True})
            assert holder.result().status_code == 200
        assert busy.status_code == 503 and busy.headers["retry-after"] == "1", busy.text
        assert busy.json()["error"]["code"] == "server_busy"
        assert "late" not in {x["id"] for x in httpx.get(f"{s.url}/v1/sessions").json()["data"]}
    finally:
        s.stop()


def test_model_aliases_and_any_name(default_checkpoint, tmp_path):
    """Tools that hard-code a model name: aliases (--model-id given again) answer too, "*" any name;
    an unknown name is still 404; the reply names the model it was asked for."""
    engine = Engine(default_checkpoint, max_seq_len=128, n_slots=2)
    s = ThreadServer(create_app(engine, snapshots=tmp_path, model_id=MODEL_ID, aliases=("gpt-4o-mini",)))
    try:
        c = client(s.url)
        assert [m.id for m in c.models.list().data] == [MODEL_ID, "gpt-4o-mini"]
        r = c.chat.completions.create(model="gpt-4o-mini", messages=[{"role": "user", "content": "hi"}],
                                      max_tokens=2)
        assert r.model == "gpt-4o-mini" and r.choices[0].message.content is not None
        with pytest.raises(openai.NotFoundError):
            c.chat.completions.create(model="claude", messages=[{"role": "user", "content": "hi"}])
    finally:
        s.stop()
    s = ThreadServer(create_app(engine, snapshots=tmp_path, model_id=MODEL_ID, aliases=("*",)))
    try:
        c = client(s.url)
        assert [m.id for m in c.models.list().data] == [MODEL_ID]
        r = c.chat.completions.create(model="anything-at-all", max_tokens=2,
                                      messages=[{"role": "user", "content": "hi"}])
        assert r.model == "anything-at-all"
    finally:
        s.stop()


def test_a_request_never_runs_in_a_session_the_store_dropped_while_it_waited(default_checkpoint, tmp_path):
    """Two requests name one new session on a full server: the first fails to start (503) and the
    session is forgotten; the second, which waited for its lock, chooses again — a registered session,
    never the dropped object (whose actor and KV slot nobody would ever free)."""
    from floe.server.sessions import NoFreeSlot, SessionStore

    engine = Engine(default_checkpoint, max_seq_len=64, n_slots=1)
    # The first waits 3 s for a slot before its 503 (not the default 30); the second, 6 s for its lock
    store = SessionStore(engine, tmp_path, wait_seconds=3.0)
    hi = [{"role": "user", "content": "hi"}]
    busy = store.acquire("busy", hi, 0)
    store.go_live(busy)  # the only slot, held by a running request
    first = store.acquire("twice", hi, 0)
    with ThreadPoolExecutor(1) as pool:
        second = pool.submit(store.acquire, "twice", hi, 0)  # waits for the first's lock
        time.sleep(0.2)
        try:
            with pytest.raises(NoFreeSlot):
                store.go_live(first)
        finally:
            store.release(first)
        session = second.result(timeout=30)
    assert session is not first and store.sessions["twice"] is session
    store.release(session)
    store.release(busy)
    store.close(freeze=False)


def store_turn(store, sid: str | None, text: str):
    """One two-token greedy turn of `text` in session `sid` (None: the store chooses or makes an
    anonymous one) through a SessionStore, as the core runs it; returns the session."""
    from floe.engine import SamplingParams

    session = store.acquire(sid, [{"role": "user", "content": text}], 0)
    try:
        store.go_live(session)
        store.run(session, [], text, max_tokens=2, params=SamplingParams())
        return session
    finally:
        store.release(session)


def test_a_slot_freed_for_another_owner_freezes_a_newer_anonymous_session_past_the_bound(default_checkpoint,
                                                                                        tmp_path):
    """A slot taken for another arrival from an owner past max_anonymous forgets that owner's session
    only if it is the one the owner's next arrival would forget (its least recently used): a newer one
    is frozen, and the oldest (frozen) is the one forgotten when the arrival takes its room."""
    from floe.actor import EngineLoop
    from floe.server.sessions import SessionStore

    engine = Engine(default_checkpoint, max_seq_len=128, n_slots=2)
    store = SessionStore(engine, tmp_path, loop=EngineLoop(engine), max_anonymous=2)

    def turn(text: str):
        return store_turn(store, None, text)

    try:
        oldest = turn("Name a colour.")
        assert store._make_room(oldest) and not oldest.live  # (not past the bound: frozen)
        newer = turn("Name a fruit.")
        arriving = store.registry.choose(None, [], 0, "")  # (registered, not yet bound)
        assert store._make_room(newer)  # three of the owner's now, two allowed
        assert store.sessions.get(newer.key) is newer and not newer.live  # frozen, not forgotten
        assert store.sessions.get(oldest.key) is oldest
        arriving.lock.acquire()
        store._bound_anonymous(arriving)
        arriving.lock.release()
        assert store.sessions.get(oldest.key) is None and store.sessions.get(newer.key) is newer
    finally:
        store.close(freeze=False)


def test_a_burst_past_the_anonymous_bound_forgets_one_idle_session_each(default_checkpoint, tmp_path):
    """A burst of new anonymous sessions into slots that idle anonymous sessions of the same owner hold
    (past max_anonymous): each arrival forgets exactly one of the old ones (claimed under the store's
    lock: none tries another's, 64 at once each tried the whole list) and takes a spare actor made
    while the loop was idle; the owner keeps max_anonymous sessions, the new ones."""
    from floe.actor import EngineLoop
    from floe.engine import SamplingParams
    from floe.server.sessions import SessionStore

    n = 4
    engine = Engine(default_checkpoint, max_seq_len=128, n_slots=n)
    store = SessionStore(engine, tmp_path, loop=EngineLoop(engine), max_anonymous=n)
    store.keep_spares(n)
    forgets = []
    forget = store.lifecycle.forget_locked

    def counted(session):
        forgets.append(session.id)
        return forget(session)

    store.lifecycle.forget_locked = counted

    def burst(round_: int) -> list[str]:
        deadline = time.time() + 60
        while store.counts()["spare_actors"] != n:
            assert time.time() < deadline, store.counts()
            time.sleep(0.02)
        spares = list(store.spares.ready)
        gate = threading.Barrier(n)

        def one(i: int):
            messages = [{"role": "user", "content": f"Round {round_}, question {i}: name a colour."}]
            gate.wait()
            session = store.acquire(None, messages, i)
            try:
                store.go_live(session)
                assert session.actor in spares
                store.run(session, [], messages[0]["content"], max_tokens=2, params=SamplingParams())
                return session.id
            finally:
                store.release(session)

        with ThreadPoolExecutor(n) as pool:
            return list(pool.map(one, range(n)))

    try:
        first = burst(1)
        assert forgets == []
        second = burst(2)
        assert sorted(forgets) == sorted(first)  # one each, and each once
        assert {s.id for s in store.sessions.values()} == set(second)
    finally:
        store.close(freeze=False)
    assert len(engine.slots.free) == n


def test_a_frozen_sessions_next_message_thaws_it_into_a_spare_actor(default_checkpoint, tmp_path):
    """A session thawed for its next message is restored into a spare actor where there is one (made
    ahead: no actor made on the message's path; floe.snapshot.thaw's into), and goes on as a session
    never frozen does; without spares the thaw makes its own."""
    from floe.actor import EngineLoop
    from floe.engine import SamplingParams
    from floe.server.sessions import SessionStore

    engine = Engine(default_checkpoint, max_seq_len=128, n_slots=2)
    loop = EngineLoop(engine)
    turns = ["Tell me a story.", "Make it shorter."]
    sampled = SamplingParams(1.0, top_p=0.9)

    def conversation(store, freeze: bool) -> tuple[list[str], object]:
        texts, history, actor = [], [], None
        for i, text in enumerate(turns):
            messages = [*history, {"role": "user", "content": text}]
            session = store.acquire("s", messages, 7)
            try:
                store.go_live(session)
                actor = session.actor
                reply = store.run(session, store.pending(session, messages), text, max_tokens=8,
                                  params=sampled)
            finally:
                store.release(session)
            texts.append(reply.text)
            history = [*messages, {"role": "assistant", "content": reply.text}]
            if freeze and i == 0:
                assert store.freeze("s", "")["state"] == "frozen"
                deadline = time.time() + 60
                while store.counts()["spare_actors"] != 2:  # (made again while the loop idles)
                    assert time.time() < deadline, store.counts()
                    time.sleep(0.02)
                spares = list(store.spares.ready)
        return texts, actor in spares if freeze else None

    plain = SessionStore(engine, tmp_path / "plain", loop=loop)
    expected, _ = conversation(plain, freeze=False)
    plain.close(freeze=False)
    store = SessionStore(engine, tmp_path / "spares", loop=loop)
    store.keep_spares(2)
    texts, thawed_into_a_spare = conversation(store, freeze=True)
    assert texts == expected and thawed_into_a_spare
    assert store.counts()["live"] == 1 and store.counts()["frozen"] == 0
    store.close(freeze=False)
    assert len(engine.slots.free) == 2


def test_new_sessions_take_spare_actors_made_while_idle(default_checkpoint, tmp_path):
    """Spare actors (without KV slots) are made while the engine loop is idle, whether slots are free or
    held; a new session takes one (seeded as its own would be: the same sampled reply) with a slot, also
    when every slot is held by an idle session (frozen for it); closing the store frees every slot."""
    from floe.actor import EngineLoop
    from floe.engine import SamplingParams
    from floe.server.sessions import SessionStore

    engine = Engine(default_checkpoint, max_seq_len=128, n_slots=2)
    loop = EngineLoop(engine)
    hi = [{"role": "user", "content": "Tell me a story."}]
    sampled = SamplingParams(1.0, top_p=0.9)

    def wait_spares(store, n):
        deadline = time.time() + 60
        while store.counts()["spare_actors"] != n:
            assert time.time() < deadline, store.counts()
            time.sleep(0.02)

    plain = SessionStore(engine, tmp_path / "plain", loop=loop)
    session = plain.acquire("s", hi, 7)
    expected = plain.run(session, [], hi[0]["content"], max_tokens=12, params=sampled).text
    plain.release(session)
    plain.close(freeze=False)

    store = SessionStore(engine, tmp_path / "spares", loop=loop)
    store.keep_spares(2)
    wait_spares(store, 2)
    spares = list(store.spares.ready)
    session = store.acquire("s", hi, 7)
    store.go_live(session)
    assert session.actor in spares and store.counts() == {"live": 1, "frozen": 0, "spare_actors": 1}
    assert store.run(session, [], hi[0]["content"], max_tokens=12, params=sampled).text == expected
    store.release(session)
    wait_spares(store, 2)  # made again (they hold no slot)
    other = store.acquire("t", hi, 8)
    store.go_live(other)
    store.release(other)
    wait_spares(store, 2)
    assert not engine.slots.free and store.counts() == {"live": 2, "frozen": 0, "spare_actors": 2}
    spares = list(store.spares.ready)
    third = store.acquire("u", hi, 9)
    store.go_live(third)  # every slot held: the least recently used idle session is frozen for it
    assert third.actor in spares and third.actor.slot is not None
    assert store.counts() == {"live": 2, "frozen": 1, "spare_actors": 1}
    store.release(third)
    assert store.thaw("s")["state"] == "live"  # (and back: "t" frozen for it)
    store.close(freeze=False)
    assert len(engine.slots.free) == 2


def test_a_snapshot_imported_over_an_anonymous_session_is_named_and_never_forgotten_as_anonymous(
        default_checkpoint, tmp_path):
    """An import onto an anonymous session's id makes it named (its record's): the owner's next
    anonymous arrival past max_anonymous forgets none of it, and its snapshot stays (the session
    table's anonymous index is told: review of b69b946)."""
    from floe.actor import EngineLoop
    from floe.server.sessions import SessionStore

    engine = Engine(default_checkpoint, max_seq_len=128, n_slots=2)
    store = SessionStore(engine, tmp_path, loop=EngineLoop(engine), max_anonymous=1)

    def turn(sid: str | None, text: str):
        return store_turn(store, sid, text)

    try:
        named = turn("carried", "Name a colour.")
        exported = b"".join(bytes(chunk) for chunk in store.export("carried"))
        anonymous = turn(None, "Name a fruit.")
        assert anonymous.anonymous and store.sessions.anonymous("") == [anonymous]
        store.import_(anonymous.id, "", [exported])
        assert not anonymous.anonymous and store.sessions.anonymous("") == []
        turn(None, "Name a tree.")  # past the bound of one if the import still counted as anonymous
        assert store.sessions.get(anonymous.key) is anonymous and store.snapshots.has(anonymous.key)
        assert store.sessions.get(named.key) is named
    finally:
        store.close(freeze=False)
