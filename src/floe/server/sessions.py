"""Sessions of `floe serve`: each conversation is an actor that keeps its KV cache, frozen into the
snapshot store (floe.snapshot.store: pinned RAM, a disk folder, an object store shared by servers)
when idle (or when its KV slot is needed) and thawed on its next message, also after a restart or on
another server sharing the store.

Invariants: a session runs one request at a time (its lock); it is frozen only between requests;
its snapshot is in the store (written through to the store's durable home, unless it is a one-shot
session's) before a freeze is acknowledged and before the actor is closed; a thaw that fails leaves
the snapshot where it was. The conversation the actor holds (`messages`) is stored inside the
snapshot (its `app` record, floe.server.records), so a snapshot is a whole session; a thaw reads the
conversation from the snapshot it thawed (another server may have moved the session on meanwhile).

Ownership across servers: a server holds a session's lease (floe.snapshot.lease) while the session is
live here or its snapshot is in this server's RAM tier, renewed by `maintain`; a session another
server holds is refused (SessionLeased, 409); one it let go of (frozen into the shared home, lease
released or expired) is taken over by the next server its client asks. Sessions made for requests
that named none (anonymous, one-shot) are kept in RAM only (never written to the home) unless the
server persists them (`persist_anonymous`) or a client freezes one explicitly.

Every session belongs to an owner (protocol.OWNER: "" on a server without API keys, else a hash of
the key that made it), stored in its record; each owner has its own session ids, and a request sees
only its owner's sessions. Store keys: `{id}` for the open owner's, `{owner}/{id}` for a key's.
"""

from __future__ import annotations

import logging
import tempfile
import threading
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from floe.actor import Actor, DecodeScheduler, EngineLoop, MessageStats
from floe.actor.stream import TokenStream
from floe.engine import Engine, SamplingParams
from floe.errors import FloeError
from floe.memory import trim_heap
from floe.server.records import (
    SESSION_ID,
    NotASession,
    app_record,
    make_record,
    session_key,
    split_key,
)
from floe.server.stops import StopText
from floe.snapshot import SnapshotError, clean_stale
from floe.snapshot.errors import LeaseHeld, LeaseLost, SnapshotNotFound
from floe.snapshot.store import SnapshotStore, open_store
from floe.snapshot.tiers import SUFFIX, DiskTier

log = logging.getLogger("floe.serve")
__all__ = ["SESSION_ID", "Answer", "Session", "SessionError", "SessionStore", "is_prefix", "session_key",
           "snapshot_store"]


class SessionError(FloeError):
    """A request a session cannot take; `status` and `code` say how the server answers it."""

    status, code = 400, "invalid_request_error"
    retry_after: float | None = None  # seconds after which the same request may succeed


class UnknownSession(SessionError):
    status, code = 404, "session_not_found"


class HistoryMismatch(SessionError):
    status, code = 409, "session_history_mismatch"


class RollbackFailed(SessionError):
    status, code = 500, "rollback_failed"


class SessionLeased(SessionError):
    """Another server holds the session (its lease in the shared store)."""

    status, code = 409, "session_leased"

    def __init__(self, sid: str, e: LeaseHeld | LeaseLost) -> None:
        if isinstance(e, LeaseHeld):
            self.retry_after = max(0.0, e.expires_at - time.time())
            super().__init__(f"session {sid!r} is held by another server (its lease runs "
                             f"{self.retry_after:.1f} s more, and is renewed while that server keeps "
                             "the session); ask the server that holds it, or again once it has let the "
                             "session go")
        else:
            super().__init__(f"session {sid!r} was taken over by another server (this one's lease "
                             "expired); ask the server that holds it now")


class NoFreeSlot(SessionError):
    status, code = 503, "server_busy"


def _owner_of_key(key: str) -> str:
    """The owner a store key's session belongs to ("" for an open server's, or a key of no session)."""
    found = split_key(key)
    return found[0] if found is not None else ""


class _Ticket:
    """A request's place in the wait queue for a KV slot."""

    __slots__ = ("owner", "bumped")

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self.bumped: str | None = None  # why it lost its place to another owner's request (its 503)


class ThawFailed(SessionError):
    status, code = 500, "thaw_failed"


class SessionExists(SessionError):
    status, code = 409, "session_exists"


class SnapshotRefused(SessionError):
    status, code = 400, "snapshot_invalid"


class OneSlotOnly(SessionError):
    status, code = 400, "needs_two_slots"


@dataclass
class Answer:
    """A message's outcome as its client received it (SessionStore.run)."""

    text: str  # the reply, cut before a stop string
    stats: MessageStats
    stopped: bool  # a stop string ended it
    left: bool  # its client left before its end: the session did not keep the turn


@dataclass
class Session:
    id: str
    messages: list[dict] = field(default_factory=list)  # what the actor holds: role, content
    actor: Actor | None = None
    last_used: float = field(default_factory=time.monotonic)
    lock: threading.Lock = field(default_factory=threading.Lock)
    seed: int = 0
    owner: str = ""  # whose it is (protocol.OWNER; "": a server without API keys)
    anonymous: bool = False  # made for a request that named no session (kept per owner up to a bound)
    doomed: bool = False  # claimed to be forgotten (SessionStore._bound_anonymous)
    persist: bool = True  # its snapshots go to the store's durable home (a one-shot's: RAM only)
    stored: bool = False  # the store holds a snapshot of it (as far as this server knows)
    snapshot_bytes: int | None = None

    @property
    def live(self) -> bool:
        return self.actor is not None

    @property
    def key(self) -> str:
        return session_key(self.owner, self.id)

    def record(self) -> dict:
        return make_record(self.id, self.owner, self.anonymous, self.messages, self.seed)

    def describe(self) -> dict:
        """What a client may know of it (not where its snapshot lies)."""
        actor = self.actor  # once: a freeze may close it meanwhile
        return {"id": self.id, "state": "live" if actor else "frozen", "messages": len(self.messages),
                "kv_tokens": actor.engine.kv_len(actor.slot) if actor else None,
                "idle_seconds": round(time.monotonic() - self.last_used, 3),
                "snapshot_bytes": self.snapshot_bytes if self.stored else None,
                "anonymous": self.anonymous, "persisted": self.persist}


def is_prefix(prefix: list[dict], messages: list[dict]) -> bool:
    return len(prefix) <= len(messages) and common_start(prefix, messages) == len(prefix)


def common_start(a: list[dict], b: list[dict]) -> int:
    """How many messages two conversations share from their start (role and content)."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x["role"] != y["role"] or x["content"] != y["content"]:
            break
        n += 1
    return n


# Forgotten sessions' actors are closed here (~1-2 ms each: their guests torn down), not by the request
# that forgot them (a burst's arrivals each forget an idle session of their owner's).
_CLOSER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="floe-close")
CLOSE_LATER_MOST = 256  # forgotten actors waiting for an idle loop to be closed; past it, closed at once
CLOSE_LATER_S = 5.0  # the longest one waits
SPARE_CHECK_S = 0.05  # how often the spare-actor maker looks for free slots and an idle engine loop
SPARE_RETRY_S = 1.0  # after a spare actor could not be made


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

        self.sessions: dict[str, Session] = {}  # by session_key(owner, id)
        self.lock = threading.Lock()  # guards `sessions` and slot accounting
        self._reserved = 0  # slots counted for sessions whose actor is being made
        # Requests waiting for a KV slot while every slot runs one, first come first served: at most
        # max_waiting, each at most wait_seconds (then a 503 with Retry-After, as when the queue is full).
        self.max_waiting, self.wait_seconds = max_waiting, wait_seconds
        self._waiting: deque[_Ticket] = deque()  # tickets, oldest first; guarded by lock
        self._slot_freed = threading.Condition(self.lock)
        self._extra_waiting = 0  # structured turns waiting for their grammar actor's slot (extra_slot)
        self._extra_held: Counter[str] = Counter()  # extra_slot's slots held now, by owner
        self._creating = threading.Lock()  # actors are made one at a time (see _ensure_live)
        self._spares: list[Actor] = []  # actors made ahead in free slots (keep_spares); guarded by lock
        self._spares_wanted = 0
        self._closing_later: deque[Actor] = deque()  # forgotten sessions' actors (_close_later)
        self._closing = threading.Event()
        self._spare_maker: threading.Thread | None = None
        self.on_thaw, self.on_freeze = on_thaw, on_freeze
        self.skipped: list[str] = []  # snapshots in the store that are not loadable sessions
        self._renewed = self._swept = time.monotonic()
        self.lost: list[str] = []  # sessions another server took over while this one held them
        self.rollbacks = 0  # conversations branched from an earlier turn (pending)

    # ---- startup -----------------------------------------------------------------------------------

    def warm_up(self) -> None:
        """Throwaway two-token turns in a fresh actor, greedy and sampled: compile the guest module and
        the chat template, start the engine loop and load the sampling kernels, which a server's first
        request would otherwise wait for (~0.3 s on the H200 host), and which the loop's bound on a
        warm guest call (floe.actor.loop.STEP_CALL_S) leaves no room for."""
        with Actor(self.engine, self.guest, scheduler=self.scheduler, loop=self.loop) as actor:
            for params in (SamplingParams(), SamplingParams(temperature=0.7, top_k=40, top_p=0.9)):
                actor.send("Hello.", max_tokens=2, params=params)
        self.engine.tokenizer.fill_reply_bytes()  # (the engine loop streams each token's in one lookup)

    def load_store(self) -> int:
        """Register every session the store's home holds (headers only, each checked as a thaw checks
        it; the tensors are verified on thaw), skipping with a log line whatever is not one, or is not
        its key's owner's; in a folder, remove what killed writers left."""
        home = self.snapshots.home
        if isinstance(home, DiskTier):
            for folder in (home.folder, *(d for d in sorted(home.folder.iterdir())
                                          if d.is_dir() and not d.is_symlink())):
                for path in clean_stale(folder):
                    log.info("removed %s, left by a snapshot writer that was killed", path.name)
        now_wall, now = time.time(), time.monotonic()
        for entry in sorted(home.entries(), key=lambda e: e.key):
            try:
                session = self._read_session(entry.key)
            except (SnapshotError, NotASession) as e:
                self.skipped.append(f"{entry.key}{SUFFIX}: {e}")
                log.warning("skipping %s%s: %s", entry.key, SUFFIX, e)
                continue
            # Least recently used first, also across a restart: its last use was its last freeze.
            session.last_used = now - max(0.0, now_wall - entry.used_at)
            session.snapshot_bytes = entry.nbytes
            self.sessions[session.key] = session
        return len(self.sessions)

    def _read_session(self, key: str) -> Session:
        """The session under `key` in the store, from its snapshot's header. Raises SnapshotNotFound,
        another SnapshotError, or NotASession."""
        named = split_key(key)
        if named is None:
            raise NotASession("its key is not a session's ([owner/]id)")
        record = app_record(self.snapshots.metadata(key))
        if record["owner"] != named[0]:  # moved: it stays its owner's, never another's
            raise NotASession("its record names another owner than its key's")
        return Session(named[1], messages=record["messages"], seed=record["seed"], owner=named[0],
                       anonymous=record["anonymous"], stored=True)

    # ---- choosing the session for a request --------------------------------------------------------

    def acquire(self, session_id: str | None, messages: list[dict], seed: int, owner: str = "") -> Session:
        """The session of `owner`'s this request continues, locked for it (`pending` then says what it
        must load before the last message, once it is live). Without an id: the owner's session whose
        conversation is the longest prefix of this one, or a new (anonymous) session."""
        history = messages[:-1]
        while True:
            session = self._choose(session_id, history, seed, owner)
            session.lock.acquire()
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
        self._restart_guest(session, forget_empty=False)
        if session.actor is None:
            raise RollbackFailed(f"session {session.id!r} could not be rolled back to its first {keep} "
                                 "messages (its guest failed; the session is as its last snapshot left it)")
        self.rollbacks += 1

    def _choose(self, session_id: str | None, history: list[dict], seed: int, owner: str) -> Session:
        """The session for a request (acquire's choice, not yet locked)."""
        if session_id is None:
            with self.lock:
                candidates = [s for s in self.sessions.values() if s.owner == owner and s.messages
                              and not s.lock.locked() and is_prefix(s.messages, history)]
                session = max(candidates, key=lambda s: len(s.messages), default=None)
                if session is None:
                    session = self._new(uuid.uuid4().hex[:16], seed, owner, anonymous=True)
                return session
        key = session_key(owner, _checked(session_id))
        with self.lock:
            session = self.sessions.get(key)
        if session is None:  # in the store: another server's, or made since this one started
            found = self._lookup(key)
            with self.lock:
                session = self.sessions.get(key)
                if session is None and found is not None:
                    self.sessions[key] = session = found
                if session is None:
                    if any(m["role"] == "assistant" for m in history):
                        self._refuse_if_leased(key, session_id)
                        raise UnknownSession(f"no session {session_id!r} (a new session starts with "
                                             "no assistant messages)")
                    session = self._new(session_id, seed, owner)
        return session  # (one whose conversation is not the start of this one's branches: pending)

    def _lookup(self, key: str) -> Session | None:
        try:
            return self._read_session(key)
        except SnapshotNotFound:
            return None
        except (SnapshotError, NotASession) as e:
            log.warning("session %r in the store cannot be read: %s", key, e)
            raise ThawFailed(f"session {key.rpartition('/')[2]!r} is in the store but cannot be read: "
                             f"{type(e).__name__}") from e

    def _refuse_if_leased(self, key: str, sid: str) -> None:
        """SessionLeased if another server holds `key` (live there, never frozen into the store)."""
        held = self.snapshots.holder(key)
        if held is not None and held[0] != self.snapshots.owner and held[1] > time.time():
            raise SessionLeased(sid, LeaseHeld(key, *held))

    def _new(self, sid: str, seed: int, owner: str, anonymous: bool = False) -> Session:
        session = Session(sid, seed=seed, owner=owner, anonymous=anonymous,
                          persist=not anonymous or self.persist_anonymous)
        self.sessions[session.key] = session
        return session

    def _bound_anonymous(self, new: Session) -> None:
        """Forget the least recently used idle anonymous session of `new`'s owner if `new` took them past
        max_anonymous (running ones are kept: at most a KV slot's worth more). Each new session forgets
        at most one: a burst of arrivals shares the forgetting (each claims its victim under the store's
        lock, so that two never count or take the same one; 64 at once each tried the whole list)."""
        with self.lock:
            mine = [s for s in self.sessions.values() if s.anonymous and s.owner == new.owner
                    and s is not new and not s.doomed]
            if len(mine) + 1 <= self.max_anonymous:
                return
            idle = [s for s in mine if not s.lock.locked()]
            victim = min(idle, key=lambda s: s.last_used, default=None)
            if victim is None:
                return
            victim.doomed = True
        forgotten = False
        if victim.lock.acquire(blocking=False):
            try:
                forgotten = self._forget_locked(victim)
                if forgotten:
                    log.info("forgot anonymous session %s (over %d of its owner's)", victim.id,
                             self.max_anonymous)
            except SessionError as e:  # held elsewhere: not this server's to forget
                log.info("could not forget anonymous session %s: %s", victim.id, e)
            finally:
                victim.lock.release()
        if not forgotten:
            victim.doomed = False  # (taken by a request meanwhile: kept, over the bound until the next)

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
        self._ensure_live(session)
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
            self._drop_live(session)
            raise
        left = should_stop()
        if not left:
            session.messages += [*history, {"role": "user", "content": text},
                                 {"role": "assistant", "content": cut.text}]
        if left or cut.matched:  # its guest holds more than the session keeps
            self._restart_guest(session)
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
            self._restart_guest(session)
        session.last_used = time.monotonic()
        self._turn_done(session)

    def _turn_done(self, session: Session) -> None:
        """With freeze_every_turn: the answered turn is in the store before its answer ends."""
        if self.freeze_every_turn and session.live and session.persist:
            self._freeze_locked(session, close=False)

    def abandon(self, session: Session) -> None:
        """After a turn that failed on another actor (the session's own is untouched): a session that
        holds nothing yet, and no snapshot, is forgotten rather than kept empty in a slot."""
        if not session.messages and not session.stored:
            self._drop_live(session)

    @contextmanager
    def extra_slot(self, owner: str = "", beside_session: bool = True) -> Iterator[None]:
        """A KV slot counted, for the block, for an actor of no session's (a structured turn's, whose
        session is `owner`'s): freezes the least recently used idle session if every slot is taken, and
        while all run a request, waits in the queue as a session's request does (NoFreeSlot when its
        wait ends) — unless the turns waiting so would then hold every slot but one: their sessions
        hold theirs while they wait, and with all held so, none would ever be freed (NoFreeSlot at once).
        beside_session False: the actor is the request's only one (a text completion's), which holds no
        slot while it waits, so it waits as a new session's request does."""
        n_slots = self.engine.cache.n_slots
        if beside_session and n_slots < 2:  # its session holds the only one while the turn runs
            raise OneSlotOnly("structured output (response_format, tools) runs on an actor of its own "
                              "beside its session's: start floe serve with --max-sessions 2 or more")
        with self.lock:
            wait = not beside_session or self._extra_waiting + 1 < n_slots
            if wait and beside_session:
                self._extra_waiting += 1
        try:
            self._reserve_slot(wait=wait, owner=owner)
        finally:
            if wait and beside_session:
                with self.lock:
                    self._extra_waiting -= 1
        with self.lock:
            self._extra_held[owner] += 1  # (the queue's fairness counts it as the owner's)
        try:
            yield
        finally:
            with self.lock:
                self._reserved -= 1
                self._extra_held[owner] -= 1
                self._slot_freed.notify_all()

    def _restart_guest(self, session: Session, forget_empty: bool = True) -> None:
        """Give the (locked) session a new actor in a KV slot that holds exactly its conversation
        (none if it has none and no snapshot and `forget_empty`: it is forgotten). Its next message
        prefills the whole conversation: a guest cannot be told to forget part of its own (see
        docs/SERVER.md, "stop")."""
        old, actor = session.actor, None
        with self.lock:  # its slot stays counted while its actor is replaced: no spare takes it
            self._reserved += 1
        try:
            old.close()
            session.actor = None
            if forget_empty and not session.messages and not session.stored:
                with self.lock:
                    self.sessions.pop(session.key, None)
                return
            actor = self._actor_with_history(session)
            actor.generator.set_state(old.generator.get_state())
            session.actor, actor = actor, None
        except Exception:  # noqa: BLE001 - the reply was delivered; the session falls back as on a failure
            log.exception("session %r: its guest could not be restarted with its conversation", session.id)
            self._drop_live(session)
        finally:
            if actor is not None:
                actor.close()
            with self.lock:
                self._reserved -= 1

    def _actor_with_history(self, session: Session) -> Actor:
        """A new actor holding the session's conversation (prefilled in full)."""
        with self._creating:
            actor = Actor(self.engine, self.guest, seed=session.seed, scheduler=self.scheduler,
                          loop=self.loop)
        try:
            for m in session.messages:
                actor.add_history(m["role"], m["content"])
        except BaseException:
            actor.close()
            raise
        return actor

    def go_live(self, session: Session) -> None:
        """Give the (locked) session a live actor now: thawed, or made, in a KV slot (freezing an idle
        session for it if need be). Raises NoFreeSlot, SessionLeased, ThawFailed, or what failed making
        the actor; a session that never held anything is then forgotten (not left listed as frozen
        without a snapshot)."""
        try:
            self._ensure_live(session)
        except BaseException:
            if not session.messages and not session.stored:
                with self.lock:
                    self.sessions.pop(session.key, None)
            raise

    def release(self, session: Session) -> None:
        session.last_used = time.monotonic()
        session.lock.release()
        with self.lock:  # an idle session's slot can be taken now (frozen for a waiting request)
            self._slot_freed.notify_all()

    def _lease(self, session: Session) -> None:
        """This server's lease on a persisted session before it makes its actor (SessionLeased if
        another server holds it)."""
        if session.persist:
            try:
                self.snapshots.acquire(session.key)
            except LeaseHeld as e:
                raise SessionLeased(session.id, e) from None

    def _ensure_live(self, session: Session) -> None:
        if session.live:
            return
        if not session.stored:
            self._lease(session)
        self._reserve_slot(owner=session.owner)
        try:
            if session.stored:
                self._thaw(session)
            elif session.messages:  # a one-shot session whose snapshot left RAM: its conversation again
                session.actor = self._actor_with_history(session)
            elif not self._take_spare(session):
                # One at a time: creating an actor is ~1 ms of short calls into Wasmtime, each a GIL
                # hand-off; 16 arrivals creating theirs at once thrash the GIL (~45 ms each, measured)
                # where taking turns costs each ~1 ms plus its wait.
                with self._creating:
                    session.actor = Actor(self.engine, self.guest, seed=session.seed,
                                          scheduler=self.scheduler, loop=self.loop)
        finally:
            with self.lock:
                self._reserved -= 1

    def _thaw(self, session: Session) -> None:
        """The (locked) session's actor thawed from the store, its conversation read from the same
        snapshot."""
        t = time.perf_counter()
        try:
            actor, metadata = self.snapshots.thaw_with_metadata(
                session.key, self.engine, self.guest, seed=session.seed, scheduler=self.scheduler,
                loop=self.loop)
        except LeaseHeld as e:
            raise SessionLeased(session.id, e) from None
        except SnapshotNotFound:
            session.stored = False
            if session.persist or not session.messages:
                with self.lock:
                    self.sessions.pop(session.key, None)
                raise UnknownSession(f"session {session.id!r} is no longer in the store (deleted, or "
                                     "past its lifetime)") from None
            session.actor = self._actor_with_history(session)  # a one-shot that left RAM
            return
        except FloeError as e:  # the client is told what failed, not where the snapshot lies
            log.warning("session %r could not be thawed: %s", session.id, e)
            raise ThawFailed(f"session {session.id!r} could not be thawed (its snapshot is left in "
                             f"place): {type(e).__name__}") from e
        try:
            record = app_record(metadata)
        except NotASession as e:
            actor.close()
            raise ThawFailed(f"session {session.id!r} could not be thawed: {e}") from None
        session.actor, session.messages, session.seed = actor, record["messages"], record["seed"]
        self.on_thaw(time.perf_counter() - t)

    def _drop_live(self, session: Session) -> None:
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
        with self.lock:
            self.sessions.pop(session.key, None)

    def _reserve_slot(self, wait: bool = True, owner: str = "") -> None:
        """Count a KV slot for a session of `owner`'s about to go live (its actor claims it next),
        freezing the least recently used idle live session if every slot is taken. Counted under the
        store's lock, so concurrent arrivals cannot both take the last slot. While every slot runs a
        request, wait (`wait`) in the queue for at most wait_seconds, fairly between owners (the next
        slot goes to the waiting request whose owner holds the fewest; among one owner's, the oldest);
        NoFreeSlot (a 503 with Retry-After) when the queue is full or the wait ends."""
        ticket, deadline = None, 0.0
        try:
            while True:
                with self.lock:
                    if ticket is None and self._waiting and wait:  # others wait already: with them
                        ticket, deadline = self._enqueue(owner)
                    if ticket is not None and ticket.bumped is not None:
                        raise NoFreeSlot(ticket.bumped)
                    if ticket is None or self._next_in_line() is ticket:
                        live = [s for s in self.sessions.values() if s.live]
                        if len(live) + self._reserved < self.engine.cache.n_slots:
                            self._reserved += 1
                            return
                        idle = sorted((s for s in live if not s.lock.locked()), key=lambda s: s.last_used)
                    else:
                        idle = []
                if any(self._freeze_if_idle(victim) for victim in idle):
                    continue
                with self.lock:
                    if not wait:
                        raise NoFreeSlot(f"all {self.engine.cache.n_slots} KV slots are busy with running "
                                         "requests")
                    if ticket is None:
                        ticket, deadline = self._enqueue(owner)
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise NoFreeSlot(f"all {self.engine.cache.n_slots} KV slots stayed busy with running "
                                         f"requests for the {self.wait_seconds:g} s this one may wait")
                    self._slot_freed.wait(min(left, 0.25))  # (woken when a request ends; else it looks again)
        finally:
            if ticket is not None:
                with self.lock:
                    if ticket.bumped is None:
                        self._waiting.remove(ticket)
                    self._slot_freed.notify_all()  # the next in line may go now

    def _enqueue(self, owner: str) -> tuple[_Ticket, float]:
        """A place in the wait queue for a request of `owner`'s (caller holds the lock). A full queue
        refuses it (NoFreeSlot), unless `owner` has none there and another owner has several: then
        that owner's newest gives up its place (its request gets the 503), so that one key cannot
        keep every other key out of the queue."""
        if len(self._waiting) >= self.max_waiting:
            mine = sum(t.owner == owner for t in self._waiting)
            counts = Counter(t.owner for t in self._waiting)
            most, n = counts.most_common(1)[0] if counts else ("", 0)
            if mine or n < 2:
                raise NoFreeSlot(f"all {self.engine.cache.n_slots} KV slots are busy with running requests "
                                 f"and {len(self._waiting)} more wait for one (the most that may)")
            newest = next(t for t in reversed(self._waiting) if t.owner == most)
            newest.bumped = (f"all {self.engine.cache.n_slots} KV slots are busy, and this request's place "
                             "in the queue went to another API key's (each key gets a share of it)")
            self._waiting.remove(newest)
            self._slot_freed.notify_all()
        ticket = _Ticket(owner)
        self._waiting.append(ticket)
        return ticket, time.monotonic() + self.wait_seconds

    def _next_in_line(self) -> _Ticket | None:
        """The waiting request the next free slot goes to (caller holds the lock): the oldest of the
        owner with the fewest sessions running or live (and slots held by extra_slot: structured turns,
        text completions), so that one key's many requests do not keep another key's waiting behind
        them all."""
        if not self._waiting:
            return None
        holding = Counter(s.owner for s in self.sessions.values() if s.live) + self._extra_held
        return min(self._waiting, key=lambda t: holding[t.owner])  # (min keeps the first of equals)

    @property
    def waiting(self) -> int:
        """Requests waiting for a KV slot now."""
        return len(self._waiting)

    def _freeze_if_idle(self, victim: Session) -> bool:
        if not victim.lock.acquire(blocking=False):
            return False
        try:
            if not victim.live:
                return False
            try:
                self._freeze_locked(victim)
            except SessionLeased:
                pass  # taken over: its actor is closed, its slot free
            return True
        finally:
            victim.lock.release()

    # ---- freezing ----------------------------------------------------------------------------------

    def _freeze_locked(self, session: Session, close: bool = True) -> dict:
        """Put the session's snapshot into the store, then (`close`) close its actor (caller holds
        session.lock). A session another server took over meanwhile (this one's lease expired) is
        dropped here and SessionLeased raised: its state is that server's now."""
        t = time.perf_counter()
        try:
            info = self.snapshots.freeze(session.key, session.actor, kv_dtype=self.kv_dtype,
                                         app=session.record(), persist=session.persist)
        except (LeaseHeld, LeaseLost) as e:
            log.warning("session %r was taken over by another server: %s", session.id, e)
            self._lose(session)
            raise SessionLeased(session.id, e) from None
        session.stored = session.persist or self.snapshots.has(session.key)
        session.snapshot_bytes = info["bytes"]
        if close:
            session.actor.close()
            session.actor = None
        self.on_freeze(time.perf_counter() - t)
        return info

    def _lose(self, session: Session) -> None:
        """Another server holds the (locked) session now: nothing of it stays here."""
        if session.actor is not None:
            session.actor.close()
            session.actor = None
        with self.lock:
            if self.sessions.get(session.key) is session:
                del self.sessions[session.key]
        self.lost.append(session.key)

    def freeze(self, sid: str, owner: str = "") -> dict:
        """Freeze `owner`'s session `sid` now, into the store's durable home (also a one-shot session:
        a client that asks for a freeze asks for it to be kept): its id, state, snapshot bytes and the
        seconds it took."""
        session = self.get(sid, owner)
        with session.lock:
            if not session.persist:
                session.persist = True
                if not session.live and session.stored:
                    self._ensure_live(session)  # its RAM copy, thawed to be written through
            if session.live:
                info = self._freeze_locked(session)
            elif session.stored:
                info = {"bytes": session.snapshot_bytes, "seconds": 0.0}
            else:
                raise SessionError(f"session {sid!r} has no state to freeze yet")
        return {"id": sid, "state": "frozen", "bytes": info["bytes"], "seconds": info["seconds"]}

    def thaw(self, sid: str, owner: str = "") -> dict:
        session = self.get(sid, owner)
        with session.lock:
            self._ensure_live(session)
        return session.describe()

    def let_go(self, sid: str, owner: str = "") -> dict:
        """Freeze `owner`'s session `sid` (if live) and give up this server's lease on it: another
        server may take it at once (a drain, a migration). Its id and snapshot bytes."""
        session = self.get(sid, owner)
        with session.lock:
            if session.live:
                session.persist = True
                self._freeze_locked(session)
            self.snapshots.release(session.key)
        return {"id": sid, "state": "frozen", "bytes": session.snapshot_bytes}

    def drain(self) -> list[str]:
        """Let every session go (`let_go`; running ones once their request ends): the keys let go."""
        with self.lock:
            sessions = list(self.sessions.values())
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
            idle = [s for s in self.sessions.values() if s.live and now - s.last_used > self.idle_seconds]
        frozen = []
        for session in idle:
            if session.lock.acquire(blocking=False):
                try:
                    if session.live and time.monotonic() - session.last_used > self.idle_seconds:
                        self._freeze_locked(session)
                        frozen.append(session.id)
                except SessionLeased:
                    pass
                finally:
                    session.lock.release()
        return frozen

    # ---- leases and the store's lifecycle ----------------------------------------------------------

    def maintain(self) -> dict[str, list[str]]:
        """What a server runs every second or so: renew this server's leases (every lease_s / 3),
        drop the sessions whose lease was lost; apply the store's TTLs and budgets (every
        sweep_seconds), forgetting the sessions whose snapshot it deleted; release the leases of
        sessions neither live here nor in this server's RAM tier."""
        now, report = time.monotonic(), {"lost": [], "deleted": [], "released": []}
        if now - self._renewed >= self.snapshots.lease_s / 3:
            self._renewed = now
            for key in self.snapshots.renew_all():
                report["lost"].append(key)
                with self.lock:
                    session = self.sessions.get(key)
                if session is not None and session.lock.acquire(blocking=False):
                    try:
                        self._lose(session)
                    finally:
                        session.lock.release()
        if now - self._swept >= self.sweep_seconds:
            self._swept = now
            with self.lock:
                busy = [s.key for s in self.sessions.values() if s.live or s.lock.locked()]
            # The home's budget is each owner's: one key's sessions never push another key's out.
            swept = self.snapshots.sweep(keep=busy, group=_owner_of_key)
            for key in swept["deleted"]:
                report["deleted"].append(key)
                self._forget_frozen(key)
            # Snapshots are made and dropped whole (MBs each) on many threads: glibc keeps what they
            # freed in its arenas (40-170 MB a churn of 100 one-shot sessions, tests/test_server_memory.py),
            # part of the core's RSS growth in bench/soak.py. Handed back once a sweep (~5-10 ms here).
            trim_heap()
        pinned = self.snapshots.pinned
        for key in self.snapshots.leased():
            with self.lock:
                session = self.sessions.get(key)
            if session is not None and (session.live or session.lock.locked()):
                continue
            if session is not None and pinned is not None and pinned.has(key):
                continue
            self.snapshots.release(key)
            report["released"].append(key)
        return report

    def _forget_frozen(self, key: str) -> None:
        with self.lock:
            session = self.sessions.get(key)
        if session is not None and session.lock.acquire(blocking=False):
            try:
                if not session.live:
                    with self.lock:
                        self.sessions.pop(key, None)
            finally:
                session.lock.release()

    # ---- export, import ----------------------------------------------------------------------------

    def export(self, sid: str, owner: str = "") -> Iterator[memoryview]:
        """`owner`'s session `sid` as its snapshot file's bytes, in chunks, every byte checked before
        the first is given; a live session is frozen first (and stays live), so it is its state now."""
        session = self.get(sid, owner)
        with session.lock:
            if session.live:
                self._freeze_locked(session, close=False)
            elif not session.stored:
                raise SessionError(f"session {sid!r} has no state to export yet")
            try:
                return self.snapshots.export(session.key)
            except SnapshotNotFound:
                raise UnknownSession(f"session {sid!r} is no longer in the store") from None
            except SnapshotError as e:
                raise ThawFailed(f"session {sid!r}: its snapshot cannot be exported: {e}") from None

    def import_(self, sid: str, owner: str, chunks: Iterable) -> dict:
        """Make (or replace) `owner`'s session `sid` from a snapshot file's bytes, checked as they
        stream (SnapshotRefused: not an intact snapshot of a floe serve session; the session as it
        was). A session made by another owner, or as anonymous, is written again as this owner's."""
        key = session_key(owner, _checked(sid))
        with self.lock:
            session = self.sessions.get(key)
            if session is None:
                session = self.sessions[key] = Session(sid, owner=owner, seed=0)
        with session.lock:
            def accept(header) -> None:
                app_record(header.metadata)  # NotASession: refused before it replaces anything

            try:
                info = self.snapshots.import_(key, chunks, accept=accept)
            except LeaseHeld as e:
                self._forget_if_empty(session)
                raise SessionLeased(sid, e) from None
            except (SnapshotError, NotASession) as e:
                self._forget_if_empty(session)
                raise SnapshotRefused(f"the snapshot was refused: {e}") from None
            if session.actor is not None:  # the imported state replaces what ran here
                session.actor.close()
                session.actor = None
            record = app_record(self.snapshots.metadata(key))
            session.messages, session.seed, session.stored = record["messages"], record["seed"], True
            session.anonymous, session.persist, session.snapshot_bytes = False, True, info["bytes"]
            if record["owner"] != owner or record["anonymous"]:  # its record must say whose it is
                self._ensure_live(session)
                self._freeze_locked(session)
        return {"id": sid, "object": "session", "bytes": info["bytes"], "checksum": info["checksum"],
                "messages": len(session.messages)}

    def fork(self, sid: str, owner: str = "", new_id: str | None = None) -> dict:
        """A new session `new_id` of `owner`'s (None: a fresh id) holding session `sid`'s state as it
        is now (its conversation, KV cache, guest memory and generator), so the two go on apart. Waits
        for a running turn of `sid` to end, as a freeze does; a frozen `sid` is thawed to be copied (as
        its next message would thaw it). The fork is in the store's durable home when this returns,
        frozen. SessionExists if `owner` has a session `new_id`."""
        new_id = uuid.uuid4().hex[:16] if new_id is None else _checked(new_id)
        source = self.get(sid, owner)
        with source.lock:
            with self.lock:
                if self.sessions.get(source.key) is not source:  # dropped while this waited for it
                    raise UnknownSession(f"no session {sid!r}")
            if not (source.live or source.stored or source.messages):
                raise SessionError(f"session {sid!r} has no state to fork yet")
            fork = self._claim_new(new_id, owner)
            try:
                self._ensure_live(source)  # (a thaw reads the conversation from the snapshot it thaws)
                fork.messages, fork.seed = [dict(m) for m in source.messages], source.seed
                info = self.snapshots.freeze(fork.key, source.actor, kv_dtype=self.kv_dtype,
                                             app=fork.record())
            except BaseException as e:
                with self.lock:
                    if self.sessions.get(fork.key) is fork:
                        del self.sessions[fork.key]
                fork.lock.release()  # a request that waited for it chooses again (acquire)
                if isinstance(e, (LeaseHeld, LeaseLost)):
                    raise SessionLeased(new_id, e) from None
                raise
            fork.stored, fork.snapshot_bytes = True, info["bytes"]
            fork.last_used = source.last_used = time.monotonic()
            fork.lock.release()
        return {**fork.describe(), "object": "session", "forked_from": sid}

    def _claim_new(self, sid: str, owner: str) -> Session:
        """A new session `sid` of `owner`'s, registered and locked (nobody runs in it before its state
        is stored); SessionExists if the id is taken, here or in the store."""
        key = session_key(owner, sid)
        taken = SessionExists(f"session {sid!r} exists; fork into a new id (or delete it first)")
        if self.snapshots.has(key):
            raise taken
        fork = Session(sid, owner=owner)
        fork.lock.acquire()
        with self.lock:
            if key in self.sessions:
                raise taken
            self.sessions[key] = fork
        return fork

    def _forget_if_empty(self, session: Session) -> None:
        if not session.stored and not session.live:
            with self.lock:
                if self.sessions.get(session.key) is session:
                    del self.sessions[session.key]

    # ---- bookkeeping -------------------------------------------------------------------------------

    def get(self, sid: str, owner: str = "") -> Session:
        """`owner`'s session `sid` (another owner's is as unknown as one that does not exist); one this
        server has not seen is looked up in the store."""
        key = session_key(owner, _checked(sid))
        with self.lock:
            session = self.sessions.get(key)
        if session is None:
            found = self._lookup(key)
            if found is not None:
                with self.lock:
                    session = self.sessions.setdefault(key, found)
        if session is None:
            raise UnknownSession(f"no session {sid!r}")
        return session

    def delete(self, sid: str, owner: str = "") -> None:
        session = self.get(sid, owner)
        with session.lock:
            if not self._forget_locked(session):
                raise UnknownSession(f"no session {sid!r}")

    def _forget_locked(self, session: Session) -> bool:
        """Close the (locked) session's actor, delete its snapshot and drop it; False if the store had
        dropped it already. It stays registered until its snapshot is gone: a new session of its id
        cannot be made (and frozen under that key) meanwhile. SessionLeased if another server holds it."""
        with self.lock:
            if self.sessions.get(session.key) is not session:
                return False
        try:  # (a one-shot session never frozen is in no tier and holds no lease: nothing to delete — the
            # store's delete would take a lease first, a file written and removed on the arrival's path)
            if session.persist or self.snapshots.has(session.key):
                self.snapshots.delete(session.key)
        except LeaseHeld as e:
            raise SessionLeased(session.id, e) from None
        if session.actor is not None:  # its slot free now; its guest torn down off this request's path
            actor, session.actor = session.actor, None
            actor.give_up_slot()
            self._close_later(actor)
        with self.lock:
            del self.sessions[session.key]
        return True

    def counts(self, owner: str | None = None) -> dict[str, int]:
        """Sessions live and frozen, and spare actors; of one owner's sessions only: live and frozen."""
        with self.lock:
            if owner is not None:
                mine = [s for s in self.sessions.values() if s.owner == owner]
                live = sum(s.live for s in mine)
                return {"live": live, "frozen": len(mine) - live}
            live = sum(s.live for s in self.sessions.values())
            return {"live": live, "frozen": len(self.sessions) - live, "spare_actors": len(self._spares)}

    # ---- spare actors ------------------------------------------------------------------------------

    def _close_later(self, actor: Actor) -> None:
        """Close an actor that gave up its slot once the engine loop is idle (its guest's teardown, ~1-2
        ms of the core's GIL, is not a burst's: 64 arrivals each forgetting a session paid 64 of them
        while they arrived), or at once past CLOSE_LATER_MOST waiting or CLOSE_LATER_S."""
        with self.lock:
            self._closing_later.append(actor)
            if len(self._closing_later) <= CLOSE_LATER_MOST:
                if len(self._closing_later) == 1:
                    _CLOSER.submit(self._close_waiting)
                return
            actor = self._closing_later.popleft()
        actor.close()

    def _close_waiting(self) -> None:
        end = time.monotonic() + CLOSE_LATER_S
        while (self.loop is not None and self.loop.busy and time.monotonic() < end
               and not self._closing.is_set()):
            time.sleep(SPARE_CHECK_S)
        while True:
            with self.lock:
                if not self._closing_later:
                    return
                actor = self._closing_later.popleft()
            actor.close()

    def keep_spares(self, wanted: int) -> None:
        """Keep up to `wanted` actors made ahead, without KV slots (Actor kv_slot="later"), made while the
        engine loop has no turn: a new session takes one (and the slot it was counted) instead of making
        its actor as it arrives (~1 ms of the core's GIL time each, which a burst of arrivals pays one
        after another). Held slots do not keep them from being made: a burst into slots idle sessions
        hold (forgotten or frozen for it) finds them too."""
        self._spares_wanted = wanted
        if self._spare_maker is None and wanted > 0:
            self._spare_maker = threading.Thread(target=self._make_spares, name="floe-spares", daemon=True)
            self._spare_maker.start()

    def _take_spare(self, session: Session) -> bool:
        """Give the session a spare actor, if there is one, in the KV slot its caller counted
        (_reserve_slot)."""
        with self.lock:
            if not self._spares:
                return False
            actor = self._spares.pop()
        try:
            actor.attach_slot()
        except FloeError:  # (no slot after all: a slot held outside the store's count) it makes its own
            log.warning("a spare actor found no free KV slot", exc_info=True)
            actor.close()
            return False
        actor.generator.manual_seed(session.seed)  # as Actor(seed=...) would start it
        session.actor = actor
        return True

    def _make_spares(self) -> None:
        while not self._closing.wait(SPARE_CHECK_S):
            while len(self._spares) < self._spares_wanted and not self._closing.is_set() and not (
                    self.loop is not None and self.loop.busy):
                actor, failed = None, False
                try:
                    with self._creating:
                        actor = Actor(self.engine, self.guest, scheduler=self.scheduler, loop=self.loop,
                                      kv_slot="later")
                except Exception:  # noqa: BLE001 - sessions make their own meanwhile, as without spares
                    log.exception("could not make a spare actor (trying again in %g s)", SPARE_RETRY_S)
                    failed = True
                with self.lock:
                    if actor is not None and not self._closing.is_set():
                        self._spares.append(actor)
                        actor = None
                if actor is not None:  # made as the store closed
                    actor.close()
                    return
                if failed:
                    self._closing.wait(SPARE_RETRY_S)
                    break

    def close(self, freeze: bool = True) -> None:
        """At shutdown: freeze every live session (so a restart, or another server, serves them again)
        and give up this server's leases."""
        self._closing.set()
        if self._spare_maker is not None:
            self._spare_maker.join(30)
        with self.lock:
            spares, self._spares = self._spares, []
            spares += self._closing_later
            self._closing_later.clear()
        for actor in spares:
            actor.close()
        for session in list(self.sessions.values()):
            with session.lock:
                if session.live:
                    try:
                        if freeze and session.messages:
                            self._freeze_locked(session)
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


def _checked(sid: str) -> str:
    """A session id as given, if it is one: never a path (no / or \\, no leading dot, no control
    characters), so its snapshot lies under the store's prefix."""
    if not isinstance(sid, str) or not SESSION_ID.fullmatch(sid) or sid.endswith(".lease"):
        raise SessionError(f"session id {str(sid)[:200]!r} is not valid (letters, digits, _ . -; at most "
                           "128; not ending in .lease)")
    return sid
