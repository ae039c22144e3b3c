"""A session's actor from live to frozen and back: thawed from the snapshot store (or made) in a KV
slot that floe.server.sessions.admission counted, frozen into the store when idle or when its slot is
needed, restarted with its conversation, dropped after a failure, forgotten.

Invariants: a session is frozen only between requests (its caller holds its lock); its snapshot is in
the store (written through to the store's durable home, unless it is a one-shot session's) before a
freeze is acknowledged and before the actor is closed; a thaw that fails leaves the snapshot where it
was; a thaw reads the conversation from the snapshot it thawed (another server may have moved the
session on meanwhile)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from floe.actor import Actor
from floe.errors import FloeError
from floe.server.records import NotASession, app_record
from floe.server.sessions.actors import ActorMaker
from floe.server.sessions.admission import SlotAdmission
from floe.server.sessions.errors import SessionError, SessionLeased, ThawFailed, UnknownSession
from floe.server.sessions.registry import SessionRegistry
from floe.server.sessions.session import Session
from floe.server.sessions.spares import SpareActors
from floe.snapshot import SnapshotError
from floe.snapshot.errors import LeaseHeld, LeaseLost, SnapshotNotFound

log = logging.getLogger("floe.serve")


class SessionLifecycle:
    """Freezing, thawing and forgetting the sessions of `registry` through its snapshot store.
    kv_dtype: how snapshots store the KV cache (None: the engine's dtype; "int8": a quarter of fp32's
    bytes, not bit-exact). on_thaw(seconds), on_freeze(seconds): told each one's time."""

    def __init__(self, registry: SessionRegistry, admission: SlotAdmission, spares: SpareActors,
                 actors: ActorMaker, *, idle_seconds: float = 300.0, kv_dtype: str | None = None) -> None:
        self.registry, self.admission, self.spares, self.actors = registry, admission, spares, actors
        self.snapshots, self.lock = registry.snapshots, registry.lock
        self.idle_seconds, self.kv_dtype = idle_seconds, kv_dtype
        self.on_thaw: Callable[[float], None] = lambda s: None
        self.on_freeze: Callable[[float], None] = lambda s: None
        self.lost: list[str] = []  # sessions another server took over while this one held them
        self.freeing: set[Session] = set()  # idle sessions held to be frozen (hold_idle); guarded by lock

    # ---- going live --------------------------------------------------------------------------------

    def lease(self, session: Session) -> None:
        """This server's lease on a persisted session before it makes its actor (SessionLeased if
        another server holds it)."""
        if session.persist:
            try:
                self.snapshots.acquire(session.key)
            except LeaseHeld as e:
                raise SessionLeased(session.id, e) from None

    def ensure_live(self, session: Session, gone: Callable[[], bool] = lambda: False) -> None:
        """Give the (locked) session a live actor: thawed, made with its conversation, a spare, or new
        (gone(): its request's client left; SlotAdmission.reserve)."""
        if session.live:
            return
        if not session.stored:
            self.lease(session)
        self.admission.reserve(owner=session.owner, gone=gone)
        actor = None
        try:
            if session.stored:
                actor = self._thaw(session)
            elif session.messages:  # a one-shot session whose snapshot left RAM: its conversation again
                actor = self.actors.with_history(session.messages, session.seed)
            elif (actor := self.spares.fresh()) is not None:
                actor.generator.manual_seed(session.seed)  # as Actor(seed=...) would start it
            else:
                actor = self.actors.new(session.seed)  # (one at a time: ActorMaker)
        finally:
            self.admission.uncount(session, actor)  # (the session counted once: live, not also reserved)

    def _thaw(self, session: Session) -> Actor:
        """The (locked) session's actor thawed from the store, its conversation read from the same
        snapshot: restored into a spare actor where there is one (made ahead, off the request's path).
        The caller gives the session its actor (SlotAdmission.uncount)."""
        t = time.perf_counter()
        actors = self.actors
        try:
            spare = self.spares.fresh()
            try:
                actor, metadata = self.snapshots.thaw_with_metadata(
                    session.key, actors.engine, actors.guest, into=spare, seed=session.seed,
                    scheduler=actors.scheduler, loop=actors.loop)
            except BaseException:
                if spare is not None:  # (a failed thaw closes it; the store may fail before the thaw)
                    spare.close()
                raise
        except LeaseHeld as e:
            raise SessionLeased(session.id, e) from None
        except SnapshotNotFound:
            session.stored = False
            if session.persist or not session.messages:
                self.registry.discard(session)
                raise UnknownSession(f"session {session.id!r} is no longer in the store (deleted, or "
                                     "past its lifetime)") from None
            return self.actors.with_history(session.messages, session.seed)  # (a one-shot that left RAM)
        except FloeError as e:  # the client is told what failed, not where the snapshot lies
            log.warning("session %r could not be thawed: %s", session.id, e)
            raise ThawFailed(f"session {session.id!r} could not be thawed (its snapshot is left in "
                             f"place): {type(e).__name__}") from e
        try:
            record = app_record(metadata)
        except NotASession as e:
            actor.close()
            raise ThawFailed(f"session {session.id!r} could not be thawed: {e}") from None
        session.messages, session.seed = record["messages"], record["seed"]
        self.on_thaw(time.perf_counter() - t)
        return actor

    def restart_guest(self, session: Session, forget_empty: bool = True) -> None:
        """Give the (locked) session a new actor that holds exactly its conversation (none if it has
        none and no snapshot and `forget_empty`: it is forgotten): a guest cannot be told to forget
        part of its own (see docs/SERVER.md, "stop"). The new actor takes over the old one's KV slot,
        so its next message prefills only what differs from what the slot held (Actor.adopt_slot):
        the turns before a rolled-back one are not computed again. The session stays live throughout
        (its slot counted once, as its: no spare takes it, and an arrival counting slots meanwhile
        does not count it twice, as live and as reserved, and freeze an idle session for nothing)."""
        old, actor = session.actor, None
        try:
            if forget_empty and not session.messages and not session.stored:
                old.close()
                session.actor = None
                self.registry.discard(session)
                return
            actor = self.actors.with_history(session.messages, session.seed, slot_of=old)
            old.close()
            actor.generator.set_state(old.generator.get_state())
            session.actor, actor = actor, None
        except Exception:  # noqa: BLE001 - the reply was delivered; the session falls back as on a failure
            log.exception("session %r: its guest could not be restarted with its conversation", session.id)
            self.drop_live(session)
        finally:
            if actor is not None:
                actor.close()

    def drop_live(self, session: Session) -> None:
        """Forget the live actor after a failure; fall back to the snapshot if there is one."""
        if session.actor is not None:
            session.actor.close()
            session.actor = None
        try:
            if session.stored:
                session.messages = app_record(self.snapshots.metadata(session.key))["messages"]
                return
        except (SnapshotError, NotASession) as e:
            log.warning("session %r: its snapshot cannot be read back (%s); it is forgotten", session.id, e)
        self.registry.discard(session)

    # ---- freezing ----------------------------------------------------------------------------------

    def freeze_live_locked(self, victim: Session) -> bool:
        """Freeze the (locked, live) `victim` for its KV slot: True (its slot is free now)."""
        try:
            self.freeze_locked(victim)
        except SessionLeased:
            pass  # taken over: its actor is closed, its slot free
        return True

    def freeze_locked(self, session: Session, close: bool = True) -> dict:
        """Put the session's snapshot into the store, then (`close`) close its actor (caller holds
        session.lock). A session another server took over meanwhile (this one's lease expired) is
        dropped here and SessionLeased raised: its state is that server's now."""
        t = time.perf_counter()
        session.may_be_stored = True
        try:
            info = self.snapshots.freeze(session.key, session.actor, kv_dtype=self.kv_dtype,
                                         app=session.record(), persist=session.persist)
        except (LeaseHeld, LeaseLost) as e:
            log.warning("session %r was taken over by another server: %s", session.id, e)
            self.lose(session)
            raise SessionLeased(session.id, e) from None
        session.stored = session.persist or self.snapshots.has(session.key)
        session.snapshot_bytes = info["bytes"]
        if close:
            session.actor.close()
            session.actor = None
        self.on_freeze(time.perf_counter() - t)
        return info

    def lose(self, session: Session) -> None:
        """Another server holds the (locked) session now: nothing of it stays here."""
        if session.actor is not None:
            session.actor.close()
            session.actor = None
        with self.lock:
            if self.registry.sessions.get(session.key) is session:
                del self.registry.sessions[session.key]
        self.lost.append(session.key)

    def freeze(self, sid: str, owner: str = "") -> dict:
        """Freeze `owner`'s session `sid` now, into the store's durable home (also a one-shot session:
        a client that asks for a freeze asks for it to be kept): its id, state, snapshot bytes and the
        seconds it took."""
        with self.registry.holding(sid, owner) as session:
            if not session.persist:
                session.persist = True
                if not session.live and session.stored:
                    self.ensure_live(session)  # its RAM copy, thawed to be written through
            if session.live:
                info = self.freeze_locked(session)
            elif session.stored:
                info = {"bytes": session.snapshot_bytes, "seconds": 0.0}
            else:
                raise SessionError(f"session {sid!r} has no state to freeze yet")
        return {"id": sid, "state": "frozen", "bytes": info["bytes"], "seconds": info["seconds"]}

    def thaw(self, sid: str, owner: str = "") -> dict:
        with self.registry.holding(sid, owner) as session:
            self.ensure_live(session)
        return session.describe()

    def let_go(self, sid: str, owner: str = "") -> dict:
        """Freeze `owner`'s session `sid` (if live) and give up this server's lease on it: another
        server may take it at once (a drain, a migration). Its id and snapshot bytes."""
        with self.registry.holding(sid, owner) as session:
            if session.live:
                session.persist = True
                self.freeze_locked(session)
            self.snapshots.release(session.key)
        return {"id": sid, "state": "frozen", "bytes": session.snapshot_bytes}

    def drain(self) -> list[str]:
        """Let every session go (`let_go`; running ones once their request ends): the keys let go."""
        with self.lock:
            sessions = list(self.registry.sessions.values())
        out = []
        for session in sessions:
            try:
                self.let_go(session.id, session.owner)
                out.append(session.key)
            except SessionError as e:
                log.warning("drain: session %r: %s", session.id, e)
        return out

    def evict_idle(self) -> list[str]:
        """Freeze every live session idle longer than idle_seconds; returns their ids."""
        now = time.monotonic()
        with self.lock:
            idle = [s for s in self.registry.sessions.live() if now - s.last_used > self.idle_seconds]
        frozen = []
        for session in idle:
            with self.lock:
                if not self.hold_idle(session):
                    continue
            try:
                if not session.doomed and time.monotonic() - session.last_used > self.idle_seconds:
                    self.freeze_locked(session)
                    frozen.append(session.id)
            except SessionLeased:
                pass
            finally:
                self.give_back(session)
        return frozen

    def hold_idle(self, session: Session) -> bool:
        """Take the idle, live session's lock to freeze it (caller holds the store's lock; False if a
        request holds it or it is frozen), listed in `freeing` until give_back. Meanwhile an arrival past
        its owner's bound of anonymous sessions that would forget it (its least recently used idle one)
        dooms it rather than skipping it (SessionStore._bound_anonymous): skipping it left the owner
        past the bound, or forgot a newer session."""
        if not session.lock.acquire(blocking=False):
            return False
        if not session.live:
            session.lock.release()
            return False
        self.freeing.add(session)
        return True

    def give_back(self, session: Session) -> None:
        """The end of a hold_idle: the session forgotten if an arrival doomed it meanwhile (once frozen),
        then unlocked. Under the store's lock, so an arrival finds it either held here or free."""
        with self.lock:
            self.freeing.discard(session)
            if not session.doomed:
                session.lock.release()
                return
        try:
            self.forget_doomed(session)
        finally:
            session.lock.release()

    # ---- forgetting --------------------------------------------------------------------------------

    def forget_locked(self, session: Session) -> bool:
        """Close the (locked) session's actor, delete its snapshot and drop it; False if the store had
        dropped it already. It stays registered until its snapshot is gone: a new session of its id
        cannot be made (and frozen under that key) meanwhile. SessionLeased if another server holds it."""
        sessions = self.registry.sessions
        with self.lock:
            if sessions.get(session.key) is not session:
                return False
        try:  # (a one-shot session never frozen is in no tier and holds no lease: nothing to delete — the
            # store's delete would take a lease first, a file written and removed on the arrival's path)
            if session.persist or (session.may_be_stored and self.snapshots.has(session.key)):
                self.snapshots.delete(session.key)
        except LeaseHeld as e:
            raise SessionLeased(session.id, e) from None
        if session.actor is not None:  # its slot free now; its guest torn down off this request's path
            actor, session.actor = session.actor, None
            actor.give_up_slot()
            self.spares.close_later(actor)
        with self.lock:
            del sessions[session.key]
        return True

    def forget_doomed(self, session: Session) -> bool:
        """Forget the (locked, doomed) anonymous session past its owner's bound: True if it is gone."""
        try:
            if self.forget_locked(session):
                log.info("forgot anonymous session %s (past its owner's bound of anonymous sessions)",
                         session.id)
                return True
        except SessionError as e:  # held elsewhere: not this server's to forget
            log.info("could not forget anonymous session %s: %s", session.id, e)
        finally:
            session.doomed = False  # (a session not forgotten stays, over the bound until the next)
        return False

    def forget_frozen(self, key: str) -> None:
        """Drop the session under `key` if it is frozen and idle (its snapshot was deleted)."""
        sessions = self.registry.sessions
        with self.lock:
            session = sessions.get(key)
        if session is not None and session.lock.acquire(blocking=False):
            try:
                if not session.live:
                    with self.lock:
                        sessions.pop(key, None)
            finally:
                session.lock.release()
