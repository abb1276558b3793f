"""Both backends over a pack in object storage, against a real S3 server (SeaweedFS on
127.0.0.1): DALILoader and make_loader read an ``s3://`` pack exactly as they read the local
one, the block shuffle covers every sample once per epoch and resumes elastically, and
tools/train.py trains from a URL prefix.

The packs hold one image per class, so a label names its sample: a batch's labels are the
dataset indices it holds.
"""

from __future__ import annotations

import fcntl
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from fastload.config import PackConfig
from fastload.data.order import find_order_state
from fastload.data.plan import BlockShufflePlan, EpochPlan
from fastload.loaders import make_loader
from fastload.pack import pack
from fastload.storage import open_pack

from _data_helpers import collect

from _dali_helpers import needs_dali
BACKENDS = ["cpu", pytest.param("dali", marks=needs_dali)]
N = 18  # samples (= classes) in each pack
CFG = {
    "jpeg": dict(payload="jpeg", shard_size=3000),  # many small shards
    "raw": dict(payload="raw", size=(32, 32), backend="hdf5", shard_size=8000),
}
SCRIPT = Path(__file__).resolve().parents[1] / "tools" / "train.py"


@pytest.fixture(scope="module")
def unique_tree(tmp_path_factory) -> Path:
    """18 classes of one 48x64 JPEG each."""
    from fastload.sample import make_image_folder

    return make_image_folder(tmp_path_factory.mktemp("unique_tree"), num_classes=N, per_class=1, size=(48, 64),
                             seed=2, workers=1)


@pytest.fixture(scope="module")
def local_packs(unique_tree, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("remote_loaders_local")
    for name, cfg in CFG.items():
        pack(unique_tree, root / name, config=PackConfig(workers=1, progress=False, **cfg))
    reader = open_pack(root / "jpeg")
    assert reader.index.labels.tolist() == list(range(N)) and len(reader.shard_entries) > 4
    return {name: root / name for name in CFG}


@pytest.fixture(scope="module")
def remote_packs(unique_tree, s3_server, tmp_path_factory) -> dict[str, str]:
    """The same packs, packed to ``s3://<bucket>/<name>`` (byte-identical: packing is deterministic)."""
    s3_server.start()
    bucket = s3_server.create_bucket("remote-loaders")
    staging = tmp_path_factory.mktemp("remote_loaders_staging")
    urls = {}
    for name, cfg in CFG.items():
        urls[name] = f"{bucket}/{name}"
        pack(unique_tree, urls[name], config=PackConfig(workers=1, progress=False, **cfg), staging=staging / name,
             endpoint_url=s3_server.endpoint_url, storage_options=s3_server.storage_options)
    return urls


def _remote(s3_server, tmp_path, **kw) -> dict:
    return dict(endpoint_url=s3_server.endpoint_url, storage_options=s3_server.storage_options,
                cache_dir=tmp_path / "cache", **kw)


def _dali(root, batch_size, **kw):
    from fastload.dali import DALILoader

    return DALILoader(root, batch_size, device="cpu", num_threads=1, py_num_workers=1, **kw)


def _kw(backend) -> dict:
    if backend == "dali":  # one CPU thread and one Python worker on a 2-core machine
        return {"num_workers": 1, "loader_kwargs": {"py_num_workers": 1}}
    return {"num_workers": 0}


def _plan(loader):
    """The EpochPlan behind make_loader's result (DALILoader, or a CUDAPrefetcher around a DataLoader)."""
    return getattr(loader, "loader", loader).plan


def _held_shards(cache_dir: Path) -> list[str]:
    """Shards some process holds in the node cache (a reader keeps LOCK_SH on the shard's lock file)."""
    held = []
    for lock in (cache_dir / "locks").rglob("*.lock"):
        with open(lock, "rb") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                held.append(lock.name)
            else:
                fcntl.flock(f, fcntl.LOCK_UN)
    return held


# -- DALILoader ---------------------------------------------------------------------------------


@needs_dali
def test_dali_over_a_url_yields_the_local_packs_batches(local_packs, remote_packs, s3_server, tmp_path):
    url = remote_packs["jpeg"]
    local = _dali(local_packs["jpeg"], 4, crop=32, seed=3)
    remote = _dali(url, 4, crop=32, seed=3, **_remote(s3_server, tmp_path))
    assert remote.root == url and f"{url!r}" in repr(remote)  # a str: Path() would mangle "s3://"
    plan = EpochPlan(N, batch_size=4, seed=3)
    for epoch in (0, 1):
        a, b = collect(local), collect(remote)
        assert [y.tolist() for _, y in b] == [y.tolist() for _, y in a]
        assert sum((y.tolist() for _, y in b), []) == plan.indices(epoch).tolist()
        assert all(torch.equal(x, x2) for (x, _), (x2, _) in zip(a, b))  # the same bytes, the same pipeline
    cache = open_pack(url, **_remote(s3_server, tmp_path)).remote.cache
    assert cache.stats().shards == len(open_pack(local_packs["jpeg"]).shard_entries)  # all through the cache
    # a worker holds the shards it reads while the pipeline runs; closing it releases them
    it = iter(remote)
    next(it)
    assert _held_shards(tmp_path / "cache")
    del it
    remote.close()
    assert _held_shards(tmp_path / "cache") == []


@needs_dali
def test_dali_raw_payload_over_a_url_gives_the_stored_pixels(local_packs, remote_packs, s3_server, tmp_path):
    reader = open_pack(local_packs["raw"])
    stored = np.stack([np.frombuffer(reader.get(i), np.uint8).reshape(32, 32, 3) for i in range(N)])
    kw = dict(crop=32, train=False, resize_ratio=1.0, seed=11, channels_last=False)
    remote = _dali(remote_packs["raw"], 5, **kw, **_remote(s3_server, tmp_path))
    local = _dali(local_packs["raw"], 5, **kw)
    assert remote.payload == "raw"
    for epoch in (0, 1):
        got = collect(remote)
        images = torch.cat([x for x, _ in got]).numpy()
        order = EpochPlan(N, batch_size=5, seed=11).indices(epoch)
        assert torch.cat([y for _, y in got]).tolist() == order.tolist()
        np.testing.assert_allclose(images * 255.0, stored[order].transpose(0, 3, 1, 2), atol=1e-3)
        assert all(torch.equal(x, x2) for (x, _), (x2, _) in zip(got, collect(local)))


@needs_dali
def test_dali_refuses_fork_for_a_url_and_a_plan_of_another_size(local_packs, remote_packs):
    from fastload.dali import DALILoader

    with pytest.raises(ValueError, match="spawn"):  # obstore's runtime does not survive fork
        DALILoader(remote_packs["jpeg"], 4, device="cpu", py_start_method="fork")
    with pytest.raises(ValueError, match="num_samples=5"):
        _dali(local_packs["jpeg"], None, plan=EpochPlan(5, batch_size=2))
    with pytest.raises(ValueError, match="batch_size"):
        _dali(local_packs["jpeg"], None)


@needs_dali
def test_dali_follows_a_plan(local_packs):
    starts = tuple(int(x) for x in open_pack(local_packs["jpeg"]).shard_starts)
    plan = BlockShufflePlan(N, batch_size=4, seed=5, shard_starts=starts, window=2)
    loader = _dali(local_packs["jpeg"], None, plan=plan, crop=24)
    assert loader.plan is plan and loader.batch_size == 4 and loader.seed == 5 and len(loader) == 5
    assert [t for _, y in loader for t in y.tolist()] == plan.indices(0).tolist()
    assert find_order_state(loader.state_dict())["plan"] == "block-shuffle"


# -- make_loader ---------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_make_loader_over_a_url_equals_the_local_loader(local_packs, remote_packs, s3_server, tmp_path, backend):
    kw = dict(backend=backend, batch_size=4, crop=24, seed=5, device="cpu", drop_last=False, **_kw(backend))
    local = make_loader(local_packs["jpeg"], **kw)
    remote = make_loader(remote_packs["jpeg"], **kw, **_remote(s3_server, tmp_path, cache_limit="10MB",
                                                               retry_seconds=5.0))
    for epoch in (0, 1):
        a, b = collect(local), collect(remote)
        assert [y.tolist() for _, y in b] == [y.tolist() for _, y in a]
        assert sum((y.tolist() for _, y in b), []) == EpochPlan(N, batch_size=4, seed=5).indices(epoch).tolist()
        assert all(torch.equal(x, x2) for (x, _), (x2, _) in zip(a, b))
    pack = remote.remote if backend == "dali" else remote.loader.dataset.reader.remote
    passed = pack.store.retry_seconds  # the option reached the store (a setting, not a timing)
    assert passed == 5.0
    cache = pack.cache
    assert cache.stats().shards == len(open_pack(local_packs["jpeg"]).shard_entries) > 1
    assert cache.limit_bytes == 10**7 and cache.directory == tmp_path / "cache"


@pytest.mark.parametrize("backend", BACKENDS)
def test_block_shuffle_is_a_seeded_permutation_per_epoch(local_packs, remote_packs, s3_server, tmp_path, backend):
    def make(seed):
        return make_loader(remote_packs["jpeg"], backend=backend, batch_size=4, crop=24, seed=seed, device="cpu",
                           drop_last=False, shuffle="block", shuffle_window=2, **_kw(backend),
                           **_remote(s3_server, tmp_path))

    loader = make(7)
    plan = _plan(loader)
    starts = tuple(int(x) for x in open_pack(local_packs["jpeg"]).shard_starts)
    assert plan == BlockShufflePlan(N, batch_size=4, seed=7, shard_starts=starts, window=2)
    epochs = []
    for epoch in (0, 1):
        got = [t for _, y in loader for t in y.tolist()]
        assert sorted(got) == list(range(N))  # every sample once, none padded
        assert got == plan.indices(epoch).tolist()
        # the first window's samples are those of its two shards
        first = set(plan.shard_order(epoch)[:2].tolist())
        k = sum(starts[s + 1] - starts[s] for s in first)
        assert {int(np.searchsorted(starts, i, side="right")) - 1 for i in got[:k]} == first
        epochs.append(got)
    assert epochs[0] != epochs[1]
    assert [t for _, y in make(7) for t in y.tolist()] == epochs[0]  # deterministic for a seed
    assert [t for _, y in make(8) for t in y.tolist()] != epochs[0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_block_shuffle_resumes_elastically_from_two_ranks_to_one(remote_packs, s3_server, tmp_path, backend):
    def make(rank, world):
        return make_loader(remote_packs["jpeg"], backend=backend, batch_size=2, crop=24, seed=3, device="cpu",
                           drop_last=False, shuffle="block", shuffle_window=3, distributed=(rank, world),
                           **_kw(backend), **_remote(s3_server, tmp_path))

    first = []
    ranks = [make(0, 2), make(1, 2)]
    for loader in ranks:
        for k, (_, y) in enumerate(loader):
            first += y.tolist()
            if k == 1:
                break
    state = ranks[0].state_dict()
    assert find_order_state(state)["position"] == 8 and find_order_state(state)["plan"] == "block-shuffle"
    assert find_order_state(ranks[1].state_dict())["position"] == 8
    one = make(0, 1)
    one.load_state_dict(state)
    rest = [t for _, y in one for t in y.tolist()]
    assert len(first) == 8 and sorted(first + rest) == list(range(N))  # the rest, each sample once
    assert first + rest != list(range(N))
    whole = _plan(make(0, 1)).indices(0).tolist()
    assert rest == whole[8:]  # the one-rank order from position 8 on
    full = make_loader(remote_packs["jpeg"], backend=backend, batch_size=2, crop=24, seed=3, device="cpu",
                       **_kw(backend), **_remote(s3_server, tmp_path))
    with pytest.raises(ValueError, match="plan"):
        full.load_state_dict(state)  # a full shuffle cannot continue a block-shuffled epoch


@pytest.mark.parametrize("backend", BACKENDS)
def test_block_shuffle_runs_in_a_cache_smaller_than_the_pack(local_packs, remote_packs, s3_server, tmp_path, backend):
    sizes = [e.bytes for e in open_pack(local_packs["jpeg"]).shard_entries]
    limit = 5 * max(sizes)  # one-shard windows: the window, the next and the shards loaded ahead
    assert limit < sum(sizes)
    loader = make_loader(remote_packs["jpeg"], backend=backend, batch_size=2, crop=24, seed=1, device="cpu",
                         drop_last=False, shuffle="block", shuffle_window=1, **_kw(backend),
                         **_remote(s3_server, tmp_path, cache_limit=limit))
    for _ in range(2):
        assert sorted(t for _, y in loader for t in y.tolist()) == list(range(N))
    cache = open_pack(remote_packs["jpeg"], **_remote(s3_server, tmp_path, cache_limit=limit)).remote.cache
    assert 0 < cache.stats().bytes <= limit
    if backend == "cpu":  # read in this process (and its download-ahead helper): they counted the evictions
        used = loader.loader.dataset.reader.remote.stats()
        assert used.evictions > 0 and used.peak_bytes <= limit


def test_dali_source_starts_the_downloads_of_the_next_batches(remote_packs, s3_server, tmp_path):
    from fastload.gpu.dali import PackBatchSource

    reader = open_pack(remote_packs["jpeg"], **_remote(s3_server, tmp_path))
    plan = EpochPlan(N, batch_size=2, seed=4)
    source = PackBatchSource(remote_packs["jpeg"], labels=reader.index.labels, shapes=None, plan=plan,
                             remote=reader.remote, ahead=2)
    source = pickle.loads(pickle.dumps(source))  # as a DALI worker gets it
    source.download_ahead(0, 1)  # batch 1 and the two after it
    want = {reader.shard_entries[k].file
            for k in plan.shards_ahead(0, first_batch=1, batches=3, shard_starts=reader.shard_starts)}
    assert len(want) < len(reader.shard_entries)
    deadline = time.monotonic() + 60
    while (cached := {p.name for p in (tmp_path / "cache" / "shards").rglob("*.lmdb")}) != want:
        assert cached < want and time.monotonic() < deadline, (cached, want)
        time.sleep(0.05)  # background downloads: nothing was read yet


def test_bad_shuffle_arguments(local_packs):
    with pytest.raises(ValueError, match="shuffle must be a bool, 'full' or 'block'"):
        make_loader(local_packs["jpeg"], batch_size=2, shuffle="sideways")
    with pytest.raises(ValueError, match="shuffle_window"):
        make_loader(local_packs["jpeg"], batch_size=2, shuffle="block", shuffle_window=0)
    loader = make_loader(local_packs["jpeg"], batch_size=2, shuffle="full", num_workers=0, device="cpu")
    assert type(_plan(loader)) is EpochPlan and _plan(loader).shuffle


# -- tools/train.py ----------------------------------------------------------------------------


def _train(*args, timeout=600):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=env)


def _remote_args(s3_server, cache: Path) -> list[str]:
    opts = [a for k, v in s3_server.storage_options.items() for a in ("--storage-option", f"{k}={v}")]
    return ["--endpoint-url", s3_server.endpoint_url, *opts, "--cache-dir", str(cache)]


def test_train_script_on_a_url_without_packs_fails_in_one_line(s3_bucket, s3_server, tmp_path):
    r = _train(f"{s3_bucket}/nothing", "--epochs", "1", "--workers", "0", *_remote_args(s3_server, tmp_path / "c"))
    assert r.returncode == 1
    assert f"{s3_bucket}/nothing/train" in r.stderr and "manifest" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_train_script_trains_from_a_url_prefix(s3_bucket, s3_server, tmp_path, backend):
    from _train_helpers import write_digits_tree

    src_train, src_val = write_digits_tree(tmp_path / "digits")
    prefix = f"{s3_bucket}/digits"
    for split, src in (("train", src_train), ("val", src_val)):
        pack(src, f"{prefix}/{split}", config=PackConfig(payload="png", workers=1, progress=False, shard_size=50_000),
             staging=tmp_path / "staging" / split, endpoint_url=s3_server.endpoint_url,
             storage_options=s3_server.storage_options)
    assert len(open_pack(f"{prefix}/train", **_remote(s3_server, tmp_path)).shard_entries) > 8
    ckpt = tmp_path / "ck.pt"
    r = _train(prefix + "/", "--arch", "small_cnn", "--batch-size", "64", "--lr", "0.2", "--crop", "32",
               "--min-scale", "0.7", "--workers", "1", "--epochs", "1", "--checkpoint", ckpt, "--backend", backend,
               "--shuffle", "block", "--shuffle-window", "4", "--cache-limit", "20MB",
               *_remote_args(s3_server, tmp_path / "cache"))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "1347 training / 450 validation images, 10 classes" in r.stdout
    assert "block shuffle over 4 shards" in r.stdout
    assert [ln.split(":")[0] for ln in r.stdout.splitlines() if ln.startswith("epoch ")] == ["epoch 0"]
    state = torch.load(ckpt, weights_only=False)
    assert find_order_state(state["loader"])["plan"] == "block-shuffle"
    assert any((tmp_path / "cache" / "shards").rglob("*.lmdb"))  # read through the node cache
