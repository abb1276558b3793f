"""The fill stage's worker processes: each takes a task (a batch of indices and a ring slot),
fills the slot through the dataset's :class:`~fastload.data.protocols.BatchFiller` methods
and sends back only the slot number (plus any records it had to replace and its RSS).

Processes, not threads: the per-sample Python around each decode holds the GIL and would
compete with the training loop, and processes isolate crashes (see the loader's module
docstring for the measurement).

**Faults.** Each worker records the batch it is filling in a small shared array, so a worker
that stops (SIGSTOP, a hung network filesystem) is named by the loader's ``timeout``; a worker
that dies is described by :func:`describe_death` (a SIGBUS with little shared memory free
says so, a SIGKILL suggests the OOM killer, any other signal is named). Workers take SIGTERM
with the default action (they own nothing the kernel does not reclaim); the main process's
SIGTERM handler (:mod:`.shm`) stops them.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import sys
import time
import traceback

import numpy as np

from ..errors import CorruptRecordError, DecodeError, FastloadError, FormatError
from .ring import map_slot
from .shm import on_terminate, shm_free

__all__ = ["WorkerError", "WorkerTimeout", "Workers", "describe_death", "raise_worker_error"]


class WorkerError(FastloadError):
    """A worker failed on a batch; the message (one line, so the CLI can print it as is)
    names the batch, and the record and shard when the dataset's error did (decode and format
    errors keep their own class). The worker's traceback is in :attr:`worker_traceback` and
    in the exception's notes, which Python prints with an uncaught traceback."""

    worker_traceback: str = ""


class WorkerTimeout(WorkerError):
    """No batch came back within the loader's ``timeout`` (a stopped or stuck worker)."""


def describe_death(exitcode: int | None, dirs: list[str]) -> str:
    """Why a worker with ``exitcode`` is gone, in words: the signal by name, with how much
    shared memory is free in ``dirs`` when it was SIGBUS and little is (a full tmpfs makes a
    first touch of a mapped page fault)."""
    if exitcode is None or exitcode >= 0:
        return f"exited with code {exitcode}"
    sig = -exitcode
    try:
        name = signal.Signals(sig).name
    except ValueError:
        name = f"signal {sig}"
    if sig == signal.SIGBUS:
        low = []
        for d in dict.fromkeys(dirs):
            free = shm_free(d)
            size = _fs_size(d)
            if free is not None and (free < 64 << 20 or (size and free < size // 10)):
                low.append(f"{d} full? ({free / 2**20:,.1f} MB free)")
        if low:
            return f"was killed by SIGBUS: {', '.join(low)}: give the container more shared memory " \
                   "(docker run --shm-size=...) or pass ring_dir= a larger tmpfs"
        return "was killed by SIGBUS (a bus error: a mapped file shrank or its filesystem filled up)"
    if sig == signal.SIGKILL:
        return "was killed by SIGKILL (the OOM killer? check dmesg)"
    return f"was killed by {name}"


def _fs_size(path: str) -> int | None:
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_blocks * st.f_frsize


def _read_rss() -> int:
    """This process's resident set size in bytes (from /proc; 0 where unavailable)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):  # pragma: no cover
        return 0


def _worker_loop(wid: int, dataset, tasks, results, batch_shape, parent: int, busy) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's to handle
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the parent's inherited cleanup handler
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
        gen, b, slot, path, epoch, seed, on_error, indices = task
        busy[2 * wid], busy[2 * wid + 1] = gen, b
        replaced = None
        try:
            if slot not in maps:
                maps[slot] = map_slot(path, batch_shape)
            images, targets = maps[slot]
            n = len(indices)
            replaced = dataset.fill_batch(indices, images[:n], targets[:n], epoch=epoch, seed=seed, on_error=on_error)
            err = None
        except BaseException as exc:  # noqa: BLE001 - everything must reach the main process
            err = (type(exc).__name__, str(exc), traceback.format_exc(limit=6))
        busy[2 * wid + 1] = -1
        results.put((gen, b, slot, err, replaced, wid, _read_rss()))


class Workers:
    """The persistent worker processes and their queues (kept apart from the DataLoader so
    a finalizer can shut them down without keeping the loader alive)."""

    def __init__(self, dataset, n: int, batch_shape, context: str | None, shm_dirs: list[str] = ()):
        ctx = mp.get_context(context or ("fork" if sys.platform.startswith("linux") else "spawn"))
        self.tasks = ctx.Queue()
        self.results = ctx.Queue()
        self.busy = ctx.RawArray("q", [-1] * (2 * n))  # per worker: (generation, batch) it is filling, or -1
        self.shm_dirs = list(shm_dirs)  # where a SIGBUS may come from (the ring's directory, /dev/shm)
        self.procs = []
        self._killed = False
        parent = os.getpid()
        self._unregister = on_terminate(self.kill)
        for w in range(n):
            p = ctx.Process(
                target=_worker_loop, args=(w, dataset, self.tasks, self.results, batch_shape, parent, self.busy),
                name=f"fastload-worker-{w}", daemon=True,
            )
            p.start()
            self.procs.append(p)

    def check_alive(self) -> None:
        """WorkerError naming the first worker that is gone and why."""
        for w, p in enumerate(self.procs):
            if not p.is_alive():
                raise WorkerError(f"DataLoader worker {w} (pid {p.pid}) {describe_death(p.exitcode, self.shm_dirs)}")

    def filling(self, gen: int, b: int) -> int | None:
        """The worker filling batch ``b`` of generation ``gen`` right now (None: no worker has it yet)."""
        for w in range(len(self.procs)):
            if self.busy[2 * w] == gen and self.busy[2 * w + 1] == b:
                return w
        return None

    def busy_workers(self) -> list[int]:
        """Workers in the middle of a batch."""
        return [w for w in range(len(self.procs)) if self.busy[2 * w + 1] >= 0]

    def kill(self) -> None:
        """Stop every worker now (SIGKILL: also ends a stopped one) and reap it. The queues are
        left alone: this runs in a signal handler, which may have interrupted a ``put`` that
        holds a queue's lock (closing the queue would take it again and never return)."""
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(timeout=5)
        self.procs = []
        self._killed = True
        if self._unregister is not None:
            self._unregister()
            self._unregister = None

    def shutdown(self) -> None:
        """Ask the workers to finish, wait a little, then end the ones that do not (stuck or stopped)."""
        if self._killed:
            return
        for _ in self.procs:
            try:
                self.tasks.put(None)
            except (OSError, ValueError):  # pragma: no cover
                pass
        self._close(wait=5.0)

    def _close(self, wait: float) -> None:
        deadline = time.monotonic() + wait
        for p in self.procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():  # stuck in C code, or stopped (SIGTERM would stay pending): SIGKILL
                p.kill()
            p.join(timeout=5)
        if not self._killed:
            for q in (self.tasks, self.results):
                q.cancel_join_thread()  # a dead reader must not keep our feeder thread waiting on a full pipe
                q.close()
        self.procs = []
        if self._unregister is not None:
            self._unregister()
            self._unregister = None


def raise_worker_error(b: int, err: tuple[str, str, str]) -> None:
    """Re-raise a worker's error in the main process, as its class where it is ours."""
    name, msg, tb = err
    cls = {"DecodeError": DecodeError, "FormatError": FormatError, "CorruptRecordError": CorruptRecordError}.get(name)
    if cls is not None:
        raise cls(msg)
    first = msg.strip().splitlines()[0] if msg.strip() else ""
    exc = WorkerError(f"batch {b}: {name}: {first}" if first else f"batch {b}: {name}")
    exc.worker_traceback = tb
    if hasattr(exc, "add_note"):  # Python >= 3.11
        exc.add_note(f"--- worker traceback ---\n{tb}")
    raise exc
