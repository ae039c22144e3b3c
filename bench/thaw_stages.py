"""Where a thaw's time goes, stage by stage: on CUDA the Llama-3.2-1B shape (seeded random bf16 weights),
on the CPU the default model (native weights, 2 threads); ~4,090 tokens of context unless --tokens.

    python bench/thaw_stages.py [--tokenizer .device/tokenizer] [--tokens 4050]   # on a CUDA machine
    python bench/thaw_stages.py --device cpu [--tokens 128]

Medians of 5, with a device synchronize after each stage (CUDA). The floor: the KV bytes copied once,
host→device from one pinned buffer (CUDA) or between two buffers (the CPU). Writes $OUT/thaw_stages.json, or
$OUT/thaw_stages_{tokens}.json when --tokens is given (OUT defaults to the current folder).
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from floe import snapshot
from floe.actor import Actor
from floe.engine import Engine
from floe.model import load_checkpoint
from floe.model.hf_folder import tokenizer_from_folder
from floe.model.synthetic import random_checkpoint
from floe.snapshot import Snapshot, checksum_v1
from floe.snapshot.file import _digests, _map_safetensors


def timed(fn, n: int = 5):
    times, result = [], None
    for _ in range(n):
        t = time.perf_counter()
        result = fn()
        if torch.cuda.is_initialized():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3, result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", default=".device/tokenizer")
    ap.add_argument("--tokens", type=int, default=None, help="context tokens to freeze (default ~4,050)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = ap.parse_args()
    cuda = args.device == "cuda"
    if cuda:
        tok = tokenizer_from_folder(Path(args.tokenizer), {})
        ckpt = random_checkpoint("llama-3.2-1b", tok, dtype=torch.bfloat16, device="cuda")
        engine = Engine(ckpt, device="cuda", dtype="bfloat16", max_seq_len=4352, n_slots=3)
    else:
        torch.set_num_threads(2)
        engine = Engine(load_checkpoint(), device="cpu", max_seq_len=4352, n_slots=3, weights="native")
        tok = engine.tokenizer
    dtype = engine.dtype
    text = tok.decode(tok.encode("The keeper wrote down the weather, the ships and the sea. " * 500)
                      [:args.tokens or 4050])
    folder = tempfile.mkdtemp()
    atexit.register(shutil.rmtree, folder, ignore_errors=True)  # snapshots are big
    path = Path(folder) / "a.safetensors"
    with Actor(engine) as actor:
        actor.send(text, max_tokens=1)
        snapshot.freeze(actor, path)
        tokens = engine.kv_len(actor.slot)
    res = {"tokens": tokens}
    res["map_only_ms"], (meta, tensors, _) = timed(lambda: _map_safetensors(path))
    res["checksum_v1_ms"], _ = timed(lambda: checksum_v1(tensors, meta))  # one pass, format 1
    res["digests_parallel_ms"], _ = timed(lambda: _digests(tensors, list(tensors)))  # every tensor
    # What a thaw does now, stage by stage (floe.snapshot.thaw):
    res["Snapshot_header_ms"], snap = timed(lambda: Snapshot(path, contents=False))
    kv = tuple(snap.kv_names())
    res["check_small_ms"], _ = timed(lambda: snap.check_contents(skip=kv))
    res["state_ms"], state = timed(lambda: snap.state(dtype))
    res["actor_new_ms"], _ = timed(lambda: Actor(engine).close())
    actor = Actor(engine)
    load = engine.cache.load
    res["kv_load_checked_ms"], _ = timed(lambda: load(actor.slot, state.k, state.v, state.tokens,
                                                      snap.kv_digests()))
    res["kv_load_unchecked_ms"], _ = timed(lambda: load(actor.slot, state.k, state.v, state.tokens))
    if cuda:
        pinned_k, pinned_v = [x.pin_memory() for x in state.k], [x.pin_memory() for x in state.v]
        res["kv_load_pinned_ms"], _ = timed(lambda: load(actor.slot, pinned_k, pinned_v, state.tokens))
    res["restore_checked_ms"], _ = timed(
        lambda: actor.restore(state, engine.cache.start_load(state.k, state.v, snap.kv_digests())))
    res["guest_memory_mb"] = state.memory_data.nbytes / 1e6
    actor.close()
    nbytes = sum(t.numel() * t.element_size() for t in state.k + state.v)
    src = torch.ones(nbytes, dtype=torch.uint8, pin_memory=cuda)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=args.device)
    floor = "h2d_floor_ms" if cuda else "copy_floor_ms"
    res[floor], _ = timed(lambda: dst.copy_(src, non_blocking=cuda), 9)
    res["kv_bytes"] = nbytes
    res["thaw_total_ms"], _ = timed(lambda: snapshot.thaw(engine, path).close(), 9)
    res["thaw_over_floor"] = res["thaw_total_ms"] / res[floor]
    print(json.dumps(res, indent=1))
    name = f"thaw_stages{'' if cuda else '_cpu'}{f'_{args.tokens}' if args.tokens else ''}.json"
    Path(os.environ.get("OUT", "."), name).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
