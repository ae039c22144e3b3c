"""The registry's session table keeps its indexes (live sessions, the sessions a request naming none may
continue, each owner's anonymous ones) equal to what a scan of every session finds, through random
changes from one thread and from several at once (floe.server.sessions.table)."""

from __future__ import annotations

import random
import threading

from floe.server.sessions.session import Session, is_prefix
from floe.server.sessions.table import SessionTable

OWNERS = ["", "a" * 16, "b" * 16]
OPENINGS = [{"role": "user", "content": text} for text in ("hi", "hello", "hi ")] + [
    {"role": "system", "content": "hi"}]


def check(table: SessionTable) -> None:
    """Every index equals the scan it replaces."""
    sessions = list(table.values())
    assert {id(s) for s in table.live()} == {id(s) for s in sessions if s.live}
    assert table.live_count() == sum(s.live for s in sessions)
    for owner in OWNERS:
        assert {id(s) for s in table.owned(owner)} == {id(s) for s in sessions if s.owner == owner}
        assert {id(s) for s in table.anonymous(owner)} == {id(s) for s in sessions
                                                            if s.anonymous and s.owner == owner}
        for first in OPENINGS:
            history = [first, {"role": "assistant", "content": "x"}, {"role": "user", "content": "y"}]
            found = {id(s) for s in table.continuing(owner, history)}
            scanned = {id(s) for s in sessions
                       if s.owner == owner and s.messages and is_prefix(s.messages[:1], history)}
            assert found == scanned
        assert table.continuing(owner, []) == []
    filed = sum(len(group) for group in table._openings.values())
    assert filed == sum(1 for s in sessions if s.messages), "an opening holds a session it should not"
    assert sum(len(group) for group in table._anonymous.values()) == sum(s.anonymous for s in sessions)
    assert sum(len(group) for group in table._owned.values()) == len(sessions)


def change(table: SessionTable, rng: random.Random, made: list[Session]) -> None:
    """One random change of what a server does to its sessions."""
    op = rng.randrange(9)
    if op == 0 or not table:
        owner = rng.choice(OWNERS)
        session = Session(f"s{len(made)}", messages=[rng.choice(OPENINGS)] if rng.random() < 0.5 else None,
                          owner=owner, anonymous=rng.random() < 0.5)
        made.append(session)
        table[session.key] = session
        return
    key = rng.choice(list(table))
    session = table[key]
    if op == 1:
        del table[key]
        session.actor = object()  # a dropped session changing afterwards is not indexed again
    elif op == 2:
        table.pop(key)
    elif op == 3:
        session.actor = None if session.live else object()
    elif op == 4:
        session.messages += [rng.choice(OPENINGS), {"role": "assistant", "content": "ok"}]
    elif op == 5:
        session.messages = session.messages[:rng.randrange(len(session.messages) + 1)]
    elif op == 6:  # another session takes its key (a store's copy read anew)
        table[key] = Session(session.id, messages=[rng.choice(OPENINGS)], owner=session.owner,
                             anonymous=session.anonymous)
    elif op == 7:  # an import makes an anonymous session named (and a test, the reverse)
        session.anonymous = not session.anonymous
    else:
        table.setdefault(key, Session(session.id, owner=session.owner))


def test_the_indexes_equal_a_scan_through_random_changes():
    rng, table, made = random.Random(0), SessionTable(), []
    for _ in range(3000):
        change(table, rng, made)
        check(table)
    table.clear()
    check(table)
    assert table.live() == [] and table._openings == {} and table._anonymous == {}


def test_the_indexes_equal_a_scan_after_threads_change_sessions_at_once():
    """Sessions change outside the registry's lock (a freeze sets the actor, a turn appends messages
    under the session's own lock) while arrivals add and drop others under it."""
    table, registry_lock = SessionTable(), threading.Lock()
    shared = [Session(f"k{i}", owner=OWNERS[i % 3], anonymous=i % 2 == 0) for i in range(40)]
    for session in shared:
        table[session.key] = session

    def turns(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(3000):
            session = rng.choice(shared)
            if rng.random() < 0.5:
                session.actor = None if rng.random() < 0.5 else object()
            else:
                session.messages = [rng.choice(OPENINGS)] if rng.random() < 0.7 else []

    def arrivals(seed: int) -> None:
        rng, made = random.Random(seed), []
        for _ in range(1500):
            with registry_lock:
                session = Session(f"n{seed}-{len(made)}", messages=[rng.choice(OPENINGS)],
                                  owner=rng.choice(OWNERS), anonymous=True)
                made.append(session)
                table[session.key] = session
                gone = rng.choice(made).key
                if rng.random() < 0.6 and gone in table:
                    del table[gone]

    threads = [threading.Thread(target=turns, args=(i,)) for i in range(3)]
    threads += [threading.Thread(target=arrivals, args=(10 + i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    check(table)


def test_a_session_in_no_table_changes_freely():
    session = Session("x", messages=[OPENINGS[0]])
    session.actor = object()
    session.messages += [OPENINGS[1]]
    assert session.live and len(session.messages) == 2 and session.filed_under is None
