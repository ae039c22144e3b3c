"""Admission to the engine's KV slots: a slot counted for each session going live (so concurrent
arrivals never both take the last one), an idle session frozen to make room when every slot is taken,
and, while every slot runs a request, a bounded wait queue that is fair between owners (API keys)."""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from floe.actor import Actor
from floe.engine import Engine
from floe.server.sessions.errors import ClientLeft, NoFreeSlot, OneSlotOnly
from floe.server.sessions.registry import SessionRegistry
from floe.server.sessions.session import Session


class _Ticket:
    """A request's place in the wait queue for a KV slot."""

    __slots__ = ("owner", "bumped")

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self.bumped: str | None = None  # why it lost its place to another owner's request (its 503)


class SlotAdmission:
    """The KV slots of `engine` counted for the sessions of `registry` (under its lock). Requests wait
    for a slot while every slot runs one, first come first served: at most max_waiting, each at most
    wait_seconds (then a 503 with Retry-After, as when the queue is full). make_room(session): free
    the session's slot if it is idle and live (frozen, or forgotten past its owner's bound of anonymous
    sessions; True if its slot is free now); set by the session store."""

    def __init__(self, registry: SessionRegistry, engine: Engine, max_waiting: int = 8,
                 wait_seconds: float = 30.0) -> None:
        self.registry, self.engine = registry, engine
        self.lock = registry.lock
        self.max_waiting, self.wait_seconds = max_waiting, wait_seconds
        self.make_room: Callable[[Session], bool] = lambda session: False
        self._reserved = 0  # slots counted for sessions whose actor is being made
        self._waiting: deque[_Ticket] = deque()  # tickets, oldest first; guarded by lock
        self._slot_freed = threading.Condition(self.lock)
        self._extra_waiting = 0  # structured turns waiting for their grammar actor's slot (extra_slot)
        self._extra_held: Counter[str] = Counter()  # extra_slot's slots held now, by owner

    @property
    def waiting(self) -> int:
        """Requests waiting for a KV slot now."""
        return len(self._waiting)

    def uncount(self, session: Session | None = None, actor: Actor | None = None) -> None:
        """The slot `reserve` counted for `session` is `actor`'s now, given to the session here (no actor:
        the slot is free again). Under the lock with the count, so that an arrival counting slots never
        sees the session both live and reserved (every slot taken, an idle session frozen for
        nothing)."""
        with self.lock:
            if session is not None and actor is not None:
                session.actor = actor
            self._reserved -= 1

    @contextmanager
    def spare(self, n: int) -> Iterator[bool]:
        """Count n KV slots for work beside the sessions (the engine's graphs captured while they run:
        Engine.warm_up_graphs_later) while the with-block runs, if n are free with no request waiting;
        never one a session would need. Yields whether they were counted."""
        with self.lock:
            live = self.registry.sessions.live_count()
            counted = not self._waiting and live + self._reserved + n <= self.engine.cache.n_slots
            if counted:
                self._reserved += n
        try:
            yield counted
        finally:
            if counted:
                with self.lock:
                    self._reserved -= n
                    self._slot_freed.notify_all()

    def notify_freed(self) -> None:
        """A session went idle: its slot can be taken now (frozen for a waiting request)."""
        with self.lock:
            self._slot_freed.notify_all()

    def reserve(self, wait: bool = True, owner: str = "", gone: Callable[[], bool] = lambda: False) -> None:
        """Count a KV slot for a session of `owner`'s about to go live (its actor claims it next),
        freezing the least recently used idle live session if every slot is taken. Counted under the
        store's lock, so concurrent arrivals cannot both take the last slot. While every slot runs a
        request, wait (`wait`) in the queue for at most wait_seconds, fairly between owners (the next
        slot goes to the waiting request whose owner holds the fewest; among one owner's, the oldest);
        NoFreeSlot (a 503 with Retry-After) when the queue is full or the wait ends; ClientLeft once
        `gone()` (its client left: a request a client gave up on held its place in the queue, and a
        client retrying on a short timeout filled it, every other request a 503)."""
        sessions = self.registry.sessions
        ticket, deadline = None, 0.0
        try:
            while True:
                with self.lock:
                    if ticket is None and self._waiting and wait:  # others wait already: with them
                        ticket, deadline = self._enqueue(owner)
                    if ticket is not None and ticket.bumped is not None:
                        raise NoFreeSlot(ticket.bumped)
                    if ticket is None or self._next_in_line() is ticket:
                        live = sessions.live()
                        if len(live) + self._reserved < self.engine.cache.n_slots:
                            self._reserved += 1
                            return
                        idle = sorted((s for s in live if not s.lock.locked()), key=lambda s: s.last_used)
                    else:
                        idle = []
                if any(self.make_room(victim) for victim in idle):
                    continue
                with self.lock:
                    if not wait:
                        raise NoFreeSlot(f"all {self.engine.cache.n_slots} KV slots are busy with running "
                                         "requests")
                    if ticket is None:
                        ticket, deadline = self._enqueue(owner)
                    left = deadline - time.monotonic()
                    if gone():
                        raise ClientLeft("the client left while its request waited for a KV slot")
                    if left <= 0:
                        raise NoFreeSlot(f"all {self.engine.cache.n_slots} KV slots stayed busy with running "
                                         f"requests for the {self.wait_seconds:g} s this one may wait")
                    self._slot_freed.wait(min(left, 0.25))  # (woken when a request ends; else it looks again)
        finally:
            if ticket is not None:
                with self.lock:
                    if ticket.bumped is None:
                        self._waiting.remove(ticket)
                    self._slot_freed.notify_all()  # the next in line may go now

    def _enqueue(self, owner: str) -> tuple[_Ticket, float]:
        """A place in the wait queue for a request of `owner`'s (caller holds the lock). A full queue
        refuses it (NoFreeSlot), unless `owner` has none there and another owner has several: then
        that owner's newest gives up its place (its request gets the 503), so that one key cannot
        keep every other key out of the queue."""
        if len(self._waiting) >= self.max_waiting:
            mine = sum(t.owner == owner for t in self._waiting)
            counts = Counter(t.owner for t in self._waiting)
            most, n = counts.most_common(1)[0] if counts else ("", 0)
            if mine or n < 2:
                raise NoFreeSlot(f"all {self.engine.cache.n_slots} KV slots are busy with running requests "
                                 f"and {len(self._waiting)} more wait for one (the most that may)")
            newest = next(t for t in reversed(self._waiting) if t.owner == most)
            newest.bumped = (f"all {self.engine.cache.n_slots} KV slots are busy, and this request's place "
                             "in the queue went to another API key's (each key gets a share of it)")
            self._waiting.remove(newest)
            self._slot_freed.notify_all()
        ticket = _Ticket(owner)
        self._waiting.append(ticket)
        return ticket, time.monotonic() + self.wait_seconds

    def _next_in_line(self) -> _Ticket | None:
        """The waiting request the next free slot goes to (caller holds the lock): the oldest of the
        owner with the fewest sessions running or live (and slots held by extra_slot: structured turns,
        text completions), so that one key's many requests do not keep another key's waiting behind
        them all."""
        if not self._waiting:
            return None
        holding = Counter(s.owner for s in self.registry.sessions.live()) + self._extra_held
        return min(self._waiting, key=lambda t: holding[t.owner])  # (min keeps the first of equals)

    @contextmanager
    def extra_slot(self, owner: str = "", beside_session: bool = True,
                   gone: Callable[[], bool] = lambda: False) -> Iterator[None]:
        """A KV slot counted, for the block, for an actor of no session's (a structured turn's, whose
        session is `owner`'s): freezes the least recently used idle session if every slot is taken, and
        while all run a request, waits in the queue as a session's request does (NoFreeSlot when its
        wait ends) — unless the turns waiting so would then hold every slot but one: their sessions
        hold theirs while they wait, and with all held so, none would ever be freed (NoFreeSlot at once).
        beside_session False: the actor is the request's only one (a text completion's), which holds no
        slot while it waits, so it waits as a new session's request does."""
        n_slots = self.engine.cache.n_slots
        if beside_session and n_slots < 2:  # its session holds the only one while the turn runs
            raise OneSlotOnly("structured output (response_format, tools) runs on an actor of its own "
                              "beside its session's: start floe serve with --max-sessions 2 or more")
        with self.lock:
            wait = not beside_session or self._extra_waiting + 1 < n_slots
            if wait and beside_session:
                self._extra_waiting += 1
        try:
            self.reserve(wait=wait, owner=owner, gone=gone)
        finally:
            if wait and beside_session:
                with self.lock:
                    self._extra_waiting -= 1
        with self.lock:
            self._extra_held[owner] += 1  # (the queue's fairness counts it as the owner's)
        try:
            yield
        finally:
            with self.lock:
                self._reserved -= 1
                self._extra_held[owner] -= 1
                self._slot_freed.notify_all()
