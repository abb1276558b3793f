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
import xxhash

from ..errors import FormatError, require
from ..schema import FORMAT_NAME, FORMAT_VERSION
from .base import ShardIndex, ShardReader, ShardWriter, StringTable


def _h5py():
    return require("h5py", "h5py", "HDF5 storage")


class HDF5ShardWriter(ShardWriter):
    """Streams payloads to a side file, then writes the HDF5 file in one go at ``finish``
    (so ``data`` can be one contiguous dataset of known size)."""

    def __init__(self, path: Path, *, shard_size: int = 1 << 30, pack_id: str | None = None):
        super().__init__(path, pack_id=pack_id)
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
            # The 512-byte user block (HDF5 skips it) carries the pack id where a reader finds it
            # without the HDF5 library: a shard of another pack is named as such before anything.
            with h5py.File(self.tmp_path, "w", libver=("earliest", "v110"), track_order=False,
                           userblock_size=_USERBLOCK) as f:
                f.attrs["format"] = FORMAT_NAME
                f.attrs["version"] = FORMAT_VERSION
                if self.pack_id is not None:
                    f.attrs["pack_id"] = self.pack_id
                kw = dict(track_times=False)
                f.create_dataset("data", data=data, **kw)
                f.create_dataset("offsets", data=np.asarray(self._offsets, dtype=np.int64), **kw)
                f.create_dataset("labels", data=index.labels, **kw)
                f.create_dataset("shapes", data=index.shapes, **kw)
                f.create_dataset("path_blob", data=index.paths.blob, **kw)
                f.create_dataset("path_offsets", data=index.paths.offsets, **kw)
                if index.checksums is not None:
                    f.create_dataset("checksums", data=index.checksums, **kw)
            with open(self.tmp_path, "rb+") as fh:
                if self.pack_id is not None:
                    fh.write(_USERBLOCK_MAGIC + self.pack_id.encode("ascii"))
                os.fsync(fh.fileno())
        finally:
            del data
            self._blob_path.unlink(missing_ok=True)

    def _entry_extra(self) -> dict:
        h5py = _h5py()
        with h5py.File(self.tmp_path, "r") as f:
            ds = f["data"]
            offset, total = ds.id.get_offset(), int(ds.shape[0])
        if offset is None:  # no records: no data block, all of the file is metadata
            offset, total = self.tmp_path.stat().st_size, 0
        span = (int(offset), total)
        return {"data_span": span, "meta_xxh3": metadata_xxh3(self.tmp_path, span)}

    def abort(self) -> None:
        if not self._blob.closed:
            self._blob.close()
        self._blob_path.unlink(missing_ok=True)
        self.tmp_path.unlink(missing_ok=True)


# What h5py raises on a damaged file varies with the damage (OSError, KeyError, TypeError,
# ValueError, RuntimeError, IndexError...); every one becomes a FormatError naming the shard.
_H5_ERRORS = (OSError, KeyError, TypeError, ValueError, RuntimeError, IndexError, AttributeError, UnicodeDecodeError)


def _damaged(where: str, exc: BaseException) -> FormatError:
    return FormatError(f"{where}: corrupt HDF5 shard ({type(exc).__name__}: {exc}); run `fastload verify`")


def metadata_xxh3(path: Path, span: tuple[int, int]) -> str:
    """XXH3-64 (hex) of every byte of ``path`` outside ``span`` = (offset, bytes) of the records'
    data: the superblock, object headers, B-trees, heaps and the small index datasets."""
    offset, total = span
    h = xxhash.xxh3_64()
    with open(path, "rb") as f:
        head = f.read(offset)
        f.seek(offset + total)
        tail = f.read()
    if len(head) != offset:
        return "short file"
    h.update(head)
    h.update(tail)
    return h.hexdigest()


_USERBLOCK = 512
_USERBLOCK_MAGIC = b"fastload pack id "


def _userblock_pack_id(path: Path) -> str | None:
    """The pack id in the file's user block (None: none there, as in older packs)."""
    with open(path, "rb") as f:
        head = f.read(_USERBLOCK)
    if not head.startswith(_USERBLOCK_MAGIC):
        return None
    return head[len(_USERBLOCK_MAGIC) :].split(b"\0", 1)[0].decode("ascii", "replace")


def _check_metadata(path: Path, where: str, check: tuple[tuple[int, int], str] | None) -> None:
    """Refuse a shard whose metadata is not what was written, before h5py reads any of it: the
    HDF5 library can hang (a loop in its attribute code) or crash on damaged metadata."""
    if check is None:
        return
    span, expected = check
    try:
        found = metadata_xxh3(path, span)
    except OSError as exc:
        raise FormatError(f"{where}: unreadable HDF5 shard ({exc}); run `fastload verify`") from None
    if found != expected:
        raise FormatError(f"{where}: corrupt HDF5 shard (its metadata checksum does not match the manifest); "
                          "run `fastload verify`")


def _open_file(path: Path, where: str | None = None, check: tuple[tuple[int, int], str] | None = None):
    where = where or str(path)
    h5py = _h5py()
    if not path.exists():
        raise FormatError(f"{where}: shard file missing")
    _check_metadata(path, where, check)
    try:
        f = h5py.File(path, "r")
    except _H5_ERRORS as exc:
        raise FormatError(f"{where}: not a readable HDF5 shard ({exc}); run `fastload verify`") from None
    try:
        fmt, version = f.attrs.get("format"), int(f.attrs.get("version", 0))
    except _H5_ERRORS as exc:
        f.close()
        raise _damaged(where, exc) from None
    if fmt != FORMAT_NAME:
        f.close()
        raise FormatError(f"{where}: not a fastload HDF5 shard")
    if version > FORMAT_VERSION:
        f.close()
        raise FormatError(f"{where}: shard format version is newer than this fastload")
    return f


class HDF5ShardReader(ShardReader):
    def __init__(self, path: Path, num_samples: int, *, pack_id: str | None = None, name: str | None = None,
                 check: tuple[tuple[int, int], str] | None = None):
        super().__init__(path, num_samples, pack_id=pack_id, name=name)
        self.check = check  # (data span, metadata XXH3) from the manifest; None: older pack, unchecked
        self._mm = None
        self._offsets = None
        self._file = None
        self._data = None
        self._stored_id = None

    def _handle_attrs(self) -> tuple[str, ...]:
        return ("_mm", "_offsets", "_file", "_data", "_stored_id")

    def _open(self) -> None:
        if self.pack_id is not None:
            try:
                self._stored_id = _userblock_pack_id(self.path)
            except OSError as exc:
                raise FormatError(f"{self.name}: unreadable HDF5 shard ({exc}); run `fastload verify`") from None
            if self._stored_id != self.pack_id:
                self._check_pack_id()
        f = _open_file(self.path, self.name, self.check)
        try:
            ds = f["data"]
            offsets = np.asarray(f["offsets"][:], dtype=np.int64)
            offset = ds.id.get_offset()
            contiguous = ds.chunks is None and ds.compression is None
            total = int(ds.shape[0])
        except _H5_ERRORS as exc:
            f.close()
            raise _damaged(self.name, exc) from None
        if len(offsets) != self.num_samples + 1:
            f.close()
            raise FormatError(f"{self.name}: offsets table does not match the manifest; run `fastload verify`")
        if len(offsets) and (offsets[0] != 0 or offsets[-1] != total or np.any(np.diff(offsets) < 0)):
            f.close()
            raise FormatError(f"{self.name}: corrupt HDF5 shard (record offsets out of order or past the data); "
                              "run `fastload verify`")
        self._offsets = offsets
        if contiguous and offset is not None and total > 0:
            # Fast path: map the contiguous dataset once; every record is a slice of it. The
            # dataset must lie inside the file: a map past its end would fault (SIGBUS) on read.
            f.close()
            if offset < 0 or offset + total > self.path.stat().st_size:
                raise FormatError(f"{self.name}: corrupt HDF5 shard (data lies past the end of the file); "
                                  "run `fastload verify`")
            self._mm = np.memmap(self.path, dtype=np.uint8, mode="r", offset=offset, shape=(total,))
        else:  # chunked/compressed data written by another tool: read through h5py
            self._file, self._data = f, ds

    def _stored_pack_id(self) -> str | None:
        return self._stored_id

    def _close(self) -> None:
        if self._file is not None:
            self._file.close()

    def _get(self, i: int):
        if not 0 <= i < self.num_samples:
            raise IndexError(f"{self.name}: record {i} out of range 0..{self.num_samples - 1}")
        a, b = int(self._offsets[i]), int(self._offsets[i + 1])
        if self._mm is not None:
            return self._mm[a:b]
        try:
            return self._data[a:b]
        except _H5_ERRORS as exc:
            raise _damaged(self.name, exc) from None

    def read_index(self) -> ShardIndex:
        f = _open_file(self.path, self.name, self.check)
        try:
            sums = f["checksums"][:].astype(np.uint64, copy=False) if "checksums" in f else None
            index = ShardIndex(
                labels=f["labels"][:].astype(np.int64, copy=False),
                shapes=f["shapes"][:].astype(np.int32, copy=False).reshape(-1, 3),
                paths=StringTable(f["path_blob"][:], f["path_offsets"][:]),
                checksums=sums,
            )
        except _H5_ERRORS as exc:
            raise FormatError(f"{self.name}: corrupt shard index ({type(exc).__name__}: {exc}); "
                              "run `fastload verify`") from None
        finally:
            f.close()
        if len(index) != self.num_samples or (index.checksums is not None and len(index.checksums) != len(index)):
            raise FormatError(f"{self.name}: index has {len(index)} records, manifest says {self.num_samples}")
        return index

    def iter_payloads(self):
        reader = HDF5ShardReader(self.path, self.num_samples, name=self._name, check=self.check)
        try:
            for i in range(self.num_samples):
                yield reader.get(i)
        finally:
            reader.close()
