"""Freeze, thaw and file size of a whole actor against re-prefilling its context, by context length.

    python bench/snapshot.py [--lengths 128 512 1024 2048 4096] [--dtype float32] [--threads 2]

The actor is the default chat guest on the default model (CPU). "Thaw" is floe.snapshot.thaw end to
end: read, verify the checksum and every field, new guest instance, restore memory, globals, KV and RNG.
"Re-prefill" is what a server without snapshots pays: prefilling the same tokens again. The int8
rows add greedy agreement (32 tokens) and the max logit error after thawing against the fp32 file.
Prints a table; writes bench/results/snapshot.json.
"""

from __future__ import annotations

import argparse
import atexit
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from smoke import results, shrink

from floe import snapshot
from floe.actor import Actor
from floe.engine import Engine
from floe.model import load_checkpoint

SENTENCE = "The keeper wrote down the weather, the ships that passed, and the colour of the sea. "


def text_of_tokens(engine: Engine, n: int) -> str:
    ids = engine.tokenizer.encode(SENTENCE * (n // 10 + 10))
    return engine.tokenizer.decode(ids[: max(1, n - 40)])  # the chat template adds ~35 tokens


def timed(fn, repeats: int) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeats):
        t = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), result


def continuation(actor: Actor, n: int = 32) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens after the thawed context, and the first step's logits."""
    engine, slot = actor.engine, actor.slot
    first = None
    tokens = []
    logits = engine.prefill([engine.cache.tokens[slot][-1]], slot)  # re-feed the last token
    for _ in range(n):
        if first is None:
            first = logits.clone()
        tokens.append(int(logits.argmax()))
        logits = engine.decode_step(tokens[-1], slot)
    return tokens, first


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 1024, 2048, 4096])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=2)
    args = shrink(ap.parse_args(), lengths=[64])
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    engine = Engine(load_checkpoint(dtype=dtype), dtype=dtype, max_seq_len=max(args.lengths) + 256, n_slots=4)
    rows = []
    folder = Path(tempfile.mkdtemp(prefix="floe-bench-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)  # snapshots are big
    for n in args.lengths:
        with Actor(engine) as actor:
            actor.send(text_of_tokens(engine, n), max_tokens=1)
            kv_len = engine.kv_len(actor.slot)
            tokens = list(engine.cache.tokens[actor.slot])
            path, path8 = folder / f"{n}.safetensors", folder / f"{n}.int8.safetensors"
            freeze_s, info = timed(lambda a=actor, p=path: snapshot.freeze(a, p), 3)
            freeze8_s, info8 = timed(lambda a=actor, p=path8: snapshot.freeze(a, p, kv_dtype="int8"), 3)

        def thaw(p=path):
            a = snapshot.thaw(engine, p)
            a.close()

        thaw(), thaw(path8)  # warm the page cache and the module cache alike for every row
        thaw_s, _ = timed(thaw, 5)
        thaw8_s, _ = timed(lambda p=path8: thaw(p), 5)

        slot = engine.claim_slot()
        try:

            def prefill(s=slot, ids=tokens):
                engine.kv_truncate(0, s)
                engine.prefill(ids, s)

            prefill_s, _ = timed(prefill, 2 if n <= 1024 else 1)
        finally:
            engine.release_slot(slot)

        with snapshot.thaw(engine, path) as a, snapshot.thaw(engine, path8) as b:
            ref_tokens, ref_logits = continuation(a)
            q_tokens, q_logits = continuation(b)
        agree = sum(x == y for x, y in zip(ref_tokens, q_tokens, strict=True)) / len(ref_tokens)
        rows.append(
            {
                "tokens": kv_len,
                "file_bytes": info["bytes"],
                "freeze_ms": freeze_s * 1e3,
                "thaw_ms": thaw_s * 1e3,
                "reprefill_ms": prefill_s * 1e3,
                "thaw_speedup": prefill_s / thaw_s,
                "int8_file_bytes": info8["bytes"],
                "int8_freeze_ms": freeze8_s * 1e3,
                "int8_thaw_ms": thaw8_s * 1e3,
                "int8_greedy_agreement": agree,
                "int8_max_logit_error": float((ref_logits - q_logits).abs().max()),
            }
        )
        r = rows[-1]
        print(
            f"{r['tokens']:>6} tokens  file {r['file_bytes'] / 1e6:7.2f} MB  "
            f"freeze {r['freeze_ms']:7.1f} ms  "
            f"thaw {r['thaw_ms']:7.1f} ms  re-prefill {r['reprefill_ms']:8.1f} ms  "
            f"×{r['thaw_speedup']:6.1f}  | int8 {r['int8_file_bytes'] / 1e6:6.2f} MB  "
            f"thaw {r['int8_thaw_ms']:6.1f} ms  agree {100 * agree:5.1f} %  "
            f"max logit err {r['int8_max_logit_error']:.3f}",
            flush=True,
        )
    out = results(Path(__file__).parent / "results" / "snapshot.json")
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"dtype": args.dtype, "threads": args.threads, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
