"""`floe serve --ray [ADDRESS] --replicas N`: N replicas (floe.cluster.replica) as Ray actors, one per
CPU (or GPU) Ray gives them, spread over the nodes, each serving one model or the same several (each
loaded on demand in the replica); one OpenAI endpoint in front of them in this process
(floe.server.app's front, with floe.cluster.router's client), plus the cluster's routes:

  GET  /v1/replicas                    each replica: alive, draining, queue depth, sessions, node
  POST /v1/replicas/{name}/drain       freeze its sessions, route nothing more to it
  POST /v1/sessions/{id}/migrate       move a live session (body {"to": name}, optional)
  GET  /v1/cluster                     failovers (session, from, to, lost_turns), migrations, drains
"""

from __future__ import annotations

import logging
import os
import signal
import sys

from fastapi import FastAPI, Request
from ray.exceptions import RayError

from floe.cluster.router import ClusterClient
from floe.errors import FloeError
from floe.server.app import create_front
from floe.server.protocol import ServeError

log = logging.getLogger("floe.cluster")


def start_replicas(n: int, snapshots: str, *, gpus: float = 0, cpus: float = 1, restarts: int = 3,
                   **options) -> dict:
    """N Replica actors spread over the cluster's nodes (ray.init first): name -> handle. A replica
    whose process dies is restarted by Ray up to `restarts` times (where a node has room for it)."""
    import ray

    from floe.cluster.replica import Replica

    remote = ray.remote(Replica)
    # Every running chat holds one of the actor's threads for its whole reply (each model's slots' worth,
    # with several models); calls need some too.
    concurrency = options.get("slots", 4) * len(options.get("models") or [None]) + 8
    handles = {f"replica-{i}": remote.options(name=None, num_cpus=cpus, num_gpus=gpus,
                                              max_concurrency=concurrency, scheduling_strategy="SPREAD",
                                              max_restarts=restarts).remote(f"replica-{i}", snapshots,
                                                                            **options)
               for i in range(n)}
    pings = {name: h.ping.remote() for name, h in handles.items()}
    for name, ping in pings.items():  # each has loaded its model (several: its first)
        try:
            ray.get(ping)
        except RayError as e:  # its constructor failed: its last line says why
            why = next((line.strip() for line in reversed(str(e).splitlines()) if line.strip()), repr(e))
            why = why.removeprefix("RuntimeError: ")  # (Replica's wrapping)
            raise FloeError(f"replica {name} could not start: {why}") from None
    return handles


def create_cluster_app(replicas: dict, *, keys: tuple[str, ...] = (), cors_origins: tuple[str, ...] = (),
                       operator_keys: tuple[str, ...] = ()) -> FastAPI:
    """The one OpenAI endpoint in front of `replicas` (name -> Ray actor handle)."""
    client = ClusterClient(replicas)
    app = create_front(client=client, keys=keys, cors_origins=cors_origins, operator_keys=operator_keys)
    app.state.cluster = client

    @app.get("/v1/replicas")
    async def replicas_(request: Request):
        return {"object": "list", "data": await client.replicas()}

    @app.post("/v1/replicas/{name}/drain")
    async def drain(name: str, request: Request):
        return await client.drain(name)

    @app.post("/v1/sessions/{sid}/migrate")
    async def migrate(sid: str, request: Request):
        body = await request.body()
        to = None
        if body:
            try:
                to = (await request.json()).get("to")
            except ValueError:
                raise ServeError(400, "the body is not a JSON object", code="invalid_json") from None
        return await client.migrate(sid, request.state.owner, to)

    @app.get("/v1/cluster")
    async def cluster(request: Request):
        return {"failovers": client.failovers, "migrations": client.migrations, "drains": client.drains,
                "restarts": client.restarts}

    return app


def ray_init(address: str | None) -> None:
    """Join the Ray cluster at `address`, or start a new local one (None) that runs no dashboard. Ray's
    usage reporting (a report to Anyscale) is off unless the user turned it on
    (RAY_USAGE_STATS_ENABLED=1): floe sends nothing anywhere on its own. (Ray 2.60 still names the
    node by the machine's address and its gRPC servers listen on every interface, node address
    127.0.0.1 asked or not: docs/RAY.md, "Network".)"""
    import ray

    from floe.wasm import trap_handlers_kept

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # "local": a new one always (None would join a cluster a killed process left behind in /tmp/ray)
    local = {} if address is not None else {"address": "local", "include_dashboard": False}
    with trap_handlers_kept():  # Ray's crash handlers would make a guest's trap kill this process
        ray.init(**({"address": address} | local), logging_level=logging.WARNING)


def serve_cluster(address: str | None, n: int, snapshots: str, *, host: str, port: int, log_level: str,
                  keys: tuple[str, ...] = (), cors_origins: tuple[str, ...] = (),
                  operator_keys: tuple[str, ...] = (), **options) -> int:
    """Join (or start, address None) a Ray cluster, start the replicas, serve the endpoint."""
    import ray
    import uvicorn

    from floe.server.deadlines import uvicorn_config
    from floe.wasm import trap_handlers_kept

    ray_init(address)
    replicas: dict = {}
    try:
        print(f"floe serve: starting {n} replica{'s' * (n > 1)} on Ray …", file=sys.stderr, flush=True)
        replicas = start_replicas(n, snapshots, **options)
        app = create_cluster_app(replicas, keys=keys, cors_origins=cors_origins, operator_keys=operator_keys)
        where = "a local Ray" if address is None else f"the Ray cluster at {address}"
        models = options.get("models")
        serving = "" if models is None else (f", each serving {len(models)} models "
                                             f"({', '.join(m.name for m in models)}, loaded on demand)")
        print(f"floe serve: {n} replica{'s' * (n > 1)} ready on {where}{serving}; http://{host}:{port}/v1",
              file=sys.stderr, flush=True)
        # uvicorn stops on SIGTERM and then raises it again for the handler it found: Ray's (sys.exit(15)
        # at ray.init). Stopped by then, the process ends as it would on its own: replicas closed, exit 0.
        signal.signal(signal.SIGTERM, lambda signum, frame: None)
        uvicorn.Server(uvicorn_config(app, host=host, port=port, log_level=log_level)).run()
    finally:
        close_replicas(replicas)
        with trap_handlers_kept():
            ray.shutdown()
    return 0


def close_replicas(replicas: dict, timeout_s: float = 120.0) -> None:
    """Close every replica (name -> Ray actor handle) at once: each freezes its live sessions into the
    shared store, as a one-process server's stop does (a dead one is passed over, said in the log)."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError

    closing = {name: h.close.remote() for name, h in replicas.items()}
    for name, ref in closing.items():
        try:
            ray.get(ref, timeout=timeout_s)
        except (RayActorError, GetTimeoutError) as e:
            log.warning("replica %s was not closed (its live sessions stay as last frozen): %s", name, e)
    if closing:
        print(f"floe serve: {len(closing)} replica{'s' * (len(closing) > 1)} closed, live sessions "
              "frozen", file=sys.stderr, flush=True)
