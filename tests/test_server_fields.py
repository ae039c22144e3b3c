"""An honest surface (issue 41): a field floe would ignore is refused naming it, an error names the
field that is wrong, a flag is not a number, and usage counts the tokens the reply generated."""

from __future__ import annotations

import httpx
import pytest
from test_server import CONTEXT, MODEL_ID, ThreadServer

from floe.actor.host import MessageStats
from floe.engine import Engine
from floe.server.app import create_app

CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def url(default_checkpoint, tmp_path_factory):
    engine = Engine(default_checkpoint, max_seq_len=CONTEXT, n_slots=2, weights="native")
    s = ThreadServer(create_app(engine, snapshots=tmp_path_factory.mktemp("sessions"), model_id=MODEL_ID))
    yield s.url
    s.stop()


def chat(url: str, **fields) -> httpx.Response:
    body = {"model": MODEL_ID, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4,
            "temperature": 0} | fields
    return httpx.post(url + CHAT, json=body, timeout=120)


def refused(r: httpx.Response, param: str) -> str:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    return error["message"]


def test_reasoning_effort_is_refused_not_ignored(url):
    message = refused(chat(url, reasoning_effort="high"), "reasoning_effort")
    assert "not supported" in message
    assert chat(url, reasoning_effort=None).status_code == 200  # its neutral value passes


@pytest.mark.parametrize("field, value", [("top_k", -1), ("top_p", 0.0), ("top_p", 2.0),
                                          ("temperature", -0.5), ("seed", -5)])
def test_a_sampling_error_names_its_own_field(url, field, value):
    assert field in refused(chat(url, **{field: value}), field)


@pytest.mark.parametrize("field", ["temperature", "top_p"])
def test_a_flag_is_not_a_number(url, field):
    refused(chat(url, **{field: True}), field)
    assert chat(url, **{field: 1}).status_code == 200  # an integer is a number


def test_completion_tokens_count_generated_tokens_not_the_guests_emits():
    """A v2 turn (the engine loop ran it: finish_reason) generated what on_token returned."""
    stats = MessageStats(decoded=[], emit_calls=2, finish_reason="stop")
    assert stats.generated_tokens == 0
    stats = MessageStats(decoded=list(range(16)), emit_calls=18, finish_reason="length")
    assert stats.generated_tokens == 16


def test_usage_never_passes_max_tokens(url):
    r = chat(url, max_tokens=16, messages=[{"role": "user", "content": "Count from 1 to 100."}])
    assert r.status_code == 200, r.text
    usage, choice = r.json()["usage"], r.json()["choices"][0]
    assert usage["completion_tokens"] <= 16
    assert choice["finish_reason"] != "length" or usage["completion_tokens"] == 16


def test_a_body_nested_past_what_json_reads_says_so(url):
    body = '{"model": "m", "messages": ' + "[" * 5000 + "]" * 5000 + "}"
    r = httpx.post(url + CHAT, content=body, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    assert "nested too deep" in r.json()["error"]["message"], r.text
