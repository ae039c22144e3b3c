"""A reply's text as Actor.send makes it: the pieces its guest's tokens and emits add (the reply's start
cut where the tokenizer's decode drops a space), kept for the Reply and given to the caller's on_text —
where the text is made (the engine loop's thread for a loop_safe on_text), or handed over in the caller's
thread. Handed over, the text is made there too where the reply streams into a TokenStream of the send's
own (the loop's native calls take its ids: no Python a token in the loop's thread; the loop wakes the
caller at each step's end where the stream grew); else the loop's thread makes it and wakes the caller
at each piece."""

from __future__ import annotations

import threading
import weakref
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from floe.actor.stream import Mark, TokenStream
from floe.wasm import GuestHostCallError
from floe.wasm.raw import describe

if TYPE_CHECKING:
    from floe.actor.host import GuestHost
    from floe.model.tokenizer import Tokenizer

_filling: weakref.WeakSet[Tokenizer] = weakref.WeakSet()  # the tokenizers fill_later() has started on
_filling_lock = threading.Lock()


def fill_later(tokenizer: Tokenizer) -> None:
    """Every token's reply bytes worked out in a thread of their own (Tokenizer.fill_reply_bytes: ~0.1 s
    once), where an engine loop runs several actors' turns: their later sends stream into TokenStreams of
    their own. A single actor (`floe run`) does not pay for it: its first token would wait ~0.1 s, its
    process hold ~5 MB more."""
    with _filling_lock:
        if tokenizer.reply_bytes_filled or tokenizer in _filling:
            return
        _filling.add(tokenizer)
    threading.Thread(target=tokenizer.fill_reply_bytes, name="floe-reply-bytes", daemon=True).start()


class ReplyText:
    """One send()'s text. handing: on_text is called in the caller's thread (hand()); own: the send's own
    TokenStream the text is made from (take()), or None."""

    def __init__(self, actor: GuestHost, on_text: Callable[[str], None] | None, handing: bool,
                 own: TokenStream | None) -> None:
        self.actor, self.on_text, self.handing, self.own = actor, on_text, handing, own
        self.parts: list[str] = []
        self.pieces: deque[str] = deque()  # made, not yet handed over
        self.woken = threading.Event()  # (set where the caller has something to hand over)
        self.starting = not actor.continues_text and actor.engine.tokenizer.strips_leading_space
        self.taken: Mark = (0, 0)  # what take() has read of `own`

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def collect(self, text: str) -> None:
        """A piece of the reply's text, where it is made."""
        if self.starting and text:
            self.starting = False
            if text[0] == " " and not (text := text[1:]):
                return
        self.parts.append(text)
        if self.handing:  # (from take() in the caller's thread, or the loop's: then the caller is woken)
            self.pieces.append(text)
            if self.own is None:
                self.woken.set()
        elif self.on_text is not None:
            self.on_text(text)

    def take(self) -> None:
        """The text of what the turn streamed into `own` since, collected (the caller's thread)."""
        if self.own is None:
            return
        items, self.taken = self.own.read(self.taken)
        reply_bytes, text_of = self.actor.engine.tokenizer.reply_bytes, self.actor.abi.text_of
        for item in items:
            if text := text_of(item if type(item) is bytes else reply_bytes(item)):
                self.collect(text)

    def hand(self) -> None:
        """What is made so far, to on_text (the caller's thread): an on_text that closed the actor gets
        no more; one that raises fails the message (its turn ends, the actor goes on)."""
        self.take()
        pieces, on_text = self.pieces, self.on_text
        while pieces and not self.actor.stop_requested:
            piece = pieces.popleft()
            try:
                on_text(piece)
            except Exception as e:
                raise GuestHostCallError(f"the caller's on_text failed: {describe(e)}") from e
