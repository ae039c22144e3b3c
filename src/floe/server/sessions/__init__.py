"""Sessions of `floe serve` (floe.server.sessions.store.SessionStore and the parts it composes)."""

from floe.server.records import SESSION_ID, session_key
from floe.server.sessions.errors import (
    HistoryMismatch,
    NoFreeSlot,
    OneSlotOnly,
    RollbackFailed,
    SessionError,
    SessionExists,
    SessionLeased,
    SnapshotRefused,
    ThawFailed,
    UnknownSession,
)
from floe.server.sessions.session import Answer, Session, is_prefix
from floe.server.sessions.store import SessionStore, snapshot_store

__all__ = ["SESSION_ID", "Answer", "HistoryMismatch", "NoFreeSlot", "OneSlotOnly", "RollbackFailed",
           "Session", "SessionError", "SessionExists", "SessionLeased", "SessionStore", "SnapshotRefused",
           "ThawFailed",
           "UnknownSession", "is_prefix", "session_key", "snapshot_store"]
