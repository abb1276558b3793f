"""turbo-crop: the C extension fastload._jpegcrop and its use by ImageFolder.

The cropped decode must equal the same box cut from a full decode at the same scale, exactly
(the extension decodes one extra column each side so fancy chroma upsampling sees the same
neighbours); the whole-image decode must equal simplejpeg's (same libjpeg-turbo settings).
"""

from __future__ import annotations

import io
import pickle
import threading

import cv2
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastload import transforms as T
from fastload.codecs import jpeg, jpegcrop
from fastload.data.dataset import ImageFolder
from fastload.errors import CorruptRecordError, DecodeError

from _data_helpers import collect, make_pack

pytestmark = pytest.mark.skipif(not jpegcrop.available(), reason="fastload._jpegcrop not built (no libjpeg-turbo headers)")

SAMPLING = {
    "420": cv2.IMWRITE_JPEG_SAMPLING_FACTOR_420,
    "422": cv2.IMWRITE_JPEG_SAMPLING_FACTOR_422,
    "444": cv2.IMWRITE_JPEG_SAMPLING_FACTOR_444,
}


def _photo(h: int = 203, w: int = 317) -> np.ndarray:
    """A smooth photo-like RGB image with edges and colour (chroma upsampling matters)."""
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    img = np.stack([128 + 100 * np.sin(x / 13.0), 128 + 100 * np.cos(y / 9.0), (x * 3 + y * 5) % 256], axis=2)
    img[h // 3 : h // 2, w // 4 : w // 2] = (250, 10, 40)
    return np.clip(img, 0, 255).astype(np.uint8)


def _encode(img: np.ndarray, sampling: str = "420", progressive: bool = False) -> bytes:
    params = [cv2.IMWRITE_JPEG_QUALITY, 90, cv2.IMWRITE_JPEG_SAMPLING_FACTOR, SAMPLING[sampling]]
    if progressive:
        params += [cv2.IMWRITE_JPEG_PROGRESSIVE, 1]
    ok, buf = cv2.imencode(".jpg", cv2.cvtColor(img, cv2.COLOR_RGB2BGR), params)
    assert ok
    return buf.tobytes()


_JPEGS = {(s, p): _encode(_photo(), s, p) for s in SAMPLING for p in (False, True)}


@settings(max_examples=200, deadline=None)
@given(key=st.sampled_from(sorted(_JPEGS)), reduce=st.sampled_from([1, 2, 4, 8]), data=st.data())
def test_crop_equals_full_decode_cropped_exactly(key, reduce, data):
    buf = _JPEGS[key]
    full = jpegcrop.decode(buf, reduce=reduce)
    H, W = full.shape[:2]
    assert (H, W) == jpegcrop.scaled_hw(203, 317, reduce)
    t = data.draw(st.integers(0, H - 1))
    l = data.draw(st.integers(0, W - 1))
    h = data.draw(st.integers(1, H - t))
    w = data.draw(st.integers(1, W - l))
    crop = jpegcrop.decode_crop(buf, (t, l, h, w), reduce=reduce)
    assert crop.shape == (h, w, 3)
    np.testing.assert_array_equal(crop, full[t : t + h, l : l + w])


@pytest.mark.parametrize("reduce", [1, 2, 4, 8])
@pytest.mark.parametrize("key", sorted(_JPEGS))
def test_full_decode_equals_simplejpeg(key, reduce):
    import simplejpeg

    buf = _JPEGS[key]
    ref = jpeg.decode(buf, backend="simplejpeg", reduce=reduce)
    np.testing.assert_array_equal(jpeg.decode(buf, backend="turbo-crop", reduce=reduce), ref)
    assert simplejpeg.decode_jpeg_header(buf)[:2] == jpegcrop.header(buf)


@settings(max_examples=100, deadline=None)
@given(key=st.sampled_from(sorted(_JPEGS)), reduce=st.sampled_from([1, 2, 4, 8]), data=st.data())
def test_fast_crop_equals_fast_full_decode_cropped(key, reduce, data):
    """fast=True (fast IDCT, merged upsampling): a box is still exactly that box of a full
    decode with the same settings."""
    buf = _JPEGS[key]
    full = jpegcrop.decode(buf, reduce=reduce, fast=True)
    H, W = full.shape[:2]
    t, l = data.draw(st.integers(0, H - 1)), data.draw(st.integers(0, W - 1))
    h, w = data.draw(st.integers(1, H - t)), data.draw(st.integers(1, W - l))
    np.testing.assert_array_equal(jpegcrop.decode_crop(buf, (t, l, h, w), reduce=reduce, fast=True),
                                  full[t : t + h, l : l + w])


@pytest.mark.parametrize("key", sorted(_JPEGS))
def test_fast_decode_is_close_to_accurate_and_matches_simplejpeg_fast(key):
    buf = _JPEGS[key]
    fast, accurate = jpegcrop.decode(buf, fast=True), jpegcrop.decode(buf)
    diff = np.abs(fast.astype(int) - accurate.astype(int))
    assert 0 < diff.mean() < 8  # a different decode (this test image is all sharp colour), not a different image
    np.testing.assert_array_equal(jpeg.decode(buf, backend="simplejpeg", fast=True), fast)
    np.testing.assert_array_equal(jpeg.decode(buf, backend="turbo-crop", fast=True), fast)


def test_decode_into_out_buffer_and_its_size_check():
    buf = _JPEGS[("420", False)]
    out = np.zeros(jpegcrop.out_bytes(50, 60), np.uint8)
    crop = jpegcrop.decode_crop(buf, (10, 33, 50, 60), out=out)
    assert np.shares_memory(crop, out)
    np.testing.assert_array_equal(crop, jpegcrop.decode(buf)[10:60, 33:93])
    with pytest.raises(ValueError, match="bytes"):
        jpegcrop.decode_crop(buf, (10, 33, 50, 60), out=np.zeros(50 * 60 * 3 - 1, np.uint8))


def test_box_outside_the_image_is_a_clear_error():
    buf = _JPEGS[("420", False)]
    with pytest.raises(ValueError, match="not inside the 102x159 image"):
        jpegcrop.decode_crop(buf, (100, 0, 5, 5), reduce=2)
    with pytest.raises(ValueError, match="reduce"):
        jpegcrop.decode_crop(buf, (0, 0, 5, 5), reduce=3)


@pytest.mark.parametrize("cut", [0.3, 0.6, 0.95])
def test_truncated_jpeg_raises_decode_error(cut):
    buf = _JPEGS[("420", False)]
    with pytest.raises(DecodeError, match="JPEG"):
        jpegcrop.decode_crop(buf[: int(len(buf) * cut)], (0, 0, 200, 300))


@pytest.mark.parametrize("payload", [b"", b"\xff\xd8", b"not a jpeg at all", bytes(range(256)) * 4])
def test_garbage_raises_decode_error(payload):
    with pytest.raises(DecodeError):
        jpegcrop.decode(payload)


def test_corrupt_entropy_data_raises_not_grey_fill():
    buf = bytearray(_JPEGS[("420", False)])
    sos = buf.index(b"\xff\xda")
    rng = np.random.default_rng(0)
    for k in rng.integers(sos + 40, len(buf) - 10, 60):  # scribble over the scan data
        buf[k] = 0xFF if buf[k] != 0xFF else 0x00
    with pytest.raises(DecodeError):
        jpegcrop.decode(bytes(buf))


def test_grayscale_jpeg_gives_three_equal_channels():
    gray = cv2.cvtColor(_photo(), cv2.COLOR_RGB2GRAY)
    ok, buf = cv2.imencode(".jpg", gray, [cv2.IMWRITE_JPEG_QUALITY, 90])
    assert jpegcrop.header(buf) == gray.shape
    crop = jpegcrop.decode_crop(buf, (20, 30, 40, 50))
    assert crop.shape == (40, 50, 3)
    assert (crop[..., 0] == crop[..., 1]).all() and (crop[..., 1] == crop[..., 2]).all()
    assert np.abs(crop[..., 0].astype(int) - gray[20:60, 30:80]).mean() < 2


def test_cmyk_jpeg_falls_back_to_opencv():
    from PIL import Image

    rgb = _photo(64, 80)
    bio = io.BytesIO()
    Image.fromarray(rgb).convert("CMYK").save(bio, "JPEG", quality=95)
    data = bio.getvalue()
    with pytest.raises(jpegcrop._ext().Unsupported):
        jpegcrop._ext().decode_crop(data)
    crop = jpegcrop.decode_crop(data, (5, 7, 30, 40))
    np.testing.assert_array_equal(crop, jpeg.decode(data, backend="cv2")[5:35, 7:47])


def test_decodes_in_threads_concurrently():
    """The GIL is released around libjpeg: threads decoding at once get the right pixels."""
    buf = _JPEGS[("420", True)]
    ref = jpegcrop.decode(buf)
    errors = []

    def run(seed):
        rng = np.random.default_rng(seed)
        for _ in range(40):
            t, l = int(rng.integers(0, 150)), int(rng.integers(0, 250))
            out = jpegcrop.scratch(jpegcrop.out_bytes(50, 60))
            if not np.array_equal(jpegcrop.decode_crop(buf, (t, l, 50, 60), out=out), ref[t : t + 50, l : l + 60]):
                errors.append(seed)

    threads = [threading.Thread(target=run, args=(s,)) for s in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []


# -- restart-segment grid ---------------------------------------------------------------------


def _encode_rst(img: np.ndarray, interval: int, sampling: str = "420") -> bytes:
    params = [cv2.IMWRITE_JPEG_QUALITY, 90, cv2.IMWRITE_JPEG_RST_INTERVAL, interval]
    if img.ndim == 3:
        params += [cv2.IMWRITE_JPEG_SAMPLING_FACTOR, SAMPLING[sampling]]
        img = cv2.cvtColor(img, cv2.COLOR_RGB2BGR)
    ok, buf = cv2.imencode(".jpg", img, params)
    assert ok
    return buf.tobytes()


# (sampling, height, width, interval): MCU 16x16 (420), 16x8 (422), 8x8 (444 and gray); sizes
# that end in a partial MCU, one MCU or one segment across, segments of 1..5 MCUs.
_GRID_CASES = [("420", 203, 317, 2), ("420", 203, 317, 4), ("420", 200, 320, 1), ("420", 17, 321, 3),
               ("422", 203, 317, 5), ("444", 203, 317, 1), ("444", 61, 64, 8), ("gray", 203, 317, 4),
               ("420", 33, 16, 1), ("420", 100, 30, 2)]
_GRID_JPEGS = {
    c: _encode_rst(cv2.cvtColor(_photo(c[1], c[2]), cv2.COLOR_RGB2GRAY) if c[0] == "gray" else _photo(c[1], c[2]),
                   c[3], "420" if c[0] == "gray" else c[0])
    for c in _GRID_CASES
}


@pytest.mark.parametrize("case", _GRID_CASES, ids=lambda c: "-".join(map(str, c)))
def test_restart_grid_is_found(case):
    sampling, h, w, interval = case
    mcu_h, mcu_w = {"420": (16, 16), "422": (8, 16), "444": (8, 8), "gray": (8, 8)}[sampling]
    assert jpegcrop.restart_grid(_GRID_JPEGS[case]) == (interval, mcu_h, mcu_w, -(-h // mcu_h), -(-w // mcu_w))


def test_no_grid_without_restarts_or_when_segments_straddle_rows():
    assert jpegcrop.restart_grid(_JPEGS[("420", False)]) is None
    assert jpegcrop.restart_grid(_JPEGS[("420", True)]) is None  # progressive
    straddle = _encode_rst(_photo(64, 320), 3)  # 20 MCUs a row: 3 does not divide it
    assert jpegcrop.restart_grid(straddle) is None
    crop = jpegcrop.decode_crop(straddle, (20, 100, 30, 40))
    np.testing.assert_array_equal(crop, jpegcrop.decode(straddle)[20:50, 100:140])
    assert jpegcrop.restart_grid(b"\xff\xd8\xff\xdd\x00\x04") is None  # truncated header: no grid, no crash


@settings(max_examples=300, deadline=None)
@given(case=st.sampled_from(_GRID_CASES), reduce=st.sampled_from([1, 1, 2, 4, 8]), fast=st.booleans(),
       data=st.data())
def test_segment_cut_equals_full_decode_cropped_exactly(case, reduce, fast, data):
    """Decoding only the segments under the box gives exactly the box of a full decode (the
    2-pixel margin keeps fancy chroma upsampling away from the cut-out's edges), for every
    sampling, scale and box, including boxes at the image edges and 1-pixel ones."""
    buf = _GRID_JPEGS[case]
    full = jpegcrop.decode(buf, reduce=reduce, fast=fast)
    H, W = full.shape[:2]
    t, l = data.draw(st.integers(0, H - 1)), data.draw(st.integers(0, W - 1))
    h, w = data.draw(st.integers(1, H - t)), data.draw(st.integers(1, W - l))
    cut = jpegcrop.decode_crop(buf, (t, l, h, w), reduce=reduce, fast=fast)
    np.testing.assert_array_equal(cut, full[t : t + h, l : l + w])
    np.testing.assert_array_equal(jpegcrop.decode_crop(buf, (t, l, h, w), reduce=reduce, fast=fast, segments=False),
                                  cut)


def test_payload_encoder_writes_a_grid_with_the_same_pixels():
    img = _photo(256, 341)  # 22 MCUs a row: segments of 2 MCUs
    buf = jpeg.encode(img)
    assert jpegcrop.restart_grid(buf) == (2, 16, 16, 16, 22)
    assert jpegcrop.restart_grid(jpeg.encode(_photo(256, 330))) == (1, 16, 16, 16, 21)  # odd: every MCU
    plain = jpeg.encode(img, restart=False)
    assert jpegcrop.restart_grid(plain) is None
    np.testing.assert_array_equal(jpegcrop.decode(buf), jpegcrop.decode(plain))  # markers change no pixel
    for backend in ("cv2", "simplejpeg", "pil"):  # any decoder reads it
        np.testing.assert_array_equal(jpeg.decode(buf, backend=backend), jpeg.decode(plain, backend=backend))
    assert len(plain) < len(buf) < 1.1 * len(plain)


def test_segment_cut_reads_only_the_segments_it_needs():
    """Scribbling over the scan below and beside the box does not touch a cut decode (proof
    that those segments are not decoded), while the plain path, which entropy-decodes every
    MCU before the box's last one, fails on the damage beside it."""
    img = _photo(256, 341)
    buf = bytearray(jpeg.encode(img))
    ref = jpegcrop.decode(bytes(buf))
    sos = buf.index(b"\xff\xda")
    data_start = sos + 2 + int.from_bytes(buf[sos + 2 : sos + 4], "big")
    # Segment 1 (pixels 0..15 x 32..63, in the first MCU row) lies between RST0 and RST1.
    rst0 = buf.index(b"\xff\xd0", data_start)
    rst1 = buf.index(b"\xff\xd1", data_start)
    for k in range(rst0 + 3, rst1 - 1, 2):  # damage it, keeping the markers
        buf[k] = 0x00
    box = (40, 150, 60, 80)  # rows 40..99, columns 150..229: far from segment 1
    got = jpegcrop.decode_crop(bytes(buf), box)
    np.testing.assert_array_equal(got, ref[40:100, 150:230])
    with pytest.raises(DecodeError, match="JPEG"):
        jpegcrop.decode_crop(bytes(buf), box, segments=False)


@pytest.mark.parametrize("damage", ["truncate", "renumber"])
def test_segment_damage_under_the_box_raises_decode_error(damage):
    buf = bytearray(jpeg.encode(_photo(256, 341)))
    if damage == "truncate":  # the box's segments are not all there: the plain path reports it
        bad = bytes(buf[: len(buf) * 2 // 3])
    else:  # a restart marker out of sequence before the box
        sos = buf.index(b"\xff\xda")
        k = buf.index(b"\xff\xd3", sos)
        buf[k + 1] = 0xD5
        bad = bytes(buf)
    with pytest.raises(DecodeError, match="JPEG"):
        jpegcrop.decode_crop(bad, (200, 100, 50, 60))


@settings(max_examples=200, deadline=None)
@given(case=st.sampled_from(_GRID_CASES), data=st.data())
def test_damaged_grid_jpeg_decodes_or_raises_decode_error(case, data):
    """Random bytes scribbled over (or cut off) a restart-marker JPEG: the segment cut must
    come back with a box of the right shape or raise DecodeError, nothing else (the C side
    parses markers and lengths from untrusted bytes)."""
    buf = bytearray(_GRID_JPEGS[case])
    for _ in range(data.draw(st.integers(1, 6))):
        buf[data.draw(st.integers(0, len(buf) - 1))] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        del buf[data.draw(st.integers(0, len(buf) - 1)) :]
    _, h_img, w_img, _ = case
    t, l = data.draw(st.integers(0, h_img - 1)), data.draw(st.integers(0, w_img - 1))
    h, w = data.draw(st.integers(1, h_img - t)), data.draw(st.integers(1, w_img - l))
    try:
        crop = jpegcrop.decode_crop(bytes(buf), (t, l, h, w))
    except DecodeError:
        return
    except ValueError as exc:  # the damage may change the frame size in the header
        assert "not inside" in str(exc)
        return
    assert crop.shape == (h, w, 3)


# -- ImageFolder with decoder="turbo-crop" --------------------------------------------------


@pytest.fixture(scope="module")
def jpeg_pack(tmp_path_factory):
    from fastload.sample import make_image_folder

    root = tmp_path_factory.mktemp("jc")
    make_image_folder(root / "src", num_classes=3, per_class=6, size=(150, 200), seed=3)
    return make_pack(root / "src", root / "pack", payload="jpeg", quality=90)


AUG = T.Compose([T.RandomResizedCrop(96), T.RandomHorizontalFlip()])


def test_auto_prefers_turbo_crop(jpeg_pack):
    assert ImageFolder(jpeg_pack).decoder == "turbo-crop"
    assert ImageFolder(jpeg_pack, decoder="simplejpeg").decoder == "simplejpeg"


def test_batch_equals_simplejpeg_batch(jpeg_pack):
    """Same seed: identical crop boxes (the plan does not depend on the decoder) and the same
    libjpeg-turbo pixels, so the batches are equal (bound: mean abs diff < 0.5; in practice 0)."""
    a = ImageFolder(jpeg_pack, AUG, decoder="turbo-crop")
    b = ImageFolder(jpeg_pack, AUG, decoder="simplejpeg")
    idx = np.arange(len(a))
    imgs = [np.zeros((len(a), 96, 96, 3), np.uint8) for _ in range(2)]
    tg = [np.zeros(len(a), np.int64) for _ in range(2)]
    a.fill_batch(idx, imgs[0], tg[0], epoch=2)
    b.fill_batch(idx, imgs[1], tg[1], epoch=2)
    assert np.array_equal(tg[0], tg[1])
    assert np.abs(imgs[0].astype(int) - imgs[1].astype(int)).mean() < 0.5
    for i in (0, 7, 17):  # the per-sample path gives the batch's pixels
        np.testing.assert_array_equal(a.load(i, epoch=2), imgs[0][i])


def test_fast_decode_dataset(jpeg_pack):
    """ImageFolder(fast_decode=True): the batch path decodes with the fast settings (equal to
    the plan run on a fast full decode), close to the accurate batch but not equal to it."""
    fast = ImageFolder(jpeg_pack, AUG, fast_decode=True)
    slow = ImageFolder(jpeg_pack, AUG)
    assert fast.decoder == "turbo-crop" and fast.fast_decode and not slow.fast_decode
    idx = np.arange(len(fast))
    imgs = [np.zeros((len(fast), 96, 96, 3), np.uint8) for _ in range(2)]
    tg = np.zeros(len(fast), np.int64)
    fast.fill_batch(idx, imgs[0], tg, epoch=1)
    slow.fill_batch(idx, imgs[1], tg, epoch=1)
    diff = np.abs(imgs[0].astype(int) - imgs[1].astype(int))
    assert 0 < diff.mean() < 3
    for i in (0, 9):
        hw = fast.stored_hw(i)
        plan = fast._fast.plan(hw, fast._rng(1, i))
        full = jpegcrop.decode(fast.reader.get(i), reduce=plan.reduce_for(hw), fast=True)
        np.testing.assert_array_equal(plan.execute(full, hw), imgs[0][i])
    assert pickle.loads(pickle.dumps(fast)).fast_decode


@pytest.mark.parametrize("t", [
    T.Compose([T.Resize(60), T.CenterCrop(50)]),  # reduce 2: DCT-downscaled box
    T.Compose([T.CenterCrop(300)]),  # box larger than the image: padded, full-decode path
    T.Compose([T.RandomResizedCrop(40, scale=(0.9, 1.0))]),  # reduce 2 or 4
])
def test_other_plans_match_simplejpeg(jpeg_pack, t):
    a = ImageFolder(jpeg_pack, t, decoder="turbo-crop")
    b = ImageFolder(jpeg_pack, t, decoder="simplejpeg")
    for i in (0, 5, 11):
        x, y = a[i][0], b[i][0]
        assert x.shape == y.shape
        assert np.abs(x.astype(int) - y.astype(int)).mean() < 0.5


def test_loader_workers_give_the_same_batches(jpeg_pack):
    from fastload.data.loader import DataLoader

    ds = ImageFolder(jpeg_pack, AUG)
    assert ds.decoder == "turbo-crop"
    runs = []
    for workers in (0, 2):
        loader = DataLoader(ds, 5, num_workers=workers, seed=7)
        try:
            runs.append(collect(loader))
        finally:
            loader.close()
    assert len(runs[0]) == len(runs[1]) == 4
    for (x, tx), (y, ty) in zip(*runs):
        assert np.array_equal(x.numpy(), y.numpy()) and np.array_equal(tx.numpy(), ty.numpy())
    assert len(pickle.dumps(ds)) < 20_000


def test_corrupt_record_error_names_the_shard(jpeg_pack, tmp_path):
    import shutil

    from fastload.storage import open_pack

    pack = tmp_path / "pack"
    shutil.copytree(jpeg_pack, pack)
    reader = open_pack(pack)
    k, j = reader.locate(4)
    shard = reader.shard_path(k)
    data = bytearray(shard.read_bytes())
    rec = bytes(reader.get(4))
    pos = data.index(rec)
    data[pos + len(rec) // 2 : pos + len(rec)] = b"\x00" * (len(rec) - len(rec) // 2)  # zero the tail of its scan
    shard.write_bytes(bytes(data))
    # A box covering the whole image: the decoder stops after a box's last row, so damage
    # below a random crop box would (rightly) go unnoticed.
    ds = ImageFolder(pack, T.Resize((100, 100)), check_files=False)
    assert ds.decoder == "turbo-crop"
    # The record's checksum catches the damage before the decoder sees it (either way the
    # error names the shard, the record and its dataset index, as a decode error would).
    with pytest.raises(CorruptRecordError, match=rf"{shard.name}.*record {j}.*dataset index 4"):
        ds.load(4)


def test_original_payload_exif_orientation_kept_with_crop_plan(tmp_path):
    """Originals with EXIF keep going through OpenCV (orientation applied); plain JPEGs take
    the crop decoder; both give what a PIL-oriented decode + the same plan gives."""
    from PIL import Image

    from fastload.image import load_source

    src = tmp_path / "src"
    (src / "a").mkdir(parents=True)
    base = _photo(48, 64)
    for orientation in (1, 3, 6):
        exif = Image.Exif()
        exif[0x0112] = orientation
        Image.fromarray(base).save(src / "a" / f"o{orientation}.jpg", quality=95, exif=exif.tobytes())
    Image.fromarray(base).save(src / "a" / "plain.jpg", quality=95)
    pack = make_pack(src, tmp_path / "pack", payload="original")
    t = T.Compose([T.CenterCrop(40), T.Resize((20, 20))])
    ds = ImageFolder(pack, t)
    assert ds.decoder == "turbo-crop"
    for i, (path, _) in enumerate(ds.samples):
        expected = t(load_source((src / path).read_bytes()), rng=np.random.default_rng(0))
        got = ds[i][0]
        assert got.shape == expected.shape == (20, 20, 3)
        assert np.abs(got.astype(int) - expected.astype(int)).mean() < 3, f"{path}: orientation or crop wrong"
