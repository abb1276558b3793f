"""Packs in object storage, end to end against a real S3 server (SeaweedFS on 127.0.0.1):
pack to a bucket, read it back pixel-identical to a local pack through the node cache, with
worker processes, a cache limit and the block-shuffle plan; a corrupted object is caught."""

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
from fastload.data.plan import BlockShufflePlan
from fastload.errors import FastloadError, PackError
from fastload.pack import pack
from fastload.storage import open_pack

from _data_helpers import collect

from _remote_helpers import AUG, CFG



def _remote(s3_server, tmp_path, **kw) -> dict:
    return dict(endpoint_url=s3_server.endpoint_url, storage_options=s3_server.storage_options,
                cache_dir=tmp_path / "cache", **kw)


def _upload(sample_tree, url, s3_server, tmp_path, **cfg):
    return pack(sample_tree, url, config=PackConfig(**{**CFG, **cfg}), staging=tmp_path / "staging",
                endpoint_url=s3_server.endpoint_url, storage_options=s3_server.storage_options)


def test_pack_to_a_bucket_and_read_back_identical_to_the_local_pack(sample_tree, local_pack, s3_bucket, s3_server,
                                                                    tmp_path):
    url = f"{s3_bucket}/train"
    summary = _upload(sample_tree, url, s3_server, tmp_path)
    assert summary.packed == 24 and summary.shards > 1 and str(summary.dest) == url
    assert not (tmp_path / "staging").exists()  # the staging copy is gone once uploaded
    store = s3_server.remote_store(url)
    keys = {k for k, _ in store.list()}
    local = open_pack(local_pack)
    assert keys == {e.file for e in local.shard_entries} | {"index.fli", "manifest.json"}
    for e in local.shard_entries:  # byte-identical shards: packing is deterministic
        assert store.head(e.file) == e.bytes
    remote = ImageFolder(url, AUG, **_remote(s3_server, tmp_path))
    ref = ImageFolder(local_pack, AUG)
    assert remote.classes == ref.classes and remote.targets.tolist() == ref.targets.tolist()
    assert list(remote.samples) == list(ref.samples)
    for i in range(len(ref)):
        assert np.array_equal(remote.load(i, epoch=1), ref.load(i, epoch=1))
    stats = remote.reader.remote.stats()
    assert stats.downloads == len(local.shard_entries) and stats.shards == len(local.shard_entries)
    # inspect and verify take the URL
    from fastload.commands.inspect import describe
    from fastload.commands.verify import verify_pack

    kw = _remote(s3_server, tmp_path)
    assert describe(url, **kw)["num_samples"] == 24
    assert verify_pack(url, **kw) == ([], 24)


def test_a_second_pack_to_the_same_url_needs_overwrite(sample_tree, s3_bucket, s3_server, tmp_path):
    url = f"{s3_bucket}/p"
    _upload(sample_tree, url, s3_server, tmp_path)
    with pytest.raises(PackError, match="already holds a finished pack"):
        _upload(sample_tree, url, s3_server, tmp_path)
    summary = _upload(sample_tree, url, s3_server, tmp_path, overwrite=True, payload="png", shard_size=1 << 30)
    assert summary.shards == 1
    keys = {k for k, _ in s3_server.remote_store(url).list()}
    assert keys == {"shard-00000.lmdb", "index.fli", "manifest.json"}  # the old shards are gone


def test_parts_from_two_processes_make_one_remote_pack(sample_tree, local_pack, s3_bucket, s3_server, tmp_path):
    url = f"{s3_bucket}/parts"
    code = (
        "import sys; from fastload.pack import pack; from fastload.config import PackConfig; "
        f"pack({str(sample_tree)!r}, {url!r}, config=PackConfig(**{CFG!r}, part=int(sys.argv[1]), parts=2), "
        f"staging=sys.argv[2], endpoint_url={s3_server.endpoint_url!r}, storage_options={s3_server.storage_options!r})"
    )
    procs = [subprocess.Popen([sys.executable, "-c", code, str(i), str(tmp_path / f"st{i}")]) for i in (0, 1)]
    assert [p.wait(timeout=300) for p in procs] == [0, 0]
    both = ImageFolder(url, **_remote(s3_server, tmp_path))
    ref = ImageFolder(local_pack)
    assert len(both) == len(ref) and both.targets.tolist() == ref.targets.tolist()
    assert np.array_equal(both.load(len(ref) - 1), ref.load(len(ref) - 1))


@pytest.mark.parametrize("workers", [0, 2])
def test_loader_over_a_remote_pack_equals_the_local_loader(sample_tree, local_pack, s3_bucket, s3_server, tmp_path,
                                                           workers):
    url = f"{s3_bucket}/train"
    _upload(sample_tree, url, s3_server, tmp_path)
    ref = collect(DataLoader(ImageFolder(local_pack, AUG), 5, num_workers=0, seed=3, pin_memory=False))
    ds = ImageFolder(url, AUG, **_remote(s3_server, tmp_path))
    with DataLoader(ds, 5, num_workers=workers, seed=3, pin_memory=False) as loader:
        if workers:
            assert loader.multiprocessing_context == "spawn"  # obstore's runtime does not survive fork
        got = collect(loader)
    assert len(got) == len(ref)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(got, ref))
    stats = ds.reader.remote.stats()
    assert stats.shards == len(ds.reader.shard_entries)  # every shard fetched once for the node


def test_cache_limit_holds_with_the_block_shuffle_plan(sample_tree, s3_bucket, s3_server, tmp_path):
    url = f"{s3_bucket}/train"
    _upload(sample_tree, url, s3_server, tmp_path)
    probe = open_pack(url, **_remote(s3_server, tmp_path))
    sizes = [e.bytes for e in probe.shard_entries]
    limit = 3 * max(sizes)  # far less than the pack
    assert limit < sum(sizes)
    ds = ImageFolder(url, AUG, **_remote(s3_server, tmp_path, cache_limit=limit))
    ds.reader.max_open = 1  # hold only the shard being read
    plan = BlockShufflePlan(len(ds), batch_size=4, seed=1, shard_starts=tuple(int(x) for x in ds.reader.shard_starts),
                            window=1)
    seen = []
    cache = ds.reader.remote.cache
    with DataLoader(ds, plan=plan, num_workers=0, pin_memory=False, prefetch=1) as loader:
        for _, y in loader:
            seen += y.tolist()
            assert cache.stats().bytes <= limit
    assert sorted(seen) == sorted(ds.targets.tolist())
    used = ds.reader.remote.stats()  # this process and its object-store helper (download-ahead)
    assert used.evictions > 0 and used.peak_bytes <= limit


def test_a_corrupted_object_is_caught_by_its_checksum(sample_tree, s3_bucket, s3_server, tmp_path):
    url = f"{s3_bucket}/train"
    _upload(sample_tree, url, s3_server, tmp_path)
    store = s3_server.remote_store(url)
    manifest = json.loads(store.get_bytes("manifest.json"))
    victim = manifest["shards"][1]["file"]
    data = bytearray(store.get_bytes(victim))
    data[len(data) // 2] ^= 0xFF  # one flipped byte, same size
    store.put_bytes(victim, bytes(data))
    ds = ImageFolder(url, **_remote(s3_server, tmp_path))
    first_of_victim = int(ds.reader.shard_starts[1])
    assert ds.load(0) is not None  # shard 0 is fine
    with pytest.raises(FastloadError, match="SHA-256"):
        ds.load(first_of_victim)
    assert not any(p.name == victim for p in (tmp_path / "cache").rglob("*") if p.is_file())  # never cached
    from fastload.commands.verify import verify_pack

    problems, _ = verify_pack(url, **_remote(s3_server, tmp_path))
    assert len(problems) == 1 and victim in problems[0] and "SHA-256" in problems[0]


def test_cli_pack_inspect_verify_with_a_url(sample_tree, s3_bucket, s3_server, tmp_path):
    url = f"{s3_bucket}/cli"
    opts = ["--endpoint-url", s3_server.endpoint_url] + [
        a for k, v in s3_server.storage_options.items() for a in ("--storage-option", f"{k}={v}")]
    run = lambda *a: subprocess.run([sys.executable, "-m", "fastload", *a], capture_output=True, text=True,  # noqa: E731
                                    timeout=300)
    r = run("pack", str(sample_tree), url, "--payload", "png", "--quiet", "--staging", str(tmp_path / "st"), *opts)
    assert r.returncode == 0, r.stderr
    assert f"-> {url}" in r.stdout
    r = run("inspect", url, "--json", "--cache-dir", str(tmp_path / "c"), *opts)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["num_samples"] == 24
    r = run("verify", url, "--cache-dir", str(tmp_path / "c"), *opts)
    assert r.returncode == 0 and r.stdout.startswith("OK"), r.stderr
    r = run("inspect", f"{s3_bucket}/nothing-here", "--cache-dir", str(tmp_path / "c"), *opts)
    assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1 and "manifest" in r.stderr


def test_an_interrupted_upload_resumes_from_what_the_bucket_holds(sample_tree, s3_bucket, s3_server, tmp_path):
    from fastload.storage.remote_pack import upload_pack

    url = f"{s3_bucket}/resume"
    staging = tmp_path / "staging"
    pack(sample_tree, staging, config=PackConfig(**CFG))  # what an interrupted `pack SRC URL` leaves behind
    store = s3_server.remote_store(url)
    local = open_pack(staging)
    first = local.shard_entries[0]
    store.upload(staging / first.file, first.file)  # the upload got this far
    with pytest.raises(FastloadError, match="no manifest.json"):
        open_pack(url, **_remote(s3_server, tmp_path))  # an unfinished remote pack never looks complete
    # rerunning the command reuses the finished staging pack and sends only what is missing
    sent = []
    total = upload_pack(staging, store, log=sent.append)
    assert first.file not in sent and len(sent) == len(local.shard_entries)  # the other shards + the index
    assert total == sum(e.bytes for e in local.shard_entries[1:]) + local.index_entries[0].bytes + len(
        (staging / "manifest.json").read_bytes())
    summary = pack(sample_tree, url, config=PackConfig(**{**CFG, "overwrite": True}), staging=staging,
                   endpoint_url=s3_server.endpoint_url, storage_options=s3_server.storage_options)
    assert summary.packed == 24
    assert len(ImageFolder(url, **_remote(s3_server, tmp_path))) == 24


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_block_shuffle_with_workers_fits_two_windows_and_a_shard_per_worker(sample_tree, s3_bucket, s3_server,
                                                                            tmp_path):
    """The documented minimum cache for a block shuffle with workers: two windows' shards (a
    window boundary, or an epoch's last window and the next epoch's first) plus one download
    per worker, with the readers' default bound; every worker pins only its current batch's
    shards, so epochs run without a CacheError and the cache never passes its limit."""
    url = f"{s3_bucket}/train"
    _upload(sample_tree, url, s3_server, tmp_path, shard_size=9000)  # 3-4 records per shard
    probe = open_pack(url, **_remote(s3_server, tmp_path))
    sizes = [e.bytes for e in probe.shard_entries]
    window, workers = 2, 2
    limit = (2 * window + workers) * max(sizes)
    assert limit < sum(sizes)
    ds = ImageFolder(url, AUG, **_remote(s3_server, tmp_path, cache_limit=limit))
    plan = BlockShufflePlan(len(ds), batch_size=2, seed=1, window=window,
                            shard_starts=tuple(int(x) for x in ds.reader.shard_starts))
    assert plan.batch_size < min(np.diff(ds.reader.shard_starts)) * window  # batches smaller than a window
    cache = ds.reader.remote.cache
    with DataLoader(ds, plan=plan, num_workers=workers, pin_memory=False) as loader:
        for epoch in range(6):  # without unpinning, the workers' pinned shards overflow it within 6
            seen = []
            for _, y in loader:
                seen += y.tolist()
                assert cache.stats().bytes <= limit
            assert sorted(seen) == sorted(ds.targets.tolist()), epoch
