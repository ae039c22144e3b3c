"""An actor: one guest instance, its memory Region, its KV cache slot and its RNG."""

from __future__ import annotations

import functools
import queue
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np
import torch

from floe.actor import native_imports
from floe.actor.abi import IMPORT_MODULE, SUPPORTED_ABI_VERSIONS, HostABI
from floe.actor.host import NATIVE_CALLS, GuestHost, MessageStats, Request
from floe.actor.loop import EngineLoop, engine_loop, in_engine_loop
from floe.actor.reply_text import ReplyText, fill_later
from floe.actor.scheduler import DecodeScheduler
from floe.actor.stream import TokenStream
from floe.actor.turn import END_REASONS
from floe.engine import Engine, SamplingParams
from floe.engine.kvcache import PendingLoad
from floe.errors import FloeError
from floe.memory import OutOfBounds
from floe.profile import Ledger
from floe.wasm import (
    GuestError,
    GuestInstance,
    GuestLoadError,
    GuestModule,
    GuestPointerError,
    GuestReportedError,
    GuestResultError,
    HostFunction,
    default_runtime,
    start_guest_thread,
)
from floe.wasm.raw import HOLD_TO_A_TICK

DEFAULT_MEMORY_CAP = 256 << 20
DEFAULT_DEADLINE_S = 600.0


class ActorClosed(FloeError):
    """The actor was closed: it takes no more messages."""


class ActorReentrantCall(FloeError):
    """An actor was asked to do something from inside its own message (an on_text callback)."""


class NeedsKVSlot(GuestError):
    """A guest of an actor made without a KV slot called the model (its message got that far)."""


# The host calls an actor without a KV slot answers: none reads or writes the KV cache or the turn.
WITHOUT_SLOT = frozenset({"abi_version", "vocab_size", "context_length", "eos_ids", "tokenize", "detokenize",
                          "chat_render", "request", "system", "log"})


# The exports the host calls, by ABI version, with their number of i32 parameters (each returns one i32).
EXPORTS = {1: {"alloc": 1, "on_message": 2}, 2: {"alloc": 1, "on_message": 2, "on_token": 0}}
OPTIONAL_EXPORTS = {1: {"on_history": 3}, 2: {"on_history": 3, "on_end": 1}}


@functools.cache
def _guests_folder() -> Path:
    return Path(str(resources.files("floe.guests")))  # (a tenth of making an actor, asked each time)


def builtin_guest(name: str) -> Path:
    """Path of a guest shipped inside the package (`chat`, `constrained`, `probe`)."""
    path = _guests_folder() / f"{name}.wasm"
    if not path.is_file():
        raise GuestLoadError(f"no built-in guest named {name!r} (looked for {path})")
    return path


def complete_message(tokenizer, text: str) -> str:
    """The built-in `complete` guest's message that continues `text` as raw text, no chat template
    (guests/complete.c): the sequence's start (Tokenizer.sequence_start: the BOS token's text where one
    is added), a NUL, the text."""
    return f"{tokenizer.sequence_start}\0{text}"


@dataclass
class ActorState:
    """Everything that makes an actor between messages, as tensors and plain values: what
    capture_state() returns, restore() takes, and floe.snapshot writes and reads."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    tokens: list[int]
    memory_size: int
    memory_pages: np.ndarray
    memory_data: np.ndarray
    globals: list[tuple[str, str, int]]
    rng: torch.Tensor
    system_prompt: str
    model_fingerprint: str
    model_name: str
    guest_sha256: str
    guest_name: str
    engine_dtype: str
    abi_version: int
    engine_weights: str = "dense"  # "native": packed quantized projections (rounds differently)


@dataclass
class Reply:
    text: str
    stats: MessageStats
    ledger: Ledger
    logs: list[str]


class Actor(GuestHost):
    """A sandboxed guest and its KV slot: one message at a time, driven by the guest (ABI v1) or by
    its engine's loop, which steps every actor's turn in one batched forward (ABI v2). What the host
    calls and the engine loop use of it is its GuestHost part (floe.actor.host)."""

    def __init__(self, engine: Engine, guest: str | Path | bytes | GuestModule | None = None, *,
                 seed: int = 0, system_prompt: str = "", memory_cap: int = DEFAULT_MEMORY_CAP,
                 deadline_s: float = DEFAULT_DEADLINE_S, scheduler: DecodeScheduler | None = None,
                 loop: EngineLoop | None = None, kv_slot: bool | str = True,
                 continues_text: bool = False) -> None:
        if scheduler is not None and scheduler.engine is not engine:
            raise FloeError("the decode scheduler drives another engine than this actor's")
        if loop is not None and loop.engine is not engine:
            raise FloeError("the engine loop drives another engine than this actor's")
        if guest is None:
            guest = builtin_guest("chat")
        module = guest if isinstance(guest, GuestModule) else default_runtime().compile(guest)
        super().__init__(engine, module, deadline_s, system_prompt, seed)
        # A reply starts as the tokenizer's decode of its tokens would (no SentencePiece space at its
        # start); a text that continues another (continues_text: a completion's) keeps its first space.
        self.continues_text = continues_text
        # With a scheduler, this actor's decode steps are batched with other actors' (its engine's).
        self.scheduler = scheduler
        self._loop = loop
        self._lock = threading.RLock()  # a message, a capture, a restore: one at a time
        self._released = False
        # kv_slot False: no slot (precheck only); the model's calls fail the message (NeedsKVSlot).
        # "later": a slot claimed by attach_slot() before its first message (an actor made ahead).
        if kv_slot not in (True, False, "later"):
            raise FloeError(f"kv_slot is True, False or 'later', not {kv_slot!r}")
        self._slot_later = kv_slot == "later"
        self.slot = engine.claim_slot() if kv_slot is True else None
        try:
            self.abi = HostABI(engine, self.context)
            functions = self.abi.functions()
            if kv_slot is False:
                functions = [f if f.name in WITHOUT_SLOT else self._refusing(f) for f in functions]
            else:  # (some answered natively, their Python methods the fallback: floe.actor.native_imports)
                functions = native_imports.attach(self.abi, functions, module.runtime.host_functions.pointers)
            self.guest = GuestInstance(self.module, IMPORT_MODULE, functions, memory_cap,
                                       deadline_s=deadline_s)
            self.context.region = self.guest.region
            if self.abi.native is not None:
                self.abi.native.bind(self.guest.watchdog, self.guest.region)
            self.guest.function("floe_abi_version", 0)
            version = self._call("floe_abi_version")
            if version not in SUPPORTED_ABI_VERSIONS:
                raise GuestLoadError(f"guest speaks floe ABI {version}; this host speaks "
                                     f"{' and '.join(map(str, SUPPORTED_ABI_VERSIONS))}")
            self.abi_version = self.abi.version = version
            # Each export's type checked and its call prepared now: an actor made ahead (a spare) spares
            # a new session's first message making them (a third of a one-shot chat's on_end).
            for name, n_params in EXPORTS[version].items():
                self.guest.function(name, n_params)
                self.guest.prepared(name, n_params)
            for name, n_params in OPTIONAL_EXPORTS[version].items():
                if self.guest.has_function(name):
                    self.guest.function(name, n_params)
                    self.guest.prepared(name, n_params)
        except BaseException:
            if self.guest is not None:
                self.guest.close()
            if self.slot is not None:
                engine.release_slot(self.slot)
            raise

    def _refusing(self, f: HostFunction) -> HostFunction:
        """Host call `f` as an actor without a KV slot answers it: the message fails (NeedsKVSlot)."""
        def refuse(*args: int) -> int:
            raise NeedsKVSlot(f"host call {f.name} needs a KV slot; this actor has none")

        return HostFunction(f.name, f.n_params, f.n_results, self.abi._raw(refuse, f.n_params, f.n_results))


    def _call(self, name: str, *args: int, deadline: float | None = None) -> int:
        """Call a guest export, by `deadline` (time.monotonic(); default: deadline_s from now), under
        the message's host budget (a fresh one outside a message); a GuestError names the guest's
        last log line. Off the main thread the call holds the GIL until its first epoch tick
        (HOLD_TO_A_TICK): an on_message's ~14 crossings into and out of Wasmtime each handed it to any
        waiting thread and waited to take it back (during a burst, behind the engine loop and the other
        arrivals); a guest that runs longer than a tick lets the others run from then on."""
        own_budget = self.abi.budget is None
        if own_budget:
            self.abi.begin(self.guest.watchdog, self.guest.memory_cap)
        seconds = self.deadline_s if deadline is None else max(0.0, deadline - time.monotonic())
        native = self.abi.native if name in NATIVE_CALLS else None
        if native is not None:
            native.stage()
        try:
            return self.guest.call(name, *args, deadline_s=seconds, pending=self.take_pending,
                                   hold_gil=HOLD_TO_A_TICK)
        except GuestError as e:
            self.name_last_log(e)
            raise
        finally:
            if native is not None:
                native.unstage()
            if own_budget:
                self.abi.budget = None


    @property
    def loop(self) -> EngineLoop:
        """The engine loop that runs this actor's turns (ABI v2): the one given, else its engine's."""
        if self._loop is None:
            self._loop = engine_loop(self.engine)
        return self._loop

    def poke_loop(self) -> None:
        if self._loop is not None:
            self._loop.poke()

    def _refuse_reentry(self, what: str) -> None:
        if self._message_thread == threading.get_ident() or in_engine_loop():
            raise ActorReentrantCall(f"{what} was called from inside a message (an on_text callback); "
                                     "call it after the message returns")

    @contextmanager
    def _guest_turn(self, what: str) -> Iterator[None]:
        """Hold the actor for one guest call (a message, a history entry): one at a time, never from
        inside another, never on a closed actor; a close() during it takes effect when it ends."""
        self._refuse_reentry(what)
        with self._lock:
            if self.closed:
                raise ActorClosed("this actor is closed")
            self._message_thread = threading.get_ident()
            try:
                yield
            finally:
                self._message_thread = None
                if self.closed:
                    self._release()

    def send(self, message: str, *, max_tokens: int = 256, params: SamplingParams | None = None,
             on_text: Callable[[str], None] | None = None, loop_safe: bool = False,
             tokens: TokenStream | None = None) -> Reply:
        """Deliver one user message; the guest answers through emit(). Returns the whole reply.

        on_text(piece): each piece of the reply's text as it comes, called in this (the caller's)
        thread: a slow or failing callback holds or fails this message only (a failure is a
        GuestHostCallError). loop_safe: on_text only hands the piece on (never blocks or raises), and
        is called where the text is made, the engine loop's thread for ABI v2 (floe serve's streaming:
        no hand-over per token).

        tokens: the reply's tokens (and any bytes the guest emits) go there, in order, as they come,
        instead of text to on_text (which must then be None): the engine loop makes no text per token
        (floe.actor.stream; floe serve's streaming). The Reply's text is made once, at the end.

        The reply's text starts as the tokenizer's decode of its tokens does: without the space a
        SentencePiece decoder drops (Tokenizer.strips_leading_space), but in an actor that continues_text.

        A trap, deadline or bad pointer raises a GuestError subclass for this message only: the
        engine and other actors carry on, and this actor's KV slot is left as the guest left it.
        """
        if self.closed:
            raise ActorClosed("this actor is closed")
        if max_tokens < 1:
            raise FloeError(f"max_tokens must be >= 1, got {max_tokens}")
        if tokens is not None and on_text is not None:
            raise FloeError("send(): a reply streamed as tokens has no on_text (its reader makes the text)")
        self._need_slot("send()")
        # ABI v2, every token's reply bytes known (Tokenizer.fill_reply_bytes; floe.actor.reply_text): the
        # loop's native calls take the reply's tokens into a TokenStream of its own, its text made here: once
        # at the end, or, handed to on_text, from what each step streamed (the loop wakes this thread).
        handing = on_text is not None and not loop_safe and self.abi_version >= 2
        own = None
        if tokens is None and self.abi_version >= 2 and (on_text is None or handing):
            if self.engine.tokenizer.reply_bytes_filled:
                tokens = own = TokenStream()
            elif self.loop.busy:  # (several actors' turns: their reply bytes worked out, for later sends)
                fill_later(self.engine.tokenizer)
        with self._guest_turn("send()"):
            reply = ReplyText(self, on_text, handing, own)
            self.request = Request(max_tokens, params or SamplingParams())
            self.stats = MessageStats(started=time.perf_counter())
            self.ledger = Ledger()
            self.logs.clear()
            self.on_text = reply.collect
            self.stop_requested = False
            if tokens is not None:
                tokens.attach(self)
                self.engine.tokenizer.reply_lengths(self.abi.vocab)  # (made here once, not in the loop)
            self.abi.tokens_to = tokens
            self.abi.last_logits = None
            self.abi.utf8.reset()
            data = message.encode()
            ptr = self._deliver(data, "message")
            try:
                if self.abi_version == 1:
                    status = self._call("on_message", ptr, len(data))
                else:
                    status = self._turn(ptr, len(data), max_tokens,
                                        (reply.woken, reply.hand) if handing else None)
            finally:
                self.abi.tokens_to = None
                self.stats.wall_s = time.perf_counter() - self.stats.started
                if self.scheduler is not None:
                    self.scheduler.leave(self.slot)
            if handing:
                reply.take()  # (what the turn's last steps streamed)
            elif tokens is not None:  # the reply's text, once (as it came: made elsewhere)
                made = tokens.reply_bytes(self.engine.tokenizer)
                reply.collect(self.abi.utf8.decode(made))  # (no on_text: it keeps the text, its start cut)
            tail = self.abi.utf8.decode(b"", final=True)
            if tail:
                reply.collect(tail)
            if handing:
                reply.hand()  # (what came after the turn: the tail, or the text of a turn that never ran)
            if status != 0:
                raise GuestReportedError(f"guest reported error {status} for this message"
                                         + (f": {self.logs[-1]}" if self.logs else ""), status)
            return Reply(reply.text, self.stats, self.ledger, list(self.logs))

    def precheck(self, message: str, *, max_tokens: int = 256, params: SamplingParams | None = None) -> int:
        """The guest's on_message, up to its first call of the model, on an actor made without a KV
        slot (kv_slot=False): its status if it refused the message before (its last log line says
        why), 0 if it got that far. Nothing of the message stays but what the guest keeps in its memory."""
        if self.slot is not None:
            raise FloeError("precheck() is for an actor made without a KV slot (kv_slot=False)")
        with self._guest_turn("precheck()"):
            self.request = Request(max_tokens, params or SamplingParams())
            self.logs.clear()
            self.stop_requested = False
            data = message.encode()
            ptr = self._deliver(data, "message")
            self.abi.begin(self.guest.watchdog, self.guest.memory_cap)
            self.abi.begin_turn()
            self.abi.preparing = True
            try:
                return self._call("on_message", ptr, len(data))
            except NeedsKVSlot:
                return 0
            finally:
                self.abi.preparing = False
                self.abi.budget = None
                self.abi.clear_queue()

    def _need_slot(self, what: str) -> None:
        if self.slot is None:
            if self._slot_later:
                raise FloeError(f"{what}: this actor has no KV slot yet (attach_slot() claims one)")
            raise FloeError(f"{what}: this actor was made without a KV slot (it only prechecks messages)")

    def attach_slot(self) -> None:
        """Claim a KV slot (emptied) for an actor made with kv_slot="later", before its first message: an
        actor made ahead, whose guest is ready while every slot is still held (a server's spare, which a
        new session takes once another's slot is freed). Raises FloeError if none is free."""
        if not self._slot_later:
            raise FloeError("attach_slot() is for an actor made with kv_slot='later'")
        if self.closed:
            raise ActorClosed("this actor is closed")
        if self.slot is None:
            self.slot = self.engine.claim_slot()

    def adopt_slot(self, old: Actor) -> None:
        """Take over the KV slot of `old` (idle, of this engine; closed by this, its guest freed by its
        close()) for an actor made with kv_slot="later", emptied as a claimed slot is, but for what it
        held: this actor's first prefill reuses the start its ids share with the ids it held (their K
        and V are still there) instead of computing it again. A session restarted with a new guest (a
        conversation rolled back to an earlier turn) keeps the turns before that turn's message."""
        if not self._slot_later or self.slot is not None:
            raise FloeError("adopt_slot() is for an actor made with kv_slot='later' that has no slot yet")
        if self.closed:  # (its close() is done: the slot would never go back)
            raise ActorClosed("this actor is closed")
        if old.engine is not self.engine:
            raise FloeError("adopt_slot(): the other actor's slot is another engine's")
        old._refuse_reentry("adopt_slot()")  # (from the engine loop: the lock is held by who waits for it)
        with old._lock:
            if old._message_thread is not None:
                raise FloeError("adopt_slot(): the other actor is running a message")
            if old.closed:  # (its slot went back to the engine: another actor may hold it now)
                raise ActorClosed("adopt_slot(): the other actor is closed; its KV slot is not its own now")
            if old.slot is None:
                raise FloeError("adopt_slot(): the other actor has no KV slot")
            old.closed = True
            slot, old.slot = old.slot, None
        self.engine.kv_hold(slot)
        self.slot = slot

    def give_up_slot(self) -> None:
        """Free the KV slot of an idle actor that is about to be closed, now: the slot's next actor need
        not wait for this one's guest to be torn down (close() may then run later, elsewhere). The
        actor can run no message after this."""
        with self._lock:
            if self._message_thread is not None:
                raise FloeError("give_up_slot() is for an idle actor (a message is running)")
            self.closed = True
            if self.slot is not None:
                slot, self.slot = self.slot, None
                self.engine.release_slot(slot)

    def _turn(self, ptr: int, length: int, max_tokens: int,
              deliver: tuple[threading.Event, Callable[[], None]] | None) -> int:
        """ABI v2: on_message queues the turn's prompt (here, in the caller's thread), then the engine
        loop runs it with every other actor's; the guest's status. deliver: EngineLoop.run's (the
        caller's on_text, handed over in this thread)."""
        deadline = time.monotonic() + self.deadline_s
        self.abi.begin(self.guest.watchdog, self.guest.memory_cap)
        self.abi.begin_turn()
        try:
            self.abi.preparing = True
            try:
                with self.loop.arriving():
                    status = self._call("on_message", ptr, length, deadline=deadline)
            finally:
                self.abi.preparing = False
                self.stats.prepared = time.perf_counter()
            if status == 0 and self.abi.queued_tokens:
                self.stats.finish_reason = END_REASONS[self.loop.run(self, max_tokens, deadline, deliver)]
            return status
        finally:
            self.abi.budget = None
            self.abi.clear_queue()

    def _deliver(self, data: bytes, what: str) -> int:
        """Copy `data` into the buffer the guest's alloc() hands out; its guest address."""
        ptr = self._call("alloc", len(data))
        if ptr == 0 and data:
            raise GuestResultError(f"guest could not allocate {len(data)} bytes for the {what} "
                                   "(its alloc returned 0)")
        try:
            self.region.write(ptr, data)
        except OutOfBounds as e:
            raise GuestPointerError(f"alloc({len(data)}) returned {ptr & 0xFFFFFFFF}, outside the guest's "
                                    f"memory ({e})") from None
        self.ledger.copy(f"host→guest {what}", len(data))
        return ptr

    HISTORY_ROLES = ("system", "user", "assistant")

    def add_history(self, role: str, text: str) -> None:
        """Load one message of an earlier conversation (system, user or assistant) without
        generating; the next send() renders it with the rest and prefills what the cache lacks.
        Needs a guest that exports `on_history` (floe's chat and constrained guests do)."""
        if self.closed:
            raise ActorClosed("this actor is closed")
        if role not in self.HISTORY_ROLES:
            raise FloeError(f"message role {role!r}: choose one of {', '.join(self.HISTORY_ROLES)}")
        if not self.guest.has_function("on_history"):
            raise FloeError(f"guest {self.module.name} cannot take a conversation history "
                            "(it exports no on_history)")
        with self._guest_turn("add_history()"):
            data = text.encode()
            ptr = self._deliver(data, "history message")
            status = self._call("on_history", self.HISTORY_ROLES.index(role), ptr, len(data))
            if status != 0:
                raise GuestReportedError(f"guest refused a {role} history message (status {status})",
                                         status)

    def stream(self, message: str, **kwargs) -> Iterator[str]:
        """send() as a generator of text pieces; the guest runs in a worker thread."""
        pieces: queue.Queue = queue.Queue()
        done = object()
        outcome: list = []

        def work() -> None:
            try:
                outcome.append(self.send(message, on_text=pieces.put, loop_safe=True, **kwargs))
            except BaseException as e:  # noqa: BLE001 - handed to the consumer
                outcome.append(e)
            finally:
                pieces.put(done)

        worker = threading.Thread(target=work, name="floe-actor", daemon=True)
        start_guest_thread(worker)
        try:
            while (item := pieces.get()) is not done:
                yield item
        finally:
            self.stop_requested = True  # the consumer went away: let the guest wind down
            worker.join()
        if isinstance(outcome[0], BaseException):
            raise outcome[0]

    # ---- state capture and restore (between messages only: the lock waits for one in flight) ----

    @contextmanager
    def between_messages(self) -> Iterator[Actor]:
        """Hold the actor between messages (one in flight finishes first): its state does not change
        until the block ends. capture_state and restore may be called inside."""
        self._refuse_reentry("between_messages()")
        with self._lock:
            if self.closed:
                raise ActorClosed("this actor is closed")
            yield self

    def capture_state(self) -> ActorState:
        """Everything that makes this actor now, as tensors and values (KV views, not copies)."""
        self._need_slot("capture_state()")
        with self.between_messages():
            k, v = self.engine.cache.export(self.slot)
            size, pages, data = self.guest.capture_memory()
            return ActorState(
                k=k, v=v, tokens=list(self.engine.cache.tokens[self.slot]), memory_size=size,
                memory_pages=pages, memory_data=data, globals=self.guest.capture_globals(),
                rng=self.generator.get_state(), system_prompt=self.system_prompt,
                model_fingerprint=self.engine.fingerprint, model_name=self.engine.checkpoint.name,
                guest_sha256=self.module.sha256, guest_name=self.module.name,
                engine_dtype=str(self.engine.dtype).removeprefix("torch."), abi_version=self.abi_version,
                engine_weights=self.engine.weights,
            )

    def restore(self, state: ActorState, kv: PendingLoad | None = None) -> None:
        """Make this (fresh) actor the one `state` was captured from; checked by the caller. `kv`: a
        load of state's KV cache already begun (KVCache.start_load, maybe with digests to check: on
        a mismatch the slot is left empty and KVDigestMismatch propagates)."""
        self._need_slot("restore()")
        with self.between_messages():
            self.system_prompt = state.system_prompt
            self.guest.restore_memory(state.memory_size, state.memory_pages, state.memory_data)
            self.guest.restore_globals(state.globals)
            kv = kv or self.engine.cache.start_load(state.k, state.v)
            kv.into(self.slot, state.tokens)
            for boundary, nbytes in kv.copies:  # in this actor's ledger until its next message
                self.ledger.copy(boundary, nbytes)
            self.generator.set_state(state.rng)

    def close(self) -> None:
        """Close the actor and free its memory and KV slot. A message in flight is stopped first (its
        sender gets GuestCancelled): from another thread close() waits for it to unwind; from inside it
        (an on_text callback) the actor is freed as the message returns."""
        if self.closed:
            if self.slot is None and not self._released and self._message_thread is None:
                with self._lock:  # (after give_up_slot: the guest is freed here)
                    self._release()
            return
        self.closed = True
        if self._message_thread is not None:
            self.stop_requested = True
            self.guest.cancel("the actor was closed")
            if self._message_thread == threading.get_ident() or in_engine_loop():
                return  # _guest_turn releases it on the way out
        with self._lock:
            self._release()

    def _release(self) -> None:
        if not self._released:
            self._released = True
            self.guest.close()
            if self.slot is not None:
                self.engine.release_slot(self.slot)

    def __enter__(self) -> Actor:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
