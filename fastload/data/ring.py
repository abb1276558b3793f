"""The ring: a fixed number of preallocated batch slots that workers fill and the caller views.

A slot is an ``N x H x W x C`` uint8 image buffer plus ``N`` int64 targets. With worker
processes the slots are files in a private directory on a tmpfs (``/dev/shm`` by default,
``ring_dir=`` elsewhere) that the workers map; without workers, plain arrays.

**Bounded, reserved up front.** The ring has ``slots`` slots, all created when the ring is,
and their memory is reserved with ``posix_fallocate``: too little ``/dev/shm`` (Docker's
default is 64 MB) is a clear error at start that says how much is needed and how much is
free, never a SIGBUS in a worker later (a sparse file on a full tmpfs faults on first touch).

**Never left behind.** The directory is named after its owner (pid and start time, see
:mod:`.shm`) and removed by :meth:`Ring.close` (which the DataLoader calls on close, at garbage
collection and at exit) and on SIGTERM; a ring whose owner was SIGKILLed is removed by the
next ring created in the same directory.

**The slot-release rule, in one place.** :meth:`Ring.lease` hands out an array over a slot
whose death returns the slot: it goes back to the ring when no array or tensor views it any
more. On CUDA, the to-device stage keeps the batch alive until its copy has completed
(:class:`fastload.gpu.pinning.HostHold`), so the slot returns only after that too.
"""

from __future__ import annotations

import collections
import errno
import mmap
import os
import shutil
import weakref
from typing import Callable

import numpy as np

from ..errors import FastloadError
from .shm import make_owned_dir, on_terminate, remove_stale

__all__ = ["RING_PREFIX", "Ring", "RingSpaceError", "default_ring_base", "slot_bytes"]

RING_PREFIX = "fastload-ring-"


def default_ring_base() -> str | None:
    """Where slot files go without ``ring_dir=``: ``/dev/shm`` (None where there is none)."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else None


class RingSpaceError(FastloadError):
    """The ring's slots do not fit in its directory's free space."""


def _slot_layout(batch_shape: tuple[int, ...]) -> tuple[int, int]:
    """(image bytes rounded up to 64, total bytes) of one slot: images, then int64 targets."""
    img = int(np.prod(batch_shape))
    img_aligned = -(-img // 64) * 64
    return img_aligned, img_aligned + 8 * batch_shape[0]


def slot_bytes(batch_shape: tuple[int, ...]) -> int:
    """Bytes one slot of a ``(N, H, W, C)`` batch takes."""
    return _slot_layout(tuple(int(s) for s in batch_shape))[1]


def map_slot(path: str, batch_shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Map a slot file as ``(images, targets)`` arrays (workers call this once per slot)."""
    img_bytes, total = _slot_layout(batch_shape)
    with open(path, "r+b") as f:
        mm = mmap.mmap(f.fileno(), total)
    images = np.frombuffer(mm, dtype=np.uint8, count=int(np.prod(batch_shape))).reshape(batch_shape)
    targets = np.frombuffer(mm, dtype=np.int64, count=batch_shape[0], offset=img_bytes)
    return images, targets


def _mb(n: int) -> str:
    return f"{n / 2**20:,.1f} MB"


class Ring:
    """``slots`` batch slots of ``batch_shape`` (see the module docstring).

    ``shared``: slot files that worker processes map (else plain arrays). ``pin``: a function
    that page-locks an array for fast host-to-GPU copies (:func:`fastload.gpu.pinning.pin_array`).
    ``directory``: where the slot files go (default ``/dev/shm``).
    """

    def __init__(self, batch_shape: tuple[int, ...], *, slots: int, shared: bool,
                 pin: Callable[[np.ndarray], np.ndarray] | None = None, directory: str | None = None):
        if slots < 1:
            raise ValueError(f"a ring needs at least 1 slot, got {slots}")
        self.batch_shape = tuple(int(s) for s in batch_shape)
        self.capacity = int(slots)
        self.shared = shared
        self.dir: str | None = None
        self.paths: list[str] = []
        self.images: list[np.ndarray] = []
        self.targets: list[np.ndarray] = []
        self.free: collections.deque[int] = collections.deque(range(self.capacity))
        self.closed = False
        self._leased: set[int] = set()
        self._lock_fd: int | None = None
        self._unregister = None
        try:
            if shared:
                self._create_files(directory)
            for k in range(self.capacity):
                if shared:
                    images, targets = map_slot(self.paths[k], self.batch_shape)
                else:
                    images = np.empty(self.batch_shape, dtype=np.uint8)
                    targets = np.empty(self.batch_shape[0], dtype=np.int64)
                self.images.append(pin(images) if pin is not None else images)
                self.targets.append(targets)
        except BaseException:
            self.close()
            raise

    def _create_files(self, directory: str | None) -> None:
        base = directory if directory is not None else default_ring_base()
        if base is None:
            import tempfile

            base = tempfile.gettempdir()
        if not os.path.isdir(base):
            raise RingSpaceError(f"ring_dir {base!r} is not a directory")
        remove_stale(base, RING_PREFIX)  # rings of SIGKILLed runs: their space counts below
        self._unregister = on_terminate(self.close)
        self.dir, self._lock_fd = make_owned_dir(RING_PREFIX, base)
        size = slot_bytes(self.batch_shape)
        need = size * self.capacity
        try:
            st = os.statvfs(self.dir)
            free = st.f_bavail * st.f_frsize
        except OSError:  # pragma: no cover - statvfs works on Linux tmpfs and disks
            free = None
        if free is not None and need > free:
            raise self._space_error(need, free, size)
        for k in range(self.capacity):
            path = os.path.join(self.dir, f"slot-{k:04d}")
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.posix_fallocate(fd, 0, size)  # reserve now: a full tmpfs fails here, not in a worker
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise self._space_error(need, free, size) from None
                if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # pragma: no cover
                    raise
                os.ftruncate(fd, size)  # a filesystem without fallocate: sparse, as before
            finally:
                os.close(fd)
            self.paths.append(path)

    def _space_error(self, need: int, free: int | None, size: int) -> RingSpaceError:
        where = os.path.dirname(self.dir) if self.dir else "?"
        free_s = _mb(free) if free is not None else "unknown"
        return RingSpaceError(
            f"the DataLoader's batch ring needs {self.capacity} slots x {_mb(size)} = {_mb(need)} in {where}, "
            f"but only {free_s} is free there: lower batch_size (or prefetch/ring_slots), give the container "
            f"more shared memory (docker run --shm-size=...), or pass ring_dir= a directory on a larger tmpfs or disk"
        )

    def __len__(self) -> int:
        return self.capacity

    @property
    def held(self) -> int:
        """Slots leased to the caller and not yet returned."""
        return len(self._leased)

    def acquire(self) -> int | None:
        """A free slot, or None when every slot is in use."""
        if self.closed:
            raise ValueError("the DataLoader was closed")
        return self.free.popleft() if self.free else None

    def release(self, k: int) -> None:
        if not self.closed:
            self._leased.discard(k)
            self.free.append(k)

    def lease(self, k: int, n: int) -> np.ndarray:
        """The first ``n`` images of slot ``k`` as an array that returns the slot to the ring
        when it, and every view of it (a torch tensor over it too), has died."""
        self._leased.add(k)
        view = self.images[k][:n].view()  # a fresh array object: it dies when its last view does
        weakref.finalize(view, self.release, k)
        return view

    def close(self) -> None:
        """Delete the slot files and drop the ring's own references: a slot no batch views is
        unpinned and unmapped now, one a held batch views when that batch dies."""
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
        if self._unregister is not None:
            self._unregister()
            self._unregister = None
        self.closed = True
        self.free.clear()
        self._leased.clear()
        self.images.clear()
        self.targets.clear()
        self.paths.clear()
