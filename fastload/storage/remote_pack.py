"""A pack at a URL (``s3://bucket/prefix``), read through the node-local shard cache.

Opening a remote pack downloads only its manifests and index files (small) into
``<cache_dir>/packs/<url hash>/``; :class:`~fastload.storage.PackReader` then reads them as
it reads a local pack. Shards are fetched whole, on first use (or ahead of it, see
:meth:`RemotePack.prefetch`), into the :class:`~fastload.storage.cache.ShardCache` that every
process and rank on the node shares: one download per shard per node, SHA-256-checked
against the manifest before it is renamed into place, evicted least-recently-used when the
cache is over ``cache_limit``.

Packs are written to a URL by packing into a local staging folder and uploading each file,
the manifest last (:func:`upload_pack`), so a remote pack never looks complete before it is.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import secrets
import shutil
from pathlib import Path
from typing import Any, Iterable, Mapping

from ..errors import FormatError
from ..schema import MANIFEST_NAME, Manifest, ShardEntry, find_manifests, read_manifest
from .base import file_sha256
from . import remote_agent
from .cache import CacheStats, ShardCache, parse_size
from .remote import RemoteNotFoundError, RemoteStore, is_url

__all__ = ["RemotePack", "default_cache_dir", "is_url", "remove_staging", "staging_dir", "upload_pack"]

_PART_MANIFEST = re.compile(r"^manifest-p\d{5}-of-\d{5}\.json$")
CACHE_ENV = "FASTLOAD_CACHE_DIR"
_DEFAULT_FREE_FRACTION = 0.8  # of the cache disk's free space, when no cache_limit is given


def default_cache_dir() -> Path:
    """``$FASTLOAD_CACHE_DIR``, else ``$XDG_CACHE_HOME/fastload``, else ``~/.cache/fastload``."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "fastload"


def _default_limit(directory: Path) -> int:
    directory.mkdir(parents=True, exist_ok=True)
    st = os.statvfs(directory)
    return max(1 << 30, int(st.f_bavail * st.f_frsize * _DEFAULT_FREE_FRACTION))


class RemotePack:
    """The files of the pack at ``url``: small ones (manifests, index files) copied into a
    local folder, shards through a :class:`ShardCache` (``cache_dir``, ``cache_limit``: bytes
    or a size like ``"200GB"``; default 80% of the cache disk's free space).

    ``storage_options``/``endpoint_url``/``retry_seconds`` go to
    :class:`~fastload.storage.remote.RemoteStore` (credentials and endpoints otherwise come
    from the environment; a store that stays unreachable fails after ``retry_seconds``). Pickles small; each
    process opens its own client and cache handle.

    The process that opens it downloads the manifests and index files and runs download-ahead
    through :mod:`~fastload.storage.remote_agent` (a helper forked from it), so it never starts
    the object-store runtime itself and its DataLoader workers can be forked; shards a process
    reads (:meth:`hold`) are downloaded by that process.
    """

    def __init__(self, url: str, *, cache_dir: str | os.PathLike | None = None, cache_limit: int | str | None = None,
                 storage_options: Mapping[str, Any] | None = None, endpoint_url: str | None = None,
                 retry_seconds: float = 60.0):
        if not is_url(url):
            raise ValueError(f"{url!r} is not an object-store URL")
        self.url = str(url).rstrip("/")
        self.store = RemoteStore(self.url, storage_options=storage_options, endpoint_url=endpoint_url,
                                 retry_seconds=retry_seconds)
        directory = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        limit = parse_size(cache_limit) if cache_limit is not None else _default_limit(directory)
        self.cache = ShardCache(directory, limit)
        self.namespace = hashlib.sha256(self.url.encode()).hexdigest()[:16]
        self.meta_dir = directory / "packs" / self.namespace
        self._owner = os.getpid()  # the opening process: its I/O goes through the agent
        self._token = secrets.token_hex(8)  # names this pack's copy in the agent

    def _via_agent(self) -> bool:
        return os.getpid() == self._owner and remote_agent.usable()

    def __repr__(self) -> str:
        return f"RemotePack({self.url!r}, cache={self.cache!r})"

    # -- manifests and index files ----------------------------------------------------------

    def fetch_meta(self) -> Path:
        """Download the manifests (always: they say whether the pack changed) and the index
        files they list (when the local copy's checksum differs) into :attr:`meta_dir`."""
        if self._via_agent():
            return remote_agent.call(_agent_fetch_meta, self, timeout=2 * self.store.retry_seconds + 60,
                                     what=f"{self.url}/{MANIFEST_NAME}")
        return self._fetch_meta()

    def _fetch_meta(self) -> Path:
        self.meta_dir.mkdir(parents=True, exist_ok=True)
        try:
            names = [MANIFEST_NAME] if self.store.head(MANIFEST_NAME) is not None else sorted(
                k for k, _ in self.store.list() if _PART_MANIFEST.match(k))
        except RemoteNotFoundError:
            names = []
        if not names:
            raise FormatError(f"{self.url}: no {MANIFEST_NAME} (not a fastload pack, or its packing never finished)")
        keep = set(names)
        for name in names:
            _atomic_write(self.meta_dir / name, self.store.get_bytes(name))
        for stale in self.meta_dir.glob("manifest*.json"):  # parts of an earlier pack at this URL
            if stale.name not in keep:
                stale.unlink(missing_ok=True)
        manifests = find_manifests(self.meta_dir)
        for m in manifests:
            if m.index is None:
                raise FormatError(
                    f"{self.url}: packed by an older fastload without an index file; repack it to read it "
                    "from object storage (or copy it to a local disk)"
                )
            self._fetch_small(m.index)
        return self.meta_dir

    def _fetch_small(self, entry: ShardEntry) -> None:
        dest = self.meta_dir / entry.file
        if dest.is_file() and dest.stat().st_size == entry.bytes and file_sha256(dest) == entry.sha256:
            return
        tmp = dest.with_name(f".{dest.name}.{os.getpid()}.part")
        self.store.download(entry.file, tmp, size=entry.bytes, sha256=entry.sha256)
        os.replace(tmp, dest)

    # -- shards ----------------------------------------------------------------------------

    def key(self, entry: ShardEntry) -> str:
        """The shard's key in the node cache (namespaced by the pack's URL)."""
        return f"{self.namespace}/{entry.file}"

    def path(self, entry: ShardEntry) -> Path:
        return self.cache.path(self.key(entry))

    def _fetcher(self, entry: ShardEntry):
        def fetch(dest: Path) -> None:
            self.store.download(entry.file, dest, size=entry.bytes, sha256=entry.sha256)

        return fetch

    def hold(self, entry: ShardEntry) -> Path:
        """The shard's local path, downloaded first if no process on the node has it, locked
        against eviction until :meth:`release`."""
        return self.cache.get(self.key(entry), size=entry.bytes, sha256=entry.sha256, fetch=self._fetcher(entry),
                              hold=True)

    def release(self, entry: ShardEntry) -> None:
        self.cache.release(self.key(entry))

    def prefetch(self, entries: Iterable[ShardEntry], *, max_workers: int = 4) -> None:
        """Start downloading shards that will be needed soon (background threads, in the agent
        if this process opened the pack; a later :meth:`hold` waits for them, and downloads the
        shard itself if they failed, raising its error)."""
        if self._via_agent():
            entries = list(entries)
            if entries:
                remote_agent.post(_agent_prefetch, self, entries, max_workers)
            return
        items = [(self.key(e), e.bytes, e.sha256, self._fetcher(e)) for e in entries]
        if items:
            self.cache.prefetch(items, max_workers=max_workers)

    def set_needed(self, entries: Iterable[ShardEntry]) -> None:
        """Shards this process will read soon: evicted last (see ShardCache.set_needed)."""
        self.cache.set_needed(self.key(e) for e in entries)

    def stats(self) -> CacheStats:
        """The cache's :class:`~fastload.storage.cache.CacheStats`, with the counters of this
        process's object-store helper added (it does the download-ahead; workers count theirs)."""
        mine = self.cache.stats()
        if os.getpid() != self._owner or not remote_agent.started():
            return mine
        theirs = remote_agent.call(_agent_stats, self, timeout=60, what=f"{self.url}: cache statistics")
        return dataclasses.replace(
            mine, hits=mine.hits + theirs.hits, misses=mine.misses + theirs.misses,
            downloads=mine.downloads + theirs.downloads, evictions=mine.evictions + theirs.evictions,
            peak_bytes=max(mine.peak_bytes, theirs.peak_bytes))

    def close(self) -> None:
        self.cache.close()


def _in_agent(pack: RemotePack) -> RemotePack:
    """The agent's copy of ``pack``: one per pack, so its client and cache persist across calls."""
    return remote_agent.keep(pack._token, lambda: pack)


def _agent_fetch_meta(pack: RemotePack) -> Path:
    return _in_agent(pack)._fetch_meta()


def _agent_prefetch(pack: RemotePack, entries: list[ShardEntry], max_workers: int) -> None:
    _in_agent(pack).prefetch(entries, max_workers=max_workers)


def _agent_stats(pack: RemotePack) -> CacheStats:
    return _in_agent(pack).cache.stats()


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.part")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# -- writing ----------------------------------------------------------------------------------


def upload_pack(local: Path, store: RemoteStore, *, part: int = 0, parts: int = 1, log=None) -> int:
    """Upload one finished local pack part to ``store``: shards, then the index file, then the
    manifest, each skipped when the bucket already holds an object of the recorded size (an
    interrupted upload resumes). Every upload is checked by size. Returns the bytes uploaded."""
    from ..schema import manifest_name

    mpath = Path(local) / manifest_name(part, parts)
    manifest: Manifest = read_manifest(mpath)
    sent = 0
    for entry in (*manifest.shards, *((manifest.index,) if manifest.index is not None else ())):
        if store.head(entry.file) == entry.bytes:
            continue
        store.upload(Path(local) / entry.file, entry.file)
        got = store.head(entry.file)
        if got != entry.bytes:
            raise FormatError(f"{store.url}/{entry.file}: uploaded {entry.bytes} bytes but the store holds {got}")
        sent += entry.bytes
        if log is not None:
            log(entry.file)
    data = mpath.read_bytes()
    store.put_bytes(mpath.name, data)  # last: the remote pack is complete from here on
    return sent + len(data)


def staging_dir(url: str, part: int, parts: int, base: Path | None = None) -> Path:
    """Where ``fastload pack SRC URL`` packs before uploading: stable per (URL, part), so a
    rerun resumes the local pack and the upload."""
    digest = hashlib.sha256(f"{url.rstrip('/')}|{part}|{parts}".encode()).hexdigest()[:16]
    return (base or default_cache_dir()) / "staging" / digest


def remove_staging(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)

