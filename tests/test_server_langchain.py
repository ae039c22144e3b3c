"""LangChain's structured output and tool binding against a real `floe serve` on loopback (issue 18's
acceptance: 20 of 20 each, behind -m slow; a few in the fast path): `with_structured_output` of a
Pydantic model, `bind_tools` with tool_choice any, a named tool and auto, and a tool result sent back;
issue 43's: two tools and a prompt that needs both get both calls in one reply, streamed or whole, and
both results go back."""

from __future__ import annotations

import pytest
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field
from test_server import MODEL_ID
from test_server_openai import stored
from test_server_structured import server  # noqa: F401 - the module's server fixture

from floe.server.structured import call_text

CITIES = ["Paris", "Tokyo", "Lima", "Cairo", "Oslo", "Delhi", "Quito", "Rome", "Seoul", "Accra",
          "Hanoi", "Dublin", "Havana", "Nairobi", "Vienna", "Manila", "Bogota", "Prague", "Perth", "Doha"]


class Trip(BaseModel):
    """A trip to a city."""

    city: str = Field(max_length=24)
    days: int
    by_train: bool
    sights: list[str] = Field(max_length=3)


class GetWeather(BaseModel):
    """The weather in a city now."""

    city: str = Field(max_length=24)


class BookHotel(BaseModel):
    """Book a hotel room in a city."""

    city: str = Field(max_length=24)
    nights: int


def model(url: str, i: int) -> ChatOpenAI:
    # Sampled, a seed per request: the mask, not greedy luck, makes every reply parse.
    return ChatOpenAI(base_url=f"{url}/v1", api_key="unused", model=MODEL_ID, temperature=0.8, seed=i,
                      max_tokens=96, max_retries=0, timeout=300)


def structured_trips(url: str, n: int) -> int:
    ok = 0
    for i, city in enumerate(CITIES[:n]):
        trip = model(url, i).with_structured_output(Trip).invoke(f"Plan a short trip to {city}.")
        assert isinstance(trip, Trip) and len(trip.sights) <= 3
        ok += 1
    return ok


def bound_tool_calls(url: str, n: int, tool_choice: str | None) -> int:
    ok = 0
    for i, city in enumerate(CITIES[:n]):
        llm = model(url, i).bind_tools([GetWeather, BookHotel], tool_choice=tool_choice)
        reply = llm.invoke(f"What is the weather in {city}? Then book two nights there.")
        if tool_choice is None and not reply.tool_calls:  # auto: the model may answer in text
            assert isinstance(reply.content, str) and not reply.invalid_tool_calls
            ok += 1
            continue
        assert reply.tool_calls and not reply.invalid_tool_calls
        for call in reply.tool_calls:  # one or more: parallel_tool_calls is true by default (issue 43)
            if tool_choice not in (None, "any"):
                assert call["name"] == tool_choice
            {"GetWeather": GetWeather, "BookHotel": BookHotel}[call["name"]].model_validate(call["args"])
        ok += 1
    return ok


def test_with_structured_output_parses_a_pydantic_model(server):  # noqa: F811
    assert structured_trips(server.url, 3) == 3


@pytest.mark.parametrize("tool_choice", ["any", "BookHotel", None])
def test_bind_tools_calls_a_bound_tool(server, tool_choice):  # noqa: F811
    assert bound_tool_calls(server.url, 2, tool_choice) == 2


def test_a_tool_result_goes_back_through_langchain(server):  # noqa: F811
    llm = model(server.url, 0).bind_tools([GetWeather], tool_choice="GetWeather")
    question = HumanMessage("What is the weather in Oslo?")
    asked = llm.invoke([question])
    (call,) = asked.tool_calls
    answer = model(server.url, 0).invoke([question, asked, ToolMessage("Snow, -3 degrees.",
                                                                      tool_call_id=call["id"])])
    assert isinstance(answer.content, str) and answer.content


BOTH = "What is the weather in Paris? Then book two nights there."
BOUND = {"GetWeather": GetWeather, "BookHotel": BookHotel}


def greedy(url: str, **extra) -> ChatOpenAI:
    return ChatOpenAI(base_url=f"{url}/v1", api_key="unused", model=MODEL_ID, temperature=0, max_tokens=128,
                      max_retries=0, timeout=300, extra_body=extra or None)


def valid_calls(reply) -> list[tuple[str, dict]]:
    """A reply's tool calls, each validated by the Pydantic model of the tool it names."""
    assert not reply.invalid_tool_calls
    assert len({call["id"] for call in reply.tool_calls}) == len(reply.tool_calls)
    for call in reply.tool_calls:
        BOUND[call["name"]].model_validate(call["args"])
    return [(call["name"], call["args"]) for call in reply.tool_calls]


def test_bind_tools_with_two_tools_makes_both_calls_in_one_reply(server):  # noqa: F811
    """issue 43's acceptance: two tools bound, a prompt that needs both, two valid calls in one reply."""
    llm = greedy(server.url).bind_tools([GetWeather, BookHotel], tool_choice="any")
    calls = valid_calls(llm.invoke(BOTH))
    assert [name for name, _ in calls] == ["GetWeather", "BookHotel"]
    assert all(args["city"] == "Paris" for _, args in calls)


def test_two_calls_streamed_through_langchain_add_up_to_the_reply(server):  # noqa: F811
    llm = greedy(server.url).bind_tools([GetWeather, BookHotel], tool_choice="any")
    chunks = list(llm.stream(BOTH))
    assert len({c["index"] for chunk in chunks for c in chunk.tool_call_chunks}) == 2
    whole = chunks[0]
    for chunk in chunks[1:]:
        whole += chunk
    assert valid_calls(whole) == valid_calls(llm.invoke(BOTH))


def test_parallel_tool_calls_false_makes_one_call_through_langchain(server):  # noqa: F811
    for i in range(2):
        llm = model(server.url, i).bind_tools([GetWeather, BookHotel], tool_choice="any",
                                              parallel_tool_calls=False)
        assert len(valid_calls(llm.invoke(BOTH))) == 1


def test_two_tool_results_go_back_through_langchain_and_the_session_keeps_both(server):  # noqa: F811
    question = HumanMessage(BOTH)
    asked = greedy(server.url, session_id="two-calls").bind_tools([GetWeather, BookHotel],
                                                                  tool_choice="any").invoke([question])
    calls = valid_calls(asked)
    assert len(calls) == 2
    results = [ToolMessage(f"result {i}", tool_call_id=call["id"]) for i, call in enumerate(asked.tool_calls)]
    answer = greedy(server.url, session_id="two-calls").invoke([question, asked, *results])
    assert isinstance(answer.content, str) and answer.content
    assert stored(server, "two-calls") == [
        {"role": "user", "content": BOTH},
        {"role": "assistant", "content": "\n".join(call_text(name, args) for name, args in calls)},
        *({"role": "user", "content": f"The function {name} returned:\nresult {i}"}
          for i, (name, _) in enumerate(calls)),
        {"role": "assistant", "content": answer.content}]


@pytest.mark.slow
def test_with_structured_output_succeeds_20_of_20(server):  # noqa: F811
    assert structured_trips(server.url, 20) == 20


@pytest.mark.slow
@pytest.mark.parametrize("tool_choice", ["any", None])
def test_bind_tools_succeeds_20_of_20(server, tool_choice):  # noqa: F811
    assert bound_tool_calls(server.url, 20, tool_choice) == 20
