"""What a dataset declares to take fastload's fast paths (declared protocols, not ``hasattr``).

* :class:`BatchFiller`: the fill stage of the ring path. A dataset that knows the fixed shape
  of its samples fills a whole batch slot in place; :class:`fastload.ImageFolder` is one.
* :class:`EpochDataset`: the per-sample path's view of a dataset whose samples depend on the
  epoch and seed (augmentation), read without mutating the dataset.

``on_error`` is the corrupt-record policy (:class:`OnRecordError`): ``"raise"`` stops with an
error naming the record, shard and source; ``"skip"`` puts a deterministic substitute in the
sample's place (so batch shapes and the epoch's length stay fixed) and reports it as a
:class:`Replacement`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

__all__ = ["BatchFiller", "EpochDataset", "OnRecordError", "Prefetching", "Replacement", "on_error_skips"]


class OnRecordError(str, enum.Enum):
    """What reading does with a record that cannot be read or decoded."""

    RAISE = "raise"  # stop: an error naming the record, its shard and its source file
    SKIP = "skip"  # replace it with a deterministic substitute, count it, go on


def on_error_skips(on_error: str) -> bool:
    """Whether the corrupt-record policy ``on_error`` (:class:`OnRecordError`) is "skip".
    Two string compares, so readers can check it per sample; ValueError for anything else."""
    if on_error == "skip":  # an OnRecordError member compares equal to its value
        return True
    if on_error == "raise":
        return False
    allowed = ", ".join(repr(e.value) for e in OnRecordError)
    raise ValueError(f"on_error must be one of {allowed}, got {on_error!r}")


@dataclass(frozen=True)
class Replacement:
    """A record that could not be read and the sample served in its place."""

    index: int  # dataset index of the bad record
    substitute: int  # dataset index served instead (its image and its label)
    epoch: int
    reason: str  # the error: names the shard, the record in it and the source file


@runtime_checkable
class BatchFiller(Protocol):
    """A dataset that can fill ring slots (the ring path of :class:`fastload.DataLoader`)."""

    def __len__(self) -> int: ...

    def batch_image_shape(self) -> tuple[int, int, int] | None:
        """(H, W, C) of every sample when it is fixed, else None (the per-sample path)."""

    def ring_blocker(self) -> str | None:
        """Why :meth:`batch_image_shape` is None, naming what to change; None when it is not."""

    def fill_batch(self, indices: np.ndarray, images: np.ndarray, targets: np.ndarray, *, epoch: int,
                   seed: int | None = None, on_error: str = "raise") -> list[Replacement] | None:
        """Write samples ``indices`` into ``images[j]`` (N, H, W, C uint8) and ``targets[j]``;
        return the records replaced under ``on_error="skip"`` (None or [] when none)."""


@runtime_checkable
class EpochDataset(Protocol):
    """A dataset whose samples depend on ``(seed, epoch)``, readable without mutating it."""

    def __len__(self) -> int: ...

    def get(self, i: int, *, epoch: int, seed: int, on_error: str = "raise") -> tuple[Any, Any, Replacement | None]:
        """``(image, target, replacement or None)`` of sample ``i`` in ``epoch``."""


@runtime_checkable
class Prefetching(Protocol):
    """A dataset whose records may be far away (a pack in object storage): the loader tells it
    which samples come a few batches ahead, so it can start fetching them. Such a dataset may
    also name the start method its worker processes need (``worker_start_method``)."""

    def prefetch(self, indices: np.ndarray) -> None:
        """Samples ``indices`` will be read soon (a hint: it must return at once)."""

    def hold_at_most(self, n: int | None) -> None:
        """Keep at most ``n`` remote shards open per process (the order's ``open_shards``)."""
