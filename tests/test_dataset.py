"""fastload.ImageFolder over real LMDB/HDF5 packs: torchvision parity, decoders, errors, pickling."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import numpy as np
import pytest

import fastload.transforms as T
from fastload.data.dataset import ImageFolder
from fastload.errors import DecodeError, FormatError
from fastload.image import IMG_EXTENSIONS, load_source

from _data_helpers import make_pack


def torchvision_style_scan(root: Path):
    """What torchvision.datasets.ImageFolder finds (its make_dataset rule, re-stated)."""
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
    class_to_idx = {c: i for i, c in enumerate(classes)}
    samples = []
    for c in classes:
        for dirpath, _, fnames in sorted(os.walk(root / c, followlinks=True)):
            for f in sorted(fnames):
                if f.lower().endswith(IMG_EXTENSIONS):
                    samples.append((os.path.join(dirpath, f), class_to_idx[c]))
    return classes, class_to_idx, samples


@pytest.fixture(scope="module", params=["lmdb", "hdf5"])
def lossless_pack(request, sample_tree, tmp_path_factory):
    dest = tmp_path_factory.mktemp(f"png_{request.param}") / "pack"
    return make_pack(sample_tree, dest, backend=request.param, payload="png")


@pytest.fixture(scope="module")
def jpeg_pack(sample_tree, tmp_path_factory):
    return make_pack(sample_tree, tmp_path_factory.mktemp("jpeg") / "pack", payload="jpeg", quality=95)


def test_parity_with_torchvision_imagefolder(lossless_pack, sample_tree):
    ds = ImageFolder(lossless_pack, source_root=sample_tree)
    classes, class_to_idx, samples = torchvision_style_scan(sample_tree)
    assert ds.classes == classes
    assert ds.class_to_idx == class_to_idx
    assert list(ds.targets) == [t for _, t in samples]
    assert list(ds.samples) == samples
    assert len(ds) == len(samples) == 24
    for i in range(len(ds)):
        img, target = ds[i]
        assert isinstance(target, int) and target == samples[i][1]
        expected = load_source(Path(samples[i][0]).read_bytes())
        assert img.dtype == np.uint8 and img.shape == expected.shape
        assert np.array_equal(img, expected), f"pixels differ for {samples[i][0]}"


def test_samples_default_to_the_recorded_source_folder(lossless_pack, sample_tree, tmp_path):
    """Without source_root, samples hold real paths (the folder the pack was made from, as
    the manifest records it), so code that opens ``samples[i][0]`` keeps working."""
    _, _, samples = torchvision_style_scan(sample_tree)
    ds = ImageFolder(lossless_pack)
    assert [(Path(p).resolve(), t) for p, t in ds.samples] == [(Path(p).resolve(), t) for p, t in samples]
    assert all(Path(p).is_file() for p, _ in ds.samples)
    moved = ImageFolder(lossless_pack, source_root=tmp_path / "elsewhere")
    assert moved.samples[0][0] == str(tmp_path / "elsewhere" / os.path.relpath(samples[0][0], sample_tree))
    assert ImageFolder(lossless_pack, source_root="").samples[0][0] == os.path.relpath(samples[0][0], sample_tree)


def test_parity_with_real_torchvision_when_available(lossless_pack, sample_tree):
    datasets = pytest.importorskip("torchvision.datasets")
    ref = datasets.ImageFolder(str(sample_tree))
    ds = ImageFolder(lossless_pack, source_root=sample_tree)
    assert ds.classes == ref.classes and ds.class_to_idx == ref.class_to_idx
    assert list(ds.targets) == ref.targets and list(ds.samples) == ref.samples


def test_image_types(lossless_pack):
    import torch
    from PIL import Image

    arr, t = ImageFolder(lossless_pack)[3]
    ten, t2 = ImageFolder(lossless_pack, image_type="tensor")[3]
    assert isinstance(ten, torch.Tensor) and ten.dtype == torch.uint8 and ten.shape == (3, *arr.shape[:2])
    assert np.array_equal(ten.permute(1, 2, 0).numpy(), arr)
    seen = []

    def plain_callable(pil_img):  # a user's own PIL transform
        seen.append(type(pil_img))
        return pil_img.transpose(Image.FLIP_LEFT_RIGHT)

    pil, t3 = ImageFolder(lossless_pack, plain_callable, image_type="pil", target_transform=lambda y: y + 100)[3]
    assert seen == [Image.Image] or issubclass(seen[0], Image.Image)
    assert np.array_equal(np.asarray(pil), arr[:, ::-1])
    assert t == t2 == t3 - 100


def test_torchvision_pil_pipeline_runs_unchanged(lossless_pack):
    tv = pytest.importorskip("torchvision.transforms")
    pipeline = tv.Compose([tv.RandomResizedCrop(32), tv.RandomHorizontalFlip(), tv.ToTensor(),
                           tv.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
    img, target = ImageFolder(lossless_pack, pipeline, image_type="pil")[0]
    assert tuple(img.shape) == (3, 32, 32) and img.dtype.is_floating_point
    assert isinstance(target, int)


def test_fastload_transform_is_seeded_by_seed_epoch_index(jpeg_pack):
    t = T.Compose([T.RandomResizedCrop(40), T.RandomHorizontalFlip()])
    a, b = ImageFolder(jpeg_pack, t, seed=1), ImageFolder(jpeg_pack, t, seed=1)
    assert np.array_equal(a[5][0], b[5][0])
    a.set_epoch(1)
    assert not np.array_equal(a[5][0], b[5][0])
    assert np.array_equal(a[5][0], b.load(5, epoch=1))
    assert a[5][0].shape == (40, 40, 3)


def test_fill_batch_matches_getitem(jpeg_pack):
    ds = ImageFolder(jpeg_pack, T.Compose([T.RandomResizedCrop((24, 28)), T.RandomHorizontalFlip()]))
    assert ds.batch_image_shape() == (24, 28, 3)
    idx = np.array([7, 0, 23, 7])
    images = np.zeros((4, 24, 28, 3), np.uint8)
    targets = np.zeros(4, np.int64)
    ds.fill_batch(idx, images, targets, epoch=2)
    for k, i in enumerate(idx):
        assert np.array_equal(images[k], ds.load(int(i), epoch=2))
        assert targets[k] == ds.targets[i]


def test_dct_reduce_is_close_to_a_full_decode(jpeg_pack):
    t = T.Compose([T.Resize((30, 40))])
    fast, full = ImageFolder(jpeg_pack, t), ImageFolder(jpeg_pack, t, dct_reduce=False)
    plan = t.plan(fast.stored_hw(0), np.random.default_rng(0))
    assert plan.reduce_for(fast.stored_hw(0)) == 4  # 120x160 stored, 30x40 wanted: a 1/4 DCT decode
    for i in (0, 9, 17):
        diff = np.abs(fast[i][0].astype(int) - full[i][0].astype(int)).mean()
        assert diff < 4.0


@pytest.mark.parametrize("decoder", ["cv2", "simplejpeg", "jpeg4py", "pil", "turbo-crop"])
def test_decoders_give_close_images(jpeg_pack, decoder):
    try:
        ds = ImageFolder(jpeg_pack, decoder=decoder)
        ds[0]
    except ImportError as exc:
        pytest.skip(f"{decoder} not usable here: {exc}")
    ref = ImageFolder(jpeg_pack, decoder="cv2")
    assert ds.decoder == decoder
    for i in (0, 11, 23):
        a, b = ds[i][0], ref[i][0]
        assert a.shape == b.shape
        assert np.abs(a.astype(int) - b.astype(int)).mean() < 1.5


def test_auto_decoder_says_what_it_picked(jpeg_pack, lossless_pack):
    assert ImageFolder(jpeg_pack).decoder in ("turbo-crop", "simplejpeg", "cv2", "jpeg4py", "pil")
    assert ImageFolder(lossless_pack).decoder == "cv2"
    with pytest.raises(ValueError, match="decoder"):
        ImageFolder(jpeg_pack, decoder="turbo")
    with pytest.raises(ValueError, match="image_type"):
        ImageFolder(jpeg_pack, image_type="bytes")


def test_raw_payload_returns_owned_arrays(sample_tree, tmp_path):
    pack = make_pack(sample_tree, tmp_path / "raw", payload="raw", size=(32, 48))
    ds = ImageFolder(pack)
    img, _ = ds[2]
    assert img.shape == (32, 48, 3) and img.flags.writeable and img.flags.owndata
    assert ds.batch_image_shape() == (32, 48, 3)
    assert ds.decoder == "none"


def test_pickles_small_without_handles(jpeg_pack):
    ds = ImageFolder(jpeg_pack, T.RandomResizedCrop(16))
    before = ds[4][0]  # opens the shard
    blob = pickle.dumps(ds)
    # labels (8 B) + shapes (12 B) per sample plus a fixed overhead; no payload, no path list
    assert len(blob) < 4096 + 20 * len(ds)
    clone = pickle.loads(blob)
    assert np.array_equal(clone[4][0], before)
    assert clone.samples[4] == ds.samples[4]


def _corrupt_record(pack: Path, ds: ImageFolder, i: int) -> str:
    payload = bytes(ds.reader.get(i))
    k, _ = ds.reader.locate(i)
    shard = ds.reader.shard_path(k)
    ds.reader.close()
    data = bytearray(shard.read_bytes())
    pos = data.find(payload)
    assert pos >= 0
    data[pos : pos + len(payload)] = bytes(len(payload))  # same size: passes the size check
    shard.write_bytes(bytes(data))
    return shard.name


@pytest.mark.parametrize("backend", ["lmdb", "hdf5"])
def test_corrupt_record_error_names_the_shard(sample_tree, tmp_path, backend):
    pack = make_pack(sample_tree, tmp_path / "p", backend=backend, payload="jpeg")
    shard_name = _corrupt_record(pack, ImageFolder(pack), 5)
    ds = ImageFolder(pack, decoder="cv2")
    ds[4]  # neighbours still fine
    with pytest.raises((DecodeError, FormatError)) as info:  # the record checksum catches it first
        ds[5]
    msg = str(info.value)
    assert shard_name in msg and "record 5" in msg and ds.samples[5][0] in msg


def test_in_memory_reads_the_same(jpeg_pack):
    ds = ImageFolder(jpeg_pack, in_memory=True)
    assert str(ds.reader.root).startswith("/dev/shm/")
    assert np.array_equal(ds[6][0], ImageFolder(jpeg_pack)[6][0])
    again = ImageFolder(jpeg_pack, in_memory=True)
    assert again.reader.root == ds.reader.root  # one copy per node, reused


def test_index_errors(jpeg_pack):
    ds = ImageFolder(jpeg_pack)
    with pytest.raises(IndexError):
        ds[len(ds)]
    assert np.array_equal(ds[-1][0], ds[len(ds) - 1][0])


_SHM_USER = """
import hashlib, sys
import numpy as np
from fastload.data.dataset import ImageFolder
from fastload.data.loader import DataLoader
from fastload.transforms import CenterCrop

def digest(ds):
    h = hashlib.sha256()
    for i in range(len(ds)):
        h.update(np.ascontiguousarray(ds[i][0]).tobytes())
    return h.hexdigest()

if __name__ == "__main__":
    pack = sys.argv[1]
    ds = ImageFolder(pack, in_memory=True)
    print(ds.reader.root, flush=True)
    sys.stdin.readline()  # wait for the test's go
    if sys.argv[2] == "user":
        # After the creator has gone: a dataset opened now, and a spawned worker, still read it.
        fresh = ImageFolder(pack, in_memory=True)
        cropped = ImageFolder(pack, CenterCrop(32), in_memory=True)
        loader = DataLoader(cropped, 8, num_workers=1, shuffle=False, multiprocessing_context="spawn")
        spawned = sum(int(images.shape[0]) for images, _ in loader)
        loader.close()
        print(digest(fresh), spawned, flush=True)
"""


def test_in_memory_copy_outlives_its_creator_and_the_last_user_removes_it(sample_tree, tmp_path):
    import subprocess
    import sys

    pack = make_pack(sample_tree, tmp_path / "pack", payload="jpeg")
    disk = ImageFolder(pack)
    import hashlib

    h = hashlib.sha256()
    for i in range(len(disk)):
        h.update(disk[i][0].tobytes())
    script = tmp_path / "shm_user.py"
    script.write_text(_SHM_USER)

    def start(role):
        p = subprocess.Popen([sys.executable, str(script), str(pack), role], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        return p, Path(p.stdout.readline().strip())

    creator, dest = start("creator")
    try:
        assert dest.parent == Path("/dev/shm") and (dest / ".complete").exists()
        user, dest2 = start("user")
        assert dest2 == dest  # one copy per node
        creator.communicate("go\n", timeout=60)
        assert creator.returncode == 0
        assert (dest / ".complete").exists(), "the creator removed the copy while another process used it"
        out, err = user.communicate("go\n", timeout=120)
        assert user.returncode == 0, err[-2000:]
        assert out.split() == [h.hexdigest(), str(len(disk))]
        assert not dest.exists() and not Path(f"{dest}.lock").exists(), "the last user left the copy behind"
    finally:
        for p in (creator, locals().get("user")):
            if p is not None and p.poll() is None:
                p.kill()


def _open_files_under(root: Path) -> list[str]:
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        # the pack's index file is memory-mapped on purpose (its pages are shared by every
        # process); shards must not be open
        if target.startswith(str(root)) and not target.endswith(".fli"):
            out.append(target)
    return out


@pytest.mark.parametrize("decoder", ["auto", "cv2"])
def test_no_shard_is_open_until_a_record_is_read(sample_tree, tmp_path, decoder):
    pack = make_pack(sample_tree, tmp_path / "p", payload="jpeg")
    ds = ImageFolder(pack, decoder=decoder)  # picking a decoder must not open the pack
    assert _open_files_under(pack) == [], "a shard is open before any worker needs it"
    ds[0]
    assert _open_files_under(pack) != []


@pytest.mark.parametrize("backend", ["lmdb", "hdf5"])
def test_parts_packed_separately_read_as_one_dataset(sample_tree, tmp_path, backend):
    whole = ImageFolder(make_pack(sample_tree, tmp_path / "whole", backend=backend, payload="png"))
    for part in range(3):
        make_pack(sample_tree, tmp_path / "parts", backend=backend, payload="png", part=part, parts=3)
    ds = ImageFolder(tmp_path / "parts")
    assert len(ds) == len(whole) == 24 and ds.classes == whole.classes
    assert list(ds.samples) == list(whole.samples) and list(ds.targets) == list(whole.targets)
    for i in (0, 7, 8, 15, 16, 23):  # across the part boundaries
        assert np.array_equal(ds[i][0], whole[i][0])


@pytest.mark.parametrize("decoder", ["simplejpeg", "pil", "cv2", "turbo-crop"])
def test_original_payload_applies_exif_orientation_with_every_decoder(tmp_path, rng, decoder):
    """Rotations by 180 degrees and mirrors keep the shape: only the EXIF tag tells them apart."""
    from PIL import Image

    src = tmp_path / "src"
    (src / "a").mkdir(parents=True)
    base = np.zeros((48, 64, 3), np.uint8)
    base[:24, :32] = (250, 20, 20)  # a red top-left quadrant shows where "up" is
    base[24:, 32:] = (20, 20, 250)
    for orientation in (1, 2, 3, 4, 6):
        exif = Image.Exif()
        exif[0x0112] = orientation
        Image.fromarray(base).save(src / "a" / f"o{orientation}.jpg", quality=95, exif=exif.tobytes())
    pack = make_pack(src, tmp_path / "pack", payload="original")
    try:
        ds = ImageFolder(pack, decoder=decoder)
    except ImportError as exc:
        pytest.skip(f"{decoder} not usable here: {exc}")
    for i, (path, _) in enumerate(ds.samples):
        expected = load_source((src / path).read_bytes())
        got = ds[i][0]
        assert got.shape == expected.shape, path
        assert np.abs(got.astype(int) - expected.astype(int)).mean() < 3, f"{path}: orientation not applied"


def test_jpeg_orientation_detection(tmp_path):
    import io

    from PIL import Image

    from fastload.codecs import jpeg
    from fastload.image import jpeg_info

    assert jpeg_info(jpeg.encode(np.zeros((8, 8, 3), np.uint8))).orientation == 1  # no turn needed
    out = io.BytesIO()
    exif = Image.Exif()
    exif[0x0112] = 3
    Image.new("RGB", (8, 8)).save(out, "JPEG", exif=exif.tobytes())
    assert jpeg_info(out.getvalue()).orientation == 3
    assert jpeg_info(b"\x89PNG\r\n\x1a\n") is None and jpeg_info(b"") is None


def test_in_memory_reads_the_same_on_both_backends(lossless_pack):
    ds = ImageFolder(lossless_pack, in_memory=True)
    assert str(ds.reader.root).startswith("/dev/shm/") and ds.reader.backend in ("lmdb", "hdf5")
    disk = ImageFolder(lossless_pack)
    for i in (0, 13, 23):
        assert np.array_equal(ds[i][0], disk[i][0])


def test_in_memory_two_processes_racing_make_one_copy(sample_tree, tmp_path):
    import subprocess
    import sys

    pack = make_pack(sample_tree, tmp_path / "pack", payload="jpeg")
    script = tmp_path / "shm_user.py"
    script.write_text(_SHM_USER)
    procs = [subprocess.Popen([sys.executable, str(script), str(pack), "creator"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        dests = [Path(p.stdout.readline().strip()) for p in procs]
        assert dests[0] == dests[1] and (dests[0] / ".complete").exists()
        assert not list(Path("/dev/shm").glob(dests[0].name + ".tmp*")), "a losing copy was left behind"
        for p in procs:
            p.communicate("go\n", timeout=60)
            assert p.returncode == 0
        assert not dests[0].exists()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
