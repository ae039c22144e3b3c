"""Soak of `floe serve` under two API keys, a well-behaved one and a hostile one (issue 41's acceptance).

    python bench/soak.py [--sessions 64] [--minutes 10] [--baseline-minutes M] [--hostile-rate 1]
                         [--max-sessions 8] [--queue 256] [--queue-wait 300] [--context 512]

Starts the real server as `floe serve` runs (`python -m floe.cli serve`, its HTTP front a child of
the engine core's process) with two keys in an --api-key-file, "good" and "hostile", then runs two
phases against the same server:
1. baseline: the good key alone. S sessions, each in its own thread of this process, hold multi-turn
   chats (named sessions, --turns each, then deleted and a new one begun) streamed with the official
   `openai` client, --max-tokens a reply; TTFT is request sent → first content chunk, queueing
   included (on 2 cores most of 64 chats wait for one of --max-sessions slots: that is measured).
2. hostile: the same load, plus the hostile key sending --hostile-rate requests a second, a rotating
   mix of what issue 41 found (HOSTILE below). Each must get a 4xx, or its client left; the long
   streams (a burst of --long-streams, at most one burst at a time) are ordinary 200s.
Between them each hostile kind is sent once on the idle server (what it gets with free slots).
Every few seconds the server's RSS (VmRSS of the serve process and all its descendants) is sampled,
with the RAM tier's bytes (/metrics, through an operator key). Per phase: requests, outcomes by status
for each key, 5xx count, the good key's TTFT p50/p95 and tokens/s, RSS at the start, after --warmup-s
and at the end, its level (the median of --level-s seconds) after warm-up and at the end, each
minute's median, and whether the server is alive. The server's log lines with ERROR or Traceback are
kept. Writes bench/results/soak_<date>.json. Acceptance (issue 41): 0 × 5xx, 0 exits, hostile-phase
TTFT p95 ≤ 2 × baseline's, RSS flat: the level's growth after warm-up ≤ 10 % for the memory outside
the RAM tier (the tier fills to its --pinned-bytes budget by design, over the first ~3 minutes of
hostile long streams; the total's level is reported beside it). Single samples swing by ±150 MB
within a minute with the snapshots and streams in flight: two of them measure the swing, not a leak.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import select
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
from smoke import results, shrink

KEYS = {"good": "soak-good-" + "7" * 32, "hostile": "soak-hostile-" + "3" * 32}
OPERATOR_KEY = "soak-operator-" + "5" * 32  # reads /metrics (the RAM tier's bytes), sends no requests
QUESTIONS = ["Tell me about {}.", "What is it best known for?", "Summarise that in one sentence.",
             "Give one more fact.", "Thank you. Anything else?"]
TOPICS = ["Paris", "the Moon", "volcanoes", "bees", "the Nile", "chess", "glaciers", "owls", "copper",
          "Mars", "whales", "tea", "bridges", "deserts", "coral", "maps"]
CHAT = "/v1/chat/completions"


def pct(xs: list[float], q: float) -> float | None:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else None


# The hostile kinds of a smoke run (bench/smoke.py): all but the slow senders, which wait out the
# server's 10-30 s deadlines.
SMOKE_KINDS = ("oversized_body", "text_past_the_bytes_bound", "text_past_the_context",
               "nested_tool_arguments", "nested_body", "left_recursive_schema", "negative_max_length",
               "reasoning_effort", "temperature_true", "malformed_json", "disconnect_mid_stream",
               "long_streams", "other_keys_session", "wrong_key")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- the server and its memory ------------------------------------------------------------------------

def start_server(args, folder: Path) -> tuple[subprocess.Popen, int, str, Path]:
    """`floe serve` with the two keys, as a child process; its port, model id and log file."""
    keys = folder / "keys"
    keys.write_text("# soak keys\n" + "\n".join(KEYS.values()) + "\n")
    keys.chmod(0o600)
    operators = folder / "operator-keys"
    operators.write_text(OPERATOR_KEY + "\n")
    operators.chmod(0o600)
    port, log = free_port(), folder / "serve.log"
    argv = [sys.executable, "-m", "floe.cli", "serve", "--port", str(port), "--snapshots",
            str(folder / "snapshots"), "--api-key-file", str(keys), "--operator-key-file", str(operators),
            "--max-sessions", str(args.max_sessions),
            "--queue", str(args.queue), "--queue-wait", str(args.queue_wait), "--context", str(args.context),
            "--log-level", "info"]
    if args.pinned_bytes is not None:
        argv += ["--pinned-bytes", args.pinned_bytes]
    with log.open("wb") as out:
        server = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    health = urllib.request.Request(f"http://127.0.0.1:{port}/health",
                                    headers={"Authorization": f"Bearer {KEYS['good']}"})
    deadline = time.time() + 300
    while True:
        if server.poll() is not None:
            tail = log.read_text()[-3000:]
            sys.exit(f"floe serve exited with {server.returncode} before it served:\n{tail}")
        try:
            with urllib.request.urlopen(health, timeout=2) as r:
                return server, port, json.loads(r.read())["model"], log
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            if time.time() > deadline:
                os.killpg(server.pid, signal.SIGKILL)
                sys.exit("floe serve did not answer /health within 300 s")
            time.sleep(0.5)


def process_tree(pid: int) -> list[int]:
    """pid and every descendant of it (from /proc/*/stat's parent ids)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    tree, frontier = [pid], [pid]
    while frontier:
        frontier = [p for p, parent in parents.items() if parent in frontier]
        tree += frontier
    return tree


def rss_bytes(pid: int) -> dict[int, int]:
    """VmRSS of pid and of each of its descendants, bytes."""
    found = {}
    for p in process_tree(pid):
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    found[p] = int(line.split()[1]) * 1024
        except OSError:
            pass
    return found


def pinned_bytes(port: int) -> int | None:
    """The bytes of frozen sessions in the server's RAM tier (its /metrics gauge), or None."""
    metrics = urllib.request.Request(f"http://127.0.0.1:{port}/metrics",
                                     headers={"Authorization": f"Bearer {OPERATOR_KEY}"})
    try:
        with urllib.request.urlopen(metrics, timeout=5) as r:
            for line in r.read().decode().splitlines():
                if line.startswith("floe_store_pinned_bytes "):
                    return int(float(line.split()[1]))
    except (OSError, ValueError):
        pass
    return None


class RssSampler:
    """The server tree's RSS every `every` seconds, in a thread: (time.time(), bytes, alive, the
    engine core's own bytes, the RAM tier's bytes or None)."""

    def __init__(self, server: subprocess.Popen, port: int, every: float):
        self.server, self.port, self.every, self.samples = server, port, every, []
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        while not self.stopped.is_set():
            alive = self.server.poll() is None
            each = rss_bytes(self.server.pid) if alive else {}
            pinned = pinned_bytes(self.port) if alive else None
            self.samples.append((time.time(), sum(each.values()), alive, each.get(self.server.pid, 0),
                                 pinned))
            self.stopped.wait(self.every)

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join()


# ---- the well-behaved key -----------------------------------------------------------------------------

class Ledger:
    """Every request's outcome, from every thread."""

    def __init__(self):
        self.rows, self.lock = [], threading.Lock()

    def add(self, **row) -> None:
        with self.lock:
            self.rows.append(row | {"t": time.time()})


def stream_turn(client: openai.OpenAI, model_id: str, messages: list[dict], max_tokens: int,
                session_id: str) -> tuple[float | None, str, int]:
    """One streamed request: its TTFT (s), its text and its completion tokens."""
    sent, first, pieces, usage = time.perf_counter(), None, [], None
    for chunk in client.chat.completions.create(
            model=model_id, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"session_id": session_id}):
        delta = chunk.choices[0].delta if chunk.choices else None
        if delta is not None and delta.content is not None and not delta.role:
            first = first or time.perf_counter()
            pieces.append(delta.content)
        usage = chunk.usage or usage
    return (None if first is None else first - sent), "".join(pieces), (
        usage.completion_tokens if usage else len(pieces))


def good_session(args, client: openai.OpenAI, model_id: str, phase: str, i: int, deadline: float,
                 ledger: Ledger) -> None:
    """Session i's chats until the deadline: --turns a conversation, then it is deleted and another begun."""
    for k in itertools.count():
        if time.time() >= deadline:
            return
        sid, messages = f"{phase}-{i}-{k}", []
        for t in range(args.turns):
            if time.time() >= deadline:
                break
            topic = TOPICS[(i + k) % len(TOPICS)]
            messages.append({"role": "user", "content": QUESTIONS[t % len(QUESTIONS)].format(topic)})
            try:
                ttft, text, tokens = stream_turn(client, model_id, messages, args.max_tokens, sid)
            except openai.APIStatusError as e:
                ledger.add(key="good", kind="chat", status=e.status_code, detail=str(e)[:300])
                break
            except openai.APIError as e:  # no answer at all: a dead server, a reset connection, a timeout
                ledger.add(key="good", kind="chat", status="no_answer",
                           detail=f"{type(e).__name__}: {e}"[:300])
                break
            ledger.add(key="good", kind="chat", status=200, ttft_s=ttft, tokens=tokens, turn=t)
            messages.append({"role": "assistant", "content": text})
        try:
            client.delete(f"/sessions/{sid}", cast_to=object)
            ledger.add(key="good", kind="delete", status=200)
        except openai.APIStatusError as e:
            ledger.add(key="good", kind="delete", status=e.status_code, detail=str(e)[:300])
        except openai.APIError as e:
            ledger.add(key="good", kind="delete", status="no_answer", detail=f"{type(e).__name__}: {e}"[:300])


# ---- the hostile key ----------------------------------------------------------------------------------

class Hostile:
    """The hostile key's requests, one kind after another (issue 41's findings). Each returns its
    outcome: an HTTP status, "client_left" (this client closed the stream on purpose) or "no_answer"."""

    def __init__(self, port: int, model_id: str, args):
        self.port, self.model, self.args = port, model_id, args
        self.url = f"http://127.0.0.1:{port}"
        self.auth = {"authorization": f"Bearer {KEYS['hostile']}", "content-type": "application/json"}
        self.http = httpx.Client(base_url=self.url, headers=self.auth, timeout=args.queue_wait + 120)
        self.bursting = threading.Lock()  # one burst of long streams at a time
        self.phase = "baseline"
        self.local = threading.local()  # .detail: what the server said, when that was not a 4xx

    def kinds(self, only: str | None = None) -> list:
        """The kinds, in their order (only: those named, comma-separated)."""
        every = [self.oversized_body, self.text_past_the_bytes_bound, self.text_past_the_context,
                 self.nested_tool_arguments, self.nested_body, self.left_recursive_schema,
                 self.negative_max_length, self.reasoning_effort, self.temperature_true, self.malformed_json,
                 self.slow_body, self.slow_headers, self.disconnect_mid_stream, self.long_streams,
                 self.other_keys_session, self.wrong_key]
        return [k for k in every if only is None or k.__name__ in only.split(",")]

    def status(self, r: httpx.Response) -> int:
        """r's status; its body kept in self.local.detail when it is not a 4xx."""
        if not 400 <= r.status_code < 500:
            self.local.detail = f"{r.status_code} {r.headers.get('retry-after', '')} {r.read()[:600]!r}"
        return r.status_code

    def post(self, body: dict | str) -> int | str:
        try:
            if isinstance(body, str):
                return self.status(self.http.post(CHAT, content=body))
            return self.status(self.http.post(CHAT, json=body))
        except httpx.HTTPError as e:
            return f"no_answer: {type(e).__name__}"

    def ask(self, **fields) -> dict:
        question = [{"role": "user", "content": "What is the capital of France?"}]
        return {"model": self.model, "messages": question, "max_tokens": 8} | fields

    def raw(self, head: bytes, body_parts, pause: float = 0.0, timeout: float = 120) -> int | str:
        """A request written on a socket by hand (a slow sender; a body past the limit, which the
        server may refuse and close while it is still being sent): the response's status."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=timeout) as s:
            try:
                s.sendall(head)
                for part in body_parts:
                    if select.select([s], [], [], pause)[0]:
                        break  # the server answered before the whole request: read that answer
                    s.sendall(part)
            except OSError:
                pass  # it answered and closed while the body was being sent
            try:
                reply = s.recv(4096)
            except OSError as e:
                return f"no_answer: {type(e).__name__}"
        if not reply.startswith(b"HTTP/1."):
            return "no_answer: closed"
        status = int(reply.split(b" ", 2)[1])
        if not 400 <= status < 500:
            self.local.detail = repr(reply[:800])
        return status

    def head(self, length: int) -> bytes:
        return (f"POST {CHAT} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEYS['hostile']}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n").encode()

    def oversized_body(self) -> int | str:
        """9 MB (the default limit is 8 MiB): 413."""
        body = json.dumps(self.ask()).encode()[:-1] + b', "user": "' + b"a" * (9 * 10**6) + b'"}'
        return self.raw(self.head(len(body)), [body[i:i + 2**20] for i in range(0, len(body), 2**20)])

    def text_past_the_bytes_bound(self) -> int | str:
        """1 MB of text in a 512-token context: 400 context_length_exceeded before tokenizing."""
        return self.post(self.ask(messages=[{"role": "user", "content": "word " * 200_000}]))

    def text_past_the_context(self) -> int | str:
        """Under the bytes bound, over the context's tokens: 400 from the core."""
        text = "tell me more " * self.args.context
        return self.post(self.ask(messages=[{"role": "user", "content": text}]))

    def nested_tool_arguments(self) -> int | str:
        call = {"name": "get_weather", "arguments": "[" * 5000 + "]" * 5000}
        return self.post(self.ask(messages=[
            {"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": call}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}], tools=[
            {"type": "function", "function": {"name": "get_weather", "parameters": {
                "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]))

    def nested_body(self) -> int | str:
        """A body too deep for Python's json at all."""
        deep = "[" * 5000 + "]" * 5000
        return self.post('{"model":"' + self.model + '","messages":[],"tools":' + deep + "}")

    def schema(self, schema: dict) -> int | str:
        return self.post(self.ask(response_format={"type": "json_schema",
                                                   "json_schema": {"name": "x", "schema": schema}}))

    def left_recursive_schema(self) -> int | str:
        return self.schema({"$defs": {"a": {"anyOf": [{"$ref": "#/$defs/a"}, {"type": "string"}]}},
                            "$ref": "#/$defs/a"})

    def negative_max_length(self) -> int | str:
        return self.schema({"type": "string", "maxLength": -1})

    def reasoning_effort(self) -> int | str:
        return self.post(self.ask(reasoning_effort="high"))

    def temperature_true(self) -> int | str:
        return self.post(self.ask(temperature=True))

    def malformed_json(self) -> int | str:
        return self.post('{"model": "' + self.model + '", "messages": [{"role": "user", "content": "hi"}')

    def slow_body(self) -> int | str:
        """A body trickled a byte every 5 s (the server wants 64 KiB or the rest per 30 s): 408."""
        body = json.dumps(self.ask()).encode()
        return self.raw(self.head(len(body)), [body[i:i + 1] for i in range(len(body))], pause=5.0)

    def slow_headers(self) -> int | str:
        """Headers a line every 4 s (the server wants them within 10 s): 408."""
        lines = [f"POST {CHAT} HTTP/1.1\r\n".encode(), b"Host: 127.0.0.1\r\n", b"X-Slow-1: a\r\n",
                 b"X-Slow-2: b\r\n", b"X-Slow-3: c\r\n", b"X-Slow-4: d\r\n", b"X-Slow-5: e\r\n"]
        return self.raw(lines[0], lines[1:], pause=4.0)

    def disconnect_mid_stream(self) -> int | str:
        """A stream read for three events and closed."""
        story = [{"role": "user", "content": "Tell me a long story."}]
        body = self.ask(max_tokens=200, stream=True, messages=story)
        try:
            with self.http.stream("POST", CHAT, json=body) as r:
                if r.status_code != 200:
                    return self.status(r)
                for n, _ in enumerate(r.iter_lines()):
                    if n >= 3:
                        return "client_left"
                return 200
        except httpx.HTTPError as e:
            return f"no_answer: {type(e).__name__}"

    def long_streams(self) -> int | str:
        """--long-streams streams of --long-tokens at once, each read to its end (ordinary 200s);
        skipped (None) while the last burst runs."""
        if not self.bursting.acquire(blocking=False):
            return None
        try:
            story = [{"role": "user", "content": "Write a very long story about a lighthouse."}]
            body = self.ask(max_tokens=self.args.long_tokens, stream=True, messages=story)

            def one(_) -> int | str:
                try:
                    with self.http.stream("POST", CHAT, json=body) as r:
                        if r.status_code != 200:
                            return self.status(r)
                        for _line in r.iter_lines():
                            pass
                        return r.status_code
                except httpx.HTTPError as e:
                    return f"no_answer: {type(e).__name__}"

            with ThreadPoolExecutor(self.args.long_streams) as pool:
                statuses = list(pool.map(one, range(self.args.long_streams)))
            bad = [s for s in statuses if s != 200]
            return bad[0] if bad else 200
        finally:
            self.bursting.release()

    def other_keys_session(self) -> int | str:
        """The good key's session ids: read, delete, fork, or chat on as if it held them: 404."""
        sid = f"{self.phase}-{int(time.time()) % self.args.sessions}-0"
        which = int(time.time()) % 4
        try:
            if which == 0:
                return self.status(self.http.get(f"/v1/sessions/{sid}"))
            if which == 1:
                return self.status(self.http.delete(f"/v1/sessions/{sid}"))
            if which == 2:
                return self.status(self.http.post(f"/v1/sessions/{sid}/fork", json={"id": "stolen"}))
        except httpx.HTTPError as e:
            return f"no_answer: {type(e).__name__}"
        return self.post(self.ask(session_id=sid, messages=[
            {"role": "user", "content": "Tell me about Paris."}, {"role": "assistant", "content": "Paris is"},
            {"role": "user", "content": "What is it best known for?"}]))

    def wrong_key(self) -> int | str:
        try:
            return self.status(httpx.post(self.url + CHAT, json=self.ask(), timeout=60,
                                          headers={"authorization": "Bearer " + KEYS["good"][:-1] + "x"}))
        except httpx.HTTPError as e:
            return f"no_answer: {type(e).__name__}"


def run_hostile(hostile: Hostile, rate: float, deadline: float, ledger: Ledger) -> None:
    """One hostile request every 1/rate s, each in its own thread (a slow sender must not hold the pace)."""
    kinds = itertools.cycle(hostile.kinds(hostile.args.hostile_kinds))
    with ThreadPoolExecutor(64) as pool:
        next_at = time.time()
        while time.time() < deadline:
            kind = next(kinds)

            def one(kind=kind) -> None:
                sent, hostile.local.detail = time.perf_counter(), None
                status = kind()
                if status is not None:
                    ledger.add(key="hostile", kind=kind.__name__, status=status,
                               seconds=time.perf_counter() - sent, detail=hostile.local.detail)

            pool.submit(one)
            next_at += 1 / rate
            time.sleep(max(0.0, next_at - time.time()))


def probe_idle(hostile: Hostile) -> dict[str, dict]:
    """Each hostile kind once (but the long streams), at once, on an idle server: what each gets
    when no slot is busy, to set beside what it gets under load."""

    def one(kind) -> tuple[str, dict]:
        hostile.local.detail = None
        status = kind()
        return kind.__name__, {"status": status, "detail": hostile.local.detail}

    kinds = [k for k in hostile.kinds(hostile.args.hostile_kinds) if k.__name__ != "long_streams"]
    with ThreadPoolExecutor(len(kinds)) as pool:
        return dict(pool.map(one, kinds))


# ---- a phase and its report ---------------------------------------------------------------------------

def run_phase(args, name: str, minutes: float, port: int, model_id: str, hostile: Hostile | None,
              sampler: RssSampler, server: subprocess.Popen) -> dict:
    """S good sessions (and the hostile key, if given) for `minutes`; the phase's report."""
    ledger = Ledger()
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEYS["good"], max_retries=0,
                           timeout=args.queue_wait + 120)
    start = time.time()
    deadline = start + 60 * minutes
    with_hostile = f" with the hostile key at {args.hostile_rate:g}/s" if hostile else ""
    print(f"[{name}] {args.sessions} sessions for {minutes} min{with_hostile}", flush=True)
    with ThreadPoolExecutor(args.sessions + 1) as pool:
        jobs = [pool.submit(good_session, args, client, model_id, name, i, deadline, ledger)
                for i in range(args.sessions)]
        if hostile:
            hostile.phase = name
            jobs.append(pool.submit(run_hostile, hostile, args.hostile_rate, deadline, ledger))
        for job in jobs:
            job.result()
    end = time.time()
    alive = server.poll() is None
    return report(args, name, ledger.rows, start, deadline, end, sampler.samples, alive)


def report(args, name: str, rows: list[dict], start: float, deadline: float, end: float,
           samples: list[tuple], alive: bool) -> dict:
    chats = [r for r in rows if r["key"] == "good" and r["kind"] == "chat"]
    ok = [r for r in chats if r["status"] == 200]
    ttft = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    by_status: dict[str, dict[str, int]] = {}
    for r in rows:
        status = str(r["status"])
        by_status.setdefault(r["key"], {})
        by_status[r["key"]][status] = by_status[r["key"]].get(status, 0) + 1
    hostile_kinds: dict[str, dict[str, int]] = {}
    for r in rows:
        if r["key"] == "hostile":
            kind = hostile_kinds.setdefault(r["kind"], {})
            kind[str(r["status"])] = kind.get(str(r["status"]), 0) + 1
    five = [r for r in rows if isinstance(r["status"], int) and r["status"] >= 500]
    refused_kinds = {"long_streams", "disconnect_mid_stream"}
    let_through = [r for r in rows if r["key"] == "hostile" and r["kind"] not in refused_kinds
                   and r["status"] == 200]
    phase = [(t, b) for t, b, live, *_ in samples if start <= t <= end and live]
    core = {t: c for t, _, live, c, _ in samples if start <= t <= end and live}
    pinned = {t: p for t, _, live, _, p in samples if start <= t <= end and live}
    warm_at = start + min(args.warmup_s, (end - start) / 2)
    warm = [(t, b) for t, b in phase if t >= warm_at]
    rss_start, rss_warm, rss_end = (phase[0][1] if phase else None), (warm[0][1] if warm else None), (
        phase[-1][1] if phase else None)
    level_warm, level_end = rss_levels(phase, warm_at, end, args.level_s)
    # what the RAM tier's budget does not bound: the tier fills to --pinned-bytes by design
    untiered = [(t, b - (pinned[t] or 0)) for t, b in phase]
    free_warm, free_end = rss_levels(untiered, warm_at, end, args.level_s)
    tokens = sum(r["tokens"] for r in ok)
    good_end = max((r["t"] for r in chats), default=end)  # the hostile key's last requests may end later
    return {
        "phase": name, "minutes": (deadline - start) / 60, "wall_s": end - start,
        "good_requests": len(chats), "good_ok": len(ok),
        "hostile_requests": sum(r["key"] == "hostile" for r in rows),
        "by_status": by_status, "hostile_by_kind": hostile_kinds,
        "5xx": len(five), "5xx_rows": five[:50],
        "no_answer": [r for r in rows if str(r["status"]).startswith("no_answer")][:50],
        "hostile_let_through": let_through[:50],
        "ttft_p50_ms": None if not ttft else 1e3 * pct(ttft, 0.5),
        "ttft_p95_ms": None if not ttft else 1e3 * pct(ttft, 0.95),
        "ttft_max_ms": None if not ttft else 1e3 * max(ttft),
        "good_tokens": tokens, "good_tok_s": tokens / (good_end - start),
        "rss_start_mb": rss_start and rss_start / 2**20, "rss_after_warmup_mb": rss_warm and rss_warm / 2**20,
        "rss_end_mb": rss_end and rss_end / 2**20,
        "rss_max_mb": max(b for _, b in phase) / 2**20 if phase else None,
        "rss_growth_after_warmup_pct": (100 * (rss_end - rss_warm) / rss_warm) if rss_warm else None,
        "rss_level_after_warmup_mb": level_warm and level_warm / 2**20,
        "rss_level_end_mb": level_end and level_end / 2**20,
        "rss_level_growth_pct": (100 * (level_end - level_warm) / level_warm) if level_warm else None,
        "rss_minute_medians_mb": minute_medians(phase, start),
        "rss_outside_ram_tier_level_after_warmup_mb": free_warm and free_warm / 2**20,
        "rss_outside_ram_tier_level_end_mb": free_end and free_end / 2**20,
        "rss_outside_ram_tier_level_growth_pct": (100 * (free_end - free_warm) / free_warm) if free_warm
        else None,
        "rss_outside_ram_tier_minute_medians_mb": minute_medians(untiered, start),
        "ram_tier_minute_medians_mb": minute_medians([(t, pinned[t] or 0) for t, _ in phase], start),
        "rss_samples_s_total_core_pinned_mb": [
            (round(t - start, 1), round(b / 2**20, 1), round(core[t] / 2**20, 1),
             None if pinned[t] is None else round(pinned[t] / 2**20, 1)) for t, b in phase],
        "server_alive_at_end": alive,
    }


def rss_levels(phase: list[tuple[float, int]], warm_at: float, end: float,
               window: float) -> tuple[float | None, float | None]:
    """The RSS level (median, bytes) of the `window` seconds after warm-up and of the last `window`: a
    leak moves the level; one sample moves with what is in flight (snapshot buffers, long streams swing
    the core by ±150 MB within a minute)."""
    first = [b for t, b in phase if warm_at <= t < warm_at + window]
    last = [b for t, b in phase if t > end - window and t >= warm_at]
    return (statistics.median(first) if first else None), (statistics.median(last) if last else None)


def minute_medians(phase: list[tuple[float, int]], start: float) -> list[float]:
    """The median RSS (MB) of each whole or partial minute of the phase."""
    minutes: dict[int, list[int]] = {}
    for t, b in phase:
        minutes.setdefault(int((t - start) // 60), []).append(b)
    return [round(statistics.median(v) / 2**20, 1) for _, v in sorted(minutes.items())]


def log_findings(log: Path) -> list[str]:
    """The server log's lines that say something went wrong."""
    lines = log.read_text(errors="replace").splitlines()
    words = ("ERROR", "Traceback", "Error:", " 500 ")
    return [line[:500] for line in lines if any(w in line for w in words)][:200]


def print_table(phases: list[dict]) -> None:
    def f(x, spec=".0f"):
        return "-" if x is None else format(x, spec)

    print(f"{'phase':9} {'good req':>8} {'hostile':>7} {'5xx':>4} {'TTFT p50':>9} {'p95 ms':>8} {'tok/s':>6} "
          f"{'RSS start':>9} {'warm':>6} {'end MB':>7} {'growth':>7} {'level warm':>10} {'end':>6} "
          f"{'growth':>7} {'untiered':>8} {'end':>6} {'growth':>7} {'alive':>5}")
    for p in phases:
        print(f"{p['phase']:9} {p['good_requests']:8d} {p['hostile_requests']:7d} {p['5xx']:4d} "
              f"{f(p['ttft_p50_ms']):>9} {f(p['ttft_p95_ms']):>8} {f(p['good_tok_s'], '.1f'):>6} "
              f"{f(p['rss_start_mb']):>9} {f(p['rss_after_warmup_mb']):>6} {f(p['rss_end_mb']):>7} "
              f"{f(p['rss_growth_after_warmup_pct'], '+.1f'):>6}% {f(p['rss_level_after_warmup_mb']):>10} "
              f"{f(p['rss_level_end_mb']):>6} {f(p['rss_level_growth_pct'], '+.1f'):>6}% "
              f"{f(p['rss_outside_ram_tier_level_after_warmup_mb']):>8} "
              f"{f(p['rss_outside_ram_tier_level_end_mb']):>6} "
              f"{f(p['rss_outside_ram_tier_level_growth_pct'], '+.1f'):>6}% "
              f"{str(p['server_alive_at_end']):>5}")
    for p in phases:
        print(f"{p['phase']}: by status {json.dumps(p['by_status'])}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=64, help="the good key's concurrent sessions")
    ap.add_argument("--minutes", type=float, default=10, help="the hostile phase's length")
    ap.add_argument("--baseline-minutes", type=float, default=None,
                    help="the baseline's length (default: --minutes)")
    ap.add_argument("--hostile-rate", type=float, default=1.0, help="hostile requests a second")
    ap.add_argument("--hostile-kinds", default=None,
                    help="only these hostile kinds, comma-separated (Hostile's method names; default: all)")
    ap.add_argument("--turns", type=int, default=4, help="turns of one conversation before a new one")
    ap.add_argument("--max-tokens", type=int, default=16, help="the good key's reply length")
    ap.add_argument("--long-streams", type=int, default=8, help="hostile streams in one burst")
    ap.add_argument("--long-tokens", type=int, default=256, help="tokens of each hostile long stream")
    ap.add_argument("--max-sessions", type=int, default=8, help="the server's KV slots")
    ap.add_argument("--queue", type=int, default=256, help="the server's --queue")
    ap.add_argument("--queue-wait", type=float, default=300, help="the server's --queue-wait (s)")
    ap.add_argument("--context", type=int, default=512, help="the server's --context (tokens)")
    ap.add_argument("--pinned-bytes", default=None,
                    help="the server's --pinned-bytes (RAM for frozen sessions' snapshots; default 512M)")
    ap.add_argument("--warmup-s", type=float, default=60, help="RSS growth is measured from this far in")
    ap.add_argument("--sample-s", type=float, default=5, help="RSS sampling interval")
    ap.add_argument("--level-s", type=float, default=60,
                    help="RSS levels are medians over this long after warm-up and at the end")
    ap.add_argument("--out", default=None)
    args = shrink(ap.parse_args(), sessions=2, minutes=0.15, baseline_minutes=0.1, turns=2, max_tokens=4,
                  long_streams=1, long_tokens=8, warmup_s=2, sample_s=1, level_s=3, queue_wait=30,
                  hostile_rate=2.0,
                  hostile_kinds=",".join(SMOKE_KINDS))
    folder = Path(tempfile.mkdtemp(prefix="floe-soak-"))
    server, port, model_id, log = start_server(args, folder)
    print(f"floe serve pid {server.pid} on port {port} ({model_id}); log {log}", flush=True)
    sampler = RssSampler(server, port, args.sample_s)
    phases, exit_status, idle = [], None, {}
    try:
        phases.append(run_phase(args, "baseline", args.baseline_minutes or args.minutes, port, model_id, None,
                                sampler, server))
        if server.poll() is None:
            hostile = Hostile(port, model_id, args)
            idle = probe_idle(hostile)
            print("hostile requests on the idle server: "
                  + ", ".join(f"{k} {v['status']}" for k, v in idle.items()), flush=True)
            phases.append(run_phase(args, "hostile", args.minutes, port, model_id, hostile, sampler, server))
    finally:
        sampler.stop()
        alive_before_stop = server.poll() is None
        if alive_before_stop:
            os.killpg(server.pid, signal.SIGTERM)  # a stop: live sessions frozen, status 0
        try:
            exit_status = server.wait(180)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            exit_status = "killed after 180 s"
    base, host = (phases + [None, None])[:2]
    goals = {
        "no_5xx": all(p["5xx"] == 0 for p in phases),
        "no_server_exit": alive_before_stop and all(p["server_alive_at_end"] for p in phases),
        "ttft_p95_within_2x": bool(base and host and base["ttft_p95_ms"] and host["ttft_p95_ms"]
                                   and host["ttft_p95_ms"] <= 2 * base["ttft_p95_ms"]),
        "rss_outside_ram_tier_level_growth_le_10pct": all(
            p["rss_outside_ram_tier_level_growth_pct"] is not None
            and p["rss_outside_ram_tier_level_growth_pct"] <= 10 for p in phases),
    }
    result = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "model": model_id, "cpus": os.cpu_count(), "args": vars(args), "goals": goals,
              "ttft_p95_ratio": (host["ttft_p95_ms"] / base["ttft_p95_ms"]) if base and host
              and base["ttft_p95_ms"] and host["ttft_p95_ms"] else None,
              "server_exit_status_after_sigterm": exit_status,
              "hostile_on_idle_server": idle, "server_log_findings": log_findings(log),
              "server_log_tail": log.read_text(errors="replace").splitlines()[-40:], "phases": phases}
    print_table(phases)
    print(f"TTFT p95 ratio hostile/baseline: {result['ttft_p95_ratio']}; goals: {json.dumps(goals)}; "
          f"server exit after SIGTERM: {exit_status}; "
          f"{len(result['server_log_findings'])} log lines with errors")
    default = Path(__file__).parent / "results" / f"soak_{datetime.date.today():%Y-%m-%d}.json"
    out = results(args.out or default)
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str))
    print(f"wrote {out} (server log kept in {log})")


if __name__ == "__main__":
    main()
