"""Compiled guests kept on disk for later processes (floe.wasm.runtime.GuestModule loads and keeps them).

A process that loads its guest from here never runs Cranelift, whose code and buffers cost 9 MB of
resident memory as it compiles the chat guest (6 MB of `floe run`'s peak on the default model,
bench/peak_rss.py) and a few ms per guest. CACHE_ENV names the folder ("off" keeps none); a file,
named by the SHA-256 of the module's bytes, holds what Module.serialize wrote and its SHA-256, so a
torn or damaged one is compiled again, never run (Wasmtime itself refuses another version's or
configuration's artifact: compiled again and replaced). What the folder holds runs as native code: a
folder or file that is not the user's own, or that others may write, is neither loaded from nor
written to (_private); the folder is made 0700, each file 0600.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
import threading
from pathlib import Path

import wasmtime
from wasmtime import Module, WasmtimeError

CACHE_ENV = "FLOE_WASM_CACHE"
CACHE_FILES = 32  # the most recently used kept (a chat guest's file: ~30 KB)


def cache_folder() -> Path | None:
    """Where compiled guests are kept: $FLOE_WASM_CACHE, else $XDG_CACHE_HOME/floe/wasm (~/.cache);
    None where the variable says "off"."""
    given = os.environ.get(CACHE_ENV)
    if given is not None:
        return None if given.strip().lower() in ("", "0", "off") else Path(given)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "floe" / "wasm"


def _file(sha256: str) -> Path | None:
    folder = cache_folder()
    return None if folder is None else folder / f"{sha256}.cwasm"


def _private(path: Path) -> bool:
    """Whether `path` belongs to this user and nobody else may write it: a compiled guest runs as native
    code, so a file or folder another user could have written is never loaded from (nor written to)."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return st.st_uid == os.getuid() and not st.st_mode & 0o022 and not stat.S_ISLNK(st.st_mode)


def load(engine: wasmtime.Engine, sha256: str) -> Module | None:
    """The module compiled earlier from the bytes of this SHA-256 by this Wasmtime and configuration, if
    kept (in a folder and a file of this user's own: _private)."""
    path = _file(sha256)
    if path is None or not (_private(path.parent) and _private(path)):
        return None
    try:
        data = path.read_bytes()
    except OSError:
        return None
    artifact, digest = data[:-32], data[-32:]
    if len(data) <= 32 or hashlib.sha256(artifact).digest() != digest:
        return None
    try:
        module = Module.deserialize(engine, artifact)
    except WasmtimeError:  # another configuration's
        return None
    with contextlib.suppress(OSError):
        os.utime(path)  # used now: the last to go
    return module


def keep(module: Module, sha256: str) -> None:
    """Keep `module` (compiled from the bytes of this SHA-256) for later processes; a folder that cannot
    be written, or is not the user's own alone, keeps none."""
    path = _file(sha256)
    if path is None:
        return
    artifact = module.serialize()
    partial = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not _private(path.parent):  # (another user's or a shared folder: nothing kept there)
            return
        fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(artifact + hashlib.sha256(artifact).digest())
        os.replace(partial, path)  # whole or not at all: another process may be reading it
    except OSError:
        with contextlib.suppress(OSError):
            partial.unlink(missing_ok=True)
    _evict(path.parent)


def _evict(folder: Path) -> None:
    """Remove all but the CACHE_FILES most recently used compiled guests of `folder`."""
    with contextlib.suppress(OSError):
        kept = sorted(folder.glob("*.cwasm"), key=lambda f: f.stat().st_mtime, reverse=True)
        for old in kept[CACHE_FILES:]:
            old.unlink(missing_ok=True)
