"""Datasets and process helpers for the runtime fault tests (signals, stuck workers, /dev/shm)."""

from __future__ import annotations

import contextlib
import gc
import mmap
import os
import shutil
import uuid
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent


@contextlib.contextmanager
def mounted_tmpfs(tmp_path: Path, size: str):
    """A real tmpfs of ``size`` (a small /dev/shm, a disk that fills up), mounted under
    ``tmp_path`` for the block and lazily unmounted after; skips the test without root."""
    import pytest

    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / f"tmpfs-{size}-{uuid.uuid4().hex[:6]}"
    mnt.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    try:
        yield mnt
    finally:
        gc.collect()  # drop maps of files in it before unmounting
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


class Filler:
    """A BatchFiller without files: image i is filled with ``i % 256``, its target is i
    (``i % classes`` with ``classes``).
    ``delay`` seconds per batch keeps workers busy mid-epoch; ``sigbus_dir`` makes the batch
    with first index ``sigbus_at`` touch a page of a sparse file on that (full) tmpfs, a
    real SIGBUS in the worker."""

    def __init__(self, n: int, hw: tuple[int, int] = (8, 8), delay: float = 0.0,
                 sigbus_dir: str | None = None, sigbus_at: int = -1, classes: int | None = None):
        self.n, self.hw, self.delay, self.classes = n, hw, delay, classes
        self.sigbus_dir, self.sigbus_at = sigbus_dir, sigbus_at

    def __len__(self) -> int:
        return self.n

    def batch_image_shape(self):
        return (*self.hw, 3)

    def ring_blocker(self):
        return None

    def fill_batch(self, indices, images, targets, *, epoch, seed, on_error):
        if self.sigbus_dir is not None and int(indices[0]) == self.sigbus_at:
            _touch_beyond_free_space(self.sigbus_dir)
        images[...] = (np.asarray(indices) % 256).astype(np.uint8)[:, None, None, None]
        targets[...] = indices if self.classes is None else np.asarray(indices) % self.classes
        if self.delay:
            time.sleep(self.delay)
        return None


def _touch_beyond_free_space(directory: str) -> None:
    """Fill ``directory``'s tmpfs, then write into a sparse mapped file there: SIGBUS."""
    filler = os.path.join(directory, f"fill-{os.getpid()}")
    with open(filler, "wb") as f:
        try:
            while True:
                f.write(b"\0" * (1 << 20))
                f.flush()
        except OSError:
            pass
    sparse = os.path.join(directory, f"sparse-{os.getpid()}")
    fd = os.open(sparse, os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, 8 << 20)
    mm = mmap.mmap(fd, 8 << 20)
    for off in range(0, 8 << 20, 4096):
        mm[off] = 1  # the first page with no room behind it faults


def alive(pid: int) -> bool:
    """Whether ``pid`` is a live, non-zombie process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_gone(pids, seconds: float = 15.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not any(alive(p) for p in pids):
            return True
        time.sleep(0.05)
    return not any(alive(p) for p in pids)


STARTED: list[subprocess.Popen] = []  # killed by the tests' teardown if still running


def kill_started() -> None:
    """SIGKILL and reap every script process a test started that is still running."""
    while STARTED:
        proc = STARTED.pop()
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def start_script(tmp_path: Path, body: str, name: str = "script.py") -> subprocess.Popen:
    """Run ``body`` in a fresh Python (this checkout on its path), stdout piped line by line."""
    script = tmp_path / name
    script.write_text(textwrap.dedent(f"""
        import os, signal, sys, time
        sys.path[:0] = [{str(REPO)!r}, {str(TESTS)!r}]
    """) + textwrap.dedent(body))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(TESTS)])}
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    STARTED.append(proc)
    return proc


def first_line(proc: subprocess.Popen) -> str:
    """The script's first line of output; its stderr as the failure when it died first."""
    line = proc.stdout.readline()
    if not line:
        proc.kill()
        _, err = proc.communicate()
        raise AssertionError(f"the script exited before printing anything:\n{err[-3000:]}")
    return line


def run_script(tmp_path: Path, body: str, timeout: float = 120) -> subprocess.CompletedProcess:
    proc = start_script(tmp_path, body)
    out, err = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
