"""The host side of the guest ABI (versions 1 and 2): the `floe` import module, connecting guest calls
to the engine. docs/ABI.md is the contract; this file implements it.

v1: the guest drives; prefill and decode run the engine now. v2: the engine loop drives
(floe.actor.loop); prefill, inside on_message, queues the prompt for the loop, and the guest's
on_token export chooses each next token.

Every argument is an i32. Pointers are offsets into the guest's memory (the actor's Region) and are
bounds-checked; a bad one traps the guest with GuestPointerError. Recoverable conditions return a
negative status instead (context full, bad token id, a negative or too large length).

Each host call is also charged to the message's HostBudget: its deadline and cancellation are checked
on entry, the bytes it handles are counted, and the calls that can take long (tokenize) are bounded
in size and waited for no longer than the deadline. docs/ABI.md, "Limits", is the contract.
"""

from __future__ import annotations

import codecs
import math
import struct
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from floe.actor.budget import (  # noqa: F401 - the limits are the ABI's too (tests, docs read them here)
    BUDGET_PER_CAP,
    CALL_OVERHEAD,
    FORWARDS_PER_CONTEXT,
    FORWARDS_PER_TOKEN,
    HOST_MEMORY_PER_CAP,
    INLINE_TOKENIZE_BYTES,
    MIN_TEXT_CAP,
    TEXT_BYTES_PER_TOKEN,
    TEXT_CAP_PER_CAP,
    HostBudget,
)
from floe.actor.guest_io import MASK32, GuestIO, NativeAnswers, as_i32
from floe.actor.host import LOG_LINES_KEPT  # noqa: F401 - (the ABI's limit: tests read it here)
from floe.engine.sampling import SamplingParams, sample_token
from floe.errors import ContextOverflow, InvalidSamplingParams
from floe.memory import OutOfBounds
from floe.wasm import (
    GuestError,
    GuestHostCallError,
    GuestPointerError,
    HostFunction,
)
from floe.wasm.raw import describe, trap_new

if TYPE_CHECKING:
    from floe.actor.host import MessageContext
    from floe.actor.stream import TokenStream
    from floe.engine import Engine
    from floe.model.tokenizer import Rendered

ABI_VERSION = 2  # the newest this host speaks
SUPPORTED_ABI_VERSIONS = (1, 2)
IMPORT_MODULE = "floe"

OK = 0
ERR_CONTEXT_FULL = -1
ERR_BAD_TOKEN = -2
ERR_BAD_ARGUMENT = -3

MESSAGE = struct.Struct("<4I")  # role_ptr, role_len, content_ptr, content_len
SAMPLING = struct.Struct("<fif4x")  # temperature, top_k, top_p, (reserved)
REQUEST = struct.Struct("<IfifQ8x")  # max_tokens, temperature, top_k, top_p, seed, (reserved)

MAX_IDS_PER_CALL = 1 << 16  # detokenize
LOG_LINE_BYTES = 4096

NO_IDS = torch.empty(0, dtype=torch.long)  # nothing queued (shared: queued ids are replaced, never written)
LOGITS_KEPT, LOGITS_IN_PLACE, LOGITS_COPIED = 0, 1, 2  # HostABI.keep_logits: which crossing
CHOICE_CROSSING = "host→guest choice (the host's token for on_token)"



class HostABI(GuestIO):
    """The `floe` import module for one actor: what it reads and writes of the actor is its
    MessageContext (floe.actor.host), which the actor fills at each message. Holds the ABI's own
    per-message state (the last logits, what on_message queued, the turn's options)."""

    def __init__(self, engine: Engine, context: MessageContext) -> None:
        self.context = context
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.vocab = self.engine.config.vocab_size
        self.last_logits: torch.Tensor | None = None
        self.utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self.budget: HostBudget | None = None  # set for each message (and add_history) by the actor
        self.text_cap = 0
        self.version = ABI_VERSION  # the guest's, once it said
        # v2: what on_message queued for the engine loop, and where each step's logits go.
        self.queued = NO_IDS
        self.logits_ptr = 0
        self.preparing = False  # inside on_message (v2): prefill queues, kv_truncate allowed
        # v2 turn options on_message may set (choice_at, stream_tokens); reset at each message.
        self.choice: np.ndarray | None = None  # int32 [1] in guest memory: the host's choice goes there
        self.choice_address = 0  # its address (floe.wasm.rows stores the choice there natively)
        self.streams = False  # the tokens on_token returns are streamed by the host
        # The message's output as token ids (Actor.send's `tokens`), or None: made into text here.
        self.tokens_to: TokenStream | None = None
        # Where sample() marks that it was called: the word of the turn's row the engine loop reads
        # (floe.actor.turn: Turn.sampled, reset before each on_token), while a turn runs; else None.
        self.sampled_at: tuple[memoryview, int] | None = None
        self.rendered: tuple[bytes, Rendered] | None = None  # the last chat_render, for tokenize()
        self.native: NativeAnswers | None = None  # the imports answered natively (floe.actor.native_imports)

    def begin_turn(self) -> None:
        """v2: a new message's turn: nothing queued, no logits target, no turn options."""
        self.clear_queue()
        self.logits_ptr = 0
        self.choice, self.choice_address, self.streams = None, 0, False

    def begin(self, watchdog, memory_cap: int) -> HostBudget:
        """A fresh budget for the next guest call (a message, a history entry)."""
        forwards = (FORWARDS_PER_CONTEXT * self.engine.max_seq_len
                    + FORWARDS_PER_TOKEN * max(0, self.context.request.max_tokens))
        self.budget = HostBudget(watchdog, BUDGET_PER_CAP * memory_cap, forwards)
        self.text_cap = min(max(MIN_TEXT_CAP, TEXT_BYTES_PER_TOKEN * self.engine.max_seq_len),
                            memory_cap // TEXT_CAP_PER_CAP)
        return self.budget

    # ---- plumbing ---------------------------------------------------------------------------------

    def functions(self) -> list[HostFunction]:
        table: list[tuple[str, int, int, Callable[..., int]]] = [
            ("abi_version", 0, 1, lambda: ABI_VERSION),
            ("vocab_size", 0, 1, lambda: self.vocab),
            ("context_length", 0, 1, lambda: self.engine.max_seq_len),
            ("eos_ids", 2, 1, self.eos_ids),
            ("tokenize", 4, 1, self.tokenize),
            ("detokenize", 4, 1, self.detokenize),
            ("chat_render", 5, 1, self.chat_render),
            ("prefill", 3, 1, self.prefill),
            ("decode", 2, 1, self.decode),
            ("sample", 1, 1, self.sample),
            ("request", 1, 1, self.request),
            ("system", 2, 1, self.system),
            ("kv_len", 0, 1, lambda: self.engine.kv_len(self.context.slot)),
            ("kv_truncate", 1, 1, self.kv_truncate),
            ("emit", 2, 1, self.emit),
            ("log", 2, 1, self.log),
            ("choice_at", 1, 1, self.choice_at),
            ("stream_tokens", 1, 1, self.stream_tokens),
            ("tokenize_rest", 4, 1, self.tokenize_rest),
        ]
        return [HostFunction(name, n, r, self._raw(fn, n, r)) for name, n, r, fn in table]

    def _raw(self, fn: Callable[..., int], n_params: int, n_results: int):
        """Adapt fn(*i32 args) -> i32 to the raw calling convention; errors trap the guest and are
        kept in the context (its `error`) so the host raises them: GuestErrors as themselves, anything
        else wrapped in GuestHostCallError (KeyboardInterrupt and SystemExit as themselves)."""
        context = self.context
        name = getattr(fn, "__name__", "?")

        def call(raw) -> int:
            try:
                if self.budget is None:
                    raise GuestHostCallError(f"host function {name} called outside a message (from a "
                                             "start function?): floe answers guests only within a call")
                native = self.native
                if native is not None and native.staged:  # (what native answers did: seen here first)
                    native.fold()
                self.budget.check_time(name)
                args = [raw[2 * i] & MASK32 for i in range(n_params)]
                result = fn(*args)
                if native is not None and native.staged:  # (the budget's room as this call left it)
                    native.room()
                if n_results:
                    raw[0] = result & MASK32
                return 0
            except BaseException as e:  # noqa: BLE001 - becomes a trap, re-raised by the actor
                if isinstance(e, (GuestError, KeyboardInterrupt, SystemExit)):
                    context.error = e
                else:
                    context.error = GuestHostCallError(f"host function {name} failed: {describe(e)}")
                    context.error.__cause__ = e
                return trap_new(describe(context.error))

        return call

    # ---- the ABI ----------------------------------------------------------------------------------

    def eos_ids(self, out_ptr: int, cap: int) -> int:
        if (cap := self._length(cap)) is None:
            return ERR_BAD_ARGUMENT
        return self._write_ids(out_ptr, cap, list(self.tokenizer.eos_ids), "eos ids")

    def tokenize(self, text_ptr: int, text_len: int, out_ptr: int, out_cap: int) -> int:
        text_len, out_cap = self._length(text_len), self._length(out_cap)
        if text_len is None or out_cap is None or text_len > self.text_cap:
            return ERR_BAD_ARGUMENT
        raw = self._bytes(text_ptr, text_len, "text")
        text = raw.decode("utf-8", "replace")
        self._view(out_ptr, out_cap, torch.int32, "token ids")  # a bad buffer fails before the work
        if self.rendered is not None and self.rendered[0] == raw:  # the conversation chat_render gave
            rendered = self.rendered[1]  # its contents never make special tokens (encode_rendered)
            encode = lambda: self.tokenizer.encode_rendered(rendered)  # noqa: E731
        else:
            encode = lambda: self.tokenizer.encode_plain(text)  # noqa: E731
        if text_len <= INLINE_TOKENIZE_BYTES:  # short: here (a thread hop costs more than it)
            ids = encode()
            self.budget.check_time("tokenize")
        else:  # long: in a worker, waited for only until the deadline
            ids = self.budget.wait(encode, "tokenize")
        return self._write_ids(out_ptr, out_cap, ids, "token ids")

    def tokenize_rest(self, ids_ptr: int, n: int, out_ptr: int, out_cap: int) -> int:
        """The ids of the last chat_render's text after the bytes of the `n` ids the guest keeps (its KV
        cache's), message contents never special tokens; -3 where the text does not go on from them
        (Tokenizer.encode_rendered_after)."""
        n, out_cap = self._length(n), self._length(out_cap)
        if n is None or out_cap is None or n > self.engine.max_seq_len or self.rendered is None:
            return ERR_BAD_ARGUMENT
        if ids_ptr % 4:
            raise GuestPointerError(f"token ids: pointer {ids_ptr} is not 4-byte aligned")
        kept = struct.unpack(f"<{n}i", self._bytes(ids_ptr, 4 * n, "token ids"))
        if any(not 0 <= i < self.vocab for i in kept):
            return ERR_BAD_TOKEN
        self._view(out_ptr, out_cap, torch.int32, "token ids")  # a bad buffer fails before the work
        encoded, rendered = self.rendered
        self.budget.spend(len(encoded), "text")
        encode = lambda: self.tokenizer.encode_rendered_after(rendered, kept)  # noqa: E731
        if len(encoded) <= INLINE_TOKENIZE_BYTES:
            ids = encode()
            self.budget.check_time("tokenize_rest")
        else:
            ids = self.budget.wait(encode, "tokenize_rest")
        return ERR_BAD_ARGUMENT if ids is None else self._write_ids(out_ptr, out_cap, ids, "token ids")

    def detokenize(self, ids_ptr: int, n: int, out_ptr: int, out_cap: int) -> int:
        n, out_cap = self._length(n), self._length(out_cap)
        if n is None or out_cap is None or n > MAX_IDS_PER_CALL:
            return ERR_BAD_ARGUMENT
        if ids_ptr % 4:
            raise GuestPointerError(f"token ids: pointer {ids_ptr} is not 4-byte aligned")
        ids = struct.unpack(f"<{n}i", self._bytes(ids_ptr, 4 * n, "token ids"))  # a tensor costs more
        if ids and (min(ids) < 0 or max(ids) >= self.vocab):  # (in C: a reply's ids at its end)
            return ERR_BAD_TOKEN
        data = self.tokenizer.ids_bytes(ids)  # (exact bytes: a token may end inside a character)
        self._write(out_ptr, out_cap, data, "text")
        return len(data)

    def chat_render(self, msgs_ptr: int, n_msgs: int, add_generation_prompt: int, out_ptr: int,
                    out_cap: int) -> int:
        n_msgs, out_cap = self._length(n_msgs), self._length(out_cap)
        if n_msgs is None or out_cap is None or n_msgs > self.engine.max_seq_len:
            return ERR_BAD_ARGUMENT
        if msgs_ptr % 4:
            raise GuestPointerError(f"message table: pointer {msgs_ptr} is not 4-byte aligned")
        table = self._bytes(msgs_ptr, MESSAGE.size * n_msgs, "message table")
        records = [MESSAGE.unpack_from(table, MESSAGE.size * i) for i in range(n_msgs)]
        if sum(r[1] + r[3] for r in records) > self.text_cap:
            return ERR_BAD_ARGUMENT
        messages = [{"role": self._bytes(rp, rl, "message role").decode("utf-8", "replace"),
                     "content": self._bytes(cp, cl, "message").decode("utf-8", "replace")}
                    for rp, rl, cp, cl in records]
        rendered = self.tokenizer.render_chat_spans(messages,
                                                    add_generation_prompt=bool(add_generation_prompt))
        encoded = rendered.text.encode()
        self.rendered = (encoded, rendered)  # tokenize() of these bytes keeps the contents plain text
        self._write(out_ptr, out_cap, encoded, "prompt text")
        return len(encoded)

    def _logits_target(self, logits_ptr: int) -> torch.Tensor | None:
        if not logits_ptr:
            return None
        return self._view(logits_ptr, self.vocab, torch.float32, "logits")

    def _run(self, ids: torch.Tensor | list[int], logits_ptr: int) -> int:
        if self.budget is not None:
            self.budget.forward(len(ids), "prefill" if len(ids) > 1 else "decode")
        out = self._logits_target(logits_ptr)
        t0 = time.perf_counter()
        scheduler, slot = self.context.scheduler, self.context.slot
        try:
            if isinstance(ids, list) and len(ids) == 1 and scheduler is not None:
                logits = scheduler.decode(ids[0], slot)  # batched with others
            elif isinstance(ids, list) and len(ids) == 1:  # one decode step (a CUDA graph replay on GPU)
                logits = self.engine.decode_step(ids[0], slot, logits_out=out)
            else:
                logits = self.engine.prefill(ids, slot, logits_out=out)
        except ContextOverflow:
            return ERR_CONTEXT_FULL
        rows = scheduler.rows_of.get(slot, 1) if scheduler is not None and len(ids) == 1 else 1
        self.took_step(len(ids), logits, out, time.perf_counter() - t0, rows)
        return OK

    @property
    def queued_tokens(self) -> int:
        """v2: prompt tokens on_message queued that the engine loop has not run yet."""
        return len(self.queued)

    def clear_queue(self) -> None:
        self.queued = NO_IDS

    def run_queued(self, chunk: int) -> int:
        """v2, for the engine loop: prefill up to `chunk` of the queued prompt ids now; a status.
        Logits (after the last chunk) go where on_message asked."""
        ids, self.queued = self.queued[:chunk], self.queued[chunk:]
        status = self._run(ids, self.logits_ptr if not len(self.queued) else 0)
        if status != OK:
            self.clear_queue()
        return status

    def take_queued(self) -> list[int]:
        """v2, for the engine loop: all the queued prompt ids, which its next step appends (then
        took_prompt)."""
        ids, self.queued = self.queued, NO_IDS
        return ids.tolist()

    def took_prompt(self, n_tokens: int, result: torch.Tensor | BaseException, seconds: float,
                    rows: int) -> int:
        """v2: the step that appended the queued prompt ended with `result` (its last logits, which
        go where on_message asked, or its error); a status, as run_queued's."""
        if isinstance(result, ContextOverflow):
            return ERR_CONTEXT_FULL
        if isinstance(result, BaseException):
            raise result
        self.took_step(n_tokens, result, self._logits_target(self.logits_ptr), seconds, rows)
        return OK

    def took_step(self, n_tokens: int, logits: torch.Tensor, out: torch.Tensor | None, seconds: float,
                  rows: int = 1) -> None:
        """Record a forward that appended n_tokens to this actor's slot (stats, ledger) and keep its
        logits for sample(). `out`: the guest buffer the logits were asked into (written here if the
        forward did not compute them there); rows: the batched step's rows."""
        self.record_forward(n_tokens, seconds, rows, self.engine.kv_len(self.context.slot))
        self.keep_logits(logits, out)

    def record_forward(self, n_tokens: int, seconds: float, rows: int, kv_len: int) -> None:
        """took_step's stats and ledger (the engine loop records a decode row's after its next launch)."""
        context, engine = self.context, self.engine
        context.stats.on_forward(n_tokens, seconds, kv_len)
        for transfer in (engine.input_transfer(n_tokens, rows), engine.output_transfer(n_tokens, rows)):
            if transfer is not None:
                context.ledger.copy(*transfer)

    def keep_logits(self, logits: torch.Tensor, out: torch.Tensor | None, record: bool = True) -> int:
        """took_step's logits: kept for sample(), and written to the guest's buffer `out` if asked.
        Which crossing it was (LOGITS_KEPT, LOGITS_IN_PLACE, LOGITS_COPIED), recorded in the ledger
        unless record=False (the engine loop counts its rows' and records them with record_rows)."""
        if out is None:
            self.last_logits = logits
            return LOGITS_KEPT
        # Zero copies only if the engine computed into the buffer and the result is that buffer in
        # guest memory (pointers compared, not assumed).
        same = logits.data_ptr() == out.data_ptr()
        if same and self.engine.logits_in_place and self.context.region.holds(logits):
            kept = LOGITS_IN_PLACE
        else:
            if not same:
                out.copy_(logits)
            kept = LOGITS_COPIED
        self.last_logits = out  # sample() reads the guest's buffer as the guest left it
        if record:
            self.record_rows(0, 0.0, {}, int(kept == LOGITS_IN_PLACE), int(kept == LOGITS_COPIED), 0)
        return kept

    def record_rows(self, rows: int, seconds: float, moved: dict[str, list[int]], in_place: int,
                    copied: int, choices: int) -> None:
        """What the engine loop counted of one turn's decode rows, recorded when it ends (as
        record_forward, keep_logits and give_choice record one at a time): `rows` one-token forwards
        taking `seconds`, the transfers they made ({boundary: [calls, bytes]}), logits computed in
        the guest's buffer (in_place) or copied there, and host choices written to the guest."""
        stats, ledger = self.context.stats, self.context.ledger
        stats.forwards += rows
        stats.forward_s += seconds
        for name, (calls, nbytes) in moved.items():
            ledger.copied(name, calls, calls, nbytes)
        row = 4 * self.vocab
        ledger.shared("engine→guest logits (computed in place)", in_place, row * in_place)
        if copied:
            e = self.engine
            source = f"{e.device.type}, {str(e.dtype)[6:]} engine, {e.weights} weights"
            ledger.copied(f"engine→guest logits (written from {source})", copied, copied, row * copied)
        ledger.copied(CHOICE_CROSSING, choices, choices, 4 * choices)
        if self.budget is not None:  # (charged, not checked: each choice came with a forward, counted)
            self.budget.spent += (CALL_OVERHEAD + 4) * choices

    def step_target(self) -> torch.Tensor | None:
        """v2: the guest buffer each decode step's logits go to (None: the host keeps them)."""
        return self._logits_target(self.logits_ptr)

    def prefill(self, ids_ptr: int, n: int, logits_ptr: int) -> int:
        n = self._length(n)
        if not n:
            return ERR_BAD_ARGUMENT
        if n > self.engine.max_seq_len:
            return ERR_CONTEXT_FULL
        self.budget.spend(4 * n, "prompt ids")
        view = self._view(ids_ptr, n, torch.int32, "token ids")
        context = self.context
        if context.region.holds(view):  # the engine reads the guest's own bytes
            context.ledger.share("guest→engine prompt ids", 4 * n)
        else:
            context.ledger.copy("guest→engine prompt ids", 4 * n)
        ids = view.numpy()
        if int(ids.min()) < 0 or int(ids.max()) >= self.vocab:
            return ERR_BAD_TOKEN
        if self.version >= 2 and not self.preparing:
            raise GuestHostCallError("prefill() is for on_message in ABI v2 (the engine loop runs it); "
                                     "on_token returns the next token instead")
        # int32 guest ids -> int64 for the embedding: a conversion the ledger shows (v2: the copy the
        # engine loop keeps until it runs them).
        t = time.perf_counter()
        wide = torch.from_numpy(ids.astype(np.int64))
        context.ledger.copy("prompt ids int32→int64", 8 * n, seconds=time.perf_counter() - t)
        if context.slot is not None and self.engine.kv_holds(context.slot):  # a handed-over slot (adopt_slot)
            wide = self._reuse(wide)
        if self.version >= 2:
            return self._queue(wide, logits_ptr)
        return self._run(wide, logits_ptr)

    def _reuse(self, ids: torch.Tensor) -> torch.Tensor:
        """The first prefill into a slot handed over with what it held (Engine.kv_hold): `ids` less the
        start the slot holds again (Engine.kv_reuse) instead of computing it. Only into an empty slot with
        nothing queued: anything else and what it held is dropped."""
        slot = self.context.slot
        if self.engine.kv_len(slot) or len(self.queued):
            self.engine.kv_drop_held(slot)
            return ids
        return ids[self.engine.kv_reuse(ids.numpy(), slot):]

    def _queue(self, ids: torch.Tensor, logits_ptr: int) -> int:
        """v2 prefill: the ids wait for the engine loop."""
        if self.engine.kv_len(self.context.slot) + len(self.queued) + len(ids) > self.engine.max_seq_len:
            return ERR_CONTEXT_FULL
        self._logits_target(logits_ptr)  # a bad buffer fails now, not in the loop
        self.queued = torch.cat([self.queued, ids]) if len(self.queued) else ids
        self.logits_ptr = logits_ptr
        return OK

    def decode(self, token: int, logits_ptr: int) -> int:
        if self.version >= 2:
            raise GuestHostCallError("decode() is ABI v1; a v2 guest returns its next token from on_token")
        token = as_i32(token)
        if not 0 <= token < self.vocab:
            return ERR_BAD_TOKEN
        self.context.stats.on_decode(token)
        return self._run([token], logits_ptr)

    def sample(self, params_ptr: int) -> int:
        if self.sampled_at is not None:
            words, i = self.sampled_at
            words[i] = 1
        if self.last_logits is None:
            raise GuestHostCallError("sample() was called before any prefill or decode in this message "
                                     "(logits are forgotten at each new message)")
        if params_ptr:
            t, k, p = SAMPLING.unpack(self._struct(params_ptr, SAMPLING, 4, "sampling params"))
            try:
                params = SamplingParams(t, k, p, 0)
            except InvalidSamplingParams:
                return ERR_BAD_ARGUMENT
        else:
            params = self.context.request.params
        t = time.perf_counter()
        context = self.context
        # The forward's own greedy choice, unless the logits are in guest memory (the guest may have
        # changed them: the draw is from the bytes as it left them).
        in_guest = context.region.holds(self.last_logits)
        chosen = self.engine.greedy_token(context.slot) if params.greedy and not in_guest else None
        if chosen is not None:  # chosen in the batched forward and already read back with it
            token = chosen
            context.ledger.copy(f"sampled token {self.last_logits.device.type}→host (readback, "
                                "with the batched step)", 8, seconds=time.perf_counter() - t)
        else:
            if not _samplable(self.last_logits):
                return ERR_BAD_ARGUMENT
            token = sample_token(self.last_logits, params, context.generator)
            if self.last_logits.device.type != "cpu":  # the chosen id is read back to the host
                context.ledger.copy(f"sampled token {self.last_logits.device.type}→host (readback)", 8,
                                    seconds=time.perf_counter() - t)
        context.stats.on_sample(token, token in self.tokenizer.eos_ids)
        return token

    def request(self, out_ptr: int) -> int:
        r = self.context.request
        p = r.params
        if out_ptr % 8:
            raise GuestPointerError(f"request: pointer {out_ptr} is not 8-byte aligned")
        self._write(out_ptr, REQUEST.size,
                    REQUEST.pack(r.max_tokens, p.temperature, p.top_k, p.top_p, p.seed), "request")
        return OK

    def system(self, out_ptr: int, cap: int) -> int:
        if (cap := self._length(cap)) is None:
            return ERR_BAD_ARGUMENT
        data = self.context.system_prompt.encode()
        self._write(out_ptr, cap, data, "system prompt")
        return len(data)

    def kv_truncate(self, n: int) -> int:
        if self.version >= 2 and (not self.preparing or len(self.queued)):
            return ERR_BAD_ARGUMENT  # v2: only in on_message, before prefill queues anything
        n = as_i32(n)
        if not 0 <= n <= self.engine.kv_len(self.context.slot):
            return ERR_BAD_ARGUMENT
        self.engine.kv_truncate(n, self.context.slot)
        return OK

    def emit(self, ptr: int, length: int) -> int:
        if (length := self._length(length)) is None:
            return ERR_BAD_ARGUMENT
        context = self.context
        context.stats.emit_calls += 1
        data = self._bytes(ptr, length, "emitted text")
        if self.tokens_to is not None:  # (its text is made by the stream's reader, in order with tokens)
            self.tokens_to.emit(data)
            if data:
                context.stats.on_emit()
            return 1 if context.stop_requested else 0
        text = self.utf8.decode(data)
        if text:
            context.stats.on_emit()
            context.on_text(text)
        return 1 if context.stop_requested else 0

    def choice_at(self, ptr: int) -> int:
        """v2, in on_message: before each on_token of the turn, write the host's choice (give_choice)
        at ptr (an int32); 0: no more."""
        if self.version < 2 or not self.preparing:
            return ERR_BAD_ARGUMENT
        if not ptr:
            self.choice, self.choice_address = None, 0
            return OK
        if ptr % 4:
            raise GuestPointerError(f"choice: pointer {ptr} is not 4-byte aligned")
        region = self.context.region
        try:
            region.check(ptr, 4)
        except OutOfBounds as e:
            raise GuestPointerError(f"choice: guest pointer {e}") from None
        self.choice = region.numpy(ptr, 1, np.int32)  # the region never moves or shrinks
        self.choice_address = self.choice.ctypes.data
        return OK

    def give_choice(self, token: int, write: bool = True, record: bool = True) -> None:
        """Write the host's choice for this step where choice_at asked (the loop calls it before
        on_token); write=False: spent here, written by the caller (floe.wasm.rows, natively);
        record=False: the caller counts it for record_rows (which charges the budget for it)."""
        if write:
            self.choice[0] = token
        if record:
            self.budget.spend(4, "choice")
            self.context.ledger.copy(CHOICE_CROSSING, 4)

    def stream_tokens(self, on: int) -> int:
        """v2, in on_message: the host streams the text of each token on_token returns (1) or not (0)."""
        if self.version < 2 or not self.preparing or on not in (0, 1):
            return ERR_BAD_ARGUMENT
        self.streams = bool(on)
        return OK

    def stream(self, token: int) -> None:
        """v2 with stream_tokens: the text of a token on_token returned, to the caller (as emit) —
        none for a special token (a control token's text, e.g. "<|im_start|>", is not reply text); the
        token itself where the message streams token ids (tokens_to)."""
        data = self.tokenizer.reply_bytes(token)
        self.budget.spend(len(data), "streamed text")
        context = self.context
        context.stats.emit_calls += 1
        if self.tokens_to is not None:  # the token, not its text (floe.actor.stream)
            self.tokens_to.append(token)
            if data:
                context.stats.on_emit()
            return
        if text := self.text_of(data):
            context.stats.on_emit()
            context.on_text(text)

    def text_of(self, data: bytes) -> str:
        """The text a token's (or an emit's) bytes add to the reply, through the reply's UTF-8 decoder."""
        if self.utf8.buffer:  # (the incremental decoder holds part of a character)
            return self.utf8.decode(data)
        try:  # (a whole token's text: as the incremental decoder would give it, without its Python)
            return data.decode()
        except UnicodeDecodeError:  # (part of a character, or bytes that are none)
            return self.utf8.decode(data)

    def log(self, ptr: int, length: int) -> int:
        if (length := self._length(length)) is None:
            return ERR_BAD_ARGUMENT
        line = self._bytes(ptr, length, "log")[:LOG_LINE_BYTES].decode("utf-8", "replace")
        self.context.logs.append(line)  # a deque: the last LOG_LINES_KEPT lines
        return OK


def _samplable(logits: torch.Tensor) -> bool:
    """Logits a distribution can be drawn from: no NaN, no +inf, and not every token masked (-inf).
    One pass: the maximum propagates a NaN, is +inf if any is, and -inf only if all are."""
    return math.isfinite(float(logits.max()))
