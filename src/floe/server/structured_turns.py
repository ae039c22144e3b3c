"""Structured turns of `floe serve`'s sessions (docs/SERVER.md, "Structured output and tools").

A request with `response_format` or `tools` is answered by a grammar-guest actor made for that one turn
in a KV slot of its own, loaded with the session's conversation (on_history); the session's own actor
(the chat guest) then takes the turn as the client received it as history (SessionStore.append). So
the session keeps exactly what its client received, and its next plain message prefills only that
turn. Grammar actors start from one primed state (the guest's vocabulary index read once per server,
~1 s; a restore is ~10 ms of memory copy) instead of reading the vocabulary each turn.

A structured turn reuses the KV cache as a plain turn does: its actor's slot is loaded with a copy of
what the session's KV cache holds (a memory copy, not a forward), and the guest is told those token ids
(its header's " kv" list), so it prefills only what they lack: it keeps every one of them where the
conversation goes on from their text, earlier replies as the model wrote them (docs/GUESTS.md, "What a
turn reuses"), and has the host tokenize only the text after them. After a structured turn the session's
own slot does not hold it (the chat guest takes it as history); so the grammar actor's KV prefix, its ids
and the conversation as it rendered it (the user's text with the schema or tools shown, the reply as
written) are kept for the session's next structured turn (at most a slot's worth of tokens in all,
the least recently used dropped first).

A schema the guest cannot compile, or a max_tokens no value of it fits in, is refused (400) before the
request takes a session or a slot: a grammar actor without a KV slot checks it (SchemaCheck, ~1 ms), so
a bad request gets its 400 however busy the server is, and costs no slot.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from floe.actor import Actor, ActorState, builtin_guest
from floe.actor.grammar import (
    STATUS_HEADER,
    IncompleteJSON,
    SchemaCheck,
    SchemaUnsupported,
    budget_refusal,
    instructed,
    reported,
    schema_refusal,
    schema_text,
)
from floe.engine import SamplingParams
from floe.errors import FloeError
from floe.server.protocol import ServeError
from floe.server.sessions import Answer, Session, SessionStore
from floe.server.structured import Constraint, outcome, tools_system_text
from floe.wasm import GuestError, default_runtime


@dataclass
class HeldKV:
    """A KV prefix to load into a grammar actor's slot: its token ids, k and v per layer."""

    ids: list[int]
    k: list[torch.Tensor]
    v: list[torch.Tensor]


@dataclass
class LastTurn:
    """What a session's last structured turn left: the session's messages then, the same conversation as
    the grammar actor rendered it, and its KV prefix (a copy)."""

    raw: list[dict]
    shown: list[dict]
    kv: HeldKV


class StructuredTurns:
    """Runs the structured turns of `store`'s sessions on grammar-guest actors."""

    def __init__(self, store: SessionStore) -> None:
        self.store = store
        self.tokenizer = store.engine.tokenizer
        self.module = default_runtime().compile(builtin_guest("grammar"))
        self._primed: ActorState | None = None
        self._priming = threading.Lock()
        self.schemas = SchemaCheck(store.engine, self.module)
        self._last: OrderedDict[str, LastTurn] = OrderedDict()  # by session key, least recent first
        self._last_lock = threading.Lock()

    def check(self, c: Constraint, max_tokens: int) -> None:
        """A ServeError (400) if the grammar guest would refuse `c`'s schema or `max_tokens` for it;
        takes no KV slot, so call it before the request takes one."""
        if (refusal := self.schemas.refusal(c.guest_schema(), max_tokens)) is not None:
            raise _refused(c, refusal)

    def close(self) -> None:
        self.schemas.close()

    def shown(self, text: str, c: Constraint) -> str:
        """The user's text as the grammar actor shows it to the model: a response format's schema after
        it, or the tools where the chat template does not take a `tools` list (else the template shows
        them). In the user's message, not a system message: the conversation before it renders as the
        session's KV cache holds it, so the turn reuses that cache. (The mask enforces either way.)"""
        if c.mode == "json":
            return instructed(text, c.guest_schema())
        if self.tokenizer.uses_tools:
            return text
        return f"{text}\n\n{tools_system_text(c.tools, c.choice, c.parallel)}"

    def prompt(self, messages: list[dict], c: Constraint) -> list[dict]:
        """The conversation the grammar actor renders for `messages` (the last the user's), for the
        context check; rendered within `tokenizer.offering_tools(self.offered(c))`, as the actor renders
        it, a template that takes tools counts them with its own wording around them."""
        return [*messages[:-1], {"role": "user", "content": self.shown(messages[-1]["content"], c)}]

    def offered(self, c: Constraint) -> list[dict] | None:
        """The tools the chat template is given for `c` (OpenAI's form); None where it takes none (the
        tools are then in the user's text: shown)."""
        if c.mode == "tools" and self.tokenizer.uses_tools:
            return [{"type": "function", "function": t} for t in c.tools]
        return None

    def run(self, session: Session, history: list[dict], text: str, c: Constraint, *, max_tokens: int,
            params: SamplingParams, seed: int | None, on_text: Callable[[str], None] | None = None,
            should_stop: Callable[[], bool] = lambda: False) -> Answer:
        """Answer the (locked, live) session's user message `text`, after `history`, under `c`; the
        session keeps the turn as its client receives it (nothing of it if the client left). A schema
        the guest cannot compile is a 400 naming the keyword; the session is left as it was."""
        store, shown = self.store, self.shown(text, c)
        try:
            with store.extra_slot(session.owner, gone=should_stop):
                before, held = self._held(session)
                conversation = [*before, *history]
                actor = self._actor()
                try:
                    loaded = self._load(actor, held)
                    reply = self._send(actor, session, conversation, self._message(shown, c, loaded), c,
                                       max_tokens, params, seed, on_text, should_stop)
                    left = should_stop()
                    if not left:
                        turn = [*history, {"role": "user", "content": text},
                                {"role": "assistant", "content": outcome(c, reply.text).kept}]
                        as_shown = [*conversation, {"role": "user", "content": shown},
                                    {"role": "assistant", "content": reply.text}]
                        self._keep(session, LastTurn([*session.messages, *turn], as_shown, _copy(actor)))
                finally:
                    actor.close()
        except BaseException:
            store.abandon(session)
            raise
        if not left:
            store.append(session, turn)
        return Answer(reply.text, reply.stats, False, left)

    def _held(self, session: Session) -> tuple[list[dict], HeldKV]:
        """The conversation so far as the turn's actor shows it, and the KV prefix to load for it: the
        session's last structured turn's, if nothing came since; else the session's own slot's."""
        with self._last_lock:
            last = self._last.get(session.key)
            if last is not None and last.raw == session.messages:
                self._last.move_to_end(session.key)
                return last.shown, last.kv
        cache, slot = self.store.engine.cache, session.actor.slot
        if slot is None:
            return session.messages, HeldKV([], [], [])
        k, v = cache.export(slot)
        return session.messages, HeldKV(list(cache.tokens[slot]), k, v)

    def _load(self, actor: Actor, held: HeldKV) -> list[int]:
        """The actor's (empty) slot holds `held`'s KV prefix, copied; the ids it holds, for the guest."""
        cache = self.store.engine.cache
        if not held.ids or len(held.ids) != held.k[0].shape[1]:
            return []  # (not the prefix its ids say: nothing is loaded, the guest prefills all)
        load = cache.start_load(held.k, held.v)
        load.into(actor.slot, held.ids)
        if cache.k.device.type == "cuda":  # the engine loop's stream reads it next
            torch.cuda.current_stream(cache.k.device).synchronize()
        for boundary, nbytes in load.copies:
            actor.ledger.copy(boundary, nbytes)
        return held.ids

    def _keep(self, session: Session, last: LastTurn) -> None:
        """Keep `last` for the session's next structured turn: at most a slot's worth of tokens in all."""
        with self._last_lock:
            self._last.pop(session.key, None)
            self._last[session.key] = last
            held = sum(len(t.kv.ids) for t in self._last.values())
            while held > self.store.engine.max_seq_len and len(self._last) > 1:
                held -= len(self._last.popitem(last=False)[1].kv.ids)

    def _message(self, shown: str, c: Constraint, ids: list[int]) -> str:
        """The message the grammar guest reads: its header (the schema; the ids its KV cache holds, if
        any: docs/GUESTS.md), then the user's text as shown."""
        schema = schema_text(c.guest_schema())
        listed = "".join(f"{i} " for i in ids)
        head = "\0json" if schema is None else f"\0json-schema {len(schema.encode())}"
        kv = f" kv {len(listed)}" if listed else ""
        return f"{head}{kv}\n{schema or ''}{listed}{shown}"

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

        try:
            with self.tokenizer.offering_tools(self.offered(c)):
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


def _copy(actor: Actor) -> HeldKV:
    """A copy of the actor's KV prefix and its ids (its slot is freed once the turn ends)."""
    cache = actor.engine.cache
    k, v = cache.export(actor.slot)
    return HeldKV(list(cache.tokens[actor.slot]), [t.clone() for t in k], [t.clone() for t in v])


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
