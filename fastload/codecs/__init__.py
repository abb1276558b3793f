"""Payload codecs: pure ``encode(img) -> bytes`` and ``decode(buf) -> img`` functions.

A codec never touches a file; storage never decodes. The manifest stores the codec's name
and readers look it up here with :func:`get_codec`. Images are HWC uint8 RGB arrays.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ..errors import FormatError
from .buffer import Buffer


class Encoder(Protocol):
    """A codec's ``encode``: HWC uint8 RGB pixels to payload bytes (options: quality...)."""

    def __call__(self, img: np.ndarray, **options) -> bytes: ...


class Decoder(Protocol):
    """A codec's ``decode``: payload bytes to HWC uint8 RGB (``shape`` from the shard index)."""

    def __call__(self, buf: Buffer, *, shape: tuple[int, int, int] | None = None, **options) -> np.ndarray: ...


@dataclass(frozen=True)
class Codec:
    """A named payload format. ``lossless`` says decode(encode(x)) == x exactly."""

    name: str
    encode: Encoder
    decode: Decoder
    lossless: bool
    needs_shape: bool = False  # decode needs the stored shape (raw pixels)


def _registry() -> dict[str, Codec]:
    from . import bmp, jpeg, original, png, raw

    return {
        m.NAME: Codec(m.NAME, m.encode, m.decode, m.LOSSLESS, getattr(m, "NEEDS_SHAPE", False))
        for m in (jpeg, bmp, png, raw, original)
    }


CODEC_NAMES = ("jpeg", "bmp", "png", "raw", "original")


def get_codec(name: str) -> Codec:
    """The codec stored under ``name`` in a manifest."""
    codecs = _registry()
    try:
        return codecs[name]
    except KeyError:
        raise FormatError(f"unknown payload codec {name!r} (known: {', '.join(CODEC_NAMES)})") from None
