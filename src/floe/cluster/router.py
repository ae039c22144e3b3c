"""The front's side of a Ray deployment: `ClusterClient` speaks to the HTTP front as the engine core's
socket client does (floe.server.client: call, chat, cancel, export, upload), and routes every request
to a replica (floe.cluster.replica).

Routing: a session live on a replica goes to it (session affinity: learned from each chat's answer);
a new or frozen session, or one whose replica died or drains, goes to the least loaded replica (fewest
requests in flight, then fewest sessions routed to it), which thaws it from the shared store. A
replica that fails a call (RayActorError) is dead: its sessions are thawed elsewhere from their last
frozen turn, and what they lost (turns the client has that their snapshot had not) is counted and
listed (`failovers`), never silently dropped. Ray restarts a dead replica's actor (its max_restarts,
floe.cluster.serve.start_replicas) where it has room: once it answers again it is routed to again, with
no session of its own (`restarts` counts them).

Several models (each replica's core a floe.server.models.ModelRouter): a request goes where its session
is, as with one; each replica refuses a session of another model (409) and loads a model on demand.
A new or frozen session of model m (or a request naming none) goes to the least loaded replica that
has m loaded with a free KV slot, if one has, else to the least loaded: replicas load (and, under
--max-loaded or --memory-budget, unload) models only when they must. The front knows each replica's
loaded models from what every answer of the replica carries (`loaded`: floe.cluster.replica), and from
a ping every WATCH_S (a model unloaded idle says so in no answer); no call of its own per request.
`/v1/models` merges what every replica says of each model; a model's load or unload goes to every
replica; `/metrics` has every replica's own families labelled `replica`; replicas stream text, so
the front needs no model's token table.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from ray.exceptions import RayActorError

from floe.server.protocol import ServeError
from floe.server.records import session_key

log = logging.getLogger("floe.cluster")
LEASE_WAIT_S = 60.0  # how long a failover waits for a dead replica's lease to end (it is its lease_s)
REVIVE_S = 2.0  # how often a dead replica is asked whether Ray has restarted it
WATCH_S = 5.0  # how often every live replica is asked what it has loaded


@dataclass
class Route:
    """A replica as the front sees it."""

    name: str
    handle: object  # the Ray actor
    inflight: int = 0
    alive: bool = True
    draining: bool = False
    sessions: set[str] = field(default_factory=set)  # keys whose live state is (or was last) there
    loaded: dict[str, int] = field(default_factory=dict)  # several models: each loaded one's free KV slots
    revival: asyncio.Task | None = None  # while dead: asks it whether Ray restarted it


class ClusterClient:
    """Routes the front's calls and chats over `replicas` (name -> Ray actor handle)."""

    GONE = ServeError(503, "no replica is running", "server_error", "engine_gone")

    def __init__(self, replicas: dict[str, object]) -> None:
        self.routes = {name: Route(name, h) for name, h in replicas.items()}
        self.where: dict[str, str] = {}  # session key -> replica name
        self.streams, self.gone = 0, False
        self.migrations = self.drains = self.restarts = 0
        self.failovers: list[dict] = []  # {"session", "from", "to", "lost_turns"}
        self._orphans: dict[str, str] = {}  # session key -> the dead replica it was on
        self._chats: dict[str, tuple[Route, asyncio.Task]] = {}
        self.model_of: dict[str, str] = {}  # session key -> its model (several models: as its chats named it)
        self._watch: asyncio.Task | None = None

    async def connect(self) -> None:
        pings = await asyncio.gather(*(r.handle.ping.remote() for r in self.routes.values()))
        for route, ping in zip(self.routes.values(), pings, strict=True):
            route.loaded = ping.get("loaded", {})
        self._watch = asyncio.get_running_loop().create_task(self._watch_loaded())

    async def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()

    async def _watch_loaded(self) -> None:
        """Every WATCH_S, each live replica's loaded models (a model unloaded idle shows in no answer)."""
        while True:
            await asyncio.sleep(WATCH_S)
            for route in [r for r in self.routes.values() if r.alive]:
                try:
                    route.loaded = (await asyncio.wait_for(route.handle.ping.remote(), 30))["loaded"]
                except RayActorError:
                    self._dead(route)
                except TimeoutError:
                    pass  # (busy: its answers still say)

    # ---- routing -------------------------------------------------------------------------------------

    def _usable(self) -> list[Route]:
        return [r for r in self.routes.values() if r.alive and not r.draining]

    def _pick(self, key: str | None, model: str | None = None) -> Route:
        """The replica for a session key (None: a request that names no session) of `model` (None: the
        one its chats named, if any)."""
        if key is not None and key in self.where:
            route = self.routes[self.where[key]]
            if route.alive and not route.draining:
                return route
        return self._placed(self._usable(), model or self.model_of.get(key))

    def _placed(self, usable: list[Route], model: str | None) -> Route:
        """Where a session of `model` goes among `usable`: the least loaded of those with `model` loaded
        and a free KV slot, else the least loaded (which loads it)."""
        if not usable:
            raise self.GONE
        holding = [r for r in usable if r.loaded.get(model, 0) > 0]
        route = min(holding or usable, key=lambda r: (r.inflight, len(r.sessions), r.name))
        if holding:
            route.loaded[model] -= 1  # (taken until its answer says again: a burst spreads)
        return route

    def _place(self, key: str, route: Route) -> None:
        old = self.where.get(key)
        if old is not None and old != route.name:
            self.routes[old].sessions.discard(key)
        self.where[key] = route.name
        route.sessions.add(key)

    def _dead(self, route: Route) -> None:
        if route.alive:
            log.warning("replica %s is gone: its sessions continue elsewhere from their last frozen turn",
                        route.name)
        route.alive = False
        for key in route.sessions:
            self._orphans[key] = route.name
            self.where.pop(key, None)
        route.sessions = set()
        if route.revival is None:
            route.revival = asyncio.get_running_loop().create_task(self._revive(route))

    async def _revive(self, route: Route) -> None:
        """Ask a dead replica every REVIVE_S whether Ray has restarted it (its constructor ran again:
        its model loaded, its store's sessions registered); once it answers, route to it again."""
        while not route.alive:
            await asyncio.sleep(REVIVE_S)
            try:
                await asyncio.wait_for(route.handle.ping.remote(), 30)
            except (RayActorError, TimeoutError):
                continue  # restarting, waiting for room on a node, or out of restarts
            route.alive = True
            self.restarts += 1
            log.warning("replica %s is back (restarted by Ray): new sessions may go to it", route.name)
        route.revival = None

    async def _ask(self, route: Route, method: str, *args):
        """A replica's answer to `method`; a dead replica is marked and GONE raised (the caller may
        retry elsewhere)."""
        route.inflight += 1
        try:
            answer = await getattr(route.handle, method).remote(*args)
        except RayActorError as e:
            log.info("replica %s failed %s: %s", route.name, method, e)
            self._dead(route)
            raise ReplicaLost(route.name) from None
        finally:
            route.inflight -= 1
        if isinstance(answer, dict) and "loaded" in answer:
            route.loaded = answer["loaded"]
        if isinstance(answer, dict) and "error" in answer:
            raise ServeError.from_payload(answer["error"])
        return answer["ok"] if isinstance(answer, dict) and "ok" in answer else answer

    # ---- the core client's interface -----------------------------------------------------------------

    async def call(self, name: str, arg=None, owner: str | None = None):
        if name == "metrics":
            return await self.metrics()
        if name == "health":
            status = "ok" if self._usable() else "degraded"
            if isinstance(arg, dict) and not arg.get("full", True):  # a key that is not the operator's
                return {"status": status}
            return {"status": status, "replicas": await self.replicas()}
        if name in ("hello",):
            return await self._ask(self._pick(None), "call", name, arg, owner)
        if name == "sessions":
            seen: dict[str, dict] = {}
            for route, sessions in await self._each(name, arg, owner):
                for s in sessions:
                    if s["id"] not in seen or s["state"] == "live":
                        seen[s["id"]] = s | {"replica": route.name}
                    if "model" in s:
                        self.model_of[session_key(owner or "", s["id"])] = s["model"]
            return list(seen.values())
        if name in ("models", "load", "unload"):  # several models: each as the replicas have it; a
            # model loaded (on every replica routed to), or unloaded (on every live one)
            answers = await self._each(name, arg, owner, self._usable() if name == "load" else None,
                                       listed=name == "models")
            if not answers:
                raise self.GONE
            return merged_models(answers) if name == "models" else merged_models(answers)[0]
        key = session_key(owner or "", arg) if isinstance(arg, str) else None
        for _ in range(len(self.routes)):
            route = self._pick(key)
            try:
                answer = await self._ask(route, "call", name, arg, owner)
            except ReplicaLost:
                continue
            if key is not None and name == "thaw":
                self._place(key, route)
            if key is not None and name == "delete":
                route.sessions.discard(key)
                self.where.pop(key, None)
                self.model_of.pop(key, None)
            return answer
        raise self.GONE

    async def _each(self, name: str, arg, owner: str | None, routes: list[Route] | None = None,
                    listed: bool = True) -> list[tuple[Route, object]]:
        """Call `name` on every replica of `routes` (default: every live one) at once: each one's
        answer (`listed` False: each wrapped in a list), those that died left out; a replica's error is
        raised."""
        routes = [r for r in self.routes.values() if r.alive] if routes is None else routes
        answers = await asyncio.gather(*(self._ask(r, "call", name, arg, owner) for r in routes),
                                       return_exceptions=True)
        for answer in answers:
            if isinstance(answer, BaseException) and not isinstance(answer, ReplicaLost):
                raise answer
        return [(r, a if listed else [a]) for r, a in zip(routes, answers, strict=True)
                if not isinstance(a, ReplicaLost)]

    async def table(self, model: str) -> None:
        """A model's token table, which a front of several models asks for (CoreClient.table): none
        needed, each replica streams its chats' text made by their model's own tokenizer."""

    def chat(self, request: dict) -> tuple[str, asyncio.Queue, asyncio.Event]:
        """Start a chat on its replica: its id, its events' queue, an event set after its last."""
        rid, queue, ended = uuid.uuid4().hex, asyncio.Queue(), asyncio.Event()
        task = asyncio.ensure_future(self._run_chat(rid, request, queue, ended))
        self._chats[rid] = (None, task)
        return rid, queue, ended

    async def _run_chat(self, rid: str, request: dict, queue: asyncio.Queue, ended: asyncio.Event) -> None:
        sid, owner = request.get("session_id"), request.get("owner") or ""
        key = session_key(owner, sid) if isinstance(sid, str) else None
        model = request.get("model") if isinstance(request.get("model"), str) else None
        deadline = time.monotonic() + LEASE_WAIT_S
        try:
            while True:
                route = self._pick(key, model)
                self._chats[rid] = (route, self._chats[rid][1])
                try:
                    await self._stream(route, rid, request, key, queue)
                    return
                except ReplicaLost:
                    continue  # nothing of this turn reached its client: another replica takes it
                except ServeError as e:
                    # A dead replica's session: its lease ends soon (at once when its process is gone).
                    if (e.code == "session_leased" and key in self._orphans
                            and time.monotonic() < deadline):
                        await asyncio.sleep(min(1.0, e.retry_after or 1.0))
                        continue
                    queue.put_nowait(("error", e.payload()))
                    return
        except ServeError as e:
            queue.put_nowait(("error", e.payload()))
        finally:
            self._chats.pop(rid, None)
            ended.set()

    async def _stream(self, route: Route, rid: str, request: dict, key: str | None,
                      queue: asyncio.Queue) -> None:
        """One attempt of a chat on `route`, its events into `queue`; ReplicaLost before its first
        event (retried elsewhere), a 503 error event after it (its client retries)."""
        started = False
        route.inflight += 1
        try:
            async for ref in route.handle.chat.remote(rid, request):
                kind, value = await ref
                if kind == "error" and not started:
                    raise ServeError.from_payload(value)
                if kind == "started":
                    started = True
                    sid, route.loaded = value["session_id"], value.get("loaded", {})
                    if sid is not None:  # (None: a text completion, which has no session to place)
                        key = session_key(request.get("owner") or "", sid)
                        self._placed_after_failover(key, route, request, value["had"])
                        self._place(key, route)
                        if isinstance(request.get("model"), str):
                            self.model_of[key] = request["model"]
                    value = sid
                queue.put_nowait((kind, value))
        except RayActorError as e:
            log.info("replica %s failed a chat: %s", route.name, e)
            self._dead(route)
            if not started:
                raise ReplicaLost(route.name) from None
            queue.put_nowait(("error", ServeError(503, f"replica {route.name} died during this turn; the "
                                                  "session continues elsewhere from its last frozen turn: "
                                                  "send the request again", "server_error",
                                                  "replica_lost").payload()))
        finally:
            route.inflight -= 1

    def _placed_after_failover(self, key: str, route: Route, request: dict, had: int) -> None:
        """A session of a dead replica's, continued on `route`: what its snapshot lacked is reported."""
        dead = self._orphans.pop(key, None)
        if dead is None:
            return
        history = len(request.get("messages", ())) - 1  # what the client says came before this turn
        lost = max(0, history - had) // 2
        self.failovers.append({"session": key.rpartition("/")[2], "from": dead, "to": route.name,
                               "lost_turns": lost})
        if lost:
            log.warning("session %s lost %d turns with replica %s (they are prefilled again from the "
                        "client's messages)", key, lost, dead)

    def cancel(self, rid: str) -> None:
        held = self._chats.pop(rid, None)
        if held is not None and held[0] is not None and held[0].alive:
            held[0].handle.cancel.remote(rid)

    async def export(self, sid: str, owner: str | None) -> AsyncIterator[bytes]:
        data = await self._session_call("export", sid, owner)

        async def chunks() -> AsyncIterator[bytes]:
            for i in range(0, len(data), 1 << 20):
                yield data[i:i + (1 << 20)]

        return chunks()

    async def upload(self, sid: str, owner: str | None, body: AsyncIterator[bytes]) -> dict:
        data = b"".join([chunk async for chunk in body])
        return await self._session_call("import_", sid, owner, data)

    async def _session_call(self, method: str, sid: str, owner: str | None, *more):
        key = session_key(owner or "", sid)
        for _ in range(len(self.routes)):
            route = self._pick(key)
            try:
                return await self._ask(route, method, sid, owner or "", *more)
            except ReplicaLost:
                continue
        raise self.GONE

    # ---- moving sessions -----------------------------------------------------------------------------

    async def migrate(self, sid: str, owner: str, to: str | None = None) -> dict:
        """Move a session to replica `to` (default: the least loaded other one): frozen where it is,
        its lease given up, thawed there. Its next message continues identically."""
        key = session_key(owner, sid)
        source = self.routes.get(self.where.get(key, ""))
        others = [r for r in self._usable() if r is not source]
        if to is not None:
            others = [r for r in others if r.name == to]
        if not others:
            raise ServeError(409, f"no replica to move session {sid!r} to{f' named {to!r}' if to else ''}",
                             code="no_replica")
        target = self._placed(others, self.model_of.get(key))
        t = time.perf_counter()
        if source is not None and source.alive:
            await self._ask(source, "call", "let_go", sid, owner)
        thawed = await self._ask(target, "call", "thaw", sid, owner)
        self._place(key, target)
        self.migrations += 1
        return {"id": sid, "object": "session.migration", "from": source.name if source else None,
                "to": target.name, "seconds": round(time.perf_counter() - t, 4), "session": thawed}

    async def drain(self, name: str) -> dict:
        """Route nothing more to replica `name`; freeze its sessions and give up their leases: each
        continues on another replica at its next message."""
        route = self.routes.get(name)
        if route is None or not route.alive:
            raise ServeError(404, f"no running replica {name!r}", code="replica_not_found")
        route.draining = True
        keys = await route.handle.drain.remote()
        for key in list(route.sessions):
            self.where.pop(key, None)
        route.sessions = set()
        self.drains += 1
        return {"replica": name, "object": "replica.drain", "sessions": len(keys)}

    # ---- what it reports -----------------------------------------------------------------------------

    async def replicas(self) -> list[dict]:
        out = []
        for route in self.routes.values():
            entry = {"name": route.name, "alive": route.alive, "draining": route.draining,
                     "queue_depth": route.inflight, "routed_sessions": len(route.sessions)}
            if route.alive:
                try:
                    entry |= await asyncio.wait_for(self._ask(route, "ping"), 30)
                except (ReplicaLost, TimeoutError):
                    entry["alive"] = False
            out.append(entry)
        return out

    async def metrics(self) -> str:
        """Prometheus text: every live replica's own families (its core's, or with several models its
        models' floe_model_* and their cores'), each sample labelled with its `replica`; then the
        cluster's: per replica, and its moves."""
        texts = await self._each("metrics", None, None, listed=False)
        return relabelled([(route.name, text) for route, (text,) in texts]) + self._own_metrics()

    def _own_metrics(self) -> str:
        lines = ["# TYPE floe_replica_up gauge", "# TYPE floe_replica_queue_depth gauge",
                 "# TYPE floe_replica_sessions gauge"]
        for r in self.routes.values():
            lines += [f'floe_replica_up{{replica="{r.name}"}} {int(r.alive and not r.draining)}',
                      f'floe_replica_queue_depth{{replica="{r.name}"}} {r.inflight}',
                      f'floe_replica_sessions{{replica="{r.name}"}} {len(r.sessions)}']
        lost = sum(f["lost_turns"] for f in self.failovers)
        for name, value in (("migrations", self.migrations), ("drains", self.drains),
                            ("failovers", len(self.failovers)), ("failover_lost_turns", lost),
                            ("replica_restarts", self.restarts)):
            lines += [f"# TYPE floe_cluster_{name} counter", f"floe_cluster_{name}_total {value}"]
        return "\n".join(lines) + "\n"


def relabelled(texts: list[tuple[str, str]]) -> str:
    """Prometheus texts of replicas (name, text) as one: each family once, each sample labelled with its
    `replica` (not summed: a replica's counters start again from zero when Ray restarts it, which
    rate() handles per series; a sum would fall)."""
    families: dict[str, Metric] = {}
    for replica, text in texts:
        for family in text_string_to_metric_families(text):
            into = families.setdefault(family.name, Metric(family.name, family.documentation, family.type,
                                                           family.unit))
            into.samples += [s._replace(labels={"replica": replica, **s.labels}) for s in family.samples]
    registry = CollectorRegistry(auto_describe=False)
    registry.register(Families(list(families.values())))
    return generate_latest(registry).decode()


@dataclass(eq=False)  # (a registry keys its collectors)
class Families:
    """Metric families as a prometheus_client collector."""

    families: list

    def collect(self) -> list:
        return self.families


def merged_models(answers: list[tuple[Route, list[dict]]]) -> list[dict]:
    """Each model of a server of several as its replicas describe it (floe.server.models): `loaded`
    where any replica has it loaded; `replicas`: each of those replicas' counts of its sessions (a
    frozen session is counted by every replica that has seen it); `sessions`: its live sessions and
    spare actors summed over them."""
    merged: dict[str, dict] = {}
    for route, models in answers:
        for m in models:
            into = merged.setdefault(m["id"], m | {"loaded": False, "replicas": {}, "sessions": None})
            if not m["loaded"]:
                continue
            counts = m["sessions"] or {}
            into["replicas"][route.name] = counts
            into |= {"loaded": True, "load_seconds": m["load_seconds"], "bytes": m["bytes"]}
            into["sessions"] = {k: (into["sessions"] or {}).get(k, 0) + counts.get(k, 0)
                                for k in ("live", "spare_actors")}
    return list(merged.values())


class ReplicaLost(Exception):
    """The replica died (its Ray actor is gone) before it answered."""
