"""A burst of arrivals counting KV slots while sessions change hands (docs/SERVER.md, "Anonymous
sessions"): each race forced with events, not timed."""

from __future__ import annotations

import threading

import pytest
from test_store_anonymous_bound import WAIT_S, answered, paused, recording

from floe.actor import EngineLoop
from floe.engine import Engine
from floe.server.sessions import SessionStore
from floe.server.sessions.session import Session
from floe.server.sessions.table import SessionTable


@pytest.fixture
def store(default_checkpoint, tmp_path):
    """Three KV slots, at most eight anonymous sessions per owner; the sessions whose slot an arrival freed
    (SlotAdmission.make_room's) recorded in `store.made_room`, forget_locked's in `store.forgotten`."""
    engine = Engine(default_checkpoint, max_seq_len=128, n_slots=3)
    store = SessionStore(engine, tmp_path, loop=EngineLoop(engine), max_anonymous=8)
    store.made_room = recording(store.admission, "make_room")
    store.forgotten = recording(store.lifecycle, "forget_locked")
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


def test_an_arrival_past_the_bound_looks_at_no_idle_session_but_the_one_it_forgets(store, monkeypatch):
    """Eight anonymous sessions of one owner (its bound), some frozen for the others' slots: the ninth's
    arrival forgets the least recently used, and of the eight it reads the conversation of that one only
    (the owner's sessions kept in least recently used order, not each scanned for the oldest: a burst
    of 64 arrivals past the bound cost each of them a scan of 64 under the store's lock)."""
    sessions = [answered(store, f"Name a number above {n}.") for n in range(8)]
    store.release(store.acquire(None, [*sessions[0].messages, {"role": "user", "content": "Another?"}], 0))
    read = []
    messages = Session.messages

    def reading(session):
        read.append(session)
        return messages.fget(session)

    monkeypatch.setattr(Session, "messages", property(reading, messages.fset))
    arrival = store.acquire(None, [{"role": "user", "content": "Name a river."}], 0)
    monkeypatch.undo()
    try:
        assert store.forgotten == [sessions[1].id]
        assert {s.id for s in read if s is not arrival} == {sessions[1].id}
    finally:
        store.release(arrival)


def test_an_owners_anonymous_sessions_are_kept_least_recently_used_first_however_they_came():
    """Sessions registered out of order (loaded from the store, each with its saved last use) are listed
    least recently used first; one used again goes last; one doomed (being forgotten) is not counted."""
    table = SessionTable()
    sessions = [Session(f"s{n}", [{"role": "user", "content": "Hi."}], owner="o", anonymous=True)
                for n in range(4)]
    for session, used in zip(sessions, (3.0, 1.0, 4.0, 2.0), strict=True):
        session.last_used = used
        table[session.key] = session
    assert table.anonymous("o") == [sessions[1], sessions[3], sessions[0], sessions[2]]
    sessions[1].last_used = 5.0
    sessions[0].doomed = True
    assert table.anonymous("o") == [sessions[3], sessions[2], sessions[1]]
    assert table.anonymous_count("o") == 3
    assert table.least_recent("o", lambda s: s is not sessions[3]) is sessions[2]
    sessions[0].doomed = False  # (its forget failed: counted again, in its place)
    assert table.anonymous("o") == [sessions[3], sessions[0], sessions[2], sessions[1]]
