"""Decode only a box of a JPEG ("turbo-crop"): libjpeg-turbo partial decompression.

RandomResizedCrop keeps on average about half of the decoded pixels. The optional C extension
``fastload._jpegcrop`` (built by ``pip install -e .`` when libjpeg-turbo's headers are there;
Debian: ``libjpeg62-turbo-dev``) skips the rows above the box without an inverse DCT, leaves
out the columns beside it (to iMCU precision) and stops after its last row, optionally with the
DCT-domain downscale (``reduce`` 2, 4, 8). When the JPEG has restart markers that cut it
into a grid of segments (fastload's jpeg payload, see :func:`fastload.codecs.jpeg.encode`),
only the segments under the box are entropy-decoded at all.

The pixels equal the same box cut from a full decode at the same scale with the same library
(ISLOW DCT, fancy upsampling: the settings simplejpeg uses), exactly: the extension asks for
one extra column on each side, because fancy chroma upsampling treats the edges of a cropped
region like image edges. tests/test_jpegcrop.py checks this over random boxes.

Without the extension, :func:`available` is False and fastload decodes with simplejpeg/OpenCV.
CMYK/YCCK JPEGs (which the extension refuses) fall back to OpenCV here; corrupt data (a
truncated file included) raises :class:`~fastload.errors.DecodeError`.
"""

from __future__ import annotations

import functools
import threading

import numpy as np

from ..errors import DecodeError
from ._cv import as_u8, imdecode_rgb

NAME = "turbo-crop"


@functools.lru_cache(maxsize=1)
def _ext():
    try:
        from .. import _jpegcrop
    except ImportError:
        return None
    return _jpegcrop


def available() -> bool:
    """Whether the C extension was built (so ``decoder="turbo-crop"`` works)."""
    return _ext() is not None


def require() -> None:
    """Raise a clear error when the extension is missing."""
    if _ext() is None:
        raise ImportError(
            "the turbo-crop JPEG decoder needs fastload's C extension fastload._jpegcrop, which was not "
            "built: install libjpeg-turbo's headers (Debian: apt-get install libjpeg62-turbo-dev) and a C "
            "compiler, then reinstall fastload (pip install -e .)"
        )


def scaled_hw(h: int, w: int, reduce: int) -> tuple[int, int]:
    """The size libjpeg decodes an h x w JPEG to at scale 1/reduce (it rounds up)."""
    return -(-int(h) // reduce), -(-int(w) // reduce)


def header(buf) -> tuple[int, int]:
    """(height, width) of a JPEG at full size, from its header (a few microseconds)."""
    require()
    ext = _ext()
    data = as_u8(buf)
    try:
        return tuple(ext.header(data)[:2])
    except ext.JpegError as exc:
        raise DecodeError(f"could not read the header of a {data.size}-byte JPEG payload: {exc}") from None


def restart_grid(buf) -> tuple[int, int, int, int, int] | None:
    """``(interval, mcu_height, mcu_width, mcu_rows, mcus_per_row)`` of a JPEG whose restart
    markers split it into a grid of segments (fastload's jpeg payload), else ``None``. With a
    grid, :func:`decode_crop` entropy-decodes only the segments under the box."""
    require()
    return _ext().restart_grid(as_u8(buf))


def out_bytes(height: int, width: int) -> int:
    """Bytes an ``out`` buffer needs for a height x width box: rows are decoded region-wide
    (the box and a column either side, at least 16 columns, back to an iMCU boundary of at
    most 32 pixels)."""
    return int(height) * (max(int(width) + 2, 16) + 32) * 3


def decode_crop(buf, box: tuple[int, int, int, int] | None = None, *, reduce: int = 1,
                out: np.ndarray | None = None, fast: bool = False, segments: bool = True) -> np.ndarray:
    """The box ``(top, left, height, width)`` (in pixels of the 1/``reduce`` scaled image) of
    a JPEG, as an HWC uint8 RGB array; ``None`` decodes the whole image.

    ``out``: a C-contiguous uint8 array of at least :func:`out_bytes` to decode into (the
    result is then a view of it, with a row stride wider than the box); else new memory.
    The box must lie inside the scaled image (:func:`scaled_hw`), else ``ValueError``.
    ``fast``: the fast integer IDCT and merged chroma upsampling (~10% faster; the box still
    equals the same box of a full decode with the same settings).
    ``segments``: use the JPEG's restart-segment grid when it has one (:func:`restart_grid`);
    False decodes from the top as for any JPEG (same pixels; for comparisons).
    """
    require()
    ext = _ext()
    if reduce not in (1, 2, 4, 8):
        raise ValueError(f"reduce must be one of 1, 2, 4, 8, got {reduce}")
    data = as_u8(buf)
    t, l, h, w = (0, 0, -1, -1) if box is None else (int(v) for v in box)
    try:
        target, h, w, stride, offset = ext.decode_crop(data, t, l, h, w, reduce, out, fast, segments)
    except ext.Unsupported:
        img = _fallback(data, reduce)
        if box is None:
            return img
        H, W = img.shape[:2]
        if t + h > H or l + w > W:
            raise ValueError(f"box {(t, l, h, w)} is not inside the {H}x{W} image (scaled 1/{reduce})") from None
        return img[t : t + h, l : l + w].copy()
    except ext.JpegError as exc:
        raise DecodeError(f"could not decode a {data.size}-byte JPEG payload: {exc}") from None
    return np.ndarray((h, w, 3), np.uint8, buffer=target if out is None else out, offset=offset,
                      strides=(stride, 3, 1))


def _fallback(data: np.ndarray, reduce: int) -> np.ndarray:
    """OpenCV for what the extension refuses (CMYK and YCCK JPEGs), as coded like the
    extension's output (no EXIF turn: the caller applies orientation, once)."""
    return imdecode_rgb(data, reduce=reduce, orientation=False)


def decode(buf, reduce: int = 1, fast: bool = False) -> np.ndarray:
    """The whole image (a JPEG backend like the others in :mod:`fastload.codecs.jpeg`)."""
    return decode_crop(buf, None, reduce=reduce, fast=fast)


_local = threading.local()


def scratch(nbytes: int) -> np.ndarray:
    """A reused uint8 buffer of at least ``nbytes`` for this thread, to pass as ``out`` when
    the crop is consumed at once (resized into a batch slot). A fresh ~250 KB array per image
    is mmap'ed and faulted in every time: measured ~80 us per 256x341 image, a quarter of the
    decode. The next call on the same thread overwrites it."""
    buf = getattr(_local, "buf", None)
    if buf is None or buf.size < nbytes:
        buf = _local.buf = np.empty(max(int(nbytes), 1 << 18), np.uint8)
    return buf
