"""Probe (H200 host, issue 4): whole-tensor copy (page cache -> pinned) + xxh3 + DMA with Python
threads, each alone and together, by thread count. Medians of 7, ms. Run after thaw_pread_ring.py
(it reuses its /tmp/probe.bin, or writes one). Results: bench/results/thaw_stream_probe_h200.json
("whole_tensor_copy_hash_dma")."""

# ruff: noqa: B023  (the probes' lambdas run inside the loop iteration that defines them)

import json
import mmap
import os
from concurrent.futures import ThreadPoolExecutor, as_completed

import numpy as np
import probe_timing  # bench/probes/probe_timing.py (the probes run as scripts from here)
import torch
import xxhash

OUT = os.environ.get("OUT", ".")
N_T, T_BYTES = 32, 4086 * 8 * 64 * 2
path = "/tmp/probe.bin"
if not os.path.exists(path):
    with open(path, "wb") as f:
        f.write(np.random.default_rng(0).integers(0, 255, N_T * T_BYTES, dtype=np.uint8).tobytes())
dev = torch.empty(N_T * T_BYTES, dtype=torch.uint8, device="cuda")
pinned = torch.empty(N_T * T_BYTES, dtype=torch.uint8, pin_memory=True)
pin_np = pinned.numpy()
res = {}


def timed(name, fn, n=7):
    probe_timing.timed(res, name, fn, n)


def src(populate=False):
    with open(path, "rb") as f:
        m = mmap.mmap(
            f.fileno(), 0, flags=mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0), prot=mmap.PROT_READ
        )
    return m, np.frombuffer(m, dtype=np.uint8)


pools = {w: ThreadPoolExecutor(w) for w in (4, 8, 12, 16)}


def variant(w, copy=True, hash_=True, dma="worker", order="copy_first", sub=0, populate=False):
    pool = pools[w]

    def run():
        m, a = src(populate)

        def one(j):
            s, d = a[j * T_BYTES : (j + 1) * T_BYTES], pin_np[j * T_BYTES : (j + 1) * T_BYTES]
            h = xxhash.xxh3_128()
            if sub:
                for o in range(0, T_BYTES, sub):
                    np.copyto(d[o : o + sub], s[o : o + sub])
                    h.update(d[o : o + sub])
            else:
                if hash_ and order == "hash_first":
                    h.update(s)
                if copy:
                    np.copyto(d, s)
                if hash_ and order == "copy_first":
                    h.update(d if copy else s)
            if dma == "worker":
                dev[j * T_BYTES : (j + 1) * T_BYTES].copy_(
                    pinned[j * T_BYTES : (j + 1) * T_BYTES], non_blocking=True
                )
            return j

        futs = [pool.submit(one, j) for j in range(N_T)]
        for f in as_completed(futs):
            j = f.result()
            if dma == "main":
                dev[j * T_BYTES : (j + 1) * T_BYTES].copy_(
                    pinned[j * T_BYTES : (j + 1) * T_BYTES], non_blocking=True
                )
        a = None  # noqa: F841 - drop the view before the map closes
        m.close()

    return run


timed("hash_only_w8", variant(8, copy=False, dma=None))
timed("copy_only_w8", variant(8, hash_=False, dma=None))
timed("copy_only_w8_populate", variant(8, hash_=False, dma=None, populate=True))
timed("copy_only_w16", variant(16, hash_=False, dma=None))
timed("copy_hash_w8", variant(8, dma=None))
timed("copy_dma_w8", variant(8, hash_=False))
timed("copy_hash_dma_w8", variant(8))
timed("copy_hash_dma_w8_main", variant(8, dma="main"))
timed("hashfirst_copy_dma_w8", variant(8, order="hash_first"))
timed("sub256k_dma_w8", variant(8, sub=1 << 18))
timed("sub1m_dma_w8", variant(8, sub=1 << 20))
for w in (4, 12, 16):
    timed(f"copy_hash_dma_w{w}", variant(w))
timed("copy_hash_dma_w8_populate", variant(8, populate=True))
timed("dma_only_from_pinned", lambda: dev.copy_(pinned, non_blocking=True))
json.dump(res, open(f"{OUT}/stream_probe2.json", "w"), indent=1)
