"""Several tool calls in one reply (issue 43): parallel_tool_calls (true by default, as OpenAI's), each
tool_choice with several tools, streamed calls as separate deltas with their own index, id and name,
driven by the official `openai` client (and LangChain's bind_tools) against a real `floe serve`."""

from __future__ import annotations

import itertools
import json
from types import SimpleNamespace

import openai
import pytest
from langchain_openai import ChatOpenAI
from test_grammar import valid
from test_server import MODEL_ID, client
from test_server_structured import TOOLS, ask, schema_of, server  # noqa: F401 - the module's server fixture

from floe.server import structured
from floe.server.structured import Constraint, ToolStream, constraint, outcome

BOTH = [{"role": "user", "content": "I need two things: the weather in Paris (celsius) and the local time "
                                    "in Tokyo."}]
NAMED = {"type": "function", "function": {"name": "get_time"}}
BY_NAME = {t["function"]["name"]: t for t in TOOLS}


def calls_of(r) -> list[tuple[str, dict]]:
    """A reply's tool calls, each checked against the tool it names (distinct ids, finish tool_calls)."""
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls
    assert len({c.id for c in calls}) == len(calls) and all(c.id.startswith("call_") for c in calls)
    out = []
    for call in calls:
        arguments = json.loads(call.function.arguments)
        assert valid(arguments, schema_of(BY_NAME[call.function.name])), call
        out.append((call.function.name, arguments))
    return out


def test_a_prompt_that_needs_both_tools_gets_both_calls_in_one_reply(server):  # noqa: F811
    calls = calls_of(ask(client(server.url), BOTH, tools=TOOLS, tool_choice="required", max_tokens=128))
    assert len(calls) >= 2 and {name for name, _ in calls} == {"get_weather", "get_time"}
    assert calls[0] == ("get_weather", {"city": "Paris", "unit": "celsius"})


def test_several_calls_stream_as_separate_deltas_with_their_own_index_id_and_name(server):  # noqa: F811
    c = client(server.url)
    whole = ask(c, BOTH, tools=TOOLS, tool_choice="required", max_tokens=128).choices[0].message.tool_calls
    heads, arguments, reason = {}, {}, None
    for chunk in ask(c, BOTH, tools=TOOLS, tool_choice="required", max_tokens=128, stream=True):
        choice = chunk.choices[0]
        reason = choice.finish_reason or reason
        for delta in choice.delta.tool_calls or ():
            if delta.id is not None:  # a call's first delta: its id, type and name, once
                assert delta.index not in heads and delta.index == len(heads) and delta.type == "function"
                heads[delta.index] = (delta.id, delta.function.name)
            arguments[delta.index] = arguments.get(delta.index, "") + (delta.function.arguments or "")
    assert reason == "tool_calls" and len(heads) == len(whole) >= 2
    assert [name for _, name in heads.values()] == [call.function.name for call in whole]
    assert [arguments[i] for i in range(len(whole))] == [call.function.arguments for call in whole]
    assert len({call_id for call_id, _ in heads.values()}) == len(heads)


def test_parallel_tool_calls_false_keeps_one_call(server):  # noqa: F811
    assert "array" not in json.dumps(constraint(None, TOOLS, "required", False).guest_schema())
    for seed in range(3):
        r = ask(client(server.url), BOTH, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                temperature=1, seed=seed, max_tokens=128)
        assert len(calls_of(r)) == 1


def test_each_tool_choice_with_several_tools(server):  # noqa: F811
    c = client(server.url)
    required = calls_of(ask(c, BOTH, tools=TOOLS, tool_choice="required", max_tokens=128))
    assert required
    named = calls_of(ask(c, BOTH, tools=TOOLS, tool_choice=NAMED, max_tokens=128))
    assert [name for name, _ in named] == ["get_time"]  # a named function: that one call
    for seed in range(3):  # auto: a text answer, or calls of the tools offered
        r = ask(c, BOTH, tools=TOOLS, temperature=1, seed=seed, max_tokens=64)
        if r.choices[0].message.tool_calls:
            assert calls_of(r)
        else:
            assert isinstance(r.choices[0].message.content, str)
            assert r.choices[0].finish_reason in ("stop", "length")
    none = ask(c, BOTH, tools=TOOLS, tool_choice="none", max_tokens=16)
    assert none.choices[0].message.tool_calls is None
    assert none.choices[0].message.content == ask(c, BOTH, max_tokens=16).choices[0].message.content


def test_parallel_tool_calls_must_be_a_boolean(server):  # noqa: F811
    with pytest.raises(openai.BadRequestError) as e:
        ask(client(server.url), BOTH, tools=TOOLS, parallel_tool_calls="yes")
    assert "parallel_tool_calls" in str(e.value.body)


def test_a_reply_of_several_calls_is_kept_one_call_a_line():
    weather, time_zone = '{"city":"Pa}r\\"is","unit":"celsius"}', '{"zone":"UTC"}'
    text = f'[{{"name":"get_weather","arguments":{weather}}},{{"name":"get_time","arguments":{time_zone}}}]'
    read = outcome(Constraint("tools", tools=(), choice="required"), text)
    assert read.calls == [("get_weather", weather), ("get_time", time_zone)]
    assert read.kept.splitlines() == [f'{{"name":"get_weather","arguments":{weather}}}',
                                      f'{{"name":"get_time","arguments":{time_zone}}}']
    assert read.finish_reason == "tool_calls"


TWO_CALLS = ('[{"name":"get_weather","arguments":{"city":"P}a],r\\"is","unit":"celsius"}},'
             '{"name":"get_time","arguments":{"zone":"Asia/Tokyo"}}]')


def test_two_streamed_calls_are_the_same_however_the_text_is_split():
    """Every split of an array of two calls into three pieces (one through `},{` too) gives the same
    calls: index 0 then 1, each head (id, name) once, its arguments whole and nothing of the other's."""
    expected = [("get_weather", '{"city":"P}a],r\\"is","unit":"celsius"}'),
                ("get_time", '{"zone":"Asia/Tokyo"}')]
    for cuts in itertools.combinations(range(1, len(TWO_CALLS)), 2):
        stream, bounds = ToolStream(), (0, *cuts, len(TWO_CALLS))
        deltas = [c for a, b in itertools.pairwise(bounds) for d in stream.feed(TWO_CALLS[a:b])
                  for c in d["tool_calls"]]
        heads = [(c["index"], c["function"]["name"]) for c in deltas if "id" in c]
        arguments = ["".join(c["function"]["arguments"] for c in deltas if c["index"] == i) for i in (0, 1)]
        assert heads == [(0, "get_weather"), (1, "get_time")], cuts
        assert list(zip([name for _, name in heads], arguments, strict=True)) == expected, cuts
        assert [c["index"] for c in deltas] == sorted(c["index"] for c in deltas), cuts


def test_tool_stream_reads_each_character_once(monkeypatch):
    """It once re-parsed everything it had read at each piece: eight times the text cost ~64 times the
    work. Counted as the characters it hands its parsers (json.loads, a call's head pattern), fed one
    character at a time, eight times the text now costs eight times the work (no clock involved)."""
    handed = []
    head, loads = structured.CALL_HEAD, json.loads

    class CountingHead:
        def fullmatch(self, text):
            handed.append(len(text))
            return head.fullmatch(text)

    monkeypatch.setattr(structured, "CALL_HEAD", CountingHead())
    monkeypatch.setattr(structured, "json", SimpleNamespace(  # the module's json, not everyone's
        loads=lambda text: (handed.append(len(text)), loads(text))[1], dumps=json.dumps,
        JSONDecodeError=json.JSONDecodeError))

    def work(raw: str) -> tuple[int, list[dict]]:
        stream, handed[:] = ToolStream(), []
        deltas = [d for ch in raw for d in stream.feed(ch)]
        return sum(handed), deltas

    call = '{"name":"get_weather","arguments":{"city":"Paris \\"' + "x" * 40 + '","unit":"celsius"}}'
    answer = "Caf\u00e9 \"quoted\" 😀 \\ line\n"
    for small, large in (("[" + ",".join([call] * 50) + "]", "[" + ",".join([call] * 400) + "]"),
                         (json.dumps(answer * 50), json.dumps(answer * 400))):
        (cost, _), (cost_8x, deltas) = work(small), work(large)
        assert 0 < cost_8x <= 8 * cost + 64
    assert "".join(d["content"] for d in deltas) == answer * 400
    _, deltas = work("[" + ",".join([call] * 400) + "]")
    assert {len(d["tool_calls"]) for d in deltas} == {1}
    assert len({d["tool_calls"][0]["index"] for d in deltas}) == 400


def test_langchain_bind_tools_with_two_tools_makes_both_calls(server):  # noqa: F811
    llm = ChatOpenAI(base_url=f"{server.url}/v1", api_key="unused", model=MODEL_ID, temperature=0,
                     max_tokens=128, max_retries=0, timeout=300).bind_tools(TOOLS, tool_choice="any")
    reply = llm.invoke(BOTH[0]["content"])
    assert not reply.invalid_tool_calls and len(reply.tool_calls) >= 2
    assert {call["name"] for call in reply.tool_calls} == {"get_weather", "get_time"}
    for call in reply.tool_calls:
        assert valid(call["args"], schema_of(BY_NAME[call["name"]]))
