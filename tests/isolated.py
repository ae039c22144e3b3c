"""Run a piece of Python in a fresh interpreter: for behaviour whose failure mode is a crash or a hang,
which would take the test runner down with it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

TESTS = Path(__file__).parent
DEFAULT_CTRL_C = "import signal as _signal; _signal.signal(_signal.SIGINT, _signal.default_int_handler)\n"


def run_isolated(code: str, timeout: float = 180) -> str:
    """Run `code` in a new interpreter (tests/ on its path); its stdout. Fails the calling test with
    the child's output if it crashed, hung past `timeout` or exited non-zero. The child starts with
    Python's own Ctrl-C handler even where the runner was started with SIGINT ignored (a background
    job of a non-interactive shell), so that tests of Ctrl-C test floe, not how they were started."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    try:
        done = subprocess.run([sys.executable, "-c", DEFAULT_CTRL_C + textwrap.dedent(code)],
                              capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"the child hung past {timeout} s; its output: {e.stdout!r} {e.stderr!r}") \
            from None
    assert done.returncode == 0, (f"the child exited with {done.returncode} (negative: killed by signal "
                                  f"{-done.returncode})\nstdout: {done.stdout}\nstderr: {_ends(done.stderr)}")
    return done.stdout


def _ends(text: str, keep: int = 3000) -> str:
    """The start (a panic's or abort's own message) and the end of a long output."""
    if len(text) <= 2 * keep:
        return text
    return f"{text[:keep]}\n[… {len(text) - 2 * keep} characters …]\n{text[-keep:]}"
