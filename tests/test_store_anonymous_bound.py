"""The bound on an owner's anonymous sessions (docs/SERVER.md, "Anonymous sessions") while another
arrival frees a KV slot: the race of a burst forced with events, not timed."""

from __future__ import annotations

import threading

import pytest

from floe.actor import EngineLoop
from floe.engine import Engine, SamplingParams
from floe.server.sessions import SessionStore

WAIT_S = 60  # the longest a step of the forced interleaving may take before the test fails


@pytest.fixture
def store(default_checkpoint, tmp_path):
    """Two KV slots, at most two anonymous sessions per owner, and forget_locked's victims recorded in
    `store.forgotten`."""
    engine = Engine(default_checkpoint, max_seq_len=128, n_slots=2)
    store = SessionStore(engine, tmp_path, loop=EngineLoop(engine), max_anonymous=2)
    store.forgotten = recording(store.lifecycle, "forget_locked")
    yield store
    store.close(freeze=False)
    assert len(engine.slots.free) == 2


def recording(owner: object, name: str) -> list[str]:
    """The ids of the sessions `owner.name(session)` is called with, in order, as it goes on."""
    calls, call = [], getattr(owner, name)

    def recorded(session):
        calls.append(session.id)
        return call(session)

    setattr(owner, name, recorded)
    return calls


def answered(store: SessionStore, text: str):
    """A new anonymous session that answered `text` and is idle again (live, in a KV slot)."""
    messages = [{"role": "user", "content": text}]
    session = store.acquire(None, messages, 0)
    try:
        store.go_live(session)
        store.run(session, [], text, max_tokens=1, params=SamplingParams())
    finally:
        store.release(session)
    return session


def paused(owner: object, name: str) -> tuple[threading.Event, threading.Event]:
    """`owner.name` stops at its first call once started: `started` set, it goes on at `go` (later calls
    go through)."""
    started, go = threading.Event(), threading.Event()
    call = getattr(owner, name)

    def held(*args, **kwargs):
        if not started.is_set():
            started.set()
            assert go.wait(WAIT_S), "the test never let the call go on"
        return call(*args, **kwargs)

    setattr(owner, name, held)
    return started, go


def arriving_while_frozen(store: SessionStore, oldest):
    """Every slot taken: a named session's arrival frees a slot by freezing the oldest idle session
    (SessionStore._make_room's freeze, held once started), and meanwhile an anonymous session arrives;
    then the freeze goes on. (arrival, named), both locked: the caller releases them."""
    started, go = paused(store.lifecycle, "freeze_live_locked")
    named = store.acquire("named", [{"role": "user", "content": "Name a city."}], 0)
    freeing = threading.Thread(target=store.go_live, args=(named,))
    freeing.start()
    try:
        assert started.wait(WAIT_S), "the named session's arrival never froze an idle session for its slot"
        assert oldest.lock.locked() and oldest.live
        arrival = store.acquire(None, [{"role": "user", "content": "Name a river."}], 0)
    finally:
        go.set()
        freeing.join(WAIT_S)
    assert not freeing.is_alive()
    return arrival, named


def test_an_arrival_past_the_bound_forgets_the_idle_session_another_arrival_is_freezing(store):
    """Every slot is taken and the owner is at its bound: a named session's arrival frees the least
    recently used idle slot (freezing the oldest anonymous session), and while it freezes, an anonymous
    arrival takes the owner past the bound. That arrival forgets the session being frozen (the oldest
    idle one, forgotten once frozen), not the one a request runs in, and not nothing: the owner ends at
    its bound, without a snapshot of the forgotten one."""
    oldest, busy = answered(store, "Name a colour."), answered(store, "Name a fruit.")
    assert store.acquire(None, [*busy.messages, {"role": "user", "content": "Another?"}], 0) is busy
    arrival, named = arriving_while_frozen(store, oldest)
    try:
        assert store.forgotten == [oldest.id]
        assert set(store.sessions) == {busy.key, arrival.key, named.key}
        assert not store.snapshots.has(oldest.key)
        assert named.live and busy.live
    finally:
        for session in (arrival, named, busy):
            store.release(session)


def test_an_arrival_past_the_bound_forgets_the_oldest_idle_session_not_a_newer_one(store):
    """As above with both anonymous sessions idle: the arrival forgets the oldest (the one being frozen
    for another arrival's slot), and the newer one stays."""
    oldest, newer = answered(store, "Name a colour."), answered(store, "Name a fruit.")
    arrival, named = arriving_while_frozen(store, oldest)
    try:
        assert store.forgotten == [oldest.id]
        assert set(store.sessions) == {newer.key, arrival.key, named.key}
    finally:
        for session in (arrival, named):
            store.release(session)


def test_an_arrival_past_the_bound_forgets_the_idle_session_the_sweep_is_freezing(store):
    """Both anonymous sessions are idle longer than idle_seconds: the idle sweep freezes the oldest, and
    while it freezes, an anonymous arrival takes the owner past the bound. That arrival forgets the
    oldest (forgotten once frozen), not the newer one the sweep has not reached yet."""
    oldest, newer = answered(store, "Name a colour."), answered(store, "Name a fruit.")
    store.lifecycle.idle_seconds = 0.0
    started, go = paused(store.lifecycle, "freeze_locked")
    sweep = threading.Thread(target=store.evict_idle)
    sweep.start()
    try:
        assert started.wait(WAIT_S), "the sweep never froze an idle session"
        assert oldest.lock.locked() and not newer.lock.locked()
        arrival = store.acquire(None, [{"role": "user", "content": "Name a river."}], 0)
    finally:
        go.set()
        sweep.join(WAIT_S)
    assert not sweep.is_alive()
    try:
        assert store.forgotten == [oldest.id]
        assert set(store.sessions) == {newer.key, arrival.key}
        assert not store.snapshots.has(oldest.key)
    finally:
        store.release(arrival)
