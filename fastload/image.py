"""Pure image helpers shared by packing and augmentation: source loading and resizing.

Everything returns HWC uint8 RGB numpy arrays; nothing here touches a pack.
"""

from __future__ import annotations

import io
import re
import warnings

import cv2
import numpy as np

from .errors import DecodeError

# Same list as torchvision.datasets.folder.IMG_EXTENSIONS, so a tree scans to the same samples.
IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")

_ADDRESS_RE = re.compile(r" ?<[^<>]* at 0x[0-9a-fA-F]+>")

# OpenCV's worker threads fight with our process-level parallelism; one thread per process.
cv2.setNumThreads(1)


def load_source(data: bytes, *, name: str = "<bytes>") -> np.ndarray:
    """Decode a source image file's bytes to HWC uint8 RGB, the way PIL users expect.

    EXIF orientation is applied (PIL's ``exif_transpose``); grayscale, palette, RGBA (alpha
    dropped, like torchvision's ``pil_loader``), CMYK and 16-bit images all become 3-channel
    8-bit RGB. Raises DecodeError naming ``name`` for anything that is not a readable image.
    """
    from PIL import Image, ImageOps

    if not data:
        raise DecodeError(f"{name}: empty file (0 bytes)")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))
            img.load()  # forces a full decode: truncated files fail here, not later
            img = ImageOps.exif_transpose(img)
            return _pil_to_rgb(img)
    except DecodeError:
        raise
    except Image.UnidentifiedImageError:
        raise DecodeError(f"{name}: not a readable image (unknown format or corrupt header)") from None
    except Exception as exc:  # PIL raises many types (OSError, SyntaxError, ValueError...)
        # Messages can embed object addresses; drop them so the same input gives the same text.
        text = _ADDRESS_RE.sub("", f"{type(exc).__name__}: {exc}")
        raise DecodeError(f"{name}: not a readable image ({text})") from None


def _pil_to_rgb(img) -> np.ndarray:
    mode = img.mode
    if mode in ("I;16", "I;16B", "I;16L", "I;16N", "I"):
        a = np.asarray(img)
        if a.dtype.kind in "iu" and a.dtype.itemsize >= 2:
            # 16-bit gray: keep the top 8 bits (PIL's convert('L') would clip, not scale).
            a = (np.clip(a, 0, 65535).astype(np.uint32) >> 8).astype(np.uint8)
        return np.ascontiguousarray(np.repeat(a[:, :, None], 3, axis=2))
    if mode == "F":
        a = np.clip(np.asarray(img), 0, 255).astype(np.uint8)
        return np.ascontiguousarray(np.repeat(a[:, :, None], 3, axis=2))
    if mode in ("P", "PA") and "transparency" in img.info:
        img = img.convert("RGBA")
    if img.mode != "RGB":
        img = img.convert("RGB")
    return np.ascontiguousarray(np.asarray(img, dtype=np.uint8))


def _interp(src_hw: tuple[int, int], dst_hw: tuple[int, int]) -> int:
    # INTER_AREA anti-aliases when shrinking; it degrades to nearest-like when enlarging.
    shrinking = dst_hw[0] * dst_hw[1] < src_hw[0] * src_hw[1]
    return cv2.INTER_AREA if shrinking else cv2.INTER_LINEAR


def resize(img: np.ndarray, hw: tuple[int, int], *, dst: np.ndarray | None = None) -> np.ndarray:
    """Resize to exactly ``hw`` (height, width); writes into ``dst`` when given."""
    h, w = int(hw[0]), int(hw[1])
    if img.shape[0] == h and img.shape[1] == w:
        if dst is None:
            return img
        dst[...] = img
        return dst
    out = cv2.resize(img, (w, h), dst=dst, interpolation=_interp(img.shape[:2], (h, w)))
    return out


def shorter_side_size(hw: tuple[int, int], size: int) -> tuple[int, int]:
    """Output (h, w) for resizing so the shorter side is ``size``, keeping aspect (torchvision rule)."""
    h, w = hw
    if h <= w:
        return size, max(1, int(size * w / h))
    return max(1, int(size * h / w)), size


def resize_shorter(img: np.ndarray, size: int) -> np.ndarray:
    """Resize so the shorter side is ``size`` pixels, keeping the aspect ratio."""
    return resize(img, shorter_side_size(img.shape[:2], size))


def center_crop(img: np.ndarray, hw: tuple[int, int]) -> np.ndarray:
    """Crop the central ``hw`` window (a view); pads nothing, so hw must fit."""
    h, w = hw
    H, W = img.shape[:2]
    if h > H or w > W:
        raise ValueError(f"center_crop: crop {h}x{w} larger than image {H}x{W}")
    top = int(round((H - h) / 2.0))
    left = int(round((W - w) / 2.0))
    return img[top : top + h, left : left + w]


def resize_center_crop(img: np.ndarray, hw: tuple[int, int]) -> np.ndarray:
    """Scale so the image covers ``hw`` then take the central crop: a fixed-size output."""
    h, w = hw
    H, W = img.shape[:2]
    scale = max(h / H, w / W)
    th, tw = max(h, round(H * scale)), max(w, round(W * scale))
    return np.ascontiguousarray(center_crop(resize(img, (th, tw)), (h, w)))
