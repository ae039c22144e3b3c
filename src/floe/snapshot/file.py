"""One actor in one safetensors file (the format: floe.snapshot's docstring): written sealed (every
tensor's digest, one checksum over all) and atomically, read as a Snapshot checked against the format
before anything in it is used, and an actor frozen into one or thawed from one."""

from __future__ import annotations

import json
import math
import mmap
import os
import time
import warnings
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import torch
import wasmtime
import xxhash
from safetensors.torch import save, save_file

from floe.actor import SUPPORTED_ABI_VERSIONS, Actor, ActorState, builtin_guest
from floe.engine import Engine, copyhash
from floe.engine.kvcache import KVDigestMismatch
from floe.errors import FloeError
from floe.snapshot import layout
from floe.snapshot.atomic import replace_file
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
from floe.snapshot.layout import (
    FORMAT,
    FORMAT_VERSION,
    KV_DTYPES,
    PAGE,
    Header,
    check_values,
    compare_checksum,
    header_checksum,
    open_regular,
    read_header,
    read_header_buffer,
)
from floe.wasm import GuestModule, default_runtime


def _quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (head, token) symmetric int8: x ~= q * scale, scale = absmax over head_dim / 127."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 127.0
    return torch.round(xf / scale).clamp(-127, 127).to(torch.int8), scale


def _tensors(state: ActorState, kv_dtype: str) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for i, (k, v) in enumerate(zip(state.k, state.v, strict=True)):
        for name, t in (("k", k), ("v", v)):
            if kv_dtype == "int8":
                q, scale = _quantize_int8(t)
                out[f"kv.{i}.{name}"], out[f"kv.{i}.{name}.scale"] = q.cpu(), scale.cpu()
            else:
                # One copy, to the CPU and the stored dtype at once; always a copy, because views of
                # one cache share storage, which safetensors refuses.
                out[f"kv.{i}.{name}"] = t.to("cpu", getattr(torch, kv_dtype), copy=True).contiguous()
    out["tokens"] = torch.tensor(state.tokens, dtype=torch.int32)
    out["guest.memory"] = torch.from_numpy(np.ascontiguousarray(state.memory_data))
    out["guest.memory.pages"] = torch.from_numpy(np.ascontiguousarray(state.memory_pages))
    # An f64's bits are unsigned (a negative value's are >= 2**63): stored as the int64 of the same bits.
    out["guest.globals"] = torch.tensor([bits - (1 << 64) if bits >= 1 << 63 else bits
                                         for _, _, bits in state.globals], dtype=torch.int64)
    out["sampler.rng"] = state.rng.clone()
    return out


def _metadata(state: ActorState, kv_dtype: str) -> dict[str, str]:
    k0 = state.k[0]
    return {
        "format": FORMAT,
        "format_version": str(FORMAT_VERSION),
        "abi_version": str(state.abi_version),
        "model_fingerprint": state.model_fingerprint,
        "model_name": state.model_name,
        "guest_sha256": state.guest_sha256,
        "guest_name": state.guest_name,
        "engine_dtype": state.engine_dtype,
        "engine_weights": state.engine_weights,
        "kv_dtype": kv_dtype,
        "kv_len": str(len(state.tokens)),
        "n_layers": str(len(state.k)),
        "n_kv_heads": str(k0.shape[0]),
        "head_dim": str(k0.shape[-1]),
        "guest_memory_bytes": str(state.memory_size),
        "guest_page_size": str(PAGE),
        "globals": json.dumps([[name, kind] for name, kind, _ in state.globals]),
        "system_prompt": state.system_prompt,
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }


def checksum_v1(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> str:
    """Format 1: one xxh3-128 pass over every tensor's name, dtype, shape and bytes and the metadata."""
    h = xxhash.xxh3_128()
    for name in sorted(tensors):
        t = tensors[name]
        h.update(f"{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        if t.numel():
            h.update(t.contiguous().view(torch.uint8).numpy())
    for key in sorted(metadata):
        if key != "checksum":
            h.update(f"{key}\0{metadata[key]}\0".encode())
    return h.hexdigest()


def checksum(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> str:
    """Format 2: xxh3-128 over every tensor's name, dtype and shape and every metadata entry but
    itself. The tensors' bytes enter through the `checksums` entry (see `seal`)."""
    return header_checksum(((name, t.dtype, tuple(t.shape)) for name, t in tensors.items()), metadata)


def _digests(tensors: dict[str, torch.Tensor], names: list[str]) -> dict[str, str]:
    """Each named tensor's XXH3-128 digest (hex), hashed by several threads at once."""
    return dict(zip(names, copyhash.digests([tensors[name] for name in names]), strict=True))


def seal(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """Set metadata's `checksums` (per tensor) and `checksum` (the whole file) for `tensors`."""
    digests = _digests(tensors, list(tensors))
    metadata["checksums"] = json.dumps({name: digests[name] for name in sorted(tensors)})
    metadata["checksum"] = checksum(tensors, metadata)


def write(state: ActorState, path: str | Path, kv_dtype: str | None = None, app: dict | None = None) -> dict:
    """Write `state` to `path` atomically: temp file in the same folder, fsync, rename, fsync folder.

    A crash at any point leaves the previous file at `path` intact. `app`: the caller's own
    JSON-able record, stored (and checksummed) with the state under the metadata key "app" (e.g. a
    server's conversation). Returns size and timings.
    """
    t0 = time.perf_counter()
    return _write(*_contents(state, kv_dtype, app), Path(path), t0)


def _contents(state: ActorState, kv_dtype: str | None, app: dict | None) -> tuple[dict, dict]:
    """The file's tensors (copies of the state's KV, guest memory, ...) and metadata."""
    kv_dtype = kv_dtype or state.engine_dtype
    if kv_dtype not in KV_DTYPES:
        raise SnapshotError(f"kv dtype {kv_dtype!r} is not supported; choose one of {', '.join(KV_DTYPES)}")
    tensors, metadata = _tensors(state, kv_dtype), _metadata(state, kv_dtype)
    if app is not None:
        metadata["app"] = json.dumps(app)
    return tensors, metadata


def encode(actor: Actor, kv_dtype: str | None = None, app: dict | None = None) -> bytes:
    """`freeze` into memory: the bytes of the file `freeze` would write (floe.snapshot.store's entries)."""
    with actor.between_messages():
        tensors, metadata = _contents(actor.capture_state(), kv_dtype, app)
    seal(tensors, metadata)
    data = save(tensors, metadata=metadata)
    # Checked now, as a thaw checks it: kept by its bytes (layout.parse_header), so that thawing it back
    # (the store's pinned tier, a page-cached file) checks nothing again (a freeze is off a request's
    # first token; a thaw is on it). A longer header than the cache keeps (a long conversation's) is not.
    if int.from_bytes(data[:8], "little") <= layout.HEADER_KEPT_BYTES:
        read_header_buffer(data, Path("<a snapshot being made>"))
    return data


def _write(tensors: dict[str, torch.Tensor], metadata: dict[str, str], path: Path, t0: float) -> dict:
    seal(tensors, metadata)
    replace_file(path, lambda tmp: save_file(tensors, str(tmp), metadata=metadata))
    return {"path": str(path), "bytes": path.stat().st_size, "seconds": time.perf_counter() - t0}


class Snapshot:
    """A snapshot file, read and checked. `verify` compares it with an engine and guest."""

    def __init__(self, path: str | Path, *, contents: bool = True, buffer=None) -> None:
        """Open and check `path`: its header against the format (layout.read_header), the checksum
        over metadata and digests, and (`contents`) every tensor's bytes against its digest and the
        small tensors' values. Without `contents` (format 2) the bytes are checked later: by
        `check_contents`, the KV cache against `kv_digests()` while a thaw loads it, and the values
        by `state()`. `buffer`: the file's bytes already in memory (bytes, a numpy array, an mmap;
        floe.snapshot.store's RAM tier), read in place; `path` then only names it in errors."""
        self.path = Path(path)
        if buffer is None:
            self.header, self.tensors, self._map = _open(self.path)
        else:
            self.header = read_header_buffer(buffer, self.path)
            self.tensors, self._map = _views(self.header, buffer), buffer
        m = self.metadata = self.header.metadata
        self._expected: dict[str, str] = {}
        if m["format_version"] == "1":  # its checksum covers the tensors' bytes
            compare_checksum(m["checksum"], checksum_v1(self.tensors, m), self.path)
        else:
            self._expected = json.loads(m["checksums"])  # checked by read_header
        if contents:
            self.check_contents()
            check_values(self.tensors, m, self.path)

    def _mismatch(self, name: str, actual: str) -> SnapshotCorrupt:
        return SnapshotCorrupt(f"{self.path}: checksum mismatch in tensor {name} (file says "
                               f"{self._expected[name]}, its bytes hash to {actual}): the file was "
                               "damaged after it was written")

    def check_contents(self, skip: tuple[str, ...] = ()) -> None:
        """Every tensor's bytes but `skip`'s against its digest, hashed by several threads at once."""
        if not self._expected:
            return
        names = [name for name in self.tensors if name not in skip]
        for name, actual in _digests(self.tensors, names).items():
            if actual != self._expected[name]:
                raise self._mismatch(name, actual)

    def kv_names(self) -> list[str]:
        """The KV tensors in the order of `kv()`'s k + v: kv.0.k … kv.{n-1}.k, kv.0.v … kv.{n-1}.v."""
        n = int(self.metadata["n_layers"])
        return [f"kv.{i}.{name}" for name in ("k", "v") for i in range(n)]

    def loads_checked(self, dtype: torch.dtype) -> bool:
        """Whether the KV tensors go into a `dtype` cache as they are, so they can be checked while
        loading (against `kv_digests()`) instead of before."""
        return self.metadata["format_version"] != "1" and self.metadata["kv_dtype"] == _dtype_name(dtype)

    def kv_digests(self) -> list[str]:
        """The digests the KV tensors must hash to, in `kv_names()` order (for KVCache.load)."""
        return [self._expected[name] for name in self.kv_names()]

    @property
    def buffer(self):
        """The file's bytes (the read-only mapping, or the buffer it was opened over)."""
        return self._map

    @property
    def kv_len(self) -> int:
        return int(self.metadata["kv_len"])

    @property
    def app(self) -> dict:
        """The record the writer stored with `app=` ({} if none)."""
        return json.loads(self.metadata.get("app", "{}"))

    def verify(self, **wanted) -> None:
        """Raise the specific SnapshotError for the first thing that does not match (verify_metadata)."""
        verify_metadata(self.metadata, **wanted)

    def kv(self, dtype: torch.dtype) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """K and V per layer in `dtype` (int8 snapshots are dequantized)."""
        n = int(self.metadata["n_layers"])
        out: tuple[list, list] = ([], [])
        for i in range(n):
            for j, name in enumerate(("k", "v")):
                t = self.tensors[f"kv.{i}.{name}"]
                if t.dtype == torch.int8:
                    t = t.float() * self.tensors[f"kv.{i}.{name}.scale"]
                out[j].append(t if t.dtype == dtype else t.to(dtype))  # (60 no-op to()s: ~0.1 ms a thaw)
        return out

    def state(self, dtype: torch.dtype, vocab_size: int | None = None) -> ActorState:
        """The actor state this file holds, KV in `dtype` (int8 files are dequantized). The small
        tensors' values are checked first (token ids against `vocab_size`, if given)."""
        m = self.metadata
        check_values(self.tensors, m, self.path, vocab_size)
        k, v = self.kv(dtype)
        kinds = json.loads(m["globals"])
        bits = self.tensors["guest.globals"].tolist()
        return ActorState(
            k=k, v=v, tokens=self.tensors["tokens"].tolist(), memory_size=int(m["guest_memory_bytes"]),
            memory_pages=self.tensors["guest.memory.pages"].numpy(),
            memory_data=self.tensors["guest.memory"].numpy(),
            globals=[(name, kind, b) for (name, kind), b in zip(kinds, bits, strict=True)],
            rng=self.tensors["sampler.rng"], system_prompt=m.get("system_prompt", ""),
            model_fingerprint=m["model_fingerprint"], model_name=m["model_name"],
            guest_sha256=m["guest_sha256"], guest_name=m["guest_name"], engine_dtype=m["engine_dtype"],
            abi_version=int(m["abi_version"]), engine_weights=m.get("engine_weights", "dense"),
        )

    def summary(self) -> dict:
        """What `floe snapshot inspect` shows."""
        m = self.metadata
        sizes: dict[str, int] = {"kv": 0, "guest_memory": 0, "other": 0}
        for name, t in self.tensors.items():
            key = ("kv" if name.startswith("kv.")
                   else "guest_memory" if name.startswith("guest.memory") else "other")
            sizes[key] += t.numel() * t.element_size()
        return {
            "path": str(self.path),
            "file_bytes": self.header.file_bytes,
            "tensor_bytes": sizes,
            "tokens": self.kv_len,
            "model": {"name": m["model_name"], "fingerprint": m["model_fingerprint"]},
            "guest": {"name": m["guest_name"], "sha256": m["guest_sha256"]},
            "format_version": int(m["format_version"]),
            "abi_version": int(m["abi_version"]),
            "engine_dtype": m["engine_dtype"],
            "engine_weights": m.get("engine_weights", "dense"),
            "kv_dtype": m["kv_dtype"],
            "shape": {"n_layers": int(m["n_layers"]), "n_kv_heads": int(m["n_kv_heads"]),
                      "head_dim": int(m["head_dim"])},
            "guest_memory_bytes": int(m["guest_memory_bytes"]),
            "globals": [name for name, _ in json.loads(m["globals"])],
            "created_at": m["created_at"],
            "checksum": m["checksum"],
        }


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _open(path: Path) -> tuple[Header, dict[str, torch.Tensor], mmap.mmap]:
    """A snapshot file's checked header and its tensors as read-only views of the memory-mapped
    file: no copy on the way in (the checksum, the KV load and the guest-memory restore read the
    page cache directly)."""
    fd = open_regular(path)
    try:
        header = read_header(fd, path)
        try:
            data = mmap.mmap(fd, header.file_bytes, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as e:
            raise SnapshotUnreadable(f"cannot map snapshot {path}: {e}") from None
    finally:
        os.close(fd)
    return header, _views(header, data), data


def _views(header: Header, data) -> dict[str, torch.Tensor]:
    """Each tensor as a read-only view of `data`, the whole file's bytes (checked by read_header)."""
    tensors: dict[str, torch.Tensor] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "buffer is not writable": these views are only read
        for name, info in header.tensors.items():
            count = math.prod(info.shape)  # read_header checked that it lies inside the file
            t = (torch.frombuffer(data, dtype=info.dtype, count=count, offset=header.data_offset + info.start)
                 if count else torch.empty(0, dtype=info.dtype))
            tensors[name] = t.view(info.shape)
    return tensors


def _map_safetensors(path: Path) -> tuple[dict[str, str], dict[str, torch.Tensor], mmap.mmap]:
    """(metadata, tensor views, mapping) of a checked snapshot: the stage bench/thaw_stages.py times."""
    header, tensors, data = _open(Path(path))
    return header.metadata, tensors, data


def freeze(actor: Actor, path: str | Path, kv_dtype: str | None = None, app: dict | None = None) -> dict:
    """Write `actor` (between messages) to one safetensors file, atomically; it keeps running. It is
    held between messages while its state is copied out (KV cache, guest memory), so the copy is of
    one moment; it may run on while the copy is hashed and written."""
    t0 = time.perf_counter()
    with actor.between_messages():
        contents = _contents(actor.capture_state(), kv_dtype, app)
    return _write(*contents, Path(path), t0)


def header(path: str | Path) -> dict[str, str]:
    """A snapshot's metadata from its header only (no tensors read): for listing many files quickly.
    The header is checked as a thaw checks it (structure, format, version, the checksum over the
    metadata, the schema); the tensors' bytes when it is thawed. Only a regular file is opened (a
    FIFO or a device is refused at once, never waited on)."""
    path = Path(path)
    fd = open_regular(path)
    try:
        return dict(read_header(fd, path).metadata)
    finally:
        os.close(fd)


def verify_metadata(m: dict[str, str], *, fingerprint: str | None = None, guest_sha256: str | None = None,
                    abi_version: int | tuple[int, ...] | None = None, n_layers: int | None = None,
                    n_kv_heads: int | None = None, head_dim: int | None = None,
                    max_seq_len: int | None = None) -> None:
    """Raise the specific SnapshotError for the first thing in a snapshot's metadata `m` that does not
    match what is given (None: not checked)."""
    speaks = (abi_version,) if isinstance(abi_version, int) else abi_version
    if speaks is not None and m["abi_version"] not in {str(v) for v in speaks}:
        raise SnapshotVersionMismatch(
            f"snapshot was made by a guest speaking ABI {m['abi_version'][:20]}; "
            f"this host speaks {' and '.join(str(v) for v in speaks)}")
    if fingerprint is not None and m["model_fingerprint"] != fingerprint:
        raise SnapshotModelMismatch(
            f"snapshot was made with model {m['model_name'][:80]!r} ({m['model_fingerprint'][:12]}…) but "
            f"this engine runs {fingerprint[:12]}…; load the same model file to thaw it")
    if guest_sha256 is not None and m["guest_sha256"] != guest_sha256:
        raise SnapshotGuestMismatch(
            f"snapshot was made with guest {m['guest_name'][:80]} ({m['guest_sha256'][:12]}…), not "
            f"{guest_sha256[:12]}…; thaw it with the same guest module")
    wanted = {"n_layers": n_layers, "n_kv_heads": n_kv_heads, "head_dim": head_dim}
    for key, value in wanted.items():
        if value is not None and int(m[key]) != value:
            raise SnapshotShapeMismatch(f"snapshot has {key}={m[key]}, the engine's cache has {value}")
    if max_seq_len is not None and int(m["kv_len"]) > max_seq_len:
        raise SnapshotShapeMismatch(
            f"snapshot holds {m['kv_len']} tokens; the engine's context holds {max_seq_len}")


def model_fingerprint(checkpoint, snap: Snapshot | Header) -> str:
    """The checkpoint's model fingerprint as the snapshot would name it: a snapshot of a model of the
    same name written before floe's model fingerprint scheme v2 names it by scheme v1, checked then (a
    SHA-256 pass over the weights, once per checkpoint). Thaw and `floe snapshot verify` both check this."""
    theirs = snap.metadata["model_fingerprint"]
    if theirs != checkpoint.fingerprint and snap.metadata["model_name"] == checkpoint.name:
        if checkpoint.legacy_fingerprint() == theirs:
            return theirs
    return checkpoint.fingerprint


def thaw(engine: Engine, path: str | Path | Snapshot, guest: str | Path | bytes | GuestModule | None = None,
         *, into: Actor | None = None, **actor_options) -> Actor:
    """A new actor continuing exactly where the frozen one stopped.

    The file is verified first (integrity, format and ABI version, model, guest module, cache shape);
    on any mismatch a specific SnapshotError is raised and nothing is created. `guest` defaults to
    the built-in guest the snapshot names. A state the guest or engine refuses while it is restored
    (e.g. guest memory over the actor's cap) raises SnapshotRestoreFailed; the actor is closed.
    `path` may be a Snapshot opened without `contents` (e.g. over a buffer).
    into: a fresh actor of the snapshot's guest on `engine` with its KV slot (made ahead and never sent
    anything: a server's spare), restored instead of a new one made here (its making, a third of a
    small thaw's time, off the thaw's path; actor_options then unused). A snapshot refused before its
    state is restored leaves it as it was; one refused while it is restored closes it.
    """
    # The bytes are checked below, nothing is used before.
    snap = path if isinstance(path, Snapshot) else Snapshot(path, contents=False)
    module = thawable(engine, snap, guest)
    if into is not None and (into.engine is not engine or into.module.sha256 != module.sha256
                             or into.slot is None or into.closed):
        raise ValueError("thaw(into=...) restores a fresh, open actor of the snapshot's guest on this "
                         "engine, with its KV slot")
    c = engine.config
    # KV tensors stored in the engine's dtype are checked as they are loaded (each read once, by
    # several threads); the rest (small), and KV that must be converted, before anything is used.
    # Onto a GPU the KV bytes start on their way (copy threads) while the actor is created.
    checked = snap.loads_checked(engine.dtype)
    snap.check_contents(skip=tuple(snap.kv_names()) if checked else ())
    state = snap.state(engine.dtype, c.vocab_size)
    kv = engine.cache.start_load(state.k, state.v, snap.kv_digests() if checked else None)
    try:
        actor = into if into is not None else Actor(engine, module, **actor_options)
    except BaseException:
        kv.close()
        raise
    if str(actor.abi_version) != snap.metadata["abi_version"]:
        kv.close()
        actor.close()
        said = snap.metadata["abi_version"][:20]
        raise SnapshotVersionMismatch(f"snapshot says its guest speaks ABI {said}, but the module speaks "
                                      f"ABI {actor.abi_version}")
    _restore(snap, actor, state, kv)
    return actor


def thawable(engine: Engine, snap: Snapshot | Header,
             guest: str | Path | bytes | GuestModule | None = None) -> GuestModule:
    """Raise the SnapshotError a thaw of `snap` (a Snapshot, or a checked Header: its metadata alone) on
    `engine` with `guest` would raise before it restores anything (ABI version, model, guest module,
    cache shape, context); else the guest module, compiled. A server checks an upload with it before the
    upload replaces a session."""
    module = _guest_module(snap, guest)
    c = engine.config
    verify_metadata(snap.metadata, fingerprint=model_fingerprint(engine.checkpoint, snap),
                    guest_sha256=module.sha256, abi_version=SUPPORTED_ABI_VERSIONS, n_layers=c.n_layers,
                    n_kv_heads=c.n_kv_heads, head_dim=c.head_dim, max_seq_len=engine.max_seq_len)
    return module


def _guest_module(snap: Snapshot | Header, guest: str | Path | bytes | GuestModule | None) -> GuestModule:
    """`guest` compiled, or (None) the built-in guest the snapshot names."""
    if guest is None:
        name = snap.metadata["guest_name"]
        try:
            guest = builtin_guest(Path(name).stem)
        except (FloeError, ValueError, OSError) as e:
            raise SnapshotGuestMismatch(f"snapshot was made with guest {name[:80]!r}, which is not built "
                                        "into floe; thaw it with the module it was made with") from e
    return guest if isinstance(guest, GuestModule) else default_runtime().compile(guest)


def _restore(snap: Snapshot, actor: Actor, state: ActorState, kv) -> None:
    """`actor.restore`; on any failure the actor is closed, and what the guest or engine refused is
    raised as a SnapshotError (the cause chained)."""
    try:
        actor.restore(state, kv)
    except KVDigestMismatch as e:
        actor.close()
        raise snap._mismatch(snap.kv_names()[e.index], e.actual) from None
    except (FloeError, wasmtime.WasmtimeError) as e:  # Wasmtime's own: e.g. memory past the module's max
        actor.close()
        if isinstance(e, SnapshotError):
            raise
        raise SnapshotRestoreFailed(f"{snap.path}: the snapshot's state was refused while it was "
                                    f"restored: {str(e).strip()[:300]}") from e
    except BaseException:
        actor.close()
        raise
