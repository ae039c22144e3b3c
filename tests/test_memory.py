"""Regions: page-aligned, growable in place, zero-copy views, bounds checks, resident memory."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from floe.memory import PAGE, OutOfBounds, Region, RegionError, rss_bytes


def test_base_is_page_aligned_and_never_moves_on_growth():
    r = Region(PAGE, capacity=64 * PAGE)
    base = r.base
    assert base % PAGE == 0
    r.numpy(0, 4)[:] = [1, 2, 3, 4]
    r.grow(40 * PAGE)
    assert r.base == base and r.size == 40 * PAGE
    assert r.numpy(0, 4).tolist() == [1, 2, 3, 4]
    assert r.numpy(39 * PAGE, 8).tolist() == [0] * 8  # new pages read as zero
    r.close()


def test_views_alias_the_same_bytes():
    r = Region(4 * PAGE)
    t = r.torch(128, 16, torch.float32)
    a = r.numpy(128, 16, np.float32)
    assert t.data_ptr() == r.base + 128 == a.ctypes.data
    t[:] = torch.arange(16.0)
    assert a.tolist() == list(map(float, range(16)))
    a[3] = -1.0
    assert t[3].item() == -1.0
    r.close()


def test_out_of_bounds_and_growth_limits_are_errors():
    r = Region(PAGE, capacity=4 * PAGE)
    with pytest.raises(OutOfBounds, match="outside the 4096 accessible bytes"):
        r.numpy(PAGE - 4, 2, np.float32)
    with pytest.raises(OutOfBounds):
        r.check(-1, 1)
    with pytest.raises(RegionError, match="limit is"):
        r.grow(5 * PAGE)
    assert r.denied_size == 5 * PAGE
    r.limit, r.denied_size = 2 * PAGE, 0
    with pytest.raises(RegionError):
        r.grow(3 * PAGE)
    assert r.denied_size == 3 * PAGE and r.size == PAGE
    r.close()
    with pytest.raises(RegionError, match="closed"):
        r.numpy(0, 1)


def test_untouched_region_costs_no_resident_memory():
    before = rss_bytes()
    r = Region(256 << 20)
    assert rss_bytes() - before < 4 << 20
    r.numpy(0, 64 << 20).fill(1)
    assert rss_bytes() - before > 60 << 20
    r.zero()
    assert r.numpy(0, 8).tolist() == [0] * 8
    r.close()


def test_probe_zero_copy_json_on_cpu():
    proc = subprocess.run([sys.executable, "-m", "floe.cli", "probe", "zero-copy", "--json"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout)
    assert r["device"] == "cpu" and r["pointer_identity"] is True
    assert r["rss_delta_zero_copy_mb"] < 1.0 < 15.0 < r["rss_delta_copy_mb"]
    assert r["gemm_max_abs_error"] == 0.0 and r["gemm_mismatches"] == 0


def test_registration_refuses_devices_it_cannot_map():
    r = Region(PAGE)
    with pytest.raises(RegionError, match="device meta"):
        r.register("meta")
    assert r.register("cpu") == r.base  # the CPU sees it where it is
    if not torch.cuda.is_available():  # on a GPU machine tests/test_cuda.py registers for real
        with pytest.raises(RegionError, match="no usable CUDA device"):
            r.register("cuda")
    r.close()
