"""What a module declares, read from its section headers before Wasmtime compiles it, and the bounds
floe holds it to.

Compiling and instantiating take time and memory that grow with what a module declares, not with its
size in bytes, and some of it faster than linearly (measured on Wasmtime 50: 100,000 data segments
compile in ~45 s and ~2 GB; an instance with 100,000 exports takes ~5 minutes to list them, since each
export is found by walking the ones before it; 300,000 functions compile in ~30 s and ~2 GB; one
element segment of 1,000,000 entries, a 1 MB module, 13-18 s and 2.6 GB; five 3 MB function bodies
38 s). None of that is under a guest's deadline or memory cap, so a module over these bounds, or one
whose sections cannot be read, is refused at once, with what it declared and the bound.
"""

from __future__ import annotations

from collections.abc import Iterator

MAX_MODULE_BYTES = 16 << 20

# The most a module may declare. Floe's own guests (src/floe/guests/*.wasm, clang -O2, 2026-12) declare
# at most: 9 sections, 13 types, 14 imports, 38 functions, 1 table of 1 element, 1 global, 8 exports,
# no element segment, 2 data segments; the grammar guest, the largest since issue 43's keywords, 92 kB
# of code with the largest body 17 kB and 44 locals in one function; each bound is at least 15 times
# that (a guest in another language, with its runtime, is bigger). At a bound Wasmtime compiles a module
# in seconds, not minutes (docs/GUESTS.md, "Module limits").
LIMITS = {
    "sections": 1024,  # also bounds this reader's own work: custom sections are free to repeat
    "types": 65_536,
    "imports": 1024,
    "functions": 65_536,
    "tables": 16,
    "table elements": 1 << 20,  # a table's initial or maximum size (8 bytes an element when instantiated)
    "globals": 65_536,
    "exports": 1024,
    "element segments": 8192,
    "element entries": 16_384,  # in all segments together (~7 kB each to compile, measured)
    "code bytes": 2 << 20,  # in all function bodies together
    "bytes in one function body": 256 << 10,  # compile time grows faster than linearly with it
    "locals in one function": 8192,
    "locals": 262_144,  # in all functions together
    "data segments": 8192,
}
_SECTIONS = {0: "custom", 1: "type", 2: "import", 3: "function", 4: "table", 5: "memory", 6: "global",
             7: "export", 8: "start", 9: "element", 10: "code", 11: "data", 12: "data count", 13: "tag"}
_COUNTED = {1: "types", 2: "imports", 3: "functions", 6: "globals", 7: "exports", 11: "data segments"}
_MAGIC = b"\0asm\x01\0\0\0"  # a core module, version 1 (anything else Wasmtime refuses itself)
# Opcodes of a constant expression with no immediate: extended-const's add, sub and mul.
_ARITHMETIC = {0x6A, 0x6B, 0x6C, 0x7C, 0x7D, 0x7E}


class _Refused(Exception):
    """Why a module is not loaded: over a bound, or not readable as far as the bounds need."""


class _Reader:
    """One section's bytes, read forward; anything past its end is a refusal naming the section."""

    def __init__(self, data: bytes, at: int, end: int, section: str, where: str = "") -> None:
        self.data, self.at, self.end, self.section = data, at, end, section
        self.where = where or f"its {section} section"

    def malformed(self, what: str) -> _Refused:
        return _Refused(f"is malformed: {what} in {self.where} (at byte {self.at})")

    def byte(self) -> int:
        if self.at >= self.end:
            raise self.malformed("a read past the end")
        self.at += 1
        return self.data[self.at - 1]

    def uleb(self) -> int:
        """An unsigned LEB128 of at most 10 bytes (u32 or u64); a signed one is skipped alike."""
        value = shift = 0
        start = self.at
        while self.at - start < 10:
            b = self.byte()
            value |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                return value
        raise self.malformed("a LEB128 number longer than 10 bytes")

    def skip(self, n: int) -> None:
        if n > self.end - self.at:
            raise self.malformed(f"{n} bytes declared where {self.end - self.at} are left")
        self.at += n

    def valtype(self) -> None:
        """Skips a value, reference or element kind type: one byte, or (ref null? ht) and its heap type."""
        if self.byte() in (0x63, 0x64):
            self.uleb()

    def limits(self) -> tuple[int, int | None]:
        """A table's or memory's limits: (initial, maximum or None)."""
        flags = self.byte()
        initial = self.uleb()
        return initial, self.uleb() if flags & 1 else None

    def expr(self) -> None:
        """Skips a constant expression, through its `end`."""
        while (op := self.byte()) != 0x0B:
            if op in (0x41, 0x42, 0x23, 0xD0, 0xD2):  # i32/i64.const, global.get, ref.null, ref.func
                self.uleb()
            elif op in (0x43, 0x44):  # f32.const, f64.const
                self.skip(4 if op == 0x43 else 8)
            elif op == 0xFD and self.uleb() == 12:  # v128.const
                self.skip(16)
            elif op not in _ARITHMETIC:
                raise self.malformed(f"opcode 0x{op:02x} in a constant expression (not one floe reads)")


def _over(count: int, what: str, limit: str, section: str = "") -> None:
    if count > LIMITS[limit]:
        where = f" in its {section} section" if section else ""
        raise _Refused(f"declares {count} {what}; floe loads at most {LIMITS[limit]}{where} (compiling and "
                       f"instantiating take time and memory that grow with them)")


def _sections(data: bytes) -> Iterator[tuple[int, _Reader]]:
    """(id, reader of its body) for each section of a core module, after checking its header."""
    at, n = len(_MAGIC), 0
    while at < len(data):
        n += 1
        _over(n, "sections", "sections")
        header = _Reader(data, at, len(data), "", f"the header of its section {n}")
        section = header.byte()
        size = header.uleb()
        name = _SECTIONS.get(section, f"unknown ({section})")
        if size > len(data) - header.at:
            raise _Refused(f"is malformed: its {name} section at byte {at} declares {size} bytes, "
                           f"{len(data) - header.at} are left")
        yield section, _Reader(data, header.at, header.at + size, name)
        at = header.at + size


def _check_tables(r: _Reader) -> None:
    count = r.uleb()
    _over(count, "tables", "tables", "table")
    for i in range(count):
        initialized = r.data[r.at:r.at + 1] == b"\x40"  # 0x40 0x00 reftype limits expr
        if initialized:
            r.skip(2)
        r.valtype()
        initial, maximum = r.limits()
        if initialized:
            r.expr()
        _over(initial, f"elements initially in table {i}", "table elements", "table")
        _over(maximum or 0, f"elements at most in table {i}", "table elements", "table")


def _check_elements(r: _Reader) -> None:
    segments = r.uleb()
    _over(segments, "element segments", "element segments", "element")
    entries = 0
    for i in range(segments):
        kind = r.uleb()
        if kind > 7:
            raise r.malformed(f"element segment {i} of kind {kind} (the Wasm spec has 0 to 7)")
        if kind & 3 == 2:  # an explicit table index
            r.uleb()
        if not kind & 1:  # active: an offset
            r.expr()
        if kind & 3:  # elemkind (kinds 1-3) or reftype (5-7); kinds 0 and 4 have neither
            r.valtype()
        count = r.uleb()
        entries += count
        _over(entries, "element entries", "element entries", "element")
        for _ in range(count):
            r.expr() if kind & 4 else r.uleb()


def _check_code(r: _Reader) -> None:
    count = r.uleb()
    _over(count, "function bodies", "functions", "code")
    code = locals_ = 0
    for i in range(count):
        size = r.uleb()
        code += size
        _over(size, f"bytes in function {i}'s body", "bytes in one function body", "code")
        _over(code, "bytes of function bodies", "code bytes", "code")
        start = r.at
        r.skip(size)
        body = _Reader(r.data, start, r.at, "code", f"function {i}'s body")
        declared = 0
        for _ in range(body.uleb()):
            declared += max(body.uleb(), 1)  # a declaration of none still counts one: each is read here
            _over(declared, f"locals in function {i}", "locals in one function", "code")
            body.valtype()
        locals_ += declared
        _over(locals_, "locals", "locals", "code")


def _check(data: bytes) -> None:
    for section, r in _sections(data):
        if section in _COUNTED:
            what = _COUNTED[section]
            _over(r.uleb(), what, what, r.section)
        elif section == 4:
            _check_tables(r)
        elif section == 9:
            _check_elements(r)
        elif section == 10:
            _check_code(r)


def refusal(data: bytes) -> str | None:
    """Why a module is too big for floe to load, or cannot be read far enough to tell; or None."""
    if len(data) > MAX_MODULE_BYTES:
        return f"is {len(data) / 2**20:.1f} MiB; floe loads modules of at most {MAX_MODULE_BYTES >> 20} MiB"
    if not data.startswith(_MAGIC):  # WAT text (counted once it is binary), or Wasmtime refuses it
        return None
    try:
        _check(data)
    except _Refused as e:
        return str(e)
    return None
