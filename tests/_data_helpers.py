"""Packs for the dataset/loader tests, built with the real packer into tmp directories."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fastload.config import PackConfig
from fastload.pack import pack


def make_pack(source: Path, dest: Path, **options) -> Path:
    """Pack ``source`` with ``options`` (PackConfig fields) into ``dest``; returns ``dest``."""
    options.setdefault("workers", 1)
    options.setdefault("progress", False)
    pack(source, dest, config=PackConfig(**options))
    return dest


def batches_equal(a, b) -> bool:
    """Two lists of (images, targets) batches hold the same pixels and labels."""
    if len(a) != len(b):
        return False
    return all(
        np.array_equal(x[0].numpy(), y[0].numpy()) and np.array_equal(x[1].numpy(), y[1].numpy())
        for x, y in zip(a, b)
    )


def collect(loader, limit: int | None = None, *, copy: bool = True) -> list:
    """Iterate ``loader``, keeping (images, targets) copies of up to ``limit`` batches."""
    out = []
    for k, (images, targets) in enumerate(loader):
        out.append((images.clone() if copy else images, targets.clone()))
        if limit is not None and k + 1 >= limit:
            break
    return out


class Indices:
    """A dataset whose sample i is a small uint8 image filled with ``i % 256`` and label i, so
    the targets a loader yields are the dataset indices it read."""

    def __init__(self, n: int, hw: tuple[int, int] = (4, 4)):
        self.n = n
        self.hw = hw

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):
        return np.full((*self.hw, 3), i % 256, np.uint8), i
