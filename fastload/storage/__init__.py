"""Storage backends behind one small writer/reader pair, and the pack-level reader.

:func:`open_pack` is what datasets use: it reads the manifest(s), checks that every shard
is present with the recorded size, and maps global record indices onto shards. Like the
shard readers, it opens no file handle until a record is read, and pickles small.
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path

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
    """All shards of a packed directory (every ``--part`` of it) as one record sequence."""

    def __init__(self, root: str | Path, *, check_files: bool = True):
        self.root = Path(root)
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
        if check_files:
            self._check_files()
        self._readers: list[ShardReader] = [
            make_shard_reader(self.backend, self.root / s.file, s.num_samples) for s in entries
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
        """Payload of global record ``i``: a zero-copy buffer valid until ``close()``."""
        k, j = self.locate(i)
        return self._readers[k].get(j)

    def shard_path(self, k: int) -> Path:
        return self.root / self.shard_entries[k].file

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

    def __getstate__(self):
        state = self.__dict__.copy()
        # The index is rebuilt from the shards if needed; datasets keep their own arrays.
        state.pop("index", None)
        return state


def open_pack(root: str | Path, *, check_files: bool = True) -> PackReader:
    """Open a packed directory for reading (nothing is opened until the first record is read)."""
    return PackReader(root, check_files=check_files)
