"""Leases: one owner of a session at a time, across processes and machines (floe.snapshot.store).

A lease is a small JSON record beside the session's snapshot, `{key}.lease`: its owner, a random
token and the wall-clock second it expires. It changes only by compare-and-swap, so of two stores
racing for it exactly one wins:

- on an object store (`S3Leases`): conditional writes — create with `If-None-Match: *`, replace and
  delete with `If-Match: <ETag>` (a 412 means someone else changed it first);
- on a local disk (`FileLeases`): a new record is hard-linked into place from a temporary (link(2)
  fails if the name exists: create-if-absent without a lock); replace and delete take the lease
  file's writers' lock (floe.snapshot.atomic.path_lock, `flock` across processes) around read,
  compare, atomic replace. A replace finds the file there and keeps it there, and a delete holds the
  lock, so a lock-free create never slips between a compare and its write; a create under the lock
  (a filesystem without hard links) makes the file with O_EXCL, so neither overwrites the other.
  A floe from before lock-free creates (2026-12-06) replaced a record it had found absent: if such a
  server shares the folder, two servers creating the same new session's lease in the same moment can
  both take it (the later one's renewal then raises LeaseLost): upgrade a folder's servers together.

Another owner's lease that has not expired is refused (LeaseHeld: who, until when); an expired one
is taken over, and so is one whose owner was a process of this host that has exited (`owner_gone`).
Renewing a lease that was taken over meanwhile raises LeaseLost. Expiry is wall-clock
time: the machines sharing a bucket must keep their clocks within a small part of a lease.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

from floe import randomness
from floe.snapshot.atomic import NoHardLinks, create_exclusive, path_lock, replace_held, write_new
from floe.snapshot.errors import LeaseHeld, LeaseLost, StoreUnavailable

LEASE_SUFFIX = ".lease"


@dataclass(frozen=True)
class Lease:
    """One owner's hold on a session until `expires_at` (seconds since the epoch)."""

    key: str
    owner: str
    token: str  # random per acquisition: an owner that took over is told apart from the one before
    expires_at: float
    etag: str  # the backend's version of the record (S3 ETag; the token on disk)

    def record(self) -> bytes:
        return json.dumps({"owner": self.owner, "token": self.token, "expires_at": self.expires_at}).encode()


class Leases(ABC):
    """The compare-and-swap logic shared by every backend; a backend supplies _read, _create,
    _replace and _delete (None / False on a lost race). create_first: a new hold tries _create before
    reading, where a create can never replace a record (a local folder's hard link or O_EXCL; not an
    object store, whose conditional write a compatible server may ignore: a live lease would then be
    overwritten, where the read first refuses it)."""

    create_first = False

    def acquire(self, key: str, owner: str, seconds: float, held: Lease | None = None) -> tuple[Lease, bool]:
        """Take (or extend, if `owner` holds it) `key`'s lease for `seconds`. Returns the lease and
        whether it continues `held` (nobody else held the session in between). Raises LeaseHeld."""
        if held is None and self.create_first:  # a hold this store does not have: most often no record
            # exists (a new session, one released), so the create is tried before any read (a new
            # session's lease: one call into the folder instead of two). A record there: as below.
            lease = self._new(key, owner, time.time() + seconds)
            try:
                etag = self._create(key, lease)
            except OSError:  # (a folder it cannot write: the read below says who holds it, if anyone)
                etag = None
            if etag is not None:
                return _with_etag(lease, etag), False
        for _ in range(16):  # each turn loses only to another store's successful write
            current = self._read(key)
            now = time.time()
            if current is None:
                lease = self._new(key, owner, now + seconds)
                etag = self._create(key, lease)
                if etag is not None:
                    return _with_etag(lease, etag), False
                continue
            record, etag = current
            if record["owner"] != owner and record["expires_at"] > now and not owner_gone(record["owner"]):
                raise LeaseHeld(key, record["owner"], record["expires_at"])
            continues = held is not None and record["token"] == held.token and record["owner"] == owner
            token = record["token"] if continues else randomness.token_hex(8)
            lease = Lease(key, owner, token, now + seconds, "")
            new_etag = self._replace(key, lease, etag)
            if new_etag is not None:
                return _with_etag(lease, new_etag), continues
        raise StoreUnavailable(f"lease of {key!r}: lost 16 races in a row to other stores")

    def renew(self, lease: Lease, seconds: float) -> Lease:
        """The same lease until `seconds` from now. Raises LeaseLost if it is no longer this one."""
        renewed = Lease(lease.key, lease.owner, lease.token, time.time() + seconds, "")
        etag = self._replace(lease.key, renewed, lease.etag)
        if etag is None:
            raise self._lost(lease)
        return _with_etag(renewed, etag)

    def release(self, lease: Lease) -> bool:
        """Give the lease up (remove its record); False if it was not this one any more."""
        return self._delete(lease.key, lease.etag)

    def holder(self, key: str) -> tuple[str, float] | None:
        """(owner, expires_at) of `key`'s lease record, if there is one (expired or not)."""
        current = self._read(key)
        return None if current is None else (current[0]["owner"], current[0]["expires_at"])

    def _lost(self, lease: Lease) -> LeaseLost:
        now = self._read(lease.key)
        who = (f"{now[0]['owner']!r} holds it now" if now is not None and now[0]["token"] != lease.token
               else "its record is gone")
        return LeaseLost(f"the lease of session {lease.key!r} is no longer held by {lease.owner!r} ({who}): "
                         "it expired and was taken over, or was released; this store must not write the "
                         "session")

    @staticmethod
    def _new(key: str, owner: str, expires_at: float) -> Lease:
        return Lease(key, owner, randomness.token_hex(8), expires_at, "")

    @abstractmethod
    def _read(self, key: str) -> tuple[dict, str] | None:
        """The record and its version tag, or None if there is none."""

    @abstractmethod
    def _create(self, key: str, lease: Lease) -> str | None:
        """Write a new record only if there is none; its version tag, or None if one exists."""

    @abstractmethod
    def _replace(self, key: str, lease: Lease, etag: str) -> str | None:
        """Replace the record only if its version is still `etag`; the new tag, or None if not."""

    @abstractmethod
    def _delete(self, key: str, etag: str) -> bool:
        """Delete the record only if its version is still `etag`; whether it was."""


def _with_etag(lease: Lease, etag: str) -> Lease:
    return Lease(lease.key, lease.owner, lease.token, lease.expires_at, etag)


def parse_record(raw: bytes, where: str) -> dict:
    """A lease record; anything else is a backend that holds something it should not."""
    try:
        record = json.loads(raw)
        if (isinstance(record, dict) and isinstance(record.get("owner"), str)
                and isinstance(record.get("token"), str)
                and isinstance(record.get("expires_at"), int | float)):
            return record
    except ValueError:
        pass
    raise StoreUnavailable(f"{where} is not a lease record (owner, token, expires_at); remove it to free "
                           "the session")


class FileLeases(Leases):
    """Leases as files in a local folder; the lease file's lock makes read-compare-replace atomic."""

    create_first = True

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.links = True  # whether the folder's filesystem hard-links (else creates take the lock)

    def _path(self, key: str) -> Path:
        return self.folder / f"{key}{LEASE_SUFFIX}"

    def _read(self, key: str) -> tuple[dict, str] | None:
        path = self._path(key)
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return None
        if not raw:  # what a machine's crash can leave of a record (written without fsync): expired
            return {"owner": "", "token": "", "expires_at": 0.0}, ""
        record = parse_record(raw, str(path))
        return record, record["token"]

    def _swap(self, key: str, etag: str | None, lease: Lease | None) -> bool:
        """Under the lease file's lock: if its token is `etag` (None: no file), write `lease` (None:
        remove it)."""
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        turn = path.with_name(path.name + ".cas")  # the lease's writers take turns on this lock
        with path_lock(turn, guards=path):  # (its sidecar goes with the lease file)
            current = self._read(key)
            if (current[1] if current is not None else None) != etag:
                return False
            if lease is None:
                path.unlink()
            elif current is None:  # a create: exclusive also against a lock-free creator's link
                return write_new(path, lease.record())
            else:
                # Not flushed to disk: a hold with an expiry needs only the atomic replace (every
                # process sees the old record or the new one); a crash that empties it ends its
                # holder too. Two fsyncs a new session were most of `floe serve`'s time to open one.
                replace_held(path, lease.record(), turn)
            return True

    def _create(self, key: str, lease: Lease) -> str | None:
        if self.links:
            try:
                return lease.token if create_exclusive(self._path(key), lease.record()) else None
            except NoHardLinks:
                self.links = False
        return lease.token if self._swap(key, None, lease) else None

    def _replace(self, key: str, lease: Lease, etag: str) -> str | None:
        return lease.token if self._swap(key, etag, lease) else None

    def _delete(self, key: str, etag: str) -> bool:
        return self._swap(key, etag, None)


class S3Leases(Leases):
    """Leases as objects in a bucket, changed only by conditional writes (If-None-Match, If-Match)."""

    def __init__(self, fs, root: str) -> None:
        self.fs, self.root = fs, root.rstrip("/")

    def _where(self, key: str) -> tuple[str, str]:
        bucket, _, prefix = f"{self.root}/{key}{LEASE_SUFFIX}".partition("/")
        return bucket, prefix

    def _read(self, key: str) -> tuple[dict, str] | None:
        bucket, name = self._where(key)
        try:
            reply = self.fs.call_s3("get_object", Bucket=bucket, Key=name)
            raw = _body(self.fs, reply)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise StoreUnavailable(f"cannot read the lease s3://{bucket}/{name}: {e}") from e
        return parse_record(raw, f"s3://{bucket}/{name}"), reply["ETag"]

    def _put(self, key: str, lease: Lease, **condition) -> str | None:
        bucket, name = self._where(key)
        try:
            return self.fs.call_s3("put_object", Bucket=bucket, Key=name, Body=lease.record(),
                                   **condition)["ETag"]
        except OSError as e:
            if _precondition_failed(e):
                return None
            raise StoreUnavailable(f"cannot write the lease s3://{bucket}/{name}: {e}") from e

    def _create(self, key: str, lease: Lease) -> str | None:
        return self._put(key, lease, IfNoneMatch="*")

    def _replace(self, key: str, lease: Lease, etag: str) -> str | None:
        return self._put(key, lease, IfMatch=etag)

    def _delete(self, key: str, etag: str) -> bool:
        bucket, name = self._where(key)
        try:
            self.fs.call_s3("delete_object", Bucket=bucket, Key=name, IfMatch=etag)
        except FileNotFoundError:
            return False
        except OSError as e:
            if _precondition_failed(e):
                return False
            raise StoreUnavailable(f"cannot remove the lease s3://{bucket}/{name}: {e}") from e
        return True


def _body(fs, reply: dict) -> bytes:
    """A get_object reply's body, read on s3fs's event loop (its client is asynchronous)."""
    from fsspec.asyn import sync

    async def read() -> bytes:
        async with reply["Body"] as body:
            return await body.read()

    return sync(fs.loop, read)


def _precondition_failed(e: OSError) -> bool:
    """s3fs turns S3's 412 (and 409, a concurrent conditional write) into OSErrors; the cause says which."""
    cause = e.__cause__
    code = getattr(cause, "response", {}).get("Error", {}).get("Code", "")
    return code in ("PreconditionFailed", "ConditionalRequestConflict") or isinstance(e, FileExistsError)


def default_owner() -> str:
    """This process's owner name: host, pid and a random part (unique per store)."""
    return f"{os.uname().nodename}:{os.getpid()}:{secrets.token_hex(3)}"


def owner_gone(owner: str) -> bool:
    """Whether `owner` (a default_owner name) was a process of this host that has exited: its lease
    can be taken over at once (a server killed and started again need not wait out its lease). An
    owner of another host, or named otherwise, is never presumed gone."""
    host, _, rest = owner.partition(":")
    pid = rest.partition(":")[0]
    if host != os.uname().nodename or not pid.isdigit() or int(pid) == os.getpid():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except (PermissionError, OverflowError):
        return False
    return False
