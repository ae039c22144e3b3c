"""Build the guests in this folder to wasm32 with zig's clang (PyPI `ziglang`), into the package.

    python guests/build.py [--out src/floe/guests]

No wasi-libc: guests use only floe.h. Exports come from FLOE_EXPORT attributes; `__stack_pointer`
stays unexported, as clang leaves it.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
GUESTS = ("chat", "constrained", "probe")
FLAGS = [
    "--target=wasm32-freestanding", "-O2", "-nostdlib", "-std=c11", "-Wall", "-Werror",
    "-Wno-unused-function", "-Wl,--no-entry", "-Wl,-z,stack-size=1048576", "-Wl,--strip-debug",
]


def build(name: str, out: Path) -> Path:
    target = out / f"{name}.wasm"
    cmd = [sys.executable, "-m", "ziglang", "cc", *FLAGS, "-o", str(target), str(HERE / f"{name}.c")]
    subprocess.run(cmd, check=True)
    return target


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=HERE.parent / "src" / "floe" / "guests")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for name in GUESTS:
        path = build(name, args.out)
        print(f"built {path} ({path.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
