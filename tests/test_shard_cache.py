"""The node-local shard cache: one download per shard per node, verified, bounded, shared.

Shards are small files of random bytes in an "origin" folder; a fetch copies one and leaves a
file in a log folder per call, so tests count downloads across processes without mocks.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import pickle
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from fastload.errors import FastloadError
from fastload.storage.cache import CacheError, ShardCache, parse_size

SHARD = 1000
START_METHODS = ("fork", "spawn")


@dataclass(frozen=True)
class CopyFetch:
    """Copies ``src`` to the destination; ``bad_calls`` first calls go wrong the ``mode`` way."""

    src: Path
    log: Path
    mode: str = "ok"  # ok | corrupt | short | hang | raise
    bad_calls: int = 0  # -1: every call
    delay: float = 0.0  # between the two halves
    digest: str | None = None  # returned, as a fetcher that hashed while streaming would

    def calls(self) -> int:
        return len(list(self.log.glob(f"{self.src.name}.*")))

    def __call__(self, dest: Path):
        bad = self.bad_calls < 0 or self.calls() < self.bad_calls
        (self.log / f"{self.src.name}.{os.getpid()}.{time.time_ns()}").touch()
        data = self.src.read_bytes()
        if bad and self.mode == "raise":
            raise RuntimeError(f"origin unreachable for {self.src.name}")
        if bad and self.mode == "corrupt":
            data = data[:10] + bytes([data[10] ^ 0xFF]) + data[11:]
        if bad and self.mode == "short":
            data = data[: len(data) // 2]
        with open(dest, "wb") as f:
            f.write(data[: len(data) // 2])
            f.flush()
            if bad and self.mode == "hang":
                (self.log / "half-written").touch()
                time.sleep(60)
            time.sleep(self.delay)
            f.write(data[len(data) // 2 :])
        return self.digest


@dataclass(frozen=True)
class Item:
    key: str
    size: int
    sha256: str
    fetch: CopyFetch

    def get(self, cache: ShardCache, **kw) -> Path:
        return cache.get(self.key, size=self.size, sha256=self.sha256, fetch=self.fetch, **kw)


class Origin:
    def __init__(self, root: Path):
        self.root = root / "origin"
        self.log = root / "log"
        self.root.mkdir()
        self.log.mkdir()

    def shard(self, name: str, size: int = SHARD, **fetch_kw) -> Item:
        src = self.root / name
        if not src.exists():
            src.write_bytes(os.urandom(size))
        data = src.read_bytes()
        return Item(f"pack/{name}", len(data), hashlib.sha256(data).hexdigest(), CopyFetch(src, self.log, **fetch_kw))


@pytest.fixture
def origin(tmp_path) -> Origin:
    return Origin(tmp_path)


def _files(root: Path, pattern: str = "*") -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob(pattern) if p.is_file())


def _held_bytes(cache: ShardCache) -> int:
    """Bytes of completed shards on disk (files may vanish while we look: other processes evict)."""
    total = 0
    for p in (cache.directory / "shards").rglob("*"):
        try:
            total += p.stat().st_size if p.is_file() and not p.name.endswith(".part") else 0
        except FileNotFoundError:
            pass
    return total


def _present(cache: ShardCache) -> set[str]:
    return {p.rsplit("/", 1)[-1] for p in _files(cache.directory / "shards")}


def _wait_for(path: Path, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < end, f"{path} never appeared"
        time.sleep(0.01)


# -- helpers run in child processes (top level, so spawn can import them) ---------------------


def _child_get(cache: ShardCache, item: Item, barrier, q) -> None:
    try:
        barrier.wait(timeout=60)
        path = item.get(cache)
        q.put((str(path), hashlib.sha256(path.read_bytes()).hexdigest()))
    except Exception as exc:  # report, rather than leave the parent waiting
        q.put(repr(exc))


def _child_holds(cache: ShardCache, key: str, q, go) -> None:
    try:
        with cache.open_shared(key):
            q.put("held")
            go.wait(timeout=60)
        q.put("released")
    except Exception as exc:
        q.put(repr(exc))


def _child_needs(cache: ShardCache, keys: list[str], q, go) -> None:
    cache.set_needed(keys)
    q.put("declared")
    go.wait(timeout=60)  # then exit without close(): the list must be ignored afterwards


def _child_forked_after_hold(cache: ShardCache, key: str, q) -> None:
    try:
        cache.release(key)
        q.put("released the parent's hold")
    except ValueError:
        cache.close()  # must not unlock what the parent holds either
        q.put("not held here")


def _run(ctx, target, *args, timeout: float = 60) -> object:
    q = ctx.Queue()
    p = ctx.Process(target=target, args=(*args, q))
    p.start()
    got = q.get(timeout=timeout)
    p.join(timeout=timeout)
    assert p.exitcode == 0
    return got


# -- parse_size and keys ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("200GB", 200 * 10**9),
        ("512MiB", 512 * 2**20),
        ("1.5GB", 1_500_000_000),
        (" 10 kB ", 10_000),
        ("2gib", 2 * 2**30),
        ("100", 100),
        ("7B", 7),
        (".5KiB", 512),
        (0, 0),
        (4096, 4096),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["", "GB", "12XB", "-1GB", "200G", "1,5GB", "1e9", -1, True, 1.5, None])
def test_parse_size_refuses(bad):
    with pytest.raises(ValueError, match="size"):
        parse_size(bad)


@pytest.mark.parametrize(
    "key", ["", "/etc/passwd", "../x", "pack/../../x", "a//b", "a/", "./a", "a/./b", "..", "a\0b", "s.123.deadbeef.part"]
)
def test_keys_escaping_the_directory_are_refused(tmp_path, origin, key):
    cache = ShardCache(tmp_path / "cache", 10 * SHARD)
    item = origin.shard("a")
    with pytest.raises(CacheError, match="shard key .* refused"):
        cache.get(key, size=item.size, sha256=item.sha256, fetch=item.fetch)
    with pytest.raises(CacheError, match="refused"):
        cache.set_needed([key])
    assert item.fetch.calls() == 0
    assert isinstance(CacheError("x"), FastloadError)


def test_bad_arguments(tmp_path, origin):
    with pytest.raises(ValueError, match="positive"):
        ShardCache(tmp_path / "c", 0)
    cache = ShardCache(tmp_path / "c", "10kB")
    assert cache.limit_bytes == 10_000
    a = origin.shard("a")
    with pytest.raises(ValueError, match="64 hex"):
        cache.get(a.key, size=a.size, sha256="abc", fetch=a.fetch)
    with pytest.raises(ValueError, match="byte count"):
        cache.get(a.key, size=-1, sha256=a.sha256, fetch=a.fetch)
    with pytest.raises(ValueError, match="not held"):
        cache.release(a.key)
    with pytest.raises(CacheError, match="not in the shard cache"):
        cache.acquire(a.key)
    assert _files(cache.directory / "locks") == []


# -- fetching once, verified ------------------------------------------------------------------


def test_fetches_once_then_hits(tmp_path, origin):
    cache = ShardCache(tmp_path / "cache", 10 * SHARD)
    a = origin.shard("a")
    path = a.get(cache)
    assert path == cache.path(a.key) and path.read_bytes() == a.fetch.src.read_bytes()
    assert a.get(cache) == path
    assert a.fetch.calls() == 1
    s = cache.stats()
    assert (s.hits, s.misses, s.downloads, s.shards, s.bytes, s.peak_bytes) == (1, 1, 1, 1, SHARD, SHARD)
    assert _files(cache.directory / "shards") == ["pack/a"]  # no temp file left


@pytest.mark.parametrize("method", START_METHODS)
def test_concurrent_gets_across_processes_fetch_once(tmp_path, origin, method):
    cache = ShardCache(tmp_path / "cache", 10 * SHARD)
    a = origin.shard("a", delay=0.3)  # long enough for every process to be waiting on it
    ctx = multiprocessing.get_context(method)
    n = 4
    barrier, q = ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=_child_get, args=(cache, a, barrier, q)) for _ in range(n)]
    for p in procs:
        p.start()
    results = [q.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    assert set(results) == {(str(cache.path(a.key)), a.sha256)}, results
    assert a.fetch.calls() == 1
    assert a.get(cache).read_bytes() == a.fetch.src.read_bytes()
    assert a.fetch.calls() == 1


@pytest.mark.parametrize("mode, what", [("corrupt", "SHA-256 .*expected"), ("short", "500 bytes, expected 1000")])
def test_bad_download_is_fetched_again(tmp_path, origin, mode, what):
    cache = ShardCache(tmp_path / "cache", 10 * SHARD)
    once = origin.shard("once", mode=mode, bad_calls=1)
    assert once.get(cache).read_bytes() == once.fetch.src.read_bytes()
    assert once.fetch.calls() == 2
    always = origin.shard("always", mode=mode, bad_calls=-1)
    with pytest.raises(CacheError, match=f"pack/always: download failed verification 3 times .*{what}"):
        always.get(cache)
    assert always.fetch.calls() == 3
    assert _files(cache.directory / "shards") == ["pack/once"]
    assert _files(cache.directory / "locks") == ["pack/once.lock"]


def test_digest_handed_in_by_the_fetcher(tmp_path, origin):
    cache = ShardCache(tmp_path / "cache", 10 * SHARD)
    ok = origin.shard("ok")
    ok = Item(ok.key, ok.size, ok.sha256, CopyFetch(ok.fetch.src, ok.fetch.log, digest=ok.sha256))
    assert ok.get(cache).is_file()
    # a fetcher that saw other bytes than the manifest promised: its digest is believed
    liar = origin.shard("liar")
    liar = Item(liar.key, liar.size, liar.sha256, CopyFetch(liar.fetch.src, liar.fetch.log, digest="0" * 64))
    with pytest.raises(CacheError, match="SHA-256 0000000000000000..., expected"):
        liar.get(cache)
    # a return value that is no digest (shutil.copy returns the path) is ignored
    other = origin.shard("other")
    other = Item(other.key, other.size, other.sha256, CopyFetch(other.fetch.src, other.fetch.log, digest="x.part"))
    assert other.get(cache).is_file()


def test_a_fetch_that_raises_leaves_nothing(tmp_path, origin):
    cache = ShardCache(tmp_path / "cache", 10 * SHARD)
    a = origin.shard("a", mode="raise", bad_calls=-1)
    with pytest.raises(RuntimeError, match="origin unreachable"):
        a.get(cache)
    assert _files(cache.directory, "*") == ["CACHEDIR.TAG", "cache.lock"]


def test_marker_from_before_a_reboot_is_checked_again(tmp_path, origin):
    cache = ShardCache(tmp_path / "cache", 10 * SHARD)
    a, b = origin.shard("a"), origin.shard("b")
    a.get(cache)
    b.get(cache)
    for item in (a, b):
        marker = cache.directory / "meta" / (item.key + ".ok")
        marker.write_text(marker.read_text().replace(marker.read_text().split()[-1], "another-boot"))
    path = cache.path(b.key)
    path.write_bytes(path.read_bytes()[::-1])  # what a power cut could leave
    assert a.get(cache).read_bytes() == a.fetch.src.read_bytes()
    assert b.get(cache).read_bytes() == b.fetch.src.read_bytes()
    assert (a.fetch.calls(), b.fetch.calls()) == (1, 2)  # a re-hashed and kept, b fetched again
    # a shard deleted behind the cache's back is fetched again too
    cache.path(a.key).unlink()
    assert a.get(cache).is_file() and a.fetch.calls() == 2


@pytest.mark.parametrize("next_key", ["same", "other"])
def test_killed_fetch_leaves_a_stale_temp_that_is_ignored_and_removed(tmp_path, origin, next_key):
    cache = ShardCache(tmp_path / "cache", 10 * SHARD)
    hang = origin.shard("a", mode="hang", bad_calls=1)
    ctx = multiprocessing.get_context("fork")
    p = ctx.Process(target=_child_get, args=(cache, hang, ctx.Barrier(1), ctx.Queue()))
    p.start()
    _wait_for(origin.log / "half-written")
    os.kill(p.pid, signal.SIGKILL)
    p.join(timeout=30)
    assert p.exitcode == -signal.SIGKILL
    (temp,) = _files(cache.directory / "shards", "*.part")
    assert temp.startswith(f"pack/a.{p.pid}.")
    if next_key == "other":  # any later download sweeps temps nobody is writing
        origin.shard("b").get(cache)
        assert _files(cache.directory / "shards") == ["pack/b"]
    path = hang.get(cache)  # the stale temp is not mistaken for the shard
    assert path.read_bytes() == hang.fetch.src.read_bytes()
    assert hang.fetch.calls() == 2
    assert _files(cache.directory / "shards", "*.part") == []


# -- limit and eviction -----------------------------------------------------------------------


def _get_checked(cache: ShardCache, item: Item, **kw) -> Path:
    path = item.get(cache, **kw)
    # the contract is "limit + one shard"; the cache keeps completed shards within the limit
    assert _held_bytes(cache) <= cache.limit_bytes
    return path


def test_evicts_least_recently_used(tmp_path, origin):
    cache = ShardCache(tmp_path / "cache", 3 * SHARD)
    a, b, c, d, e = (origin.shard(n) for n in "abcde")
    for item in (a, b, c):
        _get_checked(cache, item)
    _get_checked(cache, a)  # a is now more recent than b and c
    _get_checked(cache, d)
    assert _present(cache) == {"a", "c", "d"}
    _get_checked(cache, e)
    assert _present(cache) == {"a", "d", "e"}
    assert cache.stats().evictions == 2 and cache.stats().peak_bytes == 3 * SHARD
    _get_checked(cache, b)  # evicted shards come back with a new download
    assert b.fetch.calls() == 2
    assert _files(cache.directory / "locks") == sorted(f"pack/{n}.lock" for n in _present(cache))


@pytest.mark.parametrize("method", START_METHODS)
def test_a_shard_another_process_holds_is_never_evicted(tmp_path, origin, method):
    cache = ShardCache(tmp_path / "cache", 3 * SHARD)
    a, b, c, d, e = (origin.shard(n) for n in "abcde")
    for item in (a, b, c):
        _get_checked(cache, item)
    ctx = multiprocessing.get_context(method)
    q, go = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=_child_holds, args=(cache, a.key, q, go))
    p.start()
    assert q.get(timeout=60) == "held"
    _get_checked(cache, b)
    _get_checked(cache, c)  # a is the least recently used now, but in use
    _get_checked(cache, d)
    assert _present(cache) == {"a", "c", "d"}
    go.set()
    assert q.get(timeout=60) == "released"
    p.join(timeout=60)
    _get_checked(cache, e)
    assert _present(cache) == {"c", "d", "e"}


def test_a_shard_held_by_this_process(tmp_path, origin):
    cache = ShardCache(tmp_path / "cache", 2 * SHARD)
    a, b, c = (origin.shard(n) for n in "abc")
    path = _get_checked(cache, a, hold=True)
    assert a.get(cache, hold=True) == path  # a second hold of the same key
    _get_checked(cache, b)
    _get_checked(cache, c)
    assert _present(cache) == {"a", "c"}
    cache.release(a.key)
    _get_checked(cache, b)
    assert _present(cache) == {"a", "b"}  # still held once
    cache.release(a.key)
    _get_checked(cache, c)
    assert _present(cache) == {"b", "c"}
    changed = Item(b.key, b.size, "f" * 64, b.fetch)
    with cache.open_shared(b.key):
        with pytest.raises(CacheError, match="this process holds the cached copy"):
            changed.get(cache)


def test_needed_shards_go_last_and_only_while_their_process_lives(tmp_path, origin):
    cache = ShardCache(tmp_path / "cache", 3 * SHARD)
    a, b, c, d, e, f = (origin.shard(n) for n in "abcdef")
    for item in (a, b, c):
        _get_checked(cache, item)
    ctx = multiprocessing.get_context("fork")
    q, go = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=_child_needs, args=(cache, [a.key, c.key], q, go))
    p.start()
    assert q.get(timeout=60) == "declared"
    _get_checked(cache, d)  # a is least recently used, but needed: b goes
    assert _present(cache) == {"a", "c", "d"}
    _get_checked(cache, e)  # d is the only one not needed
    assert _present(cache) == {"a", "c", "e"}
    go.set()
    p.join(timeout=60)
    assert len(_files(cache.directory / "needed")) == 1  # left by a process that exited
    _get_checked(cache, f)  # a is needed by nobody alive now (else e would go)
    assert _present(cache) == {"c", "e", "f"}
    assert _files(cache.directory / "needed") == []


def test_protect_and_set_needed_in_this_process(tmp_path, origin):
    cache = ShardCache(tmp_path / "cache", 3 * SHARD)
    a, b, c, d, e = (origin.shard(n) for n in "abcde")
    for item in (a, b, c):
        _get_checked(cache, item)
    _get_checked(cache, d, protect=[a.key])
    assert _present(cache) == {"a", "c", "d"}
    cache.set_needed([c.key])
    _get_checked(cache, e)
    assert _present(cache) == {"c", "d", "e"}
    cache.set_needed([])
    assert _files(cache.directory / "needed") == []


def test_working_set_too_big(tmp_path, origin):
    cache = ShardCache(tmp_path / "cache", 2500)
    a, b, c = (origin.shard(n) for n in "abc")
    _get_checked(cache, a, hold=True)
    _get_checked(cache, b, hold=True)
    msg = (
        r"no room for pack/c \(1000 bytes\): cache_limit is 2500 bytes and 2000 bytes of shards are in use "
        r"by readers; set cache_limit to at least 3kB"
    )
    with pytest.raises(CacheError, match=msg):
        c.get(cache)
    assert c.fetch.calls() == 0  # refused before downloading
    assert _present(cache) == {"a", "b"}
    assert "pack/c.lock" not in _files(cache.directory / "locks")
    big = origin.shard("big", size=3001)
    with pytest.raises(CacheError, match="more than cache_limit 2500 bytes; set cache_limit to at least 3.1kB"):
        big.get(cache)
    cache.close()  # drops the holds
    _get_checked(cache, c)
    assert parse_size("3kB") == 3000


def test_limit_holds_under_concurrent_processes(tmp_path, origin):
    """Four processes reading random shards at once: every read verified, the limit kept."""
    cache = ShardCache(tmp_path / "cache", 4 * SHARD)
    items = [origin.shard(f"s{i}", delay=0.01) for i in range(12)]
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_churn, args=(cache, items, seed, q)) for seed in range(4)]
    for p in procs:
        p.start()
    results = [q.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    assert all(r == "ok" for r in results), results
    assert sum(i.fetch.calls() for i in items) > len(items)  # evictions happened on the way
    assert _held_bytes(cache) <= cache.limit_bytes
    assert _files(cache.directory / "shards", "*.part") == []


def _churn(cache: ShardCache, items: list[Item], seed: int, q) -> None:
    import random

    rng = random.Random(seed)
    try:
        for _ in range(60):
            item = rng.choice(items)
            with cache.open_shared(item.key, size=item.size, sha256=item.sha256, fetch=item.fetch) as path:
                assert hashlib.sha256(path.read_bytes()).hexdigest() == item.sha256
                held = _held_bytes(cache)
                # a scan is not atomic: it may see a shard evicted and its replacement both
                assert held <= cache.limit_bytes + SHARD, held
        q.put("ok")
    except Exception as exc:
        q.put(repr(exc))


# -- disk full --------------------------------------------------------------------------------


@pytest.fixture
def tiny_tmpfs(tmp_path):
    from _fault_helpers import mounted_tmpfs

    with mounted_tmpfs(tmp_path, "1m") as mnt:
        yield mnt


def test_disk_full_while_fetching(tiny_tmpfs, origin):
    cache = ShardCache(tiny_tmpfs / "cache", "10MB")
    big = origin.shard("big", size=2_000_000)
    with pytest.raises(CacheError, match=rf"{tiny_tmpfs}/cache: disk full while fetching pack/big .*needs 2000000 bytes"):
        big.get(cache)
    for sub in ("shards", "meta", "locks"):
        assert _files(cache.directory / sub) == [], sub
    small = origin.shard("small", size=100_000)
    assert small.get(cache).stat().st_size == 100_000  # the cache still works


# -- prefetch ---------------------------------------------------------------------------------


def test_prefetch_makes_shards_ready(tmp_path, origin):
    cache = ShardCache(tmp_path / "cache", 10 * SHARD)
    items = [origin.shard(n, delay=0.05) for n in "abc"]
    cache.prefetch([(i.key, i.size, i.sha256, i.fetch) for i in items], max_workers=2)
    for item in items:
        _wait_for(cache.path(item.key))
    assert items[0].get(cache).read_bytes() == items[0].fetch.src.read_bytes()
    slow = origin.shard("slow", delay=0.3)
    cache.prefetch([(slow.key, slow.size, slow.sha256, slow.fetch)], max_workers=2)
    slow.get(cache)  # waits for the prefetch rather than fetching a second time
    assert [i.fetch.calls() for i in (*items, slow)] == [1, 1, 1, 1]
    s = cache.stats()
    assert (s.downloads, s.shards) == (4, 4)
    with pytest.raises(ValueError, match="already runs 2 workers"):
        cache.prefetch([], max_workers=3)
    cache.close()


@pytest.mark.parametrize("mode, error", [("corrupt", CacheError), ("raise", RuntimeError)])
def test_a_failed_prefetch_surfaces_on_get(tmp_path, origin, mode, error):
    cache = ShardCache(tmp_path / "cache", 10 * SHARD)
    bad = origin.shard("bad", mode=mode, bad_calls=-1)
    cache.prefetch([(bad.key, bad.size, bad.sha256, bad.fetch)])
    with pytest.raises(error, match="pack/bad|origin unreachable"):
        bad.get(cache)
    cache.close()


# -- processes --------------------------------------------------------------------------------


def test_pickles_small_and_works_in_a_spawned_process(tmp_path, origin):
    cache = ShardCache(tmp_path / "cache", 10 * SHARD)
    a, b = origin.shard("a"), origin.shard("b")
    a.get(cache, hold=True)
    cache.set_needed([a.key])
    blob = pickle.dumps(cache)
    assert len(blob) < 400, len(blob)
    ctx = multiprocessing.get_context("spawn")
    got = _run(ctx, _child_get, cache, b, ctx.Barrier(1))
    assert got == (str(cache.path(b.key)), b.sha256)
    b.get(cache)
    assert b.fetch.calls() == 1 and cache.stats().hits == 1
    cache.close()


def test_a_forked_child_cannot_drop_the_parents_hold(tmp_path, origin):
    cache = ShardCache(tmp_path / "cache", 2 * SHARD)
    a, b, c = (origin.shard(n) for n in "abc")
    _get_checked(cache, a, hold=True)
    _get_checked(cache, b)
    ctx = multiprocessing.get_context("fork")
    assert _run(ctx, _child_forked_after_hold, cache, a.key) == "not held here"
    _get_checked(cache, c)  # a is the least recently used, and still held by us
    assert _present(cache) == {"a", "c"}
    cache.release(a.key)


class _StaleFirstLook(ShardCache):
    """A cache whose first look at a shard is out of date: it sees the shard missing although
    another process has it (the race where that process finished the fetch in between)."""

    def _valid(self, key, size, sha):
        if not getattr(self, "_looked", False):
            self._looked = True
            return False
        return super()._valid(key, size, sha)


@pytest.mark.timeout(60)
def test_a_fetch_never_waits_forever_on_a_readers_hold(origin, tmp_path):
    """Regression: a process that found a shard missing used to wait for LOCK_EX while a
    reader held the (meanwhile fetched) shard with LOCK_SH; that reader could be waiting for
    the first process (a loader's worker waiting for the main process's next task), and the
    epoch never ended. Now it sees the shard arrived and serves it."""
    item = origin.shard("a")
    reader = ShardCache(tmp_path / "c", 10 * SHARD)
    late = _StaleFirstLook(tmp_path / "c", 10 * SHARD)
    held = item.get(reader, hold=True)  # a reader holds the shard (LOCK_SH) and keeps it
    try:
        got = item.get(late)  # its first look says "missing"
        assert got == held and item.fetch.calls() == 1  # served the held copy, no second fetch
    finally:
        reader.release(item.key)
        reader.close()
        late.close()
