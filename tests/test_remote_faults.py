"""Remote packs under faults, against a real S3 server: the server restarted mid-epoch, the
server gone for good (a bounded, named error), two ranks sharing one node cache (one download
per shard), and elastic resume over a remote pack."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

import pytest
import torch

from fastload.config import PackConfig
from fastload.data.dataset import ImageFolder
from fastload.data.loader import DataLoader
from fastload.errors import FastloadError
from fastload.pack import pack

from _data_helpers import collect

from _remote_helpers import AUG, CFG


@pytest.fixture
def remote_pack(sample_tree, s3_bucket, s3_server, tmp_path) -> str:
    url = f"{s3_bucket}/train"
    pack(sample_tree, url, config=PackConfig(**CFG), staging=tmp_path / "staging",
         endpoint_url=s3_server.endpoint_url, storage_options=s3_server.storage_options)
    return url


def _kw(s3_server, tmp_path, **extra) -> dict:
    return dict(cache_dir=tmp_path / "cache", endpoint_url=s3_server.endpoint_url,
                storage_options=s3_server.storage_options, **extra)


@pytest.mark.slow
def test_server_restarted_mid_epoch_the_epoch_completes_unchanged(remote_pack, s3_server, tmp_path):
    ref = collect(DataLoader(ImageFolder(remote_pack, AUG, **_kw(s3_server, tmp_path / "ref")), 3, num_workers=0,
                             seed=5, pin_memory=False))
    ds = ImageFolder(remote_pack, AUG, **_kw(s3_server, tmp_path))
    ds.reader.max_open = 1
    got = []
    with DataLoader(ds, 3, num_workers=0, seed=5, prefetch=1, pin_memory=False) as loader:
        it = iter(loader)
        got.append(tuple(t.clone() for t in next(it)))
        s3_server.stop()  # shards not fetched yet must now wait for the server
        restart = threading.Timer(3.0, s3_server.start)
        restart.start()
        try:
            got += [tuple(t.clone() for t in b) for b in it]
        finally:
            restart.join()
    assert len(got) == len(ref)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(got, ref))


@pytest.mark.slow
def test_server_gone_gives_a_bounded_error_naming_the_shard(remote_pack, s3_server, tmp_path):
    ds = ImageFolder(remote_pack, **_kw(s3_server, tmp_path, retry_seconds=2.0))
    first_of_last = int(ds.reader.shard_starts[-2])
    s3_server.stop()
    try:
        with pytest.raises(FastloadError) as err:
            ds.load(first_of_last)
    finally:
        s3_server.start()
    msg = str(err.value)
    last = ds.reader.shard_entries[-1].file
    assert f"{remote_pack}/{last}" in msg and "\n" not in msg


@pytest.mark.slow
def test_two_ranks_on_one_node_share_the_cache_with_one_download_per_shard(remote_pack, s3_server, tmp_path):
    torchrun = shutil.which("torchrun")
    cmd = [torchrun] if torchrun else [sys.executable, "-m", "torch.distributed.run"]
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [*cmd, "--standalone", "--nproc_per_node=2", str(Path(__file__).with_name("ddp_remote_cache.py")), remote_pack,
         str(tmp_path / "cache"), s3_server.endpoint_url, json.dumps(s3_server.storage_options), str(out)],
        capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert sum(r["downloads"] for r in ranks) == ranks[0]["shards"]  # one download per shard for the node
    labels = Counter(ranks[0]["labels"] + ranks[1]["labels"])
    ref = ImageFolder(remote_pack, **_kw(s3_server, tmp_path))
    assert sum(labels.values()) == len(ref) + sum(r["padded"] for r in ranks)


def test_elastic_resume_over_a_remote_pack(remote_pack, s3_server, tmp_path):
    ds = ImageFolder(remote_pack, AUG, **_kw(s3_server, tmp_path))
    n = len(ds)
    states, seen = [], []
    for r in range(2):
        with DataLoader(ds, 3, num_workers=0, seed=7, distributed=(r, 2), pin_memory=False) as loader:
            loader.set_epoch(1)
            idx = loader.plan.indices(1)
            for b, _ in enumerate(loader):
                seen += loader.plan.batch(idx, b).tolist()
                if b == 1:
                    break
            states.append(loader.state_dict())
    assert states[0] == states[1]
    with DataLoader(ds, 5, num_workers=2, seed=7, pin_memory=False) as rest:
        rest.load_state_dict(states[0])
        position = states[0]["order"]["position"]
        idx = rest.plan.indices(1, position)
        assert sum(len(y) for _, y in rest) == len(idx) == n - position
    assert sorted(seen + idx.tolist()) == list(range(n))
