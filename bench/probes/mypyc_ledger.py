"""What compiling a module of the request's path with mypyc would buy, on one that compiles as it is:
floe.profile (the zero-copy ledger, ~10 records a chat request in the engine core). Copies
src/floe/profile.py into a temporary package, compiles it there with mypyc (from the `mypy` package: `pip
install mypy`), and times the same ledger records (copied, shared, copy over 10 boundaries) on the
interpreted module and the compiled one, each in a fresh interpreter, taking turns: ns a record, the median
of --runs each.

    python bench/probes/mypyc_ledger.py [--runs 3]

The modules a chat request's admission runs through (floe.server.core, floe.server.sessions, floe.actor) do
not compile as they are: `mypy --follow-imports=silent` finds ~190 errors in 18 of them (2026-12-07).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
TIMED = """
import time
import floe.profile as p
assert p.__file__.endswith({suffix!r}), p.__file__
ledger = p.Ledger()
names = [f"b{{i}}" for i in range(10)]
def records():
    for n in names:
        ledger.copied(n, 3, 3, 4096)
        ledger.shared(n, 2, 1024)
        ledger.copy(n, 128, seconds=0.0)
for _ in range(2000):
    records()
t = time.perf_counter()
for _ in range(20000):
    records()
print((time.perf_counter() - t) / 20000 / 30 * 1e9)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    if shutil.which("mypyc") is None:
        raise SystemExit("mypyc not found: pip install mypy")
    with tempfile.TemporaryDirectory(prefix="floe-mypyc-") as folder:
        package = Path(folder) / "floe"
        package.mkdir()
        (package / "__init__.py").write_text("")
        shutil.copy(SRC / "floe" / "profile.py", package / "profile.py")
        built = subprocess.run(["mypyc", "floe/profile.py"], cwd=folder, capture_output=True, text=True)
        if built.returncode:
            raise SystemExit(f"mypyc failed:\n{built.stdout[-2000:]}{built.stderr[-2000:]}")
        (package / "profile.py").unlink()  # (the compiled module only)
        times: dict[str, list[float]] = {"interpreted": [], "compiled": []}
        for _ in range(args.runs):
            for way, path, suffix in (("interpreted", SRC, ".py"), ("compiled", Path(folder), ".so")):
                out = subprocess.run([sys.executable, "-c", TIMED.format(suffix=suffix)], capture_output=True,
                                     text=True, check=True, env={"PYTHONPATH": str(path), "PATH": ""})
                times[way].append(float(out.stdout))
    for way, runs in times.items():
        print(f"{way}: {statistics.median(runs):.0f} ns a ledger record (runs: "
              f"{', '.join(f'{r:.0f}' for r in runs)})")


if __name__ == "__main__":
    main()
