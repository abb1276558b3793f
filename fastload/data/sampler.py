"""Sample order: a full shuffle per epoch, DDP sharding with equal counts, exact resume.

Everything derives from one pure function, :func:`epoch_indices`, so that the fastload
DataLoader, the sampler and the DALI pipeline all shard a dataset the same way. It needs
only numpy (no torch), so any reader can call it.

Sharding rule (like ``torch.utils.data.DistributedSampler``): the epoch's permutation is
made a multiple of ``world_size`` long, then rank ``r`` takes positions ``r, r + W, ...``.

* ``drop_last=False``: the permutation is padded by wrapping around to its start, so a few
  samples are seen twice in that epoch (at most ``world_size - 1`` of them, or more when the
  dataset is smaller than the world);
* ``drop_last=True``: the tail of the permutation is dropped (at most ``world_size - 1``
  samples, different ones every epoch when shuffling).

Either way every rank gets exactly the same number of samples, so no rank waits forever at
the end of an epoch, and together the ranks cover every (kept) sample once.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np


def _check(n: int, seed: int, epoch: int, rank: int, world_size: int) -> None:
    if n < 0:
        raise ValueError(f"dataset size must be >= 0, got {n}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in 0..{world_size - 1}, got {rank}")
    if seed < 0 or epoch < 0:
        raise ValueError(f"seed and epoch must be >= 0, got seed={seed}, epoch={epoch}")


def permutation(n: int, *, seed: int, epoch: int) -> np.ndarray:
    """The epoch's full shuffle of ``range(n)``: the same on every rank and every machine."""
    return np.random.default_rng([int(seed), int(epoch)]).permutation(n).astype(np.int64)


def samples_per_rank(n: int, *, world_size: int, drop_last: bool) -> int:
    """How many samples each rank sees per epoch."""
    return n // world_size if drop_last else -(-n // world_size)


def padded_per_rank(n: int, *, rank: int, world_size: int, drop_last: bool) -> int:
    """How many of rank ``rank``'s samples per epoch only repeat other ranks' samples: the
    wrap-around padding of ``drop_last=False``, always the last ones of the rank's epoch (0
    with ``drop_last=True``). An evaluation that leaves them out counts every image once."""
    if drop_last:
        return 0
    distinct = len(range(rank, n, world_size))  # rank r reads positions r, r + W, ... < n
    return samples_per_rank(n, world_size=world_size, drop_last=False) - distinct


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
    """Exactly the dataset indices rank ``rank`` reads in epoch ``epoch``, in order (int64).

    Pure: it depends on nothing but its arguments, so a restarted job, another process or the
    DALI pipeline compute the same answer.
    """
    _check(n, seed, epoch, rank, world_size)
    order = permutation(n, seed=seed, epoch=epoch) if shuffle else np.arange(n, dtype=np.int64)
    per_rank = samples_per_rank(n, world_size=world_size, drop_last=drop_last)
    total = per_rank * world_size
    if n == 0 or total == 0:
        return np.zeros(0, dtype=np.int64)
    if total > n:
        order = np.resize(order, total)  # np.resize repeats the array: padding by wrapping
    return np.ascontiguousarray(order[rank:total:world_size])


class DistributedEpochSampler:
    """A sampler for ``torch.utils.data.DataLoader`` (or anything iterating indices).

    Seeded by ``seed + epoch`` through :func:`epoch_indices`; call :meth:`set_epoch` at the
    start of each epoch (as with DistributedSampler). ``state_dict()`` records the epoch and
    how many of its samples were consumed, and ``load_state_dict()`` makes the next iteration
    continue from there: a job restarted mid-epoch sees exactly the samples it had left.
    The sampler counts a sample as consumed when it yields it; a loader that prefetches
    should keep its own count (fastload's DataLoader does).
    """

    def __init__(
        self,
        dataset_or_size,
        *,
        seed: int = 0,
        shuffle: bool = True,
        rank: int = 0,
        world_size: int = 1,
        drop_last: bool = False,
    ):
        n = dataset_or_size if isinstance(dataset_or_size, (int, np.integer)) else len(dataset_or_size)
        _check(int(n), seed, 0, rank, world_size)
        self.n = int(n)
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.drop_last = bool(drop_last)
        self.epoch = 0
        self.offset = 0  # samples of this epoch already handed out

    def indices(self, epoch: int | None = None) -> np.ndarray:
        """All of this rank's indices for ``epoch`` (default: the current one)."""
        return epoch_indices(
            self.n, seed=self.seed, epoch=self.epoch if epoch is None else int(epoch),
            shuffle=self.shuffle, rank=self.rank, world_size=self.world_size, drop_last=self.drop_last,
        )

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` from its beginning (unless a loaded state resumes this very epoch)."""
        epoch = int(epoch)
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        if epoch != self.epoch:
            self.epoch, self.offset = epoch, 0

    def __len__(self) -> int:
        return samples_per_rank(self.n, world_size=self.world_size, drop_last=self.drop_last)

    def __iter__(self) -> Iterator[int]:
        idx = self.indices()
        start = self.offset
        for k in range(start, len(idx)):
            self.offset = k + 1
            yield int(idx[k])
        # A finished epoch moves on, so iterating again without set_epoch reshuffles.
        self.epoch, self.offset = self.epoch + 1, 0

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch, "offset": self.offset, "seed": self.seed, "n": self.n,
            "world_size": self.world_size, "shuffle": self.shuffle, "drop_last": self.drop_last,
        }

    def load_state_dict(self, state: dict) -> None:
        """Resume from ``state``; refuses a state from a different dataset size, seed or world."""
        for key in ("n", "seed", "world_size", "shuffle", "drop_last"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(
                    f"sampler state has {key}={state[key]!r} but this sampler has {getattr(self, key)!r}; "
                    "resuming would not reproduce the interrupted run"
                )
        offset = int(state["offset"])
        if not 0 <= offset <= len(self):
            raise ValueError(f"sampler state offset {offset} out of range 0..{len(self)}")
        self.epoch, self.offset = int(state["epoch"]), offset
