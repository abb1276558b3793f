"""The order stage: an :class:`~fastload.data.plan.EpochPlan` plus where the consumer stands.

Every loader (fastload's DataLoader, the DALI loader) keeps one :class:`Order`, so resume
state has one shape and one unit everywhere: the epoch and the *global* position in it
(samples consumed by all ranks, see :mod:`fastload.data.plan`). Stages nest their states the
way torchdata's nodes do: a loader's ``state_dict()`` is ``{"order": ...}``, a stage wrapping
a source (``CUDAPrefetcher``) stores the source's state under ``"source"``, and
:func:`find_order_state` finds the order state in any of them, so a checkpoint taken through
one composition (CPU loader + prefetcher) loads into another (DALI).

A pass hands out its indices lazily (:meth:`Order.begin` gives a
:class:`~fastload.data.plan.RankIndices`): a loader slices one batch at a time, so an epoch
boundary costs the next batch's indices, not a permutation of the dataset.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .plan import EpochPlan, RankIndices

__all__ = ["Order", "find_order_state"]


def find_order_state(state: dict[str, Any], what: str = "loader") -> dict[str, Any]:
    """The order stage's state inside a (possibly nested) loader state."""
    seen = state
    while isinstance(seen, dict):
        if "order" in seen:
            return seen["order"]
        if "position" in seen and "epoch" in seen:  # already an order state
            return seen
        if "batches" in seen and "epoch" in seen:  # a state saved before positions were global
            return seen
        seen = seen.get("source")
    raise ValueError(f"{what} state holds no sample order position (keys: {sorted(state) if isinstance(state, dict) else type(state).__name__})")


class Order:
    """An epoch plan and the consumer's position in it: ``epoch``, the global position
    ``start`` where the current pass began, and ``batches`` handed out since.

    A loader calls :meth:`begin` when an iteration starts, :meth:`advance` as each batch
    reaches the caller and :meth:`finish` at the end of the epoch. Breaking out early and
    iterating again continues after the last batch the caller received.
    """

    def __init__(self, plan: EpochPlan):
        self.plan = plan
        self.epoch = 0
        self.start = 0
        self.batches = 0
        self._cache: tuple[int, int, np.ndarray] | None = None
        self._prepare_at = -1  # the batch of the pass after which the next epoch is prepared

    def __len__(self) -> int:
        """Batches of a whole epoch on this rank."""
        return self.plan.num_batches(0)

    @property
    def position(self) -> int:
        """Global samples consumed in the current epoch (by all ranks)."""
        return self.plan.consumed(self.batches, self.start)

    def batches_left(self) -> int:
        """Batches this rank still gets in the current epoch."""
        return self.plan.num_batches(self.start) - self.batches

    def set_epoch(self, epoch: int) -> None:
        """Read ``epoch`` from its start; a no-op for the current epoch, so a loaded
        mid-epoch position survives the usual ``set_epoch`` at the top of the loop."""
        epoch = int(epoch)
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        if epoch != self.epoch:
            self.epoch, self.start, self.batches = epoch, 0, 0

    def indices(self, epoch: int | None = None) -> np.ndarray:
        """This rank's indices of the current pass (or of a whole other ``epoch``) as one
        array: O(N / world_size), for callers that want them all (a loader uses :meth:`begin`)."""
        if epoch is not None and int(epoch) != self.epoch:
            return self.plan.indices(int(epoch))
        key = (self.epoch, self.start)
        if self._cache is None or self._cache[:2] != key:
            self._cache = (*key, self.plan.indices(self.epoch, self.start))
        return self._cache[2]

    def begin(self) -> tuple[int, int, RankIndices]:
        """Start an iteration: ``(epoch, first batch, this pass's indices)``, the indices lazy
        (slice a batch at a time: O(batch) each, nothing computed up front). A position at
        the end of its epoch gives an empty pass (whose end moves on to the next epoch)."""
        self._prepare_at = self.batches + self.batches_left() // 2
        return self.epoch, self.batches, self.plan.indices_view(self.epoch, self.start)

    def rebase(self) -> None:
        """Make the current position the start of the pass (``batches = 0``): the same samples
        follow (see :mod:`fastload.data.plan`), for a consumer that cannot start mid-pass."""
        self.start, self.batches = self.position, 0

    def batch(self, indices: np.ndarray | RankIndices, b: int) -> np.ndarray:
        """Batch ``b`` of a pass's indices (from :meth:`begin` or :meth:`indices`)."""
        return self.plan.batch(indices, b)

    def advance(self, epoch: int, b: int) -> None:
        """The caller has received batch ``b`` of ``epoch``'s current pass. Half way through
        the pass, the next epoch's shared part is computed (:meth:`EpochPlan.prepare`), so
        the epoch boundary costs no more than a batch."""
        if epoch == self.epoch:
            self.batches = b + 1
            if b == self._prepare_at:
                self.plan.prepare(epoch + 1)

    def finish(self, epoch: int) -> None:
        """Epoch ``epoch`` is over: the next iteration reads the one after it."""
        if epoch == self.epoch:
            self.epoch, self.start, self.batches = epoch + 1, 0, 0

    # -- state ---------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The epoch and global position, with the plan's identity so a resume can check it.
        A position at the end of its epoch stays in that epoch (the next iteration moves on),
        so a loop that calls ``set_epoch`` with either epoch after a restart does the right thing."""
        return {"epoch": self.epoch, "position": self.position, **self.plan.identity()}

    def load_state_dict(self, state: dict[str, Any], what: str = "loader") -> None:
        """Continue after the position in ``state`` (an order state, or a loader state that
        nests one). The world size and batch size may differ from the saving run's."""
        state = find_order_state(state, what)
        self.plan.check_resume(state, what)
        epoch = int(state["epoch"])
        if epoch < 0:
            raise ValueError(f"{what} state: epoch={epoch} must be >= 0")
        if "position" in state:
            position = int(state["position"])
        else:  # saved by fastload <= 0.1 as batches per rank under the same round-robin dealing
            old = self.plan.replace(world_size=int(state["world_size"]), rank=0,
                                    batch_size=int(state["batch_size"]))
            position = old.consumed(int(state["batches"]))
        if position < 0:
            raise ValueError(f"{what} state: position={position} must be >= 0")
        self.epoch, self.start, self.batches = epoch, position, 0
