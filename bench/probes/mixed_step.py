"""What the device spends to take a burst's prompts in: an engine alone (no actors, no server) with D slots
decoding, timed step by step (wall, the host waiting for each step's end) as K more prompts of P tokens
ride in the decode step's replay (Engine.launch_batch's prompts: the mixed graphs), against the same
prompts each prefilled alone and the decode step with none riding. Whether a 64-burst's first tokens
wait for the device's intake of the prompts (the mixed steps' time) or for the host's admission.

    python bench/probes/mixed_step.py --device cuda --shape llama-3.2-1b --tokenizer DIR [--decoding 64]
        [--prompt-tokens 70] [--riding 1 3 6] [--repeats 20] [--trace N]

Prints per case the median wall of a step (ms) over --repeats, its rows (decode + prompt), and prompt rows
taken in a second. Seeded random weights at the shape (floe.model.synthetic).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent.parent))

from floe.engine import Engine  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shape", default="llama-3.2-1b")
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--decoding", type=int, default=64, help="slots decoding in every step")
    ap.add_argument("--prompt-tokens", type=int, default=70)
    ap.add_argument("--riding", type=int, nargs="+", default=[1, 3, 6], help="prompts riding a step")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--trace", type=int, default=0, metavar="N",
                    help="then one step with the most prompts riding under torch.profiler: its N costliest "
                         "device kernels (the graph's own, as CUPTI reports them)")
    args = ap.parse_args()
    from floe.cli import _tokenizer
    from floe.model.synthetic import random_checkpoint

    device = torch.device(args.device)
    most = max(args.riding)
    checkpoint = random_checkpoint(args.shape, _tokenizer(args.tokenizer), dtype=torch.bfloat16,
                                   device=device)
    engine = Engine(checkpoint, device=device, dtype="bfloat16", max_seq_len=1024,
                    n_slots=args.decoding + most, weights="dense")
    engine.warm_up()
    vocab = engine.config.vocab_size
    gen = torch.Generator().manual_seed(0)

    def prompt() -> list[int]:
        return torch.randint(0, min(vocab, 32000), (args.prompt_tokens,), generator=gen).tolist()

    decoding = list(range(args.decoding))
    riders = list(range(args.decoding, args.decoding + most))
    for slot in decoding:
        engine.prefill(prompt(), slot)
    tokens = [engine.greedy_token(s) or 0 for s in decoding]

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    def step(k: int) -> float:
        """One decode step of the decoding slots with k prompts riding; its wall (ms)."""
        nonlocal tokens
        for slot in riders[:k]:
            engine.kv_truncate(0, slot)
        prompts = [(prompt(), slot) for slot in riders[:k]]
        for slot in decoding:  # (the slots stay well inside the context: each step is the same work)
            if engine.kv_len(slot) > 900:
                engine.kv_truncate(args.prompt_tokens, slot)
        sync()
        t = time.perf_counter()
        launched = engine.launch_batch(tokens, decoding, prompts)
        engine.finish_batch(launched)
        sync()
        wall = time.perf_counter() - t
        tokens = [engine.greedy_token(s) or 0 for s in decoding]
        for result in launched.prompt_results or ():
            if not isinstance(result, torch.Tensor):
                raise RuntimeError(f"a riding prompt failed: {result}")
        return 1e3 * wall

    def prefills(k: int) -> float:
        """k prompts, each prefilled alone, one after another; their wall (ms)."""
        for slot in riders[:k]:
            engine.kv_truncate(0, slot)
        ids = [prompt() for _ in range(k)]
        sync()
        t = time.perf_counter()
        for slot, p in zip(riders[:k], ids, strict=True):
            engine.prefill(p, slot)
        sync()
        return 1e3 * (time.perf_counter() - t)

    print(f"{args.shape} on {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}: "
          f"{args.decoding} slots decoding, prompts of {args.prompt_tokens} tokens; median of {args.repeats}")
    print(f"{'case':>34} {'ms':>8} {'rows':>6} {'prompt rows/s':>14}")
    for k in [0, *args.riding]:
        step(k)  # (a graph captured for a new size: not timed)
        ms = statistics.median(step(k) for _ in range(args.repeats))
        rows = args.decoding + k * args.prompt_tokens
        rate = f"{1e3 * k * args.prompt_tokens / ms:14.0f}" if k else f"{'':>14}"
        print(f"{f'decode step, {k} prompts riding':>34} {ms:8.2f} {rows:6d} {rate}")
    if args.trace and device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step(most)
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.trace,
                                        max_name_column_width=60))
    for k in args.riding:
        prefills(k)
        ms = statistics.median(prefills(k) for _ in range(max(3, args.repeats // 4)))
        print(f"{f'{k} prompts prefilled alone':>34} {ms:8.2f} {k * args.prompt_tokens:6d} "
              f"{1e3 * k * args.prompt_tokens / ms:14.0f}")


if __name__ == "__main__":
    main()
