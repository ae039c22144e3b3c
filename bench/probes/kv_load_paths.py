"""A checked KV load onto the GPU by where its tensors are: pageable host memory (copied and hashed into
the pinned staging buffer, then sent) against pinned memory (the store's pinned tier: sent from where it
lies while hashed there), beside an unchecked load from pinned memory and the bus floor (one pinned
buffer of the same bytes), interleaved, medians.

    python bench/probes/kv_load_paths.py [--shape llama-3.2-1b] [--tokens 4080] [--repeats 9]
        [--hash-threads N]

--hash-threads N: the copy-and-hash routine's threads (floe.engine.copyhash.threads(); its pool is made
at the first load, so one count a process); "hash only" then times the hashing of the pinned tensors
alone (no copy, no bus).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from floe.engine import Engine, copyhash
from floe.model.config import KNOWN_SHAPES
from floe.model.synthetic import random_checkpoint
from floe.model.tokenizer import Tokenizer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama-3.2-1b")
    ap.add_argument("--tokens", type=int, default=4080)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--tokenizer", default=None, help="a tokenizer folder (else the default model's)")
    ap.add_argument("--hash-threads", type=int, default=None)
    args = ap.parse_args()
    if args.hash_threads:
        copyhash.threads = lambda: args.hash_threads  # (before the first job makes the pool)
    if args.tokenizer:
        from floe.model.hf_folder import tokenizer_from_folder

        tok: Tokenizer = tokenizer_from_folder(__import__("pathlib").Path(args.tokenizer), {})
    else:
        from floe.model import load_checkpoint

        tok = load_checkpoint().tokenizer
    c = KNOWN_SHAPES[args.shape]
    engine = Engine(random_checkpoint(args.shape, tok, dtype=torch.bfloat16, device="cuda"), device="cuda",
                    dtype="bfloat16", max_seq_len=args.tokens + 16, n_slots=1)
    n, g = args.tokens, torch.Generator().manual_seed(0)
    k = [torch.randn(c.n_kv_heads, n, c.head_dim, generator=g).to(torch.bfloat16) for _ in range(c.n_layers)]
    v = [torch.randn(c.n_kv_heads, n, c.head_dim, generator=g).to(torch.bfloat16) for _ in range(c.n_layers)]
    pk, pv = [t.pin_memory() for t in k], [t.pin_memory() for t in v]
    digests = copyhash.digests(k + v)
    nbytes = sum(t.numel() * 2 for t in k + v)
    floor_src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    floor_dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    slot, tokens = engine.claim_slot(), list(range(n))
    ways = {
        "checked, pageable (staged)": lambda: engine.cache.load(slot, k, v, tokens, digests),
        "checked, pinned (direct)": lambda: engine.cache.load(slot, pk, pv, tokens, digests),
        "unchecked, pinned": lambda: engine.cache.load(slot, pk, pv, tokens),
        "bus floor (one pinned buffer)": lambda: floor_dst.copy_(floor_src, non_blocking=True),
        "hash only, pinned": lambda: copyhash.Job([[(copyhash.as_bytes(t), None)] for t in pk + pv])
        .digests(),
    }
    times: dict[str, list[float]] = {w: [] for w in ways}
    for r in range(args.repeats + 1):
        for way, fn in ways.items():
            torch.cuda.synchronize()
            t = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            if r:
                times[way].append(1e3 * (time.perf_counter() - t))
    out = {"shape": args.shape, "tokens": n, "kv_bytes": nbytes, "device": torch.cuda.get_device_name(),
           "hash_threads": copyhash.threads()}
    for way, ts in times.items():
        out[way] = statistics.median(ts)
        print(f"{way:32s} {statistics.median(ts):7.2f} ms (min {min(ts):.2f})")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
