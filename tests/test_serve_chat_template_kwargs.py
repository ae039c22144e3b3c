"""A chat request's `chat_template_kwargs` (vLLM's field: extra variables for the chat template, e.g.
Qwen3's {"enable_thinking": false}) reach every render of its turn in `floe serve`: the context check,
the chat guest's render through the host, a structured turn's, and the front's prompt hint. Served here
is the default model with its own template plus two variables it reads (`persona`, `enable_thinking`):
without them it renders exactly as the model's own. A request without the field is answered as before;
one whose variables cannot be given to a template is a 400 naming the field; concurrent requests each
render with their own; prompt hints give the same prompts as a server without them."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from test_server import MODEL_ID, ThreadServer
from test_server_hints import hint_counts

from floe.engine import Engine
from floe.model.template_vars import MAX_TEMPLATE_KWARGS, MAX_TEMPLATE_KWARGS_BYTES, TemplateKwargsError
from floe.model.tokenizer import Tokenizer
from floe.server.app import create_app
from floe.server.core import _template_kwargs
from floe.server.protocol import ServeError

# SmolLM2's own template, but its default system line is `persona` where given, and its generation prompt
# closes an empty thought where `enable_thinking` is false (as Qwen3's does).
TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\n' + (persona if persona is defined else "
    "'You are a helpful AI assistant named SmolLM, trained by Hugging Face') + '<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{% endif %}{% endif %}")
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def servers(default_checkpoint, tmp_path_factory):
    """Two servers of that template, one engine each: with prompt hints (the default) and without; and
    the model's own tokenizer."""
    made, own = {}, None
    for hinted in (True, False):
        engine = Engine(default_checkpoint, max_seq_len=512, n_slots=4, weights="native")
        own = engine.tokenizer
        engine.tokenizer = Tokenizer.from_wire(own.wire() | {"chat_template": TEMPLATE})
        folder = tmp_path_factory.mktemp(f"kwargs-hinted-{hinted}")
        made[hinted] = ThreadServer(create_app(engine, snapshots=folder, model_id=MODEL_ID, idle_seconds=3600,
                                               prompt_hints=hinted))
    made["own"] = own
    yield made
    for hinted in (True, False):
        made[hinted].stop()


def served_tokenizer(servers) -> Tokenizer:
    return Tokenizer.from_wire(servers["own"].wire() | {"chat_template": TEMPLATE})


def post(url: str, body: dict) -> httpx.Response:
    return httpx.post(url + CHAT, json={"model": MODEL_ID, "max_tokens": 4, "temperature": 0} | body,
                      timeout=120)


def usage(url: str, messages: list[dict], kwargs=..., **fields) -> dict:
    body = {"messages": messages} | fields | ({} if kwargs is ... else {"chat_template_kwargs": kwargs})
    r = post(url, body)
    assert r.status_code == 200, r.text
    return r.json()


def test_without_its_variables_the_template_renders_as_the_models_own(servers):
    served = served_tokenizer(servers)
    assert served.render_chat(QUESTION) == servers["own"].render_chat(QUESTION)
    assert served.render_chat(QUESTION, chat_template_kwargs={"enable_thinking": False}).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")


@pytest.mark.parametrize("hinted", [True, False])
def test_a_chat_without_the_field_is_answered_as_before(servers, hinted):
    url, own = servers[hinted].url, servers["own"]
    expected = len(own.encode_chat(QUESTION))
    absent = usage(url, QUESTION)
    for kwargs in (None, {}):
        given = usage(url, QUESTION, kwargs)
        assert given["usage"]["prompt_tokens"] == expected
        assert given["choices"][0]["message"]["content"] == absent["choices"][0]["message"]["content"]
    assert absent["usage"]["prompt_tokens"] == expected


@pytest.mark.parametrize("hinted", [True, False])
@pytest.mark.parametrize("kwargs", [
    {"enable_thinking": False}, {"persona": "You are Ada, who answers in verse."},
    {"persona": "You are terse.", "enable_thinking": False, "unused": [1, {"a": None}]}])
def test_the_variables_render_the_prompt_as_apply_chat_template_with_them(servers, hinted, kwargs):
    expected = len(served_tokenizer(servers).encode_chat(QUESTION, chat_template_kwargs=kwargs))
    assert expected != len(servers["own"].encode_chat(QUESTION))
    assert usage(servers[hinted].url, QUESTION, kwargs)["usage"]["prompt_tokens"] == expected


def test_a_structured_turn_renders_with_the_variables(servers):
    url, served = servers[True].url, served_tokenizer(servers)
    persona = {"persona": "You are a careful assistant who answers in JSON, and nothing else."}
    fmt = {"response_format": {"type": "json_object"}, "max_tokens": 8}
    plain = usage(url, QUESTION, **fmt)["usage"]["prompt_tokens"]
    given = usage(url, QUESTION, persona, **fmt)["usage"]["prompt_tokens"]
    assert given - plain == (len(served.encode_chat(QUESTION, chat_template_kwargs=persona))
                             - len(served.encode_chat(QUESTION))) != 0


@pytest.mark.parametrize("kwargs", [
    {"messages": []}, {"tools": []}, {"add_generation_prompt": False}, {"bos_token": "x"}, {"eos_token": "x"},
    {"pad_token": "x"}, {"unk_token": "x"}, {"namespace": 1}, {"raise_exception": 1}, {"self": 1},
    [], ["enable_thinking"], "enable_thinking", 7, True,
    {f"k{i}": i for i in range(MAX_TEMPLATE_KWARGS + 1)}, {"persona": "x" * MAX_TEMPLATE_KWARGS_BYTES},
    {"not a name": 1}, {"1st": 1}, {"": 1}, {"café": 1}, {"a-b": 1},
    {"deep": json.loads("[" * 12 + "]" * 12)},
])
def test_variables_a_template_cannot_take_are_a_400_naming_the_field(servers, kwargs):
    r = post(servers[True].url, {"messages": QUESTION, "chat_template_kwargs": kwargs})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "chat_template_kwargs"
    assert r.json()["error"]["message"].startswith("chat_template_kwargs")


def test_a_variable_the_template_cannot_render_is_a_400_not_a_500(servers):
    r = post(servers[True].url, {"messages": QUESTION, "chat_template_kwargs": {"persona": [1, 2]}})
    assert r.status_code == 400, r.text
    assert "chat template failed" in r.json()["error"]["message"]


def test_the_core_checks_the_variables_again():
    for bad in ({"messages": []}, [1], {"x y": 1}, {f"k{i}": i for i in range(MAX_TEMPLATE_KWARGS + 1)}):
        with pytest.raises(ServeError) as e:
            _template_kwargs(bad)
        assert e.value.status == 400 and e.value.param == "chat_template_kwargs"
    assert _template_kwargs(None) is None and _template_kwargs({}) is None
    assert _template_kwargs({"enable_thinking": False}) == {"enable_thinking": False}


def test_a_tokenizer_refuses_a_variable_named_as_its_special_tokens(servers):
    served = served_tokenizer(servers)
    with pytest.raises(TemplateKwargsError), served.rendering_with({"eos_token": "x"}):
        pass
    with served.rendering_with({"persona": "You are Bob."}):
        inside = served.render_chat(QUESTION)
    assert "You are Bob." in inside and served.render_chat(QUESTION) == servers["own"].render_chat(QUESTION)


def test_a_text_completion_takes_no_chat_template_kwargs(servers):
    r = httpx.post(servers[True].url + "/v1/completions", timeout=120, json={
        "model": MODEL_ID, "prompt": "The capital of France is", "max_tokens": 2,
        "chat_template_kwargs": {"enable_thinking": False}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs", r.text


@pytest.mark.parametrize("hinted", [True, False])
def test_concurrent_requests_each_render_with_their_own_variables(servers, hinted):
    url, served = servers[hinted].url, served_tokenizer(servers)
    personas = [None, {"persona": "You are A."}, {"enable_thinking": False},
                {"persona": "You are a very long-winded assistant named Bartholomew the Third, of the "
                            "House of Many Words.", "enable_thinking": False}]
    asked = [([{"role": "user", "content": f"Name a number bigger than {i}."}], personas[i % len(personas)])
             for i in range(16)]

    def prompt_tokens(job) -> int:
        messages, kwargs = job
        return usage(url, messages, ... if kwargs is None else kwargs)["usage"]["prompt_tokens"]

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(prompt_tokens, asked))
    assert got == [len(served.encode_chat(m, chat_template_kwargs=k)) for m, k in asked]
    assert len(set(got)) > 4  # (the variables made different prompts)


def test_with_prompt_hints_a_conversation_with_variables_is_the_one_without_hints(servers):
    kwargs = {"persona": "You are a helpful assistant.", "enable_thinking": False}
    before = hint_counts(servers[True].url)
    turns = ["What is the capital of France?", "And of Italy?", "Which of the two is larger?"]
    answered = {}
    for hinted in (True, False):
        messages, replies, usages = [], [], []
        for text in turns:
            messages.append({"role": "user", "content": text})
            r = usage(servers[hinted].url, messages, kwargs, max_tokens=12, session_id="kwargs-conversation")
            replies.append(r["choices"][0]["message"]["content"])
            usages.append(r["usage"])
            messages.append({"role": "assistant", "content": replies[-1]})
        answered[hinted] = replies, usages
    assert answered[True] == answered[False]
    assert answered[True][1][-1]["prompt_tokens_details"]["cached_tokens"] > 0  # (its KV went on)
    after = hint_counts(servers[True].url)
    assert after.get("true", 0) == before.get("true", 0) + len(turns)  # (made with the variables: used)
    assert after.get("false", 0) == before.get("false", 0)


def test_qwen3s_template_turns_thinking_off_through_the_server(default_checkpoint, tmp_path):
    """Qwen3's own template (tests/chat_templates), served with the default model's tokenizer (which has
    its <|im_start|> and <|im_end|>): {"enable_thinking": false} closes an empty thought after the
    generation prompt, in the prompt the guest prefilled."""
    template = (Path(__file__).parent / "chat_templates" / "qwen3.jinja").read_text()
    engine = Engine(default_checkpoint, max_seq_len=512, n_slots=2, weights="native")
    engine.tokenizer = served = Tokenizer.from_wire(engine.tokenizer.wire() | {"chat_template": template})
    server = ThreadServer(create_app(engine, snapshots=tmp_path, model_id=MODEL_ID, idle_seconds=3600))
    try:
        off = {"enable_thinking": False}
        assert served.render_chat(QUESTION, chat_template_kwargs=off) == (
            served.render_chat(QUESTION) + "<think>\n\n</think>\n\n")
        for kwargs in (None, off, {"enable_thinking": True}):
            got = usage(server.url, QUESTION, kwargs)["usage"]["prompt_tokens"]
            assert got == len(served.encode_chat(QUESTION, chat_template_kwargs=kwargs))
        assert usage(server.url, QUESTION, off)["usage"]["prompt_tokens"] > len(served.encode_chat(QUESTION))
    finally:
        server.stop()
