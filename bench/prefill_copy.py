"""What a prompt costs on native (quantized) CPU weights, three ways, on the same layers, interleaved:

    stored bf16 copy   every quantized matrix also kept as bf16 (2 bytes a weight), one GEMM each
    bf16 bands         no copy: each matrix dequantized from the kernel's codes a band of rows at a
                       time, right before that band's GEMM (floe.engine.prefill; the default)
    int8 kernel rows   no copy: floe's int8 GEMV once per prompt row

    python bench/prefill_copy.py [--model PATH] [--threads 2] [--tokens 256,512] [--repeats 5]

Prints a table, writes JSON to bench/results/prefill_copy.json. Each figure is the median of
--repeats runs after one warm-up round, the three ways taken in turn so that a shared machine's
drift lands on all alike. Also the logits' agreement with the stored copy's, and the greedy first
token of the README prompt each way.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import floe.engine.transformer as transformer
from floe.engine import Engine
from floe.engine.prefill import project
from floe.engine.qgemv import QLinear
from floe.engine.transformer import fused_quantized
from floe.model import load_checkpoint

TEXT = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, counting the steps "
    "as his father had taught him, and lit the great lamp that warned ships away from the rocks. "
)


def bf16_copies(engine: Engine, checkpoint) -> dict[str, torch.Tensor]:
    """The bf16 copy of every quantized layer's weight (what `prefill_copy=True` keeps), by module
    path; the head has none (its logits stay float32)."""
    return {path: fused_quantized(checkpoint.quantized, path, engine.config).dequantize(torch.bfloat16)
            for path, m in engine.model.named_modules() if isinstance(m, QLinear) and path != "head"}


def configure(engine: Engine, copies: dict[str, torch.Tensor] | None, banded: bool) -> None:
    for path, m in engine.model.named_modules():
        if isinstance(m, QLinear) and path != "head":
            m.dense = None if copies is None else copies[path]
    transformer.project = project if banded else (lambda module, x: module(x))


def readme_first_tokens(engine: Engine, checkpoint, ways: dict) -> dict[str, str]:
    """Each way's greedy first token of the README prompt (fp32: "The", by 0.08 over "L")."""
    ids = checkpoint.tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    first = {}
    for name, (copies, banded) in ways.items():
        configure(engine, copies, banded)
        engine.kv_truncate(0)
        first[name] = checkpoint.tokenizer.decode([int(engine.prefill(ids).argmax())])
    return first


def timed(engine: Engine, prompt: list[int], ways: dict, repeats: int) -> tuple[dict, dict]:
    """Per way: its prefill times (seconds, after a warm-up round), and its logits' largest distance
    from the stored copy's (the first way's)."""
    times: dict[str, list[float]] = {name: [] for name in ways}
    diffs, reference = {}, None
    for rep in range(repeats + 1):
        for name, (copies, banded) in ways.items():
            configure(engine, copies, banded)
            engine.kv_truncate(0)
            t = time.perf_counter()
            logits = engine.prefill(prompt)
            if rep:
                times[name].append(time.perf_counter() - t)
                continue
            reference = logits if reference is None else reference
            diffs[name] = float((logits - reference).abs().max())
    return times, diffs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", default="256,512")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "prefill_copy.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lengths = [int(n) for n in args.tokens.split(",")]
    checkpoint = load_checkpoint(args.model)
    engine = Engine(checkpoint, max_seq_len=max(lengths), weights="native")
    copies = bf16_copies(engine, checkpoint)
    ways = {"stored bf16 copy": (copies, True), "bf16 bands": (None, True), "int8 kernel rows": (None, False)}
    result = {"model": checkpoint.name, "threads": args.threads, "kernel": engine.native_kernel,
              "bf16_copy_bytes": sum(t.nbytes for t in copies.values()),
              "readme_first_token": readme_first_tokens(engine, checkpoint, ways), "rows": {}}
    ids = checkpoint.tokenizer.encode(TEXT * 40)
    for n in lengths:
        times, diffs = timed(engine, ids[:n], ways, args.repeats)
        row = result["rows"][str(n)] = {}
        for name, ts in times.items():
            ms = 1e3 * statistics.median(ts)
            row[name] = {"ms": ms, "tok_s": 1e3 * n / ms, "runs_ms": [round(1e3 * x, 1) for x in ts],
                         "max_abs_logit_diff_vs_stored": diffs[name]}
            print(f"{n:5d} tokens  {name:<18} {ms:9.1f} ms  {1e3 * n / ms:8.1f} tok/s  "
                  f"logits within {diffs[name]:.2g} of the stored copy's")
    configure(engine, None, True)
    print(f"stored bf16 copies: {result['bf16_copy_bytes'] / 1e6:.0f} MB; README prompt's first token: "
          f"{result['readme_first_token']}")
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
