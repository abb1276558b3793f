"""fastload.data.resize: area downscaling, within 1 of cv2.INTER_AREA, only ever writing dst.

The C extension's AVX2 and portable kernels must agree bit for bit (``simd=False`` forces
the portable ones); both must be within 1 of OpenCV for every shrink, channel count and crop
view. Without the extension the wrapper calls OpenCV, which is checked by faking its absence.
"""

from __future__ import annotations

import threading

import cv2
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastload.data import resize
from fastload.data.resize import resize_area

needs_ext = pytest.mark.skipif(not resize.available(), reason="fastload._resize not built")


def _cv_area(src: np.ndarray, oh: int, ow: int) -> np.ndarray:
    out = cv2.resize(np.ascontiguousarray(src), (ow, oh), interpolation=cv2.INTER_AREA)
    return out.reshape(oh, ow, *src.shape[2:])


def _crop_view(rng, h: int, w: int, c: int, *, pad: int = 3) -> np.ndarray:
    """An h x w x c view inside a bigger random image: row stride larger than the width."""
    big = rng.integers(0, 256, (h + 2 * pad, w + 2 * pad + 5, c), dtype=np.uint8)
    return big[pad : pad + h, pad + 2 : pad + 2 + w]


def _ours(src: np.ndarray, oh: int, ow: int, *, simd: bool = True) -> np.ndarray:
    dst = np.empty((oh, ow, *src.shape[2:]), np.uint8)
    if simd:
        assert resize_area(src, dst) is dst
    else:
        resize._ext().resize_area(src, dst, simd=False)
    return dst


def _sizes(rng, n: int):
    """(h, w, oh, ow, c): random shrinks, half of them small, some with one axis kept or an
    integer ratio."""
    for i in range(n):
        hi = 700 if i % 4 == 0 else 120
        h, w = (int(v) for v in rng.integers(2, hi + 1, 2))
        oh, ow = int(rng.integers(1, h + 1)), int(rng.integers(1, w + 1))
        if i % 7 == 1:
            oh = h
        elif i % 7 == 2:
            ow = w
        elif i % 7 == 3 and h % 2 == 0 and w % 2 == 0:
            oh, ow = h // 2, w // 2
        yield h, w, oh, ow, int(rng.choice([1, 3, 4]))


@needs_ext
def test_sweep_within_one_of_cv2_and_simd_equals_portable():
    rng = np.random.default_rng(1234)
    worst = 0
    for h, w, oh, ow, c in _sizes(rng, 400):
        src = _crop_view(rng, h, w, c)
        ours = _ours(src, oh, ow)
        ref = _cv_area(src, oh, ow)
        diff = int(np.abs(ours.astype(np.int16) - ref).max())
        assert diff <= 1, (h, w, oh, ow, c, diff)
        worst = max(worst, diff)
        np.testing.assert_array_equal(_ours(src, oh, ow, simd=False), ours, err_msg=str((h, w, oh, ow, c)))
    assert worst <= 1


@needs_ext
@settings(max_examples=150, deadline=None)
@given(h=st.integers(2, 90), w=st.integers(2, 90), c=st.sampled_from([1, 3, 4]), data=st.data())
def test_any_shrink_within_one_of_cv2(h, w, c, data):
    oh, ow = data.draw(st.integers(1, h)), data.draw(st.integers(1, w))
    src = _crop_view(np.random.default_rng(h * 1000 + w), h, w, c)
    ours = _ours(src, oh, ow)
    assert np.abs(ours.astype(np.int16) - _cv_area(src, oh, ow)).max() <= 1
    np.testing.assert_array_equal(_ours(src, oh, ow, simd=False), ours)


@needs_ext
def test_typical_crops_are_mostly_exact():
    """RandomResizedCrop-like boxes of a smooth image: differences from OpenCV are rounding
    ties only, a tiny fraction of the pixels."""
    y, x = np.mgrid[0:256, 0:341].astype(np.float32)
    img = np.stack([128 + 100 * np.sin(x / 11), 128 + 90 * np.cos(y / 7), (x + 2 * y) % 256], 2).astype(np.uint8)
    for bh, bw in [(250, 280), (230, 300), (256, 341), (240, 226)]:
        src = img[3 : 3 + bh, : min(bw, 341)]
        ours, ref = _ours(src, 224, 224), _cv_area(src, 224, 224)
        assert np.abs(ours.astype(np.int16) - ref).max() <= 1
        assert np.mean(ours != ref) < 0.01


@needs_ext
def test_identity_and_constant_images_are_exact():
    rng = np.random.default_rng(5)
    src = rng.integers(0, 256, (37, 53, 3), dtype=np.uint8)
    np.testing.assert_array_equal(_ours(src, 37, 53), src)
    for v in (0, 1, 127, 254, 255):
        flat = np.full((97, 113, 4), v, np.uint8)
        assert (_ours(flat, 45, 61) == v).all()


def test_two_dimensional_grayscale():
    rng = np.random.default_rng(6)
    src = rng.integers(0, 256, (81, 67), dtype=np.uint8)
    dst = np.empty((30, 50), np.uint8)
    resize_area(src, dst)
    assert np.abs(dst.astype(np.int16) - cv2.resize(src, (50, 30), interpolation=cv2.INTER_AREA)).max() <= 1


@pytest.mark.parametrize("c", [1, 3, 4])
def test_writes_only_dst(c):
    """dst sits in a bigger buffer between guard bands: nothing outside it changes, and src
    is left alone (the C=3 kernel stores 4 bytes per pixel; the last one must not)."""
    rng = np.random.default_rng(c)
    src = _crop_view(rng, 61, 77, c)
    before = src.copy()
    for oh, ow in [(23, 31), (61, 77), (1, 1), (60, 3), (7, 77)]:
        n = oh * ow * c
        buf = np.full(n + 64, 0xA5, np.uint8)
        dst = buf[32 : 32 + n].reshape(oh, ow, c)
        resize_area(src, dst)
        assert (buf[:32] == 0xA5).all() and (buf[32 + n :] == 0xA5).all()
        assert np.abs(dst.astype(np.int16) - _cv_area(src, oh, ow)).max() <= 1
    np.testing.assert_array_equal(src, before)


def _bad_args():
    a = np.zeros((20, 30, 3), np.uint8)
    d = np.zeros((10, 10, 3), np.uint8)
    ro = d.copy()
    ro.flags.writeable = False
    return [
        (a.astype(np.float32), d, "uint8"),
        (a, d.astype(np.int16), "uint8"),
        (a, np.zeros((10, 10), np.uint8), "HxW"),
        (a[:, :, 0], d, "HxW"),
        (a, np.zeros((10, 10, 4), np.uint8), "channel"),
        (np.zeros((20, 30, 5), np.uint8), np.zeros((10, 10, 5), np.uint8), "channel"),
        (a, np.zeros((21, 10, 3), np.uint8), "only shrinks"),
        (a, np.zeros((10, 31, 3), np.uint8), "only shrinks"),
        (a, np.zeros((0, 10, 3), np.uint8), "empty"),
        (a[:, ::2], d, "C-contiguous"),
        (np.zeros((20, 30, 4), np.uint8)[:, :, :3], d, "C-contiguous"),
        (a, np.zeros((10, 20, 3), np.uint8)[:, ::2], "C-contiguous"),
        (a, ro, "writable"),
        (a, a[:10, :10], "C-contiguous|overlap"),
    ]


@pytest.mark.parametrize("src,dst,match", _bad_args())
def test_wrapper_refuses_bad_arguments(src, dst, match):
    with pytest.raises(ValueError, match=match):
        resize_area(src, dst)


def test_wrapper_refuses_overlap_and_non_arrays():
    buf = np.zeros((40, 30, 3), np.uint8)
    with pytest.raises(ValueError, match="overlap"):
        resize_area(buf, buf[20:])
    with pytest.raises(ValueError, match="numpy"):
        resize_area([[1, 2], [3, 4]], np.zeros((1, 1), np.uint8))


@needs_ext
@pytest.mark.parametrize("src,dst,match", _bad_args()[:-1])
def test_extension_refuses_bad_arguments(src, dst, match):
    with pytest.raises(ValueError, match=match):
        resize._ext().resize_area(src, dst)


@needs_ext
@pytest.mark.parametrize("bad", [None, 3, "abc", b"abc", bytearray(12), memoryview(bytearray(48)).cast("i", (2, 2, 3))])
def test_extension_never_crashes_on_odd_objects(bad):
    good = np.zeros((4, 4, 3), np.uint8)
    with pytest.raises((ValueError, TypeError)):
        resize._ext().resize_area(bad, np.zeros((2, 2, 3), np.uint8))
    with pytest.raises((ValueError, TypeError)):
        resize._ext().resize_area(good, bad)


@pytest.mark.parametrize("c", [1, 3, 4])
def test_fallback_is_opencv(monkeypatch, c):
    monkeypatch.setattr(resize, "_ext", lambda: None)
    rng = np.random.default_rng(9)
    src = _crop_view(rng, 50, 70, c)
    n = 21 * 33 * c
    buf = np.full(n + 8, 7, np.uint8)
    dst = buf[4 : 4 + n].reshape(21, 33, c)
    assert resize_area(src, dst) is dst
    np.testing.assert_array_equal(dst, _cv_area(src, 21, 33))
    assert (buf[:4] == 7).all() and (buf[4 + n :] == 7).all()
    with pytest.raises(ValueError, match="only shrinks"):
        resize_area(src, np.zeros((51, 33, c), np.uint8))


@needs_ext
def test_threads_share_the_extension():
    """It releases the GIL: concurrent calls on different buffers give the serial results."""
    rng = np.random.default_rng(11)
    srcs = [_crop_view(rng, 250, 280, 3) for _ in range(4)]
    want = [_ours(s, 224, 224) for s in srcs]
    got = [np.empty((224, 224, 3), np.uint8) for _ in srcs]

    def work(i):
        for _ in range(20):
            resize_area(srcs[i], got[i])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


# -- resize: bilinear (and per-axis auto) with a fused flip ------------------------------


def _cv_linear(src: np.ndarray, oh: int, ow: int) -> np.ndarray:
    out = cv2.resize(np.ascontiguousarray(src), (ow, oh), interpolation=cv2.INTER_LINEAR)
    return out.reshape(oh, ow, *src.shape[2:])


def _cv_auto(src: np.ndarray, oh: int, ow: int) -> np.ndarray:
    """Per axis: INTER_AREA where it shrinks, INTER_LINEAR where it grows (one call per axis)."""
    h, w = src.shape[:2]
    src = np.ascontiguousarray(src)
    if oh <= h and ow <= w:
        return _cv_area(src, oh, ow)
    if oh < h:
        src = cv2.resize(src, (w, oh), interpolation=cv2.INTER_AREA).reshape(oh, w, *src.shape[2:])
    elif ow < w:
        src = cv2.resize(src, (ow, h), interpolation=cv2.INTER_AREA).reshape(h, ow, *src.shape[2:])
    return _cv_linear(src, oh, ow)


def _resized(src, oh, ow, *, filter="auto", flip=False, simd=True):
    dst = np.empty((oh, ow, *src.shape[2:]), np.uint8)
    if simd:
        assert resize.resize(src, dst, filter=filter, flip=flip) is dst
    else:
        resize._ext().resize(src, dst, linear=filter == "linear", flip=flip, simd=False)
    return dst


def _any_sizes(rng, n: int):
    """(h, w, oh, ow, c): enlargements (RandomResizedCrop's usual case), shrinks, mixed boxes,
    rows under 16 bytes, and large ratios that leave the shuffle-table path."""
    for i in range(n):
        h, w = (int(v) for v in rng.integers(1, 160, 2))
        oh, ow = (int(v) for v in rng.integers(1, 240, 2))
        if i % 5 == 0:  # a RandomResizedCrop box to 224x224
            h, w, oh, ow = int(rng.integers(20, 256)), int(rng.integers(20, 256)), 224, 224
        elif i % 5 == 1:  # a big shrink on one axis
            w, ow = int(rng.integers(100, 400)), int(rng.integers(1, 20))
        yield h, w, oh, ow, int(rng.choice([1, 2, 3, 4]))


@needs_ext
def test_linear_within_one_of_cv2_flip_mirrors_and_simd_equals_portable():
    rng = np.random.default_rng(77)
    for h, w, oh, ow, c in _any_sizes(rng, 300):
        src = _crop_view(rng, h, w, c)
        ours = _resized(src, oh, ow, filter="linear")
        diff = int(np.abs(ours.astype(np.int16) - _cv_linear(src, oh, ow)).max())
        assert diff <= 1, (h, w, oh, ow, c, diff)
        flipped = _resized(src, oh, ow, filter="linear", flip=True)
        np.testing.assert_array_equal(flipped, ours[:, ::-1], err_msg=str((h, w, oh, ow, c)))
        for flip in (False, True):
            want = flipped if flip else ours
            np.testing.assert_array_equal(
                _resized(src, oh, ow, filter="linear", flip=flip, simd=False), want, err_msg=str((h, w, oh, ow, c, flip))
            )


@needs_ext
def test_auto_is_area_or_linear_per_axis():
    rng = np.random.default_rng(78)
    for h, w, oh, ow, c in _any_sizes(rng, 300):
        src = _crop_view(rng, h, w, c)
        ours = _resized(src, oh, ow)
        diff = int(np.abs(ours.astype(np.int16) - _cv_auto(src, oh, ow)).max())
        assert diff <= 1, (h, w, oh, ow, c, diff)
        if oh <= h and ow <= w:  # a shrink on both axes is exactly resize_area
            np.testing.assert_array_equal(ours, _ours(src, oh, ow))
        np.testing.assert_array_equal(_resized(src, oh, ow, flip=True), ours[:, ::-1])
        np.testing.assert_array_equal(_resized(src, oh, ow, flip=True, simd=False), ours[:, ::-1])


@needs_ext
@settings(max_examples=150, deadline=None)
@given(h=st.integers(1, 70), w=st.integers(1, 70), oh=st.integers(1, 150), ow=st.integers(1, 150),
       c=st.sampled_from([1, 3, 4]), flip=st.booleans())
def test_any_linear_resize_within_one_of_cv2(h, w, oh, ow, c, flip):
    src = _crop_view(np.random.default_rng(h * 1000 + w), h, w, c)
    ours = _resized(src, oh, ow, filter="linear", flip=flip)
    ref = _cv_linear(src, oh, ow)
    assert np.abs(ours.astype(np.int16) - (ref[:, ::-1] if flip else ref)).max() <= 1


@needs_ext
def test_enlarged_smooth_image_is_mostly_exact_and_constant_stays_constant():
    y, x = np.mgrid[0:256, 0:341].astype(np.float32)
    img = np.stack([128 + 100 * np.sin(x / 11), 128 + 90 * np.cos(y / 7), (x + 2 * y) % 256], 2).astype(np.uint8)
    for bh, bw in [(180, 170), (100, 130), (60, 50), (224, 150)]:
        src = img[5 : 5 + bh, 9 : 9 + bw]
        ours, ref = _resized(src, 224, 224), _cv_linear(src, 224, 224)
        assert np.abs(ours.astype(np.int16) - ref).max() <= 1
        assert np.mean(ours != ref) < 0.2  # rounding ties (OpenCV's weights have 11 bits, ours 14)
    for v in (0, 1, 128, 254, 255):
        flat = np.full((33, 47, 3), v, np.uint8)
        assert (_resized(flat, 224, 224, flip=True) == v).all()
    src = np.random.default_rng(2).integers(0, 256, (37, 53, 3), dtype=np.uint8)
    np.testing.assert_array_equal(_resized(src, 37, 53), src)
    np.testing.assert_array_equal(_resized(src, 37, 53, flip=True), src[:, ::-1])


@pytest.mark.parametrize("c", [1, 3, 4])
@pytest.mark.parametrize("ext", [True, False], ids=["extension", "opencv-fallback"])
def test_resize_writes_only_dst(monkeypatch, c, ext):
    if ext and not resize.available():
        pytest.skip("fastload._resize not built")
    if not ext:
        monkeypatch.setattr(resize, "_ext", lambda: None)
    rng = np.random.default_rng(c)
    src = _crop_view(rng, 41, 57, c)
    before = src.copy()
    for oh, ow in [(224, 224), (23, 31), (41, 57), (1, 1), (90, 3), (7, 200), (30, 80)]:
        n = oh * ow * c
        buf = np.full(n + 64, 0xA5, np.uint8)
        dst = buf[32 : 32 + n].reshape(oh, ow, c)
        for flip in (False, True):
            resize.resize(src, dst, flip=flip)
            assert (buf[:32] == 0xA5).all() and (buf[32 + n :] == 0xA5).all()
            ref = _cv_auto(src, oh, ow)
            assert np.abs(dst.astype(np.int16) - (ref[:, ::-1] if flip else ref)).max() <= 1
    np.testing.assert_array_equal(src, before)


def test_resize_refuses_bad_arguments():
    a = np.zeros((20, 30, 3), np.uint8)
    with pytest.raises(ValueError, match="unknown filter 'cubic'"):
        resize.resize(a, np.zeros((40, 40, 3), np.uint8), filter="cubic")
    with pytest.raises(ValueError, match="C-contiguous"):
        resize.resize(a[:, ::2], np.zeros((40, 40, 3), np.uint8))
    with pytest.raises(ValueError, match="overlap"):
        resize.resize(a, a[10:])
    if resize.available():
        with pytest.raises(ValueError, match="channel"):
            resize._ext().resize(a, np.zeros((40, 40, 4), np.uint8))
        with pytest.raises(TypeError):
            resize._ext().resize(a)
