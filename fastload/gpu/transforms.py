"""Batch augmentation and normalisation on the device the batch lives on (GPU or CPU).

Decoded images stay uint8 until they reach the GPU (4x fewer bytes over PCIe); these
helpers then convert, normalise, flip and crop a whole batch with a few kernels. Random
decisions are drawn from a counter-based hash of ``(seed, epoch, sample index)``
(:mod:`fastload.data.draws`), so a sample gets the same augmentation whatever batch, rank or
worker count it lands in, the draws cost no per-sample Python, and they are the CPU
transforms' draws: on a batch of the stored size, :func:`random_resized_crop` with
``flip_p`` picks the box and flip that ``fastload.transforms.RandomResizedCrop`` +
``RandomHorizontalFlip`` pick for the same sample.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ..data.draws import RRC_ATTEMPTS, crop_boxes, flip_flags, uniform
from ..normalization import IMAGENET, Normalization, as_normalization, scale_shift

__all__ = [
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "BatchAugment",
    "apply_scale_shift",
    "flip_batch",
    "normalize",
    "random_flip",
    "random_resized_crop",
    "sample_crop_boxes",
    "scale_shift",
    "uniform",
]

IMAGENET_MEAN = IMAGENET.mean  # aliases of fastload.IMAGENET, in 0-1 units
IMAGENET_STD = IMAGENET.std

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)



def _check_dtype(dtype: torch.dtype) -> torch.dtype:
    if dtype not in _FLOATS:
        raise ValueError(f"dtype must be a floating type (float16, bfloat16, float32, float64), got {dtype}")
    return dtype


def normalize(
    images: torch.Tensor,
    *,
    mean: Sequence[float] | None = None,
    std: Sequence[float] | None = None,
    normalization: Normalization | None = None,
    dtype: torch.dtype = torch.float32,
    channels_last: bool = False,
) -> torch.Tensor:
    """uint8 ``(N, C, H, W)`` (or ``(C, H, W)``) -> float ``(x / 255 - mean) / std`` in ``dtype``.

    ``normalization`` (or ``mean``/``std`` in 0-1 units; see :func:`fastload.normalization.as_normalization`);
    without either the output is just ``x / 255``. The arithmetic is done in float32 whatever
    ``dtype`` is, then cast once, so float16 and bfloat16 outputs are the correctly rounded
    float32 result.
    """
    norm = as_normalization(normalization, mean=mean, std=std)
    _check_dtype(dtype)
    if images.dtype != torch.uint8:
        raise ValueError(f"normalize expects uint8 images, got {images.dtype}")
    if images.dim() not in (3, 4):
        raise ValueError(f"normalize expects (N, C, H, W) or (C, H, W) images, got shape {tuple(images.shape)}")
    c = images.shape[-3]
    scale, shift = scale_shift(norm, c)
    scale_t = torch.tensor(scale, dtype=torch.float32).view(c, 1, 1).to(images.device)
    shift_t = torch.tensor(shift, dtype=torch.float32).view(c, 1, 1).to(images.device)
    return apply_scale_shift(images, scale_t, shift_t, dtype=dtype, channels_last=channels_last)


def apply_scale_shift(
    images: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor,
    *,
    dtype: torch.dtype,
    channels_last: bool,
) -> torch.Tensor:
    """``images * scale - shift`` in float32, cast to ``dtype`` (the kernel behind :func:`normalize`).

    ``scale``/``shift`` are float32 ``(C, 1, 1)`` tensors already on the images' device, so a
    caller converting many batches (the prefetcher) builds them once.
    """
    fmt = torch.channels_last if channels_last and images.dim() == 4 else torch.preserve_format
    out = images.to(dtype=torch.float32, memory_format=fmt)
    out.mul_(scale).sub_(shift)
    return out if dtype == torch.float32 else out.to(dtype)


def _as_index_array(indices: Any, n: int) -> np.ndarray:
    if isinstance(indices, torch.Tensor):
        indices = indices.detach().cpu().numpy()
    idx = np.asarray(indices, dtype=np.int64).reshape(-1)
    if idx.size != n:
        raise ValueError(f"got {idx.size} sample indices for a batch of {n}")
    return idx


def flip_batch(images: torch.Tensor, flip: torch.Tensor) -> torch.Tensor:
    """Mirror (left-right) the images of an ``(N, C, H, W)`` batch where ``flip`` is True."""
    flip = flip.to(device=images.device, dtype=torch.bool).view(-1, *([1] * (images.dim() - 1)))
    return torch.where(flip, images.flip(-1), images)


def random_flip(
    images: torch.Tensor, *, seed: int, epoch: int, indices: Any, p: float = 0.5
) -> tuple[torch.Tensor, np.ndarray]:
    """Randomly mirror each image with probability ``p``; returns the batch and the decisions."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"flip probability must be in [0, 1], got {p}")
    idx = _as_index_array(indices, images.shape[0])
    decisions = flip_flags(seed, epoch, idx, p)
    return flip_batch(images, torch.from_numpy(decisions)), decisions


def sample_crop_boxes(
    height: int,
    width: int,
    *,
    seed: int,
    epoch: int,
    indices: Any,
    scale: tuple[float, float] = (0.08, 1.0),
    ratio: tuple[float, float] = (3.0 / 4.0, 4.0 / 3.0),
    attempts: int = RRC_ATTEMPTS,
) -> np.ndarray:
    """RandomResizedCrop boxes ``(top, left, h, w)`` as an int64 ``(N, 4)`` array.

    The same algorithm as torchvision (``attempts`` tries of area and log-ratio, falling back
    to a centre crop clamped to ``ratio``), vectorised over the batch.
    """
    if not (0 < scale[0] <= scale[1]):
        raise ValueError(f"scale must satisfy 0 < min <= max, got {scale}")
    if not (0 < ratio[0] <= ratio[1]):
        raise ValueError(f"ratio must satisfy 0 < min <= max, got {ratio}")
    if attempts < 1:
        raise ValueError(f"attempts must be >= 1, got {attempts}")
    idx = np.asarray(indices, dtype=np.int64).reshape(-1)
    return crop_boxes(seed, epoch, idx, height, width, scale=scale, ratio=ratio, attempts=attempts)


def _crop_grid(
    boxes: np.ndarray, flips: np.ndarray | None, in_hw: tuple[int, int], out_hw: tuple[int, int], device
) -> torch.Tensor:
    """Sampling grids mapping each output pixel centre into its box (align_corners=False)."""
    height, width = in_hw
    b = boxes.astype(np.float64)
    top, left, h, w = b[:, 0], b[:, 1], b[:, 2], b[:, 3]
    theta = np.zeros((len(b), 2, 3), dtype=np.float64)
    theta[:, 0, 0] = w / width
    theta[:, 0, 2] = (2 * left + w) / width - 1
    theta[:, 1, 1] = h / height
    theta[:, 1, 2] = (2 * top + h) / height - 1
    if flips is not None:
        theta[:, 0, 0] = np.where(flips, -theta[:, 0, 0], theta[:, 0, 0])
    t = torch.from_numpy(theta.astype(np.float32)).to(device)
    return F.affine_grid(t, [len(b), 1, out_hw[0], out_hw[1]], align_corners=False)


def _resample_matrices(starts: torch.Tensor, lengths: torch.Tensor, in_size: int, out_size: int) -> torch.Tensor:
    """``(N, out_size, in_size)`` weights that resize each box ``[start, start+length)`` of an
    axis to ``out_size`` with the antialiased bilinear (triangle) filter of PIL and
    torchvision's ``antialias=True``: where the box shrinks, the triangle is widened by the
    shrink factor, so every input pixel counts; where it grows, plain bilinear. Pixels
    outside the box get no weight (crop, then resize)."""
    scale = lengths / out_size  # (N,) input pixels per output pixel
    support = scale.clamp(min=1.0)
    centers = starts[:, None] + (torch.arange(out_size, device=starts.device, dtype=scale.dtype) + 0.5) * scale[:, None]
    j = torch.arange(in_size, device=starts.device, dtype=scale.dtype) + 0.5
    w = (1.0 - ((j[None, None, :] - centers[:, :, None]) / support[:, None, None]).abs()).clamp(min=0.0)
    inside = (j[None, :] > starts[:, None]) & (j[None, :] < (starts + lengths)[:, None])
    w = w * inside[:, None, :]
    return w / w.sum(dim=2, keepdim=True)


def random_resized_crop(
    images: torch.Tensor,
    size: int | tuple[int, int],
    *,
    seed: int,
    epoch: int,
    indices: Any,
    scale: tuple[float, float] = (0.08, 1.0),
    ratio: tuple[float, float] = (3.0 / 4.0, 4.0 / 3.0),
    flip_p: float = 0.0,
    antialias: bool = True,
) -> torch.Tensor:
    """RandomResizedCrop of a fixed-size float batch ``(N, C, H, W)`` with bilinear resampling.

    ``antialias=True`` (as torchvision's default and fastload's CPU transforms): two batched
    matrix products per batch, each row a PIL-style triangle filter widened where the box
    shrinks. Without it, one ``grid_sample`` call (cheaper, but a box shrunk by more than 2x
    aliases: it samples only 4 input pixels per output pixel).
    """
    if not images.is_floating_point():
        raise ValueError(f"random_resized_crop expects a float batch (normalise first), got {images.dtype}")
    if images.dim() != 4:
        raise ValueError(f"random_resized_crop expects (N, C, H, W), got shape {tuple(images.shape)}")
    out_hw = (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))
    if min(out_hw) <= 0:
        raise ValueError(f"crop size must be positive, got {size}")
    n, _, height, width = images.shape
    idx = _as_index_array(indices, n)
    boxes = sample_crop_boxes(height, width, seed=seed, epoch=epoch, indices=idx, scale=scale, ratio=ratio)
    flips = flip_flags(seed, epoch, idx, flip_p) if flip_p > 0 else None
    src = images if images.dtype in (torch.float32, torch.float64) else images.float()
    if antialias:
        b = torch.from_numpy(boxes).to(device=images.device, dtype=torch.float64)
        rows = _resample_matrices(b[:, 0], b[:, 2], height, out_hw[0]).to(src.dtype)  # (N, oh, H)
        cols = _resample_matrices(b[:, 1], b[:, 3], width, out_hw[1]).to(src.dtype)  # (N, ow, W)
        if flips is not None:
            flip = torch.from_numpy(flips).to(images.device)
            cols = torch.where(flip[:, None, None], cols.flip(1), cols)
        out = torch.matmul(torch.matmul(rows[:, None], src), cols.transpose(1, 2)[:, None])
    else:
        grid = _crop_grid(boxes, flips, (height, width), out_hw, images.device)
        out = F.grid_sample(src, grid.to(src.dtype), mode="bilinear", padding_mode="border", align_corners=False)
    if images.is_contiguous(memory_format=torch.channels_last):
        out = out.contiguous(memory_format=torch.channels_last)
    return out.to(images.dtype)


class BatchAugment:
    """Training augmentation of a fixed-size uint8 batch on its device: normalise, then
    RandomResizedCrop to ``size`` and flip with probability ``flip_p``, seeded by
    ``(seed, epoch, sample index)``. ``antialias``: see :func:`random_resized_crop`.

    Normalised with ``normalization`` (ImageNet's by default; ``None``: just ``x / 255``), or
    with ``mean``/``std`` in 0-1 units, which replace the default.
    """

    def __init__(
        self,
        size: int | tuple[int, int],
        *,
        seed: int = 0,
        scale: tuple[float, float] = (0.08, 1.0),
        ratio: tuple[float, float] = (3.0 / 4.0, 4.0 / 3.0),
        flip_p: float = 0.5,
        normalization: Normalization | None = IMAGENET,
        mean: Sequence[float] | None = None,
        std: Sequence[float] | None = None,
        dtype: torch.dtype = torch.float32,
        channels_last: bool = True,
        antialias: bool = True,
    ):
        if normalization is IMAGENET and (mean is not None or std is not None):
            normalization = None  # mean/std replace the default
        self.normalization = as_normalization(normalization, mean=mean, std=std)
        if not 0.0 <= flip_p <= 1.0:
            raise ValueError(f"flip_p must be in [0, 1], got {flip_p}")
        self.size = size
        self.seed = int(seed)
        self.scale = tuple(scale)
        self.ratio = tuple(ratio)
        self.flip_p = float(flip_p)
        self.dtype = _check_dtype(dtype)
        self.channels_last = channels_last
        self.antialias = bool(antialias)

    def __call__(self, images: torch.Tensor, *, epoch: int, indices: Any) -> torch.Tensor:
        if images.dtype == torch.uint8:
            x = normalize(images, normalization=self.normalization, dtype=torch.float32,
                          channels_last=self.channels_last)
        else:
            x = images.float()
        out = random_resized_crop(
            x, self.size, seed=self.seed, epoch=epoch, indices=indices,
            scale=self.scale, ratio=self.ratio, flip_p=self.flip_p, antialias=self.antialias,
        )
        return out.to(self.dtype)
