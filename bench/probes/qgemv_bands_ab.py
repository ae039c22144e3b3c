"""The file's rows vs interleaved bands of 8 rows (csrc/qdot/abi.h), one kernel variant, in one
process, alternating: gemv_q over 1..128 input rows on SmolLM2-135M's shapes and Llama-3.2-1B's,
outputs checked against each other (the two sum a row's groups in different orders: close, not
equal); min of N calls each (this VM's clock moves between runs: only a ratio inside one run counts).

    python bench/probes/qgemv_bands_ab.py [--kernel vnni] [--threads 2] [--rows 1 4 8 16 128]
    python bench/probes/qgemv_bands_ab.py --cold-mib 512    # weights streamed from memory

--cold-mib: each call takes the next of as many copies of the matrix as fill that many MiB (far past
the last-level cache), as a decode token does; the figures are then GB/s of weight bytes read.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize

from floe.engine import qgemv
from floe.model.quant import QuantizedWeight

SHAPES = (("135M w13", (3072, 576), Q.Q4_1), ("135M w2", (576, 1536), Q.Q4_1),
          ("135M head", (49152, 576), Q.Q8_0), ("1B w13", (16384, 2048), Q.Q4_0),
          ("1B w2", (2048, 8192), Q.Q4_0), ("1B wqkv", (3072, 2048), Q.Q4_0))


def best(fn, calls: int) -> float:
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernel", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 128])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cold-mib", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    number = qgemv.load(args.kernel)
    print(f"kernel {torch.ops.floe.qdot_name(number)}, {args.threads} threads; "
          f"{'GB/s' if args.cold_mib else 'µs per call (min)'}, rows → bands")
    rng = np.random.default_rng(0)
    for name, shape, qtype in SHAPES:
        w = rng.standard_normal(shape).astype(np.float32)
        rows = qgemv.kernel_blocks(QuantizedWeight(qtype.name, w.shape, quantize(w, qtype)))
        copies = max(1, (args.cold_mib << 20) // rows.nbytes) if args.cold_mib else 1
        layouts = {"rows": [rows.clone() for _ in range(copies)]}
        layouts["bands"] = [torch.ops.floe.interleave_q(r, shape[1]) for r in layouts["rows"]]
        line = []
        for m in args.rows:
            x = torch.randn(m, shape[1])
            a, b = (torch.ops.floe.gemv_q(x, layouts[k][0], number) for k in ("rows", "bands"))
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * float(a.abs().max()))
            calls = max(3, copies, int(2e8 / (rows.nbytes * max(1, m // 8))))
            t = dict.fromkeys(layouts, float("inf"))
            for _ in range(args.rounds):
                for k, ws in layouts.items():
                    turn = iter(range(10**9))
                    t[k] = min(t[k], best(lambda ws=ws, turn=turn, x=x: torch.ops.floe.gemv_q(
                        x, ws[next(turn) % len(ws)], number), calls))
            a, b, ratio = t["rows"], t["bands"], t["rows"] / t["bands"]
            if args.cold_mib:
                gb = rows.nbytes / 1e9
                line.append(f"{m}: {gb / a:.1f} → {gb / b:.1f} GB/s ({ratio:.2f}×)")
            else:
                line.append(f"{m}: {a * 1e6:.0f} → {b * 1e6:.0f} ({ratio:.2f}×)")
        print(f"{name:10s} {shape[0]}x{shape[1]} {qtype.name}  " + "  ".join(line), flush=True)


if __name__ == "__main__":
    main()
