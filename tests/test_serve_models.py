"""`floe serve` with several models (issue 44; floe.server.models): `/v1/models` lists them with whether
each is loaded, a request's `model` picks its engine (loaded at its first request), sessions stay on
the model that made them, and hostile model names load nothing. Driven by the official `openai` client
against the real app (front and core, as `floe serve` runs them), compared with one-model servers."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from urllib.parse import quote

import httpx
import openai
import pytest
from gguf import GGMLQuantizationType as Q
from models import write_gguf
from test_server import ThreadServer

from floe.engine import Engine
from floe.model import load_checkpoint
from floe.server.app import app_of, create_app
from floe.server.core import ServeCore
from floe.server.models import ModelRouter, ModelSpec
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

    def load(spec: ModelSpec, store) -> ServeCore:
        return ServeCore(engine_of(spec.path, default_checkpoint), snapshots=store, model_id=spec.name,
                         idle_seconds=idle_seconds)

    stores = [(ModelSpec(name, path), snapshot_store(folder / name)) for name, path in model_files.items()]
    router = ModelRouter(stores, load, **options)
    server = ThreadServer(app_of(router))
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
    listed = {s["id"]: s["model"] for s in httpx.get(f"{server.url}/v1/sessions", timeout=60).json()["data"]}
    assert listed["bound"] == "smol"
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
