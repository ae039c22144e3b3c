"""Probe (H200 host, issue 16): the device's idle gap between the engine loop's decode steps — host
timestamps around Engine.launch_batch / finish_batch while S chat actors (default 16) each answer a
64-token prompt with 128 tokens, Llama-3.2-1B shape, seeded random weights.
Run: PYTHONPATH=src FLOE_TEST_TOKENIZER=DIR [S=16] python bench/probes/loop_gap.py on a CUDA machine."""
import gc
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import torch
from cpu_batch import actors_run, message

from floe.cli import _tokenizer
from floe.engine import Engine
from floe.model.synthetic import random_checkpoint

S = int(os.environ.get("S", "16"))
ck = random_checkpoint("llama-3.2-1b", _tokenizer(os.environ["FLOE_TEST_TOKENIZER"]), dtype=torch.bfloat16,
                       device="cuda")
engine = Engine(ck, device="cuda", dtype="bfloat16", max_seq_len=1024, n_slots=64, weights="dense")
engine.warm_up()
texts = [message(engine.tokenizer, i, 64) for i in range(64)]
actors_run(engine, texts[:1], 2, batch=True)
gc.collect()
gc.freeze()
marks = []
L, F = engine.launch_batch, engine.finish_batch


def launch(*a, **k):
    t = time.perf_counter()
    r = L(*a, **k)
    marks.append(("L", t, time.perf_counter(), len(a[1])))
    return r


def finish(*a, **k):
    t = time.perf_counter()
    r = F(*a, **k)
    marks.append(("F", t, time.perf_counter(), 0))
    return r


def q(xs):
    """p50/p90 in ms."""
    return f"{1e3 * statistics.median(xs):.3f}/{1e3 * sorted(xs)[int(.9 * len(xs))]:.3f}"


engine.launch_batch, engine.finish_batch = launch, finish
for _ in range(3):
    marks.clear()
    r = actors_run(engine, texts[:S], 128, batch=True)
    st = r["engine_loop"]
    # steady state: launches of S rows; gap = launch start - previous finish end
    gaps, lens, fins, periods = [], [], [], []
    last_f = last_l = None
    for kind, a, b, n in marks:
        if kind == "F":
            last_f = (a, b)
            fins.append(b - a)
        elif n == S and last_f is not None:
            gaps.append(a - last_f[1])
            lens.append(b - a)
            if last_l is not None:
                periods.append(a - last_l)
            last_l = a
    phases = {k: round(v * 1e3 / st["steps"], 3) for k, v in st["phase_s"].items()}
    print(f"S={S} {r['tok_s']:.0f} tok/s stream {r['stream_decode_tok_s']:.0f} ttft {r['ttft_ms']:.1f} "
          f"prepare {r['prepare_ms']:.1f}/{r['prepare_max_ms']:.1f}; ms p50/p90: finish->launch {q(gaps)} "
          f"launch {q(lens)} finish {q(fins)} period {q(periods)}; phases {phases}", flush=True)
