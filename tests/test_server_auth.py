"""`floe serve` with API keys, against a real server on loopback: a request without a valid key is a 401
that is not retried; each key sees and touches only its own sessions (by id, by prefix, through a
freeze, a thaw and a restart); a fork is its owner's and continues as its source would; hostile session
ids are refused on every route; CORS is off unless configured; anonymous sessions are bounded per key."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import openai
import pytest
from test_server import (
    CONTEXT,
    MODEL_ID,
    ThreadServer,
    ask,
    folder_state,
    free_port,
    requests_counted,
    start_serve,
)

from floe.engine import Engine
from floe.server.app import create_app
from floe.server.auth import owner_of
from floe.snapshot import header

ALICE, BOB = "alice-0123456789abcdef", "bob-fedcba9876543210"
GREETING = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Hello"}]


def as_(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def client(url: str, key: str, retries: int = 0) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=retries, timeout=300)


def listed(url: str, key: str) -> dict[str, dict]:
    r = httpx.get(f"{url}/v1/sessions", headers=as_(key))
    assert r.status_code == 200, r.text
    return {s["id"]: s for s in r.json()["data"]}


def say(url: str, key: str, messages: list[dict], session: str | None = None):
    extra = {"session_id": session} if session else {}
    return ask(client(url, key), messages, max_tokens=8, extra_body=extra)


@pytest.fixture(scope="module")
def engine(default_checkpoint):
    """For the servers a test starts and stops (one at a time: each keeps spare actors in every slot)."""
    return Engine(default_checkpoint, max_seq_len=CONTEXT, n_slots=4, weights="native")


@pytest.fixture(scope="module")
def server(default_checkpoint, tmp_path_factory):
    folder = tmp_path_factory.mktemp("sessions")
    engine = Engine(default_checkpoint, max_seq_len=CONTEXT, n_slots=4, weights="native")
    s = ThreadServer(create_app(engine, snapshots=folder, model_id=MODEL_ID, idle_seconds=3600,
                                keys=(ALICE, BOB), operator_keys=(ALICE,)))  # Alice runs the server
    s.folder = folder
    yield s
    s.stop()


def test_a_request_without_a_valid_key_is_a_401_that_is_not_retried(server):
    """The official client (retrying by default) sends a wrong key once; no key, a wrong scheme and a
    key's prefix are refused the same way; /health answers without a key, and says no more than ok."""
    before = requests_counted(server.url, "401", as_(ALICE))
    with pytest.raises(openai.AuthenticationError) as e:
        client(server.url, "not-a-key", retries=2).models.list()
    assert e.value.response.headers["x-should-retry"] == "false"
    assert e.value.response.json()["error"]["code"] == "invalid_api_key"
    assert requests_counted(server.url, "401", as_(ALICE)) == before + 1
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}]}
    for headers in ({}, {"Authorization": f"Basic {ALICE}"}, as_(ALICE[:-1]), as_(f"{ALICE}x")):
        for method, path in (("POST", "/v1/chat/completions"), ("GET", "/v1/sessions"),
                             ("GET", "/v1/models"), ("GET", "/metrics"), ("DELETE", "/v1/sessions/x")):
            r = httpx.request(method, f"{server.url}{path}", headers=headers, json=body, timeout=60)
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", (headers, path, r.text)
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{server.url}/health", headers=as_(BOB)).json()["model"] == MODEL_ID
    assert [m.id for m in client(server.url, BOB).models.list().data] == [MODEL_ID]


def test_two_keys_cannot_see_or_touch_each_others_sessions(server):
    url = server.url
    turn = [{"role": "user", "content": "What is the capital of France?"}]
    first = say(url, ALICE, turn, "plans")
    alices = [*turn, {"role": "assistant", "content": first.choices[0].message.content}]
    assert "plans" in listed(url, ALICE) and "plans" not in listed(url, BOB)
    for method, path in (("GET", ""), ("POST", "/freeze"), ("POST", "/thaw"), ("DELETE", "")):
        r = httpx.request(method, f"{url}/v1/sessions/plans{path}", headers=as_(BOB), timeout=60)
        assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found", (path, r.text)
    with pytest.raises(openai.NotFoundError):  # Alice's conversation by her session's id
        say(url, BOB, [*alices, {"role": "user", "content": "And of Italy?"}], "plans")
    # Bob's own "plans": a new session of his; Alice's is untouched (and her next turn hits her cache).
    bobs = say(url, BOB, turn, "plans")
    assert bobs.usage.prompt_tokens_details.cached_tokens == 0
    assert listed(url, BOB)["plans"]["messages"] == 2 and listed(url, ALICE)["plans"]["messages"] == 2
    second = say(url, ALICE, [*alices, {"role": "user", "content": "And of Italy?"}], "plans")
    assert second.usage.prompt_tokens_details.cached_tokens > first.usage.prompt_tokens
    assert httpx.delete(f"{url}/v1/sessions/plans", headers=as_(BOB)).status_code == 200
    assert listed(url, ALICE)["plans"]["messages"] == 4 and "plans" not in listed(url, BOB)


def test_prefix_matching_finds_only_the_callers_own_sessions(server):
    """Two clients open with the same system prompt and "Hello" (greedy: the same reply, so both
    sessions hold the same conversation): two sessions; each one's next turn (the whole conversation
    resent, no id) continues its own, Bob's first, whose match Alice's older session would win."""
    url = server.url
    a, b = say(url, ALICE, GREETING), say(url, BOB, GREETING)
    sid_a, sid_b = a.model_extra["session_id"], b.model_extra["session_id"]
    assert sid_a != sid_b and b.usage.prompt_tokens_details.cached_tokens == 0
    assert a.choices[0].message.content == b.choices[0].message.content
    assert sid_a in listed(url, ALICE) and sid_a not in listed(url, BOB)
    for key, reply, sid in ((BOB, b, sid_b), (ALICE, a, sid_a)):
        again = say(url, key, [*GREETING, {"role": "assistant", "content": reply.choices[0].message.content},
                               {"role": "user", "content": "How are you?"}])
        assert again.model_extra["session_id"] == sid and again.usage.prompt_tokens_details.cached_tokens > 0


HOSTILE = ["..", ".hidden", "-x", "abc\n", "a b", "caf\u00e9", "x" * 129, "a\\b", "a\x00b", "nul\r\nX-A: b"]


def encoded(sid: str) -> str:
    return "".join(f"%{b:02X}" for b in sid.encode())  # every byte: nothing is normalized on the way


@pytest.fixture(scope="module")
def fork_source(server) -> str:
    """A session of Alice's with one turn, for the forks the tests refuse."""
    say(server.url, ALICE, [{"role": "user", "content": "Hi"}], "fork-source")
    return "fork-source"


@pytest.mark.parametrize("sid", HOSTILE)
def test_hostile_session_ids_are_refused_on_every_route(server, fork_source, sid):
    before = folder_state(server.folder.parent)
    routes = (("GET", ""), ("POST", "/freeze"), ("POST", "/thaw"), ("POST", "/fork"), ("DELETE", ""))
    for method, path in routes:
        r = httpx.request(method, f"{server.url}/v1/sessions/{encoded(sid)}{path}", headers=as_(ALICE))
        assert r.status_code == 400 and "session id" in r.json()["error"]["message"], (method, path, r.text)
    r = httpx.post(f"{server.url}/v1/sessions/{fork_source}/fork", json={"id": sid}, headers=as_(ALICE))
    assert r.status_code == 400 and "session id" in r.json()["error"]["message"], r.text
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body | {"session_id": sid}, headers=as_(ALICE),
                   timeout=60)
    assert r.status_code == 400 and "session id" in r.json()["error"]["message"], r.text
    if sid.isprintable() and sid.isascii():  # what a header can carry
        r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60,
                       headers=as_(ALICE) | {"X-Floe-Session": sid})
        assert r.status_code == 400, r.text
    assert folder_state(server.folder.parent) == before


def test_a_slash_in_a_session_id_reaches_no_session_route(server):
    for sid in ("../../etc/passwd", "a/b"):
        for path in ("/freeze", "/fork"):
            r = httpx.post(f"{server.url}/v1/sessions/{encoded(sid)}{path}", headers=as_(ALICE))
            assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", r.text


def fork(url: str, key: str, sid: str, body: dict | None = None) -> httpx.Response:
    return httpx.post(f"{url}/v1/sessions/{sid}/fork", json=body, headers=as_(key), timeout=120)


def test_a_fork_continues_exactly_as_its_source_would_and_then_apart(server):
    """Alice forks a one-turn session: the fork is hers, stored, and holds the same conversation; the
    same next message to both (greedy) gets the same reply, and the fork's KV came with it (its
    prompt cached as its source's is); then each goes on without the other."""
    url = server.url
    turn = [{"role": "user", "content": "What is the capital of France?"}]
    first = say(url, ALICE, turn, "trunk").choices[0].message.content
    r = fork(url, ALICE, "trunk", {"id": "branch"})
    assert r.status_code == 200, r.text
    made = r.json()
    assert made["id"] == "branch" and made["forked_from"] == "trunk" and made["messages"] == 2
    assert made["state"] == "frozen" and made["snapshot_bytes"] > 0 and not made["anonymous"]
    path = server.folder / owner_of(ALICE) / "branch.safetensors"
    record = json.loads(header(path)["app"])["floe_server"]
    assert (record["id"], record["owner"], record["anonymous"]) == ("branch", owner_of(ALICE), False)
    assert record["messages"] == [*turn, {"role": "assistant", "content": first}]
    later = [*turn, {"role": "assistant", "content": first}, {"role": "user", "content": "And of Italy?"}]
    a, b = (ask(client(url, ALICE), later, max_tokens=16, extra_body={"session_id": sid})
            for sid in ("trunk", "branch"))
    assert a.choices[0].message.content == b.choices[0].message.content
    assert b.usage.prompt_tokens_details.cached_tokens == a.usage.prompt_tokens_details.cached_tokens > 0
    # Apart from here: a turn in the fork leaves its source as it was.
    say(url, ALICE, [*later, {"role": "assistant", "content": b.choices[0].message.content},
                     {"role": "user", "content": "Thanks."}], "branch")
    sessions = listed(url, ALICE)
    assert sessions["trunk"]["messages"] == 4 and sessions["branch"]["messages"] == 6


def test_a_frozen_or_one_shot_session_forks_as_a_live_one(server):
    """A frozen source is thawed to be forked (and answers as its fork does); a one-shot (anonymous)
    source's fork is a named session written to the home, the source still kept in RAM only."""
    url = server.url
    turn = [{"role": "user", "content": "Name a large city."}]
    first = say(url, ALICE, turn, "cold").choices[0].message.content
    assert httpx.post(f"{url}/v1/sessions/cold/freeze", headers=as_(ALICE)).status_code == 200
    assert fork(url, ALICE, "cold", {"id": "cold-fork"}).status_code == 200
    later = [*turn, {"role": "assistant", "content": first}, {"role": "user", "content": "Why that one?"}]
    a, b = (ask(client(url, ALICE), later, max_tokens=16, extra_body={"session_id": sid})
            for sid in ("cold", "cold-fork"))
    assert a.choices[0].message.content == b.choices[0].message.content
    one_shot = say(url, ALICE, [{"role": "user", "content": "Name a small town."}]).model_extra["session_id"]
    made = fork(url, ALICE, one_shot).json()
    assert not made["anonymous"] and made["persisted"] and listed(url, ALICE)[one_shot]["anonymous"]
    assert (server.folder / owner_of(ALICE) / f"{made['id']}.safetensors").is_file()
    assert not (server.folder / owner_of(ALICE) / f"{one_shot}.safetensors").exists()


def test_a_fork_is_its_owners_and_needs_a_new_id(server):
    """Bob cannot fork (or learn of) Alice's session: 404 as for one that does not exist. A fork into
    an id the caller has is a 409 the official client does not retry; ids are per owner, so Bob may
    fork his own into an id of Alice's. Without an id the fork gets a fresh one."""
    url = server.url
    say(url, ALICE, [{"role": "user", "content": "Name a fruit."}], "mine")
    for sid in ("mine", "no-such-session"):
        r = fork(url, BOB, sid, {"id": "stolen"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found", r.text
    assert "stolen" not in listed(url, BOB) and "stolen" not in listed(url, ALICE)
    say(url, ALICE, [{"role": "user", "content": "Name a colour."}], "taken")
    for target in ("mine", "taken"):
        r = fork(url, ALICE, "mine", {"id": target})
        assert r.status_code == 409 and r.json()["error"]["code"] == "session_exists", r.text
        assert r.headers["x-should-retry"] == "false"
    with pytest.raises(openai.ConflictError):
        client(url, ALICE, retries=2).post("/sessions/mine/fork", body={"id": "taken"}, cast_to=object)
    assert listed(url, ALICE)["taken"]["messages"] == 2  # untouched
    say(url, BOB, [{"role": "user", "content": "Name a fruit."}], "bobs")
    assert fork(url, BOB, "bobs", {"id": "mine"}).status_code == 200
    assert listed(url, BOB)["mine"]["messages"] == 2
    for body in (None, {}, {"id": None}):
        made = fork(url, ALICE, "mine", body).json()
        assert len(made["id"]) == 16 and made["id"] in listed(url, ALICE) and made["messages"] == 2
    r = fork(url, ALICE, "mine", {"id": "x", "model": "y"})  # nothing is silently ignored
    assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text


def test_a_fork_of_a_busy_session_waits_for_its_turn_to_end(server):
    """A fork asked while its source streams a reply answers after that turn, and holds it."""
    url = server.url
    c = client(url, ALICE)
    stream = ask(c, [{"role": "user", "content": "Count from 1 to 60, one number a line."}], max_tokens=96,
                 stream=True, extra_body={"session_id": "busy"})
    started, ended = threading.Event(), []

    def read() -> None:
        for _ in stream:
            started.set()
        ended.append(time.monotonic())

    reader = threading.Thread(target=read)
    reader.start()
    assert started.wait(60)
    asked = time.monotonic()
    r = fork(url, ALICE, "busy", {"id": "busy-fork"})
    answered = time.monotonic()
    reader.join(60)
    assert r.status_code == 200 and r.json()["messages"] == 2, r.text
    assert asked < ended[0] <= answered  # asked while the turn ran; answered once it had ended


def test_ownership_survives_freeze_thaw_and_a_restart(engine, tmp_path):
    """Alice's sessions are stored under her key's owner id (never the key): frozen, thawed and after a
    restart on the same folder they are hers only; the server without keys sees none of them."""
    s = ThreadServer(create_app(engine, snapshots=tmp_path, model_id=MODEL_ID, keys=(ALICE, BOB)))
    turn = [{"role": "user", "content": "What is the capital of France?"}]
    try:
        reply = say(s.url, ALICE, turn, "kept").choices[0].message.content
        later = [*turn, {"role": "assistant", "content": reply}, {"role": "user", "content": "And of Italy?"}]
        anonymous = say(s.url, ALICE, GREETING).model_extra["session_id"]
        assert httpx.post(f"{s.url}/v1/sessions/kept/freeze", headers=as_(ALICE)).status_code == 200
        assert httpx.post(f"{s.url}/v1/sessions/kept/thaw", headers=as_(BOB)).status_code == 404
        assert httpx.post(f"{s.url}/v1/sessions/kept/thaw", headers=as_(ALICE)).json()["state"] == "live"
        assert listed(s.url, BOB) == {}
    finally:
        s.stop()  # freezes the live sessions
    path = tmp_path / owner_of(ALICE) / "kept.safetensors"
    meta = header(path)
    assert json.loads(meta["app"])["floe_server"]["owner"] == owner_of(ALICE)
    assert not any(key in value for value in meta.values() for key in (ALICE, BOB))
    s = ThreadServer(create_app(engine, snapshots=tmp_path, model_id=MODEL_ID, keys=(ALICE, BOB)))
    try:
        # The anonymous one was kept in RAM only (one-shot sessions are not persisted unless asked).
        assert set(listed(s.url, ALICE)) == {"kept"} and listed(s.url, BOB) == {}
        assert not (tmp_path / owner_of(ALICE) / f"{anonymous}.safetensors").exists()
        assert httpx.post(f"{s.url}/v1/sessions/kept/freeze", headers=as_(BOB)).status_code == 404
        with pytest.raises(openai.NotFoundError):
            say(s.url, BOB, later, "kept")
        r = say(s.url, ALICE, later, "kept")
        assert r.usage.prompt_tokens_details.cached_tokens > 0  # thawed, not prefilled again
    finally:
        s.stop()
    s = ThreadServer(create_app(engine, snapshots=tmp_path, model_id=MODEL_ID))  # open: one owner, "anyone"
    try:
        assert httpx.get(f"{s.url}/v1/sessions").json()["data"] == []
        assert httpx.get(f"{s.url}/v1/sessions/kept").status_code == 404
    finally:
        s.stop()
    assert path.is_file()


def preflight(url: str, origin: str) -> httpx.Response:
    return httpx.options(f"{url}/v1/chat/completions", headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})


def test_cors_is_off_by_default_and_on_for_the_configured_origins(server, engine, tmp_path):
    site = "https://app.example"
    assert "access-control-allow-origin" not in preflight(server.url, site).headers
    r = httpx.get(f"{server.url}/v1/models", headers=as_(ALICE) | {"Origin": site})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    s = ThreadServer(create_app(engine, snapshots=tmp_path, model_id=MODEL_ID, keys=(ALICE,),
                                cors_origins=(site,)))
    try:
        r = preflight(s.url, site)  # a browser's preflight carries no key
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == site, r.text
        assert "authorization" in r.headers["access-control-allow-headers"].lower()
        r = httpx.get(f"{s.url}/v1/models", headers=as_(ALICE) | {"Origin": site})
        assert r.headers["access-control-allow-origin"] == site
        assert "x-floe-session" in r.headers["access-control-expose-headers"].lower()
        refused = httpx.get(f"{s.url}/v1/models", headers={"Origin": site})  # the page can read why
        assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == site
        other = httpx.get(f"{s.url}/v1/models", headers=as_(ALICE) | {"Origin": "https://evil.example"})
        assert "access-control-allow-origin" not in other.headers
        assert "access-control-allow-origin" not in preflight(s.url, "https://evil.example").headers
    finally:
        s.stop()


def test_anonymous_sessions_are_bounded_per_key(engine, tmp_path):
    """With max_anonymous=2, Alice's third anonymous session forgets her least recently used one (its
    snapshot deleted); her named session and Bob's anonymous one are kept."""
    s = ThreadServer(create_app(engine, snapshots=tmp_path, model_id=MODEL_ID, keys=(ALICE, BOB),
                                max_anonymous=2))
    try:
        bobs = say(s.url, BOB, [{"role": "user", "content": "Name a fruit."}]).model_extra["session_id"]
        say(s.url, ALICE, [{"role": "user", "content": "Name a colour."}], "named")
        ids = [say(s.url, ALICE, [{"role": "user", "content": f"Name a number above {n}."}])
               .model_extra["session_id"] for n in range(2)]
        assert httpx.post(f"{s.url}/v1/sessions/{ids[0]}/freeze", headers=as_(ALICE)).status_code == 200
        oldest = tmp_path / owner_of(ALICE) / f"{ids[0]}.safetensors"
        assert oldest.is_file()
        ids.append(say(s.url, ALICE, [{"role": "user", "content": "Name an animal."}])
                   .model_extra["session_id"])
        alices = listed(s.url, ALICE)
        assert set(alices) == {"named", *ids[1:]} and not oldest.exists()
        assert [alices[i]["anonymous"] for i in ids[1:]] == [True, True] and not alices["named"]["anonymous"]
        assert set(listed(s.url, BOB)) == {bobs}
    finally:
        s.stop()


def test_forgetting_a_one_shot_session_never_frozen_touches_no_file(engine, tmp_path):
    """An anonymous session that was never frozen is in no tier and holds no lease: forgetting it
    (past max_anonymous) leaves the store's folder alone (it took a lease, a file written and removed
    with its lock file left behind, on the path of the request that pushed it out)."""
    s = ThreadServer(create_app(engine, snapshots=tmp_path, model_id=MODEL_ID, keys=(ALICE,),
                                max_anonymous=1))
    try:
        first = say(s.url, ALICE, [{"role": "user", "content": "Name a colour."}]).model_extra["session_id"]
        say(s.url, ALICE, [{"role": "user", "content": "Name a fruit."}])
        assert first not in listed(s.url, ALICE)
        assert not [p.name for p in tmp_path.rglob("*") if first in p.name]
    finally:
        s.stop()


def test_floe_serve_takes_keys_from_its_flags_and_the_environment(tmp_path):
    """`floe serve --api-key A` with FLOE_API_KEYS=B: both keys are served (the HTTP front, a process
    of its own, has them), no key is a 401, and the start line says how many keys there are."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_serve(tmp_path, port, "--api-key", ALICE, env=os.environ | {"FLOE_API_KEYS": f" {BOB} ,"})
    try:
        for key in (ALICE, BOB):
            assert httpx.get(f"{url}/v1/models", headers=as_(key)).status_code == 200
        assert httpx.get(f"{url}/v1/models").status_code == 401
        assert httpx.get(f"{url}/health").json() == {"status": "ok"}
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    assert "2 API keys" in proc.stderr.read()


def test_only_the_operator_sees_the_whole_server_others_their_own_sessions(server):
    """/metrics and the whole /health (every owner's sessions, the engine loop) are the operator's; a
    key that is not sees its own sessions' counts, and a 403 for /metrics."""
    say(server.url, BOB, [{"role": "user", "content": "Name a tree."}], "bobs-tree")
    r = httpx.get(f"{server.url}/metrics", headers=as_(BOB))
    assert r.status_code == 403 and r.json()["error"]["code"] == "operator_only", r.text
    assert r.headers["x-should-retry"] == "false"
    assert "floe_requests_total" in httpx.get(f"{server.url}/metrics", headers=as_(ALICE)).text
    bobs = httpx.get(f"{server.url}/health", headers=as_(BOB)).json()
    assert set(bobs) == {"status", "model", "device", "uptime_s", "sessions"}, bobs
    assert set(bobs["sessions"]) == {"live", "frozen"}
    assert sum(bobs["sessions"].values()) == len(listed(server.url, BOB)) >= 1
    everything = httpx.get(f"{server.url}/health", headers=as_(ALICE)).json()
    assert "engine_loop" in everything and "spare_actors" in everything["sessions"]


def test_keys_come_from_a_file_the_environment_and_the_command_line(tmp_path):
    """--api-key-file (one a line, # comments) and FLOE_API_KEYS are the way: `ps` shows a command line."""
    from floe.server.auth import BadApiKey, api_keys

    keys = tmp_path / "keys"
    keys.write_text("# the team's keys\nkey-one\n\n  key-two  \n")
    assert api_keys(["key-cli"], {"FLOE_API_KEYS": "key-env"}, files=[keys]) == (
        "key-cli", "key-env", "key-one", "key-two")
    keys.write_text("a key with spaces\n")
    with pytest.raises(BadApiKey, match="printable ASCII"):
        api_keys(files=[keys])
    with pytest.raises(BadApiKey, match="cannot read API keys"):
        api_keys(files=[tmp_path / "missing"])
