"""Corrupt records during training: ``on_error="raise"`` names them, ``"skip"`` serves a
deterministic substitute (its own image, label and crop), on real LMDB/HDF5 packs whose shard
files had payload bytes overwritten in place. Also ``ring_blocker()``'s reasons."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from fastload import ImageFolder
from fastload.codecs import jpegcrop
from fastload.data.draws import SUBSTITUTE_CANDIDATES, crop_boxes, substitute_index
from fastload.data.protocols import BatchFiller, EpochDataset, OnRecordError, Replacement
from fastload.errors import CorruptRecordError, DecodeError, FormatError
from fastload.storage import open_pack
from fastload.transforms import (
    CenterCrop,
    Compose,
    Lambda,
    Normalize,
    RandomHorizontalFlip,
    RandomResizedCrop,
    Resize,
    ToTensor,
)

sys.path.insert(0, str(Path(__file__).parent))
from _data_helpers import make_pack  # noqa: E402
from _pack_helpers import gradient, make_jpeg_tree  # noqa: E402

from _dali_helpers import needs_dali

HW = (40, 56)
N = 18  # 3 classes x 6 images, all HW
# Planted damage: the whole payload random (3), the first bytes zeroed so no decoder finds a
# JPEG (10), the second half zeroed: header intact, no end-of-image marker (14). Every decoder
# fails on all three when it decodes the whole image (transform=None).
BAD = {3: "garbage", 10: "head", 14: "tail"}
RRC = (RandomResizedCrop(24, scale=(0.3, 1.0)), RandomHorizontalFlip())


def _damage(payload: bytes, how: str) -> bytes:
    n = len(payload)
    if how == "garbage":
        return np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8).tobytes()
    if how == "head":
        return bytes(16) + payload[16:]
    if how == "tail":
        return payload[: n // 2] + bytes(n - n // 2)
    raise ValueError(how)


def plant(root: Path, i: int, how: str) -> None:
    """Overwrite record ``i``'s payload bytes inside its shard file, in place.

    In place because the manifest records each shard's size and the reader refuses a shard
    whose size changed (an LMDB ``put`` writes new pages and grows the file): this is the
    damage a bad disk or a bit flip does. HDF5: through h5py into the ``data`` dataset at the
    record's offsets; LMDB: at the record's bytes in the memory-mapped file (the value of a
    small record sits inside its leaf page)."""
    reader = open_pack(root)
    k, j = reader.locate(i)
    payload = bytes(reader.get(i))
    reader.close()
    shard = reader.shard_path(k)
    bad = _damage(payload, how)
    assert len(bad) == len(payload) and bad != payload
    if reader.backend == "hdf5":
        import h5py

        with h5py.File(shard, "r+") as f:
            a, b = int(f["offsets"][j]), int(f["offsets"][j + 1])
            f["data"][a:b] = np.frombuffer(bad, np.uint8)
    else:
        data = shard.read_bytes()
        at = data.find(payload)
        assert at >= 0 and data.find(payload, at + 1) < 0, "the payload must occur once in the shard file"
        with open(shard, "r+b") as fh:
            fh.seek(at)
            fh.write(bad)


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    return make_jpeg_tree(tmp_path_factory.mktemp("corrupt_src"), classes=3, per_class=6, hw=HW)


@pytest.fixture(scope="module", params=["lmdb", "hdf5"])
def damaged(request, tree, tmp_path_factory) -> Path:
    """A JPEG pack over several shards (so a record's number in its shard differs from its
    dataset index) with the records of :data:`BAD` damaged."""
    root = make_pack(tree, tmp_path_factory.mktemp(f"damaged_{request.param}") / "pack",
                     backend=request.param, shard_size=6000)
    assert len(open_pack(root).shard_entries) > 1
    for i, how in BAD.items():
        plant(root, i, how)
    return root


def _first_good(seed: int, epoch: int, i: int, bad=BAD, n: int = N) -> int:
    for k in range(SUBSTITUTE_CANDIDATES):
        s = substitute_index(seed, epoch, i, k, n)
        if s not in bad:
            return s
    raise AssertionError("no good candidate")


def _names_record(msg: str, root: Path, i: int, source: str) -> None:
    reader = open_pack(root, check_files=False)
    k, j = reader.locate(i)
    assert str(reader.shard_path(k)) in msg
    assert f"record {j} " in msg and f"dataset index {i}" in msg
    assert source in msg


# -- substitute_index ------------------------------------------------------------------------


def test_substitute_index_is_a_pure_function_over_the_other_records():
    n = 7
    got = [[substitute_index(5, 2, i, k, n) for k in range(64)] for i in range(n)]
    assert got == [[substitute_index(5, 2, i, k, n) for k in range(64)] for i in range(n)]
    for i, row in enumerate(got):
        assert i not in row and all(0 <= s < n for s in row)
        assert set(row) == set(range(n)) - {i}  # every other record comes up
    assert got != [[substitute_index(5, 3, i, k, n) for k in range(64)] for i in range(n)]  # per epoch
    assert got != [[substitute_index(6, 2, i, k, n) for k in range(64)] for i in range(n)]  # per seed
    assert substitute_index(0, 0, 0, 0, 2) == 1
    with pytest.raises(ValueError, match="no other record"):
        substitute_index(0, 0, 0, 0, 1)
    with pytest.raises(ValueError, match="out of range"):
        substitute_index(0, 0, 7, 0, 7)


# -- fill_batch ------------------------------------------------------------------------------


def test_fill_batch_raise_names_the_record_its_shard_and_its_source(damaged, tree):
    ds = ImageFolder(damaged)
    idx = np.arange(8)  # one bad record in it: 3
    images = np.zeros((8, *HW, 3), np.uint8)
    targets = np.zeros(8, np.int64)
    for kw in ({}, {"on_error": "raise"}, {"on_error": OnRecordError.RAISE}):
        with pytest.raises((DecodeError, CorruptRecordError)) as info:
            ds.fill_batch(idx, images, targets, epoch=0, **kw)
        _names_record(str(info.value), damaged, 3, str(tree / "c0" / "img003.jpg"))


@pytest.mark.parametrize("transform", [None, Compose(list(RRC))], ids=["none", "rrc_flip"])
@pytest.mark.parametrize("target_transform", [None, lambda t: t + 100], ids=["labels", "target_transform"])
@pytest.mark.parametrize("decoder", ["auto", "cv2"])  # auto: turbo-crop where built
def test_fill_batch_skip_serves_each_bad_records_substitute_with_its_label(damaged, transform, target_transform,
                                                                            decoder):
    ds = ImageFolder(damaged, transform=transform, target_transform=target_transform, decoder=decoder)
    shape = ds.batch_image_shape()
    assert shape is not None
    idx = np.random.default_rng(1).permutation(N)
    seed, epoch = 7, 2

    def fill():
        images = np.zeros((N, *shape), np.uint8)
        targets = np.full(N, -1, np.int64)
        reps = ds.fill_batch(idx, images, targets, epoch=epoch, seed=seed, on_error="skip")
        return images, targets, reps

    images, targets, reps = fill()
    assert sorted(r.index for r in reps) == sorted(BAD)
    served = {r.index: r.substitute for r in reps}
    for r in reps:
        assert isinstance(r, Replacement) and r.epoch == epoch
        assert r.substitute == _first_good(seed, epoch, r.index)
        _names_record(r.reason, damaged, r.index, ds.path(r.index))
    for j, i in enumerate(idx.tolist()):
        s = served.get(i, i)
        np.testing.assert_array_equal(images[j], ds.load(s, epoch=epoch, seed=seed))
        assert targets[j] == ds.targets[s] + (100 if target_transform else 0)
    again = fill()  # deterministic: the same substitutes, pixels and labels
    np.testing.assert_array_equal(again[0], images)
    np.testing.assert_array_equal(again[1], targets)
    assert again[2] == reps
    # a batch without bad records replaces nothing, and gives what load() gives
    good = np.asarray([i for i in range(N) if i not in BAD][:5])
    images = np.zeros((5, *shape), np.uint8)
    assert not ds.fill_batch(good, images, np.zeros(5, np.int64), epoch=epoch, seed=seed, on_error="skip")
    for j, i in enumerate(good.tolist()):
        np.testing.assert_array_equal(images[j], ds.load(i, epoch=epoch, seed=seed))


def test_skip_gives_up_when_every_substitute_is_bad_too(tree, tmp_path):
    src = tmp_path / "src"
    for name in ("c0/img000.jpg", "c0/img001.jpg", "c1/img000.jpg"):
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(tree / name, src / name)
    root = make_pack(src, tmp_path / "pack")
    for i in range(3):
        plant(root, i, "garbage")
    ds = ImageFolder(root)
    images = np.zeros((1, *HW, 3), np.uint8)
    with pytest.raises(DecodeError, match="substitutes") as info:
        ds.fill_batch(np.asarray([1]), images, np.zeros(1, np.int64), epoch=0, on_error="skip")
    _names_record(str(info.value), root, 1, ds.path(1))
    with pytest.raises(DecodeError, match="substitutes"):
        ds.get(2, epoch=0, seed=0, on_error="skip")


# -- get / __getitem__ -------------------------------------------------------------------------


@pytest.mark.parametrize("image_type", ["numpy", "tensor"])
def test_get_skip_raise_and_getitem(damaged, tree, image_type):
    ds = ImageFolder(damaged, transform=Compose(list(RRC)), image_type=image_type)
    assert isinstance(ds, EpochDataset) and isinstance(ds, BatchFiller)
    as_np = (lambda a: a.permute(1, 2, 0).numpy()) if image_type == "tensor" else np.asarray
    for i in BAD:
        img, target, rep = ds.get(i, epoch=1, seed=3, on_error="skip")
        assert rep == ds.get(i, epoch=1, seed=3, on_error="skip")[2]
        assert rep.index == i and rep.epoch == 1 and rep.substitute == _first_good(3, 1, i)
        np.testing.assert_array_equal(as_np(img), ds.load(rep.substitute, epoch=1, seed=3))
        assert target == ds.targets[rep.substitute]
        with pytest.raises((DecodeError, CorruptRecordError), match="dataset index"):
            ds.get(i, epoch=1, seed=3)
        with pytest.raises((DecodeError, CorruptRecordError)) as info:
            ds[i]  # __getitem__ keeps raising
        _names_record(str(info.value), damaged, i, ds.path(i))
    img, target, rep = ds.get(5, epoch=1, seed=3, on_error="skip")
    assert rep is None and target == ds.targets[5]
    np.testing.assert_array_equal(as_np(img), ds.load(5, epoch=1, seed=3))
    assert (ds.epoch, ds.seed) == (0, 0)  # get() reads neither, changes neither
    ds.set_epoch(4)
    img, target = ds[5]
    np.testing.assert_array_equal(as_np(img), ds.load(5, epoch=4))
    assert target == ds.targets[5]
    np.testing.assert_array_equal(as_np(ds.get(5, epoch=4, seed=0)[0]), as_np(img))
    with pytest.raises(IndexError):
        ds.get(N, epoch=0, seed=0)


def test_on_error_must_be_raise_or_skip(damaged):
    ds = ImageFolder(damaged)
    images = np.zeros((1, *HW, 3), np.uint8)
    with pytest.raises(ValueError, match="'raise', 'skip'"):
        ds.fill_batch(np.asarray([0]), images, np.zeros(1, np.int64), epoch=0, on_error="ignore")
    with pytest.raises(ValueError, match="'raise', 'skip'"):
        ds.get(0, epoch=0, seed=0, on_error="warn")
    assert ds.get(3, epoch=0, seed=0, on_error=OnRecordError.SKIP)[2] is not None


def test_errors_that_are_not_about_the_record_are_not_swallowed(damaged):
    def boom(img):
        raise RuntimeError("a bug in a transform")

    ds = ImageFolder(damaged, transform=Compose([RandomResizedCrop(24), Lambda(boom)]))
    for i in (0, 3):  # a good record, and a bad one whose substitute then hits the bug
        with pytest.raises(RuntimeError, match="a bug"):
            ds.get(i, epoch=0, seed=0, on_error="skip")
    # a batch buffer of the wrong size is the caller's bug, not a corrupt record
    ds = ImageFolder(damaged, transform=RandomResizedCrop(24))
    with pytest.raises(ValueError, match="batch slot"):
        ds.fill_batch(np.asarray([0]), np.zeros((1, 20, 20, 3), np.uint8), np.zeros(1, np.int64),
                      epoch=0, on_error="skip")


def test_an_unreadable_record_is_a_named_format_error_and_can_be_skipped(tree, tmp_path):
    """A record the storage cannot give back (here: its LMDB key deleted) is a FormatError
    naming shard, record and source, and on_error="skip" replaces it like a decode failure."""
    import lmdb

    root = make_pack(tree, tmp_path / "pack", backend="lmdb")
    # As an older pack (no record locations in index.fli): reads walk the shard, and the walk
    # finds the key gone (with locations, the bytes are read where the index says, checksummed).
    from test_record_locations import strip_locations

    strip_locations(root)
    shard = open_pack(root).shard_path(0)
    env = lmdb.open(str(shard), subdir=False, lock=False, map_size=1 << 26)
    with env.begin(write=True) as txn:
        assert txn.delete((6).to_bytes(8, "big"))
    env.close()
    ds = ImageFolder(root, check_files=False)  # the delete changed the file's size
    with pytest.raises(FormatError, match="could not be read") as info:
        ds.get(6, epoch=0, seed=0)
    _names_record(str(info.value), root, 6, str(tree / "c1" / "img000.jpg"))
    img, target, rep = ds.get(6, epoch=0, seed=0, on_error="skip")
    assert rep.substitute == _first_good(0, 0, 6, bad={6})
    np.testing.assert_array_equal(img, ds.load(rep.substitute))
    assert target == ds.targets[rep.substitute] and "record 6 missing" in rep.reason


# -- ring_blocker ------------------------------------------------------------------------------


class MyTransform:
    """A callable that is not a fastload transform (as a torchvision one would be)."""

    def __call__(self, img):
        return img


@pytest.fixture(scope="module")
def plain_pack(tree, tmp_path_factory) -> Path:
    return make_pack(tree, tmp_path_factory.mktemp("plain") / "pack")


@pytest.fixture(scope="module")
def mixed_pack(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("mixed")
    for k, hw in enumerate([(30, 40), (40, 30), (33, 33)]):
        (root / "src" / "a").mkdir(parents=True, exist_ok=True)
        Image.fromarray(gradient(*hw, seed=k)).save(root / "src" / "a" / f"{k}.jpg", quality=90)
    return make_pack(root / "src", root / "pack")


@pytest.mark.parametrize(
    ("transform", "names", "advice"),
    [
        (MyTransform(), [f"{__name__}.MyTransform"], "use fastload.transforms for geometric ops"),
        (Compose([RandomResizedCrop(24), MyTransform()]), [f"{__name__}.MyTransform"], "torchvision/other"),
        (Compose([RandomResizedCrop(24), Normalize([0.5] * 3, [0.2] * 3)]), ["fastload.transforms.Normalize"],
         "normalise on the GPU (CUDAPrefetcher / fastload.Normalization)"),
        (Normalize([0.5] * 3, [0.2] * 3), ["fastload.transforms.Normalize"], "drop it"),
        (Compose([RandomResizedCrop(24), ToTensor(), Normalize([0.5] * 3, [0.2] * 3)]),
         ["fastload.transforms.ToTensor", "fastload.transforms.Normalize"], "normalise on the GPU"),
        (Compose([RandomResizedCrop(24), Lambda(np.ascontiguousarray)]), ["fastload.transforms.Lambda"], "GPU"),
        (Compose([Compose([Lambda(np.ascontiguousarray)]), RandomResizedCrop(24)]), ["fastload.transforms.Lambda"],
         "GPU"),
        (Resize(32), ["fastload.transforms.Resize"], "add a CenterCrop or RandomResizedCrop"),
        (Compose([Resize(32), RandomHorizontalFlip()]), ["fastload.transforms.Resize"], "one size"),
    ],
    ids=["callable", "callable_in_compose", "normalize", "normalize_alone", "totensor_normalize", "lambda",
         "nested_lambda", "resize_int", "resize_flip"],
)
def test_ring_blocker_names_the_transform_and_what_to_do(plain_pack, transform, names, advice):
    ds = ImageFolder(plain_pack, transform=transform)
    assert ds.batch_image_shape() is None
    why = ds.ring_blocker()
    for name in names:
        assert name in why
    assert advice in why


@pytest.mark.parametrize(
    "transform",
    [None, Compose(list(RRC)), Compose([Resize(32), CenterCrop(28)]), Resize((20, 30))],
    ids=["none", "rrc_flip", "resize_centercrop", "resize_pair"],
)
@pytest.mark.parametrize("image_type", ["numpy", "pil"])
def test_ring_blocker_is_none_on_the_ring_path(plain_pack, transform, image_type):
    ds = ImageFolder(plain_pack, transform=transform, image_type=image_type)
    assert ds.batch_image_shape() is not None and ds.ring_blocker() is None


def test_ring_blocker_for_a_pack_of_different_sizes(mixed_pack):
    ds = ImageFolder(mixed_pack)
    assert ds.batch_image_shape() is None
    why = ds.ring_blocker()
    assert "different sizes" in why and "--size HxW" in why and "30x40x3" in why
    assert ImageFolder(mixed_pack, transform=RandomResizedCrop(16)).ring_blocker() is None


# -- DALI ----------------------------------------------------------------------------------------


class _Info:
    """DALI's batch info as the external source sees it."""

    def __init__(self, epoch_idx: int, iteration: int):
        self.epoch_idx, self.iteration = epoch_idx, iteration


def _dali_source(root: Path, *, on_error: str, train: bool, seed: int = 4):
    from fastload.dali import PackBatchSource
    from fastload.data.plan import EpochPlan

    index = open_pack(root).index
    return PackBatchSource(
        root, labels=index.labels, shapes=None, plan=EpochPlan(N, batch_size=N, seed=seed, shuffle=False),
        hw=index.shapes[:, :2], scale=(0.3, 1.0) if train else None, on_error=on_error,
    )


@needs_dali
def test_dali_source_raise_names_the_record(damaged, tree):
    source = _dali_source(damaged, on_error="raise", train=True)
    with pytest.raises((DecodeError, CorruptRecordError)) as info:
        source(_Info(0, 0))
    _names_record(str(info.value), damaged, 3, str(tree / "c0" / "img003.jpg"))


@needs_dali
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_dali_source_skip_serves_the_cpu_loaders_substitutes(damaged, train, capfd):
    seed, epoch = 4, 0
    source = _dali_source(damaged, on_error="skip", train=train, seed=seed)
    out = source(_Info(0, 0))
    data, labels = out[:2]
    pack = open_pack(damaged)
    index = pack.index
    ds = ImageFolder(damaged)
    cpu = ds.fill_batch(np.arange(N), np.zeros((N, *HW, 3), np.uint8), np.zeros(N, np.int64),
                        epoch=epoch, seed=seed, on_error="skip")
    subs = {r.index: r.substitute for r in cpu}  # the CPU loader's choice
    assert sorted(subs) == sorted(BAD)
    served = np.asarray([subs.get(i, i) for i in range(N)])
    assert len(data) == N
    for j, s in enumerate(served.tolist()):
        np.testing.assert_array_equal(data[j], np.frombuffer(bytes(pack.get(s)), np.uint8))
    np.testing.assert_array_equal(labels, index.labels[served])
    if train:  # crop boxes drawn for the substitute and its stored size
        start, end, flips = out[2:]
        boxes = crop_boxes(seed, epoch, served, index.shapes[served, 0], index.shapes[served, 1],
                           scale=(0.3, 1.0), ratio=(3 / 4, 4 / 3))
        np.testing.assert_array_equal(start, boxes[:, :2])
        np.testing.assert_array_equal(end, boxes[:, :2] + boxes[:, 2:])
    again = source(_Info(0, 0))
    assert all(np.array_equal(a, b) for a, b in zip(again[0], data))
    err = capfd.readouterr().err.strip().splitlines()
    mine = [line for line in err if line.startswith("fastload DALI source")]
    assert len(mine) == 2 * len(BAD)  # one line per replacement, two calls
    for i, s in subs.items():
        assert any(f"dataset index {i}," in line and f"dataset index {s}," in line for line in mine)


@needs_dali
def test_dali_loader_skip_finishes_the_epoch_with_full_batches(damaged):
    from fastload.dali import DALILoader

    seed = 2
    loader = DALILoader(damaged, 6, device="cpu", num_threads=1, py_num_workers=1, crop=24, seed=seed,
                        on_error="skip")
    assert loader.on_error == "skip"
    labels = open_pack(damaged).index.labels
    sizes, got = [], []
    for images, targets in loader:
        sizes.append(len(targets))
        assert images.shape == (len(targets), 3, 24, 24)
        got += targets.tolist()
    assert sizes == [6, 6, 6]
    expected = [labels[_first_good(seed, 0, i) if i in BAD else i] for i in range(N)]
    assert sorted(got) == sorted(int(v) for v in expected)
    with pytest.raises(ValueError, match="on_error"):
        DALILoader(damaged, 6, device="cpu", on_error="ignore")


@needs_dali
def test_dali_loader_raise_names_the_record_instead_of_failing_inside_dali(damaged, tree):
    from fastload.dali import DALILoader

    loader = DALILoader(damaged, 6, device="cpu", num_threads=1, py_num_workers=1, crop=24, shuffle=False)
    with pytest.raises(Exception) as info:  # DALI re-raises a worker's error as Exception, text kept
        for _ in loader:
            pass
    _names_record(str(info.value), damaged, 3, str(tree / "c0" / "img003.jpg"))


def test_dali_source_payload_check():
    from _pack_helpers import jpeg_bytes  # noqa: I001
    from fastload.gpu.dali import payload_problem  # importable without DALI itself

    jpg = np.frombuffer(jpeg_bytes(gradient(*HW)), np.uint8)
    assert payload_problem(jpg, "jpeg", HW) is None
    assert payload_problem(jpg, "original") is None
    if jpegcrop.available():  # the header is parsed by fastload's extension when it was built
        assert "header says" in payload_problem(jpg, "jpeg", (HW[0] + 1, HW[1]))
    assert "end-of-image" in payload_problem(np.frombuffer(_damage(jpg.tobytes(), "tail"), np.uint8), "jpeg")
    assert "start-of-image" in payload_problem(np.frombuffer(_damage(jpg.tobytes(), "head"), np.uint8), "jpeg")
    png = np.frombuffer(b"\x89PNG\r\n\x1a\n" + bytes(40), np.uint8)
    assert payload_problem(png, "png") is None and payload_problem(png, "original") is None
    assert "not a bmp" in payload_problem(png, "bmp")
    assert "no image" in payload_problem(np.zeros(2, np.uint8), "png")


# -- the loaders: a whole epoch over a damaged pack --------------------------------------------


def _ring_loader(root, *, workers, on_error, transform=RRC, **kw):
    from fastload.data.loader import DataLoader

    return DataLoader(ImageFolder(root, Compose(list(transform))), 4, num_workers=workers, seed=2,
                      on_error=on_error, pin_memory=False, **kw)


@pytest.mark.parametrize("workers", [0, 2])
def test_loader_skip_finishes_the_epoch_with_fixed_batches_and_reports_exactly_the_bad_records(damaged, workers):
    loader = _ring_loader(damaged, workers=workers, on_error="skip")
    assert loader.mode == "ring"
    shapes, labels = [], []
    for images, targets in loader:
        shapes.append(tuple(images.shape[1:]))
        labels += targets.tolist()
    assert len(labels) == N and set(shapes) == {(3, 24, 24)}  # the epoch's length and shapes stay fixed
    stats = loader.stats()
    assert stats["replaced"] == len(BAD)
    assert sorted(r.index for r in stats["records"]) == sorted(BAD)
    for r in stats["records"]:
        assert r.substitute not in BAD and r.epoch == 0 and "record" in r.reason
    # the substitutes' labels are served in the bad records' places (position by position)
    ds = ImageFolder(damaged)
    order = loader.plan.indices(0).tolist()
    subs = {r.index: r.substitute for r in stats["records"]}
    assert labels == [int(ds.targets[subs.get(i, i)]) for i in order]
    loader.close()


@pytest.mark.parametrize("workers", [0, 2])
def test_loader_skip_is_deterministic_and_equal_across_worker_counts(damaged, workers):
    def run(w):
        with _ring_loader(damaged, workers=w, on_error="skip") as loader:
            return [(x.clone(), y.clone()) for x, y in loader]

    a, b = run(workers), run(0)
    assert all(torch.equal(x1, x2) and torch.equal(y1, y2) for (x1, y1), (x2, y2) in zip(a, b))


@pytest.mark.parametrize("workers", [0, 2])
def test_loader_raise_names_the_record_shard_and_source(damaged, workers):
    loader = _ring_loader(damaged, workers=workers, on_error="raise")
    with pytest.raises((DecodeError, FormatError)) as err:
        for _ in loader:
            pass
    msg = str(err.value)
    bad = [i for i in BAD if f"dataset index {i}" in msg]
    assert len(bad) == 1
    _names_record(msg, damaged, bad[0], ImageFolder(damaged).path(bad[0]))
    loader.close()


def test_per_sample_path_skips_too_and_reports(damaged):
    from fastload.data.loader import DataLoader

    transform = Compose([*RRC, ToTensor(scale=False)])
    with pytest.warns(Warning, match="per-sample"):
        loader = DataLoader(ImageFolder(damaged, transform), 4, num_workers=2, seed=2, on_error="skip",
                            pin_memory=False)
    assert loader.mode == "per-sample"
    n = sum(len(y) for _, y in loader)
    assert n == N and sorted(r.index for r in loader.stats()["records"]) == sorted(BAD)
    loader.close()


def test_trainer_epoch_line_reports_replaced_records(damaged):
    from torch import nn

    from fastload.train import Trainer, TrainConfig

    loader = _ring_loader(damaged, workers=0, on_error="skip")
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 24 * 24, 3))
    lines = []
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.01), config=TrainConfig(), device="cpu",
                      log=lines.append)
    trainer.fit(loader, epochs=1)
    assert "3 corrupt record(s) replaced" in lines[0]
    assert trainer.history[0]["train"]["replaced"] == 3


def test_make_loader_passes_the_policy(damaged):
    from fastload import make_loader

    loader = make_loader(damaged, backend="cpu", batch_size=4, crop=24, device="cpu", num_workers=0,
                         on_error="skip", drop_last=False)
    assert sum(len(y) for _, y in loader) == N
    assert loader.loader.stats()["replaced"] == len(BAD)
    with pytest.raises(ValueError, match="on_error"):
        make_loader(damaged, backend="cpu", batch_size=4, device="cpu", on_error="ignore")
