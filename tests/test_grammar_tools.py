"""The language the grammar guest writes a tool turn in (issue 43 item 2), for each tool_choice with
several tools and parallel_tool_calls true and false: the automaton compiled from the reply's schema
(floe.server.structured.Constraint.guest_schema) accepts exactly what `jsonschema` accepts of it, each
call's arguments checked against its own tool's parameters (their `$defs` too), and every reply drawn
from it at random is a call, calls or text as the choice allows. No model: tests/grammar_check.c."""

import json

import pytest
from test_grammar_keywords import agrees, automaton, compact, validator  # noqa: F401 - automaton: a fixture

from floe.server.structured import Constraint, checked_tools

WEATHER = {"name": "get_weather", "description": "The weather in a city now", "parameters": {
    "$defs": {"Unit": {"enum": ["celsius", "fahrenheit"]}}, "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"$ref": "#/$defs/Unit"}},
    "required": ["city", "unit"]}}
TIME = {"name": "get_time", "description": "The local time in a time zone", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "maxLength": 12}}, "required": ["zone"]}}
TOOLS = checked_tools([{"type": "function", "function": f} for f in (WEATHER, TIME)])


def call(name: str, **arguments) -> dict:
    return {"name": name, "arguments": arguments}


PARIS = call("get_weather", city="Paris", unit="celsius")
TOKYO = call("get_time", zone="Asia/Tokyo")
NO_SUCH_UNIT = call("get_weather", city="Paris", unit="kelvin")  # outside the tool's own $defs
ANOTHER_TOOLS_ARGUMENTS = call("get_time", city="Paris", unit="celsius")
NOT_OFFERED = call("get_date")
REPLIES = [PARIS, TOKYO, [PARIS], [TOKYO, PARIS], [PARIS, TOKYO, TOKYO], [], [PARIS, NO_SUCH_UNIT],
           [ANOTHER_TOOLS_ARGUMENTS], [NOT_OFFERED], NO_SUCH_UNIT, ANOTHER_TOOLS_ARGUMENTS, NOT_OFFERED,
           "It is sunny.", ["It is sunny."], [[PARIS]], {"name": "get_time"}, None]

# (tool_choice, parallel_tool_calls): the replies among REPLIES the guest may write, by their index
ALLOWED = {
    ("required", True): [2, 3, 4],  # one or more calls, each valid for its own tool
    ("required", False): [0, 1],  # exactly one call of either
    ("auto", True): [2, 3, 4, 12],  # calls, or a text answer as one JSON string
    ("auto", False): [0, 1, 12],
    ("get_time", True): [1],  # a named function: one call of it, parallel or not
    ("get_time", False): [1],
}


@pytest.mark.parametrize("choice, parallel", list(ALLOWED))
def test_the_reply_language_is_what_the_tool_choice_allows(automaton, choice, parallel):  # noqa: F811
    schema = Constraint("tools", tools=TOOLS, choice=choice, parallel=parallel).guest_schema()
    texts = [compact(reply) for reply in REPLIES]
    agrees(automaton, schema, texts)  # exactly jsonschema's verdict on the schema the guest compiles
    assert [i for i, text in enumerate(texts) if automaton.accepts(text)] == ALLOWED[choice, parallel]


@pytest.mark.parametrize("choice, parallel", list(ALLOWED))
def test_every_drawn_reply_is_a_call_calls_or_text_as_the_choice_allows(automaton, choice, parallel):  # noqa: F811
    """Replies drawn at random (a seed each, up to 240 bytes before closing) validate against the
    reply's schema; several calls come only where parallel calls are allowed, each valid for its tool."""
    schema = Constraint("tools", tools=TOOLS, choice=choice, parallel=parallel).guest_schema()
    assert automaton.compile(schema) is None
    several = parallel and choice in ("auto", "required")
    parameters, counts = {t["name"]: t["parameters"] for t in TOOLS}, set()
    for seed in range(40):
        text = automaton.sample(seed, soft=(0, 40, 120, 240)[seed % 4])
        reply = json.loads(text)
        assert validator(schema).is_valid(reply) and len(text.encode()) >= automaton.min_bytes(), text
        if isinstance(reply, str):
            assert choice == "auto"
            continue
        calls = reply if several else [reply]
        assert isinstance(calls, list) and calls and all(isinstance(c, dict) for c in calls), text
        for c in calls:
            assert choice in ("auto", "required") or c["name"] == choice
            assert list(c) == ["name", "arguments"]  # the order ToolStream reads a call in
            assert validator(parameters[c["name"]]).is_valid(c["arguments"]), c
        counts.add(len(calls))
    assert (max(counts) >= 3) if several else counts == {1}
