"""``EpochPlan``: which samples each rank reads in an epoch, in what order, in how many batches.

This is the one place that does batch arithmetic. fastload's DataLoader, the DALI loader, the
torch sampler, ``make_loader``, the Trainer and :func:`fastload.train.check_batch_geometry`
all ask a plan; nothing else computes a batch count. A plan is pure (numpy only, no torch, no
files): the same arguments give the same answer in any process, so a restarted job, a DALI
worker and every rank agree without talking to each other.

The rule. Epoch ``e`` has one *global order* of the ``N`` samples (:meth:`EpochPlan.order`:
a permutation seeded by ``(seed, e)``, or ``0..N-1``). Positions in it are read cyclically
(position ``p`` is sample ``order[p % N]``). A *segment* starting at global position ``s`` is
dealt to ``W`` ranks round-robin: rank ``r`` reads positions ``s + r, s + r + W, ...``, each
rank the same number of samples ``S``:

* ``drop_last=False``: ``S = ceil((N - s) / W)``; the last ranks wrap around to the start of
  the order (padding: at most ``W - 1`` repeats, more only when ``N < W``);
* ``drop_last=True``: ``S = (N - s) // W``; the tail (fewer than ``W`` samples) is dropped,
  and so is each rank's last incomplete batch.

Batches are consecutive runs of ``batch_size`` of a rank's samples. Because ranks are dealt
round-robin and move in lock-step (each has read the same number of samples), after every
rank has read ``k`` samples of a segment the ranks together have read exactly the positions
``s .. s + k*W - 1``: a *prefix* of the global order. So a position is one number, global
samples consumed in the epoch (:meth:`EpochPlan.consumed`), whatever the world size. That is
what makes resume elastic: a job checkpointed on ``W`` ranks resumes on ``W'`` as the segment
starting at that position, dealt to ``W'`` ranks; no sample of the epoch is read twice or
skipped (beyond padding and ``drop_last``'s tail), and ``W' = W`` reproduces the
uninterrupted run exactly (``s + r + jW`` are the same positions).

A shard-aware order (block shuffle over shards, for packs read from object storage) is a
subclass that overrides :meth:`EpochPlan.order`; the dealing, batching and positions stay.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

__all__ = ["EpochPlan"]


@dataclass(frozen=True)
class EpochPlan:
    """The order, sharding and batching of every epoch of a dataset of ``num_samples``.

    ``rank``/``world_size`` select this process's share; ``start`` arguments are global
    positions (samples consumed in the epoch by all ranks, see the module docstring).
    """

    num_samples: int
    batch_size: int = 1
    seed: int = 0
    shuffle: bool = True
    rank: int = 0
    world_size: int = 1
    drop_last: bool = False

    kind: ClassVar[str] = "full-shuffle"  # recorded in states: a resume must use the same order

    def __post_init__(self) -> None:
        for name in ("num_samples", "batch_size", "seed", "rank", "world_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise ValueError(f"{name} must be an int, got {v!r}")
            object.__setattr__(self, name, int(v))
        object.__setattr__(self, "shuffle", bool(self.shuffle))
        object.__setattr__(self, "drop_last", bool(self.drop_last))
        if self.num_samples < 0:
            raise ValueError(f"num_samples must be >= 0, got {self.num_samples}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in 0..{self.world_size - 1}, got {self.rank}")

    def replace(self, **changes: Any) -> EpochPlan:
        """A copy with some fields changed (e.g. another rank or world size)."""
        return dataclasses.replace(self, **changes)

    # -- the global order --------------------------------------------------------------------

    def order(self, epoch: int) -> np.ndarray:
        """Epoch ``epoch``'s global order of all samples (int64), the same on every rank."""
        _check_epoch(epoch)
        if not self.shuffle:
            return np.arange(self.num_samples, dtype=np.int64)
        return np.random.default_rng([self.seed, int(epoch)]).permutation(self.num_samples).astype(np.int64)

    # -- arithmetic (no order needed) ----------------------------------------------------------

    def _check_start(self, start: int) -> int:
        start = int(start)
        if start < 0:  # past N is fine: the padding of drop_last=False ends there; nothing is left
            raise ValueError(f"a position in the epoch must be >= 0, got {start}")
        return start

    def samples_per_rank(self, start: int = 0) -> int:
        """Samples each rank reads in the segment from global position ``start``."""
        left = self.num_samples - self._check_start(start)
        if left <= 0:
            return 0
        per_rank = left // self.world_size if self.drop_last else -(-left // self.world_size)
        if self.drop_last:  # the last incomplete batch is dropped too
            per_rank -= per_rank % self.batch_size
        return per_rank

    def num_batches(self, start: int = 0) -> int:
        """Batches each rank gets in the segment from ``start`` (the whole epoch for 0).
        Every rank gets the same number, so no rank waits at the end of an epoch."""
        return -(-self.samples_per_rank(start) // self.batch_size)

    def batch_len(self, b: int, start: int = 0) -> int:
        """Samples in batch ``b`` of the segment (the last one may be short with ``drop_last=False``)."""
        return max(0, min(self.batch_size, self.samples_per_rank(start) - b * self.batch_size))

    def num_padded(self, start: int = 0) -> int:
        """How many of this rank's samples in the segment repeat other positions (the
        wrap-around padding of ``drop_last=False``, always the rank's last samples). Leaving
        them out counts every sample once over all ranks (``Trainer.evaluate`` does)."""
        if self.drop_last:
            return 0
        per_rank = self.samples_per_rank(start)
        first = self._check_start(start) + self.rank  # this rank's first position
        real = 0 if first >= self.num_samples else -(-(self.num_samples - first) // self.world_size)
        return per_rank - min(real, per_rank)

    def consumed(self, batches: int, start: int = 0) -> int:
        """Global position after every rank has received ``batches`` batches of the segment
        from ``start``: the number to checkpoint (see the module docstring)."""
        batches = int(batches)
        if not 0 <= batches <= self.num_batches(start):
            raise ValueError(f"batches must be in 0..{self.num_batches(start)}, got {batches}")
        return start + min(batches * self.batch_size, self.samples_per_rank(start)) * self.world_size

    def finished(self, start: int) -> bool:
        """Whether nothing of the epoch is left to read from position ``start``."""
        return self.num_batches(start) == 0

    # -- indices -------------------------------------------------------------------------------

    def indices(self, epoch: int, start: int = 0, order: np.ndarray | None = None) -> np.ndarray:
        """This rank's sample indices in the segment of epoch ``epoch`` from ``start``, in
        order (int64). ``order`` is :meth:`order` for the epoch, when the caller caches it."""
        per_rank = self.samples_per_rank(start)
        if per_rank == 0:
            return np.zeros(0, dtype=np.int64)
        order = self.order(epoch) if order is None else order
        pos = start + self.rank + self.world_size * np.arange(per_rank, dtype=np.int64)
        return np.ascontiguousarray(order[pos % self.num_samples])

    def batch(self, indices: np.ndarray, b: int) -> np.ndarray:
        """Batch ``b`` of a rank's :meth:`indices`."""
        return indices[b * self.batch_size : (b + 1) * self.batch_size]

    # -- states --------------------------------------------------------------------------------

    def identity(self) -> dict[str, Any]:
        """What a saved position records about the plan. A resume checks the order-defining
        fields (see :meth:`check_resume`); rank, world size and batch size may change."""
        return {
            "plan": self.kind, "num_samples": self.num_samples, "seed": self.seed, "shuffle": self.shuffle,
            "drop_last": self.drop_last, "world_size": self.world_size, "batch_size": self.batch_size,
        }

    def check_resume(self, state: dict[str, Any], what: str = "loader") -> None:
        """ValueError if ``state`` was saved under a plan with another order (resuming would
        neither reproduce the run nor cover the rest of its epoch)."""
        mine = self.identity()
        for key in ("plan", "num_samples", "seed", "shuffle"):
            if key in state and state[key] != mine[key]:
                raise ValueError(
                    f"{what} state has {key}={state[key]!r} but this {what} has {mine[key]!r}; "
                    "resuming would not continue the interrupted epoch"
                )


def _check_epoch(epoch: int) -> None:
    if int(epoch) < 0:
        raise ValueError(f"epoch must be >= 0, got {epoch}")
