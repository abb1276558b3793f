"""Raw payload: the HWC uint8 pixels themselves. No decode at load time: the fastest read."""

from __future__ import annotations

import numpy as np

from ..errors import DecodeError
from .buffer import Buffer
from ._cv import as_u8, check_rgb

NAME = "raw"
LOSSLESS = True
NEEDS_SHAPE = True


def encode(img: np.ndarray) -> bytes:
    check_rgb(img)
    return np.ascontiguousarray(img).tobytes()


def decode(buf: Buffer, *, shape: tuple[int, int, int] | None = None, **_) -> np.ndarray:
    """A zero-copy (read-only) view of the pixels; ``shape`` comes from the shard index."""
    if shape is None:
        raise ValueError("raw payloads need the record's shape to decode")
    arr = as_u8(buf)
    expected = int(shape[0]) * int(shape[1]) * int(shape[2])
    if arr.size != expected:
        raise DecodeError(f"raw payload has {arr.size} bytes, expected {expected} for shape {tuple(shape)}")
    return arr.reshape(int(shape[0]), int(shape[1]), int(shape[2]))
