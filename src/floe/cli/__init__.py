"""floe: stateful WebAssembly actors that drive LLM inference with zero-copy memory."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from floe.cli.commands import (  # noqa: F401 - (_tokenizer: the tests')
    _tokenizer,
    cmd_bench_decode,
    cmd_bench_dispatch,
    cmd_probe,
    cmd_profile,
    cmd_run,
    cmd_snapshot_inspect,
    cmd_snapshot_verify,
)
from floe.cli.machine import (  # noqa: F401 - (idle_cpus: the tests')
    idle_cpus,
    import_torch_holding_ctrl_c,
    polite_openmp,
)
from floe.cli.options import (
    DEFAULT_PROMPT_HELP,
    MODEL_HELP,
    THREADS_HELP,
    WEIGHTS,
    WEIGHTS_HELP,
    _bytes,
    _device,
    _device_or_webgpu,
    _positive_int,
    _seconds,
)
from floe.cli.serve import cmd_serve
from floe.errors import FloeError
from floe.server.protocol import MAX_REQUEST_BYTES


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
    run.add_argument("--raw", action="store_true",
                     help="continue the prompt as raw text, no chat template (a base model; the built-in "
                          "complete guest, as /v1/completions)")
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
    prof.add_argument("--device", type=_device_or_webgpu, default="cpu", help="cpu (default), cuda or webgpu")
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
    serve.add_argument("--device", type=_device_or_webgpu, default="cpu",
                       help="cpu (default), cuda or webgpu")
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
    serve.add_argument("--no-prompt-hints", dest="prompt_hints", action="store_false",
                       help="the engine core renders and tokenizes each chat's conversation itself (by "
                            "default the HTTP fronts do, in their own processes, and hand it over)")
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
    import_torch_holding_ctrl_c()
    import torch

    return torch.cuda.is_available()


def main(argv: Sequence[str] | None = None) -> int:
    polite_openmp()  # (before anything imports torch)
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
