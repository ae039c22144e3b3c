"""CPU prefill and decode speed of floe (fp32, bf16) beside llama.cpp on the same GGUF, same run.

    python bench/cpu_decode.py [--model PATH] [--threads 2] [--prompt-tokens 256] [--decode-tokens 128]

Needs the `bench` extra for the peer (`pip install -e ".[bench]"`). Prints a table, writes JSON to
bench/results/cpu_decode.json. Each figure is the median of --repeats runs after one warm-up run;
every engine is fed the same token ids.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from floe.engine import Engine
from floe.model import load_checkpoint

TEXT = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, counting the steps "
    "as his father had taught him, and lit the great lamp that warned ships away from the rocks. "
)


def measure_bandwidth_gb_s(threads: int, mib: int = 512) -> float:
    """Memory bandwidth a copy achieves (read + write bytes / s), median of 5."""
    torch.set_num_threads(threads)
    src = torch.ones(mib * 2**20 // 4)
    dst = torch.empty_like(src)
    times = []
    for _ in range(6):
        t = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t)
    return 2 * src.numel() * 4 / statistics.median(times[1:]) / 1e9


def bench_floe(engine: Engine, prompt: list[int], decode_ids: list[int], repeats: int) -> dict:
    prefill, decode = [], []
    for _ in range(repeats + 1):
        engine.kv_truncate(0)
        t = time.perf_counter()
        engine.prefill(prompt)
        prefill.append(time.perf_counter() - t)
        t = time.perf_counter()
        for token in decode_ids:
            engine.decode_step(token)
        decode.append(time.perf_counter() - t)
    engine.kv_truncate(0)
    return _rates(prefill[1:], decode[1:], len(prompt), len(decode_ids))


def bench_llama_cpp(path: Path, threads: int, prompt: list[int], decode_ids: list[int],
                    repeats: int) -> dict:
    import llama_cpp

    llm = llama_cpp.Llama(str(path), n_ctx=len(prompt) + len(decode_ids) + 8, n_batch=512,
                          n_threads=threads, n_threads_batch=threads, verbose=False)
    prefill, decode = [], []
    for _ in range(repeats + 1):
        llm.reset()
        t = time.perf_counter()
        llm.eval(prompt)
        prefill.append(time.perf_counter() - t)
        t = time.perf_counter()
        for token in decode_ids:
            llm.eval([token])
        decode.append(time.perf_counter() - t)
    return _rates(prefill[1:], decode[1:], len(prompt), len(decode_ids))


def _rates(prefill: list[float], decode: list[float], n_prompt: int, n_decode: int) -> dict:
    p, d = statistics.median(prefill), statistics.median(decode)
    return {"prefill_s": p, "prefill_tok_s": n_prompt / p, "decode_s": d, "decode_tok_s": n_decode / d,
            "ms_per_token": d / n_decode * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="GGUF file (default: SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "cpu_decode.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    fp32 = load_checkpoint(args.model)
    tok = fp32.tokenizer
    prompt = tok.encode_chat([{"role": "user", "content": TEXT * 20}])[: args.prompt_tokens]
    engine = Engine(fp32, max_seq_len=len(prompt) + args.decode_tokens + 8)
    # Decode the model's own greedy continuation, so every engine sees realistic tokens.
    logits = engine.prefill(prompt)
    decode_ids = []
    for _ in range(args.decode_tokens):
        decode_ids.append(int(logits.argmax()))
        logits = engine.decode_step(decode_ids[-1])
    engine.kv_truncate(0)

    bandwidth = measure_bandwidth_gb_s(args.threads)
    rows = {}
    n_params = fp32.config.n_params
    rows["floe float32"] = bench_floe(engine, prompt, decode_ids, args.repeats)
    rows["floe float32"]["weight_bytes"] = 4 * n_params
    del engine
    bf16 = Engine(load_checkpoint(args.model, torch.bfloat16), dtype="bfloat16",
                  max_seq_len=len(prompt) + args.decode_tokens + 8)
    rows["floe bfloat16"] = bench_floe(bf16, prompt, decode_ids, args.repeats)
    rows["floe bfloat16"]["weight_bytes"] = 2 * n_params
    del bf16
    try:
        rows[f"llama.cpp ({fp32.file_type})"] = bench_llama_cpp(
            fp32.source, args.threads, prompt, decode_ids, args.repeats
        ) | {"weight_bytes": fp32.source.stat().st_size}
    except ImportError:
        print("llama-cpp-python is not installed (pip install -e '.[bench]'): peer skipped")

    for row in rows.values():
        # Decode reads every weight once per token: the bandwidth ceiling for this engine's bytes.
        row["decode_ceiling_tok_s"] = bandwidth * 1e9 / row["weight_bytes"]
    print(f"\n{fp32.name} · {args.threads} threads · {len(prompt)}-token prompt · "
          f"{args.decode_tokens} decode tokens · copy bandwidth {bandwidth:.1f} GB/s\n")
    print(f"{'engine':<24}{'prefill tok/s':>14}{'decode tok/s':>14}{'ms/token':>10}"
          f"{'weights MB':>12}{'ceiling tok/s':>15}{'% ceiling':>11}")
    for name, r in rows.items():
        print(f"{name:<24}{r['prefill_tok_s']:>14.1f}{r['decode_tok_s']:>14.1f}{r['ms_per_token']:>10.2f}"
              f"{r['weight_bytes'] / 1e6:>12.0f}{r['decode_ceiling_tok_s']:>15.0f}"
              f"{100 * r['decode_tok_s'] / r['decode_ceiling_tok_s']:>10.0f}%")
    record = {"model": fp32.name, "fingerprint": fp32.fingerprint, "threads": args.threads,
              "prompt_tokens": len(prompt), "decode_tokens": args.decode_tokens,
              "bandwidth_gb_s": bandwidth, "machine": platform.processor() or platform.machine(),
              "torch": torch.__version__, "engines": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
