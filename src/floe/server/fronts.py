"""`floe serve`'s processes: the engine core in this one (floe.server.core_socket's CoreServer on a private
Unix socket) and its HTTP fronts (floe.server.app), each a child process on its own listening socket
(docs/SERVER.md, "Concurrency"); `serve` starts and stops them together."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from floe.server import protocol
from floe.server.core_socket import CoreServer
from floe.server.heap import gc_thresholds, settle_heap

if TYPE_CHECKING:
    from floe.server.core import ServeCore
    from floe.server.models import ModelRouter

log = logging.getLogger("floe.serve")
FRONT_STOP_S = 5.0  # at a stop, a front still running this long past its grace (s) is killed


def serve(core: ServeCore | ModelRouter, *, host: str = "127.0.0.1", port: int = 8000,
          log_level: str = "warning",
          keys: tuple[str, ...] = (), cors_origins: tuple[str, ...] = (),
          max_request_bytes: int = protocol.MAX_REQUEST_BYTES, fronts: int = 1,
          listeners: list[socket.socket] | None = None, operator_keys: tuple[str, ...] = (),
          prompt_hints: bool = True, on_ready: Callable[[CoreServer], None] = lambda server: None) -> int:
    """`floe serve` with its engine core in this process: `fronts` HTTP front processes
    (floe.server.app) listen on host:port (each on its own socket where the kernel spreads new
    connections over them: listen) and each talks to the core's socket in a private temporary folder.
    Returns when a front exits or this process is told to stop (SIGINT, SIGTERM); every live session
    is frozen before it returns. The exit status: 0 after a stop, else the first front's to exit (a
    front that lost its core: 3). keys: its API keys (handed to the fronts in their environment, never
    their command line); cors_origins: web origins that may call it; max_request_bytes: a front's
    largest request body (floe.server.limits); listeners: the sockets to serve on (listen()'s, one a
    front or one they all share), else host:port is bound here; operator_keys: the keys that see
    /metrics (in the fronts' environment); prompt_hints: the fronts render and tokenize plain chats'
    conversations for the core (floe.server.hints).
    Raises FloeError if host:port cannot be listened on."""
    import signal

    gc_thresholds()  # (a bad FLOE_GC_THRESHOLD is refused before anything starts)
    if listeners is None:
        listeners = listen(host, port, fronts)  # before anything starts: a port in use is an error at once
    if len(listeners) not in (1, fronts):
        raise ValueError(f"{len(listeners)} listening sockets for {fronts} fronts")
    settle_heap()
    core.keep_spares()  # after the freeze: spare actors are made and dropped while the server runs
    server = CoreServer(core)
    server.encode_fixed()

    def stop(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, stop)
    args = ["--socket", server.path, "--log-level", log_level,
            "--max-request-bytes", str(max_request_bytes), *([] if prompt_hints else ["--no-prompt-hints"]),
            *(arg for origin in cors_origins for arg in ("--cors-origin", origin))]
    procs, code = [], 0
    try:
        with front_environment(keys, fronts, operator_keys) as env:
            try:
                for k in range(fronts):  # (one by one: those started are stopped if a later one fails)
                    procs.append(_start_front(args, listeners[k % len(listeners)], env))
                for listener in listeners:
                    listener.close()  # the fronts hold them
                on_ready(server)
                code = _first_exit(procs)
                if code:  # not a stop: a supervisor (docs/SERVER.md, "Running it as a service") restarts it
                    log.error("an HTTP front exited with status %s", code)
            except KeyboardInterrupt:
                pass
            finally:
                _stop_fronts(procs)  # (before their metrics folder goes)
    finally:
        for listener in listeners:
            listener.close()
        signal.signal(signal.SIGTERM, previous)
        server.close()
        core.close()
    return code


def listen(host: str, port: int, count: int = 1) -> list[socket.socket]:
    """The fronts' listening TCP sockets on host:port (as uvicorn binds one: SO_REUSEADDR, backlog
    2048), inheritable by them: `count` sockets bound with SO_REUSEPORT where the kernel spreads new
    connections over such a group (Linux), one for each front; else one they all share. (On one
    shared socket the front whose event loop woke first accepted a whole burst: 64 of 64 connections
    went to one of 4 fronts.) port 0: a free port, the same for every socket. Raises FloeError naming
    the address if it cannot be had, also where anything else listens there (SO_REUSEPORT would
    otherwise let a second server of this user share the port)."""
    from floe.errors import FloeError

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    spread = count > 1 and sys.platform == "linux" and hasattr(socket, "SO_REUSEPORT")
    socks: list[socket.socket] = []
    try:
        if spread:  # the port to ourselves first: a plain bind fails where anything listens there
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind((host, port))
                port = probe.getsockname()[1]
        for _ in range(count if spread else 1):
            sock = socket.socket(family, socket.SOCK_STREAM)
            socks.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if spread:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind((host, port))
            port = sock.getsockname()[1]
            sock.listen(2048)
            sock.set_inheritable(True)
    except OSError as e:
        for sock in socks:
            sock.close()
        raise FloeError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return socks


@contextlib.contextmanager
def front_environment(keys: tuple[str, ...], fronts: int, operator_keys: tuple[str, ...] = ()):
    """The fronts' environment: their API keys and the operator's, and with several fronts a private
    folder where each counts its requests (prometheus_client's multiprocess mode: any front's /metrics
    sums them all)."""
    from floe.server.auth import KEYS_ENV, OPERATOR_KEYS_ENV

    env = os.environ | {KEYS_ENV: ",".join(keys), OPERATOR_KEYS_ENV: ",".join(operator_keys)}
    if fronts == 1:
        env.pop(protocol.METRICS_ENV, None)
        yield env
        return
    folder = tempfile.mkdtemp(prefix="floe-fronts-")  # 0700
    try:
        yield env | {protocol.METRICS_ENV: folder}
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _start_front(args: list[str], listener: socket.socket, env: dict):
    import subprocess

    return subprocess.Popen([sys.executable, "-m", "floe.server.app", *args, "--fd", str(listener.fileno())],
                            env=env, pass_fds=(listener.fileno(),))


def _first_exit(procs: list) -> int:
    """The status of the first of `procs` to exit (waits; a signal's KeyboardInterrupt ends the wait)."""
    while True:
        for p in procs:
            if (code := p.poll()) is not None:
                return code
        time.sleep(0.1)


def _stop_fronts(procs: list) -> None:
    """Stop the fronts (SIGTERM): each ends its connections within STOP_GRACE_S (floe.server.deadlines);
    one still running FRONT_STOP_S after (its shutdown stuck) is killed."""
    import subprocess

    from floe.server.deadlines import STOP_GRACE_S

    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + STOP_GRACE_S + FRONT_STOP_S
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
