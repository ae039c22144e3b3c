"""Structured output: one message answered by the grammar guest as a JSON value its schema accepts.

The schema travels in the message itself (docs/GUESTS.md): a header `\\0json-schema <N>\\n` and N bytes of
JSON Schema before the user's text (`\\0json\\n`: any JSON value). The guest compiles it, masks every
step's logits in place and ends the turn when the value is whole; nothing of the grammar runs here.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from floe.actor.actor import Actor, Reply, builtin_guest
from floe.engine import Engine, SamplingParams
from floe.errors import FloeError
from floe.wasm import GuestError, GuestModule, GuestReportedError

GRAMMAR_EXPORT = "floe_grammar_version"
STATUS_HEADER = 20  # the guest refused a header (a lone NUL: after reading the vocabulary)
STATUS_SCHEMA = 21  # the guest could not compile the schema (its log line says why)
STATUS_BUDGET = 22  # no value of the schema fits in max_tokens (its log line says what would)


class SchemaUnsupported(FloeError, ValueError):
    """The grammar guest cannot compile this schema; the message names the keyword or the problem."""


class IncompleteJSON(FloeError):
    """A reply ended before its JSON value was whole (max_tokens below what the schema needs)."""


@dataclass
class StructuredReply:
    value: Any  # the reply parsed with json.loads
    reply: Reply

    @property
    def text(self) -> str:
        return self.reply.text


def schema_text(schema: dict | str | None) -> str | None:
    """The schema as compact JSON text (None: plain JSON mode)."""
    if schema is None or isinstance(schema, str):
        return schema
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)


def instructed(message: str, schema: dict | str | None) -> str:
    """The user's text with a sentence that shows the model the schema (the mask enforces it anyway)."""
    text = schema_text(schema)
    if text is None or text == '{"type":"object"}':
        return message + ("\n\nAnswer in JSON." if text is None else "\n\nAnswer with a JSON object.")
    return message + f"\n\nAnswer with JSON that matches this JSON Schema:\n{text}"


def grammar_message(message: str, schema: dict | str | None, *, instruct: bool = True,
                    fresh: bool = False) -> str:
    """The message the grammar guest reads: the header with the schema, then the user's text (with,
    if `instruct`, a sentence showing the model the schema: the mask enforces it either way); `fresh`:
    the guest forgets the conversation before this message."""
    text = schema_text(schema)
    if instruct:
        message = instructed(message, schema)
    new = " new" if fresh else ""
    if text is None:
        return f"\0json{new}\n{message}"
    return f"\0json-schema {len(text.encode())}{new}\n{text}{message}"


def reported(error: BaseException, status: int) -> bool:
    """Whether `error` is the guest's own report of failure with `status` (GuestReportedError)."""
    return isinstance(error, GuestReportedError) and error.status == status


def schema_refusal(actor: Actor, error: GuestError) -> SchemaUnsupported | None:
    """The grammar guest's refusal of a message's schema, naming the keyword (None: another failure)."""
    if reported(error, STATUS_SCHEMA) and actor.logs:
        return SchemaUnsupported(actor.logs[-1].removeprefix("grammar: "))
    return None


def budget_refusal(actor: Actor, error: GuestError) -> str | None:
    """The grammar guest's refusal of a max_tokens in which no value of the schema fits, saying how
    many bytes the shortest takes (None: another failure)."""
    if reported(error, STATUS_BUDGET) and actor.logs:
        return actor.logs[-1].removeprefix("grammar: ")
    return None


def grammar_actor(engine: Engine, **kwargs) -> Actor:
    """An actor running the built-in grammar guest (Actor's keyword arguments)."""
    return Actor(engine, builtin_guest("grammar"), **kwargs)


def send_json(actor: Actor, message: str, schema: dict | str | None = None, *, instruct: bool = True,
              fresh: bool = False, max_tokens: int = 512, params: SamplingParams | None = None,
              on_text: Callable[[str], None] | None = None) -> StructuredReply:
    """Send one message whose reply is a JSON value valid against `schema` (None: any JSON), after the
    conversation so far (`fresh`: as its first message); the grammar stays in force for the actor's
    plain send() calls until another is given."""
    if not actor.guest.has_function(GRAMMAR_EXPORT):
        raise FloeError(f"guest {actor.module.name} does not take a grammar: run the built-in one "
                        "(floe.actor.grammar_actor(engine), or builtin_guest('grammar'))")
    try:
        text = grammar_message(message, schema, instruct=instruct, fresh=fresh)
        reply = actor.send(text, max_tokens=max_tokens, params=params, on_text=on_text)
    except GuestError as e:
        if (refusal := schema_refusal(actor, e)) is not None:
            raise refusal from None
        if (short := budget_refusal(actor, e)) is not None:
            raise IncompleteJSON(f"no reply: {short}") from None
        raise
    try:
        return StructuredReply(json.loads(reply.text), reply)
    except json.JSONDecodeError as e:
        raise IncompleteJSON(f"the reply is not a whole JSON value ({e.msg} at byte {e.pos}; finish "
                             f"reason {reply.stats.finish_reason!r}): raise max_tokens above "
                             f"{max_tokens}") from None


class SchemaCheck:
    """Whether the grammar guest takes a schema and a max_tokens, asked of a grammar actor without a KV
    slot (Actor.precheck: the guest compiles the schema and checks the budget before it calls the
    model), so a request that cannot be answered is refused without waiting for a slot. One check at a
    time; each starts from the guest's state after reading the vocabulary (read once, ~1 s)."""

    def __init__(self, engine: Engine, module: str | Path | GuestModule, *, deadline_s: float = 30.0) -> None:
        self.engine, self.module, self.deadline_s = engine, module, deadline_s
        self._lock = threading.Lock()
        self._actor: Actor | None = None
        self._primed: tuple | None = None  # the guest's memory and globals with its vocabulary read

    def refusal(self, schema: dict | str | None, max_tokens: int) -> FloeError | None:
        """Why the grammar guest would refuse a message under `schema` with `max_tokens` (None: it
        would not); SchemaUnsupported names the keyword, IncompleteJSON says what max_tokens would do."""
        message = grammar_message("", schema, instruct=False)
        with self._lock:
            actor = self._ready()
            try:
                status = actor.precheck(message, max_tokens=max_tokens)
            except BaseException:
                self._drop()
                raise
            line = actor.logs[-1].removeprefix("grammar: ") if actor.logs else f"status {status}"
        if status == STATUS_SCHEMA:
            return SchemaUnsupported(line)
        if status == STATUS_BUDGET:
            return IncompleteJSON(line)
        if status != 0:
            raise FloeError(f"the grammar guest failed a schema check with status {status}: {line}")
        return None

    def _ready(self) -> Actor:
        """The checking actor, in the guest's primed state (a new one if the last check grew its memory:
        guest memory cannot shrink)."""
        if self._actor is not None and self._actor.region.size != self._primed[0]:
            self._drop()
        if self._actor is None:
            actor = Actor(self.engine, self.module, kv_slot=False, deadline_s=self.deadline_s)
            try:
                if self._primed is None:
                    if actor.precheck("\0", max_tokens=1) != STATUS_HEADER:
                        raise FloeError("the grammar guest took a lone NUL as a header: it cannot be primed")
                    self._primed = (*actor.guest.capture_memory(), actor.guest.capture_globals())
            except BaseException:
                actor.close()
                raise
            self._actor = actor
        size, pages, data, globals_ = self._primed
        self._actor.guest.restore_memory(size, pages, data)
        self._actor.guest.restore_globals(globals_)
        return self._actor

    def _drop(self) -> None:
        if self._actor is not None:
            self._actor.close()
            self._actor = None

    def close(self) -> None:
        with self._lock:
            self._drop()
