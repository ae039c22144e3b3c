"""A new session's lease on a local disk is created without a lock (floe.snapshot.atomic.create_exclusive:
a whole file without a name (O_TMPFILE) or a whole temporary, hard-linked to the name, which link(2)
refuses if it exists): of creators racing for one key, in threads and in processes, exactly one wins,
either way; a filesystem without files without a name falls back to temporaries, one without hard links
to the lease's lock; creates racing releases and replaces never leave two holders at once; the
temporary of a creator that died is cleaned, a live creator's is not."""

from __future__ import annotations

import errno
import multiprocessing
import os
import threading
import time

import pytest

from floe.snapshot import atomic
from floe.snapshot.atomic import LINK_TEMP_STALE_S, clean_stale, create_exclusive
from floe.snapshot.errors import LeaseHeld
from floe.snapshot.lease import FileLeases

KEYS = 40


@pytest.fixture(params=["unnamed", "temporary"])
def way(request, monkeypatch):
    """create_exclusive's way: a file without a name where this machine makes them, or a temporary."""
    if request.param == "temporary":
        monkeypatch.setattr(atomic, "_held_calls", None)
    elif atomic._held_calls is None:
        pytest.skip("no files without a name here (not Linux)")
    return request.param


@pytest.fixture
def temporaries(monkeypatch):
    monkeypatch.setattr(atomic, "_held_calls", None)


def race(folder, owner: str, keys: list[str], start: float) -> list[str]:
    """The keys whose new lease `owner` won, each tried once from `start` (a wall-clock moment)."""
    leases = FileLeases(folder)
    time.sleep(max(0.0, start - time.time()))
    won = []
    for key in keys:
        try:
            leases.acquire(key, owner, 60)
            won.append(key)
        except LeaseHeld:
            pass
    return won


def _race_into(queue, folder, owner, keys, start) -> None:
    queue.put((owner, race(folder, owner, keys, start)))


def race_in_threads(folder, keys: list[str], start: float, n: int = 4) -> dict[str, list[str]]:
    """Each of n threads' winnings (race), by owner."""
    winners: dict[str, list[str]] = {}
    threads = [threading.Thread(target=lambda o=f"thread-{i}": winners.setdefault(
        o, race(folder, o, keys, start))) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return winners


def exactly_one_each(winners: dict[str, list[str]], folder, keys: list[str]) -> None:
    for key in keys:
        holders = [owner for owner, won in winners.items() if key in won]
        assert len(holders) == 1, f"{key}: won by {holders}"
        assert FileLeases(folder).holder(key)[0] == holders[0]
    left = [p.name for p in folder.rglob("*")
            if p.is_file() and not p.name.endswith((".lease", ".floe-lock"))]
    assert left == [], f"temporaries left: {left}"


def test_threads_and_processes_racing_for_new_leases_each_key_won_once(tmp_path, way):
    keys = [f"s{i}" for i in range(KEYS)] + [f"owner{i % 3}/s{i}" for i in range(KEYS)]  # new folders too
    start = time.time() + 1.0
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    processes = [context.Process(target=_race_into, args=(queue, tmp_path, f"proc-{i}", keys, start))
                 for i in range(2)]
    for p in processes:
        p.start()
    winners = race_in_threads(tmp_path, keys, start)
    for _ in processes:
        owner, won = queue.get(timeout=60)
        winners[owner] = won
    for p in processes:
        p.join(timeout=30)
        assert p.exitcode == 0
    exactly_one_each(winners, tmp_path, keys)


def test_without_hard_links_a_new_lease_takes_the_lock_and_is_still_won_once(tmp_path, monkeypatch,
                                                                               temporaries):
    def no_links(src, dst, *args, **kwargs):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    keys = [f"s{i}" for i in range(KEYS)]
    exactly_one_each(race_in_threads(tmp_path, keys, time.time() + 0.2), tmp_path, keys)
    leases = FileLeases(tmp_path)
    leases.acquire("t", "a", 60)
    assert not leases.links  # told once; its later creates go straight to the lock


def test_creates_racing_releases_never_leave_two_holders(tmp_path):
    """Owners take one key in turn: each acquires (a lock-free create once the last holder released,
    a replace under the lock when it renews), checks that nobody else believes they hold it, renews,
    and releases (a delete under the lock)."""
    holding: list[str] = []
    guard, errors = threading.Lock(), []
    deadline = time.time() + 2.0

    def owner(name: str) -> int:
        leases, turns = FileLeases(tmp_path), 0
        while time.time() < deadline:
            try:
                lease, _ = leases.acquire("k", name, 60)
            except LeaseHeld:
                continue
            with guard:
                if holding:
                    errors.append(f"{name} acquired while {holding} held it")
                holding.append(name)
            lease = leases.renew(lease, 60)
            with guard:
                holding.remove(name)
            assert leases.release(lease)
            turns += 1
        return turns

    turns = {}
    threads = [threading.Thread(target=lambda n=f"o{i}": turns.setdefault(n, owner(n))) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert sum(turns.values()) > 20, turns  # the key changed hands many times
    assert FileLeases(tmp_path).holder("k") is None


def test_a_creators_old_temporary_is_cleaned_by_its_age_and_a_young_one_kept(tmp_path, way):
    """No lock tells that a creator's temporary is in use, and its pid tells nothing where another host
    or pid namespace shares the folder: clean_stale goes by its age, takes no lock, leaves no sidecar."""
    target = tmp_path / "k.lease"
    assert create_exclusive(target, b"{}") and not create_exclusive(target, b"{}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k.lease"]
    old = tmp_path / ".k.lease.999999-1-0123abcd.link.floe-tmp"
    young = tmp_path / f".k.lease.{2**22 + 12345}-1-4567abcd.link.floe-tmp"  # no such pid here
    for path in (old, young):
        path.write_bytes(b"{\"own")  # what a creator killed before its link leaves
    long_ago = time.time() - LINK_TEMP_STALE_S - 5
    os.utime(old, (long_ago, long_ago))
    assert clean_stale(tmp_path) == [old]
    assert young.exists() and target.read_bytes() == b"{}"
    assert sorted(p.name for p in tmp_path.iterdir()) == [young.name, "k.lease"]  # no lock sidecar


def test_a_creator_whose_temporary_was_cleaned_before_its_link_writes_it_again(tmp_path, monkeypatch,
                                                                               temporaries):
    link, cleaned = os.link, []

    def cleaned_first(src, dst, *args, **kwargs):
        if not cleaned:  # a cleaner (another host's, its clock far ahead) removed it meanwhile
            cleaned.append(src)
            os.unlink(src)
        return link(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "link", cleaned_first)
    leases = FileLeases(tmp_path)
    lease, _ = leases.acquire("k", "server-a", 60)
    assert cleaned and leases.holder("k")[0] == "server-a" and leases.links
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k.lease"]


@pytest.mark.parametrize("existing", [b"", b"{}"])
def test_a_create_never_replaces_a_file_there(tmp_path, existing, way):
    target = tmp_path / "k.lease"
    target.write_bytes(existing)  # even an empty one (a crash's): replacing that is the lock's job
    assert not create_exclusive(target, b"new")
    assert target.read_bytes() == existing


def test_a_create_under_the_lock_and_a_lock_free_one_never_both_win(tmp_path, monkeypatch):
    """A store on a filesystem without hard links creates under the lease's lock: read (no record),
    then make the file with O_EXCL; a lock-free creator that links its record in between wins, and the
    locked one is refused (review of 2136627: it replaced the record it had found absent)."""
    locked, free = FileLeases(tmp_path), FileLeases(tmp_path)
    locked.links = False
    read, reads = locked._read, []

    def read_then_race(key):
        found = read(key)
        reads.append(found)
        if len(reads) == 1:  # the compare under the lock (a new hold's create comes before any other
            # read) found no record: the other store links its own
            free.acquire(key, "free", 60)
        return found

    monkeypatch.setattr(locked, "_read", read_then_race)
    with pytest.raises(LeaseHeld):
        locked.acquire("k", "locked", 60)
    assert FileLeases(tmp_path).holder("k")[0] == "free"


def test_a_new_lease_is_created_without_a_read_and_an_existing_record_is_still_read(tmp_path, monkeypatch):
    """A hold the store does not have tries the create first: a new key's lease takes no read; where a
    record exists (held by another owner, expired, or this owner's own from before), the create loses
    and the record is read and judged as before."""
    leases = FileLeases(tmp_path)
    reads = []
    read = leases._read
    monkeypatch.setattr(leases, "_read", lambda key: reads.append(key) or read(key))
    first, continues = leases.acquire("new", "server-a", 60)
    assert reads == [] and not continues and leases.holder("new")[0] == "server-a"
    with pytest.raises(LeaseHeld):
        leases.acquire("new", "server-b", 60)
    assert reads
    again, continues = leases.acquire("new", "server-a", 60, held=first)
    assert continues and again.token == first.token
    mine, continues = leases.acquire("new", "server-a", 60)  # (its own record, its hold forgotten)
    assert not continues and mine.token != first.token and leases.holder("new")[0] == "server-a"
    expired, _ = leases.acquire("old", "server-c", -1)
    taken, continues = leases.acquire("old", "server-b", 60)
    assert leases.holder("old")[0] == "server-b" and not continues and taken.token != expired.token


def test_an_object_store_reads_a_lease_before_it_creates_one():
    """A bucket's new hold reads first (its conditional write may be ignored by a compatible server: a
    live lease must be refused, not overwritten); a folder's creates first."""
    from floe.snapshot.lease import Leases, S3Leases

    assert FileLeases.create_first and not S3Leases.create_first and not Leases.create_first


def test_a_folder_it_cannot_write_still_says_who_holds_a_lease(tmp_path, monkeypatch):
    """A create that fails for the folder (not for a record there) falls through to the read: another
    owner's live lease is LeaseHeld, as before the create came first."""
    leases = FileLeases(tmp_path)
    leases.acquire("k", "server-a", 60)

    def denied(key, lease):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(leases, "_create", denied)
    with pytest.raises(LeaseHeld):
        leases.acquire("k", "server-b", 60)


def test_a_folder_refusing_files_without_a_name_gets_temporaries_and_is_not_asked_again(tmp_path,
                                                                                         monkeypatch):
    """A filesystem without O_TMPFILE (NFS, some FUSE): the create goes the temporary's way, exactly
    once a key, and that folder is not asked again; where linkat cannot name it (no /proc mounted) too."""
    if atomic._held_calls is None:
        pytest.skip("no files without a name here (not Linux)")
    monkeypatch.setattr(atomic, "_no_unnamed", set())
    opened, real_open = [], os.open

    def refusing(path, flags, *args, **kwargs):
        if flags & os.O_TMPFILE == os.O_TMPFILE:
            opened.append(path)
            raise OSError(errno.EOPNOTSUPP, "Operation not supported")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", refusing)
    keys = [f"s{i}" for i in range(KEYS)]
    exactly_one_each(race_in_threads(tmp_path, keys, time.time() + 0.2), tmp_path, keys)
    assert 1 <= len(opened) <= 4 and str(tmp_path) in atomic._no_unnamed  # (each thread's first, at most)
    monkeypatch.setattr(os, "open", real_open)
    atomic._no_unnamed.clear()
    write, _, close = atomic._held_calls

    def no_proc(*args):
        import ctypes
        ctypes.set_errno(errno.ENOENT)
        return -1

    monkeypatch.setattr(atomic, "_held_calls", (write, no_proc, close))
    target = tmp_path / "other" / "k.lease"
    assert create_exclusive(target, b"{1}") and not create_exclusive(target, b"{2}")
    assert target.read_bytes() == b"{1}" and str(target.parent) in atomic._no_unnamed
    assert sorted(p.name for p in target.parent.iterdir()) == ["k.lease"]


def test_a_file_without_a_name_is_whole_and_its_failures_are_the_callers(tmp_path, monkeypatch):
    """The unnamed way's write failing (a full disk) raises, names nothing and leaves nothing."""
    if atomic._held_calls is None:
        pytest.skip("no files without a name here (not Linux)")
    target = tmp_path / "k.lease"
    assert create_exclusive(target, b'{"owner": "a"}') and target.read_bytes() == b'{"owner": "a"}'
    _, link, close = atomic._held_calls

    def full(*args):
        import ctypes
        ctypes.set_errno(errno.ENOSPC)
        return -1

    monkeypatch.setattr(atomic, "_held_calls", (full, link, close))
    with pytest.raises(OSError) as e:
        create_exclusive(tmp_path / "j.lease", b"{}")
    assert e.value.errno == errno.ENOSPC
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k.lease"]
