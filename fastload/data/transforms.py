"""uint8 CPU augmentation on HWC arrays, seeded per sample, planned before decoding.

Geometric transforms (RandomResizedCrop, Resize, CenterCrop, RandomHorizontalFlip) do not
touch pixels one by one: each one updates a :class:`Plan` (a crop box in the coordinates of
the stored image, an output size and a flip flag). Because the plan needs only the stored
image's shape, the dataset computes it *before* decoding, so it can

* ask libjpeg-turbo for a DCT-domain downscaled decode when the crop is large and the output
  small (``reduce`` 2, 4 or 8), and
* write the resized crop straight into its slot of a batch buffer (``cv2.resize(dst=...)``).

Calling a transform on an array (``t(img, rng=rng)``) runs the same plan, so the per-sample
and the batched paths give the same pixels. Randomness comes only from the ``rng`` argument.
fastload's dataset passes the sample's :class:`~fastload.data.draws.SampleDraws`: numbers
hashed from (seed, epoch, sample index), so augmentations depend neither on which worker ran
them nor on the backend (the GPU helpers and the DALI pipeline draw the same crop boxes and
flips). A ``numpy.random.Generator`` works too; without ``rng`` a fresh unseeded one is used.

Normalisation and float conversion are not part of the default path (they happen on the GPU);
:class:`Normalize` and :class:`ToTensor` exist for CPU-only training and for compatibility.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any, Callable, Sequence, Union

import cv2
import numpy as np

from ..normalization import Normalization
from .draws import RRC_ATTEMPTS, STREAM_CROP, STREAM_FLIP, SampleDraws, rrc_box, take
from .resize import _ext as _resize_ext
from .resize import resize as resize_into

Rng = Union[np.random.Generator, SampleDraws]  # what transforms draw their random numbers from

cv2.setNumThreads(1)

_INTERP = {
    "auto": None,
    "nearest": cv2.INTER_NEAREST,
    "bilinear": cv2.INTER_LINEAR,
    "bicubic": cv2.INTER_CUBIC,
    "area": cv2.INTER_AREA,
    "lanczos": cv2.INTER_LANCZOS4,
}


def _interp_flag(name: str) -> int | None:
    try:
        return _INTERP[name]
    except KeyError:
        raise ValueError(f"unknown interpolation {name!r} (choose from {', '.join(_INTERP)})") from None


def _size_pair(size, what: str) -> tuple[int, int]:
    if isinstance(size, numbers.Integral):
        h = w = int(size)
    elif isinstance(size, Sequence) and len(size) == 1:
        h = w = int(size[0])
    elif isinstance(size, Sequence) and len(size) == 2:
        h, w = int(size[0]), int(size[1])
    else:
        raise ValueError(f"{what}: size must be an int or (height, width), got {size!r}")
    if h < 1 or w < 1:
        raise ValueError(f"{what}: size must be positive, got {size!r}")
    return h, w


@dataclass
class Plan:
    """Where the output comes from: box (top, left, h, w) in stored-image pixels, output size
    (out_h, out_w), and whether to mirror the result. Built by geometric transforms."""

    top: float
    left: float
    h: float
    w: float
    out_h: int
    out_w: int
    flip: bool = False
    interpolation: int | None = None  # None: per axis, area when it shrinks, bilinear when it grows

    @classmethod
    def identity(cls, hw: tuple[int, int]) -> Plan:
        h, w = int(hw[0]), int(hw[1])
        return cls(0.0, 0.0, float(h), float(w), h, w)

    def crop(self, i: float, j: float, ch: int, cw: int) -> None:
        """Crop rows i.., cols j.. of the current (virtual) output image."""
        if self.flip:  # the current image is mirrored: its column j is the box's column w-j-cw
            j = self.out_w - j - cw
        sy, sx = self.h / self.out_h, self.w / self.out_w
        self.top += i * sy
        self.left += j * sx
        self.h, self.w = ch * sy, cw * sx
        self.out_h, self.out_w = int(ch), int(cw)

    def resize(self, oh: int, ow: int, interpolation: int | None = None) -> None:
        self.out_h, self.out_w = int(oh), int(ow)
        if interpolation is not None:
            self.interpolation = interpolation

    def reduce_for(self, stored_hw: tuple[int, int], *, allowed: Sequence[int] = (8, 4, 2)) -> int:
        """The largest DCT downscale (8, 4, 2, else 1) that still leaves the box at least as
        large as the output, so decoding smaller loses nothing the resize would keep."""
        for r in allowed:
            if self.h / r >= self.out_h and self.w / r >= self.out_w:
                return r
        return 1

    def box_in(self, H: int, W: int, stored_hw: tuple[int, int]) -> tuple[int, int, int, int]:
        """The box (top, left, h, w) in whole pixels of an ``H`` x ``W`` decode of the stored
        image (a reduced decode is smaller). It may reach outside: then :meth:`execute` pads."""
        fy, fx = H / stored_hw[0], W / stored_hw[1]
        # Round the box's edges, not its size: a box inside the stored image then stays inside
        # a reduced decode (rounding top and height apart could reach one row past the edge,
        # and that row would be zero padding).
        t, l = int(round(self.top * fy)), int(round(self.left * fx))
        bh = max(1, int(round((self.top + self.h) * fy)) - t)
        bw = max(1, int(round((self.left + self.w) * fx)) - l)
        return t, l, bh, bw

    def execute(self, img: np.ndarray, stored_hw: tuple[int, int], *, dst: np.ndarray | None = None) -> np.ndarray:
        """Run the plan on ``img`` (the stored image, possibly decoded at a reduced scale)."""
        H, W = img.shape[:2]
        t, l, bh, bw = self.box_in(H, W, stored_hw)
        if t < 0 or l < 0 or t + bh > H or l + bw > W:
            crop = _padded_crop(img, t, l, bh, bw)
        else:
            crop = img[t : t + bh, l : l + bw]
        return self.finish(crop, dst=dst)

    def finish(self, crop: np.ndarray, *, dst: np.ndarray | None = None) -> np.ndarray:
        """Resize and flip the box's pixels (``crop``, as :meth:`box_in` placed it) to the
        output: what :meth:`execute` does after cutting the box, for a decoder that decoded
        only the box."""
        bh, bw = crop.shape[:2]
        oh, ow = self.out_h, self.out_w
        if dst is not None and dst.shape[:2] != (oh, ow):
            raise ValueError(f"batch slot is {dst.shape[:2]}, the transform outputs {(oh, ow)}")
        if (bh, bw) == (oh, ow):
            if dst is None:
                out = np.ascontiguousarray(crop) if not self.flip else crop[:, ::-1].copy()
                return out if out.base is None or out.flags.writeable else out.copy()
            if self.flip:
                np.copyto(dst, crop[:, ::-1])
            else:
                np.copyto(dst, crop)
            return dst
        interp = self.interpolation
        both_shrink = oh <= bh and ow <= bw
        if _fast_ok(crop, dst) and (
            interp in (None, cv2.INTER_LINEAR) or (interp == cv2.INTER_AREA and both_shrink)
        ):
            # fastload's resize (within 1 of OpenCV's area/bilinear, 2-6x faster), the flip
            # written in the same pass. "auto" picks the filter per axis.
            out = dst if dst is not None else np.empty((oh, ow, crop.shape[2]), np.uint8)
            ext = _resize_ext()
            if ext is not None:  # the C function checks the layouts itself: skip the wrapper's checks
                ext.resize(crop, out, linear=interp == cv2.INTER_LINEAR, flip=self.flip)
                return out
            return resize_into(crop, out, filter="linear" if interp == cv2.INTER_LINEAR else "auto", flip=self.flip)
        if interp is None:
            interp = cv2.INTER_AREA if both_shrink else cv2.INTER_LINEAR
        if crop.ndim == 3 and crop.shape[2] == 1:  # OpenCV drops a single channel axis
            out = cv2.resize(crop[:, :, 0], (ow, oh), interpolation=interp)[:, :, None]
            if self.flip:
                out = out[:, ::-1]
            if dst is None:
                return np.ascontiguousarray(out)
            np.copyto(dst, out)
            return dst
        out = cv2.resize(crop, (ow, oh), dst=dst, interpolation=interp)
        if dst is not None and not np.shares_memory(out, dst):  # dst was not usable as is
            np.copyto(dst, out)
            out = dst
        if self.flip:
            cv2.flip(out, 1, dst=out)
        return out


def _fast_ok(crop: np.ndarray, dst: np.ndarray | None) -> bool:
    """Whether :func:`~fastload.data.resize.resize` takes this crop (it calls OpenCV itself
    when the C extension is not built), else OpenCV does the work here."""
    return (
        crop.ndim == 3
        and crop.dtype == np.uint8
        and crop.shape[2] <= 4
        and crop.strides[2] == 1
        and crop.strides[1] == crop.shape[2]
        and (dst is None or dst.flags.c_contiguous)
    )


def _padded_crop(img: np.ndarray, t: int, l: int, bh: int, bw: int) -> np.ndarray:
    """A crop that reaches outside the image: zero padding, as torchvision's CenterCrop pads."""
    H, W = img.shape[:2]
    out = np.zeros((bh, bw) + img.shape[2:], dtype=img.dtype)
    y0, x0 = max(t, 0), max(l, 0)
    y1, x1 = min(t + bh, H), min(l + bw, W)
    if y1 > y0 and x1 > x0:
        out[y0 - t : y1 - t, x0 - l : x1 - l] = img[y0:y1, x0:x1]
    return out


class Transform:
    """Base of fastload transforms: ``t(img, rng=None)`` on an HWC uint8 array."""

    geometric = False

    def __call__(self, img: Any, *, rng: Rng | None = None) -> Any:
        rng = rng if rng is not None else np.random.default_rng()
        if self.geometric:
            img = _as_hwc(img)
            plan = Plan.identity(img.shape[:2])
            self.update_plan(plan, rng)
            return plan.execute(img, img.shape[:2])
        return self.apply(img, rng)

    def update_plan(self, plan: Plan, rng: Rng) -> None:  # geometric transforms
        raise NotImplementedError

    def apply(self, img: Any, rng: Rng) -> Any:  # pixel transforms
        raise NotImplementedError

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({args})"


def _as_hwc(img) -> np.ndarray:
    if not isinstance(img, np.ndarray):
        try:  # a PIL image, or anything with __array__
            img = np.asarray(img)
        except Exception:
            raise TypeError(f"fastload transforms take HWC uint8 numpy arrays, got {type(img).__name__}") from None
    if img.ndim == 2:
        img = img[:, :, None]
    if img.ndim != 3:
        raise ValueError(f"fastload transforms take HWC arrays, got shape {img.shape}")
    return img


class RandomResizedCrop(Transform):
    """Crop a random area and aspect ratio, resize to ``size``: torchvision's sampling rule
    (``scale`` of the area, log-uniform ``ratio``, 10 attempts, then a center crop clamped to
    the ratio range)."""

    geometric = True

    def __init__(self, size, scale=(0.08, 1.0), ratio=(3.0 / 4.0, 4.0 / 3.0), interpolation: str = "auto"):
        self.size = _size_pair(size, "RandomResizedCrop")
        if not (0 < scale[0] <= scale[1]):
            raise ValueError(f"RandomResizedCrop: scale must be 0 < min <= max, got {scale!r}")
        if not (0 < ratio[0] <= ratio[1]):
            raise ValueError(f"RandomResizedCrop: ratio must be 0 < min <= max, got {ratio!r}")
        self.scale = (float(scale[0]), float(scale[1]))
        self.ratio = (float(ratio[0]), float(ratio[1]))
        self.interpolation = interpolation
        self._interp = _interp_flag(interpolation)

    def get_params(self, hw: tuple[int, int], rng: Any) -> tuple[int, int, int, int]:
        """(top, left, h, w) of the crop, by torchvision's rule. ``rng`` is a sample's
        :class:`~fastload.data.draws.SampleDraws` (the box then matches the GPU and DALI
        paths for the same sample) or a ``numpy.random.Generator``."""
        u = take(rng, STREAM_CROP, 4 * RRC_ATTEMPTS)
        return rrc_box(int(hw[0]), int(hw[1]), u, scale=self.scale, ratio=self.ratio)

    def update_plan(self, plan: Plan, rng: Rng) -> None:
        i, j, h, w = self.get_params((plan.out_h, plan.out_w), rng)
        plan.crop(i, j, h, w)
        plan.resize(*self.size, self._interp)


class RandomHorizontalFlip(Transform):
    """Mirror left-right with probability ``p`` (applied as a flag; costs nothing until the
    final resize, which flips in place)."""

    geometric = True

    def __init__(self, p: float = 0.5):
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"RandomHorizontalFlip: p must be in [0, 1], got {p}")
        self.p = float(p)

    def update_plan(self, plan: Plan, rng: Any) -> None:
        if take(rng, STREAM_FLIP, 1)[0] < self.p:
            plan.flip = not plan.flip


class Resize(Transform):
    """Resize: an int sets the shorter side (keeping aspect, torchvision's rule), a pair sets
    (height, width) exactly."""

    geometric = True

    def __init__(self, size, interpolation: str = "auto"):
        if isinstance(size, numbers.Integral) or (isinstance(size, Sequence) and len(size) == 1):
            s = int(size if isinstance(size, numbers.Integral) else size[0])
            if s < 1:
                raise ValueError(f"Resize: size must be positive, got {size!r}")
            self.size: int | tuple[int, int] = s
        else:
            self.size = _size_pair(size, "Resize")
        self.interpolation = interpolation
        self._interp = _interp_flag(interpolation)

    def output_hw(self, hw: tuple[int, int]) -> tuple[int, int]:
        if isinstance(self.size, int):
            h, w = hw
            short, long = (h, w) if h <= w else (w, h)
            if short == self.size:
                return int(h), int(w)
            new_long = int(self.size * long / short)
            return (self.size, new_long) if h <= w else (new_long, self.size)
        return self.size

    def update_plan(self, plan: Plan, rng: Rng) -> None:
        plan.resize(*self.output_hw((plan.out_h, plan.out_w)), self._interp)


class CenterCrop(Transform):
    """The central ``size`` window (zero-padded where the image is smaller, as torchvision)."""

    geometric = True

    def __init__(self, size):
        self.size = _size_pair(size, "CenterCrop")

    def update_plan(self, plan: Plan, rng: Rng) -> None:
        ch, cw = self.size
        top = int(round((plan.out_h - ch) / 2.0))
        left = int(round((plan.out_w - cw) / 2.0))
        plan.crop(top, left, ch, cw)


class Normalize(Transform):
    """``(img / 255 - mean) / std`` as float32 HWC, for CPU-only training: ``Normalize(mean,
    std)`` in 0-1 units, as torchvision's (which applies after ToTensor), or
    ``Normalize(fastload.Normalization(...))``. The arithmetic is the GPU ``normalize``'s, so
    both give the same floats. The fast path normalises on the GPU instead, after a 4x smaller
    uint8 copy."""

    def __init__(self, mean: Sequence[float] | Normalization, std: Sequence[float] | None = None):
        if isinstance(mean, Normalization) != (std is None):
            raise ValueError("Normalize takes mean and std (0-1 units), or one fastload.Normalization")
        if not isinstance(mean, Normalization):
            mean = Normalization(mean, std)  # type: ignore[arg-type]  # validated and made tuples there
        self.normalization = mean
        self.mean, self.std = self.normalization.mean, self.normalization.std
        self._consts: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # channels -> (scale, shift)

    def apply(self, img, rng):
        a = _as_hwc(img)
        consts = self._consts.get(a.shape[2])
        if consts is None:
            scale, shift = self.normalization.scale_shift(a.shape[2])
            consts = self._consts[a.shape[2]] = (np.asarray(scale, np.float32), np.asarray(shift, np.float32))
        return a.astype(np.float32) * consts[0] - consts[1]


class ToTensor(Transform):
    """HWC array -> CHW torch tensor: float in [0, 1] like torchvision's ToTensor for uint8
    input (``scale=True``), or the uint8 values unchanged (``scale=False``, cheaper)."""

    def __init__(self, scale: bool = True):
        self.scale = bool(scale)

    def apply(self, img, rng):
        import torch

        a = _as_hwc(img)
        t = torch.from_numpy(np.ascontiguousarray(a)).permute(2, 0, 1)
        if self.scale and a.dtype == np.uint8:
            return t.float().div_(255.0)
        return t.contiguous()


class Lambda(Transform):
    """Wrap a plain function ``fn(img)`` (or ``fn(img, rng)`` with ``takes_rng=True``)."""

    def __init__(self, fn: Callable, *, takes_rng: bool = False):
        self.fn = fn
        self.takes_rng = bool(takes_rng)

    def apply(self, img, rng):
        if not self.takes_rng:
            return self.fn(img)
        return self.fn(img, rng.generator if isinstance(rng, SampleDraws) else rng)


class Compose(Transform):
    """Apply transforms in order. Geometric transforms at the front are fused into one plan
    (one crop, one resize, one flip, whatever their number); the rest run one by one. Plain
    callables (e.g. a torchvision transform) are allowed after the geometric part."""

    def __init__(self, transforms: Sequence[Callable]):
        self.transforms = list(transforms)
        k = 0
        while k < len(self.transforms) and getattr(self.transforms[k], "geometric", False):
            k += 1
        self._n_geometric = k
        self.geometric = k == len(self.transforms) and k > 0

    def plan(self, stored_hw: tuple[int, int], rng: Rng) -> Plan:
        """The fused plan of the geometric prefix, for an image of ``stored_hw``."""
        plan = Plan.identity(stored_hw)
        self.update_plan(plan, rng)
        return plan

    def update_plan(self, plan: Plan, rng: Rng) -> None:
        for t in self.transforms[: self._n_geometric]:
            t.update_plan(plan, rng)

    def __call__(self, img, *, rng: Rng | None = None):
        rng = rng if rng is not None else np.random.default_rng()
        if self._n_geometric:
            img = _as_hwc(img)
            img = self.plan(img.shape[:2], rng).execute(img, img.shape[:2])
        return self.apply_tail(img, rng)

    def apply_tail(self, img, rng: Rng):
        """Run the non-geometric rest on an image the plan produced."""
        for t in self.transforms[self._n_geometric :]:
            img = t(img, rng=rng) if isinstance(t, Transform) else t(img)
        return img

    def __repr__(self) -> str:
        inner = "".join(f"\n    {t!r}," for t in self.transforms)
        return f"Compose([{inner}\n])"


def as_compose(transform) -> Compose | None:
    """``transform`` as a Compose when it is a fastload transform (None otherwise)."""
    if isinstance(transform, Compose):
        return transform
    if isinstance(transform, Transform):
        return Compose([transform])
    return None


def fixed_output_hw(transform: Compose, probe_hw: Sequence[tuple[int, int]] = ((480, 640), (640, 480), (97, 123))) -> tuple[int, int] | None:
    """The output (h, w) when it does not depend on the input size, else None (e.g. Resize(int)).

    Decided by planning a few differently shaped inputs: every geometric op either fixes the
    size (crops, RandomResizedCrop, Resize to a pair) or scales with the input.
    """
    if not transform.geometric:
        return None
    rng = np.random.default_rng(0)
    sizes = {(p.out_h, p.out_w) for p in (transform.plan(hw, rng) for hw in probe_hw)}
    return sizes.pop() if len(sizes) == 1 else None
