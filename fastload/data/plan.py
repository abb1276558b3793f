"""``EpochPlan``: which samples each rank reads in an epoch, in what order, in how many batches.

This is the one place that does batch arithmetic. fastload's DataLoader, the DALI loader, the
torch sampler, ``make_loader``, the Trainer and :func:`fastload.train.check_batch_geometry`
all ask a plan; nothing else computes a batch count. A plan is pure (numpy only, no torch, no
files): the same arguments give the same answer in any process, so a restarted job, a DALI
worker and every rank agree without talking to each other.

The rule. Epoch ``e`` has one *global order* of the ``N`` samples (:meth:`EpochPlan.order`:
a permutation keyed by ``(seed, e)``, or ``0..N-1``). Positions in it are read cyclically
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

The order is never built to be read. The sample at a position is a pure function of the
position (:meth:`EpochPlan.at`: a keyed Feistel permutation, :mod:`.permutation`), so a rank
computes the positions of the batch it reads next (:meth:`EpochPlan.batch_indices`,
:meth:`EpochPlan.indices_view`): O(batch) per batch and nothing extra at an epoch boundary,
where a full ``rng.permutation(N)`` cost every rank O(N) time and 8N bytes (a second at 10M
samples) before the epoch's first batch. :meth:`EpochPlan.indices` (a rank's whole share,
O(N / world_size)) and :meth:`EpochPlan.order` (all of it, O(N)) remain for callers that want
arrays. ``order_version`` names the algorithm: 1 was the full permutation (kept so a run
interrupted mid-epoch by an older fastload can finish that epoch), 2 the pointwise one; a
state records it and a resume mid-epoch refuses another.

A shard-aware order is a subclass that overrides how a position maps to a sample; the dealing,
batching and positions stay. :class:`BlockShufflePlan` is one: for packs read from object
storage through a node-local shard cache, it mixes the samples of a few shards at a time, so
the cache holds a few shards instead of all of them (a full shuffle touches every shard all
the time). :meth:`EpochPlan.shards_ahead` and :meth:`EpochPlan.working_set` tell a
download-ahead which shards come next and how many must be cached at once, for any plan.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Iterator, Sequence

import numpy as np

from .permutation import permutation_keys, permute

__all__ = ["ORDER_VERSION", "BlockShufflePlan", "EpochPlan", "RankIndices", "shard_of"]

ORDER_VERSION = 2  # 1: rng.permutation(N) per epoch (fastload <= 0.2); 2: pointwise Feistel order
_CHUNK = 1 << 15  # positions mapped per vectorised call when a caller asks for many (cache-sized)

ShardStarts = Sequence[int] | np.ndarray  # cumulative record offsets of a pack's shards
ArrayLike = Sequence[int] | np.ndarray


def shard_of(indices: ArrayLike, shard_starts: ShardStarts) -> np.ndarray:
    """The shard holding each sample index (int64), where shard ``k`` holds the records
    ``shard_starts[k] .. shard_starts[k + 1] - 1`` (cumulative offsets, first 0, last ``N``).
    An empty shard holds nothing, so no index maps to it."""
    starts = np.asarray(shard_starts, dtype=np.int64)
    idx = np.asarray(indices, dtype=np.int64)
    if idx.size and (idx.min() < 0 or idx.max() >= starts[-1]):
        raise ValueError(f"sample indices must be in 0..{starts[-1] - 1}, got {idx.min()}..{idx.max()}")
    return np.searchsorted(starts, idx, side="right").astype(np.int64) - 1


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
    order_version: int = ORDER_VERSION

    kind: ClassVar[str] = "full-shuffle"  # recorded in states: a resume must use the same order
    # Remote shards a reader should keep open (held against eviction) under this order; None:
    # no bound from the order (a full shuffle touches every shard all the time).
    open_shards: ClassVar[int | None] = None
    # identity() keys that define the order: check_resume refuses a state that differs in one
    resume_keys: ClassVar[tuple[str, ...]] = ("plan", "order_version", "num_samples", "seed", "shuffle")
    _key_stream: ClassVar[tuple[int, ...]] = ()  # words added to (seed, epoch) for this kind's permutation keys

    def __post_init__(self) -> None:
        for name in ("num_samples", "batch_size", "seed", "rank", "world_size", "order_version"):
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
        if self.order_version not in (1, ORDER_VERSION):
            raise ValueError(f"order_version must be 1 or {ORDER_VERSION}, got {self.order_version}")

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.pop("_epoch_memo", None)  # per-epoch layouts: rebuilt on demand, not shipped to workers
        return state

    def _memo(self, key: tuple[str, int], make: Callable[[], Any]) -> Any:
        """A small per-plan cache of per-epoch data ``key = (kind, epoch)``: two epochs of each
        kind (the current one and the next, around a boundary). Safe from several threads: a
        race computes a value twice, never loses one."""
        memo = self.__dict__.setdefault("_epoch_memo", {})
        value = memo.get(key)
        if value is None:
            value = make()
            for old in [k for k in list(memo) if k[0] == key[0]][:-1]:
                memo.pop(old, None)
            memo[key] = value
        return value

    def replace(self, **changes: Any) -> EpochPlan:
        """A copy with some fields changed (e.g. another rank or world size)."""
        return dataclasses.replace(self, **changes)

    # -- the global order --------------------------------------------------------------------

    def order(self, epoch: int) -> np.ndarray:
        """Epoch ``epoch``'s global order of all samples (int64), the same on every rank.
        O(N): a loader never builds it (see :meth:`at`)."""
        _check_epoch(epoch)
        out = np.empty(self.num_samples, dtype=np.int64)
        for lo in range(0, self.num_samples, _CHUNK):
            out[lo : lo + _CHUNK] = self._at(int(epoch), np.arange(lo, min(lo + _CHUNK, self.num_samples)))
        return out

    def at(self, epoch: int, positions: ArrayLike) -> np.ndarray:
        """The samples at global ``positions`` (read cyclically) of epoch ``epoch``'s order,
        i.e. ``order(epoch)[positions % N]`` in O(len(positions)), without the order."""
        _check_epoch(epoch)
        pos = np.asarray(positions, dtype=np.int64).reshape(-1)
        if not pos.size:
            return np.zeros(0, dtype=np.int64)
        if self.num_samples == 0:
            raise ValueError("an empty dataset has no positions")
        if pos.size <= _CHUNK:
            return self._at(int(epoch), pos % self.num_samples)
        out = np.empty(pos.size, dtype=np.int64)
        for lo in range(0, pos.size, _CHUNK):  # cache-sized steps, and no N-sized temporaries
            out[lo : lo + _CHUNK] = self._at(int(epoch), pos[lo : lo + _CHUNK] % self.num_samples)
        return out

    def _at(self, epoch: int, pos: np.ndarray) -> np.ndarray:
        """:meth:`at` for positions already in 0..N-1."""
        if not self.shuffle:
            return pos
        if self.order_version == 1:
            return self._memo(("v1", epoch), lambda: self._order_v1(epoch))[pos]
        return self._lookup(epoch, pos)

    def _lookup(self, epoch: int, pos: np.ndarray) -> np.ndarray:
        """Samples at positions ``pos`` (in 0..N-1) of a shuffled order (order version 2)."""
        return permute(pos, self.num_samples, self._keys(epoch))

    def _keys(self, epoch: int) -> np.ndarray:
        """The round keys of epoch ``epoch``'s permutation (per plan kind: a block order never
        draws a full shuffle's numbers)."""
        return self._memo(("keys", epoch), lambda: permutation_keys(self.seed, epoch, *self._key_stream))

    def prepare(self, epoch: int) -> None:
        """Compute ahead what every batch of epoch ``epoch`` shares (its keys; a
        :class:`BlockShufflePlan`'s shard layout, O(num_shards)), so that epoch's first batch
        costs no more than any other. :class:`~fastload.data.order.Order` calls it half way
        through the epoch before. Never needed for correctness."""
        _check_epoch(epoch)
        if self.shuffle and self.order_version != 1:  # version 1's whole order is not built ahead
            self._keys(int(epoch))

    def _order_v1(self, epoch: int) -> np.ndarray:
        """The whole shuffled order as fastload <= 0.2 drew it (order version 1)."""
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_samples).astype(np.int64)

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
        order (int64): O(N / world_size). ``order`` is :meth:`order` for the epoch, when the
        caller has it. A loader reads :meth:`indices_view` instead, a batch at a time."""
        per_rank = self.samples_per_rank(start)
        if per_rank == 0:
            _check_epoch(epoch)
            return np.zeros(0, dtype=np.int64)
        if order is not None:
            return np.ascontiguousarray(order[self._positions(start, 0, per_rank) % self.num_samples])
        return self.take(epoch, 0, per_rank, start)

    def take(self, epoch: int, lo: int, hi: int, start: int = 0) -> np.ndarray:
        """This rank's samples ``lo .. hi - 1`` (clipped to the segment) of the segment of
        epoch ``epoch`` from ``start``: ``indices(epoch, start)[lo:hi]`` in O(hi - lo)."""
        per_rank = self.samples_per_rank(start)
        lo, hi = max(0, min(int(lo), per_rank)), max(0, min(int(hi), per_rank))
        if hi - lo <= _CHUNK:
            return self.at(epoch, self._positions(start, lo, hi))
        out = np.empty(hi - lo, dtype=np.int64)
        for a in range(lo, hi, _CHUNK):  # positions a chunk at a time: the result is the only big array
            out[a - lo : a - lo + _CHUNK] = self.at(epoch, self._positions(start, a, min(a + _CHUNK, hi)))
        return out

    def batch_indices(self, epoch: int, b: int, start: int = 0) -> np.ndarray:
        """Batch ``b`` of this rank's segment of epoch ``epoch`` from ``start``, in O(batch)."""
        return self.take(epoch, int(b) * self.batch_size, (int(b) + 1) * self.batch_size, start)

    def indices_view(self, epoch: int, start: int = 0) -> RankIndices:
        """:meth:`indices` as a lazy sequence: slicing it computes only that slice."""
        _check_epoch(epoch)
        return RankIndices(self, int(epoch), self._check_start(start))

    def _positions(self, start: int, lo: int, hi: int) -> np.ndarray:
        """Global positions of this rank's samples ``lo .. hi - 1`` in the segment from ``start``."""
        return start + self.rank + self.world_size * np.arange(lo, hi, dtype=np.int64)

    def batch(self, indices: np.ndarray | RankIndices, b: int) -> np.ndarray:
        """Batch ``b`` of a rank's :meth:`indices` (or :meth:`indices_view`: computes that batch only)."""
        return indices[b * self.batch_size : (b + 1) * self.batch_size]

    # -- shards (for a download-ahead over a shard cache) --------------------------------------

    def _shard_starts(self, shard_starts: ShardStarts | None) -> np.ndarray:
        """The pack's shard layout: given by the caller (this plan's order knows no shards)."""
        if shard_starts is None:
            raise ValueError(f"{type(self).__name__} knows no shard layout: pass shard_starts=")
        starts = np.asarray(shard_starts, dtype=np.int64)
        if starts.ndim != 1 or not len(starts) or starts[-1] != self.num_samples:
            raise ValueError(f"shard_starts must be 1-D offsets ending at num_samples={self.num_samples}")
        return starts

    def shards_ahead(self, epoch: int, *, first_batch: int = 0, batches: int = 1, start: int = 0,
                     shard_starts: ShardStarts | None = None, order: np.ndarray | None = None) -> list[int]:
        """The shards this rank's ``batches`` batches from batch ``first_batch`` of the segment
        from ``start`` read, in first-use order, each once: what a download-ahead fetches
        next. ``shard_starts``: the pack's cumulative record offsets (a
        :class:`BlockShufflePlan` knows its own); ``order``: :meth:`order`, when cached."""
        starts = self._shard_starts(shard_starts)
        first_batch, batches = int(first_batch), int(batches)
        if first_batch < 0 or batches < 0:
            raise ValueError(f"first_batch and batches must be >= 0, got {first_batch}, {batches}")
        per_rank = self.samples_per_rank(start)
        lo = min(first_batch * self.batch_size, per_rank)
        hi = min((first_batch + batches) * self.batch_size, per_rank)
        if hi <= lo:
            return []
        positions = self._positions(start, lo, hi)
        samples = self.at(epoch, positions) if order is None else order[positions % self.num_samples]
        shards = shard_of(samples, starts)
        unique, first = np.unique(shards, return_index=True)
        return unique[np.argsort(first)].tolist()

    def working_set(self, epoch: int, *, ahead: int = 0, start: int = 0,
                    shard_starts: ShardStarts | None = None, order: np.ndarray | None = None) -> int:
        """The most shards this rank holds at once over the segment from ``start`` if it keeps
        each shard from ``ahead`` batches before the batch that first reads it until the batch
        that last reads it: the shard cache this rank needs. Ranks move in lock-step, so for
        all ranks together (a node's cache, up to padding) ask
        ``plan.replace(rank=0, world_size=1, batch_size=plan.batch_size * plan.world_size)``.
        A full shuffle holds nearly every shard; see :class:`BlockShufflePlan`."""
        starts = self._shard_starts(shard_starts)
        ahead = int(ahead)
        if ahead < 0:
            raise ValueError(f"ahead must be >= 0, got {ahead}")
        idx = self.indices(epoch, start, order)
        if not len(idx):
            return 0
        shards = shard_of(idx, starts)
        batch = np.arange(len(idx), dtype=np.int64) // self.batch_size
        k = len(starts) - 1
        first = np.full(k, len(idx), dtype=np.int64)
        np.minimum.at(first, shards, batch)
        last = np.full(k, -1, dtype=np.int64)
        np.maximum.at(last, shards, batch)
        used = last >= 0
        live = np.zeros(batch[-1] + 2, dtype=np.int64)  # +1 from (first - ahead), -1 after last
        np.add.at(live, np.maximum(first[used] - ahead, 0), 1)
        np.add.at(live, last[used] + 1, -1)
        return int(np.cumsum(live).max())

    # -- states --------------------------------------------------------------------------------

    def identity(self) -> dict[str, Any]:
        """What a saved position records about the plan. A resume checks the order-defining
        fields (see :meth:`check_resume`); rank, world size and batch size may change."""
        return {
            "plan": self.kind, "order_version": self.order_version, "num_samples": self.num_samples,
            "seed": self.seed, "shuffle": self.shuffle, "drop_last": self.drop_last,
            "world_size": self.world_size, "batch_size": self.batch_size,
        }

    def check_resume(self, state: dict[str, Any], what: str = "loader") -> None:
        """ValueError if ``state`` was saved under a plan with another order (resuming would
        neither reproduce the run nor cover the rest of its epoch). Another ``order_version``
        is refused only mid-epoch: from an epoch boundary any order covers the epochs to come."""
        mine = self.identity()
        # keys missing from older states: "plan" (fastload <= 0.1) and "order_version" (<= 0.2)
        old = {"plan": "full-shuffle", "order_version": 1}
        for key in self.resume_keys:
            theirs = state.get(key, old.get(key, mine[key]))
            if theirs == mine[key]:
                continue
            if key == "order_version" and not self.shuffle:
                continue  # 0..N-1 in every version
            if key == "order_version" and self._at_epoch_boundary(state):
                continue
            if key == "order_version":
                raise ValueError(
                    f"{what} state was saved mid-epoch under order_version={theirs!r} (another fastload's sample "
                    f"order) but this {what} computes order_version={mine[key]!r}; to finish that epoch exactly, "
                    f"pass plan={type(self).__name__}(..., order_version={theirs!r}), or restart the epoch"
                )
            raise ValueError(
                f"{what} state has {key}={theirs!r} but this {what} has {mine[key]!r}; "
                "resuming would not continue the interrupted epoch"
            )

    def _at_epoch_boundary(self, state: dict[str, Any]) -> bool:
        """Whether a saved position is at its epoch's start or end (nothing of it left to read)."""
        try:
            saved = self.replace(rank=0, world_size=int(state.get("world_size", self.world_size)),
                                 batch_size=int(state.get("batch_size", self.batch_size)),
                                 drop_last=bool(state.get("drop_last", self.drop_last)))
            if "position" in state:
                position = int(state["position"])
            else:
                position = saved.consumed(int(state["batches"]))
        except (KeyError, TypeError, ValueError):
            return False
        return position == 0 or (position > 0 and saved.finished(position))


_BLOCK_STREAM = 0x626C6F63  # "bloc": a spawn key, so a block order never draws EpochPlan's numbers


@dataclass(frozen=True, kw_only=True)
class BlockShufflePlan(EpochPlan):
    """An :class:`EpochPlan` whose order shuffles shards in blocks, for packs read through a
    shard cache: only a few shards are read at any moment.

    The order of epoch ``e`` (seeded by ``(seed, e)`` only, so every rank, world size and
    batch size agree): permute the shards (:meth:`shard_order`), cut that list into
    consecutive windows of ``window`` shards, permute all the samples of each window, and
    concatenate the windows. The first ``k`` windows of the order hold exactly the samples of
    the first ``k * window`` shards of the shard order. ``shuffle=False`` gives ``0..N-1``.
    Each window has its own keyed pointwise permutation (:mod:`.permutation`), so a batch
    costs O(batch) and the shard order O(num_shards), once per epoch: no sample order is built.

    Dealing, batching, positions and elastic resume are :class:`EpochPlan`'s. Every rank
    reads the current window (ranks move in lock-step through one global order), so a node
    caches about ``window`` shards, plus the next window's while crossing a boundary:
    :meth:`working_set` measures it. A larger window mixes more; a sample's neighbours in a
    batch come from at most ``window`` shards (two windows at a boundary).

    ``shard_starts``: cumulative record offsets; shard ``k`` holds records
    ``shard_starts[k] .. shard_starts[k + 1] - 1`` (first 0, last ``num_samples``;
    non-decreasing, so empty shards are allowed). A resume checks ``window`` and a hash of
    ``shard_starts`` as well as the :class:`EpochPlan` fields.
    """

    shard_starts: tuple[int, ...] = field(default=(), repr=False)
    window: int = 4

    kind: ClassVar[str] = "block-shuffle"
    _key_stream: ClassVar[tuple[int, ...]] = (_BLOCK_STREAM,)

    @property
    def open_shards(self) -> int:  # type: ignore[override]
        """A batch reads at most two windows' shards: a reader holding more would pin, against
        eviction, shards of windows long past, and a cache sized for the windows would overflow."""
        return 2 * self.window
    resume_keys: ClassVar[tuple[str, ...]] = (*EpochPlan.resume_keys, "window", "shard_layout")

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.window, bool) or not isinstance(self.window, (int, np.integer)) or self.window < 1:
            raise ValueError(f"window must be an int >= 1, got {self.window!r}")
        object.__setattr__(self, "window", int(self.window))
        starts = np.asarray(self.shard_starts)
        if starts.ndim != 1 or not len(starts) or not np.issubdtype(starts.dtype, np.integer):
            raise ValueError("shard_starts must be a non-empty sequence of ints (cumulative record offsets), "
                             f"got {self.shard_starts!r:.80}")
        if starts[0] != 0 or starts[-1] != self.num_samples or (np.diff(starts) < 0).any():
            raise ValueError(f"shard_starts must rise (non-decreasing) from 0 to num_samples={self.num_samples}, "
                             f"got {self.shard_starts!r:.80}")
        object.__setattr__(self, "shard_starts", tuple(int(x) for x in starts))

    @functools.cached_property
    def _starts(self) -> np.ndarray:
        return np.asarray(self.shard_starts, dtype=np.int64)

    @property
    def num_shards(self) -> int:
        return len(self.shard_starts) - 1

    def _rng(self, epoch: int) -> np.random.Generator:
        _check_epoch(epoch)
        return np.random.default_rng(np.random.SeedSequence([self.seed, int(epoch)], spawn_key=(_BLOCK_STREAM,)))

    def shard_order(self, epoch: int) -> np.ndarray:
        """Epoch ``epoch``'s order of the shards (int64); window ``w`` is its entries
        ``w * window .. (w + 1) * window - 1``."""
        if not self.shuffle:
            _check_epoch(epoch)
            return np.arange(self.num_shards, dtype=np.int64)
        return self._rng(epoch).permutation(self.num_shards).astype(np.int64)

    def _layout(self, epoch: int) -> tuple[np.ndarray, ...]:
        """Epoch ``epoch``'s shard order laid out in positions: ``(shard order, shard sizes,
        end position of each shard, end position of each window)``, all O(num_shards)."""
        def make() -> tuple[np.ndarray, ...]:
            perm = self.shard_order(epoch)
            sizes = np.diff(self._starts)[perm]
            ends = np.cumsum(sizes)
            last = np.minimum(np.arange(self.window, self.num_shards + self.window, self.window), self.num_shards)
            return perm, sizes, ends, ends[last - 1] if self.num_shards else ends
        return self._memo(("layout", epoch), make)

    def _lookup(self, epoch: int, pos: np.ndarray) -> np.ndarray:
        """Position -> window -> offset shuffled within the window (its own keyed permutation)
        -> the shard and record at that offset of the window's shards, all vectorised."""
        perm, sizes, ends, window_ends = self._layout(epoch)
        w = np.searchsorted(window_ends, pos, side="right")
        first = np.concatenate([[0], window_ends])[w]  # the window's first position
        q = first + permute(pos - first, window_ends[w] - first, self._keys(epoch), tweak=w)
        j = np.searchsorted(ends, q, side="right")  # q's shard, as its place in the shard order
        return self._starts[perm[j]] + (q - (ends[j] - sizes[j]))

    def prepare(self, epoch: int) -> None:
        """:meth:`EpochPlan.prepare`, and the epoch's shard layout."""
        super().prepare(epoch)
        if self.shuffle and self.order_version != 1:
            self._layout(int(epoch))

    def _order_v1(self, epoch: int) -> np.ndarray:
        """The order as fastload <= 0.2 drew it (order version 1): one rng shuffle per window."""
        rng = self._rng(epoch)
        perm = rng.permutation(self.num_shards)  # the same draw as shard_order
        sizes = np.diff(self._starts)[perm]
        ends = np.cumsum(sizes)
        # the shards' records laid out in shard order: position p of shard j is start_j + (p - offset_j)
        out = np.arange(self.num_samples, dtype=np.int64) + np.repeat(self._starts[perm] - (ends - sizes), sizes)
        bounds = np.concatenate([[0], ends[self.window - 1 :: self.window], [self.num_samples]])
        for a, b in zip(bounds[:-1], bounds[1:]):  # one call per window, none per sample
            rng.shuffle(out[a:b])
        return out

    def _shard_starts(self, shard_starts: ShardStarts | None) -> np.ndarray:
        return self._starts if shard_starts is None else super()._shard_starts(shard_starts)

    def identity(self) -> dict[str, Any]:
        """:meth:`EpochPlan.identity` plus the window and a hash of the shard layout."""
        layout = hashlib.sha1(self._starts.astype("<i8").tobytes()).hexdigest()[:16]
        return {**super().identity(), "window": self.window, "num_shards": self.num_shards, "shard_layout": layout}


class RankIndices:
    """A rank's sample indices in a segment of one epoch (:meth:`EpochPlan.indices_view`), as a
    lazy sequence: ``view[a:b]`` computes those ``b - a`` indices only, ``view[i]`` one,
    ``np.asarray(view)`` all of them. Loaders hold one per pass and slice a batch at a time,
    so starting an epoch costs no more than reading a batch."""

    __slots__ = ("plan", "epoch", "start", "_len")

    def __init__(self, plan: EpochPlan, epoch: int, start: int):
        self.plan, self.epoch, self.start = plan, epoch, start
        self._len = plan.samples_per_rank(start)

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, key: int | slice) -> Any:
        if isinstance(key, slice):
            lo, hi, step = key.indices(self._len)
            if step == 1:
                return self.plan.take(self.epoch, lo, hi, self.start)
            return np.asarray(self)[key]
        i = operator.index(key)
        if i < 0:
            i += self._len
        if not 0 <= i < self._len:
            raise IndexError(f"index {key} out of range for {self._len} indices")
        return int(self.plan.take(self.epoch, i, i + 1, self.start)[0])

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        out = self.plan.take(self.epoch, 0, self._len, self.start)
        return out if dtype is None else out.astype(dtype)

    def __iter__(self) -> Iterator[int]:
        for lo in range(0, self._len, _CHUNK // 16):
            yield from self[lo : lo + _CHUNK // 16].tolist()

    def tolist(self) -> list[int]:
        return np.asarray(self).tolist()

    def __repr__(self) -> str:
        return f"RankIndices({self._len} indices of epoch {self.epoch} from position {self.start}, {self.plan!r})"


def _check_epoch(epoch: int) -> None:
    if int(epoch) < 0:
        raise ValueError(f"epoch must be >= 0, got {epoch}")
