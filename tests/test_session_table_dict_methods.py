"""The dict methods of the registry's SessionTable that add or drop sessions keep its indexes
(floe.server.sessions.table): update indexes what it adds, pop with a default of a missing key changes
nothing, popitem is refused, and a session replaced under its key is dropped from every index."""

from __future__ import annotations

import pytest

from floe.server.sessions.session import Session
from floe.server.sessions.table import SessionTable

HI = {"role": "user", "content": "hi"}


def made(sid: str, *, live: bool = False, anonymous: bool = True) -> Session:
    session = Session(sid, messages=[HI], owner="a" * 16, anonymous=anonymous)
    if live:
        session.actor = object()
    return session


def indexed(table: SessionTable) -> set[int]:
    """Every session some index holds."""
    return ({id(s) for s in table.live()} | {id(s) for s in table.anonymous("a" * 16)}
            | {id(s) for s in table.continuing("a" * 16, [HI])})


def test_update_indexes_the_sessions_it_adds():
    table = SessionTable()
    one, two = made("one", live=True), made("two")
    table.update({one.key: one}, **{two.key: two})
    assert table.live() == [one] and table.live_count() == 1
    assert {id(s) for s in table.anonymous("a" * 16)} == {id(one), id(two)}
    assert {id(s) for s in table.continuing("a" * 16, [HI])} == {id(one), id(two)}


def test_pop_of_a_missing_key_with_a_default_changes_nothing():
    table = SessionTable()
    one = made("one", live=True)
    table[one.key] = one
    assert table.pop("nobody", None) is None
    with pytest.raises(KeyError):
        table.pop("nobody")
    assert indexed(table) == {id(one)} and table.pop(one.key) is one
    assert indexed(table) == set() and one.filed_under is None


def test_popitem_is_refused_and_keeps_the_session():
    table = SessionTable()
    one = made("one", live=True)
    table[one.key] = one
    with pytest.raises(TypeError):
        table.popitem()
    assert table[one.key] is one and indexed(table) == {id(one)}


def test_a_session_replaced_under_its_key_leaves_every_index_and_stays_out():
    table = SessionTable()
    old, new = made("same", live=True), made("same")
    table[old.key] = old
    table[new.key] = new
    assert indexed(table) == {id(new)} and table.live_count() == 0
    old.actor, old.messages = object(), [HI, {"role": "assistant", "content": "x"}]  # changed afterwards
    assert indexed(table) == {id(new)} and table.live_count() == 0


def test_in_place_union_indexes_what_it_adds_and_a_session_goes_under_its_own_key_only():
    table = SessionTable()
    session = made("a", live=True)
    table |= {session.key: session}
    assert table.anonymous(session.owner) == [session] and table.live() == [session]
    assert table.continuing(session.owner, [HI]) == [session] and table.owned(session.owner) == [session]
    with pytest.raises(KeyError, match="its own key"):
        table["another"] = made("b")
    assert "another" not in table
