"""What every storage backend shares: the per-shard index and the writer/reader contract.

A shard holds records (opaque payload bytes, numbered 0..n-1) plus an index: the label,
the decoded (H, W, C) shape, and the source path of each record. Backends move bytes;
they never encode or decode images.
"""

from __future__ import annotations

import hashlib
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

from ..errors import FormatError
from ..schema import ShardEntry


class StringTable:
    """An immutable list of strings stored as one UTF-8 blob plus offsets.

    Cheap to pickle and copy-on-read safe in DataLoader workers, unlike a list of str.
    Encoded with ``surrogateescape``, so a file name that is not UTF-8 (``os.fsdecode`` of
    arbitrary POSIX bytes) is stored as its original bytes and read back unchanged.
    """

    __slots__ = ("blob", "offsets")

    def __init__(self, blob: np.ndarray, offsets: np.ndarray):
        self.blob = np.asarray(blob, dtype=np.uint8)
        self.offsets = np.asarray(offsets, dtype=np.int64)

    @classmethod
    def from_strings(cls, items) -> StringTable:
        encoded = [s.encode("utf-8", "surrogateescape") for s in items]
        offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
        np.cumsum([len(b) for b in encoded], out=offsets[1:])
        blob = np.frombuffer(b"".join(encoded), dtype=np.uint8).copy()
        return cls(blob, offsets)

    @classmethod
    def concat(cls, tables) -> StringTable:
        tables = list(tables)
        if not tables:
            return cls.from_strings([])
        blobs, offs, base = [], [np.zeros(1, np.int64)], 0
        for t in tables:
            blobs.append(t.blob)
            offs.append(t.offsets[1:] + base)
            base += int(t.offsets[-1])
        return cls(np.concatenate(blobs), np.concatenate(offs))

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> str:
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        i %= len(self)
        return self.blob[self.offsets[i] : self.offsets[i + 1]].tobytes().decode("utf-8", "surrogateescape")

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def __eq__(self, other) -> bool:
        return isinstance(other, StringTable) and list(self) == list(other)


@dataclass(frozen=True)
class ShardIndex:
    """Per-record metadata of one shard (or of a whole pack, concatenated)."""

    labels: np.ndarray  # int64 (n,)
    shapes: np.ndarray  # int32 (n, 3): decoded H, W, C
    paths: StringTable  # source path of each record, relative to the pack's source
    checksums: np.ndarray | None = None  # uint64 (n,): record_checksum of each record; None in older packs
    # Where each record lies in its shard file (LMDB packs' index files; None otherwise): what
    # lets a reader slice records from shared maps instead of walking each shard privately.
    record_offsets: np.ndarray | None = None  # uint64 (n,): file offset of each record's bytes
    record_sizes: np.ndarray | None = None  # uint32 (n,): size of each record
    pack_id_at: np.ndarray | None = None  # uint64 (shards, 2): (offset, size) of each shard's pack id

    def __len__(self) -> int:
        return len(self.labels)

    @classmethod
    def concat(cls, parts) -> ShardIndex:
        parts = list(parts)
        if not parts:
            return cls(np.zeros(0, np.int64), np.zeros((0, 3), np.int32), StringTable.from_strings([]),
                       np.zeros(0, np.uint64))
        sums = None
        if all(p.checksums is not None for p in parts):
            sums = np.concatenate([p.checksums for p in parts]).astype(np.uint64, copy=False)
        return cls(
            labels=np.concatenate([p.labels for p in parts]).astype(np.int64, copy=False),
            shapes=np.concatenate([p.shapes for p in parts]).astype(np.int32, copy=False).reshape(-1, 3),
            paths=StringTable.concat(p.paths for p in parts),
            checksums=sums,
        )


_MASK64 = (1 << 64) - 1


def record_checksum(payload, *, label: int, record: int, shape) -> int:
    """XXH3-64 of a record's payload, seeded by its label, its number in its shard and its
    stored (H, W, C): one number that catches a flipped payload byte, a flipped label or shape
    in any index, and a record swapped with another. XXH3 because it runs at memory speed
    (~100 GB/s here; CRC32 ~5 GB/s would cost more than the 2% read budget on raw payloads).
    The one place this rule lives: the writer stores it, :meth:`PackReader.get` and
    ``fastload verify`` recompute it."""
    h, w, c = shape
    return xxhash.xxh3_64_intdigest(payload, checksum_seed(int(label), int(record), int(h), int(w), int(c)))


def checksum_seed(label: int, record: int, h: int, w: int, c: int) -> int:
    """The seed of :func:`record_checksum` from Python ints (the per-read check calls it
    directly with ints it already has: this is on every read's path)."""
    return ((label * 0x9E3779B97F4A7C15) ^ (record * 0xC2B2AE3D27D4EB4F)
            ^ (((h << 40) | (w << 16) | c) * 0x165667B19E3779F9)) & _MASK64


def check_labels(labels: np.ndarray, num_classes: int, *, where: str, first: int = 0) -> None:
    """Refuse labels outside ``0..num_classes-1`` (vectorised; ``first``: record number of
    ``labels[0]``), naming ``where`` and the first bad record."""
    if not len(labels):
        return
    lab = np.asarray(labels)
    if int(lab.min()) >= 0 and int(lab.max()) < num_classes:
        return
    bad = int(np.flatnonzero((lab < 0) | (lab >= num_classes))[0])
    raise FormatError(
        f"{where}: record {first + bad} has label {int(lab[bad])}, outside the {num_classes} classes "
        f"0..{num_classes - 1}: corrupt or edited index; run `fastload verify`"
    )


def file_sha256(path: Path, *, chunk: int = 8 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


def fsync_dir(path: Path) -> None:
    """Make a rename in ``path`` durable (a crash after it cannot undo it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - not all filesystems allow opening a directory
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class ShardWriter(ABC):
    """Writes one shard under a temporary name; ``finish()`` makes it final atomically.

    Records must be appended in order. Until ``finish`` returns, no file with the final name
    exists, so an interrupted writer never leaves a shard that looks complete.
    """

    def __init__(self, path: Path, *, pack_id: str | None = None):
        self.path = Path(path)
        self.tmp_path = self.path.with_name(self.path.name + ".tmp")
        self.pack_id = pack_id  # stored in the shard, so a reader can tell a shard of another pack
        self.labels: list[int] = []
        self.shapes: list[tuple[int, int, int]] = []
        self.paths: list[str] = []
        self.checksums: list[int] = []
        self.payload_bytes = 0

    def __len__(self) -> int:
        return len(self.labels)

    def append(self, payload: bytes, *, label: int, shape: tuple[int, int, int], path: str) -> None:
        i = len(self.labels)
        shape = tuple(int(s) for s in shape)
        self._put(i, payload)
        self.checksums.append(record_checksum(payload, label=label, record=i, shape=shape))
        self.labels.append(int(label))
        self.shapes.append(shape)
        self.paths.append(path)
        self.payload_bytes += len(payload)

    def index(self) -> ShardIndex:
        return ShardIndex(
            labels=np.asarray(self.labels, dtype=np.int64),
            shapes=np.asarray(self.shapes, dtype=np.int32).reshape(-1, 3),
            paths=StringTable.from_strings(self.paths),
            checksums=np.asarray(self.checksums, dtype=np.uint64),
        )

    def finish(self) -> ShardEntry:
        """Write the index, flush to disk, rename to the final name; returns the manifest entry."""
        self._finalize(self.index())
        sha = file_sha256(self.tmp_path)
        size = self.tmp_path.stat().st_size
        extra = self._entry_extra()
        os.replace(self.tmp_path, self.path)
        fsync_dir(self.path.parent)
        return ShardEntry(file=self.path.name, num_samples=len(self), bytes=size, sha256=sha, **extra)

    def _entry_extra(self) -> dict:
        """More fields of the shard's manifest entry (computed on ``tmp_path``)."""
        return {}

    @abstractmethod
    def _put(self, i: int, payload: bytes) -> None: ...

    @abstractmethod
    def _finalize(self, index: ShardIndex) -> None:
        """Store the index, fsync and close ``tmp_path``."""

    @abstractmethod
    def abort(self) -> None:
        """Close and delete the temporary files."""


class ShardReader(ABC):
    """Reads one shard. Opens nothing until the first read; reopens after fork; pickles small."""

    def __init__(self, path: Path, num_samples: int, *, pack_id: str | None = None, name: str | None = None):
        self.path = Path(path)
        self.num_samples = int(num_samples)
        self.pack_id = pack_id  # the manifest's; None (older packs): not checked
        self._name = name  # how errors name the shard when not by its path (a remote pack's URL)
        self._pid: int | None = None

    @property
    def name(self) -> str:
        return self._name or str(self.path)

    def __len__(self) -> int:
        return self.num_samples

    def _ensure_open(self) -> None:
        pid = os.getpid()
        if self._pid != pid:
            # A handle inherited through fork is not ours to use; forget it and open afresh.
            self._drop()
            self._open()
            self._pid = pid
            if self.pack_id is not None:
                self._check_pack_id()

    def _check_pack_id(self) -> None:
        found = self._stored_pack_id()
        if found != self.pack_id:
            self.close()
            raise FormatError(
                f"{self.name} belongs to another pack (repacked since this dataset was opened?): "
                f"open the dataset again (shard pack id {found!r}, manifest {self.pack_id!r})"
            )

    @abstractmethod
    def _stored_pack_id(self) -> str | None:
        """The pack id written into the open shard (None: none)."""

    def get(self, i: int):
        """The payload of record ``i`` as a zero-copy buffer, valid until ``close()``."""
        self._ensure_open()
        return self._get(i)

    def close(self) -> None:
        if self._pid == os.getpid():
            self._close()
        self._drop()
        self._pid = None

    def __getstate__(self):
        state = self.__dict__.copy()
        for k in self._handle_attrs():
            state[k] = None
        state["_pid"] = None
        return state

    def _drop(self) -> None:
        for k in self._handle_attrs():
            setattr(self, k, None)

    @abstractmethod
    def _handle_attrs(self) -> tuple[str, ...]: ...

    @abstractmethod
    def _open(self) -> None: ...

    @abstractmethod
    def _close(self) -> None: ...

    @abstractmethod
    def _get(self, i: int): ...

    @abstractmethod
    def read_index(self) -> ShardIndex:
        """Read the shard's index with a short-lived handle (leaves nothing open)."""

    @abstractmethod
    def iter_payloads(self):
        """Yield every payload in order (for verify); buffers valid only until the next one."""
