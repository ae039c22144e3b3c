"""A guest compiled once is kept on disk and loaded from there after, without Cranelift (whose code and
buffers cost `floe run` ~9 MB of resident memory); a damaged file is compiled again, never run, and
the folder keeps the most recently used files only."""

from __future__ import annotations

from pathlib import Path

import pytest

from floe.actor import builtin_guest
from floe.wasm import compiled, runtime
from floe.wasm.runtime import WasmRuntime


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv(compiled.CACHE_ENV, str(tmp_path / "wasm"))
    return tmp_path / "wasm"


@pytest.fixture
def compiles(monkeypatch) -> list[int]:
    """The Cranelift compiles made from now on (one entry each)."""
    made: list[int] = []
    real = runtime.Module

    class Spy:
        deserialize = staticmethod(real.deserialize)

        def __new__(cls, engine, wasm):
            made.append(len(wasm))
            return real(engine, wasm)

    monkeypatch.setattr(runtime, "Module", Spy)
    return made


def wat(n: int) -> str:
    return f'(module (func (export "f") (result i32) (i32.const {n})))'


def test_a_guest_compiled_once_is_loaded_from_the_cache_in_another_runtime(cache, compiles):
    first = WasmRuntime().compile(builtin_guest("chat"))
    assert len(compiles) == 1 and len(list(cache.glob("*.cwasm"))) == 1
    again = WasmRuntime().compile(builtin_guest("chat"))  # a fresh runtime: as a new process
    assert len(compiles) == 1  # no Cranelift: the kept artifact
    assert again.sha256 == first.sha256 and again.exports() == first.exports()
    assert again.imports() == first.imports()


def test_a_loaded_guest_runs_as_the_compiled_one(cache, compiles):
    from wasmtime import Instance, Store

    for _ in range(2):
        rt = WasmRuntime()
        module = rt.compile(wat(41).encode()).module
        store = Store(rt.engine)
        store.set_epoch_deadline(1 << 20)  # (the runtime interrupts at epoch deadlines; none ticks here)
        assert Instance(store, module, []).exports(store)["f"](store) == 41
    assert len(compiles) == 1


def test_a_damaged_file_is_compiled_again_and_replaced(cache, compiles):
    WasmRuntime().compile(builtin_guest("chat"))
    (path,) = cache.glob("*.cwasm")
    good = path.read_bytes()
    damaged = bytearray(good)
    damaged[len(damaged) // 2] ^= 0xFF
    path.write_bytes(bytes(damaged))
    WasmRuntime().compile(builtin_guest("chat"))
    assert len(compiles) == 2 and path.read_bytes() == good
    path.write_bytes(good[:100])  # torn
    WasmRuntime().compile(builtin_guest("chat"))
    assert len(compiles) == 3 and path.read_bytes() == good


def test_the_folder_keeps_the_most_recently_used_files(cache, compiles, monkeypatch):
    monkeypatch.setattr(compiled, "CACHE_FILES", 2)
    for n in range(4):
        WasmRuntime().compile(wat(n).encode())
    assert len(list(cache.glob("*.cwasm"))) == 2
    WasmRuntime().compile(wat(3).encode())  # kept
    WasmRuntime().compile(wat(0).encode())  # evicted: compiled again
    assert len(compiles) == 5


def test_off_keeps_nothing(tmp_path, monkeypatch, compiles):
    monkeypatch.setenv(compiled.CACHE_ENV, "off")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    for _ in range(2):
        WasmRuntime().compile(wat(7).encode())
    assert len(compiles) == 2 and not any(tmp_path.rglob("*.cwasm"))


def test_a_file_or_folder_others_may_write_is_never_loaded_from(cache, compiles):
    """A compiled guest runs as native code: one in a folder, or a file, that another user could have
    written is compiled again instead (and nothing is written into such a folder)."""
    WasmRuntime().compile(builtin_guest("chat"))
    (path,) = cache.glob("*.cwasm")
    assert cache.stat().st_mode & 0o777 == 0o700 and path.stat().st_mode & 0o777 == 0o600
    path.chmod(0o664)  # group-writable
    WasmRuntime().compile(builtin_guest("chat"))
    assert len(compiles) == 2
    path.unlink()
    cache.chmod(0o777)  # a shared folder
    WasmRuntime().compile(builtin_guest("chat"))
    WasmRuntime().compile(builtin_guest("chat"))
    assert len(compiles) == 4 and list(cache.iterdir()) == []
    cache.chmod(0o700)
    WasmRuntime().compile(builtin_guest("chat"))
    WasmRuntime().compile(builtin_guest("chat"))
    assert len(compiles) == 5
