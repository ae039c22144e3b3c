"""Probe (H200 host, issue 4): per-operation microseconds inside a Python-threaded staged upload, 1
vs 8 threads: with 8, every small step took ~100x longer (GIL hand-overs), which is why the copy and
hash moved to floe.engine.copyhash's own threads. Run: python bench/probes/thaw_gil_ops.py on a CUDA
machine; writes $OUT/upload_ops.json."""

# ruff: noqa: B023  (the probes' lambdas run inside the loop iteration that defines them)

import json
import os
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
import xxhash

H, D = 8, 64
out = {}
cache = torch.zeros(32, 3, H, 4352, D, dtype=torch.bfloat16, device="cuda")
for n in (118, 4086):
    src = [torch.randn(H, n, D).to(torch.bfloat16) for _ in range(32)]
    size = src[0].numel() * 2
    for W in (1, 8):
        bufs = [torch.empty(size, dtype=torch.uint8, pin_memory=True) for _ in range(2 * W)]
        evs = [torch.cuda.Event() for _ in bufs]
        pool = ThreadPoolExecutor(W)
        ops = {}
        lock = threading.Lock()

        def upload(w):
            mine = {}

            def m(name, t):
                t2 = time.perf_counter()
                mine.setdefault(name, 0.0)
                mine[name] += (t2 - t) * 1e6
                return t2

            t = time.perf_counter()
            with torch.cuda.device(0):
                t = m("device_ctx", t)
                for turn, j in enumerate(range(w, 32, W)):
                    b = 2 * w + turn % 2
                    buf, done = bufs[b], evs[b]
                    t = m("index", t)
                    done.synchronize()
                    t = m("event_sync", t)
                    host = buf[:size].numpy()
                    t = m("numpy_view", t)
                    s = src[j].view(torch.uint8).numpy().reshape(-1)
                    t = m("src_view", t)
                    np.copyto(host, s)
                    t = m("copyto", t)
                    xxhash.xxh3_128_hexdigest(host)
                    t = m("hash", t)
                    v = buf[:size].view(torch.bfloat16).view(H, n, D)
                    t = m("torch_view", t)
                    cache[j, 1, :, :n].copy_(v, non_blocking=True)
                    t = m("h2d_copy", t)
                    done.record()
                    t = m("event_record", t)
            with lock:
                for k, x in mine.items():
                    ops[k] = ops.get(k, 0) + x

        totals = []
        for _ in range(9):
            ops.clear()
            t = time.perf_counter()
            list(pool.map(upload, range(W)))
            torch.cuda.synchronize()
            totals.append((time.perf_counter() - t) * 1e3)
        res = {
            k: round(v / 32, 1) for k, v in ops.items()
        }  # us per tensor (last iteration), summed over threads
        res["total_ms_median"] = round(statistics.median(totals), 3)
        out[f"n{n}_w{W}"] = res
        print(n, W, res, flush=True)
json.dump(out, open(os.environ.get("OUT", ".") + "/upload_ops.json", "w"), indent=1)
