"""Packs in Azure Blob Storage (``az://``), end to end against a real Azurite server on
127.0.0.1: the same code paths as S3 (obstore picks the store from the URL), checked for real
because Azure differs in what matters here: block-blob uploads, listing, ranged reads and the
error codes for a wrong key or a missing container."""

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
from fastload.storage.remote import RemoteAccessError, RemoteStore

from _data_helpers import collect

from _remote_helpers import AUG, CFG


@pytest.fixture(scope="module")
def azure():
    from _azure_server import AzureServer, find_azurite

    if find_azurite() is None:
        pytest.skip("Azurite not found: bash tools/install.sh --test installs it with npm (or set FASTLOAD_AZURITE)")
    server = AzureServer()
    try:
        yield server.start()
    finally:
        server.close()


@pytest.fixture(scope="module")
def az_pack(azure, sample_tree, tmp_path_factory) -> str:
    """The sample tree packed into a fresh container, once for this module."""
    url = azure.create_container("packs") + "/train"
    staging = tmp_path_factory.mktemp("az_staging") / "st"
    pack(sample_tree, url, config=PackConfig(**CFG), staging=staging, storage_options=azure.storage_options)
    return url



def test_pack_to_azure_and_read_back_identical_to_the_local_pack(azure, az_pack, local_pack, tmp_path):
    store = RemoteStore(az_pack, storage_options=azure.storage_options)
    local = open_pack(local_pack)
    assert {k for k, _ in store.list()} == {e.file for e in local.shard_entries} | {"index.fli", "manifest.json"}
    for e in local.shard_entries:  # byte-identical shards
        assert store.head(e.file) == e.bytes
    remote = ImageFolder(az_pack, AUG, cache_dir=tmp_path / "cache", storage_options=azure.storage_options)
    ref = ImageFolder(local_pack, AUG)
    assert remote.classes == ref.classes and list(remote.samples) == list(ref.samples)
    for i in range(len(ref)):
        assert np.array_equal(remote.load(i, epoch=2), ref.load(i, epoch=2))
    assert remote.reader.remote.stats().downloads == len(local.shard_entries)


def test_loader_with_spawned_workers_over_azure(azure, az_pack, local_pack, tmp_path):
    ref = collect(DataLoader(ImageFolder(local_pack, AUG), 5, num_workers=0, seed=4, pin_memory=False))
    ds = ImageFolder(az_pack, AUG, cache_dir=tmp_path / "cache", storage_options=azure.storage_options)
    with DataLoader(ds, 5, num_workers=2, seed=4, pin_memory=False) as loader:
        got = collect(loader)
    assert len(got) == len(ref)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(got, ref))


def test_a_corrupted_blob_is_caught_and_verify_names_it(azure, sample_tree, tmp_path):
    url = azure.create_container("corrupt") + "/p"
    pack(sample_tree, url, config=PackConfig(**CFG), staging=tmp_path / "st", storage_options=azure.storage_options)
    store = RemoteStore(url, storage_options=azure.storage_options)
    victim = json.loads(store.get_bytes("manifest.json"))["shards"][0]["file"]
    data = bytearray(store.get_bytes(victim))
    data[len(data) // 3] ^= 0x55
    store.put_bytes(victim, bytes(data))
    ds = ImageFolder(url, cache_dir=tmp_path / "cache", storage_options=azure.storage_options)
    with pytest.raises(FastloadError, match="SHA-256"):
        ds.load(0)
    from fastload.commands.verify import verify_pack

    problems, _ = verify_pack(url, cache_dir=tmp_path / "c2", storage_options=azure.storage_options)
    assert len(problems) == 1 and victim in problems[0]


def test_a_wrong_key_and_a_missing_container_are_one_line_errors(azure, az_pack, tmp_path):
    bad = {**azure.storage_options, "access_key": "d3Jvbmcga2V5IGZvciB0aGUgdGVzdA=="}
    with pytest.raises(RemoteAccessError) as info:
        open_pack(az_pack, cache_dir=tmp_path / "c", storage_options=bad, retry_seconds=0)
    assert len(str(info.value).splitlines()) == 1
    opts = [a for k, v in azure.storage_options.items() for a in ("--storage-option", f"{k}={v}")]
    r = subprocess.run([sys.executable, "-m", "fastload", "inspect", "az://no-such-container/x",
                        "--cache-dir", str(tmp_path / "c"), *opts], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "az://no-such-container/x" in r.stderr
