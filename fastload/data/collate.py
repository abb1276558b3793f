"""Collate ``(image, label)`` samples into one uint8 batch without float conversion.

Used by the DataLoader's per-sample path (a user's own Dataset, or an ImageFolder whose
transform cannot be planned). Images are written into one NHWC uint8 buffer and returned as
an N x C x H x W tensor in ``channels_last`` memory format (no NCHW copy); anything that is
not a batch of same-sized images goes to torch's ``default_collate``.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def _as_hwc(img) -> np.ndarray | None:
    """An HWC uint8 view of an image-like item, or None when it is not one."""
    if isinstance(img, np.ndarray):
        if img.dtype != np.uint8:
            return None
        if img.ndim == 2:
            return img[:, :, None]
        return img if img.ndim == 3 else None
    try:
        import torch

        if isinstance(img, torch.Tensor):
            if img.dtype != torch.uint8 or img.ndim != 3:
                return None
            return img.permute(1, 2, 0).numpy()  # CHW tensor -> HWC view
    except ImportError:  # pragma: no cover
        pass
    try:
        from PIL import Image
    except ImportError:  # pragma: no cover
        return None
    if isinstance(img, Image.Image):
        if img.mode not in ("RGB", "L"):
            img = img.convert("RGB")
        return _as_hwc(np.asarray(img))
    return None


def collate_uint8(batch: list[Any]):
    """``[(image, label), ...]`` -> ``(uint8 N x C x H x W channels_last tensor, int64 labels)``.

    Images may be HWC uint8 arrays, CHW uint8 tensors or PIL images, all of one size. Other
    batches (float tensors, dicts, variable sizes...) fall back to ``default_collate``.
    """
    import torch
    from torch.utils.data import default_collate

    first = batch[0] if batch else None
    if not (isinstance(first, (tuple, list)) and len(first) == 2):
        return default_collate(batch)
    images = [_as_hwc(item[0]) for item in batch]
    if any(a is None for a in images) or len({a.shape for a in images}) != 1:
        return default_collate(batch)
    labels = [item[1] for item in batch]
    out = torch.empty((len(images), *images[0].shape), dtype=torch.uint8)
    dst = out.numpy()
    for j, a in enumerate(images):
        dst[j] = a
    if all(isinstance(t, (int, np.integer)) for t in labels):
        targets = torch.as_tensor(np.asarray(labels, dtype=np.int64))
    else:
        targets = default_collate(labels)
    return out.permute(0, 3, 1, 2), targets
