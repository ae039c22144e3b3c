"""The engine core's memory while sessions churn through the snapshot store's RAM tier (issue 41's soak:
the core's RSS grew +43 % under long anonymous streams and mid-stream disconnects, 4.8 % without the
RAM tier): the tier holds within its byte budget, and the server's upkeep hands back to the system
what the snapshots it made and dropped freed (glibc keeps freed buffers in its arenas otherwise)."""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from floe.actor import Actor
from floe.engine import Engine
from floe.memory import rss_bytes
from floe.server.sessions import SessionStore, snapshot_store

BUDGET = 32 << 20
THREADS = 4  # a server freezes and thaws on its request threads and its upkeep's, each with its arena


@pytest.fixture(scope="module")
def engine(default_checkpoint):
    return Engine(default_checkpoint, max_seq_len=512, n_slots=2 * THREADS, weights="native")


@pytest.fixture(scope="module")
def actors(engine):
    """Conversations of 20 to 400 words: snapshots of ~2 to ~19 MB."""
    made = []
    for words in (20, 120, 250, 400):
        actor = Actor(engine)
        actor.send("word " * words, max_tokens=2)
        made.append(actor)
    yield made
    for actor in made:
        actor.close()


def held_bytes(store: SessionStore) -> int:
    """The bytes the RAM tier's buffers hold (not what its entries say they hold)."""
    pinned = store.snapshots.pinned
    return sum(memoryview(held[0]).nbytes for e in pinned.entries() if (held := pinned.get(e.key)))


def churn(store: SessionStore, engine, actors, n: int, seed: int) -> list[int]:
    """n one-shot sessions frozen into the store from THREADS threads (a third thawed again), the
    tier's accounting checked after each; returns each snapshot's bytes."""
    snapshots, rng = store.snapshots, random.Random(seed)

    def one(i: int) -> int:
        key = f"anon-{seed}-{i}"
        made = snapshots.freeze(key, rng.choice(actors), persist=False)["bytes"]
        if i % 3 == 0 and snapshots.pinned.has(key):
            snapshots.thaw(key, engine).close()
        assert snapshots.pinned.nbytes <= BUDGET
        return made

    with ThreadPoolExecutor(THREADS) as pool:
        return list(pool.map(one, range(n)))


def test_the_ram_tier_holds_within_its_budget_while_one_shot_sessions_churn_through_it(engine, actors,
                                                                                       tmp_path):
    store = SessionStore(engine, snapshot_store(tmp_path, pinned_bytes=BUDGET, pinned_ttl_s=60),
                         sweep_seconds=0)
    made = churn(store, engine, actors, 120, seed=0)
    # Full, and no more than its budget: the tier pushes out its oldest only until the newest fits, so
    # what it holds and the last snapshot it pushed out (at most the largest) exceed the budget. (Half
    # the budget was asserted here once: [19, 12] MB held and a 2 MB one put leaves 14 MB, as CI saw.)
    assert BUDGET - max(made) < held_bytes(store) <= BUDGET
    assert held_bytes(store) == store.snapshots.pinned.nbytes
    assert store.snapshots.home.entries() == []  # one-shot: never written to the home
    assert store.snapshots.sweep(now=2**40)["dropped"]  # past their TTL: dropped, not moved down
    assert held_bytes(store) == 0 and store.snapshots.keys() == []


def test_the_upkeep_hands_back_what_churned_snapshots_freed_and_the_rss_stays_flat(engine, actors, tmp_path):
    """Measured here: each churn of 100 (~1 GB of snapshots made) left 40-170 MB of freed snapshot buffers
    in glibc's arenas (0 MB handed back without the upkeep's heap trim); the RSS after each upkeep stayed
    within 50 MB here, 136 MB over two rounds on CI's machine (arenas' fragmentation settles slowly)."""
    store = SessionStore(engine, snapshot_store(tmp_path, pinned_bytes=BUDGET), sweep_seconds=0)
    settled, made = [], 0
    for seed in range(3):
        made = sum(churn(store, engine, actors, 100, seed=seed))
        churned = rss_bytes()
        store.maintain()
        settled.append(rss_bytes())
        assert churned - settled[-1] > 16 << 20, f"the upkeep gave back {(churned - settled[-1]) >> 20} MB"
    # Snapshots kept past the tier's budget would add a round's bytes (~1 GB) each round; fragmentation
    # left in the arenas adds a small part of them.
    assert max(settled) - settled[0] < made // 4, \
        f"RSS after each upkeep (MB): {[r >> 20 for r in settled]}, a round made {made >> 20} MB of snapshots"


def test_a_one_shot_session_frozen_into_ram_then_forgotten_leaves_no_snapshot_there(engine, tmp_path):
    """An anonymous session frozen while idle goes to the RAM tier only; when its owner's next one-shot
    session pushes it past max_anonymous, its snapshot leaves the tier with it (a forget asks the tiers
    only for sessions that were ever frozen: floe.server.sessions.Session.may_be_stored)."""
    from floe.engine import SamplingParams

    store = SessionStore(engine, snapshot_store(tmp_path, pinned_bytes=BUDGET), sweep_seconds=0,
                         max_anonymous=1, idle_seconds=0.01)

    def one_shot(text: str):
        messages = [{"role": "user", "content": text}]
        session = store.acquire(None, messages, seed=0)
        try:
            store.go_live(session)
            store.run(session, [], text, max_tokens=2, params=SamplingParams())
        finally:
            store.release(session)
        return session

    try:
        first = one_shot("Name a colour.")
        time.sleep(0.05)
        store.lifecycle.evict_idle()  # (idle past idle_seconds: frozen, as the store's upkeep would)
        assert not first.live and store.snapshots.pinned.has(first.key)
        assert store.snapshots.home.entries() == []  # one-shot: never written to the home
        second = one_shot("Name a fruit.")
        assert first.key not in store.sessions and second.key in store.sessions
        assert not store.snapshots.has(first.key) and store.snapshots.keys() == []
    finally:
        store.close()
