"""LMDB shards: one single-file LMDB environment per shard.

Records are keyed by their 8-byte big-endian index (so keys sort in record order and
``append=True`` writes are cheap); the index lives under keys starting with 0xFF, after
every record key. Readers open with ``readonly=True, lock=False, readahead=False,
meminit=False`` and keep one read transaction per process, so ``get`` returns a zero-copy
memoryview into the memory map.
"""

from __future__ import annotations

import contextlib
import io
import mmap
from dataclasses import dataclass
from typing import Any
import os
import struct
import threading
from pathlib import Path

import lmdb
import numpy as np

from ..errors import FormatError
from ..schema import FORMAT_NAME, FORMAT_VERSION
from .base import ShardIndex, ShardReader, ShardWriter, StringTable

_META = b"\xff"
_KEY = struct.Struct(">Q")
_FLUSH_RECORDS = 256
_FLUSH_BYTES = 64 << 20


def _key(i: int) -> bytes:
    return _KEY.pack(i)


def _npy(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(a), allow_pickle=False)
    return buf.getvalue()


def _from_npy(b) -> np.ndarray:
    """The array ``_npy`` stored, as a read-only view of ``b`` (np.load would copy it again)."""
    from numpy.lib import format as npy

    b = bytes(b)
    f = io.BytesIO(b)  # shares b's buffer
    version = npy.read_magic(f)
    if version not in ((1, 0), (2, 0)):
        return np.load(io.BytesIO(b), allow_pickle=False)
    read = npy.read_array_header_1_0 if version == (1, 0) else npy.read_array_header_2_0
    shape, fortran, dtype = read(f)
    if dtype.hasobject:
        raise ValueError("object arrays are not allowed in a fastload index")
    a = np.frombuffer(b, dtype=dtype, count=int(np.prod(shape)), offset=f.tell())
    return a.reshape(shape, order="F" if fortran else "C")


class LMDBShardWriter(ShardWriter):
    """Buffers records and commits them in fixed-size batches (fixed, so output is byte-identical
    however the records were produced). The map grows by doubling on MapFullError."""

    def __init__(self, path: Path, *, shard_size: int = 1 << 30, pack_id: str | None = None):
        super().__init__(path, pack_id=pack_id)
        self._discard_tmp()
        self._map_size = max(64 << 20, int(shard_size * 1.25))
        self._env = lmdb.open(
            str(self.tmp_path), subdir=False, map_size=self._map_size, meminit=True,
            sync=False, metasync=False, max_dbs=0, readahead=False,
        )
        self._pending: list[tuple[bytes, bytes]] = []
        self._pending_bytes = 0

    def _discard_tmp(self) -> None:
        for p in (self.tmp_path, Path(str(self.tmp_path) + "-lock")):
            p.unlink(missing_ok=True)

    def _put(self, i: int, payload: bytes) -> None:
        self._pending.append((_key(i), bytes(payload)))
        self._pending_bytes += len(payload)
        if len(self._pending) >= _FLUSH_RECORDS or self._pending_bytes >= _FLUSH_BYTES:
            self._flush()

    def _flush(self, extra: list[tuple[bytes, bytes]] = ()) -> None:
        items = self._pending + list(extra)
        if not items:
            return
        while True:
            try:
                with self._env.begin(write=True) as txn:
                    with txn.cursor() as cur:
                        for k, v in items:
                            if not cur.put(k, v, append=True):
                                raise FormatError(f"{self.tmp_path}: duplicate or out-of-order key")
                break
            except lmdb.MapFullError:
                self._map_size *= 2
                self._env.set_mapsize(self._map_size)
        self._pending, self._pending_bytes = [], 0

    def _finalize(self, index: ShardIndex) -> None:
        meta = [(_META + b"checksums", _npy(index.checksums))] if index.checksums is not None else []
        meta += [  # in key order (append=True)
            (_META + b"format", f"{FORMAT_NAME}/{FORMAT_VERSION}".encode()),
            (_META + b"labels", _npy(index.labels)),
        ]
        if self.pack_id is not None:
            meta.append((_META + b"pack_id", self.pack_id.encode()))
        meta += [
            (_META + b"path_blob", _npy(index.paths.blob)),
            (_META + b"path_offsets", _npy(index.paths.offsets)),
            (_META + b"shapes", _npy(index.shapes)),
        ]
        self._flush(meta)
        self._env.sync(True)
        self._env.close()
        self._env = None
        Path(str(self.tmp_path) + "-lock").unlink(missing_ok=True)

    def abort(self) -> None:
        if self._env is not None:
            self._env.close()
            self._env = None
        self._discard_tmp()


# LMDB's on-disk structures (lmdb's mdb.c, data version 1, 64-bit little-endian builds).
_LMDB_MAGIC, _P_BRANCH, _P_LEAF, _P_OVERFLOW, _P_META = 0xBEEFC0DE, 0x01, 0x02, 0x04, 0x08
_P_DIRTY, _F_BIGDATA, _PAGEHDR, _NODEHDR, _P_INVALID = 0x10, 0x01, 16, 8, (1 << 64) - 1
_MDB_FIXEDMAP = 0x01
_CHUNK_PAGES = 4096  # pages examined per numpy step (bounded memory)


class _Corrupt(Exception):
    pass


def _u16(a: np.ndarray, at: np.ndarray) -> np.ndarray:
    return a[at].astype(np.uint64) | (a[at + 1].astype(np.uint64) << np.uint64(8))


def _u64(a: np.ndarray, at: np.ndarray) -> np.ndarray:
    out = np.zeros(len(at), np.uint64)
    for b in range(8):
        out |= a[at + b].astype(np.uint64) << np.uint64(8 * b)
    return out


def check_lmdb_structure(path: Path, *, name: str | None = None) -> LeafTable:
    """Refuse an LMDB file whose structure could make LMDB read outside the file.

    LMDB trusts its pages: a flipped byte in a meta, branch or leaf page can send it to a page
    number past the end of the file (SIGBUS), a page size of 0 divides by zero (SIGFPE), a node
    offset outside its page reads wild memory. Before LMDB opens a shard we walk, with numpy
    over the memory map, everything a read of the main database can touch: both meta pages,
    the meta LMDB will pick (higher txnid), every branch and leaf page under its root (header,
    node pointers, node sizes inside the page, child page numbers inside the file, each page
    seen once, depth and entry count as recorded), and the extent of every overflow record a
    leaf points at (inside the file). Branch and leaf pages are a small part of a shard of
    images; a record's bytes are not read here (the record checksum covers them).

    Returns where every key and value lies in the file (:class:`LeafTable`): the reader slices
    records from it (and ``iter_payloads``), so LMDB's own code runs only for ``read_index``.
    Measured here (warm page cache): 6-12 ms for a 1.1 GiB shard of 35k 30 KB records,
    150-250 ms for a 150 MiB shard of 1M 100-byte records."""
    where = name or str(path)
    try:
        with open(path, "rb") as f:
            m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if os.fstat(f.fileno()).st_size else None
        if m is None:
            return _walk_lmdb(np.zeros(0, np.uint8))
        # After each chunk of pages, drop the pages the walk touched from this process's map
        # (they stay in the page cache): a shard of small records is nearly all leaf pages, and
        # its whole file would otherwise count in the RSS of a process that reads a few records.
        advice = getattr(mmap, "MADV_DONTNEED", None)  # Linux, macOS; elsewhere nothing is dropped
        return _walk_lmdb(np.frombuffer(m, dtype=np.uint8),
                          drop=None if advice is None else (lambda: m.madvise(advice)))
    except _Corrupt as exc:
        raise FormatError(f"{where}: corrupt LMDB shard ({exc}); run `fastload verify`") from None
    except (OSError, ValueError) as exc:
        raise FormatError(f"{where}: unreadable LMDB shard ({exc}); run `fastload verify`") from None


def trim_heap() -> None:
    """Give the heap that glibc keeps after a large walk back to the system (the arrays are
    freed, but glibc holds freed memory under its raised mmap threshold): measured, 125 MB of
    RssAnon after opening a 1M-record shard, 15 MB (the record table) after this, in ~6 ms."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to give back
        pass


def _meta(m: np.ndarray, pg: int, size: int) -> dict:
    """Meta page ``pg`` (as LMDB reads it: at 0 and at meta 0's page size)."""
    hdr = m[: _PAGEHDR + 136]
    if int(hdr[10:12].view("<u2")[0]) & ~_P_DIRTY != _P_META:
        raise _Corrupt(f"meta page {pg} is not a meta page")
    v = hdr[_PAGEHDR:].view("<u4")
    if int(v[0]) != _LMDB_MAGIC or int(v[1]) != 1:
        raise _Corrupt(f"meta page {pg}: bad magic or version")
    q = hdr[_PAGEHDR:].view("<u8")  # 8-byte fields of MDB_meta, in its own offsets / 8
    out = {
        "address": int(q[1]), "mapsize": int(q[2]),
        "psize": int(hdr[_PAGEHDR + 24 : _PAGEHDR + 28].view("<u4")[0]),
        "envflags": int(hdr[_PAGEHDR + 28 : _PAGEHDR + 30].view("<u2")[0]),
        "depth": int(hdr[_PAGEHDR + 78 : _PAGEHDR + 80].view("<u2")[0]),
        "root": int(q[14]), "entries": int(q[13]), "last": int(q[15]), "txnid": int(q[16]),
    }
    ps = out["psize"]
    if ps < 512 or ps > 65536 or ps & (ps - 1):
        raise _Corrupt(f"meta page {pg}: impossible page size {ps}")
    if out["address"] != 0 or out["envflags"] & _MDB_FIXEDMAP:
        raise _Corrupt(f"meta page {pg}: fixed map address")
    # No lower bound: an older meta page keeps the map size from before the writer grew the map,
    # and LMDB maps at least the pages the picked meta uses anyway.
    if out["mapsize"] > 1 << 46:
        raise _Corrupt(f"meta page {pg}: impossible map size {out['mapsize']}")
    return out


@dataclass(frozen=True)
class LeafTable:
    """Where every key and value of the main database lies in the file, from the structure walk."""

    mm: np.ndarray  # the file, memory-mapped
    key_at: np.ndarray  # int64 file offset of each key, in B-tree order
    ksize: np.ndarray  # int64 key sizes
    offsets: np.ndarray  # int64 file offset of each value
    sizes: np.ndarray  # int64 value sizes
    # uint64: each 8-byte key read as a big-endian number (record keys), all ones for other
    # sizes; taken from the walk's copy of the leaf pages, so finding records touches no page
    knum: np.ndarray
    drop: Any = None  # drops the pages touched so far from this process's map (None: cannot)

    def value(self, key: bytes):
        """The value of a metadata key (0xFF...), or None."""
        at = self.value_at(key)
        return None if at is None else self.mm[at[0] : at[0] + at[1]]

    def value_at(self, key: bytes) -> tuple[int, int] | None:
        """(file offset, size) of a metadata key's value (0xFF...), or None."""
        if len(key) == 8:
            meta = np.flatnonzero((self.ksize == 8) & (self.knum == np.uint64(int.from_bytes(key, "big"))))
        else:
            meta = np.flatnonzero(self.ksize == len(key))  # metadata keys only: records' keys are 8 bytes
        for k in meta.tolist():
            a = int(self.key_at[k])
            if self.mm[a : a + len(key)].tobytes() == key:
                return int(self.offsets[k]), int(self.sizes[k])
        return None

    def records(self, n: int, where: str) -> tuple[np.ndarray, np.ndarray]:
        """(offsets, sizes) of records 0..n-1 (keyed by their 8-byte big-endian number); a
        record whose key is missing gets size -1 (reading it is an error naming it)."""
        off, size = np.full(n, -1, np.int64), np.full(n, -1, np.int64)
        sel = np.flatnonzero(self.ksize == 8)
        if len(sel):
            num = self.knum[sel]
            ok = num < np.uint64(n)
            num, sel = num[ok].astype(np.int64), sel[ok]
            off[num], size[num] = self.offsets[sel], self.sizes[sel]
            # every key filled its own slot (offsets are >= 0): fewer filled slots = a key twice.
            # (np.unique here took 0.8 s per 1M records; this is a count.)
            if np.count_nonzero(size >= 0) != len(num):
                raise FormatError(f"{where}: corrupt LMDB shard (a record key appears twice); run `fastload verify`")
        return off, size


def record_locations(path: Path, num_samples: int, *, name: str | None = None
                     ) -> tuple[np.ndarray, np.ndarray, tuple[int, int]]:
    """Where a finished shard's records and pack id lie (one structure walk): (uint64 offsets,
    uint32 sizes, (offset, size) of the pack-id value, (0, 0) when it has none). The packer
    stores them in the index file so that readers never walk (:class:`LMDBShardReader`)."""
    where = name or str(path)
    table = check_lmdb_structure(path, name=where)
    off, size = table.records(num_samples, where)
    if len(size) and int(size.min()) < 0:
        raise FormatError(f"{where}: record {int(np.flatnonzero(size < 0)[0])} missing from the shard just written")
    id_at = table.value_at(_META + b"pack_id") or (0, 0)
    del table
    trim_heap()
    return off.astype(np.uint64), size.astype(np.uint32), id_at


def with_record_locations(index: ShardIndex, shards) -> ShardIndex:
    """``index`` (of the finished ``shards``, (path, records) each, in order) with every record's
    place in its shard and each shard's pack-id place, for the pack's index file: readers then
    slice records from that shared file instead of walking every shard into private arrays in
    every process (issue 16). One walk per shard; deterministic, so packs stay byte-identical."""
    import dataclasses

    locs = [record_locations(Path(p), n) for p, n in shards]
    return dataclasses.replace(
        index,
        record_offsets=np.concatenate([o for o, _, _ in locs]) if locs else np.zeros(0, np.uint64),
        record_sizes=np.concatenate([z for _, z, _ in locs]) if locs else np.zeros(0, np.uint32),
        pack_id_at=np.asarray([a for _, _, a in locs], np.uint64).reshape(-1, 2),
    )


def _walk_lmdb(mm: np.ndarray, drop=None) -> LeafTable:
    """The walk of :func:`check_lmdb_structure`; ``drop()`` is called after each chunk of pages."""
    size = len(mm)
    if size < 2 * 512:
        raise _Corrupt(f"file of {size} bytes is too small")
    m0 = _meta(mm[:4096], 0, size)
    ps = m0["psize"]
    if size < 2 * ps or size % ps:
        raise _Corrupt(f"file size {size} is not a whole number of {ps}-byte pages")
    m1 = _meta(mm[ps : 2 * ps], 1, size)
    if m1["psize"] != ps:
        raise _Corrupt("meta pages disagree on the page size")
    meta = m1 if m1["txnid"] > m0["txnid"] else m0
    npages = size // ps
    if meta["last"] >= npages:
        raise _Corrupt(f"last page {meta['last']} is past the end of the file ({npages} pages)")
    pages2d = mm.reshape(npages, ps)
    if meta["root"] == _P_INVALID:
        if meta["depth"] != 0 or meta["entries"] != 0:
            raise _Corrupt("empty tree with entries")
        return LeafTable(mm, *(np.zeros(0, np.int64) for _ in range(4)), np.zeros(0, np.uint64), drop)
    depth = meta["depth"]
    if not 1 <= depth <= 64:
        raise _Corrupt(f"tree depth {depth}")
    seen = np.zeros(npages, bool)
    level = np.asarray([meta["root"]], np.uint64)
    leaves = 0
    found = []
    for d in range(depth):
        is_leaf = d == depth - 1
        nxt = []
        for c0 in range(0, len(level), _CHUNK_PAGES):
            chunk = level[c0 : c0 + _CHUNK_PAGES]
            children, n = _check_pages(pages2d, chunk, npages, ps, seen, leaf=is_leaf)
            if drop is not None:
                drop()
            if is_leaf:
                leaves += len(n[0])
                found.append(n)
            else:
                nxt.append(children)
        if not is_leaf:
            level = np.concatenate(nxt) if nxt else np.zeros(0, np.uint64)
            if not len(level):
                raise _Corrupt("branch pages without children")
    if leaves != meta["entries"]:
        raise _Corrupt(f"{leaves} entries in the leaves, the meta page says {meta['entries']}")
    return LeafTable(mm, *(np.concatenate([f[i] for f in found]) for i in range(5)), drop)


def _check_pages(pages2d, pgnos: np.ndarray, npages: int, ps: int, seen: np.ndarray, *, leaf: bool):
    """Check one chunk of same-level pages; returns (child page numbers or None, leaf entries)."""
    if np.any(pgnos < 2) or np.any(pgnos >= npages):
        raise _Corrupt(f"a page number points outside the file ({npages} pages)")
    idx = pgnos.astype(np.int64)
    if np.any(seen[idx]) or len(np.unique(idx)) != len(idx):
        raise _Corrupt("a page is reachable twice (cycle)")
    seen[idx] = True
    P = pages2d[idx]  # copies the chunk's pages
    hdr = P[:, :_PAGEHDR].copy()
    if np.any(hdr[:, :8].view("<u8").ravel() != pgnos):
        raise _Corrupt("a page's number does not match its place")
    flags = hdr[:, 10:12].view("<u2").ravel() & ~np.uint16(_P_DIRTY)
    if np.any(flags != (_P_LEAF if leaf else _P_BRANCH)):
        raise _Corrupt(f"a {'leaf' if leaf else 'branch'} page has page flags {int(flags[0]):#x}")
    lower = hdr[:, 12:14].view("<u2").ravel().astype(np.int64)
    upper = hdr[:, 14:16].view("<u2").ravel().astype(np.int64)
    if np.any(lower < _PAGEHDR + 2) or np.any(lower > upper) or np.any(upper > ps) or np.any(lower % 2):
        raise _Corrupt("a page's free-space bounds are impossible")
    nkeys = (lower - _PAGEHDR) // 2
    maxk = int(nkeys.max())
    ptrs = P[:, _PAGEHDR : _PAGEHDR + 2 * maxk].copy().view("<u2").astype(np.int64)
    valid = np.arange(maxk)[None, :] < nkeys[:, None]
    row = np.nonzero(valid)[0]
    ptr = ptrs[valid]
    if np.any(ptr < upper[row]) or np.any(ptr > ps - _NODEHDR) or np.any(ptr % 2):
        raise _Corrupt("a node pointer lies outside its page's node area")
    flat = P.reshape(-1)
    at = row * ps + ptr
    lo, hi, fl, ks = (_u16(flat, at + 2 * f) for f in range(4))
    end = ptr + _NODEHDR + ks.astype(np.int64)
    if not leaf:
        if np.any(end > ps):
            raise _Corrupt("a branch node runs past its page")
        return lo | (hi << np.uint64(16)) | (fl << np.uint64(32)), None
    dsz = (lo | (hi << np.uint64(16))).astype(np.int64)
    big = fl == _F_BIGDATA
    if np.any((fl != 0) & ~big):
        raise _Corrupt("a leaf node has flags this database never writes (sub-database/duplicates)")
    if np.any(end + np.where(big, 8, dsz) > ps):
        raise _Corrupt("a leaf node runs past its page")
    if np.any(big):
        ov = _u64(flat, at[big] + _NODEHDR + ks[big].astype(np.int64))
        if np.any(ov < 2) or np.any(ov >= npages):
            raise _Corrupt(f"an overflow page number points outside the file ({npages} pages)")
        # The pages a read of the record touches, from the node alone (LMDB reads the data size
        # from the node, not from the overflow page): checked without faulting in one page per
        # record. Bytes that are wrong but inside the file are the record checksum's job.
        count = (dsz[big] + _PAGEHDR + ps - 1) // ps
        if np.any(ov.astype(np.int64) + count > npages):
            raise _Corrupt("an overflow record runs past the end of the file")
    ks64 = ks.astype(np.int64)
    knum = np.full(len(ks64), np.iinfo(np.uint64).max, np.uint64)
    eight = np.flatnonzero(ks64 == 8)
    if len(eight):  # record keys, read from the chunk's copy (inside the page: checked above)
        kat, num = at[eight] + _NODEHDR, np.zeros(len(eight), np.uint64)
        for b in range(8):
            num = (num << np.uint64(8)) | flat[kat + b].astype(np.uint64)
        knum[eight] = num
    base = pgnos.astype(np.int64)[row] * ps + ptr  # the node's place in the file
    offsets = base + _NODEHDR + ks64
    if np.any(big):
        offsets[big] = ov.astype(np.int64) * ps + _PAGEHDR
    return None, (base + _NODEHDR, ks64, offsets, dsz, knum)


def _open_readonly(path: Path, name: str | None = None) -> lmdb.Environment:
    if not path.exists():
        raise FormatError(f"{name or path}: shard file missing")
    check_lmdb_structure(path, name=name)
    try:
        return lmdb.open(
            str(path), subdir=False, readonly=True, lock=False, readahead=False,
            meminit=False, max_readers=2048, max_dbs=0,
        )
    except lmdb.Error as exc:
        raise FormatError(f"{name or path}: not a readable LMDB shard ({exc}); run `fastload verify`") from None


# py-lmdb refuses to open one file twice in a process, so every reader of a shard in this
# process shares one environment (reference-counted); each keeps its own read transaction.
_ENVS: dict[str, list] = {}  # resolved path -> [pid, env, refs]
# Re-entrant: opening a shard allocates, so the GC can run a dropped reader's finalizer
# (_release_env) inside _acquire_env on the same thread; a plain Lock deadlocked there.
_ENVS_LOCK = threading.RLock()


def _acquire_env(path: Path, name: str | None = None) -> lmdb.Environment:
    key, pid = str(Path(path).resolve()), os.getpid()
    with _ENVS_LOCK:
        ent = _ENVS.get(key)
        if ent is not None and ent[0] == pid:
            ent[2] += 1
            return ent[1]
        if ent is not None:
            # Inherited through fork: not ours to use, and py-lmdb refuses a second open of the
            # file until it is closed. Closing it here only unmaps the child's copy.
            try:
                ent[1].close()
            except Exception:  # pragma: no cover - best effort
                pass
        env = _open_readonly(path, name)
        _ENVS[key] = [pid, env, 1]
        return env


def _release_env(path: Path, env: lmdb.Environment) -> None:
    key = str(Path(path).resolve())
    with _ENVS_LOCK:
        ent = _ENVS.get(key)
        if ent is None or ent[1] is not env or ent[0] != os.getpid():
            return
        ent[2] -= 1
        if ent[2] <= 0:
            del _ENVS[key]
            env.close()


class LMDBShardReader(ShardReader):
    """Reads records without LMDB: a record is a slice of one read-only memory map of the file.
    Where each record lies comes from the pack's index file (``locations``, written by the
    packer from one walk of the finished shard: shared pages, nothing per record private, no
    walk at open; each read is bounds-checked against the file, and the record checksum
    catches a wrong place), or, for packs without them, from the structure walk done at open
    (:func:`check_lmdb_structure`, private arrays of 16 bytes per record). Either way a read
    cannot fault, costs a slice, and a buffer handed out keeps the map alive after the shard
    is closed (an LRU close or a garbage-collected reader never leaves a caller with unmapped
    memory). LMDB itself reads only the index (``read_index``: verify, older packs)."""

    def __init__(self, path: Path, num_samples: int, *, pack_id: str | None = None, name: str | None = None,
                 locations: Any = None):
        super().__init__(path, num_samples, pack_id=pack_id, name=name)
        # A callable giving (offsets, sizes, pack-id place) from the pack's index file, or None
        # (:class:`~fastload.storage.pack_index.ShardLocations`); without it, or when it gives
        # None (older packs), the shard is walked at open.
        self._locations = locations
        self._mm = None
        self._off = None
        self._size = None
        self._stored_id = None
        self._drop_pages = None

    def _handle_attrs(self) -> tuple[str, ...]:
        return ("_mm", "_off", "_size", "_stored_id", "_drop_pages")

    def _open(self) -> None:
        if not self.path.exists():
            raise FormatError(f"{self.name}: shard file missing")
        if self._locations is not None and self._open_located():
            return
        self._open_walked()

    def _open_located(self) -> bool:
        """Open from the index file's record locations (shared pages: nothing per record is
        kept privately, no walk). False: no locations, or the pack id is not where the index
        says (then the walk decides, and names the real pack id or the damage)."""
        loc = self._locations()
        if loc is None:
            return False
        off, size, (id_off, id_size) = loc
        try:
            with open(self.path, "rb") as f:
                fsize = os.fstat(f.fileno()).st_size
                m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if fsize else None
        except (OSError, ValueError) as exc:
            raise FormatError(f"{self.name}: unreadable LMDB shard ({exc}); run `fastload verify`") from None
        if m is None:
            return False
        mm = np.frombuffer(m, dtype=np.uint8)
        stored = None
        if 0 < id_size <= 256 and id_off + id_size <= fsize:
            stored = mm[id_off : id_off + id_size].tobytes().decode("ascii", "replace")
        if self.pack_id is not None and stored != self.pack_id:
            return False
        self._stored_id = stored
        self._off, self._size, self._mm = off, size, mm
        advice = getattr(mmap, "MADV_DONTNEED", None)
        self._drop_pages = None if advice is None else (lambda: m.madvise(advice))
        return True

    def _open_walked(self) -> None:
        table = check_lmdb_structure(self.path, name=self.name)
        v = table.value(_META + b"pack_id")
        self._stored_id = None if v is None else v.tobytes().decode("ascii", "replace")
        if self.pack_id is not None and self._stored_id != self.pack_id:
            self._check_pack_id()  # another pack's shard: say so before anything about its records
        self._off, self._size = table.records(self.num_samples, self.name)
        self._mm = table.mm
        self._drop_pages = table.drop
        if len(table.key_at) >= 1 << 16:
            del table
            trim_heap()  # the walk's temporaries: ~110 MB per 1M records that glibc would keep

    def _stored_pack_id(self) -> str | None:
        return self._stored_id

    def _close(self) -> None:
        pass  # dropping the map is enough: buffers handed out keep it alive until they go

    def _get(self, i: int):
        if not 0 <= i < self.num_samples:
            raise IndexError(f"{self.name}: record {i} out of range 0..{self.num_samples - 1}")
        o, n = int(self._off[i]), int(self._size[i])
        if n < 0:
            raise FormatError(f"{self.name}: record {i} missing; the shard is corrupt or truncated")
        if o + n > len(self._mm):  # index-file locations are bounds-checked here; content by the checksum
            raise FormatError(f"{self.name}: record {i}: its location in the pack's index file ({o}, {n} bytes) "
                              f"lies outside the shard ({len(self._mm)} bytes): index file damaged; "
                              "run `fastload verify` on the pack, and repack")
        return self._mm[o : o + n]

    @contextlib.contextmanager
    def _borrow_env(self):
        """A short-lived environment (shared, reference-counted, with any other reader of the
        file in this process: py-lmdb refuses to open the same file twice in one process)."""
        env = _acquire_env(self.path, self.name)
        try:
            yield env
        finally:
            _release_env(self.path, env)

    def read_index(self) -> ShardIndex:
        with self._borrow_env() as env, env.begin() as txn:
            try:
                fmt = txn.get(_META + b"format")
                if fmt is None or not fmt.startswith(FORMAT_NAME.encode() + b"/"):
                    raise FormatError(f"{self.name}: no fastload index in this LMDB file")
                version = int(fmt.split(b"/")[1])
                if version > FORMAT_VERSION:
                    raise FormatError(f"{self.name}: shard format version {version} is newer than this fastload")
                get = lambda k: _from_npy(txn.get(_META + k))  # noqa: E731
                sums = txn.get(_META + b"checksums")
                index = ShardIndex(
                    labels=get(b"labels"), shapes=get(b"shapes"),
                    paths=StringTable(get(b"path_blob"), get(b"path_offsets")),
                    checksums=None if sums is None else _from_npy(sums).astype(np.uint64, copy=False),
                )
            except lmdb.Error as exc:
                raise FormatError(f"{self.name}: corrupt LMDB shard ({exc})") from None
            except (ValueError, TypeError, OSError) as exc:
                raise FormatError(f"{self.name}: corrupt shard index ({exc})") from None
        if len(index) != self.num_samples:
            raise FormatError(f"{self.name}: index has {len(index)} records, manifest says {self.num_samples}")
        return index

    def iter_payloads(self):
        """Every record in order, from a walk of the shard (also when reads use the index file's
        locations, which must then equal the walk's: verify checks both); the pages already read are dropped from this
        process's map every 64 MiB (they stay in the page cache), so verifying a shard holds
        a bounded part of it in RSS whatever its size."""
        self._ensure_open()
        mm, off, size, drop, done = self._mm, self._off, self._size, self._drop_pages, 0
        loc = self._locations() if self._locations is not None else None
        if loc is not None:
            # Opened from the index file's locations: verify still walks the shard (its own
            # structure is what is checked), and the stored locations must say the same.
            table = check_lmdb_structure(self.path, name=self.name)
            off, size = table.records(self.num_samples, self.name)
            bad = np.flatnonzero((np.asarray(loc[0]).astype(np.int64) != off)
                                 | (np.asarray(loc[1]).astype(np.int64) != size))
            if len(bad):
                raise FormatError(f"{self.name}: record {int(bad[0])}: its location in the pack's index file differs "
                                  "from the shard's (index file damaged); repack")
            mm, drop = table.mm, table.drop
            del table
        for i in range(self.num_samples):
            n = int(size[i])
            if n < 0:
                raise FormatError(f"{self.name}: record {i} missing; the shard is corrupt or truncated")
            o = int(off[i])
            buf = mm[o : o + n]
            yield buf
            done += len(buf)
            if drop is not None and done >= 64 << 20:
                drop()
                done = 0
