"""A new actor that takes over another's KV slot (Actor.adopt_slot: a server session restarted with
a new guest, e.g. its conversation rolled back to an earlier turn) reuses the K and V of the ids its
first prompt shares with what the slot held, instead of computing them again."""

from __future__ import annotations

import threading

import pytest
import torch

from floe.actor import Actor, ActorClosed, builtin_guest
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


def test_adopt_slot_refuses_a_closed_actor_on_either_side(dense_engine):
    """A closed actor gave its slot back to the engine (another actor may hold it now): there is none
    to take over, and taking it would give one slot two owners. A closed actor takes none: its close()
    is done, and would never give it back."""
    old = Actor(dense_engine)
    old.close()
    with Actor(dense_engine) as other, Actor(dense_engine, kv_slot="later") as new:
        with pytest.raises(ActorClosed, match="closed"):
            new.adopt_slot(old)
        assert new.slot is None and other.slot not in dense_engine.slots.free
    free = tuple(dense_engine.slots.free)
    with Actor(dense_engine) as old:
        closed = Actor(dense_engine, kv_slot="later")
        closed.close()
        with pytest.raises(ActorClosed, match="closed"):
            closed.adopt_slot(old)
        assert closed.slot is None and not old.closed
    assert dense_engine.slots.free == free


def test_a_restore_into_an_adopted_slot_leaves_nothing_of_what_it_held_to_reuse(dense_engine):
    """restore() writes the slot (the snapshot's K and V over what the adopted slot held): a next prompt
    that empties the slot and shares a start with the ids it held (the complete guest truncates to 0
    each message) computes them again, not the snapshot's K and V taken for theirs."""
    complete = builtin_guest("complete")
    prompt, other_prompt = "\0The capital of France is", "\0My favourite fruit is the banana, because it"
    old, other = Actor(dense_engine, complete), Actor(dense_engine, complete)
    with other:
        old.send(prompt, max_tokens=4)
        other.send(other_prompt, max_tokens=4)
        new = Actor(dense_engine, complete, kv_slot="later")
        new.adopt_slot(old)
        old.close()
        new.restore(other.capture_state())
    with new, Actor(dense_engine, complete) as fresh:
        branched, alone = new.send(prompt, max_tokens=4), fresh.send(prompt, max_tokens=4)
        n = alone.stats.context_tokens
        assert cached(branched) == 0 and branched.stats.token_ids == alone.stats.token_ids
        k, v = dense_engine.cache.export(new.slot)
        k_fresh, v_fresh = dense_engine.cache.export(fresh.slot)
        for mine, theirs in zip([*k, *v], [*k_fresh, *v_fresh], strict=True):
            torch.testing.assert_close(mine[:, :n], theirs[:, :n], rtol=0, atol=1e-4)


def test_a_rolled_back_session_keeps_a_guest_that_reads_its_kv_cache_while_it_loads_history(
        dense_engine, tmp_path):
    """The ABI lets a guest call kv_len (a v1 guest also prefill) in on_history: the new actor of a rolled-
    back session is loaded with the conversation in the KV slot it takes over, not before it has one."""
    from guests_wat import guest

    from floe.engine import SamplingParams
    from floe.server.sessions import SessionStore

    reads_kv = tmp_path / "reads_kv.wasm"
    reads_kv.write_bytes(guest(
        "(drop (call $emit (i32.const 16) (i32.const 2))) (i32.const 0)",
        imports='(import "floe" "kv_len" (func $kv_len (result i32)))',
        extra='(func (export "on_history") (param i32 i32 i32) (result i32)'
              '  (drop (call $kv_len)) (i32.const 0))'))
    store = SessionStore(dense_engine, tmp_path / "snapshots", guest=str(reads_kv))

    def turn(messages: list[dict]) -> None:
        session = store.acquire("s", messages, 0)
        try:
            store.go_live(session)
            history = store.pending(session, messages)
            assert store.run(session, history, messages[-1]["content"], max_tokens=2,
                             params=SamplingParams()).text == "ok"
        finally:
            store.release(session)

    try:
        a, b, c = ({"role": "user", "content": t} for t in "abc")
        ok = {"role": "assistant", "content": "ok"}
        turn([a])
        turn([a, ok, b])
        turn([a, ok, c])  # edits the second turn: rolled back to [a, ok], its guest made again
        assert store.rollbacks == 1 and store.sessions["s"].messages == [a, ok, c, ok]
    finally:
        store.close(freeze=False)


def test_adopt_slot_from_inside_a_message_is_refused_not_a_deadlock(tiny_engine):
    """From an on_text callback the engine loop runs (loop_safe) the other actor is mid-message, its lock
    held by its sender, who waits for the loop: adopt_slot refuses, as the other calls of an actor do,
    instead of waiting for that lock with every session's turns."""
    from floe.actor import ActorReentrantCall, EngineLoop

    refused = []
    old, new = Actor(tiny_engine, loop=EngineLoop(tiny_engine)), Actor(tiny_engine, kv_slot="later")

    def take(text: str) -> None:
        if not refused:
            try:
                new.adopt_slot(old)
            except ActorReentrantCall as e:
                refused.append(e)

    sender = threading.Thread(target=lambda: old.send("Hi", max_tokens=4, on_text=take, loop_safe=True),
                              daemon=True)
    sender.start()
    sender.join(timeout=60)
    assert not sender.is_alive(), "the engine loop waits for the lock its own turn's sender holds"
    with old, new:  # (closed only where nothing waits: a close() would wait for the lock too)
        assert refused and new.slot is None and old.slot is not None


def test_whatever_writes_a_held_slot_drops_what_it_held(dense_engine):
    """What an emptied slot holds (KVCache.hold) is reused only until anything writes or claims it: a
    prompt's or a decode step's positions, a snapshot's load, a claim, a release."""
    cache, ids = dense_engine.cache, list(range(100, 140))
    slot = dense_engine.claim_slot()
    try:
        writes = {
            "prefill": lambda: dense_engine.prefill([7, 8], slot),
            "decode step": lambda: cache.reserve_each([slot]),
            "load": lambda: cache.start_load(*cache.export(slot)).into(slot, []),
            "release, claimed again": lambda: (dense_engine.release_slot(slot),
                                               dense_engine.slots.claim_free([slot])),
        }
        for name, write in writes.items():
            dense_engine.kv_truncate(0, slot)
            dense_engine.prefill(ids, slot)
            dense_engine.kv_hold(slot)
            dense_engine.kv_hold(slot)  # (handed on again before anything wrote it: still held)
            assert dense_engine.kv_len(slot) == 0 and cache.held[slot] == ids
            write()
            assert cache.held[slot] is None, name
            dense_engine.kv_truncate(0, slot)
            assert dense_engine.kv_reuse(ids, slot) == 0, name
        dense_engine.prefill(ids, slot)
        dense_engine.kv_hold(slot)
        assert dense_engine.kv_reuse([*ids[:30], 5, 6], slot) == 30  # untouched: the shared start is back
        assert dense_engine.kv_len(slot) == 30 and cache.tokens[slot] == ids[:30]
    finally:
        dense_engine.kv_truncate(0, slot)
        dense_engine.release_slot(slot)
