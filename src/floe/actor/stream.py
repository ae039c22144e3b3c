"""A reply streamed as token ids (Actor.send's `tokens`): no text is made per token in the engine loop.

`floe serve` streams many replies at once: making each token's text (its bytes, the UTF-8 decoder, the
stop-string cut, the hand-over) in the engine loop's thread cost every other row its share of the GIL
each step. A TokenStream takes the tokens instead; whoever reads it (the serve core's flusher, which
sends them to the HTTP front processes) turns them into text elsewhere.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from floe.actor.actor import Actor


class TokenStream:
    """A reply's output in order: each token on_token returned (an int, a token id: its text is the
    tokenizer's reply_bytes) and the bytes a guest emit()s (bytes), appended by the message's threads.
    Together they are the reply's UTF-8 bytes, decoded as one stream ("replace" errors), as the text a
    send() without it hands to on_text. `items` only grows while the message runs: another thread reads
    `items[taken:]` and sees whole items. stop(): the message ends at its next token (its client left),
    whenever it is called."""

    __slots__ = ("items", "has_bytes", "stopped", "_actor")

    def __init__(self) -> None:
        self.items: list[int | bytes] = []
        self.has_bytes = False  # whether a guest emitted bytes into it (else items are all token ids)
        self.stopped = False
        self._actor: Actor | None = None

    def stop(self) -> None:
        self.stopped = True
        actor = self._actor
        if actor is not None:
            actor.stop_requested = True

    def attach(self, actor: Actor) -> None:
        """The message `actor` is about to run writes here (after it cleared stop_requested)."""
        self._actor = actor
        if self.stopped:  # (stopped before: the message stops at once)
            actor.stop_requested = True


def reply_bytes(items: list[int | bytes], token_bytes) -> bytes:
    """The reply bytes of a TokenStream's items (token_bytes(id): a token's reply bytes)."""
    return b"".join(item if isinstance(item, bytes) else token_bytes(item) for item in items)
