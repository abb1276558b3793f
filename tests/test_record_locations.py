"""Record locations in the shared index file (issue 16): an LMDB pack's index.fli says where
every record lies in its shard, so a reader slices records from shared maps instead of walking
each shard's B-tree into private per-record arrays in every process. Real packs, real child
processes; a damaged location is an error naming the record and shard, never a crash or
wrong data; packs without the sections still read through the walk."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from _data_helpers import make_pack
from _pack_helpers import make_jpeg_tree, synthetic_lmdb_pack, tree_bytes
from fastload.config import PackConfig
from fastload.errors import FormatError
from fastload.pack import pack
from fastload.schema import manifest_checksum
from fastload.storage import lmdb_backend, open_pack
from fastload.storage.index_file import read_index_file, write_index_file


@pytest.fixture(scope="module")
def lmdb_pack(tmp_path_factory) -> Path:
    """A 4-shard LMDB pack of 24 JPEGs."""
    base = tmp_path_factory.mktemp("loc")
    src = make_jpeg_tree(base / "src", classes=3, per_class=8)
    return make_pack(src, base / "pack", backend="lmdb", shard_size=4_000)


def _copy(pack_dir: Path, dest: Path) -> Path:
    import shutil

    shutil.copytree(pack_dir, dest)
    return dest


def _rewrite_index(pack_dir: Path, change) -> None:
    """Rewrite ``pack_dir``'s index.fli as ``change(ShardIndex)`` gives it, and the manifest to
    list it (size, SHA-256, checksum), as a pack written that way would be."""
    m = json.loads((pack_dir / "manifest.json").read_text())
    index = read_index_file(pack_dir / "index.fli")
    index = change(dataclasses.replace(index, **{f: (None if getattr(index, f) is None else np.array(getattr(index, f)))
                                                 for f in ("record_offsets", "record_sizes", "pack_id_at")}))
    size, digest = write_index_file(pack_dir / "index.fli.new", index, pack_id=m["pack_id"])
    os.replace(pack_dir / "index.fli.new", pack_dir / "index.fli")
    m["index"].update(bytes=size, sha256=digest)
    m["checksum"] = manifest_checksum(m)
    (pack_dir / "manifest.json").write_text(json.dumps(m))


def strip_locations(pack_dir: Path) -> None:
    """Make ``pack_dir`` an LMDB pack as fastload wrote it before record locations (its readers walk)."""
    _rewrite_index(pack_dir, lambda ix: dataclasses.replace(ix, record_offsets=None, record_sizes=None,
                                                            pack_id_at=None))


def test_index_file_holds_the_walks_locations(lmdb_pack):
    r = open_pack(lmdb_pack)
    part = r.index.part(0)
    assert part.record_offsets.dtype == np.uint64 and part.record_sizes.dtype == np.uint32
    assert len(part.pack_id_at) == len(r.shard_entries) > 1
    for k, e in enumerate(r.shard_entries):
        a, b = int(r.shard_starts[k]), int(r.shard_starts[k + 1])
        table = lmdb_backend.check_lmdb_structure(lmdb_pack / e.file)
        off, size = table.records(e.num_samples, e.file)
        assert np.array_equal(part.record_offsets[a:b], off) and np.array_equal(part.record_sizes[a:b], size)
        assert tuple(part.pack_id_at[k]) == table.value_at(b"\xffpack_id")
        assert int(part.record_sizes[a:b].sum()) == sum(len(r.get(i)) for i in range(a, b))


def test_reading_every_record_walks_no_shard(lmdb_pack, monkeypatch):
    calls = []
    walk = lmdb_backend.check_lmdb_structure
    monkeypatch.setattr(lmdb_backend, "check_lmdb_structure", lambda *a, **k: calls.append(a) or walk(*a, **k))
    r = open_pack(lmdb_pack)
    payloads = [bytes(r.get(i)) for i in range(len(r))]
    assert calls == []
    assert r.has_checksums and len(set(payloads)) == len(r)  # every read checked against its checksum
    # verify still walks every shard (and compares the stored locations with it)
    from fastload.commands.verify import verify_pack

    problems, _ = verify_pack(lmdb_pack)
    assert not problems and len(calls) >= len(r.shard_entries)


def test_pack_without_locations_reads_through_the_walk(lmdb_pack, tmp_path, monkeypatch):
    old = _copy(lmdb_pack, tmp_path / "old")
    strip_locations(old)
    assert read_index_file(old / "index.fli").record_offsets is None
    calls = []
    walk = lmdb_backend.check_lmdb_structure
    monkeypatch.setattr(lmdb_backend, "check_lmdb_structure", lambda *a, **k: calls.append(a) or walk(*a, **k))
    new, r = open_pack(lmdb_pack), open_pack(old)
    assert [bytes(r.get(i)) for i in range(len(r))] == [bytes(new.get(i)) for i in range(len(new))]
    assert len(calls) == len(r.shard_entries)


_READ_ALL = r"""
import sys
from fastload.errors import FastloadError
from fastload.storage import open_pack
r = open_pack(sys.argv[1])
for i in range(len(r)):
    try:
        r.get(i)
    except FastloadError as exc:
        print(type(exc).__name__, "|", exc)
"""


def _read_all_in_child(pack_dir: Path) -> list[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    out = subprocess.run([sys.executable, "-c", _READ_ALL, str(pack_dir)], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]  # never a crash
    return out.stdout.splitlines()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("damage", ["offset past the end", "offset of another record", "size + 1", "size huge"])
def test_a_damaged_location_is_an_error_naming_record_and_shard(lmdb_pack, tmp_path, damage):
    bad = _copy(lmdb_pack, tmp_path / "bad")
    r = open_pack(bad)
    k, j = 1, 2  # record 2 of the second shard
    g = int(r.shard_starts[k]) + j

    def change(ix):
        if damage == "offset past the end":
            ix.record_offsets[g] = np.uint64(1 << 62)
        elif damage == "offset of another record":
            ix.record_offsets[g] = ix.record_offsets[g + 1]
        elif damage == "size + 1":
            ix.record_sizes[g] += np.uint32(1)
        else:
            ix.record_sizes[g] = np.uint32(0xFFFFFFFF)
        return ix

    _rewrite_index(bad, change)
    lines = _read_all_in_child(bad)
    assert len(lines) == 1, lines  # only that record; every other still reads
    kind, msg = lines[0].split(" | ", 1)
    assert kind in ("FormatError", "CorruptRecordError")
    assert f"record {j}" in msg and r.shard_entries[k].file in msg
    from fastload.commands.verify import verify_pack

    problems, _ = verify_pack(bad)
    assert any("location" in p and r.shard_entries[k].file in p for p in problems), problems


def test_a_damaged_pack_id_location_falls_back_to_the_walk(lmdb_pack, tmp_path):
    bad = _copy(lmdb_pack, tmp_path / "bad")

    def change(ix):
        ix.pack_id_at[0, 0] = np.uint64(1 << 62)
        return ix

    _rewrite_index(bad, change)
    r = open_pack(bad)
    assert [bytes(r.get(i)) for i in range(len(r))] == [bytes(open_pack(lmdb_pack).get(i)) for i in range(len(r))]


def test_location_sections_are_validated_when_mapped(lmdb_pack, tmp_path):
    bad = _copy(lmdb_pack, tmp_path / "bad")

    def change(ix):  # one record short: a section size that disagrees with the others
        return dataclasses.replace(ix, record_sizes=ix.record_sizes[:-1])

    with pytest.raises(ValueError):  # the writer refuses it ...
        _rewrite_index(bad, change)
    raw = bytearray((lmdb_pack / "index.fli").read_bytes())
    head_len = int.from_bytes(raw[8:16], "little")
    header = json.loads(raw[16 : 16 + head_len])
    header["sections"]["record_sizes"][1] -= 4  # ... and the reader refuses a file that says so
    new = json.dumps(header).encode()
    raw[8:16] = len(new).to_bytes(8, "little")
    raw[16 : 16 + len(new)] = new
    (bad / "index.fli").write_bytes(bytes(raw))
    with pytest.raises(FormatError, match="index.fli: damaged index file"):
        read_index_file(bad / "index.fli")


def test_packs_are_byte_identical_for_any_worker_count_and_on_resume(tmp_path):
    from _pack_helpers import pack_interrupted

    src = make_jpeg_tree(tmp_path / "src", classes=2, per_class=10)
    outs = []
    for w in (1, 2):
        pack(src, tmp_path / f"w{w}", config=PackConfig(backend="lmdb", workers=w, shard_size=3_500))
        outs.append(tree_bytes(tmp_path / f"w{w}"))
    assert outs[0] == outs[1]
    assert read_index_file(tmp_path / "w1" / "index.fli").record_offsets is not None
    cfg = PackConfig(backend="lmdb", workers=1, shard_size=3_500)
    pack_interrupted(src, tmp_path / "resumed", cfg, after_shards=2)
    pack(src, tmp_path / "resumed", config=cfg)
    assert tree_bytes(tmp_path / "resumed") == outs[0]


_READ_ALL_ANON = r"""
import sys
from fastload.storage import open_pack

def anon():
    s = dict(l.split(":", 1) for l in open("/proc/self/status").read().splitlines() if ":" in l)
    return int(s["RssAnon"].split()[0])

r = open_pack(sys.argv[1])
r.index  # mapped: what the index costs is test_index_sharing's; this measures the shard's open and reads
before = anon()
total = sum(len(r.get(i)) for i in range(len(r)))
print(anon() - before, total)
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_reading_every_record_adds_no_private_memory_per_record(tmp_path):
    """300k records: the walk's private (offset, size) table would be 4.8 MB in every process
    that reads the shard; through the index file's shared locations it adds almost nothing."""
    grew = {}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    for n in (1000, 300_000):
        p = synthetic_lmdb_pack(tmp_path / f"p{n}", n)
        out = subprocess.run([sys.executable, "-c", _READ_ALL_ANON, str(p)], capture_output=True, text=True,
                             env=env, timeout=240)
        assert out.returncode == 0, out.stderr[-2000:]
        kb, total = out.stdout.split()
        assert int(total) == n * len(bytes(open_pack(p).get(0)))
        grew[n] = int(kb)
    assert grew[300_000] - grew[1000] < 1024, grew  # KiB; the walk's table alone would add ~4,700
