"""Issue 14: the shape a pack's index stores for a record is the shape every reader decodes.

The packer sizes an ``original`` JPEG by :func:`fastload.image.jpeg_info`'s EXIF orientation
(APP1 anywhere before the scan, fill bytes, either byte order; XMP ignored, as OpenCV and DALI
ignore it), and every decoder (OpenCV, simplejpeg, jpeg4py, PIL, turbo-crop, DALI) turns its
pixels by that same rule. The JPEGs here are real bytes: an OpenCV-encoded image with an APP1
segment spliced where cameras and editors put it in the wild. A pack whose index disagrees
with its payloads (made by the pre-fix packer, which followed Pillow's ``exif_transpose``
and so honoured XMP) makes every read path raise a DecodeError naming the record, which
``on_error="skip"`` replaces; ``fastload verify --decode`` lists it.
"""

from __future__ import annotations

import io
import struct
import sys
from pathlib import Path

import cv2
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image, ImageOps

import fastload.image
from fastload import ImageFolder
from fastload.codecs import jpegcrop
from fastload.errors import DecodeError
from fastload.gpu.dali import payload_problem
from fastload.image import exif_orientations, jpeg_info, orient, oriented_hw, shape_problem
from fastload.storage import open_pack
from fastload.transforms import Compose, RandomHorizontalFlip, RandomResizedCrop

sys.path.insert(0, str(Path(__file__).parent))
from _data_helpers import make_pack  # noqa: E402
from _pack_helpers import run_cli  # noqa: E402

from _dali_helpers import needs_dali

H, W = 50, 30  # as coded: taller than wide, so a quarter turn shows in the shape
RRC = (RandomResizedCrop(16, scale=(0.3, 1.0)), RandomHorizontalFlip())
DECODERS = ("cv2", "simplejpeg", "jpeg4py", "pil", "turbo-crop")


# -- real JPEG bytes with EXIF/XMP where the wild puts it ----------------------------------------


def _coded_image() -> np.ndarray:
    """Four flat quadrants with a soft gradient: any turn or mirror moves a colour somewhere else."""
    img = np.zeros((H, W, 3), np.uint8)
    img[: H // 2, : W // 2] = (230, 30, 30)
    img[: H // 2, W // 2 :] = (30, 200, 30)
    img[H // 2 :, : W // 2] = (30, 30, 220)
    img[H // 2 :, W // 2 :] = (220, 220, 40)
    img[..., 2] = np.clip(img[..., 2].astype(int) + np.arange(W)[None, :], 0, 255).astype(np.uint8)
    return img


def _encode(img: np.ndarray) -> bytes:
    ok, out = cv2.imencode(".jpg", cv2.cvtColor(img, cv2.COLOR_RGB2BGR), [cv2.IMWRITE_JPEG_QUALITY, 95])
    assert ok
    return out.tobytes()


def exif_body(orientation: int, *, big_endian: bool = False, tag_type: int = 3) -> bytes:
    """An APP1 ``Exif`` body: a TIFF header and IFD0 with one entry, tag 0x0112."""
    e = ">" if big_endian else "<"
    value = struct.pack(e + "H", orientation) + bytes(2) if tag_type == 3 else struct.pack(e + "I", orientation)
    tiff = (b"MM\x00*" if big_endian else b"II*\x00") + struct.pack(e + "I", 8) + struct.pack(e + "H", 1)
    tiff += struct.pack(e + "HHI", 0x0112, tag_type, 1) + value + struct.pack(e + "I", 0)
    return b"Exif\x00\x00" + tiff


def exif_body_without_orientation() -> bytes:
    """An APP1 ``Exif`` body whose IFD0 holds one entry, not the orientation (0x0110, Model)."""
    tiff = b"II*\x00" + struct.pack("<I", 8) + struct.pack("<H", 1)
    tiff += struct.pack("<HHI", 0x0110, 3, 1) + struct.pack("<H", 1) + bytes(2) + struct.pack("<I", 0)
    return b"Exif\x00\x00" + tiff


def xmp_body(orientation: int, *, element: bool = False) -> bytes:
    """An APP1 XMP body carrying ``tiff:Orientation`` (as an attribute or an element)."""
    attr = "" if element else f' tiff:Orientation="{orientation}"'
    inner = f"<tiff:Orientation>{orientation}</tiff:Orientation>" if element else ""
    packet = (
        '<x:xmpmeta xmlns:x="adobe:ns:meta/"><rdf:RDF xmlns:rdf="http://www.w3.org/1999/02/22-rdf-syntax-ns#">'
        f'<rdf:Description xmlns:tiff="http://ns.adobe.com/tiff/1.0/"{attr}>{inner}</rdf:Description>'
        "</rdf:RDF></x:xmpmeta>"
    )
    return b"http://ns.adobe.com/xap/1.0/\x00" + packet.encode()


def _segments(data: bytes) -> list[tuple[int, int, int]]:
    """(offset, marker, length) of each header segment of a JPEG without fill bytes."""
    pos, out = 2, []
    while True:
        marker = data[pos + 1]
        (length,) = struct.unpack(">H", data[pos + 2 : pos + 4])
        out.append((pos, marker, length))
        if marker == 0xDA:
            return out
        pos += 2 + length


def splice(data: bytes, body: bytes, *, after: int | None, fill: int = 0) -> bytes:
    """``data`` with an APP1 segment holding ``body`` put after the first segment with marker
    ``after`` (None: right after SOI), preceded by ``fill`` 0xFF fill bytes."""
    pos = 2
    if after is not None:
        off, _, length = next(s for s in _segments(data) if s[1] == after)
        pos = off + 2 + length
    return data[:pos] + b"\xff" * fill + b"\xff\xe1" + struct.pack(">H", len(body) + 2) + body + data[pos:]


APP0, DQT, SOF0 = 0xE0, 0xDB, 0xC0
BASE = _encode(_coded_image())
# name -> (bytes, the orientation every reader applies)
CASES = {
    "exif6-first": (splice(BASE, exif_body(6), after=None), 6),
    "exif6-after-dqt-le": (splice(BASE, exif_body(6), after=DQT), 6),
    "exif6-after-dqt-be": (splice(BASE, exif_body(6, big_endian=True), after=DQT), 6),
    "exif6-fill-bytes-be": (splice(BASE, exif_body(6, big_endian=True), after=APP0, fill=3), 6),
    "exif8-after-sof-fill-le": (splice(BASE, exif_body(8), after=SOF0, fill=1), 8),
    "exif3-after-dqt-be": (splice(BASE, exif_body(3, big_endian=True), after=DQT), 3),
    "exif6-long-type": (splice(BASE, exif_body(6, tag_type=4), after=APP0), 6),
    # the first EXIF block has no orientation tag: the next one's counts
    "exif-untagged-then-exif6": (splice(splice(BASE, exif_body(6), after=DQT), exif_body_without_orientation(),
                                        after=APP0), 6),
    "xmp6-only": (splice(BASE, xmp_body(6), after=APP0), 1),
    "xmp6-element-only": (splice(BASE, xmp_body(6, element=True), after=DQT), 1),
    "exif1-and-xmp6": (splice(splice(BASE, xmp_body(6), after=APP0), exif_body(1), after=APP0), 1),
}


def reference(orientation: int, coded: np.ndarray) -> np.ndarray:
    """The upright image, by numpy's rotations (not by fastload's :func:`orient`)."""
    return {1: coded, 3: np.rot90(coded, 2), 6: np.rot90(coded, -1), 8: np.rot90(coded, 1)}[orientation]


def _coded_decode(data: bytes) -> np.ndarray:
    return cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR_RGB | cv2.IMREAD_IGNORE_ORIENTATION)


def _close(a: np.ndarray, b: np.ndarray, bound: float = 4.0) -> bool:
    return a.shape == b.shape and float(np.abs(a.astype(int) - b.astype(int)).mean()) < bound


# -- the orientation rule ----------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CASES))
def test_jpeg_info_reads_the_orientation_opencv_applies(name):
    data, orientation = CASES[name]
    info = jpeg_info(data)
    assert info == (H, W, orientation)
    for view in (np.frombuffer(data, np.uint8), memoryview(data), bytearray(data)):
        assert jpeg_info(view) == info
    upright = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR_RGB)  # OpenCV's own EXIF reading
    assert upright.shape[:2] == info.oriented_hw
    np.testing.assert_array_equal(upright, orient(_coded_decode(data), info.orientation))
    np.testing.assert_array_equal(upright, reference(orientation, _coded_decode(data)))


@pytest.mark.parametrize("orientation", range(1, 9))
def test_orient_is_pils_exif_transpose(orientation):
    out = io.BytesIO()
    exif = Image.Exif()
    exif[0x0112] = orientation
    Image.fromarray(_coded_image()).save(out, "JPEG", quality=95, exif=exif.tobytes())
    data = out.getvalue()
    pil = np.asarray(ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB"))
    coded = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    assert jpeg_info(data).orientation == orientation
    np.testing.assert_array_equal(orient(coded, orientation), pil)
    assert oriented_hw((H, W), orientation) == pil.shape[:2]
    np.testing.assert_array_equal(fastload.image.load_source(data), pil)


def test_jpeg_info_on_malformed_headers():
    tiff_cut = splice(BASE, exif_body(6)[:14], after=APP0)  # IFD0 offset points past the block
    bad_order = splice(BASE, b"Exif\x00\x00XX*\x00" + exif_body(6)[10:], after=APP0)
    out_of_range = splice(BASE, exif_body(9), after=APP0)
    for data in (tiff_cut, bad_order, out_of_range):
        assert jpeg_info(data) == (H, W, 1)  # a broken EXIF block turns nothing, as OpenCV
        assert cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR_RGB).shape[:2] == (H, W)
    assert jpeg_info(b"") is None and jpeg_info(b"\x89PNG\r\n\x1a\n" + bytes(30)) is None
    sof = next(s for s in _segments(BASE) if s[1] == SOF0)
    assert jpeg_info(BASE[: sof[0]]) is None  # cut before its frame header: no size to report
    assert shape_problem((H, W, 3), (H, W, 3)) is None
    assert shape_problem((7, 4, 3), (H, W, 3), reduce=8) is None  # libjpeg rounds up
    assert shape_problem((6, 3, 3), (H, W, 3), reduce=8) is None  # a resize rounds down
    assert shape_problem((W, H, 3), (H, W, 3)) == f"decoded {W}x{H}, index says {H}x{W}: run `fastload verify --decode`"


@pytest.mark.parametrize("decoder", DECODERS)
def test_every_jpeg_backend_decodes_libjpegs_size_at_every_scale(decoder):
    """The index's shape scaled by 1/reduce, rounded up, is what each backend gives (Pillow's
    draft used to pick 1/2 where 1/4 was asked for)."""
    from fastload.codecs import jpeg

    if not _usable(decoder):
        pytest.skip(f"{decoder} is not built here")
    rng = np.random.default_rng(5)
    for h, w in [(1, 3), (7, 9), (17, 64), (50, 30), (65, 99), (100, 341)]:
        data = jpeg.encode(rng.integers(0, 256, (h, w, 3), np.uint8))
        for reduce in (1, 2, 4, 8):
            assert jpeg.decode(data, backend=decoder, reduce=reduce).shape == (-(-h // reduce), -(-w // reduce), 3)


@settings(max_examples=300, deadline=None)
@given(case=st.sampled_from(sorted(CASES)), cut=st.integers(0, 400),
       flips=st.lists(st.tuples(st.integers(0, 399), st.integers(0, 255)), max_size=6))
def test_jpeg_info_never_raises_on_damaged_headers(case, cut, flips):
    """Truncated or overwritten header bytes give None or a valid orientation, never an
    exception: the parser runs on every record read, on whatever bytes the shard holds."""
    data = bytearray(CASES[case][0])
    for pos, value in flips:
        data[pos % len(data)] = value
    for buf in (bytes(data), bytes(data[: min(cut, len(data))])):
        info = jpeg_info(buf)
        assert info is None or (1 <= info.orientation <= 8 and info.height >= 0 and info.width >= 0)


def test_two_exif_blocks_the_first_tag_counts_and_dali_is_spared_a_disagreement():
    """OpenCV reads the first orientation tag; a tag with a value outside 1..8 counts (as 1); a
    block cut short is passed over. DALI 2.4's CPU decoder crashes the process (SIGSEGV, seen
    while writing these tests) on two blocks that disagree: its source refuses such a record."""
    cases = {
        (3, 6): (splice(splice(BASE, exif_body(6), after=DQT), exif_body(3), after=APP0), 3),
        (1, 6): (splice(splice(BASE, exif_body(6), after=DQT), exif_body(9), after=APP0), 1),
        (6,): (splice(splice(BASE, exif_body(6), after=DQT), exif_body(3)[:14], after=APP0), 6),
        (6, 6): (splice(splice(BASE, exif_body(6), after=DQT), exif_body(6), after=APP0), 6),
    }
    for tags, (data, orientation) in cases.items():
        assert exif_orientations(data) == tags and jpeg_info(data).orientation == orientation
        upright = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR_RGB)
        np.testing.assert_array_equal(upright, orient(_coded_decode(data), orientation))
        buf, hw = np.frombuffer(data, np.uint8), oriented_hw((H, W), orientation)
        problem = payload_problem(buf, "original", hw)
        if len(set(tags)) > 1:
            assert "disagree on the orientation" in problem and "CPU loader" in problem
        else:
            assert problem is None
    assert exif_orientations(BASE) == () and exif_orientations(b"GIF89a") == ()


# -- packs: the index is what every decoder decodes ------------------------------------------------


def _write_tree(root: Path) -> Path:
    (root / "a").mkdir(parents=True)
    (root / "b").mkdir()
    for name, (data, _) in CASES.items():
        (root / "a" / f"{name}.jpg").write_bytes(data)
    for k in range(4):  # plain JPEGs: substitutes for a bad record
        (root / "b" / f"plain{k}.jpg").write_bytes(_encode(np.roll(_coded_image(), 7 * k, axis=1)))
    return root


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    return _write_tree(tmp_path_factory.mktemp("nasty"))


@pytest.fixture(scope="module", params=["original", "jpeg"])
def packed(request, tree, tmp_path_factory) -> tuple[Path, str]:
    dest = tmp_path_factory.mktemp(f"pack_{request.param}") / "pack"
    return make_pack(tree, dest, payload=request.param), request.param


def _expected(path: str) -> np.ndarray | None:
    """The upright reference pixels of one of the nasty sources (None for the plain ones)."""
    name = Path(path).stem
    if name not in CASES:
        return None
    data, orientation = CASES[name]
    return reference(orientation, _coded_decode(data))


def _usable(decoder: str) -> bool:
    return decoder != "turbo-crop" or jpegcrop.available()


@pytest.mark.parametrize("decoder", DECODERS)
def test_every_decoder_decodes_the_index_shape_upright(packed, decoder):
    root, payload = packed
    if not _usable(decoder):
        pytest.skip(f"{decoder} is not built here")
    ds = ImageFolder(root, decoder=decoder)
    shapes = open_pack(root).index.shapes
    for i, (path, _) in enumerate(ds.samples):
        img = ds[i][0]
        assert img.shape == tuple(shapes[i]), path
        want = _expected(path)
        if want is not None:
            assert img.shape == want.shape, path
            assert _close(img, want), f"{path}: not turned the way the pack's shape says ({decoder}, {payload})"
        for reduce in (2, 4):  # the DCT-downscaled decodes a small crop takes
            assert shape_problem(ds.decode(i, reduce=reduce).shape, tuple(shapes[i]), reduce=reduce) is None


@pytest.mark.parametrize("decoder", ["cv2", "turbo-crop", "simplejpeg"])
def test_ring_path_equals_the_per_sample_path(packed, decoder):
    root, payload = packed
    if not _usable(decoder):
        pytest.skip(f"{decoder} is not built here")
    ds = ImageFolder(root, Compose(list(RRC)), decoder=decoder, seed=3)
    idx = np.arange(len(ds))
    images = np.zeros((len(ds), 16, 16, 3), np.uint8)
    assert ds.fill_batch(idx, images, np.zeros(len(ds), np.int64), epoch=1) is None
    for i in idx.tolist():
        np.testing.assert_array_equal(images[i], ds.load(i, epoch=1))


@pytest.mark.parametrize("fast", [False, True], ids=["islow", "fast"])
def test_turbo_crop_decodes_only_the_box_of_a_turned_original_with_the_full_decodes_pixels(tree, tmp_path, fast):
    """An original with EXIF orientation takes the crop decoder too: the plan's box is mapped
    back to the image as coded (:func:`coded_box`), decoded alone and turned; pixels equal
    the same plan run on a full turbo-crop decode turned by the same orientation."""
    from fastload.data.draws import SampleDraws

    if not jpegcrop.available():
        pytest.skip("turbo-crop is not built here")
    root = make_pack(tree, tmp_path / "pack", payload="original")
    pack = open_pack(root)
    for transform in (RRC, (RandomResizedCrop(8, scale=(0.1, 0.3)),)):  # the second takes reduced decodes
        compose = Compose(list(transform))
        ds = ImageFolder(root, compose, decoder="turbo-crop", seed=11, fast_decode=fast)
        for epoch in range(3):
            for i in range(len(ds)):
                buf = bytes(pack.get(i))
                hw = tuple(int(v) for v in pack.index.shapes[i, :2])
                plan = compose.plan(hw, SampleDraws.single(11, epoch, i))
                reduce = plan.reduce_for(hw)
                full = orient(jpegcrop.decode(buf, reduce=reduce, fast=fast), jpeg_info(buf).orientation)
                np.testing.assert_array_equal(ds.load(i, epoch=epoch), plan.execute(full, hw))
    pack.close()


@pytest.mark.parametrize("orientation", range(1, 9))
def test_coded_box_is_the_box_before_the_turn(orientation):
    from fastload.image import coded_box

    rng = np.random.default_rng(orientation)
    for _ in range(300):
        h, w = (int(v) for v in rng.integers(1, 24, 2))
        coded = rng.integers(0, 256, (h, w, 3), np.uint8)
        up = orient(coded, orientation)
        uh, uw = up.shape[:2]
        assert (uh, uw) == oriented_hw((h, w), orientation)
        t, l = int(rng.integers(0, uh)), int(rng.integers(0, uw))
        bh, bw = int(rng.integers(1, uh - t + 1)), int(rng.integers(1, uw - l + 1))
        ct, cl, ch, cw = coded_box((t, l, bh, bw), (uh, uw), orientation)
        assert 0 <= ct and ct + ch <= h and 0 <= cl and cl + cw <= w
        turned = orient(coded[ct : ct + ch, cl : cl + cw], orientation)
        np.testing.assert_array_equal(turned, up[t : t + bh, l : l + bw])


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@needs_dali
@pytest.mark.parametrize("device", ["cpu", "mixed"], ids=["cpu", "nvjpeg"])
def test_dali_decodes_the_index_shape_upright(packed, device):
    from nvidia.dali import fn, pipeline_def, types

    if device == "mixed" and not _cuda():
        pytest.skip("DALI's GPU decoder needs CUDA")
    root, payload = packed
    pack = open_pack(root)
    index = pack.index
    records = [np.frombuffer(bytes(pack.get(i)), np.uint8) for i in range(len(index.labels))]
    for i, buf in enumerate(records):
        assert payload_problem(buf, payload, index.shapes[i, :2]) is None

    @pipeline_def(batch_size=len(records), num_threads=1, device_id=None if device == "cpu" else 0)
    def decode():  # the decoder DALILoader runs (device="cpu": "cpu", device="gpu": "mixed")
        data = fn.external_source(source=lambda: records, batch=True)
        return fn.decoders.image(data, device=device, output_type=types.RGB)

    pipe = decode()
    pipe.build()
    (out,) = pipe.run()
    if device == "mixed":
        out = out.as_cpu()
    for i in range(len(records)):
        img = np.array(out[i])
        path = index.paths[i]
        assert img.shape == tuple(index.shapes[i]), path
        want = _expected(path)
        if want is not None:
            assert _close(img, want), f"{path}: DALI turned it otherwise ({payload})"


# -- a pack whose index disagrees with its payloads ----------------------------------------------


def _pre_fix_load_source(data: bytes, *, name: str = "<bytes>") -> np.ndarray:
    """The packer's source loading before issue 14: Pillow's exif_transpose, which also obeys
    an orientation found only in XMP (no reader does)."""
    img = Image.open(io.BytesIO(data))
    img.load()
    return np.ascontiguousarray(np.asarray(ImageOps.exif_transpose(img).convert("RGB")))


@pytest.fixture(scope="module")
def stale(tmp_path_factory) -> tuple[Path, int]:
    """An ``original`` pack made by the pre-fix packer: the XMP-only JPEG's index shape is
    turned (30x50), its payload decodes as coded (50x30) everywhere. (record index of it)"""
    src = tmp_path_factory.mktemp("stale_src")
    (src / "a").mkdir()
    (src / "a" / "xmp6.jpg").write_bytes(CASES["xmp6-only"][0])
    for k in range(5):
        (src / "a" / f"plain{k}.jpg").write_bytes(_encode(np.roll(_coded_image(), 5 * k, axis=0)))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fastload.image, "load_source", _pre_fix_load_source)
        root = make_pack(src, tmp_path_factory.mktemp("stale") / "pack", payload="original", workers=1)
    index = open_pack(root).index
    bad = list(index.paths).index("a/xmp6.jpg")
    assert tuple(index.shapes[bad]) == (W, H, 3)  # the mismatch issue 14 found
    return root, bad


def _names_it(msg: str, root: Path, bad: int) -> None:
    assert "shard-00000" in msg and f"dataset index {bad}," in msg and "xmp6.jpg" in msg, msg
    assert f"index says {W}x{H}" in msg and "fastload verify --decode" in msg, msg


@pytest.mark.parametrize("decoder", DECODERS)
@pytest.mark.parametrize("transform", [None, RRC], ids=["whole", "crop"])
def test_stale_index_raises_per_sample_and_skip_replaces(stale, decoder, transform):
    root, bad = stale
    if not _usable(decoder):
        pytest.skip(f"{decoder} is not built here")
    ds = ImageFolder(root, None if transform is None else Compose(list(transform)), decoder=decoder)
    with pytest.raises(DecodeError) as info:
        ds[bad]
    _names_it(str(info.value), root, bad)
    img, target, replacement = ds.get(bad, epoch=0, seed=0, on_error="skip")
    assert replacement is not None and replacement.index == bad and replacement.substitute != bad
    assert "index says" in replacement.reason
    assert img.shape == ds[replacement.substitute][0].shape


@pytest.mark.parametrize("decoder", ["cv2", "turbo-crop", "simplejpeg"])
def test_stale_index_raises_on_the_ring_path_and_skip_replaces(stale, decoder):
    root, bad = stale
    if not _usable(decoder):
        pytest.skip(f"{decoder} is not built here")
    ds = ImageFolder(root, Compose(list(RRC)), decoder=decoder)
    idx = np.arange(len(ds))
    images, targets = np.zeros((len(ds), 16, 16, 3), np.uint8), np.zeros(len(ds), np.int64)
    with pytest.raises(DecodeError) as info:
        ds.fill_batch(idx, images, targets, epoch=0)
    _names_it(str(info.value), root, bad)
    replaced = ds.fill_batch(idx, images, targets, epoch=0, on_error="skip")
    assert [r.index for r in replaced] == [bad]
    s = replaced[0].substitute
    np.testing.assert_array_equal(images[bad], ds.load(s, epoch=0))


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("ring", [True, False], ids=["ring", "per-sample"])
def test_stale_index_with_worker_processes(stale, ring):
    from fastload.data.loader import DataLoader
    from fastload.transforms import ToTensor

    root, bad = stale
    transform = Compose(list(RRC) if ring else [*RRC, ToTensor(scale=False)])
    with pytest.warns(Warning, match="per-sample") if not ring else _no_warning():
        loader = DataLoader(ImageFolder(root, transform), 3, num_workers=2, seed=1, on_error="skip", pin_memory=False)
    try:
        n = sum(len(y) for _, y in loader)
        assert n == 6 and [r.index for r in loader.stats()["records"]] == [bad]
    finally:
        loader.close()
    loader = DataLoader(ImageFolder(root, transform), 3, num_workers=2, seed=1, pin_memory=False) if ring else None
    if loader is not None:
        try:
            with pytest.raises(DecodeError) as info:
                for _ in loader:
                    pass
            _names_it(str(info.value), root, bad)
        finally:
            loader.close()


class _no_warning:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@needs_dali
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_stale_index_on_dali(stale):
    from fastload.dali import DALILoader

    root, bad = stale
    pack = open_pack(root)  # held: get() is a view into its memory map
    problem = payload_problem(np.frombuffer(bytes(pack.get(bad)), np.uint8), "original", (W, H))
    pack.close()
    assert problem == f"JPEG header says {H}x{W}, index says {W}x{H}: run `fastload verify --decode`"
    loader = DALILoader(root, 3, device="cpu", num_threads=1, py_num_workers=1, crop=16, shuffle=False)
    with pytest.raises(Exception) as info:  # DALI re-raises its worker's error, text kept
        for _ in loader:
            pass
    _names_it(str(info.value), root, bad)
    loader.close()
    loader = DALILoader(root, 3, device="cpu", num_threads=1, py_num_workers=1, crop=16, on_error="skip")
    sizes = [len(y) for _, y in loader]
    assert sizes == [3, 3]
    loader.close()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_verify_decode_lists_the_stale_record_and_passes_a_fresh_pack(stale, packed):
    root, bad = stale
    out = run_cli("verify", "--decode", root)
    assert out.returncode == 1
    lines = [line for line in (out.stdout + out.stderr).splitlines() if "xmp6.jpg" in line]
    assert len(lines) == 1 and f"decoded {H}x{W}, index says {W}x{H}" in lines[0], lines
    fresh, _ = packed
    assert run_cli("verify", "--decode", fresh).returncode == 0
