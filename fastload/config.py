"""Frozen configuration passed between stages (CLI -> library)."""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass


def usable_cpus() -> int:
    """CPU cores this process may run on: the default for every worker and thread count.

    The scheduler affinity, not ``os.cpu_count()``: under ``taskset`` or a container's cpuset
    the machine's total would start more processes than there are cores to run them.
    """
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


class OnError(str, enum.Enum):
    """What packing does with an input it cannot read."""

    SKIP = "skip"  # warn, list it in the manifest's `skipped`, go on
    FAIL = "fail"  # stop at the first bad input


PAYLOADS = ("jpeg", "bmp", "png", "raw", "original")
PACK_BACKENDS = ("lmdb", "hdf5")


@dataclass(frozen=True)
class PackConfig:
    """Options of one ``fastload pack`` run. Everything that changes the output bytes is here.

    ``workers``, ``on_error``, ``overwrite`` and ``progress`` change how a pack runs, never
    the bytes it writes. Bad values raise ValueError at construction, before any work.
    """

    backend: str = "lmdb"  # "lmdb" | "hdf5"
    payload: str = "jpeg"  # "jpeg" | "bmp" | "png" | "raw" | "original"
    quality: int = 90  # JPEG quality for payload "jpeg"
    restart_markers: bool = True  # payload "jpeg": a restart-segment grid (crops decode faster)
    resize: int | None = None  # shorter side to this many pixels, keeping aspect
    size: tuple[int, int] | None = None  # (h, w): resize to cover, then center crop
    shard_size: int = 1 << 30  # bytes of payload per shard before a new shard starts
    workers: int | None = None  # decode/encode processes; None = all cores
    part: int = 0  # pack only slice `part` of `parts` (0-based)
    parts: int = 1
    on_error: OnError = OnError.SKIP
    overwrite: bool = False
    progress: bool = True
    max_file_size: int = 256 << 20  # source files larger than this are skipped (and listed), never read

    def __post_init__(self) -> None:
        if self.backend not in PACK_BACKENDS:
            raise ValueError(f"unknown format {self.backend!r} (choose from {', '.join(PACK_BACKENDS)})")
        if self.payload not in PAYLOADS:
            raise ValueError(f"unknown payload {self.payload!r} (choose from {', '.join(PAYLOADS)})")
        if not _is_int(self.quality) or not 1 <= self.quality <= 100:
            raise ValueError(f"quality must be an integer in 1..100, got {self.quality!r}")
        if not isinstance(self.restart_markers, bool):
            raise ValueError(f"restart_markers must be True or False, got {self.restart_markers!r}")
        if self.resize is not None and (not _is_int(self.resize) or self.resize < 1):
            raise ValueError(f"resize must be a positive integer, got {self.resize!r}")
        if self.size is not None:
            if (
                not isinstance(self.size, tuple)
                or len(self.size) != 2
                or not all(_is_int(v) and v >= 1 for v in self.size)
            ):
                raise ValueError(f"size must be a (height, width) tuple of positive integers, got {self.size!r}")
        if self.resize is not None and self.size is not None:
            raise ValueError("give either resize (shorter side) or size (HxW crop), not both")
        if self.payload == "original" and (self.resize is not None or self.size is not None):
            raise ValueError("payload 'original' stores the source bytes untouched; it cannot be resized")
        if not _is_int(self.shard_size) or self.shard_size <= 0:
            raise ValueError(f"shard_size must be a positive number of bytes, got {self.shard_size!r}")
        if not _is_int(self.max_file_size) or self.max_file_size <= 0:
            raise ValueError(f"max_file_size must be a positive number of bytes, got {self.max_file_size!r}")
        if self.workers is not None and (not _is_int(self.workers) or self.workers < 1):
            raise ValueError(f"workers must be a positive integer, got {self.workers!r}")
        if not _is_int(self.parts) or self.parts < 1 or self.parts > 99999:
            raise ValueError(f"parts must be an integer in 1..99999, got {self.parts!r}")
        if not _is_int(self.part) or not 0 <= self.part < self.parts:
            raise ValueError(f"part must be in 0..{self.parts - 1} (0-based) for {self.parts} parts, got {self.part!r}")
        if not isinstance(self.on_error, OnError):
            object.__setattr__(self, "on_error", OnError(self.on_error))

    def output_options(self) -> dict:
        """The options that shape the output bytes, as stored in the manifest."""
        return {
            "quality": self.quality,
            "restart_markers": self.restart_markers,
            "resize": self.resize,
            "size": list(self.size) if self.size else None,
            "shard_size": self.shard_size,
        }


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
