"""What a session cannot do for a request: each error says how the server answers it (status, code)."""

from __future__ import annotations

import time

from floe.errors import FloeError
from floe.snapshot.errors import LeaseHeld, LeaseLost


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


class ClientLeft(SessionError):
    """The request's client left while it waited (for a KV slot, or its busy session): its place goes to
    another request's, and nobody reads the answer."""

    status, code = 499, "client_closed_request"


class SessionBusy(SessionError):
    """The session runs another request, and this one may not wait for it (floe.server.sessions.waits)."""

    status, code = 503, "session_busy"


class ThawFailed(SessionError):
    status, code = 500, "thaw_failed"


class SessionExists(SessionError):
    status, code = 409, "session_exists"


class SnapshotRefused(SessionError):
    status, code = 400, "snapshot_invalid"


class OneSlotOnly(SessionError):
    status, code = 400, "needs_two_slots"
