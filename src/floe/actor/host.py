"""The host side of one guest instance — what its host calls (floe.actor.abi) and the engine loop
(floe.actor.loop) use of an actor: its engine and guest, the guest calls made within a message, and its
MessageContext: the plain data its host calls read and write (KV slot, guest memory, RNG, the message it
runs: request, stats, ledger, logs, where its text goes, whether it was asked to stop, a host call's
failure). Actor (floe.actor.actor) is a GuestHost with the API on top: the layers below it name this,
never the Actor; the host ABI names only the MessageContext.
"""

from __future__ import annotations

import operator
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from floe.engine import Engine, SamplingParams
from floe.memory import Region
from floe.profile import Ledger
from floe.wasm import GuestError, GuestInstance, GuestModule

if TYPE_CHECKING:
    from floe.actor.scheduler import DecodeScheduler

LOG_LINES_KEPT = 64  # a guest's log lines kept (the last ones)
# The guest calls whose host calls may be answered natively (floe.actor.native_imports: staged around
# them): a message's arrival and its history, a turn's end. Not on_token: its calls ask none of them.
NATIVE_CALLS = frozenset({"on_message", "on_history", "on_end"})
STOP_GRACE_S = 2.0  # a guest asked to stop that goes on is stopped this much later (stop_requested)


@dataclass
class Request:
    """What one message asks of the guest; the guest reads it through `request()`."""

    max_tokens: int = 256
    params: SamplingParams = field(default_factory=SamplingParams)


@dataclass
class MessageStats:
    prompt_tokens: int = 0  # tokens prefilled (beyond what the KV cache already held)
    context_tokens: int = 0  # the whole prompt: tokens in the KV cache after the first forward
    first_forward_tokens: int = 0  # tokens the first forward computed (≥ 1 even if all were cached)
    sampled: list[int] = field(default_factory=list)  # non-EOS tokens the host sampled
    decoded: list[int] = field(default_factory=list)  # tokens the guest fed back one at a time
    forward_s: float = 0.0  # time in the engine
    forwards: int = 0
    started: float = 0.0
    prepared: float = 0.0  # ABI v2: on_message returned, its prompt queued for the engine loop
    first_text: float = 0.0
    last_text: float = 0.0
    emits: int = 0
    emit_calls: int = 0  # one per token for floe's guests, whatever the text
    wall_s: float = 0.0  # the whole message, guest and engine
    finish_reason: str = ""  # ABI v2: why the engine loop ended the turn (stop, length, context_full, …)

    @property
    def outside_engine_s(self) -> float:
        """Time in the guest and the host ABI: the price of the sandbox for this message."""
        return max(0.0, self.wall_s - self.forward_s)

    def on_forward(self, n_tokens: int, seconds: float, kv_len: int = 0) -> None:
        if self.forwards == 0:
            self.context_tokens, self.first_forward_tokens = kv_len, n_tokens
        self.forwards += 1
        self.forward_s += seconds
        if n_tokens > 1:
            self.prompt_tokens += n_tokens

    def on_sample(self, token: int, is_eos: bool) -> None:
        if not is_eos:
            self.sampled.append(token)

    def on_decode(self, token: int) -> None:
        self.decoded.append(token)

    @property
    def token_ids(self) -> list[int]:
        """The reply's tokens: what the host sampled, or (for a guest that samples itself) what it
        decoded, plus its last choice when that was not fed back."""
        return self.sampled if self.sampled else self.decoded

    @property
    def generated_tokens(self) -> int:
        """Tokens the reply generated. ABI v2 (the engine loop ran the turn: finish_reason): every token
        on_token returned, whatever the guest emitted (its emits are text, not tokens: counted, they
        made 18 of max_tokens 16, and 2 of a turn that generated none)."""
        if self.finish_reason:
            return len(self.decoded)
        return len(self.sampled) if self.sampled else max(len(self.decoded), self.emit_calls)

    def on_emit(self) -> None:
        now = time.perf_counter()
        self.emits += 1
        if not self.first_text:
            self.first_text = now
        self.last_text = now

    @property
    def ttft_s(self) -> float:
        return self.first_text - self.started if self.first_text else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        span = self.last_text - self.first_text
        return (self.generated_tokens - 1) / span if self.generated_tokens > 1 and span > 0 else 0.0


def _no_text(text: str) -> None:
    """Where a message's text goes when nobody asked for it."""


@dataclass(eq=False, slots=True)
class MessageContext:
    """What an actor's host calls (floe.actor.abi) and its engine loop read and write of it: where it
    runs (its KV slot, v1 decode scheduler, guest memory, RNG, system prompt, log lines) and the message
    it runs, set by the actor as each message starts (kept until the next: a restore's KV copies are
    counted in its ledger). A host call's failure waits in `error` until the actor raises it
    (GuestHost.take_pending). One per actor, updated in place: the host ABI holds it for the actor's
    life."""

    generator: torch.Generator
    system_prompt: str = ""
    slot: int | None = None
    scheduler: DecodeScheduler | None = None
    region: Region | None = None  # the guest's memory, once the guest is made (it never moves)
    logs: deque[str] = field(default_factory=lambda: deque(maxlen=LOG_LINES_KEPT))
    request: Request = field(default_factory=Request)
    stats: MessageStats = field(default_factory=MessageStats)
    ledger: Ledger = field(default_factory=Ledger)
    on_text: Callable[[str], None] = _no_text
    stop_requested: bool = False  # (GuestHost.stop_requested sets it: the guest winds down)
    error: BaseException | None = None


def _in_context(name: str) -> property:
    """A GuestHost attribute kept in its MessageContext (one place, which the host ABI reads)."""
    get = operator.attrgetter(name)

    def put(self: GuestHost, value) -> None:
        setattr(self.context, name, value)

    return property(lambda self: get(self.context), put, doc=f"MessageContext.{name} of this actor")


class GuestHost:
    """One guest instance's host side (the module doc). `abi` is its HostABI, set by Actor, which
    reads and writes its `context`."""

    request = _in_context("request")
    stats = _in_context("stats")
    ledger = _in_context("ledger")
    logs = _in_context("logs")
    on_text = _in_context("on_text")
    slot = _in_context("slot")
    scheduler = _in_context("scheduler")  # (v1: a DecodeScheduler batching its decode steps with others')
    generator = _in_context("generator")
    system_prompt = _in_context("system_prompt")
    pending_error = _in_context("error")

    def __init__(self, engine: Engine, module: GuestModule, deadline_s: float, system_prompt: str,
                 seed: int) -> None:
        self.engine = engine
        self.module = module
        self.deadline_s = deadline_s
        generator = torch.Generator(device="cpu")
        generator.manual_seed(seed)
        self.context = MessageContext(generator, system_prompt)
        self._message_thread: int | None = None  # the thread running a guest call, while it runs
        self.closed = False
        self.guest: GuestInstance | None = None
        self.abi = None

    @property
    def region(self) -> Region:
        return self.guest.region

    @property
    def stop_requested(self) -> bool:
        """Whether this message was asked to stop (its consumer left, a stop sequence, a close): the
        guest sees it (emit answers 1) and must return; one that goes on (a v1 guest still calling
        decode) is stopped STOP_GRACE_S later instead of running to its deadline."""
        return self.context.stop_requested

    @stop_requested.setter
    def stop_requested(self, value: bool) -> None:
        self.context.stop_requested = value
        if value and self._message_thread is not None:
            self.guest.wind_down(STOP_GRACE_S)
        if value:
            self.poke_loop()

    def poke_loop(self) -> None:
        """Tell the engine loop running this actor's turns (if any) to look for turns to cancel
        (EngineLoop.poke): Actor's."""

    def take_pending(self) -> BaseException | None:
        context = self.context
        error, context.error = context.error, None
        return error

    def name_last_log(self, e: GuestError) -> None:
        if self.logs and e.args:
            e.args = (f"{e.args[0]} (the guest's last log line: {self.logs[-1]!r})", *e.args[1:])

    def guest_call(self, name: str, *args: int, seconds: float) -> int:
        """For the engine loop: call a guest export within the running message (its budget), for at
        most `seconds`, holding the GIL through the guest's code (GuestInstance.call: the loop's
        thread, which every turn waits for, waits for no other thread)."""
        if self.abi.budget is None:
            raise RuntimeError(f"{name}: the engine loop calls a guest only within its message")
        native = self.abi.native if name in NATIVE_CALLS else None
        if native is not None:
            native.stage()
        try:
            return self.guest.call(name, *args, deadline_s=seconds, pending=self.take_pending, hold_gil=True)
        except GuestError as e:
            self.name_last_log(e)
            raise
        finally:
            if native is not None:
                native.unstage()
