"""The variables a request may give a chat template besides the conversation (OpenAI-style servers'
`chat_template_kwargs`, e.g. Qwen3's {"enable_thinking": false}): checked here, given to the template by
floe.model.tokenizer.Tokenizer.rendering_with."""

from __future__ import annotations

import json

from floe.errors import FloeError

# Names a chat template is given by the renderer itself (transformers' apply_chat_template: the
# conversation, the special tokens by name; the environment's globals): never a request's to set.
TEMPLATE_NAMES = frozenset({
    "messages", "tools", "documents", "add_generation_prompt", "bos_token", "eos_token", "unk_token",
    "pad_token", "sep_token", "cls_token", "mask_token", "additional_special_tokens", "raise_exception",
    "strftime_now", "range", "dict", "lipsum", "cycler", "joiner", "namespace"})
MAX_TEMPLATE_KWARGS = 16  # variables a request may give a chat template
MAX_TEMPLATE_KWARGS_BYTES = 4096  # their JSON, in all
MAX_TEMPLATE_KWARGS_DEPTH = 8  # lists and objects within a value


class TemplateKwargsError(FloeError):
    """Extra variables for a chat template (chat_template_kwargs) that cannot be given to it."""


def check_template_kwargs(value: object) -> dict:
    """`value` as a chat template's extra variables (a request's chat_template_kwargs): a JSON object of
    at most MAX_TEMPLATE_KWARGS identifiers, none a name the renderer sets (TEMPLATE_NAMES), whose
    values are JSON (nested at most MAX_TEMPLATE_KWARGS_DEPTH deep) of at most MAX_TEMPLATE_KWARGS_BYTES
    in all; else TemplateKwargsError says what is wrong."""
    if not isinstance(value, dict):
        raise TemplateKwargsError(f"an object of the template's variables, not {type(value).__name__}")
    if len(value) > MAX_TEMPLATE_KWARGS:
        raise TemplateKwargsError(f"{len(value)} variables; at most {MAX_TEMPLATE_KWARGS}")
    for key in value:
        if not (isinstance(key, str) and key.isascii() and key.isidentifier()):
            raise TemplateKwargsError(f"{str(key)[:40]!r} is not a name a template can read (an identifier)")
        if key == "self":  # (jinja2's Template.render(self, ...) cannot be given a variable of that name)
            raise TemplateKwargsError("'self' is a name the template renderer's own call takes; it cannot be "
                                      "a template variable")
        if key in TEMPLATE_NAMES:
            raise TemplateKwargsError(f"{key!r} is set by the renderer itself (the conversation, the tools, "
                                      "the special tokens), not by a request")
    stack = [(v, 1) for v in value.values()]
    while stack:  # (iterative: a value nested deep fails here, not in a recursion)
        item, depth = stack.pop()
        if isinstance(item, (list, dict)):
            if depth > MAX_TEMPLATE_KWARGS_DEPTH:
                raise TemplateKwargsError(f"a value nested more than {MAX_TEMPLATE_KWARGS_DEPTH} deep")
            if isinstance(item, dict) and not all(isinstance(k, str) for k in item):
                raise TemplateKwargsError("an object's keys are strings (JSON)")
            stack += [(v, depth + 1) for v in (item.values() if isinstance(item, dict) else item)]
        elif item is not None and not isinstance(item, (str, int, float)):
            raise TemplateKwargsError(f"a value of type {type(item).__name__} (JSON values only)")
    size = len(json.dumps(value))
    if size > MAX_TEMPLATE_KWARGS_BYTES:
        raise TemplateKwargsError(f"{size} bytes of JSON; at most {MAX_TEMPLATE_KWARGS_BYTES}")
    return value
