"""Several models in one `floe serve` (issue 44): what loading a model on demand costs its request, what
the router costs a loaded model, and two models' sessions at once against one model's alone.

    python bench/serve_models.py [--device cpu] [--model PATH | --shape llama-3.2-1b] [--repeats 3]
                                 [--sessions 4] [--max-tokens 32] [--context 1024]
    python bench/serve_models.py --unbalanced 6 1 [--repeats 3] [--max-tokens 64]

1. load-and-first-token: `floe serve --model a=PATH --model b=COPY` (b a copy of the file: evicting it
   leaves a's cached); b's first request after b was unloaded (POST /v1/models/b/unload), its file in
   the page cache, and cold (evicted with posix_fadvise DONTNEED first: what an unprivileged process
   can do; the kernel may keep pages), --repeats each, alternated.
2. a loaded model's request through the router against a one-model `floe serve` of the same file,
   both running, requests alternated: time to first token and to a --max-tokens reply, medians.
3. --sessions streams on model a alone, then on a and b at once: aggregate generated tokens/s.
4. --unbalanced A B (instead of 1-3): A sessions stream on model a without a pause while B sessions
   each stream one --max-tokens reply on model b; against B on b alone and A on a alone, alternated,
   --repeats each: b's tokens/s a session, time to its first text and the gaps between its streamed
   texts (p50, p99, max), a's aggregate tokens/s over b's replies, and each engine loop's decode steps
   (EngineLoop.stats(), through /health): whether one model starves the other. Writes
   serve_models_unbalanced_<device>.json.

Each server is a `floe serve` process (its engine core and HTTP front as in production). --shape NAME
first writes a random Llama model of that shape (floe.model.config.KNOWN_SHAPES; the default model's
tokenizer, so its vocabulary) as a Hugging Face folder of bf16 safetensors in a temporary folder.
Writes bench/results/serve_models_<device>.json, with the router's log lines on each load (`load_log`:
checkpoint, engine, warm-up and core seconds, and the whole load).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

RESULTS = Path(__file__).parent / "results"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(flags: list[str], folder: Path, args) -> tuple[subprocess.Popen, str]:
    port = free_port()
    log = open(server_log(folder), "w")  # noqa: SIM115 - the server's for its life (load_phases reads it)
    proc = subprocess.Popen([sys.executable, "-m", "floe.cli", "serve", "--port", str(port), "--snapshots",
                             str(folder), "--context", str(args.context), "--device", args.device,
                             "--max-sessions", str(max(4, 2 * args.sessions)), *flags],
                            stdout=subprocess.DEVNULL, stderr=log)
    log.close()  # (the child holds its own descriptor)
    url, deadline = f"http://127.0.0.1:{port}", time.time() + 600
    while True:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            raise SystemExit(f"floe serve did not start: {server_log(folder).read_text()[-2000:]}")
        time.sleep(0.05)


def server_log(folder: Path) -> Path:
    """Where serve(…, folder, …)'s server writes its log (stderr)."""
    return folder.with_name(folder.name + ".log")


def load_phases(folder: Path) -> list[str]:
    """The server's lines on each model load: where its time went (checkpoint, engine, warm-up, core)
    and its whole time."""
    return [line.removeprefix("floe serve: ") for line in server_log(folder).read_text().splitlines()
            if ": checkpoint " in line or " loaded in " in line]


def reply(url: str, model: str, max_tokens: int, text: str = "Tell me about Paris.",
          chunks: list | None = None) -> tuple:
    """One streamed chat: seconds to its first content, to its end, and its tokens. chunks: each
    chunk of text's time.perf_counter() is appended to it."""
    started, first, usage = time.perf_counter(), None, 0
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=600, json={
            "model": model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and '"content"' in line:
                now = time.perf_counter()
                first = now - started if first is None else first
                if chunks is not None and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                    chunks.append(now)  # (not the first chunk's empty content, with its role)
            if line.startswith("data: {") and '"usage": {' in line:
                usage = json.loads(line[6:])["usage"]["completion_tokens"]
    return first, time.perf_counter() - started, usage


def evict(path: Path) -> None:
    for f in ([path] if path.is_file() else sorted(path.iterdir())):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def unload(url: str, model: str) -> None:
    while (r := httpx.post(f"{url}/v1/models/{model}/unload", timeout=600)).status_code == 409:
        time.sleep(0.05)  # (its last request is ending)
    r.raise_for_status()


def load_and_first_token(url: str, copy: Path, repeats: int) -> dict:
    times: dict[str, list[float]] = {"cached": [], "cold": []}
    reply(url, "b", 1)  # (the first load of b reads its file: neither case)
    for i in range(2 * repeats):
        kind = "cold" if i % 2 else "cached"
        unload(url, "b")
        time.sleep(6)  # its engine collected (the engine loop's thread lets go after 5 s idle)
        if kind == "cold":
            evict(copy)
        times[kind].append(reply(url, "b", 1)[0])
    return {k: {"median_s": statistics.median(v), "all_s": v} for k, v in times.items()}


def router_cost(router: str, single: str, single_id: str, args) -> dict:
    runs: dict[str, list[tuple]] = {"router": [], "one_model": []}
    ways = [("router", router, "a"), ("one_model", single, single_id)]
    for _, url, model in ways:
        reply(url, model, args.max_tokens)
    for i in range(10 * args.repeats):
        for name, url, model in (ways if i % 2 else ways[::-1]):
            runs[name].append(reply(url, model, args.max_tokens))
    return {name: {"ttft_ms": 1e3 * statistics.median(r[0] for r in rs),
                   "reply_ms": 1e3 * statistics.median(r[1] for r in rs)} for name, rs in runs.items()}


def aggregate(url: str, models: list[str], sessions: int, max_tokens: int) -> float:
    """Generated tokens/s of `sessions` streams on each of `models`, all at once."""
    jobs = [(m, f"Tell me about topic {i} of {m}.") for m in models for i in range(sessions)]
    started = time.perf_counter()
    with ThreadPoolExecutor(len(jobs)) as pool:
        tokens = sum(r[2] for r in pool.map(lambda job: reply(url, job[0], max_tokens, job[1]), jobs))
    return tokens / (time.perf_counter() - started)


def loop_stats(url: str) -> dict:
    """Each loaded model's engine loop counters (EngineLoop.stats(), through /health)."""
    models = httpx.get(url + "/health", timeout=60).json()["models"]
    return {name: m["engine_loop"] for name, m in models.items() if "engine_loop" in m}


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def unbalanced_run(url: str, busy: int, lone: int, max_tokens: int) -> dict:
    """`busy` streams on a (each streaming again as soon as it ends) while `lone` streams on b each run
    one reply; either side 0: the other alone. b's streams, and a's tokens while b's ran."""
    import threading

    stop, a_chunks, b_runs = threading.Event(), [[] for _ in range(busy)], []

    def busy_stream(i: int) -> None:
        while not stop.is_set():
            reply(url, "a", max_tokens, f"Tell me about topic {i}.", a_chunks[i])

    def lone_stream(i: int) -> None:
        chunks: list[float] = []
        begun = time.perf_counter()
        _, total, tokens = reply(url, "b", max_tokens, f"Tell me about place {i}.", chunks)
        gaps = [1e3 * (t1 - t0) for t0, t1 in zip(chunks, chunks[1:], strict=False)]
        b_runs.append({"ttft_ms": 1e3 * (chunks[0] - begun), "tok_s": tokens / total, "tokens": tokens,
                       "gaps_ms": gaps})

    with ThreadPoolExecutor(busy + lone) as pool:
        jobs = [pool.submit(busy_stream, i) for i in range(busy)]
        if busy:
            time.sleep(2.0)  # a's streams past their prompts
        before, started = loop_stats(url), time.perf_counter()
        lones = [pool.submit(lone_stream, i) for i in range(lone)]
        for j in lones:
            j.result()
        if not lone:
            time.sleep(max_tokens / 40)
        ended = time.perf_counter()
        after = loop_stats(url)  # (before a's streams end)
        stop.set()
        for j in jobs:
            j.result()
    a_tokens = sum(1 for c in a_chunks for t in c if started <= t <= ended)
    seconds = ended - started
    steps = {m: {k: after[m][k] - before.get(m, after[m])[k] for k in ("steps", "rows", "step_s")}
             for m in after}
    for s in steps.values():  # each loop's decode steps a second, and its mean time in a step
        s["steps_per_s"], s["step_ms"] = s["steps"] / seconds, 1e3 * s["step_s"] / max(1, s["steps"])
    return {"b": b_runs, "a_tok_s": a_tokens / seconds if busy else None, "seconds": seconds,
            "steps": steps}


def unbalanced(url: str, busy: int, lone: int, args) -> dict:
    """--unbalanced: the three runs (b alone, a alone, both), alternated, --repeats each."""
    reply(url, "b", 4)  # (both loaded and warm)
    reply(url, "a", 4)
    runs: dict[str, list[dict]] = {"b_alone": [], "a_alone": [], "both": []}
    for i in range(args.repeats):
        order = [("b_alone", 0, lone), ("a_alone", busy, 0), ("both", busy, lone)]
        for name, n_a, n_b in (order if i % 2 == 0 else order[::-1]):
            runs[name].append(unbalanced_run(url, n_a, n_b, args.max_tokens))
    out = {}
    for name, rs in runs.items():
        bs = [b for r in rs for b in r["b"]]
        gaps = [g for b in bs for g in b["gaps_ms"]]
        out[name] = {"runs": rs, "a_tok_s": [r["a_tok_s"] for r in rs if r["a_tok_s"] is not None],
                     "b_tok_s": [b["tok_s"] for b in bs], "b_ttft_ms": [b["ttft_ms"] for b in bs],
                     "b_gap_ms": {"p50": percentile(gaps, 0.5), "p99": percentile(gaps, 0.99),
                                  "max": max(gaps, default=float("nan"))},
                     "steps": [r["steps"] for r in rs]}
    return out


def report_unbalanced(result: dict) -> None:
    u = result["unbalanced"]
    print(f"{result['model']} on {result['device']}: {result['busy']} sessions streaming on a, "
          f"{result['lone']} on b, {result['max_tokens']}-token replies, {result['repeats']} repeats")

    def span(values: list[float], unit: str) -> str:
        return f"{min(values):.1f}-{max(values):.1f} {unit}" if values else "-"

    for name in ("b_alone", "a_alone", "both"):
        r = u[name]
        steps = "; ".join(f"{m} {s['steps_per_s']:.0f} steps/s, {s['step_ms']:.1f} ms a step"
                          for m, s in r["steps"][-1].items() if s["steps"])
        print(f"  {name:8s} b: {span(r['b_tok_s'], 'tok/s')}, TTFT {span(r['b_ttft_ms'], 'ms')}, gaps p50 "
              f"{r['b_gap_ms']['p50']:.1f} p99 {r['b_gap_ms']['p99']:.1f} max {r['b_gap_ms']['max']:.1f} ms"
              f" | a: {span(r['a_tok_s'], 'tok/s')} | last run: {steps}")
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"serve_models_unbalanced_{result['device']}.json"
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


def random_model(shape: str, folder: Path, tokenizer_folder: str | None = None) -> Path:
    """A random Llama model of `shape` as a Hugging Face folder (bf16 safetensors), the default model's
    tokenizer or `tokenizer_folder`'s (its tokenizer.json and tokenizer_config.json copied: where the
    default model's package is not installed, as on a lent GPU machine)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from floe.model.config import KNOWN_SHAPES

    c = KNOWN_SHAPES[shape]
    if tokenizer_folder:
        from floe.model.hf_folder import tokenizer_from_folder

        tokenizer = tokenizer_from_folder(Path(tokenizer_folder), {})
    else:
        from floe.model import default_model_path
        from floe.model.gguf_file import GGUFFile
        from floe.model.gguf_tokenizer import tokenizer_from_gguf

        tokenizer = tokenizer_from_gguf(GGUFFile(default_model_path()).fields)
    config = LlamaConfig(hidden_size=c.dim, num_hidden_layers=c.n_layers, num_attention_heads=c.n_heads,
                         num_key_value_heads=c.n_kv_heads, intermediate_size=c.ffn_dim,
                         vocab_size=tokenizer.vocab_size, max_position_embeddings=8192,
                         rms_norm_eps=c.norm_eps,
                         tie_word_embeddings=c.tie_embeddings, bos_token_id=1, eos_token_id=2)
    write_random_weights(config, LlamaForCausalLM, folder)
    tokenizer.backend.save(str(folder / "tokenizer.json"))
    if tokenizer_folder:
        shutil.copy(Path(tokenizer_folder) / "tokenizer_config.json", folder)
    return folder


SHARD_BYTES = 4 << 30  # a safetensors shard of the random model, as transformers shards (index beside)


def write_random_weights(config, model_class, folder: Path, seed: int = 0) -> None:
    """`model_class(config)`'s weights, seeded random bf16 (std 0.02; norms 1), written shard by shard
    with their index: the model's tensors' names and shapes from a model made on the meta device, each
    tensor drawn on the GPU where there is one (an 8B model made and written in seconds, where
    transformers' own init on the CPU took minutes and twice its size in memory)."""
    import torch
    from safetensors.torch import save_file

    with torch.device("meta"):
        model = model_class(config)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(seed)
    folder.mkdir(parents=True, exist_ok=True)
    setattr(config, "dtype" if hasattr(config, "dtype") else "torch_dtype", torch.bfloat16)
    config.save_pretrained(folder)
    names = [n for n, _ in model.named_parameters()]  # (a tied head is one tensor: named once)
    shapes = dict(model.state_dict(keep_vars=True).items())
    shards, shard, size = [], {}, 0
    for name in names:
        shape = shapes[name].shape
        if name.endswith("norm.weight"):
            t = torch.ones(shape, dtype=torch.bfloat16)
        else:
            t = (torch.randn(shape, generator=gen, device=device, dtype=torch.float32) * 0.02).to(
                torch.bfloat16).cpu()
        shard[name] = t
        size += t.numel() * 2
        if size >= SHARD_BYTES:
            shards.append(shard)
            shard, size = {}, 0
    if shard:
        shards.append(shard)
    weight_map, total = {}, 0
    for k, tensors in enumerate(shards):
        file = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, str(folder / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
        total += sum(t.numel() * 2 for t in tensors.values())
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))


def report(result: dict) -> None:
    """The table, and the JSON in bench/results/."""
    lt, lm, tm = result["load_and_first_token"], result["loaded_model"], result["two_models"]
    print(f"{result['model']} on {result['device']}")
    print(f"  load-and-first-token  cached {lt['cached']['median_s']:.3f} s, "
          f"cold {lt['cold']['median_s']:.3f} s")
    for name, r in lm.items():
        print(f"  loaded, {name:9s}  TTFT {r['ttft_ms']:.1f} ms, {result['max_tokens']}-token reply "
              f"{r['reply_ms']:.1f} ms")
    ratio = tm["both_tok_s"] / tm["one_alone_tok_s"]
    print(f"  {result['sessions']} sessions a model: one alone {tm['one_alone_tok_s']:.0f} tok/s, "
          f"two at once {tm['both_tok_s']:.0f} tok/s together ({ratio:.2f}x)")
    for line in result.get("load_log", []):
        print(f"  log: {line}")
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"serve_models_{result['device']}.json"
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default=None, help="GGUF file or Hugging Face folder (default: the default "
                    "model)")
    ap.add_argument("--shape", default=None, help="a random model of this shape instead (e.g. llama-3.2-1b)")
    ap.add_argument("--tokenizer", default=None, help="tokenizer folder for --shape (tokenizer.json, "
                    "tokenizer_config.json; default: the default model's)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--unbalanced", type=int, nargs=2, metavar=("A", "B"), default=None,
                    help="only case 4: A sessions streaming on model a, B on model b")
    args = ap.parse_args()
    from floe.model import default_model_path

    work = Path(tempfile.mkdtemp(prefix="floe-serve-models-"))
    procs = []
    try:
        if args.shape:
            source = random_model(args.shape, work / "model", args.tokenizer)
        else:
            source = Path(args.model) if args.model else default_model_path()
        copy = work / f"copy{source.suffix}"
        (shutil.copytree if source.is_dir() else shutil.copy)(source, copy)
        if args.unbalanced:
            busy, lone = args.unbalanced
            args.sessions = (busy + lone + 1) // 2  # (--max-sessions: room for them all)
            router, router_url = serve(["--model", f"a={source}", "--model", f"b={copy}"], work / "s1", args)
            procs.append(router)
            result = {"device": args.device, "model": args.shape or source.name, "busy": busy, "lone": lone,
                      "max_tokens": args.max_tokens, "repeats": args.repeats,
                      "unbalanced": unbalanced(router_url, busy, lone, args)}
            return report_unbalanced(result)
        router, router_url = serve(["--model", f"a={source}", "--model", f"b={copy}"], work / "s1", args)
        procs.append(router)
        single, single_url = serve(["--model", str(source), "--model-id", "one"], work / "s2", args)
        procs.append(single)
        result = {"device": args.device, "model": args.shape or source.name, "sessions": args.sessions,
                  "max_tokens": args.max_tokens,
                  "load_and_first_token": load_and_first_token(router_url, copy, args.repeats),
                  "loaded_model": router_cost(router_url, single_url, "one", args)}
        single.terminate()
        reply(router_url, "b", 1)  # (b loaded again)
        alone = aggregate(router_url, ["a"], args.sessions, args.max_tokens)
        both = aggregate(router_url, ["a", "b"], args.sessions, args.max_tokens)
        result["two_models"] = {"one_alone_tok_s": alone, "both_tok_s": both}
        result["load_log"] = load_phases(work / "s1")
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                p.wait(60)
        shutil.rmtree(work, ignore_errors=True)
    report(result)

if __name__ == "__main__":
    main()
