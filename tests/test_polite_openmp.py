"""floe's commands keep PyTorch's OpenMP threads from spinning long at the end of a parallel region
(floe.cli.machine.polite_openmp): set before torch is imported, never over a value the user set."""

from __future__ import annotations

import os
import subprocess
import sys

from floe.cli.machine import GOMP_SPINS, polite_openmp


def child(code: str, **env: str) -> str:
    """What `code` prints in a fresh interpreter whose environment has no GOMP_SPINCOUNT but `env`'s."""
    base = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**base, **env})
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


SHOW = "import os; print(os.environ.get('GOMP_SPINCOUNT'))"


def test_the_floe_command_sets_it_before_torch_is_imported():
    out = child("import sys\nfrom floe.cli import main\ntry:\n    main(['--help'])\n"
                "except SystemExit:\n    pass\nprint('torch' in sys.modules, end=' ')\n" + SHOW)
    assert out.splitlines()[-1] == f"False {GOMP_SPINS}"


def test_a_value_the_user_set_is_kept():
    assert child(f"from floe.cli.machine import polite_openmp\npolite_openmp()\n{SHOW}",
                 GOMP_SPINCOUNT="300000") == "300000"


def test_after_torch_is_imported_it_is_left_alone():
    # (its OpenMP runtime read the environment when it loaded: a value set now would only mislead)
    code = f"import torch\nfrom floe.cli.machine import polite_openmp\npolite_openmp()\n{SHOW}"
    assert child(code) == "None"


def test_a_child_processs_environment_gets_it():
    env = {"PATH": "/usr/bin"}
    polite_openmp(env)
    assert env == {"PATH": "/usr/bin", "GOMP_SPINCOUNT": GOMP_SPINS}
    mine = {"GOMP_SPINCOUNT": "0"}
    polite_openmp(mine)
    assert mine == {"GOMP_SPINCOUNT": "0"}
