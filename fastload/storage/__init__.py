"""Storage backends behind one small writer/reader pair, and the pack-level reader.

:func:`open_pack` is what datasets use: it reads the manifest(s), checks that every shard
is present with the recorded size, and maps global record indices onto shards. Like the
shard readers, it opens no file handle until a record is read, and pickles small.
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import FormatError
from ..schema import BACKENDS, Manifest, ShardEntry, find_manifests
from .base import ShardIndex, ShardReader, ShardWriter, StringTable, file_sha256
from .index_file import read_index_file

__all__ = [
    "PackReader",
    "ShardIndex",
    "ShardReader",
    "ShardWriter",
    "StringTable",
    "make_shard_reader",
    "make_shard_writer",
    "open_pack",
]


def make_shard_writer(backend: str, path: Path, *, shard_size: int = 1 << 30) -> ShardWriter:
    if backend == "lmdb":
        from .lmdb_backend import LMDBShardWriter

        return LMDBShardWriter(path, shard_size=shard_size)
    if backend == "hdf5":
        from .hdf5_backend import HDF5ShardWriter

        return HDF5ShardWriter(path, shard_size=shard_size)
    raise ValueError(f"unknown storage backend {backend!r} (choose from {', '.join(BACKENDS)})")


def make_shard_reader(backend: str, path: Path, num_samples: int) -> ShardReader:
    if backend == "lmdb":
        from .lmdb_backend import LMDBShardReader

        return LMDBShardReader(path, num_samples)
    if backend == "hdf5":
        from .hdf5_backend import HDF5ShardReader

        return HDF5ShardReader(path, num_samples)
    raise FormatError(f"unknown storage backend {backend!r}")


class PackReader:
    """All shards of a packed directory (every ``--part`` of it) as one record sequence.

    ``remote``: a pack at a URL (:class:`~fastload.storage.remote_pack.RemotePack`): its
    manifests and index come from a local copy, and each shard is taken from the node's shard
    cache when first read, held against eviction while this process has it open (at most
    ``max_open`` remote shards at once; the oldest is closed and released first).
    """

    def __init__(self, root: str | Path, *, check_files: bool = True, remote: Any = None, max_open: int = 32):
        self.remote = remote
        self.url = remote.url if remote is not None else None
        self.root = Path(remote.fetch_meta()) if remote is not None else Path(root)
        self.max_open = int(max_open)
        self._held: dict[int, None] = {}  # remote shards this process holds, oldest first
        self._announced: dict[int, None] = {}  # remote shards whose download was started, recent last
        self.manifests: tuple[Manifest, ...] = tuple(find_manifests(self.root))
        first = self.manifests[0]
        self.backend = first.backend
        self.payload = first.payload
        self.classes = first.classes
        entries = [s for m in self.manifests for s in m.shards]
        self.shard_entries = tuple(entries)
        counts = np.asarray([s.num_samples for s in entries], dtype=np.int64)
        self.shard_starts = np.zeros(len(entries) + 1, dtype=np.int64)
        np.cumsum(counts, out=self.shard_starts[1:])
        shapes = {m.image_shape for m in self.manifests}
        self.image_shape = shapes.pop() if len(shapes) == 1 else None
        if check_files and remote is None:
            self._check_files()
        self._readers: list[ShardReader] = [
            make_shard_reader(self.backend, self.shard_path(k), s.num_samples) for k, s in enumerate(entries)
        ]

    def _check_files(self) -> None:
        for s in self.shard_entries:
            p = self.root / s.file
            try:
                size = p.stat().st_size
            except FileNotFoundError:
                raise FormatError(f"{p}: shard listed in the manifest is missing") from None
            if size != s.bytes:
                raise FormatError(
                    f"{p}: size {size} bytes, manifest says {s.bytes}: shard truncated or replaced "
                    f"(run `fastload verify {self.root}`)"
                )

    def __len__(self) -> int:
        return int(self.shard_starts[-1])

    @property
    def num_samples(self) -> int:
        return len(self)

    @property
    def class_to_idx(self) -> dict[str, int]:
        return {c: i for i, c in enumerate(self.classes)}

    @property
    def skipped(self):
        return tuple(s for m in self.manifests for s in m.skipped)

    @property
    def options(self) -> dict:
        return dict(self.manifests[0].options)

    @cached_property
    def index(self) -> ShardIndex:
        """Labels, shapes and paths of every record: memory-mapped from the parts' index files
        (one part: no copy at all), or, for packs made before index files, read from every
        shard with short-lived handles."""
        if not self._readers:
            return ShardIndex(np.zeros(0, np.int64), np.zeros((0, 3), np.int32), StringTable.from_strings([]))
        if all(m.index is not None for m in self.manifests):
            parts = [read_index_file(self.root / m.index.file, num_samples=m.num_samples) for m in self.manifests]
            return parts[0] if len(parts) == 1 else ShardIndex.concat(parts)
        return ShardIndex.concat(r.read_index() for r in self._readers)

    @property
    def index_entries(self) -> tuple[ShardEntry, ...]:
        """The manifests' index-file entries (none for packs made before index files)."""
        return tuple(m.index for m in self.manifests if m.index is not None)

    def locate(self, i: int) -> tuple[int, int]:
        """(shard number, record number inside it) of global record ``i``."""
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"record {i} out of range for a pack of {n}")
        i %= n
        k = int(np.searchsorted(self.shard_starts, i, side="right")) - 1
        return k, i - int(self.shard_starts[k])

    def get(self, i: int):
        """Payload of global record ``i``: a zero-copy buffer valid until ``close()`` (for a
        remote pack, until another shard's first read may close this one)."""
        k, j = self.locate(i)
        if self.remote is not None and k not in self._held:
            self._hold(k)
        return self._readers[k].get(j)

    def _hold(self, k: int) -> None:
        self.remote.hold(self.shard_entries[k])
        self._held[k] = None
        while len(self._held) > self.max_open:
            old = next(iter(self._held))
            del self._held[old]
            self._readers[old].close()
            self.remote.release(self.shard_entries[old])

    def prefetch(self, indices) -> None:
        """Start downloading, in the background, the remote shards records ``indices`` are in,
        unless this process already did (a no-op for a local pack); the shards recently
        announced are the ones this process needs soon, evicted last. Returns at once."""
        if self.remote is None or not len(indices):
            return
        shards = np.unique(np.searchsorted(self.shard_starts, np.asarray(indices), side="right") - 1)
        new = [int(k) for k in shards if int(k) not in self._announced]
        if not new:
            return
        self.remote.prefetch([self.shard_entries[k] for k in new])
        for k in new:
            self._announced[k] = None
        while len(self._announced) > 4 * self.max_open:  # bounded: forget the oldest
            del self._announced[next(iter(self._announced))]
        self.remote.set_needed(self.shard_entries[k] for k in self._announced)

    def hold_at_most(self, n: int | None) -> None:
        """Keep at most ``n`` remote shards open (an order's ``open_shards``; None: no change)."""
        if n is not None:
            self.max_open = min(self.max_open, int(n))

    def shard_path(self, k: int) -> Path:
        """Shard ``k``'s local file (for a remote pack, its place in the node cache)."""
        if self.remote is not None:
            return self.remote.path(self.shard_entries[k])
        return self.root / self.shard_entries[k].file

    def shard_name(self, k: int) -> str:
        """How errors name shard ``k``: its path, or its URL for a remote pack."""
        if self.url is not None:
            return f"{self.url}/{self.shard_entries[k].file}"
        return str(self.shard_path(k))

    def shard_reader(self, k: int) -> ShardReader:
        return self._readers[k]

    def verify_checksums(self, progress=None) -> list[str]:
        """Recompute every shard's SHA-256; returns one message per mismatch."""
        problems = []
        for s in (*self.shard_entries, *self.index_entries):
            p = self.root / s.file
            if not p.exists():
                problems.append(f"{p}: missing")
            else:
                digest = file_sha256(p)
                if digest != s.sha256:
                    problems.append(f"{p}: SHA-256 mismatch (corrupt shard): expected {s.sha256[:16]}..., got {digest[:16]}...")
            if progress is not None:
                progress(s)
        return problems

    def close(self) -> None:
        for r in self._readers:
            r.close()
        if self.remote is not None:
            for k in list(self._held):
                self.remote.release(self.shard_entries[k])
            self._held.clear()

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_held"] = {}  # holds are this process's file locks
        state["_announced"] = {}  # and downloads are started per process
        # The index is rebuilt from the shards if needed; datasets keep their own arrays.
        state.pop("index", None)
        return state


def open_pack(root: str | Path, *, check_files: bool = True, cache_dir: str | Path | None = None,
              cache_limit: int | str | None = None, storage_options: dict | None = None,
              endpoint_url: str | None = None, retry_seconds: float = 60.0) -> PackReader:
    """Open a packed directory, or a pack at a URL (``s3://``, ``gs://``, ``az://``...) read
    through the node's shard cache (``cache_dir``, ``cache_limit``; ``storage_options``,
    ``endpoint_url`` and ``retry_seconds`` for the store). Nothing is opened until the first
    record is read."""
    from .remote import is_url

    if is_url(root):
        from .remote_pack import RemotePack

        remote = RemotePack(str(root), cache_dir=cache_dir, cache_limit=cache_limit,
                            storage_options=storage_options, endpoint_url=endpoint_url,
                            retry_seconds=retry_seconds)
        return PackReader(str(root), check_files=check_files, remote=remote)
    return PackReader(root, check_files=check_files)
