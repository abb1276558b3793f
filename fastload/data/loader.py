"""``fastload.DataLoader``: whole uint8 batches from persistent workers through a shared-memory ring.

Two paths, chosen from the dataset:

* **ring** (a fastload ImageFolder whose output size is fixed: a planned transform such as
  RandomResizedCrop, or a fixed-size pack without transform): persistent worker processes
  each build a whole batch per task, decoding every record and resizing its crop straight
  into its slot of a preallocated NHWC uint8 buffer in ``/dev/shm``; only the slot number
  travels back. The batch comes out as an N x C x H x W tensor in ``channels_last`` memory
  format over that buffer: no allocation, no copy, no ``torch.stack``.
* **per-sample** (any other map-style Dataset, including a user's own returning
  ``(array | tensor | PIL image, label)``): ``torch.utils.data.DataLoader`` with this
  loader's sampler and :func:`~fastload.data.collate.collate_uint8` (same uint8 batch format;
  ``default_collate`` when items are not images). Its workers persist across epochs; a
  dataset with ``set_epoch`` (a fastload ImageFolder) receives each sample's epoch with its
  index.

**Processes, not threads.** OpenCV and simplejpeg release the GIL, so threads in the main
process could fill the ring too; benchmarks/bench_loader.py measures that (its "threads"
rows). On the 2-core development machine, under load, at 1,000 images, 2 threads filling
batches with no consumer reached 89-99% of the 2-process loader. The per-sample Python
around each decode holds the GIL and would compete with the training loop, and processes
isolate crashes, so workers are processes.

**Slot lifetime.** A yielded image tensor is a view of a ring slot. The slot goes back to the
ring only when every tensor viewing it (the batch, its slices, ...) has been garbage
collected, so holding on to batches is always safe: the ring then grows by a slot instead of
overwriting one. ``copy=True`` yields a private copy instead and recycles the slot at once.
Targets are always a small private tensor.

Order and augmentation depend only on (seed, epoch, sample index), never on the worker, so
``num_workers=0`` and ``num_workers=2`` give identical batches. ``state_dict()`` counts the
batches handed to the caller; ``load_state_dict()`` resumes right after them.
"""

from __future__ import annotations

import collections
import functools
import mmap
import multiprocessing as mp
import os
import queue
import shutil
import signal
import sys
import tempfile
import traceback
import warnings
import weakref
from typing import Any, Callable, Iterator

import numpy as np

from ..config import usable_cpus
from ..errors import DecodeError, FastloadError, FormatError
from .collate import collate_uint8
from .position import EpochPosition
from .sampler import DistributedEpochSampler, padded_per_rank

__all__ = ["DataLoader", "WorkerError"]


class WorkerError(FastloadError):
    """A worker failed on a batch; the message (one line, so the CLI can print it as is)
    names the batch, and the record and shard when the dataset's error did (decode and format
    errors keep their own class). The worker's traceback is in :attr:`worker_traceback` and
    in the exception's notes, which Python prints with an uncaught traceback."""

    worker_traceback: str = ""


def _resolve_distributed(distributed) -> tuple[int, int]:
    if distributed is False:
        return 0, 1
    if distributed is None or distributed is True:
        try:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                return dist.get_rank(), dist.get_world_size()
        except ImportError:  # pragma: no cover
            pass
        if distributed is True:
            raise ValueError("distributed=True but torch.distributed is not initialised")
        return 0, 1
    try:
        rank, world = (int(x) for x in distributed)
    except (TypeError, ValueError):
        raise ValueError(f"distributed must be None, a bool or (rank, world_size), got {distributed!r}") from None
    if not 0 <= rank < world:
        raise ValueError(f"distributed=(rank, world_size) needs 0 <= rank < world_size, got {distributed!r}")
    return rank, world


def _read_rss() -> int:
    """This process's resident set size in bytes (from /proc; 0 where unavailable)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):  # pragma: no cover
        return 0


# -- the ring of batch slots ----------------------------------------------------------------


def _slot_layout(batch_shape: tuple[int, ...]) -> tuple[int, int]:
    """(image bytes rounded up to 64, total bytes) of one slot: images, then int64 targets."""
    img = int(np.prod(batch_shape))
    img_aligned = -(-img // 64) * 64
    return img_aligned, img_aligned + 8 * batch_shape[0]


def _map_slot(path: str, batch_shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    img_bytes, total = _slot_layout(batch_shape)
    with open(path, "r+b") as f:
        mm = mmap.mmap(f.fileno(), total)
    images = np.frombuffer(mm, dtype=np.uint8, count=int(np.prod(batch_shape))).reshape(batch_shape)
    targets = np.frombuffer(mm, dtype=np.int64, count=batch_shape[0], offset=img_bytes)
    return images, targets


class _SlotPool:
    """Batch buffers: files in a private /dev/shm directory (or plain arrays for
    ``num_workers=0``), created on demand and recycled when no tensor views them any more."""

    def __init__(self, batch_shape: tuple[int, ...], *, shared: bool, pin: bool):
        self.batch_shape = tuple(int(s) for s in batch_shape)
        self.shared = shared
        self.pin = pin
        self.dir: str | None = None
        if shared:
            base = "/dev/shm" if os.path.isdir("/dev/shm") else None
            self.dir = tempfile.mkdtemp(prefix="fastload-ring-", dir=base)
        self.paths: list[str] = []
        self.images: list[np.ndarray] = []
        self.targets: list[np.ndarray] = []
        self.free: collections.deque[int] = collections.deque()
        self.closed = False

    def __len__(self) -> int:
        return len(self.images)

    def acquire(self) -> int:
        if self.closed:
            raise ValueError("the DataLoader was closed")
        if self.free:
            return self.free.popleft()
        k = len(self.images)
        if self.shared:
            path = os.path.join(self.dir, f"slot-{k:04d}")
            with open(path, "wb") as f:
                f.truncate(_slot_layout(self.batch_shape)[1])
            images, targets = _map_slot(path, self.batch_shape)
        else:
            path = ""
            images = np.empty(self.batch_shape, dtype=np.uint8)
            targets = np.empty(self.batch_shape[0], dtype=np.int64)
        if self.pin:
            images = _pin(images)
        self.paths.append(path)
        self.images.append(images)
        self.targets.append(targets)
        return k

    def release(self, k: int) -> None:
        if not self.closed:
            self.free.append(k)

    def close(self) -> None:
        """Delete the ring's files and drop the pool's own references to its slots: a slot that
        no batch views is unpinned and unmapped now, one a held batch views when that batch dies."""
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None
        self.closed = True
        self.free.clear()
        self.images.clear()
        self.targets.clear()
        self.paths.clear()


class _ReleasedLast:
    """Owner of an array's memory that runs ``release`` once, just before the memory can go.

    ``np.asarray(owner)`` is an array over ``a``'s memory whose views (numpy or torch) all keep
    the owner alive, and the owner keeps ``a`` (and so an mmap under it) alive. When the last
    view dies, the owner's weakref callback runs before its attributes are cleared: ``release``
    sees the memory still mapped, and only afterwards can ``a``, and then the mapping, go.
    """

    def __init__(self, a: np.ndarray, release: Callable[[], None]):
        if not a.flags.c_contiguous:
            raise ValueError("_ReleasedLast needs a C-contiguous array")
        self.a = a
        self.__array_interface__ = {
            "shape": a.shape, "typestr": a.dtype.str, "data": (a.ctypes.data, False), "version": 3,
        }
        self.release = weakref.finalize(self, release)
        # At interpreter exit the process and its mappings end anyway; do not call into a
        # runtime that may be shutting down.
        self.release.atexit = False


def _pin(a: np.ndarray) -> np.ndarray:
    """Page-lock a slot for fast, asynchronous host-to-GPU copies (cudaHostRegister).

    Returns an array over the same memory that unregisters it (cudaHostUnregister on the same
    pointer) when its last view dies, before the memory is unmapped or freed: registered memory
    that is unmapped stays in the driver's table, and a later mapping at the same address then
    fails to register. Without CUDA, returns ``a`` unchanged. If the driver refuses (a memlock
    limit, a container without the right), warns and returns ``a``: copies from pageable
    memory are slower but correct.
    """
    import torch

    if not torch.cuda.is_available():
        return a
    ptr = a.ctypes.data
    err = int(torch.cuda.cudart().cudaHostRegister(ptr, a.nbytes, 0))
    if err != 0:  # pragma: no cover - needs a GPU (tests/test_loader.py::test_failed_pin_* runs it there)
        _drain_cuda_error()
        # Python's default warning filter shows this once, not once per slot.
        warnings.warn(f"cudaHostRegister of a {a.nbytes}-byte batch slot failed (CUDA error {err}); batches "
                      "stay in pageable memory, so host-to-GPU copies are slower and not asynchronous",
                      RuntimeWarning, stacklevel=2)
        return a
    return np.asarray(_ReleasedLast(a, functools.partial(_unpin, ptr, os.getpid())))


def _unpin(ptr: int, pid: int) -> None:
    """cudaHostUnregister ``ptr`` (in the process that registered it; a forked child must not
    touch CUDA). A failure is drained and otherwise ignored: nothing could be done about it here."""
    if os.getpid() != pid:  # pragma: no cover - defensive
        return
    import torch

    if int(torch.cuda.cudart().cudaHostUnregister(ptr)) != 0:  # pragma: no cover - needs a GPU
        _drain_cuda_error()


def _cudart_paths(maps_lines) -> list[str]:
    """The distinct CUDA runtime libraries mapped into this process, from /proc/self/maps lines
    (pip wheels name them libcudart.so.12, some torch builds libcudart-<hash>.so.12)."""
    paths = []
    for line in maps_lines:
        fields = line.split(maxsplit=5)
        if len(fields) < 6:
            continue
        path = fields[5].strip().removesuffix(" (deleted)")
        if os.path.basename(path).startswith("libcudart") and ".so" in path and path not in paths:
            paths.append(path)
    return paths


def _drain_cuda_error() -> None:
    """Reset the CUDA runtime's pending "last error" after a failed cudart call we handle.

    A failed cudaHostRegister/Unregister leaves its code pending, and torch's next
    kernel-launch check (``cudaGetLastError``) would raise it from an unrelated operation.
    torch's cudart binding has no cudaGetLastError, so call it through ctypes in every
    libcudart this process has mapped (each library instance keeps its own error state;
    dlopen of a mapped path returns that instance)."""
    import ctypes

    try:
        with open("/proc/self/maps") as f:
            paths = _cudart_paths(f)
    except OSError:  # pragma: no cover - not Linux
        return
    for path in paths:
        try:
            ctypes.CDLL(path).cudaGetLastError()
        except (OSError, AttributeError):  # pragma: no cover - defensive
            pass


# -- worker processes ---------------------------------------------------------------------


def _worker_loop(wid: int, dataset, tasks, results, batch_shape, parent: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's to handle
    maps: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    while True:
        try:
            task = tasks.get(timeout=2.0)
        except queue.Empty:
            if os.getppid() != parent:  # the main process died: do not linger
                return
            continue
        if task is None:
            return
        gen, b, slot, path, epoch, seed, indices = task
        try:
            if slot not in maps:
                maps[slot] = _map_slot(path, batch_shape)
            images, targets = maps[slot]
            n = len(indices)
            dataset.fill_batch(indices, images[:n], targets[:n], epoch=epoch, seed=seed)
            err = None
        except BaseException as exc:  # noqa: BLE001 - everything must reach the main process
            err = (type(exc).__name__, str(exc), traceback.format_exc(limit=6))
        results.put((gen, b, slot, err, wid, _read_rss()))


class _Workers:
    """The persistent worker processes and their queues (kept apart from the DataLoader so
    a finalizer can shut them down without keeping the loader alive)."""

    def __init__(self, dataset, n: int, batch_shape, context: str | None):
        ctx = mp.get_context(context or ("fork" if sys.platform.startswith("linux") else "spawn"))
        self.tasks = ctx.Queue()
        self.results = ctx.Queue()
        self.procs = []
        parent = os.getpid()
        for w in range(n):
            p = ctx.Process(
                target=_worker_loop, args=(w, dataset, self.tasks, self.results, batch_shape, parent),
                name=f"fastload-worker-{w}", daemon=True,
            )
            p.start()
            self.procs.append(p)

    def check_alive(self) -> None:
        for w, p in enumerate(self.procs):
            if not p.is_alive():
                raise WorkerError(
                    f"DataLoader worker {w} (pid {p.pid}) exited unexpectedly with code {p.exitcode} "
                    "(killed by the OOM killer or a signal?)"
                )

    def shutdown(self) -> None:
        for _ in self.procs:
            try:
                self.tasks.put(None)
            except (OSError, ValueError):  # pragma: no cover
                pass
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():  # pragma: no cover - a worker stuck in C code
                p.terminate()
                p.join(timeout=2)
        for q in (self.tasks, self.results):
            q.close()
            q.join_thread()
        self.procs = []


class _EpochItems:
    """The dataset as the per-sample path's workers see it: keys arrive as ``(epoch, index)``,
    so persistent workers augment for the right epoch without being restarted."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key):
        epoch, i = key
        if getattr(self.dataset, "epoch", None) != epoch:
            self.dataset.set_epoch(epoch)
        return self.dataset[i]


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
    workers, pool = state.pop("workers", None), state.pop("pool", None)
    if workers is not None:
        workers.shutdown()
    if pool is not None:
        pool.close()


def _raise_worker_error(b: int, err: tuple[str, str, str]) -> None:
    name, msg, tb = err
    cls = {"DecodeError": DecodeError, "FormatError": FormatError}.get(name)
    if cls is not None:
        raise cls(msg)
    first = msg.strip().splitlines()[0] if msg.strip() else ""
    exc = WorkerError(f"batch {b}: {name}: {first}" if first else f"batch {b}: {name}")
    exc.worker_traceback = tb
    if hasattr(exc, "add_note"):  # Python >= 3.11
        exc.add_note(f"--- worker traceback ---\n{tb}")
    raise exc


# -- the loader ---------------------------------------------------------------------------


class DataLoader:
    """Batches of ``(uint8 images N x C x H x W, int64 targets)`` from a map-style dataset.

    ``shuffle``/``seed``: a full reshuffle per epoch seeded by ``seed + epoch``; the same seed
    gives the same batches and augmentations for any ``num_workers``. ``drop_last``: drop the
    samples that do not divide evenly over the ranks and the last incomplete batch (otherwise
    the ranks are padded by wrapping around, see :mod:`fastload.data.sampler`).
    ``num_workers``: worker processes (default: one per core; 0 = in the calling process).
    ``distributed``: None reads rank and world size from ``torch.distributed`` when it is
    initialised; ``(rank, world_size)`` sets them. ``pin_memory``: page-lock the batch slots
    (default: when CUDA is available). ``prefetch``: batches in flight (default 2 per worker).
    ``copy``: yield private copies instead of ring-slot views (see the module docstring).

    Iterating again without :meth:`set_epoch` moves on to the next epoch.
    """

    def __init__(
        self,
        dataset,
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        num_workers: int | None = None,
        distributed=None,
        pin_memory: bool | None = None,
        prefetch: int | None = None,
        copy: bool = False,
        collate_fn: Callable[[list], Any] | None = None,
        multiprocessing_context: str | None = None,
    ):
        if int(batch_size) < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.dataset = dataset
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        self.num_workers = usable_cpus() if num_workers is None else int(num_workers)
        if self.num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        self.rank, self.world_size = _resolve_distributed(distributed)
        if pin_memory is None:
            pin_memory = _cuda_available()
        self.pin_memory = bool(pin_memory)
        self.prefetch = int(prefetch) if prefetch is not None else 2 * max(1, self.num_workers)
        if self.prefetch < 1:
            raise ValueError(f"prefetch must be >= 1, got {prefetch}")
        self.copy = bool(copy)
        self.collate_fn = collate_fn
        self.multiprocessing_context = multiprocessing_context
        self.sampler = DistributedEpochSampler(
            len(dataset), seed=self.seed, shuffle=shuffle, rank=self.rank,
            world_size=self.world_size, drop_last=self.drop_last,
        )
        self._pos = EpochPosition()  # the epoch, and batches of it handed to the caller
        self._generation = 0
        shape = None
        if collate_fn is None and hasattr(dataset, "fill_batch") and hasattr(dataset, "batch_image_shape"):
            shape = dataset.batch_image_shape()
        self.mode = "ring" if shape is not None else "per-sample"
        self._image_shape = tuple(shape) if shape is not None else None
        self._state: dict = {}  # workers + pool, shut down by the finalizer
        self._finalizer = weakref.finalize(self, _shutdown, self._state)
        self.worker_rss: dict[int, int] = {}  # last resident size each worker reported (bytes)

    # -- epochs, length, resume -------------------------------------------------------------

    @property
    def epoch(self) -> int:
        return self._pos.epoch

    def __len__(self) -> int:
        per_rank = len(self.sampler)
        return per_rank // self.batch_size if self.drop_last else -(-per_rank // self.batch_size)

    @property
    def num_padded(self) -> int:
        """How many of this rank's samples per epoch only repeat other ranks' samples.

        With ``drop_last=False`` under DDP every rank is padded to the same count by wrapping
        around (see :mod:`fastload.data.sampler`), so a rank may get one sample that another
        rank also gets (more only when the dataset is smaller than the world). The padding is
        always the last samples of the rank's epoch: leaving out the final ``num_padded``
        samples of a full pass counts every image exactly once over all ranks, while every
        rank still runs the same number of batches. :meth:`fastload.train.Trainer.evaluate`
        does that. 0 with ``drop_last=True`` (nothing is repeated; the remainder is dropped).
        """
        return padded_per_rank(len(self.dataset), rank=self.rank, world_size=self.world_size,
                               drop_last=self.drop_last)

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` (a no-op when it is the current one, so a resumed state holds)."""
        self._pos.set_epoch(epoch)

    def _identity(self) -> dict:
        return {
            "seed": self.seed, "batch_size": self.batch_size, "num_samples": len(self.dataset),
            "world_size": self.world_size, "rank": self.rank, "shuffle": self.sampler.shuffle,
            "drop_last": self.drop_last,
        }

    def state_dict(self) -> dict:
        """Where the caller is: epoch and batches consumed in it (plus what must not change)."""
        return self._pos.state_dict(num_batches=len(self), identity=self._identity())

    def load_state_dict(self, state: dict) -> None:
        """Continue exactly after the batches recorded in ``state``."""
        self._pos.load_state_dict(state, num_batches=len(self), identity=self._identity(), what="DataLoader")

    # -- iteration ----------------------------------------------------------------------------

    def _batch_indices(self, idx: np.ndarray, b: int) -> np.ndarray:
        return idx[b * self.batch_size : (b + 1) * self.batch_size]

    def __iter__(self) -> Iterator[tuple[Any, Any]]:
        if self.mode == "ring":
            return self._iter_ring()
        return self._iter_per_sample()

    def _finish_epoch(self, epoch: int) -> None:
        if self._pos.epoch == epoch:
            self._pos.next_epoch()

    def _pool(self) -> _SlotPool:
        pool = self._state.get("pool")
        if pool is None:
            shape = (self.batch_size, *self._image_shape)
            pool = _SlotPool(shape, shared=self.num_workers > 0, pin=self.pin_memory)
            self._state["pool"] = pool
        return pool

    def _workers(self) -> _Workers:
        workers = self._state.get("workers")
        if workers is None:
            workers = _Workers(self.dataset, self.num_workers, (self.batch_size, *self._image_shape),
                               self.multiprocessing_context)
            self._state["workers"] = workers
        return workers

    def _wrap(self, pool: _SlotPool, slot: int, n: int):
        import torch

        images = pool.images[slot][:n]
        targets = torch.from_numpy(pool.targets[slot][:n].copy())
        if self.copy:
            out = torch.empty(images.shape, dtype=torch.uint8, pin_memory=self.pin_memory and _cuda_available())
            out.numpy()[...] = images
            pool.release(slot)
        else:
            lease = images.view()  # a fresh array object: it dies when the last tensor over it does
            weakref.finalize(lease, pool.release, slot)
            out = torch.from_numpy(lease)
        return out.permute(0, 3, 1, 2), targets

    def _iter_ring(self):
        epoch, start = self._pos.epoch, self._pos.batches
        idx = self.sampler.indices(epoch)
        nb = len(self)
        pool = self._pool()
        if self.num_workers == 0:
            for b in range(start, nb):
                bidx = self._batch_indices(idx, b)
                slot = pool.acquire()
                try:
                    self.dataset.fill_batch(bidx, pool.images[slot][: len(bidx)], pool.targets[slot][: len(bidx)],
                                            epoch=epoch, seed=self.seed)
                except BaseException:
                    pool.release(slot)
                    raise
                batch = self._wrap(pool, slot, len(bidx))
                self._pos.batches = b + 1
                yield batch
            self._finish_epoch(epoch)
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
                    slot = pool.acquire()
                    workers.tasks.put((gen, send, slot, pool.paths[slot], epoch, self.seed,
                                       self._batch_indices(idx, send)))
                    in_flight.add(send)
                    send += 1
                while want not in ready:
                    try:
                        g, b, slot, err, wid, rss = workers.results.get(timeout=1.0)
                    except queue.Empty:
                        workers.check_alive()
                        continue
                    self.worker_rss[wid] = rss
                    if g != gen:  # left over from an iteration the caller abandoned
                        pool.release(slot)
                        continue
                    in_flight.discard(b)
                    if err is not None:
                        pool.release(slot)
                        _raise_worker_error(b, err)
                    ready[b] = slot
                slot = ready.pop(want)
                batch = self._wrap(pool, slot, len(self._batch_indices(idx, want)))
                want += 1
                self._pos.batches = want
                yield batch
        finally:
            for slot in ready.values():
                pool.release(slot)
            # In-flight tasks finish in the background; their slots come back, tagged with an
            # old generation, on the next iteration.
        self._finish_epoch(epoch)

    def _torch_loader(self):
        """torch's DataLoader over this loader's batches, made once: its workers persist
        across epochs (keys carry the epoch for datasets that have ``set_epoch``)."""
        loader = self._state.get("torch_loader")
        if loader is not None:
            return loader
        import torch
        from torch.utils.data import DataLoader as TorchDataLoader

        if hasattr(self.dataset, "fill_batch") and hasattr(self.dataset, "seed"):
            self.dataset.seed = self.seed  # a fastload ImageFolder: augmentation follows the loader's seed
        dataset = _EpochItems(self.dataset) if hasattr(self.dataset, "set_epoch") else self.dataset
        gen = torch.Generator()
        gen.manual_seed(self.seed)
        workers = self.num_workers
        loader = TorchDataLoader(
            dataset, batch_sampler=_Batches(), num_workers=workers,
            collate_fn=self.collate_fn or collate_uint8, pin_memory=self.pin_memory and _cuda_available(),
            generator=gen, multiprocessing_context=self.multiprocessing_context if workers else None,
            prefetch_factor=max(1, self.prefetch // workers) if workers else None,
            persistent_workers=workers > 0,
        )
        self._state["torch_loader"] = loader
        return loader

    def _iter_per_sample(self):
        epoch, start = self._pos.epoch, self._pos.batches
        idx = self.sampler.indices(epoch)
        loader = self._torch_loader()
        batches = [self._batch_indices(idx, b).tolist() for b in range(start, len(self))]
        if isinstance(loader.dataset, _EpochItems):
            batches = [[(epoch, i) for i in b] for b in batches]
        loader.batch_sampler.batches = batches
        for b, batch in enumerate(loader, start):
            self._pos.batches = b + 1
            yield batch
        self._finish_epoch(epoch)

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

