"""Pure image helpers shared by packing, decoding and augmentation: source loading, resizing,
and the one EXIF-orientation rule (:func:`jpeg_info`, :func:`orient`) and index-shape check
(:func:`shape_problem`) that the packer and every reader share.

Everything returns HWC uint8 RGB numpy arrays; nothing here touches a pack.
"""

from __future__ import annotations

import io
import re
import struct
import warnings
from typing import NamedTuple

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

    EXIF orientation is applied (a JPEG's by :func:`jpeg_info`, the rule every reader of an
    ``original`` payload applies; other formats' by PIL's ``exif_transpose``); grayscale,
    palette, RGBA (alpha dropped, like torchvision's ``pil_loader``), CMYK and 16-bit images
    all become 3-channel 8-bit RGB. Raises DecodeError naming ``name`` for anything that is not a readable image.
    """
    from PIL import Image, ImageOps

    if not data:
        raise DecodeError(f"{name}: empty file (0 bytes)")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))
            img.load()  # forces a full decode: truncated files fail here, not later
            info = jpeg_info(data)
            if info is None:
                return _pil_to_rgb(ImageOps.exif_transpose(img))
            # A JPEG turns by fastload's own rule (see jpeg_info), which every reader applies,
            # not by PIL's (which also honours XMP): the packed shape is what readers decode.
            return orient(_pil_to_rgb(img), info.orientation)
    except DecodeError:
        raise
    except Image.UnidentifiedImageError:
        raise DecodeError(f"{name}: not a readable image (unknown format or corrupt header)") from None
    except Exception as exc:  # PIL raises many types (OSError, SyntaxError, ValueError...)
        # Messages can embed object addresses; drop them so the same input gives the same text.
        text = _ADDRESS_RE.sub("", f"{type(exc).__name__}: {exc}")
        raise DecodeError(f"{name}: not a readable image ({text})") from None


class JpegInfo(NamedTuple):
    """What a JPEG's header segments say: its size as coded and its EXIF orientation."""

    height: int  # as coded (before orientation)
    width: int
    orientation: int  # 1..8, the EXIF meaning; 1 when absent or unreadable

    @property
    def oriented_hw(self) -> tuple[int, int]:
        """(height, width) after the orientation is applied: what a reader decodes."""
        return oriented_hw((self.height, self.width), self.orientation)

    def shape_problem(self, stored: tuple[int, ...]) -> str | None:
        """:func:`shape_problem` of this header's upright size against an index's ``stored``
        shape: what a crop decoder (turbo-crop, DALI) checks instead of a decoded shape."""
        turned = "" if self.orientation == 1 else f" (EXIF orientation {self.orientation})"
        return shape_problem(self.oriented_hw, stored, what=f"JPEG header{turned} says")


_SOF_MARKERS = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}  # DHT, JPG and DAC are not frames
_ORIENTATION_TAG = 0x0112


def jpeg_info(buf) -> JpegInfo | None:
    """Size and EXIF orientation of a JPEG from its header segments (no pixel is decoded),
    or None when ``buf`` is not a JPEG (no SOI marker) or has no frame header before its scan.

    The rule (the one OpenCV's ``imdecode`` and DALI's decoders follow, measured on cases
    built for tests/test_shape_truth.py): orientation is tag 0x0112 of IFD0 in the first APP1
    ``Exif`` segment that has one, anywhere before the scan (after DQT or SOF too), either
    TIFF byte order, 0xFF fill bytes before any marker allowed; a tag with a value outside
    1..8 means 1, a malformed block is passed over. Orientation in XMP only is ignored:
    Pillow's ``exif_transpose`` honours it, OpenCV and DALI do not, so honouring it would make
    packed shapes disagree with those readers.
    """
    header = _read_header(buf)
    if header is None or header[0] is None:
        return None
    (h, w), orientations = header
    return JpegInfo(h, w, orientations[0] if orientations else 1)


def exif_orientations(buf) -> tuple[int, ...]:
    """Every EXIF orientation tag a JPEG's header holds, in order (one per APP1 ``Exif``
    segment that has one); ``()`` for none or for what is not a JPEG. :func:`jpeg_info` uses
    the first; DALI 2.4's decoder crashes the process on two that differ (see gpu/dali.py)."""
    header = _read_header(buf)
    return () if header is None else tuple(header[1])


def _read_header(buf) -> tuple[tuple[int, int] | None, list[int]] | None:
    """(frame size or None, orientation tags) from a JPEG's header segments; None if no JPEG."""
    if isinstance(buf, np.ndarray):
        buf = np.ascontiguousarray(buf).reshape(-1).view(np.uint8)
    mv = memoryview(buf)
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    n = len(mv)
    if n < 4 or mv[0] != 0xFF or mv[1] != 0xD8:
        return None
    pos, size, orientations = 2, None, []
    while pos + 1 < n:
        if mv[pos] != 0xFF:
            break  # not a marker where one must be: stop reading the header
        while pos < n and mv[pos] == 0xFF:  # fill bytes (any number of 0xFF) before a marker
            pos += 1
        if pos >= n:
            break
        marker = mv[pos]
        pos += 1
        if marker == 0x01 or 0xD0 <= marker <= 0xD7:
            continue  # standalone markers carry no length
        if marker in (0xDA, 0xD9) or pos + 2 > n:
            break  # start of scan (or end of image): the header is over
        length = (mv[pos] << 8) | mv[pos + 1]
        if length < 2:
            break
        body = mv[pos + 2 : min(n, pos + length)]
        if marker in _SOF_MARKERS and size is None and len(body) >= 5:
            size = ((body[1] << 8) | body[2], (body[3] << 8) | body[4])
        elif marker == 0xE1 and bytes(body[:6]) == b"Exif\x00\x00":
            orientation = _exif_orientation(body[6:])
            if orientation is not None:
                orientations.append(orientation)
        pos += length
    return size, orientations


def _exif_orientation(tiff: memoryview) -> int | None:
    """Tag 0x0112 of IFD0 of a TIFF-structured EXIF block (1 for a value outside 1..8, as
    OpenCV reads it); None when the tag is missing or the block malformed."""
    head = bytes(tiff[:8])
    if head[:4] == b"II*\x00":
        order = "<"
    elif head[:4] == b"MM\x00*":
        order = ">"
    else:
        return None
    try:
        (ifd,) = struct.unpack_from(order + "I", tiff, 4)
        (count,) = struct.unpack_from(order + "H", tiff, ifd)
        for k in range(count):
            tag, typ, num = struct.unpack_from(order + "HHI", tiff, ifd + 2 + 12 * k)
            if tag != _ORIENTATION_TAG:
                continue
            if typ == 3:  # SHORT, the type EXIF prescribes
                (value,) = struct.unpack_from(order + "H", tiff, ifd + 10 + 12 * k)
            elif typ == 4:  # LONG, which some writers use
                (value,) = struct.unpack_from(order + "I", tiff, ifd + 10 + 12 * k)
            else:
                return 1
            return int(value) if num >= 1 and 1 <= value <= 8 else 1
    except struct.error:  # an offset past the block's end
        return None
    return None


# orientation -> (transposed, rows flipped, columns flipped): orient() is a transpose, then flips
_ORIENT_STEPS = {1: (0, 0, 0), 2: (0, 0, 1), 3: (0, 1, 1), 4: (0, 1, 0), 5: (1, 0, 0), 6: (1, 0, 1), 7: (1, 1, 1),
                 8: (1, 1, 0)}


def oriented_hw(hw: tuple[int, int], orientation: int) -> tuple[int, int]:
    """(height, width) of an ``hw`` image after EXIF ``orientation``: 5..8 swap the axes."""
    return (int(hw[1]), int(hw[0])) if orientation >= 5 else (int(hw[0]), int(hw[1]))


def orient(img: np.ndarray, orientation: int) -> np.ndarray:
    """Turn a decoded image (HW or HWC) upright by its EXIF ``orientation`` (1..8), the
    transposes of PIL's ``exif_transpose``: a copy when it changes anything, else ``img``."""
    if orientation <= 1 or orientation > 8:
        return img
    # 2 mirrors left-right, 3 turns 180 degrees, 4 mirrors top-bottom, 5 transposes, 6 turns
    # 90 degrees clockwise, 7 transposes across the other diagonal, 8 turns 90 counter-clockwise
    transposed, flip_rows, flip_cols = _ORIENT_STEPS[orientation]
    out = img.swapaxes(0, 1) if transposed else img
    if flip_rows:
        out = out[::-1]
    if flip_cols:
        out = out[:, ::-1]
    return np.ascontiguousarray(out)


def coded_box(box: tuple[int, int, int, int], hw: tuple[int, int], orientation: int) -> tuple[int, int, int, int]:
    """The box ``(top, left, height, width)`` of the image as coded whose :func:`orient` is box
    ``box`` of the upright ``hw`` image: a crop decoder cuts that from the coded JPEG, then
    turns the crop (``orient(coded[coded_box]) == orient(coded)[box]``)."""
    t, l, bh, bw = (int(v) for v in box)
    transposed, flip_rows, flip_cols = _ORIENT_STEPS.get(int(orientation), (0, 0, 0))
    if flip_rows:
        t = int(hw[0]) - t - bh
    if flip_cols:
        l = int(hw[1]) - l - bw
    return (l, t, bw, bh) if transposed else (t, l, bh, bw)


def shape_problem(
    decoded: tuple[int, ...], stored: tuple[int, ...], *, reduce: int = 1, what: str = "decoded"
) -> str | None:
    """Why a decoded image's shape contradicts the shape a pack's index stores for it (the
    shape every crop box is planned from), or None when they agree. ``reduce``: the decode
    was scaled 1/reduce (libjpeg rounds up, a resize rounds down: both are accepted). Only a
    comparison: callers run it on every decode, and on header sizes for crop decoders
    (``what`` then names the source of ``decoded``, e.g. "JPEG header says")."""
    h, w = int(stored[0]), int(stored[1])
    H, W = int(decoded[0]), int(decoded[1])
    ok_h = H in (max(1, h // reduce), -(-h // reduce))
    ok_w = W in (max(1, w // reduce), -(-w // reduce))
    ok_c = len(decoded) < 3 or len(stored) < 3 or int(decoded[2]) == int(stored[2])
    if ok_h and ok_w and ok_c:
        return None
    got = f"{H}x{W}" + (f"x{int(decoded[2])}" if not ok_c else "")
    want = f"{h}x{w}" + (f"x{int(stored[2])}" if not ok_c else "")
    scale = f" at scale 1/{reduce}" if reduce != 1 else ""
    return f"{what} {got}{scale}, index says {want}: run `fastload verify --decode`"


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
