"""A turn: one message of one actor as the engine loop runs it (floe.actor.loop), and how a turn ends.

A turn's per-token state (its next token, the host's choice, what it generated, ...) lives in a row of
its engine loop's TurnTable (one row per KV slot, int64 words), where the loop's native guest calls
(floe.wasm.rows.call_slots) read and write it without Python; Turn's properties read and write the same
words for the loop's Python path. A turn not yet in a loop keeps its row to itself.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import numpy as np
import torch

from floe.wasm import rows as guest_rows

if TYPE_CHECKING:
    from floe.actor.abi import HostABI
    from floe.actor.host import GuestHost, MessageContext
    from floe.wasm import GuestInstance

STOP = -1  # what on_token returns to end the turn
FED = -2  # Turn.speculated of a fed row whose token is not known yet (floe.actor.loop)
END_STOP, END_LENGTH, END_CONTEXT_FULL, END_CANCELLED = 0, 1, 2, 3
END_REASONS = {END_STOP: "stop", END_LENGTH: "length", END_CONTEXT_FULL: "context_full",
               END_CANCELLED: "cancelled"}

W = guest_rows.Col  # a row's words: floe.wasm.rows' layout
NONE = guest_rows.NONE


class TurnTable:
    """The per-token state of the turns of one engine loop: one row of guest_rows.WIDTH int64 words per
    KV slot (a turn's row is its actor's slot's), read and written by the native guest calls."""

    def __init__(self, slots: int) -> None:
        self.array = np.zeros((max(1, slots), guest_rows.WIDTH), np.int64)
        self.doubles = self.array.view(np.float64)  # (the double words: DEADLINE, ROWS_S)
        self.words, self.dwords = _views(self.array)  # (scalar access: ~5x numpy's)
        # The boundaries Col.IN_* and Col.OUT_* count (Engine.input_transfer / output_transfer's names)
        self.moved_names: list[str | None] = [None, None]
        # +1 whenever one of its turns ends or is done (Turn.end set, Turn.set_done): the loop keeps what
        # it derives from its live turns (EngineLoop._live: their list, slots, guests) until this changes.
        self.changes = 0


class Roster:
    """An engine loop's live turns as of one TurnTable.changes (EngineLoop._live), and what the loop's
    steps derive from them, made once for as long as no turn ends or arrives rather than at every step:
    their tuple, slots (int64, read-only), guests, draws (tuples: never changed in place); and facts that hold
    for every one of them once they hold (asked until they do, then kept): each has its call words
    (Turn.headed), none has a prompt queued (Turn.prompt: once taken, never queued again in a turn),
    each keeps no logits of its own (Turn.target None: set once, at its first decode row); those whose
    caller takes its reply's text in its own thread (Turn.wake)."""

    __slots__ = ("turns", "key", "slot_list", "slots", "guests", "draws", "drawing", "handing", "_headed",
                 "_prompted", "_targetless")

    def __init__(self, turns: tuple[Turn, ...], key: int) -> None:
        self.turns, self.key = turns, key
        self.slot_list = tuple(t.slot for t in turns)
        self.slots = np.array(self.slot_list, np.int64)
        self.slots.flags.writeable = False
        self.guests = tuple(t.guest for t in turns)
        self.draws = tuple(t.draws for t in turns)
        self.drawing = tuple(t for t in turns if t.draws)
        self.handing = tuple(t for t in turns if t.woken is not None)
        self._headed = self._prompted = self._targetless = False

    def headed(self) -> bool:
        if not self._headed:
            self._headed = all([t.headed for t in self.turns])
        return self._headed

    def prompted(self) -> bool:
        if not self._prompted:
            self._prompted = not any([t.prompt for t in self.turns])
        return self._prompted

    def targetless(self) -> bool:
        if not self._targetless:
            self._targetless = all([t.target is None for t in self.turns])
        return self._targetless


_NEW_ROW = np.zeros(guest_rows.WIDTH, np.int64)  # a turn's row before its first step: nothing yet
_NEW_ROW[[W.CHOICE, W.SPECULATED, W.NEXT_TOKEN]] = NONE


def _views(array: np.ndarray) -> tuple[memoryview, memoryview]:
    """int64 and float64 scalar views of an int64 array's words."""
    raw = memoryview(array).cast("B")
    return raw.cast("q"), raw.cast("d")


def _word(col: int, optional: bool = False, flag: bool = False) -> property:
    """A property of Turn backed by word `col` of its row (optional: NONE reads None; flag: a bool)."""
    if flag:
        def get(self):
            return bool(self._words[self._base + col])

        def put(self, value) -> None:
            self._words[self._base + col] = 1 if value else 0
    elif optional:
        def get(self):
            value = self._words[self._base + col]
            return None if value == NONE else value

        def put(self, value) -> None:
            self._words[self._base + col] = NONE if value is None else value
    else:
        def get(self):
            return self._words[self._base + col]

        def put(self, value) -> None:
            self._words[self._base + col] = value
    return property(get, put)


def _double(col: int) -> property:
    """A property of Turn backed by word `col` of its row, a double."""
    def get(self) -> float:
        return self._dwords[self._base + col]

    def put(self, value: float) -> None:
        self._dwords[self._base + col] = value
    return property(get, put)


class Turn:
    """One message of one actor, as the loop runs it. Its per-token state is in its TurnTable row
    (the properties below); the rest, read once a turn or on its rarer paths, in slots."""

    __slots__ = ("actor", "deadline", "speculated_at", "rng_before", "prompt", "_end", "error",
                 "abandoned", "calls_on_end", "done", "over", "woken", "abi", "context", "guest", "draws",
                 "target", "slot", "_row", "_words", "_dwords", "_base", "_moved_names", "headed", "decoded",
                 "_table", "_handed")

    generated = _word(W.GENERATED)  # tokens it generated
    max_tokens = _word(W.MAX_TOKENS)
    next_token = _word(W.NEXT_TOKEN, optional=True)  # to append in the next step
    fresh = _word(W.FRESH, flag=True)  # logits of a forward the guest has not seen yet
    # the host's choice for its fresh logits (argmax, or the draw asked of them)
    choice = _word(W.CHOICE, optional=True)
    takes_choice = _word(W.TAKES_CHOICE, flag=True)  # its guest's last token was the host's choice
    refused = _word(W.REFUSED, flag=True)  # its guest refused the last token its row was speculated with
    # the token in flight before its guest chose it (floe.actor.loop), or FED
    speculated = _word(W.SPECULATED, optional=True)
    sampled = _word(W.SAMPLED, flag=True)  # its guest called sample() in its last on_token
    # What its decode rows crossed, counted and recorded once it ends (HostABI.record_rows): one-token
    # forwards and their seconds, transfers (moved()), logits in place or copied into the guest's
    # buffer, host choices written to the guest.
    rows = _word(W.ROWS)
    rows_s = _double(W.ROWS_S)
    in_place = _word(W.IN_PLACE)
    copied = _word(W.COPIED)
    choices = _word(W.CHOICES)
    flying = _word(W.FLYING)  # its rows in launched forwards not yet finished (two when fed)

    def __init__(self, actor: GuestHost, max_tokens: int, deadline: float,
                 woken: threading.Event | None = None) -> None:
        self._table: TurnTable | None = None  # its loop's, once bound
        self.actor = actor
        self.deadline = deadline  # time.monotonic()
        self.speculated_at = 0  # that row's position in its KV slot
        self.rng_before: torch.Tensor | None = None  # its generator before a speculated row's draw
        self.prompt = True  # its prompt may still be queued (HostABI.queued_tokens is asked only then)
        self.end = None  # why it ended (END_*), once it has
        self.error: BaseException | None = None
        self.abandoned = False  # its caller stopped waiting (Ctrl-C): end it at the next step
        self.calls_on_end = False  # ended well: its caller calls its guest's on_end (GuestCalls.on_end)
        self.done = threading.Event()
        self.over = False  # done is set (read each step: an attribute, not a call)
        self.woken = woken  # its caller's, set at its end too (run's `deliver`)
        self._handed = 0  # its reply stream's items when its caller was last woken (wake())
        self.abi: HostABI = actor.abi
        self.context: MessageContext = actor.context  # (its message, slot, RNG: what its host calls see)
        self.guest: GuestInstance = actor.guest
        # Its steps draw its host choice (a guest that asked for it, sampling parameters): fixed for the
        # turn (on_message asked, the request's parameters).
        self.draws = self.abi.choice is not None and not self.context.request.params.greedy
        self.target: torch.Tensor | None | bool = False  # its decode rows' logits buffer (False: not asked)
        self.slot = self.context.slot
        self.headed = False  # its row's call words are made (floe.wasm.rows.head, at its first on_token)
        self._row = _NEW_ROW.copy()  # its own until bind()
        self._words, self._dwords = _views(self._row)
        self._base = 0
        self._moved_names: list[str | None] = [None, None]
        # The ids on_token returned, in order (a plain one written by the native calls): the message's
        # stats' decoded ids once it ends (settle()).
        # (room for every token it can generate: past the context's end none is appended)
        self.decoded = np.empty(min(max_tokens, actor.engine.max_seq_len) + 1, np.int32)
        w = self._words
        w[W.MAX_TOKENS], w[W.VOCAB], w[W.DRAWS] = max_tokens, self.abi.vocab, int(self.draws)
        w[W.DECODED_AT], w[W.DECODED_CAP] = self.decoded.ctypes.data, len(self.decoded)
        self._dwords[W.DEADLINE] = deadline

    @property
    def end(self) -> int | None:
        return self._end

    @end.setter
    def end(self, value: int | None) -> None:
        self._end = value
        if self._table is not None:  # (what its loop derived from its live turns is stale)
            self._table.changes += 1

    def bind(self, table: TurnTable) -> None:
        """Its row moves to `table` (its loop's, at the row of its slot): from the loop's thread, once
        the turn that held the slot before is gone from the loop."""
        table.array[self.slot], self._row = self._row, None
        words, base = table.words, self.slot * guest_rows.WIDTH
        self._words, self._dwords, self._base = words, table.dwords, base
        self._moved_names = table.moved_names
        self._table = table
        self.abi.sampled_at = (words, base + W.SAMPLED)

    def head(self) -> None:
        """Its row's call words (its guest's on_token, where its host choice goes, its watchdog), made
        at its first on_token through the native loop; its guest's regions and watchdog made fresh."""
        guest_rows.fresh(self.guest)
        words, base = self._words, self._base
        for col, value in zip(range(W.CONTEXT, W.WHEN_AT + 1),
                              guest_rows.heads([self.guest], "on_token", [self.abi.choice_address])[0],
                              strict=True):
            words[base + col] = value
        words[base + W.STREAMS] = int(self.abi.streams)
        stream, abi = self.abi.tokens_to, self.abi
        if stream is not None and abi.streams and abi.budget is not None:  # its ids streamed natively too
            stream.reserve(len(self.decoded))
            self.stream_moved()
            words[base + W.STREAM_N_AT] = stream.count.ctypes.data
            words[base + W.REPLY_LEN_AT] = abi.tokenizer.reply_lengths(abi.vocab).ctypes.data
            abi.budget.bind(words, base + W.ROOM, base + W.STREAMED)
        self.headed = True

    def decode(self, token: int) -> None:
        """A token on_token returned that the native calls did not take (the Python path)."""
        w, b = self._words, self._base
        n = w[b + W.N_DECODED]
        if n == len(self.decoded):  # (full: never by the context's bound; grown, and the row told)
            self.decoded = np.concatenate([self.decoded, np.empty(len(self.decoded), np.int32)])
            w[b + W.DECODED_AT], w[b + W.DECODED_CAP] = self.decoded.ctypes.data, len(self.decoded)
        self.decoded[n] = token
        w[b + W.N_DECODED] = n + 1

    @property
    def streaming(self) -> bool:
        """Whether its reply's ids are streamed by the native calls (head(), until settle())."""
        return self._words[self._base + W.STREAM_N_AT] != 0

    def stream_moved(self) -> None:
        """Its reply's TokenStream buffer as it is now (head(); after Python's stream grew it)."""
        stream = self.abi.tokens_to
        self._words[self._base + W.STREAM_IDS_AT] = stream.ids.ctypes.data
        self._words[self._base + W.STREAM_CAP] = len(stream.ids)

    def settle(self) -> None:
        """What the native calls took into its row goes to its message's stats (and budget): its decoded
        ids, and its streamed ids' counts, times and bytes."""
        w, b, stats = self._words, self._base, self.context.stats
        n = w[b + W.N_DECODED]
        if n:
            stats.decoded.extend(self.decoded[:n].tolist())
            w[b + W.N_DECODED] = 0
        if not self.streaming:
            return
        stats.emit_calls += w[b + W.EMIT_CALLS]
        stats.emits += w[b + W.EMITS]
        first, last = self._dwords[b + W.FIRST_TEXT], self._dwords[b + W.LAST_TEXT]
        if first and (not stats.first_text or first < stats.first_text):
            stats.first_text = first
        stats.last_text = max(stats.last_text, last)
        if self.abi.budget is not None:
            self.abi.budget.unbind()
        for col in (W.STREAM_IDS_AT, W.STREAM_N_AT, W.REPLY_LEN_AT, W.ROOM, W.STREAMED, W.EMIT_CALLS, W.EMITS,
                    W.FIRST_TEXT, W.LAST_TEXT, W.STREAM_CAP):
            w[b + col] = 0

    def moved(self) -> dict[str, list[int]]:
        """The transfers its decode rows made: {boundary: [calls, bytes]}."""
        w, b, out = self._words, self._base, {}
        words = ((W.IN_CALLS, W.IN_BYTES), (W.OUT_CALLS, W.OUT_BYTES))
        for name, (calls, nbytes) in zip(self._moved_names, words, strict=True):
            if name is not None and w[b + calls]:
                out[name] = [w[b + calls], w[b + nbytes]]
        return out

    def count_moved(self, moved: list[tuple[int, int, int]]) -> None:
        """One more decode row's transfers: (calls word, bytes word, bytes) each (EngineLoop._moved)."""
        w, b = self._words, self._base
        for calls, nbytes, n in moved:
            w[b + calls] += 1
            w[b + nbytes] += n

    def record(self) -> None:
        """Record what its decode rows crossed (counted since the last record) in its actor's stats
        and ledger."""
        rows, in_place, copied, choices = self.rows, self.in_place, self.copied, self.choices
        if rows or in_place or copied or choices:
            self.abi.record_rows(rows, self.rows_s, self.moved(), in_place, copied, choices)
            w, b = self._words, self._base
            for col in (W.ROWS, W.ROWS_S, W.IN_CALLS, W.IN_BYTES, W.OUT_CALLS, W.OUT_BYTES, W.IN_PLACE,
                        W.COPIED, W.CHOICES):
                w[b + col] = 0  # (0.0 as a double: the same bits)

    def wake(self) -> None:
        """At a step's end, for a turn whose caller takes its reply's text in its own thread (run's
        `deliver`, a reply streamed into a TokenStream): its caller woken if the stream grew."""
        stream = self.abi.tokens_to
        if stream is not None and (items := int(stream.count[0]) + len(stream.emitted)) != self._handed:
            self._handed = items
            self.woken.set()

    def finish(self, end: int, error: BaseException | None) -> None:
        """End now and wake its caller, unless a launched forward still has its row: then it ends
        (on_end is skipped for a failure) once that forward is taken (floe.actor.loop)."""
        self.end, self.error = end, error
        self.record()  # what its rows crossed (a row still in flight is undone, not recorded)
        if not self.flying:
            self.set_done()

    def set_done(self) -> None:
        self.settle()
        self.abi.sampled_at = None  # (its row is the slot's next turn's from now on)
        self.over = True
        if self._table is not None:
            self._table.changes += 1
        self.done.set()
        if self.woken is not None:
            self.woken.set()

