"""What a module declares, read from its section headers before Wasmtime compiles it, and the bounds
floe holds it to.

Compiling and instantiating take time and memory that grow with what a module declares, not with its
size in bytes, and some of it faster than linearly (measured on Wasmtime 50: 100,000 data segments
compile in ~45 s and ~2 GB; an instance with 100,000 exports takes ~5 minutes to list them, since each
export is found by walking the ones before it; 300,000 functions compile in ~30 s and ~2 GB). None of
that is under a guest's deadline or memory cap, so a module over these bounds is refused at once.
"""

from __future__ import annotations

MAX_MODULE_BYTES = 16 << 20
# Per section, what its items are called in an error; the most a module may declare.
LIMITS = {
    2: ("imports", 1024),
    3: ("functions", 65_536),
    6: ("globals", 65_536),
    7: ("exports", 1024),
    11: ("data segments", 8192),
}
_MAGIC = b"\0asm\x01\0\0\0"  # a core module, version 1 (anything else Wasmtime refuses itself)


def _uleb(data: bytes, at: int) -> tuple[int, int]:
    """An unsigned LEB128 at `at`: (value, offset after it); ValueError past the end or over 5 bytes."""
    value = shift = 0
    for i in range(at, min(at + 5, len(data))):
        value |= (data[i] & 0x7F) << shift
        shift += 7
        if not data[i] & 0x80:
            return value, i + 1
    raise ValueError("truncated LEB128")


def declared(data: bytes) -> dict[int, int]:
    """Item counts of the sections in LIMITS that `data` has (empty for what is not a core module;
    a malformed one is read as far as it goes: Wasmtime refuses it with its own message)."""
    counts: dict[int, int] = {}
    if not data.startswith(_MAGIC):
        return counts
    at = len(_MAGIC)
    try:
        while at < len(data):
            section, size_at = data[at], at + 1
            size, body = _uleb(data, size_at)
            if section in LIMITS:
                counts[section] = counts.get(section, 0) + _uleb(data, body)[0]
            at = body + size
    except (ValueError, IndexError):
        pass
    return counts


def refusal(data: bytes) -> str | None:
    """Why a module is too big for floe to load, or None."""
    if len(data) > MAX_MODULE_BYTES:
        return f"is {len(data) / 2**20:.1f} MiB; floe loads modules of at most {MAX_MODULE_BYTES >> 20} MiB"
    for section, count in declared(data).items():
        what, most = LIMITS[section]
        if count > most:
            return (f"declares {count} {what}; floe loads at most {most} (compiling and instantiating take "
                    f"time and memory that grow with them)")
    return None
