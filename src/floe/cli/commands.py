"""The commands besides `floe serve`: run (one message), probe, snapshot inspect and verify, profile, and
bench decode and dispatch."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from floe.cli.machine import (
    _check_device,
    _load_with_progress,
    _stderr_console,
    _threads,
    import_torch_holding_ctrl_c,
)
from floe.cli.options import WEIGHTS, weights_for
from floe.errors import FloeError


def _prompt(args: argparse.Namespace) -> str:
    """`floe run`'s message: the argument, standard input (`-`) or --prompt-file's text (from those two,
    less one final newline, as a shell's $(…) takes it: `echo … | floe run -` asks what the argument
    would)."""
    if (args.prompt is None) == (args.prompt_file is None):
        raise FloeError("give the message as PROMPT, as - (read from standard input) or with "
                        "--prompt-file FILE (one of them)")
    try:
        if args.prompt_file is not None:
            text = Path(args.prompt_file).read_text(encoding="utf-8")
        elif args.prompt == "-":
            text = sys.stdin.read()
        else:
            return args.prompt
        return text.removesuffix("\n").removesuffix("\r")
    except (OSError, UnicodeDecodeError) as e:
        raise FloeError(f"cannot read the message from {args.prompt_file or 'standard input'}: {e}") from None


def cmd_run(args: argparse.Namespace) -> int:
    from floe.sampling_params import SamplingParams

    # Mistakes in the command line first: said at once, before torch is imported (1-4 s).
    params = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
    if args.max_tokens < 1:
        raise FloeError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if args.raw and (args.system or args.json_schema or args.thaw):
        raise FloeError("--raw continues a text: it takes no --system, --json-schema or --thaw (a chat's)")
    prompt = _prompt(args)

    import_torch_holding_ctrl_c()
    from floe.actor import Actor
    from floe.engine import Engine

    _check_device(args.device)  # before the model loads: no CUDA (or WebGPU adapter) here is said at once
    _threads(args, args.device)
    weights = weights_for(args.device, args.weights)
    dtype, kind = WEIGHTS[weights]
    started = time.perf_counter()
    checkpoint = _load_with_progress(args.model, "float32", quiet=args.json)
    engine = Engine(checkpoint, device=args.device, dtype=dtype, max_seq_len=args.context, weights=kind)
    stream = None if args.json else _write_stdout
    guest = args.guest
    if args.raw:  # the complete guest, as /v1/completions
        from floe.actor import builtin_guest, complete_message

        guest = guest or builtin_guest("complete")
        prompt = complete_message(engine.tokenizer, prompt)
    if args.json_schema:  # the grammar guest reads the schema from the message (docs/GUESTS.md)
        from floe.actor import builtin_guest
        from floe.actor.grammar import grammar_message

        guest = guest or builtin_guest("grammar")
        prompt = grammar_message(prompt, Path(args.json_schema).read_text())
    if args.thaw or args.freeze:  # (safetensors and the snapshot format: imported only then)
        from floe import snapshot
    if args.thaw:
        if args.system:
            raise FloeError("--system applies to a new conversation; a thawed one keeps its own")
        actor = snapshot.thaw(engine, args.thaw, guest, seed=args.seed)
    else:
        actor = Actor(engine, guest, seed=args.seed, system_prompt=args.system or "", continues_text=args.raw)
    if args.json_schema:
        from floe.actor.grammar import GRAMMAR_EXPORT

        if not actor.guest.has_function(GRAMMAR_EXPORT):
            actor.close()
            raise FloeError("--json-schema needs the grammar guest: this actor's guest (--guest, or the "
                            "thawed snapshot's) does not read a schema")
    setup_s = time.perf_counter() - started  # the model read, the engine built, the actor made
    with actor:
        reply = actor.send(prompt, max_tokens=args.max_tokens, params=params, on_text=stream)
        frozen = snapshot.freeze(actor, args.freeze, args.kv_dtype) if args.freeze else None
    stats = reply.stats
    finish = "length" if stats.generated_tokens >= args.max_tokens else "stop"
    if args.json:
        record = _run_record(engine, reply, finish, str(guest) if guest else None)
        record["kv_len"] = engine.kv_len(actor.slot)
        record["setup_ms"] = round(setup_s * 1e3, 1)
        if frozen:
            record["frozen"] = frozen
        print(json.dumps(record, ensure_ascii=False))
    else:
        sys.stdout.write("\n")
        _stderr_console().print(
            f"[dim]{stats.prompt_tokens} prompt tokens, {stats.generated_tokens} generated "
            f"({finish}); TTFT {stats.ttft_s * 1e3:.0f} ms, "
            f"decode {stats.decode_tokens_per_s:.1f} tok/s"
            f"{f' ({engine.native_kernel} kernel)' if engine.native_kernel else ''}; "
            f"{reply.ledger.total_copies()} copies across the guest boundary[/dim]"
        )
        if frozen:
            _stderr_console().print(f"[dim]froze the conversation into {frozen['path']} "
                                    f"({frozen['bytes'] / 1e6:.2f} MB, "
                                    f"{frozen['seconds'] * 1e3:.1f} ms)[/dim]")
    return 0


def _write_stdout(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _run_record(engine, reply, finish: str, guest: str | None) -> dict:
    ckpt = engine.checkpoint
    stats = reply.stats
    return {
        "text": reply.text,
        "token_ids": stats.token_ids,
        "prompt_tokens": stats.prompt_tokens,
        "generated_tokens": stats.generated_tokens,
        "finish_reason": finish,
        "ttft_ms": round(stats.ttft_s * 1e3, 3),
        "decode_tokens_per_s": round(stats.decode_tokens_per_s, 3),
        "model": {"name": ckpt.name, "fingerprint": ckpt.fingerprint, "path": str(ckpt.source),
                  "file_type": ckpt.file_type},
        "device": "webgpu" if engine.backend == "webgpu" else str(engine.device),  # (its tensors: cpu)
        "dtype": str(engine.dtype).removeprefix("torch."),
        "weights": {"kind": engine.weights, "kernel": engine.native_kernel, "quantized": engine.packed},
        "guest": guest or "chat (built in)",
        "boundaries": reply.ledger.rows(),
    }


def cmd_probe(args: argparse.Namespace) -> int:
    import_torch_holding_ctrl_c()
    from floe.engine import parse_device
    from floe.probe import probe_zero_copy

    parse_device(args.device)
    r = probe_zero_copy(args.device)
    if args.json:
        print(json.dumps(r))
    else:
        ok = "[green]yes[/green]" if r["pointer_identity"] else "[red]NO[/red]"
        console = _stderr_console()
        console.print(f"zero-copy probe on {r['device']}")
        for name, ptr in r["pointers"].items():
            console.print(f"  {name:<20} {ptr}")
        console.print(f"  pointer identity     {ok}")
        console.print(f"  RSS growth, 16 MiB exposed to torch: view {r['rss_delta_zero_copy_mb']:.2f} MB,"
                      f" copy {r['rss_delta_copy_mb']:.2f} MB")
        console.print(f"  {r['gemm_n']}x{r['gemm_n']} GEMM in guest memory: max abs error "
                      f"{r['gemm_max_abs_error']:g}, mismatches {r['gemm_mismatches']}")
    good = r["pointer_identity"] and r["gemm_mismatches"] == 0
    return 0 if good else 1


def cmd_snapshot_inspect(args: argparse.Namespace) -> int:
    import_torch_holding_ctrl_c()
    from floe.snapshot import Snapshot

    s = Snapshot(args.file).summary()
    if args.json:
        print(json.dumps(s))
        return 0
    print(f"{s['path']}: {s['file_bytes'] / 1e6:.2f} MB, {s['tokens']} tokens of context")
    print(f"  model   {s['model']['name']} ({s['model']['fingerprint'][:16]}…)")
    print(f"  guest   {s['guest']['name']} ({s['guest']['sha256'][:16]}…), ABI {s['abi_version']}")
    print(f"  kv      {s['kv_dtype']} (engine {s['engine_dtype']}, {s['engine_weights']} weights), "
          f"{s['shape']['n_layers']} layers × "
          f"{s['shape']['n_kv_heads']} heads × {s['shape']['head_dim']}, "
          f"{s['tensor_bytes']['kv'] / 1e6:.2f} MB")
    print(f"  memory  {s['guest_memory_bytes'] / 2**20:.2f} MiB guest memory, "
          f"{s['tensor_bytes']['guest_memory'] / 1e6:.3f} MB stored (zero pages left out)")
    print(f"  made    {s['created_at']}, format {s['format_version']}, checksum {s['checksum']}")
    return 0


def cmd_snapshot_verify(args: argparse.Namespace) -> int:
    import_torch_holding_ctrl_c()
    from floe.actor import SUPPORTED_ABI_VERSIONS
    from floe.snapshot import Snapshot, model_fingerprint

    snap = Snapshot(args.file)  # integrity, format version and checksum
    checks = ["integrity and checksum"]
    snap.verify(abi_version=SUPPORTED_ABI_VERSIONS)
    checks.append(f"ABI {snap.metadata['abi_version']}")
    if args.model is not None or args.default_model:
        checkpoint = _load_with_progress(args.model, "float32", quiet=True)
        c = checkpoint.config
        snap.verify(fingerprint=model_fingerprint(checkpoint, snap), n_layers=c.n_layers,
                    n_kv_heads=c.n_kv_heads, head_dim=c.head_dim, max_seq_len=c.context_length)
        checks.append(f"model {checkpoint.name}")
    print(f"{args.file}: ok ({', '.join(checks)})")
    return 0


def _tokenizer(folder: str | None):
    """The tokenizer in `folder` (tokenizer.json), or the default model's."""
    if folder:
        from pathlib import Path

        from floe.model.hf_folder import tokenizer_from_folder

        return tokenizer_from_folder(Path(folder), {})
    from floe.model import load_checkpoint

    return load_checkpoint().tokenizer


def cmd_profile(args: argparse.Namespace) -> int:
    import_torch_holding_ctrl_c()
    from floe.engine import parse_device, parse_dtype
    from floe.profiling import profile_turn
    from floe.report import html_report, print_report, roofline_png

    webgpu = args.device == "webgpu"  # (Engine takes the name: WGSL shaders through wgpu)
    if webgpu:
        _check_device("webgpu")  # no adapter: said now, before the model loads
    device = "webgpu" if webgpu else parse_device(args.device)
    if args.max_tokens < 1:
        raise FloeError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    _threads(args, args.device)
    weights = weights_for(args.device, args.weights)
    dtype, kind = WEIGHTS[weights]
    if args.shape:
        if args.model:
            raise FloeError("--shape profiles seeded random weights; it cannot be combined with --model")
        from floe.model.synthetic import random_checkpoint

        checkpoint = random_checkpoint(args.shape, _tokenizer(args.tokenizer), dtype=parse_dtype(dtype),
                                       device="cpu" if webgpu else device)
    else:
        checkpoint = _load_with_progress(args.model, "float32", quiet=args.json)
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise FloeError("--plot needs matplotlib: pip install 'floe[plot]'") from None
    say = (lambda text: None) if args.json else (lambda text: print(f"… {text}", file=sys.stderr))
    result = profile_turn(checkpoint, args.prompt, device=str(device), dtype=dtype, weights=kind,
                          max_tokens=args.max_tokens, fusion=args.fusion, context=args.context,
                          progress=say)
    png = None
    if args.plot or args.html:
        try:
            png = roofline_png(result)
        except ImportError:  # --html without matplotlib: the page, without the plot
            png = None
    if args.plot:
        Path(args.plot).write_bytes(png)
        result["plot"] = args.plot
    if args.html:
        Path(args.html).write_text(html_report(result, png))
        result["html"] = args.html
    if args.json:
        print(json.dumps(result))
    else:
        from rich.console import Console

        print_report(result, Console())
        for key in ("plot", "html"):
            if key in result:
                print(f"wrote {result[key]}")
    return 0


def cmd_bench_decode(args: argparse.Namespace) -> int:
    import_torch_holding_ctrl_c()
    from floe.bench import decode
    from floe.engine import parse_device

    parse_device(args.device)
    _threads(args, args.device)
    tokenizer = _tokenizer(args.tokenizer)
    say = (lambda text: None) if args.json else (lambda text: print(text, flush=True))
    results = [decode(shape, args.device, tokenizer, peers=not args.no_peers, guest=not args.no_guest,
                      progress=say) for shape in args.shape]
    if args.json:
        print(json.dumps(results if len(results) > 1 else results[0]))
    return 0


def cmd_bench_dispatch(args: argparse.Namespace) -> int:
    import_torch_holding_ctrl_c()
    from floe.bench import dispatch
    from floe.engine import parse_device

    if args.device == "webgpu":
        return _bench_dispatch_webgpu(args)
    parse_device(args.device)
    r = dispatch(args.device, n=args.n)
    if args.json:
        print(json.dumps(r))
        return 0
    print(f"kernel launch cost on {r['device']}, {r['n']} tiny kernels (µs per kernel)")
    print(f"{'kernel':<22}{'(a) launch+sync':>16}{'(b) launches, 1 sync':>22}"
          f"{'(c) graph replay':>18}{'a/b':>7}")
    for name, row in r["kernels"].items():
        c = "n/a" if row["c_graph_replay_us"] is None else f"{row['c_graph_replay_us']:.2f}"
        print(f"{name:<22}{row['a_dispatch_sync_us']:>16.2f}{row['b_dispatch_batch_us']:>22.2f}{c:>18}"
              f"{row['ratio_a_over_b']:>7.1f}")
    return 0


def _bench_dispatch_webgpu(args: argparse.Namespace) -> int:
    from floe.engine.webgpu.dispatch import dispatch, framework_on_shape

    r = dispatch(n=args.n)
    r["framework"] = framework_on_shape()
    if args.json:
        print(json.dumps(r))
        return 0
    print(f"dispatch cost on {r['adapter']}, {r['n']} tiny dispatches (µs per dispatch, medians)")
    print(f"{'kernel':<20}{'(a) dispatch+sync':>18}{'(b) n in 1 submit':>18}{'API (host)':>12}"
          f"{'device':>9}{'a/b':>6}")
    for name, row in r["kernels"].items():
        device = "n/a" if row["device_us"] is None else f"{row['device_us']:.1f}"
        print(f"{name:<20}{row['a_dispatch_sync_us']:>18.1f}{row['b_dispatch_batch_us']:>18.1f}"
              f"{row['api_us']:>12.1f}{device:>9}{row['ratio_a_over_b']:>6.1f}")
    reuse = r["reused_command_buffer"]
    print(f"(c) reused command buffer: {'allowed' if reuse['allowed'] else 'refused'} "
          f"(exit status {reuse['exit_status']}: {reuse['error']})")
    f = r["framework"]
    print(f"floe's decode step ({f['measured_on']}): {f['floe_record_submit_us']:.1f} µs per dispatch to "
          f"record and submit, the API calls alone {f['api_record_submit_us']:.1f}")
    for shape, counts in f["dispatches_per_decode_token"].items():
        print(f"dispatches per decode token at {shape}: {counts['fused']} fused, {counts['unfused']} unfused")
    return 0
