"""Sessions moved as snapshot files: exported (its bytes, checked), imported (made or replaced from
them), forked (a new session holding another's state as it is now)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable, Iterator

from floe.server.records import NotASession, app_record, session_key
from floe.server.sessions.errors import (
    SessionError,
    SessionLeased,
    SnapshotRefused,
    ThawFailed,
    UnknownSession,
)
from floe.server.sessions.lifecycle import SessionLifecycle
from floe.server.sessions.session import checked_id
from floe.snapshot import SnapshotError, thawable
from floe.snapshot.errors import LeaseHeld, LeaseLost, SnapshotNotFound


class SessionTransfers:
    """Export, import and fork for the sessions of `lifecycle`'s registry."""

    def __init__(self, lifecycle: SessionLifecycle) -> None:
        self.lifecycle, self.registry, self.snapshots = lifecycle, lifecycle.registry, lifecycle.snapshots

    def export(self, sid: str, owner: str = "") -> Iterator[memoryview]:
        """`owner`'s session `sid` as its snapshot file's bytes, in chunks, every byte checked before
        the first is given; a live session is frozen first (and stays live), so it is its state now."""
        with self.registry.holding(sid, owner) as session:
            if session.live:
                self.lifecycle.freeze_locked(session, close=False)
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
        key = session_key(owner, checked_id(sid))
        with self.registry.holding(sid, owner, make=True) as session:
            def accept(header) -> None:
                app_record(header.metadata)  # NotASession: refused before it replaces anything
                # What a thaw here would refuse (another model's, guest, cache shape, a longer context):
                # stored, it failed every later request of its session (500 thaw_failed), and a restart
                # skipped it — an upload over a session of another model lost that session
                thawable(self.lifecycle.actors.engine, header, self.lifecycle.actors.guest)

            try:
                info = self.snapshots.import_(key, chunks, accept=accept)
            except BaseException as e:  # refused, or its client stopped sending: nothing is kept of it
                self.registry.forget_if_empty(session)
                if isinstance(e, LeaseHeld):
                    raise SessionLeased(sid, e) from None
                if isinstance(e, (SnapshotError, NotASession)):
                    raise SnapshotRefused(f"the snapshot was refused: {e}") from None
                raise
            if session.actor is not None:  # the imported state replaces what ran here
                session.actor.close()
                session.actor = None
            record = app_record(self.snapshots.metadata(key))
            session.messages, session.seed, session.stored = record["messages"], record["seed"], True
            session.anonymous, session.persist, session.snapshot_bytes = False, True, info["bytes"]
            if record["owner"] != owner or record["anonymous"]:  # its record must say whose it is
                self.lifecycle.ensure_live(session)
                self.lifecycle.freeze_locked(session)
        return {"id": sid, "object": "session", "bytes": info["bytes"], "checksum": info["checksum"],
                "messages": len(session.messages)}

    def fork(self, sid: str, owner: str = "", new_id: str | None = None) -> dict:
        """A new session `new_id` of `owner`'s (None: a fresh id) holding session `sid`'s state as it
        is now (its conversation, KV cache, guest memory and generator), so the two go on apart. Waits
        for a running turn of `sid` to end, as a freeze does; a frozen `sid` is thawed to be copied (as
        its next message would thaw it). The fork is in the store's durable home when this returns,
        frozen. SessionExists if `owner` has a session `new_id`."""
        new_id = uuid.uuid4().hex[:16] if new_id is None else checked_id(new_id)
        sessions = self.registry.sessions
        with self.registry.holding(sid, owner) as source:
            if not (source.live or source.stored or source.messages):
                raise SessionError(f"session {sid!r} has no state to fork yet")
            fork = self.registry.claim_new(new_id, owner)
            try:
                # (a thaw reads the conversation from the snapshot it thaws)
                self.lifecycle.ensure_live(source)
                fork.messages, fork.seed = [dict(m) for m in source.messages], source.seed
                info = self.snapshots.freeze(fork.key, source.actor, kv_dtype=self.lifecycle.kv_dtype,
                                             app=fork.record())
            except BaseException as e:
                with self.registry.lock:
                    if sessions.get(fork.key) is fork:
                        del sessions[fork.key]
                fork.lock.release()  # a request that waited for it chooses again (acquire)
                if isinstance(e, (LeaseHeld, LeaseLost)):
                    raise SessionLeased(new_id, e) from None
                raise
            fork.stored, fork.snapshot_bytes = True, info["bytes"]
            fork.last_used = source.last_used = time.monotonic()
            fork.lock.release()
        return {**fork.describe(), "object": "session", "forked_from": sid}
