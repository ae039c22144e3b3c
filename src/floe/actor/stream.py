"""A reply streamed as token ids (Actor.send's `tokens`): no text is made per token in the engine loop.

`floe serve` streams many replies at once: making each token's text (its bytes, the UTF-8 decoder, the
stop-string cut, the hand-over) in the engine loop's thread cost every other row its share of the GIL
each step. A TokenStream takes the tokens instead — the engine loop's native guest calls write them into
its id buffer without Python (floe.wasm.rows) — and whoever reads it (the serve core's flusher, which
sends them to the HTTP front processes) turns them into text elsewhere.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from floe.actor.host import GuestHost

Mark = tuple[int, int]  # what a reader has taken of a stream: (ids, emitted byte strings)


class TokenStream:
    """A reply's output in order: each token on_token returned (a token id: its text is the tokenizer's
    reply_bytes) and the bytes a guest emit()s. Together they are the reply's UTF-8 bytes, decoded as
    one stream ("replace" errors), as the text a send() without it hands to on_text.

    The ids are `ids[:count[0]]` (int32; count an int64 word the engine loop's native calls advance);
    each emitted byte string is kept with the number of ids streamed before it. Both only grow while the
    message runs: another thread reads them with read(). stop(): the message ends at its next token (its
    client left), whenever it is called."""

    __slots__ = ("ids", "count", "emitted", "stopped", "_actor")

    def __init__(self) -> None:
        self.ids = np.empty(64, np.int32)
        self.count = np.zeros(1, np.int64)
        self.emitted: list[tuple[int, bytes]] = []
        self.stopped = False
        self._actor: GuestHost | None = None

    @property
    def has_bytes(self) -> bool:
        """Whether a guest emitted bytes into it (else its items are all token ids)."""
        return bool(self.emitted)

    def reserve(self, n: int) -> None:
        """Room for n more ids without moving the buffer (before native calls write into it)."""
        need = int(self.count[0]) + n
        if need > len(self.ids):
            grown = np.empty(max(need, 2 * len(self.ids)), np.int32)
            grown[:len(self.ids)] = self.ids
            self.ids = grown

    def append(self, token: int) -> None:
        """One more token id (the engine loop's Python path; its native calls write ids[count] themselves)."""
        n = int(self.count[0])
        if n == len(self.ids):
            self.reserve(1)
        self.ids[n] = token
        self.count[0] = n + 1

    def emit(self, data: bytes) -> None:
        """Bytes a guest emitted, after the ids streamed so far."""
        self.emitted.append((int(self.count[0]), data))

    def read(self, mark: Mark = (0, 0)) -> tuple[list[int | bytes], Mark]:
        """The items after `mark` (ints: ids; bytes: emitted) in order, and the mark after them."""
        taken, emits = mark
        n = self.count.item()
        m = len(self.emitted)  # (after: one emitted since is at >= n, and the ids before it are written)
        if m == emits:  # (ids only since the mark: a serve core's flush of every stream, each step)
            return (self.ids[taken:n].tolist() if n > taken else []), (n if n > taken else taken, m)
        out: list[int | bytes] = []
        for at, data in self.emitted[emits:m]:
            if at > taken:
                out.extend(self.ids[taken:at].tolist())
                taken = at
            out.append(data)
        if n > taken:
            out.extend(self.ids[taken:n].tolist())
        return out, (max(n, taken), m)

    def reply_bytes(self, tokenizer) -> bytes:
        """The reply bytes of every item so far (a token's: tokenizer.reply_bytes): where a guest emitted
        none, its ids' looked up in one pass (Tokenizer.ids_reply_bytes: ~0.1 us a token, against ~1
        through a Python call each, at every reply's end in 64 sessions' threads)."""
        if not self.emitted:
            return tokenizer.ids_reply_bytes(self.ids[:int(self.count[0])].tolist())
        return reply_bytes(self.items, tokenizer.reply_bytes)

    @property
    def items(self) -> list[int | bytes]:
        """Every item so far, in order."""
        return self.read()[0]

    def stop(self) -> None:
        self.stopped = True
        actor = self._actor
        if actor is not None:
            actor.stop_requested = True

    def attach(self, actor: GuestHost) -> None:
        """The message `actor` is about to run writes here (after it cleared stop_requested)."""
        self._actor = actor
        if self.stopped:  # (stopped before: the message stops at once)
            actor.stop_requested = True


def reply_bytes(items: list[int | bytes], token_bytes) -> bytes:
    """The reply bytes of a TokenStream's items (token_bytes(id): a token's reply bytes)."""
    return b"".join(item if isinstance(item, bytes) else token_bytes(item) for item in items)
