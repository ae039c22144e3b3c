"""Build floe's C++ routines on first use with the machine's compiler, and load them cheaply after.

PyTorch's `cpp_extension.load` builds into a per-machine cache (~/.cache/torch_extensions) under a
lock file, and takes that lock and runs ninja in every process, even when nothing changed. A process
killed while holding it (a SIGKILLed server, a test that kills writers) left the lock behind, and
every later `load` waited for it forever. So: a build that is up to date (its stamp names the same
sources and flags: each version builds in a folder named by their hash) is loaded directly, with no
lock and no ninja; a lock older than STALE_LOCK_S is taken for a dead builder's and removed.
"""

from __future__ import annotations

import hashlib
import sys
import time
from pathlib import Path

STALE_LOCK_S = 300.0  # a build takes 1–60 s; a lock this old belongs to a builder that died


def build(name: str, sources: list[Path], cflags: list[str], ldflags: list[str] = (),
          what: str = "") -> Path:
    """The built shared library for `sources` (built now if needed; it registers whatever it
    registers when loaded by the caller). Raises what the build raises (no compiler, ...)."""
    from torch.utils import cpp_extension

    digest = hashlib.sha256()
    for source in sources:
        digest.update(source.read_bytes())
        for header in sorted(source.parent.glob("*.h")):
            digest.update(header.read_bytes())
    digest.update(repr((cflags, list(ldflags), _cpu())).encode())  # -march=native: per CPU
    name = f"{name}_{digest.hexdigest()[:12]}"  # each version of the sources builds in its own folder
    directory = Path(cpp_extension._get_build_directory(name, verbose=False))
    library, stamp = directory / f"{name}.so", directory / "floe.built"
    if library.exists() and stamp.exists():
        return library
    _clear_stale_lock(directory / "lock")
    print(f"floe: building {what or name} (once per machine) …", file=sys.stderr, flush=True)
    cpp_extension.load(name=name, sources=[str(s) for s in sources], is_python_module=False,
                       extra_cflags=cflags, extra_ldflags=list(ldflags))
    stamp.touch()
    return library


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
