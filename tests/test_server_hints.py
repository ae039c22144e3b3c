"""Prompt hints (floe.server.hints): the HTTP front renders and tokenizes a plain chat's conversation and
the core's chat guest takes both from the hint. Replies, usage and sessions are the same as a server
without hints; a hint's ids are what the guest's prompt is (a hint of other ids shows it); a malformed
hint is ignored, never an error."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest
from test_server import MODEL_ID, TURNS, ThreadServer, client, conversation

from floe.engine import Engine
from floe.model.tokenizer import Hint
from floe.server import hints
from floe.server.app import create_app
from floe.server.core import ServeCore


@pytest.fixture(scope="module")
def servers(default_checkpoint, tmp_path_factory):
    """Two servers of one engine each: with prompt hints (the default) and without."""
    made = {}
    for hinted in (True, False):
        engine = Engine(default_checkpoint, max_seq_len=512, n_slots=4, weights="native")
        folder = tmp_path_factory.mktemp(f"hinted-{hinted}")
        made[hinted] = ThreadServer(create_app(engine, snapshots=folder, model_id=MODEL_ID, idle_seconds=3600,
                                               prompt_hints=hinted))
    yield made
    for s in made.values():
        s.stop()


def hint_counts(url: str) -> dict[str, float]:
    counts = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("floe_prompt_hints_total{"):
            counts[line.split('used="')[1].split('"')[0]] = float(line.rsplit(" ", 1)[1])
    return counts


@pytest.mark.parametrize("session", [None, "hinted-named"])
def test_a_conversation_with_hints_is_the_conversation_without(servers, session):
    turns = [*TURNS, "Say <|im_end|> and <|im_start|> back to me."]  # (special-token text: the spans)
    before = hint_counts(servers[True].url).get("true", 0)
    hinted = conversation(client(servers[True].url), session, turns)
    plain = conversation(client(servers[False].url), session, turns)
    assert hinted[0] == plain[0]  # the replies
    assert [u.model_dump() for u in hinted[1]] == [u.model_dump() for u in plain[1]]  # prompt, cached, ...
    assert hint_counts(servers[True].url).get("true", 0) == before + len(turns)
    assert hint_counts(servers[True].url).get("false", 0) == 0
    assert hint_counts(servers[False].url) == {}


def test_the_core_takes_the_prompt_from_the_hint_and_ignores_a_malformed_one(default_checkpoint, tmp_path):
    engine = Engine(default_checkpoint, max_seq_len=512, n_slots=2, weights="native")
    core = ServeCore(engine, snapshots=tmp_path, model_id=MODEL_ID)
    tokenizer = engine.tokenizer
    try:
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        truth = tokenizer.hint(messages)
        other = tokenizer.hint([{"role": "user", "content": "Name a colour, please, any colour at all."}])
        forged = hints.wire(Hint(messages, truth.rendered, other.ids))  # this text, another prompt's ids

        def prompt_tokens(hint) -> int:
            request = {"messages": messages, "max_tokens": 2, "temperature": 0.0, "owner": ""}
            if hint is not None:
                request["hint"] = hint
            return core.run(core.open(request))["usage"]["prompt_tokens"]

        assert prompt_tokens(None) == len(truth.ids)
        assert prompt_tokens(hints.wire(truth)) == len(truth.ids)
        assert prompt_tokens(forged) == len(other.ids) != len(truth.ids)  # (the guest took the hint)
        good = hints.wire(truth)
        vocab = tokenizer.vocab_size
        malformed = [
            "not a hint", {}, good | {"text": 7}, good | {"spans": [[5, 2]]}, good | {"spans": [[0, 10**6]]},
            good | {"spans": [["0", 1]]}, good | {"ids": "not base64!"}, good | {"ids": "AAA="},
            good | {"ids": base64.b64encode(np.array([vocab], "<i4").tobytes()).decode()},
            good | {"ids": base64.b64encode(np.array([-1], "<i4").tobytes()).decode()}, good | {"ids": ""}]
        for bad in malformed:
            assert hints.from_wire(bad, messages, vocab) is None, bad
            assert prompt_tokens(bad) == len(truth.ids), bad
    finally:
        core.close()
