"""A burst of arrivals counting KV slots while sessions change hands (docs/SERVER.md, "Anonymous
sessions"): each race forced with events, not timed."""

from __future__ import annotations

import threading

import pytest
from test_store_anonymous_bound import WAIT_S, answered, paused

from floe.actor import EngineLoop
from floe.engine import Engine
from floe.server.sessions import SessionStore


@pytest.fixture
def store(default_checkpoint, tmp_path):
    """Three KV slots, the sessions whose slot an arrival freed (SlotAdmission.make_room's) recorded in
    `store.made_room`."""
    engine = Engine(default_checkpoint, max_seq_len=128, n_slots=3)
    store = SessionStore(engine, tmp_path, loop=EngineLoop(engine), max_anonymous=8)
    store.made_room = []
    make_room = store.admission.make_room

    def recorded(session):
        store.made_room.append(session.id)
        return make_room(session)

    store.admission.make_room = recorded
    yield store
    store.close(freeze=False)
    assert len(engine.slots.free) == 3


def arrive(store: SessionStore, text: str):
    """A new anonymous session for `text`, live (locked: the caller releases it)."""
    session = store.acquire(None, [{"role": "user", "content": text}], 0)
    store.go_live(session)
    return session


def test_a_session_going_live_is_counted_once_while_another_arrival_counts_the_slots(store):
    """Of three KV slots an idle session holds one and a named session reserves another: as the
    reservation becomes its actor's, an anonymous arrival counts the slots. It finds the third free (the
    named session counted once, as live or as reserved, never both) and freezes no idle session."""
    idle = answered(store, "Name a colour.")
    started, go = paused(store.admission, "uncount")
    named = store.acquire("named", [{"role": "user", "content": "Name a city."}], 0)
    going = threading.Thread(target=store.go_live, args=(named,))
    going.start()
    try:
        assert started.wait(WAIT_S), "the named session never went live"
        arrival = arrive(store, "Name a river.")
    finally:
        go.set()
        going.join(WAIT_S)
    assert not going.is_alive()
    try:
        assert store.made_room == []
        assert idle.live and named.live and arrival.live
        assert not store.snapshots.has(idle.key)
    finally:
        for session in (arrival, named):
            store.release(session)


def test_a_session_restarting_its_guest_is_counted_once_while_another_arrival_counts_the_slots(store):
    """As above with the session's guest restarted with its conversation (a reply cut at a stop string):
    its slot stays its own, counted once, while the new actor is made, and an arrival finds the third
    slot free."""
    idle, busy = answered(store, "Name a colour."), answered(store, "Name a fruit.")
    assert store.acquire(None, [*busy.messages, {"role": "user", "content": "Another?"}], 0) is busy
    started, go = paused(store.actors, "with_history")
    restarting = threading.Thread(target=store.lifecycle.restart_guest, args=(busy,))
    restarting.start()
    try:
        assert started.wait(WAIT_S), "the guest was never restarted"
        arrival = arrive(store, "Name a river.")
    finally:
        go.set()
        restarting.join(WAIT_S)
    assert not restarting.is_alive()
    try:
        assert store.made_room == []
        assert idle.live and busy.live and arrival.live
    finally:
        for session in (arrival, busy):
            store.release(session)
