"""The front's short way for a valid request of the chat API (floe.server.fastpath): the answers it gives
are the ones FastAPI's routes give, and everything else is FastAPI's, as before. A front against a core
client that answers at once (no model): each request goes to a front with the short way and to one without
it."""

from __future__ import annotations

import asyncio
import json

import pytest
from starlette.testclient import TestClient

from floe.server.app import create_front
from floe.server.fastpath import FastPath

CHAT, COMPLETE = "/v1/chat/completions", "/v1/completions"
OK = {"model": "m", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4}
TEXT = {"model": "m", "prompt": "Once upon a time", "max_tokens": 4}


class InstantCore:
    """A core client whose chats end at once (started, one piece, done); context 8 tokens."""

    streams, gone = 0, False

    def __init__(self) -> None:
        self.asked: list[dict] = []

    async def connect(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def call(self, name: str, arg=None, owner=None):
        if name == "hello":
            return {"model_id": "m", "started": 1.0, "aliases": [], "max_text_bytes": 4096, "context": 8}
        if name == "metrics":
            return ""  # (the core's own: none here)
        return None  # ("tokenizer": none, so no prompt hints)

    async def table(self, model: str) -> None:
        pass

    def chat(self, request: dict):
        self.asked.append(request)
        queue, ended = asyncio.Queue(), asyncio.Event()
        queue.put_nowait(("started", None if "prompt" in request else "s1"))
        if request.get("stream"):
            queue.put_nowait(("text", "Hi"))
        queue.put_nowait(("done", {"text": "Hi", "finish_reason": "stop",
                                   "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}))
        ended.set()
        return len(self.asked), queue, ended

    def cancel(self, rid: int) -> None:
        pass


def short_way(app) -> FastPath | None:
    """The app's FastPath instance in its built middleware stack, if it has one."""
    layer = app.middleware_stack
    while layer is not None:
        if isinstance(layer, FastPath):
            return layer
        layer = getattr(layer, "app", None)
    return None


@pytest.fixture(scope="module")
def fronts():
    """(client of the front with the short way, its core; client of the front without it, its core)."""
    made = []
    for short in (True, False):
        core = InstantCore()
        app = create_front(client=core, max_request_bytes=2048)
        if not short:
            app.user_middleware[:] = [m for m in app.user_middleware if m.cls is not FastPath]
        client = TestClient(app)
        client.__enter__()
        made.append((client, core))
    yield made
    for client, _ in made:
        client.__exit__(None, None, None)


def same(r) -> tuple:
    """A response's status, the headers a client reads, and its body without a chat's own id and time."""
    headers = {k: v for k, v in r.headers.items() if k in ("content-type", "x-floe-session", "retry-after",
                                                           "x-should-retry")}
    text = r.text
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        events = [e for e in text.split("\n\n") if e]
        text = [json.loads(e[6:]) if e != "data: [DONE]" else e for e in events]
    elif r.headers.get("content-type") == "application/json":
        text = r.json()
    for value in text if isinstance(text, list) else [text]:
        if isinstance(value, dict):
            value.pop("id", None), value.pop("created", None)
    return r.status_code, headers, text


ASKED = [  # (where, what is sent, whether the short way answers it)
    (CHAT, dict(json=OK), True),
    (CHAT, dict(json=OK | {"stream": True}), True),
    (CHAT, dict(json=OK | {"stream": True, "stream_options": {"include_usage": True}}), True),
    (CHAT, dict(json=OK | {"model": "nope"}), True),  # valid, the chat service's 404
    (CHAT, dict(json=OK | {"logprobs": True}), True),  # valid, the chat service's 400
    (CHAT, dict(json=OK | {"max_tokens": "4"}), False),  # not valid: strict
    (CHAT, dict(json=OK | {"messages": []}), False),
    (CHAT, dict(json={k: v for k, v in OK.items() if k != "model"}), False),
    (CHAT, dict(json=[OK]), False),
    (CHAT, dict(json=OK | {"messages": [{"role": "user", "content": "x"}] * 9}), True),  # past the context
    (CHAT, dict(json={"messages": [{"role": "user", "content": 1}] * 9, "max_tokens": "x"}), True),  # first
    (CHAT, dict(content=b"", headers={"content-type": "application/json"}), False),
    (CHAT, dict(content=b'{"model": "m", "messa', headers={"content-type": "application/json"}), False),
    (CHAT, dict(content=json.dumps(OK).encode()), False),  # no content type: FastAPI reads no JSON
    (CHAT, dict(content=json.dumps(OK).encode(), headers={"content-type": "text/plain"}), False),
    (CHAT, dict(content=json.dumps(OK).encode(), headers={"content-type": "application/json",
                                                          "content-encoding": "gzip"}), False),
    (CHAT, dict(content=json.dumps(OK).encode(),
                headers={"content-type": "application/vnd.x+json; charset=utf-8"}), True),
    (CHAT, dict(content=b"\xff\xfe{}", headers={"content-type": "application/json"}), False),
    (CHAT, dict(content=(json.dumps(OK)[:-1] + ', "pad": "' + "x" * 3000 + '"}').encode(),
          headers={"content-type": "application/json"}), False),  # past the body limit, by its length
    (COMPLETE, dict(json=TEXT), True),
    (COMPLETE, dict(json=TEXT | {"stream": True}), True),
    (COMPLETE, dict(json=TEXT | {"prompt": ["a", "b"]}), True),  # valid, the chat service's 400
    (COMPLETE, dict(json=TEXT | {"session_id": "x"}), True),  # valid, the chat service's 400
    (COMPLETE, dict(json=TEXT | {"max_tokens": "4"}), False),
    (COMPLETE, dict(json={k: v for k, v in TEXT.items() if k != "prompt"}), False),
    (COMPLETE, dict(content=json.dumps(TEXT).encode()), False),
]


@pytest.mark.parametrize("path, asked, short", ASKED, ids=[str(i) for i in range(len(ASKED))])
def test_each_request_gets_the_answer_the_route_gives(fronts, path, asked, short):
    (fast, fast_core), (plain, plain_core) = fronts
    way = short_way(fast.app) if fast.app.middleware_stack else None
    before = 0 if way is None else way.answered
    got, expected = fast.post(path, **asked), plain.post(path, **asked)
    assert same(got) == same(expected)
    way = short_way(fast.app)
    assert way is not None and short_way(plain.app) is None
    assert way.answered - before == short, (got.status_code, got.text)
    if got.status_code == 200:  # the core was asked the same
        assert fast_core.asked[-1] == plain_core.asked[-1]


def test_a_body_past_the_limit_in_chunks_is_refused_as_before(fronts):
    (fast, _), (plain, _) = fronts
    body = (json.dumps(OK)[:-1] + ', "pad": "' + "x" * 3000 + '"}').encode()

    def chunks():
        for i in range(0, len(body), 500):
            yield body[i:i + 500]

    before = short_way(fast.app).answered if fast.app.middleware_stack else 0
    got = fast.post(CHAT, content=chunks(), headers={"content-type": "application/json"})
    expected = plain.post(CHAT, content=chunks(), headers={"content-type": "application/json"})
    assert got.status_code == 413 and same(got) == same(expected)
    assert short_way(fast.app).answered == before


def test_other_routes_are_the_apps(fronts):
    (fast, _), (plain, _) = fronts
    for path in ("/health", "/v1/models", "/v1/chat/completions/x", CHAT):
        assert same(fast.get(path)) == same(plain.get(path))
    assert same(fast.post("/v1/models", json=OK)) == same(plain.post("/v1/models", json=OK))


def mutations(seed: int, n: int):
    """n bodies of the chat API made from valid ones by random edits (a field dropped, retyped or added, a
    value swapped, bytes cut or flipped), each with the path it goes to and its content type."""
    import random

    rng = random.Random(seed)
    values = [None, True, 0, -1, 1.5, "", "x", "4", [], {}, [OK["messages"][0]], {"type": "text"},
              "\ud800", 2 ** 70, 1e308, [1, 2], {"include_usage": "yes"}]
    fields = ["model", "messages", "max_tokens", "temperature", "top_p", "top_k", "seed", "n", "stream",
              "stream_options", "stop", "session_id", "keep_alive", "max_completion_tokens", "prompt",
              "response_format", "tools", "tool_choice", "logprobs", "chat_template_kwargs", "extra"]
    kinds = [b"application/json", b"application/x.y+json", b"text/plain",
             b"application/json; charset=latin-1"]
    for _ in range(n):
        path, body = rng.choice([(CHAT, dict(OK)), (COMPLETE, dict(TEXT))])
        for _ in range(rng.randint(1, 3)):
            edit = rng.random()
            if edit < 0.3 and body:
                body.pop(rng.choice(sorted(body)))
            elif edit < 0.8:
                body[rng.choice(fields)] = rng.choice(values)
            else:
                body["messages"] = [{"role": rng.choice(["user", "system", "tool", "bot"]),
                                     "content": rng.choice(values)} for _ in range(rng.randint(0, 3))]
        raw = json.dumps(body, allow_nan=True).encode("utf-8", "surrogatepass")
        if rng.random() < 0.15:
            cut = rng.randrange(len(raw) + 1)
            raw = raw[:cut] + bytes([rng.randrange(256)]) + raw[cut + 1:]
        yield path, raw, rng.choice(kinds)


def test_mutated_requests_get_the_answers_the_routes_give(fronts):
    """300 requests made from valid ones by random edits: each answered by the front with the short way as
    by the front without it."""
    (fast, _), (plain, _) = fronts
    fast.get("/health")  # (the app's middleware built)
    before = short_way(fast.app).answered
    for path, raw, kind in mutations(40, 300):
        headers = {"content-type": kind.decode()}
        got, expected = fast.post(path, content=raw, headers=headers), plain.post(path, content=raw,
                                                                                 headers=headers)
        assert same(got) == same(expected), (path, raw[:200], kind)
    answered = short_way(fast.app).answered - before
    assert 30 < answered < 270, answered  # both ways were compared, many times each (52 of 300 here)


def test_the_requests_are_counted_as_the_routes_count_them(fronts):
    """floe_requests by status (the chat API's requests, and those refused before their route ran) the same
    in both fronts after the same requests were sent to each (these, and any test's above)."""
    (fast, _), (plain, _) = fronts
    for client in (fast, plain):
        client.post(CHAT, json=OK)
        client.post(CHAT, json=OK | {"messages": [{"role": "user", "content": "x"}] * 9})  # refused: 400
        client.post(CHAT, json=OK | {"model": "nope"})  # 404
        client.post(COMPLETE, json=TEXT)

    def counts(client) -> list[str]:
        return sorted(line for line in client.get("/metrics").text.splitlines()
                      if line.startswith("floe_requests_total"))

    assert counts(fast) == counts(plain)
    assert any('status="400"' in line for line in counts(fast)), counts(fast)
