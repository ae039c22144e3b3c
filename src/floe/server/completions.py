"""Text completions of `floe serve` (/v1/completions; docs/SERVER.md, "Text completions").

A prompt is continued as raw text, as OpenAI's and llama.cpp's /v1/completions continue it: no chat
template, the model's BOS first where its tokenizer adds one, special-token text in the prompt parsed
as its token (as llama.cpp's completion endpoint parses it). It runs in the sandbox like everything
else, on a one-shot actor of the `complete` guest (guests/complete.c) in a KV slot counted by the
session store for that request alone (SessionStore.extra_slot: the same slot accounting, wait queue and
per-key fairness as a session's request), and closed after it: no session, no snapshot.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass

from floe.actor import Actor, builtin_guest, complete_message
from floe.actor.stream import TokenStream
from floe.engine import SamplingParams
from floe.server.protocol import ServeError
from floe.server.sessions import Answer, SessionStore
from floe.server.stops import StopText
from floe.wasm import default_runtime


@dataclass
class Completion:
    """A text completion request checked against the engine (ServeCore.open), until ServeCore.run returns."""

    message: str  # what the complete guest reads: the sequence's start, a NUL, the prompt
    max_tokens: int
    params: SamplingParams
    seed: int  # the request's, or a random one
    stops: tuple[str, ...]
    owner: str
    session: None = None  # (a chat's Chat has its session; a completion has none)
    constraint: None = None


class TextCompletions:
    """Runs text completions on one-shot actors of the complete guest, in slots `store` counts."""

    def __init__(self, store: SessionStore) -> None:
        self.store = store
        self.engine = store.engine
        self.module = default_runtime().compile(builtin_guest("complete"))
        self.start = self.engine.tokenizer.sequence_start  # (a BOS that does not round-trip: refused now)

    def open(self, prompt: str, max_tokens: int | None, params: SamplingParams, seed: int | None,
             stops: tuple[str, ...], owner: str) -> Completion:
        """The completion of `prompt`, checked against the context (a 400 past it); takes no slot yet."""
        if not prompt and not self.start:
            raise ServeError(400, "prompt: an empty prompt gives the model nothing to continue",
                             param="prompt")
        n_ctx = self.engine.max_seq_len
        bound = len(prompt.encode()) + 17  # a token stands for at least one byte; BOS and a few more
        if bound + (max_tokens or 1024) > n_ctx:  # near the end: count exactly
            bound = len(self.engine.tokenizer.encode(prompt))
        room = n_ctx - bound
        if room < 1:
            raise ServeError(400, f"the prompt is {bound} tokens; this server's context holds {n_ctx}",
                             code="context_length_exceeded", param="prompt")
        max_tokens = max_tokens or min(room, 16)  # OpenAI's default for a completion: 16
        if max_tokens > room:
            raise ServeError(400, f"max_tokens {max_tokens} + the prompt's {bound} tokens exceed this "
                             f"server's context of {n_ctx}", code="context_length_exceeded",
                             param="max_tokens")
        return Completion(complete_message(self.engine.tokenizer, prompt), max_tokens, params,
                          secrets.randbits(63) if seed is None else seed, stops, owner)

    def run(self, c: Completion, on_text: Callable[[str], None] | None = None,
            should_stop: Callable[[], bool] = lambda: False, tokens: TokenStream | None = None) -> Answer:
        """Continue `c`'s prompt to an EOS, max_tokens or its first stop string (cut before it; on_text
        never sees any part of one). should_stop(): the client left; the row stops at its next token.
        tokens: the reply streamed as token ids instead of text (no stops: SessionStore.run's)."""
        if tokens is not None and (c.stops or on_text is not None):
            raise ValueError("a reply streamed as token ids has no stop strings and no on_text (they need "
                             "its text)")
        cut = StopText(c.stops)
        with self.store.extra_slot(c.owner, beside_session=False, gone=should_stop):
            actor = Actor(self.engine, self.module, seed=c.seed, loop=self.store.loop, continues_text=True)
            try:
                if tokens is not None:
                    reply = actor.send(c.message, max_tokens=c.max_tokens, params=c.params, tokens=tokens)
                    cut.text = reply.text
                else:
                    emit = cut.emitter(actor, on_text, should_stop)
                    reply = actor.send(c.message, max_tokens=c.max_tokens, params=c.params, on_text=emit,
                                       loop_safe=True)
            finally:
                actor.close()
        if (tail := cut.rest()) and on_text is not None:  # held back for a stop string that never came
            on_text(tail)
        return Answer(cut.text, reply.stats, cut.matched, should_stop())
