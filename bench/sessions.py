"""Many sessions on one device, three ways in one run: the engine alone, actors through one engine
loop, and `floe serve` (a child process; a raw HTTP client, --client openai: the official one).

    python bench/sessions.py --device cuda --shape llama-3.2-1b --tokenizer DIR [--sessions 1 4 16 64]
    python bench/sessions.py --device cpu [--sessions 1 8] [--threads 2]

Per session count S, each with --prompt-tokens-token prompts (64) and --tokens out (128), greedy
(actors and serve sample instead with --temperature T [--top-p P]):
- engine: S slots prefilled, then --tokens steps of Engine.decode_batch, each row's greedy choice
  fed back (the argmax the step computed where it has one); TTFT = one prompt's prefill alone.
- actors: S chat-guest actors send one message each at once through one EngineLoop (no HTTP).
- serve: bench/serve_load.py --server-process --sessions S --turns 1 with --probe new sessions
  timed while the S decode (the TTFT the issue asks for), the clients warmed first, CLIENT_STREAMS
  sessions a client process (many users are many processes, not one process's GIL).
Aggregate tok/s = tokens generated / wall; per-stream decode and TTFT p50 (p95 where measured). The
actors' and serve's wall holds their prompts' prefills, the engine's does not: "of e+pf" is their
share of the engine alone with its S prefills (one after another) counted too, the same work.
The CPU runs the default model (native weights); CUDA a real shape with seeded random bf16 weights.
Writes bench/results/sessions_<device>_<name>.json and prints the table.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from floe.cli.machine import polite_openmp

polite_openmp()  # as `floe serve` sets it, before torch is imported: every way runs alike

import torch  # noqa: E402
from cpu_batch import actors_run, message  # noqa: E402
from serve_load import ride_rows  # noqa: E402
from smoke import host, results, shrink  # noqa: E402

from floe.engine import Engine, SamplingParams  # noqa: E402

HERE = Path(__file__).parent
CLIENT_STREAMS = 8  # serve: sessions a client process holds (64 sessions: 8 processes of 8 streams)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def engine_alone(engine: Engine, prompts: list[list[int]], steps: int) -> dict:
    """S slots prefilled, then `steps` batched greedy steps; aggregate rate and one prefill's time."""
    slots = list(range(len(prompts)))
    tokens = []
    prefill_s = []
    for slot, ids in zip(slots, prompts, strict=True):
        engine.kv_truncate(0, slot)
        sync(engine.device)
        t = time.perf_counter()
        logits = engine.prefill(ids, slot)
        token = engine.greedy_token(slot)
        tokens.append(int(logits.argmax()) if token is None else token)
        prefill_s.append(time.perf_counter() - t)
    sync(engine.device)
    t = time.perf_counter()
    for _ in range(steps):
        rows = engine.decode_batch(tokens, slots)
        tokens = [engine.greedy_token(s) for s in slots]
        if None in tokens:
            tokens = [int(r.argmax()) for r in rows]
    sync(engine.device)
    wall = time.perf_counter() - t
    for slot in slots:
        engine.kv_truncate(0, slot)
    n = len(prompts) * steps
    # (the same work as the actors' and serve's rate, which counts their prompts' prefills: every
    # prompt prefilled one after another, then the steps)
    return {"tok_s": n / wall, "stream_decode_tok_s": steps / wall,
            "ttft_ms": 1e3 * statistics.median(prefill_s), "with_prefill_tok_s": n / (wall + sum(prefill_s))}


def serve(args, sessions: int) -> dict:
    out = Path(tempfile.mkdtemp()) / "serve.json"
    cmd = [sys.executable, str(HERE / "serve_load.py"), "--server-process", "--device", args.device,
           "--sessions", str(sessions), "--turns", "1", "--max-tokens", str(args.tokens),
           "--prompt-tokens", str(args.prompt_tokens), "--probe", str(args.probe), "--threads",
           str(args.threads), "--client-processes", str(max(1, sessions // args.client_streams)),
           "--temperature", str(args.temperature), "--top-p", str(args.top_p), "--out", str(out),
           "--fronts", str(args.fronts), "--client", args.client,
           *([] if args.ride_rows is None else ["--ride-rows", str(args.ride_rows)]),
           *([] if args.switch_interval_ms is None else
             ["--switch-interval-ms", str(args.switch_interval_ms)]),
           *([] if args.prompt_hints else ["--no-prompt-hints"]),
           *([] if args.timeline is None else ["--timeline", str(args.timeline / f"serve_{sessions}")])]
    if args.shape:
        cmd += ["--shape", args.shape, "--tokenizer", args.tokenizer]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.serve_timeout_s)
    if not out.exists():
        return {"failed": done.stderr[-1500:]}
    r = json.loads(out.read_text())
    return {"tok_s": r["aggregate_tok_s"], "stream_decode_tok_s": r["decode_tok_s_p50"],
            "ttft_ms": r["ttft_p50_ms"], "ttft_p95_ms": r["ttft_p95_ms"],
            "probe_ttft_ms": r["probe_ttft_p50_ms"], "probe_ttft_p95_ms": r["probe_ttft_p95_ms"],
            "errors": len(r["errors"]), "generated": r["generated_tokens"],
            "engine_loop": r.get("engine_loop")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--shape", default=None, help="seeded random weights at this shape (CUDA runs)")
    ap.add_argument("--tokenizer", default=None, help="tokenizer folder for --shape")
    ap.add_argument("--sessions", type=int, nargs="+", default=None)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--probe", type=int, default=8, help="new sessions timed while the others decode")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ways", nargs="+", default=["engine", "actors", "serve"])
    ap.add_argument("--serve-timeout-s", type=float, default=400)
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="actors' and serve's sampling (0: greedy; the engine alone is always greedy)")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--name", default=None)
    ap.add_argument("--fronts", type=int, default=1, help="serve: `floe serve --fronts N`")
    ap.add_argument("--switch-interval-ms", type=float, default=None,
                    help="serve: the core process's GIL switch interval (serve_load.py's; Python's: 5 ms)")
    ap.add_argument("--timeline", type=Path, default=None,
                    help="serve: which of the core's threads ran when, into DIR/serve_S "
                         "(probes/thread_timeline.py --show DIR/serve_S/timeline.json)")
    ap.add_argument("--ride-rows", type=int, default=None,
                    help="prompt rows a CUDA decode step takes along (bench/serve_load.py --ride-rows)")
    ap.add_argument("--no-prompt-hints", dest="prompt_hints", action="store_false",
                    help="serve: `floe serve --no-prompt-hints`")
    ap.add_argument("--client", choices=["raw", "openai"], default="raw",
                    help="serve: the load's HTTP client (bench/serve_load.py --client)")
    ap.add_argument("--client-streams", type=int, default=CLIENT_STREAMS,
                    help="serve: sessions one client process holds (the official client parses each "
                         "streamed chunk in Python: 8 streams kept a process ~95 %% busy on the H200 host)")
    args = shrink(ap.parse_args(), sessions=[1, 2], prompt_tokens=16, tokens=4, probe=1)
    params = SamplingParams(args.temperature, top_p=args.top_p)
    device = torch.device(args.device)
    sessions = args.sessions or ([1, 4, 16, 64] if device.type == "cuda" else [1, 8])
    torch.set_num_threads(args.threads)
    ride_rows(args.ride_rows)
    if args.shape:
        from floe.cli import _tokenizer
        from floe.model.synthetic import random_checkpoint

        checkpoint = random_checkpoint(args.shape, _tokenizer(args.tokenizer), dtype=torch.bfloat16,
                                       device=device)
    else:
        from floe.model import load_checkpoint

        checkpoint = load_checkpoint()
    native = device.type == "cpu"
    machine = host()  # (before the load: its calibration on a quiet host)
    rows = {}
    if {"engine", "actors"} & set(args.ways):
        engine = Engine(checkpoint, device=device, dtype="float32" if native else "bfloat16",
                        max_seq_len=1024, n_slots=max(sessions), weights="native" if native else "dense")
        engine.warm_up()
        texts = [message(engine.tokenizer, i, args.prompt_tokens) for i in range(max(sessions))]
        prompts = [engine.tokenizer.encode_chat([{"role": "user", "content": t}]) for t in texts]
        actors_run(engine, texts[:1], 2, batch=True)  # compiles the guest module, starts the loop
        # every token's reply bytes worked out, as `floe serve`'s warm-up does and as an application's
        # engine loop running several turns has done for its later sends (floe.actor.reply_text.fill_later)
        engine.tokenizer.fill_reply_bytes()
        gc.collect()  # as `floe serve` does at start: the start-up heap out of the cyclic GC's passes
        gc.freeze()
        for s in sessions:
            if "engine" in args.ways:
                engine_alone(engine, prompts[:1], 4)  # its first steps at this size: warm
                rows[s, "engine"] = engine_alone(engine, prompts[:s], args.tokens)
            if "actors" in args.ways:
                rows[s, "actors"] = actors_run(engine, texts[:s], args.tokens, batch=True, params=params)
            print(s, {k: v for (n, k), v in rows.items() if n == s}, flush=True)
        del engine
    if "serve" in args.ways:
        for s in sessions:
            rows[s, "serve"] = serve(args, s)
            print(s, "serve", rows[s, "serve"], flush=True)
    base = {s: rows[s, "engine"] for s in sessions if (s, "engine") in rows}
    print(f"\n{'sessions':>8} {'way':>7} {'tok/s':>9} {'of engine':>9} {'of e+pf':>8} {'stream':>8} "
          f"{'TTFT p50':>9} {'probe TTFT':>10} {'errors':>6}")
    for (s, way), r in rows.items():
        # (of e+pf: of the engine alone with its prompts' prefills counted, as the other ways count them)
        share, share_pf = (f"{100 * r['tok_s'] / base[s][k]:.0f} %" if s in base and "tok_s" in r else ""
                           for k in ("tok_s", "with_prefill_tok_s"))
        if way == "engine":  # (its own rate with its prefills instead)
            share_pf = f"{r['with_prefill_tok_s']:.0f}"
        probe = f"{r['probe_ttft_ms']:.1f}" if r.get("probe_ttft_ms") else ""
        stream = r.get("stream_decode_tok_s") or 0
        print(f"{s:>8} {way:>7} {r.get('tok_s', 0):>9.1f} {share:>9} {share_pf:>8} {stream:>8.1f} "
              f"{r.get('ttft_ms', 0):>9.1f} {probe:>10} {r.get('errors', '')!s:>6}")
    print(f"host: {machine['cpu']}, {machine['cores']} cores, Python {machine['python']} "
          f"({machine['python_us']:.0f} µs a fixed workload: bench/smoke.py's host())")
    name = args.name or (args.shape or "default")
    out = results(HERE / "results" / f"sessions_{device.type}_{name}.json")
    out.parent.mkdir(exist_ok=True)
    about = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
             "shape": args.shape, "prompt_tokens": args.prompt_tokens, "tokens": args.tokens,
             "temperature": args.temperature, "top_p": args.top_p, "host": machine}
    out.write_text(json.dumps(about | {"rows": [{"sessions": s, "way": w} | r for (s, w), r in rows.items()]},
                              indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
