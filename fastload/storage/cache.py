"""A node-local shard cache that every process on the machine shares.

Packs in object storage are read through one directory on local disk. All DataLoader workers
and DDP ranks of a node point a :class:`ShardCache` at the same directory; the objects
cooperate through the filesystem only (``flock`` and atomic renames), so one pickles to its
directory and limit and works after fork or spawn. It never talks to object storage itself:
``get`` receives a ``fetch(dest)`` callable that writes the whole shard to ``dest``.

Layout of the directory::

    cache.lock                 global lock: held (LOCK_EX) briefly to count, evict and commit
    shards/<key>               a completed shard
    shards/<key>.<pid>.<hex>.part   a download in progress (or left by a killed process)
    meta/<key>.ok              marker "completed by this protocol": size, SHA-256, boot id;
                               its mtime is the shard's last use (the LRU clock)
    locks/<key>.lock           per shard: LOCK_SH = a reader uses it, LOCK_EX = fetch or evict
    needed/<pid>.<hex>.keys    one object's ``set_needed`` list, LOCK_EX by its owner while alive

Protocol, in short:

- ``get`` takes LOCK_SH on the shard's lock; a valid marker is a hit. Otherwise it takes
  LOCK_EX (so it waits for whoever is fetching), looks again and only then fetches into a temp
  name, checks size and SHA-256, and under the global lock evicts to make room, renames and
  writes the marker. One download per shard per node; a temp file is never trusted.
- Eviction runs under the global lock and takes LOCK_EX|LOCK_NB on a shard's lock: a shard a
  reader holds (LOCK_SH) is skipped. Only the LOCK_EX holder unlinks a lock file, and whoever
  locks one checks afterwards that the path still names the inode it locked.
- A temp file whose shard lock can be taken has no live fetcher: it is removed. A marker
  written before a reboot is not trusted until the file is hashed again (data renamed into
  place is not fsynced, so only a crash of the machine could have lost it).
"""

from __future__ import annotations

import errno
import fcntl
import os
import random
import re
import secrets
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path

from ..errors import FastloadError
from .base import file_sha256

_EXCLUSIVE_WAIT_S = 300.0  # how long a fetch waits for another process's hold on the same shard

__all__ = ["CacheError", "CacheStats", "Fetch", "ShardCache", "check_key", "parse_size"]

Fetch = Callable[[Path], object]
"""Writes the whole shard to the given path; may return the hex SHA-256 it computed while
streaming, which saves hashing the file again (any other return value is ignored)."""

ATTEMPTS = 3
_MARKER_TAG = "fastload-cache-1"
_TEMP_RE = re.compile(r"(.+)\.(\d+)\.([0-9a-f]{8})\.part")
_SHA_RE = re.compile(r"[0-9a-f]{64}")
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
_STALE_TMP_NS = 60 * 10**9  # a set_needed temp file older than this was left by a crash

_UNITS = {
    "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "pb": 10**15,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "pib": 2**50,
}
_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*")


class CacheError(FastloadError):
    """The shard cache cannot deliver a shard: bad downloads, a full disk, or a limit too small."""


def parse_size(value: int | str) -> int:
    """Bytes from an int or a string like "200GB" (10^9 units) or "512MiB" (2^20 units).

    Both unit families are accepted because people write cache limits both ways; a bare
    number is bytes, and single letters ("200G") are refused as ambiguous.
    """
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"a size is an int or a string like '200GB', not {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"a size cannot be negative: {value}")
        return value
    m = _SIZE_RE.fullmatch(value)
    unit = m.group(2).lower() if m else ""
    if m is None or (unit or "b") not in _UNITS:
        raise ValueError(
            f"cannot read size {value!r}: write a number and a unit such as 200GB (10^9 bytes) "
            f"or 512MiB (2^20 bytes)"
        )
    return int(Decimal(m.group(1)) * _UNITS[unit or "b"])


def _at_least(n: int) -> str:
    """The smallest round size >= n bytes, written so that parse_size reads it back."""
    for unit, scale in (("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if n >= scale:
            tenths = -(-n * 10 // scale)
            return f"{tenths // 10}{unit}" if tenths % 10 == 0 else f"{tenths // 10}.{tenths % 10}{unit}"
    return f"{n}B"


def check_key(key: str) -> str:
    """``key`` if it is a relative name that stays inside the cache directory, else CacheError.

    Keys come from manifests, so a hostile or broken one must not reach outside the cache.
    """
    parts = key.split("/") if isinstance(key, str) else [""]
    if (
        not isinstance(key, str)
        or key.startswith("/")
        or "\0" in key
        or any(p in ("", ".", "..") for p in parts)
        or _TEMP_RE.fullmatch(parts[-1])
    ):
        raise CacheError(
            f"shard key {key!r} refused: a key is a relative name like 'pack/shard-00003.lmdb' "
            f"without '..', '.' or empty parts"
        )
    return key


@dataclass(frozen=True)
class CacheStats:
    """What the cache holds now (node-wide) and what this object did (this process)."""

    bytes: int  # completed shards on disk now, all processes
    shards: int
    hits: int  # get() found the shard ready
    misses: int  # get() had to fetch it or wait for another process's fetch
    downloads: int  # fetch calls by this object, retries and prefetches included
    evictions: int  # shards this object evicted
    peak_bytes: int  # the largest total this process saw


@dataclass(frozen=True)
class _Entry:
    key: str
    size: int
    used_ns: int  # marker mtime; 0 without a marker, so such leftovers go first


def _read_boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or "-"
    except OSError:  # pragma: no cover - not Linux
        return "-"


_BOOT_ID = _read_boot_id()


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    fst = os.fstat(fd)
    return (st.st_ino, st.st_dev) == (fst.st_ino, fst.st_dev)


def _flock(path: Path, op: int) -> int | None:
    """An fd on ``path`` locked with ``op``, or None when LOCK_NB finds it taken.

    Lock files are unlinked by their LOCK_EX holder, so a lock won on an inode the path no
    longer names is worthless: check, and start again on the new file.
    """
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        except FileNotFoundError:
            path.parent.mkdir(parents=True, exist_ok=True)
            continue
        try:
            fcntl.flock(fd, op)
        except BlockingIOError:
            os.close(fd)
            return None
        except BaseException:
            os.close(fd)
            raise
        if _same_file(fd, path):
            return fd
        _unlock(fd)


def _unlock(fd: int) -> None:
    # Unlock explicitly: a forked child may still share this open file description.
    try:
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass


def _read_marker(path: Path) -> tuple[int, str, str] | None:
    """(size, sha256, boot id) from a marker, None if missing or unreadable."""
    try:
        parts = path.read_text().split()
    except (FileNotFoundError, NotADirectoryError, UnicodeDecodeError):
        return None
    if len(parts) != 4 or parts[0] != _MARKER_TAG or not parts[1].isdigit():
        return None
    return int(parts[1]), parts[2], parts[3]


_LIVE: weakref.WeakSet[ShardCache] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for cache in list(_LIVE):
        cache._forget_parent()


os.register_at_fork(after_in_child=_after_fork_in_child)


class ShardCache:
    """Shards fetched once per node into ``directory``, at most ``limit_bytes`` of them.

    ``limit_bytes`` takes an int or a string for :func:`parse_size`. Every process of the node
    may build its own object over the same directory; they cooperate through the files only.
    Completed shards never exceed the limit: before a new shard is renamed into place, shards
    nobody holds are evicted, least recently used first, shards some process declared needed
    (:meth:`set_needed`) after all others. Downloads in flight are not counted.
    """

    def __init__(self, directory: str | Path, limit_bytes: int | str, *, attempts: int = ATTEMPTS):
        self.directory = Path(directory)
        self.limit_bytes = parse_size(limit_bytes)
        if self.limit_bytes <= 0:
            raise ValueError(f"{self.directory}: cache limit must be positive, got {limit_bytes!r}")
        if type(attempts) is not int or attempts < 1:
            raise ValueError(f"attempts must be a positive int, got {attempts!r}")
        self.attempts = attempts
        for sub in ("shards", "meta", "locks", "needed"):
            (self.directory / sub).mkdir(parents=True, exist_ok=True)
        tag = self.directory / "CACHEDIR.TAG"
        if not tag.exists():  # tells backup tools to skip the cache
            tag.write_text("Signature: 8a477f597d28d172789f06886806bc55\n# fastload shard cache\n")
        self._forget_parent()
        _LIVE.add(self)

    def _forget_parent(self) -> None:
        """Fresh per-process state; after fork, drop (without unlocking) what the parent holds."""
        for fd, _ in getattr(self, "_held", {}).values():
            os.close(fd)
        if getattr(self, "_needed_fd", None) is not None:
            os.close(self._needed_fd)
        self._mutex = threading.Lock()
        self._held: dict[str, tuple[int, int]] = {}  # key -> (fd with LOCK_SH, hold count)
        self._needed_fd: int | None = None
        self._token = secrets.token_hex(4)
        self._pool: ThreadPoolExecutor | None = None
        self._pool_workers = 0
        self._pending: dict[str, Future] = {}
        self._counts = dict(hits=0, misses=0, downloads=0, evictions=0, peak_bytes=0)

    def __getstate__(self) -> dict:
        return {"directory": str(self.directory), "limit_bytes": self.limit_bytes, "attempts": self.attempts}

    def __setstate__(self, state: dict) -> None:
        self.__init__(**state)

    def __repr__(self) -> str:
        return f"ShardCache({str(self.directory)!r}, limit_bytes={self.limit_bytes})"

    def __enter__(self) -> ShardCache:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- paths -------------------------------------------------------------------------------

    def path(self, key: str) -> Path:
        """Where shard ``key`` lives once completed (present or not)."""
        return self.directory / "shards" / check_key(key)

    def _marker(self, key: str) -> Path:
        return self.directory / "meta" / (key + ".ok")

    def _lock(self, key: str) -> Path:
        return self.directory / "locks" / (key + ".lock")

    # -- reading -----------------------------------------------------------------------------

    def get(
        self,
        key: str,
        *,
        size: int,
        sha256: str,
        fetch: Fetch,
        protect: Iterable[str] = (),
        hold: bool = False,
    ) -> Path:
        """The local path of shard ``key``, fetched first if no process on the node has it.

        With ``hold=True`` the shard stays locked shared until :meth:`release`, so no process
        can evict it between this call and the reader opening it; without it the path may be
        evicted at any time. ``protect`` lists keys that evictions made by this call take last.
        A failed :meth:`prefetch` of ``key`` raises its error here.
        """
        key = check_key(key)
        sha256 = self._check_wanted(key, size, sha256)
        with self._mutex:
            fut = self._pending.pop(key, None)
        if fut is not None and not fut.cancelled():
            fut.result()
        return self._get(key, size, sha256, fetch, frozenset(protect), hold=hold, count=True)

    def acquire(self, key: str) -> Path:
        """Lock a shard already in the cache against eviction (shared) and return its path."""
        key = check_key(key)
        with self._mutex:
            if key in self._held:
                fd, n = self._held[key]
                self._held[key] = (fd, n + 1)
                return self.directory / "shards" / key
        fd = _flock(self._lock(key), fcntl.LOCK_SH)
        if self._completed(key) is None:
            _unlock(fd)
            self._tidy_lock(key)
            raise CacheError(f"{key}: not in the shard cache {self.directory} (get() it first)")
        return self._serve(key, fd, hold=True)

    def release(self, key: str) -> None:
        """Drop one hold taken by ``get(hold=True)``, :meth:`acquire` or :meth:`open_shared`."""
        with self._mutex:
            fd, n = self._held.get(key, (-1, 0))
            if n == 0:
                raise ValueError(f"{key}: not held by this cache object")
            if n > 1:
                self._held[key] = (fd, n - 1)
                return
            del self._held[key]
        _unlock(fd)

    @contextmanager
    def open_shared(
        self,
        key: str,
        *,
        size: int | None = None,
        sha256: str | None = None,
        fetch: Fetch | None = None,
        protect: Iterable[str] = (),
    ) -> Iterator[Path]:
        """The shard's path, safe from eviction inside the ``with`` block.

        With ``fetch`` (and ``size``, ``sha256``) it is ``get(..., hold=True)``; without, it
        is :meth:`acquire` of a shard already present.
        """
        if fetch is None:
            path = self.acquire(key)
        else:
            path = self.get(key, size=size, sha256=sha256, fetch=fetch, protect=protect, hold=True)
        try:
            yield path
        finally:
            self.release(key)

    def _check_wanted(self, key: str, size: int, sha256: str) -> str:
        if type(size) is not int or size < 0:
            raise ValueError(f"{key}: size must be a byte count, got {size!r}")
        sha = sha256.lower() if isinstance(sha256, str) else ""
        if not _SHA_RE.fullmatch(sha):
            raise ValueError(f"{key}: sha256 must be 64 hex digits, got {sha256!r}")
        if size > self.limit_bytes:
            raise CacheError(
                f"{self.directory}: shard {key} is {size} bytes, more than cache_limit "
                f"{self.limit_bytes} bytes; set cache_limit to at least {_at_least(size)}"
            )
        return sha

    def _get(
        self, key: str, size: int, sha: str, fetch: Fetch, protect: frozenset[str], *, hold: bool, count: bool
    ) -> Path:
        with self._mutex:
            entry = self._held.get(key)
            if entry is not None:  # pin our hold while we look
                self._held[key] = (entry[0], entry[1] + 1)
        if entry is not None:
            # Present and unchangeable while we hold it; waiting for LOCK_EX would deadlock.
            try:
                if not self._valid(key, size, sha):
                    raise CacheError(
                        f"{key}: this process holds the cached copy, which differs from the size "
                        f"and SHA-256 asked for; release it before fetching the new one"
                    )
                path = self._serve(key, None, hold=False, hit=True, count=count)
            except BaseException:
                self.release(key)
                raise
            if not hold:
                self.release(key)
            return path
        lock = self._lock(key)
        missed = False
        for _ in range(self.attempts):
            fd = _flock(lock, fcntl.LOCK_SH)
            if self._valid(key, size, sha):
                return self._serve(key, fd, hold=hold, hit=not missed, count=count)
            missed = True
            _unlock(fd)
            fd = self._exclusive(key, size, sha)
            if fd is None:  # it arrived while we waited: someone else fetched it
                fd = _flock(lock, fcntl.LOCK_SH)
                if self._valid(key, size, sha):
                    return self._serve(key, fd, hold=hold, hit=False, count=count)
                _unlock(fd)
                continue
            try:
                if not self._valid(key, size, sha):  # whoever held LOCK_EX may have fetched it
                    self._fill(key, size, sha, fetch, protect)
                # flock(2) converts by unlocking first, so an evictor can slip in: look again.
                fcntl.flock(fd, fcntl.LOCK_SH)
            except BaseException:
                if not (self.directory / "shards" / key).exists():
                    _unlink(lock)  # we hold LOCK_EX (or lost it to nobody): leave nothing behind
                _unlock(fd)
                raise
            if _same_file(fd, lock) and self._valid(key, size, sha):
                return self._serve(key, fd, hold=hold, hit=False, count=count)
            _unlock(fd)
        raise CacheError(
            f"{self.directory}: {key} was evicted by other processes as soon as it was fetched, "
            f"{self.attempts} times: cache_limit {self.limit_bytes} bytes is too small for the "
            f"shards in use"
        )

    def _exclusive(self, key: str, size: int, sha: str) -> int | None:
        """LOCK_EX on ``lock`` to fetch the shard, or None once the shard is present.

        Never a blocking wait for LOCK_EX: a reader that holds the shard (LOCK_SH, kept while it
        reads) may be waiting for this very process to hand it work, and a blocked LOCK_EX
        would then wait forever. So: try LOCK_EX without waiting; if taken, wait for LOCK_SH
        (that waits only for a downloader, which finishes) and report a shard that is now
        there; else back off and try again, for at most ``_EXCLUSIVE_WAIT_S``.
        """
        lock = self._lock(key)
        deadline = time.monotonic() + _EXCLUSIVE_WAIT_S
        while True:
            fd = _flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if fd is not None:
                return fd
            fd = _flock(lock, fcntl.LOCK_SH)
            present = self._valid(key, size, sha)
            _unlock(fd)
            if present:
                return None
            if time.monotonic() > deadline:
                raise CacheError(f"{lock}: another process has held this shard for {_EXCLUSIVE_WAIT_S:.0f} s "
                                 "without finishing it (a copy with other content still in use?)")
            time.sleep(random.uniform(0.005, 0.05))

    def _serve(self, key: str, fd: int | None, *, hold: bool, hit: bool = True, count: bool = False) -> Path:
        """Mark a shard we hold LOCK_SH on as used, count it, and keep or drop the lock ``fd``."""
        now = time.time_ns()
        try:
            os.utime(self._marker(key), ns=(now, now))
        except FileNotFoundError:  # pragma: no cover - cannot vanish while we hold LOCK_SH
            pass
        with self._mutex:
            if count:
                self._counts["hits" if hit else "misses"] += 1
            if fd is not None and hold:
                if key in self._held:  # a second hold: one lock per key is enough
                    old, n = self._held[key]
                    self._held[key] = (old, n + 1)
                else:
                    self._held[key], fd = (fd, 1), None
        if fd is not None:
            _unlock(fd)
        return self.directory / "shards" / key

    def _completed(self, key: str) -> int | None:
        """Size of the completed shard ``key`` if its marker is trusted (this boot) and matches."""
        m = _read_marker(self._marker(key))
        if m is None or m[2] != _BOOT_ID:
            return None
        try:
            return m[0] if os.stat(self.directory / "shards" / key).st_size == m[0] else None
        except (FileNotFoundError, NotADirectoryError):
            return None

    def _valid(self, key: str, size: int, sha: str) -> bool:
        m = _read_marker(self._marker(key))
        return m is not None and m[:2] == (size, sha) and self._completed(key) == size

    # -- filling -----------------------------------------------------------------------------

    def _fill(self, key: str, size: int, sha: str, fetch: Fetch, protect: frozenset[str]) -> None:
        """Fetch, verify and commit ``key``; the caller holds its lock with LOCK_EX."""
        data, marker = self.directory / "shards" / key, self._marker(key)
        data.parent.mkdir(parents=True, exist_ok=True)
        for stale in data.parent.glob(f"{_glob_escape(data.name)}.*.part"):
            if _TEMP_RE.fullmatch(stale.name):
                _unlink(stale)  # we hold LOCK_EX, so its fetcher is gone
        if self._salvage(key, size, sha, protect):
            return
        _unlink(marker)
        _unlink(data)
        with self._global():
            self._make_room(key, size, protect)  # early, so the download has disk to land on
        problems = []
        for _ in range(self.attempts):
            tmp = data.with_name(f"{data.name}.{os.getpid()}.{secrets.token_hex(4)}.part")
            with self._mutex:
                self._counts["downloads"] += 1
            try:
                reported = fetch(tmp)
                problem = _check_download(tmp, size, sha, reported)
                if problem is None:
                    with self._global():
                        held = self._make_room(key, size, protect)
                        os.replace(tmp, data)
                        _write_marker(marker, size, sha)
                        self._note_peak(held + size)
                    return
            except OSError as exc:
                _unlink(tmp)
                if exc.errno in _DISK_FULL:
                    _unlink(marker)
                    _unlink(data)
                    raise self._disk_full(key, size, exc) from exc
                raise
            except BaseException:
                _unlink(tmp)
                raise
            _unlink(tmp)
            problems.append(problem)
        raise CacheError(
            f"{key}: download failed verification {self.attempts} times (last: {problems[-1]}); "
            f"the source shard may be corrupt"
        )

    def _salvage(self, key: str, size: int, sha: str, protect: frozenset[str]) -> bool:
        """Re-adopt a renamed file whose marker is missing or from before a reboot, if it hashes right."""
        data, marker = self.directory / "shards" / key, self._marker(key)
        m = _read_marker(marker)
        try:
            if data.stat().st_size != size or (m is not None and m[:2] != (size, sha)):
                return False
        except FileNotFoundError:
            return False
        if file_sha256(data) != sha:
            return False
        with self._global():
            held = self._make_room(key, size, protect)
            _write_marker(marker, size, sha)
            self._note_peak(held + size)
        return True

    def _disk_full(self, key: str, size: int, exc: OSError) -> CacheError:
        try:
            st = os.statvfs(self.directory)
            free = f"{st.f_bavail * st.f_frsize} bytes free"
        except OSError:  # pragma: no cover
            free = "free space unknown"
        return CacheError(
            f"{self.directory}: disk full while fetching {key} ({exc.strerror or exc}): it needs {size} "
            f"bytes, {free}; free space or lower cache_limit"
        )

    @contextmanager
    def _global(self) -> Iterator[None]:
        fd = _flock(self.directory / "cache.lock", fcntl.LOCK_EX)
        try:
            yield
        finally:
            _unlock(fd)

    # -- eviction ----------------------------------------------------------------------------

    def _scan(self) -> tuple[list[_Entry], list[tuple[Path, str]]]:
        """Completed (or marker-less leftover) shards, and temp files with their keys."""
        root = self.directory / "shards"
        entries, temps = [], []
        for dirpath, _dirs, files in os.walk(root):
            rel_dir = Path(dirpath).relative_to(root).as_posix()
            prefix = "" if rel_dir == "." else rel_dir + "/"
            for name in files:
                path = Path(dirpath, name)
                m = _TEMP_RE.fullmatch(name)
                if m:
                    temps.append((path, prefix + m.group(1)))
                    continue
                key = prefix + name
                try:
                    size = path.stat().st_size
                except FileNotFoundError:
                    continue
                try:
                    used = self._marker(key).stat().st_mtime_ns
                except FileNotFoundError:
                    used = 0
                entries.append(_Entry(key, size, used))
        return entries, temps

    def _make_room(self, key: str, need: int, protect: frozenset[str]) -> int:
        """Evict until the other shards plus ``need`` fit the limit; returns their bytes.

        The caller holds the global lock. Raises CacheError when what readers hold leaves
        too little room.
        """
        entries, temps = self._scan()
        self._sweep(temps)
        others = [e for e in entries if e.key != key]
        held = sum(e.size for e in others)
        self._note_peak(held)
        if held + need <= self.limit_bytes:
            return held
        needed = self._needed_keys() | protect
        in_use = 0
        for e in sorted(others, key=lambda e: (e.key in needed, e.used_ns)):
            if held + need <= self.limit_bytes:
                break
            if self._evict(e.key):
                held -= e.size
            else:
                in_use += e.size
        if held + need > self.limit_bytes:
            raise CacheError(
                f"{self.directory}: no room for {key} ({need} bytes): cache_limit is "
                f"{self.limit_bytes} bytes and {in_use} bytes of shards are in use by readers; "
                f"set cache_limit to at least {_at_least(in_use + need)}"
            )
        return held

    def _evict(self, key: str) -> bool:
        fd = _flock(self._lock(key), fcntl.LOCK_EX | fcntl.LOCK_NB)
        if fd is None:
            return False  # a reader holds it, or it is being fetched
        try:
            _unlink(self._marker(key))  # first: without it nobody trusts the data
            _unlink(self.directory / "shards" / key)
            _unlink(self._lock(key))
        finally:
            _unlock(fd)
        with self._mutex:
            self._counts["evictions"] += 1
        return True

    def _sweep(self, temps: list[tuple[Path, str]]) -> None:
        """Remove temp files nobody is writing (their fetcher was killed)."""
        for path, key in temps:
            fd = _flock(self._lock(key), fcntl.LOCK_EX | fcntl.LOCK_NB)
            if fd is None:
                continue
            try:
                _unlink(path)
                if not (self.directory / "shards" / key).exists():
                    _unlink(self._lock(key))
            finally:
                _unlock(fd)

    def _tidy_lock(self, key: str) -> None:
        fd = _flock(self._lock(key), fcntl.LOCK_EX | fcntl.LOCK_NB)
        if fd is not None:
            if not (self.directory / "shards" / key).exists():
                _unlink(self._lock(key))
            _unlock(fd)

    def _note_peak(self, total: int) -> None:
        with self._mutex:
            self._counts["peak_bytes"] = max(self._counts["peak_bytes"], total)

    # -- priorities --------------------------------------------------------------------------

    def set_needed(self, keys: Iterable[str]) -> None:
        """Declare the shards this object still needs (its epoch plan), for every process to see.

        Each object has one list (a call replaces it, ``set_needed(())`` clears it); evictions
        in any process take shards no live object needs first, least recently used first,
        then needed ones in the same order. It is a priority, not a pin (hold a shard for
        that), and it lasts while the declaring process lives: after it exits, or after
        :meth:`close`, the list is ignored and removed.
        """
        keys = [check_key(k) for k in keys]
        folder = self.directory / "needed"
        final = folder / f"{os.getpid()}.{self._token}.keys"
        fd = None
        if keys:
            tmp = folder / f"{final.name}.{secrets.token_hex(4)}.tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)  # held while we live: how others know we do
                with open(fd, "w", encoding="utf-8", closefd=False) as f:
                    f.write("\n".join(keys) + "\n")
                os.replace(tmp, final)
            except BaseException:
                _unlink(tmp)
                _unlock(fd)
                raise
        with self._mutex:
            old, self._needed_fd = self._needed_fd, fd
        if old is not None:
            if fd is None and _same_file(old, final):
                _unlink(final)
            _unlock(old)

    def _needed_keys(self) -> set[str]:
        """Union of the lists of live objects; removes the lists of dead ones."""
        keys: set[str] = set()
        for path in (self.directory / "needed").iterdir():
            if not path.name.endswith((".keys", ".tmp")):
                continue
            try:
                f = open(path, encoding="utf-8")
            except FileNotFoundError:
                continue
            with f:
                try:
                    fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:  # its owner is alive
                    if path.name.endswith(".keys"):
                        keys.update(line for line in f.read().splitlines() if line)
                    continue
                try:
                    young = time.time_ns() - os.fstat(f.fileno()).st_mtime_ns < _STALE_TMP_NS
                    # a .tmp is locked by its writer only just after it is created
                    if not (path.name.endswith(".tmp") and young) and _same_file(f.fileno(), path):
                        _unlink(path)
                finally:
                    fcntl.flock(f.fileno(), fcntl.LOCK_UN)
        return keys

    # -- prefetch ----------------------------------------------------------------------------

    def prefetch(self, items: Iterable[tuple[str, int, str, Fetch]], *, max_workers: int = 2) -> None:
        """Start fetching ``(key, size, sha256, fetch)`` items in background threads.

        At most ``max_workers`` downloads run at once (the first call sizes the pool). A later
        ``get`` of the key waits for its prefetch and raises its error, if any. Prefetched
        shards are ordinary cache entries: a limit too small for them evicts them again.
        """
        if type(max_workers) is not int or max_workers < 1:
            raise ValueError(f"max_workers must be a positive int, got {max_workers!r}")
        checked = []
        for key, size, sha256, fetch in items:
            key = check_key(key)
            checked.append((key, size, self._check_wanted(key, size, sha256), fetch))
        with self._mutex:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="fastload-cache")
                self._pool_workers = max_workers
            elif max_workers != self._pool_workers:
                raise ValueError(
                    f"prefetch pool already runs {self._pool_workers} workers, asked for {max_workers}"
                )
            for key, size, sha, fetch in checked:
                fut = self._pending.get(key)
                if fut is None or fut.done():
                    self._pending[key] = self._pool.submit(
                        self._get, key, size, sha, fetch, frozenset(), hold=False, count=False
                    )

    def close(self) -> None:
        """Stop prefetching (waiting for downloads under way), drop holds and the needed list."""
        with self._mutex:
            pool, self._pool = self._pool, None
            self._pending = {}
            held, self._held = self._held, {}
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        for fd, _ in held.values():
            _unlock(fd)
        self.set_needed(())

    # -- accounting --------------------------------------------------------------------------

    def stats(self) -> CacheStats:
        """Bytes and shards held now (a scan, no lock), and this object's counters."""
        entries, _ = self._scan()
        total = sum(e.size for e in entries)
        self._note_peak(total)
        with self._mutex:
            c = dict(self._counts)
        return CacheStats(bytes=total, shards=len(entries), **c)


def _glob_escape(name: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", name)


def _check_download(tmp: Path, size: int, sha: str, reported: object) -> str | None:
    """What is wrong with a finished download, or None if its size and SHA-256 match."""
    try:
        got = tmp.stat().st_size
    except FileNotFoundError:
        return "the fetch wrote no file"
    if got != size:
        return f"{got} bytes, expected {size}"
    if isinstance(reported, str) and _SHA_RE.fullmatch(reported.lower()):
        digest = reported.lower()
    else:
        digest = file_sha256(tmp)
    if digest != sha:
        return f"SHA-256 {digest[:16]}..., expected {sha[:16]}..."
    return None


def _write_marker(path: Path, size: int, sha: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{_MARKER_TAG} {size} {sha} {_BOOT_ID}\n")
