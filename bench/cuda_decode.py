"""Batch-1 decode on CUDA at real shapes (seeded random bf16 weights): eager vs CUDA-graph replay,
% of the bandwidth roofline measured in the same run, kernels per token, agreement, the guest's
share of a step, and 2048-token prefill against its compute floor.

    python bench/cuda_decode.py --tokenizer DIR [--shape llama-3.2-1b --shape llama-3-8b] [--out F]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from cuda_clock import events_time
from torch.profiler import ProfilerActivity, profile

from floe.actor import Actor
from floe.engine import Engine, Generation, SamplingParams, generate
from floe.model.hf_folder import tokenizer_from_folder
from floe.model.synthetic import random_checkpoint


def copy_bandwidth() -> float:
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    return 2 * n / events_time(lambda: dst.copy_(src), 20)


def matmul_rate() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    return 2 * 8192**3 / events_time(lambda: a @ b, 10)


def decode_bytes(engine: Engine) -> int:
    """Bytes one batch-1 decode step must read: every weight once (one embedding row only)."""
    total = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    c = engine.config
    if not c.tie_embeddings:
        total -= (c.vocab_size - 1) * c.dim * engine.model.tok_embeddings.weight.element_size()
    return total


def step_time(engine: Engine, context: int = 256) -> float:
    engine.kv_truncate(0)
    engine.prefill(list(range(100, 100 + context)))

    def step():
        engine.decode_step(300)
        engine.kv_truncate(context)

    return events_time(step, 100)


def kernels_per_step(engine: Engine, context: int = 256) -> float:
    engine.kv_truncate(0)
    engine.prefill(list(range(100, 100 + context)))
    engine.decode_step(300)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            engine.decode_step(300)
        torch.cuda.synchronize()
    kernels = [
        e
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
        and "memcpy" not in e.name.lower()
        and "memset" not in e.name.lower()
    ]
    engine.kv_truncate(0)
    return len(kernels) / 10


def greedy(engine: Engine, n: int = 32) -> tuple[list[int], torch.Tensor]:
    engine.kv_truncate(0)
    logits = engine.prefill(list(range(100, 164)))
    tokens, first = [], None
    for _ in range(n):
        tokens.append(int(logits.argmax()))
        logits = engine.decode_step(tokens[-1])
        if first is None:
            first = logits.clone()
    engine.kv_truncate(0)
    return tokens, first


def guest_vs_host(engine: Engine, tokens: int = 128) -> dict:
    prompt = "Write a long story about a lighthouse keeper."
    ids = engine.tokenizer.encode_chat([{"role": "user", "content": prompt}])
    out = {"host": [], "guest": [], "outside_ms": [], "engine_ms": []}
    for _ in range(4):
        slot = engine.claim_slot()
        r = Generation()
        list(generate(engine, ids, SamplingParams(), tokens, slot=slot, result=r))
        engine.release_slot(slot)
        out["host"].append(r.decode_tokens_per_s)
        with Actor(engine) as a:
            s = a.send(prompt, max_tokens=tokens).stats
        out["guest"].append(s.decode_tokens_per_s)
        out["outside_ms"].append(s.outside_engine_s / s.forwards * 1e3)
        out["engine_ms"].append(s.forward_s / s.forwards * 1e3)
    return {k: statistics.median(v[1:]) for k, v in out.items()}


def prefill_vs_floor(engine: Engine, rate: float, n: int = 2048) -> dict:
    c = engine.config
    ids = list(range(100, 100 + n))

    def run():
        engine.kv_truncate(0)
        engine.prefill(ids)

    t = events_time(run, 5)
    linear = sum(
        p.numel()
        for name, p in engine.model.named_parameters()
        if p.ndim == 2 and "tok_embeddings" not in name
    )
    if c.tie_embeddings:
        linear += c.vocab_size * c.dim
    flops = 2 * linear * n + 2 * 2 * c.n_layers * c.n_heads * c.head_dim * n * n / 2
    engine.kv_truncate(0)
    return {"prefill_ms": t * 1e3, "floor_ms": flops / rate * 1e3, "pct_of_floor": 100 * flops / rate / t}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", type=Path, required=True)
    ap.add_argument("--shape", action="append")
    ap.add_argument("--out", type=Path, default=Path("cuda_decode.json"))
    args = ap.parse_args()
    tok = tokenizer_from_folder(args.tokenizer, {})
    bw, rate = copy_bandwidth(), matmul_rate()
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s, bf16 matmul {rate / 1e12:.0f} TFLOP/s", flush=True)
    results = {"bandwidth_gb_s": bw / 1e9, "matmul_tflop_s": rate / 1e12, "shapes": {}}
    for shape in args.shape or ["llama-3.2-1b", "llama-3-8b"]:
        ckpt = random_checkpoint(shape, tok, dtype=torch.bfloat16, device="cuda")
        eager = Engine(ckpt, device="cuda", dtype="bfloat16", max_seq_len=2304, cuda_graphs=False)
        graph = Engine(
            ckpt, device="cuda", dtype="bfloat16", max_seq_len=2304, n_slots=2, fused_kernels=False
        )
        fused = Engine(
            ckpt, device="cuda", dtype="bfloat16", max_seq_len=2304, n_slots=2, fused_kernels=True
        )
        nbytes = decode_bytes(graph)
        ceiling = bw / nbytes
        row = {"decode_bytes": nbytes, "ceiling_tok_s": ceiling}
        for name, eng in (("eager", eager), ("graph", graph), ("graph+triton", fused)):
            s = step_time(eng)
            row[name] = {
                "ms_per_token": s * 1e3,
                "tok_s": 1 / s,
                "pct_roofline": 100 / s / ceiling,
                "kernels_per_token": kernels_per_step(eng),
            }
        (te, le), (tg, lg), (tc, lc) = greedy(eager), greedy(graph), greedy(fused)
        row["graph_vs_eager"] = {
            "greedy_identical_32": te == tg,
            "first_logits_max_abs": float((le - lg).abs().max()),
        }
        row["triton_vs_eager"] = {
            "greedy_agree_32": sum(a == b for a, b in zip(te, tc, strict=True)),
            "first_logits_max_abs": float((le - lc).abs().max()),
        }
        row["guest_vs_host"] = guest_vs_host(fused)
        row["prefill_2048"] = prefill_vs_floor(eager, rate)
        results["shapes"][shape] = row
        print(shape, json.dumps(row), flush=True)
        del eager, graph, fused, ckpt
        torch.cuda.empty_cache()
    args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
