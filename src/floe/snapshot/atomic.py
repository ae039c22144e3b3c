"""Replacing a file atomically, one writer of a path at a time, and cleaning what killed writers left.

A write goes into a temporary folder beside the target, named `.{target}.writing.floe-tmp` (where the
filesystem has no flock: `.{target}.{pid}-{thread}-{random}.floe-tmp`; the library that serializes the
file may make its own temporary files: they land inside it), is fsynced, renamed over the target, and
the folder fsynced (a lease record, which needs only the atomic rename, skips both fsyncs:
`durable=False`). Writers of one path take turns: a lock per path, held from before the temporary
folder is made until after the rename is durable — a `threading.Lock` within the process and
`fcntl.flock` on the sidecar `.{target}.floe-lock` across processes. So a write that returns has put its
whole file at the path, and the file at a path is the one whose writer took its turn last. A temporary
folder whose path nobody holds the lock of is stale (its writer died: the kernel drops a dead process's
flock) and is removed by the next writer of that path (one look at its one name; a process's first
write into a folder, and every write where there is no flock, scans the folder for every name a
writer may have left) and by `clean_stale` over a folder.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import re
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from floe import randomness

TEMP_SUFFIX = ".floe-tmp"
LOCK_SUFFIX = ".floe-lock"
_TEMP = re.compile(r"\.(?P<target>.+)\.(?P<pid>\d+)-(?P<tid>\d+)-[0-9a-f]{8}" + re.escape(TEMP_SUFFIX))
_HELD_TEMP = re.compile(r"\.(?P<target>.+)\.writing" + re.escape(TEMP_SUFFIX))  # under a real flock
_LEGACY_TEMP = re.compile(r"\.(?P<target>.+)\.(?P<pid>\d+)\.tmp")  # floe before per-writer names
# create_exclusive's, which no lock guards: removed once this old (seconds; a creator's lives microseconds)
LINK_TEMP_STALE_S = 600.0
_LINK_TEMP = re.compile(r"\.(?P<target>.+)\.(?P<pid>\d+)-(?P<tid>\d+)-[0-9a-f]{8}\.link"
                        + re.escape(TEMP_SUFFIX))
_NO_LINKS = (errno.EPERM, errno.EOPNOTSUPP, errno.ENOSYS, errno.EXDEV, errno.EMLINK)
_NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)
_NO_UNNAMED = (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL, errno.ENOSYS)  # O_TMPFILE refused
_AT_FDCWD, _AT_SYMLINK_FOLLOW = -100, 0x400

_locks: dict[str, list] = {}  # absolute path -> [threading.Lock, number of users]
_locks_guard = threading.Lock()
# Folders this process has scanned for every writer's temporaries (_remove_stale_of), and those where
# flock is refused (every write there scans, with a name of its own); guarded by _locks_guard
_scanned: set[str] = set()
_no_flock: set[str] = set()
_no_unnamed: set[str] = set()  # folders whose filesystem refused a file without a name (O_TMPFILE)
SCANNED_MOST = 4096


def temp_name(target: Path) -> str:
    """This writer's temporary name for `target`: unique per process, thread and call."""
    return f".{target.name}.{os.getpid()}-{threading.get_native_id()}-{randomness.token_hex(4)}{TEMP_SUFFIX}"


def held_temp_name(target: Path) -> str:
    """The one temporary name of `target` for a writer that holds its flock (no other writer can)."""
    return f".{target.name}.writing{TEMP_SUFFIX}"


def lock_path(target: Path) -> Path:
    return target.with_name(f".{target.name}{LOCK_SUFFIX}")


@contextmanager
def path_lock(target: Path, *, blocking: bool = True, guards: Path | None = None) -> Iterator[bool]:
    """Hold the writers' lock of `target` (yields True), or yield False at once if `blocking` is off
    and another writer holds it. Where the filesystem has no flock, only this process's writers
    take turns. The sidecar lock file lives while the file it guards (`guards`, default `target`)
    does: a holder that leaves no such file removes the sidecar before it lets go (a server whose
    sessions come and go kept one empty sidecar per session it ever saved, which every write's scan
    of the folder then read); a waiter whose sidecar was removed so takes the new one."""
    key = os.path.abspath(target)
    with _locks_guard:
        entry = _locks.setdefault(key, [threading.Lock(), 0])
        entry[1] += 1
    try:
        if not entry[0].acquire(blocking=blocking):
            yield False
            return
        try:
            fd = _open_locked(lock_path(target), blocking)
            if fd is None:
                yield False
                return
            try:
                yield True
            finally:
                if not os.path.lexists(guards or target):
                    lock_path(target).unlink(missing_ok=True)  # (still held: a waiter retries on a new one)
                os.close(fd)  # drops the flock
        finally:
            entry[0].release()
    finally:
        with _locks_guard:
            entry[1] -= 1
            if not entry[1]:
                del _locks[key]


def _open_locked(path: Path, blocking: bool) -> int | None:
    """The sidecar `path` opened (made if absent) and flocked: its descriptor, or None if `blocking` is
    off and another process holds it. A sidecar removed by its holder while this one waited for it (the
    holder left no file to guard) is let go, and the one at `path` now taken instead."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            if not _flock(fd, blocking, path):
                os.close(fd)
                return None
            try:
                now = os.stat(path)
            except FileNotFoundError:
                now = None
        except BaseException:
            os.close(fd)
            raise
        held = os.fstat(fd)
        if now is not None and (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino):
            return fd
        os.close(fd)


def _flock(fd: int, blocking: bool, path: Path) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
    except BlockingIOError:
        return False
    except OSError as e:
        if e.errno not in _NO_FLOCK:
            raise
        with _locks_guard:
            _no_flock.add(os.path.abspath(path.parent))
    return True


def replace_file(target: Path, save: Callable[[Path], None], durable: bool = True) -> None:
    """Call `save(tmp)` to write the new file, then put it at `target` atomically and (durable) on disk
    before returning. Not durable: other processes see the whole new file or the old one, but a crash
    of the machine may leave an empty file (a lease record, which a crash ends anyway)."""
    with path_lock(target):
        _remove_stale_of(target)
        flocked = os.path.abspath(target.parent) not in _no_flock
        folder = target.with_name(held_temp_name(target) if flocked else temp_name(target))
        folder.mkdir()
        try:
            tmp = folder / target.name
            save(tmp)
            if durable:
                _fsync(tmp)
            os.replace(tmp, target)
            if durable:
                _fsync(target.parent)
        finally:
            shutil.rmtree(folder, ignore_errors=True)


def replace_held(target: Path, data: bytes, turn: Path) -> None:
    """Put `data` at `target` atomically (every reader sees the old file or the new one; not durable,
    as replace_file's durable=False) for a writer that holds path_lock(turn) already (a lease's
    compare-and-swap): one temporary file beside it, named as `turn`'s temporaries are (clean_stale
    removes it if this writer dies, never while that lock is held). No temporary folder and no
    second lock: a new session's lease was ~20 calls into the filesystem, each a GIL hand-off, which a
    burst of 64 new sessions made one after another (~80-150 ms of a named session's open)."""
    tmp = target.with_name(temp_name(turn))
    try:
        with open(tmp, "xb") as f:
            f.write(data)
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


class NoHardLinks(OSError):
    """The filesystem cannot hard-link (create_exclusive's way); the caller takes a lock instead."""


def create_exclusive(target: Path, data: bytes) -> bool:
    """Put `data` at `target` only if no file is there (False if one is), without a lock: written
    whole into a file without a name (O_TMPFILE: _create_unnamed) or else a temporary beside it, then
    hard-linked to the name, which link(2) refuses if the name exists, so of creators racing for one
    name exactly one wins and a reader sees no file or the whole one. Not durable (as replace_held).
    A new session's lease so costs 4 calls into the filesystem (a temporary's way: 6), where the
    compare-and-swap under the lease's lock costs ~12, each a GIL hand-off in a burst. Raises
    NoHardLinks where the filesystem has none. No lock tells that a temporary is in use: clean_stale
    removes one only once it is LINK_TEMP_STALE_S old (a creator's lives microseconds), and a creator
    whose temporary was removed anyway (a clock far off, a stopped process) writes it again."""
    made = _create_unnamed(target, data)
    if made is not None:
        return made
    for _ in range(3):
        tmp = target.with_name(f".{target.name}.{os.getpid()}-{threading.get_native_id()}-"
                               f"{randomness.token_hex(4)}.link{TEMP_SUFFIX}")
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        try:
            fd = os.open(tmp, flags, 0o644)
        except FileNotFoundError:  # the key's folder (an owner's) is new
            target.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(tmp, flags, 0o644)
        try:
            try:
                os.write(fd, data)  # (a record of ~100 bytes: one write)
            finally:
                os.close(fd)
            os.link(tmp, target)
            return True
        except FileExistsError:
            return False
        except FileNotFoundError:  # the temporary was cleaned meanwhile: again
            continue
        except OSError as e:
            if e.errno in _NO_LINKS:
                raise NoHardLinks(e.errno, f"cannot hard-link in {target.parent}: {e.strerror}") from e
            raise
        finally:
            with suppress(FileNotFoundError):
                os.unlink(tmp)
    raise OSError(errno.ENOENT, f"creating {target.name}: its temporary was removed three times in a row "
                                "(by a clean_stale that takes it for a dead writer's)")


def _create_unnamed(target: Path, data: bytes) -> bool | None:
    """create_exclusive where the kernel and the folder's filesystem make files without a name
    (O_TMPFILE: ext4, xfs, btrfs, tmpfs): `data` written into one, which linkat(2) through /proc then
    names `target` (refused if the name exists). Four calls, not six, and nothing for clean_stale: a
    creator killed midway leaves no file. The open lets the GIL go as any call into the filesystem;
    the write of ~100 bytes, the link and the close keep it (ctypes.PyDLL: microseconds on a
    filesystem that has just answered), where each hand-off cost a new session ~2.6 ms in a burst of 64
    (bench/probes/gil_handoff.py). None where there is no such way here (the caller's own then)."""
    folder = str(target.parent)
    if _held_calls is None or folder in _no_unnamed:
        return None
    flags = os.O_TMPFILE | os.O_WRONLY | os.O_CLOEXEC
    try:
        try:
            fd = os.open(folder, flags, 0o644)
        except FileNotFoundError:  # the key's folder (an owner's) is new
            target.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(folder, flags, 0o644)
    except OSError as e:
        if e.errno not in _NO_UNNAMED:
            raise
        _refuse_unnamed(folder)
        return None
    write, link, close = _held_calls
    try:
        if (written := write(fd, data, len(data))) != len(data):  # (~100 bytes: all at once, or an error)
            code = ctypes.get_errno() if written < 0 else errno.EIO
            raise OSError(code, f"writing {target}: {os.strerror(code)}")
        if link(_AT_FDCWD, f"/proc/self/fd/{fd}".encode(), _AT_FDCWD, os.fsencode(target),
                _AT_SYMLINK_FOLLOW) == 0:
            return True
        code = ctypes.get_errno()
        if code == errno.EEXIST:
            return False
        if code in (*_NO_LINKS, *_NO_UNNAMED, errno.ENOENT):  # (ENOENT: no /proc here)
            _refuse_unnamed(folder)
            return None
        raise OSError(code, f"linking {target}: {os.strerror(code)}")
    finally:
        close(fd)


def _refuse_unnamed(folder: str) -> None:
    with _locks_guard:
        if len(_no_unnamed) >= SCANNED_MOST:
            _no_unnamed.clear()
        _no_unnamed.add(folder)


def _libc_held_calls() -> tuple | None:
    """libc's write, linkat and close called with the GIL held (ctypes.PyDLL), or None where files
    without a name are not made (not Linux)."""
    if not (sys.platform.startswith("linux") and hasattr(os, "O_TMPFILE")):
        return None
    libc = ctypes.PyDLL(None, use_errno=True)
    write, link, close = libc.write, libc.linkat, libc.close
    write.argtypes, write.restype = [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t], ctypes.c_ssize_t
    link.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
    link.restype = ctypes.c_int
    close.argtypes, close.restype = [ctypes.c_int], ctypes.c_int
    return write, link, close


_held_calls = _libc_held_calls()


def write_new(target: Path, data: bytes) -> bool:
    """Make `target` with `data` if no file is there (False if one is), in place (O_EXCL): for a writer
    that holds path_lock of it already where the filesystem cannot hard-link (create_exclusive's way).
    A reader may see the file empty for a moment (as a crash may leave it); not durable."""
    try:
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    except FileExistsError:
        return False
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    return True


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_stale_of(target: Path, scan: bool = False) -> list[Path]:
    """Under `target`'s lock: every temporary of it is stale (a live writer would hold the lock). Where
    flock holds, a writer's temporary has one name (held_temp_name): one look; the first time in a
    folder (an older floe's names, a writer's where there was no flock) and where flock is refused,
    every name in the folder (and always with `scan`)."""
    folder = os.path.abspath(target.parent)
    with _locks_guard:
        scan = scan or folder not in _scanned or folder in _no_flock
    if not scan:
        held = target.with_name(held_temp_name(target))
        if not os.path.lexists(held):
            return []
        _remove(held)
        return [held]
    removed = []
    prefix = f".{target.name}."
    # os.scandir and a prefix, not Path.glob: a glob compiled a pattern per target and matched it in
    # Python against every name in the folder, 1 ms of a new session's lease in a serving store's folder
    # (hundreds of files), holding the GIL that every other session's tokens wait for; and a scan at all
    # only the first time (a folder of 20,000 sessions: 8.8 ms a write).
    with os.scandir(target.parent) as names:
        candidates = [target.parent / e.name for e in names if e.name.startswith(prefix)]
    for entry in candidates:
        match = _temp_match(entry.name)
        if match is None or match["target"] != target.name:
            continue
        if match.re is _LEGACY_TEMP and _pid_alive(int(match["pid"])):
            continue  # an older floe's writer, which takes no lock, may still be at work
        _remove(entry)
        removed.append(entry)
    with _locks_guard:
        if len(_scanned) >= SCANNED_MOST:  # (an owner's folder each: forget them all, scan again)
            _scanned.clear()
        _scanned.add(folder)
    return removed


def clean_stale(folder: Path) -> list[Path]:
    """Remove the temporaries that killed writers left in `folder` (live writers' are kept)."""
    targets = set()
    for entry in folder.glob(f"*{TEMP_SUFFIX}"):
        match = _temp_match(entry.name)
        if match is not None:
            targets.add(match["target"])
    for entry in folder.glob("*.tmp"):
        match = _LEGACY_TEMP.fullmatch(entry.name)
        if match is not None:
            targets.add(match["target"])
    removed = _remove_old_link_temps(folder)
    for name in sorted(targets):
        with path_lock(folder / name, blocking=False) as held:
            if held:
                removed += _remove_stale_of(folder / name, scan=True)
    return removed


def _temp_match(name: str) -> re.Match | None:
    return _TEMP.fullmatch(name) or _HELD_TEMP.fullmatch(name) or _LEGACY_TEMP.fullmatch(name)


def _remove_old_link_temps(folder: Path) -> list[Path]:
    """create_exclusive's temporaries in `folder` older than LINK_TEMP_STALE_S (no lock to take: their
    age tells, not a pid, which another host or pid namespace sharing the folder would not show)."""
    removed, now = [], time.time()
    for entry in folder.glob(f"*.link{TEMP_SUFFIX}"):
        try:
            old = _LINK_TEMP.fullmatch(entry.name) and now - entry.lstat().st_mtime > LINK_TEMP_STALE_S
        except FileNotFoundError:
            continue
        if old:
            entry.unlink(missing_ok=True)
            removed.append(entry)
    return removed


def _remove(entry: Path) -> None:
    if entry.is_dir() and not entry.is_symlink():
        shutil.rmtree(entry, ignore_errors=True)
    else:
        entry.unlink(missing_ok=True)


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:
        return True
    return True
