"""Structured turns of `floe serve`'s sessions (docs/SERVER.md, "Structured output and tools").

A request with `response_format` or `tools` is answered by a grammar-guest actor made for that one turn
in a KV slot of its own, loaded with the session's conversation (on_history); the session's own actor
(the chat guest) then takes the turn as the client received it as history (SessionStore.append). So
the session keeps exactly what its client received, and its next plain message prefills only that
turn. Grammar actors start from one primed state (the guest's vocabulary index read once per server,
~1 s; a restore is ~10 ms of memory copy) instead of reading the vocabulary each turn.

A schema the guest cannot compile, or a max_tokens no value of it fits in, is refused (400) before the
request takes a session or a slot: a grammar actor without a KV slot checks it (SchemaCheck, ~1 ms), so
a bad request gets its 400 however busy the server is, and costs no slot.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from floe.actor import Actor, ActorState, builtin_guest
from floe.actor.grammar import (
    STATUS_HEADER,
    IncompleteJSON,
    SchemaCheck,
    SchemaUnsupported,
    budget_refusal,
    grammar_message,
    instructed,
    reported,
    schema_refusal,
)
from floe.engine import SamplingParams
from floe.errors import FloeError
from floe.server.protocol import ServeError
from floe.server.sessions import Answer, Session, SessionStore
from floe.server.structured import Constraint, outcome, tools_system_text
from floe.wasm import GuestError, default_runtime


class StructuredTurns:
    """Runs the structured turns of `store`'s sessions on grammar-guest actors."""

    def __init__(self, store: SessionStore) -> None:
        self.store = store
        self.tokenizer = store.engine.tokenizer
        self.module = default_runtime().compile(builtin_guest("grammar"))
        self._primed: ActorState | None = None
        self._priming = threading.Lock()
        self.schemas = SchemaCheck(store.engine, self.module)

    def check(self, c: Constraint, max_tokens: int) -> None:
        """A ServeError (400) if the grammar guest would refuse `c`'s schema or `max_tokens` for it;
        takes no KV slot, so call it before the request takes one."""
        if (refusal := self.schemas.refusal(c.guest_schema(), max_tokens)) is not None:
            raise _refused(c, refusal)

    def close(self) -> None:
        self.schemas.close()

    def conversation(self, messages: list[dict], c: Constraint) -> list[dict]:
        """`messages` as the grammar actor holds them: with the tools in a system message, where the
        chat template does not take a `tools` list (else they are offered to the template)."""
        if c.mode != "tools" or self.tokenizer.uses_tools:
            return messages
        text = tools_system_text(c.tools, c.choice, c.parallel)
        if messages and messages[0]["role"] == "system":
            return [{"role": "system", "content": f"{messages[0]['content']}\n\n{text}"}, *messages[1:]]
        return [{"role": "system", "content": text}, *messages]

    def message(self, text: str, c: Constraint) -> str:
        """The user's message as the grammar guest reads it: the grammar's header first; a response
        format also shows the model its schema (the mask enforces it either way)."""
        return grammar_message(text, c.guest_schema(), instruct=c.mode == "json")

    def prompt(self, messages: list[dict], c: Constraint) -> list[dict]:
        """The whole conversation the grammar actor renders for `messages` (the last the user's)."""
        text = messages[-1]["content"]
        shown = instructed(text, c.guest_schema()) if c.mode == "json" else text
        return [*self.conversation(messages[:-1], c), {"role": "user", "content": shown}]

    def run(self, session: Session, history: list[dict], text: str, c: Constraint, *, max_tokens: int,
            params: SamplingParams, seed: int | None, on_text: Callable[[str], None] | None = None,
            should_stop: Callable[[], bool] = lambda: False) -> Answer:
        """Answer the (locked, live) session's user message `text`, after `history`, under `c`; the
        session keeps the turn as its client receives it (nothing of it if the client left). A schema
        the guest cannot compile is a 400 naming the keyword; the session is left as it was."""
        store = self.store
        conversation = self.conversation([*session.messages, *history], c)
        try:
            with store.extra_slot(session.owner):
                actor = self._actor()
                try:
                    reply = self._send(actor, session, conversation, self.message(text, c), c,
                                       max_tokens, params, seed, on_text, should_stop)
                finally:
                    actor.close()
        except BaseException:
            store.abandon(session)
            raise
        left = should_stop()
        if not left:
            kept = outcome(c, reply.text).kept
            store.append(session, [*history, {"role": "user", "content": text},
                                   {"role": "assistant", "content": kept}])
        return Answer(reply.text, reply.stats, False, left)

    def _send(self, actor: Actor, session: Session, conversation: list[dict], message: str, c: Constraint,
              max_tokens: int, params: SamplingParams, seed: int | None, on_text, should_stop):
        # The session's generator goes on where it is (the grammar actor's draws do not advance it).
        actor.generator.set_state(session.actor.generator.get_state())
        if seed is not None:
            actor.generator.manual_seed(seed)
        for m in conversation:
            actor.add_history(m["role"], m["content"])

        def emit(piece: str) -> None:
            if should_stop():
                actor.stop_requested = True
            if on_text is not None:
                on_text(piece)

        offered = [{"type": "function", "function": t} for t in c.tools] if (
            c.mode == "tools" and self.tokenizer.uses_tools) else None
        try:
            with self.tokenizer.offering_tools(offered):
                return actor.send(message, max_tokens=max_tokens, params=params, on_text=emit, loop_safe=True)
        except GuestError as e:  # (check() refuses these before the turn takes a slot)
            if (refusal := schema_refusal(actor, e)) is not None:
                raise _refused(c, refusal) from None
            if (short := budget_refusal(actor, e)) is not None:
                raise _refused(c, IncompleteJSON(short)) from None
            raise

    def _actor(self) -> Actor:
        """A grammar actor whose vocabulary index is read (the first one reads it; the rest restore)."""
        actor = Actor(self.store.engine, self.module, loop=self.store.loop)
        try:
            with self._priming:
                if self._primed is None:
                    self._primed = _prime(actor)
                    return actor
            actor.restore(self._primed)
        except BaseException:
            actor.close()
            raise
        return actor


def _refused(c: Constraint, refusal: FloeError) -> ServeError:
    """The 400 of a schema the grammar guest refuses (SchemaUnsupported), or of a max_tokens too small
    for any value of it (IncompleteJSON)."""
    if isinstance(refusal, SchemaUnsupported):
        param = "tools" if c.mode == "tools" else "response_format"
        return ServeError(400, f"{param}: the grammar guest cannot compile this schema: {refusal}",
                          code="unsupported_schema", param=param)
    return ServeError(400, f"{_what(c)} does not fit: {refusal}", code="max_tokens_too_small",
                      param="max_tokens")


def _what(c: Constraint) -> str:
    """What the reply of `c` must be, for a message."""
    if c.mode == "json":
        return "a reply valid against response_format"
    if c.choice == "auto":
        return "a reply (a call or a text answer)"
    return "a call of " + (c.choice if c.choice != "required" else " or ".join(t["name"] for t in c.tools))


def _prime(actor: Actor) -> ActorState:
    """The state of a grammar actor that has read its vocabulary and holds no conversation: the guest
    reads the vocabulary at its first message, before the header, so a header it refuses (a lone NUL)
    leaves exactly that (docs/GUESTS.md)."""
    try:
        actor.send("\0", max_tokens=1)
    except GuestError as e:
        if not reported(e, STATUS_HEADER):
            raise
    else:
        raise FloeError("the grammar guest took a lone NUL as a header: it cannot be primed")
    return actor.capture_state()
