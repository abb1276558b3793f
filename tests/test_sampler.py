"""Sample order, DDP sharding and resume: epoch_indices and DistributedEpochSampler."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastload.data.order import Order
from fastload.data.plan import EpochPlan
from fastload.data.sampler import DistributedEpochSampler, epoch_indices


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(0, 300), world=st.integers(1, 4), drop_last=st.booleans(),
    shuffle=st.booleans(), seed=st.integers(0, 2**31), epoch=st.integers(0, 50),
)
def test_ranks_get_equal_counts_and_cover_the_dataset(n, world, drop_last, shuffle, seed, epoch):
    parts = [
        epoch_indices(n, seed=seed, epoch=epoch, shuffle=shuffle, rank=r, world_size=world, drop_last=drop_last)
        for r in range(world)
    ]
    counts = {len(p) for p in parts}
    assert len(counts) == 1, "every rank must see the same number of samples"
    (count,) = counts
    assert count == (n // world if drop_last else -(-n // world))
    allidx = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    assert allidx.dtype == np.int64
    assert ((allidx >= 0) & (allidx < max(n, 1))).all()
    if drop_last:
        # nothing repeated; only fewer than `world` samples dropped
        assert len(np.unique(allidx)) == len(allidx) == count * world
        assert n - len(allidx) < world
    else:
        # every sample seen at least once; the padding repeats at most world-1 extra samples
        # (more only when the dataset is smaller than the world)
        assert set(allidx.tolist()) == set(range(n))
        assert len(allidx) - n == (-n) % world


def test_order_is_a_pure_function_of_seed_and_epoch():
    a = epoch_indices(1000, seed=7, epoch=3)
    assert np.array_equal(a, epoch_indices(1000, seed=7, epoch=3))
    assert not np.array_equal(a, epoch_indices(1000, seed=7, epoch=4))
    assert not np.array_equal(a, epoch_indices(1000, seed=8, epoch=3))
    assert sorted(a.tolist()) == list(range(1000))
    assert np.array_equal(epoch_indices(10, shuffle=False), np.arange(10))
    assert np.array_equal(epoch_indices(10, shuffle=False, rank=1, world_size=3), [1, 4, 7, 0])


@pytest.mark.parametrize(
    "kwargs",
    [dict(n=-1), dict(n=5, world_size=0), dict(n=5, rank=2, world_size=2), dict(n=5, seed=-1), dict(n=5, epoch=-2)],
)
def test_bad_arguments_raise_value_error(kwargs):
    n = kwargs.pop("n")
    with pytest.raises(ValueError):
        epoch_indices(n, **kwargs)


def test_sampler_matches_epoch_indices_and_advances_epochs():
    s = DistributedEpochSampler(50, seed=1, rank=1, world_size=3)
    assert len(s) == EpochPlan(50, world_size=3, rank=1).samples_per_rank() == 17
    first = list(s)
    assert first == epoch_indices(50, seed=1, epoch=0, rank=1, world_size=3).tolist()
    second = list(s)  # a finished epoch moves on by itself
    assert second == epoch_indices(50, seed=1, epoch=1, rank=1, world_size=3).tolist()
    s.set_epoch(0)
    assert list(s) == first


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 120), world=st.integers(1, 4), stop=st.integers(0, 40), epoch=st.integers(0, 5))
def test_sampler_resumes_exactly_mid_epoch(n, world, stop, epoch):
    ref = DistributedEpochSampler(n, seed=5, rank=world - 1, world_size=world)
    ref.set_epoch(epoch)
    full = list(ref)
    stop = min(stop, len(full))
    s = DistributedEpochSampler(n, seed=5, rank=world - 1, world_size=world)
    s.set_epoch(epoch)
    it = iter(s)
    seen = [next(it) for _ in range(stop)]
    state = s.state_dict()
    restarted = DistributedEpochSampler(n, seed=5, rank=world - 1, world_size=world)
    restarted.load_state_dict(state)
    restarted.set_epoch(epoch)  # what a training loop does on restart: must not rewind
    assert seen + list(restarted) == full


def test_load_state_refuses_a_different_run():
    s = DistributedEpochSampler(10, seed=1)
    with pytest.raises(ValueError, match="seed"):
        s.load_state_dict({"order": {**s.state_dict()["order"], "seed": 2}})
    with pytest.raises(ValueError, match="num_samples="):
        s.load_state_dict({"order": {**s.state_dict()["order"], "num_samples": 11}})
    with pytest.raises(ValueError, match="shuffle="):
        s.load_state_dict({"order": {**s.state_dict()["order"], "shuffle": False}})
    with pytest.raises(ValueError, match="position"):
        s.load_state_dict({"order": {**s.state_dict()["order"], "position": -1}})


@pytest.mark.slow
def test_real_torchrun_two_ranks_cover_the_dataset(tmp_path):
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    torchrun = shutil.which("torchrun")
    cmd = [torchrun] if torchrun else [sys.executable, "-m", "torch.distributed.run"]
    script = Path(__file__).with_name("ddp_loader_indices.py")
    n, batch = 37, 4
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [*cmd, "--standalone", "--nproc_per_node=2", str(script), str(tmp_path), str(n), str(batch)],
        capture_output=True, text=True, timeout=180, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    r0, r1 = np.load(tmp_path / "rank0.npy"), np.load(tmp_path / "rank1.npy")
    assert r0.shape == r1.shape == (2, 19)  # ceil(37 / 2) each, padded by wrapping
    for epoch in range(2):
        union = np.concatenate([r0[epoch], r1[epoch]])
        assert set(union.tolist()) == set(range(n))
        assert np.array_equal(r0[epoch], epoch_indices(n, seed=3, epoch=epoch, rank=0, world_size=2))
        assert np.array_equal(r1[epoch], epoch_indices(n, seed=3, epoch=epoch, rank=1, world_size=2))
    assert not np.array_equal(r0[0], r0[1])


def test_sampler_iterates_and_resumes_across_its_chunks():
    """The sampler computes the order a chunk at a time: the stream, and a resume in the middle
    of a chunk or right at its end, match the whole epoch's indices."""
    n, world = 20_000, 2
    want = epoch_indices(n, seed=9, epoch=4, rank=1, world_size=world).tolist()
    for stop in (1, 4095, 4096, 4097, 9999):
        s = DistributedEpochSampler(n, seed=9, rank=1, world_size=world)
        s.set_epoch(4)
        it = iter(s)
        seen = [next(it) for _ in range(stop)]
        restarted = DistributedEpochSampler(n, seed=9, rank=1, world_size=world)
        restarted.load_state_dict(s.state_dict())
        assert seen + list(restarted) == want
    assert list(s) == epoch_indices(n, seed=9, epoch=4, rank=1, world_size=world).tolist()[stop:]


def test_a_sampler_state_from_the_old_order_finishes_its_epoch_under_that_order():
    """A state saved by fastload <= 0.2 (order_version 1, the full permutation) mid-epoch is refused
    with a message naming order_version; a plan of that version resumes it exactly."""
    s = DistributedEpochSampler(100, seed=2)
    old = {"order": {**s.state_dict()["order"], "position": 30}}
    del old["order"]["order_version"]
    with pytest.raises(ValueError, match="order_version=1"):
        s.load_state_dict(old)
    order = Order(EpochPlan(100, seed=2, order_version=1))
    order.load_state_dict(old, what="sampler")
    assert np.asarray(order.begin()[2]).tolist() == np.random.default_rng([2, 0]).permutation(100)[30:].tolist()
