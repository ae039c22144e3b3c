"""A model's chat template rendered as transformers renders it: compiled in jinja2's sandbox with
transformers' filters and globals, and given the messages in the shape transformers gives them, so that
the prompt floe renders is the text the model was tuned on (floe.model.tokenizer.Tokenizer.render_chat
renders it, with a request's tools and variables)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from floe.errors import FloeError


class ChatTemplateError(FloeError):
    """The model's chat template raised an error, or the model has none."""


# The names a message's reasoning comes under; chat templates read the first (Qwen3's).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def template_messages(messages: Sequence[dict]) -> list[dict]:
    """`messages` as transformers hands them to a chat template: a key whose value is None dropped (an
    OpenAI message's content=None or tool_calls=None: templates test `is defined`), and the reasoning
    under any of its names copied to `reasoning_content` and `thinking`."""
    shown = []
    for message in messages:
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in _REASONING_FIELDS if k in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        shown.append(message)
    return shown


def compile_template(source: str) -> jinja2.Template:
    """`source` compiled as transformers' _compile_jinja_template compiles it, so that templates render
    identically; ChatTemplateError where it does not parse."""

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template does not parse: {e}") from e
