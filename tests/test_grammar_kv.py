"""The grammar guest's " kv" header list (docs/GUESTS.md): told which token ids its KV slot already holds
(a conversation the host copied into it), it prefills only what they lack; a list whose count is not
the cache's length, or that is malformed, leaves nothing reused or is refused."""

import json

import pytest

from floe.actor import grammar_actor
from floe.actor.grammar import STATUS_HEADER, reported
from floe.wasm import GuestError

FIRST, SECOND = "Name a colour as JSON.", "Now another one."


def header(ids: list[int], text: str) -> str:
    listed = "".join(f"{i} " for i in ids)
    return f"\0json kv {len(listed)}\n{listed}{text}"


@pytest.fixture(scope="module")
def first_turn(tiny_engine):
    """A grammar actor's first turn: its reply, and a copy of its KV prefix with the ids behind it."""
    cache = tiny_engine.cache
    with grammar_actor(tiny_engine) as actor:
        reply = actor.send(f"\0json\n{FIRST}", max_tokens=12, params=None)
        k, v = cache.export(actor.slot)
        return (reply, list(cache.tokens[actor.slot]), [t.clone() for t in k], [t.clone() for t in v])


def second_turn(engine, first_turn, ids_told):
    """A fresh grammar actor whose slot holds a copy of the first turn's cache, told `ids_told`."""
    reply, ids, k, v = first_turn
    with grammar_actor(engine) as actor:
        engine.cache.load(actor.slot, k, v, ids)
        actor.add_history("user", FIRST)
        actor.add_history("assistant", reply.text)
        return actor.send(header(ids_told, SECOND), max_tokens=12)


def cached(reply) -> int:
    return reply.stats.context_tokens - reply.stats.first_forward_tokens


def test_told_what_its_cache_holds_it_prefills_only_the_rest(tiny_engine, first_turn):
    first, ids = first_turn[0], first_turn[1]
    assert len(ids) >= first.stats.context_tokens
    second = second_turn(tiny_engine, first_turn, ids)
    json.loads(second.text)
    assert cached(second) >= first.stats.context_tokens
    assert second.stats.first_forward_tokens < second.stats.context_tokens - first.stats.context_tokens + 8


def test_a_list_that_is_not_what_the_cache_holds_reuses_nothing(tiny_engine, first_turn):
    ids = first_turn[1]
    for told in (ids[:-1], [*ids, 0]):  # a count that is not the cache's length
        second = second_turn(tiny_engine, first_turn, told)
        json.loads(second.text)
        assert cached(second) == 0


def test_a_malformed_list_is_refused_as_a_header(tiny_engine):
    with grammar_actor(tiny_engine) as actor, pytest.raises(GuestError) as e:
        actor.send("\0json kv 3\n1x2" + FIRST, max_tokens=4)
    assert reported(e.value, STATUS_HEADER) and "kv <bytes>" in actor.logs[-1]
