"""CPU prefill and decode speed of floe (native, fp32, bf16) beside llama.cpp on the same GGUF, same run.

    python bench/cpu_decode.py [--model PATH] [--threads 2] [--prompt-tokens 256] [--decode-tokens 128]
                               [--kernels vnni,avx2,portable,int4pack] [--no-dense]
                               [--write-shape qwen3-0.6b]

--kernels: the native kernels to run, each as its own engine (default: every variant of floe's
kernel this CPU runs, and PyTorch's packed int4); --no-dense leaves out floe fp32 and bf16.
--write-shape: first write --model (if no file is there) as a GGUF of that KNOWN_SHAPES shape, a Llama
or Qwen3, every matrix Q4_0 of random codes, named as llama.cpp's converter names them (Qwen3's
blk.N.attn_q_norm / attn_k_norm, qwen3.attention.key_length), with SmolLM2's tokenizer padded to the
shape's vocabulary (unused [PADn] tokens): the token ids are the prompt's, the weights' values do not
matter to a speed.

Needs the `bench` extra for the peer (`pip install -e ".[bench]"`). Prints a table, writes JSON to
bench/results/cpu_decode.json. Each figure is the median of --repeats runs after one warm-up run,
the engines' runs interleaved (A B C D A B C D ...) so a shared machine's drift hits all alike;
every engine is fed the same token ids (floe fp32's greedy continuation of the prompt), and each
floe engine's greedy agreement with that continuation is reported.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
from smoke import results, shrink

from floe.bench import decode_bytes
from floe.engine import Engine
from floe.model import default_model_path, load_checkpoint
from floe.model.config import KNOWN_SHAPES
from floe.model.gguf_file import GGUFFile

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


def write_q4_0_shape(path: Path, shape: str, seed: int = 0) -> Path:
    """A GGUF of KNOWN_SHAPES[shape] (llama or qwen3), every matrix Q4_0 (random codes, fp16 scales
    ~0.002), norms 1, tied embeddings, written a tensor at a time (never the whole file in memory)."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFWriter

    c = KNOWN_SHAPES[shape]
    if c.arch not in ("llama", "qwen3"):
        raise SystemExit(f"--write-shape writes Llama and Qwen3 shapes, not {c.arch} ({shape})")
    hd = c.head_dim or c.dim // c.n_heads
    writer = GGUFWriter(path, c.arch)
    writer.add_name(f"{shape}-random-q4_0")
    for add, value in ((writer.add_block_count, c.n_layers), (writer.add_context_length, c.context_length),
                       (writer.add_embedding_length, c.dim), (writer.add_feed_forward_length, c.ffn_dim),
                       (writer.add_head_count, c.n_heads), (writer.add_head_count_kv, c.n_kv_heads),
                       (writer.add_key_length, hd), (writer.add_value_length, hd),
                       (writer.add_rope_freq_base, c.rope_theta), (writer.add_layer_norm_rms_eps, c.norm_eps),
                       (writer.add_vocab_size, c.vocab_size)):
        add(value)
    _add_padded_tokenizer(writer, c.vocab_size)
    matrices = {"token_embd.weight": (c.vocab_size, c.dim)}
    vectors = {"output_norm.weight": c.dim}
    for i in range(c.n_layers):
        p = f"blk.{i}."
        matrices.update({p + "attn_q.weight": (c.n_heads * hd, c.dim),
                         p + "attn_k.weight": (c.n_kv_heads * hd, c.dim),
                         p + "attn_v.weight": (c.n_kv_heads * hd, c.dim),
                         p + "attn_output.weight": (c.dim, c.n_heads * hd),
                         p + "ffn_gate.weight": (c.ffn_dim, c.dim), p + "ffn_up.weight": (c.ffn_dim, c.dim),
                         p + "ffn_down.weight": (c.dim, c.ffn_dim)})
        vectors.update({p + "attn_norm.weight": c.dim, p + "ffn_norm.weight": c.dim})
        if c.arch == "qwen3":
            vectors.update({p + "attn_q_norm.weight": hd, p + "attn_k_norm.weight": hd})
    for name, (rows, cols) in matrices.items():
        nbytes = rows * cols // 32 * 18
        writer.add_tensor_info(name, (rows, nbytes // rows), np.dtype(np.uint8), nbytes,
                               GGMLQuantizationType.Q4_0)
    for name, n in vectors.items():
        writer.add_tensor_info(name, (n,), np.dtype(np.float32), 4 * n)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for rows, cols in matrices.values():
        blocks = rng.integers(0, 256, size=(rows * cols // 32, 18), dtype=np.uint8)
        scales = (0.0015 + 0.001 * rng.random(len(blocks))).astype(np.float16)
        blocks[:, :2] = scales.view(np.uint8).reshape(-1, 2)
        writer.write_tensor_data(blocks.reshape(rows, -1))
    for n in vectors.values():
        writer.write_tensor_data(np.ones(n, dtype=np.float32))
    writer.close()
    return path


def _add_padded_tokenizer(writer, vocab: int) -> None:
    """SmolLM2's tokenizer (floe's default GGUF's tokenizer.* fields), its token list padded with unused
    [PADn] tokens to `vocab` (as Qwen's GGUFs pad theirs): llama.cpp wants a token per embedding row."""
    from gguf import TokenType

    fields = GGUFFile(default_model_path()).fields
    tokens = list(fields["tokenizer.ggml.tokens"])
    types = list(fields["tokenizer.ggml.token_type"])
    pad = vocab - len(tokens)
    writer.add_token_list(tokens + [f"[PAD{i}]" for i in range(len(tokens), vocab)])
    writer.add_token_types(types + [TokenType.UNUSED] * pad)
    writer.add_token_merges(fields["tokenizer.ggml.merges"])
    scalars = {bool: writer.add_bool, int: writer.add_uint32, str: writer.add_string}
    for key, value in fields.items():  # the special ids, the pre-tokenizer's name, the chat template
        if key.startswith("tokenizer.") and type(value) in scalars:
            scalars[type(value)](key, value)


def floe_run(engine: Engine, prompt: list[int], decode_ids: list[int]):
    """One timed run: (prefill seconds, decode seconds) of the whole prompt and every decode id."""

    def run() -> tuple[float, float]:
        engine.kv_truncate(0)
        t = time.perf_counter()
        engine.prefill(prompt)
        t1 = time.perf_counter()
        for token in decode_ids:
            engine.decode_step(token)
        t2 = time.perf_counter()
        engine.kv_truncate(0)
        return t1 - t, t2 - t1

    return run


def greedy_agreement(engine: Engine, prompt: list[int], reference: list[int]) -> int:
    """How many of the reference greedy tokens this engine reproduces before it first differs."""
    engine.kv_truncate(0)
    logits = engine.prefill(prompt)
    same = 0
    for token in reference:
        if int(logits.argmax()) != token:
            break
        same += 1
        logits = engine.decode_step(token)
    engine.kv_truncate(0)
    return same


def llama_cpp_run(path: Path, threads: int, prompt: list[int], decode_ids: list[int]):
    import llama_cpp

    llm = llama_cpp.Llama(str(path), n_ctx=len(prompt) + len(decode_ids) + 8, n_batch=512,
                          n_threads=threads, n_threads_batch=threads, verbose=False)

    def run() -> tuple[float, float]:
        llm.reset()
        t = time.perf_counter()
        llm.eval(prompt)
        t1 = time.perf_counter()
        for token in decode_ids:
            llm.eval([token])
        return t1 - t, time.perf_counter() - t1

    return run


def floe_engines(fp32, args, n: int, fp32_engine: Engine) -> dict[str, Engine]:
    """One engine per native kernel asked for, then (unless --no-dense) floe fp32 and bf16."""
    from floe.engine import qgemv

    here = [*qgemv.runnable(), "int4pack"]
    asked = args.kernels.split(",") if args.kernels else here
    kernels = [k for k in asked if k in here]
    for k in sorted(set(asked) - set(here)):  # (a command written for another CPU runs the rest)
        print(f"the {k} kernel does not run on this CPU: left out")
    if not kernels:
        raise SystemExit(f"none of the kernels asked for runs on this CPU (here: {', '.join(here)})")
    engines = {f"floe native ({k})": Engine(fp32, max_seq_len=n, weights="native", native_kernel=k)
               for k in kernels}
    if not args.no_dense:
        engines["floe float32"] = fp32_engine
        engines["floe bfloat16"] = Engine(load_checkpoint(args.model, torch.bfloat16), dtype="bfloat16",
                                          max_seq_len=n)
    return engines


def machine() -> dict:
    """The CPU's model name and the feature flags floe's kernel variants look at."""
    from floe.engine import qgemv

    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        model = names[0] if names else model
    except OSError:
        pass
    wanted = {flag for v in qgemv.VARIANTS.values() for flag in v.cpu_flags}
    return {"cpu": model, "cores": os.cpu_count(), "flags": sorted(wanted & qgemv.cpu_flags()),
            "floe_kernels": qgemv.runnable()}


def interleaved(runs: dict, repeats: int) -> dict[str, tuple[list[float], list[float]]]:
    """Each engine's runs taken in turn (after one warm-up each), so that drift of a shared
    machine's speed lands on every engine alike."""
    times = {name: ([], []) for name in runs}
    for run in runs.values():
        run()
    for _ in range(repeats):
        for name, run in runs.items():
            p, d = run()
            times[name][0].append(p)
            times[name][1].append(d)
    return times


def _rates(prefill: list[float], decode: list[float], n_prompt: int, n_decode: int) -> dict:
    p, d = statistics.median(prefill), statistics.median(decode)
    return {"prefill_s": p, "prefill_tok_s": n_prompt / p, "decode_s": d, "decode_tok_s": n_decode / d,
            "ms_per_token": d / n_decode * 1e3,
            "decode_tok_s_runs": [round(n_decode / x, 2) for x in decode]}


def print_table(rows: dict, peer: dict | None, cpu: dict, title: str, n_decode: int) -> None:
    print(f"\n{cpu['cpu']} ({', '.join(cpu['flags'])})\n{title}\n")
    print(f"{'engine':<30}{'prefill tok/s':>14}{'decode tok/s':>14}{'ms/token':>10}"
          f"{'weights MB':>12}{'% ceiling':>11}{'vs llama.cpp (p / d)':>22}{'greedy agree':>14}")
    for name, r in rows.items():
        if peer:
            r["prefill_vs_llama_cpp"] = r["prefill_tok_s"] / peer["prefill_tok_s"]
            r["decode_vs_llama_cpp"] = r["decode_tok_s"] / peer["decode_tok_s"]
        ratio = f"{r['prefill_vs_llama_cpp']:.2f}x / {r['decode_vs_llama_cpp']:.2f}x" if peer else "-"
        agree = f"{r['greedy_agreement']}/{n_decode}" if "greedy_agreement" in r else "-"
        print(f"{name:<30}{r['prefill_tok_s']:>14.1f}{r['decode_tok_s']:>14.1f}{r['ms_per_token']:>10.2f}"
              f"{r['weight_bytes'] / 1e6:>12.0f}"
              f"{100 * r['decode_tok_s'] / r['decode_ceiling_tok_s']:>10.0f}%{ratio:>22}{agree:>14}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="GGUF file (default: SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--kernels", default=None, help="native kernels, comma-separated (default: all here)")
    ap.add_argument("--no-dense", action="store_true", help="leave out floe fp32 and bf16")
    ap.add_argument("--write-shape", choices=sorted(k for k, c in KNOWN_SHAPES.items()
                                                    if c.arch in ("llama", "qwen3")),
                    help="first write --model (if absent) as a random Q4_0 GGUF of this shape")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "cpu_decode.json"))
    args = shrink(ap.parse_args(), prompt_tokens=16, decode_tokens=4, repeats=1)
    args.out = results(args.out)
    torch.set_num_threads(args.threads)
    if args.write_shape:
        if not args.model:
            raise SystemExit("--write-shape writes the file --model names: give one")
        if not Path(args.model).exists():
            print(f"writing {args.model}: {args.write_shape}, random Q4_0 ...")
            write_q4_0_shape(Path(args.model), args.write_shape)

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
    engines = floe_engines(fp32, args, len(prompt) + args.decode_tokens + 8, engine)
    runs = {name: floe_run(e, prompt, decode_ids) for name, e in engines.items()}
    peer_info = None
    try:
        runs[f"llama.cpp ({fp32.file_type})"] = llama_cpp_run(fp32.source, args.threads, prompt, decode_ids)
        import llama_cpp

        peer_info = {"version": llama_cpp.__version__, "path": llama_cpp.__file__,
                     "system_info": llama_cpp.llama_print_system_info().decode()}
    except ImportError:
        print("llama-cpp-python is not installed (pip install -e '.[bench]'): peer skipped")
    rows = {}
    for name, (prefill, decode) in interleaved(runs, args.repeats).items():
        rows[name] = _rates(prefill, decode, len(prompt), len(decode_ids))
        if name in engines:
            rows[name]["weight_bytes"] = decode_bytes(engines[name])
            rows[name]["greedy_agreement"] = greedy_agreement(engines[name], prompt, decode_ids)
        else:
            rows[name]["weight_bytes"] = fp32.source.stat().st_size
    peer = next((r for name, r in rows.items() if name.startswith("llama.cpp")), None)

    for row in rows.values():
        # Decode reads every weight once per token: the bandwidth ceiling for this engine's bytes.
        row["decode_ceiling_tok_s"] = bandwidth * 1e9 / row["weight_bytes"]
    cpu = machine()
    print_table(rows, peer, cpu, f"{fp32.name} · {args.threads} threads · {len(prompt)}-token prompt · "
                f"{args.decode_tokens} decode tokens · copy bandwidth {bandwidth:.1f} GB/s", len(decode_ids))
    record = {"model": fp32.name, "fingerprint": fp32.fingerprint, "threads": args.threads,
              "prompt_tokens": len(prompt), "decode_tokens": args.decode_tokens,
              "bandwidth_gb_s": bandwidth, "machine": cpu,
              "torch": torch.__version__, "llama_cpp": peer_info, "engines": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
