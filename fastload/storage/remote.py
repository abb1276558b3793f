"""Packs in object storage: move bytes between a URL prefix (``s3://bucket/pack``) and local files.

Why obstore: one small wheel (a Rust core, no Python dependencies) speaks S3, GCS, Azure and
plain HTTP; its GETs stream large chunks without holding the GIL and ``put`` of a file object
runs concurrent multipart uploads. boto3 is S3-only and needs s3transfer tuning to be fast;
s3fs/gcsfs/adlfs are one package per cloud on top of fsspec and aiohttp.

Credentials and endpoints: obstore reads the usual environment (``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_REGION``, ``AWS_ENDPOINT_URL``;
``GOOGLE_APPLICATION_CREDENTIALS``; ``AZURE_STORAGE_ACCOUNT_NAME``/``_KEY``...) and cloud
identities (EC2/ECS roles, web-identity tokens, GCE metadata, Azure managed identity). It does
not read ``~/.aws`` profiles: export the keys or pass them. ``storage_options`` overrides
the environment with obstore's own option names (``region``, ``access_key_id``,
``skip_signature``... and HTTP client options such as ``allow_http`` or ``timeout``);
``endpoint_url`` is the shortcut for S3-compatible servers (MinIO, SeaweedFS, R2): path-style
requests, plain HTTP allowed when the URL says ``http://``.

Retries: transient failures (connection refused or reset, timeouts, HTTP 5xx, 408, 429) are
retried with exponential backoff and jitter within a budget of ``retry_seconds``: per request
by obstore (which also resumes a download whose body broke off, with a Range request), and
once more around the whole operation for whatever escapes it mid-way (our writes replace
whole objects, so repeating one is safe); then one :class:`RemoteError` names the object's
URL and the cause. Denied (401/403) and missing (404) objects fail at once. Every request has
a connect timeout, a read (stall) timeout and an overall timeout, so nothing waits forever.

Processes: a :class:`RemoteStore` pickles small and opens its client lazily in each process.
obstore's I/O runtime does not survive ``fork()`` once it has run, so a process forked after
its parent used object storage gets a clear :class:`RemoteError` instead of a hang (only use
through this module is tracked): such workers must be started with the ``spawn`` or
``forkserver`` multiprocessing context, or the parent must not touch the store before forking.
:func:`runtime_started` tells which; a remote pack's opening process avoids it by sending its
requests to a forked helper (:mod:`.remote_agent`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
import re
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlparse

from ..errors import FastloadError, require

__all__ = [
    "RemoteAccessError",
    "RemoteError",
    "RemoteIntegrityError",
    "RemoteNotFoundError",
    "RemoteStore",
    "is_url",
    "join_url",
    "local_path",
    "runtime_started",
]

log = logging.getLogger(__name__)
T = TypeVar("T")

# The schemes obstore's from_url understands (file:// and memory:// are deliberately not here).
URL_SCHEMES = frozenset({"s3", "s3a", "gs", "az", "azure", "abfs", "abfss", "adl", "http", "https"})
_S3_SCHEMES = frozenset({"s3", "s3a"})
MIN_CHUNK_SIZE = 5 << 20  # S3's smallest multipart part (SeaweedFS and AWS both enforce it)
_FIRST_BACKOFF = 0.1
_MAX_BACKOFF = 10.0
# Keys of obstore's ClientConfig; every other storage option goes to the store's own config.
_CLIENT_KEYS = frozenset({
    "allow_http", "allow_invalid_certificates", "connect_timeout", "default_content_type",
    "default_headers", "http1_only", "http2_keep_alive_interval", "http2_keep_alive_timeout",
    "http2_keep_alive_while_idle", "http2_only", "pool_idle_timeout", "pool_max_idle_per_host",
    "proxy_ca_certificate", "proxy_excludes", "proxy_url", "randomize_addresses", "read_timeout",
    "root_certificate", "timeout", "user_agent",
})
# Connect fast, notice a stalled stream within a minute, and still let a multi-GB shard finish.
_DEFAULT_CLIENT = {
    "connect_timeout": timedelta(seconds=10),
    "read_timeout": timedelta(seconds=60),
    "timeout": timedelta(minutes=30),
}

# The pid whose obstore runtime has done I/O: a forked child inherits a runtime without threads.
_RUNTIME_PID: int | None = None


class RemoteError(FastloadError):
    """An object-store operation failed (after retrying, if the cause was transient)."""


class RemoteNotFoundError(RemoteError, FileNotFoundError):
    """The object (or its bucket) does not exist (HTTP 404)."""


class RemoteAccessError(RemoteError, PermissionError):
    """The store refused the credentials or the request (HTTP 401/403)."""


class RemoteIntegrityError(RemoteError):
    """A downloaded object has the wrong size or SHA-256: truncated, corrupt or replaced."""


def runtime_started() -> bool:
    """True once this process has made an object-store request (which starts the I/O runtime
    that a forked child cannot use: it hangs): from then on its workers must be spawned."""
    return _RUNTIME_PID == os.getpid()


def is_url(path: str | os.PathLike) -> bool:
    """True for object-store URLs (s3://, gs://, az://, abfs(s)://, http(s)://...).

    Local paths and ``file://`` URLs are False: they name local files, read with the local
    backends (see :func:`local_path`).
    """
    if not isinstance(path, str):
        return False
    scheme, sep, _ = path.partition("://")
    return bool(sep) and scheme.lower() in URL_SCHEMES


def local_path(path: str | os.PathLike) -> Path:
    """A local path, accepting ``file://`` URLs too (``file:///data/pack`` -> ``/data/pack``)."""
    if isinstance(path, str) and path.lower().startswith("file://"):
        from urllib.request import url2pathname

        parsed = urlparse(path)
        if parsed.netloc not in ("", "localhost"):
            raise ValueError(f"{path}: file:// URL names another host ({parsed.netloc})")
        return Path(url2pathname(parsed.path))  # it unquotes %20 and friends
    if is_url(path):
        raise ValueError(f"{path} is a remote URL, not a local path")
    return Path(path)


def join_url(base: str, name: str) -> str:
    """``base`` + "/" + ``name``, with exactly one slash between them."""
    if not name:
        return base.rstrip("/")
    return f"{base.rstrip('/')}/{name.lstrip('/')}"


def _check_key(key: str) -> str:
    if not isinstance(key, str) or not key or key.startswith("/") or ".." in key.split("/"):
        raise ValueError(f"object key must be a non-empty relative path without '..', got {key!r}")
    return key


# ---- turning obstore's multi-line errors into one line --------------------------------------

_NOT_FOUND, _DENIED, _TRANSIENT, _FATAL = "not found", "denied", "transient", "fatal"
_TRANSIENT_TEXT = re.compile(
    r"kind: (Connect|Request|Timeout|Interrupted|Decode)\b|timed out|connection (reset|closed)|"
    r"broken pipe|error decoding response body|incomplete message",
    re.IGNORECASE,
)


def _status(text: str) -> int | None:
    m = re.search(r"status code: (\d{3})", text)
    return int(m.group(1)) if m else None


def _classify(exc: BaseException) -> str:
    from obstore.exceptions import (
        GenericError,
        NotFoundError,
        PermissionDeniedError,
        UnauthenticatedError,
    )

    text = str(exc)
    status = _status(text)
    if isinstance(exc, (FileNotFoundError, NotFoundError)) or status == 404:
        return _NOT_FOUND
    if isinstance(exc, (PermissionDeniedError, UnauthenticatedError)) or status in (401, 403):
        return _DENIED
    if isinstance(exc, GenericError):
        if status is not None:
            return _TRANSIENT if status >= 500 or status in (408, 429) else _FATAL
        if _TRANSIENT_TEXT.search(text):
            return _TRANSIENT
    return _FATAL


def _reason(exc: BaseException) -> str:
    """The cause in a few words: 'HTTP 503 Service Unavailable (SlowDown)', 'connection refused'."""
    text = str(exc)
    code = re.search(r"<Code>([^<]+)</Code>", text)
    status = re.search(r"status code: (\d{3}[^:\n]*)", text)
    if status:
        return f"HTTP {status.group(1).strip()}" + (f" ({code.group(1)})" if code else "")
    if re.search(r"kind: Timeout|TimedOut|timed out", text):
        return "timed out"
    os_message = re.search(r'message: "([^"]+)"', text)
    if os_message:
        return os_message.group(1).lower()
    first = text.split("\n", 1)[0].strip()
    return first.rsplit(" - ", 1)[-1][:300] or type(exc).__name__


def _error_code(exc: BaseException) -> str | None:
    m = re.search(r"<Code>([^<]+)</Code>", str(exc))
    return m.group(1) if m else None


class RemoteStore:
    """Objects under one URL prefix, addressed by keys relative to it (``shards/000.lmdb``).

    Cheap to pickle (options only); the obstore client is created on first use in each
    process. ``retry_seconds`` bounds how long one call keeps retrying transient failures.
    ``chunk_size`` is the multipart part size for uploads (at least 5 MiB, S3's minimum) and
    the read size of downloads; ``max_concurrency`` is the number of parts in flight.
    """

    def __init__(
        self,
        url: str,
        *,
        storage_options: Mapping[str, Any] | None = None,
        endpoint_url: str | None = None,
        retry_seconds: float = 60.0,
        chunk_size: int = 8 << 20,
        max_concurrency: int = 8,
    ):
        if not is_url(url):
            raise ValueError(
                f"{url!r} is not an object-store URL (expected one of {', '.join(sorted(URL_SCHEMES))}://...)"
            )
        if retry_seconds < 0:
            raise ValueError(f"retry_seconds must be >= 0, got {retry_seconds}")
        if chunk_size < MIN_CHUNK_SIZE:
            raise ValueError(f"chunk_size must be at least {MIN_CHUNK_SIZE} bytes (S3's smallest multipart part), got {chunk_size}")
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        self.url = url.rstrip("/")
        self.scheme = url.partition("://")[0].lower()
        if endpoint_url is not None and self.scheme not in _S3_SCHEMES:
            raise ValueError(
                f"{url}: endpoint_url is for S3-compatible stores (s3://); pass {self.scheme}:// options in storage_options"
            )
        self.storage_options = dict(storage_options or {})
        self.endpoint_url = endpoint_url
        self.retry_seconds = float(retry_seconds)
        self.chunk_size = int(chunk_size)
        self.max_concurrency = int(max_concurrency)
        self._store: Any = None
        self._pid: int | None = None
        self.client  # noqa: B018 - build once now so a bad option fails here, not in a worker

    # ---- the client, per process ----------------------------------------------------------

    def _options(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """(store config, client options) from storage_options and endpoint_url."""
        options = dict(self.storage_options)
        client = dict(_DEFAULT_CLIENT)
        client.update(options.pop("client_options", None) or {})
        config: dict[str, Any] = {}
        for key, value in options.items():
            (client if key in _CLIENT_KEYS else config)[key] = value
        if self.endpoint_url is not None:
            config.setdefault("endpoint", self.endpoint_url)
            config.setdefault("virtual_hosted_style_request", False)
            if self.endpoint_url.startswith("http://"):
                client.setdefault("allow_http", True)
        return config, client

    def _retry_config(self) -> dict[str, Any]:
        if self.retry_seconds == 0:
            return {"max_retries": 0}
        return {
            "max_retries": 1000,  # the time budget, not the count, ends the retries
            "retry_timeout": timedelta(seconds=self.retry_seconds),
            "backoff": {
                "init_backoff": timedelta(seconds=_FIRST_BACKOFF),
                "max_backoff": timedelta(seconds=min(_MAX_BACKOFF, max(_FIRST_BACKOFF, self.retry_seconds / 4))),
                "base": 2,
            },
        }

    @property
    def client(self) -> Any:
        """The obstore store for this process (created on first use, again after fork; creating
        one starts no runtime, its first request does)."""
        if self._store is None or self._pid != os.getpid():
            obstore_store = require("obstore.store", "obstore", "reading and writing packs in object storage")
            config, client = self._options()
            try:
                self._store = obstore_store.from_url(
                    self.url, config=config, client_options=client, retry_config=self._retry_config()
                )
            except Exception as exc:  # obstore raises ValueError or its own error for a bad option
                raise ValueError(f"{self.url}: bad storage option: {str(exc).splitlines()[0]}") from exc
            self._pid = os.getpid()
        return self._store

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_store"] = None
        state["_pid"] = None
        return state

    def __repr__(self) -> str:
        endpoint = f", endpoint_url={self.endpoint_url!r}" if self.endpoint_url else ""
        return f"RemoteStore({self.url!r}{endpoint})"

    # ---- one place for retries and error messages ---------------------------------------------

    def _url(self, key: str) -> str:
        return join_url(self.url, key)

    def _call(self, op: str, key: str, fn: Callable[[Any], T]) -> T:
        """Run ``fn(store)``. obstore has already retried each request; this loop repeats the
        whole operation for transient failures that escaped it mid-way, within the same budget."""
        from obstore.exceptions import BaseError

        global _RUNTIME_PID
        pid = os.getpid()
        if _RUNTIME_PID is not None and _RUNTIME_PID != pid:
            raise RemoteError(
                f"cannot {op} {self._url(key)}: this process was forked after its parent (pid {_RUNTIME_PID}) "
                "used object storage, and obstore does not survive fork; start workers with the "
                "'spawn' or 'forkserver' multiprocessing context"
            )
        store = self.client
        _RUNTIME_PID = pid
        start = time.monotonic()
        delay = _FIRST_BACKOFF
        while True:
            try:
                return fn(store)
            except (BaseError, FileNotFoundError) as exc:
                kind = _classify(exc)
                elapsed = time.monotonic() - start
                if kind == _TRANSIENT and elapsed + delay < self.retry_seconds:
                    log.warning("%s %s failed (%s); retrying in %.1f s", op, self._url(key), _reason(exc), delay)
                    time.sleep(delay * random.uniform(0.5, 1.0))
                    delay = min(delay * 2, _MAX_BACKOFF)
                    continue
                raise self._error(op, key, exc, kind, elapsed) from exc

    def _error(self, op: str, key: str, exc: BaseException, kind: str, elapsed: float) -> RemoteError:
        url = self._url(key)
        code = _error_code(exc)
        if kind == _NOT_FOUND:
            detail = f" ({code})" if code and code != "NoSuchKey" else ""
            return RemoteNotFoundError(f"{url} does not exist{detail}")
        if kind == _DENIED:
            return RemoteAccessError(f"access denied to {url}: check credentials ({code or _reason(exc)})")
        where = f" at {self.endpoint_url}" if self.endpoint_url else ""
        if kind == _TRANSIENT:
            return RemoteError(f"cannot {op} {url}{where}: {_reason(exc)} (gave up after {elapsed:.1f} s of retries)")
        return RemoteError(f"cannot {op} {url}{where}: {_reason(exc)}")

    # ---- operations ------------------------------------------------------------------------------

    def get_bytes(self, key: str) -> bytes:
        """The whole object in memory (for manifests and indexes, not shards)."""
        import obstore

        _check_key(key)
        return self._call("read", key, lambda store: bytes(obstore.get(store, key).bytes()))

    def download(self, key: str, dest: str | os.PathLike, *, size: int | None = None, sha256: str | None = None) -> None:
        """Stream the object into ``dest`` (written as given, then fsynced), checking ``size`` and
        ``sha256`` when given. On any failure ``dest`` is removed, so a partial file never looks
        complete; renaming a temporary name into place is the caller's job."""
        import obstore

        _check_key(key)
        dest = Path(dest)
        url = self._url(key)

        def attempt(store: Any, f: Any) -> tuple[int, str]:
            f.seek(0)
            f.truncate()
            digest = hashlib.sha256()
            result = obstore.get(store, key)
            remote_size = int(result.meta["size"])
            if size is not None and remote_size != size:
                raise RemoteIntegrityError(f"{url}: {remote_size} bytes, expected {size}: object truncated or replaced")
            n = 0
            for chunk in result.stream(min_chunk_size=self.chunk_size):
                f.write(chunk)
                digest.update(chunk)
                n += len(chunk)
            return n, digest.hexdigest()

        done = False
        try:
            with open(dest, "wb") as f:
                n, digest = self._call("download", key, lambda store: attempt(store, f))
                f.flush()
                os.fsync(f.fileno())
            if size is not None and n != size:
                raise RemoteIntegrityError(f"{url}: received {n} bytes, expected {size}: object truncated or replaced")
            if sha256 is not None and digest != sha256.lower():
                raise RemoteIntegrityError(
                    f"{url}: SHA-256 mismatch (corrupt or replaced object): expected {sha256[:16]}..., got {digest[:16]}..."
                )
            done = True
        finally:
            if not done:
                dest.unlink(missing_ok=True)

    def upload(self, src: str | os.PathLike, key: str) -> None:
        """Upload a local file; files over ``chunk_size`` go up as concurrent multipart parts."""
        import obstore

        _check_key(key)
        with open(src, "rb") as f:

            def attempt(store: Any) -> None:
                f.seek(0)
                obstore.put(store, key, f, chunk_size=self.chunk_size, max_concurrency=self.max_concurrency)

            self._call("upload", key, attempt)

    def put_bytes(self, key: str, data: bytes | bytearray | memoryview) -> None:
        """Write a small object (a manifest, an index) in one request."""
        import obstore

        _check_key(key)
        payload = bytes(data)
        self._call("write", key, lambda store: obstore.put(store, key, payload, use_multipart=False))

    def head(self, key: str) -> int | None:
        """The object's size in bytes, or None if it does not exist."""
        import obstore

        _check_key(key)
        try:
            return self._call("stat", key, lambda store: int(obstore.head(store, key)["size"]))
        except RemoteNotFoundError:
            return None

    def list(self, prefix: str = "") -> list[tuple[str, int]]:
        """(key, size) of every object under ``prefix`` (a directory-like path; "" for all), sorted."""
        import obstore

        if prefix:
            _check_key(prefix)

        def attempt(store: Any) -> list[tuple[str, int]]:
            found: list[tuple[str, int]] = []
            for batch in obstore.list(store, prefix=prefix or None, chunk_size=1000):
                found += [(meta["path"], int(meta["size"])) for meta in batch]
            return sorted(found)

        return self._call("list", prefix, attempt)

    def delete(self, key: str) -> None:
        """Remove the object; removing one that does not exist is not an error (S3 semantics)."""
        import obstore

        _check_key(key)
        try:
            self._call("delete", key, lambda store: obstore.delete(store, key))
        except RemoteNotFoundError:  # GCS answers 404 where S3 answers 204
            pass
