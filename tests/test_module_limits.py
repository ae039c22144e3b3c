"""Every section Wasmtime compiles is bounded before it compiles (floe.wasm.shape): element entries,
tables, function bodies, locals; a module whose section headers cannot be read is refused too, all as
GuestLoadError naming the section, what was declared and the bound. floe's own guests pass them all
with a wide margin.

    python tests/test_module_limits.py   # hostile modules' compile time and peak RSS, bounded or not
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest
import wasmtime

from floe.wasm import GuestLoadError, runtime, shape

GUESTS = sorted((Path(__file__).parent.parent / "src" / "floe" / "guests").glob("*.wasm"))
FUNCREF, REF_FUNC_0 = b"\x70", b"\xd2\x00\x0b"


def uleb(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def vec(items: list[bytes]) -> bytes:
    return uleb(len(items)) + b"".join(items)


def section(id_: int, body: bytes) -> bytes:
    return bytes([id_]) + uleb(len(body)) + body


def module(*, bodies: list[bytes] = (b"\x00\x0b",), tables: list[bytes] = (b"\x70\x00\x01",),
           elements: list[bytes] = (), data: int = 0) -> bytes:
    """A module of `() -> ()` functions with these bodies (locals + code + end), these tables, these
    element segments, and `data` one-byte data segments in a memory of one page."""
    sections = [section(1, vec([b"\x60\x00\x00"])), section(3, vec([b"\x00"] * len(bodies)))]
    if tables:
        sections.append(section(4, vec(list(tables))))
    if data:
        sections.append(section(5, vec([b"\x00\x01"])))
    if elements:
        sections.append(section(9, vec(list(elements))))
    sections.append(section(10, vec([uleb(len(b)) + b for b in bodies])))
    if data:
        sections.append(section(11, vec([b"\x00\x41\x00\x0b\x01x"] * data)))
    return b"\0asm\x01\0\0\0" + b"".join(sections)


def element_segment(kind: int, entries: int) -> bytes:
    """An element segment of the Wasm spec's `kind` (0 to 7), every entry function 0."""
    table = b"\x00" if kind & 3 == 2 else b""  # kinds 2 and 6 name their table
    offset = b"" if kind & 1 else b"\x41\x00\x0b"  # active ones (even kinds) have an offset
    type_ = b"" if not kind & 3 else FUNCREF if kind & 4 else b"\x00"  # a reftype, or elemkind funcref
    entry = REF_FUNC_0 if kind & 4 else b"\x00"  # an expression, or a function index
    return uleb(kind) + table + offset + type_ + uleb(entries) + entry * entries


def calls(size: int) -> bytes:
    """A function body of `size` bytes of `call 0`: of the bodies tried, Cranelift's slowest per byte
    (3 MB: 11 s and 2.6 GB on the 2-core VM, 10 times 300 KB's time)."""
    return b"\x00" + b"\x10\x00" * ((size - 2) // 2) + b"\x0b"


def live_locals(n: int) -> bytes:
    """A body that sets `n` i64 locals, then adds them all up: every one live at once."""
    sets = b"".join(b"\x42" + uleb(i) + b"\x21" + uleb(i) for i in range(n))
    adds = b"\x42\x00" + b"".join(b"\x20" + uleb(i) + b"\x7c" for i in range(n))
    return b"\x01" + uleb(n) + b"\x7e" + sets + adds + b"\x1a\x0b"


def with_locals(n: int) -> bytes:
    return b"\x01" + uleb(n) + b"\x7e\x0b"  # n i64 locals, an empty body


def refused(data: bytes, monkeypatch) -> str:
    """The GuestLoadError message loading `data` gives, with Wasmtime's compiler out of reach."""
    def compile_(*_):
        raise AssertionError("Wasmtime was asked to compile a module floe should have refused")
    monkeypatch.setattr(runtime, "Module", compile_)
    with pytest.raises(GuestLoadError) as e:
        runtime.GuestModule(runtime.default_runtime(), data, "hostile.wasm")
    return str(e.value)


def loads(data: bytes) -> bool:
    return runtime.GuestModule(runtime.default_runtime(), data).module is not None


@pytest.mark.parametrize("path", GUESTS, ids=lambda p: p.name)
def test_every_shipped_guest_passes_bounds_ten_times_tighter(path, monkeypatch):
    monkeypatch.setattr(shape, "LIMITS", {k: v // 10 for k, v in shape.LIMITS.items()})
    assert shape.refusal(path.read_bytes()) is None


def test_a_million_entry_element_segment_is_refused_before_compiling(monkeypatch):
    message = refused(module(elements=[element_segment(0, 1_000_000)]), monkeypatch)
    assert message.startswith("hostile.wasm declares 1000000 element entries; floe loads at most 16384 in "
                              "its element section")


@pytest.mark.parametrize("kind", range(8))
def test_element_entries_are_counted_in_every_segment_kind(kind, monkeypatch):
    assert loads(module(elements=[element_segment(kind, 3)] * 2))  # read as Wasmtime reads it
    assert "declares 16385 element entries" in refused(
        module(elements=[element_segment(kind, 3)] * 2 + [element_segment(kind, 16_379)]), monkeypatch)


def test_element_segments_are_counted_even_when_empty(monkeypatch):
    message = refused(module(elements=[element_segment(1, 0)] * 8193), monkeypatch)
    assert "declares 8193 element segments; floe loads at most 8192 in its element section" in message


def test_a_function_body_over_256_kib_is_refused_before_compiling(monkeypatch):
    message = refused(module(bodies=[calls(3 << 20)] * 5), monkeypatch)  # 38 s to compile, unbounded
    assert f"declares {3 << 20} bytes in function 0's body; floe loads at most 262144 in its code " \
           "section" in message


def test_function_bodies_over_2_mib_in_all_are_refused_before_compiling(monkeypatch):
    message = refused(module(bodies=[calls(250 << 10)] * 9), monkeypatch)
    assert "bytes of function bodies; floe loads at most 2097152 in its code section" in message


def test_locals_are_bounded_per_function_and_in_all(monkeypatch):
    assert loads(module(bodies=[with_locals(8192)] * 8))
    assert "declares 8193 locals in function 0; floe loads at most 8192 in its code section" in refused(
        module(bodies=[with_locals(8193)]), monkeypatch)
    # 10,000 functions of 50,000 locals each (Wasmtime's own bound): a 130 kB module, 31 s to compile.
    assert "declares 50000 locals in function 0;" in refused(
        module(bodies=[with_locals(50_000)] * 10_000), monkeypatch)
    assert "locals; floe loads at most 262144 in its code section" in refused(
        module(bodies=[with_locals(8000)] * 40), monkeypatch)


def test_tables_are_bounded_in_number_and_in_size(monkeypatch):
    assert loads(module(tables=[b"\x70\x01\x01" + uleb(1 << 20)] * 2))
    assert "declares 17 tables; floe loads at most 16 in its table section" in refused(
        module(tables=[b"\x70\x00\x01"] * 17), monkeypatch)
    big = uleb((1 << 20) + 1)
    assert f"declares {(1 << 20) + 1} elements initially in table 1; floe loads at most 1048576" in refused(
        module(tables=[b"\x70\x00\x01", b"\x70\x00" + big]), monkeypatch)
    assert f"declares {(1 << 20) + 1} elements at most in table 0;" in refused(
        module(tables=[b"\x70\x01\x01" + big]), monkeypatch)


MALFORMED = {
    "a section size cut short": b"\0asm\x01\0\0\0\x01\xff",
    "a section running past the end": b"\0asm\x01\0\0\0\x01\x10\x01\x60",
    "a LEB128 number over 10 bytes": module()[:8] + b"\x09\x0c\x01" + b"\x80" * 11,
    "an element segment cut short": module(elements=[element_segment(0, 5)])[:-3],
    "an element segment of kind 9": module(elements=[b"\x09\x00\x00"]),
    "a function body running past its section": module(bodies=[])[:-3] + section(10, b"\x01\x05\x00\x0b"),
    "an offset expression floe does not read": module(elements=[b"\x00\x20\x00\x0b\x00"]),
}


@pytest.mark.parametrize("data", MALFORMED.values(), ids=MALFORMED.keys())
def test_a_malformed_section_header_is_refused_as_malformed(data, monkeypatch):
    assert " is malformed: " in refused(data, monkeypatch)


def test_a_guest_cut_anywhere_is_refused_or_left_to_wasmtime_never_an_exception():
    data = GUESTS[0].read_bytes()
    answers = [shape.refusal(data[:n]) for n in range(0, len(data), 7)]
    assert all(a is None or isinstance(a, str) for a in answers)
    assert sum(a is not None for a in answers) > len(answers) // 2


# Hostile modules, timed outside CI: `python tests/test_module_limits.py`.
HOSTILE = {
    "element segment, 1M entries (1 MB)": lambda: module(elements=[element_segment(0, 1_000_000)]),
    "element segment, 4M entries (4 MB)": lambda: module(elements=[element_segment(0, 4_000_000)]),
    "element entries at the bound (16,384)": lambda: module(elements=[element_segment(0, 16_384)]),
    "element segments at the bound (8,192 of 2)": lambda: module(elements=[element_segment(1, 2)] * 8192),
    "5 function bodies of 3 MB": lambda: module(bodies=[calls(3 << 20)] * 5),
    "code at the bounds (8 bodies of 256 KiB)": lambda: module(bodies=[calls(256 << 10)] * 8),
    "10,000 functions of 50,000 locals": lambda: module(bodies=[with_locals(50_000)] * 10_000),
    "locals at the bounds (32 of 8,192)": lambda: module(bodies=[with_locals(8192)] * 32),
    "8 bodies of 8,192 live locals": lambda: module(bodies=[live_locals(8192)] * 8),
    "data segments at the bound (8,192)": lambda: module(data=8192),
    "all at the bounds at once": lambda: module(bodies=[calls(256 << 10)] * 8, data=8192,
                                                elements=[element_segment(1, 2)] * 8192),
}


def _measure_one(name: str, bounded: bool) -> dict:
    data = HOSTILE[name]()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.monotonic()
    try:
        if bounded:
            runtime.GuestModule(runtime.default_runtime(), data)
        else:
            wasmtime.Module(runtime.default_runtime().engine, data)
        outcome = "compiled"
    except GuestLoadError as e:
        outcome = f"refused: {str(e).split(';')[0]}"
    seconds = time.monotonic() - start
    grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    return {"module": name, "bytes": len(data), "bounds": bounded, "seconds": round(seconds, 2),
            "peak_rss_growth_mb": grew >> 10, "outcome": outcome}


def main() -> None:
    """Each hostile module (those whose names contain an argument, else all) in a fresh process,
    compiled without and then with floe's bounds. The 4 MB element segment takes ~9 GB unbounded."""
    if sys.argv[1:2] == ["--one"]:
        print(json.dumps(_measure_one(sys.argv[2], sys.argv[3] == "bounded")))
        return
    rows = []
    for name in [n for n in HOSTILE if not sys.argv[1:] or any(a in n for a in sys.argv[1:])]:
        for mode in ("unbounded", "bounded"):
            out = subprocess.run([sys.executable, __file__, "--one", name, mode], capture_output=True,
                                 text=True, check=True)
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            r = rows[-1]
            print(f"{r['module']:<42} {mode:<9} {r['seconds']:>7.2f} s {r['peak_rss_growth_mb']:>6} MB  "
                  f"{r['outcome']}", flush=True)
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
