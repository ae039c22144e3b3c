"""OpenAI fields of `floe serve`, driven by the official `openai` client on loopback: `stop` (plain and
streamed, held back while streaming, the session keeping what the client received),
`max_completion_tokens`."""

from __future__ import annotations

import itertools

import httpx
import openai
import pytest
from test_server import CONTEXT, MODEL_ID, ThreadServer, ask, client

from floe.engine import Engine
from floe.server.app import create_app
from floe.server.protocol import ServeError
from floe.server.stops import StopText, checked_stops
from floe.snapshot import header

STORY = [{"role": "user", "content": "Write two sentences about a lighthouse keeper."}]


@pytest.fixture(scope="module")
def server(default_checkpoint, tmp_path_factory):
    folder = tmp_path_factory.mktemp("sessions")
    engine = Engine(default_checkpoint, max_seq_len=CONTEXT, n_slots=4, weights="native")
    s = ThreadServer(create_app(engine, snapshots=folder, model_id=MODEL_ID, idle_seconds=3600))
    s.folder = folder
    yield s
    s.stop()


def streamed(c: openai.OpenAI, messages: list[dict], **kwargs) -> tuple[list[str], str | None]:
    pieces, reason = [], None
    for chunk in ask(c, messages, stream=True, **kwargs):
        if chunk.choices:
            pieces += [chunk.choices[0].delta.content] if chunk.choices[0].delta.content else []
            reason = chunk.choices[0].finish_reason or reason
    return pieces, reason


def stored(server, sid: str) -> list[dict]:
    """The conversation the session keeps (frozen: its snapshot's record)."""
    assert httpx.post(f"{server.url}/v1/sessions/{sid}/freeze").status_code == 200
    import json

    return json.loads(header(server.folder / f"{sid}.safetensors")["app"])["floe_server"]["messages"]


def test_stop_text_hands_on_everything_before_the_first_stop_and_nothing_of_one():
    text = "one, two; three, four"
    for stops, expected in (((", f", "; t"), "one, two"), (("four!",), text), ((", ",), "one"), ((), text)):
        for cuts in itertools.combinations(range(1, len(text)), 3):  # every split into four pieces
            bounds = (0, *cuts, len(text))
            cut = StopText(stops)
            out = [cut.take(text[a:b]) for a, b in itertools.pairwise(bounds)]
            handed = "".join(out) + ("" if cut.matched else cut.rest())
            assert handed == cut.text == expected, (stops, cuts)
            assert cut.matched == (expected != text)
            for i in range(len(out)):  # what was handed on at each point is a prefix of the answer
                assert expected.startswith("".join(out[:i + 1]))


@pytest.mark.parametrize("value", [[""], ["a"] * 5, [1], {"a": 1}, ["x" * 257], ["\ud800"]])
def test_a_stop_that_is_not_one_is_a_400(value):
    with pytest.raises(ServeError) as e:
        checked_stops(value)
    assert e.value.status == 400 and e.value.param == "stop"


def test_a_reply_ends_before_its_stop_string_plain_and_streamed(server):
    c = client(server.url)
    whole = ask(c, STORY, max_tokens=32).choices[0].message.content
    stop = whole[12:16]
    expected = whole[:whole.index(stop)]
    r = ask(c, STORY, max_tokens=32, stop=[stop, "never appears §"])
    assert r.choices[0].message.content == expected and r.choices[0].finish_reason == "stop"
    pieces, reason = streamed(c, STORY, max_tokens=32, stop=stop)
    assert "".join(pieces) == expected and reason == "stop"
    # A stop string the reply begins but never completes: the held-back text is sent at the end.
    pieces, reason = streamed(c, STORY, max_tokens=32, stop=whole[-4:] + "§")
    assert "".join(pieces) == whole


def test_a_session_keeps_the_reply_its_client_received_and_goes_on_from_it(server):
    """A reply cut at a stop string is what the session keeps and what its next turn builds on: the
    next turn's prompt and reply equal a new session's given the conversation the client holds."""
    c = client(server.url)
    opening = [{"role": "user", "content": "List five fruits, one per line."}]
    r = ask(c, opening, max_tokens=40, stop="\n", extra_body={"session_id": "cut"})
    cut = r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop" and "\n" not in cut
    assert stored(server, "cut") == [*opening, {"role": "assistant", "content": cut}]
    conversation = [*opening, {"role": "assistant", "content": cut},
                    {"role": "user", "content": "Which of those is red?"}]
    went_on = ask(c, conversation, max_tokens=16, extra_body={"session_id": "cut"})
    fresh = ask(c, conversation, max_tokens=16)  # no session holds this prefix: a new one
    assert fresh.model_extra["session_id"] != "cut"
    assert went_on.usage.prompt_tokens == fresh.usage.prompt_tokens
    assert went_on.choices[0].message.content == fresh.choices[0].message.content


def test_max_completion_tokens_bounds_the_reply(server):
    r = ask(client(server.url), STORY, max_tokens=None, max_completion_tokens=3)
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"
