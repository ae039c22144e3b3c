"""floe.randomness: unguessable values without a system call each — of the sizes asked, none alike in a
process or across threads, a forked child's never its parent's, and no kernel read after the first."""

from __future__ import annotations

import multiprocessing
import os
import threading

import pytest

from floe import randomness


def _child_tokens(queue) -> None:
    queue.put([randomness.token_hex(16) for _ in range(100)])


def test_values_have_their_sizes_and_are_never_alike_across_threads_or_a_fork(monkeypatch):
    assert len(randomness.token_hex(8)) == 16 and int(randomness.token_hex(8), 16) >= 0
    assert all(0 <= randomness.randbits(63) < 2 ** 63 for _ in range(1000))
    assert len({randomness.randbits(63) for _ in range(1000)}) == 1000
    with pytest.raises(ValueError):
        randomness.token_hex(33)
    with pytest.raises(ValueError):
        randomness.randbits(0)
    seen: list[str] = []
    threads = [threading.Thread(target=lambda: seen.extend(randomness.token_hex(8) for _ in range(2000)))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(seen)) == len(seen) == 8000
    parent = [randomness.token_hex(16) for _ in range(100)]
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_child_tokens, args=(queue,))
    child.start()
    theirs = queue.get(timeout=60)
    child.join(timeout=30)
    parent += [randomness.token_hex(16) for _ in range(100)]
    assert child.exitcode == 0 and not set(theirs) & set(parent)
    reads = []
    monkeypatch.setattr(os, "urandom", lambda n: reads.append(n) or b"\0" * n)
    for _ in range(100):
        randomness.token_hex(8)
    assert reads == []  # (the key is read once a process)
