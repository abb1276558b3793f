"""OpenCV encode/decode shared by the codecs that OpenCV handles (kept here once)."""

from __future__ import annotations

import cv2
import numpy as np

from ..errors import DecodeError

cv2.setNumThreads(1)

_HAS_RGB_FLAG = hasattr(cv2, "IMREAD_COLOR_RGB")
# IMREAD_REDUCED_COLOR_{2,4,8} = 16/32/64 | IMREAD_COLOR; combined with IMREAD_COLOR_RGB they
# decode straight to RGB with libjpeg's DCT-domain downscale.
_REDUCE_BITS = {1: 0, 2: 16, 4: 32, 8: 64}


def as_u8(buf) -> np.ndarray:
    """A zero-copy uint8 view over any buffer (bytes, memoryview from LMDB, memmap slice)."""
    if isinstance(buf, np.ndarray):
        return buf if buf.dtype == np.uint8 else buf.view(np.uint8)
    return np.frombuffer(buf, dtype=np.uint8)


def imdecode_rgb(buf, *, reduce: int = 1, orientation: bool = True) -> np.ndarray:
    """Decode any OpenCV-readable image to HWC uint8 RGB (EXIF orientation applied unless
    ``orientation=False``: then the pixels as coded, for a caller that turns them itself)."""
    if reduce not in _REDUCE_BITS:
        raise ValueError(f"reduce must be one of 1, 2, 4, 8, got {reduce}")
    arr = as_u8(buf)
    if arr.size == 0:
        raise DecodeError("empty payload (0 bytes)")
    if reduce > 1 and not (arr.size > 1 and arr[0] == 0xFF and arr[1] == 0xD8):
        # Only JPEG has a DCT-domain downscale; for other formats OpenCV's reduced read is a
        # resize after decoding, and for TIFF it skips the EXIF orientation. Decode (oriented)
        # at full size and shrink here: same cost, and the shape always matches the index.
        return shrink(imdecode_rgb(arr, orientation=orientation), reduce)
    extra = _REDUCE_BITS[reduce] | (0 if orientation else cv2.IMREAD_IGNORE_ORIENTATION)
    try:
        if _HAS_RGB_FLAG:
            img = cv2.imdecode(arr, cv2.IMREAD_COLOR_RGB | extra)
        else:  # pragma: no cover - OpenCV < 4.10
            img = cv2.imdecode(arr, cv2.IMREAD_COLOR | extra)
            if img is not None:
                img = cv2.cvtColor(img, cv2.COLOR_BGR2RGB)
    except cv2.error as exc:
        raise DecodeError(f"OpenCV could not decode a {arr.size}-byte payload ({str(exc).strip()[-120:]})") from None
    if img is None:
        raise DecodeError(f"OpenCV could not decode a {arr.size}-byte payload (corrupt or not an image)")
    return img


def shrink(img: np.ndarray, reduce: int) -> np.ndarray:
    """Downscale by ``reduce`` (floor, at least 1 pixel) for decoders without a DCT downscale."""
    if reduce == 1:
        return img
    h, w = img.shape[:2]
    return cv2.resize(img, (max(1, w // reduce), max(1, h // reduce)), interpolation=cv2.INTER_AREA)


def imencode_rgb(img: np.ndarray, ext: str, params: list[int] | None = None) -> bytes:
    """Encode an HWC uint8 RGB array with OpenCV (which expects BGR)."""
    check_rgb(img)
    ok, out = cv2.imencode(ext, cv2.cvtColor(img, cv2.COLOR_RGB2BGR), params or [])
    if not ok:
        raise ValueError(f"OpenCV failed to encode a {img.shape} image as {ext}")
    return out.tobytes()


def check_rgb(img: np.ndarray) -> None:
    if not isinstance(img, np.ndarray) or img.dtype != np.uint8 or img.ndim != 3 or img.shape[2] != 3:
        raise ValueError(
            f"expected an HWC uint8 RGB array, got {getattr(img, 'dtype', type(img))} "
            f"{getattr(img, 'shape', '')}"
        )
