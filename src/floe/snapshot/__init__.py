"""Whole-actor snapshots: one safetensors file holding the KV cache prefix, guest memory and globals,
token history and sampler state, verified on load; written atomically.

Tensors (format version 1):
  kv.{layer}.k, kv.{layer}.v      [n_kv_heads, kv_len, head_dim], engine dtype or int8
  kv.{layer}.k.scale, ...v.scale  float32 [n_kv_heads, kv_len, 1]   (int8 only: absmax / 127)
  guest.memory                    uint8 [n_pages * 4096]: the pages of guest memory not all zero
  guest.memory.pages              int32 [n_pages]: their page numbers, strictly increasing
  guest.globals                   int64 [n_globals]: raw bits of exported mutable globals
  tokens                          int32 [kv_len]: the token ids behind the KV cache
  sampler.rng                     uint8: the actor's torch.Generator state
Metadata (all strings): see `_metadata`. `checksums` (format 2) is a JSON object: every tensor's
xxh3-128 digest of its bytes. `checksum` is xxh3-128 over every tensor's name, dtype and shape and
every other metadata entry (so over the per-tensor digests too); format 1 files hashed the tensor
bytes into it directly, and are still read. The per-tensor digests are hashed by several threads at
once (floe.engine.copyhash); a thaw checks the KV tensors in the same pass that copies them out of
the file. They detect corruption; they are not a signature: every file is also checked against the
format (floe.snapshot.layout) before anything in it is used, and every error is a SnapshotError.
Writing: floe.snapshot.atomic (a temporary beside the target, renamed; writers of a path take turns).
"""

from floe.actor import (
    ActorState,
)
from floe.snapshot.atomic import (
    clean_stale,
    path_lock,
)
from floe.snapshot.errors import (
    SnapshotCorrupt,
    SnapshotError,
    SnapshotGuestMismatch,
    SnapshotModelMismatch,
    SnapshotRestoreFailed,
    SnapshotShapeMismatch,
    SnapshotUnreadable,
    SnapshotVersionMismatch,
)
from floe.snapshot.file import (
    Snapshot,
    checksum,
    checksum_v1,
    encode,
    freeze,
    header,
    model_fingerprint,
    seal,
    thaw,
    thawable,
    write,
)
from floe.snapshot.layout import (
    FORMAT,
    FORMAT_VERSION,
    KV_DTYPES,
    PAGE,
    READABLE_VERSIONS,
)

__all__ = [
    "FORMAT", "FORMAT_VERSION", "KV_DTYPES", "PAGE", "READABLE_VERSIONS", "ActorState", "Snapshot",
    "SnapshotCorrupt", "SnapshotError", "SnapshotGuestMismatch", "SnapshotModelMismatch",
    "SnapshotRestoreFailed", "SnapshotShapeMismatch", "SnapshotUnreadable", "SnapshotVersionMismatch",
    "checksum", "checksum_v1", "clean_stale", "encode", "freeze", "header", "model_fingerprint", "path_lock",
    "seal", "thaw", "thawable", "write",
]
