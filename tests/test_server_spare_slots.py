"""KV slots taken beside a server's sessions (the CUDA graphs a model loaded on demand captures while its
first sessions run: Engine.warm_up_graphs_later) are counted by the server's admission first, so an
arriving session never finds the slot it was admitted to taken; and a spare never takes a slot a
session needs."""

from __future__ import annotations

import threading
import time

import pytest
from models import tiny_engine

from floe.server.core import ServeCore
from floe.server.sessions.errors import NoFreeSlot


@pytest.fixture(scope="module")
def core(tmp_path_factory):
    core = ServeCore(tiny_engine(n_slots=4), snapshots=tmp_path_factory.mktemp("spare"), model_id="tiny")
    yield core
    core.close()


def test_spare_slots_are_counted_and_given_back(core):
    admission = core.store.admission
    with admission.spare(5) as taken:  # more than the engine has
        assert not taken
    with admission.spare(3) as taken:
        assert taken
        admission.reserve(wait=False)  # the one left
        with pytest.raises(NoFreeSlot):
            admission.reserve(wait=False)  # a fifth would not find its slot
        with admission.spare(1) as more:
            assert not more
        admission.uncount()
    for _ in range(4):  # all four again once the spare ones are given back
        admission.reserve(wait=False)
    for _ in range(4):
        admission.uncount()


def test_a_waiting_request_goes_before_a_spare(core):
    admission = core.store.admission
    for _ in range(4):
        admission.reserve(wait=False)
    waiter = threading.Thread(target=admission.reserve)  # in the queue: every slot counted
    waiter.start()
    try:
        for _ in range(200):
            if admission.waiting:
                break
            time.sleep(0.01)
        assert admission.waiting == 1
        admission.uncount()  # a slot frees: the waiting request's, not a spare's
        with admission.spare(1) as taken:
            assert not taken
        waiter.join(10)
        assert not waiter.is_alive() and not admission.waiting
    finally:
        for _ in range(4):
            admission.uncount()
