"""Probe (H200 host, issue 4): ways to get a 134 MB page-cached file hashed and onto the GPU with
Python threads: fresh mmap + hash, pread into a ring of pinned buffers + hash + DMA, by thread count.
Medians of 7, ms. Run on a CUDA machine: python bench/probes/thaw_pread_ring.py;
writes $OUT/stream_probe.json.
Results: bench/results/thaw_stream_probe_h200.json ("pread_ring_pipeline")."""

# ruff: noqa: B023  (the probes' lambdas run inside the loop iteration that defines them)

import json
import mmap
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import probe_timing  # bench/probes/probe_timing.py (the probes run as scripts from here)
import torch
import xxhash

OUT = os.environ.get("OUT", ".")
N_T, T_BYTES = 32, 4086 * 8 * 64 * 2  # 1B shape, 4,086 tokens: 32 tensors of 4.18 MB
path = "/tmp/probe.bin"
with open(path, "wb") as f:
    f.write(np.random.default_rng(0).integers(0, 255, N_T * T_BYTES, dtype=np.uint8).tobytes())
os.sync() if hasattr(os, "sync") else None
dev = torch.empty(N_T * T_BYTES, dtype=torch.uint8, device="cuda")
res = {"cpus": os.cpu_count(), "bytes": N_T * T_BYTES}


def timed(name, fn, n=7):
    probe_timing.timed(res, name, fn, n)


pinned_all = torch.empty(N_T * T_BYTES, dtype=torch.uint8, pin_memory=True)
timed("dma_floor_one_copy", lambda: dev.copy_(pinned_all, non_blocking=True))
timed(
    "dma_floor_32_copies",
    lambda: [
        dev[j * T_BYTES : (j + 1) * T_BYTES].copy_(
            pinned_all[j * T_BYTES : (j + 1) * T_BYTES], non_blocking=True
        )
        for j in range(N_T)
    ],
)


def mmap_hash(workers, populate=False):
    pool = ThreadPoolExecutor(workers)

    def run():
        with open(path, "rb") as f:
            flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
            m = mmap.mmap(f.fileno(), 0, flags=flags, prot=mmap.PROT_READ)
        a = np.frombuffer(m, dtype=np.uint8)
        list(pool.map(lambda j: xxhash.xxh3_128_hexdigest(a[j * T_BYTES : (j + 1) * T_BYTES]), range(N_T)))
        a = None  # noqa: F841 - drop the view before the map closes

    return run


for w in (1, 8):
    timed(f"mmap_fresh_hash_w{w}", mmap_hash(w))
timed("mmap_populate_hash_w8", mmap_hash(8, True))
fd = os.open(path, os.O_RDONLY)


def pread_pipeline(workers, sub, piece=T_BYTES // 2, hash_=True, dma=True):
    pool = ThreadPoolExecutor(workers)
    bufs = [
        [torch.empty(piece, dtype=torch.uint8, pin_memory=True) for _ in range(2)] for _ in range(workers)
    ]
    events = [[torch.cuda.Event() for _ in range(2)] for _ in range(workers)]

    def work(w):
        k = 0
        for j in range(w, N_T, workers):
            h = xxhash.xxh3_128()
            for p0 in range(0, T_BYTES, piece):
                b, e = bufs[w][k % 2], events[w][k % 2]
                k += 1
                e.synchronize()
                n = min(piece, T_BYTES - p0)
                mv = memoryview(b.numpy())[:n]
                for s0 in range(0, n, sub):
                    s1 = min(n, s0 + sub)
                    os.preadv(fd, [mv[s0:s1]], j * T_BYTES + p0 + s0)
                    if hash_:
                        h.update(mv[s0:s1])
                if dma:
                    dev[j * T_BYTES + p0 : j * T_BYTES + p0 + n].copy_(b[:n], non_blocking=True)
                    e.record()
            h.hexdigest()

    def run():
        list(pool.map(work, range(workers)))

    return run


for w in (4, 8, 12, 16):
    timed(f"pread_hash_dma_w{w}_sub512k", pread_pipeline(w, 1 << 19))
timed("pread_hash_dma_w8_sub2m", pread_pipeline(8, 1 << 21))
timed("pread_hash_dma_w8_sub128k", pread_pipeline(8, 1 << 17))
timed("pread_only_w8", pread_pipeline(8, 1 << 19, hash_=False, dma=False))
timed("pread_hash_w8", pread_pipeline(8, 1 << 19, dma=False))
timed("pread_dma_w8", pread_pipeline(8, 1 << 19, hash_=False))
timed("pread_hash_dma_w8_piece1m", pread_pipeline(8, 1 << 19, piece=1 << 20))
# pinned buffers already allocated: a hash of pinned memory only (no read), for the hash's own speed
timed(
    "hash_pinned_w8",
    lambda: list(
        ThreadPoolExecutor(8).map(
            lambda j: xxhash.xxh3_128_hexdigest(pinned_all[j * T_BYTES : (j + 1) * T_BYTES].numpy()),
            range(N_T),
        )
    ),
)
json.dump(res, open(f"{OUT}/stream_probe.json", "w"), indent=1)
