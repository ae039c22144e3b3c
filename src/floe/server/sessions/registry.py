"""Which sessions a server knows, by owner and id: the one lock that guards them (and the slot
accounting of floe.server.sessions.admission, which shares it), finding a request's session, and
reading the sessions the snapshot store holds.

Every session belongs to an owner (protocol.OWNER: "" on a server without API keys, else a hash of
the key that made it), stored in its record; each owner has its own session ids, and a request sees
only its owner's sessions. Store keys: `{id}` for the open owner's, `{owner}/{id}` for a key's.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

from floe import randomness
from floe.server.records import NotASession, app_record, session_key, split_key
from floe.server.sessions.errors import SessionExists, SessionLeased, ThawFailed, UnknownSession
from floe.server.sessions.session import Session, checked_id, is_prefix
from floe.server.sessions.table import SessionTable
from floe.server.sessions.waits import LockWaits
from floe.snapshot import SnapshotError, clean_stale
from floe.snapshot.errors import LeaseHeld, SnapshotNotFound
from floe.snapshot.store import SnapshotStore
from floe.snapshot.tiers import SUFFIX, DiskTier

log = logging.getLogger("floe.serve")
LOAD_THREADS = 16  # a start's header reads at once


class SessionRegistry:
    """The sessions of one server by store key, and the lock that guards them."""

    def __init__(self, snapshots: SnapshotStore, persist_anonymous: bool = False, max_waiting: int = 8,
                 wait_seconds: float = 30.0) -> None:
        """max_waiting, wait_seconds: how many requests may wait for busy sessions, and how long (s) one
        may wait for a KV slot (for a busy session: twice that, as its holder may wait that long first)."""
        self.snapshots, self.persist_anonymous = snapshots, persist_anonymous
        self.waits = LockWaits(max_waiting, 2 * wait_seconds)  # requests waiting for a busy session's lock
        self.sessions = SessionTable()  # by session_key(owner, id), indexed
        self.lock = threading.Lock()  # guards `sessions` and slot accounting
        self.skipped: list[str] = []  # snapshots in the store that are not loadable sessions

    def load(self) -> int:
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
        entries = sorted(home.entries(), key=lambda e: e.key)

        def read(key: str) -> Session | Exception:
            try:
                return self.read(key)
            except (SnapshotError, NotASession) as e:
                return e

        # The headers in parallel: from an object store each is a request (12 ms each, one after
        # another, on loopback: two minutes' start for 10,000 sessions)
        with ThreadPoolExecutor(LOAD_THREADS, thread_name_prefix="floe-load") as pool:
            found = pool.map(read, [e.key for e in entries])
            for entry, session in zip(entries, found, strict=True):
                if isinstance(session, Exception):
                    self.skipped.append(f"{entry.key}{SUFFIX}: {session}")
                    log.warning("skipping %s%s: %s", entry.key, SUFFIX, session)
                    continue
                # Least recently used first, also across a restart: its last use was its last freeze.
                session.last_used = now - max(0.0, now_wall - entry.used_at)
                session.snapshot_bytes = entry.nbytes
                self.sessions[session.key] = session
        return len(self.sessions)

    def read(self, key: str) -> Session:
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

    def choose(self, session_id: str | None, history: list[dict], seed: int, owner: str) -> Session:
        """The session for a request (SessionStore.acquire's choice, not yet locked)."""
        if session_id is None:
            with self.lock:
                candidates = [s for s in self.sessions.continuing(owner, history)
                              if not s.lock.locked() and is_prefix(s.messages, history)]
                session = max(candidates, key=lambda s: len(s.messages), default=None)
                if session is None:
                    session = self.new(randomness.token_hex(8), seed, owner, anonymous=True)
                return session
        key = session_key(owner, checked_id(session_id))
        with self.lock:
            session = self.sessions.get(key)
        if session is None:  # in the store: another server's, or made since this one started
            found = self.lookup(key)
            with self.lock:
                session = self.sessions.get(key)
                if session is None and found is not None:
                    self.sessions[key] = session = found
                if session is None:
                    if any(m["role"] == "assistant" for m in history):
                        self.refuse_if_leased(key, session_id)
                        raise UnknownSession(f"no session {session_id!r} (a new session starts with "
                                             "no assistant messages)")
                    session = self.new(session_id, seed, owner)
        return session  # (one whose conversation is not the start of this one's branches: pending)

    def lookup(self, key: str) -> Session | None:
        try:
            return self.read(key)
        except SnapshotNotFound:
            return None
        except (SnapshotError, NotASession) as e:
            log.warning("session %r in the store cannot be read: %s", key, e)
            raise ThawFailed(f"session {key.rpartition('/')[2]!r} is in the store but cannot be read: "
                             f"{type(e).__name__}") from e

    def refuse_if_leased(self, key: str, sid: str) -> None:
        """SessionLeased if another server holds `key` (live there, never frozen into the store)."""
        held = self.snapshots.holder(key)
        if held is not None and held[0] != self.snapshots.owner and held[1] > time.time():
            raise SessionLeased(sid, LeaseHeld(key, *held))

    def new(self, sid: str, seed: int, owner: str, anonymous: bool = False) -> Session:
        """A new session registered (caller holds the lock)."""
        session = Session(sid, seed=seed, owner=owner, anonymous=anonymous,
                          persist=not anonymous or self.persist_anonymous)
        self.sessions[session.key] = session
        return session

    def get(self, sid: str, owner: str = "") -> Session:
        """`owner`'s session `sid` (another owner's is as unknown as one that does not exist); one this
        server has not seen is looked up in the store."""
        key = session_key(owner, checked_id(sid))
        with self.lock:
            session = self.sessions.get(key)
        if session is None:
            found = self.lookup(key)
            if found is not None:
                with self.lock:
                    session = self.sessions.setdefault(key, found)
        if session is None:
            raise UnknownSession(f"no session {sid!r}")
        return session

    @contextlib.contextmanager
    def holding(self, sid: str, owner: str = "", make: bool = False) -> Iterator[Session]:
        """`owner`'s session `sid` (get; `make`: made, registered and empty, if this server has none, as
        an import's), locked for the block (waiting as LockWaits.take waits). One dropped while this
        waited for its lock (a delete, a failed thaw) is looked up again: a request that held it then
        thawed it into a KV slot nothing freed, froze it back into the store, or imported a snapshot
        that the session of its id made meanwhile overwrote."""
        while True:
            session = self._made(sid, owner) if make else self.get(sid, owner)
            self.waits.take(session)
            with self.lock:
                if self.sessions.get(session.key) is session:
                    break
            session.lock.release()
        try:
            yield session
        finally:
            session.lock.release()

    def _made(self, sid: str, owner: str) -> Session:
        key = session_key(owner, checked_id(sid))
        with self.lock:
            session = self.sessions.get(key)
            if session is None:
                session = self.sessions[key] = Session(sid, owner=owner, seed=0)
            return session

    def claim_new(self, sid: str, owner: str) -> Session:
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

    def forget_if_empty(self, session: Session) -> None:
        if not session.stored and not session.live:
            with self.lock:
                if self.sessions.get(session.key) is session:
                    del self.sessions[session.key]

    def discard(self, session: Session) -> None:
        """Drop the session's key, whichever session it names now."""
        with self.lock:
            self.sessions.pop(session.key, None)
