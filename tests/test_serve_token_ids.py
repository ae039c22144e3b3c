"""floe serve streams replies as token ids (floe.actor.stream; floe.server.protocol's "ids" frames):
the engine core makes no text per token, the HTTP front makes it from the core's vocabulary table. The
text a client gets is the text the core's reply holds; stop strings and structured replies stay text."""

from __future__ import annotations

import asyncio
import codecs
import socket
import tempfile
import threading
from pathlib import Path

import pytest

from floe.engine import Engine
from floe.server.client import CoreClient
from floe.server.protocol import HEADER, frame_length, pack, unpack, vocab_table

MODEL_ID = "SmolLM2-135M-Instruct.Q4_1"


@pytest.fixture(scope="module")
def core_server(default_checkpoint):
    from floe.server.core import ServeCore
    from floe.server.core_socket import CoreServer

    folder = Path(tempfile.mkdtemp(prefix="floe-test-"))  # short: a Unix socket's path has ~100 bytes
    core = ServeCore(Engine(default_checkpoint, max_seq_len=256, n_slots=2), snapshots=folder / "s",
                     model_id=MODEL_ID)
    server = CoreServer(core, folder / "core.sock")
    yield server
    server.close()
    core.close()


class Wire:
    """A raw connection to the engine core, as a front's."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.connect(path)
        self.sock.settimeout(120)

    def send(self, value) -> None:
        self.sock.sendall(pack(value))

    def read(self):
        def exactly(n: int) -> bytes:
            data = b""
            while len(data) < n:
                chunk = self.sock.recv(n - len(data))
                assert chunk, "the core hung up"
                data += chunk
            return data

        return unpack(exactly(frame_length(exactly(HEADER.size))))

    def chat(self, rid: int, **request) -> list:
        """Chat `rid`'s frames, to its "done" (and the ids/text frames' parts that are its own)."""
        self.send({"op": "chat", "id": rid, "request": {"messages": [{"role": "user", "content": "Hi!"}],
                                                        "temperature": 0, "max_tokens": 24, "owner": "",
                                                        **request}})
        out = []
        while True:
            frame = self.read()
            if frame[0] in ("ids", "text"):
                out += [(frame[0], part) for r, part in frame[1] if r == rid]
            elif frame[1] == rid:
                out.append((frame[0], frame[2]))
                if frame[0] in ("done", "error"):
                    return out


def test_a_fronts_start_up_answers_are_encoded_once_and_each_is_the_cores_own(core_server, monkeypatch):
    """The "vocab" and "tokenizer" answers (each front asks for both at its start) are the core's own,
    JSON-encoded once however many fronts ask (ServeCore.fixed_calls); its other calls are not kept."""
    core = core_server.core
    asked = []
    call = core.call
    monkeypatch.setattr(core, "call",
                        lambda name, arg=None, owner=None: asked.append(name) or call(name, arg, owner))
    fronts = [Wire(core_server.path) for _ in range(3)]
    for rid, wire in enumerate(fronts):
        for name in ("vocab", "tokenizer", "hello"):
            wire.send({"op": "call", "id": rid, "name": name})
            kind, got, answer = wire.read()
            assert (kind, got) == ("ok", rid)
            assert answer == call(name), name
    assert asked.count("hello") == 3
    assert asked.count("vocab") <= 1 and asked.count("tokenizer") <= 1  # (encoded at the server's start)
    assert vocab_table(answer_of(fronts[0], "vocab")) == [core.engine.tokenizer.reply_bytes(i)
                                                          for i in range(core.engine.tokenizer.vocab_size)]


def answer_of(wire: Wire, name: str):
    wire.send({"op": "call", "id": 99, "name": name})
    return wire.read()[2]


def test_a_streamed_reply_goes_as_token_ids_whose_text_is_the_replys(core_server):
    wire = Wire(core_server.path)
    wire.send({"op": "call", "id": 1, "name": "vocab"})
    kind, _, answer = wire.read()
    vocab = vocab_table(answer)
    tokenizer = core_server.core.engine.tokenizer
    assert kind == "ok" and len(vocab) == tokenizer.vocab_size
    assert all(vocab[i] == tokenizer.reply_bytes(i) for i in range(0, tokenizer.vocab_size, 97))
    frames = wire.chat(2, stream=True)
    kinds = [k for k, _ in frames]
    assert kinds[0] == "started" and kinds[-1] == "done" and "text" not in kinds, frames
    ids = [i for k, part in frames if k == "ids" for i in part]
    assert ids and all(type(i) is int for i in ids)
    utf8 = codecs.getincrementaldecoder("utf-8")("replace")
    text = "".join(utf8.decode(b"".join(vocab[i] for i in part)) for k, part in frames if k == "ids")
    done = frames[-1][1]
    assert text + utf8.decode(b"", final=True) == done["text"]
    assert done["usage"]["completion_tokens"] == len(ids)
    # Not streamed: no ids go out, the answer holds the same text (greedy).
    frames = wire.chat(3)
    assert [k for k, _ in frames] == ["started", "done"] and frames[-1][1]["text"] == done["text"]
    # A stop string is cut in the core, from text: text frames, and the reply stops before it.
    cut = done["text"][len(done["text"]) // 2:][:3]
    frames = wire.chat(4, stream=True, stop=[cut])
    assert "ids" not in [k for k, _ in frames]
    assert frames[-1][1]["text"] == done["text"][:done["text"].index(cut)]
    wire.sock.close()


def test_the_front_makes_the_text_of_ids_across_frames():
    """A character split across tokens and frames, a special token (no bytes), an id past the table,
    bytes a guest emitted (latin-1 text on the wire), and a character left unfinished at the end."""
    async def run() -> list:
        client = CoreClient("/nowhere")
        client._vocab = [b"", b"\xc3", b"\xa9", b"a", b"\xf0\x9f"]
        queue = asyncio.Queue()
        client._chats[7], client._ended[7] = queue, asyncio.Event()
        client._dispatch(["ids", [[7, [3, 1]], [8, [3]]]])  # (chat 8 is not this front's: dropped)
        client._dispatch(["ids", [[7, [2, 0, 99, "\xc3\xa9!"]]]])
        client._dispatch(["ids", [[7, [4]]]])
        client._dispatch(["done", 7, {"text": "aé\u00e9!", "finish_reason": "stop"}])
        out = []
        while not queue.empty():
            out.append(queue.get_nowait())
        return out

    events = asyncio.run(run())
    assert events == [("text", "a"), ("text", "éé!"), ("text", "\ufffd"),
                      ("done", {"text": "aé\u00e9!", "finish_reason": "stop"})]


LOUD = """
(module
  (import "floe" "prefill" (func $prefill (param i32 i32 i32) (result i32)))
  (import "floe" "emit" (func $emit (param i32 i32) (result i32)))
  (import "floe" "stream_tokens" (func $stream_tokens (param i32) (result i32)))
  (memory (export "memory") 40)
  (global $n (mut i32) (i32.const 0))
  (global $big (mut i32) (i32.const 0))
  (func (export "floe_abi_version") (result i32) (i32.const 2))
  (func (export "alloc") (param i32) (result i32) (i32.const 8192))
  (func (export "on_message") (param i32 i32) (result i32)
    (global.set $n (i32.const 0))
    (global.set $big (i32.eq (i32.load8_u (local.get 0)) (i32.const 98)))
    (if (call $stream_tokens (i32.const 1)) (then (return (i32.const 12))))
    (i32.store (i32.const 4096) (i32.const 17))
    (call $prefill (i32.const 4096) (i32.const 1) (i32.const 0)))
  (func (export "on_token") (result i32)
    (global.set $n (i32.add (global.get $n) (i32.const 1)))
    (if (i32.and (global.get $big) (i32.eq (global.get $n) (i32.const 2)))
      (then (memory.fill (i32.const 65536) (i32.const 97) (i32.const 2000000))
            (drop (call $emit (i32.const 65536) (i32.const 2000000)))))
    (if (i32.gt_u (global.get $n) (i32.const 6)) (then (return (i32.const -1))))
    (i32.const 5)))
"""


def test_a_guests_output_past_a_frame_ends_its_own_reply_not_the_connections(default_checkpoint, tmp_path,
                                                                             monkeypatch):
    """A guest that emits 2 MB between two flushes (frames here capped at 1 MiB): its reply ends with a
    500 output_too_large, streamed as ids or as text (a stop string); another reply streaming beside it
    on the same connection ends well, and the connection takes the next chat."""
    import wasmtime

    from floe.server import protocol
    from floe.server.core import ServeCore
    from floe.server.core_socket import CoreServer

    guest = tmp_path / "loud.wasm"
    guest.write_bytes(wasmtime.wat2wasm(LOUD))
    folder = Path(tempfile.mkdtemp(prefix="floe-test-"))
    core = ServeCore(Engine(default_checkpoint, max_seq_len=64, n_slots=3), snapshots=folder / "s",
                     model_id=MODEL_ID, guest=str(guest))
    server = CoreServer(core, folder / "core.sock")
    monkeypatch.setattr(protocol, "MAX_FRAME", 1 << 20)
    try:
        wire = Wire(server.path)

        def chat(rid: int, text: str, **extra) -> None:
            wire.send({"op": "chat", "id": rid, "request": {"messages": [{"role": "user", "content": text}],
                                                            "max_tokens": 8, "owner": "", "stream": True,
                                                            **extra}})

        chat(1, "big one")
        chat(2, "small one")
        chat(3, "big, cut as text", stop=["zzz"])
        ends = {}
        while len(ends) < 3:
            frame = wire.read()
            if frame[0] in ("done", "error"):
                ends[frame[1]] = frame
        for rid in (1, 3):
            assert ends[rid][0] == "error" and ends[rid][2]["code"] == "output_too_large", ends[rid]
        assert ends[2][0] == "done" and ends[2][2]["finish_reason"] in ("stop", "length")
        chat(4, "small again")
        while (frame := wire.read())[0] not in ("done", "error"):
            pass
        assert frame[:2] == ["done", 4]
        wire.sock.close()
    finally:
        server.close()
        core.close()


def test_while_the_loop_steps_its_thread_sends_each_steps_ids_not_the_flusher(core_server, monkeypatch):
    """The engine loop's thread sends what each step streamed (CoreServer._after_step, a step watcher)
    while the flusher thread stays out of it (its polls took the GIL from the loop); the reply's ids
    still arrive whole and in order."""
    import threading

    from floe.actor.loop import in_engine_loop
    from floe.server import core_socket

    senders = []
    parts = core_socket._Connection._write_parts

    def noted(self, kind, sent, write=None):  # (who sends each frame of ids)
        if kind == "ids":
            senders.append("loop" if in_engine_loop() else threading.current_thread().name)
        parts(self, kind, sent, write)

    monkeypatch.setattr(core_socket._Connection, "_write_parts", noted)
    wire = Wire(core_server.path)
    frames = wire.chat(11, stream=True, max_tokens=24)
    ids = [i for k, part in frames if k == "ids" for i in part]
    done = frames[-1][1]
    assert frames[-1][0] == "done" and done["usage"]["completion_tokens"] == len(ids)
    # Each step's ids from the loop's thread; the flusher's only before the steps' pace is known (the
    # first after an idle loop), or past a step twice as long as the one before (a busy machine).
    assert senders.count("loop") >= max(2, len(senders) // 2), senders
    wire.sock.close()


def test_a_front_that_stops_reading_never_holds_the_loops_thread_and_loses_nothing():
    """The loop's sends never wait: into a socket its reader has stopped draining, a frame goes out as
    far as the socket takes it and the rest waits (pending) for the next writer, who sends it first;
    every frame arrives whole and in order once the reader reads again."""
    import threading
    import time

    from floe.actor.stream import TokenStream
    from floe.server.core_socket import _Connection

    ours, theirs = socket.socketpair()
    conn = _Connection(ours)
    stream = TokenStream()
    conn.watch(5, stream, sent=True)
    sent_ids = []
    longest = 0.0
    for token in range(20000):  # (far past what the socket holds unread)
        stream.append(token % 1000)
        sent_ids.append(token % 1000)
        t = time.perf_counter()
        conn.try_flush()
        longest = max(longest, time.perf_counter() - t)
    assert conn.pending, "the socket took everything: the test did not fill it"
    assert longest < 0.5  # (never waited for the reader)
    got = []

    def drain() -> None:
        wire = Wire.__new__(Wire)
        wire.sock = theirs
        while len(got) < len(sent_ids):
            frame = wire.read()
            assert frame[0] == "ids"
            got.extend(i for r, part in frame[1] if r == 5 for i in part)

    reader = threading.Thread(target=drain)
    reader.start()
    conn.flush()  # (a writer that may wait: the rest first, then what is new)
    reader.join(60)
    assert not reader.is_alive() and got == sent_ids and not conn.pending
    ours.close()
    theirs.close()


def test_the_loops_send_takes_what_the_socket_takes_now_and_says_when_the_front_is_gone():
    """protocol.send_now (the engine loop's sends, the GIL held): the bytes the socket took, 0 once it
    takes nothing, and an OSError once its reader has closed (the connection is then lost)."""
    from floe.server.core_socket import _Connection
    from floe.server.protocol import send_now

    ours, theirs = socket.socketpair()
    assert send_now(ours, b"hello") == 5 and theirs.recv(5) == b"hello"
    taken = [send_now(ours, b"x" * 65536) for _ in range(64)]
    assert taken[0] > 0 and taken[-1] == 0  # (full: nothing taken, no wait)
    theirs.close()
    with pytest.raises(OSError):
        send_now(ours, b"y")
    conn = _Connection(ours)
    conn._write_without_waiting(b"z")
    assert conn.closed  # (lost: its chats stop at their next token)
    ours.close()


def test_a_chats_started_frame_goes_with_the_next_flush_before_its_output_and_its_end():
    """_Connection.started takes no send lock (a burst's chats waited for it behind each other): the
    frame goes with the next flush — the loop's try_flush or a send — ahead of its chat's ids and
    text, and a chat's end or error sent at once still follows it; watch() while a flush reads the
    watched chats loses nothing."""
    import threading

    from floe.actor.stream import TokenStream
    from floe.server.core_socket import _Connection

    ours, theirs = socket.socketpair()
    wire = Wire.__new__(Wire)
    wire.sock = theirs
    conn = _Connection(ours)
    conn.send_lock.acquire()  # (another thread sending: started() must not wait for it)
    try:
        conn.started(1, "s-1")
        assert conn.streaming  # (the flusher looks while one waits to go)
        assert conn.try_flush()  # (the lock busy: nothing sent, nothing half sent)
    finally:
        conn.send_lock.release()
    stream = TokenStream()
    conn.watch(1, stream, sent=True)
    stream.append(7)
    conn.text(2, "x")
    conn.started(2, None)
    assert conn.try_flush()
    assert wire.read() == ["started", 1, "s-1"] and wire.read() == ["started", 2, None]
    assert wire.read() == ["text", [[2, "x"]]] and wire.read() == ["ids", [[1, [7]]]]
    conn.started(3, "s-3")
    conn.send(["error", 3, {"message": "no"}])  # (a chat that failed before any output)
    assert wire.read() == ["started", 3, "s-3"] and wire.read()[:2] == ["error", 3]
    streams = [TokenStream() for _ in range(300)]
    for s in streams:
        s.append(1)
    adding = threading.Thread(target=lambda: [conn.watch(100 + k, s, sent=True)
                                              for k, s in enumerate(streams)])
    adding.start()
    while adding.is_alive():
        conn.flush()  # (iterates the watched chats while others are added: no "changed size" error)
    adding.join()
    conn.flush()
    seen = set()
    theirs.settimeout(2)
    while len(seen) < len(streams):
        frame = wire.read()
        seen.update(rid for rid, _ in frame[1] if rid >= 100)
    ours.close()
    theirs.close()


def test_a_chat_watched_while_a_flush_sends_has_its_ids_after_its_started_frame():
    """watch() takes no lock, so a chat may start and be watched while another thread's flush is sending
    (its socket writes let the GIL go): that flush must not send the new chat's ids, whose "started"
    frame it did not take; they go with the next flush, after it."""
    from floe.actor.stream import TokenStream
    from floe.server.core_socket import _Connection

    ours, theirs = socket.socketpair()
    wire = Wire.__new__(Wire)
    wire.sock = theirs
    conn = _Connection(ours)
    conn.text(1, "a")  # (the flush in flight sends this first)
    late = TokenStream()
    parts = conn._write_parts

    def arriving_meanwhile(kind, sent, write=None):
        if kind == "text":  # (while the text goes out: a chat starts, is watched and streams an id)
            conn.started(2, "s-2")
            conn.watch(2, late, sent=True)
            late.append(9)
        parts(kind, sent, write)

    conn._write_parts = arriving_meanwhile
    conn.flush()
    conn._write_parts = parts
    conn.flush()
    frames = [wire.read() for _ in range(3)]
    assert frames == [["text", [[1, "a"]]], ["started", 2, "s-2"], ["ids", [[2, [9]]]]], frames
    ours.close()
    theirs.close()


def test_the_cores_chat_threads_are_all_started_before_its_first_request(core_server):
    """A chat's thread is waiting when its request comes: the core's reading thread, which reads every
    request of its front, starts none (ThreadPoolExecutor's start at a submit waits for the new thread
    to run: a first burst's later requests were read that much later)."""
    server = core_server
    workers = server.pool._max_workers
    assert workers >= server.core.engine.cache.n_slots
    assert sum(t.is_alive() for t in server.pool._threads) == workers


def test_a_started_pool_has_its_threads_before_any_submit_and_runs_work_on_them():
    from floe.server.pools import started_pool

    pool = started_pool(6, "floe-test")
    try:
        before = set(pool._threads)
        assert len(before) == 6 and all(t.is_alive() for t in before)
        names = set(pool.map(lambda _: threading.current_thread().name, range(24)))
        assert set(pool._threads) == before  # (none made later)
        assert names <= {t.name for t in before}
    finally:
        pool.shutdown()
