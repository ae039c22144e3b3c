"""What a snapshot that cannot be used raises: one class per cause, all of them SnapshotError."""

from __future__ import annotations

from datetime import UTC, datetime

from floe.errors import FloeError


class SnapshotError(FloeError):
    """A snapshot cannot be used; nothing was loaded."""


class SnapshotUnreadable(SnapshotError):
    """There is no regular file at the path (missing, a folder, a FIFO, a device), or it cannot be opened."""


class SnapshotCorrupt(SnapshotError):
    """The file is truncated, not a safetensors file, breaks the snapshot format's rules (header,
    tensor names, dtypes, shapes, offsets, metadata), or its contents do not match its checksum."""


class SnapshotVersionMismatch(SnapshotError):
    """The snapshot's format or guest ABI version is not one this floe reads."""


class SnapshotModelMismatch(SnapshotError):
    """The snapshot was made with another model than the engine runs."""


class SnapshotGuestMismatch(SnapshotError):
    """The snapshot was made with another guest module, or names a built-in guest that does not exist."""


class SnapshotShapeMismatch(SnapshotError):
    """The snapshot's KV cache does not fit this engine's cache (layers, heads, length)."""


class SnapshotRestoreFailed(SnapshotError):
    """The guest or the engine refused the snapshot's state while a thaw restored it (e.g. its guest
    memory is over the actor's cap); the new actor was closed."""


# ---- the store (floe.snapshot.store) -----------------------------------------------------------------

class SnapshotNotFound(SnapshotError):
    """No tier of the store holds a snapshot under this key."""


class SnapshotKeyInvalid(SnapshotError):
    """A store key is not one: segments of letters, digits, _ . - (at most 128 each), joined by /."""


class SnapshotTooLarge(SnapshotError):
    """A snapshot is larger than the store accepts (an import's max_bytes, or a tier's whole budget)."""


class StoreUnavailable(SnapshotError):
    """A tier's backend (the disk, the object store) failed an operation; the store changed nothing."""


class LeaseHeld(SnapshotError):
    """Another owner holds the session's lease; it may be taken over once the lease expires."""

    def __init__(self, key: str, owner: str, expires_at: float) -> None:
        until = datetime.fromtimestamp(expires_at, UTC).isoformat(timespec="seconds")
        super().__init__(f"session {key!r} is held by {owner!r} until {until} (its lease); another server "
                         "may take it over only after that, if its owner has not renewed it")
        self.key, self.owner, self.expires_at = key, owner, expires_at


class LeaseLost(SnapshotError):
    """This store's lease was taken over (it had expired) or removed: it no longer owns the session."""
