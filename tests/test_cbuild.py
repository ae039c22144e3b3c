"""Building floe's C++ routines: an up-to-date build loads without PyTorch's build lock, and a lock
left by a builder that was killed is not waited for forever."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from toolchain import has_compiler

from floe.engine import cbuild, copyhash

SOURCES = [copyhash.SOURCE]
FLAGS = ["-O3", "-march=native"]


@pytest.fixture(scope="module")
def built():
    if not has_compiler():
        pytest.skip("no C++ compiler on this machine (floe falls back to Python threads there)")
    return cbuild.build("floe_copy_hash", SOURCES, FLAGS)  # with a compiler, it must build


def test_a_built_library_loads_even_while_a_lock_file_exists(built):
    lock = built.parent / "lock"
    lock.touch()  # as if another process were building now (or had died doing it)
    try:
        t = time.monotonic()
        assert cbuild.build("floe_copy_hash", SOURCES, FLAGS) == built
        assert time.monotonic() - t < 1.0  # neither waited for the lock nor ran the build
    finally:
        lock.unlink(missing_ok=True)


def test_a_stale_lock_of_a_killed_build_is_removed_and_the_build_finishes(built):
    stamp, lock = built.parent / "floe.built", built.parent / "lock"
    stamp.unlink()  # the build never said it finished
    lock.touch()
    old = time.time() - cbuild.STALE_LOCK_S - 10
    os.utime(lock, (old, old))
    assert cbuild.build("floe_copy_hash", SOURCES, FLAGS) == built
    assert stamp.exists() and not lock.exists()


def test_other_flags_build_apart(built):
    assert cbuild.build("floe_copy_hash", SOURCES, [*FLAGS, "-DFLOE_TEST_FLAG"]).parent != built.parent


def test_floe_looks_for_its_builds_in_pytorchs_extension_folder(monkeypatch):
    from torch.utils import cpp_extension

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setattr(cpp_extension.os, "makedirs", lambda *a, **k: None)
    folder, name = cbuild._folder("floe_copy_hash", SOURCES, FLAGS)
    assert folder == Path(cpp_extension._get_build_directory(name, verbose=False))


def test_loading_built_kernels_imports_no_setuptools(built):
    """(PyTorch's cpp_extension brings setuptools and distutils: ~3 MB of `floe run`'s peak memory.)"""
    from floe.engine import qgemv

    qgemv.load("auto")  # built here first, if this machine had not yet
    code = ("import sys\nfrom floe.engine import qgemv\nqgemv.load('auto')\n"
            "print(sorted(m for m in sys.modules if m.startswith(('setuptools', 'distutils', "
            "'torch.utils.cpp_extension'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
