"""RemoteStore against a real S3 server (SeaweedFS ``weed mini``, started once per session by the
``s3_server`` fixture) and against tiny misbehaving HTTP servers on 127.0.0.1: no mocks."""

from __future__ import annotations

import hashlib
import http.server
import json
import multiprocessing
import os
import pickle
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from fastload.errors import FastloadError
from fastload.storage.remote import (
    RemoteAccessError,
    RemoteError,
    RemoteIntegrityError,
    RemoteNotFoundError,
    RemoteStore,
    is_url,
    join_url,
    local_path,
)

MiB = 1 << 20
REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent


def _one_line(exc: BaseException) -> str:
    text = str(exc)
    assert "\n" not in text, text
    return text


# ---- URLs --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path, expected",
    [
        ("s3://bucket/pack", True), ("S3://bucket", True), ("gs://b/p", True), ("az://acct/c/p", True),
        ("abfss://c@acct.dfs.core.windows.net/p", True), ("https://host/p", True), ("http://h/p", True),
        ("file:///data/pack", False), ("/data/pack", False), ("data/s3://x", False), ("C:\\data", False),
        (Path("/data/pack"), False), ("memory:///", False),
    ],
)
def test_is_url(path, expected):
    assert is_url(path) is expected


def test_join_url_and_local_path():
    assert join_url("s3://b/p/", "/shards/0.lmdb") == "s3://b/p/shards/0.lmdb"
    assert join_url("s3://b", "k") == "s3://b/k"
    assert join_url("s3://b/p/", "") == "s3://b/p"
    assert local_path("file:///data/my%20pack") == Path("/data/my pack")
    assert local_path("/data/pack") == Path("/data/pack")
    with pytest.raises(ValueError, match="remote URL"):
        local_path("s3://b/p")
    with pytest.raises(ValueError, match="another host"):
        local_path("file://server/share")


def test_bad_arguments_fail_at_construction(s3_server):
    with pytest.raises(ValueError, match="not an object-store URL"):
        RemoteStore("/local/pack")
    with pytest.raises(ValueError, match="chunk_size"):
        s3_server.remote_store("s3://bkt/p", chunk_size=MiB)
    with pytest.raises(ValueError, match="endpoint_url is for S3"):
        RemoteStore("gs://bkt/p", endpoint_url="http://127.0.0.1:1")
    with pytest.raises(ValueError, match=r"s3://bkt/p: bad storage option.*no_such_option"):
        s3_server.remote_store("s3://bkt/p", storage_options={"no_such_option": 1})
    store = s3_server.remote_store("s3://bkt/p")
    for key in ("", "/abs", "a/../b"):
        with pytest.raises(ValueError, match="relative path"):
            store.get_bytes(key)


# ---- round trips ---------------------------------------------------------------------------------


def test_bytes_round_trip_head_list_delete(s3_server, s3_bucket):
    store = s3_server.remote_store(f"{s3_bucket}/pack/")
    assert store.url == f"{s3_bucket}/pack"
    assert store.list() == []
    store.put_bytes("manifest.json", b'{"v": 1}')
    store.put_bytes("shards/000.lmdb", bytearray(b"\x00" * 1000))
    store.put_bytes("shards/001.lmdb", memoryview(b"x" * 10))
    assert store.get_bytes("manifest.json") == b'{"v": 1}'
    assert store.head("shards/000.lmdb") == 1000
    assert store.head("shards/nope") is None
    assert store.list() == [("manifest.json", 8), ("shards/000.lmdb", 1000), ("shards/001.lmdb", 10)]
    assert store.list("shards") == [("shards/000.lmdb", 1000), ("shards/001.lmdb", 10)]
    store.put_bytes("manifest.json", b"{}")  # overwrite
    assert store.get_bytes("manifest.json") == b"{}"
    store.delete("shards/000.lmdb")
    store.delete("shards/000.lmdb")  # deleting a missing key is fine
    assert store.head("shards/000.lmdb") is None
    assert [k for k, _ in store.list()] == ["manifest.json", "shards/001.lmdb"]
    # the prefix really is a prefix: a sibling store sees none of it
    assert s3_server.remote_store(f"{s3_bucket}/other").list() == []


@pytest.mark.parametrize("size", [0, 1234, 11 * MiB + 7], ids=["empty", "small", "multipart"])
def test_file_round_trip(s3_server, s3_bucket, tmp_path, size):
    import obstore

    store = s3_server.remote_store(f"{s3_bucket}/pack", chunk_size=5 * MiB, max_concurrency=2)
    data = os.urandom(size)
    src = tmp_path / "src.bin"
    src.write_bytes(data)
    store.upload(src, "shards/000.bin")
    assert store.head("shards/000.bin") == size
    if size > store.chunk_size:  # S3 marks a multipart object's ETag with its part count
        assert obstore.head(store.client, "shards/000.bin")["e_tag"].strip('"').endswith("-3")
    dest = tmp_path / "dest.bin"
    store.download("shards/000.bin", dest, size=size, sha256=hashlib.sha256(data).hexdigest())
    assert dest.read_bytes() == data
    dest2 = tmp_path / "dest2.bin"
    store.download("shards/000.bin", dest2)  # no checks asked for
    assert dest2.read_bytes() == data


def test_upload_of_missing_local_file_names_it(s3_server, s3_bucket, tmp_path):
    store = s3_server.remote_store(s3_bucket)
    with pytest.raises(FileNotFoundError, match="nope.bin"):
        store.upload(tmp_path / "nope.bin", "k")


# ---- integrity -----------------------------------------------------------------------------------


def test_corrupt_object_fails_the_hash_check_and_leaves_no_file(s3_server, s3_bucket, tmp_path):
    store = s3_server.remote_store(f"{s3_bucket}/pack")
    data = os.urandom(100_000)
    good = hashlib.sha256(data).hexdigest()
    corrupt = bytearray(data)
    corrupt[5000] ^= 0xFF
    store.put_bytes("shard.bin", bytes(corrupt))  # same size, one flipped bit
    dest = tmp_path / "shard.bin"
    with pytest.raises(RemoteIntegrityError) as info:
        store.download("shard.bin", dest, size=len(data), sha256=good)
    msg = _one_line(info.value)
    assert f"{s3_bucket}/pack/shard.bin" in msg and "SHA-256 mismatch" in msg
    assert not dest.exists()


def test_wrong_size_fails_before_downloading(s3_server, s3_bucket, tmp_path):
    store = s3_server.remote_store(f"{s3_bucket}/pack")
    store.put_bytes("shard.bin", b"x" * 100)
    dest = tmp_path / "shard.bin"
    dest.write_bytes(b"stale")
    with pytest.raises(RemoteIntegrityError, match=r"100 bytes, expected 101"):
        store.download("shard.bin", dest, size=101)
    assert not dest.exists()
    assert isinstance(RemoteIntegrityError("x"), FastloadError)


# ---- errors that are not retried -----------------------------------------------------------------


@pytest.mark.timeout(20)  # retry_seconds=30: a retried 404 would run into this limit
def test_missing_object_is_one_line_naming_the_url(s3_server, s3_bucket, tmp_path):
    store = s3_server.remote_store(f"{s3_bucket}/pack", retry_seconds=30)
    with pytest.raises(RemoteNotFoundError) as info:
        store.get_bytes("manifest.json")
    assert _one_line(info.value) == f"{s3_bucket}/pack/manifest.json does not exist"
    assert isinstance(info.value, FileNotFoundError) and isinstance(info.value, FastloadError)
    dest = tmp_path / "d.bin"
    with pytest.raises(RemoteNotFoundError, match="does not exist"):
        store.download("shards/0.lmdb", dest)
    assert not dest.exists()
    with pytest.raises(RemoteNotFoundError, match=r"s3://no-such-bucket-here/pack does not exist \(NoSuchBucket\)"):
        s3_server.remote_store("s3://no-such-bucket-here/pack").list()
    assert "gave up" not in str(info.value)  # a 404 is not retried


@pytest.mark.parametrize(
    "options",
    [{"secret_access_key": "wrong-secret"}, {"access_key_id": "nobody"}, {"skip_signature": True}],
    ids=["bad-secret", "unknown-key", "anonymous"],
)
@pytest.mark.timeout(20)  # retry_seconds=30: a retried 403 would run into this limit
def test_wrong_credentials_are_denied_at_once(s3_server, s3_bucket, options):
    s3_server.remote_store(s3_bucket).put_bytes("pack/manifest.json", b"{}")
    store = s3_server.remote_store(f"{s3_bucket}/pack", storage_options=options, retry_seconds=30)
    for call in (lambda: store.get_bytes("manifest.json"), lambda: store.put_bytes("x", b"1")):
        with pytest.raises(RemoteAccessError) as info:
            call()
        msg = _one_line(info.value)
        assert msg.startswith(f"access denied to {s3_bucket}/pack/") and "check credentials" in msg
        assert isinstance(info.value, PermissionError) and "gave up" not in msg  # not retried


# ---- transient faults ------------------------------------------------------------------------------


@pytest.mark.slow
def test_stopped_server_gives_one_remote_error_after_bounded_retries(s3_server, s3_bucket, tmp_path):
    store = s3_server.remote_store(f"{s3_bucket}/pack", retry_seconds=2)
    store.put_bytes("manifest.json", b"{}")
    s3_server.stop()
    try:
        for call in (lambda: store.get_bytes("manifest.json"), lambda: store.download("manifest.json", tmp_path / "m")):
            with pytest.raises(RemoteError) as info:
                call()
            msg = _one_line(info.value)
            assert f"{s3_bucket}/pack/manifest.json" in msg and "connection refused" in msg
            assert not isinstance(info.value, (RemoteNotFoundError, RemoteAccessError))
        assert not (tmp_path / "m").exists()
    finally:
        s3_server.start()


@pytest.mark.slow
def test_server_restarted_mid_sequence_is_retried_through(s3_server, s3_bucket, tmp_path):
    store = s3_server.remote_store(f"{s3_bucket}/pack", retry_seconds=60)
    data = os.urandom(200_000)
    store.put_bytes("a.bin", data)
    s3_server.stop()
    results: dict[str, object] = {}

    def client() -> None:  # runs while the server is down; the main thread restarts it
        try:
            results["get"] = store.get_bytes("a.bin")
            store.put_bytes("b.bin", b"after restart")
            results["list"] = store.list()
        except BaseException as exc:  # pragma: no cover - reported below
            results["error"] = exc

    t = threading.Thread(target=client)
    t.start()
    time.sleep(1.0)
    s3_server.start()  # same ports and data dir (and from the main thread, see _s3_server)
    t.join(90)
    assert not t.is_alive() and "error" not in results, results
    assert results["get"] == data
    assert results["list"] == [("a.bin", len(data)), ("b.bin", 13)]


class _Stall:
    """A TCP server that accepts connections and never answers."""

    def __enter__(self) -> int:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.conns: list[socket.socket] = []
        self.stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()
        return self.sock.getsockname()[1]

    def _accept(self) -> None:
        self.sock.settimeout(0.2)
        while not self.stop.is_set():
            try:
                self.conns.append(self.sock.accept()[0])
            except OSError:
                continue

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for c in self.conns:
            c.close()
        self.sock.close()


def test_stalled_server_times_out_instead_of_hanging():
    with _Stall() as port:
        store = RemoteStore(
            "s3://bkt/pack", endpoint_url=f"http://127.0.0.1:{port}", retry_seconds=1,
            storage_options={"access_key_id": "k", "secret_access_key": "s", "read_timeout": "500ms"},
        )
        with pytest.raises(RemoteError) as info:
            store.get_bytes("manifest.json")
    msg = _one_line(info.value)
    assert "s3://bkt/pack/manifest.json" in msg and "timed out" in msg and f"127.0.0.1:{port}" in msg


def test_server_errors_are_retried_then_reported():
    hits: list[str] = []

    class Unavailable(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the http.server API
            hits.append(self.path)
            body = b"<Error><Code>SlowDown</Code></Error>"
            self.send_response(503)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Unavailable)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        store = RemoteStore(
            "s3://bkt/pack", endpoint_url=f"http://127.0.0.1:{server.server_address[1]}", retry_seconds=1,
            storage_options={"access_key_id": "k", "secret_access_key": "s"},
        )
        with pytest.raises(RemoteError) as info:
            store.get_bytes("manifest.json")
    finally:
        server.shutdown()
        server.server_close()
    msg = _one_line(info.value)
    assert "s3://bkt/pack/manifest.json" in msg and "HTTP 503 Service Unavailable (SlowDown)" in msg
    assert "gave up after" in msg
    assert len(hits) > 1  # retried


def test_download_whose_body_breaks_off_is_resumed(tmp_path):
    data = os.urandom(3 * MiB)
    ranges: list[str | None] = []

    class BreaksOnce(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:  # noqa: N802 - the http.server API
            ranges.append(self.headers.get("Range"))
            body, status = data, 200
            if ranges[-1]:  # "bytes=a-b", inclusive
                a, b = (int(x) for x in ranges[-1].split("=")[1].split("-"))
                body, status = data[a : b + 1], 206
            self.send_response(status)
            if status == 206:
                self.send_header("Content-Range", f"bytes {a}-{b}/{len(data)}")
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Last-Modified", "Sun, 22 Nov 2026 16:48:07 GMT")
            self.send_header("ETag", '"v1"')
            self.end_headers()
            if len(ranges) == 1:  # the first response stops a third of the way in
                body = body[: len(body) // 3]
                self.close_connection = True
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), BreaksOnce)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        store = RemoteStore(
            "s3://bkt/pack", endpoint_url=f"http://127.0.0.1:{server.server_address[1]}", retry_seconds=5,
            storage_options={"access_key_id": "k", "secret_access_key": "s"},
        )
        dest = tmp_path / "shard.bin"
        store.download("shard.bin", dest, size=len(data), sha256=hashlib.sha256(data).hexdigest())
    finally:
        server.shutdown()
        server.server_close()
    assert dest.read_bytes() == data
    assert ranges[0] is None and ranges[1] is not None and ranges[1].startswith("bytes=")  # resumed, not restarted


# ---- processes ---------------------------------------------------------------------------------------


def test_pickles_small_without_its_client(s3_server, s3_bucket):
    store = s3_server.remote_store(f"{s3_bucket}/pack")
    store.put_bytes("k", b"v")
    blob = pickle.dumps(store)
    assert len(blob) < 2000
    clone = pickle.loads(blob)
    assert clone._store is None and clone.url == store.url
    assert clone.get_bytes("k") == b"v"
    assert "secret" not in repr(store)


def test_spawned_child_uses_a_pickled_store(s3_server, s3_bucket):
    store = s3_server.remote_store(f"{s3_bucket}/pack")
    store.put_bytes("k", b"from the parent")  # the parent has used obstore: spawn is still fine
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        assert pool.apply(store.get_bytes, ("k",)) == b"from the parent"
        pool.apply(store.put_bytes, ("child", b"from the child"))
    assert store.get_bytes("child") == b"from the child"


_FORK_SCRIPT = textwrap.dedent(
    """
    import json, multiprocessing, pickle, sys
    sys.path.insert(0, sys.argv[1])
    from _s3_server import S3Server
    from fastload.storage.remote import RemoteError, RemoteStore

    server = S3Server.__new__(S3Server)  # just the client options of the running server
    server.ports = {"s3.port": int(sys.argv[2])}
    store = server.remote_store(sys.argv[3])
    assert pickle.loads(pickle.dumps(store))._store is None
    ctx = multiprocessing.get_context("fork")

    def fork_call(fn, *args):
        with ctx.Pool(1) as pool:
            return pool.apply_async(fn, args).get(timeout=60)

    out = {"child": fork_call(store.get_bytes, "k").decode()}  # parent has done no I/O yet
    out["parent"] = store.get_bytes("k").decode()
    try:  # now obstore's runtime has run here: a forked child must fail fast, not hang
        fork_call(store.get_bytes, "k")
    except RemoteError as exc:
        out["after"] = str(exc)
    print(json.dumps(out))
    """
)


def test_forked_child_uses_the_store_and_fails_fast_once_the_parent_used_obstore(s3_server, s3_bucket):
    # In a fresh interpreter: this pytest process has long used obstore, so it cannot fork users.
    url = f"{s3_bucket}/pack"
    s3_server.remote_store(url).put_bytes("k", b"hello")
    out = subprocess.run(
        [sys.executable, "-c", _FORK_SCRIPT, str(TESTS), str(s3_server.ports["s3.port"]), url],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["child"] == "hello" and result["parent"] == "hello"
    assert "forked after its parent" in result["after"] and "spawn" in result["after"]
    assert f"{url}/k" in result["after"]


def test_import_fastload_does_not_import_obstore():
    code = (
        "import sys, json, fastload, fastload.storage.remote as r; "
        "r.is_url('s3://b/k'); "
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'obstore')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert json.loads(out.stdout) == []
