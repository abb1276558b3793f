"""BMP payload: lossless, larger than PNG, but decodes at memcpy speed."""

from __future__ import annotations

import numpy as np

from .buffer import Buffer
from ._cv import imdecode_rgb, imencode_rgb

NAME = "bmp"
LOSSLESS = True


def encode(img: np.ndarray) -> bytes:
    return imencode_rgb(img, ".bmp")


def decode(buf: Buffer, *, shape: tuple[int, int, int] | None = None, **_) -> np.ndarray:
    return imdecode_rgb(buf)
