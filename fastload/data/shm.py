"""What fastload keeps in shared memory (``/dev/shm``) and the rules that keep it from leaking
or being hijacked, in one place for the ring (:mod:`.ring`) and the ``in_memory`` pack copy
(:mod:`.dataset`).

* **Owned names.** A private directory is named ``<prefix><pid>-<start>-<random>``: the
  owner's pid and its start time (field 22 of ``/proc/<pid>/stat``, in clock ticks since boot),
  so a later process can tell a leftover of a dead owner from a live one even when the pid
  has been reused. The owner also holds a shared ``flock`` on the directory for its lifetime
  (inherited by its forked workers): a process in another pid namespace sharing this
  ``/dev/shm`` (``docker --ipc=host``) may not see the owner's pid, but it sees the lock.
* **Stale sweep.** :func:`remove_stale` removes such directories of this uid whose owner is
  gone (pid dead or reused, *and* no lock held), never a symlink, another user's or a live
  owner's. The DataLoader runs it when it creates a ring, so a SIGKILLed run's rings
  disappear at the next start instead of at reboot.
* **SIGTERM.** :func:`on_terminate` registers a cleanup for the process that registered it;
  the first registration installs a SIGTERM handler, only where the disposition is still the
  default, that runs the cleanups (last registered first), restores the default and re-sends SIGTERM, so the process
  still dies "killed by SIGTERM" (exit status 143 in a shell). A forked child inherits the
  handler but runs none of its parent's cleanups. SIGKILL cannot be caught: the sweep is
  the answer to it.
* **Checked before use.** :func:`check_private_dir` refuses a path that is a symlink, owned by
  another user or writable by group/others, with one line naming it.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import signal
import stat
import tempfile
import threading
from pathlib import Path
from typing import Callable

from ..errors import FastloadError

__all__ = ["SharedMemoryFull", "UnsafeShmError", "check_private_dir", "lock_dir", "make_owned_dir", "on_terminate",
           "process_start_time", "remove_stale", "shm_free"]


class SharedMemoryFull(FastloadError):
    """Shared memory ran out while a batch was being placed in it."""


class UnsafeShmError(FastloadError):
    """A shared-memory path fastload would use is not safely its own (symlink, other owner, mode)."""


def process_start_time(pid: int) -> int | None:
    """When ``pid`` started, in clock ticks since boot (``/proc/<pid>/stat`` field 22); None
    when there is no such process (or no /proc)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    # the command name (field 2) is in parentheses and may contain spaces or ")"
    fields = data[data.rindex(b")") + 2 :].split()
    try:
        return int(fields[19])  # field 22 overall; fields[0] is field 3
    except (IndexError, ValueError):  # pragma: no cover - a kernel with another layout
        return None


def _owner_tag() -> str:
    pid = os.getpid()
    return f"{pid}-{process_start_time(pid) or 0}-"


def make_owned_dir(prefix: str, base: str) -> tuple[str, int]:
    """A new private directory (mode 0700) in ``base`` named after this process, and an fd
    holding a shared flock on it (close it when the directory is gone; keep it open while
    the directory is in use: forked workers inherit it, which is right, they use it too)."""
    path = tempfile.mkdtemp(prefix=prefix + _owner_tag(), dir=base)
    return path, lock_dir(path)


def lock_dir(path: str) -> int:
    """An fd with a shared flock on directory ``path`` (what marks its owner as alive)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | os.O_NOFOLLOW)
    fcntl.flock(fd, fcntl.LOCK_SH)
    return fd


def _owner_alive(pid: int, start: int) -> bool:
    now = process_start_time(pid)
    if now is None:
        return False
    return start == 0 or now == start  # start 0: unknown when named; assume the pid is the owner


def remove_stale(base: str, prefix: str) -> list[str]:
    """Remove the directories ``<prefix><pid>-<start>-*`` in ``base`` that belong to this uid
    and whose owner is gone; returns what was removed. Anything else is left alone."""
    pattern = re.compile(re.escape(prefix) + r"(\d+)-(\d+)-")
    removed = []
    try:
        names = os.listdir(base)
    except OSError:
        return removed
    uid = os.getuid()
    for name in names:
        m = pattern.match(name)
        if m is None:
            continue
        path = os.path.join(base, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid:  # a symlink, a file, another user's
            continue
        if _owner_alive(int(m.group(1)), int(m.group(2))):
            continue
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a live owner in another pid namespace holds it
        except OSError:
            os.close(fd)
            continue
        try:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        finally:
            os.close(fd)
    return removed


def check_private_dir(path: str | Path, what: str) -> None:
    """UnsafeShmError unless ``path`` is a real directory (not a symlink) of this uid that
    nobody else may write to."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise UnsafeShmError(f"{path}: {what} vanished while in use (removed by another process?)") from None
    why = None
    if stat.S_ISLNK(st.st_mode):
        why = "is a symlink"
    elif not stat.S_ISDIR(st.st_mode):
        why = "is not a directory"
    elif st.st_uid != os.getuid():
        why = f"is owned by uid {st.st_uid}, not by this user ({os.getuid()})"
    elif st.st_mode & 0o022:
        why = f"is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    if why is not None:
        raise UnsafeShmError(f"{path}: {what} {why}: refusing to use it (another user may have planted it); "
                             "remove it, or check who created it")


def shm_free(path: str) -> int | None:
    """Bytes free on the filesystem holding ``path`` (None if it cannot be asked)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


# -- SIGTERM --------------------------------------------------------------------------------

_cleanups: dict[int, Callable[[], None]] = {}  # id -> cleanup, for the process in _owner_pid
_owner_pid: int | None = None
_installed = False
_lock = threading.Lock()


def on_terminate(cleanup: Callable[[], None]) -> Callable[[], None]:
    """Run ``cleanup`` if this process is ended by SIGTERM (see the module docstring); returns
    a function that unregisters it (call it when the resource is freed normally)."""
    global _owner_pid
    pid = os.getpid()
    with _lock:
        if _owner_pid != pid:  # a forked child: its parent's cleanups are not its own
            _cleanups.clear()
            _owner_pid = pid
        key = id(cleanup)
        _cleanups[key] = cleanup
    _install()

    def unregister() -> None:
        if _owner_pid == os.getpid():
            _cleanups.pop(key, None)

    return unregister


def _install() -> None:
    global _installed
    if _installed:
        return
    try:
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return  # the application handles SIGTERM (or ignores it): its choice
        signal.signal(signal.SIGTERM, _handle_sigterm)
        _installed = True
    except ValueError:  # not the main thread: cannot install; SIGKILL-style sweep covers it
        return


def _handle_sigterm(signum, frame) -> None:
    if _owner_pid == os.getpid():
        for cleanup in reversed(list(_cleanups.values())):  # last registered first: workers before what they use
            try:
                cleanup()
            except Exception:  # noqa: BLE001 - one failed cleanup must not keep the rest (or the exit) from running
                pass
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)
