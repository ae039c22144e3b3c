"""Thread pools whose threads exist before the first burst needs them."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor, wait

START_S = 30.0  # the most starting a pool's threads may take


def started_pool(workers: int, name: str) -> ThreadPoolExecutor:
    """A ThreadPoolExecutor of `workers` threads, all started now. ThreadPoolExecutor starts a thread
    at a submit that finds none idle, in the submitting thread, which waits for the new thread to run
    (a GIL hand-off, longer while other threads hold the GIL): the core's reading thread, which reads
    every request of its front, started one a chat through the first burst after a server's start,
    and read the burst's later requests that much later (docs/PERF_HISTORY.md, "A first burst's
    requests read as they come")."""
    pool = ThreadPoolExecutor(workers, name)
    together = threading.Barrier(workers)  # (each task waits for the others: the pool makes a thread each)
    wait([pool.submit(_meet, together) for _ in range(workers)], timeout=START_S)
    return pool


def _meet(barrier: threading.Barrier) -> None:
    try:
        barrier.wait(START_S)
    except threading.BrokenBarrierError:  # (a pool that could not start them all: it starts the rest later)
        pass
