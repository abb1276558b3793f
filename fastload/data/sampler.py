"""Sample order for ``torch.utils.data.DataLoader`` users: :class:`DistributedEpochSampler`,
and :func:`epoch_indices` for anyone who wants a rank's indices of an epoch.

Both are thin views of :class:`~fastload.data.plan.EpochPlan` (with ``batch_size=1``), so a
torch DataLoader, fastload's DataLoader and the DALI pipeline shard a dataset the same way.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np

from .order import Order
from .plan import EpochPlan

__all__ = ["DistributedEpochSampler", "epoch_indices"]

_CHUNK = 4096  # indices computed per step of iteration


def epoch_indices(
    n: int,
    *,
    seed: int = 0,
    epoch: int = 0,
    shuffle: bool = True,
    rank: int = 0,
    world_size: int = 1,
    drop_last: bool = False,
) -> np.ndarray:
    """Exactly the dataset indices rank ``rank`` reads in epoch ``epoch``, in order (int64)."""
    return EpochPlan(n, seed=seed, shuffle=shuffle, rank=rank, world_size=world_size,
                     drop_last=drop_last).indices(epoch)


class DistributedEpochSampler:
    """A sampler for ``torch.utils.data.DataLoader`` (or anything iterating indices).

    Seeded by ``(seed, epoch)``; call :meth:`set_epoch` at the start of each epoch (as with
    DistributedSampler). ``state_dict()`` records the epoch and the global position (samples
    all ranks consumed); ``load_state_dict()`` makes the next iteration continue from there,
    on any number of ranks. The sampler counts a sample as consumed when it yields it; a
    loader that prefetches should keep its own count (fastload's DataLoader does).
    """

    def __init__(self, dataset_or_size, *, seed: int = 0, shuffle: bool = True, rank: int = 0,
                 world_size: int = 1, drop_last: bool = False):
        n = dataset_or_size if isinstance(dataset_or_size, (int, np.integer)) else len(dataset_or_size)
        self.order = Order(EpochPlan(int(n), seed=seed, shuffle=shuffle, rank=rank, world_size=world_size,
                                     drop_last=drop_last))

    @property
    def plan(self) -> EpochPlan:
        return self.order.plan

    @property
    def epoch(self) -> int:
        return self.order.epoch

    def indices(self, epoch: int | None = None) -> np.ndarray:
        """All of this rank's indices for ``epoch`` (default: the current pass)."""
        return self.order.indices(epoch)

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` from its beginning (unless a loaded state resumes this very epoch)."""
        self.order.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.order)

    def __iter__(self) -> Iterator[int]:
        epoch, start, idx = self.order.begin()
        n = len(idx)
        for lo in range(start, n, _CHUNK):  # a chunk of the order at a time: no O(N) work up front
            for k, i in enumerate(idx[lo : min(n, lo + _CHUNK)].tolist(), lo):
                self.order.advance(epoch, k)
                yield i
        # A finished epoch moves on, so iterating again without set_epoch reshuffles.
        self.order.finish(epoch)

    def state_dict(self) -> dict:
        return {"order": self.order.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Resume from ``state``; refuses a state from a different dataset size, seed or order."""
        self.order.load_state_dict(state, what="sampler")
