"""JPEG payload, with a choice of decoder backends (all return HWC uint8 RGB).

``reduce`` (1, 2, 4, 8) asks for libjpeg-turbo's DCT-domain downscale: decoding at 1/2 size
costs roughly a third of a full decode, which pays whenever the output crop is small.

``turbo-crop`` is fastload's own C extension (:mod:`fastload.codecs.jpegcrop`): here it
decodes the whole image; the dataset uses it to decode only a transform's crop box. It is
present only when the extension was built (:func:`fastload.codecs.jpegcrop.available`).
"""

from __future__ import annotations

import functools

import cv2
import numpy as np

from ..errors import DecodeError
from .buffer import Buffer
from ._cv import as_u8, imdecode_rgb, imencode_rgb

NAME = "jpeg"
LOSSLESS = False
BACKENDS = ("cv2", "simplejpeg", "jpeg4py", "pil", "turbo-crop")


# 4:2:0: an MCU is 16x16 pixels.
_MCU = 16


def encode(img: np.ndarray, *, quality: int = 90, restart: bool = True) -> bytes:
    """Baseline JPEG, 4:2:0, with Huffman tables optimised for this image: an extra pass at
    pack time that makes the payload ~3.5% smaller and every decode ~2% faster (fewer bits
    to entropy-decode; measured on 256x341 photos at quality 90). Same pixels as without.

    ``restart``: restart markers every 2 MCUs (32 pixels) where a row has an even number of
    MCUs, else every MCU, so the image is a grid of independently coded segments. The
    turbo-crop decoder then entropy-decodes only the segments under a crop box: ~17% less
    decode time for RandomResizedCrop boxes, for ~2-6% more bytes (2.3% on the benchmark
    photos). Every JPEG decoder reads the result; those that decode whole images (OpenCV,
    simplejpeg) run ~8% slower on it, since libjpeg-turbo's fast Huffman path is off when a
    stream has restart markers.
    """
    if not 1 <= int(quality) <= 100:
        raise ValueError(f"JPEG quality must be in 1..100, got {quality}")
    params = [cv2.IMWRITE_JPEG_QUALITY, int(quality), cv2.IMWRITE_JPEG_OPTIMIZE, 1]
    if restart:
        params += [cv2.IMWRITE_JPEG_RST_INTERVAL, restart_interval(img.shape[1])]
    return imencode_rgb(img, ".jpg", params)


def restart_interval(width: int) -> int:
    """MCUs between restart markers for a 4:2:0 image ``width`` pixels wide: 2 when that
    divides a row's MCUs, else 1 (a segment must not straddle two rows). Measured on 384x288
    photos: 1 MCU decodes crops fastest, 2 costs ~2% more time for half the extra bytes, 3+
    is slower still."""
    return 2 if (-(-int(width) // _MCU)) % 2 == 0 else 1


def decode(
    buf: Buffer, *, shape: tuple[int, int, int] | None = None, backend: str = "cv2", reduce: int = 1,
    fast: bool = False, **_,
) -> np.ndarray:
    """``fast``: libjpeg-turbo's fast integer IDCT and merged chroma upsampling (turbo-crop and
    simplejpeg; the other backends have no such switch and ignore it): ~10% less decode time,
    pixels differ slightly (mean ~1.4 levels, more at sharp colour edges)."""
    try:
        fn = _BACKEND_FUNCS[backend]
    except KeyError:
        raise ValueError(f"unknown JPEG decoder {backend!r} (choose from {', '.join(BACKENDS)})") from None
    return fn(buf, reduce, fast)


def _decode_cv2(buf, reduce: int, fast: bool = False) -> np.ndarray:
    # As coded, like every other backend (none of them reads EXIF): a caller that wants an
    # original JPEG upright turns it by fastload.image.jpeg_info's orientation, once.
    return imdecode_rgb(buf, reduce=reduce, orientation=False)


def _decode_simplejpeg(buf, reduce: int, fast: bool = False) -> np.ndarray:
    import simplejpeg

    data = as_u8(buf)
    try:
        if reduce == 1:
            return simplejpeg.decode_jpeg(data, colorspace="RGB", fastdct=fast, fastupsample=fast)
        h, w = simplejpeg.decode_jpeg_header(data)[:2]
        # simplejpeg picks the smallest libjpeg scale that still covers min_height x min_width.
        return simplejpeg.decode_jpeg(
            data, colorspace="RGB", fastdct=fast, fastupsample=fast, min_height=-(-h // reduce), min_width=-(-w // reduce)
        )
    except ValueError as exc:
        raise DecodeError(f"simplejpeg could not decode a {data.size}-byte payload: {exc}") from None


@functools.lru_cache(maxsize=1)
def _jpeg4py():
    from ..errors import require

    mod = require("jpeg4py", "jpeg4py (and Debian's libturbojpeg0)", "the jpeg4py decoder")
    mod.JPEG(np.zeros(0, np.uint8))  # noqa: loads libturbojpeg now, so a missing library fails early
    return mod


def _decode_jpeg4py(buf, reduce: int, fast: bool = False) -> np.ndarray:
    jpeg4py = _jpeg4py()
    data = as_u8(buf)
    try:
        img = jpeg4py.JPEG(data).decode()
    except Exception as exc:  # jpeg4py raises JPEGRuntimeError and others
        raise DecodeError(f"jpeg4py could not decode a {data.size}-byte payload: {exc}") from None
    if reduce != 1:
        h, w = img.shape[:2]
        img = cv2.resize(img, (-(-w // reduce), -(-h // reduce)), interpolation=cv2.INTER_AREA)
    return img


def _decode_pil(buf, reduce: int, fast: bool = False) -> np.ndarray:
    import io

    from PIL import Image

    data = bytes(as_u8(buf))
    try:
        img = Image.open(io.BytesIO(data))
        want = (-(-img.height // reduce), -(-img.width // reduce))  # libjpeg's 1/reduce size
        if reduce != 1:
            # Pillow picks the largest libjpeg scale 1/a with a <= min(size // requested): asking
            # for the floored size makes that 1/reduce exactly (the ceiled size gave 1/2 where
            # 1/4 was asked for), so the decode has the shape every other backend gives.
            img.draft("RGB", (max(1, img.width // reduce), max(1, img.height // reduce)))
        out = np.asarray(img.convert("RGB"))
    except Exception as exc:
        raise DecodeError(f"PIL could not decode a {len(data)}-byte payload: {exc}") from None
    if out.shape[:2] != want:  # a side shorter than ``reduce``: Pillow scales both axes alike
        out = cv2.resize(out, (want[1], want[0]), interpolation=cv2.INTER_AREA)
    return out


def _decode_turbo_crop(buf, reduce: int, fast: bool = False) -> np.ndarray:
    from . import jpegcrop

    return jpegcrop.decode(buf, reduce=reduce, fast=fast)


_BACKEND_FUNCS = {
    "cv2": _decode_cv2,
    "simplejpeg": _decode_simplejpeg,
    "jpeg4py": _decode_jpeg4py,
    "pil": _decode_pil,
    "turbo-crop": _decode_turbo_crop,
}
