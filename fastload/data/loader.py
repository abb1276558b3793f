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
  images). Its workers persist across epochs, and with workers one torch iteration runs on
  from one epoch into the next (see below). A BatchFiller that cannot take the ring path
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
gets slower. ``copy=True`` always yields private copies. No batch holds a file descriptor: a
ring view is a slice of a mapping whose file was closed after mapping, a copy is private
memory, and the per-sample path's workers share batches with torch's ``file_system``
strategy (torch's default, ``file_descriptor``, keeps one descriptor open per tensor
received, so holding ~1,000 batches hit "Too many open files").

**Epoch boundaries** (``prefetch_next_epoch=True``, the default). With workers, the pipeline
does not drain at the end of an epoch: once epoch ``e``'s last batches are in flight, the ring
path sends epoch ``e + 1``'s first ones (from its start) under a generation of their own, in
free slots only and within ``prefetch``, and announces them to a remote dataset; the
per-sample path's batch sampler chains into the next epoch so torch's workers prefetch
across. The next iteration takes this work when it is the natural continuation (``e + 1``
from its start, same plan, seed and error policy) and drops it otherwise (:meth:`set_epoch`
to another epoch, :meth:`load_state_dict` elsewhere, a break mid-epoch): filled slots return
to the ring at once, in-flight ones when they come back. Replaced records are counted when
their batch reaches the caller, so :meth:`stats` and the batches are the same either way.

**Faults.** A worker that dies is named with its signal (:func:`.workers.describe_death`); one
that stops or hangs for ``timeout`` seconds (default 300) is named with the batch it holds,
and the workers are shut down. The ring's shared memory is removed on close, at exit, on
SIGTERM and, after a SIGKILL, by the next DataLoader that creates a ring (:mod:`.shm`).

Order and augmentation depend only on (seed, epoch, sample index), never on the worker, so
``num_workers=0`` and ``num_workers=2`` give identical batches.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import queue
import re
import signal
import time
import warnings
import weakref
from typing import Any, Callable, Iterator

import numpy as np

from ..checks import check_main_guard, resolve_distributed
from ..config import usable_cpus
from ..errors import PerformanceWarning  # defined with the errors (codecs warn too); exported here as before
from .collate import collate_uint8
from .order import Order
from .plan import EpochPlan, RankIndices
from .protocols import BatchFiller, EpochDataset, OnRecordError, Prefetching, Replacement, on_error_skips
from .ring import Ring, default_ring_base
from .shm import SharedMemoryFull, on_terminate, shm_free
from .workers import WorkerError, Workers, WorkerTimeout, describe_death, raise_worker_error

__all__ = ["DataLoader", "LoaderStats", "PerformanceWarning", "WorkerError", "WorkerTimeout"]

DEFAULT_TIMEOUT = 300.0  # seconds without a batch from the workers before a stuck one is named

RING_MARGIN = 4  # slots beyond ``prefetch`` that the caller may hold as views




class LoaderStats(dict):
    """``loader.stats()``: ``replaced`` (count) and ``records`` (the :class:`Replacement`s of
    corrupt records served as substitutes under ``on_error="skip"``), ``copied`` (batches
    copied out of the ring because the caller held too many) and ``worker_rss`` (bytes)."""


@dataclasses.dataclass(eq=False)
class _NextPass:
    """Epoch ``e + 1``'s first batches, sent to the workers once epoch ``e``'s pass has sent
    all of its own, so its first batch is filled while the caller still reads ``e``'s last
    ones. Its slots obey the ring's rule like any other: taken from the free ones, never a
    held batch's. The next pass adopts it when its :attr:`key` matches (the natural
    continuation), otherwise it is discarded like an abandoned pass."""

    key: tuple
    gen: int
    idx: RankIndices
    nb: int
    plan: EpochPlan
    sent: int = 0
    announced: int = 0  # next-epoch batches announced to a Prefetching dataset
    in_flight: set = dataclasses.field(default_factory=set)
    done: dict = dataclasses.field(default_factory=dict)  # batch -> (slot, err, replacements)

    @property
    def load(self) -> int:
        """Ring slots it holds for the workers (in flight or filled)."""
        return len(self.in_flight) + len(self.done)


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
    """A batch sampler the loader points at each pass (torch's persistent workers keep the
    DataLoader, and so its batch sampler, from one epoch to the next). It makes one batch's
    list at a time from the pass's lazy indices: an epoch starts without building N keys.
    With ``chain`` it goes on into the following epochs from their start, so torch's workers
    prefetch across the boundary (the loader takes exactly a pass's batches from it)."""

    def __init__(self):
        self.pass_: tuple = (None, None, 0, 0, 0, False, False)

    def set_pass(self, plan: EpochPlan, idx, first: int, end: int, epoch: int, *, keyed: bool,
                 chain: bool = False) -> None:
        """Batches ``first .. end - 1`` of ``idx`` (epoch ``epoch``), as keys ``(epoch, index)``
        when ``keyed``; then, with ``chain``, every following epoch's from its start."""
        self.pass_ = (plan, idx, first, end, epoch, keyed, chain)

    def __iter__(self):
        plan, idx, first, end, epoch, keyed, chain = self.pass_  # fixed when torch starts iterating
        while True:
            for b in range(first, end):
                batch = plan.batch(idx, b).tolist()
                yield [(epoch, i) for i in batch] if keyed else batch
            if not chain:
                return
            epoch += 1
            idx, first, end = plan.indices_view(epoch, 0), 0, plan.num_batches(0)

    def __len__(self) -> int:
        return self.pass_[3] - self.pass_[2]


def _file_system_sharing(worker_id: int) -> None:
    """torch worker init: send tensors by shared-memory file name, not by descriptor, so the
    main process keeps no descriptor per batch it holds (only the workers' strategy matters:
    the receiver rebuilds whatever kind it is sent; the user's own setting is untouched)."""
    import torch.multiprocessing

    torch.multiprocessing.set_sharing_strategy("file_system")


class _InSharedMemory:
    """Collate, then (in a worker) move the batch's tensors into shared memory right there:
    torch would otherwise do it while pickling, in a queue thread where a full ``/dev/shm``
    is an error nobody hears and the main process waits for the batch forever. Here it is an
    error of the batch, with the free space and what to do (no extra copy: torch skips
    tensors that are already shared)."""

    def __init__(self, collate_fn: Callable[[list], Any]):
        self.collate_fn = collate_fn

    def __call__(self, items: list) -> Any:
        batch = self.collate_fn(items)
        from torch.utils.data import get_worker_info

        if get_worker_info() is not None:
            try:
                _share(batch)
            except RuntimeError as exc:
                if "No space left" not in str(exc):
                    raise
                free = shm_free("/dev/shm")
                raise SharedMemoryFull(
                    f"/dev/shm is full ({(free or 0) / 2**20:,.1f} MB free): a batch of the per-sample path could not "
                    "be placed in shared memory to reach the main process: give the container more shared memory "
                    "(docker run --shm-size=...), lower batch_size or prefetch") from None
        return batch


def _share(obj: Any) -> None:
    import torch

    if isinstance(obj, torch.Tensor):
        obj.share_memory_()
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            _share(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            _share(o)


def _torch_workers(torch_loader) -> list:
    it = getattr(torch_loader, "_iterator", None)
    return list(getattr(it, "_workers", None) or [])


def _kill(state: dict) -> None:
    """On SIGTERM: SIGKILL every worker and remove the ring, touching no queue (the handler may
    have interrupted a ``put`` holding a queue's lock) and no torch shutdown protocol."""
    workers, ring = state.get("workers"), state.get("ring")
    if workers is not None:
        workers.kill()
    torch_loader = state.get("torch_loader")
    procs = _torch_workers(torch_loader) if torch_loader is not None else []
    if procs:  # torch's SIGCHLD handler would raise "worker killed" in the middle of this loop
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(timeout=5)
    if ring is not None:
        ring.close()


DRAIN_SECONDS = 5.0  # at close, how long to wait for batches torch's workers still owe


def _drain(it) -> None:
    """Receive (and drop) the batches torch's workers made that nobody took: the next epoch's
    first ones, or those of a pass broken off. Under the ``file_system`` sharing strategy each
    is a file in /dev/shm that only its receipt removes (else it stays until the process exits)."""
    deadline = time.monotonic() + DRAIN_SECONDS
    try:
        while getattr(it, "_tasks_outstanding", 0) > 0 and time.monotonic() < deadline:
            ok, _ = it._try_get_data(timeout=max(0.01, min(1.0, deadline - time.monotonic())))
            if ok:
                it._tasks_outstanding -= 1
    except Exception:  # noqa: BLE001 - a dead or stuck worker: the shutdown below ends it
        pass


def _shutdown(state: dict, drain: bool = False) -> None:
    """Stop the workers and free the ring; ``drain``: first take the batches torch's workers
    still owe (a healthy close, not after a worker failure)."""
    state.pop("torch_iter", None)
    unregister = state.pop("unregister", None)
    if unregister is not None:
        unregister()
    torch_loader = state.pop("torch_loader", None)
    if torch_loader is not None:
        procs = _torch_workers(torch_loader)
        it = getattr(torch_loader, "_iterator", None)
        if drain and it is not None and procs and all(p.is_alive() for p in procs):
            _drain(it)
        if it is not None and hasattr(it, "_shutdown_workers"):
            it._shutdown_workers()
        torch_loader._iterator = None
        for p in procs:  # torch terminates a stuck worker with SIGTERM, which a stopped one never acts on
            if p.is_alive():
                p.kill()
            p.join(timeout=5)
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
    substitute in its place and reports it in :meth:`stats`. ``timeout``: seconds to wait for
    the workers' next batch before raising :class:`WorkerTimeout` naming the worker, the epoch,
    the batch and its first record, and shutting the workers down (a stopped worker, a hung
    network filesystem); 0 or None waits forever. ``prefetch_next_epoch``: on the ring path
    with workers, once an epoch's last batches are in flight, start filling the next epoch's
    first ones (and announce them to a remote dataset), so the next iteration starts without
    waiting for a whole fill; the work is dropped if the next iteration is not the next epoch
    from its start (after :meth:`set_epoch` to another epoch or :meth:`load_state_dict`).
    Pass False for a loader that is iterated once.

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
        timeout: float | None = DEFAULT_TIMEOUT,
        prefetch_next_epoch: bool = True,
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
        self.timeout = float(timeout) if timeout else 0.0
        if self.timeout < 0:
            raise ValueError(f"timeout must be >= 0 seconds (0 or None: wait forever), got {timeout}")
        on_error_skips(on_error)  # the one check of the policy's value
        self.on_error = OnRecordError(on_error).value
        self.collate_fn = collate_fn
        self._context = multiprocessing_context
        self._check_main_guard()
        self._hint = dataset.prefetch if isinstance(dataset, Prefetching) else None
        if isinstance(dataset, Prefetching):  # before the workers copy the dataset
            dataset.hold_at_most(self.plan.open_shards)
        self.mode, self._image_shape = self._choose_path(dataset, collate_fn)
        self.prefetch_next_epoch = bool(prefetch_next_epoch)
        self._next: _NextPass | None = None  # the next epoch's first batches, filled ahead (ring path)
        self._generation = 0
        self._outstanding = 0  # tasks sent to workers whose results have not come back (any generation)
        self._state: dict = {}  # workers, ring, torch loader: shut down by the finalizer
        self._finalizer = weakref.finalize(self, _shutdown, self._state, True)
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
        self._drop_stale_next()

    def state_dict(self) -> dict:
        """``{"order": {epoch, position, plan identity}}`` as of the last batch the caller received."""
        return {"order": self.order.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Continue right after the position in ``state`` (from this loader, a DALI loader or
        a prefetcher around either; any world size and batch size, same dataset and seed)."""
        self.order.load_state_dict(state, what="DataLoader")
        self._drop_stale_next()

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

    def _on_terminate(self) -> None:
        """From the first worker or shared ring on: SIGTERM stops the workers and removes the ring."""
        if "unregister" not in self._state:
            self._state["unregister"] = on_terminate(functools.partial(_kill, self._state))

    def _ring(self) -> Ring:
        ring = self._state.get("ring")
        if ring is None:
            if self.num_workers > 0:
                self._on_terminate()
            pin = None
            if self.pin_memory and _cuda_available():
                from ..gpu.pinning import pin_array as pin
            ring = Ring((self.batch_size, *self._image_shape), slots=self.ring_slots,
                        shared=self.num_workers > 0, pin=pin, directory=self.ring_dir)
            self._state["ring"] = ring
        return ring

    @property
    def multiprocessing_context(self) -> str | None:
        """The start method for worker processes: the one given, else the dataset's (a remote
        pack's workers must not be forked from a process that has made object-store requests
        itself), else fork on Linux. Asked again whenever workers start."""
        return self._context or getattr(self.dataset, "worker_start_method", None)

    def _check_main_guard(self) -> None:
        """A spawned worker re-runs the main script: refuse one without a main guard (checked
        when the loader is made and again when workers start, as the method may change)."""
        if self.num_workers and self.multiprocessing_context in ("spawn", "forkserver"):
            check_main_guard("fastload.DataLoader")

    def _workers(self) -> Workers:
        workers = self._state.get("workers")
        if workers is None:
            self._check_main_guard()
            self._on_terminate()
            dirs = [d for d in (self.ring_dir or default_ring_base(), "/dev/shm") if d]
            workers = Workers(self.dataset, self.num_workers, (self.batch_size, *self._image_shape),
                              self.multiprocessing_context, shm_dirs=dirs)
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
        if self.num_workers == 0:
            self._announce(idx, start, min(nb, start + ahead))
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
        nxt, self._next = self._next, None
        if start >= nb:  # an empty pass (a state saved at the end of an epoch): the next one may still adopt
            self._next = nxt
            order.finish(epoch)
            return
        in_flight: set[int] = set()
        ready: dict[int, int] = {}
        want = start
        if nxt is not None and nxt.key == self._pass_key(epoch, start, order.start):
            gen, send, announced, done = nxt.gen, nxt.sent, nxt.announced, nxt.done  # the natural continuation
            in_flight = nxt.in_flight
        else:
            if nxt is not None:
                self._discard(nxt)
            self._generation += 1
            gen, send, announced, done = self._generation, start, start, {}
        nxt = None  # epoch + 1's first batches, once this pass has sent all of its own
        waiting_since = time.monotonic()

        def announce(front: int) -> None:
            """Announce what a remote dataset reads up to ``ahead`` batches past the send front
            (``front`` counts on into the next epoch's batches)."""
            nonlocal announced, nxt
            if announced < nb:
                self._announce(idx, announced, min(front + ahead, nb))
                announced = max(announced, min(front + ahead, nb))
            if front + ahead > nb and self._hint is not None and self.prefetch_next_epoch:
                nxt = nxt or self._next_pass(epoch)
                k = min(front + ahead - nb, nxt.nb)
                self._announce(nxt.idx, nxt.announced, k)
                nxt.announced = max(nxt.announced, k)

        def top_up() -> None:
            """Send tasks while fewer than ``prefetch`` are the workers' (in flight or filled):
            this pass's, then the next epoch's first ones."""
            nonlocal send, nxt
            while len(in_flight) + len(ready) + (nxt.load if nxt is not None else 0) < self.prefetch:
                if send < nb:
                    slot = ring.acquire()
                    if slot is None:  # every slot is in flight (maybe for an abandoned pass) or held
                        return
                    workers.tasks.put((gen, send, slot, ring.paths[slot], epoch, self.seed, self.on_error,
                                       order.batch(idx, send)))
                    in_flight.add(send)
                    send += 1
                    announce(send)
                elif self.prefetch_next_epoch:
                    nxt = nxt or self._next_pass(epoch)
                    if nxt.sent >= nxt.nb:
                        return
                    slot = ring.acquire()
                    if slot is None:
                        return
                    workers.tasks.put((nxt.gen, nxt.sent, slot, ring.paths[slot], epoch + 1, self.seed,
                                       self.on_error, order.batch(nxt.idx, nxt.sent)))
                    nxt.in_flight.add(nxt.sent)
                    nxt.sent += 1
                    announce(nb + nxt.sent)
                else:
                    return
                self._outstanding += 1

        def receive(b: int, slot: int, err, reps) -> None:
            in_flight.discard(b)
            if err is not None:
                ring.release(slot)
                raise_worker_error(b, err)
            self._note_replaced(reps)
            ready[b] = slot

        try:
            announce(send)
            for b in sorted(done):  # batches filled ahead, at the end of the previous epoch
                receive(b, *done.pop(b))
            while want < nb:
                top_up()
                if want in ready:
                    slot = ready.pop(want)
                    batch = self._wrap(ring, slot, len(order.batch(idx, want)))
                    order.advance(epoch, want)
                    want += 1
                    if want == nb:  # the last batch: its slot no longer counts, send the next epoch's now
                        top_up()
                        self._next = nxt  # kept for the next pass, which adopts or drops it
                    yield batch
                    waiting_since = time.monotonic()
                    continue
                if self._outstanding == 0:  # pragma: no cover - _wrap's copies keep slots free
                    raise RuntimeError("fastload.DataLoader: no free ring slot and nothing in flight")
                try:
                    g, b, slot, err, reps, wid, rss = workers.results.get(timeout=1.0)
                except queue.Empty:
                    try:
                        workers.check_alive()
                    except WorkerError as exc:
                        self._stop_workers(kill=())
                        raise WorkerError(f"{exc}; while reading batch {want} of epoch {epoch}"
                                          f"{self._first_record(idx, want)}") from None
                    if self.timeout and time.monotonic() - waiting_since > self.timeout:
                        self._timed_out(workers, gen, want, epoch, idx, nxt)
                    continue
                waiting_since = time.monotonic()
                self.worker_rss[wid] = rss
                self._outstanding -= 1
                if nxt is not None and g == nxt.gen:  # the next epoch's, filled ahead: kept for it
                    nxt.in_flight.discard(b)
                    nxt.done[b] = (slot, err, reps)
                elif g != gen:  # left over from an iteration the caller abandoned: its slot is free again
                    ring.release(slot)
                else:
                    receive(b, slot, err, reps)
        finally:
            for slot in ready.values():
                ring.release(slot)
            # In-flight tasks finish in the background; their slots come back, tagged with an
            # old generation, on the next iteration.
            if self._next is not nxt and nxt is not None:  # abandoned (or failed) before its end
                self._discard(nxt)
        order.finish(epoch)

    def _pass_key(self, epoch: int, batch: int, start: int) -> tuple:
        """What decides a pass's batches: work sent ahead for a pass with another key is dropped
        (the plan by identity: a :class:`_NextPass` keeps its plan alive, so the id stays its own)."""
        return (epoch, batch, start, id(self.plan), self.seed, self.on_error)

    def _next_pass(self, epoch: int) -> _NextPass:
        """The pass that naturally follows ``epoch``'s: ``epoch + 1`` from its start, under a
        generation of its own (its results are told apart from this pass's)."""
        self._generation += 1
        plan = self.plan
        return _NextPass(key=self._pass_key(epoch + 1, 0, 0), gen=self._generation,
                         idx=plan.indices_view(epoch + 1, 0), nb=plan.num_batches(0), plan=plan)

    def _discard(self, nxt: _NextPass) -> None:
        """Drop work sent ahead for a pass that did not come: its filled slots go back to the
        ring now, its in-flight ones when they arrive (their generation is stale)."""
        ring = self._state.get("ring")
        if ring is not None:
            for slot, _, _ in nxt.done.values():
                ring.release(slot)
        nxt.done.clear()

    def _drop_stale_next(self) -> None:
        """After set_epoch/load_state_dict: drop the next epoch's work unless it is still what comes next."""
        nxt = self._next
        if nxt is None:
            return
        order = self.order
        at_end = order.batches_left() == 0  # an empty pass, then epoch + 1 from its start
        if at_end:
            key = self._pass_key(order.epoch + 1, 0, 0)
        else:
            key = self._pass_key(order.epoch, order.batches, order.start)
        if key != nxt.key:
            self._next = None
            self._discard(nxt)

    def _first_record(self, idx: np.ndarray, b: int) -> str:
        rec = self.order.batch(idx, b)
        return f" (first record index {int(rec[0])})" if len(rec) else ""

    def _stop_workers(self, kill) -> None:
        """Drop the workers (``kill``: these first, with SIGKILL) and the ring: the next
        iteration starts afresh. Batches the caller holds stay valid."""
        workers, ring = self._state.pop("workers", None), self._state.pop("ring", None)
        if workers is not None:
            for w in kill:
                if workers.procs[w].is_alive():
                    workers.procs[w].kill()
            workers.shutdown()
        if ring is not None:
            ring.close()
        self._outstanding = 0
        self._next = None

    def _timed_out(self, workers: Workers, gen: int, b: int, epoch: int, idx: np.ndarray,
                   nxt: _NextPass | None = None) -> None:
        w = workers.filling(gen, b)
        stuck = [w] if w is not None else workers.busy_workers()
        if stuck:
            k = stuck[0]
            holds = int(workers.busy[2 * k + 1])
            if nxt is not None and int(workers.busy[2 * k]) == nxt.gen:  # a batch of the next epoch, sent ahead
                epoch, idx = epoch + 1, nxt.idx
            what = (f"worker {k} (pid {workers.procs[k].pid}) has not finished batch {holds} of epoch {epoch}"
                    f"{self._first_record(idx, holds)}")
        else:  # stopped while taking a task: it holds the queue, so nobody picks the batch up
            pids = ", ".join(str(p.pid) for p in workers.procs)
            what = f"workers (pids {pids}) have not picked up batch {b} of epoch {epoch}{self._first_record(idx, b)}"
        self._stop_workers(kill=stuck)
        raise WorkerTimeout(
            f"DataLoader {what} in {self.timeout:g} s: stopped, or stuck (a hung network filesystem?); "
            "the workers were shut down. Pass a larger timeout= (0 waits forever) if batches are this slow"
        )

    def _torch_loader(self):
        """torch's DataLoader over this loader's batches, made once: its workers persist
        across epochs (keys carry the epoch for datasets that implement EpochDataset)."""
        loader = self._state.get("torch_loader")
        if loader is not None:
            return loader
        if self.num_workers > 0:
            self._check_main_guard()
            self._on_terminate()
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
        if workers:
            collate = _InSharedMemory(collate)
        loader = TorchDataLoader(
            dataset, batch_sampler=_Batches(), num_workers=workers,
            collate_fn=collate, pin_memory=self.pin_memory and _cuda_available(),
            generator=gen, multiprocessing_context=self.multiprocessing_context if workers else None,
            prefetch_factor=max(1, self.prefetch // workers) if workers else None,
            persistent_workers=workers > 0, timeout=self.timeout if workers else 0,
            worker_init_fn=_file_system_sharing if workers else None,
        )
        self._state["torch_loader"] = loader
        return loader

    def _iter_per_sample(self):
        order = self.order
        epoch, start, idx = order.begin()
        nb = order.batches_left() + start
        loader = self._torch_loader()
        if start >= nb:  # an empty pass (a state saved at the end of an epoch): the next one may continue
            order.finish(epoch)
            return
        keeps_replacements = isinstance(loader.dataset, _EpochItems)
        # With workers, one torch iteration runs on across epochs (its sampler chains them), so its
        # workers prefetch the next epoch's first batches; it is continued while each pass is the
        # natural continuation of the batches taken from it, and restarted otherwise.
        chain = self.prefetch_next_epoch and self.num_workers > 0
        running = self._state.pop("torch_iter", None)
        it = None
        if (running is not None and running[0] is getattr(loader, "_iterator", None)
                and running[1] == self._pass_key(epoch, start, order.start)):
            it = running[0]
        else:
            loader.batch_sampler.set_pass(self.plan, idx, start, nb, epoch, keyed=keeps_replacements, chain=chain)
        ahead = self._ahead
        # With the chained iteration, the workers read the next epoch's first batches before
        # this one ends: a remote dataset hears of them as it would of this epoch's (once).
        told = self._state.pop("torch_told", None)
        told = told[1] if it is not None and told is not None and told[0] == (epoch, start) else start
        self._announce(idx, told, min(nb, start + ahead))
        following = self.plan.indices_view(epoch + 1, 0) if chain and self._hint is not None else None
        try:
            for b, batch in enumerate(self._torch_batches(loader, epoch, start, idx, it, nb - start), start):
                if b + ahead < nb:
                    self._announce(idx, b + ahead, b + ahead + 1)
                elif following is not None and b + ahead - nb < self.plan.num_batches(0):
                    self._announce(following, b + ahead - nb, b + ahead - nb + 1)
                    self._state["torch_told"] = ((epoch + 1, 0), b + ahead - nb + 1)
                if keeps_replacements:
                    batch, reps = batch
                    self._note_replaced(reps)
                order.advance(epoch, b)
                if chain:  # where the torch iteration stands: a pass that starts there continues it
                    at = self._pass_key(epoch, b + 1, order.start) if b + 1 < nb else self._pass_key(epoch + 1, 0, 0)
                    self._state["torch_iter"] = (loader._iterator, at)
                yield batch
        except GeneratorExit:  # the caller broke out: the iteration stays where it stands
            raise
        except BaseException:  # a failed (or interrupted) torch iteration is never continued
            self._state.pop("torch_iter", None)
            raise
        order.finish(epoch)

    def _torch_batches(self, loader, epoch: int, start: int, idx: np.ndarray, it=None, count: int | None = None):
        """``count`` of torch's batches (from ``it``, else a new iteration), with its worker
        failures turned into one-line errors that name the batch (and the workers shut down,
        so a retry starts afresh)."""
        it = iter(loader) if it is None else it
        b = start
        while count is None or b - start < count:
            try:
                batch = next(it)
            except StopIteration:
                return
            except SharedMemoryFull as exc:  # torch re-raises it with the worker's traceback in the message
                last = str(exc).strip().splitlines()[-1]
                _shutdown({"torch_loader": self._state.pop("torch_loader", None)})
                raise SharedMemoryFull(f"{last.split(': ', 1)[-1]}; while reading batch {b} of epoch {epoch}"
                                       f"{self._first_record(idx, b)}") from None
            except RuntimeError as exc:
                raise self._torch_failure(exc, loader, epoch, b, idx) from None
            yield batch
            b += 1

    def _torch_failure(self, exc: RuntimeError, loader, epoch: int, b: int, idx: np.ndarray) -> Exception:
        msg = str(exc)
        where = f"batch {b} of epoch {epoch}{self._first_record(idx, b)}"
        procs = _torch_workers(loader)
        if msg.startswith("DataLoader timed out"):
            pids = ", ".join(str(p.pid) for p in procs)
            err: Exception = WorkerTimeout(
                f"DataLoader workers (pids {pids}) returned no batch in {self.timeout:g} s while reading {where}: "
                "one is stopped, or stuck (a hung network filesystem?); the workers were shut down. "
                "Pass a larger timeout= (0 waits forever) if batches are this slow")
        elif msg.startswith("DataLoader worker (pid"):  # not "Caught ... in DataLoader worker process": a dataset error
            dirs = [d for d in (default_ring_base(), "/dev/shm") if d]
            m = re.search(r"pid\(?s?\)? ?(\d+)", msg)
            dead = [p for p in procs if m is None or p.pid == int(m.group(1))]
            dead = [p for p in dead if not p.is_alive()] or dead
            why = describe_death(dead[0].exitcode, dirs) if dead else msg.splitlines()[0]
            pid = dead[0].pid if dead else "?"
            err = WorkerError(f"DataLoader worker (pid {pid}) {why}; while reading {where}")
        else:
            return exc
        state = {"torch_loader": self._state.pop("torch_loader", None)}
        _shutdown(state)
        return err

    def close(self) -> None:
        """Stop the workers and free the ring now (otherwise done at garbage collection/exit).
        Batches still held stay valid."""
        self._next = None
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
