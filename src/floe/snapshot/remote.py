"""The store's object-store tier: any fsspec URL (`s3://bucket/prefix`), with a local cache.

Objects are `{prefix}/{key}.safetensors`, leases `{prefix}/{key}.lease` (S3Leases: conditional
writes). A write streams as a multipart upload that is completed only once every byte passed the
check (floe.snapshot.stream), and aborted otherwise — on S3 an object appears whole or not at all, so
a writer killed mid-upload leaves the previous object as it was. A read is one GET, checked as it
streams into the local cache (`{cache}/{key}.safetensors` beside `{key}.etag`); with a cached copy it
carries `If-None-Match` its ETag, and a 304 (not modified) uses the cached copy again.
`file://` URLs are local folders: `tier_for_url` makes them a DiskTier.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterable
from pathlib import Path

import fsspec
from fsspec.asyn import sync

from floe.snapshot.errors import SnapshotNotFound, StoreUnavailable
from floe.snapshot.layout import Header, corrupt, header_length, parse_header
from floe.snapshot.lease import LEASE_SUFFIX, S3Leases
from floe.snapshot.stream import StreamCheck, checked
from floe.snapshot.tiers import SUFFIX, DiskTier, Entry

HEADER_READ = 64 << 10  # bytes a header's first GET asks for

PART_BYTES = 8 << 20  # multipart part size (S3 wants >= 5 MiB for every part but the last)
READ_BYTES = 8 << 20


class RemoteTier:
    """Snapshots as objects under an fsspec URL, read through a local cache folder."""

    name = "remote"
    durable = True

    def __init__(self, url: str, cache: str | Path, budget_bytes: int | None = None,
                 ttl_s: float | None = None, *, cache_bytes: int | None = None, part_bytes: int = PART_BYTES,
                 **storage_options) -> None:
        self.url, self.budget_bytes, self.ttl_s, self.cache_bytes = url, budget_bytes, ttl_s, cache_bytes
        self.part_bytes = part_bytes
        storage_options.setdefault("use_listings_cache", False)  # other stores change the bucket
        self.fs, root = fsspec.core.url_to_fs(url, **storage_options)
        self.root = root.rstrip("/")
        protocols = (self.fs.protocol,) if isinstance(self.fs.protocol, str) else self.fs.protocol
        if not {"s3", "s3a"} & set(protocols):
            raise StoreUnavailable(f"{url}: leases need conditional writes, which floe uses on s3:// only "
                                   "(a local folder: give its path or a file:// URL)")
        self.leases = S3Leases(self.fs, self.root)
        self.cache = Path(cache)
        self.cache.mkdir(parents=True, exist_ok=True)

    def _object(self, key: str) -> str:
        return f"{self.root}/{key}{SUFFIX}"

    def _split(self, key: str) -> tuple[str, str]:
        bucket, _, name = self._object(key).partition("/")
        return bucket, name

    def _failed(self, what: str, e: Exception) -> StoreUnavailable:
        return StoreUnavailable(f"{self.url}: cannot {what}: {e}")

    # ---- writing -------------------------------------------------------------------------------------

    def put(self, key: str, data) -> None:
        """Upload `data` (checked by the caller) as the entry."""
        self.write(key, [data], None)

    def write(self, key: str, chunks: Iterable, check: StreamCheck | None) -> None:
        """Upload `chunks` as the entry, each checked by `check` first; the upload is completed only
        once `check.finish()` passed, else aborted (the entry is as it was)."""
        try:
            f = self.fs.open(self._object(key), "wb", block_size=self.part_bytes)
        except OSError as e:
            raise self._failed(f"start writing {key!r}", e) from e
        try:
            for chunk in checked(chunks, check):
                f.write(chunk)
        except BaseException:
            f.discard()  # aborts the multipart upload: nothing becomes visible
            f.closed = True  # else its finalizer would try to complete what was discarded
            raise
        try:
            f.close()
        except OSError as e:
            raise self._failed(f"finish writing {key!r}", e) from e
        self.drop_cached(key)

    # ---- reading -------------------------------------------------------------------------------------

    def etag(self, key: str) -> str | None:
        """The object's ETag (one HEAD), or None if there is none."""
        bucket, name = self._split(key)
        try:
            return self.fs.call_s3("head_object", Bucket=bucket, Key=name)["ETag"]
        except FileNotFoundError:
            return None
        except OSError as e:
            raise self._failed(f"look up {key!r}", e) from e

    def has(self, key: str) -> bool:
        return self.etag(key) is not None

    def header(self, key: str) -> Header | None:
        """The object's checked header, or None: one ranged GET of its first HEADER_READ bytes, which
        hold a session's whole header but for a long conversation's (a second GET reads the rest)."""
        name = Path(f"{self.url}/{key}{SUFFIX}")
        try:
            head = self.fs.cat_file(self._object(key), start=0, end=HEADER_READ)
            if len(head) < 8:
                raise corrupt(name, f"{len(head)} bytes, shorter than a safetensors header length")
            n = header_length(head[:8], None, name)
            raw = head[8:8 + n]
            if len(raw) < n and len(head) == HEADER_READ:  # (a shorter read was the whole object)
                # from the last byte read, inside the object whatever its length (from just past it, an
                # object of exactly HEADER_READ bytes would be answered 416: "unavailable", not corrupt)
                raw += self.fs.cat_file(self._object(key), start=HEADER_READ - 1, end=8 + n)[1:]
        except FileNotFoundError:
            return None
        except OSError as e:
            raise self._failed(f"read the header of {key!r}", e) from e
        if len(raw) < n:
            raise corrupt(name, f"cut short inside its header ({len(raw)} of {n} bytes)")
        return parse_header(raw, None, name)

    def source(self, key: str) -> Path | None:
        """The entry in the local cache — fetched and checked as it streamed, unless the cached copy is
        the object's current version — or None if there is no object. One request either way."""
        path, tag = self._cached(key)
        cached = tag.read_text() if path.is_file() and tag.is_file() else None
        try:
            return self._fetch(key, cached)
        except SnapshotNotFound:
            self.drop_cached(key)
            return None

    def _cached(self, key: str) -> tuple[Path, Path]:
        path = self.cache / f"{key}{SUFFIX}"
        return path, path.with_name(path.name + ".etag")

    def _fetch(self, key: str, cached: str | None) -> Path:
        """One GET (If-None-Match the cached copy's ETag), checked as it streams into the cache. No
        fsync: a cache file a crash damaged fails its check on the next read and is fetched again."""
        path, tag = self._cached(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.part")
        check = StreamCheck(f"{self.url}/{key}{SUFFIX}")
        bucket, name = self._split(key)
        condition = {"IfNoneMatch": cached} if cached else {}

        async def download() -> str:
            reply = await self.fs._call_s3("get_object", Bucket=bucket, Key=name, **condition)
            with open(tmp, "wb") as f:
                async with reply["Body"] as body:
                    while chunk := await body.read(READ_BYTES):
                        check.update(chunk)
                        f.write(chunk)
            return reply["ETag"]

        try:
            etag = sync(self.fs.loop, download)
            check.finish()
            tag.unlink(missing_ok=True)
            os.replace(tmp, path)
            tag.write_text(etag)
        except FileNotFoundError as e:
            raise SnapshotNotFound(f"no snapshot under {key!r} in {self.url}") from e
        except OSError as e:
            if _status(e) == 304:  # the cached copy is the object's current version
                os.utime(path)
                return path
            raise self._failed(f"read {key!r}", e) from e
        finally:
            tmp.unlink(missing_ok=True)
        self._trim_cache(keep=path)
        return path

    def drop_cached(self, key: str) -> None:
        """Remove the local cache's copy of `key` (the next read fetches the object)."""
        for p in self._cached(key):
            p.unlink(missing_ok=True)

    def _trim_cache(self, keep: Path) -> None:
        """Least recently used cached copies out, until the cache is within cache_bytes."""
        if self.cache_bytes is None:
            return
        files = sorted((p.stat().st_mtime, p.stat().st_size, p) for p in self.cache.rglob(f"*{SUFFIX}")
                       if not p.name.startswith("."))
        total = sum(size for _, size, _ in files)
        for _, size, p in files:
            if total <= self.cache_bytes:
                break
            if p != keep:
                p.unlink(missing_ok=True)
                p.with_name(p.name + ".etag").unlink(missing_ok=True)
                total -= size

    # ---- listing, removing ---------------------------------------------------------------------------

    def entries(self) -> list[Entry]:
        try:
            found = self.fs.find(self.root, detail=True)
        except FileNotFoundError:
            return []
        except OSError as e:
            raise self._failed("list the snapshots", e) from e
        out = []
        for path, info in found.items():
            rel = path[len(self.root) + 1:]
            if not rel.endswith(SUFFIX) or rel.endswith(LEASE_SUFFIX):
                continue
            modified = info.get("LastModified")
            used = modified.timestamp() if modified is not None else float(info.get("mtime", 0))
            out.append(Entry(rel[: -len(SUFFIX)], int(info["size"]), used))
        return out

    def remove(self, key: str) -> None:
        try:
            self.fs.rm_file(self._object(key))
        except FileNotFoundError:
            pass
        except OSError as e:
            raise self._failed(f"remove {key!r}", e) from e
        self.drop_cached(key)

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries())


def _status(e: OSError) -> int | None:
    """The HTTP status behind an s3fs error (its cause is botocore's ClientError)."""
    return getattr(e.__cause__, "response", {}).get("ResponseMetadata", {}).get("HTTPStatusCode")


def tier_for_url(url: str, cache: str | Path, budget_bytes: int | None = None, ttl_s: float | None = None,
                 **storage_options) -> DiskTier | RemoteTier:
    """The durable tier a `--snapshots` value names: a folder (a path or file:// URL) or an s3:// URL."""
    if url.startswith("file://"):
        return DiskTier(url.removeprefix("file://"), budget_bytes, ttl_s)
    if "://" not in url:
        return DiskTier(url, budget_bytes, ttl_s)
    return RemoteTier(url, cache, budget_bytes, ttl_s, **storage_options)
