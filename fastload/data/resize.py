"""Resizing into a caller's buffer: cv2.INTER_AREA and INTER_LINEAR, faster, with a free flip.

RandomResizedCrop shrinks many of its boxes (15% of raw 256x256 samples, ~46% of 256x341
JPEGs) and antialiases them with an area filter, like torchvision's PIL path and FFCV. With a
non-integer ratio OpenCV's INTER_AREA takes 200-500 us per 224x224 output, several times
INTER_LINEAR. The optional C extension ``fastload._resize`` computes the same box filter
as two separable fixed-point passes (AVX2 where the CPU has it), within 1 of OpenCV on every
pixel; benchmarks/bench_resize.py measures it. Without the extension, :func:`resize_area`
calls OpenCV, so results differ by at most 1 either way.

Most RandomResizedCrop boxes *enlarge* to 224x224 (82% of 256x341 JPEG samples, 85% of raw
256x256 ones), where OpenCV's INTER_LINEAR takes 40-80 us, most of the per-sample time of a
raw payload. :func:`resize` does bilinear on such boxes in about half that (horizontal pass on
bytes with a shuffle table built once per call, each source row's pass cached for the next
output row), writes a mirrored result at no cost (RandomHorizontalFlip), and by default picks
the filter per axis: area where the axis shrinks, bilinear where it grows, as PIL's
separable resize does (OpenCV's INTER_AREA on a box that shrinks one way and grows the
other is a 2-tap filter on both axes, aliasing the shrinking one).
"""

from __future__ import annotations

import functools

import numpy as np

from ..errors import warn_not_built

__all__ = ["available", "resize", "resize_area"]


@functools.lru_cache(maxsize=1)
def _ext():
    try:
        from .. import _resize
    except ImportError:
        return None
    return _resize


def available() -> bool:
    """Whether the C extension ``fastload._resize`` was built (else OpenCV does the work)."""
    return _ext() is not None


def _check(src: np.ndarray, dst: np.ndarray, *, shrink_only: bool = True) -> None:
    if not isinstance(src, np.ndarray) or not isinstance(dst, np.ndarray):
        raise ValueError(f"src and dst must be numpy arrays, got {type(src).__name__} and {type(dst).__name__}")
    if src.dtype != np.uint8 or dst.dtype != np.uint8:
        raise ValueError(f"src and dst must be uint8, got {src.dtype} and {dst.dtype}")
    if src.ndim not in (2, 3) or dst.ndim != src.ndim:
        raise ValueError(f"src and dst must both be HxW or HxWxC, got shapes {src.shape} and {dst.shape}")
    if src.ndim == 3 and (src.shape[2] not in (1, 2, 3, 4) or dst.shape[2] != src.shape[2]):
        raise ValueError(f"src and dst need the same channel count, 1 to 4: shapes {src.shape} and {dst.shape}")
    (h, w), (oh, ow) = src.shape[:2], dst.shape[:2]
    if min(h, w, oh, ow) < 1:
        raise ValueError(f"empty image: src {src.shape}, dst {dst.shape}")
    if shrink_only and (oh > h or ow > w):
        raise ValueError(
            f"area resize only shrinks: dst {oh}x{ow} is larger than src {h}x{w} on an axis "
            "(use INTER_LINEAR to enlarge)"
        )
    c = src.shape[2] if src.ndim == 3 else 1
    if (src.ndim == 3 and c > 1 and src.strides[2] != 1) or (w > 1 and src.strides[1] != c):
        raise ValueError("src rows must be C-contiguous (pixels packed, channels last), e.g. a crop view img[t:b, l:r]")
    if not dst.flags.c_contiguous or not dst.flags.writeable:
        raise ValueError("dst must be a writable C-contiguous array")
    if np.may_share_memory(src, dst):
        raise ValueError("src and dst must not overlap")


def resize_area(src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """Shrink ``src`` into ``dst`` with an area (box) filter and return ``dst``.

    ``src`` is H x W x C (or H x W) uint8, C in 1..4, rows C-contiguous (a crop view of a
    contiguous image is fine); ``dst`` is oh x ow x C uint8, C-contiguous, with oh <= H and
    ow <= W: what ``cv2.resize(src, (ow, oh), interpolation=cv2.INTER_AREA)`` computes for a
    shrink, within 1 per pixel. Only ``dst`` is written. Raises ValueError for anything else,
    an enlarging size included (INTER_AREA then means something else; use INTER_LINEAR).
    The extension releases the GIL.
    """
    _check(src, dst)
    ext = _ext()
    if ext is not None:
        ext.resize_area(src, dst)
        return dst
    warn_not_built("_resize", "OpenCV resizes instead (2-6x slower)")
    import cv2

    oh, ow = dst.shape[:2]
    if dst.ndim == 3 and dst.shape[2] == 1:  # OpenCV reads and writes one channel as 2-D
        src, out = src[:, :, 0], dst[:, :, 0]
    else:
        out = dst
    res = cv2.resize(src, (ow, oh), dst=out, interpolation=cv2.INTER_AREA)
    if not np.shares_memory(res, dst):  # OpenCV allocated instead of using dst
        np.copyto(out, res)
    return dst


FILTERS = ("auto", "linear")


def resize(src: np.ndarray, dst: np.ndarray, *, filter: str = "auto", flip: bool = False) -> np.ndarray:
    """Resize ``src`` into ``dst`` (any sizes) and return ``dst``; ``flip`` mirrors the result
    left-right.

    ``filter="auto"``: per axis, the area filter where it shrinks and bilinear where it grows
    (or keeps its size): INTER_AREA for a shrink on both axes, INTER_LINEAR for an enlargement
    on both, within 1 of OpenCV. ``filter="linear"``: bilinear on both axes, INTER_LINEAR
    (which only samples when shrinking). Layouts as :func:`resize_area`. Releases the GIL.
    """
    if filter not in FILTERS:
        raise ValueError(f"unknown filter {filter!r} (choose from {', '.join(FILTERS)})")
    _check(src, dst, shrink_only=False)
    ext = _ext()
    if ext is not None:
        ext.resize(src, dst, linear=filter == "linear", flip=bool(flip))
        return dst
    warn_not_built("_resize", "OpenCV resizes instead (2-6x slower)")
    _resize_cv2(src, dst, filter)
    if flip:
        dst[:] = dst[:, ::-1].copy()
    return dst


def _resize_cv2(src: np.ndarray, dst: np.ndarray, filter: str) -> None:
    """:func:`resize` without the extension: OpenCV, one call per axis for a mixed box."""
    import cv2

    (h, w), (oh, ow) = src.shape[:2], dst.shape[:2]
    two_d = dst.ndim == 2 or dst.shape[2] == 1  # OpenCV reads and writes one channel as 2-D
    a = src if not (src.ndim == 3 and two_d) else src[:, :, 0]
    out = dst if not (dst.ndim == 3 and two_d) else dst[:, :, 0]
    if filter == "auto" and (oh < h) != (ow < w) and oh != h and ow != w:
        # shrink one axis with the area filter, then grow the other bilinearly
        mid = (oh, w) if oh < h else (h, ow)
        a = cv2.resize(a, (mid[1], mid[0]), interpolation=cv2.INTER_AREA)
    interp = cv2.INTER_AREA if filter == "auto" and oh <= a.shape[0] and ow <= a.shape[1] else cv2.INTER_LINEAR
    res = cv2.resize(a, (ow, oh), dst=out, interpolation=interp)
    if not np.shares_memory(res, dst):  # OpenCV allocated instead of using dst
        np.copyto(out, res.reshape(out.shape))
