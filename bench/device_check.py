"""One run on a CUDA machine: bandwidths, the zero-copy probe on the device, CUDA engine against the
CPU fp32 engine, snapshot migration CPU <-> CUDA, and snapshot thaw vs re-prefill at the
Llama-3.2-1B shape. Random seeded weights; the tokenizer from a folder (tokenizer.json).

    python bench/device_check.py --tokenizer DIR [--out results.json]
"""

from __future__ import annotations

import argparse
import atexit
import json
import shutil
import statistics
import tempfile
import time
import traceback
from pathlib import Path

import torch

from floe import snapshot
from floe.actor import Actor
from floe.bench import timed as events_time
from floe.engine import Engine
from floe.model.hf_folder import tokenizer_from_folder
from floe.model.synthetic import random_checkpoint

RESULTS: dict = {}


def section(name):
    def wrap(fn):
        def run(*args):
            t = time.perf_counter()
            try:
                RESULTS[name] = fn(*args)
            except Exception as e:  # noqa: BLE001 - record and go on to the next section
                RESULTS[name] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
            RESULTS[name + "_s"] = time.perf_counter() - t
            print(f"== {name}: {json.dumps(RESULTS[name])[:1500]}", flush=True)

        return run

    return wrap


@section("bandwidth")
def bandwidth():
    n = 1 << 30
    src, dst = (
        torch.empty(n, dtype=torch.uint8, device="cuda"),
        torch.empty(n, dtype=torch.uint8, device="cuda"),
    )
    src.random_()
    d2d = 2 * n / events_time(lambda: dst.copy_(src), 20)
    pinned = torch.empty(n // 4, dtype=torch.uint8).pin_memory()
    pageable = torch.empty(n // 4, dtype=torch.uint8)
    h2d_pinned = n / 4 / events_time(lambda: dst[: n // 4].copy_(pinned, non_blocking=True), 20)
    h2d_pageable = n / 4 / events_time(lambda: dst[: n // 4].copy_(pageable), 5)
    return {
        "d2d_gb_s": d2d / 1e9,
        "h2d_pinned_gb_s": h2d_pinned / 1e9,
        "h2d_pageable_gb_s": h2d_pageable / 1e9,
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
    }


@section("probe_zero_copy_cuda")
def probe():
    from floe.probe import probe_zero_copy

    return probe_zero_copy("cuda")


@section("cuda_vs_cpu_logits")
def cuda_vs_cpu(tok):
    ids = tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    cpu = Engine(random_checkpoint("smollm2-135m", tok, dtype=torch.float32), max_seq_len=512)
    gpu = Engine(
        random_checkpoint("smollm2-135m", tok, dtype=torch.bfloat16),
        device="cuda",
        dtype="bfloat16",
        max_seq_len=512,
    )
    ref, out = cpu.prefill(ids), gpu.prefill(ids).cpu()
    tokens = {"cpu": [], "cuda": []}
    for name, eng, logits in (("cpu", cpu, ref), ("cuda", gpu, out)):
        for _ in range(32):
            tokens[name].append(int(logits.argmax()))
            logits = eng.decode_step(tokens[name][-1])
    agree = sum(a == b for a, b in zip(tokens["cpu"], tokens["cuda"], strict=True))
    return {
        "rel_error": float((out - ref).norm() / ref.norm()),
        "max_abs": float((out - ref).abs().max()),
        "argmax_equal": int(out.argmax()) == int(ref.argmax()),
        "greedy_agreement_32": agree,
    }


@section("migration")
def migration(tok):
    out = {}
    folder = Path(tempfile.mkdtemp())
    atexit.register(shutil.rmtree, folder, ignore_errors=True)  # snapshots are big
    engines = {
        "cpu": Engine(random_checkpoint("smollm2-135m", tok, dtype=torch.float32), max_seq_len=512),
        "cuda": Engine(
            random_checkpoint("smollm2-135m", tok, dtype=torch.float32), device="cuda", max_seq_len=512
        ),
    }
    for src, dst in (("cpu", "cuda"), ("cuda", "cpu")):
        with Actor(engines[src]) as a:
            a.send("Tell me about the sea.", max_tokens=8)
            snapshot.freeze(a, folder / f"{src}.safetensors")
            straight = a.send("And the sky?", max_tokens=16).stats.token_ids
        with snapshot.thaw(engines[dst], folder / f"{src}.safetensors") as b:
            moved = b.send("And the sky?", max_tokens=16).stats.token_ids
        with snapshot.thaw(engines[src], folder / f"{src}.safetensors") as c:
            same = c.send("And the sky?", max_tokens=16).stats.token_ids
        out[f"{src}->{dst}"] = {
            "greedy_agreement": sum(x == y for x, y in zip(straight, moved, strict=False)),
            "of": len(straight),
            "same_device_identical": same == straight,
        }
    return out


@section("snapshot_1b")
def snapshot_1b(tok, h2d_gb_s):
    engine = Engine(
        random_checkpoint("llama-3.2-1b", tok, dtype=torch.bfloat16, device="cuda"),
        device="cuda",
        dtype="bfloat16",
        max_seq_len=4352,
        n_slots=3,
    )
    folder = Path(tempfile.mkdtemp())
    atexit.register(shutil.rmtree, folder, ignore_errors=True)  # snapshots are big
    rows = []
    base = tok.encode("The keeper wrote down the weather, the ships that passed, and the sea. " * 500)
    for n in (128, 512, 1024, 2048, 4096):
        text = tok.decode(base[: n - 40])
        with Actor(engine) as a:
            a.send(text, max_tokens=1)
            kv_len, tokens = engine.kv_len(a.slot), list(engine.cache.tokens[a.slot])
            t = time.perf_counter()
            info = snapshot.freeze(a, folder / f"{n}.safetensors")
            freeze_s = time.perf_counter() - t

        def thaw(p=folder / f"{n}.safetensors"):
            snapshot.thaw(engine, p).close()
            torch.cuda.synchronize()

        thaw()
        thaw_times = []
        for _ in range(5):
            t = time.perf_counter()
            thaw()
            thaw_times.append(time.perf_counter() - t)
        slot = engine.claim_slot()

        def prefill(s=slot, ids=tokens):
            engine.kv_truncate(0, s)
            engine.prefill(ids, s)

        prefill_s = events_time(prefill, 3)
        engine.release_slot(slot)
        kv_bytes = 2 * 16 * 8 * kv_len * 64 * 2
        rows.append(
            {
                "tokens": kv_len,
                "file_bytes": info["bytes"],
                "kv_bytes": kv_bytes,
                "freeze_ms": freeze_s * 1e3,
                "thaw_ms": statistics.median(thaw_times) * 1e3,
                "reprefill_ms": prefill_s * 1e3,
                "h2d_floor_ms": kv_bytes / (h2d_gb_s * 1e9) * 1e3,
            }
        )
        print(rows[-1], flush=True)
    return rows


@section("decode_1b")
def eager_decode(tok):
    engine = Engine(
        random_checkpoint("llama-3.2-1b", tok, dtype=torch.bfloat16, device="cuda"),
        device="cuda",
        dtype="bfloat16",
        max_seq_len=1024,
    )
    engine.prefill(list(range(100, 356)))

    def step_once():
        engine.decode_step(300)
        engine.kv_truncate(256)

    step = events_time(step_once, 50)
    with Actor(engine) as a:
        r = a.send("Write a story.", max_tokens=64)
    return {
        "host_ms_per_token": step * 1e3,
        "host_tok_s": 1 / step,
        "guest_tok_s": r.stats.decode_tokens_per_s,
        "guest_outside_engine_ms_per_step": r.stats.outside_engine_s / r.stats.forwards * 1e3,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", type=Path, required=True)
    ap.add_argument("--out", type=Path, default=Path("device_check.json"))
    ap.add_argument("--only-1b", action="store_true", help="bandwidth and the 1B sections only")
    args = ap.parse_args()
    tok = tokenizer_from_folder(args.tokenizer, {})
    bandwidth()
    if not args.only_1b:
        probe()
        cuda_vs_cpu(tok)
        migration(tok)
    h2d = RESULTS.get("bandwidth", {}).get("h2d_pinned_gb_s", 50.0)
    snapshot_1b(tok, h2d)
    eager_decode(tok)
    args.out.write_text(json.dumps(RESULTS, indent=2))


if __name__ == "__main__":
    main()
