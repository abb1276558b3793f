"""The manifest schema: JSON round trip, refused versions, part naming and completeness."""

from __future__ import annotations

import json

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
entries = st.builds(ShardEntry, file=text, num_samples=st.integers(0, 10**6), bytes=st.integers(0, 10**12),
                    sha256=st.text("0123456789abcdef", min_size=64, max_size=64))


@st.composite
def manifests(draw):
    shards = tuple(draw(st.lists(entries, max_size=4)))
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
    with pytest.raises(FormatError, match="different backend"):
        find_manifests(tmp_path)
    write_manifest(tmp_path / manifest_name(1, 3), _part(1, 3))
    assert [m.part for m in find_manifests(tmp_path)] == [0, 1, 2]
    write_manifest(tmp_path / manifest_name(0, 2), _part(0, 2))
    with pytest.raises(FormatError, match="disagree on the number of parts"):
        find_manifests(tmp_path)
    assert not list(tmp_path.glob("*.tmp"))  # writes are atomic renames
