"""floe's commands keep PyTorch's OpenMP threads from spinning long at the end of a parallel region, and
spinning as long in every thread that runs regions (floe.cli.machine.polite_openmp): set before torch
is imported, never over a value the user set."""

from __future__ import annotations

import os
import subprocess
import sys

from floe.cli.machine import GOMP_SPINS, OMP_WAIT, polite_openmp

OURS = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")


def child(code: str, stderr: bool = False, **env: str) -> str:
    """What `code` prints (or writes to stderr) in a fresh interpreter whose environment has neither of
    the two variables but from `env`."""
    base = {k: v for k, v in os.environ.items() if k not in OURS}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**base, **env})
    assert done.returncode == 0, done.stderr
    return (done.stderr if stderr else done.stdout).strip()


SHOW = "import os; print(os.environ.get('GOMP_SPINCOUNT'), os.environ.get('OMP_WAIT_POLICY'))"


def test_the_floe_command_sets_it_before_torch_is_imported():
    out = child("import sys\nfrom floe.cli import main\ntry:\n    main(['--help'])\n"
                "except SystemExit:\n    pass\nprint('torch' in sys.modules, end=' ')\n" + SHOW)
    assert out.splitlines()[-1] == f"False {GOMP_SPINS} {OMP_WAIT}"


def test_pytorchs_openmp_runtime_reads_them():
    # (libgomp prints what it read as it loads; ACTIVE keeps GOMP_SPINCOUNT's spins in a second
    # thread's team too, where it would otherwise spin 100 times: bench/probes/omp_threads.py)
    code = "from floe.cli.machine import polite_openmp\npolite_openmp()\nimport torch\n"
    shown = child(code, stderr=True, OMP_DISPLAY_ENV="VERBOSE")
    assert f"OMP_WAIT_POLICY = '{OMP_WAIT}'" in shown
    assert f"GOMP_SPINCOUNT = '{GOMP_SPINS}'" in shown


def test_a_value_the_user_set_is_kept():
    # (either of them: the user has taken the runtime's waits into their own hands)
    code = f"from floe.cli.machine import polite_openmp\npolite_openmp()\n{SHOW}"
    assert child(code, GOMP_SPINCOUNT="300000") == "300000 None"
    assert child(code, OMP_WAIT_POLICY="PASSIVE") == "None PASSIVE"


def test_after_torch_is_imported_it_is_left_alone():
    # (its OpenMP runtime read the environment when it loaded: a value set now would only mislead)
    code = f"import torch\nfrom floe.cli.machine import polite_openmp\npolite_openmp()\n{SHOW}"
    assert child(code) == "None None"


def test_a_child_processs_environment_gets_it():
    env = {"PATH": "/usr/bin"}
    polite_openmp(env)
    assert env == {"PATH": "/usr/bin", "GOMP_SPINCOUNT": GOMP_SPINS, "OMP_WAIT_POLICY": OMP_WAIT}
    mine = {"GOMP_SPINCOUNT": "0"}
    polite_openmp(mine)
    assert mine == {"GOMP_SPINCOUNT": "0"}
