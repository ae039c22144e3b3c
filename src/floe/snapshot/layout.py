"""Reading a snapshot's header and checking it against the format before anything in it is used.

`read_header` is the one validation that `Snapshot` (verify, inspect, thaw) and `header` (listing)
share. It accepts only files the `safetensors` library accepts too (8-byte little-endian header
length of at most 100,000,000 bytes, a JSON object of tensor entries and string metadata, tensors
that tile the data section from its start to the end of the file: contiguous, in order, no overlap,
no gap, nothing after the last), and is stricter where floe reads tensors in place or trusts values:
no duplicate JSON keys or non-JSON constants, every tensor aligned to its element size, exactly the
tensors, dtypes and shapes the metadata describes, and every metadata entry of its type and range.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
import struct
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash

from floe.snapshot.errors import SnapshotCorrupt, SnapshotUnreadable, SnapshotVersionMismatch

FORMAT = "floe-snapshot"
FORMAT_VERSION = 2
READABLE_VERSIONS = ("1", "2")
KV_DTYPES = ("float32", "bfloat16", "int8")  # "int4" fits the same layout later (packed + scales)
PAGE = 4096
WASM_PAGE = 65536
MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own cap (MAX_HEADER_SIZE)
GLOBAL_KINDS = ("i32", "i64", "f32", "f64")

# The dtypes floe writes; any other (the library knows more) is not a floe snapshot's.
ST_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "I64": torch.int64,
             "I32": torch.int32, "I8": torch.int8, "U8": torch.uint8}
_U64 = 2**64
_DECIMAL = re.compile(r"0|[1-9][0-9]{0,18}")
_HEX128 = re.compile(r"[0-9a-f]{32}")
# Whole-number metadata: inclusive ranges.
_NUMBERS = {"abi_version": (0, 2**31 - 1), "kv_len": (0, 2**31 - 1), "n_layers": (1, 2**16),
            "n_kv_heads": (1, 2**16), "head_dim": (1, 2**16), "guest_memory_bytes": (0, 2**32)}
_REQUIRED = ("model_fingerprint", "model_name", "guest_sha256", "guest_name", "engine_dtype", "created_at",
             "checksum", "kv_dtype", "guest_page_size", "globals")


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's entry: dtype, shape, and its bytes' offsets in the data section (end exclusive)."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int


@dataclass(frozen=True)
class Header:
    """A snapshot's checked header: its metadata, its tensors' entries, where the data starts."""

    metadata: dict[str, str]
    tensors: dict[str, TensorInfo]
    data_offset: int  # bytes from the start of the file
    file_bytes: int


def corrupt(path: Path, detail: str) -> SnapshotCorrupt:
    return SnapshotCorrupt(f"{path} is not a readable snapshot (truncated or corrupt: {detail})")


def open_regular(path: Path) -> int:
    """A read-only descriptor of `path` if it is a regular file: never blocks (a FIFO is refused,
    not waited on), never follows into a device or folder."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise SnapshotUnreadable(f"no snapshot at {path}") from None
    except OSError as e:
        raise SnapshotUnreadable(f"cannot open snapshot {path}: {e.strerror}") from None
    except ValueError as e:  # a NUL byte in the path
        raise SnapshotUnreadable(f"cannot open snapshot {str(path)[:200]!r}: {e}") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = "a folder" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "not a file"
        raise SnapshotUnreadable(f"{path} is {kind}, not a regular file: a snapshot is a .safetensors file")
    return fd


def read_header(fd: int, path: Path) -> Header:
    """The header of the open file `fd`, checked: safetensors' structure, then floe's format,
    version, header checksum (format 2) and schema. Reads the header only, never the tensors."""
    try:
        size = os.fstat(fd).st_size
        if size < 8:
            raise corrupt(path, f"{size} bytes, shorter than a safetensors header length")
        n = header_length(os.pread(fd, 8, 0), size, path)
        raw = _read_exactly(fd, 8, n, path)
    except OSError as e:
        raise SnapshotUnreadable(f"cannot read snapshot {path}: {e.strerror}") from None
    return parse_header(raw, size, path)


def read_header_buffer(data, path: Path) -> Header:
    """`read_header` over a snapshot's bytes held in memory (bytes, an mmap, a numpy array)."""
    view = memoryview(data).cast("B")
    if len(view) < 8:
        raise corrupt(path, f"{len(view)} bytes, shorter than a safetensors header length")
    n = header_length(bytes(view[:8]), len(view), path)
    return parse_header(bytes(view[8:8 + n]), len(view), path)


def header_length(prefix: bytes, size: int | None, path: Path) -> int:
    """The header length in a file's first 8 bytes, checked against the cap and (if known) the size."""
    (n,) = struct.unpack("<Q", prefix)
    if n > MAX_HEADER_BYTES:
        raise corrupt(path, f"header length {n} is over the limit of {MAX_HEADER_BYTES} bytes")
    if size is not None and 8 + n > size:
        raise corrupt(path, f"header length {n} does not fit a file of {size} bytes")
    if (8 + n) % 8:
        raise corrupt(path, f"header length {n} leaves the data section unaligned (safetensors pads it)")
    return n


# Headers checked before, by their exact bytes: a session's snapshot thawed again (from the pinned tier,
# a page-cached file) or thawed after this process wrote it (file.encode checks what it wrote) is not
# parsed and checked again (~0.65 ms of a 118-token thaw's ~4 on a 2-core Zen 3, 65 tensors: JSON with
# its duplicate-key hook, each entry, the tiling, the format's checks). The same bytes check the same for
# a file of the size they were checked for (the tiling ends the data there; a stream's, size None, ends
# where its last tensor does, which is that size). A header that failed is never kept, and each caller
# gets its own Header (its dicts copied: one caller's change is no other's). Bounded: the most recently
# used HEADERS_KEPT, each at most HEADER_KEPT_BYTES (a longer one is checked every time).
HEADERS_KEPT, HEADER_KEPT_BYTES = 64, 32 << 10
_checked: OrderedDict[bytes, Header] = OrderedDict()
_checked_lock = threading.Lock()


def parse_header(raw: bytes, size: int | None, path: Path) -> Header:
    """The header's bytes checked, for a file of `size` bytes (None: a stream, whose length the
    header decides: the end of its last tensor)."""
    raw, header = bytes(raw), None
    kept = len(raw) <= HEADER_KEPT_BYTES
    if kept:
        with _checked_lock:
            header = _checked.get(raw)
            if header is not None and (size is None or size == header.file_bytes):
                _checked.move_to_end(raw)
            else:
                header = None
    if header is None:
        header = _parse_header(raw, size, path)
        if kept:
            with _checked_lock:
                _checked[raw] = header
                while len(_checked) > HEADERS_KEPT:
                    _checked.popitem(last=False)
    return Header(dict(header.metadata), dict(header.tensors), header.data_offset, header.file_bytes)


def _parse_header(raw: bytes, size: int | None, path: Path) -> Header:
    n = len(raw)
    document = parse_json(raw, path, "the header")
    if not isinstance(document, dict):
        raise corrupt(path, "the header is not a JSON object")
    metadata = _string_metadata(document.pop("__metadata__", None), path)
    tensors = {name: _tensor_info(name, entry, path) for name, entry in document.items()}
    data_bytes = max((t.end for t in tensors.values()), default=0) if size is None else size - 8 - n
    _check_tiling(tensors, data_bytes, path)
    header = Header(metadata, tensors, 8 + n, 8 + n + data_bytes)
    check_format(header, path)
    return header


def _read_exactly(fd: int, offset: int, n: int, path: Path) -> bytes:
    parts, done = [], 0
    while done < n:
        part = os.pread(fd, min(n - done, 1 << 24), offset + done)
        if not part:
            raise corrupt(path, "the file shrank while it was read")
        parts.append(part)
        done += len(part)
    return b"".join(parts)


def parse_json(raw: bytes | str, path: Path, what: str):
    """Strict JSON: UTF-8, no duplicate keys, no NaN/Infinity, no unpaired surrogates, bounded depth."""
    try:
        # Decoded here: json.loads would guess UTF-16/32, drop a BOM and let encoded surrogates pass.
        text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
        return json.loads(text, object_pairs_hook=_unique_keys, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeError are ValueErrors
        raise corrupt(path, f"{what} is not valid JSON: {str(e)[:200]}") from None


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key[:80]!r}")
        key.encode()  # an unpaired surrogate ("\ud800") is not UTF-8: UnicodeEncodeError
        if isinstance(value, str):
            value.encode()
        out[key] = value
    return out


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON value")


def _string_metadata(value: object, path: Path) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise corrupt(path, "__metadata__ is not a JSON object of strings")
    return value


def _u64(value: object) -> bool:
    return type(value) is int and 0 <= value < _U64


def _tensor_info(name: str, entry: object, path: Path) -> TensorInfo:
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        raise corrupt(path, f"tensor {name[:80]!r} is not an entry of dtype, shape and data_offsets")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in ST_DTYPES:
        raise corrupt(path, f"tensor {name[:80]!r} has dtype {str(dtype)[:20]!r}, which no snapshot uses")
    if not isinstance(shape, list) or not all(_u64(d) for d in shape):
        raise corrupt(path, f"tensor {name[:80]!r} has shape {str(shape)[:80]}, not a list of sizes")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_u64(o) for o in offsets):
        raise corrupt(path, f"tensor {name[:80]!r} has data_offsets {str(offsets)[:80]}, not [start, end]")
    info = TensorInfo(ST_DTYPES[dtype], tuple(shape), offsets[0], offsets[1])
    nbytes = math.prod(info.shape) * info.dtype.itemsize
    if info.end < info.start or info.end - info.start != nbytes:
        raise corrupt(path, f"tensor {name[:80]!r} ({dtype} {list(info.shape)}, {nbytes} bytes) has offsets "
                            f"{info.start}..{info.end}")
    if info.start % info.dtype.itemsize:
        raise corrupt(path, f"tensor {name[:80]!r} starts at {info.start}, not aligned to its {dtype} "
                            "elements")
    return info


def _check_tiling(tensors: dict[str, TensorInfo], data_bytes: int, path: Path) -> None:
    """safetensors' rule: in offset order the tensors cover the data section exactly."""
    at = 0
    for name, info in sorted(tensors.items(), key=lambda item: (item[1].start, item[1].end)):
        if info.start != at:
            what = "overlaps the one before" if info.start < at else "leaves a gap after the one before"
            raise corrupt(path, f"tensor {name[:80]!r} at offset {info.start} {what} (which ends at {at})")
        at = info.end
    if at != data_bytes:
        raise corrupt(path, f"the tensors end at byte {at} of a data section of {data_bytes} bytes: the "
                            "file is cut short or has bytes after its last tensor")


def check_format(header: Header, path: Path) -> None:
    """floe's rules over a structurally valid header: format, version, checksum (format 2), schema."""
    m = header.metadata
    if m.get("format") != FORMAT:
        raise SnapshotCorrupt(f"{path} is a safetensors file but not a floe snapshot")
    if m.get("format_version") not in READABLE_VERSIONS:
        raise SnapshotVersionMismatch(f"snapshot format version {str(m.get('format_version'))[:20]}; this "
                                      f"floe reads versions {', '.join(READABLE_VERSIONS)}")
    if m["format_version"] != "1":  # format 1's checksum covers the bytes: checked once they are mapped
        entries = ((name, t.dtype, t.shape) for name, t in header.tensors.items())
        compare_checksum(m.get("checksum"), header_checksum(entries, m), path)
    _check_metadata(m, set(header.tensors), path)
    _check_tensors(header.tensors, m, path)


def compare_checksum(expected: str | None, actual: str, path: Path) -> None:
    if expected != actual:
        raise SnapshotCorrupt(f"{path}: checksum mismatch (file says {str(expected)[:40]}, contents hash "
                              f"to {actual}): the file was damaged after it was written")


def header_checksum(entries: Iterable[tuple[str, torch.dtype, tuple[int, ...]]],
                    metadata: dict[str, str]) -> str:
    """Format 2's `checksum`: xxh3-128 over every tensor's name, dtype and shape and every metadata
    entry but itself (the tensors' bytes enter through the `checksums` entry)."""
    h = xxhash.xxh3_128()
    for name, dtype, shape in sorted(entries, key=lambda e: e[0]):
        h.update(f"{name}\0{dtype}\0{tuple(shape)}\0".encode())
    for key in sorted(metadata):
        if key != "checksum":
            h.update(f"{key}\0{metadata[key]}\0".encode())
    return h.hexdigest()


def number(m: dict[str, str], key: str, path: Path) -> int:
    """Metadata `key` as a whole number in its range (canonical decimal only: no sign, spaces, exponent)."""
    value = m.get(key)
    if value is None:
        raise corrupt(path, f"metadata lacks {key!r}")
    low, high = _NUMBERS[key]
    if not _DECIMAL.fullmatch(value) or not low <= int(value) <= high:
        raise corrupt(path, f"metadata {key}={value[:40]!r} is not a whole number in {low}..{high}")
    return int(value)


def _check_metadata(m: dict[str, str], names: set[str], path: Path) -> None:
    for key in (*_REQUIRED, *(("checksums",) if m["format_version"] != "1" else ())):
        if key not in m:
            raise corrupt(path, f"metadata lacks {key!r}")
    for key in _NUMBERS:
        number(m, key, path)
    if int(m["guest_memory_bytes"]) % WASM_PAGE:
        raise corrupt(path, f"guest_memory_bytes={m['guest_memory_bytes']} is not a whole number of "
                            "64 KiB WebAssembly pages")
    if m.get("guest_page_size") != str(PAGE):
        raise corrupt(path, f"guest_page_size is {str(m.get('guest_page_size'))[:20]!r}, not {PAGE}")
    if m.get("kv_dtype") not in KV_DTYPES:
        raise corrupt(path, f"kv_dtype {str(m.get('kv_dtype'))[:20]!r} is not one of {', '.join(KV_DTYPES)}")
    globals_kinds(m, path)
    if "app" in m and not isinstance(parse_json(m["app"], path, "metadata 'app'"), dict):
        raise corrupt(path, "metadata 'app' is not a JSON object")
    if m["format_version"] != "1":
        digests = parse_json(m["checksums"], path, "metadata 'checksums'")
        if not isinstance(digests, dict) or set(digests) != names:
            raise corrupt(path, "the per-tensor checksums do not name its tensors")
        if not all(isinstance(d, str) and _HEX128.fullmatch(d) for d in digests.values()):
            raise corrupt(path, "a per-tensor checksum is not 32 hex digits")


def globals_kinds(m: dict[str, str], path: Path) -> list[tuple[str, str]]:
    """Metadata 'globals': [[name, wasm type], ...], names distinct."""
    kinds = parse_json(m["globals"], path, "metadata 'globals'")
    if not isinstance(kinds, list) or not all(
            isinstance(g, list) and len(g) == 2 and isinstance(g[0], str) and g[1] in GLOBAL_KINDS
            for g in kinds):
        raise corrupt(path, f"metadata 'globals' is not a list of [name, {'|'.join(GLOBAL_KINDS)}]")
    names = [name for name, _ in kinds]
    if len(set(names)) != len(names):
        raise corrupt(path, "metadata 'globals' names a global twice")
    for name in names:
        name.encode()  # strings inside lists were not checked by the parser
    return [(name, kind) for name, kind in kinds]


def _check_tensors(tensors: dict[str, TensorInfo], m: dict[str, str], path: Path) -> None:
    """Exactly the tensors the metadata describes, each of its dtype and shape."""
    n_layers, kv_len = int(m["n_layers"]), int(m["kv_len"])
    kv_shape = (int(m["n_kv_heads"]), kv_len, int(m["head_dim"]))
    int8 = m["kv_dtype"] == "int8"
    if len(tensors) != 5 + 2 * n_layers * (2 if int8 else 1):  # before building n_layers' names
        raise corrupt(path, f"{len(tensors)} tensors, not the number {n_layers} layers of {m['kv_dtype']} "
                            "KV and the guest's state make")
    expected: dict[str, tuple[torch.dtype, tuple[int, ...] | None]] = {
        "tokens": (torch.int32, (kv_len,)), "sampler.rng": (torch.uint8, None),
        "guest.globals": (torch.int64, (len(globals_kinds(m, path)),)),
        "guest.memory": (torch.uint8, None), "guest.memory.pages": (torch.int32, None)}
    kv_dtype = torch.int8 if int8 else getattr(torch, m["kv_dtype"])
    for i in range(n_layers):
        for name in (f"kv.{i}.k", f"kv.{i}.v"):
            expected[name] = (kv_dtype, kv_shape)
            if int8:
                expected[f"{name}.scale"] = (torch.float32, kv_shape[:2] + (1,))
    if set(expected) != set(tensors):
        odd = sorted(set(expected) ^ set(tensors))[:3]
        raise corrupt(path, f"its tensors are not a snapshot's ({', '.join(n[:40] for n in odd)} …)")
    memory = tensors["guest.memory"].shape
    if len(memory) != 1 or memory[0] % PAGE:
        raise corrupt(path, f"guest.memory has shape {memory}, not a whole number of {PAGE}-byte pages")
    expected["guest.memory.pages"] = (torch.int32, (memory[0] // PAGE,))
    for name, (dtype, shape) in expected.items():
        info = tensors[name]
        if info.dtype != dtype:
            raise corrupt(path, f"{name} has dtype {info.dtype}, not {dtype}")
        if info.shape != shape and (shape is not None or len(info.shape) != 1):
            raise SnapshotCorrupt(f"{path}: {name} has shape {info.shape}, not {shape or '(n,)'}")


# A 32-bit kind's bit pattern, as a signed or an unsigned number (64-bit ones fill the int64: any value).
_BITS_RANGE = {"i32": (-(2**31), 2**32), "f32": (-(2**31), 2**32)}


def check_values(tensors: dict[str, torch.Tensor], m: dict[str, str], path: Path,
                 vocab_size: int | None = None) -> None:
    """The small tensors' values that the format constrains: guest page numbers in range and strictly
    increasing, globals' bits within their type, token ids in the vocabulary, a valid RNG state."""
    pages = tensors["guest.memory.pages"].numpy().astype("int64")
    n_pages = int(m["guest_memory_bytes"]) // PAGE
    if len(pages) and (pages[0] < 0 or pages[-1] >= n_pages or (pages[1:] <= pages[:-1]).any()):
        raise corrupt(path, "guest.memory.pages are not strictly increasing page numbers in "
                            f"0..{n_pages - 1}")
    for (name, kind), bits in zip(globals_kinds(m, path), tensors["guest.globals"].tolist(), strict=True):
        low, high = _BITS_RANGE.get(kind, (bits, bits + 1))
        if not low <= bits < high:
            raise corrupt(path, f"global {name[:40]!r} holds {bits}, not the bits of an {kind}")
    tokens = tensors["tokens"]
    if tokens.numel() and (int(tokens.min()) < 0 or (vocab_size and int(tokens.max()) >= vocab_size)):
        raise corrupt(path, f"a token id is outside the vocabulary (0..{(vocab_size or 2**31) - 1})")
    try:
        torch.Generator().set_state(tensors["sampler.rng"].clone())
    except RuntimeError as e:
        raise corrupt(path, f"sampler.rng is not a random generator's state ({e})") from None
