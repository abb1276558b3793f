"""Storage backends behind one small writer/reader pair, and the pack-level reader.

:func:`open_pack` is what datasets use: it reads the manifest(s), checks that every shard
is present with the recorded size, and maps global record indices onto shards. Like the
shard readers, it opens no file handle until a record is read, and pickles small.
"""

from __future__ import annotations

import bisect
import os
import weakref
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from ..errors import CorruptRecordError, FormatError
from ..schema import BACKENDS, Manifest, ShardEntry, find_manifests
from .base import ShardIndex, ShardReader, ShardWriter, StringTable, checksum_seed, check_labels, file_sha256, record_checksum
from .pack_index import PackIndex, PartedArray, ShardLocations

__all__ = [
    "PackReader",
    "ShardIndex",
    "ShardReader",
    "ShardWriter",
    "StringTable",
    "make_shard_reader",
    "make_shard_writer",
    "default_max_open",
    "open_pack",
    "record_checksum",
]


def make_shard_writer(backend: str, path: Path, *, shard_size: int = 1 << 30, pack_id: str | None = None) -> ShardWriter:
    if backend == "lmdb":
        from .lmdb_backend import LMDBShardWriter

        return LMDBShardWriter(path, shard_size=shard_size, pack_id=pack_id)
    if backend == "hdf5":
        from .hdf5_backend import HDF5ShardWriter

        return HDF5ShardWriter(path, shard_size=shard_size, pack_id=pack_id)
    raise ValueError(f"unknown storage backend {backend!r} (choose from {', '.join(BACKENDS)})")


def make_shard_reader(backend: str, path: Path, num_samples: int, *, pack_id: str | None = None,
                      name: str | None = None, entry: ShardEntry | None = None,
                      locations: ShardLocations | None = None) -> ShardReader:
    """A reader of one shard; ``entry`` (its manifest entry) carries what the backend checks
    before trusting the file (HDF5: the metadata checksum); ``locations``: where the pack's
    index file says its records lie (LMDB: read from there instead of walking the shard)."""
    if backend == "lmdb":
        from .lmdb_backend import LMDBShardReader

        return LMDBShardReader(path, num_samples, pack_id=pack_id, name=name, locations=locations)
    if backend == "hdf5":
        from .hdf5_backend import HDF5ShardReader

        check = None
        if entry is not None and entry.meta_xxh3 is not None and entry.data_span is not None:
            check = (tuple(entry.data_span), entry.meta_xxh3)
        return HDF5ShardReader(path, num_samples, pack_id=pack_id, name=name, check=check)
    raise FormatError(f"unknown storage backend {backend!r}")


def default_max_open() -> int:
    """How many local shards one process keeps open: half its file-descriptor limit (each open
    shard holds one descriptor), so a pack of thousands of shards never hits "Too many open
    files" and the other half stays for everything else."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):  # pragma: no cover - not on POSIX
        return 256
    if soft == getattr(resource, "RLIM_INFINITY", -1) or soft <= 0:
        return 1024
    return max(4, min(1024, soft // 2))


def _close_all(readers: list[ShardReader]) -> None:
    for r in readers:
        try:
            r.close()
        except Exception:  # pragma: no cover - best effort at garbage collection
            pass


def _plain(labels, shapes, sums) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The same memory as plain ndarrays (shapes flat): indexing an ``np.memmap`` builds a
    memmap view each time, which made the per-read check twice as slow."""
    return np.asarray(labels), np.asarray(shapes).reshape(-1), np.asarray(sums)


class PackReader:
    """All shards of a packed directory (every ``--part`` of it) as one record sequence.

    ``remote``: a pack at a URL (:class:`~fastload.storage.remote_pack.RemotePack`): its
    manifests and index come from a local copy, and each shard is taken from the node's shard
    cache when first read, held against eviction while this process has it open (at most
    ``max_open`` remote shards at once; the oldest is closed and released first). A local pack
    keeps at most ``max_open`` shards open too (default: :func:`default_max_open`), closing the
    least recently used first; a reader that is garbage-collected closes its shards.

    ``verify_records``: check every record read against the checksum stored when it was packed
    (payload, label, shape and record number; see :func:`~fastload.storage.base.record_checksum`).
    On by default; off only to measure what the check costs. Packs made before checksums read
    unchecked.
    """

    def __init__(self, root: str | Path, *, check_files: bool = True, remote: Any = None,
                 max_open: int | None = None, verify_records: bool = True):
        self.remote = remote
        self.url = remote.url if remote is not None else None
        self.root = Path(remote.fetch_meta()) if remote is not None else Path(root)
        self.max_open = int(max_open) if max_open is not None else (32 if remote is not None else default_max_open())
        self.verify_records = bool(verify_records)
        self._checks: tuple | None = None  # see _record_checks; None: not loaded yet
        self._part_of_shard: list[int] | None = None
        self._held: dict[int, None] = {}  # shards this process has open (remote: holds), oldest first
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
        self._starts_list: list[int] = self.shard_starts.tolist()  # for bisect on every read
        shapes = {m.image_shape for m in self.manifests}
        self.image_shape = shapes.pop() if len(shapes) == 1 else None
        if check_files and remote is None:
            self._check_files()
        ids = [m.pack_id for m in self.manifests for _ in m.shards]
        # The pack's index files, mapped on first use; shared by :attr:`index` and the shard
        # readers (which take record locations from it instead of walking their shards).
        self._pack_index: PackIndex | None = None
        if entries and all(m.index is not None for m in self.manifests):
            self._pack_index = PackIndex([(self.root / m.index.file, m.num_samples, getattr(m, "pack_id", None))
                                          for m in self.manifests], [m.index.sha256 for m in self.manifests])
        locations: list[ShardLocations | None] = [None] * len(entries)
        if self._pack_index is not None and self.backend == "lmdb":
            k = 0
            for m, mf in enumerate(self.manifests):
                first = 0
                for j, s in enumerate(mf.shards):
                    locations[k] = ShardLocations(self._pack_index, m, first, s.num_samples, j)
                    first += s.num_samples
                    k += 1
        self._readers: list[ShardReader] = [
            make_shard_reader(self.backend, self.shard_path(k), s.num_samples, pack_id=ids[k],
                              name=self.shard_name(k) if remote is not None else None, entry=s,
                              locations=locations[k])
            for k, s in enumerate(entries)
        ]
        # Close this process's shards when the reader is dropped (the list is shared, not self).
        self._finalizer = weakref.finalize(self, _close_all, self._readers)
        if remote is not None:
            _REMOTE_READERS.add(self)

    def _forget_parent(self) -> None:
        """In a forked child: the parent's holds are its own (the child's cache object has
        dropped them, see ShardCache), so this process holds and announces nothing yet."""
        self._held.clear()
        self._announced.clear()

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
    def index(self) -> ShardIndex | PackIndex:
        """Labels, shapes and paths of every record: a :class:`PackIndex` memory-mapped from the
        parts' index files (one physical copy per node, no private copy, pickled as the files'
        paths), or, for packs made before index files, read from every shard with short-lived
        handles (a private copy)."""
        if not self._readers:
            index = ShardIndex(np.zeros(0, np.int64), np.zeros((0, 3), np.int32), StringTable.from_strings([]))
        elif self._pack_index is not None:
            index = self._pack_index.open()
            labels = index.labels.parts if isinstance(index.labels, PartedArray) else [index.labels]
            for m, lab in zip(self.manifests, labels):  # part by part: no joined copy of N labels
                check_labels(lab, len(self.classes), where=str(self.root / m.index.file))
        else:
            parts = []
            for k, r in enumerate(self._readers):
                idx = r.read_index()
                check_labels(idx.labels, len(self.classes), where=self.shard_name(k))
                parts.append(idx)
            index = ShardIndex.concat(parts)
        return index

    @property
    def has_checksums(self) -> bool:
        """Whether the pack stores record checksums (packs made before them do not)."""
        return bool(self._record_checks())

    def _record_checks(self) -> tuple:
        """Per part of the pack: (first record, labels, shapes, checksums), the very arrays
        :attr:`index` serves (memory maps of the index files: the label a dataset serves is the
        label checked); ``()`` for packs without checksums. Per part so that a read costs two
        array lookups, never a search or a concatenated copy."""
        if self._checks is None:
            index = self.index
            sums = index.checksums
            if sums is None or not len(self):
                self._checks = ()
            elif isinstance(index, PackIndex) and len(index.files) > 1:
                starts = index.starts.tolist()
                parts = zip(index.labels.parts, index.shapes.parts, sums.parts)
                self._checks = tuple((starts[m], *_plain(*arrs)) for m, arrs in enumerate(parts))
            else:
                self._checks = ((0, *_plain(index.labels, index.shapes, sums)),)
            if self._checks:
                part_of = [m for m, mf in enumerate(self.manifests) for _ in mf.shards]
                self._part_of_shard = part_of if len(self._checks) > 1 else None
        return self._checks

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
        starts = self._starts_list
        k = bisect.bisect_right(starts, i) - 1  # 20x cheaper than np.searchsorted for one value
        return k, i - starts[k]

    def get(self, i: int):
        """Payload of global record ``i``: a zero-copy buffer valid until ``close()``, or until a
        read of another shard closes this one (more than ``max_open`` shards in use).

        Raises :class:`~fastload.errors.CorruptRecordError` when the bytes, or the label or
        shape the index holds for the record, differ from what was packed."""
        k, j = self.locate(i)
        if k in self._held:
            self._held[k] = self._held.pop(k)  # most recently used last
        else:
            self._hold(k)
        buf = self._readers[k].get(j)
        if self.verify_records:
            checks = self._checks if self._checks is not None else self._record_checks()
            if checks:
                g = self._starts_list[k] + j
                start, labels, shapes, sums = checks[self._part_of_shard[k] if len(checks) > 1 else 0]
                r = g - start
                # record_checksum's rule, with the Python ints .item() gives (three times cheaper
                # than numpy scalars): this runs on every read.
                b = 3 * r
                seed = checksum_seed(labels.item(r), j, shapes.item(b), shapes.item(b + 1), shapes.item(b + 2))
                if xxhash.xxh3_64_intdigest(buf, seed) != sums.item(r):
                    raise self._corrupt(k, j, g)
        return buf

    def _corrupt(self, k: int, j: int, g: int) -> CorruptRecordError:
        try:
            source = repr(self.index.paths[g])
        except Exception:  # the index itself may be what is damaged
            source = "unknown"
        detail = (f"checksum mismatch: its bytes, or its label or shape in the index, are damaged; "
                  f"run `fastload verify {self.url or self.root}`")
        return CorruptRecordError(f"{self.shard_name(k)}: record {j} (pack record {g}, source {source}): {detail}",
                                  detail=detail)

    def _hold(self, k: int) -> None:
        if self.remote is not None:
            self.remote.hold(self.shard_entries[k])
        self._held[k] = None
        while len(self._held) > self.max_open:
            old = next(iter(self._held))
            del self._held[old]
            self._readers[old].close()
            if self.remote is not None:
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

    def hold_only(self, indices) -> None:
        """Before reading a batch of records ``indices``: release the remote shards this process
        holds that the batch does not read (a no-op for a local pack).

        A reader otherwise keeps its last ``max_open`` shards pinned in the node cache, and
        under a :class:`~fastload.data.plan.BlockShufflePlan` those include windows long past:
        with several workers the pinned shards outgrow a cache sized for the windows being
        read. Pinning only the current batch's shards bounds the node's pinned set by the
        batches in flight (at most two windows' shards for batches smaller than a window).
        Shards read by consecutive batches stay held and open: no churn inside a window."""
        if self.remote is None or not self._held or not len(indices):
            return
        keep = set(np.unique(np.searchsorted(self.shard_starts, np.asarray(indices), side="right") - 1).tolist())
        for k in [k for k in self._held if k not in keep]:
            del self._held[k]
            self._readers[k].close()
            self.remote.release(self.shard_entries[k])

    def hold_at_most(self, n: int | None) -> None:
        """Keep at most ``n`` shards open (an order's ``open_shards``; None: no change)."""
        if n is not None:
            self.max_open = min(self.max_open, int(n))

    def shard_path(self, k: int) -> Path:
        """Shard ``k``'s local file (for a remote pack, its place in the node cache)."""
        if self.remote is not None:
            return self.remote.path(self.shard_entries[k])
        return self.root / self.shard_entries[k].file

    def shard_name(self, k: int) -> str:
        """How errors name shard ``k``: its path, or its URL for a remote pack."""
        if getattr(self, "url", None) is not None:
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
        # A PackIndex pickles as its files' paths (the receiver maps them again); an index
        # read from the shards of an older pack is read again from them if needed.
        if not isinstance(state.get("index"), PackIndex):
            state.pop("index", None)
        state.pop("_finalizer", None)
        if state.get("_checks"):
            state["_checks"] = None  # mapped again from the index files (or read from the shards), not pickled
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._finalizer = weakref.finalize(self, _close_all, self._readers)
        if self.remote is not None:
            _REMOTE_READERS.add(self)


# Remote readers of this process: a forked DataLoader worker starts without its parent's holds.
_REMOTE_READERS: weakref.WeakSet[PackReader] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for reader in list(_REMOTE_READERS):
        reader._forget_parent()


os.register_at_fork(after_in_child=_after_fork_in_child)


def open_pack(root: str | Path, *, check_files: bool = True, cache_dir: str | Path | None = None,
              cache_limit: int | str | None = None, storage_options: dict | None = None,
              endpoint_url: str | None = None, retry_seconds: float = 60.0,
              verify_records: bool = True) -> PackReader:
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
        return PackReader(str(root), check_files=check_files, remote=remote, verify_records=verify_records)
    return PackReader(root, check_files=check_files, verify_records=verify_records)
