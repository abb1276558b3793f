"""The manifest schema: JSON round trip, refused versions, part naming and completeness."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastload.errors import FormatError
from fastload.schema import (
    FORMAT_VERSION,
    Manifest,
    ShardEntry,
    SkippedInput,
    find_manifests,
    manifest_name,
    read_manifest,
    shard_name,
    write_manifest,
)

text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)
# Shard file names are plain names inside the pack (the schema refuses anything else).
names = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="/\\\0"), min_size=1,
                max_size=12).filter(lambda n: n not in (".", ".."))
entries = st.builds(ShardEntry, file=names, num_samples=st.integers(0, 10**6), bytes=st.integers(0, 10**12),
                    sha256=st.text("0123456789abcdef", min_size=64, max_size=64))


@st.composite
def manifests(draw):
    shards = tuple(draw(st.lists(entries, max_size=4, unique_by=lambda e: e.file)))
    parts = draw(st.integers(1, 5))
    shape = draw(st.none() | st.tuples(st.integers(1, 4096), st.integers(1, 4096), st.just(3)))
    return Manifest(
        backend=draw(st.sampled_from(["lmdb", "hdf5"])),
        payload=draw(st.sampled_from(["jpeg", "bmp", "png", "raw", "original"])),
        num_samples=sum(s.num_samples for s in shards),
        classes=tuple(draw(st.lists(text, max_size=5, unique=True))),
        shards=shards,
        image_shape=shape,
        options=draw(st.fixed_dictionaries({"quality": st.integers(1, 100), "resize": st.none() | st.integers(1, 999)})),
        skipped=tuple(draw(st.lists(st.builds(SkippedInput, path=text, reason=text), max_size=3))),
        part=draw(st.integers(0, parts - 1)),
        parts=parts,
        source_count=draw(st.integers(0, 10**6)),
        pack_id=draw(st.none() | st.text("0123456789abcdef", min_size=32, max_size=32)),
    )


@settings(max_examples=60, deadline=None)
@given(m=manifests())
def test_manifest_round_trips_through_json(m):
    d = json.loads(m.to_json())
    assert list(d)[:5] == ["format", "version", "backend", "payload", "num_samples"]
    assert d["class_to_idx"] == {c: i for i, c in enumerate(m.classes)}
    assert Manifest.from_dict(d) == m


def _base(**kw) -> dict:
    m = Manifest(backend="lmdb", payload="jpeg", num_samples=3, classes=("a",),
                 shards=(ShardEntry("shard-00000.lmdb", 3, 10, "0" * 64),))
    d = m.to_dict()
    d.update(kw)
    return d


@pytest.mark.parametrize("version", [FORMAT_VERSION + 1, 0, "1", None])
def test_refuses_unknown_versions(version):
    with pytest.raises(FormatError, match="version"):
        Manifest.from_dict(_base(version=version), where="m.json")


def test_refuses_bad_manifests():
    with pytest.raises(FormatError, match="not a fastload manifest"):
        Manifest.from_dict(_base(format="other"))
    with pytest.raises(FormatError, match="unknown backend"):
        Manifest.from_dict(_base(backend="zip"))
    with pytest.raises(FormatError, match="do not add up"):
        Manifest.from_dict(_base(num_samples=4))
    d = _base()
    del d["shards"]
    with pytest.raises(FormatError, match="malformed"):
        Manifest.from_dict(d)
    with pytest.raises(FormatError, match="not a fastload manifest"):
        Manifest.from_dict([])  # valid JSON, but not an object
    d = _base()
    d["shards"][0]["num_samples"] = "3"
    with pytest.raises(FormatError, match="bad shard entry"):
        Manifest.from_dict(d)


def test_read_manifest_errors_name_the_file(tmp_path):
    with pytest.raises(FormatError, match="manifest not found"):
        read_manifest(tmp_path / "manifest.json")
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(FormatError, match=r"manifest\.json: manifest is not valid JSON"):
        read_manifest(tmp_path / "manifest.json")
    (tmp_path / "manifest.json").write_bytes(b'{"format": "\xff"}')
    with pytest.raises(FormatError, match=r"manifest\.json: manifest is not UTF-8"):
        read_manifest(tmp_path / "manifest.json")
    future = _base(version=FORMAT_VERSION + 1)
    (tmp_path / "manifest.json").write_text(json.dumps(future))
    with pytest.raises(FormatError, match="upgrade fastload"):
        read_manifest(tmp_path / "manifest.json")


def test_names():
    assert manifest_name(0, 1) == "manifest.json"
    assert manifest_name(3, 12) == "manifest-p00003-of-00012.json"
    assert shard_name("lmdb", 0, 1, 7) == "shard-00007.lmdb"
    assert shard_name("hdf5", 2, 4, 0) == "p00002-of-00004-shard-00000.h5"


def _part(i: int, n: int, **kw) -> Manifest:
    return Manifest(backend=kw.get("backend", "lmdb"), payload="jpeg", num_samples=0, classes=("a",),
                    shards=(), part=i, parts=n)


def test_find_manifests_parts(tmp_path):
    with pytest.raises(FormatError, match="no such directory"):
        find_manifests(tmp_path / "nope")
    with pytest.raises(FormatError, match="no manifest.json"):
        find_manifests(tmp_path)
    for i in (2, 0):
        write_manifest(tmp_path / manifest_name(i, 3), _part(i, 3))
    with pytest.raises(FormatError, match=r"1 of 3 parts missing \(parts \[1\]"):
        find_manifests(tmp_path)
    write_manifest(tmp_path / manifest_name(1, 3), _part(1, 3, backend="hdf5"))
    with pytest.raises(FormatError, match=r"manifest-p00000-of-00003.json and .*manifest-p00001-of-00003.json disagree on backend"):
        find_manifests(tmp_path)
    write_manifest(tmp_path / manifest_name(1, 3), _part(1, 3))
    assert [m.part for m in find_manifests(tmp_path)] == [0, 1, 2]
    write_manifest(tmp_path / manifest_name(0, 2), _part(0, 2))
    with pytest.raises(FormatError, match="disagree on the number of parts"):
        find_manifests(tmp_path)
    assert not list(tmp_path.glob("*.tmp"))  # writes are atomic renames


# -- the manifest's own checksum ------------------------------------------------------------------


def _sealed(tmp_path, **kw) -> tuple:
    m = Manifest(backend="lmdb", payload="jpeg", num_samples=3, classes=("cat", "dog", "émeu"),
                 shards=(ShardEntry(file="shard-00000.lmdb", num_samples=3, bytes=4096, sha256="ab" * 32),),
                 options={"quality": 90, "resize": None}, source="/data/train", source_count=3,
                 skipped=(SkippedInput(path="bad.jpg", reason="not an image"),), pack_id="0123abcd" * 4, **kw)
    path = tmp_path / "manifest.json"
    write_manifest(path, m)
    return m, path


@settings(max_examples=40, deadline=None)
@given(m=manifests())
def test_every_written_manifest_is_sealed_and_reads_back(tmp_path_factory, m):
    path = tmp_path_factory.mktemp("m") / "manifest.json"
    write_manifest(path, m)
    d = json.loads(path.read_text(encoding="utf-8"))
    assert list(d)[-1] == "checksum" and d["checksum"].startswith("xxh3:")
    assert read_manifest(path) == m
    write_manifest(path.with_name("again.json"), m)  # deterministic: packs stay byte-identical
    assert path.with_name("again.json").read_bytes() == path.read_bytes()


def test_every_single_bit_flip_of_a_manifest_reads_exact_or_fails_cleanly(tmp_path):
    """A flipped bit anywhere (class names, source path, hashes, keys, the checksum itself)
    gives the same manifest back or a one-line FormatError: never a different manifest."""
    m, path = _sealed(tmp_path)
    good = path.read_bytes()
    damaged = tmp_path / "damaged.json"
    wrong, caught = [], 0
    for at in range(len(good)):
        for bit in (0, 5):  # a low bit (a letter or digit changes) and 0x20 (case, space)
            b = bytearray(good)
            b[at] ^= 1 << bit
            damaged.write_bytes(bytes(b))
            try:
                got = read_manifest(damaged)
            except FormatError as exc:
                assert "\n" not in str(exc) and str(damaged) in str(exc)
                caught += 1
                continue
            if got != m:
                wrong.append((at, bit, good[max(0, at - 20) : at + 20]))
    assert not wrong, wrong[:5]
    assert caught > len(good)  # nearly every flip is caught (a few hit JSON whitespace harmlessly)


@pytest.mark.parametrize("edit", ["class", "source", "sha256", "skipped", "checksum", "checksum_key"])
def test_an_edited_manifest_is_refused_naming_it_and_verify(tmp_path, edit):
    _, path = _sealed(tmp_path)
    text = path.read_text(encoding="utf-8")
    old, new = {"class": ('"dog"', '"dig"'), "source": ("/data/train", "/data/trail"),
                "sha256": ("abab", "abac"), "skipped": ("not an image", "not an imago"),
                "checksum": ('"xxh3:', '"xxh3:0'), "checksum_key": ('"checksum"', '"checksun"')}[edit]
    assert text.count(old) >= 1
    path.write_text(text.replace(old, new, 1), encoding="utf-8")
    with pytest.raises(FormatError, match=r"manifest.json: manifest damaged or edited .*run `fastload verify`"):
        read_manifest(path)


def test_manifests_written_before_checksums_still_read(tmp_path):
    m, path = _sealed(tmp_path)
    d = json.loads(path.read_text(encoding="utf-8"))
    del d["checksum"], d["pack_id"]  # what an older fastload wrote
    path.write_text(json.dumps(d, indent=1), encoding="utf-8")
    assert read_manifest(path).classes == m.classes
    d["pack_id"] = m.pack_id  # a pack id came before checksums: with one, the checksum is required
    path.write_text(json.dumps(d, indent=1), encoding="utf-8")
    with pytest.raises(FormatError, match="damaged or edited"):
        read_manifest(path)


def test_a_damaged_checksum_key_is_refused_even_without_a_pack_id(tmp_path):
    m = Manifest(backend="lmdb", payload="raw", num_samples=0, classes=("a",), shards=())
    path = tmp_path / "manifest.json"
    write_manifest(path, m)
    path.write_text(path.read_text().replace('"checksum"', '"checksuM"'))
    with pytest.raises(FormatError, match="damaged or edited"):
        read_manifest(path)
    d = json.loads(path.read_text())
    del d["checksuM"], d["pack_id"]  # a manifest as written before checksums and pack ids: reads
    path.write_text(json.dumps(d))
    assert read_manifest(path) == m


def test_the_checksum_does_not_depend_on_layout(tmp_path):
    m, path = _sealed(tmp_path)
    d = json.loads(path.read_text(encoding="utf-8"))
    path.write_text(json.dumps(dict(reversed(list(d.items()))), ensure_ascii=False), encoding="utf-8")
    assert read_manifest(path) == m


# -- parts that disagree ----------------------------------------------------------------------------


@pytest.mark.parametrize("field_, value, says", [
    ("classes", ("a", "c"), r"classes \(2 vs 2; first difference at class 1: 'b' vs 'c'\)"),
    ("classes", ("a",), r"classes \(2 vs 1; first difference at class 1: 'b' vs None\)"),
    ("source_count", 11, r"source_count \(10 vs 11\)"),
    ("payload", "png", r"payload \('jpeg' vs 'png'\)"),
    ("options", {"quality": 80, "shard_size": 1}, r"options \(\{'quality': 90\} vs \{'quality': 80\}\)"),
])
def test_parts_that_disagree_are_refused_naming_both_manifests(tmp_path, field_, value, says):
    base = dict(backend="lmdb", payload="jpeg", num_samples=0, classes=("a", "b"), shards=(), parts=2,
                source_count=10, options={"quality": 90, "shard_size": 1 << 30})
    write_manifest(tmp_path / manifest_name(0, 2), Manifest(**base, part=0))
    write_manifest(tmp_path / manifest_name(1, 2), Manifest(**{**base, field_: value}, part=1))
    with pytest.raises(FormatError) as info:
        find_manifests(tmp_path)
    msg = str(info.value)
    assert "\n" not in msg
    assert f"{tmp_path / manifest_name(0, 2)} and {tmp_path / manifest_name(1, 2)} disagree on " in msg
    assert re.search(says, msg), msg
    assert "repack part 1" in msg


def test_parts_may_differ_in_shard_size_and_source_folder(tmp_path):
    base = dict(backend="lmdb", payload="jpeg", num_samples=0, classes=("a", "b"), shards=(), parts=2,
                source_count=10)
    write_manifest(tmp_path / manifest_name(0, 2), Manifest(**base, part=0, options={"shard_size": 1}, source="/a"))
    write_manifest(tmp_path / manifest_name(1, 2), Manifest(**base, part=1, options={"shard_size": 2}, source="/b"))
    assert [m.part for m in find_manifests(tmp_path)] == [0, 1]


def test_a_part_manifest_under_another_parts_name_is_refused(tmp_path):
    base = dict(backend="lmdb", payload="jpeg", num_samples=0, classes=("a",), shards=(), parts=2)
    write_manifest(tmp_path / manifest_name(0, 2), Manifest(**base, part=0))
    write_manifest(tmp_path / manifest_name(1, 2), Manifest(**base, part=0))  # copied over part 1's
    with pytest.raises(FormatError, match=r"manifest-p00001-of-00002.json: says it is part 0 of 2, its name says 1 of 2"):
        find_manifests(tmp_path)
