"""Structured output and tool calls of `floe serve` (docs/SERVER.md, "Structured output and tools"): what
a request's `response_format`, `tools` and `tool_choice` ask of the grammar guest, tool conversations
as the text messages the guests hold, and the guest's JSON replies as OpenAI content or `tool_calls`
(whole, or streamed as deltas). Used by the HTTP front and the engine core; imports nothing heavy.

A tool turn's reply is one JSON value the grammar guest writes compactly, in its schema's order:
`{"name":"<function>","arguments":{...}}` for a call, `[<call>,<call>,…]` for one or more calls
(parallel_tool_calls, OpenAI's default), and (tool_choice auto) a JSON string for a text answer: the
guest decides between them by its grammar (an anyOf), not the host. A named tool_choice, or
parallel_tool_calls false, asks for exactly one call.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from itertools import accumulate

from floe.server.protocol import ServeError

FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function's name (fullmatch)
CALL_HEAD = re.compile(r'\{"name":("(?:[^"\\]|\\.)*"),"arguments":')  # a call's text up to its arguments
NO_PARAMETERS = {"type": "object", "properties": {}}
ANY_OBJECT = {"type": "object"}  # response_format json_object: a JSON object at the top level
MAX_NESTING = 512  # levels of arrays and objects in a client's JSON: Python's json recurses per level
JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
NOT_BRACKET = re.compile(r"[^\[\]{}]+")
BRACKET_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}
DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})  # values, not schemas: no $ref in them
NAME_MAPS = frozenset({"properties", "$defs", "definitions"})  # their keys are names, not keywords


@dataclass(frozen=True)
class Constraint:
    """What the grammar guest enforces on a reply: `json` (schema None: any JSON value) or `tools`."""

    mode: str  # "json" or "tools"
    schema: dict | None = None  # json: the response's JSON Schema
    tools: tuple[dict, ...] = ()  # tools: the functions offered, {"name", "description", "parameters"}
    choice: str = "auto"  # tools: "auto", "required", or the one function's name
    parallel: bool = True  # tools: a reply may make several calls (a named choice makes one)

    def wire(self) -> dict:
        return {"mode": self.mode, "schema": self.schema, "tools": list(self.tools), "choice": self.choice,
                "parallel": self.parallel}

    @property
    def several(self) -> bool:
        """Whether the reply's calls are an array (one or more) rather than one call object."""
        return self.mode == "tools" and self.parallel and self.choice in ("auto", "required")

    @classmethod
    def from_wire(cls, value) -> Constraint:
        """The core's reading of the front's constraint, checked again (the core trusts no peer)."""
        if not isinstance(value, dict) or value.get("mode") not in ("json", "tools"):
            raise ServeError(400, "structured: not a constraint", param="response_format")
        check_nesting(value, "response_format" if value["mode"] == "json" else "tools")
        if value["mode"] == "json":
            schema = value.get("schema")
            if not (schema is None or isinstance(schema, dict)):
                raise ServeError(400, "response_format: the schema must be an object",
                                 param="response_format")
            return cls("json", schema)
        parallel = value.get("parallel", True)
        if not isinstance(parallel, bool):
            raise ServeError(400, "parallel_tool_calls: a boolean", param="parallel_tool_calls")
        return cls("tools", tools=checked_tools(value.get("tools")), choice=_choice_name(
            value.get("choice"), value.get("tools")), parallel=parallel)

    def guest_schema(self) -> dict | None:
        """The JSON Schema the grammar guest compiles for this reply (None: any JSON value)."""
        if self.mode == "json":
            return self.schema
        offered = self.tools if self.choice in ("auto", "required") else [
            t for t in self.tools if t["name"] == self.choice]
        at = "#/anyOf/1" if self.choice == "auto" else "#"  # where the call (or the array of calls) lies
        if self.several:
            calls = [call_schema(t, f"{at}/items/anyOf/{i}") for i, t in enumerate(offered)]
            reply = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
        elif len(offered) == 1:
            reply = call_schema(offered[0], at)  # the call is the whole reply
        else:
            reply = {"anyOf": [call_schema(t, f"{at}/anyOf/{i}") for i, t in enumerate(offered)]}
        return {"anyOf": [{"type": "string"}, reply]} if self.choice == "auto" else reply


def call_schema(tool: dict, root: str = "#") -> dict:
    """A call of `tool` at `root` of the reply's schema: its name, then arguments valid against its
    parameters (their local $refs, "#/$defs/…", pointed at where the parameters now lie)."""
    parameters = rebased(tool.get("parameters") or NO_PARAMETERS, root + "/properties/arguments")
    return {"type": "object", "properties": {"name": {"const": tool["name"]}, "arguments": parameters},
            "required": ["name", "arguments"]}


def rebased(schema: dict, base: str) -> dict:
    """A copy of `schema` whose local `$ref`s ("#…") point into it where it lies at `base` of a larger
    schema; walked without recursion (check_nesting bounds it first), data keywords left as they are."""
    copy = dict(schema)
    todo = [(copy, False)]  # (a dict or list of the copy, whether its keys are names, not keywords)
    while todo:
        node, names = todo.pop()
        for key, value in list(node.items() if isinstance(node, dict) else enumerate(node)):
            keyword = isinstance(node, dict) and not names
            if keyword and key == "$ref" and isinstance(value, str) and value.startswith("#"):
                node[key] = base + value[1:]
            elif isinstance(value, (dict, list)) and not (keyword and key in DATA_KEYWORDS):
                node[key] = dict(value) if isinstance(value, dict) else list(value)
                todo.append((node[key], keyword and key in NAME_MAPS))
    return copy


# ---- the request's fields ---------------------------------------------------------------------------

def constraint(response_format, tools, tool_choice, parallel_tool_calls=None) -> Constraint | None:
    """The constraint a chat request asks for (None: a plain reply), or a 400 saying what is wrong."""
    check_nesting(response_format, "response_format")
    check_nesting(tools, "tools")
    fmt = _response_format(response_format)
    offered = checked_tools(tools) if tools else ()
    choice = "auto" if tool_choice is None else tool_choice
    if offered:
        name = _choice_name(choice, tools)
        if name != "none":
            if fmt is not None:
                raise ServeError(400, "response_format with tools is not supported: send one of them",
                                 code="unsupported_parameter", param="response_format")
            return Constraint("tools", tools=offered, choice=name, parallel=parallel_tool_calls is not False)
    elif choice not in ("none", "auto"):
        raise ServeError(400, "tool_choice needs tools", param="tool_choice")
    return fmt


def _response_format(value) -> Constraint | None:
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json", ANY_OBJECT)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("name", ""), str):
            raise ServeError(400, "response_format.json_schema: an object with a name and a schema",
                             param="response_format")
        schema = spec.get("schema")
        if not (schema is None or isinstance(schema, dict)) or spec.get("strict") not in (None, True, False):
            raise ServeError(400, "response_format.json_schema: schema must be an object and strict a "
                                  "boolean", param="response_format")
        return Constraint("json", schema or None)
    raise ServeError(400, "response_format.type: one of text, json_object, json_schema",
                     param="response_format")


def checked_tools(tools) -> tuple[dict, ...]:
    """The functions of an OpenAI `tools` list, as {"name", "description", "parameters"}."""
    if not isinstance(tools, list) or not tools:
        raise ServeError(400, "tools: a list of functions", param="tools")
    out, names = [], set()
    for i, tool in enumerate(tools):
        fn = tool.get("function", tool) if isinstance(tool, dict) else None  # the core's own form: bare
        if not isinstance(fn, dict) or tool.get("type", "function") != "function":
            raise ServeError(400, f"tools[{i}]: a tool of type function with a function object",
                             param="tools")
        name, params, about = fn.get("name"), fn.get("parameters"), fn.get("description", "")
        if not (isinstance(name, str) and FUNCTION_NAME.fullmatch(name)) or name in names:
            raise ServeError(400, f"tools[{i}].function.name: letters, digits, _ and -, at most 64, "
                                  "each name once", param="tools")
        if not (params is None or isinstance(params, dict)) or not isinstance(about, str):
            raise ServeError(400, f"tools[{i}].function: parameters must be an object and description "
                                  "a string", param="tools")
        names.add(name)
        out.append({"name": name, "description": about, "parameters": params or NO_PARAMETERS})
    return tuple(out)


def _choice_name(choice, tools) -> str:
    """tool_choice as "none", "auto", "required" or the named function (which must be offered)."""
    if choice in ("none", "auto", "required"):
        return choice
    name = _function(choice).get("name") if isinstance(choice, dict) else choice
    offered = {_function(t).get("name") for t in tools or () if isinstance(t, dict)}
    if not isinstance(name, str) or name not in offered:
        raise ServeError(400, "tool_choice: none, auto, required or {\"type\": \"function\", \"function\": "
                              "{\"name\": <one of the tools>}}", param="tool_choice")
    return name


def _function(tool: dict) -> dict:
    """A tool's function object (OpenAI's {"type": "function", "function": {...}}, or the bare one)."""
    function = tool.get("function", tool)
    return function if isinstance(function, dict) else {}


def nesting(value, limit: int = MAX_NESTING) -> int:
    """Levels of lists and dicts in `value` (0: a scalar), counted without recursion up to limit + 1."""
    depth, level = 0, [value]
    while depth <= limit:
        level = [x for x in level if isinstance(x, (dict, list))]
        if not level:
            break
        depth += 1
        level = [y for x in level for y in (x.values() if isinstance(x, dict) else x)]
    return depth


def text_nesting(text: str) -> int:
    """Levels of arrays and objects in JSON text (its strings skipped), counted without parsing it."""
    brackets = NOT_BRACKET.sub("", JSON_STRING.sub("", text))
    return max(accumulate(map(BRACKET_STEP.__getitem__, brackets)), default=0)


def check_nesting(value, param: str) -> None:
    """A 400 for a client's JSON nested deeper than MAX_NESTING (Python's json would exhaust its stack),
    or holding a string that is not Unicode text (a lone surrogate, which JSON's \\ud800 escape lets in:
    the schema or tools shown to the model, or compiled by the grammar guest, were a 500 at its encoding)."""
    if nesting(value) > MAX_NESTING:
        raise ServeError(400, f"{param}: JSON nested deeper than {MAX_NESTING} levels", param=param)
    if not unicode_json(value):
        raise ServeError(400, f"{param}: a string that is not valid Unicode text (a lone surrogate)",
                         param=param)


def unicode_json(value) -> bool:
    """Whether every string of a JSON value (keys too) is valid Unicode text (no lone surrogate)."""
    try:
        json.dumps(value, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return False
    return True


class ArgumentsRefused(ValueError):
    """Tool-call arguments a session cannot keep as text."""


class NestedTooDeep(ArgumentsRefused):
    """Tool-call arguments nested deeper than MAX_NESTING levels."""


# ---- tool conversations as text messages ------------------------------------------------------------

def call_text(name: str, arguments) -> str:
    """A tool call as the text a session keeps: the grammar's form, its arguments in canonical compact
    JSON (clients send arguments back re-serialized: LangChain with spaces, so both sides canonicalize).
    Arguments nested deeper than MAX_NESTING raise NestedTooDeep before they are parsed."""
    if (text_nesting(arguments) if isinstance(arguments, str) else nesting(arguments)) > MAX_NESTING:
        raise NestedTooDeep(f"arguments nested deeper than {MAX_NESTING} levels")
    if isinstance(arguments, str):
        arguments = json.loads(arguments)
    if not unicode_json(arguments):  # (a \ud800 escape in the JSON: the session's text cannot be encoded)
        raise ArgumentsRefused("arguments holding a string that is not valid Unicode text (a lone surrogate)")
    return ('{"name":' + json.dumps(name) + ',"arguments":'
            + json.dumps(arguments, separators=(",", ":"), ensure_ascii=False) + "}")


def assistant_calls_text(i: int, calls) -> tuple[str, dict[str, str]]:
    """An assistant message's `tool_calls` as text (one call a line), and their names by call id."""
    lines, names = [], {}
    if not isinstance(calls, list):
        raise ServeError(400, f"messages[{i}].tool_calls: a list", param="messages")
    for call in calls:
        fn = call.get("function") if isinstance(call, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        try:
            if not isinstance(name, str):
                raise ValueError
            lines.append(call_text(name, fn.get("arguments") or "{}"))
        except ArgumentsRefused as e:
            raise ServeError(400, f"messages[{i}].tool_calls: {e}", param="messages") from None
        except (ValueError, TypeError):
            raise ServeError(400, f"messages[{i}].tool_calls: each a function with a name and JSON "
                                  "arguments", param="messages") from None
        if isinstance(call.get("id"), str):
            names[call["id"]] = name
    return "\n".join(lines), names


def tool_result_text(name: str, content: str) -> str:
    """A role tool message as the user message the guests hold (they take three roles)."""
    return f"The function {name} returned:\n{content}"


def tools_system_text(tools: tuple[dict, ...], choice: str, parallel: bool = True) -> str:
    """The tools, shown to a model whose chat template does not take them, in a system message."""
    listed = "\n".join(json.dumps({"name": t["name"], "description": t["description"],
                                   "parameters": t["parameters"]}, ensure_ascii=False) for t in tools)
    call = '{"name": <the function\'s name>, "arguments": <its arguments as a JSON object>}'
    if choice not in ("auto", "required"):
        return f"You can call these functions:\n{listed}\nCall the function {choice}: reply with only {call}."
    how = (f"reply with only a JSON array of calls, [{call}, …], one call for each thing the request needs"
           if parallel else f"reply with only {call}")
    if choice == "auto":
        rule = f"To call them, {how}; to answer in text instead, reply with the text as one JSON string."
    else:
        rule = f"Call {'one or more' if parallel else 'one'} of them: {how}."
    return f"You can call these functions:\n{listed}\n{rule}"


# ---- the reply ------------------------------------------------------------------------------------

@dataclass
class Outcome:
    """A structured reply read: its content (None for calls), its calls, the text the session keeps."""

    content: str | None
    calls: list[tuple[str, str]] = field(default_factory=list)  # (name, arguments as written)
    kept: str = ""
    whole: bool = True  # the value was complete (else max_tokens cut it: finish_reason length)

    @property
    def finish_reason(self) -> str:
        return "tool_calls" if self.calls else "stop" if self.whole else "length"


def outcome(c: Constraint, text: str) -> Outcome:
    """What the grammar guest's reply `text` says under `c`."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return Outcome(text, kept=text, whole=False)
    if c.mode == "tools" and isinstance(value, (dict, list)):
        stream = ToolStream()
        stream.feed(text)
        stream.end()
        if stream.calls and len(stream.calls) == (len(value) if isinstance(value, list) else 1):
            calls = [(name, "".join(parts)) for name, parts in stream.calls]
            kept = "\n".join(call_text(name, arguments) for name, arguments in calls)
            return Outcome(None, calls, kept)
    if c.mode == "tools" and isinstance(value, str):
        return Outcome(value, kept=value)
    return Outcome(text, kept=text)


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_calls(calls: list[tuple[str, str]]) -> list[dict]:
    return [{"id": call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}
            for name, arguments in calls]


class ToolStream:
    """A tool turn's streamed text as OpenAI deltas: a text answer (a JSON string) as content pieces;
    each call (one object, or the items of an array of them) as its own `index`, its id and name once
    the name is whole, then its arguments in pieces, as OpenAI sends them. Each character is read once
    (a reply costs linear time): a call's head is matched as it grows (it is short: a name is at most 64
    characters), its arguments are told from its closing brace by the nesting they are at."""

    def __init__(self) -> None:
        self.kind: str | None = None  # "text", "call" (one object) or "calls" (an array), from the first byte
        self.tail = ""  # text: raw not decoded yet (at most an escape's worth, then the new piece)
        self.opened = False  # text: its opening quote is read
        self.closed = False  # text: its closing quote has come
        self.depth = 0  # call(s): arrays and objects open, outside strings
        self.in_string = self.escaped = False
        self.head: str | None = None  # a call's text while its head (up to its arguments) is not whole
        self.in_arguments = False
        self.calls: list[tuple[str, list[str]]] = []  # (name, pieces of arguments) of each call begun

    def feed(self, piece: str) -> list[dict]:
        if self.kind is None and piece:
            self.kind = {'"': "text", "[": "calls"}.get(piece[0], "call")
        return self._text(piece) if self.kind == "text" else self._calls(piece)

    def end(self) -> list[dict]:
        """What the reply's end releases: nothing (every character is sent once it is read)."""
        return []

    def _text(self, piece: str) -> list[dict]:
        """The content decoded since the last piece: only raw past what was sent is parsed (each
        boundary lies between characters, outside any escape), so a reply costs linear time."""
        if self.closed:
            return []
        raw = self.tail + piece
        if not self.opened:  # the opening quote
            raw, self.opened = raw[1:], True
        new, used, self.closed = _string_prefix(raw)
        self.tail = raw[used:]
        return [{"content": new}] if new else []

    def _calls(self, piece: str) -> list[dict]:
        out: list[dict] = []
        level = 1 if self.kind == "calls" else 0  # the depth a call object opens at
        args: list[str] = []  # this piece's characters of the current call's arguments
        for ch in piece:
            if self.head is not None:
                self.head += ch
                if ch == ":" and (m := CALL_HEAD.fullmatch(self.head)):
                    name = json.loads(m.group(1))
                    self.calls.append((name, []))
                    head = {"name": name, "arguments": ""}
                    out.append({"tool_calls": [{"index": len(self.calls) - 1, "id": call_id(),
                                                "type": "function", "function": head}]})
                    self.head, self.in_arguments = None, True
                continue
            if self.in_string:
                self.in_string = self.escaped or ch != '"'
                self.escaped = not self.escaped and ch == "\\"
            elif ch == '"':
                self.in_string = True
            elif ch in "[{":
                self.depth += 1
                if ch == "{" and self.depth == level + 1 and not self.in_arguments:
                    self.head = "{"  # a call begins
                    continue
            elif ch in "]}":
                self.depth -= 1
                if self.in_arguments and self.depth == level:  # the call's own closing brace
                    self._flush(args, out)
                    self.in_arguments = False
                    continue
            if self.in_arguments:
                args.append(ch)
        self._flush(args, out)
        return out

    def _flush(self, args: list[str], out: list[dict]) -> None:
        """This piece's characters of the current call's arguments, as one delta."""
        if args:
            text = "".join(args)
            self.calls[-1][1].append(text)
            out.append({"tool_calls": [{"index": len(self.calls) - 1, "function": {"arguments": text}}]})
            args.clear()


def _string_prefix(raw: str) -> tuple[str, int, bool]:
    """(text, characters of raw it takes, whether the string closed) for the longest prefix of part
    of a JSON string's body (starting between characters, outside an escape) that ends between
    characters: never inside an escape, never after half of a surrogate pair."""
    escaped, closed = False, False
    for i, ch in enumerate(raw):  # up to its closing quote, if it has come
        if ch == '"' and not escaped:
            raw, closed = raw[:i], True
            break
        escaped = ch == "\\" and not escaped
    for cut in range(len(raw), max(-1, len(raw) - 13), -1):
        try:
            text = json.loads('"' + raw[:cut] + '"')
        except json.JSONDecodeError:
            continue
        if text and "\ud800" <= text[-1] <= "\udbff":
            continue
        return text, cut, closed and cut == len(raw)
    return "", 0, False
