"""The tiered snapshot store: sessions' snapshots in pinned host RAM, on local disk and in an object
store, under leases, with a TTL and a byte budget per tier.

    store = SnapshotStore([PinnedTier(2 << 30), DiskTier("/var/floe/cache", 20 << 30, ttl_s=86400),
                           RemoteTier("s3://bucket/floe", cache="/var/floe/s3", ttl_s=30 * 86400)])
    store.freeze("alice/chat-1", actor, app=record)       # RAM, and written through to the last tier
    actor = store.thaw("alice/chat-1", engine)            # from the highest tier that holds it
    for chunk in store.export("alice/chat-1"): ...        # verified bytes; store.import_ takes them back

Tiers, top to bottom; the last is the *home* (durable: a folder, or an object store that other
servers share). A persisted snapshot is written through to the home before `freeze`/`put` returns, so
a server killed at any moment loses no acknowledged freeze; the tiers above are caches of it that the
store trusts only while its lease on the key has been continuous (a lease taken anew, or over,
drops them: another server may have written the session meanwhile). A session moves down as it
idles (`sweep`: past a tier's TTL, or beyond its byte budget, oldest use first) and up on its next
use (a thaw makes it live; its next freeze lands in RAM). One-shot entries (`persist=False`) live in
RAM only and are dropped, never moved down. Every byte read from the disk or the object store, and
every import, is checked (floe.snapshot.stream, Snapshot) before it is used or passed on; a damaged
object is refused with SnapshotCorrupt.
"""

from __future__ import annotations

import logging
import mmap
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from floe.snapshot import Snapshot, encode, thaw
from floe.snapshot.errors import (
    LeaseHeld,
    LeaseLost,
    SnapshotCorrupt,
    SnapshotError,
    SnapshotTooLarge,
    SnapshotUnreadable,
)
from floe.snapshot.layout import Header, read_header_buffer
from floe.snapshot.lease import Lease, default_owner
from floe.snapshot.remote import RemoteTier
from floe.snapshot.stream import StreamCheck, check_bytes
from floe.snapshot.tiers import DiskTier, Entry, PinnedTier, check_key, not_found

MAX_BYTES = 1 << 34  # the largest snapshot an import accepts, unless told (16 GiB)
EXPORT_CHUNK = 1 << 20
RENEW_THREADS = 16  # leases renewed at once (renew_all)
log = logging.getLogger("floe.snapshot")


class SnapshotStore:
    """One store over `tiers` (top to bottom; the last is the durable home holding the leases)."""

    def __init__(self, tiers: list, *, owner: str | None = None, lease_s: float = 30.0,
                 max_bytes: int = MAX_BYTES) -> None:
        if not tiers or not tiers[-1].durable:
            raise ValueError("a store's last tier must be durable (a DiskTier or a RemoteTier)")
        self.tiers, self.home = list(tiers), tiers[-1]
        self.pinned = tiers[0] if isinstance(tiers[0], PinnedTier) else None
        if any(isinstance(t, PinnedTier) for t in tiers[1:]):
            raise ValueError("the pinned RAM tier, if any, is a store's first")
        self.owner, self.lease_s, self.max_bytes = owner or default_owner(), lease_s, max_bytes
        self._leases: dict[str, Lease] = {}
        self._lock = threading.Lock()
        self._keep: set[str] = set()  # sweep's: keys the caller is using
        self._held_elsewhere: dict[str, float] = {}  # sweep's: home keys another owner's lease kept, until

    # ---- leases ------------------------------------------------------------------------------------

    def acquire(self, key: str) -> Lease:
        """This store's lease on `key` for lease_s (taken, taken over if expired, or extended).
        Raises LeaseHeld (who holds it, until when) while another owner's lease runs."""
        check_key(key)
        with self._lock:
            held = self._leases.get(key)
        lease, continues = self.home.leases.acquire(key, self.owner, self.lease_s, held)
        if not continues:
            self._drop_copies(key)  # another store may have written it since these were made
        with self._lock:
            self._leases[key] = lease
        return lease

    def _hold(self, key: str) -> Lease:
        """The lease, renewed once half of it has run (acquired if this store has none)."""
        with self._lock:
            lease = self._leases.get(key)
        now = time.time()
        if lease is not None and lease.expires_at - now > self.lease_s / 2:
            return lease
        if lease is not None and lease.expires_at > now:
            return self.renew(key)
        return self.acquire(key)

    def renew(self, key: str) -> Lease:
        """Extend this store's lease on `key` by lease_s from now. Raises LeaseLost if it was taken over."""
        with self._lock:
            lease = self._leases.get(key)
        if lease is None:
            raise LeaseLost(f"this store ({self.owner!r}) holds no lease on session {key!r}")
        try:
            lease = self.home.leases.renew(lease, self.lease_s)
        except LeaseLost:
            with self._lock:
                self._leases.pop(key, None)
            self._drop_copies(key)
            raise
        with self._lock:
            self._leases[key] = lease
        return lease

    def renew_all(self) -> list[str]:
        """Renew every lease this store holds (a server runs this every lease_s / 3); the keys lost,
        also where others' renewals failed (logged, tried again at the next round: a lost key is
        dropped from this store's leases as it is found, so a round that raised would never report
        it). On an object store RENEW_THREADS at once: each is a conditional PUT, a network round
        trip, and one after another 300 of them at 20 ms took 9.7-9.9 s, a round as long as
        lease_s / 3 (python bench/probes/store_load.py --rtt-ms 20); in a folder one after another
        (threads only add their hand-offs to calls of microseconds)."""
        with self._lock:
            keys = list(self._leases)

        def renew(key: str) -> Exception | None:
            try:
                self.renew(key)
            except SnapshotError as e:  # (LeaseLost, or the store unavailable: each key's outcome)
                return e
            return None

        if len(keys) > 1 and isinstance(self.home, RemoteTier):
            with ThreadPoolExecutor(min(RENEW_THREADS, len(keys)), thread_name_prefix="floe-renew") as pool:
                outcomes = list(pool.map(renew, keys))
        else:
            outcomes = [renew(key) for key in keys]
        failed = [(key, e) for key, e in zip(keys, outcomes, strict=True)
                  if e is not None and not isinstance(e, LeaseLost)]
        if failed:
            log.warning("%d of %d leases were not renewed (tried again at the next round), e.g. %r: %s",
                        len(failed), len(keys), failed[0][0], failed[0][1])
        return [key for key, e in zip(keys, outcomes, strict=True) if isinstance(e, LeaseLost)]

    def release(self, key: str) -> None:
        """Give up this store's lease on `key` (another server may take the session at once)."""
        with self._lock:
            lease = self._leases.pop(key, None)
        if lease is not None:
            self.home.leases.release(lease)

    def holder(self, key: str) -> tuple[str, float] | None:
        """(owner, expires_at) of the lease on `key`, if a record exists (it may have expired)."""
        return self.home.leases.holder(check_key(key))

    def _drop_copies(self, key: str) -> None:
        for tier in self.tiers[:-1]:
            tier.remove(key)

    # ---- writing -----------------------------------------------------------------------------------

    def put(self, key: str, data, *, persist: bool = True) -> dict:
        """Store a snapshot file's bytes, checked first: in RAM (if the store has a pinned tier) and,
        if `persist`, written through to the home under this store's lease (LeaseHeld if another
        owner's). A one-shot entry (`persist=False`) goes to RAM only. Returns bytes and checksum."""
        header = check_bytes(data, check_key(key), self.max_bytes)
        if persist:
            self._hold(key)
            self.home.put(key, data)
        if self.pinned is not None:
            try:
                self._settle(self.pinned.put(key, data, persist))
            except SnapshotTooLarge:
                self.pinned.remove(key)  # the home has it (or, one-shot, nothing does)
        return {"key": key, "bytes": header.file_bytes, "checksum": header.metadata["checksum"],
                "persisted": persist}

    def freeze(self, key: str, actor, *, kv_dtype: str | None = None, app: dict | None = None,
               persist: bool = True) -> dict:
        """`floe.snapshot.freeze` into the store (see `put`); bytes, checksum and seconds it took."""
        t = time.perf_counter()
        info = self.put(key, encode(actor, kv_dtype, app), persist=persist)
        return {**info, "seconds": time.perf_counter() - t}

    def import_(self, key: str, chunks: Iterable, *, max_bytes: int | None = None,
                accept: Callable[[Header], None] | None = None) -> dict:
        """Take a snapshot file as a stream of byte chunks (a PUT body) into the home, each checked as
        it passes; the entry is replaced only if the whole stream is one intact snapshot (else a
        SnapshotError, the entry as it was) and `accept(header)`, if given, did not raise (a caller's
        own check of what the snapshot holds). Needs the lease. Returns bytes and checksum."""
        check = StreamCheck(check_key(key), max_bytes or self.max_bytes)
        if accept is not None:
            check = _Accepting(check, accept)
        self._hold(key)
        self.home.write(key, chunks, check)
        self._drop_copies(key)
        return {"key": key, "bytes": check.received, "checksum": check.header.metadata["checksum"]}

    def delete(self, key: str) -> None:
        """Remove `key` from every tier and give its lease up (LeaseHeld if another owner holds it).
        A one-shot entry (in RAM only, never leased) is just dropped."""
        held = self.pinned.get(check_key(key)) if self.pinned is not None else None
        with self._lock:
            leased = key in self._leases
        if held is not None and not held[1].persist and not leased:
            self.pinned.remove(key)
            return
        self._hold(key)
        for tier in self.tiers:
            tier.remove(key)
        self.release(key)

    # ---- reading -----------------------------------------------------------------------------------

    def _trusted(self, key: str) -> list:
        """The tiers whose copy of `key` may be read: all while this store's lease runs (or for a
        one-shot entry in RAM), else the home only."""
        with self._lock:
            lease = self._leases.get(key)
        if lease is not None and lease.expires_at > time.time():
            return self.tiers
        held = self.pinned.get(key) if self.pinned is not None else None
        return self.tiers if held is not None and not held[1].persist else [self.home]

    def get(self, key: str) -> Snapshot:
        """The snapshot under `key`, checked in full (every tensor's bytes) if it came from the disk or
        the object store; in RAM it was checked on its way in. Raises SnapshotNotFound, SnapshotCorrupt."""
        return self._read(key, lambda source: source if isinstance(source, Snapshot) else Snapshot(source))

    def thaw(self, key: str, engine, guest=None, **actor_options):
        """A new actor from the snapshot under `key` (floe.snapshot.thaw, which checks every byte as
        it loads), read from the highest tier that holds it. Takes the lease first (LeaseHeld if
        another owner holds it), except for a one-shot entry."""
        return self.thaw_with_metadata(key, engine, guest, **actor_options)[0]

    def thaw_with_metadata(self, key: str, engine, guest=None, **actor_options) -> tuple[object, dict]:
        """`thaw`, and the metadata of the very snapshot it thawed (e.g. its `app` record: what a
        server keeps beside the actor must be read from the same version, which another store may
        have replaced since this one last looked)."""
        check_key(key)
        held = self.pinned.get(key) if self.pinned is not None else None
        if held is None or held[1].persist:
            self._hold(key)

        def use(source):
            snap = source if isinstance(source, Snapshot) else Snapshot(source, contents=False)
            options = actor_options
            if options.get("into") is not None and options["into"].closed:  # (a first try whose restore
                options = options | {"into": None}  # failed closed it: _read's second makes its own actor)
            return thaw(engine, snap, guest, **options), dict(snap.metadata)

        return self._read(key, use)

    def metadata(self, key: str) -> dict[str, str]:
        """The metadata of the snapshot under `key` from its header alone (checked as a thaw checks a
        header; the tensors' bytes are checked when it is thawed): for listing many sessions. From RAM
        if this store's lease lets it trust its copy, else from the home (one small ranged read on an
        object store). Raises SnapshotNotFound."""
        for tier in self._trusted(check_key(key)):
            if isinstance(tier, PinnedTier):
                held = tier.get(key)
                if held is not None:
                    return dict(read_header_buffer(held[0], Path(f"pinned:{key}")).metadata)
                continue
            found = tier.header(key)
            if found is not None:
                return dict(found.metadata)
        raise not_found(key)

    def _read(self, key: str, use):
        """use(what `key` is read from). A damaged copy in the object store's local cache is fetched
        again, once (the object itself is checked as it streams: a damaged object is refused)."""
        tier, source = self._source(key)
        try:
            return use(source)
        except SnapshotUnreadable as e:  # removed meanwhile by another store
            raise not_found(key) from e
        except SnapshotCorrupt:
            if not isinstance(tier, RemoteTier):
                raise
            tier.drop_cached(key)
            return use(self._source(key)[1])

    def source(self, key: str) -> Snapshot | Path:
        """What `thaw` reads `key` from: a Snapshot over its RAM copy, or a local file (the disk tier's,
        or the object store's copy in the local cache, fetched and checked as it streamed)."""
        return self._source(check_key(key))[1]

    def _source(self, key: str) -> tuple[object, Snapshot | Path]:
        for tier in self._trusted(check_key(key)):
            if isinstance(tier, PinnedTier):
                held = tier.get(key)
                if held is not None:
                    return tier, Snapshot(f"pinned:{key}", buffer=held[0], contents=False)
                continue
            path = tier.source(key)
            if path is not None:
                return tier, path
        raise not_found(key)

    def export(self, key: str, chunk_bytes: int = EXPORT_CHUNK) -> Iterator[memoryview]:
        """The snapshot file under `key` as a stream of chunks, every byte checked before the first is
        given (a GET body). Raises before yielding: SnapshotNotFound, SnapshotCorrupt."""
        snap = self.get(key)
        if not isinstance(snap.buffer, mmap.mmap):  # a RAM copy (a file's was checked by get): it
            check_bytes(snap.buffer, snap.path)    # leaves this process, so it is checked again
        view = memoryview(snap.buffer).cast("B")

        def chunks() -> Iterator[memoryview]:
            for i in range(0, len(view), chunk_bytes):
                yield view[i:i + chunk_bytes]

        return chunks()

    def leased(self) -> list[str]:
        """The keys this store holds a lease on (it may have expired, if renew_all did not run)."""
        with self._lock:
            return sorted(self._leases)

    def keys(self) -> list[str]:
        """Every key any tier holds."""
        return sorted({e.key for tier in self.tiers for e in tier.entries()})

    def has(self, key: str) -> bool:
        """Whether the store holds `key` (in RAM, or in the home: where every persisted entry is)."""
        held = self.pinned is not None and self.pinned.has(check_key(key))
        return held or self.home.has(key)

    def where(self, key: str) -> list[str]:
        """The names of the tiers that hold `key`, top to bottom."""
        return [tier.name for tier in self.tiers if tier.has(check_key(key))]

    # ---- lifecycle ---------------------------------------------------------------------------------

    def sweep(self, now: float | None = None, keep: Iterable[str] = (),
              group: Callable[[str], str] | None = None, budget_s: float | None = None) -> dict:
        """Apply every tier's TTL (seconds since an entry's last use) and byte budget (oldest use out
        first): out of RAM or the disk cache an entry moves down (a one-shot one is dropped); out of
        the home it is deleted, unless another owner holds its lease, or it is in `keep` (a server's
        sessions in use: their last snapshot is not taken from under them). group(key): the home's
        budget applies to each group of keys on its own (a server's: each owner's sessions), so that
        one group's growth deletes only its own oldest. `budget_s`: take nothing more out once that long
        has passed since the first (always taken: every sweep gets on; a slow listing is not counted),
        and say so (`unfinished`: a later sweep goes on; from an object store each deletion is several
        requests, and a mass expiry would hold the server's upkeep, and the lease renewals after it, for
        minutes). An entry of the home another owner's lease kept is not tried again before that lease
        ends. Returns what moved, was dropped, deleted, or kept for its lease."""
        now = time.time() if now is None else now
        self._keep = set(keep)
        wall = time.time()
        self._held_elsewhere = {k: t for k, t in self._held_elsewhere.items() if t > wall}
        deadline = None
        report: dict = {"moved": [], "dropped": [], "deleted": [], "leased": [], "unfinished": False}
        for i, tier in enumerate(self.tiers):
            by_group: dict[str, list[Entry]] = {}
            for entry in sorted(tier.entries(), key=lambda e: e.used_at):
                by_group.setdefault(group(entry.key) if group and tier is self.home else "", []).append(entry)
            for entries in by_group.values():
                total = sum(e.nbytes for e in entries)
                for entry in entries:
                    expired = tier.ttl_s is not None and now - entry.used_at > tier.ttl_s
                    over = tier.budget_bytes is not None and total > tier.budget_bytes
                    if not (expired or over):
                        continue
                    if tier is self.home and entry.key in self._held_elsewhere:
                        report["leased"].append(entry.key)
                        continue
                    if budget_s is not None:
                        if deadline is None:
                            deadline = time.monotonic() + budget_s
                        elif time.monotonic() > deadline:
                            report["unfinished"] = True
                            return report
                    if self._leave(i, entry, report):
                        total -= entry.nbytes
        return report

    def _leave(self, i: int, entry: Entry, report: dict[str, list[str]]) -> bool:
        """Take `entry` out of tier i; False if it stays (the home's, leased by another owner)."""
        tier = self.tiers[i]
        if tier is self.home:
            if entry.key in self._keep:
                report["leased"].append(entry.key)
                return False
            try:
                self.delete(entry.key)
            except LeaseHeld as e:
                self._held_elsewhere[entry.key] = e.expires_at
                report["leased"].append(entry.key)
                return False
            report["deleted"].append(entry.key)
            return True
        if isinstance(tier, PinnedTier):
            held = tier.take(entry.key)
            if held is not None:
                self._settle([(held[1], held[0])], start=i)
            report["moved" if entry.persist else "dropped"].append(entry.key)
            return True
        tier.remove(entry.key)  # a disk cache above the object store: the home has it
        report["moved"].append(entry.key)
        return True

    def _settle(self, leaving: list[tuple[Entry, object]], start: int = 0) -> None:
        """RAM entries pushed out: persisted ones into the next tier below RAM unless that is the home
        (which has them already); one-shot ones dropped."""
        below = next((t for t in self.tiers[start + 1:] if not isinstance(t, PinnedTier)), None)
        for entry, data in leaving:
            if entry.persist and below is not None and below is not self.home:
                below.put(entry.key, data)


class _Accepting:
    """A StreamCheck whose finish also runs the caller's `accept(header)`."""

    def __init__(self, check: StreamCheck, accept: Callable[[Header], None]) -> None:
        self.check, self.accept = check, accept

    def update(self, chunk) -> None:
        self.check.update(chunk)

    def finish(self) -> Header:
        header = self.check.finish()
        self.accept(header)
        return header

    @property
    def received(self) -> int:
        return self.check.received

    @property
    def header(self) -> Header | None:
        return self.check.header


def open_store(snapshots: str | Path, *, pinned_bytes: int = 1 << 30, cache: str | Path | None = None,
               disk: str | Path | None = None, disk_bytes: int | None = None,
               disk_ttl_s: float | None = None, home_bytes: int | None = None,
               home_ttl_s: float | None = None, pinned_ttl_s: float | None = None,
               **store_options) -> SnapshotStore:
    """The store a server's `--snapshots` names (a folder, file://, or s3://bucket/prefix): pinned RAM,
    an optional local disk tier, and that home (an object store is read through `cache`)."""
    from floe.snapshot.remote import tier_for_url

    snapshots = str(snapshots)
    cache = cache if cache is not None else Path(disk or ".") / ".floe-remote-cache"
    tiers: list = [PinnedTier(pinned_bytes, pinned_ttl_s)] if pinned_bytes else []
    if disk is not None:
        tiers.append(DiskTier(disk, disk_bytes, disk_ttl_s))
    tiers.append(tier_for_url(snapshots, cache, home_bytes, home_ttl_s))
    return SnapshotStore(tiers, **store_options)


__all__ = ["DiskTier", "PinnedTier", "RemoteTier", "SnapshotStore", "open_store"]
