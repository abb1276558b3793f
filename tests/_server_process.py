"""Running a storage server binary for tests: a free loopback port, its own session, death
with the process that started it, and a stop that never leaves it behind.

:class:`Emulator` is the lifecycle the Azure and GCS emulators share (own temp directory and
log, started on a free port, waited for until it answers HTTP, stopped at exit); SeaweedFS
(``_s3_server``) keeps fixed ports across restarts and uses the functions only.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path


def die_with_parent(parent: int):
    """A preexec_fn: SIGKILL the server when the process that started it dies (Linux)."""
    libc = None
    # PDEATHSIG fires when the forking *thread* exits: only the main thread lives as long as pytest.
    if sys.platform.startswith("linux") and threading.current_thread() is threading.main_thread():
        with contextlib.suppress(OSError):
            libc = ctypes.CDLL("libc.so.6", use_errno=True)  # loaded before fork, not in the child

    def preexec() -> None:
        if libc is not None:
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return preexec


def free_port() -> int:
    """A loopback port nobody listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_group(proc: subprocess.Popen | None, timeout: float = 10.0) -> None:
    """SIGTERM a server started with ``start_new_session=True`` (its whole process group),
    SIGKILL it if it lingers past ``timeout``."""
    if proc is None or proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout)


class Emulator:
    """An emulator binary on 127.0.0.1: a temp directory for its data and log, removed by
    :meth:`close` (also at exit). Subclasses build the command in ``start`` and call
    :meth:`_launch`."""

    def __init__(self, binary: str, name: str, startup_timeout: float):
        self.binary = binary
        self.name = name
        self.data_dir = Path(tempfile.mkdtemp(prefix=f"fl-{name}-"))
        self.log_path = self.data_dir / f"{name}.log"
        self.startup_timeout = startup_timeout
        self.port: int | None = None
        self.proc: subprocess.Popen | None = None
        self._log = None
        atexit.register(self.close)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _launch(self, cmd: list[str], probe_url: str) -> None:
        """Start ``cmd`` (in its own session, dying with this process) and wait until
        ``probe_url`` answers HTTP (any status: an unsigned request may be refused)."""
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True, preexec_fn=die_with_parent(os.getpid()))
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                code = self.proc.returncode
                self.stop()
                raise RuntimeError(f"{self.name} exited with code {code}: {self.log_path.read_text()[-2000:]}")
            try:
                urllib.request.urlopen(probe_url, timeout=1).close()
                return
            except urllib.error.HTTPError:  # it answered
                return
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"{self.name} did not answer at {probe_url} within {self.startup_timeout:.0f} s")

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        stop_group(proc)
        if self._log is not None:
            self._log.close()
            self._log = None

    def close(self) -> None:
        self.stop()
        atexit.unregister(self.close)
        shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
