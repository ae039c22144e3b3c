"""Load on `floe serve` over loopback: S sessions × T turns, streamed (a raw HTTP client or the official).

    python bench/serve_load.py [--sessions 8] [--turns 3] [--max-tokens 32] [--device cpu]
                               [--weights native] [--shape llama-3.2-1b --tokenizer DIR]
                               [--client raw|openai]

Starts the real server in this process (uvicorn on a free loopback port), then runs every session
in its own client thread: each turn sends the whole conversation so far with the session's id and
streams the reply. Reports p50/p95 TTFT (request sent → first content chunk, client side), p50/p95
per-turn decode rate, cached vs prefilled prompt tokens, and the aggregate generated tokens/s over
the wall time of the whole load. Bounded: every request has a timeout, the run has --budget-s.
With --server-process the server runs as `floe serve` does, in child processes (its engine core,
and the HTTP front in the core's child; the clients' HTTP and JSON work shares neither's GIL).
Before the clock starts the client is warmed with one throwaway request (its session deleted
after): the openai package's first request imports and builds its resources (~0.1 s), a cost of
the client, not of the server.
--prompt-tokens N pads each session's first message with context to about N prompt tokens.
--probe K: once every session has its first token, K new sessions one after another send a
--prompt-tokens prompt and take two tokens: the TTFT of a new conversation while the others decode.
Writes bench/results/serve_load_<device>.json.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import json
import multiprocessing
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import torch
import uvicorn

from floe.cli.machine import polite_openmp
from floe.engine import Engine
from floe.server.app import create_app

QUESTIONS = ["Tell me about {}.", "What is it best known for?", "Summarise that in one sentence.",
             "Give one more fact.", "Thank you. Anything else?"]
TOPICS = ["Paris", "the Moon", "volcanoes", "bees", "the Nile", "chess", "glaciers", "owls", "copper",
          "Mars", "whales", "tea", "bridges", "deserts", "coral", "maps"]


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--weights", default=None, choices=["native", "dense"])
    ap.add_argument("--shape", default=None, help="seeded random weights at this shape (GPU runs)")
    ap.add_argument("--tokenizer", default=None, help="tokenizer folder for --shape")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    ap.add_argument("--batching", choices=["auto", "on", "off"], default="auto",
                    help="batched decode across sessions (auto: where the engine has it, i.e. CUDA)")
    ap.add_argument("--switch-interval-ms", type=float, default=None,
                    help="the server's GIL switch interval (Python's default: 5 ms)")
    ap.add_argument("--server-process", action="store_true",
                    help="run the server in a child process, so the clients do not share its GIL")
    ap.add_argument("--serve-on", type=int, default=None, help=argparse.SUPPRESS)  # the child's port
    ap.add_argument("--fronts", type=int, default=1, help="with --server-process: HTTP front processes")
    ap.add_argument("--no-prompt-hints", dest="prompt_hints", action="store_false",
                    help="with --server-process: `floe serve --no-prompt-hints` (the core renders and "
                         "tokenizes each prompt itself)")
    ap.add_argument("--prompt-tokens", type=int, default=0,
                    help="pad each first message to about this many prompt tokens (0: the short questions)")
    ap.add_argument("--ride-rows", type=int, default=None,
                    help="prompt rows a CUDA decode step takes along (floe.actor.loop.RIDE_ROWS and the "
                         "graphs' MIXED_ROWS; default 256)")
    ap.add_argument("--probe", type=int, default=0,
                    help="TTFT probes: new sessions sent one by one while the load decodes")
    ap.add_argument("--client-processes", type=int, default=1,
                    help="spread the sessions' clients over this many processes (one process's GIL "
                         "is a bottleneck of its own past ~16 streams: 64 users are not one process)")
    ap.add_argument("--client", choices=["raw", "openai"], default="raw",
                    help="the load's HTTP client: raw (asyncio and HTTP/1.1, a line read and one "
                         "json.loads a chunk, as vLLM's benchmark_serving uses aiohttp) or the official "
                         "openai package (its pydantic objects a chunk: at 64 streams its client "
                         "processes, not the server, set the TTFT)")
    ap.add_argument("--anonymous", action="store_true", help="requests without a session_id (one turn)")
    ap.add_argument("--tag", default="", help="a prefix of the sessions' ids (runs against one --url)")
    ap.add_argument("--temperature", type=float, default=0.0, help="the load's sampling (0: greedy)")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--budget-s", type=float, default=600)
    ap.add_argument("--out", default=None)
    ap.add_argument("--timeline", type=Path, default=None,
                    help="with --server-process: a folder for which of the core's threads ran when "
                         "(probes/thread_timeline.py: timeline.json, names.json, marks.json)")
    ap.add_argument("--url", default=None,
                    help="load a running `floe serve` (e.g. http://127.0.0.1:8000) instead of starting one "
                         "in this process; its model id is read from /v1/models")
    args = ap.parse_args()
    if args.url:
        client = openai.OpenAI(base_url=f"{args.url}/v1", api_key="unused", max_retries=0,
                               timeout=args.budget_s)
        model_id = client.models.list().data[0].id
        run_load(args, client, model_id, {"device": args.device, "model": model_id, "server": args.url})
        return
    if args.server_process:
        run_against_child(args)
        return
    if args.serve_on:  # the child of --server-process: `floe serve`'s two processes, until terminated
        from floe.server.core import ServeCore
        from floe.server.fronts import serve

        engine, model_id, folder, _ = make_engine(args)
        if args.timeline:
            write_thread_names(args.timeline / "names.json")
        serve(ServeCore(engine, snapshots=folder, model_id=model_id, idle_seconds=3600, batching=BATCHING[
            args.batching]), port=args.serve_on, log_level="error", fronts=args.fronts,
            prompt_hints=args.prompt_hints)
        return
    server, about = make_server(args, free_port())
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.config.port}/v1", api_key="unused",
                           max_retries=0, timeout=args.budget_s)
    try:
        run_load(args, client, about["model"], about | {"server": "in this process"})
    finally:
        server.should_exit = True
        thread.join(30)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


BATCHING = {"auto": None, "on": True, "off": False}


def ride_rows(rows: int | None) -> None:
    """Prompt rows a CUDA decode step takes along (None: floe's own, 256), set before an engine is made."""
    if rows:
        from floe.actor import loop as engine_loop
        from floe.engine.cuda_graph import BatchGraphDecoder

        engine_loop.RIDE_ROWS = BatchGraphDecoder.MIXED_ROWS = rows


def make_engine(args) -> tuple[Engine, str, Path, dict]:
    """The engine (warmed up, as `floe serve` does at start), its model id, a snapshot folder."""
    if args.switch_interval_ms:
        sys.setswitchinterval(args.switch_interval_ms / 1e3)
    ride_rows(getattr(args, "ride_rows", None))
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    weights = args.weights or ("native" if device.type == "cpu" else "dense")
    dtype = "float32" if device.type == "cpu" else "bfloat16"
    if args.shape:
        from floe.cli import _tokenizer
        from floe.model.synthetic import random_checkpoint

        checkpoint = random_checkpoint(args.shape, _tokenizer(args.tokenizer), dtype=torch.bfloat16,
                                       device=device)
        model_id = args.shape
    else:
        from floe.model import load_checkpoint

        checkpoint = load_checkpoint()
        model_id = checkpoint.source.stem
    engine = Engine(checkpoint, device=device, dtype=dtype, max_seq_len=1024,
                    n_slots=args.sessions + (1 if args.probe else 0), weights=weights)
    t = time.perf_counter()
    engine.warm_up()  # graph captures are not a user's TTFT
    warm_up_s = time.perf_counter() - t
    print(f"server: warm-up {warm_up_s:.1f} s", file=sys.stderr, flush=True)
    folder = Path(tempfile.mkdtemp(prefix="floe-load-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)  # snapshots are big
    return engine, model_id, folder, {"device": str(device), "model": model_id, "weights": weights,
                                      "threads": args.threads, "warm_up_s": warm_up_s,
                                      "switch_interval_ms": 1e3 * sys.getswitchinterval()}


def make_server(args, port: int) -> tuple[uvicorn.Server, dict]:
    """The app (front and engine core in this process) on a loopback port."""
    engine, model_id, folder, about = make_engine(args)
    app = create_app(engine, snapshots=folder, model_id=model_id, idle_seconds=3600,
                     batching=BATCHING[args.batching])
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    return server, about | {"decode_batching": app.state.core.scheduler is not None}


def write_thread_names(path: Path, every_s: float = 0.2) -> None:
    """{native thread id: name} of this process's threads, written every `every_s` by a daemon thread
    (for probes/thread_timeline.py: Python's names are not the OS's)."""
    seen: dict[str, str] = {}

    def write() -> None:
        while True:
            seen.update({str(t.native_id): t.name for t in threading.enumerate()})
            path.with_suffix(".tmp").write_text(json.dumps(seen))
            path.with_suffix(".tmp").replace(path)
            time.sleep(every_s)

    path.parent.mkdir(parents=True, exist_ok=True)
    threading.Thread(target=write, name="load-thread-names", daemon=True).start()


def start_timeline(args, pid: int) -> subprocess.Popen | None:
    """probes/thread_timeline.py sampling the core `pid` into args.timeline (None: no --timeline)."""
    if not args.timeline:
        return None
    args.timeline.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen([sys.executable, str(Path(__file__).parent / "probes" / "thread_timeline.py"),
                             "--pid", str(pid), "--out", str(args.timeline / "timeline.json"),
                             "--names", str(args.timeline / "names.json"), "--every-ms", "1", "--children"])


def stop_timeline(sampler: subprocess.Popen | None) -> None:
    if sampler is not None:
        sampler.send_signal(signal.SIGTERM)
        sampler.wait(60)


def run_against_child(args) -> None:
    """Start the server in a child process, wait for /health, load it from this one."""
    port = free_port()
    argv = [a for a in sys.argv[1:] if a != "--server-process"]
    env = dict(os.environ)
    polite_openmp(env)  # as `floe serve`'s processes have it
    child = subprocess.Popen([sys.executable, __file__, *argv, "--serve-on", str(port)], env=env)
    try:
        deadline = time.time() + args.budget_s
        while True:
            if child.poll() is not None:
                sys.exit(f"the server process exited with {child.returncode} before it served")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    health = json.loads(r.read())
                if health.get("fronts", 1) >= args.fronts:  # every front takes connections
                    break
                raise ConnectionError("not every front is up yet")
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                if time.time() > deadline:
                    sys.exit("the server process did not answer /health in time")
                time.sleep(0.25)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0,
                               timeout=args.budget_s)
        about = {"device": health["device"], "model": health["model"], "server": "child process",
                 "fronts": health.get("fronts", 1),
                 "decode_batching": health["decode_batching"], "switch_interval_ms": args.switch_interval_ms}
        sampler = start_timeline(args, child.pid)
        try:
            run_load(args, client, health["model"], about)
        finally:
            stop_timeline(sampler)
    finally:
        child.terminate()
        child.wait(30)


CONTEXT = ("Background notes: rivers, mountains, harbours, markets, libraries, gardens, railways, "
           "festivals, bridges and museums all shape how a place is remembered by those who visit it. ")


def first_message(i: int, prompt_tokens: int) -> str:
    """Session i's first question, padded with context to about prompt_tokens tokens (~0.75 words a
    token, less the chat template's ~30)."""
    question = QUESTIONS[0].format(TOPICS[i % len(TOPICS)])
    words = max(0, int((prompt_tokens - 30) * 0.75) - len(question.split()))
    padding = (CONTEXT.split() * (1 + words // len(CONTEXT.split())))[:words]
    return " ".join(padding + [question]) if padding else question


def stream_turn(client: openai.OpenAI, model_id: str, messages: list[dict], max_tokens: int,
                session_id: str, on_first=lambda: None, sampling: dict | None = None) -> dict:
    """One streamed request; its TTFT, decode rate, text and token counts. on_first(): called at its
    first token."""
    sent = time.perf_counter()
    first = last = None
    pieces, usage = [], None
    for chunk in client.chat.completions.create(
            model=model_id, messages=messages, max_tokens=max_tokens, **(sampling or {"temperature": 0}),
            stream=True, stream_options={"include_usage": True},
            extra_body={} if session_id is None else {"session_id": session_id}):
        delta = chunk.choices[0].delta if chunk.choices else None
        # A token's chunk, even of no text (random weights pick ids past the tokenizer's vocabulary,
        # which stand for nothing); the first chunk only says the role.
        if delta is not None and delta.content is not None and not delta.role:
            last = time.perf_counter()
            if first is None:
                first = last
                on_first()
            pieces.append(delta.content)
        usage = chunk.usage or usage
    n = usage.completion_tokens if usage else len(pieces)
    return {"ttft_s": None if first is None else first - sent, "text": "".join(pieces), "sent_at": sent,
            "decode_tok_s": (n - 1) / (last - first) if first and last > first else None,
            "completion_tokens": n, "prompt_tokens": usage.prompt_tokens if usage else None,
            "cached_tokens": usage.prompt_tokens_details.cached_tokens if usage else None}


async def stream_turn_raw(base_url: str, model_id: str, messages: list[dict], max_tokens: int,
                          session_id: str, on_first=lambda: None, sampling: dict | None = None) -> dict:
    """stream_turn's request from a raw HTTP/1.1 client (asyncio, one connection a request): the same
    row, with each SSE line read and parsed by json.loads, no client objects."""
    host, _, port = base_url.removeprefix("http://").partition("/")[0].partition(":")
    body = json.dumps({"model": model_id, "messages": messages, "max_tokens": max_tokens, "stream": True,
                       "stream_options": {"include_usage": True}, **(sampling or {"temperature": 0}),
                       **({} if session_id is None else {"session_id": session_id})}).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: "
            f"application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    connecting = time.perf_counter()
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        sent = time.perf_counter()
        writer.write(head + body)
        await writer.drain()
        status = await reader.readline()
        if b" 200 " not in status:
            raise RuntimeError(f"HTTP {status.decode().strip()}: {(await reader.read()).decode()[-300:]}")
        first = last = None
        pieces, usage = [], None
        async for line in reader:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"the stream failed: {chunk['error']}")
            delta = chunk["choices"][0]["delta"] if chunk.get("choices") else None
            if delta is not None and delta.get("content") is not None and not delta.get("role"):
                last = time.perf_counter()
                if first is None:
                    first = last
                    on_first()
                pieces.append(delta["content"])
            usage = chunk.get("usage") or usage
    finally:
        writer.close()
    n = usage["completion_tokens"] if usage else len(pieces)
    return {"ttft_s": None if first is None else first - sent, "text": "".join(pieces),
            "connecting_at": connecting, "sent_at": sent,  # (perf_counter: one clock for all processes)
            "decode_tok_s": (n - 1) / (last - first) if first and last > first else None,
            "completion_tokens": n, "prompt_tokens": usage["prompt_tokens"] if usage else None,
            "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"] if usage else None}


def run_sessions_raw(args, base_url: str, model_id: str, indices: list[int], deadline: float,
                     decoding: list) -> tuple[list[dict], list[str], float]:
    """run_sessions with the raw client: every session a task of one event loop."""
    rows, errors = [], []

    async def session(i: int) -> None:
        messages = []
        for t in range(args.turns):
            if time.time() > deadline:
                errors.append(f"session {i}: budget exhausted before turn {t}")
                return
            messages.append(user_turn(args, i, t))
            try:
                row = await asyncio.wait_for(stream_turn_raw(
                    base_url, model_id, messages, args.max_tokens, session_name(args, i),
                    on_first=decoding[i].set, sampling=sampling(args)), max(1.0, deadline - time.time()))
            except (RuntimeError, OSError, TimeoutError, ValueError, KeyError) as e:
                errors.append(f"session {i} turn {t}: {type(e).__name__}: {e}")
                return
            finally:
                decoding[i].set()
            messages.append({"role": "assistant", "content": row.pop("text")})
            rows.append({"session": i, "turn": t} | row)

    async def every() -> None:
        await asyncio.gather(*(session(i) for i in indices))

    asyncio.run(every())
    return rows, errors, time.perf_counter()


def warm_client(client: openai.OpenAI, model_id: str, session_id: str = "warm-client") -> None:
    """One throwaway request (its session deleted): the client's lazy imports and its connection."""
    client.models.list()
    stream_turn(client, model_id, [{"role": "user", "content": "Hi."}], 2, session_id)
    client.delete(f"/sessions/{session_id}", cast_to=object)


def run_sessions(args, client: openai.OpenAI, model_id: str, indices: list[int], deadline: float,
                 decoding: list) -> tuple[list[dict], list[str], float]:
    """Sessions `indices`, each in its own thread: its rows, the errors and when the last ended
    (time.perf_counter: one clock for every process of this machine). decoding[i] is set at session
    i's first token."""
    rows, errors = [], []

    def session(i: int) -> None:
        messages = []
        for t in range(args.turns):
            if time.time() > deadline:
                errors.append(f"session {i}: budget exhausted before turn {t}")
                return
            messages.append(user_turn(args, i, t))
            try:
                row = stream_turn(client, model_id, messages, args.max_tokens, session_name(args, i),
                                  on_first=decoding[i].set, sampling=sampling(args))
            except openai.APIError as e:
                errors.append(f"session {i} turn {t}: {e}")
                return
            finally:
                decoding[i].set()
            messages.append({"role": "assistant", "content": row.pop("text")})
            rows.append({"session": i, "turn": t} | row)

    with ThreadPoolExecutor(len(indices)) as pool:
        for job in [pool.submit(session, i) for i in indices]:
            job.result()
    return rows, errors, time.perf_counter()


def client_process(args, base_url: str, model_id: str, indices: list[int], deadline: float, decoding: list,
                   ready, out) -> None:
    """A client process's share of the sessions (--client-processes): its own client, warmed, then
    waits for the others so that all start together."""
    try:
        client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=args.budget_s)
        warm_client(client, model_id, f"warm-client-{indices[0]}")
    except BaseException as e:  # the others and the parent must not wait for this one at the barrier
        print(f"client process of sessions {indices[:3]}...: its warm-up failed: {e!r}", file=sys.stderr,
              flush=True)
        ready.abort()
        raise
    ready.wait()
    if args.client == "raw":
        out.put(run_sessions_raw(args, base_url, model_id, indices, deadline, decoding))
    else:
        out.put(run_sessions(args, client, model_id, indices, deadline, decoding))


def write_marks(path: Path, rows: list[dict]) -> None:
    """When the load's first turns were sent, their first and last first tokens and their first and last
    ends (time.perf_counter: CLOCK_MONOTONIC, one clock for every process of this machine)."""
    first = [r for r in rows if r["turn"] == 0 and r["ttft_s"] is not None]
    if not first:
        return
    tokens = [r["sent_at"] + r["ttft_s"] for r in first]
    ends = [t + (r["completion_tokens"] - 1) / r["decode_tok_s"] if r["decode_tok_s"] else t
            for r, t in zip(first, tokens, strict=True)]
    marks = {"sent": min(r["sent_at"] for r in first), "last_sent": max(r["sent_at"] for r in first),
             "first_token": min(tokens), "ttft_p50": sorted(tokens)[len(tokens) // 2],
             "last_first_token": max(tokens), "first_end": min(ends), "last_end": max(ends)}
    path.write_text(json.dumps(marks, indent=1))


def user_turn(args, i: int, t: int) -> dict:
    """Session i's user message at turn t."""
    return {"role": "user", "content": first_message(i, args.prompt_tokens) if t == 0
            else QUESTIONS[t % len(QUESTIONS)].format(TOPICS[i % len(TOPICS)])}


def session_name(args, i: int) -> str | None:
    """Session i's id (None with --anonymous: a one-turn request without one)."""
    return None if args.anonymous else f"load-{args.tag}{i}"


def sampling(args) -> dict:
    """The load's sampling parameters (greedy unless --temperature)."""
    return {"temperature": args.temperature, "top_p": args.top_p}


def run_load(args, client: openai.OpenAI, model_id: str, about: dict) -> None:
    warm_client(client, model_id)
    deadline = time.time() + args.budget_s
    rows, errors, probes = [], [], []
    processes = max(1, min(args.client_processes, args.sessions))
    context = multiprocessing.get_context("fork")  # forked before any thread of this process starts
    decoding = [context.Event() for _ in range(args.sessions)]  # set at each session's first token

    def probe() -> None:
        """New sessions one by one while the others decode (each has its first token): their TTFT."""
        for event in decoding:
            if not event.wait(max(0.0, deadline - time.time())):
                errors.append("probe: the sessions never all started")
                return
        for k in range(args.probe):
            messages = [{"role": "user", "content": first_message(k, args.prompt_tokens)}]
            try:
                row = stream_turn(client, model_id, messages, 2, f"probe-{k}")
                client.delete(f"/sessions/probe-{k}", cast_to=object)
            except openai.APIError as e:
                errors.append(f"probe {k}: {e}")
                return
            row.pop("text")
            probes.append(row)

    groups = [list(range(args.sessions))[p::processes] for p in range(processes)]
    if processes > 1:
        ready, out = context.Barrier(processes + 1), context.Queue()
        children = [context.Process(target=client_process, args=(args, str(client.base_url), model_id, g,
                                                                 deadline, decoding, ready, out))
                    for g in groups]
        for child in children:
            child.start()
        try:
            ready.wait(timeout=args.budget_s)
        except threading.BrokenBarrierError:  # (a child's warm-up failed: it said why on stderr)
            for child in children:
                child.join(5)
            raise SystemExit("a client process did not get ready (exit codes "
                             f"{[child.exitcode for child in children]}): see its error above") from None
    start = time.perf_counter()
    with ThreadPoolExecutor(2) as pool:
        prober = pool.submit(probe) if args.probe else None
        if processes > 1:
            results = [out.get(timeout=args.budget_s) for _ in children]
            for child in children:
                child.join(30)
        elif args.client == "raw":
            results = [run_sessions_raw(args, str(client.base_url), model_id, groups[0], deadline, decoding)]
        else:
            results = [run_sessions(args, client, model_id, groups[0], deadline, decoding)]
        if prober is not None:
            prober.result()
    for group_rows, group_errors, _ in results:
        rows += group_rows
        errors += group_errors
    wall = max(end for *_, end in results) - start
    try:  # the server's own count of its engine loop's steps and rows
        health = str(client.base_url).rstrip("/").removesuffix("/v1") + "/health"
        with urllib.request.urlopen(health, timeout=30) as r:
            about = about | {"engine_loop": json.loads(r.read()).get("engine_loop")}
    except (urllib.error.URLError, ConnectionError, ValueError):
        pass
    ttft = [r["ttft_s"] for r in rows if r["ttft_s"] is not None]
    rates = [r["decode_tok_s"] for r in rows if r["decode_tok_s"]]
    generated = sum(r["completion_tokens"] for r in rows)
    later = [r for r in rows if r["turn"] > 0]
    probe_ttft = [p["ttft_s"] for p in probes if p["ttft_s"] is not None]
    result = about | {
        "sessions": args.sessions, "turns": args.turns, "max_tokens": args.max_tokens, "client": args.client,
        "temperature": args.temperature, "top_p": args.top_p,
        "requests": len(rows), "errors": errors, "wall_s": wall,
        "ttft_p50_ms": 1e3 * pct(ttft, 0.5), "ttft_p95_ms": 1e3 * pct(ttft, 0.95),
        "ttft_first_turn_p50_ms": 1e3 * pct([r["ttft_s"] for r in rows if r["turn"] == 0
                                             and r["ttft_s"] is not None], 0.5),
        "ttft_later_turns_p50_ms": 1e3 * pct([r["ttft_s"] for r in later if r["ttft_s"] is not None], 0.5),
        "replies_without_a_token": sum(r["ttft_s"] is None for r in rows),
        "decode_tok_s_p50": pct(rates, 0.5), "decode_tok_s_p95": pct(rates, 0.95),
        "aggregate_tok_s": generated / wall, "generated_tokens": generated,
        "later_turns_cached_share": (sum(r["cached_tokens"] for r in later)
                                     / max(1, sum(r["prompt_tokens"] for r in later))) if later else None,
        "prompt_tokens": args.prompt_tokens or None,
        "probe_ttft_p50_ms": 1e3 * pct(probe_ttft, 0.5) if probe_ttft else None,
        "probe_ttft_p95_ms": 1e3 * pct(probe_ttft, 0.95) if probe_ttft else None,
        "probe_prompt_tokens": probes[0]["prompt_tokens"] if probes else None,
        "rows": rows, "probes": probes,
    }
    print(f"{args.sessions} sessions × {args.turns} turns on {about['device']} ({model_id}): "
          f"{len(rows)} requests, {len(errors)} errors, {wall:.1f} s")
    print(f"TTFT p50 {result['ttft_p50_ms']:.0f} ms, p95 {result['ttft_p95_ms']:.0f} ms "
          f"(first turns p50 {result['ttft_first_turn_p50_ms']:.0f} ms, later turns "
          f"{result['ttft_later_turns_p50_ms']:.0f} ms); per-stream decode p50 "
          f"{result['decode_tok_s_p50']:.1f} tok/s; aggregate {result['aggregate_tok_s']:.1f} tok/s; "
          f"later turns: {100 * (result['later_turns_cached_share'] or 0):.0f} % of prompt tokens cached")
    if probe_ttft:
        print(f"new sessions while {args.sessions} decode: TTFT p50 {result['probe_ttft_p50_ms']:.1f} ms, "
              f"p95 {result['probe_ttft_p95_ms']:.1f} ms ({len(probes)} probes, "
              f"{result['probe_prompt_tokens']} prompt tokens)")
    if getattr(args, "timeline", None) and rows:
        write_marks(args.timeline / "marks.json", rows)
    device = about["device"].split(":")[0]
    out = Path(args.out or Path(__file__).parent / "results" / f"serve_load_{device}.json")
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    sys.exit(1 if errors else 0)


if __name__ == "__main__":
    main()
