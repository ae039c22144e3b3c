"""`floe serve` with several models (issue 44; floe.server.models): `/v1/models` lists them with whether
each is loaded, a request's `model` picks its engine (loaded at its first request), sessions stay on
the model that made them, and hostile model names load nothing. Driven by the official `openai` client
against the real app (front and core, as `floe serve` runs them), compared with one-model servers."""

from __future__ import annotations

import gc
import re
import signal
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import quote

import httpx
import openai
import psutil
import pytest
from gguf import GGMLQuantizationType as Q
from models import write_gguf
from test_server import ThreadServer, free_port, start_serve

from floe.engine import Engine
from floe.memory import rss_bytes
from floe.model import load_checkpoint
from floe.server.app import app_of, create_app
from floe.server.core import ServeCore
from floe.server.models import ModelRouter, ModelSpec, model_specs, models_in
from floe.server.sessions import snapshot_store

pytestmark = pytest.mark.slow  # three engines and their servers
CONTEXT = 256
TURNS = ["What is the capital of France?", "And of Italy?"]


@pytest.fixture(scope="module")
def model_files(tmp_path_factory):
    """Two tiny random GGUF models (the default model's tokenizer), by name; "smol": the default model."""
    folder = tmp_path_factory.mktemp("models")
    return {"smol": None, **{name: str(write_gguf(folder / f"{name}.gguf", [Q.F32], seed=seed))
                             for seed, name in enumerate(("tiny-a", "tiny-b"), 1)}}


def engine_of(path: str | None, default_checkpoint) -> Engine:
    checkpoint = default_checkpoint if path is None else load_checkpoint(path)
    return Engine(checkpoint, max_seq_len=CONTEXT, n_slots=4, weights="native")


def router_server(model_files, default_checkpoint, folder, **options) -> ThreadServer:
    """The app of a router over `model_files`, each model's sessions under `folder`/its name."""
    idle_seconds = options.pop("idle_seconds", 3600)
    keys = {k: options.pop(k, ()) for k in ("keys", "operator_keys")}

    def load(spec: ModelSpec, store) -> ServeCore:
        return ServeCore(engine_of(spec.path, default_checkpoint), snapshots=store, model_id=spec.name,
                         idle_seconds=idle_seconds)

    stores = [(ModelSpec(name, path), snapshot_store(folder / name)) for name, path in model_files.items()]
    router = ModelRouter(stores, load, **options)
    server = ThreadServer(app_of(router, **keys))
    server.router = router
    return server


@pytest.fixture(scope="module")
def server(model_files, default_checkpoint, tmp_path_factory):
    s = router_server(model_files, default_checkpoint, tmp_path_factory.mktemp("sessions"))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def references(model_files, default_checkpoint, tmp_path_factory):
    """A one-model server of each model, by name."""
    servers = {name: ThreadServer(create_app(engine_of(path, default_checkpoint), model_id=name,
                                             snapshots=tmp_path_factory.mktemp(name), idle_seconds=3600))
               for name, path in model_files.items()}
    yield servers
    for s in servers.values():
        s.stop()


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)


def conversation(url: str, model: str, session: str) -> list[str]:
    """The greedy replies of TURNS, one session (named), on `model`."""
    c, messages, replies = client(url), [], []
    for text in TURNS:
        messages.append({"role": "user", "content": text})
        r = c.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=12,
                                      extra_body={"session_id": session})
        assert r.model == model and r.model_extra["session_id"] == session
        replies.append(r.choices[0].message.content)
        messages.append({"role": "assistant", "content": replies[-1]})
    return replies


def loaded(url: str) -> dict[str, bool]:
    return {m.id: m.model_extra["loaded"] for m in client(url).models.list().data}


def test_models_are_listed_with_whether_each_is_loaded_and_load_on_first_request(server):
    assert loaded(server.url) == {"smol": True, "tiny-a": False, "tiny-b": False}  # the first at start
    one = client(server.url).models.retrieve("tiny-b")
    assert one.id == "tiny-b" and one.model_extra["loaded"] is False
    r = client(server.url).chat.completions.create(
        model="tiny-b", messages=[{"role": "user", "content": "Hi"}], max_tokens=2, temperature=0)
    assert r.model == "tiny-b" and r.usage.completion_tokens >= 1
    one = client(server.url).models.retrieve("tiny-b")
    assert one.model_extra["loaded"] is True and one.model_extra["load_seconds"] > 0
    with pytest.raises(openai.NotFoundError) as e:
        client(server.url).models.retrieve("tiny-c")
    assert e.value.code == "model_not_found" and "'smol', 'tiny-a', 'tiny-b'" in e.value.message


def test_concurrent_sessions_on_three_models_answer_as_one_model_servers_do(server, references):
    names = ["smol", "tiny-a", "tiny-b"]
    expected = {name: conversation(references[name].url, name, f"ref-{name}") for name in names}
    with ThreadPoolExecutor(6) as pool:  # two sessions on each model, all at once
        runs = {(name, i): pool.submit(conversation, server.url, name, f"conc-{name}-{i}")
                for name in names for i in range(2)}
        got = {key: run.result() for key, run in runs.items()}
    for (name, _), replies in got.items():
        assert replies == expected[name], name
    assert expected["smol"] != expected["tiny-a"] != expected["tiny-b"]  # three models, not one


def test_a_session_asked_on_another_model_is_refused(server):
    conversation(server.url, "smol", "bound")
    for step in ("live", "frozen"):
        with pytest.raises(openai.ConflictError) as e:
            client(server.url).chat.completions.create(
                model="tiny-a", messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                extra_body={"session_id": "bound"})
        assert e.value.code == "session_model_mismatch" and "'smol'" in e.value.message, step
        httpx.post(f"{server.url}/v1/sessions/bound/freeze", timeout=60).raise_for_status()
    turn(server.url, "tiny-a", "other", [], "Hi")
    listed = {s["id"]: s["model"] for s in httpx.get(f"{server.url}/v1/sessions", timeout=60).json()["data"]}
    assert listed["bound"] == "smol" and listed["other"] == "tiny-a"
    fork = httpx.post(f"{server.url}/v1/sessions/bound/fork", json={"id": "other"}, timeout=60)
    assert fork.status_code == 409 and fork.json()["error"]["code"] == "session_exists"  # (tiny-a's id)
    for sid in ("bound", "other"):  # each session's routes reach its own model's core
        snapshot = httpx.get(f"{server.url}/v1/sessions/{sid}/snapshot", timeout=60)
        assert snapshot.status_code == 200 and len(snapshot.content) > 1000
    assert conversation(server.url, "smol", "bound")  # (its own model goes on with it)


@pytest.mark.parametrize("name", ["../tiny-a", "/etc/passwd", "tiny-a/../tiny-b", "..", "x" * 10_000,
                                  "tiny-a\n", "tiny\x00a", "tiny-a\x1b[2J", "TINY-A", " tiny-a"])
def test_hostile_model_names_are_refused_and_load_nothing(server, name):
    before = loaded(server.url)
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "model": name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    assert r.status_code in (400, 404), r.text
    assert len(r.text) < 1000 and "model" in r.json()["error"]["message"]
    listing = httpx.get(f"{server.url}/v1/models/{quote(name, safe='')}", timeout=60)  # (as sent: not
    # resolved by the client)
    assert listing.status_code in (400, 404) and len(listing.text) < 1000
    assert loaded(server.url) == before


def turn(url: str, model: str, session: str, messages: list[dict], text: str, **extra) -> str:
    """One greedy turn of `session` on `model`: its reply, appended to `messages` with the question."""
    messages.append({"role": "user", "content": text})
    r = client(url).chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=12,
                                            extra_body={"session_id": session, **extra})
    messages.append({"role": "assistant", "content": r.choices[0].message.content})
    return r.choices[0].message.content


def wait_for(condition, seconds: float = 60.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "it never happened"
        time.sleep(0.1)


def test_an_idle_model_is_unloaded_its_memory_released_and_its_session_continues(
        model_files, default_checkpoint, references, tmp_path):
    """keep_alive 1 s, sessions frozen after 0.5 s idle: tiny-a loads for a turn, is unloaded (its engine
    collected, the process's RSS back down by most of what the load added), and its session's next turn
    loads it again and answers as an uninterrupted one-model server's."""
    expected = conversation(references["tiny-a"].url, "tiny-a", "ref-idle")
    s = router_server({"smol": None, "tiny-a": model_files["tiny-a"]}, default_checkpoint, tmp_path,
                      idle_seconds=0.5, keep_alive=1.0)
    try:
        gc.collect()
        before = rss_bytes()
        messages = []
        replies = [turn(s.url, "tiny-a", "idle", messages, TURNS[0])]
        engine = weakref.ref(s.router.models["tiny-a"].core.engine)
        loaded_rss = rss_bytes()
        wait_for(lambda: not loaded(s.url)["tiny-a"])
        wait_for(lambda: gc.collect() is not None and engine() is None, 30)  # (its loop's thread ends idle)
        # the server hands the freed heap back on its next upkeep round (0.25 s) after it sees the engine
        # gone; this test's own collect may be the one that freed it, so wait for that round
        released = []
        try:
            wait_for(lambda: released.append(rss_bytes()) or
                     released[-1] < loaded_rss - (loaded_rss - before) / 2, 10)
        except AssertionError:
            raise AssertionError(("rss before, loaded, after", before, loaded_rss, released[-1])) from None
        listed = httpx.get(f"{s.url}/v1/sessions", timeout=60).json()["data"]  # (read from its store)
        assert [(x["id"], x["model"], x["state"], x["messages"]) for x in listed] == [
            ("idle", "tiny-a", "frozen", 2)]
        one = httpx.get(f"{s.url}/v1/sessions/idle", timeout=60).json()
        assert one["state"] == "frozen" and one["snapshot_bytes"] > 0 and not loaded(s.url)["tiny-a"]
        wait_for(lambda: not any(loaded(s.url).values()))  # (the first model too: idle, no session)
        for sid, status in (("nobody", 404), ("-bad", 400)):  # answered without loading a model for it
            for call in (httpx.get, httpx.delete):
                assert call(f"{s.url}/v1/sessions/{sid}", timeout=60).status_code == status
        assert not any(loaded(s.url).values())
        replies.append(turn(s.url, "tiny-a", "idle", messages, TURNS[1]))
        assert replies == expected and s.router.models["tiny-a"].loads == 2
    finally:
        s.stop()


def test_a_request_keep_alive_sets_its_model_idle_time(model_files, default_checkpoint, tmp_path):
    s = router_server(model_files, default_checkpoint, tmp_path, idle_seconds=0.5,  # kept for ever, and
                      memory_budget=64 << 30)  # a budget that holds them all
    try:
        messages = []
        turn(s.url, "tiny-a", "kept", messages, "Hi", keep_alive="10m")
        turn(s.url, "tiny-b", "gone", [], "Hi", keep_alive=0)
        wait_for(lambda: not loaded(s.url)["tiny-b"])
        assert loaded(s.url) == {"smol": True, "tiny-a": True, "tiny-b": False}
        with pytest.raises(openai.BadRequestError) as e:
            turn(s.url, "tiny-a", "kept", messages, "Hi", keep_alive="soon")
        assert e.value.param == "keep_alive"
    finally:
        s.stop()


@pytest.mark.parametrize("limit", [{"max_loaded": 1}, {"memory_budget": 1}], ids=["max_loaded", "budget"])
def test_one_model_loaded_at_a_time_alternating_requests_answer_and_sessions_thaw(
        model_files, default_checkpoint, references, tmp_path, limit):
    """--max-loaded 1, or a memory budget that holds one model (here: none; alone, a model loads): each
    request for the other model unloads the one loaded (its live session frozen first); alternating
    turns of two sessions answer as uninterrupted one-model servers' do, and requests for both models at
    once all answer (a load waits for the loaded model's request to end)."""
    expected = {name: conversation(references[name].url, name, f"ref-max-{name}")
                for name in ("tiny-a", "tiny-b")}
    s = router_server(model_files, default_checkpoint, tmp_path, **limit)
    try:
        messages = {"tiny-a": [], "tiny-b": []}
        replies = {"tiny-a": [], "tiny-b": []}
        for text in TURNS:
            for name in ("tiny-a", "tiny-b"):
                replies[name].append(turn(s.url, name, f"max-{name}", messages[name], text))
                assert [m for m, up in loaded(s.url).items() if up] == [name]
        assert replies == expected
        assert s.router.models["tiny-a"].loads == 2 and s.router.models["tiny-b"].loads == 2
        assert client(s.url).models.retrieve("tiny-b").model_extra["bytes"] > 0  # (measured at its load)
        with ThreadPoolExecutor(4) as pool:
            runs = {(name, i): pool.submit(conversation, s.url, name, f"both-{name}-{i}")
                    for i in range(2) for name in ("tiny-a", "tiny-b")}
            assert all(run.result() == expected[name] for (name, _), run in runs.items())
    finally:
        s.stop()


def test_floe_serve_loads_a_named_model_on_demand_and_unloads_it_idle(model_files, tmp_path):
    """The command: `--model NAME=PATH` twice (`smol=`: the default model), --keep-alive; the process's
    RSS falls back once the on-demand model is unloaded, and its log says so."""
    port = free_port()
    proc = start_serve(tmp_path, port, "--model", "smol=", "--model", f"tiny-a={model_files['tiny-a']}",
                       "--keep-alive", "1")
    url = f"http://127.0.0.1:{port}"
    try:
        rss = psutil.Process(proc.pid).memory_info
        # smol kept loaded (--keep-alive 1 is every model's: a loaded machine's wait below outlasted it,
        # smol was unloaded and its health had no sessions)
        client(url).chat.completions.create(model="smol", messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=1, extra_body={"keep_alive": "10m"})
        health = lambda: httpx.get(url + "/health", timeout=60).json()["models"]["smol"]  # noqa: E731
        wait_for(lambda: health().get("sessions", {}).get("spare_actors") == 4)  # (settled: the first
        base = rss().rss  # model's spares made, which the RSS below must not count as the second model's)
        assert loaded(url) == {"smol": True, "tiny-a": False}
        r = client(url).chat.completions.create(model="tiny-a", messages=[{"role": "user", "content": "Hi"}],
                                                max_tokens=4, temperature=0)
        assert r.model == "tiny-a"
        up = rss().rss
        wait_for(lambda: not loaded(url)["tiny-a"])  # (its session frozen after --idle-seconds 0.5)
        wait_for(lambda: rss().rss < up - (up - base) / 2, 30)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0
        log = proc.stderr.read()
        assert "loading model tiny-a" in log and "model tiny-a unloaded (idle 1 s)" in log, log
    finally:
        if proc.poll() is None:
            proc.kill()


def metrics(url: str) -> dict[tuple, float]:
    """/metrics' samples by (name, its labels as a sorted tuple of (label, value))."""
    text = httpx.get(url + "/metrics", timeout=60).text
    samples = {}
    for m in re.finditer(r"^(\w+)(?:\{(.*)\})? (\S+)$", text, re.M):
        labels = tuple(sorted(re.findall(r'(\w+)="([^"]*)"', m[2] or "")))
        samples[m[1], labels] = float(m[3])
    return samples


def test_metrics_per_model(server):
    before = metrics(server.url)
    r = client(server.url).chat.completions.create(
        model="tiny-a", messages=[{"role": "user", "content": "Hi"}], max_tokens=3, temperature=0)
    after = metrics(server.url)
    a = (("model", "tiny-a"),)
    for kind, n in (("generated", r.usage.completion_tokens), ("prompt", r.usage.prompt_tokens)):
        key = ("floe_model_tokens_total", (("kind", kind), *a))
        assert after[key] - before.get(key, 0) == n
    assert after["floe_model_loaded", a] == 1 and after["floe_model_loads_total", a] == 1
    assert after["floe_model_load_seconds", a] > 0
    assert after["floe_model_sessions", (*a, ("state", "live"))] >= 1
    key = ("floe_generated_tokens_total", a)  # the core's own metrics, labelled by model
    assert after[key] - before.get(key, 0) == r.usage.completion_tokens
    assert ("floe_generated_tokens_total", (("model", "smol"),)) in after
    health = httpx.get(server.url + "/health", timeout=60).json()
    assert health["models"]["tiny-a"]["loaded"] and health["models"]["tiny-a"]["sessions"]["live"] >= 1


def test_model_names_from_flags_and_a_folder(tmp_path, model_files):
    a, b = model_files["tiny-a"], model_files["tiny-b"]
    assert model_specs(["smol=", f"a={a}", b]) == [ModelSpec("smol", None), ModelSpec("a", a),
                                                   ModelSpec("tiny-b", b)]
    for bad in (["../x=/tmp/x.gguf"], ["a=x", "a=y"], [".hidden=x"], ["x" * 200 + "=x"], ["a\n=x"]):
        with pytest.raises(ValueError):
            model_specs(bad)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    (tmp_path / "not-a-model").mkdir()
    (tmp_path / "m.gguf").write_bytes(b"")
    (tmp_path / "notes.txt").write_text("")
    assert models_in(tmp_path) == [ModelSpec("hf", str(tmp_path / "hf")),
                                   ModelSpec("m", str(tmp_path / "m.gguf"))]


def test_the_operator_loads_and_unloads_a_model(model_files, default_checkpoint, references, tmp_path):
    s = router_server({"smol": None, "tiny-a": model_files["tiny-a"]}, default_checkpoint, tmp_path,
                      keys=("user-key", "operator-key"), operator_keys=("operator-key",))
    try:
        def post(path: str, key: str | None) -> httpx.Response:
            headers = {} if key is None else {"Authorization": f"Bearer {key}"}
            return httpx.post(f"{s.url}/v1/models/{path}", headers=headers, timeout=120)

        assert post("tiny-a/load", None).status_code == 401
        assert post("tiny-a/load", "user-key").json()["error"]["code"] == "operator_only"
        assert not s.router.models["tiny-a"].core
        loaded_now = post("tiny-a/load", "operator-key")
        assert loaded_now.status_code == 200 and loaded_now.json()["loaded"] is True
        r = openai.OpenAI(base_url=f"{s.url}/v1", api_key="user-key", max_retries=0).chat.completions.create(
            model="tiny-a", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
        assert r.model == "tiny-a" and s.router.models["tiny-a"].loads == 1  # (no second load)
        unloaded = post("tiny-a/unload", "operator-key")
        assert unloaded.status_code == 200 and unloaded.json()["loaded"] is False
        assert post("tiny-c/load", "operator-key").status_code == 404
        assert post("..%2Ftiny-a/load", "operator-key").status_code in (404, 405)  # (a path: no route)
        assert not s.router.models["tiny-a"].core
    finally:
        s.stop()
    one = httpx.post(f"{references['smol'].url}/v1/models/smol/unload", timeout=60)
    assert one.status_code == 400 and one.json()["error"]["code"] == "one_model"


def sentencepiece_model(folder: Path) -> str:
    """A tiny random model (folder/sp.gguf) with a SentencePiece vocabulary, whose decode drops a reply's
    first space: another tokenizer than the default model's byte-level BPE."""
    from models import convert_to_gguf, save_hf_folder
    from test_tokenizer_sentencepiece import write_sentencepiece_gguf

    from floe.model.gguf_file import GGUFFile

    spm = GGUFFile(write_sentencepiece_gguf(folder / "vocabulary.gguf", "llama")).fields
    fields = {k: v for k, v in spm.items() if k.startswith("tokenizer.")}
    tokens = fields["tokenizer.ggml.tokens"]
    picks = [i for i, t in enumerate(tokens) if t.startswith("\u2581") and len(t) > 1]
    save_hf_folder(folder / "hf", "mistral", tie=False, vocab_size=len(tokens), picks=picks)
    return str(convert_to_gguf(folder / "hf", folder / "sp.gguf", tokenizer=fields))


def test_a_model_of_another_tokenizer_answers_as_a_one_model_server_does(default_checkpoint, tmp_path):
    """A model with a SentencePiece vocabulary (whose decode drops a reply's first space) beside the
    first model's byte-level BPE: its replies stream as token ids made into text with its own table
    (the front's CoreClient.table), the same text, streamed or not, as a one-model server of it gives."""
    path = sentencepiece_model(tmp_path)
    one = ThreadServer(create_app(engine_of(path, default_checkpoint), model_id="sp",
                                  snapshots=tmp_path / "one", idle_seconds=3600))
    s = router_server({"smol": None, "sp": path}, default_checkpoint, tmp_path / "several")
    try:
        def texts(url: str) -> list[str]:
            c, messages = client(url), [{"role": "user", "content": "Hello there, how are you?"}]
            plain = c.chat.completions.create(model="sp", messages=messages, max_tokens=10, temperature=0)
            streamed = c.chat.completions.create(model="sp", messages=messages, max_tokens=10, temperature=0,
                                                 stream=True)
            return [plain.choices[0].message.content,
                    "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices)]

        expected = texts(one.url)
        assert expected[0] == expected[1] and not expected[0].startswith(" ")
        assert texts(s.url) == expected
        assert s.router._ids_ok == {}  # (ids with its own table: never the text fallback)
    finally:
        s.stop()
        one.stop()


def test_a_text_completion_runs_on_its_model(server, references):
    def complete(url: str, model: str, stream: bool = False) -> str:
        r = client(url).completions.create(model=model, prompt="The capital of France is", max_tokens=8,
                                           temperature=0, stream=stream)
        return "".join(c.choices[0].text for c in r) if stream else r.choices[0].text

    for name in ("smol", "tiny-b"):
        expected = complete(references[name].url, name)
        assert complete(server.url, name) == expected == complete(server.url, name, stream=True), name


def test_a_new_session_asked_on_two_models_at_once_is_made_on_one(server):
    """Eight ids, each asked for on tiny-a and tiny-b at the same moment: each is made on one model, and
    the other request is refused (409), never both made."""
    def ask(model: str, sid: str) -> int:
        r = httpx.post(f"{server.url}/v1/chat/completions", timeout=300, json={
            "model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
            "session_id": sid})
        return r.status_code

    with ThreadPoolExecutor(16) as pool:
        runs = {(sid, model): pool.submit(ask, model, sid)
                for sid in (f"race-{i}" for i in range(8)) for model in ("tiny-a", "tiny-b")}
        codes = {key: run.result() for key, run in runs.items()}
    for sid in {sid for sid, _ in codes}:
        assert sorted(codes[sid, m] for m in ("tiny-a", "tiny-b")) == [200, 409], (sid, codes)


def test_a_snapshot_imported_under_a_new_id_goes_to_the_model_it_names(server):
    """An exported session of a model that is not the first, imported under an id no model holds, lands in
    its own model (found by the snapshot header's model) and goes on there as the original does; a
    snapshot whose header names no model here goes to the first, whose core refuses what it cannot thaw."""
    turn(server.url, "tiny-b", "exported-b", [], "Hi")
    data = httpx.get(f"{server.url}/v1/sessions/exported-b/snapshot", timeout=60)
    assert data.status_code == 200
    put = httpx.put(f"{server.url}/v1/sessions/imported-b/snapshot", content=data.content, timeout=120)
    assert put.status_code == 200, put.text
    listed = {s["id"]: s["model"] for s in httpx.get(f"{server.url}/v1/sessions", timeout=60).json()["data"]}
    assert listed["imported-b"] == "tiny-b"
    first = turn(server.url, "tiny-b", "probe-b", [], "Hi")  # (the first reply, to go on from)
    history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": first}]
    original = turn(server.url, "tiny-b", "exported-b", list(history), "And then?")
    assert turn(server.url, "tiny-b", "imported-b", list(history), "And then?") == original
    with pytest.raises(openai.ConflictError) as e:  # bound to its model as any session
        client(server.url).chat.completions.create(
            model="smol", messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
            extra_body={"session_id": "imported-b"})
    assert e.value.code == "session_model_mismatch"
    junk = httpx.put(f"{server.url}/v1/sessions/junk/snapshot", content=b"\x10" + b"\x00" * 7 + b"{}" * 8,
                     timeout=60)
    assert junk.status_code == 400 and "refused" in junk.text


def test_a_keep_alive_that_is_not_a_duration_is_a_400():
    """Ollama's keep_alive: seconds or a duration ("5m"), negative for ever; NaN (JSON's NaN literal, which
    Python's parser takes), a flag or a word is a 400 (NaN was taken: a model never compared idle)."""
    import math

    from floe.server.models import keep_alive_seconds
    from floe.server.protocol import ServeError

    assert keep_alive_seconds("5m") == 300 and keep_alive_seconds(0) == 0
    assert keep_alive_seconds(-1) == math.inf
    for bad in (float("nan"), True, "soon", None, [1]):
        with pytest.raises(ServeError) as e:
            keep_alive_seconds(bad)
        assert e.value.status == 400, bad
