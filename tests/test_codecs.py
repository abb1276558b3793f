"""Payload codecs: lossless ones round-trip exactly, JPEG within a bound, bad bytes fail clearly."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from _pack_helpers import gradient, jpeg_bytes
from fastload.codecs import CODEC_NAMES, get_codec
from fastload.codecs.jpeg import BACKENDS as JPEG_BACKENDS
from fastload.errors import DecodeError, FormatError

images = st.tuples(st.integers(1, 24), st.integers(1, 24)).flatmap(
    lambda hw: arrays(np.uint8, (hw[0], hw[1], 3))
)


@pytest.mark.parametrize("name", ["raw", "bmp", "png"])
@settings(max_examples=40, deadline=None)
@given(img=images)
def test_lossless_codecs_round_trip_exactly(name, img):
    codec = get_codec(name)
    assert codec.lossless
    buf = codec.encode(img)
    assert isinstance(buf, bytes)
    out = codec.decode(buf, shape=img.shape)
    assert out.dtype == np.uint8 and out.shape == img.shape
    np.testing.assert_array_equal(out, img)


@settings(max_examples=25, deadline=None)
@given(img=images, buffer_kind=st.sampled_from(["bytes", "memoryview", "ndarray"]))
def test_decoders_accept_any_buffer(img, buffer_kind):
    buf = get_codec("png").encode(img)
    wrapped = {"bytes": buf, "memoryview": memoryview(buf), "ndarray": np.frombuffer(buf, np.uint8)}[buffer_kind]
    np.testing.assert_array_equal(get_codec("png").decode(wrapped), img)


def test_raw_is_a_zero_copy_view_and_checks_size():
    img = gradient(5, 7)
    buf = bytearray(get_codec("raw").encode(img))
    out = get_codec("raw").decode(memoryview(buf), shape=(5, 7, 3))
    buf[0] ^= 0xFF
    assert out[0, 0, 0] == img[0, 0, 0] ^ 0xFF  # same memory
    with pytest.raises(DecodeError, match="expected 105"):
        get_codec("raw").decode(b"\x00" * 104, shape=(5, 7, 3))
    with pytest.raises(ValueError, match="shape"):
        get_codec("raw").decode(bytes(buf))


def test_jpeg_error_is_bounded_and_falls_with_quality():
    from fastload.image import load_source, resize
    from fastload.sample import photo_paths

    img = resize(load_source(photo_paths()[0].read_bytes()), (96, 128))  # a real photograph
    errors = []
    for quality, bound in [(95, 4.0), (90, 5.0), (50, 10.0)]:
        out = get_codec("jpeg").decode(get_codec("jpeg").encode(img, quality=quality))
        assert out.shape == img.shape
        errors.append(np.abs(out.astype(np.int16) - img).mean())
        assert errors[-1] < bound, (quality, errors[-1])
    assert errors[0] < errors[1] < errors[2]


def test_jpeg_payload_has_optimised_huffman_tables_and_the_same_pixels():
    """Pack-time JPEGs carry per-image Huffman tables: smaller than OpenCV's default encoding
    at the same quality, decoding to exactly the same pixels (only the entropy code differs)."""
    import cv2

    from fastload.image import load_source, resize
    from fastload.sample import photo_paths

    img = resize(load_source(photo_paths()[1].read_bytes()), (192, 256))
    ours = get_codec("jpeg").encode(img, quality=90)
    ok, plain = cv2.imencode(".jpg", np.ascontiguousarray(img[:, :, ::-1]), [cv2.IMWRITE_JPEG_QUALITY, 90])
    assert ok and len(ours) < plain.size
    np.testing.assert_array_equal(get_codec("jpeg").decode(ours), get_codec("jpeg").decode(plain.tobytes()))


def _backend_available(name: str) -> bool:
    try:
        get_codec("jpeg").decode(jpeg_bytes(gradient(8, 8)), backend=name)
        return True
    except Exception:
        return False


@pytest.mark.parametrize("backend", JPEG_BACKENDS)
def test_jpeg_backends_agree(backend):
    if not _backend_available(backend):
        pytest.skip(f"JPEG backend {backend} not usable here")
    img = gradient(40, 56, 5)
    buf = get_codec("jpeg").encode(img, quality=92)
    ref = get_codec("jpeg").decode(buf, backend="cv2")
    out = get_codec("jpeg").decode(buf, backend=backend)
    assert out.shape == ref.shape == img.shape and out.dtype == np.uint8
    assert np.abs(out.astype(np.int16) - ref).mean() < 1.5


@pytest.mark.parametrize("backend", JPEG_BACKENDS)
@pytest.mark.parametrize("reduce", [2, 4, 8])
def test_jpeg_reduce_downscales(backend, reduce):
    if not _backend_available(backend):
        pytest.skip(f"JPEG backend {backend} not usable here")
    img = gradient(64, 96, 6)
    out = get_codec("jpeg").decode(get_codec("jpeg").encode(img), backend=backend, reduce=reduce)
    assert out.shape == (64 // reduce, 96 // reduce, 3)
    small = img.reshape(64 // reduce, reduce, 96 // reduce, reduce, 3).mean(axis=(1, 3))
    assert np.abs(out.astype(np.float64) - small).mean() < 6.0


@pytest.mark.parametrize("name", ["jpeg", "bmp", "png", "original"])
@pytest.mark.parametrize("bad", [b"", b"not an image at all", jpeg_bytes(gradient(16, 16))[:40]])
def test_bad_bytes_raise_decode_error(name, bad):
    with pytest.raises(DecodeError):
        get_codec(name).decode(bad)


def test_encoders_reject_non_rgb_arrays():
    for name in ("jpeg", "bmp", "png", "raw"):
        with pytest.raises(ValueError, match="HWC uint8 RGB"):
            get_codec(name).encode(np.zeros((4, 4), np.uint8))
        with pytest.raises(ValueError, match="HWC uint8 RGB"):
            get_codec(name).encode(np.zeros((4, 4, 3), np.float32))
    with pytest.raises(ValueError, match="1..100"):
        get_codec("jpeg").encode(gradient(4, 4), quality=0)
    with pytest.raises(ValueError, match="unknown JPEG decoder"):
        get_codec("jpeg").decode(jpeg_bytes(gradient(4, 4)), backend="nope")


def test_registry():
    assert set(CODEC_NAMES) == {"jpeg", "bmp", "png", "raw", "original"}
    assert [get_codec(n).name for n in CODEC_NAMES] == list(CODEC_NAMES)
    assert get_codec("raw").needs_shape and not get_codec("png").needs_shape
    with pytest.raises(FormatError, match="unknown payload codec 'webp'"):
        get_codec("webp")


def test_original_decodes_what_opencv_cannot(tmp_path):
    from PIL import Image
    import io

    buf = io.BytesIO()
    Image.fromarray(gradient(10, 12)).save(buf, "GIF")
    out = get_codec("original").decode(buf.getvalue())
    assert out.shape == (10, 12, 3)
    assert get_codec("original").decode(buf.getvalue(), reduce=2).shape == (5, 6, 3)  # PIL path honours reduce


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_every_codec_has_the_protocol_signatures(name):
    import inspect

    codec = get_codec(name)
    dec = inspect.signature(codec.decode).parameters
    assert list(dec)[0] == "buf" and dec["shape"].kind is inspect.Parameter.KEYWORD_ONLY
    assert any(p.kind is inspect.Parameter.VAR_KEYWORD for p in dec.values())  # ignores others' options
    assert list(inspect.signature(codec.encode).parameters)[0] == "img"
