"""Original payload: the source file's bytes, untouched (any format OpenCV or PIL reads)."""

from __future__ import annotations

import numpy as np

from ..errors import DecodeError
from ..image import jpeg_info, load_source, orient
from .buffer import Buffer
from ._cv import as_u8, imdecode_rgb, shrink

NAME = "original"
LOSSLESS = False  # lossless w.r.t. the source file, but pixels depend on the decoder


def encode(img: np.ndarray) -> bytes:  # pragma: no cover - packing copies bytes instead
    raise TypeError("the 'original' payload stores source bytes; it has no encoder")


def decode(buf: Buffer, *, shape: tuple[int, int, int] | None = None, reduce: int = 1, **_) -> np.ndarray:
    """Decode with OpenCV; fall back to PIL for what OpenCV cannot read (CMYK oddities, GIF...).

    A JPEG is decoded as coded and turned by :func:`fastload.image.jpeg_info`'s orientation,
    the rule the packer sized it by and every other decoder of an original payload applies
    (so OpenCV's own EXIF reading can never disagree with the index)."""
    info = jpeg_info(buf)
    try:
        if info is not None:
            return orient(imdecode_rgb(buf, reduce=reduce, orientation=False), info.orientation)
        return imdecode_rgb(buf, reduce=reduce)
    except DecodeError:
        return shrink(load_source(bytes(as_u8(buf)), name="<original payload>"), reduce)
