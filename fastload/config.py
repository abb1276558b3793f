"""Frozen configuration passed between stages (CLI -> library)."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class OnError(str, enum.Enum):
    """What packing does with an input it cannot read."""

    SKIP = "skip"  # warn, list it in the manifest's `skipped`, go on
    FAIL = "fail"  # stop at the first bad input


@dataclass(frozen=True)
class PackConfig:
    """Options of one ``fastload pack`` run. Everything that changes the output bytes is here."""

    backend: str = "lmdb"  # "lmdb" | "hdf5"
    payload: str = "jpeg"  # "jpeg" | "bmp" | "png" | "raw" | "original"
    quality: int = 90  # JPEG quality for payload "jpeg"
    resize: int | None = None  # shorter side to this many pixels, keeping aspect
    size: tuple[int, int] | None = None  # (h, w): resize to cover, then center crop
    shard_size: int = 1 << 30  # bytes of payload per shard before a new shard starts
    workers: int | None = None  # decode/encode processes; None = all cores
    part: int = 0  # pack only slice `part` of `parts` (0-based)
    parts: int = 1
    on_error: OnError = OnError.SKIP
    overwrite: bool = False
    progress: bool = True
