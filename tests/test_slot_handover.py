"""A new actor that takes over another's KV slot (Actor.adopt_slot: a server session restarted with
a new guest, e.g. its conversation rolled back to an earlier turn) reuses the K and V of the ids its
first prompt shares with what the slot held, instead of computing them again."""

from __future__ import annotations

import pytest

from floe.actor import Actor
from floe.engine import Engine
from floe.errors import FloeError

TURNS = ["Name a colour.", "And a fruit?"]
BRANCH = "And a vegetable?"


@pytest.fixture(scope="module")
def dense_engine(default_checkpoint):
    """float32 weights: a prompt's product and a decode step's agree to ~1e-5, so an actor that reuses
    turns a decode computed answers as one that prefills them (native int8 steps differ by ~1e-2)."""
    return Engine(default_checkpoint, max_seq_len=512, n_slots=3, weights="dense")


def with_history(engine: Engine, history: list[tuple[str, str]], **kwargs) -> Actor:
    actor = Actor(engine, **kwargs)
    for role, text in history:
        actor.add_history(role, text)
    return actor


def cached(reply) -> int:
    return reply.stats.context_tokens - reply.stats.first_forward_tokens


def test_an_adopted_slot_reuses_the_turns_the_conversation_shares(dense_engine):
    old = Actor(dense_engine)
    first = old.send(TURNS[0], max_tokens=12)
    old.send(TURNS[1], max_tokens=12)  # the slot goes on past the branch
    slot, held = old.slot, list(dense_engine.cache.tokens[old.slot])
    history = [("user", TURNS[0]), ("assistant", first.text)]
    new = with_history(dense_engine, history, kv_slot="later")
    new.adopt_slot(old)
    assert old.closed and old.slot is None and new.slot == slot and dense_engine.kv_len(slot) == 0
    old.close()  # its guest is freed; the slot stays the new actor's
    assert dense_engine.slots.free.count(slot) == 0
    with new, with_history(dense_engine, history) as fresh:
        branched, alone = new.send(BRANCH, max_tokens=12), fresh.send(BRANCH, max_tokens=12)
        # the first turn, its reply and the next message's first tokens ("And a") came from the slot
        assert cached(branched) >= first.stats.context_tokens + len(first.stats.token_ids)
        assert cached(alone) == 0
        assert branched.stats.token_ids == alone.stats.token_ids
        prompt = branched.stats.context_tokens
        assert dense_engine.cache.tokens[slot][:cached(branched)] == held[:cached(branched)]
        assert dense_engine.cache.tokens[slot][:prompt] == dense_engine.cache.tokens[fresh.slot][:prompt]


def test_reuse_stops_at_the_first_id_that_differs(dense_engine):
    old = Actor(dense_engine)
    first = old.send(TURNS[0], max_tokens=8)
    edited = [("user", "Name a colour, please."), ("assistant", first.text)]
    new, fresh = with_history(dense_engine, edited, kv_slot="later"), with_history(dense_engine, edited)
    with new, fresh:
        new.adopt_slot(old)
        old.close()
        branched, alone = new.send(BRANCH, max_tokens=8), fresh.send(BRANCH, max_tokens=8)
        # the system turn and "Name a colour" are shared; the edit is not
        assert 0 < cached(branched) < first.stats.context_tokens
        assert branched.stats.token_ids == alone.stats.token_ids


def test_adopt_slot_refuses_what_it_cannot_take(dense_engine):
    old, has_one, new = Actor(dense_engine), Actor(dense_engine), Actor(dense_engine, kv_slot="later")
    with old, has_one, new:
        with pytest.raises(FloeError, match="kv_slot='later'"):
            has_one.adopt_slot(old)
        new.adopt_slot(old)
        with pytest.raises(FloeError, match="kv_slot='later'"):
            new.adopt_slot(has_one)  # it has one now
        assert not has_one.closed and has_one.slot is not None
