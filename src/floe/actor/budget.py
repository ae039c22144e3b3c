"""What one message may ask of the host beyond guest instructions (docs/ABI.md, "Limits"): the limits,
and the HostBudget each message's host calls are charged to (floe.actor.abi)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from floe.wasm import GuestBudgetExceeded, GuestCancelled, GuestDeadlineExceeded
from floe.wasm.raw import signals

# Host work one message may ask for, beyond guest instructions (docs/ABI.md, "Limits").
BUDGET_PER_CAP = 4  # bytes the host handles for one message: at most this many times the memory cap
# Tokens one message may run through the model (prefill + decode calls): this many contexts (a guest
# may truncate and prefill again) and this many times its max_tokens.
FORWARDS_PER_CONTEXT, FORWARDS_PER_TOKEN = 4, 2
CALL_OVERHEAD = 64  # bytes charged per host call on top of its data (each call costs the host objects)
TEXT_BYTES_PER_TOKEN = 32  # tokenize / chat_render input: at most this many bytes per token of context
MIN_TEXT_CAP = 64 << 10  # ... but never less than 64 KiB
TEXT_CAP_PER_CAP = 64  # ... and at most 1/64 of the memory cap (tokenizing holds ~500 B per input byte)
HOST_MEMORY_PER_CAP = 16  # what the above bound: the host holds at most ~this x the cap for a message

# tokenize runs here, so a long one can be left behind at the deadline (the tokenizer releases the GIL).
_SLOW_CALLS = ThreadPoolExecutor(max_workers=2, thread_name_prefix="floe-host-call")


class HostBudget:
    """What one message may still ask of the host: time (the guest's watchdog: deadline and
    cancellation), bytes handled (text tokenized, rendered, emitted, logged; ids moved) and tokens
    forwarded through the model (prefill and decode calls)."""

    def __init__(self, watchdog, limit: int, forward_limit: int | None = None) -> None:
        self.watchdog = watchdog
        self.limit = limit
        self.spent = 0
        self.forward_limit, self.forwarded = forward_limit, 0
        self._row: tuple | None = None  # (words, room, streamed) while the engine loop streams natively

    def bind(self, words, room: int, streamed: int) -> None:
        """Tokens the engine loop's native calls stream (floe.wasm.rows) are charged to words[streamed],
        within words[room]: what this budget had left now, lowered by each spend() from here on."""
        words[room], words[streamed] = self.limit - self.spent, 0
        self._row = (words, room, streamed)

    def unbind(self) -> None:
        """The native charges, into spent."""
        if self._row is not None:
            words, _, streamed = self._row
            self.spent += words[streamed]
            self._row = None

    def forward(self, n_tokens: int, call: str) -> None:
        """Count n_tokens the guest asks the model to run; past the message's share of the device (a
        guest that re-prefills or decodes without end) its budget error, not its deadline's minutes."""
        self.forwarded += n_tokens
        if self.forward_limit is not None and self.forwarded > self.forward_limit:
            raise GuestBudgetExceeded(
                f"the guest asked the model to run more than {self.forward_limit} tokens in one message "
                f"({FORWARDS_PER_CONTEXT}x the context + {FORWARDS_PER_TOKEN}x max_tokens; at {call})")

    def check_time(self, call: str) -> None:
        signals.deliver()  # a Ctrl-C that came during guest code: raised here, in the host call's try
        reason = self.watchdog.expired()
        if reason == "deadline":
            raise GuestDeadlineExceeded(f"the message ran past its deadline (in host call {call})")
        if reason is not None:
            raise GuestCancelled(f"the message was stopped: {reason} (in host call {call})")

    def spend(self, nbytes: int, call: str) -> None:
        n = CALL_OVERHEAD + nbytes
        self.spent += n
        total = self.spent
        if self._row is not None:
            words, room, streamed = self._row
            words[room] -= n
            total += words[streamed]
        if total > self.limit:
            raise GuestBudgetExceeded(
                f"the guest asked the host to handle more than {self.limit >> 20} MiB in one message "
                f"({BUDGET_PER_CAP}x its memory cap; at {call})")

    def wait(self, fn: Callable[[], object], call: str) -> object:
        """fn() in a worker thread, waited for only until the deadline or a cancellation (the work
        left behind is bounded by the call's size cap)."""
        future = _SLOW_CALLS.submit(fn)
        while True:
            try:
                return future.result(timeout=0.01)
            except TimeoutError:
                self.check_time(call)


# Texts up to this size are tokenized in the calling thread (~1 ms at most); longer ones in a worker
# that the message's deadline can walk away from.
INLINE_TOKENIZE_BYTES = 16 << 10
