"""What a server runs every second or so for the snapshot store: renewing its leases (ownership across
servers), applying the store's lifetimes and budgets, releasing leases it no longer needs.

A server holds a session's lease (floe.snapshot.lease) while the session is live here or its snapshot
is in this server's RAM tier; a session another server holds is refused (SessionLeased, 409); one it
let go of (frozen into the shared home, lease released or expired) is taken over by the next server
its client asks."""

from __future__ import annotations

import time

from floe.memory import trim_heap
from floe.server.sessions.lifecycle import SessionLifecycle
from floe.server.sessions.session import owner_of_key


class StoreUpkeep:
    """The leases and the store's upkeep of `lifecycle`'s sessions (renewed every lease_s / 3, swept
    every sweep_seconds)."""

    def __init__(self, lifecycle: SessionLifecycle, sweep_seconds: float = 10.0) -> None:
        self.lifecycle, self.sweep_seconds = lifecycle, sweep_seconds
        self.registry, self.snapshots = lifecycle.registry, lifecycle.snapshots
        self._renewed = self._swept = time.monotonic()

    def maintain(self) -> dict[str, list[str]]:
        """Renew this server's leases (every lease_s / 3), drop the sessions whose lease was lost; apply
        the store's TTLs and budgets (every sweep_seconds), forgetting the sessions whose snapshot it
        deleted; release the leases of sessions neither live here nor in this server's RAM tier."""
        now, report = time.monotonic(), {"lost": [], "deleted": [], "released": []}
        lock, sessions = self.registry.lock, self.registry.sessions
        if now - self._renewed >= self.snapshots.lease_s / 3:
            self._renewed = now
            for key in self.snapshots.renew_all():
                report["lost"].append(key)
                with lock:
                    session = sessions.get(key)
                if session is not None and session.lock.acquire(blocking=False):
                    try:
                        self.lifecycle.lose(session)
                    finally:
                        session.lock.release()
        if now - self._swept >= self.sweep_seconds:
            self._swept = now
            with lock:
                busy = [s.key for s in sessions.values() if s.live or s.lock.locked()]
            # The home's budget is each owner's: one key's sessions never push another key's out. A
            # sweep takes at most a sixth of a lease's time: the leases' renewals wait for it.
            swept = self.snapshots.sweep(keep=busy, group=owner_of_key, budget_s=self.snapshots.lease_s / 6)
            if swept["unfinished"]:
                self._swept = now - self.sweep_seconds  # (the rest at the next upkeep, in a second)
            for key in swept["deleted"]:
                report["deleted"].append(key)
                self.lifecycle.forget_frozen(key)
            # Snapshots are made and dropped whole (MBs each) on many threads: glibc keeps what they
            # freed in its arenas (40-170 MB a churn of 100 one-shot sessions, tests/test_server_memory.py),
            # part of the core's RSS growth in bench/soak.py. Handed back once a sweep (~5-10 ms here).
            trim_heap()
        pinned = self.snapshots.pinned
        for key in self.snapshots.leased():
            with lock:
                session = sessions.get(key)
            if session is not None and (session.live or session.lock.locked()):
                continue
            if session is not None and pinned is not None and pinned.has(key):
                continue
            self.snapshots.release(key)
            report["released"].append(key)
        return report
