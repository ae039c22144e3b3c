"""docs/PERF.md is a reference a user reads in five minutes, and each command in it runs as written on a
fresh clone. Its commands are in fenced blocks marked by where they run (```sh cpu, cuda, vulkan or
file); the CPU ones run here with FLOE_BENCH_SMOKE=1 (bench/smoke.py: tiny sizes, results in a temporary
folder), the others are skipped with the reason. Its links into PERF_HISTORY.md land on a heading."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
PERF = ROOT / "docs" / "PERF.md"
HISTORY = ROOT / "docs" / "PERF_HISTORY.md"
MOST_LINES = 400
# Where a block's commands run -> why this test does not run them (None: it does, in smoke mode).
WHERE = {"cpu": None, "cuda": "needs a CUDA device: a device run checks it (its date is the figure's)",
         "vulkan": "needs a GPU with a Vulkan driver for WebGPU",
         "file": "reads a model file a test writes (hundreds of MB)"}
BLOCK = re.compile(r"^```sh (\w+)\n(.*?)^```$", re.MULTILINE | re.DOTALL)
FENCE = re.compile(r"^```(.*)$", re.MULTILINE)
# An inline code span that is a command to run, not a name: commands belong in a marked block.
INLINE_COMMAND = re.compile(r"`((?:\w+=\S+ )*(?:python3?|bash|floe|taskset) [^`]*(?:--|\.py|\.sh)[^`]*)`")


def commands(text: str) -> list[tuple[str, str]]:
    """(where, command) of each command in `text`'s marked blocks: a line each (a trailing `\\` continues
    one)."""
    return [(where, " ".join(line.split())) for where, body in BLOCK.findall(text)
            for line in body.replace("\\\n", " ").splitlines() if line.strip()]


def slugs(markdown: str) -> set[str]:
    """The anchors GitHub gives a file's headings: lower case, punctuation dropped, spaces as hyphens,
    a repeated one numbered."""
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#+ (.+)$", FENCE.sub("", markdown), re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_perf_md_is_a_short_reference_whose_commands_are_all_marked():
    text = PERF.read_text()
    assert len(text.splitlines()) <= MOST_LINES
    openings = FENCE.findall(text)[::2]  # (every other fence closes a block)
    assert openings and all(o.startswith("sh ") and o[3:] in WHERE for o in openings), openings
    assert len(commands(text)) >= len(openings)
    assert INLINE_COMMAND.findall(text) == []


def test_every_link_into_the_history_and_within_lands_on_a_heading():
    text = PERF.read_text()
    history = re.findall(r"\]\(PERF_HISTORY\.md#([^)]+)\)", text)
    own = re.findall(r"\]\(#([^)]+)\)", text)
    assert history and own
    assert set(history) - slugs(HISTORY.read_text()) == set()
    assert set(own) - slugs(text) == set()


def test_the_slugs_are_githubs():
    headings = "# A `floe serve` run: 1B (issue 40)\n## Moved from PERF.md on 2026-12-05\n## A\n## A\n"
    assert slugs(headings) == {"a-floe-serve-run-1b-issue-40", "moved-from-perfmd-on-2026-12-05", "a", "a-1"}


@pytest.mark.slow
@pytest.mark.parametrize(("where", "command"), commands(PERF.read_text()),
                         ids=[f"{w} {c[:60]}" for w, c in commands(PERF.read_text())])
def test_a_command_of_perf_md_runs_as_written(where, command, tmp_path):
    """A CPU command, in smoke mode: it runs to its end (exit 0) and writes its results where smoke mode
    puts them, not into bench/results/."""
    if WHERE[where] is not None:
        pytest.skip(WHERE[where])
    env = {**os.environ, "FLOE_BENCH_SMOKE": "1", "FLOE_BENCH_OUT": str(tmp_path),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    done = subprocess.run(["bash", "-c", command], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, f"{command}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    if command.startswith("python bench/"):
        assert list((tmp_path / "floe-bench-smoke").iterdir())
