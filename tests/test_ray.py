"""`floe serve` on Ray (floe.cluster): replicas on a local multi-node Ray cluster on loopback
(ray.cluster_utils.Cluster, one CPU per node, the default model), one OpenAI endpoint in front, driven
by the official `openai` client: named sessions spread over the replicas and continue with the greedy
text of an uninterrupted run; a migrated live session continues identically; a drained replica's
sessions continue elsewhere; a node killed mid-conversation → its sessions continue on another replica
from their last frozen turn (every turn is frozen: none lost, which the front reports)."""

from __future__ import annotations

import time
from contextlib import contextmanager

import httpx
import pytest
from test_server import CONTEXT, TURNS, ThreadServer, client, conversation

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

from floe.cluster.serve import create_cluster_app, start_replicas  # noqa: E402
from floe.wasm import trap_handlers_kept  # noqa: E402


def test_a_local_ray_started_by_floe_reports_nothing_and_runs_no_dashboard():
    """`floe serve --ray` with no address starts a new Ray with no dashboard and Ray's usage reporting
    off (unless the user asked for it: RAY_USAGE_STATS_ENABLED=1)."""
    from isolated import run_isolated

    out = run_isolated("""
        import os
        os.environ.pop("RAY_USAGE_STATS_ENABLED", None)
        import ray
        from ray._common.usage import usage_lib
        from floe.cluster.serve import ray_init
        ray_init(None)
        try:
            dashboard = ray.get_runtime_context().get_node_id() and ray._private.worker.get_dashboard_url()
            print(os.environ["RAY_USAGE_STATS_ENABLED"], usage_lib.usage_stats_enabled(), repr(dashboard))
        finally:
            ray.shutdown()
    """)
    assert out.split("\n")[-2] in ("0 False ''", "0 False None"), out


@contextmanager
def ray_front(folder, cpus: tuple[int, ...] = (1, 1, 1), **options):
    """Nodes of `cpus` CPUs (the first the head; default three nodes of one), a replica on each CPU
    (Replica's `options` over this module's), their sessions in one shared folder; the endpoint in
    front, in this process."""
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": cpus[0]})
    workers = [c.add_node(num_cpus=n) for n in cpus[1:]]
    with trap_handlers_kept():  # (Ray's crash handlers would make a guest's trap kill pytest)
        ray.init(address=c.address, logging_level="ERROR")
    try:
        options = {"context": CONTEXT, "slots": 4, "threads": 1, "lease_s": 5.0, "idle_seconds": 3600,
                   "freeze_every_turn": True} | options
        replicas = start_replicas(sum(cpus), str(folder), **options)
        front = ThreadServer(create_cluster_app(replicas))
        front.ray, front.workers, front.head = c, workers, c.head_node
        try:
            yield front
        finally:
            front.stop()
    finally:
        with trap_handlers_kept():
            ray.shutdown()
            c.shutdown()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with ray_front(tmp_path_factory.mktemp("shared-sessions")) as front:
        yield front


@pytest.fixture(scope="module")
def reference(cluster) -> list[str]:
    """The three greedy replies of one uninterrupted conversation."""
    return conversation(client(cluster.url), "reference")[0]


def where(url: str) -> dict[str, str]:
    """Each live session's replica."""
    return {s["id"]: s["replica"] for s in httpx.get(f"{url}/v1/sessions", timeout=60).json()["data"]
            if s["state"] == "live"}


def replicas(url: str) -> dict[str, dict]:
    return {r["name"]: r for r in httpx.get(f"{url}/v1/replicas", timeout=120).json()["data"]}


def turns(url: str, sid: str, upto: int, messages: list[dict]) -> list[str]:
    """Turns len(messages)//2 .. upto-1 of TURNS in session `sid`, after `messages`."""
    c, out = client(url), []
    for text in TURNS[len(messages) // 2:upto]:
        messages.append({"role": "user", "content": text})
        r = c.chat.completions.create(model="SmolLM2-135M-Instruct.Q4_1", messages=messages, temperature=0,
                                      max_tokens=24, extra_body={"session_id": sid})
        out.append(r.choices[0].message.content)
        messages.append({"role": "assistant", "content": out[-1]})
    return out


def test_named_sessions_spread_over_replicas_and_a_migrated_one_continues_identically(cluster, reference):
    histories = {f"s{i}": [] for i in range(4)}
    replies = {sid: turns(cluster.url, sid, 2, h) for sid, h in histories.items()}
    placed = where(cluster.url)
    assert len({placed[sid] for sid in histories}) >= 2  # spread: least loaded first
    moved = httpx.post(f"{cluster.url}/v1/sessions/s0/migrate", timeout=120).json()
    assert moved["from"] == placed["s0"] != moved["to"] and moved["session"]["state"] == "live"
    for sid, h in histories.items():
        replies[sid] += turns(cluster.url, sid, 3, h)
        assert replies[sid] == reference, sid
    assert where(cluster.url)["s0"] == moved["to"]
    metrics = httpx.get(f"{cluster.url}/metrics").text
    assert "floe_cluster_migrations_total 1" in metrics
    assert 'floe_replica_up{replica="replica-0"} 1' in metrics


def test_a_drained_replicas_sessions_continue_elsewhere(cluster, reference):
    """Drain the head node's replica (the nodes the next test kills are the workers)."""
    head = next(r for r in replicas(cluster.url).values() if r["node"] == cluster.head.node_id)
    histories = {f"d{i}": [] for i in range(3)}
    replies = {sid: turns(cluster.url, sid, 1, h) for sid, h in histories.items()}
    if where(cluster.url)["d0"] != head["name"]:  # one of them there at least
        httpx.post(f"{cluster.url}/v1/sessions/d0/migrate", json={"to": head["name"]}, timeout=120)
    on_head = [sid for sid, name in where(cluster.url).items() if name == head["name"] and sid in histories]
    assert "d0" in on_head, where(cluster.url)
    drained = httpx.post(f"{cluster.url}/v1/replicas/{head['name']}/drain", timeout=120).json()
    assert drained["sessions"] >= len(on_head)
    for sid, h in histories.items():
        replies[sid] += turns(cluster.url, sid, 3, h)
        assert replies[sid] == reference, sid
    assert not {sid for sid, name in where(cluster.url).items() if name == head["name"]}
    assert replicas(cluster.url)[head["name"]]["draining"]


def test_a_killed_replica_is_restarted_and_routed_to_again(cluster, reference):
    """Its process killed (Ray restarts the actor where it ran: its model loads again), the replica is
    found dead at its next call, its sessions continue elsewhere, and once it answers it is routed to
    again; a conversation on it continues as an uninterrupted run."""
    import ray

    client = cluster.server.config.app.state.cluster
    serving = [r for r in replicas(cluster.url).values() if r["alive"] and not r["draining"]]
    victim = serving[0]["name"]
    drained = {name for name, route in client.routes.items() if route.draining}  # (an earlier test's)
    before = httpx.get(f"{cluster.url}/v1/cluster").json()["restarts"]
    ray.kill(client.routes[victim].handle, no_restart=False)
    deadline = time.time() + 300
    while replicas(cluster.url)[victim]["alive"]:  # (this call finds it dead)
        assert time.time() < deadline, "the killed replica still answers"
        time.sleep(0.5)
    while not replicas(cluster.url)[victim]["alive"]:
        assert time.time() < deadline, "Ray's restart of the replica was never routed to"
        time.sleep(1)
    assert httpx.get(f"{cluster.url}/v1/cluster").json()["restarts"] == before + 1
    for route in client.routes.values():  # every other replica drained: the next session goes to it
        if route.name != victim:
            route.draining = True
    try:
        history: list[dict] = []
        assert turns(cluster.url, "after-restart", 1, history) == reference[:1]
        assert where(cluster.url)["after-restart"] == victim
    finally:
        for route in client.routes.values():
            route.draining = route.name in drained


def test_a_killed_nodes_sessions_continue_from_their_last_frozen_turn(cluster, reference):
    killed_mid_conversation(cluster, reference, [f"k{i}" for i in range(4)])


def killed_mid_conversation(cluster, reference: list[str], sids: list[str]) -> None:
    """Turns 1-2 of each session, a worker node holding some of them removed, turn 3 of each: the
    greedy text of an uninterrupted run, the failovers reported with no turn lost."""
    histories = {sid: [] for sid in sids}
    replies = {sid: turns(cluster.url, sid, 2, h) for sid, h in histories.items()}
    placed = where(cluster.url)
    nodes = {r["name"]: r["node"] for r in replicas(cluster.url).values()}
    live = {sid: nodes[placed[sid]] for sid in histories if sid in placed}  # the rest: frozen for a slot
    victim = next(w for w in cluster.workers if w.node_id in live.values())
    doomed = {sid for sid, node in live.items() if node == victim.node_id}
    cluster.ray.remove_node(victim, allow_graceful=False)
    dead = next(name for name, node in nodes.items() if node == victim.node_id)
    deadline = time.time() + 120
    while replicas(cluster.url)[dead]["alive"]:
        assert time.time() < deadline, "the killed node's replica still answers"
        time.sleep(0.5)
    for sid, h in histories.items():
        replies[sid] += turns(cluster.url, sid, 3, h)
        assert replies[sid] == reference, sid
    report = httpx.get(f"{cluster.url}/v1/cluster").json()["failovers"]
    assert {f["session"] for f in report} >= doomed and all(f["from"] == dead for f in report)
    assert [f["lost_turns"] for f in report] == [0] * len(report)  # every turn was frozen as answered
    assert "floe_cluster_failovers_total" in httpx.get(f"{cluster.url}/metrics").text




TRAP_AFTER_RAY = """
import wasmtime
from ray.cluster_utils import Cluster
import ray
from floe.wasm import trap_handlers_kept
engine = wasmtime.Engine()
store = wasmtime.Store(engine)
module = wasmtime.Module(engine, '(module (func (export "f") unreachable))')
f = wasmtime.Instance(store, module, []).exports(store)["f"]
c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
with trap_handlers_kept():
    ray.init(address=c.address, logging_level="ERROR")
for stage in ("while ray runs", "after ray.shutdown"):
    try:
        f(store)
    except wasmtime.Trap:
        print("a trap is an error", stage, flush=True)
    if stage == "while ray runs":
        with trap_handlers_kept():
            ray.shutdown()
            c.shutdown()
"""


def test_a_guests_trap_stays_an_error_in_a_ray_driver():
    """Ray installs crash handlers of its own at ray.init (and resets them at shutdown): kept around
    both, wasmtime's handlers still turn a guest's trap into an error instead of killing the process."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", TRAP_AFTER_RAY], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[:2] == ["a trap is an error while ray runs",
                                          "a trap is an error after ray.shutdown"]
