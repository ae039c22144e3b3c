"""A prompt's projections on the CPU, by how they are multiplied: floe's int8 kernel (each variant
this CPU runs) against dense bf16 and fp32 GEMMs of the same Q4_1 weights.

    python bench/cpu_prefill.py [ROWS] [THREADS]        # default 256 rows, 2 threads

SmolLM2-135M's four projection shapes of a layer (qkv, o, gate+up, down), random weights quantized
to Q4_1; prints tokens a second for the 30 layers' projections alone (median of 7, after 2 warm-ups).
Run it under ONEDNN_MAX_CPU_ISA=AVX2 (and ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2) to
see an AVX2-only CPU's GEMMs, where bf16 is emulated (docs/PERF.md).
"""

from __future__ import annotations

import sys

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize

from floe.bench import wall_time
from floe.engine import qgemv
from floe.model import KNOWN_SHAPES
from floe.model.quant import QuantizedWeight


def main() -> None:
    rows = int(sys.argv[1]) if len(sys.argv) > 1 else 256
    torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 2)
    c = KNOWN_SHAPES["smollm2-135m"]
    qkv = (c.n_heads + 2 * c.n_kv_heads) * c.head_dim
    shapes = [(qkv, c.dim), (c.dim, c.n_heads * c.head_dim), (2 * c.ffn_dim, c.dim), (c.dim, c.ffn_dim)]
    rng = np.random.default_rng(0)
    layers = []
    for out_features, in_features in shapes:
        w = rng.standard_normal((out_features, in_features)).astype(np.float32)
        layers.append((QuantizedWeight("Q4_1", w.shape, quantize(w, Q.Q4_1)), torch.randn(rows, in_features)))
    print(f"bf16 GEMMs native to oneDNN here: {torch.ops.mkldnn._is_mkldnn_bf16_supported()}")
    for kernel in (k for k in qgemv.runnable() if k != "portable"):
        mods = [(qgemv.QLinear(q, dense=False, kernel=kernel), x) for q, x in layers]
        s = wall_time(lambda mods=mods: [m(x) for m, x in mods], 7, 2) * c.n_layers
        print(f"floe {kernel} int8 kernel, {rows} rows: {rows / s:7.0f} tok/s (projections only)")
    for dtype in (torch.bfloat16, torch.float32):
        dense = [(q.dequantize().to(dtype), x.to(dtype)) for q, x in layers]
        s = wall_time(lambda dense=dense: [F.linear(x, w) for w, x in dense], 7, 2) * c.n_layers
        name = str(dtype).removeprefix("torch.")
        print(f"{name} GEMM, {rows} rows: {rows / s:7.0f} tok/s (projections only)")


if __name__ == "__main__":
    main()
