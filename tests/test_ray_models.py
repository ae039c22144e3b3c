"""`floe serve --ray` with several models (issue 44; floe.cluster over floe.server.models): two replicas
on a local Ray on loopback, each serving the same two models of different tokenizers (a tiny random
model of the default model's byte-level BPE, loaded at the replica's start, and one of a SentencePiece
vocabulary, loaded on its first request), one OpenAI endpoint in front, driven by the official `openai`
client: every model listed, an unknown one a 404, each model's replies (streamed or not) those of a
one-model server of it, a session bound to its model on every replica (409), and sessions continued
on another replica with their model after a migration, a replica's death and a drain."""

from __future__ import annotations

import signal
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from gguf import GGMLQuantizationType as Q
from models import write_gguf
from test_ray import ray_front, replicas, where
from test_serve_models import CONTEXT, client, engine_of, sentencepiece_model, wait_for
from test_server import TURNS, ThreadServer, free_port, start_serve

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


@pytest.mark.parametrize(("flags", "message"), [
    (["--model", "a=/no/such.gguf", "--model", "b="], "--model a=/no/such.gguf: no such file or folder"),
    (["--model", "a=", "--model", "a="], "a model name given twice: 'a'"),
    (["--model", "../a=", "--model", "b="], "model name '../a'"),
    (["--model", "a=", "--model", "b=", "--max-loaded", "0"], "--max-loaded must be >= 1"),
    (["--model", "a=", "--model", "b=", "--model-id", "x"], "--model-id names the one model"),
])
def test_floe_serve_ray_refuses_bad_models_before_starting_ray(flags, message, tmp_path, capsys):
    from floe.cli import main

    assert main(["serve", "--ray", "--snapshots", str(tmp_path), *flags]) == 1
    assert message in capsys.readouterr().err


@pytest.mark.slow  # its own Ray and replica: 16-22 s on the 2-core box
def test_floe_serve_ray_serves_a_folder_of_models_and_unloads_one_idle_in_its_replica(model_files, references,
                                                                                    tmp_path):
    """The command (before the module's cluster starts: one Ray at a time): `floe serve --ray --models
    DIR --keep-alive 1`: its models listed, one loaded on demand in the replica and unloaded there once
    idle (its session frozen after --idle-seconds), the session going on after it as an uninterrupted
    one-model server's does; SIGTERM closes the replica (its live sessions frozen) and exits 0."""
    (tmp_path / "models").mkdir()
    for name, path in model_files.items():
        (tmp_path / "models" / f"{name}.gguf").symlink_to(path)
    port = free_port()
    proc = start_serve(tmp_path / "sessions", port, "--ray", "--replicas", "1", "--models",
                       str(tmp_path / "models"), "--keep-alive", "1", "--threads", "1")
    url = f"http://127.0.0.1:{port}"
    try:
        loaded = lambda: {m.id: m.model_extra["loaded"] for m in client(url).models.list().data}  # noqa: E731
        assert loaded() == {"sp": True, "tiny": False}  # (by name: sp first)
        history: list[dict] = []
        replies = turns(url, "tiny", "on-demand", history, 1)
        wait_for(lambda: not loaded()["tiny"])
        assert replies + turns(url, "tiny", "on-demand", history, 2) == references["tiny"][:2]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0
        log = proc.stderr.read()
        assert "each serving 2 models (sp, tiny, loaded on demand)" in log, log
        assert "1 replica closed, live sessions frozen" in log, log
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_replica_whose_first_model_cannot_load_is_a_clear_error(cluster, tmp_path):
    from floe.cluster.serve import start_replicas
    from floe.errors import FloeError

    (tmp_path / "junk.gguf").write_text("junk")
    with pytest.raises(FloeError) as e:  # (no CPU: the cluster's two are its replicas')
        start_replicas(1, str(tmp_path), cpus=0, models=[ModelSpec("junk", str(tmp_path / "junk.gguf"))],
                       context=CONTEXT, slots=1)
    assert str(e.value).startswith("replica replica-0 could not start: ModelLoadFailed: the model 'junk' "
                                   "could not be loaded: NotAModel: "), e.value


def test_every_model_is_listed_and_an_unknown_one_is_a_404_naming_them(cluster):
    listed = {m.id: m.model_extra for m in client(cluster.url).models.list().data}
    assert list(listed) == list(MODELS)
    assert listed["tiny"]["loaded"] and sorted(listed["tiny"]["replicas"]) == ["replica-0", "replica-1"]
    assert listed["sp"]["replicas"] == {} and listed["sp"]["sessions"] is None  # (loaded on demand)
    for unknown in (lambda: ask(cluster.url, "nope"), lambda: client(cluster.url).models.retrieve("nope")):
        with pytest.raises(openai.NotFoundError) as e:
            unknown()
        assert e.value.code == "model_not_found" and "'tiny', 'sp'" in e.value.message


def test_each_model_answers_as_its_one_model_server_streamed_or_not(cluster, references):
    """A session of each model streamed and one not, all at once (the second model loading meanwhile):
    each gives its one-model server's greedy text, made by its own tokenizer."""
    assert references["tiny"] != references["sp"]  # two models, not one
    ways = {f"same-{name}-{'stream' if stream else 'plain'}": (name, stream)
            for name in MODELS for stream in (False, True)}
    with ThreadPoolExecutor(4) as pool:
        runs = {sid: pool.submit(turns, cluster.url, name, sid, [], 2, stream)
                for sid, (name, stream) in ways.items()}
        for sid, run in runs.items():
            assert run.result() == references[ways[sid][0]][:2], sid
    placed = where(cluster.url)
    assert len({placed[sid] for sid in runs}) == 2
    listed = {m.id: m.model_extra for m in client(cluster.url).models.list().data}
    assert all(m["loaded"] and m["sessions"]["live"] >= 2 for m in listed.values()), listed
    sessions = {s["id"]: s for s in httpx.get(f"{cluster.url}/v1/sessions", timeout=60).json()["data"]}
    assert {sid: sessions[sid]["model"] for sid in placed if sid.startswith("same-")} == {
        f"same-{name}-{way}": name for name in MODELS for way in ("plain", "stream")}


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


def test_a_killed_replicas_session_continues_with_its_model_on_the_other(cluster, references):
    """Its replica's process killed after turn 1 (every turn frozen as answered), the session of the
    model loaded on demand continues on the other replica from the shared store, as an uninterrupted
    run, nothing lost; Ray restarts the killed replica (its first model loaded again) and it is routed
    to again."""
    import ray

    history: list[dict] = []
    replies = turns(cluster.url, "sp", "survivor", history, 1)
    victim = where(cluster.url)["survivor"]
    ray.kill(cluster.server.config.app.state.cluster.routes[victim].handle, no_restart=False)
    wait_for(lambda: not replicas(cluster.url)[victim]["alive"], 120)  # (this call finds it dead)
    replies += turns(cluster.url, "sp", "survivor", history, 2)
    assert replies == references["sp"][:2] and where(cluster.url)["survivor"] != victim
    failover = next(f for f in httpx.get(f"{cluster.url}/v1/cluster").json()["failovers"]
                    if f["session"] == "survivor")
    assert failover["from"] == victim and failover["lost_turns"] == 0
    wait_for(lambda: replicas(cluster.url)[victim]["alive"], 300)


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


@pytest.fixture(scope="module")
def tight(cluster, model_files, tmp_path_factory):
    """Two more replicas on the module's Ray (no CPU of their own) serving both models with `--max-loaded
    1` (the first loaded at their start), their sessions in a folder of their own; an endpoint of their
    own in front."""
    import ray

    from floe.cluster.serve import close_replicas, create_cluster_app, start_replicas

    specs = [ModelSpec(name, model_files[name]) for name in MODELS]
    handles = start_replicas(2, str(tmp_path_factory.mktemp("tight-sessions")), cpus=0, models=specs,
                             max_loaded=1, context=CONTEXT, slots=4, threads=1, lease_s=5.0,
                             idle_seconds=3600, freeze_every_turn=True)
    front = ThreadServer(create_cluster_app(handles))
    try:
        yield front
    finally:
        front.stop()
        close_replicas(handles)
        for handle in handles.values():
            ray.kill(handle, no_restart=True)


def metrics(url: str) -> dict[tuple[str, tuple], float]:
    """/metrics' samples: (name, its labels sorted) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=60).text)
            for s in family.samples}


def loads(url: str) -> dict[tuple[str, str], int]:
    """Each (replica, model)'s loads, from /metrics' floe_model_loads_total."""
    return {(dict(labels)["replica"], dict(labels)["model"]): int(value)
            for (name, labels), value in metrics(url).items() if name == "floe_model_loads_total" and value}


def test_new_sessions_go_to_the_replica_that_has_their_model_loaded(tight, references):
    """Two replicas of --max-loaded 1, the first model loaded on both: the first session of the second
    model loads it in one replica, and every later one of it goes there (it has a free KV slot), every
    session of the first model to the other: one load of the second model in all, none unloaded. (By
    the least loaded alone, the second session of `sp` went to the other replica, loading `sp` there
    too and unloading `tiny`.)"""
    order = [("p-sp-1", "sp"), ("p-sp-2", "sp"), ("p-tiny-1", "tiny"), ("p-tiny-2", "tiny"), ("p-sp-3", "sp")]
    histories = {sid: [] for sid, _ in order}
    for sid, model in order:
        assert turns(tight.url, model, sid, histories[sid], 1) == references[model][:1], sid
    placed = where(tight.url)
    holder = placed["p-sp-1"]
    assert {sid: placed[sid] == holder for sid, _ in order} == {sid: model == "sp" for sid, model in order}
    other = ({"replica-0", "replica-1"} - {holder}).pop()
    assert loads(tight.url) == {(holder, "tiny"): 1, (holder, "sp"): 1, (other, "tiny"): 1}
    for sid, model in order:  # (each where it lives)
        assert turns(tight.url, model, sid, histories[sid], 2) == references[model][1:2], sid
    assert where(tight.url) == placed and len(loads(tight.url)) == 3


def test_metrics_have_each_replicas_model_families_labelled_with_it(cluster):
    """/metrics of a cluster of several models: every replica's floe_model_* (and its models' core
    families), each labelled `replica` and `model`, beside the cluster's own."""
    ask(cluster.url, "tiny")
    samples = metrics(cluster.url)
    names = {name for name, _ in samples}
    assert {"floe_model_loaded", "floe_model_load_seconds", "floe_model_loads_total", "floe_model_sessions",
            "floe_model_tokens_total", "floe_replica_up", "floe_cluster_migrations_total"} <= names, names
    for replica in ("replica-0", "replica-1"):
        assert samples["floe_model_loaded", (("model", "tiny"), ("replica", replica))] in (0.0, 1.0)
        assert ("floe_model_tokens_total", (("kind", "generated"), ("model", "sp"), ("replica", replica))
                ) in samples
    generated = sum(v for (name, labels), v in samples.items() if name == "floe_model_tokens_total"
                    and ("kind", "generated") in labels and ("model", "tiny") in labels)
    assert generated >= 2
    assert any(name == "floe_generated_tokens_total" and dict(labels).keys() >= {"model", "replica"}
               for name, labels in samples)


def test_a_session_exported_from_the_cluster_continues_in_one_process_and_in_the_cluster(cluster, model_files,
                                                                                       references, tmp_path):
    """A session of the model loaded on demand: its snapshot after turn 1 from the cluster, put into a
    one-model server of its model, and put back into the cluster after it went on there (its turn 2
    undone): turns 2-3 go on in each as an uninterrupted run's. (A snapshot put under an id no model
    holds goes to the first model, as in one process: docs/SERVER.md.)"""
    history: list[dict] = []
    assert turns(cluster.url, "sp", "carried", history, 1) == references["sp"][:1]
    snapshot = httpx.get(f"{cluster.url}/v1/sessions/carried/snapshot", timeout=60)
    assert snapshot.status_code == 200 and len(snapshot.content) > 1000
    one = ThreadServer(create_app(engine_of(model_files["sp"], None), model_id="sp", snapshots=tmp_path,
                                  idle_seconds=3600))
    try:
        put = httpx.put(f"{one.url}/v1/sessions/carried/snapshot", content=snapshot.content, timeout=60)
        assert put.status_code == 200 and put.json()["messages"] == 2, put.text
        assert turns(one.url, "sp", "carried", list(history), 3) == references["sp"][1:3]
    finally:
        one.stop()
    assert turns(cluster.url, "sp", "carried", list(history), 2) == references["sp"][1:2]
    put = httpx.put(f"{cluster.url}/v1/sessions/carried/snapshot", content=snapshot.content, timeout=60)
    assert put.status_code == 200 and put.json()["messages"] == 2, put.text
    assert turns(cluster.url, "sp", "carried", history, 3) == references["sp"][1:3]
    assert {s["id"]: s["model"] for s in httpx.get(f"{cluster.url}/v1/sessions", timeout=60).json()["data"]
            }["carried"] == "sp"


def test_placement_prefers_a_replica_with_the_model_loaded_and_a_free_slot():
    """The front's placement alone (no Ray): a session of `sp` whose replica died goes to the replica
    that has `sp` loaded with a free KV slot, busier as it is; its slot taken, the next new session of
    `sp` goes to the least loaded; a request of `tiny` to the least loaded of those with `tiny` loaded;
    a live session stays where it lives."""
    from floe.cluster.router import ClusterClient
    from floe.server.records import session_key

    client = ClusterClient({f"replica-{i}": None for i in range(3)})
    r0, r1, r2 = client.routes.values()
    r1.loaded, r2.loaded, r2.inflight, r1.inflight = {"tiny": 4}, {"sp": 1, "tiny": 2}, 3, 1
    orphan, live = session_key("", "orphan"), session_key("", "live")
    client._place(live, r2)
    client.model_of[orphan] = client.model_of[live] = "sp"
    r0.alive = False  # (its sessions' places forgotten, as ClusterClient._dead forgets them)
    assert client._pick(orphan) is r2
    assert client._pick(session_key("", "new"), "sp") is r1 and r2.loaded["sp"] == 0
    assert client._pick(None, "tiny") is r1
    r1.loaded["tiny"] = 0
    assert client._pick(None, "tiny") is r2 and client._pick(live) is r2
