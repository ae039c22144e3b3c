"""DESIGN.md's layers as contracts (pyproject.toml's [tool.importlinter], run by import-linter): they
hold for floe as it is, and they fail when a lower layer imports a higher one."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
pytest.importorskip("importlinter")


def lint_imports(src: Path) -> subprocess.CompletedProcess:
    """import-linter on the package under `src`, with the project's contracts."""
    code = ("import sys; from importlinter.cli import lint_imports_command as lint; sys.exit(lint.main("
            "['--config', sys.argv[1], '--no-cache'], standalone_mode=False))")
    return subprocess.run([sys.executable, "-c", code, str(ROOT / "pyproject.toml")], capture_output=True,
                          text=True, timeout=300, cwd=src,
                          env={"PYTHONPATH": str(src), "PATH": "/usr/bin:/bin"})  # (this src's floe)


def test_the_layers_hold():
    done = lint_imports(ROOT / "src")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "0 broken" in done.stdout


@pytest.mark.parametrize("module, imports", [("memory.py", "floe.server.app"),
                                             ("engine/slots.py", "floe.actor.actor"),
                                             ("wasm/raw.py", "floe.model.tokenizer"),
                                             ("profile.py", "floe.memory"),
                                             ("server/sessions/registry.py",
                                              "floe.server.sessions.lifecycle")])
def test_a_lower_layer_importing_a_higher_one_breaks_a_contract(tmp_path, module, imports):
    shutil.copytree(ROOT / "src" / "floe", tmp_path / "floe",
                    ignore=shutil.ignore_patterns("__pycache__", "*.wasm", "csrc", "shaders"))
    with open(tmp_path / "floe" / module, "a") as f:
        f.write(f"\n\ndef _uses_a_layer_above():\n    import {imports}  # noqa\n")
    done = lint_imports(tmp_path)
    assert done.returncode != 0 and "BROKEN" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
    assert imports.rsplit(".", 1)[0] in done.stdout
