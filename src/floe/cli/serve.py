"""`floe serve`: one model or several behind the OpenAI-compatible API (an engine core and HTTP fronts),
or replicas on Ray."""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

from floe.cli.machine import _check_device, _load_with_progress, _threads, import_torch_holding_ctrl_c
from floe.cli.options import WEIGHTS, weights_for
from floe.errors import FloeError


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        import fastapi  # noqa: F401 - the HTTP front's, checked before the model loads
        import uvicorn  # noqa: F401

        import_torch_holding_ctrl_c()  # (the core's modules import it)
        from floe.server.auth import OPERATOR_KEYS_ENV, BadApiKey, api_keys
        from floe.server.fronts import listen, serve
        from floe.server.heap import gc_thresholds
    except ImportError as e:
        raise FloeError(f"floe serve needs fastapi and uvicorn ({e.name} is missing): "
                        "pip install floe") from e
    from floe.engine import bound_kernel_caches, parse_device

    bound_kernel_caches()  # (before the model's first matmul: a server sees many prompt lengths)
    webgpu = args.device == "webgpu"  # (Engine takes the name: WGSL shaders through wgpu)
    if webgpu and args.ray is not None:
        raise FloeError("floe serve --ray runs its replicas on cpu or cuda; --device webgpu serves here")
    if webgpu:
        _check_device("webgpu")  # no adapter: said now, before the model loads
    device = "webgpu" if webgpu else parse_device(args.device)
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
    gc_thresholds()  # a bad FLOE_GC_THRESHOLD: an error now, not after the model loads
    # The HTTP front (its own process) streams every token: leave it a core, or the model's parallel
    # GEMVs wait on their slowest thread (2 cores: 40 -> 73 tok/s per stream, docs/PERF.md).
    fronts = args.fronts
    listeners = listen(args.host, args.port, fronts)  # a port in use: an error now, not after the model loads
    _threads(args, args.device, reserve=fronts)
    weights = weights_for(args.device, args.weights)
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
    return serve(core, listeners=listeners, log_level=args.log_level, keys=keys, fronts=fronts,
                 operator_keys=operators,
                 cors_origins=tuple(args.cors_origin), max_request_bytes=args.max_request_bytes,
                 prompt_hints=args.prompt_hints)


def _one_model(args: argparse.Namespace) -> str | None:
    """The one unnamed `--model PATH` (None: the default model); several: _serve_models's."""
    return args.model[0] if args.model else None


def _serve_core(args: argparse.Namespace, checkpoint, device, weights: str, store, model_id: str,
                aliases=(), phases: dict[str, float] | None = None, graphs: str = "all"):
    """The engine core of one model (its engine warmed up) as `floe serve`'s flags describe it.
    phases: the seconds of each part of making it are added there ("engine", "warm-up", "core").
    graphs="first": the warm-up captures the smallest KV bucket's CUDA graphs only (Engine.warm_up);
    the caller has the core capture the others beside its sessions (ServeCore.warm_graphs_later)."""
    from floe.engine import Engine
    from floe.server.core import ServeCore

    phases = {} if phases is None else phases
    dtype, kind = WEIGHTS[weights]
    with _timed(phases, "engine"):
        engine = Engine(checkpoint, device=device, dtype=dtype, max_seq_len=args.context,
                        n_slots=args.max_sessions, weights=kind)
    print(f"floe serve: warming up the engine ({args.max_sessions} KV slots) …", file=sys.stderr, flush=True)
    with _timed(phases, "warm-up"):
        engine.warm_up(graphs=graphs)
    with _timed(phases, "core"):
        return ServeCore(engine, snapshots=store, model_id=model_id, aliases=aliases,
                         idle_seconds=args.idle_seconds, guest=args.guest, max_anonymous=args.max_anonymous,
                         batching={"auto": None, "on": True, "off": False}[args.batching],
                         kv_dtype=args.kv_dtype, persist_anonymous=args.persist_anonymous,
                         freeze_every_turn=args.freeze_every_turn, sweep_seconds=args.sweep_seconds,
                         max_waiting=args.queue, wait_seconds=args.queue_wait)


@contextlib.contextmanager
def _timed(phases: dict[str, float], part: str):
    """phases[part] = the seconds the with-block took."""
    started = time.perf_counter()
    try:
        yield
    finally:
        phases[part] = time.perf_counter() - started


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

    say = lambda text: print(f"floe serve: {text}", file=sys.stderr, flush=True)  # noqa: E731

    def load(spec, store):  # (where a load's time goes, on the log: bench/serve_models.py reads it)
        phases: dict[str, float] = {}
        with _timed(phases, "checkpoint"):
            checkpoint = _load_with_progress(spec.path, "float32", quiet=False)
        # (its first token sooner: the other KV buckets' graphs are captured beside its first sessions)
        core = _serve_core(args, checkpoint, device, weights, store, spec.name, phases=phases, graphs="first")
        say(f"model {spec.name}: " + ", ".join(f"{part} {seconds:.2f} s" for part, seconds in phases.items()))
        core.warm_graphs_later(lambda graphs, seconds: graphs and say(
            f"model {spec.name}: {graphs} more CUDA graphs captured beside its sessions in {seconds:.2f} s"))
        return core

    stores = [(spec, _serve_store(args, spec.name)) for spec in specs]
    footprint = rss_bytes  # (a model's bytes: what the process grew by while it loaded)
    if str(device).startswith("cuda"):
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
    if args.max_loaded is not None and args.max_loaded < 1:
        raise FloeError("--max-loaded must be >= 1")
    specs = _serve_models(args)  # several: each replica serves them all, each loaded on demand there
    models = {"model": _one_model(args)} if specs is None else {
        "models": specs, "keep_alive": args.keep_alive, "max_loaded": args.max_loaded,
        "memory_budget": args.memory_budget}
    if "://" not in args.snapshots and args.ray not in ("local",):
        print("floe serve: --snapshots is a local folder; replicas on other machines need a shared one "
              "(s3://…, or a folder every node mounts)", file=sys.stderr)
    return serve_cluster(None if args.ray == "local" else args.ray, args.replicas, args.snapshots,
                         host=args.host, port=args.port, log_level=args.log_level, keys=keys,
                         operator_keys=operators,
                         cors_origins=tuple(args.cors_origin), **models, context=args.context,
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
