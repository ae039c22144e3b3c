"""The step scheduler: concurrent actors' decode steps become one batched engine forward.

Each actor runs its guest in its own thread and calls decode() once per token. A caller that finds no
forward running becomes the leader: it takes every waiting step, runs them as one
Engine.decode_batch, hands each caller its logits and wakes them (no scheduler thread, no hand-off).
Between steps the leader waits a little for the actors of the last batch that have not come back yet
(they are sampling, or running guest code), so a batch does not split into two that alternate. An
actor whose message ended calls leave(): nobody waits for it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

from floe.engine import Engine
from floe.errors import FloeError


@dataclass
class _Step:
    token: int
    slot: int
    result: Tensor | BaseException | None = None
    done: bool = False


class DecodeScheduler:
    """Batches the decode steps of actors that share `engine` (see the module docstring).

    gather_s: how long a ready step waits for members of the previous batch to rejoin (seconds).
    on_batch(rows): called after every forward with its number of rows (metrics).
    """

    def __init__(self, engine: Engine, gather_s: float = 0.005,
                 on_batch: Callable[[int], None] = lambda rows: None) -> None:
        self.engine, self.gather_s, self.on_batch = engine, gather_s, on_batch
        self._cond = threading.Condition()
        self._waiting: dict[int, _Step] = {}
        self._running = False
        self._expected: set[int] = set()  # slots of the last batch that have not left
        self._released_at = 0.0
        self.forwards = 0  # batched forwards run
        self.rows = 0  # steps run in them
        self.rows_of: dict[int, int] = {}  # per slot: how many rows its last step's forward had

    def decode(self, token: int, slot: int) -> Tensor:
        """One decode step of `slot`, run together with whatever other slots are ready; its logits."""
        step = _Step(token, slot)
        with self._cond:
            if slot in self._waiting:
                raise FloeError(f"slot {slot} already has a decode step waiting")
            # No notify: if this step completes the gathering, this thread leads it itself (waking
            # the waiters of a running forward for every arrival cost O(B²) wake-ups per step).
            self._waiting[slot] = step
            while not step.done:
                if self._running:
                    self._cond.wait()
                    continue
                wait = self._gather_left()
                if wait > 0:
                    self._cond.wait(wait)
                    continue
                batch = list(self._waiting.values())
                self._waiting.clear()
                self._running = True
                break
        if not step.done:
            self._lead(batch)
        if isinstance(step.result, BaseException):
            raise step.result
        return step.result

    def _gather_left(self) -> float:
        """Seconds still to wait for last batch's members; <= 0 when the waiting steps should run."""
        if not self._waiting or self._expected <= self._waiting.keys():
            return 0.0
        return self._released_at + self.gather_s - time.monotonic()

    def _lead(self, batch: list[_Step]) -> None:
        try:
            results = self.engine.decode_batch([s.token for s in batch], [s.slot for s in batch])
        except BaseException as e:  # the forward itself failed: every caller gets the error
            results = [e] * len(batch)
        with self._cond:
            for step, result in zip(batch, results, strict=True):
                step.result, step.done = result, True
                self.rows_of[step.slot] = len(batch)
            self._expected = {s.slot for s in batch if not isinstance(s.result, BaseException)}
            self._released_at = time.monotonic()
            self._running = False
            self.forwards += 1
            self.rows += len(batch)
            self._cond.notify_all()
        self.on_batch(len(batch))

    def leave(self, slot: int) -> None:
        """`slot`'s actor will not decode again soon (its message ended): stop waiting for it."""
        with self._cond:
            self._expected.discard(slot)
            self._cond.notify_all()
