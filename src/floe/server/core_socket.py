"""The engine core's Unix socket (floe.server.protocol): `CoreServer` serves a `ServeCore` (or a
`ModelRouter`) to the HTTP fronts (floe.server.fronts starts them: docs/SERVER.md, "Concurrency")."""

from __future__ import annotations

import base64
import logging
import math
import os
import queue
import shutil
import socket
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from floe.actor.stream import TokenStream
from floe.actor.watchers import watch_steps
from floe.server import protocol
from floe.server.pools import started_pool
from floe.server.protocol import HEADER, ProtocolError, ServeError, frame_length, pack, send_now, unpack

if TYPE_CHECKING:
    from floe.server.core import ServeCore
    from floe.server.models import ModelRouter

log = logging.getLogger("floe.serve")
# answered in the reading thread
RECV_BYTES = 256 << 10  # what the core's reading thread asks its socket for at a time (_Connection.read)
INLINE_CALLS = ("hello", "health", "sessions", "session", "metrics", "models")
LOOKS = 2  # threads for the inline calls a core may answer from a store (its `reads_stores`: a router's)
FLUSH_S = 0.002  # after a flush of streamed text, the next waits this long: its frame gathers more
# While an engine loop steps, its thread sends what each step streamed (CoreServer._after_step); the
# flusher thread sends only once no step has for twice the last gap between steps, and at least this long
# (or at once where a step left a frame half sent).
STEPPED_S = 0.02
STEP_GAP_S = 0.5  # a longer gap between two steps is the loop's idling, not its pace
UPLOAD_WAIT_S = 300.0  # an import whose next chunk takes longer than this is given up
MAX_IMPORTS = 4  # snapshot uploads at once (each holds a thread while its client sends); more: a 503,
# as is an API key's past half of them (a client trickling 4 uploads held them all, every key's, for hours)
# An export sends at most EXPORT_WINDOW chunks (1 MiB each) ahead of what its client has taken ("more"
# frames): without it, exports to clients that read nothing piled in the front's memory (10 of a 70 MB
# snapshot: +780 MB). EXPORTS send at once (each holds a thread of their own pool); more wait for one,
# but an API key's past half of them are a 503 (one key's 8 exports nobody read held every key's export
# waiting ~60 s, again and again).
EXPORT_WINDOW, EXPORTS = 4, 8
EXPORT_STALL_S = 60.0  # an export whose client takes nothing for this long is given up


class _Connection:
    """One front's connection: frames out under one lock, streamed text gathered in an outbox, and
    replies streamed as token ids (floe.actor.stream) watched until their end."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.send_lock = threading.Lock()  # frames go out whole and in order
        self.out_lock = threading.Lock()  # guards outbox (appended by the engine loop's thread)
        self.outbox: list[list] = []  # [id, text] pieces not yet sent
        self.starts: list[bytes] = []  # chats' "started" frames not yet sent (guarded by out_lock)
        # Chats streaming token ids: id -> [its TokenStream, the mark of what was sent (TokenStream.read),
        # whether they are sent at all (else it is watched for its client's leaving only)]. Read by the
        # flusher, under send_lock.
        self.watched: dict[int, list] = {}
        self.running: set[int] = set()  # chats taken and not yet ended (queued or running)
        self.cancelled: set[int] = set()  # of those, the ones whose client left
        self.uploads: dict[int, queue.Queue] = {}  # imports under way: their chunks (None: the end)
        self.overflowed: set[int] = set()  # chats whose streamed output could not be sent (_write_parts)
        self.exports: dict[int, threading.Semaphore] = {}  # exports under way: the chunks they may send
        self.closed = False
        self.pending = b""  # the rest of a frame the engine loop's thread sent without waiting (try_flush)
        self._inbuf, self._at = bytearray(), 0  # what was read and not yet taken: read()'s, from _at

    def text(self, rid: int, piece: str) -> None:
        with self.out_lock:
            self.outbox.append([rid, piece])

    def started(self, rid: int, sid: str | None) -> None:
        """Chat `rid` holds its session: its "started" frame goes with the next flush, before its text
        (not through send_lock here: a burst's chats each waited ~6 ms for it behind the others)."""
        frame = pack(["started", rid, sid])
        with self.out_lock:
            self.starts.append(frame)

    def watch(self, rid: int, stream: TokenStream, sent: bool) -> None:
        """Chat `rid` streams token ids into `stream`: its new ones go out at each flush (sent); it stops
        when its client leaves or this connection ends (no lock: a flush reads a copy of `watched`)."""
        self.watched[rid] = [stream, (0, 0), sent]
        if self.closed or rid in self.cancelled:
            stream.stop()

    def unwatch(self, rid: int) -> None:
        with self.send_lock:
            self.watched.pop(rid, None)

    def cancel(self, rid: int) -> None:
        """Chat `rid`'s client left: its row stops at its next token."""
        if rid in self.running:  # a cancel after the chat's end is nothing to keep
            self.cancelled.add(rid)
        watched = self.watched.get(rid)
        if watched is not None:
            watched[0].stop()

    def lost(self) -> None:
        """The front is gone: every chat streaming ids stops at its next token (the others see closed)."""
        self.closed = True
        for stream, _, _ in list(self.watched.values()):
            stream.stop()
        for credit in list(self.exports.values()):  # (an export waiting for its client sees closed)
            credit.release()
        for chunks in list(self.uploads.values()):  # (an import waiting for its next chunk: nothing is
            chunks.put(UploadStopped())  # stored; it waited UPLOAD_WAIT_S, and a stop of the core for it)

    @property
    def streaming(self) -> bool:
        """Whether a watched chat streams ids, or a frame is half sent (the flusher then looks every
        FLUSH_S)."""
        return bool(self.pending or self.starts) or any(sent for _, _, sent in list(self.watched.values()))

    def send(self, value) -> None:
        """Send a frame after every piece of text gathered before it (a chat's text precedes its end).
        An answer too large for a frame is its request's error instead: the connection carries others."""
        try:
            frame = pack(value)
        except ServeError as e:
            frame = pack(["error", value[1], ServeError(500, f"the answer is too large to send: {e}",
                                                        "server_error", "answer_too_large").payload()])
        with self.send_lock:
            self._flush_locked()
            self._write(frame)

    def send_frame(self, frame: bytes) -> None:
        """Send a frame made already (pack's), after the text gathered before it, as send()."""
        with self.send_lock:
            self._flush_locked()
            self._write(frame)

    def flush(self) -> None:
        with self.send_lock:
            self._flush_locked()

    def try_flush(self) -> bool:
        """flush() from the engine loop's thread, which must never wait: nothing if another thread is
        sending or a frame is left half sent; the frame goes out as far as the socket takes it at once,
        its rest kept for the next writer (pending). Whether all of it went."""
        if not (self.outbox or self.watched or self.starts) or not self.send_lock.acquire(blocking=False):
            return not self.pending
        try:
            if not self.pending:
                self._flush_locked(self._write_without_waiting)
            return not self.pending
        finally:
            self.send_lock.release()

    def _flush_locked(self, write=None) -> None:
        write = write or self._write
        if self.pending:
            self._write(b"")  # (what was left of a frame first)
        with self.out_lock:  # (the chats watched as of now: one watched later has its "started" after these)
            pieces, self.outbox = self.outbox, []
            starts, self.starts = self.starts, []
            chats = list(self.watched.items())  # (watch() adds without the send lock)
        if starts:  # (before any chat's text: each chat's own "started" came before its text)
            write(b"".join(starts))
        if pieces:
            self._write_parts("text", pieces, write)
        ids = []
        for rid, watched in chats:
            stream, mark, sent = watched
            if not sent:
                continue
            new, watched[1] = stream.read(mark)  # (appended only: what came since, whole)
            if new:
                if stream.emitted:  # a guest's emitted bytes among them: JSON carries them as latin-1 text
                    new = [i if type(i) is int else i.decode("latin-1") for i in new]
                ids.append([rid, new])
        if ids:
            self._write_parts("ids", ids, write)

    def _write_parts(self, kind: str, parts: list[list], write=None) -> None:
        """One frame of every chat's [id, output] part; past a frame's limit (a guest that emitted tens
        of MB between two flushes) a frame each, and a chat whose own part cannot go in a frame ends with
        an error (its output stops; the connection's other chats go on)."""
        write = write or self._write
        try:
            write(pack([kind, parts]))
            return
        except ServeError:
            pass
        for part in parts:
            try:
                write(pack([kind, [part]]))
            except ServeError:
                self.overflowed.add(part[0])
                log.warning("chat %s: its output between two flushes is past a frame's limit: it is ended",
                            part[0])
                self.cancelled.add(part[0])  # (its session keeps nothing of the turn, as a client's leaving)
                watched = self.watched.get(part[0])
                if watched is not None:
                    watched[0].stop()

    def _write(self, frame: bytes) -> None:
        if self.closed:
            return
        try:
            if self.pending:
                self.sock.sendall(self.pending)
                self.pending = b""
            self.sock.sendall(frame)
        except OSError:  # the front is gone: its chats stop at their next token
            self.lost()

    def _write_without_waiting(self, frame: bytes) -> None:
        """As far as the socket takes it now; the rest is pending (sent first by the next _write)."""
        if self.closed:
            return
        if self.pending:
            self.pending += frame
            return
        try:
            sent = send_now(self.sock, frame)
        except OSError:
            self.lost()
            return
        if sent < len(frame):
            self.pending = frame[sent:]

    def read(self):
        """The next frame's value, or None at the end of the connection. The socket is read RECV_BYTES
        at a time and every frame that came whole is taken from what was read: each recv gives up the
        GIL and waits to take it back behind the core's other threads (a burst's 64 chats and the engine
        loop), which one recv a header and one a body paid twice a frame."""
        buf = self._inbuf
        while True:
            if len(buf) - self._at >= HEADER.size:
                end = self._at + HEADER.size + frame_length(bytes(buf[self._at:self._at + HEADER.size]))
                if len(buf) >= end:
                    data = bytes(buf[self._at + HEADER.size:end])
                    self._at = end
                    return unpack(data)
                want = end - len(buf)
            else:
                want = 0
            if self._at:  # (what was taken goes before reading more)
                del buf[:self._at]
                self._at = 0
            chunk = self.sock.recv(min(max(RECV_BYTES, want), 16 * RECV_BYTES))  # (a large frame: in parts)
            if not chunk:
                if buf:
                    raise ProtocolError("the connection ended inside a frame")
                return None
            buf += chunk


class CoreServer:
    """Serves a ServeCore on a Unix socket at `path` (its folder should be private: 0700; default: a
    private temporary folder of its own, removed at close): a thread reads each connection's frames,
    chats and calls run in a pool of threads (a chat's thread waits while the engine loop steps it),
    and a flusher thread sends each connection's streamed text."""

    def __init__(self, core: ServeCore | ModelRouter, path: str | Path | None = None) -> None:
        self._folder = None if path is not None else tempfile.mkdtemp(prefix="floe-serve-")  # 0700
        self.core, self.path = core, str(path if path is not None else Path(self._folder) / "core.sock")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(self.path)
        os.chmod(self.path, 0o600)
        self.sock.listen()
        # (a running chat holds a thread, and so does an import while its client sends)
        self.pool = started_pool(core.pool_threads + MAX_IMPORTS, "floe-chat")
        self._importing: Counter = Counter()  # imports under way, by owner
        self._imports_lock = threading.Lock()
        self._exporting: Counter = Counter()  # exports under way or waiting, by API key (none: open)
        self.exporting = ThreadPoolExecutor(EXPORTS, "floe-export")  # (never a chat's thread)
        # Inline calls that may read a store (a router's looks at an unloaded model's sessions: a snapshot
        # header each, a round trip each on S3) go here, not in the reading thread, which every request
        # of that front waits behind, nor behind the pool's waiters
        self.looking = ThreadPoolExecutor(LOOKS, "floe-look")
        self._reads_stores = frozenset(core.reads_stores)
        self.connections: list[_Connection] = []
        # The answers of the core's calls that never change while it serves (ServeCore.fixed_calls: a
        # front's "vocab" and "tokenizer" at its start, each a whole vocabulary's table), JSON-encoded
        # once (encode_fixed, before the fronts start): encoded per front, 4 fronts' start-up answers
        # took half the chat threads' GIL samples of a burst that came meanwhile on the H200's host.
        self._fixed: dict[str, bytes] = {}
        self._fixed_lock = threading.Lock()
        self._wake = threading.Event()  # text is waiting in an outbox
        self._closed = False
        # The last engine loop step's end (_after_step), the gap before it, and whether it sent all
        self._step_at, self._step_gap, self._step_sent = -math.inf, 0.0, False
        self._unwatch_steps = watch_steps(self._after_step)
        for target, name in ((self._accept, "floe-accept"), (self._flush_loop, "floe-flush")):
            threading.Thread(target=target, name=name, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                sock, _ = self.sock.accept()
            except OSError:
                return  # closed
            conn = _Connection(sock)
            self.connections.append(conn)
            threading.Thread(target=self._serve, args=(conn,), name="floe-conn", daemon=True).start()

    def _serve(self, conn: _Connection) -> None:
        try:
            while (message := conn.read()) is not None:
                self._dispatch(conn, message)
        except (ProtocolError, OSError) as e:
            log.error("the HTTP front's connection broke: %s", e)
        finally:
            conn.lost()  # its running chats stop at their next token
            self.connections.remove(conn)
            conn.sock.close()

    def _dispatch(self, conn: _Connection, message) -> None:
        if not isinstance(message, dict) or type(message.get("id")) is not int:
            raise ProtocolError(f"not a request: {str(message)[:200]}")
        op, rid = message.get("op"), message["id"]
        if op == "chat" and isinstance(message.get("request"), dict):
            conn.running.add(rid)
            self.pool.submit(self._chat, conn, rid, message["request"])
        elif op == "cancel":
            conn.cancel(rid)
            if rid in conn.uploads:
                conn.uploads[rid].put(UploadStopped())
            if (credit := conn.exports.pop(rid, None)) is not None:  # its client left: it stops
                credit.release()
        elif op == "more":  # an export's client took a chunk: one more may go
            if (credit := conn.exports.get(rid)) is not None:
                credit.release()
        elif op == "call" and message.get("name") in self._reads_stores:
            self.looking.submit(self._call, conn, rid, message["name"], message.get("arg"),
                                message.get("owner"))
        elif op == "call" and message.get("name") in INLINE_CALLS:  # never behind the pool's waiters
            self._call(conn, rid, message["name"], message.get("arg"), message.get("owner"))
        elif op == "call":  # freeze, thaw, delete: may wait for a session's lock
            self.pool.submit(self._call, conn, rid, message.get("name"), message.get("arg"),
                             message.get("owner"))
        elif op == "export" and (refused := self._take_export(_text_or_none(message.get("owner")))):
            _answer_error(conn, rid, ServeError(503, f"{refused}; send this one once one has ended",
                                                "server_error", "server_busy"), "an export")
        elif op == "export":
            conn.exports[rid] = threading.Semaphore(EXPORT_WINDOW)
            self.exporting.submit(self._export, conn, rid, message.get("arg"), message.get("owner"))
        elif op == "import" and (refused := self._take_import(_text_or_none(message.get("owner")))):
            _answer_error(conn, rid, ServeError(503, f"{refused}; send this one once one has ended",
                                                "server_error", "server_busy"), "an import")
        elif op == "import":
            conn.uploads[rid] = chunks = queue.Queue()
            self.pool.submit(self._import, conn, rid, message.get("arg"), _text_or_none(message.get("owner")),
                             chunks)
        elif op in ("data", "end") and (op == "end" or isinstance(message.get("data"), str)):
            chunks = conn.uploads.get(rid)  # none: the import ended already (refused early)
            if chunks is not None:
                chunks.put(None if op == "end" else _decoded(message["data"]))
        else:
            raise ProtocolError(f"not a request: {str(message)[:200]}")

    def encode_fixed(self) -> None:
        """Encode the fixed calls' answers now (at the server's start, before any front asks)."""
        for name in self.core.fixed_calls:
            self._fixed_answer(name)

    def _fixed_answer(self, name: str) -> bytes:
        with self._fixed_lock:
            if name not in self._fixed:
                self._fixed[name] = protocol.encode(self.core.call(name))
            return self._fixed[name]

    def _call(self, conn: _Connection, rid: int, name, arg, owner) -> None:
        try:
            if name in self.core.fixed_calls:
                conn.send_frame(protocol.pack_ok(rid, self._fixed_answer(name)))
                return
            value = self.core.call(name, arg, owner)
            if name == "health" and "engine_loop" in value:  # the whole view (the operator's)
                value["fronts"] = len(self.connections)  # HTTP fronts connected (floe serve --fronts)
            conn.send(["ok", rid, value])
        except Exception as e:  # noqa: BLE001 - answered; the core goes on
            _answer_error(conn, rid, e, f"call {name!r}")

    def _export(self, conn: _Connection, rid: int, sid, owner) -> None:
        chunks = None
        try:
            chunks = self.core.export(sid, owner)  # checked whole before the first chunk
            conn.send(["started", rid, sid])
            for chunk in chunks:
                credit = conn.exports.get(rid)
                if credit is None or conn.closed:  # its client left
                    return
                if not credit.acquire(timeout=EXPORT_STALL_S):
                    raise ServeError(408, f"the export's client took nothing for {EXPORT_STALL_S:g} s",
                                     code="export_stalled")
                conn.send(["data", rid, base64.b64encode(chunk).decode()])
            conn.send(["done", rid, {}])
        except Exception as e:  # noqa: BLE001 - answered; the core goes on
            _answer_error(conn, rid, e, "an export")
        finally:
            conn.exports.pop(rid, None)
            if chunks is not None and hasattr(chunks, "close"):  # (a model's export holds it loaded)
                chunks.close()
            if owner := _text_or_none(owner):  # (counted by _take_export)
                with self._imports_lock:
                    self._exporting[owner] -= 1
                    if not self._exporting[owner]:
                        del self._exporting[owner]

    def _take_export(self, owner) -> str | None:
        """Count an export of API key `owner`'s, or say why it may not start: the key has half of
        EXPORTS under way or waiting (an open server's exports only wait for a thread)."""
        if not owner:
            return None
        with self._imports_lock:
            if self._exporting[owner] >= EXPORTS // 2:
                return (f"this API key has {EXPORTS // 2} snapshot exports under way (each key may have "
                        f"half of the server's {EXPORTS})")
            self._exporting[owner] += 1
            return None

    def _take_import(self, owner) -> str | None:
        """Count an import of `owner`'s as under way, or say why it may not start now: MAX_IMPORTS run
        already, or an API key's half of them (the one owner of a server without keys: all)."""
        with self._imports_lock:
            if sum(self._importing.values()) >= MAX_IMPORTS:
                return f"{MAX_IMPORTS} snapshot uploads are under way"
            if owner and self._importing[owner] >= MAX_IMPORTS // 2:
                return (f"this API key has {MAX_IMPORTS // 2} snapshot uploads under way (each key may have "
                        f"half of the server's {MAX_IMPORTS})")
            self._importing[owner] += 1
            return None

    def _import(self, conn: _Connection, rid: int, sid, owner, chunks: queue.Queue) -> None:
        def received():
            while (chunk := chunks.get(timeout=UPLOAD_WAIT_S)) is not None:
                if isinstance(chunk, BaseException):
                    raise chunk
                conn.send(["more", rid])  # taken: the front may send one more (client.UPLOAD_WINDOW)
                yield chunk

        try:
            conn.send(["ok", rid, self.core.import_(sid, owner, received())])
        except queue.Empty:
            _answer_error(conn, rid, ServeError(408, f"the snapshot's upload stalled for {UPLOAD_WAIT_S} s",
                                                code="upload_timeout"), "an import")
        except UploadStopped:  # its client left (nobody reads an answer): no failure to log
            _answer_error(conn, rid, ServeError(499, "the snapshot's upload stopped before its end",
                                                code="upload_stopped"), "an import")
        except Exception as e:  # noqa: BLE001 - answered; the core goes on
            _answer_error(conn, rid, e, "an import")
        finally:
            conn.uploads.pop(rid, None)
            with self._imports_lock:
                self._importing[owner] -= 1
                if not self._importing[owner]:  # (an owner with none under way is not kept)
                    del self._importing[owner]

    def _chat(self, conn: _Connection, rid: int, request: dict) -> None:
        try:
            if not (conn.closed or rid in conn.cancelled):  # else its client left while it was queued
                self._run_chat(conn, rid, request)
        except Exception as e:  # noqa: BLE001 - answered; the core goes on
            _answer_error(conn, rid, e, "a chat")
        finally:
            conn.running.discard(rid)
            conn.cancelled.discard(rid)
            conn.overflowed.discard(rid)

    def _run_chat(self, conn: _Connection, rid: int, request: dict) -> None:
        should_stop = lambda: conn.closed or rid in conn.cancelled  # noqa: E731
        chat = self.core.open(request, should_stop)  # its session is locked from here until run() returns
        # A structured chat starts at its first text: a schema the guest refuses is then a 400, not a
        # 200 stream with an error in it.
        started = [False]

        def start() -> None:
            if not started[0]:
                started[0] = True
                conn.started(rid, None if chat.session is None else chat.session.id)
                if not self._wake.is_set():  # (the flusher sends it if no step does first)
                    self._wake.set()

        if chat.constraint is None:
            start()
        # The reply as token ids (the front makes its text) where the front's table is its model's
        if chat.constraint is None and not chat.stops and self.core.streams_ids(chat):
            tokens = TokenStream()
            conn.watch(rid, tokens, sent=bool(request.get("stream")))
            self._wake.set()  # (the flusher looks every FLUSH_S while it streams)
            try:
                result = self.core.run(chat, None, should_stop, tokens)
                conn.send(self._end_of(conn, rid, result))  # (after the ids not yet sent)
            finally:
                conn.unwatch(rid)
            return
        on_text = None
        if request.get("stream"):
            def on_text(piece: str) -> None:
                start()
                conn.text(rid, piece)
                if not self._wake.is_set():
                    self._wake.set()
        result = self.core.run(chat, on_text, should_stop)
        start()
        conn.send(self._end_of(conn, rid, result))

    @staticmethod
    def _end_of(conn: _Connection, rid: int, result: dict) -> list:
        """A chat's last frame: done with its result, or the error of an output too large to stream."""
        if rid not in conn.overflowed:
            return ["done", rid, result]
        conn.overflowed.discard(rid)
        error = ServeError(500, "the guest's output between two flushes was larger than a frame "
                           f"({protocol.MAX_FRAME >> 20} MiB): the reply was ended", "server_error",
                           "output_too_large")
        return ["error", rid, error.payload()]

    def _after_step(self) -> None:
        """After each engine loop step (in the loop's thread, on a GPU while its forward computes):
        what the step streamed goes to each front now, in one frame a connection, instead of the
        flusher thread polling every FLUSH_S, whose work at 128 streams (~0.2 ms) took the GIL from
        the loop; a connection busy sending, or a frame the socket did not take whole, is the
        flusher's."""
        whole = True
        for conn in list(self.connections):
            try:
                whole = conn.try_flush() and whole
            except Exception:  # noqa: BLE001 - the flusher tries again; the loop goes on
                log.exception("sending a front's streamed output after a step failed")
                whole = False
        now = time.monotonic()
        if now - self._step_at < STEP_GAP_S:
            self._step_gap = now - self._step_at
        self._step_at, self._step_sent = now, whole
        if not whole:
            self._wake.set()

    def _flush_loop(self) -> None:
        while not self._closed:
            if not any(conn.streaming for conn in list(self.connections)):
                self._wake.wait()
            self._wake.clear()
            if self._step_sent and time.monotonic() - self._step_at < max(STEPPED_S, 2 * self._step_gap):
                time.sleep(FLUSH_S)
                continue
            for conn in list(self.connections):
                try:
                    conn.flush()
                except Exception:  # noqa: BLE001 - a bug here must not stop every stream for good
                    log.exception("flushing a front's streamed output failed")
            time.sleep(FLUSH_S)

    def close(self) -> None:
        """Stop serving: no new connections or requests; running chats stop at their next token."""
        self._closed = True
        self._unwatch_steps()
        self._wake.set()
        for conn in list(self.connections):
            conn.lost()
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread
        except OSError:
            pass
        self.sock.close()
        Path(self.path).unlink(missing_ok=True)
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
        self.pool.shutdown(wait=True, cancel_futures=True)  # chats not yet started never start
        self.exporting.shutdown(wait=True, cancel_futures=True)
        self.looking.shutdown(wait=True, cancel_futures=True)


class UploadStopped(Exception):
    """The client of an import left before its snapshot's end: nothing is stored."""


def _text_or_none(value) -> str | None:
    """An owner as the import counts it (what is not a string: None, which the core's import refuses)."""
    return value if isinstance(value, str) else None


def _decoded(data: str) -> bytes:
    try:
        return base64.b64decode(data, validate=True)
    except ValueError as e:
        raise ProtocolError(f"an import's data frame is not base64: {e}") from None


def _answer_error(conn: _Connection, rid: int, e: Exception, what: str) -> None:
    """A request's failure as its answer: a ServeError as it is, anything else (a bug) a logged 500."""
    if not isinstance(e, ServeError):
        log.exception("%s failed", what)
        e = ServeError(500, f"internal error: {type(e).__name__}: {e}", "server_error", "internal_error")
    conn.send(["error", rid, e.payload()])
