"""Decode and prefill of one model with its weights in the file's rows vs in interleaved bands of
8 rows (csrc/qdot/abi.h), same kernel variant, one process, runs alternating; and whether the two
agree on the greedy continuation (their sums differ in order: close, not bitwise).

    python bench/probes/cpu_bands_decode.py [--model GGUF] [--kernel vnni] [--threads 2]
                                            [--prompt-tokens 128] [--decode-tokens 64] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent.parent))
from cpu_decode import TEXT, floe_run, greedy_agreement  # noqa: E402

from floe.engine import Engine, qgemv  # noqa: E402
from floe.model import load_checkpoint  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--kernel", default="auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    checkpoint = load_checkpoint(args.model)
    n = args.prompt_tokens + args.decode_tokens + 8
    engines = {}
    interleaves = qgemv.interleaves
    try:
        qgemv.interleaves = lambda number: False
        engines["rows"] = Engine(checkpoint, max_seq_len=n, weights="native", native_kernel=args.kernel)
    finally:
        qgemv.interleaves = interleaves
    engines["bands"] = Engine(checkpoint, max_seq_len=n, weights="native", native_kernel=args.kernel)
    del checkpoint
    tok = engines["rows"].tokenizer
    prompt = tok.encode(TEXT * (args.prompt_tokens // 20 + 2))[: args.prompt_tokens]
    engine = engines["rows"]
    engine.kv_truncate(0)
    logits, ids = engine.prefill(prompt), []
    for _ in range(args.decode_tokens):
        ids.append(int(logits.argmax()))
        logits = engine.decode_step(ids[-1])
    engine.kv_truncate(0)
    runs = {name: floe_run(e, prompt, ids) for name, e in engines.items()}
    times = {name: ([], []) for name in runs}
    for run in runs.values():
        run()
    for _ in range(args.repeats):
        for name, run in runs.items():
            p, d = run()
            times[name][0].append(p)
            times[name][1].append(d)
    print(f"{args.model or 'default model'}, kernel {engines['bands'].native_kernel}, "
          f"{args.threads} threads, {args.prompt_tokens}-token prompt, {args.decode_tokens} decoded; "
          f"medians of {args.repeats}")
    rates = {}
    for name, (p, d) in times.items():
        rates[name] = (args.prompt_tokens / statistics.median(p), args.decode_tokens / statistics.median(d))
        agree = greedy_agreement(engines[name], prompt, ids)
        print(f"  {name:6s} prefill {rates[name][0]:8.1f} tok/s  decode {rates[name][1]:7.1f} tok/s  "
              f"greedy agreement with rows {agree}/{len(ids)}")
    print(f"  bands / rows: prefill {rates['bands'][0] / rates['rows'][0]:.2f}×, "
          f"decode {rates['bands'][1] / rates['rows'][1]:.2f}×")


if __name__ == "__main__":
    main()
