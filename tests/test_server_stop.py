"""A stop of a real `floe serve` (SIGTERM) on loopback while clients hold requests open. uvicorn's
graceful shutdown waited for every open request, so one snapshot upload trickling a few bytes (or none)
or one export whose client read nothing held the stop ~30 s (the front's body or send deadline, or its
kill). What must hold: the stop ends in a bounded time whatever clients do (a request still arriving
or a reply nobody reads is closed at once; a reply under way has STOP_GRACE_S to end), with status 0,
every live session frozen, nothing of an abandoned upload left in the folder, and the stored sessions
thaw and chat after a restart."""

from __future__ import annotations

import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import httpx
from test_server import MODEL_ID, free_port, start_serve
from test_server_hostile_round3 import trickle

from floe.server.deadlines import STOP_GRACE_S

CHAT = "/v1/chat/completions"
STORY = "Write a very long story about a dragon, at least 2000 words."


def started(folder: Path, *flags: str) -> tuple[subprocess.Popen, str, int]:
    port = free_port()
    proc = start_serve(folder, port, "--idle-seconds", "3600", *flags)  # (live sessions: a stop freezes them)
    return proc, f"http://127.0.0.1:{port}", port


def stopped(proc: subprocess.Popen) -> float:
    """SIGTERM `proc`; the seconds until it exited (its status: proc.returncode)."""
    t = time.perf_counter()
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    return time.perf_counter() - t


def chat(url: str, sid: str, text: str = "hi", max_tokens: int = 2) -> list[dict]:
    """A turn of session `sid`: the conversation it makes."""
    messages = [{"role": "user", "content": text}]
    body = {"model": MODEL_ID, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "session_id": sid}
    r = httpx.post(url + CHAT, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return [*messages, r.json()["choices"][0]["message"]]


def thaws_and_chats(folder: Path, sid: str, conversation: list[dict], *flags: str,
                    cached: bool = True) -> None:
    """A restarted server on `folder` has `sid` frozen holding `conversation`; its next turn thaws it
    and is answered (`cached`: its KV cache kept, the conversation not prefilled again)."""
    proc, url, _ = started(folder, *flags)
    try:
        described = httpx.get(f"{url}/v1/sessions/{sid}", timeout=60).json()
        assert (described["state"], described["messages"]) == ("frozen", len(conversation)), described
        body = {"model": MODEL_ID, "max_tokens": 2, "temperature": 0, "session_id": sid,
                "messages": [*conversation, {"role": "user", "content": "and then?"}]}
        r = httpx.post(url + CHAT, json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert not cached or r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, r.text
    finally:
        stopped(proc)


def leftovers(folder: Path, sid: str) -> list[str]:
    """What an upload as `sid` left: its file, lease, lock sidecars or temporary write folder."""
    return sorted(p.name for p in folder.iterdir() if sid in p.name or p.name.endswith(".floe-tmp"))


def test_a_stop_abandons_trickling_uploads_at_once_and_keeps_nothing_of_them(tmp_path):
    """Two uploads send their first 4 KiB, then nothing: one of a new session, one replacing a live one.
    Before: the stop waited for their body deadline (29.4 s, measured), status 0."""
    proc, url, port = started(tmp_path)
    try:
        kept = chat(url, "kept")
        data = httpx.get(f"{url}/v1/sessions/kept/snapshot", timeout=60).content
        slow = [trickle(port, "incoming", data), trickle(port, "kept", data)]
        deadline = time.time() + 30
        while len(list(tmp_path.glob(".*.safetensors.*.floe-tmp"))) < 2:  # the core is writing both
            assert time.time() < deadline and proc.poll() is None, "the uploads never started"
            time.sleep(0.05)
    finally:
        took = stopped(proc)
    for s in slow:
        try:
            s.settimeout(5)
            answer = s.recv(4096)  # a 503 saying why, or the connection's end (the rest of the body unread)
            assert not answer or b" 503 " in answer and b"server_stopping" in answer, answer
        except ConnectionResetError:
            pass
        finally:
            s.close()
    assert proc.returncode == 0 and took < STOP_GRACE_S, (proc.returncode, took, proc.stderr.read())
    assert leftovers(tmp_path, "incoming") == []
    assert leftovers(tmp_path, "kept") == [".kept.safetensors.floe-lock", "kept.safetensors"]
    thaws_and_chats(tmp_path, "kept", kept)  # as it was
    assert leftovers(tmp_path, "incoming") == []


def stalled_export(port: int, sid: str) -> socket.socket:
    """A GET of session `sid`'s snapshot whose client reads nothing (a tiny receive buffer)."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", port))
    s.sendall(f"GET /v1/sessions/{sid}/snapshot HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    return s


def test_a_stop_closes_an_export_nobody_reads_at_once(tmp_path):
    """Before: the stop waited until floe serve killed its front (30.6 s, measured), status 0."""
    proc, url, port = started(tmp_path)
    try:
        # A prompt that fills the KV cache: an ~18 MB snapshot, more than the sockets' buffers hold
        big = chat(url, "big", "hi " + "apple pear plum " * 120)
        reader = stalled_export(port, "big")
        time.sleep(1.5)  # (the front has written what the buffers take, and waits)
    finally:
        took = stopped(proc)
        reader.close()
    assert proc.returncode == 0 and took < STOP_GRACE_S, (proc.returncode, took, proc.stderr.read())
    assert leftovers(tmp_path, "big") == [".big.safetensors.floe-lock", "big.safetensors"]
    thaws_and_chats(tmp_path, "big", big)


def streamed(url: str, sid: str, before: list[dict], max_tokens: int, started: threading.Event,
             lines: list[str]) -> None:
    """A streamed turn of session `sid` (its conversation so far: `before`) read to its end (or its
    connection's), `started` set at its first line; its lines into `lines`."""
    body = {"model": MODEL_ID, "messages": [*before, {"role": "user", "content": STORY}],
            "max_tokens": max_tokens, "temperature": 0, "session_id": sid, "stream": True}
    try:
        with httpx.stream("POST", url + CHAT, json=body, timeout=120) as r:
            for line in filter(None, r.iter_lines()):
                lines.append(line)
                started.set()
    except httpx.RemoteProtocolError:  # the stream cut short
        lines.append("(cut)")


def test_a_stop_lets_a_reply_under_way_end_within_the_grace_then_cuts_it(tmp_path):
    """Two streams run at the stop: a short one ends as it would have ([DONE]), a long one (1,500
    tokens: ~20 s here) is cut at STOP_GRACE_S, its session keeping its earlier turn (as when a client
    leaves: nothing of the cut turn). Before: the stop waited for the long stream's end (or 30 s)."""
    proc, url, _ = started(tmp_path, "--context", "2048")
    short, long = [], []
    try:
        first = chat(url, "long")  # its first turn, kept
        going = [threading.Event(), threading.Event()]
        threads = [threading.Thread(target=streamed, args=(url, "short", [], 40, going[0], short)),
                   threading.Thread(target=streamed, args=(url, "long", first, 1500, going[1], long))]
        for t in threads:
            t.start()
        assert all(e.wait(60) for e in going)
    finally:
        took = stopped(proc)
    for t in threads:
        t.join(60)
    assert proc.returncode == 0 and STOP_GRACE_S - 1 < took < STOP_GRACE_S + 4, (proc.returncode, took)
    assert short[-1] == "data: [DONE]" and long[-1] == "(cut)", (short[-2:], long[-2:])
    # (a cut turn restarts the session's guest with its conversation, as a client's leaving does: its next
    # turn may prefill it again)
    thaws_and_chats(tmp_path, "long", first, "--context", "2048", cached=False)
