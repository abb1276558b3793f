"""The fill stage's worker processes: each takes a task (a batch of indices and a ring slot),
fills the slot through the dataset's :class:`~fastload.data.protocols.BatchFiller` methods
and sends back only the slot number (plus any records it had to replace and its RSS).

Processes, not threads: the per-sample Python around each decode holds the GIL and would
compete with the training loop, and processes isolate crashes (see the loader's module
docstring for the measurement).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import sys
import traceback

import numpy as np

from ..errors import DecodeError, FastloadError, FormatError
from .ring import map_slot

__all__ = ["WorkerError", "Workers", "raise_worker_error"]


class WorkerError(FastloadError):
    """A worker failed on a batch; the message (one line, so the CLI can print it as is)
    names the batch, and the record and shard when the dataset's error did (decode and format
    errors keep their own class). The worker's traceback is in :attr:`worker_traceback` and
    in the exception's notes, which Python prints with an uncaught traceback."""

    worker_traceback: str = ""


def _read_rss() -> int:
    """This process's resident set size in bytes (from /proc; 0 where unavailable)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):  # pragma: no cover
        return 0


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
        gen, b, slot, path, epoch, seed, on_error, indices = task
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
        results.put((gen, b, slot, err, replaced, wid, _read_rss()))


class Workers:
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


def raise_worker_error(b: int, err: tuple[str, str, str]) -> None:
    """Re-raise a worker's error in the main process, as its class where it is ours."""
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
