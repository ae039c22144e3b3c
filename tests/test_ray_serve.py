"""floe as a Ray Serve application (floe.cluster.deployment): a real Ray with Ray Serve on loopback,
floe's application under a route prefix of its own beside another application of the user's, two
floe replicas (the default model, CPU) sharing one session folder, driven by the official `openai`
client: the model listed, a named session's turns (plain and streamed) those of a one-process
`floe serve`, continued on the other replica after a migration; the same through a DeploymentHandle
(as another deployment calls it), streamed or not, and its refusal; and (slow) a session continued
after the application was deleted and deployed anew (its replicas froze their sessions into the
store)."""

from __future__ import annotations

import httpx
import pytest
from pydantic import ValidationError
from test_server import CONTEXT, MODEL_ID, TURNS, ThreadServer, client, conversation, free_port

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from floe.cluster.deployment import ChatRefused, Options, app, build  # noqa: E402
from floe.engine import Engine  # noqa: E402
from floe.server.app import create_app  # noqa: E402
from floe.wasm import trap_handlers_kept  # noqa: E402

SLOTS = 4


def test_a_serve_configs_arguments_are_floe_serves_flags():
    """`serve run floe.cluster.deployment:build replicas=2 ...` gives strings: converted, each mapped
    onto the replicas' options as `floe serve --ray` maps its flags; a misspelt one refused by name."""
    options = Options.model_validate({"snapshots": "s3://bucket/floe", "replicas": "2", "max_sessions": "8",
                                      "durability": "idle", "device": "cuda"})
    assert options.replicas == 2
    assert options.replica_options() == {
        "model": None, "context": 2048, "slots": 8, "threads": 1, "lease_s": 30.0, "device": "cuda",
        "gpus": 1, "idle_seconds": 300.0, "freeze_every_turn": False}
    several = Options(snapshots="/s", models={"a": "/m/a.gguf", "b": None}, max_loaded=1).replica_options()
    assert [(m.name, m.path) for m in several["models"]] == [("a", "/m/a.gguf"), ("b", None)]
    assert several["max_loaded"] == 1 and "model" not in several
    with pytest.raises(ValidationError, match="replica"):
        build({"snapshots": "/shared", "replica": "2"})
    assert isinstance(build({"snapshots": "/shared"}), serve.Application)


@pytest.fixture(scope="module")
def reference(default_checkpoint, tmp_path_factory) -> list[str]:
    """The greedy replies of one uninterrupted conversation with a one-process `floe serve`."""
    engine = Engine(default_checkpoint, max_seq_len=CONTEXT, n_slots=SLOTS, weights="native")
    one = ThreadServer(create_app(engine, snapshots=tmp_path_factory.mktemp("one"), model_id=MODEL_ID,
                                  idle_seconds=3600))
    try:
        return conversation(client(one.url), "reference")[0]
    finally:
        one.stop()


@serve.deployment(ray_actor_options={"num_cpus": 0})
class Hello:
    """Another application of the user's, beside floe's."""

    def __call__(self, request) -> str:
        return "hello"


def deploy(snapshots: str) -> None:
    serve.run(app(snapshots=snapshots, replicas=2, context=CONTEXT, max_sessions=SLOTS, idle_seconds=3600,
                  lease_seconds=5), name="floe", route_prefix="/floe")


@pytest.fixture(scope="module")
def served(reference, tmp_path_factory):
    """Ray and Ray Serve on loopback; floe's application at /floe/v1, the user's at /hello."""
    port = free_port()
    with trap_handlers_kept():  # (Ray's crash handlers would make a guest's trap kill pytest)
        ray.init(address="local", include_dashboard=False, num_cpus=2, logging_level="ERROR")
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(Hello.bind(), name="hello", route_prefix="/hello")
        folder = str(tmp_path_factory.mktemp("shared-sessions"))
        deploy(folder)
        yield {"url": f"http://127.0.0.1:{port}/floe", "root": f"http://127.0.0.1:{port}", "folder": folder}
    finally:
        serve.shutdown()
        with trap_handlers_kept():
            ray.shutdown()


def turn(url: str, sid: str, messages: list[dict], stream: bool = False) -> str:
    """The next turn of TURNS in session `sid`, after `messages` (which it extends)."""
    messages.append({"role": "user", "content": TURNS[len(messages) // 2]})
    r = client(url).chat.completions.create(model=MODEL_ID, messages=messages, temperature=0, max_tokens=24,
                                            stream=stream, extra_body={"session_id": sid})
    if stream:
        text = "".join(chunk.choices[0].delta.content or "" for chunk in r if chunk.choices)
    else:
        assert r.model_extra["session_id"] == sid
        text = r.choices[0].message.content
    messages.append({"role": "assistant", "content": text})
    return text


def live_on(url: str, sid: str) -> str:
    """The replica where session `sid` is live."""
    return next(s["replica"] for s in httpx.get(f"{url}/v1/sessions", timeout=60).json()["data"]
                if s["id"] == sid and s["state"] == "live")


def test_the_model_is_listed_beside_the_users_own_application(served):
    assert [m.id for m in client(served["url"]).models.list()] == [MODEL_ID]
    assert httpx.get(f"{served['root']}/hello", timeout=30).text == "hello"
    replicas = httpx.get(f"{served['url']}/v1/replicas", timeout=60).json()["data"]
    assert [r["alive"] for r in replicas] == [True, True]


def test_a_session_continues_on_another_replica(served, reference):
    url, history = served["url"], []
    replies = [turn(url, "s", history)]
    first = live_on(url, "s")
    moved = httpx.post(f"{url}/v1/sessions/s/migrate", timeout=120).json()
    assert moved["from"] == first != moved["to"]
    replies.append(turn(url, "s", history, stream=True))
    assert live_on(url, "s") == moved["to"]
    replies.append(turn(url, "s", history))
    assert replies == reference


def test_a_deployment_handle_chats_as_http_does(served, reference):
    """Through serve.get_app_handle, as another deployment of the user's calls floe: a session's turns,
    plain and streamed, give the same text; a bad request is refused with its status and error."""
    floe = serve.get_app_handle("floe")
    history = [{"role": "user", "content": TURNS[0]}]
    body = {"model": MODEL_ID, "temperature": 0, "max_tokens": 24, "session_id": "h"}
    answer = floe.chat.remote(body | {"messages": history}).result()
    assert answer["session_id"] == "h"
    history += [answer["choices"][0]["message"], {"role": "user", "content": TURNS[1]}]
    chunks = list(floe.options(stream=True).chat_stream.remote(body | {"messages": history}))
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert [answer["choices"][0]["message"]["content"], streamed] == reference[:2]
    with pytest.raises(ChatRefused) as refused:
        floe.chat.remote(body | {"messages": [], "session_id": "bad"}).result()
    assert refused.value.status == 400 and refused.value.error["type"] == "invalid_request_error"


@pytest.mark.slow
def test_a_session_outlives_its_application(served, reference):
    """Deleted (its replicas close, each freezing its live sessions into the shared store) and deployed
    anew, the application continues a session as an uninterrupted run (~10 s more: two model loads)."""
    url, history = served["url"], []
    replies = [turn(url, "r", history), turn(url, "r", history, stream=True)]
    serve.delete("floe")
    deploy(served["folder"])
    replies.append(turn(url, "r", history))
    assert replies == reference
