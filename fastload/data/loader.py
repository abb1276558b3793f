"""``fastload.DataLoader``: whole uint8 batches, as a composition of stages.

    order (EpochPlan + position) -> fill (workers, BatchFiller) -> ring (bounded slots) -> caller
                                                                  [-> to-device: CUDAPrefetcher]

* **order** (:mod:`.order`, :mod:`.plan`): which samples this rank reads, in which batches;
  the only place batch counts are computed; the resume state, in global sample positions, so
  a checkpoint resumes on another number of ranks.
* **fill**: persistent worker processes (:mod:`.workers`) each build a whole batch per task
  through the dataset's :class:`~fastload.data.protocols.BatchFiller` methods, decoding every
  record and resizing its crop straight into its slot; only the slot number travels back.
* **ring** (:mod:`.ring`): a fixed number of preallocated slots in ``/dev/shm`` (or
  ``ring_dir``), reserved at start. A batch comes out as an N x C x H x W tensor in
  ``channels_last`` memory format over its slot: no allocation, no copy, no ``torch.stack``.

Two paths (:attr:`DataLoader.mode`):

* ``"ring"``: a dataset implementing :class:`~fastload.data.protocols.BatchFiller` whose
  samples have one fixed size (a fastload ImageFolder with a planned transform such as
  RandomResizedCrop, or a fixed-size pack without transform).
* ``"per-sample"``: any other map-style Dataset, including a user's own returning ``(array |
  tensor | PIL image, label)``: ``torch.utils.data.DataLoader`` with this loader's order and
  :func:`~fastload.data.collate.collate_uint8` (``default_collate`` when items are not
  images). Its workers persist across epochs. A BatchFiller that cannot take the ring path
  (e.g. a ``Normalize`` in its transform) warns once, naming the transform and what to do.

**Processes, not threads.** OpenCV and simplejpeg release the GIL, so threads in the main
process could fill the ring too; benchmarks/bench_loader.py measures that (its "threads"
rows). On the 2-core development machine, under load, at 1,000 images, 2 threads filling
batches with no consumer reached 89-99% of the 2-process loader. The per-sample Python
around each decode holds the GIL and would compete with the training loop, and processes
isolate crashes, so workers are processes.

**Holding batches.** A yielded image tensor is a view of a ring slot; the slot goes back to
the ring only when every tensor viewing it has been garbage collected (:mod:`.ring`). The
ring has ``ring_slots`` slots (default ``prefetch + 4``). When the caller holds so many
batches that the workers would run out of slots, further batches are *copied* out of the
ring (with one warning) until some are released: holding batches is always safe, it only
gets slower. ``copy=True`` always yields private copies.

Order and augmentation depend only on (seed, epoch, sample index), never on the worker, so
``num_workers=0`` and ``num_workers=2`` give identical batches.
"""

from __future__ import annotations

import collections
import queue
import warnings
import weakref
from typing import Any, Callable, Iterator

import numpy as np

from ..checks import resolve_distributed
from ..config import usable_cpus
from .collate import collate_uint8
from .order import Order
from .plan import EpochPlan
from .protocols import BatchFiller, EpochDataset, OnRecordError, Prefetching, Replacement, on_error_skips
from .ring import Ring
from .workers import WorkerError, Workers, raise_worker_error

__all__ = ["DataLoader", "LoaderStats", "PerformanceWarning", "WorkerError"]

RING_MARGIN = 4  # slots beyond ``prefetch`` that the caller may hold as views


class PerformanceWarning(UserWarning):
    """fastload fell off a fast path (the message says why and what to do)."""


class LoaderStats(dict):
    """``loader.stats()``: ``replaced`` (count) and ``records`` (the :class:`Replacement`s of
    corrupt records served as substitutes under ``on_error="skip"``), ``copied`` (batches
    copied out of the ring because the caller held too many) and ``worker_rss`` (bytes)."""


class _EpochItems:
    """The dataset as the per-sample path's workers see it: keys arrive as ``(epoch, index)``
    and are read with :meth:`EpochDataset.get` under the loader's seed and error policy, so
    persistent workers augment for the right epoch and the user's dataset is never mutated."""

    def __init__(self, dataset: EpochDataset, seed: int, on_error: str):
        self.dataset = dataset
        self.seed = seed
        self.on_error = on_error

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key):
        epoch, i = key
        return self.dataset.get(i, epoch=epoch, seed=self.seed, on_error=self.on_error)


class _CollateKeepingReplacements:
    """Collate ``(image, target, replacement)`` items as ``collate_fn`` would the pairs, and
    carry the replacements to the main process beside the batch."""

    def __init__(self, collate_fn: Callable[[list], Any]):
        self.collate_fn = collate_fn

    def __call__(self, items: list) -> tuple[Any, list]:
        return self.collate_fn([(img, t) for img, t, _ in items]), [r for _, _, r in items if r is not None]


class _Batches:
    """A batch sampler the loader refills before each pass (torch's persistent workers keep
    the DataLoader, and so its batch sampler, from one epoch to the next)."""

    def __init__(self):
        self.batches: list[list] = []

    def __iter__(self):
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def _shutdown(state: dict) -> None:
    torch_loader = state.pop("torch_loader", None)
    if torch_loader is not None:
        it = getattr(torch_loader, "_iterator", None)
        if it is not None and hasattr(it, "_shutdown_workers"):
            it._shutdown_workers()
        torch_loader._iterator = None
    workers, ring = state.pop("workers", None), state.pop("ring", None)
    if workers is not None:
        workers.shutdown()
    if ring is not None:
        ring.close()


# -- the loader ---------------------------------------------------------------------------


class DataLoader:
    """Batches of ``(uint8 images N x C x H x W, int64 targets)`` from a map-style dataset.

    ``shuffle``/``seed``: a full reshuffle per epoch seeded by ``(seed, epoch)``; the same seed
    gives the same batches and augmentations for any ``num_workers``. ``drop_last``: drop the
    samples that do not divide evenly over the ranks and the last incomplete batch (otherwise
    the ranks are padded by wrapping around, see :mod:`fastload.data.plan`).
    ``num_workers``: worker processes (default: one per core; 0 = in the calling process).
    ``distributed``: None reads rank and world size from ``torch.distributed`` when it is
    initialised; ``(rank, world_size)`` sets them. ``pin_memory``: page-lock the batch slots
    (default: when CUDA is available). ``prefetch``: batches in flight (default 2 per worker).
    ``ring_slots``: slots in the ring (default ``prefetch + 4``); ``ring_dir``: where they live
    (default ``/dev/shm``). ``copy``: yield private copies instead of ring-slot views (see the
    module docstring). ``on_error``: ``"raise"`` (default) stops at a corrupt record with an
    error naming it, its shard and its source file; ``"skip"`` serves a deterministic
    substitute in its place and reports it in :meth:`stats`.

    ``plan``: an :class:`~fastload.data.plan.EpochPlan` to follow instead (e.g. a
    :class:`~fastload.data.plan.BlockShufflePlan` for packs read through a shard cache); its
    ``num_samples`` must be ``len(dataset)``, and its fields win over ``batch_size`` (which
    may then be left out), ``seed``, ``shuffle``, ``drop_last`` and ``distributed``.

    ``state_dict()`` is ``{"order": ...}``: the epoch and the global position (samples all
    ranks consumed), so a job checkpointed on W ranks resumes on W' ranks; with W' = W it
    continues exactly where the interrupted run would have. Iterating again without
    :meth:`set_epoch` moves on to the next epoch.
    """

    def __init__(
        self,
        dataset,
        batch_size: int | None = None,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        num_workers: int | None = None,
        distributed=None,
        pin_memory: bool | None = None,
        prefetch: int | None = None,
        ring_slots: int | None = None,
        ring_dir: str | None = None,
        copy: bool = False,
        on_error: OnRecordError | str = OnRecordError.RAISE,
        collate_fn: Callable[[list], Any] | None = None,
        multiprocessing_context: str | None = None,
        plan: EpochPlan | None = None,
    ):
        self.dataset = dataset
        self.num_workers = usable_cpus() if num_workers is None else int(num_workers)
        if self.num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        if plan is None:
            if batch_size is None:
                raise ValueError("DataLoader needs a batch_size (or a plan=)")
            rank, world_size = resolve_distributed(distributed)
            plan = EpochPlan(len(dataset), batch_size=batch_size, seed=seed, shuffle=shuffle,
                             rank=rank, world_size=world_size, drop_last=drop_last)
        elif plan.num_samples != len(dataset):
            raise ValueError(f"plan has num_samples={plan.num_samples} but the dataset has {len(dataset)} samples")
        self.rank, self.world_size = plan.rank, plan.world_size
        self.order = Order(plan)
        if pin_memory is None:
            pin_memory = _cuda_available()
        self.pin_memory = bool(pin_memory)
        self.prefetch = int(prefetch) if prefetch is not None else 2 * max(1, self.num_workers)
        if self.prefetch < 1:
            raise ValueError(f"prefetch must be >= 1, got {prefetch}")
        self.ring_slots = int(ring_slots) if ring_slots is not None else self.prefetch + RING_MARGIN
        if self.ring_slots < self.prefetch:
            raise ValueError(f"ring_slots ({self.ring_slots}) must be >= prefetch ({self.prefetch})")
        self.ring_dir = None if ring_dir is None else str(ring_dir)
        self.copy = bool(copy)
        on_error_skips(on_error)  # the one check of the policy's value
        self.on_error = OnRecordError(on_error).value
        self.collate_fn = collate_fn
        # a remote pack's workers must not be forked from a process that has used the store
        self.multiprocessing_context = multiprocessing_context or getattr(dataset, "worker_start_method", None)
        self._hint = dataset.prefetch if isinstance(dataset, Prefetching) else None
        if isinstance(dataset, Prefetching):  # before the workers copy the dataset
            dataset.hold_at_most(self.plan.open_shards)
        self.mode, self._image_shape = self._choose_path(dataset, collate_fn)
        self._generation = 0
        self._outstanding = 0  # tasks sent to workers whose results have not come back (any generation)
        self._state: dict = {}  # workers, ring, torch loader: shut down by the finalizer
        self._finalizer = weakref.finalize(self, _shutdown, self._state)
        self._replaced: collections.deque[Replacement] = collections.deque(maxlen=1000)
        self._replaced_count = 0
        self._copied = 0
        self.worker_rss: dict[int, int] = {}  # last resident size each worker reported (bytes)

    @staticmethod
    def _choose_path(dataset, collate_fn) -> tuple[str, tuple[int, ...] | None]:
        if collate_fn is not None or not isinstance(dataset, BatchFiller):
            return "per-sample", None
        shape = dataset.batch_image_shape()
        if shape is None:
            why = dataset.ring_blocker() or "its samples have no fixed size"
            warnings.warn(f"fastload.DataLoader takes the slower per-sample path for {type(dataset).__name__}: "
                          f"{why}", PerformanceWarning, stacklevel=3)
            return "per-sample", None
        return "ring", tuple(int(s) for s in shape)

    # -- plan, epochs, resume -----------------------------------------------------------------

    @property
    def plan(self) -> EpochPlan:
        return self.order.plan

    @property
    def batch_size(self) -> int:
        return self.plan.batch_size

    @property
    def seed(self) -> int:
        return self.plan.seed

    @property
    def drop_last(self) -> bool:
        return self.plan.drop_last

    @property
    def epoch(self) -> int:
        return self.order.epoch

    def __len__(self) -> int:
        """Batches per epoch on this rank (a resumed epoch has :meth:`batches_left` of them left)."""
        return len(self.order)

    def batches_left(self) -> int:
        """Batches this rank still gets in the current epoch."""
        return self.order.batches_left()

    @property
    def num_padded(self) -> int:
        """How many of this rank's samples per epoch only repeat other ranks' samples (the
        wrap-around padding of ``drop_last=False``, always the rank's last samples; 0 with
        ``drop_last=True``). :meth:`fastload.train.Trainer.evaluate` leaves them out, so every
        image counts once over all ranks."""
        return self.plan.num_padded()

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` (a no-op when it is the current one, so a resumed state holds)."""
        self.order.set_epoch(epoch)

    def state_dict(self) -> dict:
        """``{"order": {epoch, position, plan identity}}`` as of the last batch the caller received."""
        return {"order": self.order.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Continue right after the position in ``state`` (from this loader, a DALI loader or
        a prefetcher around either; any world size and batch size, same dataset and seed)."""
        self.order.load_state_dict(state, what="DataLoader")

    def stats(self) -> LoaderStats:
        """What happened so far: replaced corrupt records, batches copied, worker memory."""
        return LoaderStats(replaced=self._replaced_count, records=list(self._replaced), copied=self._copied,
                           worker_rss=dict(self.worker_rss))

    def _note_replaced(self, reps: list[Replacement] | None) -> None:
        if reps:
            self._replaced_count += len(reps)
            self._replaced.extend(reps)

    # -- iteration ----------------------------------------------------------------------------

    def __iter__(self) -> Iterator[tuple[Any, Any]]:
        if self.mode == "ring":
            return self._iter_ring()
        return self._iter_per_sample()

    def _ring(self) -> Ring:
        ring = self._state.get("ring")
        if ring is None:
            pin = None
            if self.pin_memory and _cuda_available():
                from ..gpu.pinning import pin_array as pin
            ring = Ring((self.batch_size, *self._image_shape), slots=self.ring_slots,
                        shared=self.num_workers > 0, pin=pin, directory=self.ring_dir)
            self._state["ring"] = ring
        return ring

    def _workers(self) -> Workers:
        workers = self._state.get("workers")
        if workers is None:
            workers = Workers(self.dataset, self.num_workers, (self.batch_size, *self._image_shape),
                              self.multiprocessing_context)
            self._state["workers"] = workers
        return workers

    def _wrap(self, ring: Ring, slot: int, n: int):
        """The batch in ``slot`` as tensors: a view of the slot, or a private copy when asked
        for or when the caller already holds ``ring_slots - prefetch`` batches."""
        import torch

        targets = torch.from_numpy(ring.targets[slot][:n].copy())
        copy = self.copy
        if not copy and ring.held >= self.ring_slots - self.prefetch:
            copy = True
            self._copied += 1
            if self._copied == 1:
                warnings.warn(
                    f"the caller holds {ring.held} fastload batches (ring_slots={self.ring_slots}, prefetch="
                    f"{self.prefetch}): further batches are copied out of the ring until some are released. "
                    "Keep fewer batches alive, or pass a larger ring_slots= (or copy=True)",
                    PerformanceWarning, stacklevel=3)
        if copy:
            out = torch.empty((n, *self._image_shape), dtype=torch.uint8,
                              pin_memory=self.pin_memory and _cuda_available())
            out.numpy()[...] = ring.images[slot][:n]
            ring.release(slot)
        else:
            out = torch.from_numpy(ring.lease(slot, n))
        return out.permute(0, 3, 1, 2), targets

    @property
    def _ahead(self) -> int:
        """How many batches ahead a remote dataset hears about (download-ahead)."""
        return 2 * self.prefetch

    def _announce(self, idx: np.ndarray, first: int, last: int) -> None:
        """Tell a Prefetching dataset which samples batches ``first .. last - 1`` will read."""
        if self._hint is not None and first < last:
            bs = self.batch_size
            self._hint(idx[first * bs : last * bs])

    def _iter_ring(self):
        order = self.order
        epoch, start, idx = order.begin()
        nb = order.batches_left() + start
        ring = self._ring()
        ahead = self._ahead
        self._announce(idx, start, min(nb, start + ahead))
        if self.num_workers == 0:
            for b in range(start, nb):
                if b + ahead < nb:
                    self._announce(idx, b + ahead, b + ahead + 1)
                bidx = order.batch(idx, b)
                slot = ring.acquire()
                try:
                    reps = self.dataset.fill_batch(bidx, ring.images[slot][: len(bidx)], ring.targets[slot][: len(bidx)],
                                                   epoch=epoch, seed=self.seed, on_error=self.on_error)
                except BaseException:
                    ring.release(slot)
                    raise
                self._note_replaced(reps)
                batch = self._wrap(ring, slot, len(bidx))
                order.advance(epoch, b)
                yield batch
            order.finish(epoch)
            return

        workers = self._workers()
        self._generation += 1
        gen = self._generation
        in_flight: set[int] = set()
        ready: dict[int, int] = {}
        send, want = start, start
        try:
            while want < nb:
                while send < nb and len(in_flight) + len(ready) < self.prefetch:
                    slot = ring.acquire()
                    if slot is None:  # every slot is in flight (maybe for an abandoned pass) or held
                        break
                    workers.tasks.put((gen, send, slot, ring.paths[slot], epoch, self.seed, self.on_error,
                                       order.batch(idx, send)))
                    in_flight.add(send)
                    self._outstanding += 1
                    if send + ahead < nb:
                        self._announce(idx, send + ahead, send + ahead + 1)
                    send += 1
                if want in ready:
                    slot = ready.pop(want)
                    batch = self._wrap(ring, slot, len(order.batch(idx, want)))
                    order.advance(epoch, want)
                    want += 1
                    yield batch
                    continue
                if self._outstanding == 0:  # pragma: no cover - _wrap's copies keep slots free
                    raise RuntimeError("fastload.DataLoader: no free ring slot and nothing in flight")
                try:
                    g, b, slot, err, reps, wid, rss = workers.results.get(timeout=1.0)
                except queue.Empty:
                    workers.check_alive()
                    continue
                self.worker_rss[wid] = rss
                self._outstanding -= 1
                if g != gen:  # left over from an iteration the caller abandoned: its slot is free again
                    ring.release(slot)
                    continue
                in_flight.discard(b)
                if err is not None:
                    ring.release(slot)
                    raise_worker_error(b, err)
                self._note_replaced(reps)
                ready[b] = slot
        finally:
            for slot in ready.values():
                ring.release(slot)
            # In-flight tasks finish in the background; their slots come back, tagged with an
            # old generation, on the next iteration.
        order.finish(epoch)

    def _torch_loader(self):
        """torch's DataLoader over this loader's batches, made once: its workers persist
        across epochs (keys carry the epoch for datasets that implement EpochDataset)."""
        loader = self._state.get("torch_loader")
        if loader is not None:
            return loader
        import torch
        from torch.utils.data import DataLoader as TorchDataLoader

        collate = self.collate_fn or collate_uint8
        dataset = self.dataset
        if isinstance(dataset, EpochDataset):
            dataset = _EpochItems(dataset, self.seed, self.on_error)
            collate = _CollateKeepingReplacements(collate)
        gen = torch.Generator()
        gen.manual_seed(self.seed)
        workers = self.num_workers
        loader = TorchDataLoader(
            dataset, batch_sampler=_Batches(), num_workers=workers,
            collate_fn=collate, pin_memory=self.pin_memory and _cuda_available(),
            generator=gen, multiprocessing_context=self.multiprocessing_context if workers else None,
            prefetch_factor=max(1, self.prefetch // workers) if workers else None,
            persistent_workers=workers > 0,
        )
        self._state["torch_loader"] = loader
        return loader

    def _iter_per_sample(self):
        order = self.order
        epoch, start, idx = order.begin()
        nb = order.batches_left() + start
        loader = self._torch_loader()
        batches = [order.batch(idx, b).tolist() for b in range(start, nb)]
        keeps_replacements = isinstance(loader.dataset, _EpochItems)
        if keeps_replacements:
            batches = [[(epoch, i) for i in b] for b in batches]
        loader.batch_sampler.batches = batches
        ahead = self._ahead
        self._announce(idx, start, min(nb, start + ahead))
        for b, batch in enumerate(loader, start):
            if b + ahead < nb:
                self._announce(idx, b + ahead, b + ahead + 1)
            if keeps_replacements:
                batch, reps = batch
                self._note_replaced(reps)
            order.advance(epoch, b)
            yield batch
        order.finish(epoch)

    def close(self) -> None:
        """Stop the workers and free the ring now (otherwise done at garbage collection/exit).
        Batches still held stay valid."""
        self._finalizer()

    def __enter__(self) -> DataLoader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"fastload.DataLoader({len(self.dataset)} samples, batch_size={self.batch_size}, "
            f"{len(self)} batches/epoch, rank {self.rank}/{self.world_size}, workers={self.num_workers}, "
            f"mode={self.mode})"
        )


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:  # pragma: no cover
        return False
