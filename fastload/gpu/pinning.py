"""Page-locked host memory for the to-device stage: register a ring slot with CUDA, and
unregister it before its memory goes.

This and :mod:`fastload.gpu.prefetcher` are the only modules that call CUDA; the loader
passes :func:`pin_array` to its ring when ``pin_memory`` is on. Without CUDA every function
here is a no-op, so importing it is always safe (torch is imported where it is used).
"""

from __future__ import annotations

import collections
import functools
import os
import warnings
from typing import Callable
import weakref

import numpy as np

__all__ = ["HostHold", "ReleasedLast", "cudart_paths", "drain_cuda_error", "pin_array"]


class ReleasedLast:
    """Owner of an array's memory that runs ``release`` once, just before the memory can go.

    ``np.asarray(owner)`` is an array over ``a``'s memory whose views (numpy or torch) all keep
    the owner alive, and the owner keeps ``a`` (and so an mmap under it) alive. When the last
    view dies, the owner's weakref callback runs before its attributes are cleared: ``release``
    sees the memory still mapped, and only afterwards can ``a``, and then the mapping, go.
    """

    def __init__(self, a: np.ndarray, release: Callable[[], None]):
        if not a.flags.c_contiguous:
            raise ValueError("ReleasedLast needs a C-contiguous array")
        self.a = a
        self.__array_interface__ = {
            "shape": a.shape, "typestr": a.dtype.str, "data": (a.ctypes.data, False), "version": 3,
        }
        self.release = weakref.finalize(self, release)
        # At interpreter exit the process and its mappings end anyway; do not call into a
        # runtime that may be shutting down.
        self.release.atexit = False


def pin_array(a: np.ndarray) -> np.ndarray:
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
        drain_cuda_error()
        # Python's default warning filter shows this once, not once per slot.
        warnings.warn(f"cudaHostRegister of a {a.nbytes}-byte batch slot failed (CUDA error {err}); batches "
                      "stay in pageable memory, so host-to-GPU copies are slower and not asynchronous",
                      RuntimeWarning, stacklevel=2)
        return a
    return np.asarray(ReleasedLast(a, functools.partial(_unpin, ptr, os.getpid())))


def _unpin(ptr: int, pid: int) -> None:
    """cudaHostUnregister ``ptr`` (in the process that registered it; a forked child must not
    touch CUDA). A failure is drained and otherwise ignored: nothing could be done about it here."""
    if os.getpid() != pid:  # pragma: no cover - defensive
        return
    import torch

    if int(torch.cuda.cudart().cudaHostUnregister(ptr)) != 0:  # pragma: no cover - needs a GPU
        drain_cuda_error()


def cudart_paths(maps_lines) -> list[str]:
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


def drain_cuda_error() -> None:
    """Reset the CUDA runtime's pending "last error" after a failed cudart call we handle.

    A failed cudaHostRegister/Unregister leaves its code pending, and torch's next
    kernel-launch check (``cudaGetLastError``) would raise it from an unrelated operation.
    torch's cudart binding has no cudaGetLastError, so call it through ctypes in every
    libcudart this process has mapped (each library instance keeps its own error state;
    dlopen of a mapped path returns that instance)."""
    import ctypes

    try:
        with open("/proc/self/maps") as f:
            paths = cudart_paths(f)
    except OSError:  # pragma: no cover - not Linux
        return
    for path in paths:
        try:
            ctypes.CDLL(path).cudaGetLastError()
        except (OSError, AttributeError):  # pragma: no cover - defensive
            pass


class HostHold:
    """Host batches kept alive until the device copies that read them have completed.

    The to-device half of the slot-release rule (the ring's half is :meth:`Ring.lease`): a
    ``non_blocking`` copy from page-locked memory runs when its stream gets to it, maybe after
    the host has dropped the batch, and a ring slot goes back to the workers as soon as no
    tensor views it. So whoever issues such a copy holds the batch here until the copy's event
    has fired; checked with ``query()``, never by waiting, except in :meth:`drain`.
    """

    def __init__(self) -> None:
        self._held: collections.deque = collections.deque()  # (CUDA event, host batch)

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, batch: object, stream) -> None:
        """Keep ``batch`` until the work queued on ``stream`` so far has run."""
        import torch

        done = torch.cuda.Event()
        done.record(stream)
        self._held.append((done, batch))
        self.reap()

    def reap(self) -> None:
        """Drop the batches whose copies have completed (in order: events fire in order per stream)."""
        while self._held and self._held[0][0].query():
            self._held.popleft()

    def drain(self) -> None:
        """Wait for every held copy, then drop the batches (at the end of an iteration)."""
        while self._held:
            done, _ = self._held.popleft()
            done.synchronize()
