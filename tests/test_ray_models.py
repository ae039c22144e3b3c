"""`floe serve --ray` with several models (issue 44; floe.cluster over floe.server.models): two replicas
on a local Ray on loopback, each serving the same two models of different tokenizers (a tiny random
model of the default model's byte-level BPE, loaded at the replica's start, and one of a SentencePiece
vocabulary, loaded on its first request), one OpenAI endpoint in front, driven by the official `openai`
client: every model listed, an unknown one a 404, each model's replies (streamed or not) those of a
one-model server of it, a session bound to its model on every replica (409), and sessions continued
on another replica with their model after a migration and a drain."""

from __future__ import annotations

import httpx
import openai
import pytest
from gguf import GGMLQuantizationType as Q
from models import write_gguf
from test_ray import ray_front, replicas, where
from test_serve_models import CONTEXT, client, engine_of, sentencepiece_model
from test_server import TURNS, ThreadServer

from floe.server.app import create_app
from floe.server.models import ModelSpec

MODELS = ("tiny", "sp")  # the first loads at each replica's start, the second on its first request


@pytest.fixture(scope="module")
def model_files(tmp_path_factory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("models")
    return {"tiny": str(write_gguf(folder / "tiny.gguf", [Q.F32], seed=1)), "sp": sentencepiece_model(folder)}


@pytest.fixture(scope="module")
def cluster(model_files, tmp_path_factory):
    """One node of two CPUs, a replica on each CPU serving both models, their sessions in one shared
    folder (each model's under its name); the endpoint in front, in this process."""
    specs = [ModelSpec(name, model_files[name]) for name in MODELS]
    with ray_front(tmp_path_factory.mktemp("shared-sessions"), (2,), models=specs, context=CONTEXT) as front:
        yield front


@pytest.fixture(scope="module")
def references(model_files, tmp_path_factory) -> dict[str, list[str]]:
    """Each model's greedy replies to TURNS, from a one-model server of it."""
    out = {}
    for name, path in model_files.items():
        one = ThreadServer(create_app(engine_of(path, None), model_id=name,
                                      snapshots=tmp_path_factory.mktemp(name), idle_seconds=3600))
        try:
            out[name] = turns(one.url, name, "reference", [], len(TURNS))
        finally:
            one.stop()
    return out


def turns(url: str, model: str, sid: str, messages: list[dict], upto: int, stream: bool = False) -> list[str]:
    """Turns len(messages)//2 .. upto-1 of TURNS in session `sid` on `model`, after `messages`."""
    c, out = client(url), []
    for text in TURNS[len(messages) // 2:upto]:
        messages.append({"role": "user", "content": text})
        r = c.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=8,
                                      stream=stream, extra_body={"session_id": sid})
        if stream:
            out.append("".join(chunk.choices[0].delta.content or "" for chunk in r if chunk.choices))
        else:
            assert r.model == model and r.model_extra["session_id"] == sid
            out.append(r.choices[0].message.content)
        messages.append({"role": "assistant", "content": out[-1]})
    return out


def ask(url: str, model: str, sid: str | None = None):
    extra = {} if sid is None else {"session_id": sid}
    return client(url).chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=2, temperature=0, extra_body=extra)


def test_every_model_is_listed_and_an_unknown_one_is_a_404_naming_them(cluster):
    listed = {m.id: m.model_extra for m in client(cluster.url).models.list().data}
    assert list(listed) == list(MODELS)
    assert listed["tiny"]["loaded"] and sorted(listed["tiny"]["replicas"]) == ["replica-0", "replica-1"]
    for unknown in (lambda: ask(cluster.url, "nope"), lambda: client(cluster.url).models.retrieve("nope")):
        with pytest.raises(openai.NotFoundError) as e:
            unknown()
        assert e.value.code == "model_not_found" and "'tiny', 'sp'" in e.value.message


def test_each_model_answers_as_its_one_model_server_streamed_or_not(cluster, references):
    assert references["tiny"] != references["sp"]  # two models, not one
    for name in MODELS:
        for stream in (False, True):
            sid = f"same-{name}-{'stream' if stream else 'plain'}"
            assert turns(cluster.url, name, sid, [], 2, stream) == references[name][:2], sid
    placed = where(cluster.url)
    assert len({placed[f"same-{name}-plain"] for name in MODELS} | {placed["same-sp-stream"]}) == 2
    assert all(m.model_extra["loaded"] for m in client(cluster.url).models.list().data)


def test_a_session_asked_on_another_model_is_refused_on_every_replica(cluster):
    ask(cluster.url, "tiny", "bound")
    held = [where(cluster.url)["bound"]]
    for step in ("where it lives", "after it moved"):
        with pytest.raises(openai.ConflictError) as e:
            ask(cluster.url, "sp", "bound")
        assert e.value.code == "session_model_mismatch" and "'tiny'" in e.value.message, step
        moved = httpx.post(f"{cluster.url}/v1/sessions/bound/migrate", timeout=120).json()
        assert moved["from"] == held[-1] != moved["to"] and moved["session"]["state"] == "live"
        held.append(moved["to"])
    assert sorted(set(held)) == ["replica-0", "replica-1"]
    assert ask(cluster.url, "tiny", "bound").usage.completion_tokens >= 1


def test_the_operator_unloads_and_loads_a_model_on_every_replica(cluster):
    for call, loaded in (("unload", False), ("load", True)):
        answer = httpx.post(f"{cluster.url}/v1/models/sp/{call}", timeout=300).json()
        assert answer["id"] == "sp" and answer["loaded"] is loaded, answer
        listed = {m.id: m.model_extra for m in client(cluster.url).models.list().data}
        assert listed["sp"]["loaded"] is loaded and len(listed["sp"]["replicas"]) == 2 * loaded


def test_sessions_continue_on_another_replica_with_their_model(cluster, references):
    """A session of each model: the first's migrated after turn 1, the second's replica drained after
    it (the session thawed from the shared store on the other replica, which never held it, where it
    is still its model's: 409): turns 2 and 3 give an uninterrupted run's text."""
    histories = {name: [] for name in MODELS}
    replies = {name: turns(cluster.url, name, f"moving-{name}", h, 1) for name, h in histories.items()}
    moved = httpx.post(f"{cluster.url}/v1/sessions/moving-tiny/migrate", timeout=120).json()
    assert moved["from"] != moved["to"]
    replies["tiny"] += turns(cluster.url, "tiny", "moving-tiny", histories["tiny"], 2)
    drained = where(cluster.url)["moving-sp"]
    assert httpx.post(f"{cluster.url}/v1/replicas/{drained}/drain", timeout=120).json()["sessions"] >= 1
    with pytest.raises(openai.ConflictError) as e:
        ask(cluster.url, "tiny", "moving-sp")
    assert e.value.code == "session_model_mismatch" and "'sp'" in e.value.message
    for name, h in histories.items():
        replies[name] += turns(cluster.url, name, f"moving-{name}", h, 3)
        assert replies[name] == references[name], name
    assert drained not in where(cluster.url).values() and replicas(cluster.url)[drained]["draining"]
