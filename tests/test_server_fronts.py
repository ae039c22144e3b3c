"""`floe serve --fronts N`: several HTTP front processes share one port and one engine core (issue 40:
one front streamed every token of every session through one GIL). Each new connection goes to one of
them, a burst's spread over them all; every front answers the same way and /metrics counts all of them
together."""

from __future__ import annotations

import gc
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import psutil
import pytest
from test_server import CONTEXT, MODEL_ID, free_port, start_serve

pytestmark = pytest.mark.slow  # whole `floe serve` processes


def requests_counted(url: str, status: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    return sum(float(v) for v in re.findall(rf'^floe_requests_total{{status="{status}"}} (\S+)$', text, re.M))


def test_several_fronts_share_the_port_and_count_requests_together(tmp_path):
    port = free_port()
    proc = start_serve(tmp_path, port, "--fronts", "2", "--model-id", MODEL_ID)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120  # the first front may answer before the second has connected
        while httpx.get(url + "/health", timeout=30).json()["fronts"] < 2:
            assert time.time() < deadline, "the second front never connected to the core"
            time.sleep(0.1)
        # A burst of connections is spread over the fronts (on one shared socket the front whose loop
        # woke first accepted all of them: 64 of 64 in one of 4 fronts).
        burst = [socket.create_connection(("127.0.0.1", port)) for _ in range(16)]
        try:
            for sock in burst:
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: floe\r\n\r\n")
            for sock in burst:
                assert sock.recv(65536).startswith(b"HTTP/1.1 200")
            held = [sum(c.status == psutil.CONN_ESTABLISHED and c.laddr.port == port
                        for c in front.net_connections("tcp"))
                    for front in psutil.Process(proc.pid).children(recursive=True)]
            if sys.platform == "linux":  # (SO_REUSEPORT's spreading; elsewhere one shared socket)
                assert sum(h > 0 for h in held) == 2 and sum(held) == 16, held  # (all in one: 2 ** -15)
        finally:
            for sock in burst:
                sock.close()
        for i in range(6):  # a new connection each: the kernel hands each to one front
            with httpx.Client(timeout=300) as c:
                r = c.post(url + "/v1/chat/completions", json={
                    "model": MODEL_ID, "messages": [{"role": "user", "content": f"Say {i}."}],
                    "max_tokens": 3, "temperature": 0})
                assert r.status_code == 200, r.text
        for _ in range(3):  # whichever front answers /metrics counts every front's requests
            assert requests_counted(url, "200") == 6
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_port_in_use_is_an_error_before_the_model_loads(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "floe.cli", "serve", "--port", str(port), "--snapshots",
                               str(tmp_path), "--context", str(CONTEXT)], capture_output=True, text=True,
                              timeout=300)
    assert done.returncode == 1, done.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr and "Traceback" not in done.stderr
    assert "warming up" not in done.stderr  # refused before the model loaded (then its KV slots warm)


@pytest.mark.skipif(sys.platform != "linux", reason="one socket for all fronts without SO_REUSEPORT")
def test_several_fronts_do_not_share_a_port_another_server_listens_on(tmp_path):
    """Each front's socket is bound with SO_REUSEPORT (the kernel spreads connections over them), which
    would let a second server of the same user join the port: it is refused as any port in use."""
    from floe.errors import FloeError
    from floe.server.fronts import listen

    first = listen("127.0.0.1", 0, 2)
    try:
        port = first[0].getsockname()[1]
        assert len(first) == 2 and {s.getsockname()[1] for s in first} == {port}
        with pytest.raises(FloeError, match=f"cannot listen on 127.0.0.1:{port}"):
            listen("127.0.0.1", port, 2)
        with pytest.raises(FloeError, match=f"cannot listen on 127.0.0.1:{port}"):
            listen("127.0.0.1", port)
    finally:
        for sock in first:
            sock.close()


def test_fronts_started_before_one_that_fails_to_start_are_stopped(tmp_path, monkeypatch):
    """A front that cannot be started (its process not made) ends `floe serve` with that error, and the
    fronts started before it are stopped with it, not left serving the port on their own."""
    from models import tiny_engine

    from floe.server import fronts
    from floe.server.core import ServeCore

    started, start = [], fronts._start_front

    def second_fails(args, listener, env):
        if started:
            raise OSError("no process for the second front")
        started.append(start(args, listener, env))
        return started[-1]

    monkeypatch.setattr(fronts, "_start_front", second_fails)
    core = ServeCore(tiny_engine(n_slots=2), snapshots=tmp_path, model_id="tiny")
    collector = gc.get_threshold()
    try:
        with pytest.raises(OSError, match="second front"):
            fronts.serve(core, fronts=2, listeners=fronts.listen("127.0.0.1", 0, 2))
    finally:  # (serve settled this process's heap for serving: the tests after this one run as before)
        gc.unfreeze()
        gc.set_threshold(*collector)
    assert started and started[0].poll() is not None  # (it was stopped: serve waits for it)
