"""Prompt hints: `floe serve`'s HTTP front renders and tokenizes a chat's conversation in its own process
and sends both with the request; the engine core's chat guest then asks the host to render and tokenize
that very conversation, and the core answers from the hint (floe.model.tokenizer.Hint) instead of doing
the work on the thread every arrival and the engine loop share one GIL with (a message's render and
tokenize were ~45 % of its on_message on the core's side: bench/probes/arrival_cost.py).

A hint answers only a render of exactly its messages (as the guest holds them; with its request's
chat_template_kwargs, if any) and the tokenize of that render: any other conversation (a session whose
stored history differs, a guest that renders its own) is rendered and tokenized in the core as without
it. The front's tokenizer is the core's, sent by the
"tokenizer" call (Tokenizer.wire). A front is floe's own process (it checks every request): a hint it
sends is checked for shape and vocabulary, not recomputed."""

from __future__ import annotations

import asyncio
import base64
import logging

import numpy as np

from floe.model.tokenizer import ChatTemplateError, Hint, Rendered, Tokenizer
from floe.server.client import CoreClient

log = logging.getLogger("floe.serve")

INLINE_CHARS = 16_384  # a conversation up to this long is hinted on the front's event loop (~1 ms at most)
MESSAGE_CHARS = 64  # what a message counts for that, besides its text (the template renders each: 200,000
# empty messages took the event loop 4 s)


def wire(hint: Hint) -> dict:
    """A hint as JSON: the render's text and spans, the ids as base64 of little-endian int32s."""
    return {"text": hint.rendered.text, "spans": [list(s) for s in hint.rendered.spans],
            "ids": base64.b64encode(np.asarray(hint.ids, "<i4").tobytes()).decode()}


def from_wire(value: object, messages: list[dict], vocab: int, kwargs: dict | None = None) -> Hint | None:
    """The Hint of `messages` a request carries (wire()), rendered with the template's variables `kwargs`
    (the request's chat_template_kwargs, as the front made it), or None: none, or one not of that shape."""
    if not isinstance(value, dict):
        return None
    text, spans, ids = value.get("text"), value.get("spans"), value.get("ids")
    if not (isinstance(text, str) and isinstance(spans, list) and isinstance(ids, str)):
        return None
    at = 0
    for span in spans:
        if not (isinstance(span, list) and len(span) == 2 and all(type(x) is int for x in span)
                and at <= span[0] <= span[1] <= len(text)):
            return None
        at = span[1]
    try:
        raw = base64.b64decode(ids, validate=True)
    except ValueError:
        return None
    if len(raw) % 4:
        return None
    ids = np.frombuffer(raw, "<i4").tolist()  # (a prompt's few hundred: min and max of a list cost less)
    if not ids or min(ids) < 0 or max(ids) >= vocab:
        return None
    return Hint(messages, Rendered(text, tuple(tuple(s) for s in spans)), ids, kwargs)


class FrontHints:
    """The front's side: the core's tokenizer (asked once, at the front's start) and the hints it makes."""

    def __init__(self) -> None:
        self.tokenizer: Tokenizer | None = None
        self._failed = False  # a hint failed to be made once (logged once)

    async def load(self, client: CoreClient) -> None:
        """Make the core's tokenizer from its "tokenizer" call's answer, through `client` (a CoreClient;
        an answer of None: the core offers none, as a server of several models: no hints)."""
        try:
            answer = await client.call("tokenizer")
            if answer is not None:
                self.tokenizer = await asyncio.to_thread(Tokenizer.from_wire, answer)
        except Exception as e:  # noqa: BLE001 - without hints the core does the work, as before
            log.warning("prompt hints are off: the core's tokenizer could not be had here (%s: %s)",
                        type(e).__name__, e)

    async def make(self, messages: list[dict], kwargs: dict | None = None) -> dict | None:
        """The wire() of `messages`' hint, rendered with the template's variables `kwargs` (a request's
        chat_template_kwargs, checked), or None (no tokenizer, or a conversation its template refuses:
        the core says why)."""
        tokenizer = self.tokenizer
        if tokenizer is None:
            return None
        try:
            if sum(len(m["content"]) + MESSAGE_CHARS for m in messages) <= INLINE_CHARS:
                hint = tokenizer.hint(messages, kwargs)
            else:  # (long: off the event loop, as the core tokenizes long texts off its guest's thread)
                hint = await asyncio.to_thread(tokenizer.hint, messages, kwargs)
        except ChatTemplateError:
            return None
        except Exception as e:  # noqa: BLE001 - a hint only saves the core work: the request goes on
            if not self._failed:
                self._failed = True
                log.warning("a prompt hint could not be made (%s: %s); the core makes the prompt itself",
                            type(e).__name__, e)
            return None
        return wire(hint)
