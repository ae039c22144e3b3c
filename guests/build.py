"""Build floe guests to wasm32 with zig's clang (PyPI `ziglang`): this folder's, into the package, or
your own C sources anywhere (floe.h is found here, whatever the current folder).

    python guests/build.py [--out src/floe/guests]          # chat, complete, constrained, grammar, probe
    python guests/build.py my_guest.c [more.c …] --out .    # your own: my_guest.wasm in --out

No wasi-libc: guests use only floe.h. Exports come from FLOE_EXPORT attributes; `__stack_pointer`
stays unexported, as clang leaves it.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
GUESTS = ("chat", "complete", "constrained", "grammar", "probe")
FLAGS = [
    "--target=wasm32-freestanding", "-O2", "-nostdlib", "-std=c11", "-Wall", "-Werror",
    "-Wno-unused-function", "-Wl,--no-entry", "-Wl,-z,stack-size=1048576", "-Wl,--strip-debug",
]


def build(source: Path, out: Path, defines: tuple[str, ...] = (), name: str | None = None) -> Path:
    """Compile one C guest to out/<name or its stem>.wasm; `defines`: e.g. ("FLOE_ABI_V1",)."""
    target = out / f"{name or source.stem}.wasm"
    cmd = [sys.executable, "-m", "ziglang", "cc", *FLAGS, *(f"-D{d}" for d in defines), f"-I{HERE}",
           "-o", str(target), str(source)]
    subprocess.run(cmd, check=True)
    return target


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sources", nargs="*", type=Path, help="C files to build (default: floe's own guests)")
    ap.add_argument("--out", type=Path, default=None,
                    help="output folder (default: the package for floe's guests, else the current folder)")
    args = ap.parse_args()
    sources = args.sources or [HERE / f"{name}.c" for name in GUESTS]
    out = args.out or (HERE.parent / "src" / "floe" / "guests" if not args.sources else Path.cwd())
    out.mkdir(parents=True, exist_ok=True)
    for source in sources:
        path = build(source, out)
        print(f"built {path} ({path.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
