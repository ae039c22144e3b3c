"""Structured output and tool calls of `floe serve`, driven by the official `openai` client on loopback:
response_format (json_object, json_schema, chat.completions.parse with a Pydantic model), tools with each
tool_choice, streamed tool-call deltas, role tool messages, the 400s; sessions keep what their client
received across plain and structured turns."""

from __future__ import annotations

import itertools
import json
import logging

import httpx
import openai
import pytest
from pydantic import BaseModel
from test_grammar import valid
from test_server import MODEL_ID, ThreadServer, client
from test_server_openai import stored

from floe.engine import Engine
from floe.server.app import create_app
from floe.server.protocol import ServeError
from floe.server.structured import Constraint, ToolStream, call_text, constraint

CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                         "country": {"type": "string", "maxLength": 20}},
        "required": ["city", "country"]}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 24}},
                   "required": ["zone"]}}}
TOOLS = [WEATHER, TIME]
BY_NAME_OF_TOOLS = {t["function"]["name"]: t for t in TOOLS}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]
CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]


class Capital(BaseModel):
    city: str
    country: str
    population: int


@pytest.fixture(scope="module")
def server(default_checkpoint, tmp_path_factory):
    folder = tmp_path_factory.mktemp("sessions")
    engine = Engine(default_checkpoint, max_seq_len=1024, n_slots=4, weights="native")
    s = ThreadServer(create_app(engine, snapshots=folder, model_id=MODEL_ID, idle_seconds=3600))
    s.folder = folder
    yield s
    s.stop()


def ask(c: openai.OpenAI, messages: list[dict], **kwargs):
    kwargs = {"model": MODEL_ID, "temperature": 0, "max_tokens": 64} | kwargs
    return c.chat.completions.create(messages=messages, **kwargs)


def schema_of(tool: dict) -> dict:
    return tool["function"]["parameters"]


def the_call(r) -> tuple[str, dict]:
    """The one tool call of a reply, checked against the tool it names."""
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    tool = {t["function"]["name"]: t for t in TOOLS}[call.function.name]
    arguments = json.loads(call.function.arguments)
    assert valid(arguments, schema_of(tool))
    return call.function.name, arguments


# ---- response_format ---------------------------------------------------------------------------------

def test_json_object_replies_are_json_objects(server):
    """json_object means an object at the top level (a bare string broke LangChain's json_mode)."""
    assert constraint({"type": "json_object"}, None, None).guest_schema() == {"type": "object"}
    for seed in range(3):
        r = ask(client(server.url), [{"role": "user", "content": "Say hello as one JSON string."}],
                response_format={"type": "json_object"}, temperature=1, seed=seed, max_tokens=32)
        assert isinstance(json.loads(r.choices[0].message.content), dict)
        assert r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("temperature", [0, 1])
def test_json_schema_replies_validate_against_their_schema(server, temperature):
    for seed in range(3):
        r = ask(client(server.url), CAPITAL, temperature=temperature, seed=seed, response_format={
            "type": "json_schema", "json_schema": {"name": "capital", "schema": CITY, "strict": True}})
        assert valid(json.loads(r.choices[0].message.content), CITY)
        assert r.choices[0].finish_reason == "stop"


def test_parse_with_a_pydantic_model(server):
    r = client(server.url).chat.completions.parse(model=MODEL_ID, messages=CAPITAL, temperature=0,
                                                  max_tokens=64, response_format=Capital)
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, Capital) and isinstance(parsed.population, int)


def test_a_streamed_structured_reply_is_the_same_json(server):
    fmt = {"type": "json_schema", "json_schema": {"name": "capital", "schema": CITY}}
    whole = ask(client(server.url), CAPITAL, response_format=fmt).choices[0].message.content
    chunks = ask(client(server.url), CAPITAL, response_format=fmt, stream=True)
    pieces = [ch.choices[0].delta.content or "" for ch in chunks if ch.choices]
    assert "".join(pieces) == whole


# ---- the 400s ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("stream", [False, True])
def test_a_schema_the_guest_cannot_compile_is_a_400_naming_the_keyword(server, stream):
    schema = {"type": "object", "properties": {"code": {"type": "string", "pattern": "^(?=A)[A-Z]{3}$"}}}
    body = {"model": MODEL_ID, "messages": CAPITAL, "stream": stream,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 400 and r.headers["x-should-retry"] == "false"
    error = r.json()["error"]
    assert "'pattern'" in error["message"] and error["param"] == "response_format"
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "n": {"type": "array", "contains": {"const": 3}}}, "required": ["n"]}}}
    with pytest.raises(openai.BadRequestError) as e:
        ask(client(server.url), CAPITAL, tools=[tool], tool_choice="required")
    assert "'contains'" in e.value.message


@pytest.mark.parametrize("fields", [
    {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "not_offered"}}},
    {"tool_choice": "required"},
    {"tools": [{"type": "function", "function": {"name": "has space"}}]},
    {"tools": TOOLS, "response_format": {"type": "json_object"}},
    {"response_format": {"type": "json_object"}, "stop": "}"},
    {"response_format": {"type": "yaml"}},
    {"tools": TOOLS, "tool_choice": {"type": "function", "function": "get_weather"}},  # not an object
    {"tools": TOOLS, "tool_choice": {"function": None}},
    {"tools": [*TOOLS, {"type": "function", "function": 3}], "tool_choice": "required"},
    {"tools": TOOLS, "messages": [*CAPITAL, {"role": "tool", "tool_call_id": ["x"], "content": "1"}]},
])
def test_a_malformed_structured_request_is_a_400(server, fields):
    r = httpx.post(f"{server.url}/v1/chat/completions",
                   json={"model": MODEL_ID, "messages": CAPITAL} | fields, timeout=60)
    assert r.status_code == 400 and r.headers["x-should-retry"] == "false", r.text


def test_a_tool_message_must_answer_an_earlier_call(server):
    messages = [*ASK_WEATHER, {"role": "tool", "tool_call_id": "call_nobody", "content": "sunny"}]
    with pytest.raises(openai.BadRequestError):
        ask(client(server.url), messages, tools=TOOLS)


def test_a_tools_parameters_may_refer_to_their_own_defs(server):
    """Pydantic writes nested models as $defs and "#/$defs/…" refs into the parameters: they are
    pointed at where the parameters lie in the call's schema (they once named the call's root)."""
    parameters = {"$defs": {"Unit": {"enum": ["celsius", "fahrenheit"]}}, "type": "object",
                  "properties": {"city": {"type": "string", "maxLength": 24},
                                 "unit": {"$ref": "#/$defs/Unit"}},
                  "required": ["city", "unit"]}
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": parameters}}
    for choice in ("required", "auto"):
        r = ask(client(server.url), ASK_WEATHER, tools=[tool, TIME], tool_choice=choice)
        for call in r.choices[0].message.tool_calls or ():
            arguments = json.loads(call.function.arguments)
            assert valid(arguments, parameters if call.function.name == "get_weather" else schema_of(TIME))


# ---- hostile requests (issue 41) -----------------------------------------------------------------------

def post_raw(server, body: str) -> httpx.Response:
    """A request body written as text (the client's own json.dumps would recurse on a deep value)."""
    return httpx.post(f"{server.url}/v1/chat/completions", content=body,
                      headers={"content-type": "application/json"}, timeout=60)


def errors_logged(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


def test_tool_call_arguments_nested_too_deep_are_a_400_without_a_traceback(server, caplog):
    """5,000 levels once gave a 500 with a RecursionError logged: now refused before they are parsed."""
    for deep in ("[" * 5000 + "]" * 5000, '{"a":' * 5000 + "0" + "}" * 5000):
        history = [*ASK_WEATHER, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": deep}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
        r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
            "model": MODEL_ID, "messages": history, "tools": TOOLS, "max_tokens": 8})
        assert r.status_code == 400, r.text
        assert "nested deeper than 512 levels" in r.json()["error"]["message"]
    as_object = ('{"role":"assistant","tool_calls":[{"id":"call_1","type":"function","function":{'
                 '"name":"get_weather","arguments":' + '{"a":' * 900 + "0" + "}" * 900 + "}}]}")
    # arguments as an object (not a string): checked the same
    asked = json.dumps(ASK_WEATHER[0])
    r = post_raw(server, f'{{"model":"{MODEL_ID}","max_tokens":8,"messages":[{asked},{as_object}]}}')
    assert r.status_code == 400 and "nested deeper than 512 levels" in r.json()["error"]["message"], r.text
    r = post_raw(server, '{"model":"' + MODEL_ID + '","messages":[],"tools":' + "[" * 5000 + "]" * 5000 + "}")
    assert r.status_code == 400, r.text  # a body too deep for Python's json at all: the front's parser
    assert not errors_logged(caplog)


@pytest.mark.parametrize("field", ["response_format", "tools"])
def test_a_schema_nested_too_deep_is_a_400_naming_the_limit(server, caplog, field):
    deep = '{"type":"array","items":' * 600 + "{}" + "}" * 600
    if field == "tools":
        part = '"tools":[{"type":"function","function":{"name":"f","parameters":' + deep + '}}]'
    else:
        part = '"response_format":{"type":"json_schema","json_schema":{"name":"x","schema":' + deep + "}}"
    r = post_raw(server, '{"model":"' + MODEL_ID + '","messages":' + json.dumps(CAPITAL) + "," + part + "}")
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["message"] == f"{field}: JSON nested deeper than 512 levels" and error["param"] == field
    assert not errors_logged(caplog)
    deep_object = json.loads(deep)
    with pytest.raises(ServeError, match="512"):  # the core checks again
        Constraint.from_wire({"mode": "json", "schema": deep_object})


@pytest.mark.parametrize("schema, says", [
    ({"$defs": {"a": {"anyOf": [{"$ref": "#/$defs/a"}, {"type": "string"}]}}, "$ref": "#/$defs/a"},
     "refers to itself without consuming input"),
    ({"type": "string", "maxLength": -1}, "'maxLength' must be a non-negative integer"),
    ({"type": "array", "minItems": 1.5}, "'minItems' must be a non-negative integer"),
    ({"type": "object", "minProperties": -1}, "'minProperties' must be a non-negative integer"),
    ({"type": "array", "uniqueItems": True}, "'uniqueItems' on items that are not an enum"),
])
def test_a_hostile_schema_is_a_400_naming_the_problem(server, caplog, schema, says):
    """A left-recursive anyOf once exhausted the guest's stack (500); a negative maxLength was accepted
    and then broken."""
    for field in ("response_format", "tools"):
        body = {"model": MODEL_ID, "messages": CAPITAL, "max_tokens": 16} | (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
            if field == "response_format" else
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}],
             "tool_choice": "required"})
        r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert says in error["message"] and error["param"] == field and error["code"] == "unsupported_schema"
    assert not errors_logged(caplog)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice, names", [
    ("required", "get_weather or get_time"),
    ({"type": "function", "function": {"name": "get_time"}}, "get_time"),
])
def test_a_max_tokens_too_small_for_any_call_is_a_400_saying_what_would_do(server, stream, choice, names):
    """It once answered an empty reply, finish length and no call: LangChain saw neither call nor error."""
    body = {"model": MODEL_ID, "messages": ASK_WEATHER, "tools": TOOLS, "tool_choice": choice,
            "max_tokens": 12, "stream": stream}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "max_tokens" and error["code"] == "max_tokens_too_small"
    assert error["message"].startswith(f"a call of {names} does not fit: max_tokens 12 is too small")
    shortest = int(error["message"].split("(max_tokens ")[1].split()[0])
    the_call(ask(client(server.url), ASK_WEATHER, tools=TOOLS, tool_choice=choice, max_tokens=shortest))


# ---- tools -------------------------------------------------------------------------------------------

def test_tool_choice_required_calls_one_of_the_tools(server):
    name, _ = the_call(ask(client(server.url), ASK_WEATHER, tools=TOOLS, tool_choice="required"))
    assert name in ("get_weather", "get_time")


def test_a_named_tool_choice_calls_that_function(server):
    choice = {"type": "function", "function": {"name": "get_time"}}
    assert the_call(ask(client(server.url), ASK_WEATHER, tools=TOOLS, tool_choice=choice))[0] == "get_time"


def test_tool_choice_auto_answers_in_text_or_with_a_call(server):
    for messages in (ASK_WEATHER, [{"role": "user", "content": "Say hello."}]):
        r = ask(client(server.url), messages, tools=TOOLS)  # auto, the default with tools
        if r.choices[0].message.tool_calls:
            the_call(r)
        else:
            assert isinstance(r.choices[0].message.content, str) and r.choices[0].finish_reason == "stop"


def test_tool_choice_none_is_a_plain_reply(server):
    r = ask(client(server.url), ASK_WEATHER, tools=TOOLS, tool_choice="none")
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content
    plain = ask(client(server.url), ASK_WEATHER)
    assert r.choices[0].message.content == plain.choices[0].message.content


def test_streamed_tool_calls_arrive_as_openai_deltas(server):
    whole = ask(client(server.url), ASK_WEATHER, tools=TOOLS, tool_choice="required")
    (call,) = whole.choices[0].message.tool_calls
    heads, arguments, reason = [], "", None
    for chunk in ask(client(server.url), ASK_WEATHER, tools=TOOLS, tool_choice="required", stream=True):
        choice = chunk.choices[0]
        reason = choice.finish_reason or reason
        for delta in choice.delta.tool_calls or ():
            assert delta.index == 0
            if delta.id is not None:
                heads.append((delta.id, delta.function.name))
            arguments += delta.function.arguments or ""
    assert len(heads) == 1 and heads[0][1] == call.function.name and heads[0][0].startswith("call_")
    assert arguments == call.function.arguments and reason == "tool_calls"


def test_a_tool_result_is_answered_and_the_session_keeps_what_its_client_received(server):
    c = client(server.url)
    named = {"type": "function", "function": {"name": "get_weather"}}
    first = ask(c, ASK_WEATHER, tools=TOOLS, tool_choice=named, extra_body={"session_id": "weather"})
    (call,) = first.choices[0].message.tool_calls
    conversation = [*ASK_WEATHER, first.choices[0].message.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "sunny", "degrees": 21}'}]
    second = ask(c, conversation, tools=TOOLS, tool_choice="none", extra_body={"session_id": "weather"})
    answer = second.choices[0].message.content
    assert second.model_extra["session_id"] == "weather" and answer
    assert stored(server, "weather") == [
        *ASK_WEATHER, {"role": "assistant", "content": call_text("get_weather", call.function.arguments)},
        {"role": "user", "content": 'The function get_weather returned:\n{"sky": "sunny", "degrees": 21}'},
        {"role": "assistant", "content": answer}]


def test_a_session_takes_plain_and_structured_turns_and_keeps_its_cache(server):
    c, extra = client(server.url), {"extra_body": {"session_id": "mixed"}}
    messages = [{"role": "user", "content": "Name a big city."}]
    plain = ask(c, messages, max_tokens=16, **extra)
    messages += [{"role": "assistant", "content": plain.choices[0].message.content},
                 {"role": "user", "content": "Now as JSON."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "capital", "schema": CITY}}
    shaped = ask(c, messages, response_format=fmt, **extra)
    assert valid(json.loads(shaped.choices[0].message.content), CITY)
    messages += [{"role": "assistant", "content": shaped.choices[0].message.content},
                 {"role": "user", "content": "Thanks!"}]
    after = ask(c, messages, max_tokens=8, **extra)
    assert after.model_extra["session_id"] == "mixed"
    # The chat actor took the structured turn as history: only it and the new message are prefilled.
    assert after.usage.prompt_tokens_details.cached_tokens >= plain.usage.prompt_tokens
    assert stored(server, "mixed") == [*messages, {"role": "assistant",
                                                   "content": after.choices[0].message.content}]


def reply_message(r) -> dict:
    """A reply's message as its client sends it back."""
    return r.choices[0].message.model_dump(exclude_none=True)


def tool_results(r) -> list[dict]:
    return [{"role": "tool", "tool_call_id": call.id, "content": '{"ok": true}'}
            for call in r.choices[0].message.tool_calls]


@pytest.mark.parametrize("kind", ["json_schema", "tools"])
def test_a_second_structured_turn_reuses_the_cache_of_the_conversation_before_it(server, kind):
    """Each structured turn once prefilled the whole conversation on its grammar actor: now it loads a
    copy of what the session's cache (or its last structured turn's) holds and prefills only the rest."""
    c, extra = client(server.url), {"extra_body": {"session_id": f"cached-{kind}"}}
    fields = ({"response_format": {"type": "json_schema", "json_schema": {"name": "capital", "schema": CITY}}}
              if kind == "json_schema" else {"tools": TOOLS, "tool_choice": "required"})
    messages = [{"role": "user", "content": "Name a big city."}]
    plain = ask(c, messages, max_tokens=16, **extra)
    messages += [reply_message(plain), *ASK_WEATHER]
    first = ask(c, messages, **fields, **extra)  # after a plain turn: the session's own cache
    assert first.usage.prompt_tokens_details.cached_tokens >= plain.usage.prompt_tokens
    messages.append(reply_message(first))
    messages += tool_results(first) if kind == "tools" else CAPITAL
    second = ask(c, messages, **fields, **extra)  # after a structured turn: that turn's cache
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens
    assert second.usage.prefilled_tokens < second.usage.prompt_tokens - first.usage.prompt_tokens + 8
    if kind == "json_schema":
        assert valid(json.loads(second.choices[0].message.content), CITY)
    else:
        assert {call.function.name for call in second.choices[0].message.tool_calls} <= set(BY_NAME_OF_TOOLS)


NEXT_QUESTIONS = ["And the capital of Italy?", "And of Spain?"]


def structured_conversation(c: openai.OpenAI, session: str, kind: str, turns: int = 3) -> list:
    """`turns` structured replies in one session, each request the whole conversation so far."""
    fields = ({"response_format": {"type": "json_schema", "json_schema": {"name": "capital", "schema": CITY}}}
              if kind == "json_schema" else {"tools": TOOLS, "tool_choice": "required"})
    messages = list(CAPITAL if kind == "json_schema" else ASK_WEATHER)
    replies = []
    for i in range(turns):
        r = ask(c, messages, **fields, extra_body={"session_id": session})
        if kind == "json_schema":
            assert valid(json.loads(r.choices[0].message.content), CITY)
        else:
            assert {call.function.name for call in r.choices[0].message.tool_calls} <= set(BY_NAME_OF_TOOLS)
        replies.append(r)
        messages.append(reply_message(r))
        follow = [{"role": "user", "content": NEXT_QUESTIONS[i % 2]}]
        messages += tool_results(r) if kind == "tools" else follow
    return replies


@pytest.mark.parametrize("kind", ["json_schema", pytest.param("tools", marks=pytest.mark.slow)])
def test_each_structured_turn_reuses_the_whole_conversation_before_it(server, kind):
    """Issue 43: a structured turn's cache holds every earlier turn, its reply as the model wrote it (its
    tokens: the reply's text tokenized again may split otherwise, `":` `"` for `":"`, which once stopped
    the reuse a few tokens into the reply), so a later turn prefills only the messages after it."""
    c = client(server.url)
    replies = structured_conversation(c, f"three-{kind}", kind)
    for before, after in itertools.pairwise(replies):
        held = before.usage.prompt_tokens + before.usage.completion_tokens
        assert after.usage.prompt_tokens_details.cached_tokens >= held
    # The same requests in a new session: the same replies (its cache holds the same ids, copied).
    again = structured_conversation(c, f"three-{kind}-again", kind)
    assert [said(r) for r in again] == [said(r) for r in replies]


def said(r) -> tuple:
    """What a reply says: its content and its calls (their ids are new each time)."""
    message = r.choices[0].message
    return message.content, [(t.function.name, t.function.arguments) for t in message.tool_calls or []]


def test_the_context_check_counts_the_tools_text(server):
    """A conversation that fits the context alone but not with its tools shown is a 400 before it
    takes a slot (the tools' descriptions are ~1,500 tokens; the server's context is 1,024)."""
    wordy = {"type": "function", "function": {"name": "wordy", "description": "word " * 1500,
                                              "parameters": schema_of(TIME)}}
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "model": MODEL_ID, "messages": CAPITAL, "tools": [wordy], "tool_choice": "required",
        "max_tokens": 16})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "context_length_exceeded"


# ---- streaming deltas, piece by piece ----------------------------------------------------------------

@pytest.mark.parametrize("raw, content, arguments", [
    ('{"name":"get_weather","arguments":{"city":"Par\\"is"}}', None, '{"city":"Par\\"is"}'),
    ('"Caf\\u00e9 \\ud83d\\ude00 \\\\ done"', "Café 😀 \\ done", None),
])
def test_tool_stream_gives_the_same_reply_however_the_text_is_split(raw, content, arguments):
    for cuts in itertools.combinations(range(1, len(raw)), 2):
        stream, bounds = ToolStream(), (0, *cuts, len(raw))
        deltas = [d for a, b in itertools.pairwise(bounds) for d in stream.feed(raw[a:b])] + stream.end()
        text = "".join(d.get("content", "") for d in deltas)
        calls = [c for d in deltas for c in d.get("tool_calls", ())]
        assert (text or None) == content, cuts
        if arguments is not None:
            assert calls[0]["function"]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
            assert "".join(c["function"]["arguments"] for c in calls) == arguments, cuts


def test_a_long_text_streamed_a_character_at_a_time_arrives_whole():
    """Each piece is decoded from where the last one ended (never the whole reply again): a long
    answer with escapes and surrogate pairs, fed one raw character at a time, arrives exactly."""
    answer = "Caf\u00e9 \"quoted\" 😀 \\ line\n" * 400
    raw = json.dumps(answer)
    stream = ToolStream()
    pieces = [d["content"] for ch in raw for d in stream.feed(ch)] + [d["content"] for d in stream.end()]
    assert "".join(pieces) == answer and all(pieces)


# ---- a chat template that takes tools ---------------------------------------------------------------

TOOLS_TEMPLATE = ("{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
                  "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                  "<|im_start|>assistant\n")


def test_tools_are_offered_to_a_chat_template_that_takes_them(default_checkpoint):
    import copy

    plain = default_checkpoint.tokenizer
    taking = copy.copy(plain)
    taking.__dict__.pop("_template", None)
    taking.__dict__.pop("uses_tools", None)
    taking.chat_template = TOOLS_TEMPLATE
    assert taking.uses_tools and not plain.uses_tools
    offered = [WEATHER]
    with taking.offering_tools(offered):
        shown = taking.render_chat(ASK_WEATHER)
    assert f"Tools: {json.dumps(offered, ensure_ascii=False)}" in shown
    assert "Tools:" not in taking.render_chat(ASK_WEATHER)  # outside the block: none


# A template that shows tools as Llama 3.1's does: its own wording, each tool as indented JSON.
WORDY_TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nYou have access to the following functions. To call a function, "
    "respond with JSON for a function call. Only call functions you were given.\n"
    "{% for t in tools %}{{ t | tojson(indent=4) }}\n\n{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "<|im_start|>assistant\n")


def test_the_context_check_counts_tools_as_the_chat_template_shows_them(default_checkpoint, tmp_path):
    """A template that takes tools shows them in its own words, longer than floe's listing that the
    check used to count (here 367 tokens against 276): a max_tokens that fits only without them is a 400
    before the turn takes a slot; one that fits with them gets its call."""
    import copy
    import dataclasses

    taking = copy.copy(default_checkpoint.tokenizer)
    taking.__dict__.pop("_template", None)
    taking.__dict__.pop("uses_tools", None)
    taking.chat_template = WORDY_TOOLS_TEMPLATE
    engine = Engine(dataclasses.replace(default_checkpoint, tokenizer=taking), max_seq_len=512, n_slots=2,
                    weights="native")
    props = {f"p{i}": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0},
                                                         "b": {"type": "string"}}, "required": ["a"]}
             for i in range(4)}
    tool = {"type": "function", "function": {"name": "f", "description": "Does things.",
                                             "parameters": {"type": "object", "properties": props}}}
    messages = [{"role": "user", "content": "Call f."}]
    with taking.offering_tools([tool]):
        prompt = len(taking.encode_chat(messages))
    s = ThreadServer(create_app(engine, snapshots=tmp_path, model_id=MODEL_ID, idle_seconds=3600))
    try:
        def ask_f(max_tokens: int) -> httpx.Response:
            return httpx.post(f"{s.url}/v1/chat/completions", timeout=120, json={
                "model": MODEL_ID, "messages": messages, "tools": [tool], "tool_choice": "required",
                "max_tokens": max_tokens})

        r = ask_f(512 - prompt + 1)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "context_length_exceeded"
        assert f"the conversation's {prompt} tokens" in r.json()["error"]["message"]
        r = ask_f(512 - prompt)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == prompt
        assert {c["function"]["name"] for c in r.json()["choices"][0]["message"]["tool_calls"]} == {"f"}
    finally:
        s.stop()


def test_structured_output_on_a_one_slot_server_is_a_400_saying_what_it_needs(default_checkpoint, tmp_path):
    engine = Engine(default_checkpoint, max_seq_len=512, n_slots=1, weights="native")
    s = ThreadServer(create_app(engine, snapshots=tmp_path, model_id=MODEL_ID, idle_seconds=3600))
    try:
        c = client(s.url)
        with pytest.raises(openai.BadRequestError) as e:
            ask(c, CAPITAL, response_format={"type": "json_object"})
        assert e.value.response.headers["x-should-retry"] == "false"
        assert "--max-sessions 2" in e.value.response.json()["error"]["message"]
        assert ask(c, CAPITAL, max_tokens=4).choices[0].message.content  # plain turns are served
    finally:
        s.stop()
