"""A prompt on the CPU: the default model's whole prefill at a few prompt lengths, or its projections
alone by how they are multiplied.

    python bench/cpu_prefill.py --prompts 16 64 256 [--threads 2] [--repeats 9] [--kernel auto]
                                [--name NAME]
    python bench/cpu_prefill.py [ROWS] [THREADS]        # projections; default 256 rows, 2 threads

--prompts: Engine.prefill of SmolLM2-135M-Instruct's native weights (the installed Q4_1 GGUF, kernel
--kernel) on a chat prompt cut to each length, as floe runs it (each quantized layer dequantized a band
of rows at a time, `floe.engine.prefill`), beside its ceiling (the same engine with a stored copy of
the dense weights: no dequantization, 3.5x the memory) and its peer (llama.cpp on the same file).
Every figure is the median of --repeats runs, the three interleaved, with the slowest and fastest
beside it; writes bench/results/cpu_prefill/NAME.json.

Projections: SmolLM2-135M's four projection shapes of a layer (qkv, o, gate+up, down), random weights
quantized to Q4_1; prints tokens a second for the 30 layers' projections alone (median of 7, after
2 warm-ups): floe's int8 kernel on every row and floe's bands (each variant), dense GEMMs on a
stored copy in bf16 and fp32.

Run either under ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 (and
--kernel avx2) to see an AVX2-only CPU's, where bf16 GEMMs are emulated and prompts run in float32
(docs/PERF.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize
from smoke import results, shrink

from floe.bench import wall_time
from floe.engine import Engine, qgemv
from floe.engine.int4 import gemm_dtype
from floe.engine.prefill import banded_linear
from floe.model import KNOWN_SHAPES, load_checkpoint
from floe.model.quant import QuantizedWeight

RESULTS = Path(__file__).parent / "results" / "cpu_prefill"


def prompts(lengths: list[int], kernel: str, repeats: int, threads: int, name: str) -> None:
    """The default model's prefill at each prompt length: floe's bands, a stored copy, llama.cpp."""
    from cpu_decode import TEXT, floe_run, interleaved, llama_cpp_run, machine

    ckpt = load_checkpoint()
    ids = ckpt.tokenizer.encode_chat([{"role": "user", "content": TEXT * 20}])
    n = max(lengths)
    banded = Engine(ckpt, max_seq_len=n, weights="native", native_kernel=kernel)
    stored = Engine(ckpt, max_seq_len=n, weights="native", native_kernel=kernel, prefill_copy=True)
    what = {"floe bands": banded, "stored copy (ceiling)": stored}
    print(f"{ckpt.name} · native {banded.native_kernel} · prompt GEMMs in {gemm_dtype()} · {threads} threads")
    print(f"{'tokens':>6}{'floe bands ms':>22}{'stored copy ms':>22}{'llama.cpp ms':>22}{'bands/stored':>14}"
          f"{'bands/llama':>13}")
    record = {"model": ckpt.name, "kernel": banded.native_kernel, "gemm_dtype": str(gemm_dtype()),
              "threads": threads, "repeats": repeats, "machine": machine(), "torch": torch.__version__,
              "prompts": {}}
    for length in lengths:
        prompt = ids[:length]
        runs = {name: floe_run(engine, prompt, []) for name, engine in what.items()}
        try:
            runs["llama.cpp"] = llama_cpp_run(ckpt.source, threads, prompt, [])
        except ImportError:  # (the row goes on without its peer, as cpu_decode's)
            print("llama-cpp-python is not installed (pip install -e '.[bench]'): peer skipped")
        times = {name: sorted(p) for name, (p, _) in interleaved(runs, repeats).items()}
        ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        cells = "".join(f"{ms[k]:.1f} ({t[0] * 1e3:.0f}-{t[-1] * 1e3:.0f})".rjust(22)
                        for k, t in times.items())
        peer = f"{ms['floe bands'] / ms['llama.cpp']:>12.2f}x" if "llama.cpp" in ms else f"{'-':>13}"
        print(f"{length:>6}{cells}{ms['floe bands'] / ms['stored copy (ceiling)']:>13.2f}x{peer}")
        record["prompts"][length] = {k: {"median_ms": ms[k], "runs_ms": [round(x * 1e3, 2) for x in t]}
                                     for k, t in times.items()}
    out = results(RESULTS / f"{name}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2))
    print(f"wrote {out}")


def projections(rows: int, threads: int) -> None:
    torch.set_num_threads(threads)
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
        s = wall_time(lambda mods=mods: [banded_linear(m, x) for m, x in mods], 7, 2) * c.n_layers
        print(f"floe {kernel} bands in {gemm_dtype()}, {rows} rows: {rows / s:7.0f} tok/s (projections only)")
    for dtype in (torch.bfloat16, torch.float32):
        dense = [(q.dequantize().to(dtype), x.to(dtype)) for q, x in layers]
        s = wall_time(lambda dense=dense: [F.linear(x, w) for w, x in dense], 7, 2) * c.n_layers
        name = str(dtype).removeprefix("torch.")
        print(f"{name} GEMM, {rows} rows: {rows / s:7.0f} tok/s (projections only)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rows", nargs="?", type=int, default=256, help="projections: input rows")
    ap.add_argument("threads_", nargs="?", type=int, default=None, metavar="THREADS")
    ap.add_argument("--prompts", type=int, nargs="+", help="the default model's prefill at these lengths")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--kernel", default="auto", help="floe's native kernel (default: the best here)")
    ap.add_argument("--name", default="prompts", help="the JSON's name under bench/results/cpu_prefill")
    args = ap.parse_args()
    if args.prompts:
        args = shrink(args, prompts=[16], repeats=1)
    threads = args.threads_ or args.threads
    if args.prompts:
        torch.set_num_threads(threads)
        prompts(args.prompts, args.kernel, args.repeats, threads, args.name)
    else:
        projections(args.rows, threads)


if __name__ == "__main__":
    main()
