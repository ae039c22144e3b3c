"""Probe (CPU, issue 16): 8 chat actors at once, 64-token prompts, 32 tokens out, through one engine loop,
with the arrivals' prompts prefilled in one forward (Engine.prompts_together) and one by one, interleaved
three times. Run: PYTHONPATH=src python bench/probes/cpu_prompts_together.py"""
import statistics
import sys

sys.path.insert(0, "bench")
import torch
from cpu_batch import actors_run, message

from floe.engine import Engine
from floe.model import load_checkpoint

torch.set_num_threads(2)
e = Engine(load_checkpoint(), max_seq_len=1024, n_slots=8, weights="native")
e.warm_up()
texts = [message(e.tokenizer, i, 64) for i in range(8)]
actors_run(e, texts[:2], 2, batch=True)
res = {True: [], False: []}
orig = Engine.prompts_together
for _ in range(3):
    for on in (True, False):
        Engine.prompts_together = orig if on else property(lambda self: False)
        r = actors_run(e, texts, 32, batch=True)
        phases = r["engine_loop"]["phase_s"]
        res[on].append((r["tok_s"], r["ttft_ms"], phases["prefill"], phases["launch"]))
        print(on, [round(x, 2) for x in res[on][-1]], flush=True)
for on in (True, False):
    print("together" if on else "one by one", "tok/s median", statistics.median(x[0] for x in res[on]),
          "TTFT median", statistics.median(x[1] for x in res[on]))
