"""Build floe's C++ routines on first use with the machine's compiler, and load them cheaply after.

Two kinds: `build` makes a PyTorch extension (PyTorch's `cpp_extension.load`: its headers, its
libraries; tens of seconds), `build_plain` a plain shared library with no PyTorch in it (one
compiler call; a second or two). Each version builds in its own folder of PyTorch's per-user cache
(~/.cache/torch_extensions), named by a hash of the sources, the headers they include and the flags
(and, only for `-march=native`, the CPU's feature flags), so a library built for one instruction set
never stands in for another.

PyTorch's `cpp_extension.load` takes its lock file and runs ninja in every process, even when nothing
changed, and a process killed while holding it (a SIGKILLed server, a test that kills writers) left
the lock behind, so every later `load` waited forever. So: a build that is up to date (its stamp
exists) is loaded directly, with no lock and no ninja; a lock older than STALE_LOCK_S is taken for a
dead builder's and removed.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

STALE_LOCK_S = 300.0  # a build takes 1–60 s; a lock this old belongs to a builder that died
STAMP = "floe.built"


class BuildError(RuntimeError):
    """A C++ build that could not run or did not compile; the message has the compiler's words."""


def build(name: str, sources: list[Path], cflags: list[str], ldflags: list[str] = (),
          what: str = "", seconds: float = 30) -> Path:
    """The built PyTorch extension for `sources` (built now if needed; it registers whatever it
    registers when loaded by the caller). Raises what the build raises (no compiler, ...)."""
    directory, name = _folder(name, sources, [*cflags, "|", *ldflags])
    library = directory / f"{name}.so"
    if library.exists() and (directory / STAMP).exists():
        return library
    from torch.utils import cpp_extension

    _clear_stale_lock(directory / "lock")
    started = _announce(what or name, seconds)
    directory.mkdir(parents=True, exist_ok=True)
    cpp_extension.load(name=name, sources=[str(s) for s in sources], is_python_module=False,
                       extra_cflags=cflags, extra_ldflags=list(ldflags), build_directory=str(directory))
    (directory / STAMP).touch()
    _done(what or name, started)
    return library


def build_plain(name: str, sources: list[Path], cflags: list[str], what: str = "",
                seconds: float = 2) -> Path:
    """A shared library of `sources` built with the C++ compiler alone (no PyTorch headers or
    libraries; -O3, C++17, hidden symbols unless exported) and `cflags`; built now if needed.
    Raises BuildError if there is no compiler or the sources do not compile with these flags."""
    directory, name = _folder(name, sources, cflags)
    library = directory / f"lib{name}.so"
    if library.exists() and (directory / STAMP).exists():
        return library
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise BuildError(f"no C++ compiler {compiler!r} on PATH: install g++ or clang++, or set CXX")
    directory.mkdir(parents=True, exist_ok=True)
    with _locked(directory / "lock"):
        if library.exists() and (directory / STAMP).exists():
            return library  # another process built it while we waited
        started = _announce(what or name, seconds)
        partial = directory / f"lib{name}.{os.getpid()}.tmp"
        command = [compiler, "-std=c++17", "-O3", "-fPIC", "-shared", "-fvisibility=hidden", *cflags,
                   "-o", str(partial), *map(str, sources)]
        proc = subprocess.run(command, capture_output=True, text=True)
        if proc.returncode != 0:
            partial.unlink(missing_ok=True)
            raise BuildError(f"{' '.join(command)} failed:\n{proc.stderr[-3000:]}")
        os.replace(partial, library)
        (directory / STAMP).touch()
    _done(what or name, started)
    return library


def _folder(name: str, sources: list[Path], flags: list[str]) -> tuple[Path, str]:
    """(build folder, versioned name): each version of sources, headers and flags in its own."""
    digest = hashlib.sha256()
    for path in _with_headers(sources):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    native = any(f.startswith(("-march=native", "-mcpu=native")) for f in flags)
    digest.update(repr((flags, _cpu() if native else "")).encode())
    name = f"{name}_{digest.hexdigest()[:12]}"
    return _extensions_root() / name, name


def _extensions_root() -> Path:
    """PyTorch's per-user folder of built extensions, as its cpp_extension._get_build_directory names
    it, without importing cpp_extension to ask: setuptools and distutils come with it, ~3 MB of resident
    memory for one path (1 MB of `floe run`'s peak); a build up to date needs nothing else of it."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is not None:
        return Path(root)
    import torch
    from torch import _appdirs

    version = torch.version
    accelerator = (f"rocm{version.hip.replace('.', '')}" if version.hip is not None
                   else f"cu{version.cuda.replace('.', '')}" if version.cuda is not None else "cpu")
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    cache = Path(os.path.realpath(_appdirs.user_cache_dir(appname="torch_extensions")))
    return cache / f"{python}_{accelerator}"


_INCLUDE = re.compile(rb'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def _with_headers(sources: list[Path]) -> list[Path]:
    """The sources and every header they include with quotes, found next to the includer."""
    seen: dict[Path, None] = {}
    todo = [Path(s) for s in sources]
    while todo:
        path = todo.pop(0)
        if path in seen or not path.exists():
            continue
        seen[path] = None
        todo += [path.parent / m.decode() for m in _INCLUDE.findall(path.read_bytes())]
    return list(seen)


def _announce(what: str, seconds: float) -> float:
    print(f"floe: building {what} (~{seconds:.0f} s, once per machine) …", file=sys.stderr,
          flush=True)
    return time.monotonic()


def _done(what: str, started: float) -> None:
    print(f"floe: built {what} in {time.monotonic() - started:.1f} s", file=sys.stderr, flush=True)


@contextmanager
def _locked(lock: Path):
    """Hold `lock` (created exclusively) while building; a dead builder's lock is removed."""
    while True:
        _clear_stale_lock(lock)
        try:
            os.close(os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            break
        except FileExistsError:
            continue
    try:
        yield
    finally:
        lock.unlink(missing_ok=True)


def _clear_stale_lock(lock: Path) -> None:
    """Wait for a build in progress; remove a lock that outlived any build."""
    while lock.exists():
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return
        if age > STALE_LOCK_S:
            lock.unlink(missing_ok=True)
            return
        time.sleep(0.5)


def _cpu() -> str:
    """What the compiler's -march=native sees: the machine and (Linux) the CPU's feature flags."""
    import platform

    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return platform.machine() + flags
