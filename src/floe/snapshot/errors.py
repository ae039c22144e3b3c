"""What a snapshot that cannot be used raises: one class per cause, all of them SnapshotError."""

from __future__ import annotations

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
