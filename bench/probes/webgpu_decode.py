"""Batch-1 decode at a real shape on WebGPU next to the CUDA path, in one process, on the same seeded
random weights (issue 21): the CUDA engine (bf16, graphs: `floe bench decode`'s "floe" row) first,
then WebGPU decoders over one float32 host model (the same bf16 values): layouts, weight formats,
the deep plan vs six dispatches a layer (five before the attention in splits) vs unfused. Each row:
tok/s (wall clock, median), the host's record + submit share of a step and the wait, dispatches per
token, greedy agreement with CUDA, and each kind of dispatch's device time (op_times).
The JSON is rewritten after every row, so a run cut short keeps what it measured.

    python bench/probes/webgpu_decode.py --shape llama-3.2-1b --tokenizer .tok --out decode.json
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import time
import traceback

import torch

CONTEXT = 256  # tokens in the cache while decode is timed (floe.bench.CONTEXT)


def cuda_row(checkpoint, agree_tokens: int) -> tuple[dict, list[int]]:
    from floe.bench import decode_bytes, floe_row
    from floe.engine import Engine

    engine = Engine(checkpoint, device="cuda", dtype=torch.bfloat16, max_seq_len=2304, n_slots=2)
    row = floe_row(engine)
    row["decode_bytes_per_token"] = decode_bytes(engine)
    greedy = greedy_tokens(engine, agree_tokens)
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    return row, greedy


def greedy_tokens(engine, n: int) -> list[int]:
    """n greedy tokens after the CONTEXT-token prompt (argmax of each step's logits)."""
    engine.kv_truncate(0)
    logits = engine.prefill(list(range(100, 100 + CONTEXT)))
    out = []
    for _ in range(n):
        token = int(torch.as_tensor(logits).float().argmax())
        out.append(token)
        logits = engine.decode_step(token)
    engine.kv_truncate(0)
    return out


def webgpu_row(engine, decoder, steps: int, agree: list[int]) -> dict:
    """Time `decoder` as the engine's step: wall clock per token, and its record+submit vs wait."""
    engine._batch = decoder
    engine.kv_truncate(0)
    t = time.perf_counter()
    engine.prefill(list(range(100, 100 + CONTEXT)))
    prefill_s = time.perf_counter() - t
    pos, slot = CONTEXT, 0
    plan = decoder.decode_plan
    ops = plan.embed + plan.layers + plan.head
    walls, records = [], []
    for i in range(steps + 5):
        t0 = time.perf_counter()
        decoder._submit(ops, [300], [pos], [slot], 0, 1, ahead=True)  # (as step(): the next one recorded
        # while this one computes)
        t1 = time.perf_counter()
        decoder._read(1, None)
        t2 = time.perf_counter()
        if i >= 5:
            walls.append(t2 - t0)
            records.append(t1 - t0)
    wall, record = statistics.median(walls), statistics.median(records)
    by_kind: dict[str, dict] = {}  # each dispatch in a pass of its own between timestamps, median of 5
    runs = [decoder.op_times(300, pos, slot) for _ in range(5)]
    for k, op in enumerate(runs[0]):
        kind = by_kind.setdefault(op["kind"], {"dispatches": 0, "us": 0.0, "weight_bytes": 0})
        kind["dispatches"] += 1
        kind["us"] += statistics.median(run[k]["us"] for run in runs)
        kind["weight_bytes"] += op["weight_bytes"]
    for kind in by_kind.values():
        rated = kind["us"] and kind["weight_bytes"]
        kind["weight_gb_s"] = kind["weight_bytes"] / kind["us"] / 1e3 if rated else None
    engine.kv_truncate(0)
    row = {"tok_s": 1 / wall, "ms_per_token": wall * 1e3, "record_submit_ms": record * 1e3,
           "wait_read_ms": (wall - record) * 1e3, "dispatches_per_token": len(ops),
           "deep": decoder.deep, "layout": decoder.layout, "weights": decoder.weights,
           "weight_bytes": decoder.weight_bytes, "prefill_256_ms": prefill_s * 1e3,
           "gb_s": decoder.weight_bytes / wall / 1e9, "device_us_by_kind": by_kind}
    # engine.decode_step as an actor would call it (the logits copied out to a host tensor)
    engine.prefill(list(range(100, 100 + CONTEXT)))
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.decode_step(300)
        times.append(time.perf_counter() - t)
        engine.kv_truncate(CONTEXT)
    row["engine_decode_step_tok_s"] = 1 / statistics.median(times)
    if agree:
        got = greedy_tokens(engine, len(agree))
        row["greedy_agreement_with_cuda"] = sum(a == b for a, b in zip(got, agree, strict=True)) / len(agree)
        row["greedy_first_differs_at"] = next((i for i, (a, b) in enumerate(zip(got, agree, strict=True))
                                               if a != b), None)
    return row


def failure(e: Exception) -> dict:
    return {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-2000:]}


# (name, layout, environment (GEMV lanes x rows; attend_out lanes x rows x lanes a row; mlp lanes x
# columns x lanes a row), weights, plan)
DEFAULT = {"FLOE_WEBGPU_LANES": "128x4", "FLOE_WEBGPU_ATTEND": "64x256x4", "FLOE_WEBGPU_MLP": "256x32x32",
           "FLOE_WEBGPU_UNROLL": "1", "FLOE_WEBGPU_WIDE": "0"}
VARIANTS = [
    ("lanes f16 deep", "lanes", {}, "f16", "deep"),
    ("lanes f32 deep", "lanes", {}, "f32", "deep"),
    ("lanes f16 deep, gemv 256x4", "lanes", {"FLOE_WEBGPU_LANES": "256x4"}, "f16", "deep"),
    ("lanes f16 deep, gemv 64x8", "lanes", {"FLOE_WEBGPU_LANES": "64x8"}, "f16", "deep"),
    ("lanes f16 deep, gemv 256x2", "lanes", {"FLOE_WEBGPU_LANES": "256x2"}, "f16", "deep"),
    ("lanes f16 deep, mlp 256x64x32", "lanes", {"FLOE_WEBGPU_MLP": "256x64x32"}, "f16", "deep"),
    ("lanes f16 deep, mlp 128x16x16", "lanes", {"FLOE_WEBGPU_MLP": "128x16x16"}, "f16", "deep"),
    ("lanes f16 deep, attend 64x128x1", "lanes", {"FLOE_WEBGPU_ATTEND": "64x128x1"}, "f16", "deep"),
    ("lanes f16 six a layer", "lanes", {}, "f16", "five"),  # (five before the split attention; wide loads
    # by default since the eighth session of 2026-12-06: plan.WIDE)
    ("lanes f16 six a layer, narrow", "lanes", {"FLOE_WEBGPU_WIDE": "0"}, "f16", "five"),  # (8-byte loads)
    ("lanes f16 six a layer, unroll 2", "lanes", {"FLOE_WEBGPU_UNROLL": "2"}, "f16", "five"),
    ("lanes f16 six a layer, unroll 4", "lanes", {"FLOE_WEBGPU_UNROLL": "4"}, "f16", "five"),
    ("lanes f16 six a layer, gemv 256x4 unroll 2", "lanes", {"FLOE_WEBGPU_LANES": "256x4",
                                                             "FLOE_WEBGPU_UNROLL": "2"}, "f16", "five"),
    ("lanes f16 six a layer, wide", "lanes", {"FLOE_WEBGPU_WIDE": "1"}, "f16", "five"),
    ("lanes f16 six a layer, wide unroll 2", "lanes", {"FLOE_WEBGPU_WIDE": "1", "FLOE_WEBGPU_UNROLL": "2"},
     "f16", "five"),
    ("lanes f16 six a layer, wide gemv 128x8", "lanes",
     {"FLOE_WEBGPU_WIDE": "1", "FLOE_WEBGPU_LANES": "128x8"}, "f16", "five"),
    ("lanes f16 six a layer, wide gemv 64x4", "lanes", {"FLOE_WEBGPU_WIDE": "1", "FLOE_WEBGPU_LANES": "64x4"},
     "f16", "five"),
    ("lanes f16 six a layer, gemv 64x8", "lanes", {"FLOE_WEBGPU_LANES": "64x8"}, "f16", "five"),
    ("lanes f16 six a layer, gemv 256x2", "lanes", {"FLOE_WEBGPU_LANES": "256x2"}, "f16", "five"),
    ("lanes f16 six a layer, gemv 32x8", "lanes", {"FLOE_WEBGPU_LANES": "32x8"}, "f16", "five"),
    ("lanes f16 unfused", "lanes", {}, "f16", "unfused"),
    ("threads f16 deep", "threads", {}, "f16", "deep"),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-3.2-1b")
    ap.add_argument("--tokenizer", default=".tok")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--agree", type=int, default=16, help="greedy tokens compared with CUDA")
    ap.add_argument("--out", default="decode_webgpu.json")
    ap.add_argument("--skip-cuda", action="store_true")
    ap.add_argument("--layers", type=int, default=None, help="cut the shape to N layers (a quick check)")
    ap.add_argument("--variants", nargs="+", default=None, metavar="NAME",
                    help="only these of VARIANTS (their names, e.g. 'lanes f16 six a layer'); default: all")
    args = ap.parse_args()
    unknown = set(args.variants or ()) - {v[0] for v in VARIANTS}
    if unknown:
        ap.error(f"no such variants: {sorted(unknown)} (known: {[v[0] for v in VARIANTS]})")

    from floe.cli import _tokenizer
    from floe.engine import Engine
    from floe.engine.webgpu import decoder as webgpu_decoder
    from floe.engine.webgpu.device import gpu
    from floe.model.config import KNOWN_SHAPES
    from floe.model.synthetic import random_checkpoint

    result = {"shape": args.shape, "context": CONTEXT, "steps": args.steps, "rows": {}}

    def save() -> None:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    tokenizer = _tokenizer(args.tokenizer)
    cuda = torch.cuda.is_available() and not args.skip_cuda
    shape = KNOWN_SHAPES[args.shape]
    if args.layers:
        shape = dataclasses.replace(shape, n_layers=args.layers)
    checkpoint = random_checkpoint(shape, tokenizer, dtype=torch.bfloat16,
                                   device="cuda" if cuda else "cpu")
    agree: list[int] = []
    if cuda:
        try:
            result["cuda_device"] = torch.cuda.get_device_name()
            result["cuda"], agree = cuda_row(checkpoint, args.agree)
            print(f"cuda bf16 graphs: {result['cuda']['tok_s']:.1f} tok/s", flush=True)
        except Exception as e:  # noqa: BLE001 - the WebGPU rows still run
            result["cuda"] = failure(e)
        save()
    # The same bf16 values as float32 on the host: WebGPU's model (f16 storage rounds them again).
    host = dataclasses.replace(checkpoint, weights={k: v.float().cpu()
                                                    for k, v in checkpoint.weights.items()})
    del checkpoint
    gc.collect()
    g = gpu()
    result["adapter"] = g.description
    result["limits"] = {"max_binding": g.max_binding, "max_buffer": g.max_buffer,
                        "storage_buffers": g.max_storage_buffers, "default_layout": g.gemv_layout,
                        "mappable_storage": g.mappable_storage}
    engine = Engine(host, device="webgpu", max_seq_len=2304, n_slots=1)
    real_deep = webgpu_decoder.deep_fused
    for name, layout, environment, weights, plan in VARIANTS:
        if args.variants and name not in args.variants:
            continue
        try:
            g.gemv_layout = layout
            os.environ.update({**DEFAULT, **environment, "FLOE_WEBGPU_DEEP": "1" if plan == "deep" else "0"})
            if plan == "five":
                webgpu_decoder.deep_fused = lambda *a, **k: False
            t = time.perf_counter()
            decoder = webgpu_decoder.WebGPUDecoder(engine.model, engine.cache, fused=plan != "unfused",
                                                   weights=weights)
            webgpu_decoder.deep_fused = real_deep
            build_s = time.perf_counter() - t
            row = webgpu_row(engine, decoder, args.steps, agree)
            row["build_s"], row["environment"] = build_s, {**DEFAULT, **environment}
            if "cuda" in result and "tok_s" in result["cuda"]:
                row["vs_cuda"] = row["tok_s"] / result["cuda"]["tok_s"]
            result["rows"][name] = row
            print(f"{name}: {row['tok_s']:.1f} tok/s ({row['ms_per_token']:.2f} ms: record+submit "
                  f"{row['record_submit_ms']:.2f}, wait+read {row['wait_read_ms']:.2f}), "
                  f"{row['dispatches_per_token']} dispatches, {row['gb_s']:.0f} GB/s of weights, "
                  f"x{row.get('vs_cuda', float('nan')):.2f} of cuda, agreement "
                  f"{row.get('greedy_agreement_with_cuda')}", flush=True)
            for kind, k in row["device_us_by_kind"].items():
                rate = "" if k["weight_gb_s"] is None else f", weights at {k['weight_gb_s']:.1f} GB/s"
                print(f"    {kind}: {k['dispatches']} dispatches, {k['us']:.0f} us of device time{rate}",
                      flush=True)
        except Exception as e:  # noqa: BLE001 - one variant's failure is reported, the others run
            webgpu_decoder.deep_fused = real_deep
            result["rows"][name] = failure(e)
            print(f"{name}: failed: {type(e).__name__}: {e}", flush=True)
        engine._batch = decoder = None
        gc.collect()
        save()
    for variable in (*DEFAULT, "FLOE_WEBGPU_DEEP"):
        os.environ.pop(variable, None)


if __name__ == "__main__":
    main()
