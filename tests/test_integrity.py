"""Read-time integrity: record checksums, pack identity, labels inside the class list, and a
bounded number of open shards. Real packs, real files, real worker processes."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fastload import ImageFolder
from fastload.commands.verify import verify_pack
from fastload.errors import CorruptRecordError, FormatError
from fastload.schema import BACKENDS, manifest_checksum
from fastload.storage import ShardIndex, ShardWriter, StringTable, open_pack

from _data_helpers import make_pack
from _pack_helpers import REPO, cli_env, run_cli

N = 12


def _tree(root: Path, n: int = N, *, seed: int = 0) -> Path:
    """``n`` random images in 3 classes, two sizes (records of equal size can be swapped)."""
    rng = np.random.default_rng(seed)
    for k in range(n):
        hw = 8 if k % 2 else 20
        p = root / f"c{k % 3}" / f"img{k:03d}.png"
        p.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (hw, hw, 3), np.uint8)).save(p)
    return root


@pytest.fixture(params=BACKENDS)
def packed(request, tmp_path) -> Path:
    return make_pack(_tree(tmp_path / "src"), tmp_path / "pack", backend=request.param, payload="raw",
                     shard_size=3_000)


def _record_at(pack: Path, i: int) -> tuple[Path, int, bytes]:
    """(shard file, byte offset in it, bytes) of record ``i``'s payload, found in the file."""
    r = open_pack(pack)
    k, _ = r.locate(i)
    payload = bytes(r.get(i))
    r.close()
    data = r.shard_path(k).read_bytes()
    at = data.find(payload)
    assert at >= 0 and data.find(payload, at + 1) < 0
    return r.shard_path(k), at, payload


def _write_at(path: Path, at: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(data)


def _flip_payload(pack: Path, i: int) -> None:
    shard, at, payload = _record_at(pack, i)
    _write_at(shard, at + len(payload) // 2, bytes([payload[len(payload) // 2] ^ 0x10]))


def _index_array(pack: Path, name: str) -> tuple[int, np.dtype]:
    """Byte offset and dtype of section ``name`` of the pack's index file."""
    raw = (pack / "index.fli").read_bytes()
    hlen = int.from_bytes(raw[8:16], "little")
    header = json.loads(raw[16 : 16 + hlen])
    dtype = {"labels": "<i8", "shapes": "<i4", "checksums": "<u8", "path_blob": "u1"}[name]
    return header["sections"][name][0], np.dtype(dtype)


def _set_label(pack: Path, i: int, label: int) -> None:
    start, dtype = _index_array(pack, "labels")
    _write_at(pack / "index.fli", start + 8 * i, np.asarray([label], dtype).tobytes())


def _label(pack: Path, i: int) -> int:
    start, dtype = _index_array(pack, "labels")
    return int(np.frombuffer((pack / "index.fli").read_bytes()[start + 8 * i : start + 8 * i + 8], dtype)[0])


# -- record checksums ---------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_a_flipped_payload_byte_is_refused_naming_shard_record_and_source(packed):
    _flip_payload(packed, 5)
    r = open_pack(packed)
    assert r.has_checksums
    k, j = r.locate(5)
    with pytest.raises(CorruptRecordError) as info:
        r.get(5)
    msg = str(info.value)
    assert str(r.shard_path(k)) in msg and f"record {j} " in msg and r.index.paths[5] in msg
    assert "fastload verify" in msg and "\n" not in msg
    assert all(bytes(r.get(i)) for i in range(N) if i != 5)  # the others read
    r.close()
    ds = ImageFolder(packed)
    with pytest.raises(CorruptRecordError, match="dataset index 5"):
        ds[5]
    assert "record checksums checked on every read" in run_cli("inspect", packed).stdout
    img, target, rep = ds.get(5, epoch=0, seed=1, on_error="skip")
    assert rep is not None and rep.index == 5 and target == ds.targets[rep.substitute]
    problems, n = verify_pack(packed)
    assert n == N and any(r.shard_entries[k].file in p for p in problems)


@pytest.mark.timeout(120)
def test_a_flipped_label_in_the_index_is_refused_and_skipped_by_workers(packed):
    """The label a dataset serves comes from the index file: a different (valid) label there is
    caught by the checksum, in the main process and in worker processes alike."""
    from fastload.data.loader import DataLoader
    from fastload.transforms import Compose, RandomResizedCrop

    good = _label(packed, 4)
    _set_label(packed, 4, (good + 1) % 3)
    ds = ImageFolder(packed)
    with pytest.raises(CorruptRecordError, match="dataset index 4"):
        ds[4]
    loader = DataLoader(ImageFolder(packed, Compose([RandomResizedCrop(8)])), 4, num_workers=2, seed=0,
                        on_error="skip", pin_memory=False)
    assert loader.mode == "ring"
    labels = [int(t) for _, y in loader for t in y]
    assert len(labels) == N
    records = loader.stats()["records"] if isinstance(loader.stats(), dict) else loader.stats().records
    assert [r.index for r in records] == [4]
    loader.close()


@pytest.mark.timeout(120)
def test_swapped_records_of_equal_size_are_caught(packed):
    a, b = 1, 3  # both 8x8, same shard
    r = open_pack(packed)
    assert r.locate(a)[0] == r.locate(b)[0]
    r.close()
    sa, at_a, pa = _record_at(packed, a)
    sb, at_b, pb = _record_at(packed, b)
    assert len(pa) == len(pb)
    _write_at(sa, at_a, pb)
    _write_at(sb, at_b, pa)
    r = open_pack(packed)
    for i in (a, b):
        with pytest.raises(CorruptRecordError):
            r.get(i)
    r.close()


@pytest.mark.timeout(120)
def test_a_label_outside_the_class_list_is_refused_at_open_and_by_verify(packed):
    _set_label(packed, 7, 99)
    with pytest.raises(FormatError, match=r"record 7 has label 99, outside the 3 classes"):
        ImageFolder(packed)
    problems, _ = verify_pack(packed)
    assert any("record 7 has label 99" in p for p in problems)


def test_checksum_covers_payload_label_shape_and_record_number():
    from fastload.storage import record_checksum

    base = record_checksum(b"pixels", label=1, record=2, shape=(1, 2, 3))
    assert base == record_checksum(memoryview(b"pixels"), label=1, record=2, shape=(1, 2, 3))
    others = [
        record_checksum(b"pixelt", label=1, record=2, shape=(1, 2, 3)),
        record_checksum(b"pixels", label=0, record=2, shape=(1, 2, 3)),
        record_checksum(b"pixels", label=1, record=3, shape=(1, 2, 3)),
        record_checksum(b"pixels", label=1, record=2, shape=(2, 1, 3)),
    ]
    assert base not in others and len(set(others)) == len(others)


@pytest.mark.timeout(120)
def test_verify_streams_every_record_against_its_checksum(tmp_path):
    """A record damaged inside an HDF5 shard whose SHA-256 was recomputed (so only the record
    checksum can tell) is named by verify, record by record."""
    import hashlib

    pack = make_pack(_tree(tmp_path / "src"), tmp_path / "pack", backend="hdf5", payload="raw", shard_size=3_000)
    _flip_payload(pack, 2)
    r = open_pack(pack)
    k, j = r.locate(2)
    shard = r.shard_path(k)
    m = json.loads((pack / "manifest.json").read_text())
    m["shards"][k]["sha256"] = hashlib.sha256(shard.read_bytes()).hexdigest()
    m["checksum"] = manifest_checksum(m)  # resealed: only the record checksum can tell
    (pack / "manifest.json").write_text(json.dumps(m))
    problems, _ = verify_pack(pack)
    assert problems == [f"{shard}: record {j} ({r.index.paths[2]}): checksum mismatch (its bytes, label or shape are damaged)"]


# -- pack identity ------------------------------------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_dataset_opened_before_a_repack_refuses_the_new_shards(tmp_path, backend):
    src = _tree(tmp_path / "src")
    pack = make_pack(src, tmp_path / "pack", backend=backend, payload="raw", shard_size=3_000)
    ds = ImageFolder(pack)  # opens no shard yet
    make_pack(src, pack, backend=backend, payload="png", shard_size=3_000, overwrite=True)
    with pytest.raises(FormatError, match="belongs to another pack .*open the dataset again") as info:
        ds[0]
    assert "shard-00000" in str(info.value)
    assert ImageFolder(pack)[0][1] == 0  # opened again: reads


def test_pack_ids_are_per_part_and_stable_for_the_same_input(tmp_path):
    src = _tree(tmp_path / "src")
    a = make_pack(src, tmp_path / "a", backend="lmdb", payload="raw", shard_size=3_000)
    b = make_pack(src, tmp_path / "b", backend="lmdb", payload="raw", shard_size=3_000, workers=2)
    ida, idb = (json.loads((p / "manifest.json").read_text())["pack_id"] for p in (a, b))
    assert ida == idb and len(ida) == 32  # the same input and options: the same (byte-identical) pack
    c = make_pack(src, tmp_path / "c", backend="lmdb", payload="png", shard_size=3_000)
    assert json.loads((c / "manifest.json").read_text())["pack_id"] != ida
    parts = tmp_path / "parts"
    for i in range(2):
        make_pack(src, parts, backend="hdf5", payload="raw", part=i, parts=2)
    ids = {m.pack_id for m in open_pack(parts).manifests}
    assert len(ids) == 2 and None not in ids
    whole, parted = ImageFolder(a), ImageFolder(parts)
    for i in range(N):
        (x, y), (u, v) = whole[i], parted[i]
        assert y == v and np.array_equal(x, u)


@pytest.mark.timeout(120)
def test_an_index_file_of_another_pack_is_refused(tmp_path):
    src = _tree(tmp_path / "src")
    a = make_pack(src, tmp_path / "a", backend="lmdb", payload="raw")
    b = make_pack(src, tmp_path / "b", backend="lmdb", payload="png")
    (a / "index.fli").write_bytes((b / "index.fli").read_bytes())
    m = json.loads((a / "manifest.json").read_text())
    m["index"]["bytes"] = (a / "index.fli").stat().st_size
    m["checksum"] = manifest_checksum(m)
    (a / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(FormatError, match="index.fli belongs to another pack"):
        ImageFolder(a)


# -- packs made before checksums and ids ----------------------------------------------------------


@pytest.mark.timeout(120)
def test_an_older_pack_without_checksums_or_id_reads_unchecked_and_verify_says_so(tmp_path, monkeypatch):
    def old_index(self):
        return ShardIndex(labels=np.asarray(self.labels, np.int64),
                          shapes=np.asarray(self.shapes, np.int32).reshape(-1, 3),
                          paths=StringTable.from_strings(self.paths))

    monkeypatch.setattr(ShardWriter, "index", old_index)
    pack = make_pack(_tree(tmp_path / "src"), tmp_path / "pack", backend="lmdb", payload="raw", shard_size=3_000)
    monkeypatch.undo()
    m = json.loads((pack / "manifest.json").read_text())
    del m["pack_id"], m["checksum"]  # as an older fastload wrote it
    (pack / "manifest.json").write_text(json.dumps(m))
    r = open_pack(pack)
    assert not r.has_checksums and all(len(bytes(r.get(i))) for i in range(N))
    r.close()
    notes: list[str] = []
    assert verify_pack(pack, notes=notes) == ([], N)
    assert notes == [f"{pack}: no record checksums: packed by an older fastload; repack to get read-time checks"]
    res = run_cli("verify", pack)
    assert res.returncode == 0 and "no record checksums" in res.stdout
    res = run_cli("inspect", pack)
    assert res.returncode == 0 and "no record checksums: packed by an older fastload" in res.stdout


# -- the manifest's own checksum, and parts that disagree -----------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("old, new", [('"c1"', '"c7"'), ("/src", "/srd"), ('"c1": 1', '"c1": 2')])
def test_a_damaged_manifest_is_refused_by_readers_and_verify_in_one_line(tmp_path, old, new):
    """Class names and the source folder are covered by no record checksum: the manifest's own
    checksum catches them (a class name flipped would otherwise be served as the label's name)."""
    pack = make_pack(_tree(tmp_path / "src"), tmp_path / "pack", backend="lmdb", payload="raw", shard_size=3_000)
    mpath = pack / "manifest.json"
    text = mpath.read_text(encoding="utf-8")
    assert old in text
    mpath.write_text(text.replace(old, new, 1), encoding="utf-8")
    with pytest.raises(FormatError, match=r"manifest.json: manifest damaged or edited"):
        ImageFolder(pack)
    res = run_cli("verify", pack)
    assert res.returncode == 1 and "Traceback" not in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and "manifest damaged or edited" in res.stderr


@pytest.mark.timeout(180)
def test_parts_packed_from_a_source_that_changed_in_between_are_refused(tmp_path):
    src = _tree(tmp_path / "src")
    pack = tmp_path / "pack"
    make_pack(src, pack, backend="lmdb", payload="raw", part=0, parts=2)
    _tree(tmp_path / "src" / "c3", n=2, seed=1)  # a new class folder appears before part 1 runs
    import shutil

    for f in (src / "c3").rglob("*.png"):  # flatten c3/c0/x.png -> c3/x.png: one new class
        shutil.move(str(f), str(src / "c3" / f.name))
    make_pack(src, pack, backend="lmdb", payload="raw", part=1, parts=2)
    with pytest.raises(FormatError, match=r"manifest-p00000-of-00002.json and .*manifest-p00001-of-00002.json "
                                          r"disagree on the classes \(3 vs 4"):
        ImageFolder(pack)
    res = run_cli("verify", pack)
    assert res.returncode == 1 and "disagree on the classes" in res.stderr and "Traceback" not in res.stderr


@pytest.mark.timeout(120)
def test_a_damaged_source_path_in_the_index_file_is_refused_when_paths_are_used(tmp_path):
    """Source paths are in no record checksum: the index file's SHA-256 (in the manifest) is
    checked the first time a process decodes a path; records (pixels, labels) still read."""
    pack = make_pack(_tree(tmp_path / "src"), tmp_path / "pack", backend="lmdb", payload="raw", shard_size=3_000)
    good = ImageFolder(pack)
    path3 = good.path(3)
    start, _ = _index_array(pack, "path_blob")
    raw = (pack / "index.fli").read_bytes()
    _write_at(pack / "index.fli", start + 2, bytes([raw[start + 2] ^ 0x01]))  # 'c0/img000' -> 'c1/img000'
    ds = ImageFolder(pack)
    x, y = ds[3]
    assert y == good[3][1] and np.array_equal(x, good[3][0])  # records are checked by their own checksums
    with pytest.raises(FormatError, match=r"index.fli: index file damaged \(SHA-256 differs.*run `fastload verify`"):
        ds.path(3)
    assert good.path(3) == path3  # a process that checked before the damage is not re-checked
    problems, _ = verify_pack(pack)
    assert any("index.fli: SHA-256 mismatch" in p for p in problems)


# -- manifests that point outside the pack or list a shard twice ----------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("bad", ["../other/shard-00000.lmdb", "/etc/passwd", "sub/shard.lmdb", ".", "..", "a\0b", ""])
def test_verify_and_open_refuse_a_shard_path_outside_the_pack(tmp_path, bad):
    pack = make_pack(_tree(tmp_path / "src"), tmp_path / "pack", backend="lmdb", payload="raw", shard_size=3_000)
    m = json.loads((pack / "manifest.json").read_text())
    m["shards"][0]["file"] = bad
    (pack / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(FormatError, match="manifest.json: file name .* is not a plain file name inside the pack"):
        open_pack(pack)
    res = run_cli("verify", pack)
    assert res.returncode != 0 and "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1


@pytest.mark.timeout(120)
def test_verify_and_open_refuse_a_manifest_listing_a_shard_twice(tmp_path):
    pack = make_pack(_tree(tmp_path / "src"), tmp_path / "pack", backend="hdf5", payload="raw", shard_size=3_000)
    m = json.loads((pack / "manifest.json").read_text())
    m["shards"][1] = dict(m["shards"][0])
    m["num_samples"] = sum(s["num_samples"] for s in m["shards"])
    (pack / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(FormatError, match="lists 'shard-00000.h5' twice"):
        open_pack(pack)
    res = run_cli("verify", pack)
    assert res.returncode != 0 and "twice" in res.stderr and "Traceback" not in res.stderr


# -- open shards: bounded, and closed when the reader goes ---------------------------------------

_FD_CHILD = r"""
import os, resource, sys
import numpy as np
from fastload import ImageFolder
limit = int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_NOFILE, (limit, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
ds = ImageFolder(sys.argv[1])
peak = 0
for epoch in range(2):
    for i in np.random.default_rng(epoch).permutation(len(ds)):
        img, label = ds[int(i)]
        assert label == int(ds.targets[int(i)]) and img.shape[2] == 3
        peak = max(peak, len(os.listdir("/proc/self/fd")))
print(len(ds), len(ds.reader.shard_entries), peak, ds.reader.max_open)
"""


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_pack_of_many_shards_reads_under_a_low_open_file_limit(tmp_path, backend):
    pack = make_pack(_tree(tmp_path / "src", n=90), tmp_path / "pack", backend=backend, payload="raw", shard_size=1)
    res = subprocess.run([sys.executable, "-c", _FD_CHILD, str(pack), "48"], env=cli_env(), cwd=REPO,
                         capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stderr[-2000:]
    n, shards, peak, max_open = map(int, res.stdout.split())
    assert n == shards == 90 and max_open == 24 and peak <= 48


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_reader_that_is_dropped_closes_its_shards(tmp_path, backend):
    pack = make_pack(_tree(tmp_path / "src", n=30), tmp_path / "pack", backend=backend, payload="raw", shard_size=1)
    gc.collect()
    before = len(os.listdir("/proc/self/fd"))
    r = open_pack(pack)
    for i in range(30):
        r.get(i)
    assert len(os.listdir("/proc/self/fd")) >= before + 30
    del r
    gc.collect()
    assert len(os.listdir("/proc/self/fd")) == before


@pytest.mark.timeout(120)
def test_an_lmdb_shard_whose_map_grew_while_packing_passes_the_structure_check(tmp_path):
    """The writer doubles LMDB's map when it fills: the older meta page keeps the old map size,
    smaller than the file. That is a healthy shard, and must open."""
    from fastload.storage import make_shard_reader, make_shard_writer
    from fastload.storage.lmdb_backend import check_lmdb_structure

    w = make_shard_writer("lmdb", tmp_path / "s.lmdb", shard_size=1 << 20)  # a 64 MiB map to start
    payloads = [bytes([k]) * (1 << 20) for k in range(80)]
    for k, b in enumerate(payloads):
        w.append(b, label=0, shape=(1, 1 << 18, 4), path=f"{k}")
    entry = w.finish()
    assert entry.bytes > 64 << 20
    check_lmdb_structure(tmp_path / "s.lmdb")
    r = make_shard_reader("lmdb", tmp_path / "s.lmdb", len(payloads))
    assert all(bytes(r.get(k)) == b for k, b in enumerate(payloads))
    r.close()


@pytest.mark.timeout(60)
def test_damaged_hdf5_metadata_is_refused_before_the_hdf5_library_reads_it(tmp_path):
    """A byte flip in an HDF5 object header can send the HDF5 library into an endless loop
    (found by the fuzz test): the manifest's metadata checksum refuses the file first."""
    pack = make_pack(_tree(tmp_path / "src"), tmp_path / "pack", backend="hdf5", payload="raw", shard_size=3_000)
    r = open_pack(pack)
    entry = r.shard_entries[0]
    assert entry.data_span is not None and entry.meta_xxh3 is not None
    start, size = entry.data_span
    shard = pack / entry.file
    at = 600 if start > 600 else start + size + 16  # metadata, outside the records' data
    _write_at(shard, at, bytes([shard.read_bytes()[at] ^ 0x01]))
    with pytest.raises(FormatError, match="metadata checksum does not match the manifest.*fastload verify"):
        r.get(0)
    r.close()


# -- property: any single-byte flip of a record is caught ----------------------------------------


@pytest.fixture(scope="module", params=BACKENDS)
def flip_pack(request, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp(f"flip-{request.param}")
    return make_pack(_tree(root / "src"), root / "pack", backend=request.param, payload="png", shard_size=3_000)


@pytest.mark.timeout(300)
def test_any_single_byte_flip_of_a_record_is_caught(flip_pack):
    """Hypothesis picks the record, the byte (payload, or its label in the index) and the XOR
    mask; the flipped record is never served, every other record still is, and restoring the
    byte restores the record."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    locations = {i: _record_at(flip_pack, i) for i in range(N)}
    labels_at, _ = _index_array(flip_pack, "labels")

    @settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
    @given(i=st.integers(0, N - 1), where=st.floats(0, 1, exclude_max=True), mask=st.integers(1, 255),
           in_label=st.booleans())
    def check(i, where, mask, in_label):
        shard, at, payload = locations[i]
        if in_label:  # one of the 8 bytes of its int64 label in index.fli
            path, pos = flip_pack / "index.fli", labels_at + 8 * i + int(where * 8)
        else:
            path, pos = shard, at + int(where * len(payload))
        original = path.read_bytes()[pos]
        _write_at(path, pos, bytes([original ^ mask]))
        try:
            # A label flipped out of the class list is refused when the pack opens; any other
            # flip when the record is read.
            with pytest.raises(FormatError, match=r"record \d+"):
                r = open_pack(flip_pack)
                try:
                    bytes(r.get(i))
                finally:
                    r.close()
            if not in_label:  # the other records of the shard are still served
                r = open_pack(flip_pack)
                neighbour = (i + 1) % N
                assert bytes(r.get(neighbour)) == locations[neighbour][2]
                r.close()
        finally:
            _write_at(path, pos, bytes([original]))
        r = open_pack(flip_pack)
        assert bytes(r.get(i)) == payload
        r.close()

    check()
