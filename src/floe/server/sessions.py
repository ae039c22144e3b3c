"""Sessions of `floe serve`: each conversation is an actor that keeps its KV cache, frozen to disk
when idle (or when its KV slot is needed) and thawed on its next message, also after a restart.

Invariants: a session runs one request at a time (its lock); it is frozen only between requests;
the snapshot file is written (atomically, fsynced) before a freeze is acknowledged and before the
actor is closed; a thaw that fails leaves the file where it was. The conversation the actor holds
(`messages`) is stored inside the snapshot (its `app` record), so a file is a whole session.

Every session belongs to an owner (protocol.OWNER: "" on a server without API keys, else a hash of
the key that made it), stored in its record; each owner has its own session ids, and a request sees
only its owner's sessions. The open owner's sessions are files `{id}.safetensors` in the folder, an
owner's in the folder's subfolder named by it.
"""

from __future__ import annotations

import logging
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from floe import snapshot
from floe.actor import Actor, DecodeScheduler, EngineLoop, MessageStats
from floe.engine import Engine, SamplingParams
from floe.errors import FloeError
from floe.server.protocol import OWNER
from floe.server.stops import StopText
from floe.snapshot import SnapshotError, clean_stale, header

log = logging.getLogger("floe.serve")
SESSION_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")  # fullmatch: "$" would let a final "\n" in
ROLES = ("system", "user", "assistant")


class SessionError(FloeError):
    """A request a session cannot take; `status` and `code` say how the server answers it."""

    status, code = 400, "invalid_request_error"


class UnknownSession(SessionError):
    status, code = 404, "session_not_found"


class HistoryMismatch(SessionError):
    status, code = 409, "session_history_mismatch"


class NoFreeSlot(SessionError):
    status, code = 503, "server_busy"


class ThawFailed(SessionError):
    status, code = 500, "thaw_failed"


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
    path: Path
    messages: list[dict] = field(default_factory=list)  # what the actor holds: role, content
    actor: Actor | None = None
    last_used: float = field(default_factory=time.monotonic)
    lock: threading.Lock = field(default_factory=threading.Lock)
    seed: int = 0
    owner: str = ""  # whose it is (protocol.OWNER; "": a server without API keys)
    anonymous: bool = False  # made for a request that named no session (kept per owner up to a bound)

    @property
    def live(self) -> bool:
        return self.actor is not None

    @property
    def key(self) -> str:
        return session_key(self.owner, self.id)

    def describe(self) -> dict:
        """What a client may know of it (not where its file lies)."""
        actor = self.actor  # once: a freeze may close it meanwhile
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            size = None
        return {"id": self.id, "state": "live" if actor else "frozen", "messages": len(self.messages),
                "kv_tokens": actor.engine.kv_len(actor.slot) if actor else None,
                "idle_seconds": round(time.monotonic() - self.last_used, 3), "snapshot_bytes": size,
                "anonymous": self.anonymous}


def session_key(owner: str, sid: str) -> str:
    """A session's name in SessionStore.sessions: its id, under its owner's (ids are per owner)."""
    return f"{owner}/{sid}" if owner else sid


def is_prefix(prefix: list[dict], messages: list[dict]) -> bool:
    return len(prefix) <= len(messages) and all(
        a["role"] == b["role"] and a["content"] == b["content"]
        for a, b in zip(prefix, messages, strict=False))


SPARE_CHECK_S = 0.05  # how often the spare-actor maker looks for free slots and an idle engine loop
SPARE_RETRY_S = 1.0  # after a spare actor could not be made


class SessionStore:
    """All sessions of one server: live ones hold a KV slot of `engine`, frozen ones a file.

    max_anonymous: sessions made for requests that named none, kept per owner; beyond it, making one
    forgets the owner's least recently used idle one (and deletes its file). They are a cache of the
    conversations that clients resend whole: a forgotten one is found by no prefix, and its
    conversation's next request starts a new session."""

    def __init__(self, engine: Engine, folder: Path, *, idle_seconds: float = 300.0,
                 guest: str | None = None, on_thaw: Callable[[float], None] = lambda s: None,
                 on_freeze: Callable[[float], None] = lambda s: None,
                 scheduler: DecodeScheduler | None = None, loop: EngineLoop | None = None,
                 max_anonymous: int = 64) -> None:
        if max_anonymous < 1:
            raise FloeError(f"max_anonymous must be at least 1, not {max_anonymous}")
        self.engine, self.folder, self.idle_seconds, self.guest = engine, Path(folder), idle_seconds, guest
        self.max_anonymous = max_anonymous
        self.scheduler = scheduler  # batches v1 guests' decode steps (None: they take turns)
        self.loop = loop  # steps v2 guests' turns (None: the engine's own loop)

        self.folder.mkdir(parents=True, exist_ok=True)
        self.sessions: dict[str, Session] = {}  # by session_key(owner, id)
        self.lock = threading.Lock()  # guards `sessions` and slot accounting
        self._reserved = 0  # slots counted for sessions whose actor is being made
        self._creating = threading.Lock()  # actors are made one at a time (see _ensure_live)
        self._spares: list[Actor] = []  # actors made ahead in free slots (keep_spares); guarded by lock
        self._spares_wanted = 0
        self._closing = threading.Event()
        self._spare_maker: threading.Thread | None = None
        self.on_thaw, self.on_freeze = on_thaw, on_freeze
        self.skipped: list[str] = []  # files in the folder that are not loadable sessions

    # ---- startup -----------------------------------------------------------------------------------

    def warm_up(self) -> None:
        """One throwaway two-token turn in a fresh actor: compiles the guest module and the chat
        template and starts the engine loop, which a server's first request would otherwise wait for
        (~0.3 s on the H200 host)."""
        with Actor(self.engine, self.guest, scheduler=self.scheduler, loop=self.loop) as actor:
            actor.send("Hello.", max_tokens=2)

    def load_folder(self) -> int:
        """Register every session frozen in the folder and its owners' subfolders (headers only, each
        checked as a thaw checks it; the tensors are verified on thaw), skipping with a log line
        whatever is not one (a FIFO or a folder is refused at once, never waited on), or is not its
        folder's owner's; remove what killed writers left."""
        owners = [("", self.folder), *((d.name, d) for d in sorted(self.folder.iterdir())
                                       if OWNER.fullmatch(d.name) and d.is_dir() and not d.is_symlink())]
        for owner, folder in owners:
            for path in clean_stale(folder):
                log.info("removed %s, left by a snapshot writer that was killed", path.name)
            for path in sorted(folder.glob("*.safetensors")):
                name = str(path.relative_to(self.folder))
                try:
                    record = _app_record(header(path))
                    if record["owner"] != owner:  # moved: it stays its owner's, never another's
                        raise NotASession("its record names another owner than its folder's")
                    if not SESSION_ID.fullmatch(path.stem):
                        raise NotASession("its name is not a session id (letters, digits, _ . -)")
                except (SnapshotError, NotASession) as e:
                    self.skipped.append(f"{name}: {e}")
                    log.warning("skipping %s: %s", name, e)
                    continue
                # Least recently used first, also across a restart: its last use was its last freeze.
                used = time.monotonic() - max(0.0, time.time() - path.stat().st_mtime)
                session = Session(path.stem, path, messages=record["messages"], seed=record["seed"],
                                  owner=owner, anonymous=record["anonymous"], last_used=used)
                self.sessions[session.key] = session
        return len(self.sessions)

    # ---- choosing the session for a request --------------------------------------------------------

    def acquire(self, session_id: str | None, messages: list[dict], seed: int,
                owner: str = "") -> tuple[Session, list[dict]]:
        """The session of `owner`'s this request continues, locked for it, and the earlier messages
        it must load before the last (user) one. Without an id: the owner's session whose
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
        if not is_prefix(session.messages, history):  # another request moved it on meanwhile
            session.lock.release()
            raise HistoryMismatch(f"session {session.id!r} changed while this request waited")
        if session.anonymous and not session.messages:  # a new one: room for it
            self._bound_anonymous(session)
        return session, history[len(session.messages):]

    def _choose(self, session_id: str | None, history: list[dict], seed: int, owner: str) -> Session:
        """The session for a request (acquire's choice, not yet locked)."""
        with self.lock:
            if session_id is not None:
                session = self.sessions.get(session_key(owner, _checked(session_id)))
                if session is None:
                    if any(m["role"] == "assistant" for m in history):
                        raise UnknownSession(f"no session {session_id!r} (a new session starts with "
                                             "no assistant messages)")
                    session = self._new(session_id, seed, owner)
                elif not is_prefix(session.messages, history):
                    raise HistoryMismatch(
                        f"session {session_id!r} holds {len(session.messages)} messages that are not "
                        "the start of this request's conversation")
            else:
                candidates = [s for s in self.sessions.values() if s.owner == owner and s.messages
                              and not s.lock.locked() and is_prefix(s.messages, history)]
                session = max(candidates, key=lambda s: len(s.messages), default=None)
                if session is None:
                    session = self._new(uuid.uuid4().hex[:16], seed, owner, anonymous=True)
            return session

    def _new(self, sid: str, seed: int, owner: str, anonymous: bool = False) -> Session:
        session = Session(sid, self.folder / owner / f"{sid}.safetensors", seed=seed, owner=owner,
                          anonymous=anonymous)  # folder / "" / name is folder / name
        self.sessions[session.key] = session
        return session

    def _bound_anonymous(self, new: Session) -> None:
        """Forget the least recently used idle anonymous sessions of `new`'s owner beyond
        max_anonymous (running ones are kept: at most a KV slot's worth more)."""
        with self.lock:
            others = sorted((s for s in self.sessions.values() if s.anonymous and s.owner == new.owner
                             and s is not new), key=lambda s: s.last_used)
        excess = len(others) + 1 - self.max_anonymous
        for victim in others:
            if excess <= 0:
                return
            if victim.lock.acquire(blocking=False):
                try:
                    if self._forget_locked(victim):
                        excess -= 1
                        log.info("forgot anonymous session %s (over %d of its owner's)", victim.id,
                                 self.max_anonymous)
                finally:
                    victim.lock.release()

    # ---- running a message -------------------------------------------------------------------------

    def run(self, session: Session, history: list[dict], text: str, *, max_tokens: int,
            params: SamplingParams, on_text: Callable[[str], None] | None = None,
            should_stop: Callable[[], bool] = lambda: False, reseed: int | None = None,
            stops: tuple[str, ...] = ()) -> Answer:
        """Deliver `text` to the (locked) session's actor, loading `history` first; the answer.
        reseed: restart the actor's generator from this seed first (a request's own seed: the same
        request with the same seed draws the same tokens); None: it goes on from where it was.
        stops: the reply ends before the first of these (floe.server.stops); on_text never sees any
        part of one. should_stop(): the client left; its row stops at its next token.

        The session keeps the turn as its client received it: the reply cut at a stop string, and
        nothing of a turn whose client left (its guest, which took more, is restarted with the
        session's conversation). A guest failure ends this request only: the actor is dropped and the
        session returns to its last snapshot (or is forgotten if it never had one).
        """
        self._ensure_live(session)
        actor = session.actor
        if reseed is not None:
            actor.generator.manual_seed(reseed)
        cut = StopText(stops)
        try:
            for m in history:
                actor.add_history(m["role"], m["content"])

            def emit(piece: str) -> None:
                piece = cut.take(piece)
                if cut.matched or should_stop():
                    actor.stop_requested = True
                if piece and on_text is not None:
                    on_text(piece)

            reply = actor.send(text, max_tokens=max_tokens, params=params, on_text=emit)
            if (tail := cut.rest()) and on_text is not None:  # held back for a stop string that never came
                on_text(tail)
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

    def abandon(self, session: Session) -> None:
        """After a turn that failed on another actor (the session's own is untouched): a session that
        holds nothing yet, and no snapshot, is forgotten rather than kept empty in a slot."""
        if not session.messages and not session.path.exists():
            self._drop_live(session)

    @contextmanager
    def extra_slot(self) -> Iterator[None]:
        """A KV slot counted, for the block, for an actor of no session's (a structured turn's): freezes
        the least recently used idle session if every slot is taken; NoFreeSlot if all are running."""
        if self.engine.cache.n_slots < 2:  # its session holds the only one while the turn runs
            raise OneSlotOnly("structured output (response_format, tools) runs on an actor of its own "
                              "beside its session's: start floe serve with --max-sessions 2 or more")
        self._reserve_slot()
        try:
            yield
        finally:
            with self.lock:
                self._reserved -= 1

    def _restart_guest(self, session: Session) -> None:
        """Give the (locked) session a new actor in a KV slot that holds exactly its conversation
        (none if it has none and no snapshot: it is forgotten). Its next message prefills the whole
        conversation: a guest cannot be told to forget part of its own (see docs/SERVER.md, "stop")."""
        old, actor = session.actor, None
        with self.lock:  # its slot stays counted while its actor is replaced: no spare takes it
            self._reserved += 1
        try:
            old.close()
            session.actor = None
            if not session.messages and not session.path.exists():
                with self.lock:
                    self.sessions.pop(session.key, None)
                return
            with self._creating:
                actor = Actor(self.engine, self.guest, scheduler=self.scheduler, loop=self.loop)
            actor.generator.set_state(old.generator.get_state())
            for m in session.messages:
                actor.add_history(m["role"], m["content"])
            session.actor, actor = actor, None
        except Exception:  # noqa: BLE001 - the reply was delivered; the session falls back as on a failure
            log.exception("session %r: its guest could not be restarted with its conversation", session.id)
            self._drop_live(session)
        finally:
            if actor is not None:
                actor.close()
            with self.lock:
                self._reserved -= 1

    def go_live(self, session: Session) -> None:
        """Give the (locked) session a live actor now: thawed, or made, in a KV slot (freezing an idle
        session for it if need be). Raises NoFreeSlot, ThawFailed, or what failed making the actor; a
        session that never held anything is then forgotten (not left listed as frozen without a file)."""
        try:
            self._ensure_live(session)
        except BaseException:
            if not session.messages and not session.path.exists():
                with self.lock:
                    self.sessions.pop(session.key, None)
            raise

    def release(self, session: Session) -> None:
        session.last_used = time.monotonic()
        session.lock.release()

    def _ensure_live(self, session: Session) -> None:
        if session.live:
            return
        if not session.path.exists() and self._take_spare(session):
            return
        self._reserve_slot()
        try:
            if session.path.exists():
                t = time.perf_counter()
                try:
                    session.actor = snapshot.thaw(self.engine, session.path, self.guest, seed=session.seed,
                                               scheduler=self.scheduler, loop=self.loop)
                except FloeError as e:  # the client is told what failed, not where the file lies
                    log.warning("session %r could not be thawed from %s: %s", session.id, session.path, e)
                    raise ThawFailed(f"session {session.id!r} could not be thawed (the file is left in "
                                     f"place): {type(e).__name__}") from e
                self.on_thaw(time.perf_counter() - t)
            else:
                # One at a time: creating an actor is ~1 ms of short calls into Wasmtime, each a GIL
                # hand-off; 16 arrivals creating theirs at once thrash the GIL (~45 ms each, measured)
                # where taking turns costs each ~1 ms plus its wait.
                with self._creating:
                    session.actor = Actor(self.engine, self.guest, seed=session.seed,
                                          scheduler=self.scheduler, loop=self.loop)
        finally:
            with self.lock:
                self._reserved -= 1

    def _drop_live(self, session: Session) -> None:
        """Forget the live actor after a failure; fall back to the snapshot if there is one."""
        if session.actor is not None:
            session.actor.close()
            session.actor = None
        if session.path.exists():
            session.messages = _app_record(header(session.path))["messages"]
        else:
            with self.lock:
                self.sessions.pop(session.key, None)

    def _reserve_slot(self) -> None:
        """Count a KV slot for a session about to go live (its actor claims it next), freezing the
        least recently used idle live session if every slot is taken. Counted under the store's lock,
        so concurrent arrivals cannot both take the last slot."""
        while True:
            with self.lock:
                live = [s for s in self.sessions.values() if s.live]
                if len(live) + self._reserved + len(self._spares) < self.engine.cache.n_slots:
                    self._reserved += 1
                    return
                if self._spares:  # its slot is needed (a thaw): it goes, and is made again when idle
                    spare = self._spares.pop()
                    self._reserved += 1  # counted as ours in the same breath: nobody takes it between
                    break
                idle = sorted((s for s in live if not s.lock.locked()), key=lambda s: s.last_used)
            if not any(self._freeze_if_idle(victim) for victim in idle):
                raise NoFreeSlot(f"all {self.engine.cache.n_slots} KV slots are busy with running requests")
        spare.close()  # frees the slot just counted as this caller's

    def _freeze_if_idle(self, victim: Session) -> bool:
        if not victim.lock.acquire(blocking=False):
            return False
        try:
            if not victim.live:
                return False
            self._freeze_locked(victim)
            return True
        finally:
            victim.lock.release()

    # ---- freezing ----------------------------------------------------------------------------------

    def _freeze_locked(self, session: Session) -> dict:
        """Write the session's snapshot, then close its actor (caller holds session.lock)."""
        t = time.perf_counter()
        session.path.parent.mkdir(mode=0o700, exist_ok=True)  # an owner's folder
        info = snapshot.freeze(session.actor, session.path, app={"floe_server": {
            "id": session.id, "owner": session.owner, "anonymous": session.anonymous,
            "messages": session.messages, "seed": session.seed}})
        session.actor.close()
        session.actor = None
        self.on_freeze(time.perf_counter() - t)
        return info

    def freeze(self, sid: str, owner: str = "") -> dict:
        """Freeze `owner`'s session `sid` now: its id, state, snapshot bytes and the seconds it took."""
        session = self.get(sid, owner)
        with session.lock:
            if session.live:
                info = self._freeze_locked(session)
            elif session.path.exists():
                info = {"bytes": session.path.stat().st_size, "seconds": 0.0}
            else:
                raise SessionError(f"session {sid!r} has no state to freeze yet")
        return {"id": sid, "state": "frozen", "bytes": info["bytes"], "seconds": info["seconds"]}

    def thaw(self, sid: str, owner: str = "") -> dict:
        session = self.get(sid, owner)
        with session.lock:
            self._ensure_live(session)
        return session.describe()

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
                finally:
                    session.lock.release()
        return frozen

    # ---- bookkeeping -------------------------------------------------------------------------------

    def get(self, sid: str, owner: str = "") -> Session:
        """`owner`'s session `sid` (another owner's is as unknown as one that does not exist)."""
        with self.lock:
            session = self.sessions.get(session_key(owner, _checked(sid)))
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
        dropped it already. It stays registered until its file is gone: a new session of its id
        cannot be made (and frozen to that file) meanwhile."""
        with self.lock:
            if self.sessions.get(session.key) is not session:
                return False
        if session.actor is not None:
            session.actor.close()
            session.actor = None
        session.path.unlink(missing_ok=True)
        with self.lock:
            del self.sessions[session.key]
        return True

    def counts(self) -> dict[str, int]:
        with self.lock:
            live = sum(s.live for s in self.sessions.values())
            return {"live": live, "frozen": len(self.sessions) - live, "spare_actors": len(self._spares)}

    # ---- spare actors ------------------------------------------------------------------------------

    def keep_spares(self, wanted: int) -> None:
        """Keep up to `wanted` actors made ahead, in free KV slots, made while the engine loop has no
        turn: a new session takes one instead of making its actor as it arrives (~1 ms of the core's
        GIL time each, which a burst of arrivals pays one after another). A thaw that finds no free
        slot closes a spare first."""
        self._spares_wanted = wanted
        if self._spare_maker is None and wanted > 0:
            self._spare_maker = threading.Thread(target=self._make_spares, name="floe-spares", daemon=True)
            self._spare_maker.start()

    def _take_spare(self, session: Session) -> bool:
        """Give the session a spare actor, if there is one (counted as its live actor at once)."""
        with self.lock:
            if not self._spares:
                return False
            session.actor = self._spares.pop()
        session.actor.generator.manual_seed(session.seed)  # as Actor(seed=...) would start it
        return True

    def _make_spares(self) -> None:
        while not self._closing.wait(SPARE_CHECK_S):
            while len(self._spares) < self._spares_wanted and not self._closing.is_set() and not (
                    self.loop is not None and self.loop.busy):
                with self.lock:
                    live = sum(s.live for s in self.sessions.values())
                    if live + self._reserved + len(self._spares) >= self.engine.cache.n_slots:
                        break
                    self._reserved += 1
                actor, failed = None, False
                try:
                    with self._creating:
                        actor = Actor(self.engine, self.guest, scheduler=self.scheduler, loop=self.loop)
                except Exception:  # noqa: BLE001 - sessions make their own meanwhile, as without spares
                    log.exception("could not make a spare actor (trying again in %g s)", SPARE_RETRY_S)
                    failed = True
                finally:
                    with self.lock:  # one breath: the slot is counted throughout
                        self._reserved -= 1
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
        """At shutdown: freeze every live session (so a restart serves them again)."""
        self._closing.set()
        if self._spare_maker is not None:
            self._spare_maker.join(30)
        with self.lock:
            spares, self._spares = self._spares, []
        for actor in spares:
            actor.close()
        for session in list(self.sessions.values()):
            with session.lock:
                if session.live:
                    if freeze and session.messages:
                        self._freeze_locked(session)
                    else:
                        session.actor.close()
                        session.actor = None


def _checked(sid: str) -> str:
    """A session id as given, if it is one: never a path (no / or \\, no leading dot, no control
    characters), so its file lies in the snapshot folder."""
    if not SESSION_ID.fullmatch(sid):
        raise SessionError(f"session id {sid[:200]!r} is not valid (letters, digits, _ . -; at most 128)")
    return sid


class NotASession(ValueError):
    """A snapshot without a well-formed conversation record of floe serve's."""


def _app_record(metadata: dict[str, str]) -> dict:
    """The snapshot's conversation record: messages of a known role with text, and an integer seed."""
    import json

    record = json.loads(metadata.get("app", "{}")).get("floe_server")  # "app" is checked to be an object
    messages = record.get("messages") if isinstance(record, dict) else None
    if not isinstance(messages, list) or not all(
            isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)
            for m in messages):
        raise NotASession("not a floe serve session (no conversation record of role and content messages)")
    seed, owner, anonymous = record.get("seed", 0), record.get("owner", ""), record.get("anonymous", False)
    if type(seed) is not int:
        raise NotASession(f"not a floe serve session (its seed {str(seed)[:20]!r} is not an integer)")
    if not (isinstance(owner, str) and OWNER.fullmatch(owner)) or type(anonymous) is not bool:
        raise NotASession("not a floe serve session (its owner is not an owner id or 'anonymous' not a "
                          "boolean)")
    return {"messages": messages, "seed": seed, "owner": owner, "anonymous": anonymous}
