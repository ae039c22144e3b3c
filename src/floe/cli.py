"""floe: stateful WebAssembly actors that drive LLM inference with zero-copy memory."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from floe.errors import FloeError
from floe.server.protocol import MAX_REQUEST_BYTES

DEFAULT_PROMPT_HELP = "the user's message (the model's chat template wraps it)"
MODEL_HELP = ("GGUF file, Hugging Face folder, or a repo id in the local Hugging Face cache (owner/name, "
              "owner/name:Q4_0; nothing is downloaded) (default: SmolLM2-135M-Instruct)")
# --weights: (activation and KV cache dtype, Engine weights kind)
WEIGHTS = {"native": ("float32", "native"), "bf16": ("bfloat16", "dense"), "fp32": ("float32", "dense"),
           "f16": ("float32", "f16")}
THREADS_HELP = "CPU threads for the model (default: the cores idle when floe starts)"
WEIGHTS_HELP = ("native: a quantized GGUF's 4-bit/8-bit weights as the file stores them (CPU; the "
                "default there); bf16 or fp32: dequantized (bf16 is the default on cuda); f16: "
                "float16 matrices on webgpu (fp32 is its default)")


def _load_with_progress(model: str | None, dtype: str, quiet: bool):
    """Load a checkpoint, showing a progress bar on stderr while tensors are read."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from floe.engine import parse_dtype
    from floe.model import load_checkpoint

    torch_dtype = parse_dtype(dtype)
    if quiet or not sys.stderr.isatty():
        return load_checkpoint(model, torch_dtype)
    columns = (TextColumn("loading {task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())
    with Progress(*columns, transient=True, console=_stderr_console()) as bar:
        task = bar.add_task(model or "default model (SmolLM2-135M-Instruct)", total=None)

        def progress(done: int, total: int, name: str) -> None:
            bar.update(task, completed=done, total=total)

        return load_checkpoint(model, torch_dtype, progress)


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


def _stderr_console():
    from rich.console import Console

    return Console(stderr=True, soft_wrap=True)


def cmd_run(args: argparse.Namespace) -> int:
    from floe.sampling_params import SamplingParams

    # Mistakes in the command line first: said at once, before torch is imported (1-4 s).
    params = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
    if args.max_tokens < 1:
        raise FloeError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    prompt = _prompt(args)

    from floe import snapshot
    from floe.actor import Actor
    from floe.engine import Engine

    _check_device(args.device)  # before the model loads: no CUDA (or WebGPU adapter) here is said at once
    _threads(args, args.device)
    weights = args.weights or {"cpu": "native", "webgpu": "fp32"}.get(args.device, "bf16")
    dtype, kind = WEIGHTS[weights]
    started = time.perf_counter()
    checkpoint = _load_with_progress(args.model, "float32", quiet=args.json)
    engine = Engine(checkpoint, device=args.device, dtype=dtype, max_seq_len=args.context, weights=kind)
    stream = None if args.json else _write_stdout
    guest = args.guest
    if args.json_schema:  # the grammar guest reads the schema from the message (docs/GUESTS.md)
        from floe.actor import builtin_guest
        from floe.actor.grammar import grammar_message

        guest = guest or builtin_guest("grammar")
        prompt = grammar_message(prompt, Path(args.json_schema).read_text())
    if args.thaw:
        if args.system:
            raise FloeError("--system applies to a new conversation; a thawed one keeps its own")
        actor = snapshot.thaw(engine, args.thaw, guest, seed=args.seed)
    else:
        actor = Actor(engine, guest, seed=args.seed, system_prompt=args.system or "")
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
    from floe.engine import parse_device, parse_dtype
    from floe.profiling import profile_turn
    from floe.report import html_report, print_report, roofline_png

    device = parse_device(args.device)
    if args.max_tokens < 1:
        raise FloeError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    _threads(args, args.device)
    weights = args.weights or ("native" if device.type == "cpu" else "bf16")
    dtype, kind = WEIGHTS[weights]
    if args.shape:
        if args.model:
            raise FloeError("--shape profiles seeded random weights; it cannot be combined with --model")
        from floe.model.synthetic import random_checkpoint

        checkpoint = random_checkpoint(args.shape, _tokenizer(args.tokenizer), dtype=parse_dtype(dtype),
                                       device=device)
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


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        import fastapi  # noqa: F401 - the HTTP front's, checked before the model loads
        import uvicorn  # noqa: F401

        from floe.server.auth import OPERATOR_KEYS_ENV, BadApiKey, api_keys
        from floe.server.core_socket import listen, serve
    except ImportError as e:
        raise FloeError(f"floe serve needs fastapi and uvicorn ({e.name} is missing): "
                        "pip install floe") from e
    from floe.engine import bound_kernel_caches, parse_device

    bound_kernel_caches()  # (before the model's first matmul: a server sees many prompt lengths)
    device = parse_device(args.device)
    if args.max_sessions < 1 or args.idle_seconds <= 0 or args.max_anonymous < 1:
        raise FloeError("--max-sessions and --max-anonymous must be >= 1 and --idle-seconds > 0")
    try:
        keys = api_keys(args.api_key, files=args.api_key_file)  # and FLOE_API_KEYS
        operators = api_keys(files=args.operator_key_file, variable=OPERATOR_KEYS_ENV)
    except BadApiKey as e:
        raise FloeError(f"--api-key / --api-key-file / --operator-key-file / FLOE_API_KEYS / "
                        f"FLOE_OPERATOR_KEYS: {e}") from None
    if operators and not keys:
        raise FloeError("operator keys are for a server with API keys (FLOE_API_KEYS or --api-key-file): "
                        "an open server shows everything to everyone")
    if args.api_key:
        print("floe serve: warning: --api-key puts the key on the command line, which `ps` shows every "
              "user of this machine; use FLOE_API_KEYS or --api-key-file", file=sys.stderr, flush=True)
    if args.ray is not None:
        return _serve_ray(args, keys, operators)
    # The HTTP front (its own process) streams every token: leave it a core, or the model's parallel
    # GEMVs wait on their slowest thread (2 cores: 40 -> 73 tok/s per stream, docs/PERF.md).
    fronts = args.fronts
    listener = listen(args.host, args.port)  # a port in use: an error now, not after the model loads
    _threads(args, args.device, reserve=fronts)
    weights = args.weights or ("native" if device.type == "cpu" else "bf16")
    access = (f"{len(keys)} API key{'s' * (len(keys) > 1)}, each seeing its own sessions" if keys else
              "open: no API keys, anyone who reaches the port uses and manages every session")
    specs = _serve_models(args)
    if specs is not None:  # several models (or named ones): loaded on demand (floe.server.models)
        core = _model_router(args, specs, device, weights)
        print(f"floe serve: {len(specs)} models ({', '.join(core.models)}) on {device} ({weights} weights), "
              f"{fronts} HTTP front{'s' * (fronts > 1)}, {args.max_sessions} live sessions each; {access}; "
              f"http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    else:
        checkpoint = _load_with_progress(_one_model(args), "float32", quiet=False)
        model_id, *aliases = args.model_id or [checkpoint.source.stem]
        core = _serve_core(args, checkpoint, device, weights, _serve_store(args), model_id, aliases)
        batching = "batched decode" if core.scheduler is not None else "decode in turns"
        print(f"floe serve: {model_id} on {device} ({weights} weights, {batching}), {fronts} HTTP front"
              f"{'s' * (fronts > 1)}, {args.max_sessions} live sessions × "
              f"{core.engine.max_seq_len} tokens, snapshots in {args.snapshots} "
              f"({len(core.store.sessions)} sessions found); {access}; http://{args.host}:{args.port}/v1",
              file=sys.stderr, flush=True)
    return serve(core, listener=listener, log_level=args.log_level, keys=keys, fronts=fronts,
                 operator_keys=operators,
                 cors_origins=tuple(args.cors_origin), max_request_bytes=args.max_request_bytes)


def _one_model(args: argparse.Namespace) -> str | None:
    if args.models or len(args.model or []) > 1:
        raise FloeError("floe serve --ray serves one model (--model PATH)")
    return args.model[0] if args.model else None


def _serve_core(args: argparse.Namespace, checkpoint, device, weights: str, store, model_id: str,
                aliases=()):
    """The engine core of one model (its engine warmed up) as `floe serve`'s flags describe it."""
    from floe.engine import Engine
    from floe.server.core import ServeCore

    dtype, kind = WEIGHTS[weights]
    engine = Engine(checkpoint, device=device, dtype=dtype, max_seq_len=args.context,
                    n_slots=args.max_sessions, weights=kind)
    print(f"floe serve: warming up {args.max_sessions} KV slots …", file=sys.stderr, flush=True)
    engine.warm_up()
    return ServeCore(engine, snapshots=store, model_id=model_id, aliases=aliases,
                     idle_seconds=args.idle_seconds, guest=args.guest, max_anonymous=args.max_anonymous,
                     batching={"auto": None, "on": True, "off": False}[args.batching],
                     kv_dtype=args.kv_dtype, persist_anonymous=args.persist_anonymous,
                     freeze_every_turn=args.freeze_every_turn, sweep_seconds=args.sweep_seconds,
                     max_waiting=args.queue, wait_seconds=args.queue_wait)


def _serve_models(args: argparse.Namespace):
    """The models of `--model NAME=PATH ...` and `--models DIR`, or None for one unnamed `--model`
    (a server of one model, as before)."""
    from floe.server.models import model_specs, models_in

    values = args.model or []
    if not args.models and len(values) <= 1 and not any("=" in v for v in values):
        return None
    if args.model_id:
        raise FloeError("--model-id names the one model of a server; with several, --model NAME=PATH "
                        "names each")
    try:
        specs = model_specs(values) + (models_in(args.models) if args.models else [])
        model_specs(f"{s.name}=" for s in specs)  # (a name given twice, also across --models)
    except ValueError as e:
        raise FloeError(f"--model / --models: {e}") from None
    if not specs:
        raise FloeError(f"--models {args.models}: no GGUF file or Hugging Face folder in it")
    for spec in specs:
        if spec.path is not None and not Path(spec.path).expanduser().exists():
            raise FloeError(f"--model {spec.name}={spec.path}: no such file or folder")
    return specs


def _model_router(args: argparse.Namespace, specs, device, weights: str):
    """The engine cores of several models, each made when a request first names it (floe.server.models):
    each model's sessions in a folder (or prefix) of its own under --snapshots."""
    from floe.memory import rss_bytes
    from floe.server.models import ModelRouter

    if args.max_loaded is not None and args.max_loaded < 1:
        raise FloeError("--max-loaded must be >= 1")

    def load(spec, store):
        checkpoint = _load_with_progress(spec.path, "float32", quiet=False)
        return _serve_core(args, checkpoint, device, weights, store, spec.name)

    stores = [(spec, _serve_store(args, spec.name)) for spec in specs]
    say = lambda text: print(f"floe serve: {text}", file=sys.stderr, flush=True)  # noqa: E731
    footprint = rss_bytes  # (a model's bytes: what the process grew by while it loaded)
    if device.type == "cuda":
        import torch

        footprint = lambda: torch.cuda.memory_allocated(device)  # noqa: E731
    return ModelRouter(stores, load, keep_alive=args.keep_alive, max_loaded=args.max_loaded,
                       memory_budget=args.memory_budget, footprint=footprint, say=say)


def _serve_ray(args: argparse.Namespace, keys: tuple[str, ...], operators: tuple[str, ...]) -> int:
    """`floe serve --ray`: replicas on a Ray cluster behind one endpoint (floe.cluster, docs/RAY.md)."""
    try:
        from floe.cluster.serve import serve_cluster
    except ImportError as e:
        raise FloeError(f"floe serve --ray needs Ray ({e.name} is missing): pip install 'floe[ray]'") from e
    if args.replicas < 1:
        raise FloeError("--replicas must be >= 1")
    if "://" not in args.snapshots and args.ray not in ("local",):
        print("floe serve: --snapshots is a local folder; replicas on other machines need a shared one "
              "(s3://…, or a folder every node mounts)", file=sys.stderr)
    return serve_cluster(None if args.ray == "local" else args.ray, args.replicas, args.snapshots,
                         host=args.host, port=args.port, log_level=args.log_level, keys=keys,
                         operator_keys=operators,
                         cors_origins=tuple(args.cors_origin), model=_one_model(args), context=args.context,
                         slots=args.max_sessions, threads=args.threads or 1, lease_s=args.lease_seconds,
                         device=args.device, gpus=0 if args.device == "cpu" else 1,
                         idle_seconds=args.idle_seconds, max_anonymous=args.max_anonymous,
                         kv_dtype=args.kv_dtype, persist_anonymous=args.persist_anonymous,
                         freeze_every_turn=args.durability != "idle", sweep_seconds=args.sweep_seconds)


def _serve_store(args: argparse.Namespace, model: str | None = None):
    """The session store `floe serve`'s --snapshots and lifecycle flags describe (of one of several
    models: its folder, or prefix, under --snapshots)."""
    from floe.server.sessions import snapshot_store
    from floe.snapshot import SnapshotError

    if args.lease_seconds <= 0 or args.sweep_seconds <= 0:
        raise FloeError("--lease-seconds and --sweep-seconds must be > 0")
    try:
        where = args.snapshots if model is None else f"{args.snapshots.rstrip('/')}/{model}"
        return snapshot_store(where, idle_seconds=args.idle_seconds, pinned_bytes=args.pinned_bytes,
                              pinned_ttl_s=args.pinned_ttl, ttl_s=args.snapshot_ttl,
                              budget_bytes=args.snapshot_budget, cache=args.snapshot_cache,
                              lease_s=args.lease_seconds)
    except (SnapshotError, ValueError, OSError) as e:
        raise FloeError(f"--snapshots {args.snapshots}: {e}") from e


def _bytes(text: str) -> int:
    """A byte count: 1000000, 512M, 2G (binary multiples: K, M, G, T)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    scale = units.get(text[-1:].upper(), 1)
    try:
        value = int(float(text[:-1] if scale > 1 else text) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a byte count (e.g. 1000000, 512M, 2G)") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is negative")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: seconds must be > 0")
    return value


def cmd_bench_decode(args: argparse.Namespace) -> int:
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


def _check_device(device: str) -> None:
    """Raise FloeError now if `device` cannot run here (no CUDA; no WebGPU adapter)."""
    if device == "webgpu":
        from floe.engine.webgpu import adapter

        adapter()
        return
    from floe.engine import parse_device

    parse_device(device)


def _device_or_webgpu(text: str) -> str:
    """_device's, or webgpu (wgpu's WebGPU: Vulkan, Metal, D3D12)."""
    return text if text == "webgpu" else _device(text)


def _device(text: str) -> str:
    """cpu, cuda or cuda:N, checked without importing torch (a typo is a usage error at once)."""
    kind, _, index = text.partition(":")
    if kind not in ("cpu", "cuda") or (index and not (kind == "cuda" and index.isdigit())):
        raise argparse.ArgumentTypeError(f"unknown device {text!r}: choose cpu, cuda or cuda:N")
    return text


def _threads(args: argparse.Namespace, device: str, reserve: int = 0) -> int | None:
    """Set PyTorch's CPU threads for a CPU run: --threads, else the cores idle right now (less
    `reserve`). A thread on a core another process keeps busy makes every parallel op wait for it
    (decode ~50x slower on 2 cores), so busy cores are left out. Returns the count (None: not CPU)."""
    if not device.startswith("cpu"):
        return None
    import torch

    n = args.threads or max(1, idle_cpus() - reserve)
    torch.set_num_threads(n)
    return n


def idle_cpus(window_s: float = 0.1) -> int:
    """CPUs (of those this process may run on) that were mostly idle over the last `window_s`."""
    import os
    import time

    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    try:
        first = _cpu_times()
        time.sleep(window_s)
        second = _cpu_times()
    except OSError:  # no /proc/stat: every allowed core
        return max(1, len(allowed) or (os.cpu_count() or 1))
    idle = 0
    for cpu in allowed or second:
        if cpu in first and cpu in second:
            busy0, total0 = first[cpu]
            busy1, total1 = second[cpu]
            if total1 > total0 and (busy1 - busy0) / (total1 - total0) < 0.5:
                idle += 1
    return max(1, idle)


def _cpu_times() -> dict[int, tuple[int, int]]:
    """cpu index -> (busy jiffies, total jiffies), from /proc/stat."""
    out = {}
    with open("/proc/stat") as f:
        for line in f:
            name, *fields = line.split()
            if name.startswith("cpu") and name[3:].isdigit():
                values = [int(v) for v in fields]
                total = sum(values[:8])
                out[int(name[3:])] = (total - values[3] - values[4], total)  # idle, iowait
    return out


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


class _Parser(argparse.ArgumentParser):
    """argparse whose usage mistakes are one line on stderr (`floe run: error: …; see floe run
    --help`) and exit status 2, not the whole usage block."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}; see {self.prog} --help\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="floe", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="answer one message with a model (default: SmolLM2-135M on CPU)")
    run.add_argument("prompt", nargs="?", default=None,
                     help=DEFAULT_PROMPT_HELP + "; - reads it from standard input")
    run.add_argument("--prompt-file", metavar="FILE", help="read the message from FILE (UTF-8) instead")
    run.add_argument("--model", help=MODEL_HELP)
    run.add_argument("--system", help="system message")
    run.add_argument("--max-tokens", type=int, default=256, help="most tokens to generate (256)")
    run.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    run.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest (0 = all)")
    run.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1.0 = off)")
    run.add_argument("--seed", type=int, default=0, help="sampling seed (0)")
    run.add_argument("--weights", choices=list(WEIGHTS), default=None, help=WEIGHTS_HELP)
    run.add_argument("--device", type=_device_or_webgpu, default="cpu", help="cpu (default), cuda or webgpu")
    run.add_argument("--threads", type=_positive_int, default=None, help=THREADS_HELP)
    run.add_argument("--context", type=_positive_int, default=None,
                     help="KV cache length in tokens (default: the model's context length)")
    run.add_argument("--guest", help="guest module (.wasm) that drives the model (default: built-in chat)")
    run.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    run.add_argument("--json-schema", metavar="FILE",
                     help="reply with JSON valid against this JSON Schema (the built-in grammar guest)")
    run.add_argument("--thaw", metavar="FILE", help="continue the conversation frozen in FILE")
    run.add_argument("--freeze", metavar="FILE", help="after the reply, freeze the conversation into FILE")
    run.add_argument("--kv-dtype", choices=["float32", "bfloat16", "int8"], default=None,
                     help="how --freeze stores the KV cache (default: the engine's dtype)")
    run.set_defaults(handler=cmd_run)

    bench = sub.add_parser("bench", help="measure speed against the hardware's ceiling and peers")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    dec = bench_sub.add_parser("decode", help="batch-1 decode at a real shape, seeded random weights")
    dec.add_argument("--shape", action="append", choices=sorted(KNOWN_SHAPE_NAMES),
                     help="repeat for several (default: llama-3.2-1b on cuda, smollm2-135m on cpu)")
    dec.add_argument("--device", type=_device, default=None, help="cuda if present, else cpu")
    dec.add_argument("--threads", type=_positive_int, default=None, help=THREADS_HELP)
    dec.add_argument("--tokenizer", help="folder with tokenizer.json (default: the default model's)")
    dec.add_argument("--no-peers", action="store_true", help="skip the transformers peers")
    dec.add_argument("--no-guest", action="store_true", help="skip guest-driven vs host-driven")
    dec.add_argument("--json", action="store_true")
    dec.set_defaults(handler=cmd_bench_decode)
    disp = bench_sub.add_parser("dispatch", help="cost of one kernel launch: synced, batched, graph-replayed")
    disp.add_argument("--device", type=_device_or_webgpu, default=None,
                      help="cuda if present, else cpu; or webgpu")
    disp.add_argument("--n", type=_positive_int, default=2000, help="kernels per measurement")
    disp.add_argument("--json", action="store_true")
    disp.set_defaults(handler=cmd_bench_dispatch)

    snapshot = sub.add_parser("snapshot", help="look into and check snapshot files")
    snap_sub = snapshot.add_subparsers(dest="snapshot", required=True)
    inspect = snap_sub.add_parser("inspect", help="metadata, sizes, token count, model")
    inspect.add_argument("file")
    inspect.add_argument("--json", action="store_true")
    inspect.set_defaults(handler=cmd_snapshot_inspect)
    verify = snap_sub.add_parser("verify", help="check integrity, and that a model can thaw it")
    verify.add_argument("file")
    verify.add_argument("--model", help="check against this model (GGUF or HF folder)")
    verify.add_argument("--default-model", action="store_true", help="check against the default model")
    verify.set_defaults(handler=cmd_snapshot_verify)

    prof = sub.add_parser("profile", help="one actor turn: boundaries, dispatches and the roofline, measured")
    prof.add_argument("prompt", help=DEFAULT_PROMPT_HELP)
    prof.add_argument("--model", help=MODEL_HELP)
    prof.add_argument("--shape", choices=sorted(KNOWN_SHAPE_NAMES),
                      help="seeded random weights at a real architecture's shape instead of --model")
    prof.add_argument("--tokenizer",
                      help="folder with tokenizer.json for --shape (default: the default model's)")
    prof.add_argument("--device", type=_device, default="cpu", help="cpu (default) or cuda")
    prof.add_argument("--threads", type=_positive_int, default=None, help=THREADS_HELP)
    prof.add_argument("--weights", choices=list(WEIGHTS), default=None, help=WEIGHTS_HELP)
    prof.add_argument("--max-tokens", type=int, default=64, help="most tokens the turn generates (64)")
    prof.add_argument("--context", type=_positive_int, default=None, help="KV cache length (default: ≤ 4096)")
    prof.add_argument("--fusion", choices=["on", "off", "both"], default="on",
                      help="the fused decode step (CPU: lean TorchScript step; CUDA: Triton kernels); "
                           "both: also measure it off, same weights, same run")
    prof.add_argument("--json", action="store_true", help="print one JSON object")
    prof.add_argument("--plot", metavar="PNG", help="write a roofline plot (needs matplotlib)")
    prof.add_argument("--html", metavar="HTML", help="write a self-contained HTML report")
    prof.set_defaults(handler=cmd_profile)

    serve = sub.add_parser("serve", help="an OpenAI-compatible server whose conversations are actors")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--model", action="append", metavar="[NAME=]PATH",
                       help=MODEL_HELP + "; again, as NAME=PATH, for several models, each loaded when a "
                       "request first names it")
    serve.add_argument("--models", metavar="DIR", help="serve every GGUF file and Hugging Face folder in DIR "
                       "(named by file or folder), each loaded when a request first names it")
    serve.add_argument("--keep-alive", type=_seconds, default=None, metavar="S",
                       help="with several models: a model with no live sessions and no request for S "
                            "seconds is unloaded (default: kept; a request's keep_alive sets its model's)")
    serve.add_argument("--max-loaded", type=int, default=None, metavar="N",
                       help="with several models: at most N loaded at once; loading one more unloads the "
                            "least recently used (its live sessions frozen first)")
    serve.add_argument("--memory-budget", type=_bytes, default=None, metavar="BYTES",
                       help="with several models: the most their engines may take together (on a GPU its "
                            "memory, else RAM; each measured at its load); loading one more unloads the "
                            "least recently used until it fits")
    serve.add_argument("--model-id", action="append", metavar="NAME",
                       help="the model name clients send (default: the file's name); again for aliases "
                            "(many tools hard-code a name), '*' to accept any")
    serve.add_argument("--device", type=_device, default="cpu", help="cpu (default) or cuda")
    serve.add_argument("--weights", choices=list(WEIGHTS), default=None, help=WEIGHTS_HELP)
    serve.add_argument("--guest", help="guest module (.wasm) every session runs (default: built-in chat)")
    serve.add_argument("--snapshots", default="floe-sessions",
                       help="where sessions are frozen, shared by the servers that name it: a folder, "
                            "file://PATH or s3://BUCKET/PREFIX (fsspec; credentials and endpoint from the "
                            "environment, e.g. FSSPEC_S3='{\"endpoint_url\": ...}')")
    serve.add_argument("--pinned-bytes", type=_bytes, default=512 << 20, metavar="BYTES",
                       help="RAM kept for recently frozen sessions' snapshots (512M; 0: none)")
    serve.add_argument("--pinned-ttl", type=_seconds, default=None, metavar="S",
                       help="a frozen session's snapshot stays in RAM (and this server keeps its lease) "
                            "this long (default: --idle-seconds)")
    serve.add_argument("--snapshot-ttl", type=_seconds, default=None, metavar="S",
                       help="a session unused this long is deleted from the store (default: kept)")
    serve.add_argument("--snapshot-budget", type=_bytes, default=None, metavar="BYTES",
                       help="each API key's bytes of sessions in the store (an open server's: all of "
                            "them); beyond, that key's least recently used are deleted")
    serve.add_argument("--snapshot-cache", default=None, metavar="DIR",
                       help="local cache of an object store's snapshots (default: a temporary folder)")
    serve.add_argument("--lease-seconds", type=float, default=30.0, metavar="S",
                       help="a session's lease: another server may take a session over once its holder "
                            "has not renewed it this long (30)")
    serve.add_argument("--sweep-seconds", type=float, default=10.0, metavar="S",
                       help="how often the store's TTL and budget are applied (10)")
    serve.add_argument("--kv-dtype", choices=["float32", "bfloat16", "int8"], default=None,
                       help="how snapshots store the KV cache (default: the engine's dtype, bit-exact; "
                            "int8: a quarter of fp32's bytes, continues close to but not bit-identically)")
    serve.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
                       help="run --replicas engine replicas on a Ray cluster (ADDRESS, e.g. auto or "
                            "ray://host:10001; none: a local one) behind this endpoint (docs/RAY.md)")
    serve.add_argument("--replicas", type=int, default=2, metavar="N", help="with --ray: replicas (2)")
    serve.add_argument("--durability", choices=["turn", "idle"], default="turn",
                       help="with --ray: freeze every answered turn (turn; a dead replica's sessions lose "
                            "nothing) or only idle sessions (idle)")
    serve.add_argument("--persist-anonymous", action="store_true",
                       help="write sessions of requests that name none to the store (default: RAM only)")
    serve.add_argument("--freeze-every-turn", action="store_true",
                       help="freeze every answered turn into the store before its answer ends (a killed "
                            "server loses no answered turn), not only idle sessions")
    serve.add_argument("--idle-seconds", type=float, default=300.0,
                       help="freeze a session idle this long (300)")
    serve.add_argument("--max-sessions", type=int, default=16,
                       help="live sessions (KV cache slots); beyond, the least recently used is frozen")
    serve.add_argument("--context", type=_positive_int, default=4096, help="tokens per session (4096)")
    serve.add_argument("--threads", type=_positive_int, default=None,
                       help="CPU threads for the model (default: the idle cores but one, for the HTTP "
                            "stack)")
    serve.add_argument("--batching", choices=["auto", "on", "off"], default="auto",
                       help="run concurrent sessions' decode steps as one batched forward (auto: on CUDA)")
    serve.add_argument("--api-key", action="append", default=[], metavar="KEY",
                       help="clients must send `Authorization: Bearer KEY`; again for more keys (also "
                            "FLOE_API_KEYS=K1,K2); each key sees only its own sessions (default: open)")
    serve.add_argument("--api-key-file", action="append", default=[], metavar="FILE",
                       help="API keys, one a line (# comments); the way to give them with FLOE_API_KEYS "
                            "(a command line's --api-key is visible to every user in `ps`)")
    serve.add_argument("--operator-key-file", action="append", default=[], metavar="FILE",
                       help="the operator's keys (also FLOE_OPERATOR_KEYS), one a line: with API keys, "
                            "only these see /metrics and the whole /health (others: their own sessions)")
    serve.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                       help="a web origin whose pages may call the server (e.g. https://app.example); "
                            "again for more, '*' for any (default: CORS off)")
    serve.add_argument("--fronts", type=_positive_int, default=1, metavar="N",
                       help="HTTP front processes sharing the port, each streaming its own clients' "
                            "replies (1; 3 measured no faster on the H200's host: docs/PERF.md)")
    serve.add_argument("--max-request-bytes", type=_bytes, default=MAX_REQUEST_BYTES, metavar="BYTES",
                       help="the largest request body (8M); past it, 413 (a snapshot upload streams "
                            "and is checked by the store instead)")
    serve.add_argument("--max-anonymous", type=int, default=64, metavar="N",
                       help="sessions made without an id kept per API key (64); beyond, the least "
                            "recently used idle one is deleted")
    serve.add_argument("--queue", type=int, default=8, metavar="N",
                       help="requests that wait for a KV slot while every slot runs one, first come first "
                            "served (8); beyond, 503 with Retry-After")
    serve.add_argument("--queue-wait", type=float, default=30.0, metavar="S",
                       help="the most a request waits in that queue (30 s), then 503 with Retry-After")
    serve.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    serve.set_defaults(handler=cmd_serve)

    probe = sub.add_parser("probe", help="prove and measure floe's zero-copy chain")
    probe_sub = probe.add_subparsers(dest="probe", required=True)
    zero = probe_sub.add_parser("zero-copy", help="region == guest memory == tensor; RSS; in-place GEMM")
    zero.add_argument("--device", type=_device, default="cpu", help="cpu (default) or cuda")
    zero.add_argument("--json", action="store_true", help="print one JSON object")
    zero.set_defaults(handler=cmd_probe)
    return parser


KNOWN_SHAPE_NAMES = ("smollm2-135m", "llama-3.2-1b", "llama-3-8b", "qwen2.5-0.5b", "qwen3-0.6b", "qwen3-1.7b",
                     "qwen3-8b", "gemma-3-1b", "gemma-3-4b")  # config.KNOWN_SHAPES' keys


def _cuda_present() -> bool:
    import torch

    return torch.cuda.is_available()


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        if getattr(args, "bench", None) and args.device is None:
            args.device = "cuda" if _cuda_present() else "cpu"
        if getattr(args, "bench", None) == "decode" and not args.shape:
            args.shape = ["llama-3.2-1b" if args.device.startswith("cuda") else "smollm2-135m"]
        return args.handler(args)
    except FloeError as e:
        print(f"floe: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("floe: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # a Ctrl-C wrapped on its way up (during an import: "Error calling __set_name__")
        if not _caused_by_ctrl_c(e):
            raise
        print("floe: interrupted", file=sys.stderr)
        return 130


def _caused_by_ctrl_c(e: BaseException) -> bool:
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, KeyboardInterrupt):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


def run() -> None:
    """The `floe` command: main()'s exit code. After Ctrl-C (130) the process ends at once, its
    output flushed (os._exit): with a normal exit, a Ctrl-C during start-up (inside torch's imports)
    ended the process killed by SIGINT instead of exiting 130 in about 1 run in 10 (0 in 88 runs
    since; the cause inside the interpreter's finalization was not pinned down), and a half-imported
    torch is nothing to finalize."""
    code = main()
    if code == 130:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130)
    sys.exit(code)


if __name__ == "__main__":
    run()
