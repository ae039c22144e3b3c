"""bench/README.md is the index of bench/: every script there and in bench/probes/ has its entry (a
table row naming it), and every entry names a script that exists."""

from __future__ import annotations

import re
from pathlib import Path

BENCH = Path(__file__).parents[1] / "bench"
# A table row's first cell: `name.py`, `probes/name.sh` (from bench/) or, in the probes' table, `name.py`.
ENTRY = re.compile(r"^\| `([\w/]+\.(?:py|sh))` \|", re.MULTILINE)


def entries() -> set[str]:
    """The scripts the index has a row for, as paths under bench/."""
    named = set(ENTRY.findall((BENCH / "README.md").read_text()))
    return {n if (BENCH / n).exists() or "/" in n else f"probes/{n}" for n in named}


def scripts() -> set[str]:
    return {str(p.relative_to(BENCH)) for p in [*BENCH.glob("*.py"), *(BENCH / "probes").glob("*.*")]
            if p.suffix in (".py", ".sh")}


def test_every_bench_script_has_an_entry_in_the_index():
    assert scripts() - entries() == set()


def test_every_entry_of_the_index_names_a_script_that_exists():
    assert entries() - scripts() == set()
