"""The sessions of `floe serve`, as the rest of the server sees them: each conversation is an actor that
keeps its KV cache, frozen into the snapshot store (floe.snapshot.store: pinned RAM, a disk folder, an
object store shared by servers) when idle (or when its KV slot is needed) and thawed on its next
message, also after a restart or on another server sharing the store.

SessionStore composes the parts, each with one job: SessionRegistry (ids, owners, the lock),
SlotAdmission (KV slots and the wait queue), SessionLifecycle (freeze, thaw, evict, forget),
SpareActors (actors made ahead, closed later), StoreUpkeep (leases, the store's lifetimes and budgets)
and SessionTransfers (export, import, fork); itself it chooses a request's session and runs its
message. A session runs one request at a time (its lock). The conversation the actor holds
(`messages`) is stored inside the snapshot (its `app` record, floe.server.records), so a snapshot is a
whole session. Sessions made for requests that named none (anonymous, one-shot) are kept in RAM only
(never written to the home) unless the server persists them (`persist_anonymous`) or a client freezes
one explicitly.
"""

from __future__ import annotations

import logging
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path

from floe.actor import DecodeScheduler, EngineLoop
from floe.actor.stream import TokenStream
from floe.engine import Engine, SamplingParams
from floe.errors import FloeError
from floe.server.sessions.actors import ActorMaker
from floe.server.sessions.admission import SlotAdmission
from floe.server.sessions.errors import HistoryMismatch, RollbackFailed, SessionError, UnknownSession
from floe.server.sessions.lifecycle import SessionLifecycle
from floe.server.sessions.registry import SessionRegistry
from floe.server.sessions.session import Answer, Session, common_start, is_prefix
from floe.server.sessions.spares import SpareActors
from floe.server.sessions.transfers import SessionTransfers
from floe.server.sessions.upkeep import StoreUpkeep
from floe.server.stops import StopText
from floe.snapshot import SnapshotError
from floe.snapshot.store import SnapshotStore, open_store

log = logging.getLogger("floe.serve")


class SessionStore:
    """All sessions of one server: live ones hold a KV slot of `engine`, frozen ones a snapshot in
    `snapshots` (the tiered store).

    max_anonymous: sessions made for requests that named none, kept per owner; beyond, making one
    forgets the owner's least recently used idle one (and drops its snapshot). They are a cache of the
    conversations that clients resend whole: a forgotten one is found by no prefix, and its
    conversation's next request starts a new session. kv_dtype: how snapshots store the KV cache
    (None: the engine's dtype; "int8": a quarter of fp32's bytes, not bit-exact). freeze_every_turn:
    every answered turn is frozen into the store before its answer ends (a server killed loses no
    answered turn), not only on idle."""

    def __init__(self, engine: Engine, snapshots: SnapshotStore | Path | str, *, idle_seconds: float = 300.0,
                 guest: str | None = None, on_thaw: Callable[[float], None] = lambda s: None,
                 on_freeze: Callable[[float], None] = lambda s: None,
                 scheduler: DecodeScheduler | None = None, loop: EngineLoop | None = None,
                 max_anonymous: int = 64, kv_dtype: str | None = None, persist_anonymous: bool = False,
                 freeze_every_turn: bool = False, sweep_seconds: float = 10.0, max_waiting: int = 8,
                 wait_seconds: float = 30.0) -> None:
        if max_anonymous < 1:
            raise FloeError(f"max_anonymous must be at least 1, not {max_anonymous}")
        if max_waiting < 0 or not wait_seconds >= 0:
            raise FloeError(f"the wait queue needs max_waiting >= 0 and wait_seconds >= 0, not {max_waiting} "
                            f"and {wait_seconds}")
        if not isinstance(snapshots, SnapshotStore):
            snapshots = snapshot_store(snapshots, idle_seconds=idle_seconds)
        self.engine, self.snapshots, self.idle_seconds, self.guest = engine, snapshots, idle_seconds, guest
        self.max_anonymous, self.kv_dtype = max_anonymous, kv_dtype
        self.persist_anonymous, self.freeze_every_turn = persist_anonymous, freeze_every_turn
        self.sweep_seconds = sweep_seconds
        self.scheduler = scheduler  # batches v1 guests' decode steps (None: they take turns)
        self.loop = loop  # steps v2 guests' turns (None: the engine's own loop)
        self.max_waiting, self.wait_seconds = max_waiting, wait_seconds

        self.registry = SessionRegistry(snapshots, persist_anonymous, max_waiting, wait_seconds)
        self.sessions, self.lock = self.registry.sessions, self.registry.lock  # (by session_key(owner, id))
        self.actors = ActorMaker(engine, guest, scheduler, loop)
        self.admission = SlotAdmission(self.registry, engine, max_waiting, wait_seconds)
        self.spares = SpareActors(self.actors, self.lock)
        self.lifecycle = SessionLifecycle(self.registry, self.admission, self.spares, self.actors,
                                          idle_seconds=idle_seconds, kv_dtype=kv_dtype)
        self.lifecycle.on_thaw, self.lifecycle.on_freeze = on_thaw, on_freeze
        self.admission.make_room = self._make_room
        self.upkeep = StoreUpkeep(self.lifecycle, sweep_seconds)
        self.transfers = SessionTransfers(self.lifecycle)
        self.rollbacks = 0  # conversations branched from an earlier turn (pending)

    # ---- the parts' surface ------------------------------------------------------------------------

    @property
    def on_thaw(self) -> Callable[[float], None]:
        return self.lifecycle.on_thaw

    @on_thaw.setter
    def on_thaw(self, observe: Callable[[float], None]) -> None:
        self.lifecycle.on_thaw = observe

    @property
    def on_freeze(self) -> Callable[[float], None]:
        return self.lifecycle.on_freeze

    @on_freeze.setter
    def on_freeze(self, observe: Callable[[float], None]) -> None:
        self.lifecycle.on_freeze = observe

    @property
    def skipped(self) -> list[str]:
        """Snapshots in the store that are not loadable sessions."""
        return self.registry.skipped

    @property
    def lost(self) -> list[str]:
        """Sessions another server took over while this one held them."""
        return self.lifecycle.lost

    @property
    def waiting(self) -> int:
        """Requests waiting for a KV slot now."""
        return self.admission.waiting

    def warm_up(self) -> None:
        """Compile the guest and start the engine loop before the first request (ActorMaker.warm_up)."""
        self.actors.warm_up()

    def load_store(self) -> int:
        """Register every session the store's home holds (SessionRegistry.load): how many there are."""
        return self.registry.load()

    def get(self, sid: str, owner: str = "") -> Session:
        """`owner`'s session `sid`, looked up in the store if this server has not seen it."""
        return self.registry.get(sid, owner)

    def extra_slot(self, owner: str = "", beside_session: bool = True,
                   gone: Callable[[], bool] = lambda: False) -> AbstractContextManager[None]:
        """A KV slot counted, for the block, for an actor of no session's (SlotAdmission.extra_slot)."""
        return self.admission.extra_slot(owner, beside_session, gone)

    def keep_spares(self, wanted: int) -> None:
        """Keep up to `wanted` actors made ahead while the engine loop is idle (SpareActors.keep)."""
        self.spares.keep(wanted)

    def freeze(self, sid: str, owner: str = "") -> dict:
        """Freeze `owner`'s session `sid` now, into the store's durable home (SessionLifecycle.freeze)."""
        return self.lifecycle.freeze(sid, owner)

    def thaw(self, sid: str, owner: str = "") -> dict:
        return self.lifecycle.thaw(sid, owner)

    def let_go(self, sid: str, owner: str = "") -> dict:
        """Freeze `owner`'s session `sid` and give up this server's lease on it (SessionLifecycle.let_go)."""
        return self.lifecycle.let_go(sid, owner)

    def drain(self) -> list[str]:
        """Let every session go (SessionLifecycle.drain): the keys let go."""
        return self.lifecycle.drain()

    def evict_idle(self) -> list[str]:
        """Freeze every live session idle longer than idle_seconds; returns their ids."""
        return self.lifecycle.evict_idle()

    def maintain(self) -> dict[str, list[str]]:
        """The store's upkeep, every second or so (StoreUpkeep.maintain): keys lost, deleted, released."""
        return self.upkeep.maintain()

    def export(self, sid: str, owner: str = "") -> Iterator[memoryview]:
        """`owner`'s session `sid` as its snapshot file's bytes (SessionTransfers.export)."""
        return self.transfers.export(sid, owner)

    def import_(self, sid: str, owner: str, chunks: Iterable) -> dict:
        """Make (or replace) `owner`'s session `sid` from snapshot bytes (SessionTransfers.import_)."""
        return self.transfers.import_(sid, owner, chunks)

    def fork(self, sid: str, owner: str = "", new_id: str | None = None) -> dict:
        """A new session holding session `sid`'s state as it is now (SessionTransfers.fork)."""
        return self.transfers.fork(sid, owner, new_id)

    def delete(self, sid: str, owner: str = "") -> None:
        with self.registry.holding(sid, owner) as session:
            if not self.lifecycle.forget_locked(session):
                raise UnknownSession(f"no session {sid!r}")

    def counts(self, owner: str | None = None) -> dict[str, int]:
        """Sessions live and frozen, and spare actors; of one owner's sessions only: live and frozen."""
        with self.lock:
            if owner is not None:
                mine = self.sessions.owned(owner)
                live = sum(s.live for s in mine)
                return {"live": live, "frozen": len(mine) - live}
            live = self.sessions.live_count()
            return {"live": live, "frozen": len(self.sessions) - live, "spare_actors": len(self.spares.ready)}

    # ---- choosing the session for a request --------------------------------------------------------

    def acquire(self, session_id: str | None, messages: list[dict], seed: int, owner: str = "",
                gone: Callable[[], bool] = lambda: False) -> Session:
        """The session of `owner`'s this request continues, locked for it (`pending` then says what it
        must load before the last message, once it is live). Without an id: the owner's session whose
        conversation is the longest prefix of this one, or a new (anonymous) session."""
        history = messages[:-1]
        while True:
            session = self.registry.choose(session_id, history, seed, owner)
            self.registry.waits.take(session, gone)  # (a busy session: a bounded wait)
            with self.lock:
                if self.sessions.get(session.key) is session:
                    break
            # Dropped while this request waited for it (a failed start, a guest error, a delete):
            # choose again rather than run in a session the store no longer holds.
            session.lock.release()
        if session_id is None and not is_prefix(session.messages, history):  # moved on meanwhile
            session.lock.release()
            raise HistoryMismatch(f"session {session.id!r} changed while this request waited")
        if session.anonymous and not session.messages:  # a new one: room for it
            self._bound_anonymous(session)
        return session

    def pending(self, session: Session, messages: list[dict]) -> list[dict]:
        """The earlier messages of a request that the (locked, live) session must load before its last
        one. A session whose conversation is not the start of the request's (a client regenerating or
        editing a turn; another server moved it on) is rolled back to their common start first: the
        conversation branches there, as the request says."""
        history = messages[:-1]
        if not is_prefix(session.messages, history):
            self._roll_back(session, common_start(session.messages, history))
        return history[len(session.messages):]

    def _roll_back(self, session: Session, keep: int) -> None:
        """The (locked, live) session's conversation cut to its first `keep` messages, in a new actor
        that holds exactly those (prefilled with the next message: a guest cannot be told to forget
        part of its own); its generator goes on. The store's snapshot is replaced at its next freeze."""
        log.info("session %r: rolled back from %d to %d messages (the request's conversation branches "
                 "there)", session.id, len(session.messages), keep)
        session.messages = session.messages[:keep]
        self.lifecycle.restart_guest(session, forget_empty=False)
        if session.actor is None:
            raise RollbackFailed(f"session {session.id!r} could not be rolled back to its first {keep} "
                                 "messages (its guest failed; the session is as its last snapshot left it)")
        self.rollbacks += 1

    def _bound_anonymous(self, new: Session) -> None:
        """Forget the least recently used idle anonymous session of `new`'s owner if `new` took them past
        max_anonymous (running ones are kept: at most a KV slot's worth more). Each new session forgets
        at most one: a burst of arrivals shares the forgetting. Each claims its victim under the store's
        lock, so that two never count or take the same one (64 at once each tried the whole list): by
        taking its lock, or, for one held to be frozen (for another arrival's KV slot, or by the idle
        sweep: SessionLifecycle.hold_idle), by dooming it there (it is forgotten as that ends). Skipping
        that one instead left the owner past the bound, or took a newer session than the least
        recently used idle one."""
        freeing = self.lifecycle.freeing
        with self.lock:
            if self.sessions.anonymous_count(new.owner) <= self.max_anonymous:  # (`new` among them)
                return
            victim = self.sessions.least_recent(
                new.owner, lambda s: s is not new and (s in freeing or s.lock.acquire(blocking=False)))
            if victim is None:
                return
            victim.doomed = True  # (not counted by another arrival while this one forgets it)
            if victim in freeing:
                return
        try:
            self.lifecycle.forget_doomed(victim)
        finally:
            victim.lock.release()

    def _make_room(self, victim: Session) -> bool:
        """Free the KV slot of `victim` if no request holds it and it is live (the admission's choice for
        an arrival that found every slot taken): True if its slot is free now. An anonymous session past
        its owner's max_anonymous that the owner's next arrival would forget (its least recently used
        idle one: _bound_anonymous) is forgotten rather than frozen: no snapshot written for it. Else it
        is frozen, and an arrival that dooms it meanwhile has it forgotten once frozen
        (SessionLifecycle.hold_idle)."""
        lifecycle = self.lifecycle
        with self.lock:
            if not lifecycle.hold_idle(victim):
                return False
            owner, sessions = victim.owner, self.sessions
            victim.doomed = (victim.anonymous and sessions.anonymous_count(owner) > self.max_anonymous
                             and sessions.least_recent(owner, lambda s: s is victim or not s.lock.locked())
                             is victim)
        try:
            if victim.doomed and lifecycle.forget_doomed(victim):
                return True
            return lifecycle.freeze_live_locked(victim)
        finally:
            lifecycle.give_back(victim)

    def go_live(self, session: Session, gone: Callable[[], bool] = lambda: False) -> None:
        """Give the (locked) session a live actor now: thawed, or made, in a KV slot (freezing an idle
        session for it if need be). Raises NoFreeSlot, SessionLeased, ThawFailed, or what failed making
        the actor; a session that never held anything is then forgotten (not left listed as frozen
        without a snapshot)."""
        try:
            self.lifecycle.ensure_live(session, gone)
        except BaseException:
            if not session.messages and not session.stored:
                self.registry.discard(session)
            raise

    def release(self, session: Session) -> None:
        session.last_used = time.monotonic()
        session.lock.release()
        # an idle session's slot can be taken now (frozen for a waiting request)
        self.admission.notify_freed()

    # ---- running a message -------------------------------------------------------------------------

    def run(self, session: Session, history: list[dict], text: str, *, max_tokens: int,
            params: SamplingParams, on_text: Callable[[str], None] | None = None,
            should_stop: Callable[[], bool] = lambda: False, reseed: int | None = None,
            stops: tuple[str, ...] = (), tokens: TokenStream | None = None) -> Answer:
        """Deliver `text` to the (locked) session's actor, loading `history` first; the answer.
        reseed: restart the actor's generator from this seed first (a request's own seed: the same
        request with the same seed draws the same tokens); None: it goes on from where it was.
        stops: the reply ends before the first of these (floe.server.stops); on_text never sees any
        part of one. should_stop(): the client left; its row stops at its next token. tokens: the
        reply streamed as token ids instead of text to on_text (no stops; its reader stops it).

        The session keeps the turn as its client received it: the reply cut at a stop string, and
        nothing of a turn whose client left (its guest, which took more, is restarted with the
        session's conversation). A guest failure ends this request only: the actor is dropped and the
        session returns to its last snapshot (or is forgotten if it never had one).
        """
        if tokens is not None and (stops or on_text is not None):
            raise ValueError("a reply streamed as token ids has no stop strings and no on_text (they need "
                             "its text)")
        lifecycle = self.lifecycle
        lifecycle.ensure_live(session)
        actor = session.actor
        if reseed is not None:
            actor.generator.manual_seed(reseed)
        cut = StopText(stops)
        try:
            for m in history:
                actor.add_history(m["role"], m["content"])

            if tokens is not None:
                reply = actor.send(text, max_tokens=max_tokens, params=params, tokens=tokens)
                cut.text = reply.text
            else:
                emit = cut.emitter(actor, on_text, should_stop)
                reply = actor.send(text, max_tokens=max_tokens, params=params, on_text=emit,
                                   loop_safe=True)  # (emit only hands the piece on: no hand-over per token)
                if (tail := cut.rest()) and on_text is not None:  # held back for a stop string that never
                    on_text(tail)  # came
        except BaseException:
            lifecycle.drop_live(session)
            raise
        left = should_stop()
        if not left:
            session.messages += [*history, {"role": "user", "content": text},
                                 {"role": "assistant", "content": cut.text}]
        if left or cut.matched:  # its guest holds more than the session keeps
            lifecycle.restart_guest(session)
        session.last_used = time.monotonic()
        if not left:
            self._turn_done(session)
        return Answer(cut.text, reply.stats, cut.matched, left)

    def append(self, session: Session, messages: list[dict]) -> None:
        """The (locked, live) session's conversation goes on with `messages` that another actor answered
        (a structured turn): loaded into its actor as history, so the actor holds what the session keeps
        and its next message prefills only them (restarted with the conversation if that fails)."""
        session.messages += messages
        try:
            for m in messages:
                session.actor.add_history(m["role"], m["content"])
        except Exception:  # noqa: BLE001 - the reply was delivered; the actor is remade from the record
            log.exception("session %r: its guest could not take the turn as history", session.id)
            self.lifecycle.restart_guest(session)
        session.last_used = time.monotonic()
        self._turn_done(session)

    def _turn_done(self, session: Session) -> None:
        """With freeze_every_turn: the answered turn is in the store before its answer ends."""
        if self.freeze_every_turn and session.live and session.persist:
            self.lifecycle.freeze_locked(session, close=False)

    def abandon(self, session: Session) -> None:
        """After a turn that failed on another actor (the session's own is untouched): a session that
        holds nothing yet, and no snapshot, is forgotten rather than kept empty in a slot."""
        if not session.messages and not session.stored:
            self.lifecycle.drop_live(session)

    def close(self, freeze: bool = True) -> None:
        """At shutdown: freeze every live session (so a restart, or another server, serves them again)
        and give up this server's leases."""
        self.spares.close()
        for session in list(self.sessions.values()):
            with session.lock:
                if session.live:
                    try:
                        if freeze and session.messages:
                            self.lifecycle.freeze_locked(session)
                    except (SessionError, SnapshotError) as e:
                        log.warning("session %r was not frozen at shutdown: %s", session.id, e)
                    if session.actor is not None:
                        session.actor.close()
                        session.actor = None
        for key in self.snapshots.leased():
            try:
                self.snapshots.release(key)
            except SnapshotError as e:
                log.warning("the lease of %r was not released at shutdown: %s", key, e)


def snapshot_store(snapshots: Path | str, *, idle_seconds: float = 300.0, pinned_bytes: int = 512 << 20,
                   pinned_ttl_s: float | None = None, ttl_s: float | None = None,
                   budget_bytes: int | None = None, cache: str | Path | None = None,
                   lease_s: float = 30.0) -> SnapshotStore:
    """The store `floe serve --snapshots` names (a folder, file://, s3://bucket/prefix): pinned RAM
    (`pinned_bytes`; a frozen session stays there `pinned_ttl_s`, default idle_seconds, while this
    server keeps its lease) over that home (its lifetime `ttl_s` and byte budget). An object store is
    read through `cache` (default: a private temporary folder of this process's)."""
    url = str(snapshots)
    if "://" in url and not url.startswith("file://") and cache is None:
        cache = tempfile.mkdtemp(prefix="floe-store-cache-")
    elif "://" not in url:
        url = str(Path(url).expanduser())
    return open_store(url, pinned_bytes=pinned_bytes, cache=cache, home_bytes=budget_bytes, home_ttl_s=ttl_s,
                      pinned_ttl_s=idle_seconds if pinned_ttl_s is None else pinned_ttl_s, lease_s=lease_s)
