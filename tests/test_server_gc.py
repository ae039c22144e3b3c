"""The engine core's cyclic collector once it serves (floe.server.fronts.settle_heap): its start-up heap
frozen, the youngest generation collected every GC_THRESHOLDS[0] new containers, FLOE_GC_THRESHOLD to
set them, a bad value refused before the model loads."""

from __future__ import annotations

import gc
import os
import subprocess
import sys

import pytest
from test_server import CONTEXT

from floe.errors import FloeError
from floe.server.heap import GC_THRESHOLDS, gc_thresholds, settle_heap


@pytest.fixture
def collector():
    """The test process's collector as it was, after the test (settle_heap freezes and sets it)."""
    before = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*before)


def test_the_default_collects_the_youngest_generation_less_often_than_python(monkeypatch):
    monkeypatch.delenv("FLOE_GC_THRESHOLD", raising=False)
    assert gc_thresholds() == GC_THRESHOLDS
    assert GC_THRESHOLDS[0] > 700 and GC_THRESHOLDS[1:] == (10, 10)


@pytest.mark.parametrize("value, expected", [("700,10,10", (700, 10, 10)), (" 20000, 5,10 ", (20000, 5, 10)),
                                             ("0,0,0", (0, 0, 0))])
def test_the_variable_sets_the_thresholds(monkeypatch, value, expected):
    monkeypatch.setenv("FLOE_GC_THRESHOLD", value)
    assert gc_thresholds() == expected


@pytest.mark.parametrize("value", ["10000", "1,2", "1,2,3,4", "a,b,c", "-1,10,10", "1.5,10,10", "1,,3"])
def test_a_bad_variable_is_a_clear_error(monkeypatch, value):
    monkeypatch.setenv("FLOE_GC_THRESHOLD", value)
    with pytest.raises(FloeError, match="FLOE_GC_THRESHOLD must be three integers"):
        gc_thresholds()


def test_settle_heap_freezes_what_exists_and_sets_the_thresholds(monkeypatch, collector):
    monkeypatch.setenv("FLOE_GC_THRESHOLD", "12345,7,9")
    kept = [[i] for i in range(1000)]  # (containers alive now: frozen with the rest)
    assert settle_heap() == (12345, 7, 9)
    assert gc.get_threshold() == (12345, 7, 9)
    assert gc.get_freeze_count() >= len(kept)
    young = {id(o) for o in gc.get_objects(generation=0)}
    assert not any(id(x) in young for x in kept)  # out of the generations the collector passes over


def test_floe_serve_refuses_a_bad_variable_before_the_model_loads(tmp_path):
    done = subprocess.run([sys.executable, "-m", "floe.cli", "serve", "--port", "0", "--snapshots",
                           str(tmp_path), "--context", str(CONTEXT)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "FLOE_GC_THRESHOLD": "lots"})
    assert done.returncode == 1, done.stderr
    assert "FLOE_GC_THRESHOLD must be three integers" in done.stderr and "Traceback" not in done.stderr
    assert "warming up" not in done.stderr  # refused before the model loaded (then its KV slots warm)
