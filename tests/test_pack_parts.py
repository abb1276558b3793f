"""``--part I/N``: each part lists only what it needs, and the parts concatenate to the whole.

Parts are equal contiguous ranges of the global order (``fastload.scan.part_bounds``). A CSV
part streams the file twice (count and labels, then its own rows) and keeps only its rows; a
folder part lists every name and keeps only its share. Either way every part agrees on the
class list, and the parts read together are byte for byte the records of a one-part pack.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from _pack_helpers import make_jpeg_tree, pack_interrupted, tree_bytes
import fastload.scan as scanmod
from fastload.config import PackConfig
from fastload.errors import PackError
from fastload.pack import journal_name, pack
from fastload.scan import list_source, part_bounds
from fastload.schema import manifest_name, read_manifest
from fastload.storage import open_pack


def _csv_source(root: Path, *, rows: int = 23) -> Path:
    """A CSV of ``rows`` samples over a small JPEG tree, with what a real list has: a header,
    blank lines, a quoted path with a comma, and a label ("zebra") that only the last rows use,
    so the first parts only learn it from the rows they do not keep."""
    tree = make_jpeg_tree(root / "img", classes=2, per_class=6)
    files = sorted(p.relative_to(root).as_posix() for p in tree.rglob("*.jpg"))
    odd = root / "img" / "a, b.jpg"
    odd.write_bytes((tree / "c0" / "img000.jpg").read_bytes())
    lines = ["path,label", ""]
    for i in range(rows):
        label = "zebra" if i >= rows - 2 else ("cat", "dog", "ant")[i % 3]
        path = '"img/a, b.jpg"' if i == 5 else files[(i * 5) % len(files)]
        lines.append(f"{path},{label}")
        if i == 10:
            lines.append("   ")
    csv = root / "list.csv"
    csv.write_text("\n".join(lines) + "\n")
    return csv


@pytest.mark.timeout(240)
def test_csv_parts_concatenate_to_the_whole(tmp_path):
    csv = _csv_source(tmp_path)
    cfg = dict(backend="lmdb", payload="png", shard_size=4_000)
    pack(csv, tmp_path / "whole", config=PackConfig(**cfg, workers=1))
    parted = tmp_path / "parted"
    for i in (3, 1, 0, 2):
        pack(csv, parted, config=PackConfig(**cfg, workers=1 + i % 2, part=i, parts=4))
    whole, parts = open_pack(tmp_path / "whole"), open_pack(parted)
    assert len(parts) == len(whole) == 23
    assert [m.num_samples for m in parts.manifests] == [5, 6, 6, 6]
    assert all(m.source_count == 23 for m in parts.manifests)
    assert all(m.classes == ("ant", "cat", "dog", "zebra") for m in parts.manifests)
    assert list(parts.index.paths) == list(whole.index.paths)
    assert parts.index.labels.tolist() == whole.index.labels.tolist()
    assert whole.index.labels.tolist()[-2:] == [3, 3]
    for i in range(23):
        assert bytes(parts.get(i)) == bytes(whole.get(i))


def test_a_csv_part_keeps_only_its_own_rows(tmp_path):
    csv = _csv_source(tmp_path)
    full = list_source(csv)
    for part in range(3):
        lo, hi = part_bounds(part, 3, 23)
        mine = list_source(csv, part=part, parts=3)
        assert (mine.start, mine.total, len(mine)) == (lo, 23, hi - lo)
        assert list(mine.relpaths) == list(full.relpaths)[lo:hi]
        assert mine.labels.tolist() == full.labels.tolist()[lo:hi]
        assert mine.classes == full.classes == ("ant", "cat", "dog", "zebra")
        # only the part's own paths are held, not the whole file's
        assert mine.relpaths.blob.nbytes == sum(len(p.encode()) for p in list(full.relpaths)[lo:hi])


def test_integer_labels_give_every_part_the_same_classes(tmp_path):
    make_jpeg_tree(tmp_path / "img", classes=1, per_class=2)
    csv = tmp_path / "list.csv"
    csv.write_text("img/c0/img000.jpg,0\nimg/c0/img001.jpg,1\nimg/c0/img000.jpg,1\nimg/c0/img001.jpg,7\n")
    listings = [list_source(csv, part=p, parts=2) for p in range(2)]
    assert [x.classes for x in listings] == [tuple(map(str, range(8)))] * 2
    assert [x.labels.tolist() for x in listings] == [[0, 1], [1, 7]]


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 30), parts=st.integers(1, 8), tsv=st.booleans(), header=st.booleans())
def test_csv_part_listings_concatenate_to_the_whole_listing(n, parts, tsv, header):
    with tempfile.TemporaryDirectory() as d:
        sep = "\t" if tsv else ","
        csv = Path(d) / ("list.tsv" if tsv else "list.csv")
        rows = ([f"path{sep}label"] if header else []) + [f"x/{i}.jpg{sep}{'lbl' + str(i * 7 % 5)}" for i in range(n)]
        csv.write_text("\n".join(rows) + "\n")
        full = list_source(csv)
        got = [list_source(csv, part=p, parts=parts) for p in range(parts)]
    assert [x.start for x in got] == [part_bounds(p, parts, n)[0] for p in range(parts)]
    assert sum((list(x.relpaths) for x in got), []) == list(full.relpaths)
    assert np.concatenate([x.labels for x in got]).tolist() == full.labels.tolist()
    assert all(x.classes == full.classes and x.total == n for x in got)


@pytest.mark.parametrize("parts", [1, 2, 3, 5, 13])
def test_folder_part_listings_concatenate_to_the_whole_listing(tmp_path, parts):
    src = tmp_path / "src"
    for c, k in (("a", 3), ("b", 0), ("c", 5)):
        (src / c / "sub").mkdir(parents=True)
        for i in range(k):
            (src / c / f"{i}.jpg").write_bytes(b"x")
    (src / "b" / "sub" / "deep.png").write_bytes(b"x")
    os.symlink("..", src / "a" / "sub" / "up")  # a loop: listed as skipped, in every part's listing
    full = list_source(src)
    got = [list_source(src, part=p, parts=parts) for p in range(parts)]
    assert sum((list(x.relpaths) for x in got), []) == list(full.relpaths)
    assert np.concatenate([x.labels for x in got]).tolist() == full.labels.tolist() == [0] * 3 + [1] + [2] * 5
    assert all(x.classes == ("a", "b", "c") and x.total == 9 and x.skipped == full.skipped for x in got)


def test_every_part_reports_a_bad_row_anywhere_in_the_csv(tmp_path):
    """The first pass reads the whole file, so a part whose own rows are fine still refuses a
    CSV with a broken row elsewhere: no part packs from a list another part rejects."""
    csv = tmp_path / "bad.csv"
    csv.write_text("a.jpg,x\nb.jpg,y\nc.jpg,y\nd.jpg\n")
    for part in range(3):
        with pytest.raises(PackError, match=r"bad\.csv:4: expected 2 columns"):
            list_source(csv, part=part, parts=3)


def test_a_csv_edited_between_the_two_passes_is_refused(tmp_path, monkeypatch):
    csv = tmp_path / "list.csv"
    csv.write_text("".join(f"{i}.jpg,c\n" for i in range(10)))
    first_pass = scanmod._read_csv

    def read_then_append(path, *args, **kw):
        rows = first_pass(path, *args, **kw)
        with open(path, "a") as f:  # another job rewrites the list while this part reads it
            f.write("late.jpg,c\n")
        return rows

    monkeypatch.setattr(scanmod, "_read_csv", read_then_append)
    with pytest.raises(PackError, match=r"list\.csv: the file changed while it was read; rerun"):
        list_source(csv, part=1, parts=2)



@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["csv", "folder"])
def test_a_resumed_part_equals_an_uninterrupted_one(tmp_path, kind):
    src = _csv_source(tmp_path) if kind == "csv" else make_jpeg_tree(tmp_path / "src", classes=3, per_class=7)
    cfg = PackConfig(backend="hdf5", payload="png", workers=1, shard_size=3_000, part=1, parts=3)
    pack(src, tmp_path / "clean", config=cfg)
    dest = tmp_path / "dest"
    pack_interrupted(src, dest, cfg, after_shards=1)
    journal = json.loads((dest / journal_name(1, 3)).read_text())
    assert len(journal["shards"]) == 1
    s = pack(src, dest, config=cfg)
    assert s.resumed_shards == 1 and s.resumed_from == journal["ends"][0]
    assert tree_bytes(dest) == tree_bytes(tmp_path / "clean")
    m = read_manifest(dest / manifest_name(1, 3))
    assert m.num_samples == len(list_source(src, part=1, parts=3)) and m.source_count == list_source(src).total


@pytest.mark.timeout(120)
def test_a_csv_part_is_byte_identical_for_any_worker_count(tmp_path):
    csv = _csv_source(tmp_path)
    outs = []
    for w in (1, 2):
        pack(csv, tmp_path / f"w{w}", config=PackConfig(payload="jpeg", workers=w, shard_size=3_000, part=2, parts=3))
        outs.append(tree_bytes(tmp_path / f"w{w}"))
    assert outs[0] == outs[1] and len(outs[0]) > 2


def test_a_part_with_no_rows_of_its_own_still_finishes(tmp_path):
    make_jpeg_tree(tmp_path / "img", classes=1, per_class=2)
    csv = tmp_path / "list.csv"
    csv.write_text("img/c0/img000.jpg,a\nimg/c0/img001.jpg,b\n")
    for part in range(3):
        pack(csv, tmp_path / "out", config=PackConfig(workers=1, part=part, parts=3))
    r = open_pack(tmp_path / "out")
    assert [m.num_samples for m in r.manifests] == [0, 1, 1] and len(r) == 2
    assert all(m.classes == ("a", "b") for m in r.manifests)
