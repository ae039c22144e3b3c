"""Probe (H200 host, issue 4): the native copy-and-hash job alone, KVCache.start_load / load checked
and unchecked, and DMA into contiguous vs strided destinations, at 118 and 4,086 tokens (1B shape).
Run: PYTHONPATH=src python bench/probes/thaw_load.py on a CUDA machine; writes $OUT/load_probe.json.
Results: bench/results/thaw_load_probe_h200.json."""

# ruff: noqa: B023  (the probes' lambdas run inside the loop iteration that defines them)

import json
import os

import probe_timing  # bench/probes/probe_timing.py (the probes run as scripts from here)
import torch

from floe.engine import copyhash
from floe.engine.kvcache import KVCache

H, D = 8, 64
res = {}


def tm(name, fn, n=21):
    probe_timing.timed(res, name, fn, n, skip_first=True)


for n in (118, 4086):
    src = [torch.randn(H, n, D).to(torch.bfloat16) for _ in range(32)]
    pinned = torch.empty(32 * src[0].numel() * 2, dtype=torch.uint8, pin_memory=True)
    views = pinned.view(32, -1)
    dig = copyhash.digests(src)
    tm(
        f"n{n}_job_copy_hash",
        lambda: copyhash.Job(
            [[(copyhash.as_bytes(s), views[j].numpy())] for j, s in enumerate(src)]
        ).digests(),
    )
    tm(f"n{n}_job_hash_only", lambda: copyhash.Job([[(copyhash.as_bytes(s), None)] for s in src]).digests())
    tm(f"n{n}_job_1tensor", lambda: copyhash.Job([[(copyhash.as_bytes(src[0]), views[0].numpy())]]).digests())
    cfg = type("cfg", (), {"n_layers": 16, "n_kv_heads": H, "head_dim": D})
    cache = KVCache(cfg, 4352, 3, torch.bfloat16, "cuda")
    toks = list(range(n))
    tm(f"n{n}_start_load", lambda: cache.start_load(src[:16], src[16:], dig).close())
    tm(f"n{n}_load_checked", lambda: cache.load(1, src[:16], src[16:], toks, dig))
    tm(f"n{n}_load_unchecked", lambda: cache.load(1, src[:16], src[16:], toks))
    dev = torch.empty(32, H, n, D, dtype=torch.bfloat16, device="cuda")
    pv = [views[j].view(torch.bfloat16).view(H, n, D) for j in range(32)]
    tm(f"n{n}_dma_contig_32", lambda: [dev[j].copy_(pv[j], non_blocking=True) for j in range(32)])
    tm(
        f"n{n}_dma_contig_32_then_2_kernels",
        lambda: (
            [dev[j].copy_(pv[j], non_blocking=True) for j in range(32)],
            cache.k[:, 1, :, :n].copy_(dev[:16]),
            cache.v[:, 1, :, :n].copy_(dev[16:]),
        ),
    )
    tm(
        f"n{n}_dma_strided_32",
        lambda: [cache.k[j % 16, 1, :, :n].copy_(pv[j], non_blocking=True) for j in range(32)],
    )
json.dump(res, open(os.environ.get("OUT", ".") + "/load_probe.json", "w"), indent=1)
