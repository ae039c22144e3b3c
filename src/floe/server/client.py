"""The HTTP front's end of the socket to `floe serve`'s engine core (floe.server.protocol): calls and
chats, each answered by the frames the core sends back. Imports nothing heavy (no torch)."""

from __future__ import annotations

import asyncio
import base64
import codecs
import itertools
import logging
from collections.abc import AsyncIterator, Callable

from floe.server.protocol import HEADER, ProtocolError, ServeError, frame_length, pack, unpack, vocab_table

log = logging.getLogger("floe.serve")
UPLOAD_CHUNK = 1 << 20  # an import's bytes per frame
# An import's frames sent ahead of what the core has taken ("more" frames): without a window, an upload
# to a busy session (the import waits for it) piled in the core's memory (1.5 GB of body: +1.6 GB).
UPLOAD_WINDOW = 4


class CoreClient:
    """The front's end of the socket to the engine core. Its methods run on the event loop; one task
    reads the core's frames and hands each to the call or chat it answers."""

    GONE = ServeError(503, "the engine core is not running", "server_error", "engine_gone")

    def __init__(self, path: str, on_lost: Callable[[], None] = lambda: None) -> None:
        """on_lost: called when the core ends the connection (not after close())."""
        self.path, self.on_lost = path, on_lost
        self._ids = itertools.count(1)
        self._calls: dict[int, asyncio.Future] = {}
        self._credits: dict[int, asyncio.Semaphore] = {}  # imports under way: the frames they may send
        self._chats: dict[int, asyncio.Queue] = {}
        self._ended: dict[int, asyncio.Event] = {}  # set when a chat's last event is queued
        self._vocab: list[bytes] = []  # each token's reply bytes (the "vocab" call), for "ids" frames
        self._utf8: dict[int, codecs.IncrementalDecoder] = {}  # a chat streamed as ids: its decoder
        self._strips = False  # whether a chat's reply drops the space it starts with (the "vocab" call)
        self._starting: set[int] = set()  # the chats whose reply has made no text yet, where it drops one
        # A server of several models (floe.server.models): each model's (table, strips) by name, and the
        # chats streamed with one that is not the core's own ("vocab" without a model)
        self._tables: dict[str, tuple[list[bytes], bool]] = {}
        self._table_of: dict[int, list[bytes]] = {}
        self.streams = 0  # streamed replies being sent
        self.gone = False
        self._closing = False  # close() was called: the connection's end is not the core's loss
        self._frames: _Frames | None = None

    async def connect(self) -> None:
        _, self._frames = await asyncio.get_running_loop().create_unix_connection(
            lambda: _Frames(self._dispatch, self._lost), self.path)
        answer = await self.call("vocab")
        self._vocab, self._strips = vocab_table(answer), bool(answer.get("strips_leading_space"))

    async def close(self) -> None:
        self._closing = True
        if self._frames is not None:
            self._frames.transport.close()
            await self._frames.closed

    def _send(self, value) -> None:
        if self.gone:
            raise self.GONE
        self._frames.transport.write(pack(value))

    async def call(self, name: str, arg=None, owner: str | None = None):
        """A call's answer; `owner`: whose sessions a session call sees (protocol.OWNER)."""
        rid = next(self._ids)
        # Sent before its future is kept (its answer is read on this event loop, after the next await):
        # a message refused before it is sent (too large: a 413) leaves nothing behind.
        self._send({"op": "call", "id": rid, "name": name, "arg": arg, "owner": owner})
        self._calls[rid] = future = asyncio.get_running_loop().create_future()
        return await future

    async def table(self, model: str) -> None:
        """Have `model`'s token table (a server of several models: the "vocab" call of that model, once),
        for chats that name it as their "table"."""
        if model not in self._tables:
            answer = await self.call("vocab", model)
            self._tables[model] = vocab_table(answer), bool(answer.get("strips_leading_space"))

    def chat(self, request: dict) -> tuple[int, asyncio.Queue, asyncio.Event]:
        """Start a chat: its id, the queue of its events (("started", session id), then ("text",
        piece)s when streamed, then ("done", result) or ("error", payload) at any point) and an
        event set once its last one is queued. A request's "table": the model whose token table
        (table()) makes the text of its ids."""
        rid, queue, ended = self._open({"op": "chat", "request": request})
        strips = self._strips
        if (table := self._tables.get(request.get("table"))) is not None:
            self._table_of[rid], strips = table
        if strips and "prompt" not in request:  # (a text completion continues its prompt: it keeps it)
            self._starting.add(rid)
        return rid, queue, ended

    def _open(self, message: dict) -> tuple[int, asyncio.Queue, asyncio.Event]:
        rid = next(self._ids)
        self._send({**message, "id": rid})  # first, as a call's
        self._chats[rid], self._ended[rid] = queue, ended = asyncio.Queue(), asyncio.Event()
        return rid, queue, ended

    async def export(self, sid: str, owner: str | None) -> AsyncIterator[bytes]:
        """Session `sid`'s snapshot file, in chunks. Raises the core's ServeError before the first."""
        rid, queue, _ = self._open({"op": "export", "arg": sid, "owner": owner})
        kind, value = await queue.get()
        if kind == "error":
            raise ServeError.from_payload(value)

        async def chunks() -> AsyncIterator[bytes]:
            try:
                while (event := await queue.get())[0] == "data":
                    yield base64.b64decode(event[1])
                    self._send({"op": "more", "id": rid})  # taken: the core may send one more
                if event[0] == "error":  # after the first byte: the body is cut short (an import refuses it)
                    raise ServeError.from_payload(event[1])
            finally:
                self.cancel(rid)

        return chunks()

    async def upload(self, sid: str, owner: str | None, body: AsyncIterator[bytes]) -> dict:
        """Send a snapshot file (a request body, streamed) to be imported as session `sid`; the core's
        answer once it checked and stored it."""
        rid = next(self._ids)
        self._send({"op": "import", "id": rid, "arg": sid, "owner": owner})  # first, as a call's
        self._calls[rid] = future = asyncio.get_running_loop().create_future()
        self._credits[rid] = credit = asyncio.Semaphore(UPLOAD_WINDOW)
        try:
            async for chunk in body:
                for i in range(0, len(chunk), UPLOAD_CHUNK):
                    if not await _granted(credit, future):  # refused before its end
                        break
                    self._send({"op": "data", "id": rid,
                                "data": base64.b64encode(chunk[i:i + UPLOAD_CHUNK]).decode()})
                if future.done():
                    break
                await self._frames.drain()
        except BaseException:
            if not self.gone:
                self._send({"op": "cancel", "id": rid})
            self._calls.pop(rid, None)
            if future.done() and not future.cancelled():
                future.exception()  # (refused while its client left: nobody reads why, nor logs it unread)
            raise
        finally:
            self._credits.pop(rid, None)
        if not future.done():
            self._send({"op": "end", "id": rid})
        return await future

    def cancel(self, rid: int) -> None:
        """The chat's client left: its row stops at its next token (nothing if it has ended)."""
        self._ended.pop(rid, None)
        self._utf8.pop(rid, None)
        self._starting.discard(rid)
        self._table_of.pop(rid, None)
        if self._chats.pop(rid, None) is not None and not self.gone:
            self._send({"op": "cancel", "id": rid})

    def _lost(self) -> None:
        """The connection ended (the core's end, a broken frame, or close()): every call and chat fails."""
        self.gone = True
        for future in self._calls.values():
            if not future.done():
                future.set_exception(self.GONE)
        for queue in self._chats.values():
            queue.put_nowait(("error", self.GONE.payload()))
        for ended in self._ended.values():
            ended.set()
        self._calls.clear()
        self._chats.clear()
        self._starting.clear()
        self._table_of.clear()
        self._ended.clear()
        if not self._closing:
            self.on_lost()

    def _dispatch(self, message: list) -> None:
        kind = message[0]
        if kind == "more":  # an import's frame taken: one more may go
            if (credit := self._credits.get(message[1])) is not None:
                credit.release()
            return
        if kind == "text":
            for rid, piece in message[1]:
                queue = self._chats.get(rid)
                if queue is not None:
                    queue.put_nowait(("text", piece))
            return
        if kind == "ids":  # made into text here (floe.server.protocol): the core made none per token
            for rid, items in message[1]:
                queue = self._chats.get(rid)
                if queue is None:
                    continue
                vocab = self._table_of.get(rid, self._vocab)
                size = len(vocab)
                utf8 = self._utf8.get(rid)
                if utf8 is None:
                    utf8 = self._utf8[rid] = codecs.getincrementaldecoder("utf-8")("replace")
                text = utf8.decode(b"".join(
                    (vocab[i] if 0 <= i < size else b"") if type(i) is int else i.encode("latin-1")
                    for i in items))
                if text and rid in self._starting:  # (as the core's reply text: Actor.send)
                    self._starting.discard(rid)
                    text = text[1:] if text[0] == " " else text
                if text:
                    queue.put_nowait(("text", text))
            return
        rid, value = message[1], message[2]
        utf8 = self._utf8.pop(rid, None) if kind in ("done", "error") else None
        if kind in ("done", "error"):
            self._starting.discard(rid)
            self._table_of.pop(rid, None)
        if utf8 is not None and (tail := utf8.decode(b"", final=True)) and rid in self._chats:
            self._chats[rid].put_nowait(("text", tail))  # (a character the stream's end left unfinished)
        future = self._calls.pop(rid, None)
        if future is not None:
            if not future.done():
                if kind == "ok":
                    future.set_result(value)
                else:
                    future.set_exception(ServeError.from_payload(value))
            return
        queue = self._chats.get(rid)
        if queue is not None:
            queue.put_nowait((kind, value))
            if kind in ("done", "error"):
                del self._chats[rid]
                self._ended.pop(rid).set()


class _Frames(asyncio.Protocol):
    """The socket's reading side: each whole frame's message handed to `dispatch` as its bytes arrive
    (a frame a flush, per token: no stream reader and no task woken between the socket and the chats'
    queues); `lost()` once the connection ends. Its writing side is the transport, `drain` its flow."""

    def __init__(self, dispatch: Callable[[list], None], lost: Callable[[], None]) -> None:
        self.dispatch, self.lost = dispatch, lost
        self.buffer = bytearray()  # a frame's bytes so far
        self.need = HEADER.size  # the bytes the buffer needs before a frame can be read from it
        self.closed = asyncio.get_running_loop().create_future()  # set once the connection has ended
        self._paused = False
        self._resumed: asyncio.Future | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self.buffer:
            self.buffer += data
            if len(self.buffer) < self.need:
                return
            data = bytes(self.buffer)
            self.buffer.clear()
        at, end = 0, len(data)
        try:
            while end - at >= HEADER.size:
                n = frame_length(data[at:at + HEADER.size])
                if end - at - HEADER.size < n:
                    self.need = HEADER.size + n
                    break
                at += HEADER.size + n
                self.dispatch(unpack(data[at - n:at]))
            else:
                self.need = HEADER.size
        except ProtocolError as e:
            log.error("the engine core's connection broke: %s", e)
            self.transport.close()
            return
        if at < end:
            self.buffer += data[at:]

    def connection_lost(self, exc: Exception | None) -> None:
        if exc is not None:
            log.error("the engine core's connection broke: %s", exc)
        self.buffer.clear()
        self._paused = False
        if self._resumed is not None and not self._resumed.done():
            self._resumed.set_result(None)
        self.closed.set_result(None)
        self.lost()

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        if self._resumed is not None and not self._resumed.done():
            self._resumed.set_result(None)

    async def drain(self) -> None:
        """Wait while the transport's write buffer is full (an upload's frames). Every upload waiting
        shares one future (a waiter that made its own replaced the others', which then waited for ever),
        shielded: a waiter cancelled (its client left) does not cancel the others' wait."""
        if self._paused:
            if self._resumed is None or self._resumed.done():
                self._resumed = asyncio.get_running_loop().create_future()
            await asyncio.shield(self._resumed)


async def _granted(credit: asyncio.Semaphore, answered: asyncio.Future) -> bool:
    """Take one of an import's credits, waiting for the core to grant one; False if the core answered
    (refused it) first."""
    if answered.done():
        return False
    if not credit.locked():
        await credit.acquire()
        return True
    take = asyncio.ensure_future(credit.acquire())
    await asyncio.wait({take, answered}, return_when=asyncio.FIRST_COMPLETED)
    if take.done():
        return True
    take.cancel()
    return False

