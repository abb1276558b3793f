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
    return np.load(io.BytesIO(bytes(b)), allow_pickle=False)


class LMDBShardWriter(ShardWriter):
    """Buffers records and commits them in fixed-size batches (fixed, so output is byte-identical
    however the records were produced). The map grows by doubling on MapFullError."""

    def __init__(self, path: Path, *, shard_size: int = 1 << 30):
        super().__init__(path)
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
        meta = [
            (_META + b"format", f"{FORMAT_NAME}/{FORMAT_VERSION}".encode()),
            (_META + b"labels", _npy(index.labels)),
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


def _open_readonly(path: Path) -> lmdb.Environment:
    if not path.exists():
        raise FormatError(f"{path}: shard file missing")
    try:
        return lmdb.open(
            str(path), subdir=False, readonly=True, lock=False, readahead=False,
            meminit=False, max_readers=2048, max_dbs=0,
        )
    except lmdb.Error as exc:
        raise FormatError(f"{path}: not a readable LMDB shard ({exc})") from None


# py-lmdb refuses to open one file twice in a process, so every reader of a shard in this
# process shares one environment (reference-counted); each keeps its own read transaction.
_ENVS: dict[str, list] = {}  # resolved path -> [pid, env, refs]
_ENVS_LOCK = threading.Lock()


def _acquire_env(path: Path) -> lmdb.Environment:
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
        env = _open_readonly(path)
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
    def __init__(self, path: Path, num_samples: int):
        super().__init__(path, num_samples)
        self._env = None
        self._txn = None

    def _handle_attrs(self) -> tuple[str, ...]:
        return ("_env", "_txn")

    def _open(self) -> None:
        self._env = _acquire_env(self.path)
        self._txn = self._env.begin(buffers=True)

    def _close(self) -> None:
        if self._txn is not None:
            self._txn.abort()
        if self._env is not None:
            _release_env(self.path, self._env)

    def _get(self, i: int):
        try:
            v = self._txn.get(_key(i))
        except lmdb.Error as exc:
            raise FormatError(f"{self.path}: record {i} unreadable ({exc}); the shard is corrupt") from None
        if v is None:
            raise FormatError(f"{self.path}: record {i} missing; the shard is corrupt or truncated")
        return v

    @contextlib.contextmanager
    def _borrow_env(self):
        """This process's open environment, or a short-lived one (py-lmdb refuses to open the
        same file twice in one process, so we must not open a second one beside ours)."""
        if self._pid == os.getpid() and self._env is not None:
            yield self._env
            return
        env = _acquire_env(self.path)
        try:
            yield env
        finally:
            _release_env(self.path, env)

    def read_index(self) -> ShardIndex:
        with self._borrow_env() as env, env.begin() as txn:
            try:
                fmt = txn.get(_META + b"format")
                if fmt is None or not fmt.startswith(FORMAT_NAME.encode() + b"/"):
                    raise FormatError(f"{self.path}: no fastload index in this LMDB file")
                version = int(fmt.split(b"/")[1])
                if version > FORMAT_VERSION:
                    raise FormatError(f"{self.path}: shard format version {version} is newer than this fastload")
                get = lambda k: _from_npy(txn.get(_META + k))  # noqa: E731
                index = ShardIndex(
                    labels=get(b"labels"), shapes=get(b"shapes"),
                    paths=StringTable(get(b"path_blob"), get(b"path_offsets")),
                )
            except lmdb.Error as exc:
                raise FormatError(f"{self.path}: corrupt LMDB shard ({exc})") from None
            except (ValueError, TypeError, OSError) as exc:
                raise FormatError(f"{self.path}: corrupt shard index ({exc})") from None
        if len(index) != self.num_samples:
            raise FormatError(f"{self.path}: index has {len(index)} records, manifest says {self.num_samples}")
        return index

    def iter_payloads(self):
        with self._borrow_env() as env, env.begin(buffers=True) as txn:
            try:
                for i in range(self.num_samples):
                    v = txn.get(_key(i))
                    if v is None:
                        raise FormatError(f"{self.path}: record {i} missing")
                    yield v
            except lmdb.Error as exc:
                raise FormatError(f"{self.path}: corrupt LMDB shard ({exc})") from None
