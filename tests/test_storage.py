"""Shard storage: LMDB/HDF5 writers and readers, PackReader, pickling, fork safety, refusals."""

from __future__ import annotations

import hashlib
import multiprocessing
import pickle
from pathlib import Path

import cv2
import numpy as np
import pytest

from fastload.errors import FormatError
from fastload.schema import Manifest, manifest_checksum, manifest_name, shard_name, write_manifest
from fastload.storage import StringTable, make_shard_reader, make_shard_writer, open_pack

BACKENDS = ("lmdb", "hdf5")


def _records(n: int, seed: int = 0) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, int(rng.integers(0, 3000)), dtype=np.uint8).tobytes() for _ in range(n)]


def _write_pack(root: Path, backend: str, shards: list[list[bytes]], classes=("a", "b", "c")) -> list[bytes]:
    """A real pack written with the storage API (no codec involved: storage moves bytes)."""
    root.mkdir(parents=True, exist_ok=True)
    entries, flat = [], []
    for k, recs in enumerate(shards):
        w = make_shard_writer(backend, root / shard_name(backend, 0, 1, k))
        for i, r in enumerate(recs):
            w.append(r, label=(len(flat) + i) % len(classes), shape=(i + 1, 2 * i + 1, 3), path=f"dir/ü{len(flat) + i}.jpg")
        assert not w.path.exists()  # no final name before finish
        entries.append(w.finish())
        assert not w.tmp_path.exists() and w.path.exists()
        flat += recs
    write_manifest(root / manifest_name(0, 1), Manifest(
        backend=backend, payload="raw", num_samples=len(flat), classes=tuple(classes), shards=tuple(entries)))
    return flat


@pytest.mark.parametrize("backend", BACKENDS)
def test_round_trip_multi_shard(tmp_path, backend):
    recs = _records(23)
    recs[5] = b""  # an empty payload is a valid record
    flat = _write_pack(tmp_path / "p", backend, [recs[:10], recs[10:11], recs[11:]])
    r = open_pack(tmp_path / "p")
    assert len(r) == 23 and r.classes == ("a", "b", "c")
    assert [r.locate(i) for i in (0, 9, 10, 11, 22, -1)] == [(0, 0), (0, 9), (1, 0), (2, 0), (2, 11), (2, 11)]
    for i, want in enumerate(flat):
        assert bytes(r.get(i)) == want
    idx = r.index
    assert idx.labels.dtype == np.int64 and idx.labels.tolist() == [i % 3 for i in range(23)]
    assert idx.shapes.dtype == np.int32 and idx.shapes.shape == (23, 3)
    assert idx.paths[12] == "dir/ü12.jpg" and len(idx.paths) == 23
    with pytest.raises(IndexError):
        r.get(23)
    assert r.verify_checksums() == []
    r.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_writes_are_byte_identical(tmp_path, backend):
    recs = _records(300, seed=3)  # > one LMDB commit batch
    _write_pack(tmp_path / "a", backend, [recs])
    _write_pack(tmp_path / "b", backend, [recs])
    name = shard_name(backend, 0, 1, 0)
    assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


@pytest.mark.parametrize("backend", BACKENDS)
def test_abort_leaves_nothing(tmp_path, backend):
    w = make_shard_writer(backend, tmp_path / shard_name(backend, 0, 1, 0))
    w.append(b"abc", label=0, shape=(1, 1, 3), path="x")
    w.abort()
    assert list(tmp_path.iterdir()) == []


def _child_reads(reader, i, q):
    try:
        q.put(bytes(reader.get(i)))
    except Exception as exc:  # report, rather than leave the parent waiting
        q.put(repr(exc))


@pytest.mark.parametrize("backend", BACKENDS)
def test_pickles_small_and_reads_in_forked_and_spawned_children(tmp_path, backend):
    flat = _write_pack(tmp_path / "p", backend, [_records(50, 1), _records(50, 2)])
    r = open_pack(tmp_path / "p")
    assert bytes(r.get(3)) == flat[3]  # parent has open handles now
    _ = r.index
    blob = pickle.dumps(r)
    assert len(blob) < 4096, len(blob)  # no handles, no index, no payloads
    r2 = pickle.loads(blob)
    assert bytes(r2.get(77)) == flat[77]
    for method in ("fork", "spawn"):
        ctx = multiprocessing.get_context(method)
        q = ctx.Queue()
        p = ctx.Process(target=_child_reads, args=(r, 60, q))
        p.start()
        got = q.get(timeout=60)
        p.join(timeout=60)
        assert p.exitcode == 0 and got == flat[60], method
    assert bytes(r.get(61)) == flat[61]  # the parent's handles still work after the fork
    r.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_refuses_truncated_shard(tmp_path, backend):
    _write_pack(tmp_path / "p", backend, [_records(20)])
    shard = tmp_path / "p" / shard_name(backend, 0, 1, 0)
    shard.write_bytes(shard.read_bytes()[:-512])
    with pytest.raises(FormatError, match=r"shard-00000\.\w+: size \d+ bytes, manifest says \d+: shard truncated"):
        open_pack(tmp_path / "p")
    shard.unlink()
    with pytest.raises(FormatError, match="missing"):
        open_pack(tmp_path / "p")


def test_refuses_future_shard_version(tmp_path):
    import h5py
    import lmdb

    _write_pack(tmp_path / "l", "lmdb", [_records(3)])
    path = tmp_path / "l" / "shard-00000.lmdb"
    env = lmdb.open(str(path), subdir=False, lock=False)
    with env.begin(write=True) as txn:
        txn.put(b"\xffformat", b"fastload/99")
    env.close()
    with pytest.raises(FormatError, match="version 99 is newer"):
        make_shard_reader("lmdb", path, 3).read_index()
    _write_pack(tmp_path / "h", "hdf5", [_records(3)])
    path = tmp_path / "h" / "shard-00000.h5"
    with h5py.File(path, "r+") as f:
        f.attrs["version"] = 99
    with pytest.raises(FormatError, match="newer than this fastload"):
        make_shard_reader("hdf5", path, 3).read_index()


def test_refuses_future_manifest_version(tmp_path):
    import json

    _write_pack(tmp_path / "p", "lmdb", [_records(3)])
    m = tmp_path / "p" / "manifest.json"
    d = json.loads(m.read_text())
    d["version"] = 99
    m.write_text(json.dumps(d))
    with pytest.raises(FormatError, match="format version 99 is not supported"):
        open_pack(tmp_path / "p")


@pytest.mark.parametrize("backend", BACKENDS)
def test_not_a_shard(tmp_path, backend):
    p = tmp_path / f"junk{'.lmdb' if backend == 'lmdb' else '.h5'}"
    p.write_bytes(b"\x00" * 8192)
    with pytest.raises(FormatError):
        make_shard_reader(backend, p, 1).read_index()


def test_index_count_mismatch_is_refused(tmp_path):
    _write_pack(tmp_path / "p", "hdf5", [_records(4)])
    with pytest.raises(FormatError, match="index has 4 records, manifest says 5"):
        make_shard_reader("hdf5", tmp_path / "p" / "shard-00000.h5", 5).read_index()


@pytest.mark.slow
def test_lmdb_map_grows_past_its_initial_size(tmp_path):
    big = [bytes([i]) * (30 << 20) for i in range(3)]  # 90 MiB > the 64 MiB initial map
    w = make_shard_writer("lmdb", tmp_path / "shard-00000.lmdb", shard_size=1 << 20)
    for i, b in enumerate(big):
        w.append(b, label=0, shape=(1, 1, 3), path=str(i))
    entry = w.finish()
    r = make_shard_reader("lmdb", tmp_path / entry.file, 3)
    assert [bytes(r.get(i)[:1]) for i in range(3)] == [b"\x00", b"\x01", b"\x02"]
    assert len(r.get(2)) == 30 << 20
    r.close()


def test_string_table():
    items = ["a", "", "ünï/cödé.jpg", "x" * 300]
    t = StringTable.from_strings(items)
    assert list(t) == items and len(t) == 4 and t[-1] == items[-1]
    both = StringTable.concat([t, StringTable.from_strings(["z"])])
    assert list(both) == items + ["z"]
    assert StringTable.concat([]) == StringTable.from_strings([])
    assert t.blob.dtype == np.uint8 and t.offsets.dtype == np.int64
    with pytest.raises(IndexError):
        t[4]


def test_index_file_round_trip_is_memory_mapped_and_checked(tmp_path):
    from fastload.errors import FormatError
    from fastload.storage import ShardIndex, StringTable
    from fastload.storage.index_file import read_index_file, write_index_file

    paths = ["a/b.jpg", "c/é.png", ""]
    idx = ShardIndex(np.array([3, 0, 7], np.int64), np.array([[5, 6, 3], [7, 8, 3], [1, 1, 3]], np.int32),
                     StringTable.from_strings(paths))
    size, digest = write_index_file(tmp_path / "index.fli", idx)
    data = (tmp_path / "index.fli").read_bytes()
    assert size == len(data) and digest == hashlib.sha256(data).hexdigest()
    back = read_index_file(tmp_path / "index.fli", num_samples=3)
    assert back.labels.tolist() == [3, 0, 7] and back.shapes.tolist() == idx.shapes.tolist()
    assert list(back.paths) == paths
    assert isinstance(back.labels.base, np.memmap) or isinstance(back.labels, np.memmap)
    with pytest.raises(FormatError, match="manifest says 4"):
        read_index_file(tmp_path / "index.fli", num_samples=4)
    (tmp_path / "bad.fli").write_bytes(b"NOTANIDX" + data[8:])
    with pytest.raises(FormatError, match="not a fastload index"):
        read_index_file(tmp_path / "bad.fli")
    (tmp_path / "short.fli").write_bytes(data[:200])
    with pytest.raises(FormatError, match="damaged index file"):
        read_index_file(tmp_path / "short.fli")
    empty = ShardIndex(np.zeros(0, np.int64), np.zeros((0, 3), np.int32), StringTable.from_strings([]))
    write_index_file(tmp_path / "empty.fli", empty)
    assert len(read_index_file(tmp_path / "empty.fli", num_samples=0)) == 0


def test_packs_carry_an_index_file_that_readers_and_verify_use(tmp_path):
    from fastload.commands.verify import verify_pack
    from fastload.storage import ShardIndex, open_pack
    from fastload.storage.index_file import write_index_file

    src = tmp_path / "src"
    for c in ("x", "y"):
        (src / c).mkdir(parents=True)
        for k in range(3):
            cv2.imwrite(str(src / c / f"{k}.png"), np.random.default_rng(k).integers(0, 256, (8 + k, 9, 3), np.uint8))
    from fastload.config import PackConfig
    from fastload.pack import pack

    pack(src, tmp_path / "p", config=PackConfig(payload="png", backend="hdf5", workers=1, progress=False, shard_size=400))
    r = open_pack(tmp_path / "p")
    (entry,) = r.index_entries
    assert entry.file == "index.fli" and entry.num_samples == len(r) == 6 and len(r.shard_entries) > 1
    from_shards = [x for k in range(len(r.shard_entries)) for x in r.shard_reader(k).read_index().labels.tolist()]
    assert r.index.labels.tolist() == from_shards
    assert verify_pack(tmp_path / "p") == ([], 6)
    # an index file that disagrees with the shards (same size and checksum recorded) is caught
    bad = r.index
    size, digest = write_index_file(tmp_path / "p" / "index.fli",
                                    ShardIndex(np.asarray(bad.labels)[::-1].copy(), np.asarray(bad.shapes), bad.paths,
                                               np.asarray(bad.checksums)), pack_id=r.manifests[0].pack_id)
    import json

    m = json.loads((tmp_path / "p" / "manifest.json").read_text())
    m["index"].update(bytes=size, sha256=digest)
    m["checksum"] = manifest_checksum(m)
    (tmp_path / "p" / "manifest.json").write_text(json.dumps(m))
    problems, _ = verify_pack(tmp_path / "p")
    assert len(problems) == 1 and "index file does not match" in problems[0]
