"""PNG payload: lossless and compact, slower to decode than BMP or raw."""

from __future__ import annotations

import cv2
import numpy as np

from .buffer import Buffer
from ._cv import imdecode_rgb, imencode_rgb

NAME = "png"
LOSSLESS = True


def encode(img: np.ndarray, *, compression: int = 3) -> bytes:
    return imencode_rgb(img, ".png", [cv2.IMWRITE_PNG_COMPRESSION, int(compression)])


def decode(buf: Buffer, *, shape: tuple[int, int, int] | None = None, **_) -> np.ndarray:
    return imdecode_rgb(buf)
