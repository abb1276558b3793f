"""A pack's index (labels, shapes, paths, checksums) shared by every process on a node.

Each part's ``index.fli`` is memory-mapped read-only, so the pages live once in the page
cache whatever the number of processes or how they were started: fork children inherit the
mappings, and a pickled :class:`PackIndex` carries only the files' paths (spawned workers and
DDP ranks map them again on first use). A pack of several parts is read through one map per
part, routed by record number (:class:`PartedArray`, :class:`PartedStrings`): nothing that
grows with the number of records is copied into a process. Paths are decoded one at a time,
when asked for.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from .base import ShardIndex, StringTable
from .index_file import read_index_file

__all__ = ["PackIndex", "PartedArray", "PartedStrings", "ShardLocations"]


def _part_of(starts: np.ndarray, i):
    """Part number(s) holding global record(s) ``i`` (``starts``: first record of each part, then n)."""
    return np.searchsorted(starts, i, side="right") - 1


class PartedArray:
    """Read-only concatenation of per-part arrays (memmaps), without copying them.

    Indexing by an int, a slice, an int/bool array (optionally with more axes: ``a[idx, :2]``)
    copies out only what was asked for. ``np.asarray`` concatenates the whole array on demand
    (for code that wants one; it is a private copy of size N)."""

    __slots__ = ("_parts", "_starts")

    def __init__(self, parts: Sequence[np.ndarray], starts: np.ndarray):
        self._parts = list(parts)
        self._starts = np.asarray(starts, dtype=np.int64)

    @property
    def parts(self) -> list[np.ndarray]:
        """The per-part arrays (memory maps of the parts' index files)."""
        return self._parts

    @property
    def dtype(self) -> np.dtype:
        return self._parts[0].dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self), *self._parts[0].shape[1:])

    @property
    def ndim(self) -> int:
        return self._parts[0].ndim

    def __len__(self) -> int:
        return int(self._starts[-1])

    def __getitem__(self, key):
        rest: tuple = ()
        if isinstance(key, tuple):
            key, rest = key[0], key[1:]
        n = len(self)
        if isinstance(key, (int, np.integer)):
            i = int(key)
            if not -n <= i < n:
                raise IndexError(f"index {i} out of range for {n} records")
            i %= n
            k = int(_part_of(self._starts, i))
            return self._parts[k][(i - int(self._starts[k]), *rest)]
        if isinstance(key, slice):
            start, stop, step = key.indices(n)
            if step == 1:
                pieces = []
                for k, part in enumerate(self._parts):
                    lo, hi = max(start, int(self._starts[k])), min(stop, int(self._starts[k + 1]))
                    if lo < hi:
                        pieces.append(part[lo - int(self._starts[k]) : hi - int(self._starts[k])])
                out = np.concatenate(pieces) if pieces else np.empty((0, *self.shape[1:]), self.dtype)
                return out[(slice(None), *rest)] if rest else out
            idx = np.arange(start, stop, step, dtype=np.int64)
        else:
            idx = np.asarray(key)
            idx = np.flatnonzero(idx) if idx.dtype == bool else idx.astype(np.int64, copy=False)
            if idx.size and (idx.min() < -n or idx.max() >= n):
                raise IndexError(f"index out of range for {n} records")
            idx = idx % n if n else idx
        out = np.empty((*idx.shape, *self.shape[1:]), self.dtype)
        parts = _part_of(self._starts, idx)
        for k in np.unique(parts).tolist():
            sel = parts == k
            out[sel] = self._parts[k][idx[sel] - int(self._starts[k])]
        return out[(Ellipsis, *rest)] if rest else out

    def __iter__(self) -> Iterator:
        for part in self._parts:
            yield from part

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        out = np.concatenate(self._parts) if self._parts else np.empty(self.shape, self.dtype)
        return out if dtype is None else out.astype(dtype, copy=False)

    def astype(self, dtype, copy: bool = True) -> np.ndarray:
        return np.asarray(self).astype(dtype, copy=False)

    def tolist(self) -> list:
        return np.asarray(self).tolist()

    def min(self, axis=None):
        """Minimum (per part, then across parts: nothing of size N is allocated)."""
        return np.min(np.stack([p.min(axis=axis) for p in self._parts if len(p)]), axis=0)

    def max(self, axis=None):
        return np.max(np.stack([p.max(axis=axis) for p in self._parts if len(p)]), axis=0)

    def __eq__(self, other) -> Any:  # elementwise, as on an ndarray
        return np.asarray(self) == other

    def __ne__(self, other) -> Any:
        return np.asarray(self) != other

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"<PartedArray {self.shape} {self.dtype} over {len(self._parts)} parts>"


class PartedStrings:
    """Read-only concatenation of per-part :class:`StringTable` (index-file path sections):
    ``t[i]`` decodes one path. ``offsets``/``blob`` build the joined table on demand."""

    __slots__ = ("_parts", "_starts")

    def __init__(self, parts: Sequence[StringTable], starts: np.ndarray):
        self._parts = list(parts)
        self._starts = np.asarray(starts, dtype=np.int64)

    def __len__(self) -> int:
        return int(self._starts[-1])

    def __getitem__(self, i: int) -> str:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(i)
        i = int(i) % n
        k = int(_part_of(self._starts, i))
        return self._parts[k][i - int(self._starts[k])]

    def __iter__(self) -> Iterator[str]:
        for part in self._parts:
            yield from part

    def joined(self) -> StringTable:
        """One StringTable of every part (a private copy of size N: for checks, not loaders)."""
        return StringTable.concat(self._parts)

    @property
    def offsets(self) -> np.ndarray:
        return self.joined().offsets

    @property
    def blob(self) -> np.ndarray:
        return self.joined().blob

    def __eq__(self, other) -> bool:
        return len(self) == len(other) and all(a == b for a, b in zip(self, other))

    __hash__ = None  # type: ignore[assignment]


class PackIndex:
    """Every record's label, shape, path (and checksum) of a pack, mapped from its parts'
    index files on first use; what :attr:`PackReader.index <fastload.storage.PackReader.index>` is.

    Has the fields of a :class:`ShardIndex`: for a one-part pack they are the memory maps
    themselves; for several parts, :class:`PartedArray`/:class:`PartedStrings` over the
    parts' maps. Pickles as the files' paths only. ``files``: (index file, records, pack id
    or None) per part, as the manifests list them.
    """

    def __init__(self, files: Sequence[tuple[Path, int, str | None]], sha256: Sequence[str | None] = ()):
        self.files = tuple((Path(p), int(n), pack_id) for p, n, pack_id in files)
        # The manifests' SHA-256 of each file, checked before the first path is decoded: labels,
        # shapes and checksums are covered by the record checksums, the source paths only by this.
        self.sha256 = tuple(sha256)
        self._paths_checked = not any(self.sha256)
        starts = np.zeros(len(self.files) + 1, dtype=np.int64)
        np.cumsum([f[1] for f in self.files], out=starts[1:])
        self.starts = starts
        self._fields: dict[str, Any] | None = None

    def __len__(self) -> int:
        return int(self.starts[-1])

    def _load(self) -> dict[str, Any]:
        if self._fields is None:
            parts = [self.part(m) for m in range(len(self.files))]
            if len(parts) == 1:
                one = parts[0]
                fields = {"labels": one.labels, "shapes": one.shapes, "paths": one.paths,
                          "checksums": one.checksums}
            elif not parts:
                empty = ShardIndex.concat([])
                fields = {f: getattr(empty, f) for f in ("labels", "shapes", "paths", "checksums")}
            else:
                sums = [p.checksums for p in parts]
                fields = {
                    "labels": PartedArray([p.labels for p in parts], self.starts),
                    "shapes": PartedArray([p.shapes for p in parts], self.starts),
                    "paths": PartedStrings([p.paths for p in parts], self.starts),
                    "checksums": None if any(s is None for s in sums) else PartedArray(sums, self.starts),
                }
            self._fields = fields
        return self._fields

    def part(self, m: int) -> ShardIndex:
        """Part ``m``'s own index (memory maps of its file; records ``starts[m]:starts[m + 1]``):
        for checks that walk a pack part by part (verify) without joining the parts. Mapped
        and validated once per process (every shard reader of the part asks for it)."""
        cache = self.__dict__.setdefault("_part_cache", {})
        if m not in cache:
            path, n, pid = self.files[m]
            cache[m] = read_index_file(path, num_samples=n, pack_id=pid)
        return cache[m]

    def shard_locations(self, m: int, first: int, count: int, shard: int):
        """(offsets, sizes, (pack-id offset, size)) of records ``first:first + count`` of part
        ``m`` (shard number ``shard`` of the part), views of the shared map; None when the
        part's index file has no record locations (older packs, HDF5)."""
        part = self.part(m)
        if part.record_offsets is None or part.pack_id_at is None:
            return None
        if not (0 <= first and first + count <= len(part) and 0 <= shard < len(part.pack_id_at)):
            return None  # the index does not describe this shard: the reader walks it instead
        at = part.pack_id_at[shard]
        return (part.record_offsets[first : first + count], part.record_sizes[first : first + count],
                (int(at[0]), int(at[1])))

    def open(self) -> PackIndex:
        """Map the index files now (so a damaged one is reported at open, not at first read)."""
        self._load()
        return self

    @property
    def labels(self) -> np.ndarray | PartedArray:
        """int64 label of every record."""
        return self._load()["labels"]

    @property
    def shapes(self) -> np.ndarray | PartedArray:
        """int32 (N, 3) stored (H, W, C) of every record."""
        return self._load()["shapes"]

    @property
    def paths(self) -> StringTable | PartedStrings:
        """Source path of every record, relative to the pack's source folder (decoded per item).
        The first use in a process hashes the index files (~60 ms per 1M records, warm cache)."""
        if not self._paths_checked:
            self._check_paths()
        return self._load()["paths"]

    def _check_paths(self) -> None:
        from ..errors import FormatError
        from .base import file_sha256

        if getattr(self, "_paths_bad", None):
            raise FormatError(self._paths_bad)  # once found, not hashed again (error messages ask often)
        for (path, _, _), want in zip(self.files, self.sha256):
            if want and file_sha256(path) != want:
                self._paths_bad = (f"{path}: index file damaged (SHA-256 differs from the manifest's): its "
                                   "source paths cannot be trusted; run `fastload verify` on the pack, and repack")
                raise FormatError(self._paths_bad)
        self._paths_checked = True

    @property
    def checksums(self) -> np.ndarray | PartedArray | None:
        """uint64 record checksum of every record, None when the pack's index files have none."""
        return self._load()["checksums"]

    def __getstate__(self) -> dict:
        # Maps are not pickled (a memmap pickles as a full copy): the receiver maps the files again.
        return {"files": self.files, "starts": self.starts, "_fields": None, "_part_cache": {},
                "sha256": getattr(self, "sha256", ()), "_paths_checked": getattr(self, "_paths_checked", True)}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"<PackIndex of {len(self)} records in {len(self.files)} index file(s)>"


class ShardLocations:
    """Where one shard's records lie, as its pack's index file records them: what an LMDB shard
    reader calls at open instead of walking the shard. Pickles as the :class:`PackIndex` (its
    files' paths, shared with the pack reader's) and four numbers."""

    __slots__ = ("index", "part", "first", "count", "shard")

    def __init__(self, index: PackIndex, part: int, first: int, count: int, shard: int):
        self.index, self.part, self.first, self.count, self.shard = index, part, first, count, shard

    def __call__(self):
        """(offsets, sizes, pack-id place) or None (no locations: walk the shard)."""
        return self.index.shard_locations(self.part, self.first, self.count, self.shard)

    def __getstate__(self):
        return (self.index, self.part, self.first, self.count, self.shard)

    def __setstate__(self, state) -> None:
        self.index, self.part, self.first, self.count, self.shard = state
