"""Probe (H200, issue 22): the host's share of a 2,048-token prefill at the 1B shape — torch.profiler's
CPU view (ops by self CPU time) and the time before the first kernel.
Run: PYTHONPATH=src FLOE_TEST_TOKENIZER=DIR python bench/probes/prefill_host.py"""
import os
import time

import torch

from floe.cli import _tokenizer
from floe.engine import Engine
from floe.model.synthetic import random_checkpoint

ck = random_checkpoint("llama-3.2-1b", _tokenizer(os.environ["FLOE_TEST_TOKENIZER"]), dtype=torch.bfloat16,
                       device="cuda")
engine = Engine(ck, device="cuda", dtype="bfloat16", max_seq_len=2304, n_slots=2)
ids = list(range(100, 2148))


def run():
    engine.kv_truncate(0)
    engine.prefill(ids)


with torch.inference_mode():
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    for label, fn in [("kv_truncate", lambda: engine.kv_truncate(0)),
                      ("as_tensor", lambda: torch.as_tensor(ids)),
                      ("check_ids", lambda: engine._check_ids(ids)),
                      ("tolist", lambda: torch.as_tensor(ids).tolist())]:
        t = time.perf_counter()
        for _ in range(20):
            fn()
        print(f"{label}: {(time.perf_counter() - t) / 20 * 1e6:.0f} us")
    walls = []
    for _ in range(5):
        torch.cuda.synchronize()
        t = time.perf_counter()
        run()
        h = time.perf_counter()
        torch.cuda.synchronize()
        e = time.perf_counter()
        walls.append((1e3 * (h - t), 1e3 * (e - t)))
    print("host returns / all done (ms):", walls)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        run()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
    prof.export_chrome_trace(os.path.join(os.environ.get("OUT", "."), "prefill_1b_trace.json"))
