"""HDF5 shards: one .h5 file per shard.

All payloads of a shard are concatenated into one contiguous uint8 dataset ``data`` with an
``offsets`` (n+1) dataset beside it, plus ``labels``, ``shapes``, ``path_blob`` and
``path_offsets``. Because ``data`` is contiguous and uncompressed, a reader memory-maps it
at its file offset and slices records zero-copy, with no h5py call per record. h5py is
imported only here, so ``import fastload`` does not need it.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ..errors import FormatError, require
from ..schema import FORMAT_NAME, FORMAT_VERSION
from .base import ShardIndex, ShardReader, ShardWriter, StringTable


def _h5py():
    return require("h5py", "h5py", "HDF5 storage")


class HDF5ShardWriter(ShardWriter):
    """Streams payloads to a side file, then writes the HDF5 file in one go at ``finish``
    (so ``data`` can be one contiguous dataset of known size)."""

    def __init__(self, path: Path, *, shard_size: int = 1 << 30):
        super().__init__(path)
        _h5py()
        self._blob_path = self.path.with_name(self.path.name + ".blob.tmp")
        self.tmp_path.unlink(missing_ok=True)
        self._blob = open(self._blob_path, "wb")
        self._offsets = [0]

    def _put(self, i: int, payload: bytes) -> None:
        self._blob.write(payload)
        self._offsets.append(self._offsets[-1] + len(payload))

    def _finalize(self, index: ShardIndex) -> None:
        h5py = _h5py()
        self._blob.flush()
        os.fsync(self._blob.fileno())
        self._blob.close()
        total = self._offsets[-1]
        data = np.memmap(self._blob_path, dtype=np.uint8, mode="r", shape=(total,)) if total else np.zeros(0, np.uint8)
        try:
            # track_times=False and a fixed libver keep the file byte-identical across runs.
            with h5py.File(self.tmp_path, "w", libver=("earliest", "v110"), track_order=False) as f:
                f.attrs["format"] = FORMAT_NAME
                f.attrs["version"] = FORMAT_VERSION
                kw = dict(track_times=False)
                f.create_dataset("data", data=data, **kw)
                f.create_dataset("offsets", data=np.asarray(self._offsets, dtype=np.int64), **kw)
                f.create_dataset("labels", data=index.labels, **kw)
                f.create_dataset("shapes", data=index.shapes, **kw)
                f.create_dataset("path_blob", data=index.paths.blob, **kw)
                f.create_dataset("path_offsets", data=index.paths.offsets, **kw)
            with open(self.tmp_path, "rb+") as fh:
                os.fsync(fh.fileno())
        finally:
            del data
            self._blob_path.unlink(missing_ok=True)

    def abort(self) -> None:
        if not self._blob.closed:
            self._blob.close()
        self._blob_path.unlink(missing_ok=True)
        self.tmp_path.unlink(missing_ok=True)


def _open_file(path: Path):
    h5py = _h5py()
    if not path.exists():
        raise FormatError(f"{path}: shard file missing")
    try:
        f = h5py.File(path, "r")
    except OSError as exc:
        raise FormatError(f"{path}: not a readable HDF5 shard ({exc})") from None
    if f.attrs.get("format") != FORMAT_NAME:
        f.close()
        raise FormatError(f"{path}: not a fastload HDF5 shard")
    if int(f.attrs.get("version", 0)) > FORMAT_VERSION:
        f.close()
        raise FormatError(f"{path}: shard format version is newer than this fastload")
    return f


class HDF5ShardReader(ShardReader):
    def __init__(self, path: Path, num_samples: int):
        super().__init__(path, num_samples)
        self._mm = None
        self._offsets = None
        self._file = None
        self._data = None

    def _handle_attrs(self) -> tuple[str, ...]:
        return ("_mm", "_offsets", "_file", "_data")

    def _open(self) -> None:
        f = _open_file(self.path)
        try:
            ds = f["data"]
            self._offsets = f["offsets"][:]
            offset = ds.id.get_offset()
            contiguous = ds.chunks is None and ds.compression is None
        except (KeyError, OSError) as exc:
            f.close()
            raise FormatError(f"{self.path}: corrupt HDF5 shard ({exc})") from None
        if len(self._offsets) != self.num_samples + 1:
            f.close()
            raise FormatError(f"{self.path}: offsets table does not match the manifest")
        if contiguous and offset is not None and ds.shape[0] > 0:
            # Fast path: map the contiguous dataset once; every record is a slice of it.
            self._mm = np.memmap(self.path, dtype=np.uint8, mode="r", offset=offset, shape=(ds.shape[0],))
            f.close()
        else:  # chunked/compressed data written by another tool: read through h5py
            self._file, self._data = f, ds

    def _close(self) -> None:
        if self._file is not None:
            self._file.close()

    def _get(self, i: int):
        if not 0 <= i < self.num_samples:
            raise IndexError(f"{self.path}: record {i} out of range 0..{self.num_samples - 1}")
        a, b = int(self._offsets[i]), int(self._offsets[i + 1])
        if self._mm is not None:
            return self._mm[a:b]
        return self._data[a:b]

    def read_index(self) -> ShardIndex:
        f = _open_file(self.path)
        try:
            index = ShardIndex(
                labels=f["labels"][:].astype(np.int64, copy=False),
                shapes=f["shapes"][:].astype(np.int32, copy=False).reshape(-1, 3),
                paths=StringTable(f["path_blob"][:], f["path_offsets"][:]),
            )
        except (KeyError, OSError, ValueError) as exc:
            raise FormatError(f"{self.path}: corrupt shard index ({exc})") from None
        finally:
            f.close()
        if len(index) != self.num_samples:
            raise FormatError(f"{self.path}: index has {len(index)} records, manifest says {self.num_samples}")
        return index

    def iter_payloads(self):
        reader = HDF5ShardReader(self.path, self.num_samples)
        try:
            for i in range(self.num_samples):
                yield reader.get(i)
        finally:
            reader.close()
