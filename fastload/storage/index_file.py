"""The pack index file: every record's label, stored shape and source path in one file.

Written by the packer next to the shards (one per ``--part``) and listed in the manifest with
its size and SHA-256, so a reader gets a pack's whole index from one small file instead of
opening every shard: that is what lets a pack in object storage be opened without downloading
its shards, and the file is memory-mapped, so every process on a node shares one copy.

Layout (little-endian; every section starts at a multiple of 64 bytes)::

    b"FLINDEX1"  u64 header length  JSON header {"num_samples", "sections": {name: [offset, bytes]}}
    labels       int64[n]
    shapes       int32[n, 3]        decoded (H, W, C)
    path_offsets int64[n + 1]       into path_blob
    path_blob    uint8[...]         UTF-8 source paths, relative to the pack's source folder
    checksums    uint64[n]          record_checksum of each record (version 2)
    record_offsets uint64[n]        LMDB packs: where each record's bytes start in its shard file
    record_sizes   uint32[n]        LMDB packs: each record's size in bytes
    pack_id_at     uint64[shards, 2] LMDB packs: (offset, size) of each shard's pack-id value

The JSON header of version 2 also holds "version" and "pack_id". Version 1 files (no "version"
key) have no checksums section and no pack id; they still read, without the read-time check.
The magic stays ``FLINDEX1`` so the change is additive: an older fastload skips the section.
The three location sections (issue 16) are additive too: with them a reader slices records
from the shared map of this file instead of walking each shard's B-tree into private arrays;
without them (older packs, HDF5) it walks as before.

Packs made before this file existed have none; readers then build the index from the shards.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

import numpy as np

from ..errors import FormatError
from .base import ShardIndex, StringTable

__all__ = ["INDEX_SUFFIX", "index_name", "read_index_file", "write_index_file"]

MAGIC = b"FLINDEX1"
INDEX_VERSION = 2
INDEX_SUFFIX = ".fli"
_ALIGN = 64
_SECTIONS = (("labels", np.int64, 1), ("shapes", np.int32, 3), ("path_offsets", np.int64, 1), ("path_blob", np.uint8, 1))
_OPTIONAL = (("checksums", np.uint64), ("record_offsets", np.uint64), ("record_sizes", np.uint32),
             ("pack_id_at", np.uint64))


def index_name(prefix: str) -> str:
    """File name of a part's index (``prefix`` is the part's file-name prefix, '' for one part)."""
    return f"{prefix}index{INDEX_SUFFIX}"


def _pad(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def write_index_file(path: Path, index: ShardIndex, *, pack_id: str | None = None) -> tuple[int, str]:
    """Write ``index`` to ``path`` atomically (temp name, fsync, rename); returns (bytes, SHA-256)."""
    arrays = {
        "labels": np.ascontiguousarray(index.labels, dtype="<i8"),
        "shapes": np.ascontiguousarray(index.shapes, dtype="<i4").reshape(-1, 3),
        "path_offsets": np.ascontiguousarray(index.paths.offsets, dtype="<i8"),
        "path_blob": np.ascontiguousarray(index.paths.blob, dtype=np.uint8),
    }
    n = len(arrays["labels"])
    if index.checksums is not None:
        arrays["checksums"] = np.ascontiguousarray(index.checksums, dtype="<u8")
        if len(arrays["checksums"]) != n:
            raise ValueError("index arrays disagree on the number of records")
    if index.record_offsets is not None:
        arrays["record_offsets"] = np.ascontiguousarray(index.record_offsets, dtype="<u8")
        arrays["record_sizes"] = np.ascontiguousarray(index.record_sizes, dtype="<u4")
        arrays["pack_id_at"] = np.ascontiguousarray(index.pack_id_at, dtype="<u8").reshape(-1, 2)
        if len(arrays["record_offsets"]) != n or len(arrays["record_sizes"]) != n:
            raise ValueError("index arrays disagree on the number of records")
    if len(arrays["shapes"]) != n or len(arrays["path_offsets"]) != n + 1:
        raise ValueError("index arrays disagree on the number of records")
    sections, offset = {}, 0
    # The header's length depends on the offsets, which depend on the header's length: reserve
    # a generous fixed-size header block instead.
    header_block = _pad(512 + 32 * len(arrays))
    offset = header_block
    for name, a in arrays.items():
        sections[name] = [offset, int(a.nbytes)]
        offset = _pad(offset + a.nbytes)
    head_doc: dict = {"num_samples": n, "sections": sections, "version": INDEX_VERSION}
    if pack_id is not None:
        head_doc["pack_id"] = pack_id
    header = json.dumps(head_doc).encode()
    if 16 + len(header) > header_block:  # pragma: no cover - the header is ~200 bytes
        raise ValueError("index header too large")
    tmp = path.with_name(path.name + ".tmp")
    digest = hashlib.sha256()
    with open(tmp, "wb") as f:
        def put(b: bytes) -> None:
            f.write(b)
            digest.update(b)

        head = MAGIC + struct.pack("<Q", len(header)) + header
        put(head + bytes(header_block - len(head)))
        pos = header_block
        for name, a in arrays.items():
            start, size = sections[name]
            put(bytes(start - pos))
            put(a.tobytes())
            pos = start + size
        put(bytes(_pad(pos) - pos))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return _pad(pos), digest.hexdigest()


def read_index_file(path: Path, *, num_samples: int | None = None, pack_id: str | None = None) -> ShardIndex:
    """The index in ``path``, memory-mapped read-only (nothing is copied; pages are shared by
    every process that maps the file). ``num_samples``: what the manifest says, checked;
    ``pack_id``: the manifest's, checked when given."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            head = f.read(16)
            if len(head) < 16 or head[:8] != MAGIC:
                raise FormatError(f"{path}: not a fastload index file (run `fastload verify` on the pack)")
            (hlen,) = struct.unpack("<Q", head[8:])
            if hlen > 1 << 20:
                raise ValueError(f"header length {hlen}")
            header = json.loads(f.read(hlen))
            if not isinstance(header, dict):
                raise ValueError("header is not a JSON object")
        size = path.stat().st_size
    except FileNotFoundError:
        raise FormatError(f"{path}: index file listed in the manifest is missing") from None
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise FormatError(f"{path}: unreadable index file ({exc})") from None
    try:
        n = int(header["num_samples"])
        version = int(header.get("version", 1))
        sections = {k: (int(v[0]), int(v[1])) for k, v in header["sections"].items()}
        found_id = header.get("pack_id")
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as exc:
        raise FormatError(f"{path}: damaged index file ({exc}); run `fastload verify` on the pack") from None
    if version > INDEX_VERSION:
        raise FormatError(f"{path}: index file version {version} is newer than this fastload; upgrade fastload")
    if pack_id is not None and found_id != pack_id:
        raise FormatError(f"{path} belongs to another pack (repacked since this dataset was opened?): "
                          "open the dataset again")
    try:
        views = {}
        mm = np.memmap(path, dtype=np.uint8, mode="r") if size else np.zeros(0, np.uint8)
        locs = [k for k in ("record_offsets", "record_sizes", "pack_id_at") if k in sections]
        if locs and len(locs) != 3:
            raise ValueError("record location sections incomplete")
        wanted = _SECTIONS + tuple((name, dtype, 1) for name, dtype in _OPTIONAL if name in sections)
        for name, dtype, width in wanted:
            start, nbytes = sections[name]
            if (start < 0 or nbytes < 0 or start + nbytes > size or start % 8 or nbytes % np.dtype(dtype).itemsize
                    or (name == "pack_id_at" and nbytes % 16)):
                raise ValueError(f"section {name} lies outside the file")
            views[name] = mm[start : start + nbytes].view(np.dtype(dtype).newbyteorder("<"))
    except (KeyError, TypeError, ValueError) as exc:
        raise FormatError(f"{path}: damaged index file ({exc}); run `fastload verify` on the pack") from None
    if len(views["shapes"]) % 3:
        raise FormatError(f"{path}: damaged index file (shapes section size); run `fastload verify` on the pack")
    labels, shapes = views["labels"], views["shapes"].reshape(-1, 3)
    offsets, blob = views["path_offsets"], views["path_blob"]
    sums = views.get("checksums")
    rec_off, rec_size = views.get("record_offsets"), views.get("record_sizes")
    if (len(labels) != n or len(shapes) != n or len(offsets) != n + 1 or (n and int(offsets[-1]) != len(blob))
            or (sums is not None and len(sums) != n)
            or (rec_off is not None and (len(rec_off) != n or len(rec_size) != n))):
        raise FormatError(f"{path}: damaged index file (section sizes disagree); run `fastload verify` on the pack")
    if n and (int(offsets[0]) != 0 or not _ascending(offsets)):
        raise FormatError(f"{path}: damaged index file (path offsets out of order); run `fastload verify` on the pack")
    if num_samples is not None and n != num_samples:
        raise FormatError(f"{path}: index holds {n} records, the manifest says {num_samples}")
    id_at = views.get("pack_id_at")
    return ShardIndex(labels, shapes, StringTable(blob, offsets), sums, record_offsets=rec_off,
                      record_sizes=rec_size, pack_id_at=None if id_at is None else id_at.reshape(-1, 2))


def _ascending(a: np.ndarray, *, chunk: int = 1 << 20) -> bool:
    """Whether ``a`` never decreases, checked a chunk at a time: a temporary of the whole
    array (``np.diff``) would cost every process that opens a 10M-record pack ~90 MB."""
    for lo in range(0, len(a) - 1, chunk):
        hi = min(lo + chunk, len(a) - 1)
        if np.any(a[lo + 1 : hi + 1] < a[lo:hi]):
            return False
    return True
