"""Whether this machine can build floe's C++ routines (then they must build: no silent fallback)."""

import os
import shutil


def has_compiler() -> bool:
    return any(shutil.which(c) for c in (os.environ.get("CXX", "c++"), "g++", "clang++"))
