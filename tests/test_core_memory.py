"""The engine core's memory as it sees new prompt lengths (issue 41's soak: ~1 MB of RSS a new prompt
length that neither the glibc trim nor oneDNN's kernel cap gave back). Under PyTorch's CPU matmuls sit
two caches keyed by shape, 1,024 entries each: oneDNN's kernels and ideep's matmul descriptors
(~0.26 MB an entry, 5 shapes a prompt length on the default model). `bound_kernel_caches` caps both, so a
server's memory stops growing once its caches are full, however many lengths it sees. Each check runs in
a fresh interpreter: the caps are read at the first matmul."""

from __future__ import annotations

import json

import pytest
from isolated import run_isolated

MB = 1 << 20

# Matmuls of the engine's prompt shape (576 -> 1536, the default model's FFN) in the dtype its prefill
# uses, for `fill` row counts and then `shapes` more new ones; RSS after each phase, the heap trimmed.
MATMULS = """
import json
import torch
import torch.nn.functional as F
from floe.engine import bound_kernel_caches
from floe.engine.int4 import gemm_dtype
from floe.memory import rss_bytes, trim_heap

if CAPPED:
    bound_kernel_caches()
dtype = gemm_dtype()
weight = torch.randn(1536, 576).to(dtype)
rows = iter(range(40, 10_000))
def matmuls(n):
    for _ in range(n):
        F.linear(torch.randn(next(rows), 576).to(dtype), weight)
    trim_heap()
    return rss_bytes()
filled = matmuls(96)
print(json.dumps({"filled": filled, "after": matmuls(192), "dtype": str(dtype)}))
"""


def matmul_growth(capped: bool) -> tuple[int, str]:
    """RSS growth (bytes) over 192 new matmul shapes after 96, and the matmuls' dtype."""
    out = json.loads(run_isolated(MATMULS.replace("CAPPED", str(capped))).splitlines()[-1])
    return out["after"] - out["filled"], out["dtype"]


def test_new_matmul_shapes_stop_costing_memory_once_the_kernel_caches_are_capped():
    grown, dtype = matmul_growth(capped=False)
    if grown < 24 * MB:  # fp32 on a CPU without native bf16 products: MKL's sgemm, no cache per shape
        pytest.skip(f"this CPU's {dtype} matmuls keep nothing per shape ({grown / MB:.1f} MB over 192)")
    bounded, _ = matmul_growth(capped=True)
    # uncapped: ~50 MB (ideep's descriptors); capped: ~3 MB, the larger row counts' own buffers
    assert bounded < 10 * MB, f"{bounded / MB:.1f} MB over 192 new shapes with the caches capped " \
                              f"(uncapped: {grown / MB:.1f} MB)"


def test_an_unusable_ideep_capacity_in_the_environment_becomes_one():
    out = run_isolated("""
        import os
        os.environ["LRU_CACHE_CAPACITY"] = "0"
        os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = "7"
        from floe.engine import bound_kernel_caches
        bound_kernel_caches()
        import torch
        torch.nn.functional.linear(torch.randn(100, 576).bfloat16(), torch.randn(64, 576).bfloat16())
        print(os.environ["LRU_CACHE_CAPACITY"], os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"])
    """)
    assert out.split() == ["1", "7"]  # 0 would crash at that matmul; another capacity set is kept


@pytest.mark.slow
def test_a_core_prefilling_many_new_prompt_lengths_keeps_its_rss_flat():
    """The engine's own prefill (default model, native weights as `floe serve` runs them): 64 prompts of
    lengths it has not seen, after 32 that fill the caches. Uncapped: ~1.4 MB a length."""
    out = run_isolated("""
        import json
        from floe.engine import Engine, bound_kernel_caches
        from floe.memory import rss_bytes, trim_heap
        from floe.model import load_checkpoint

        bound_kernel_caches()
        engine = Engine(load_checkpoint(), max_seq_len=512, n_slots=1, weights="native")
        def prompts(lengths):
            for n in lengths:
                engine.kv_truncate(0)
                engine.prefill([5 + i % 1000 for i in range(n)])
            trim_heap()
            return rss_bytes()
        filled = prompts(range(40, 104, 2))
        print(json.dumps({"filled": filled, "after": prompts(range(41, 169, 2))}))
    """, timeout=600)
    rss = json.loads(out.splitlines()[-1])
    grown = rss["after"] - rss["filled"]
    assert grown < 0.1 * rss["filled"], f"RSS {rss['filled'] / MB:.0f} -> {rss['after'] / MB:.0f} MB over " \
                                        f"64 new prompt lengths"
