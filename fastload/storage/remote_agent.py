"""Object-store I/O of a process that forks workers, done in one helper process forked from it.

obstore's I/O runtime (tokio) panics in a process forked after its parent started it. If the
main process downloaded a remote pack's manifest and announced download-ahead itself, its
DataLoader workers would have to be spawned, and a spawned worker imports torch again before
its first batch (1.5-2 s here, most of a cold epoch of 5,000 images). Instead, the process
that opens a remote pack sends that I/O to an *agent*: one process forked from it on first
need, which starts its own runtime and never forks. The opening process never starts one, so
its workers fork in milliseconds, as PyTorch users expect (and need no main guard).

One agent per process, shared by every remote pack it opens. Calls run in the agent one at a
time; :func:`call` waits for the result (or the error, re-raised here), :func:`post` does not
(download-ahead: a failure there only logs, the reader that needs the shard downloads it
itself and raises). The agent ignores SIGINT (the parent handles Ctrl-C), takes SIGTERM's
default action, and ends within a second of its parent dying, even by ``kill -9``.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing as mp
import multiprocessing.util as mp_util
import os
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, TypeVar

from .remote import RemoteError, runtime_started

__all__ = ["call", "keep", "pids", "post", "shutdown", "started", "usable"]

log = logging.getLogger(__name__)
T = TypeVar("T")

_WAIT_MARGIN_S = 60.0  # on top of the call's own retry budget before the agent counts as stuck
_lock = threading.Lock()
_agent: tuple[int, ProcessPoolExecutor] | None = None  # (owner pid, executor)
_state: dict[str, Any] = {}  # in the agent: objects kept between calls (see :func:`keep`)


def usable() -> bool:
    """True where I/O should go to the agent: fork works here (Linux) and this process has not
    started obstore's runtime itself (once it has, its workers must be spawned anyway)."""
    return hasattr(os, "fork") and "fork" in mp.get_all_start_methods() and not runtime_started()


def started() -> bool:
    """True if this process has an agent running."""
    return _agent is not None and _agent[0] == os.getpid()


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(0)  # the parent is gone: downloads for it are useless


def _init(parent: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the parent's cleanup handlers
    threading.Thread(target=_watch_parent, args=(parent,), name="fastload-agent-watch", daemon=True).start()


def _executor() -> ProcessPoolExecutor:
    global _agent
    with _lock:
        pid = os.getpid()
        if _agent is None or _agent[0] != pid:  # none yet, or a forked child's copy of its parent's
            ex = ProcessPoolExecutor(1, mp_context=mp.get_context("fork"), initializer=_init, initargs=(pid,))
            _agent = (pid, ex)
            # In a multiprocessing child, exit joins the child processes before any atexit hook
            # could stop the agent: a finalizer with an exit priority runs first.
            mp_util.Finalize(None, shutdown, exitpriority=100)
        return _agent[1]


def _drop(ex: ProcessPoolExecutor) -> None:
    global _agent
    with _lock:
        if _agent is not None and _agent[1] is ex:
            _agent = None
    _kill(ex)


def _processes(ex: ProcessPoolExecutor) -> list:
    return list((getattr(ex, "_processes", None) or {}).values())


def pids() -> list[int]:
    """Process ids of this process's agent (none if it has none)."""
    agent = _agent
    return [p.pid for p in _processes(agent[1])] if agent is not None and agent[0] == os.getpid() else []


def _kill(ex: ProcessPoolExecutor) -> None:
    procs = _processes(ex)
    ex.shutdown(wait=False, cancel_futures=True)
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(5)


def _submit(fn: Callable[..., Any], *args: Any) -> tuple[ProcessPoolExecutor, Future]:
    """Submit to the agent, starting a fresh one if the last one died (killed, out of memory)."""
    ex = _executor()
    try:
        return ex, ex.submit(fn, *args)
    except (BrokenProcessPool, RuntimeError):  # it died since the last call, or was shut down
        _drop(ex)
    ex = _executor()
    return ex, ex.submit(fn, *args)


def call(fn: Callable[..., T], *args: Any, timeout: float, what: str) -> T:
    """Run ``fn(*args)`` in the agent and return its result (its exception is re-raised here).

    ``timeout``: seconds the call may take (its retry budget); past it plus a margin the
    agent is killed and :class:`RemoteError` names ``what``.
    """
    ex, fut = _submit(fn, *args)
    try:
        return fut.result(timeout=timeout + _WAIT_MARGIN_S)
    except BrokenProcessPool as exc:
        _drop(ex)
        raise RemoteError(f"{what}: the object-store helper process died ({exc})") from None
    except TimeoutError:
        _drop(ex)
        raise RemoteError(f"{what}: no answer from the object-store helper process in "
                          f"{timeout + _WAIT_MARGIN_S:.0f} s") from None


def post(fn: Callable[..., Any], *args: Any) -> None:
    """Run ``fn(*args)`` in the agent without waiting; a failure is logged, not raised."""
    try:
        _, fut = _submit(fn, *args)
    except (BrokenProcessPool, RuntimeError) as exc:  # cannot start one (e.g. at interpreter exit)
        log.warning("download-ahead skipped: no object-store helper process (%s)", exc)
        return
    fut.add_done_callback(_log_failure)


def _log_failure(fut: Future) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.warning("download-ahead failed (the reader will download the shard itself): %s", fut.exception())


def keep(key: str, make: Callable[[], T]) -> T:
    """In the agent: the object stored under ``key``, made on first use (clients and caches
    live across calls, so connections are reused and each pack has one needed-list)."""
    obj = _state.get(key)
    if obj is None:
        obj = _state[key] = make()
    return obj


def _close_kept() -> None:
    for obj in list(_state.values()):
        close = getattr(obj, "close", None)
        if close is not None:
            try:
                close()
            except Exception:  # noqa: BLE001 - closing at exit: nothing left to tell
                pass
    _state.clear()


def shutdown(timeout: float = 30.0) -> None:
    """Stop this process's agent: downloads under way finish (bounded by ``timeout``), queued
    ones are dropped. Registered at exit; safe to call twice."""
    global _agent
    with _lock:
        agent, _agent = _agent, None
    if agent is None or agent[0] != os.getpid():
        return
    ex = agent[1]
    try:
        ex.submit(_close_kept).result(timeout=timeout)
        ex.shutdown(wait=True, cancel_futures=True)
    except Exception:  # noqa: BLE001 - broken or stuck: kill it
        _kill(ex)


# Before concurrent.futures' own exit hook (these run in reverse order of registration), so
# queued download-ahead is cancelled rather than waited for when the program ends.
_register = getattr(threading, "_register_atexit", None)
(_register or atexit.register)(shutdown)
