"""Where one fused decode step's time goes, on CUDA: each kernel's device time (profiler, eager
replay of the step), and each weight matrix's GEMV alone (graph-replayed back to back) with its
achieved bandwidth, against the step measured as a graph replay.

    python bench/cuda_breakdown.py --tokenizer DIR [--shape llama-3.2-1b] [--out F]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from floe.bench import copy_bandwidth
from floe.bench import timed as events_time
from floe.engine import Engine
from floe.model.hf_folder import tokenizer_from_folder
from floe.model.synthetic import random_checkpoint


def gemv_table(engine: Engine) -> list[dict]:
    """Each distinct weight shape's M=1 product alone: 50 calls captured in one graph."""
    shapes: dict[tuple[int, int], tuple[torch.Tensor, int]] = {}
    for name, p in engine.model.named_parameters():
        if p.ndim == 2 and "tok_embeddings" not in name:
            w, count = shapes.get(tuple(p.shape), (p, 0))
            shapes[tuple(p.shape)] = (w, count + 1)
    if engine.config.tie_embeddings:
        w = engine.model.tok_embeddings.weight
        shapes[tuple(w.shape)] = (w, 1)
    rows = []
    for (out_f, in_f), (w, count) in shapes.items():
        x = torch.randn(1, in_f, dtype=w.dtype, device=w.device)
        graph = torch.cuda.CUDAGraph()
        F.linear(x, w)
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            for _ in range(50):
                F.linear(x, w)
        seconds = events_time(graph.replay, 20) / 50
        nbytes = w.numel() * w.element_size()
        rows.append(
            {
                "shape": [out_f, in_f],
                "per_step": count,
                "us": seconds * 1e6,
                "gb_s": nbytes / seconds / 1e9,
                "us_per_step": seconds * 1e6 * count,
            }
        )
    return rows


@torch.inference_mode()
def kernel_table(engine: Engine) -> list[dict]:
    """Device time per kernel name over one step (the fused core run eagerly under the profiler)."""
    decoder = engine._decoder(0)
    engine.kv_truncate(0)
    engine.prefill(list(range(100, 356)))
    engine.decode_step(300)  # captures the graph; also warms the kernels
    decoder.host_in[0], decoder.host_in[1] = 300, 256
    torch.cuda.synchronize()
    steps = 10
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            decoder._forward(decoder.bucket_for(257))
        torch.cuda.synchronize()
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            key = e.name[:80]
            totals[key][0] += e.device_time / steps
            totals[key][1] += 1 / steps
    engine.kv_truncate(0)
    return sorted(
        ({"kernel": k, "us_per_step": v[0], "launches_per_step": v[1]} for k, v in totals.items()),
        key=lambda r: -r["us_per_step"],
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", type=Path, required=True)
    ap.add_argument("--shape", action="append")
    ap.add_argument("--out", type=Path, default=Path("cuda_breakdown.json"))
    args = ap.parse_args()
    tok = tokenizer_from_folder(args.tokenizer, {})
    bw = copy_bandwidth(torch.device("cuda"))
    out = {"bandwidth_gb_s": bw / 1e9, "shapes": {}}
    for shape in args.shape or ["llama-3.2-1b"]:
        ckpt = random_checkpoint(shape, tok, dtype=torch.bfloat16, device="cuda")
        engine = Engine(ckpt, device="cuda", dtype="bfloat16", max_seq_len=1024)
        engine.prefill(list(range(100, 356)))

        def step(e=engine):
            e.decode_step(300)
            e.kv_truncate(256)

        step_us = events_time(step, 100) * 1e6
        gemvs, kernels = gemv_table(engine), kernel_table(engine)
        gemv_us = sum(r["us_per_step"] for r in gemvs)
        kernel_us = sum(r["us_per_step"] for r in kernels)
        out["shapes"][shape] = {
            "step_us": step_us,
            "gemv_alone_us": gemv_us,
            "kernels_device_us": kernel_us,
            "gemvs": gemvs,
            "kernels": kernels[:25],
        }
        print(
            f"{shape}: step {step_us:.0f} us (graph replay); kernels' device time {kernel_us:.0f} us; "
            f"GEMVs alone {gemv_us:.0f} us"
        )
        for r in gemvs:
            print(f"  GEMV {r['shape']}  x{r['per_step']}: {r['us']:.1f} us, {r['gb_s']:.0f} GB/s")
        for r in kernels[:14]:
            print(f"  {r['us_per_step']:8.1f} us  {r['launches_per_step']:5.0f}x  {r['kernel']}")
        del engine, ckpt
        torch.cuda.empty_cache()
    args.out.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
