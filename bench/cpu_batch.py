"""Batched decode on the CPU: Engine.decode_batch over B slots, and N actors through one engine loop.

    python bench/cpu_batch.py [--model PATH] [--threads 2] [--sizes 1 2 4 8] [--actors 1 8]
                              [--prompt-tokens 64] [--tokens 128] [--repeats 5] [--name NAME]

Native weights of the model (default: SmolLM2-135M-Instruct, the installed GGUF). Engine alone: B
slots, each prefilled with its own --prompt-tokens prompt, then --tokens greedy steps of
decode_batch (each row's argmax fed back); its peer in the same run is the same rows stepped one
after another (decode_step per slot, what decode_batch did on the CPU before it batched). Actors: N
chat-guest actors answer one message each (rendered to ~--prompt-tokens tokens, greedy, up to
--tokens out), all at once through one EngineLoop; its peer, the loop with batch=False (a forward
per row). Every figure is the median of --repeats runs, the variants of a repeat interleaved, so a
shared machine's drift lands on all alike. Prints a table; writes bench/results/cpu_batch/NAME.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from cpu_decode import TEXT, machine, measure_bandwidth_gb_s

from floe.actor import Actor, EngineLoop
from floe.actor.stream import TokenStream
from floe.bench import decode_bytes, together
from floe.engine import Engine, SamplingParams
from floe.model import load_checkpoint

GREEDY = SamplingParams(0.0)


def message(tokenizer, i: int, n_tokens: int) -> str:
    """A user message whose rendered chat prompt is at most n_tokens tokens (as long as it can be)."""
    words = (f"Story {i}: write a long story about a lighthouse. " + TEXT * 8).split()
    lo, hi = 1, len(words)
    while lo < hi:  # the most words whose rendered prompt fits
        mid = (lo + hi + 1) // 2
        fits = len(tokenizer.encode_chat([{"role": "user", "content": " ".join(words[:mid])}])) <= n_tokens
        lo, hi = (mid, hi) if fits else (lo, mid - 1)
    return " ".join(words[:lo])


def engine_run(engine: Engine, prompts: list[list[int]], steps: int, batched: bool) -> float:
    """Seconds of `steps` greedy decode steps of every prompt's slot (prefill not timed)."""
    slots = list(range(len(prompts)))
    tokens = []
    for slot, ids in zip(slots, prompts, strict=True):
        engine.kv_truncate(0, slot)
        tokens.append(int(engine.prefill(ids, slot).argmax()))
    t = time.perf_counter()
    for _ in range(steps):
        rows = engine.decode_batch(tokens, slots) if batched else [
            engine.decode_step(token, slot) for token, slot in zip(tokens, slots, strict=True)]
        tokens = [int(row.argmax()) for row in rows]
    return time.perf_counter() - t


def actors_run(engine: Engine, messages: list[str], max_tokens: int, batch: bool,
               params: SamplingParams = GREEDY, ids: bool = False, on_text: bool = False,
               **loop_options) -> dict:
    """Every message sent by its own actor (chat guest) at once through one engine loop; ids: each
    reply streamed as token ids (a TokenStream, as `floe serve` streams); on_text: as text, each piece
    handed to its caller's on_text; else its text only at the end. loop_options: EngineLoop's (overlap,
    feed)."""
    loop = EngineLoop(engine, batch=batch, **loop_options)
    actors = [Actor(engine, loop=loop, seed=i) for i in range(len(messages))]
    streams = ((lambda: {"tokens": TokenStream()}) if ids else (lambda: {"on_text": [].append}) if on_text
               else dict)
    replies, wall = together([lambda a=a, m=m: a.send(m, max_tokens=max_tokens, params=params,
                                                      **streams()).stats
                              for a, m in zip(actors, messages, strict=True)])
    for actor in actors:
        actor.close()
    generated = sum(r.generated_tokens for r in replies)
    return {"wall_s": wall, "generated": generated, "tok_s": generated / wall,
            "prompt_tokens": [r.context_tokens for r in replies],
            "stream_decode_tok_s": statistics.median(r.decode_tokens_per_s for r in replies),
            "ttft_ms": 1e3 * statistics.median(r.ttft_s for r in replies),
            # on_message in each caller's thread (the rest of TTFT: the loop's steps to its first token)
            "prepare_ms": 1e3 * statistics.median(r.prepared - r.started for r in replies),
            "prepare_max_ms": 1e3 * max(r.prepared - r.started for r in replies),
            "rows_per_step": loop.rows / max(loop.steps, 1), "engine_loop": loop.stats()}


def interleaved(runs: dict, repeats: int) -> dict[str, list]:
    """Each run once to warm up, then `repeats` rounds of every run in turn (each printed as it ends)."""
    for run in runs.values():
        run()
    out: dict[str, list] = {name: [] for name in runs}
    for repeat in range(repeats):
        for name, run in runs.items():
            out[name].append(run())
            print(f"round {repeat + 1}/{repeats} {name}: {out[name][-1]}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="GGUF file (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--actors", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--name", default="cpu_batch", help="the JSON's name under bench/results/cpu_batch/")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    checkpoint = load_checkpoint(args.model)
    n_slots = max(*args.sizes, *args.actors, 2)
    engine = Engine(checkpoint, max_seq_len=4 * (args.prompt_tokens + args.tokens), n_slots=n_slots,
                    weights="native")
    tok = engine.tokenizer
    messages = [message(tok, i, args.prompt_tokens) for i in range(n_slots)]
    prompts = [tok.encode_chat([{"role": "user", "content": m}]) for m in messages]

    runs = {}
    for size in args.sizes:
        for batched in (True, False) if size > 1 else (True,):
            runs[("engine", size, batched)] = (
                lambda s=size, b=batched: engine_run(engine, prompts[:s], args.tokens, b))
    for n in args.actors:
        for batch in (True, False) if n > 1 else (True,):
            runs[("actors", n, batch)] = lambda n=n, b=batch: actors_run(engine, messages[:n], args.tokens, b)
    times = interleaved(runs, args.repeats)

    bandwidth, weight_bytes = measure_bandwidth_gb_s(args.threads), decode_bytes(engine)
    ceiling = bandwidth * 1e9 / weight_bytes  # tok/s of one row if the weights stream at copy bandwidth
    rows = []
    for (kind, size, batched), runs_of in times.items():
        row = {"kind": kind, "rows": size, "batched": batched}
        if kind == "engine":
            tok_s = [size * args.tokens / s for s in runs_of]
            row |= {"tok_s": statistics.median(tok_s), "tok_s_runs": tok_s,
                    "ceiling_tok_s": size * ceiling}  # the weights read once a step, for every row
        else:
            medians = ("tok_s", "stream_decode_tok_s", "ttft_ms", "wall_s", "rows_per_step")
            row |= {key: statistics.median(r[key] for r in runs_of) for key in medians}
            row |= {f"{key}_runs": [r[key] for r in runs_of] for key in ("tok_s", "generated")}
            row["prompt_tokens"] = runs_of[0]["prompt_tokens"]
        row["tok_s_per_row"] = row["tok_s"] / size
        rows.append(row)
    for kind in ("engine", "actors"):
        one = next((r["tok_s"] for r in rows if r["kind"] == kind and r["rows"] == 1), None)
        for r in rows:
            if r["kind"] == kind and one:
                r["vs_one"] = r["tok_s"] / one

    cpu = machine()
    c = engine.config
    print(f"\n{cpu['cpu']} ({', '.join(cpu['flags'])}), {args.threads} threads, "
          f"kernel {engine.native_kernel}")
    print(f"{checkpoint.name}: dim {c.dim}, {c.n_layers} layers, {c.n_heads}/{c.n_kv_heads} heads, ffn "
          f"{c.ffn_dim}, vocab {c.vocab_size}; {weight_bytes / 1e6:.0f} MB read a step; copy bandwidth "
          f"{bandwidth:.1f} GB/s; {args.prompt_tokens}-token prompts, {args.tokens} tokens out\n")
    print(f"{'':<8}{'rows':>5}  {'how':<13}{'tok/s':>8}{'best':>8}{'per row':>9}{'vs 1 row':>10}"
          f"{'ceiling':>9}{'TTFT ms':>9}{'stream tok/s':>14}")
    for r in rows:  # best: the fastest run (a shared machine's drift only slows runs down)
        how = "one forward" if r["batched"] else "row by row"
        ceiling = f"{r['ceiling_tok_s']:9.0f}" if "ceiling_tok_s" in r else f"{'':>9}"
        actor = f"{r['ttft_ms']:9.0f}{r['stream_decode_tok_s']:14.1f}" if r["kind"] == "actors" else ""
        print(f"{r['kind']:<8}{r['rows']:>5}  {how:<13}{r['tok_s']:8.1f}{max(r['tok_s_runs']):8.1f}"
              f"{r['tok_s_per_row']:9.1f}{r.get('vs_one', float('nan')):9.2f}x{ceiling}{actor}")
    record = {"model": checkpoint.name, "fingerprint": checkpoint.fingerprint, "threads": args.threads,
              "kernel": engine.native_kernel, "prompt_tokens": args.prompt_tokens, "tokens": args.tokens,
              "repeats": args.repeats, "bandwidth_gb_s": bandwidth, "weight_bytes": weight_bytes,
              "shape": {"dim": c.dim, "n_layers": c.n_layers, "n_heads": c.n_heads,
                        "n_kv_heads": c.n_kv_heads, "ffn_dim": c.ffn_dim, "vocab_size": c.vocab_size},
              "machine": cpu, "torch": torch.__version__, "rows": rows}
    out = Path(__file__).parent / "results" / "cpu_batch" / f"{args.name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
