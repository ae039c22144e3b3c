"""Batch-1 matrix-vector speed on CPU for SmolLM2-135M's weight shapes, by weight format.

    python bench/cpu_gemv.py [--threads 2]

All the linears of one decode token (30 layers' qkv, o, gate+up, down, and the tied lm_head), with
fp32, bf16, int8 weight-only (`torch._weight_int8pack_mm`, per-row scales, bf16 activations), int4
weight-only (`torch._weight_int4pack_mm_for_cpu`, groups of 32 with a scale and a zero: the layout
Q4_1 maps onto exactly), and floe's int8-activation kernel in each variant this CPU runs (4-bit
blocks for the layers (Q4_1), 8-bit for the head (Q8_0), read in place: the SmolLM2 Q4_1 file's mix).
Shows what a faster CPU decode needs: fewer weight bytes through a kernel that streams them well.
Prints a table; writes bench/results/cpu_gemv.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from floe.model import KNOWN_SHAPES


def decode_shapes(name: str) -> list[tuple[int, int]]:
    c = KNOWN_SHAPES[name]
    qkv = (c.n_heads + 2 * c.n_kv_heads) * c.head_dim
    per_layer = [(qkv, c.dim), (c.dim, c.n_heads * c.head_dim), (2 * c.ffn_dim, c.dim), (c.dim, c.ffn_dim)]
    return per_layer * c.n_layers + [(c.vocab_size, c.dim)]


def time_all(fn, weights, xs, repeats: int = 10) -> float:
    """Median seconds for one pass over every weight."""
    for w in weights[:8]:
        fn(xs[w[-1]], w)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        for w in weights:
            fn(xs[w[-1]], w)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def floe_rows(shapes: list[tuple[int, int]], x32: dict) -> dict[str, tuple[float, int]]:
    """(seconds, bytes) a token for each variant of floe's kernel this CPU runs, on GGUF blocks."""
    from floe.engine import qgemv

    weights = []
    for i, (o, k) in enumerate(shapes):
        head = i == len(shapes) - 1  # the head as Q8_0 (34-byte blocks), the layers as Q4_1 (20)
        blocks = torch.randint(0, 256, (o, k // 32, 34 if head else 20), dtype=torch.uint8)
        blocks[..., 0:2] = torch.rand(o, k // 32, 1).mul(0.01).half().view(torch.uint8)  # fp16 d
        if not head:
            blocks[..., 2:4] = torch.rand(o, k // 32, 1).mul(-0.1).half().view(torch.uint8)  # fp16 m
        weights.append((blocks.view(o, -1), k))
    nbytes = sum(b.nbytes for b, _ in weights)
    rows = {}
    for name in qgemv.runnable():
        number = qgemv.load(name)

        def gemv(x, w, number=number):
            return torch.ops.floe.gemv_q(x, w[0], number)

        rows[f"floe {name} (int8 x 4/8-bit)"] = (time_all(gemv, weights, x32), nbytes)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--shape", default="smollm2-135m", choices=sorted(KNOWN_SHAPES))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    shapes = decode_shapes(args.shape)
    n = sum(o * i for o, i in shapes)
    fp32 = [(torch.randn(o, i), i) for o, i in shapes]
    x32 = {i: torch.randn(1, i) for _, i in shapes}
    x16 = {i: v.bfloat16() for i, v in x32.items()}
    bf16 = [(w.bfloat16(), i) for w, i in fp32]
    int8 = []
    for w, i in fp32:
        scale = w.abs().amax(1) / 127
        int8.append((torch.round(w / scale[:, None]).to(torch.int8), scale.bfloat16(), i))
    int4 = []
    for w, i in fp32:
        codes = torch.randint(0, 16, w.shape, dtype=torch.int32)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        int4.append((packed, torch.randn(i // 32, w.shape[0], 2, dtype=torch.bfloat16), i))
    def int4_mm(x, w):
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, w[0], 32, w[1])

    rows = {
        "float32 (F.linear)": (time_all(lambda x, w: torch.nn.functional.linear(x, w[0]), fp32, x32), 4 * n),
        "bfloat16 (F.linear)": (time_all(lambda x, w: torch.nn.functional.linear(x, w[0]), bf16, x16), 2 * n),
        "int8 weight-only": (time_all(lambda x, w: torch._weight_int8pack_mm(x, w[0], w[1]), int8, x16), n),
        "int4 weight-only (g32)": (time_all(int4_mm, int4, x16), n * 5 // 8),
        **floe_rows(shapes, x32),
    }
    print(f"\n{args.shape}: {len(shapes)} matrices, {n / 1e6:.0f} M weights, {args.threads} threads\n")
    print(f"{'weights':<30}{'ms/token':>10}{'MB/token':>10}{'GB/s':>8}{'tok/s if only GEMV':>20}")
    out = {}
    for name, (s, nbytes) in rows.items():
        out[name] = {"s_per_token": s, "bytes_per_token": nbytes, "gb_s": nbytes / s / 1e9}
        print(f"{name:<30}{s * 1e3:>10.2f}{nbytes / 1e6:>10.0f}{nbytes / s / 1e9:>8.1f}{1 / s:>20.1f}")
    path = Path(__file__).parent / "results" / "cpu_gemv.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps({"shape": args.shape, "threads": args.threads, "rows": out}, indent=2))


if __name__ == "__main__":
    main()
