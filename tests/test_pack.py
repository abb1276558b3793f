"""The packer as a library: round trips, colour modes, CSV sources, parts, determinism, resume."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageOps

from _pack_helpers import gradient, make_jpeg_tree, make_special_tree, pack_interrupted, save, tree_bytes
from fastload.codecs import get_codec
from fastload.config import OnError, PackConfig
from fastload.errors import FormatError, PackError
from fastload.image import load_source, resize_center_crop, resize_shorter
from fastload.pack import journal_name, pack, scan_source
from fastload.storage import open_pack

BACKENDS = ("lmdb", "hdf5")
PAYLOADS = ("raw", "bmp", "png", "jpeg", "original")


@pytest.fixture(scope="module")
def special_tree(tmp_path_factory) -> Path:
    return make_special_tree(tmp_path_factory.mktemp("special"))


def _expected(src_root: Path, relpath: str, cfg: PackConfig) -> np.ndarray:
    img = load_source((src_root / relpath).read_bytes(), name=relpath)
    if cfg.resize:
        img = resize_shorter(img, cfg.resize)
    elif cfg.size:
        img = resize_center_crop(img, cfg.size)
    return img


def _decode_all(dest: Path):
    r = open_pack(dest)
    codec = get_codec(r.payload)
    idx = r.index
    out = [np.array(codec.decode(r.get(i), shape=tuple(idx.shapes[i]))) for i in range(len(r))]
    paths = list(idx.paths)
    labels = idx.labels.copy()
    r.close()
    return out, paths, labels


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("payload", PAYLOADS)
def test_round_trip_sample_tree(sample_tree, tmp_path, backend, payload):
    size = (40, 56) if payload == "raw" else None
    resize = 48 if payload in ("jpeg", "png") else None
    cfg = PackConfig(backend=backend, payload=payload, size=size, resize=resize, workers=1, shard_size=30_000)
    summary = pack(sample_tree, tmp_path / "out", config=cfg)
    classes, relpaths, labels = scan_source(sample_tree)
    assert summary.packed == len(relpaths) == 24 and summary.skipped == 0
    assert summary.manifest == tmp_path / "out" / "manifest.json" and summary.manifest.exists()
    assert summary.shards > 1  # the small shard size forced a rollover
    imgs, paths, got_labels = _decode_all(tmp_path / "out")
    assert paths == relpaths and got_labels.tolist() == labels.tolist()
    r = open_pack(tmp_path / "out")
    assert r.classes == classes and r.payload == payload and r.backend == backend
    assert summary.bytes == sum(s.bytes for s in r.shard_entries)
    for rel, img in zip(relpaths, imgs):
        want = _expected(sample_tree, rel, cfg)
        assert img.shape == want.shape and img.dtype == np.uint8
        if payload in ("raw", "bmp", "png"):
            np.testing.assert_array_equal(img, want)
        else:
            mae = np.abs(img.astype(np.int16) - want.astype(np.int16)).mean()
            assert mae < (6.0 if payload == "jpeg" else 2.0), (rel, mae)
    if payload == "original":
        for i, rel in enumerate(relpaths):
            assert bytes(r.get(i)) == (sample_tree / rel).read_bytes()
    if payload == "raw":
        assert r.image_shape == (40, 56, 3)
    r.close()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("payload", ("raw", "png", "bmp"))
def test_colour_modes_and_odd_sizes_byte_exact(special_tree, tmp_path, backend, payload):
    cfg = PackConfig(backend=backend, payload=payload, workers=1)
    pack(special_tree, tmp_path / "out", config=cfg)
    imgs, paths, _ = _decode_all(tmp_path / "out")
    assert len(paths) == 8
    for rel, img in zip(paths, imgs):
        assert img.ndim == 3 and img.shape[2] == 3, rel
        np.testing.assert_array_equal(img, _expected(special_tree, rel, cfg), err_msg=rel)
    by_name = dict(zip(paths, imgs))
    assert by_name["a_modes/odd_31x17.png"].shape == (17, 31, 3)
    gray = by_name["a_modes/gray_L.png"]
    assert (gray[..., 0] == gray[..., 1]).all() and (gray[..., 1] == gray[..., 2]).all()
    # RGBA: alpha dropped, colour kept
    np.testing.assert_array_equal(by_name["a_modes/rgba.png"], gradient(19, 23, 3))
    # 16-bit gray keeps the top 8 bits, not PIL's clipping convert('L')
    g16 = np.asarray(Image.open(special_tree / "b_more/gray16.png")).astype(np.uint32)
    np.testing.assert_array_equal(by_name["b_more/gray16.png"][..., 0], (g16 >> 8).astype(np.uint8))
    # CMYK JPEG converted to RGB like PIL does
    cmyk = np.asarray(Image.open(special_tree / "a_modes/cmyk.jpg").convert("RGB"))
    np.testing.assert_array_equal(by_name["a_modes/cmyk.jpg"], cmyk)


def test_exif_orientation_applied(special_tree, tmp_path):
    pack(special_tree, tmp_path / "out", config=PackConfig(payload="png", workers=1))
    imgs, paths, _ = _decode_all(tmp_path / "out")
    img = dict(zip(paths, imgs))["b_more/exif6.jpg"]
    src = Image.open(special_tree / "b_more/exif6.jpg")
    assert src.size == (28, 16) and src.getexif()[0x0112] == 6
    assert img.shape == (28, 16, 3)  # orientation 6: stored transposed
    np.testing.assert_array_equal(img, np.asarray(ImageOps.exif_transpose(src).convert("RGB")))


def test_original_payload_records_oriented_shape(special_tree, tmp_path):
    pack(special_tree, tmp_path / "out", config=PackConfig(payload="original", workers=1))
    r = open_pack(tmp_path / "out")
    idx = r.index
    i = list(idx.paths).index("b_more/exif6.jpg")
    assert tuple(idx.shapes[i]) == (28, 16, 3)
    assert bytes(r.get(i)) == (special_tree / "b_more/exif6.jpg").read_bytes()
    assert get_codec("original").decode(r.get(i)).shape == (28, 16, 3)
    r.close()


def test_original_payload_shapes_follow_exif_orientation_in_every_format(tmp_path):
    """The index records the EXIF-oriented shape (PIL's exif_transpose); the 'original' codec
    (OpenCV, which also applies EXIF) must decode to that shape and those pixels, also with
    a reduced decode, for every orientation and every format that carries EXIF."""
    from _pack_helpers import _exif

    src = tmp_path / "src"
    kw = {"JPEG": dict(quality=95), "PNG": {}, "TIFF": {}, "WEBP": dict(lossless=True)}
    for fmt, opts in kw.items():
        for o in range(1, 9):
            save(Image.fromarray(gradient(16, 28, o)), src / fmt.lower() / f"o{o}.{fmt.lower()}", exif=_exif(o), **opts)
    pack(src, tmp_path / "out", config=PackConfig(payload="original", workers=1))
    r = open_pack(tmp_path / "out")
    idx, codec = r.index, get_codec("original")
    assert len(r) == 32
    for i, rel in enumerate(idx.paths):
        want = load_source((src / rel).read_bytes(), name=rel)
        shape = tuple(int(v) for v in idx.shapes[i])
        rotated = int(rel.split("/o")[1][0]) >= 5
        assert shape == want.shape == ((28, 16, 3) if rotated else (16, 28, 3)), rel
        img = codec.decode(r.get(i), shape=shape)
        assert img.shape == shape, rel
        assert np.abs(img.astype(np.int16) - want).mean() < 1.0, rel
        half = codec.decode(r.get(i), shape=shape, reduce=2)
        assert abs(half.shape[0] - shape[0] / 2) <= 1 and abs(half.shape[1] - shape[1] / 2) <= 1, (rel, half.shape)
    r.close()


def test_size_gives_fixed_shape_and_resize_keeps_aspect(special_tree, tmp_path):
    pack(special_tree, tmp_path / "fixed", config=PackConfig(payload="raw", size=(10, 12), workers=1))
    r = open_pack(tmp_path / "fixed")
    assert r.image_shape == (10, 12, 3) and (r.index.shapes == [10, 12, 3]).all()
    pack(special_tree, tmp_path / "short", config=PackConfig(payload="raw", resize=12, workers=1))
    r2 = open_pack(tmp_path / "short")
    shapes = r2.index.shapes
    assert (shapes[:, :2].min(axis=1) == 12).all()
    assert r2.image_shape is None  # shapes vary, so the manifest does not claim one


def test_scan_matches_torchvision_order(tmp_path):
    root = tmp_path / "src"
    for rel in ["b/z.JPG", "b/sub/a.png", "a/2.jpeg", "a/10.jpg", "a/readme.txt", "B/x.webp", "a/.hidden.png"]:
        save(Image.fromarray(gradient(4, 4)), root / rel, format="PNG")
    classes, relpaths, labels = scan_source(root)
    assert classes == ("B", "a", "b")
    assert relpaths == ["B/x.webp", "a/.hidden.png", "a/10.jpg", "a/2.jpeg", "b/z.JPG", "b/sub/a.png"]
    assert labels.dtype == np.int64 and labels.tolist() == [0, 1, 1, 1, 2, 2]


def test_scan_empty_class_folder_is_an_error(tmp_path):
    make_jpeg_tree(tmp_path / "src", classes=2, per_class=1)
    (tmp_path / "src" / "empty_class").mkdir()
    (tmp_path / "src" / "empty_class" / "notes.txt").write_text("x")
    with pytest.raises(PackError, match="empty_class.*no image files"):
        scan_source(tmp_path / "src")


def test_csv_source_with_class_names_and_relative_paths(tmp_path):
    src = make_jpeg_tree(tmp_path / "imgs", classes=2, per_class=3)
    csv = tmp_path / "list.csv"
    rows = ["path,label", "imgs/c1/img002.jpg,dog", "imgs/c0/img000.jpg,cat", "imgs/c1/img000.jpg,dog",
            f"{src / 'c0' / 'img001.jpg'},cat"]
    csv.write_text("\n".join(rows) + "\n")
    s = pack(csv, tmp_path / "out", config=PackConfig(payload="png", workers=1))
    assert s.packed == 4
    r = open_pack(tmp_path / "out")
    assert r.classes == ("cat", "dog")
    idx = r.index
    assert idx.labels.tolist() == [1, 0, 1, 0]
    assert list(idx.paths)[:3] == ["imgs/c1/img002.jpg", "imgs/c0/img000.jpg", "imgs/c1/img000.jpg"]
    img = get_codec("png").decode(r.get(0))
    np.testing.assert_array_equal(img, load_source((src / "c1/img002.jpg").read_bytes()))


def test_tsv_source_with_integer_labels_no_header(tmp_path):
    make_jpeg_tree(tmp_path / "imgs", classes=1, per_class=3)
    tsv = tmp_path / "list.tsv"
    tsv.write_text("imgs/c0/img000.jpg\t2\nimgs/c0/img001.jpg\t0\nimgs/c0/img002.jpg\t5\n")
    pack(tsv, tmp_path / "out", config=PackConfig(workers=1))
    r = open_pack(tmp_path / "out")
    assert r.index.labels.tolist() == [2, 0, 5]
    assert r.classes == ("0", "1", "2", "3", "4", "5")


def test_csv_errors_name_the_line(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("a.jpg,cat\nb.jpg\n")
    with pytest.raises(PackError, match=r"bad\.csv:2: expected 2 columns"):
        scan_source(bad)
    empty = tmp_path / "empty.csv"
    empty.write_text("path,label\n")
    with pytest.raises(PackError, match="no rows"):
        scan_source(empty)


def test_workers_do_not_change_output(tmp_path):
    src = make_jpeg_tree(tmp_path / "src", classes=3, per_class=10)
    (src / "c1" / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    for backend in BACKENDS:
        outs = []
        for w in (1, 2):
            dest = tmp_path / f"{backend}-{w}"
            s = pack(src, dest, config=PackConfig(backend=backend, workers=w, shard_size=6_000))
            assert s.skipped == 1 and s.packed == 30 and s.shards > 2
            outs.append(tree_bytes(dest))
        assert outs[0] == outs[1], backend


def test_parts_concatenate_to_the_whole(tmp_path):
    src = make_jpeg_tree(tmp_path / "src", classes=3, per_class=7)  # 21 images: uneven split
    cfg = dict(backend="hdf5", payload="png", workers=1, shard_size=6_000)
    pack(src, tmp_path / "whole", config=PackConfig(**cfg))
    parted = tmp_path / "parted"
    for i in (2, 0):
        pack(src, parted, config=PackConfig(**cfg, part=i, parts=3))
    with pytest.raises(FormatError, match="1 of 3 parts missing"):
        open_pack(parted)
    pack(src, parted, config=PackConfig(**cfg, part=1, parts=3))
    whole, parts = open_pack(tmp_path / "whole"), open_pack(parted)
    assert len(parts) == len(whole) == 21
    assert [m.num_samples for m in parts.manifests] == [7, 7, 7]
    assert [m.part for m in parts.manifests] == [0, 1, 2] and all(m.source_count == 21 for m in parts.manifests)
    assert list(parts.index.paths) == list(whole.index.paths)
    assert parts.index.labels.tolist() == whole.index.labels.tolist()
    for i in range(21):
        assert bytes(parts.get(i)) == bytes(whole.get(i))
    names = sorted(p.name for p in parted.iterdir())
    assert "manifest-p00001-of-00003.json" in names and any(n.startswith("p00002-of-00003-shard-") for n in names)


def test_more_parts_than_images_gives_empty_parts(tmp_path):
    src = make_jpeg_tree(tmp_path / "src", classes=1, per_class=2)
    for i in range(3):
        pack(src, tmp_path / "out", config=PackConfig(workers=1, part=i, parts=3))
    r = open_pack(tmp_path / "out")
    assert len(r) == 2 and [m.num_samples for m in r.manifests] == [0, 1, 1]


def test_bad_inputs_are_skipped_and_listed(tmp_path):
    src = make_jpeg_tree(tmp_path / "src", classes=2, per_class=2)
    (src / "c0" / "zero.jpg").write_bytes(b"")
    (src / "c0" / "text.png").write_text("hello, not an image")
    full = (src / "c1" / "img000.jpg").read_bytes()
    (src / "c1" / "truncated.jpg").write_bytes(full[: len(full) // 2])
    s = pack(src, tmp_path / "out", config=PackConfig(workers=2))
    assert s.packed == 4 and s.skipped == 3
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    reasons = {d["path"]: d["reason"] for d in manifest["skipped"]}
    assert set(reasons) == {"c0/zero.jpg", "c0/text.png", "c1/truncated.jpg"}
    assert "empty" in reasons["c0/zero.jpg"]
    assert "not a readable image" in reasons["c0/text.png"]
    assert "c1/truncated.jpg" not in open_pack(tmp_path / "out").index.paths


def test_on_error_fail_stops_at_first_bad_input(tmp_path):
    src = make_jpeg_tree(tmp_path / "src", classes=1, per_class=3)
    (src / "c0" / "img001.jpg").write_bytes(b"garbage")
    with pytest.raises(PackError, match=r"img001\.jpg.*not a readable image"):
        pack(src, tmp_path / "out", config=PackConfig(workers=2, on_error=OnError.FAIL))
    assert not (tmp_path / "out" / "manifest.json").exists()
    assert not list((tmp_path / "out").glob("*.tmp"))


def test_all_inputs_unreadable_is_an_error(tmp_path):
    (tmp_path / "src" / "c").mkdir(parents=True)
    (tmp_path / "src" / "c" / "x.jpg").write_bytes(b"nope")
    with pytest.raises(PackError, match="none of the 1 inputs could be read"):
        pack(tmp_path / "src", tmp_path / "out", config=PackConfig(workers=1))


def test_dest_rules(tmp_path):
    src = make_jpeg_tree(tmp_path / "src", classes=1, per_class=2)
    cfg = PackConfig(workers=1)
    pack(src, tmp_path / "out", config=cfg)
    with pytest.raises(PackError, match="already holds a finished pack"):
        pack(src, tmp_path / "out", config=cfg)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "mine.txt").write_text("keep me")
    with pytest.raises(PackError, match="not empty"):
        pack(src, tmp_path / "other", config=cfg)
    s = pack(src, tmp_path / "out", config=PackConfig(workers=1, payload="png", overwrite=True))
    assert s.packed == 2 and open_pack(tmp_path / "out").payload == "png"
    pack(src, tmp_path / "other", config=PackConfig(workers=1, overwrite=True))
    assert (tmp_path / "other" / "mine.txt").read_text() == "keep me"  # never deletes foreign files
    (tmp_path / "afile").write_text("x")
    with pytest.raises(PackError, match="not a directory"):
        pack(src, tmp_path / "afile", config=cfg)



def test_resume_from_journal_equals_uninterrupted(tmp_path):
    """Simulate a run that died after two shards: cut the finished pack back to its journal state."""
    src = make_jpeg_tree(tmp_path / "src", classes=2, per_class=10)
    (src / "c0" / "img004.jpg").write_bytes(b"bad")
    cfg = PackConfig(backend="lmdb", workers=1, shard_size=3_500)
    clean = tmp_path / "clean"
    pack(src, clean, config=cfg)
    expected = tree_bytes(clean)

    dest = tmp_path / "dest"
    pack_interrupted(src, dest, cfg, after_shards=2)
    journal = json.loads((dest / journal_name(0, 1)).read_text())
    assert len(journal["shards"]) == 2 and not (dest / "manifest.json").exists()
    assert [s["path"] for _, s in journal["skipped"]] == ["c0/img004.jpg"]
    with pytest.raises(FormatError):
        open_pack(dest)
    (dest / "shard-00002.lmdb.tmp").write_bytes(b"stale half-written shard")
    s = pack(src, dest, config=PackConfig(backend="lmdb", workers=2, shard_size=3_500))
    assert s.resumed_from == journal["ends"][-1] > 0
    assert tree_bytes(dest) == expected


def test_resume_restarts_when_a_packed_file_was_edited_in_place(tmp_path):
    """Same file list, but a file already in a finished shard changed: resuming would mix old
    and new pixels, so the rerun must start over and match a clean pack of the edited source."""
    src = make_jpeg_tree(tmp_path / "src", classes=2, per_class=10)
    cfg = PackConfig(backend="hdf5", payload="png", workers=1, shard_size=5_000)
    dest = tmp_path / "dest"
    pack_interrupted(src, dest, cfg, after_shards=2)
    journal = json.loads((dest / journal_name(0, 1)).read_text())
    assert len(journal["shards"]) == 2
    edited = src / "c0" / "img000.jpg"  # the first record: surely in shard 0
    st = edited.stat()
    save(Image.fromarray(gradient(24, 32, seed=999)), edited, quality=90)
    os.utime(edited, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    s = pack(src, dest, config=cfg)
    assert s.resumed_from == 0
    pack(src, tmp_path / "clean", config=cfg)
    assert tree_bytes(dest) == tree_bytes(tmp_path / "clean")
    img = get_codec("png").decode(open_pack(dest).get(0))
    np.testing.assert_array_equal(img, load_source(edited.read_bytes()))


def test_resume_keeps_the_shards_before_a_file_edited_in_place(tmp_path):
    """Files are checked per finished shard (no stat pass over the whole source before the
    first image): an edit in shard 1 keeps shard 0 and repacks from shard 1 on."""
    src = make_jpeg_tree(tmp_path / "src", classes=2, per_class=10)
    cfg = PackConfig(backend="lmdb", payload="png", workers=1, shard_size=5_000)
    dest = tmp_path / "dest"
    pack_interrupted(src, dest, cfg, after_shards=2)
    journal = json.loads((dest / journal_name(0, 1)).read_text())
    first_of_shard_1 = scan_source(src)[1][journal["ends"][0]]
    edited = src / first_of_shard_1
    st = edited.stat()
    save(Image.fromarray(gradient(24, 32, seed=998)), edited, quality=90)
    os.utime(edited, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    s = pack(src, dest, config=cfg)
    assert s.resumed_from == journal["ends"][0] and s.resumed_shards == 1
    pack(src, tmp_path / "clean", config=cfg)
    assert tree_bytes(dest) == tree_bytes(tmp_path / "clean")


def test_resume_after_options_change_restarts(tmp_path):
    src = make_jpeg_tree(tmp_path / "src", classes=1, per_class=6)
    dest = tmp_path / "dest"
    pack(src, dest, config=PackConfig(workers=1, shard_size=2_000))
    (dest / "manifest.json").unlink()  # looks like an unfinished pack with a journal...
    import fastload.pack as packmod

    packmod._write_journal(dest / journal_name(0, 1), {"key": "other options", "shards": []})
    s = pack(src, dest, config=PackConfig(workers=1, payload="png"))
    assert s.resumed_from == 0 and open_pack(dest).payload == "png"
    assert sorted(p.name for p in dest.iterdir()) == ["index.fli", "manifest.json", "shard-00000.lmdb"]


def test_resume_drops_a_damaged_finished_shard(tmp_path):
    src = make_jpeg_tree(tmp_path / "src", classes=1, per_class=12)
    cfg = PackConfig(backend="hdf5", workers=1, shard_size=2_000)
    pack(src, tmp_path / "clean", config=cfg)
    expected = tree_bytes(tmp_path / "clean")
    dest = tmp_path / "dest"
    pack(src, dest, config=cfg)
    import fastload.pack as packmod
    from fastload.schema import read_manifest

    m = read_manifest(dest / "manifest.json")
    assert len(m.shards) >= 3
    ends = list(np.cumsum([e.num_samples for e in m.shards]))
    listing = packmod.list_source(src)
    stamps = [packmod.stamps_digest(packmod.file_stamp(listing.resolve(listing.relpaths[i])) for i in range(lo, hi))
              for lo, hi in [(0, int(ends[0])), (int(ends[0]), int(ends[1]))]]
    packmod._write_journal(dest / journal_name(0, 1), {
        "key": packmod._source_key(cfg, listing),
        "shards": [e.__dict__ for e in m.shards[:2]], "ends": [int(x) for x in ends[:2]],
        "skipped": [], "shapes": [[24, 32, 3], [24, 32, 3]], "stamps": stamps,
    })
    (dest / "manifest.json").unlink()
    p = dest / m.shards[1].file
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0xFF  # second finished shard damaged
    p.write_bytes(bytes(data))
    s = pack(src, dest, config=cfg)
    assert s.resumed_from == ends[0]
    assert tree_bytes(dest) == expected


def test_pack_config_rejects_bad_values():
    for kw, msg in [
        (dict(quality=0), "quality"), (dict(quality=101), "quality"), (dict(shard_size=0), "shard_size"),
        (dict(payload="gif"), "payload"), (dict(backend="zip"), "format"), (dict(part=2, parts=2), "part"),
        (dict(size=(0, 4)), "size"), (dict(resize=0), "resize"), (dict(workers=0), "workers"),
        (dict(payload="original", resize=64), "original"), (dict(resize=4, size=(4, 4)), "not both"),
        (dict(restart_markers=1), "restart_markers"),
    ]:
        with pytest.raises(ValueError, match=msg):
            PackConfig(**kw)
    assert PackConfig(on_error="fail").on_error is OnError.FAIL


def test_scan_skips_are_listed_once_by_part_0_of_a_parted_pack(tmp_path):
    src = make_jpeg_tree(tmp_path / "src", classes=2, per_class=3)
    os.symlink(".", src / "c0" / "loop")  # a link loop: listed as skipped, walked once
    (src / "stray.jpg").write_bytes(b"x")  # outside any class folder
    dest = tmp_path / "out"
    for part in (0, 1):
        pack(src, dest, config=PackConfig(workers=1, part=part, parts=2))
    from fastload.schema import manifest_name, read_manifest

    m0, m1 = (read_manifest(dest / manifest_name(p, 2)) for p in (0, 1))
    assert sorted(s.path for s in m0.skipped) == ["c0/loop/", "stray.jpg"] and m1.skipped == ()
    assert m0.num_samples + m1.num_samples == 6
    assert len(open_pack(dest)) == 6
