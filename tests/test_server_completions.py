"""`floe serve`'s /v1/completions continues its prompt as raw text (as OpenAI's and llama.cpp's do), on
a one-shot actor of the complete guest: the official `openai` client's `completions.create` against
floe.engine.generate on the prompt's own ids (no chat template)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from test_server import MODEL_ID, ThreadServer, client

from floe.engine import Engine, SamplingParams, generate
from floe.engine.generate import Generation
from floe.server.app import create_app

CONTEXT = 256
PROMPT = "The capital of France is Paris. The capital of Italy is"


@pytest.fixture(scope="module")
def server(default_checkpoint, tmp_path_factory):
    engine = Engine(default_checkpoint, max_seq_len=CONTEXT, n_slots=4, weights="native")
    s = ThreadServer(create_app(engine, snapshots=tmp_path_factory.mktemp("sessions"), model_id=MODEL_ID,
                                idle_seconds=3600))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def reference(default_checkpoint):
    """An engine of its own for floe.engine.generate (the server's slots are its actors')."""
    return Engine(default_checkpoint, max_seq_len=CONTEXT, n_slots=1, weights="native")


def greedy(engine: Engine, prompt: str, max_tokens: int) -> tuple[list[int], Generation]:
    ids = engine.tokenizer.encode(prompt)  # raw text: the model's BOS if it adds one, no template
    out = Generation()
    slot = engine.claim_slot()  # (a fresh one each time: generate's prefill appends to what a slot holds)
    try:
        list(generate(engine, ids, SamplingParams(temperature=0.0), max_tokens, slot=slot, result=out))
    finally:
        engine.release_slot(slot)
    return ids, out


def complete(c: openai.OpenAI, prompt, **kwargs):
    return c.completions.create(**({"model": MODEL_ID, "prompt": prompt, "temperature": 0, "max_tokens": 20}
                                   | kwargs))


CHATML = "<|im_start|>user\nName a colour.<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("prompt", [PROMPT, CHATML], ids=["plain", "special-token-text"])
def test_a_completion_continues_the_raw_prompt_as_generate_does(server, reference, prompt):
    """The prompt's ids are its raw tokenization (special-token text parsed as its token, as llama.cpp's
    completion endpoint does), not a chat template's: usage counts exactly them, and the greedy text
    is floe.engine.generate's on them."""
    ids, want = greedy(reference, prompt, 20)
    templated = reference.tokenizer.encode_chat([{"role": "user", "content": prompt}])
    assert len(templated) > len(ids)  # (the check below tells the two apart)
    r = complete(client(server.url), prompt)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(want.token_ids)
    assert r.usage.total_tokens == len(ids) + len(want.token_ids)
    assert r.choices[0].text == want.text and want.text
    assert r.choices[0].finish_reason == want.finish_reason


def test_special_token_text_makes_its_token(reference):
    """(What the parametrized test above relies on: "<|im_end|>" in a prompt is one token, not text.)"""
    tok = reference.tokenizer
    ids = tok.encode("a<|im_end|>b")
    assert any(tok.decode([i]) == "<|im_end|>" for i in ids)
    assert len(ids) < len(tok.encode("a<|im_end |>b"))  # (the same text, not a special token's: pieces)


def test_a_streamed_completion_equals_the_plain_one(server):
    c = client(server.url)
    plain = complete(c, PROMPT, max_tokens=24)
    pieces, usage, reasons = [], None, []
    for chunk in complete(c, PROMPT, max_tokens=24, stream=True, stream_options={"include_usage": True}):
        assert chunk.object == "text_completion"
        for choice in chunk.choices:
            pieces.append(choice.text)
            reasons.append(choice.finish_reason)
        usage = chunk.usage or usage
    assert len([p for p in pieces if p]) > 1 and "".join(pieces) == plain.choices[0].text
    assert reasons[-1] == plain.choices[0].finish_reason and set(reasons[:-1]) == {None}
    assert usage is not None and usage.prompt_tokens == plain.usage.prompt_tokens
    assert usage.completion_tokens == plain.usage.completion_tokens


def test_a_stop_string_cuts_the_completion(server):
    c = client(server.url)
    whole = complete(c, PROMPT, max_tokens=24).choices[0].text
    words = whole.split()
    assert len(words) >= 3, whole
    stop = words[2]
    want = whole[:whole.index(stop)]
    r = complete(c, PROMPT, max_tokens=24, stop=[stop])
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    streamed = "".join(ch.choices[0].text for ch in complete(c, PROMPT, max_tokens=24, stop=stop, stream=True)
                       if ch.choices)
    assert streamed == want


def test_max_tokens_ends_it_with_finish_reason_length(server, reference):
    ids, want = greedy(reference, PROMPT, 3)
    assert want.finish_reason == "length"
    r = complete(client(server.url), PROMPT, max_tokens=3)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3
    assert r.choices[0].text == want.text


def test_the_same_seed_draws_the_same_completion(server):
    c = client(server.url)
    runs = [complete(c, PROMPT, temperature=1.0, seed=7, max_tokens=16).choices[0].text for _ in range(2)]
    other = complete(c, PROMPT, temperature=1.0, seed=8, max_tokens=16).choices[0].text
    assert runs[0] == runs[1] and runs[0]
    greedy_text = complete(c, PROMPT, max_tokens=16).choices[0].text
    assert other != runs[0] or greedy_text != runs[0]  # the seed is used (draws differ somewhere)


def test_a_prompt_as_a_list_of_one_string(server):
    c = client(server.url)
    assert complete(c, [PROMPT]).choices[0].text == complete(c, PROMPT).choices[0].text
    with pytest.raises(openai.BadRequestError) as e:
        complete(c, [PROMPT, "Another"])
    assert e.value.body["param"] == "prompt"


def test_an_empty_prompt_without_a_bos_is_a_400(server, reference):
    assert not reference.tokenizer.add_bos  # (the default model's: the prompt would have no token)
    with pytest.raises(openai.BadRequestError) as e:
        complete(client(server.url), "")
    assert e.value.body["param"] == "prompt"


def test_a_prompt_past_the_context_is_a_clear_400(server):
    c = client(server.url)
    with pytest.raises(openai.BadRequestError) as e:
        complete(c, "one two three " * 200)
    assert e.value.body["code"] == "context_length_exceeded" and "context" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:  # the prompt fits, the reply asked for does not
        complete(c, PROMPT, max_tokens=CONTEXT)
    assert e.value.body["code"] == "context_length_exceeded" and e.value.body["param"] == "max_tokens"


def test_a_completion_has_no_session(server):
    """Stateless: no session is made or named (a session_id is a 400, not silently ignored)."""
    before = httpx.get(f"{server.url}/v1/sessions").json()["data"]
    r = httpx.post(f"{server.url}/v1/completions", timeout=60,
                   json={"model": MODEL_ID, "prompt": PROMPT, "max_tokens": 2})
    assert r.status_code == 200 and "session_id" not in r.json() and "x-floe-session" not in r.headers
    assert httpx.get(f"{server.url}/v1/sessions").json()["data"] == before
    r = httpx.post(f"{server.url}/v1/completions", timeout=60,
                   json={"model": MODEL_ID, "prompt": PROMPT, "session_id": "alice"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "session_id"


def test_a_completion_holds_a_kv_slot_as_the_store_counts_them(default_checkpoint, tmp_path):
    """One slot, held by a running completion: a chat arriving then waits its 0.3 s and gets 503 with
    Retry-After; once the completion ends its slot is free again (a chat and a completion run)."""
    # (native weights, as floe serve's on a CPU: the 200 tokens that hold the slot ~5x sooner than float32)
    engine = Engine(default_checkpoint, max_seq_len=CONTEXT, n_slots=1, weights="native")
    s = ThreadServer(create_app(engine, snapshots=tmp_path, model_id=MODEL_ID, wait_seconds=0.3))
    try:
        long = {"model": MODEL_ID, "prompt": "1, 2, 3, 4, 5, 6,", "max_tokens": 200, "temperature": 0}
        chat = {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        with ThreadPoolExecutor(1) as pool:
            holder = pool.submit(httpx.post, f"{s.url}/v1/completions", json=long, timeout=300)
            deadline = time.time() + 60
            while httpx.get(f"{s.url}/health").json()["engine_loop"]["active"] == 0:
                assert time.time() < deadline and not holder.done(), "the completion never ran"
                time.sleep(0.01)
            busy = httpx.post(f"{s.url}/v1/chat/completions", json=chat, timeout=60)
            done = holder.result()
        assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] > 20, done.text
        assert busy.status_code == 503 and busy.headers["retry-after"] == "1", busy.text
        assert httpx.post(f"{s.url}/v1/chat/completions", json=chat, timeout=60).status_code == 200
        r = httpx.post(f"{s.url}/v1/completions", json=long | {"max_tokens": 2}, timeout=60)
        assert r.status_code == 200, r.text
    finally:
        s.stop()


def test_a_base_model_without_a_chat_template_serves_completions_and_refuses_chats(reference, tmp_path):
    """A base model (no chat template) is served: its warm-up runs the complete guest (the chat guest's
    render failed and `floe serve` exited before it listened); a chat gets a 400 naming /v1/completions,
    streamed or not; a completion is generate's."""
    from floe.model import load_checkpoint

    checkpoint = load_checkpoint()
    checkpoint.tokenizer.chat_template = None  # (its own tokenizer: a base model's has no template)
    engine = Engine(checkpoint, max_seq_len=CONTEXT, n_slots=2, weights="native")
    s = ThreadServer(create_app(engine, snapshots=tmp_path, model_id=MODEL_ID, idle_seconds=3600))
    try:
        c = client(s.url)
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as refused:
                c.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=2, stream=stream)
            assert refused.value.code == "no_chat_template" and "/v1/completions" in str(refused.value)
        _, want = greedy(reference, PROMPT, 8)
        assert complete(c, PROMPT, max_tokens=8).choices[0].text == want.text
    finally:
        s.stop()
