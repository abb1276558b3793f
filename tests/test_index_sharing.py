"""One copy of a pack's index per node (issue 16): the dataset reads labels, shapes and paths
from memory maps of the pack's index files, a pickle carries only their paths, DataLoader
workers (fork and spawn) map the same file instead of holding a private copy, and paths are
decoded only when asked for. Real packs, real worker processes."""

from __future__ import annotations

import functools
import json
import os
import pickle
from pathlib import Path

import numpy as np
import pytest

from _data_helpers import make_pack
from _pack_helpers import synthetic_lmdb_pack
from fastload.commands.inspect import describe, shape_range_of
from fastload.data.dataset import ImageFolder
from fastload.schema import manifest_checksum
from fastload.storage import open_pack
from fastload.storage.pack_index import PackIndex, PartedArray, PartedStrings


def _tree(root: Path, n: int, *, classes: int = 3, varied: bool = False) -> Path:
    """``n`` tiny PNGs in ``classes`` folders; with ``varied`` their sizes differ."""
    import cv2

    rng = np.random.default_rng(n)
    for i in range(n):
        d = root / f"c{i % classes}"
        d.mkdir(parents=True, exist_ok=True)
        h, w = (3 + i % 7, 4 + (i * 3) % 5) if varied else (4, 4)
        cv2.imwrite(str(d / f"img{i:05d}.png"), rng.integers(0, 255, (h, w, 3), dtype=np.uint8))
    return root


@pytest.fixture(scope="module")
def packs(tmp_path_factory) -> dict[str, Path]:
    """Packs of 100 and 2,000 records (same name length), and a 3-part pack of varied sizes."""
    base = tmp_path_factory.mktemp("packs")
    out = {}
    for n in (100, 2000):
        out[str(n)] = make_pack(_tree(base / f"src{n:05d}", n), base / f"pack{n:05d}", payload="png")
    src = _tree(base / "src-varied", 60, varied=True)
    for part in range(3):
        make_pack(src, base / "parts", payload="png", part=part, parts=3)
    out["parts"] = base / "parts"
    out["parts-src"] = src
    return out


def _source_pairs(src: Path) -> list[tuple[str, int]]:
    """(path, class index) in torchvision's order, from the source tree itself."""
    classes = sorted(p.name for p in src.iterdir())
    return [(str(f), c) for c, name in enumerate(classes) for f in sorted((src / name).iterdir())]


def test_index_is_a_read_only_map_of_the_index_file(packs):
    ds = ImageFolder(packs["100"])
    for arr in (ds._labels, ds._shapes):
        assert isinstance(arr, np.memmap) and not arr.flags.writeable
        assert Path(arr.filename).name == "index.fli"
    # targets hands out the mapped array itself: no copy of N labels
    assert np.shares_memory(np.asarray(ds.targets), ds._labels)
    table = ds.reader.index.paths
    assert _maps_a_file(table.blob) and _maps_a_file(table.offsets)


def _maps_a_file(a) -> bool:
    """``a`` is a view of a memory-mapped file (an np.memmap somewhere down its ``.base`` chain)."""
    import mmap

    while a is not None:
        if isinstance(a, (np.memmap, mmap.mmap)):
            return True
        a = getattr(a, "base", None)
    return False


def test_pickle_size_does_not_grow_with_the_pack(packs):
    small, large = ImageFolder(packs["100"]), ImageFolder(packs["2000"])
    for ds in (small, large):  # touch everything a worker touches: labels, shapes, paths, a record
        np.asarray(ds.targets).sum()
        ds.path(len(ds) - 1)
        ds[0]
    a, b = len(pickle.dumps(small)), len(pickle.dumps(large))
    assert abs(a - b) < 300, (a, b)
    back = pickle.loads(pickle.dumps(large))
    assert back.reader.index._fields is None  # mapped again lazily, on first use
    assert np.array_equal(np.asarray(back.targets), np.asarray(large.targets))
    assert isinstance(back._labels, np.memmap)
    assert back.samples[1999] == large.samples[1999]


def test_paths_and_samples_match_the_source_tree_and_are_decoded_on_demand(packs):
    ds = ImageFolder(packs["100"])
    want = _source_pairs(packs["100"].parent / "src00100")
    assert ds.path(7) == want[7][0] and ds.path(-1) == want[-1][0]
    assert list(ds.samples) == want
    assert ds.samples[10:13] == want[10:13]
    assert ds.targets == [c for _, c in want]
    with pytest.raises(IndexError):
        ds.samples[len(ds)]
    # nothing holds the decoded paths: the dataset and its reader keep no list or tuple of N
    held = [v for obj in (ds, ds.reader, ds.reader.index) for v in vars(obj).values()]
    assert not any(isinstance(v, (list, tuple)) and len(v) >= len(ds) for v in held)


def test_multi_part_pack_is_routed_over_per_part_maps(packs):
    ds = ImageFolder(packs["parts"])
    want = _source_pairs(packs["parts-src"])
    assert len(ds) == len(want) == 60
    index = ds.reader.index
    assert isinstance(index, PackIndex) and len(index.files) == 3
    assert isinstance(ds._labels, PartedArray) and isinstance(index.paths, PartedStrings)
    assert all(isinstance(p, np.memmap) for p in ds._labels.parts + ds._shapes.parts)
    assert list(ds.samples) == want and ds.targets == [c for _, c in want]
    # every way the dataset and loaders index them agrees with one joined array
    labels, shapes = np.asarray(ds._labels), np.asarray(ds._shapes)
    idx = np.array([59, 0, 19, 20, 21, 40, 39, -1])
    assert np.array_equal(ds._labels[idx], labels[idx])
    assert np.array_equal(ds._shapes[idx, :2], shapes[idx, :2])
    assert np.array_equal(ds._shapes[5:45], shapes[5:45]) and np.array_equal(ds._shapes[::7], shapes[::7])
    assert np.array_equal(ds._shapes[:, 0], shapes[:, 0])
    assert [int(ds._labels[i]) for i in range(-60, 60)] == labels[np.arange(-60, 60)].tolist()
    assert np.array_equal(ds._shapes.min(axis=0), shapes.min(axis=0))
    assert np.array_equal(ds._shapes.max(axis=0), shapes.max(axis=0))
    with pytest.raises(IndexError):
        ds._labels[60]
    with pytest.raises(IndexError):
        ds._labels[np.array([3, 60])]
    # a pickle carries the three files' paths, not their contents; they are mapped again on use
    back = pickle.loads(pickle.dumps(ds))
    assert back.reader.index._fields is None and back.reader.index.files == index.files
    assert list(back.samples) == want


def _record_worker(out_dir: Path, worker_id: int) -> None:
    """worker_init_fn: what this worker's copy of the dataset holds, after touching every label,
    shape and one path as an epoch would."""
    import torch.utils.data as tud

    ds = tud.get_worker_info().dataset
    total = int(np.asarray(ds.targets).sum()) + int(np.asarray(ds._shapes).sum() > 0)
    ds.path(len(ds) - 1)
    maps = Path("/proc/self/maps").read_text()
    info = {
        "pid": os.getpid(),
        "labels_memmap": isinstance(ds._labels, np.memmap),
        "labels_file": str(getattr(ds._labels, "filename", "")),
        "shapes_memmap": isinstance(ds._shapes, np.memmap),
        "index_mapped": any(line.endswith("index.fli") for line in maps.splitlines()),
        "label_sum": total,
    }
    (out_dir / f"worker{worker_id}-{os.getpid()}.json").write_text(json.dumps(info))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_workers_map_the_shared_index_file(packs, tmp_path, method):
    torch = pytest.importorskip("torch")
    ds = ImageFolder(packs["2000"])
    expected = int(np.asarray(ds.targets).sum()) + 1
    loader = torch.utils.data.DataLoader(
        ds, batch_size=50, num_workers=2, multiprocessing_context=method,
        worker_init_fn=functools.partial(_record_worker, tmp_path),
    )
    seen = 0
    for k, (images, targets) in enumerate(loader):
        seen += len(targets)
        if k == 3:
            break
    del loader
    assert seen == 200
    reports = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("worker*.json"))]
    assert len(reports) == 2 and {r["pid"] for r in reports}.isdisjoint({os.getpid()})
    for r in reports:
        assert r["labels_memmap"] and r["shapes_memmap"] and r["index_mapped"], r
        assert Path(r["labels_file"]).resolve() == (packs["2000"] / "index.fli").resolve()
        assert r["label_sum"] == expected


def test_inspect_shape_range_in_chunks_matches_the_whole_array(packs):
    r = open_pack(packs["parts"])
    shapes = np.asarray(r.index.shapes)
    want = [shapes.min(axis=0).tolist(), shapes.max(axis=0).tolist()]
    assert want[0] != want[1]  # the sizes do vary
    for chunk in (1, 7, 20, 1 << 18):
        assert shape_range_of(open_pack(packs["parts"]), chunk=chunk) == want
    d = describe(packs["parts"], skipped_limit=5)
    assert d["image_shape"] is None and d["image_shape_range"] == want
    assert d["num_samples"] == 60 and d["parts"] == 3


def test_pack_without_index_file_still_reads_and_pickles(packs, tmp_path):
    """Packs made before index files: the index comes from the shards (a private copy)."""
    import shutil

    old = tmp_path / "old"
    shutil.copytree(packs["100"], old)
    (old / "index.fli").unlink()
    m = json.loads((old / "manifest.json").read_text())
    m["index"] = None
    m["checksum"] = manifest_checksum(m)
    (old / "manifest.json").write_text(json.dumps(m))
    ds, new = ImageFolder(old), ImageFolder(packs["100"])
    assert ds.targets == new.targets and list(ds.samples) == list(new.samples)
    back = pickle.loads(pickle.dumps(ds))
    assert back.targets == new.targets and back.path(5) == new.path(5)
    assert shape_range_of(open_pack(old)) == shape_range_of(open_pack(packs["100"]))


def test_inspect_lists_a_few_skipped_inputs_unless_asked_for_all(tmp_path):
    src = _tree(tmp_path / "src", 6)
    for k in range(8):
        (src / "c0" / f"zero{k}.png").write_bytes(b"")
    pack = make_pack(src, tmp_path / "pack", payload="png")
    full = describe(pack)
    few = describe(pack, skipped_limit=5)
    assert full["num_skipped"] == few["num_skipped"] == 8
    assert len(full["skipped"]) == 8 and few["skipped"] == full["skipped"][:5]
    assert {s["path"] for s in full["skipped"]} == {f"c0/zero{k}.png" for k in range(8)}


_UNPICKLE_AND_TOUCH = r"""
import pickle, sys
import numpy as np
import fastload.data.dataset  # imports first: they are not what is measured

def anon():
    s = dict(l.split(":", 1) for l in open("/proc/self/status").read().splitlines() if ":" in l)
    return int(s["RssAnon"].split()[0])

blob = open(sys.argv[1], "rb").read()
before = anon()
ds = pickle.loads(blob)  # what a spawned DataLoader worker or a DDP rank receives
total = int(np.asarray(ds.targets).sum()) + int(ds._shapes[:, 0].sum())
ds.path(len(ds) - 1)
print(anon() - before, total)
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_spawned_process_adds_no_private_memory_per_record(tmp_path):
    """200k records: a private copy of labels, shapes and paths would be ~10 MB in every
    spawned worker; touching them all through the shared map adds almost nothing."""
    import subprocess
    import sys

    grew = {}
    for n in (1000, 200_000):
        ds = ImageFolder(synthetic_lmdb_pack(tmp_path / f"p{n}", n))
        blob = tmp_path / f"ds{n}.pickle"
        blob.write_bytes(pickle.dumps(ds))
        script = tmp_path / "probe.py"
        script.write_text(_UNPICKLE_AND_TOUCH)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        out = subprocess.run([sys.executable, str(script), str(blob)], capture_output=True, text=True, env=env,
                             timeout=240)
        assert out.returncode == 0, out.stderr[-2000:]
        kb, total = out.stdout.split()
        assert int(total) == int(np.asarray(ds.targets).sum()) + 8 * n
        grew[n] = int(kb)
    assert grew[200_000] - grew[1000] < 2048, grew  # KiB; a private copy would add ~10,000


def test_pack_index_parts_are_the_slices_of_the_whole(packs):
    index = open_pack(packs["parts"]).index
    starts = index.starts.tolist()
    for m in range(3):
        part = index.part(m)
        a, b = starts[m], starts[m + 1]
        assert np.array_equal(part.labels, np.asarray(index.labels)[a:b])
        assert np.array_equal(part.shapes, index.shapes[a:b])
        assert list(part.paths) == [index.paths[i] for i in range(a, b)]
