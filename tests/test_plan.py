"""EpochPlan: one batch arithmetic for every loader, disjoint covering ranks, elastic resume.

The in-process rank simulation runs real fastload DataLoaders (``num_workers=0``, one per
simulated rank); the worker-process variant and the torchrun 2 -> 1 resume are below.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fastload.transforms as T
from fastload.data.dataset import ImageFolder
from fastload.data.loader import DataLoader
from fastload.data.order import Order
from fastload.data.plan import ORDER_VERSION, EpochPlan, RankIndices
from fastload.data.sampler import DistributedEpochSampler
from fastload.train import check_batch_geometry

from _data_helpers import Indices, make_pack


def _targets(batches) -> list[int]:
    return [int(t) for _, y in batches for t in y]


def _run(loader, limit: int | None = None) -> list[list[int]]:
    out = []
    for images, targets in loader:
        out.append(targets.tolist())
        if limit is not None and len(out) >= limit:
            break
    return out


plans = st.fixed_dictionaries({
    "num_samples": st.integers(0, 90), "world_size": st.integers(1, 5), "batch_size": st.integers(1, 9),
    "drop_last": st.booleans(), "seed": st.integers(0, 2**31), "shuffle": st.booleans(),
    "order_version": st.sampled_from([1, ORDER_VERSION]),  # the dealing holds under either order
})


@settings(max_examples=150, deadline=None)
@given(p=plans, epoch=st.integers(0, 30))
def test_ranks_are_disjoint_cover_the_epoch_and_agree_on_batches(p, epoch):
    n, w, b = p["num_samples"], p["world_size"], p["batch_size"]
    ranks = [EpochPlan(rank=r, **p) for r in range(w)]
    counts = {pl.num_batches() for pl in ranks}
    assert len(counts) == 1, "every rank gets the same number of batches"
    parts = [pl.indices(epoch) for pl in ranks]
    assert len({len(x) for x in parts}) == 1
    allidx = np.concatenate(parts)
    padded = sum(pl.num_padded() for pl in ranks)
    if p["drop_last"]:
        assert padded == 0 and len(np.unique(allidx)) == len(allidx)
        assert n - len(allidx) < w * b  # the tail of the order and incomplete batches
        assert all(len(x) % b == 0 for x in parts)
    elif n:
        assert set(allidx.tolist()) == set(range(n))
        assert len(allidx) - n == padded
        if n >= w:
            assert padded == (-n) % w  # at most world_size - 1 repeats
        # the padding is each rank's last samples: leaving it out counts every sample once
        kept = np.concatenate([x[: len(x) - pl.num_padded()] for x, pl in zip(parts, ranks)])
        assert sorted(kept.tolist()) == list(range(n))
    # check_batch_geometry uses the same count whenever it accepts the geometry
    try:
        assert check_batch_geometry(n, batch_size=b, world_size=w, drop_last=p["drop_last"]) == counts.pop()
    except ValueError:
        assert n < b * w or EpochPlan(**p).num_batches() == 0


@settings(max_examples=60, deadline=None)
@given(p=plans.filter(lambda p: p["num_samples"] > 0), epoch=st.integers(0, 5))
def test_every_loader_yields_the_plans_batches(p, epoch):
    """fastload's DataLoader (each simulated rank) and the torch sampler give exactly the plan."""
    n, w = p["num_samples"], p["world_size"]
    for r in range(w):
        plan = EpochPlan(rank=r, **p)
        if p["order_version"] == ORDER_VERSION:
            loader = DataLoader(Indices(n), p["batch_size"], num_workers=0, distributed=(r, w), seed=p["seed"],
                                shuffle=p["shuffle"], drop_last=p["drop_last"], pin_memory=False)
        else:
            loader = DataLoader(Indices(n), plan=plan, num_workers=0, pin_memory=False)
        assert len(loader) == plan.num_batches() == loader.batches_left()
        loader.set_epoch(epoch)
        got = _run(loader)
        assert len(got) == plan.num_batches()
        assert sum(got, []) == plan.indices(epoch).tolist()
        sampler = DistributedEpochSampler(n, seed=p["seed"], shuffle=p["shuffle"], rank=r, world_size=w,
                                          drop_last=p["drop_last"])
        sampler.set_epoch(epoch)
        assert len(sampler) == plan.replace(batch_size=1).num_batches()
        if p["order_version"] == ORDER_VERSION:
            assert list(sampler) == plan.replace(batch_size=1).indices(epoch).tolist()


@settings(max_examples=25, deadline=None)
@given(world=st.integers(1, 5), batch=st.integers(1, 13), drop_last=st.booleans(), accum=st.integers(1, 3))
def test_dali_fastload_make_loader_and_check_batch_geometry_agree(aug_pack, world, batch, drop_last, accum):
    """Every loader over a real pack, on every rank, and check_batch_geometry count the same
    batches (constructing the DALI loader builds no pipeline)."""
    pytest.importorskip("nvidia.dali")
    from fastload.gpu.dali import DALILoader
    from fastload.loaders import make_loader

    ds = ImageFolder(aug_pack, T.RandomResizedCrop(16))  # the ring path
    n = len(ds)
    want = EpochPlan(n, batch_size=batch, world_size=world, drop_last=drop_last).num_batches()
    for r in range(world):
        kw = dict(seed=1, drop_last=drop_last, distributed=(r, world))
        counts = {len(DataLoader(ds, batch, num_workers=0, **kw))}
        if want:
            counts.add(len(DALILoader(aug_pack, batch, device="cpu", crop=16, **kw)))
            counts.add(len(make_loader(aug_pack, backend="cpu", batch_size=batch, crop=16, device="cpu",
                                       num_workers=0, **kw)))
        else:
            with pytest.raises(ValueError, match="make no batch"):
                DALILoader(aug_pack, batch, device="cpu", crop=16, **kw)
        assert counts == {want}
    try:
        assert check_batch_geometry(n, batch_size=batch, world_size=world, accum_steps=accum,
                                    drop_last=drop_last) == want
    except ValueError as exc:
        assert n < batch * world * accum or want < accum, exc


def _elastic(n, seed, shuffle, drop_last, epoch, w1, b1, k, w2, b2, workers=0, dataset=None):
    """Run ``k`` batches on ``w1`` simulated ranks, checkpoint (rank 0's state), resume on
    ``w2`` ranks with batch size ``b2``; return (first part per rank, rest per rank, state)."""
    dataset = Indices(n) if dataset is None else dataset
    kw = dict(seed=seed, shuffle=shuffle, drop_last=drop_last, num_workers=workers, pin_memory=False)
    first, states = [], []
    for r in range(w1):
        with DataLoader(dataset, b1, distributed=(r, w1), **kw) as loader:
            loader.set_epoch(epoch)
            first.append(_run(loader, k) if k else [])
            states.append(loader.state_dict())
    assert all(s == states[0] for s in states), "a position is global: every rank saves the same state"
    rest = []
    for r in range(w2):
        with DataLoader(dataset, b2, distributed=(r, w2), **kw) as loader:
            loader.load_state_dict(states[0])
            loader.set_epoch(epoch)  # what a training loop does on restart: must not rewind
            rest.append(_run(loader))
            assert loader.epoch == epoch + 1  # the epoch ended; the next iteration moves on
    return first, rest, states[0]


@settings(max_examples=80, deadline=None)
@given(n=st.integers(1, 70), seed=st.integers(0, 1000), shuffle=st.booleans(), drop_last=st.booleans(),
       epoch=st.integers(0, 3), w1=st.integers(1, 4), w2=st.integers(1, 4), b1=st.integers(1, 6),
       b2=st.integers(1, 6), k=st.integers(0, 8))
def test_resume_on_another_world_size_covers_the_rest_exactly_once(n, seed, shuffle, drop_last, epoch, w1, w2,
                                                                    b1, b2, k):
    k = min(k, EpochPlan(n, batch_size=b1, world_size=w1, drop_last=drop_last).num_batches())
    first, rest, state = _elastic(n, seed, shuffle, drop_last, epoch, w1, b1, k, w2, b2)
    seen = Counter(sum((sum(x, []) for x in first), []))
    resumed = Counter(sum((sum(x, []) for x in rest), []))
    position = state["order"]["position"]
    order = EpochPlan(n, seed=seed, shuffle=shuffle).order(epoch)
    # the first part is exactly a prefix of the epoch's order (up to its own padding)
    assert set(seen) == set(order[: min(position, n)].tolist())
    both = seen + resumed
    tail = [EpochPlan(n, batch_size=b2, world_size=w2, rank=r, drop_last=drop_last, seed=seed, shuffle=shuffle)
            for r in range(w2)]
    if drop_last:
        assert max(both.values(), default=1) == 1, "drop_last: nothing is read twice"
        assert n - sum(both.values()) < max(w1 * b1, w2 * b2)
    else:
        assert set(both) == set(range(n)), "every sample of the epoch is read"
        repeats = sum(both.values()) - n
        if position > n:  # the first part finished the epoch, padding included; nothing is left
            assert resumed == Counter()
            assert repeats == sum(EpochPlan(n, batch_size=b1, world_size=w1, rank=r).num_padded() for r in range(w1))
        else:
            assert repeats == sum(pl.num_padded(position) for pl in tail)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 60), seed=st.integers(0, 1000), drop_last=st.booleans(), w=st.integers(1, 4),
       b=st.integers(1, 5), k=st.integers(0, 6))
def test_resume_on_the_same_world_reproduces_the_run(n, seed, drop_last, w, b, k):
    k = min(k, EpochPlan(n, batch_size=b, world_size=w, drop_last=drop_last).num_batches())
    first, rest, _ = _elastic(n, seed, True, drop_last, 2, w, b, k, w, b)
    for r in range(w):
        full = EpochPlan(n, batch_size=b, world_size=w, rank=r, seed=seed, drop_last=drop_last)
        assert sum(first[r] + rest[r], []) == full.indices(2).tolist()


@pytest.fixture(scope="module")
def aug_pack(sample_tree, tmp_path_factory):
    return make_pack(sample_tree, tmp_path_factory.mktemp("plan") / "jpeg", payload="jpeg")


@pytest.mark.parametrize("w1,w2", [(2, 1), (1, 3), (3, 2), (2, 2)])
def test_elastic_resume_with_worker_processes_serves_the_same_pixels(aug_pack, w1, w2):
    """Real worker processes on the ring path, W -> W': the resumed ranks serve exactly the
    rest of the epoch, each sample with the pixels the uninterrupted run gives it
    (augmentation depends on (seed, epoch, index) only, not on rank, batch or worker)."""
    ds = ImageFolder(aug_pack, T.Compose([T.RandomResizedCrop((24, 32)), T.RandomHorizontalFlip()]))
    n = len(ds)
    ref = {}
    with DataLoader(ds, 4, num_workers=2, seed=9, pin_memory=False) as loader:
        loader.set_epoch(1)
        idx = loader.plan.indices(1)
        for b, (x, _) in enumerate(loader):
            ref.update(zip(loader.plan.batch(idx, b).tolist(), x.clone()))
    assert len(ref) == n
    state = None
    for r in range(w1):
        with DataLoader(ds, 3, num_workers=2, seed=9, distributed=(r, w1), pin_memory=False) as a:
            a.set_epoch(1)
            idx = a.plan.indices(1)
            for b, (x, _) in enumerate(a):
                for img, i in zip(x, a.plan.batch(idx, b).tolist()):
                    assert torch.equal(img, ref[i])
                if b == 1:
                    break
            state = a.state_dict()
    position = state["order"]["position"]
    assert position == 2 * 3 * w1
    served = []
    for r in range(w2):
        with DataLoader(ds, 5, num_workers=2, seed=9, distributed=(r, w2), pin_memory=False) as c:
            c.load_state_dict(state)
            idx = c.plan.indices(1, position)
            got = [x.clone() for x, _ in c]
            assert sum(len(x) for x in got) == len(idx)
            for img, i in zip(torch.cat(got) if got else [], idx.tolist()):
                assert torch.equal(img, ref[i])
            served += idx.tolist()
    order = EpochPlan(n, seed=9).order(1)
    assert set(served) == set(order[position:].tolist())
    assert len(served) - (n - position) == sum(
        EpochPlan(n, batch_size=5, world_size=w2, rank=r).num_padded(position) for r in range(w2))


OLD_STATE = {"epoch": 2, "batches": 2, "seed": 3, "batch_size": 4, "num_samples": 30, "world_size": 2, "rank": 1,
             "shuffle": True, "drop_last": False}  # fastload <= 0.1: batches per rank, order version 1


def test_old_per_rank_batch_states_still_load():
    """A state saved before positions were global (epoch + batches per rank) and before the
    pointwise order resumes at the same place in the order it was saved under (order_version=1),
    the very permutation fastload <= 0.2 drew."""
    plan = EpochPlan(30, batch_size=4, seed=3, rank=1, world_size=2, order_version=1)
    loader = DataLoader(Indices(30), plan=plan, num_workers=0, pin_memory=False)
    loader.load_state_dict(OLD_STATE)
    legacy = np.random.default_rng([3, 2]).permutation(30)
    assert plan.indices(2).tolist() == legacy[1::2].tolist()  # rank 1 of 2: odd positions
    assert sum(_run(loader), []) == plan.indices(2)[8:].tolist()
    assert loader.epoch == 3
    assert sum(_run(loader), []) == plan.indices(3).tolist()


def test_an_old_order_state_is_refused_mid_epoch_and_accepted_at_an_epoch_boundary():
    loader = DataLoader(Indices(30), 4, num_workers=0, distributed=(1, 2), seed=3, pin_memory=False)
    with pytest.raises(ValueError, match=r"mid-epoch under order_version=1 .*order_version=1\), or restart"):
        loader.load_state_dict(OLD_STATE)
    with pytest.raises(ValueError, match="order_version=1"):
        loader.load_state_dict({"order": {**loader.state_dict()["order"], "order_version": 1, "position": 8}})
    loader.load_state_dict({**OLD_STATE, "batches": 0})  # nothing of epoch 2 read: any order covers it
    assert sum(_run(loader), []) == loader.plan.indices(2).tolist()
    finished = {**OLD_STATE, "batches": 4}  # every batch of epoch 2 read: the next epoch starts afresh
    loader.load_state_dict(finished)
    assert _run(loader) == [] and loader.epoch == 3
    assert sum(_run(loader), []) == loader.plan.indices(3).tolist()


def test_a_state_from_another_order_is_refused():
    a = DataLoader(Indices(30), 4, num_workers=0, seed=3, pin_memory=False)
    for change in ({"seed": 4}, {"num_samples": 31}, {"shuffle": False}, {"plan": "block-shuffle"},
                   {"order_version": 1, "position": 8}):  # another algorithm's order: refused mid-epoch
        state = a.state_dict()
        state["order"].update(change)
        with pytest.raises(ValueError, match=next(iter(change))):
            a.load_state_dict(state)


@pytest.mark.slow
def test_real_torchrun_two_ranks_then_resume_on_one(tmp_path):
    torchrun = shutil.which("torchrun")
    cmd = [torchrun] if torchrun else [sys.executable, "-m", "torch.distributed.run"]
    script = Path(__file__).with_name("ddp_elastic_resume.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    n = 41
    for world, phase in ((2, "first"), (1, "rest")):
        proc = subprocess.run(
            [*cmd, "--standalone", f"--nproc_per_node={world}", str(script), str(tmp_path), str(n), phase],
            capture_output=True, text=True, timeout=240, env=env,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
    first = [np.load(tmp_path / f"first{r}.npy") for r in range(2)]
    rest = np.load(tmp_path / "rest0.npy")
    assert all(len(f) == 3 * 4 for f in first)  # 3 batches of 4 on each of the 2 ranks
    both = Counter(np.concatenate([*first, rest]).tolist())
    assert set(both) == set(range(n)) and max(both.values()) == 1  # one rank: no padding


@pytest.mark.slow
def test_real_torchrun_trainer_checkpointed_on_two_ranks_finishes_the_epoch_on_one(tmp_path):
    """The Trainer's mid-epoch checkpoint is elastic too: 2 ranks train 2 steps of epoch 0
    (2 x 2 x 64 images), 1 rank resumes and trains exactly the rest of the epoch's images."""
    import json

    from _train_helpers import pack_digits

    tr, _ = pack_digits(tmp_path)
    n = len(ImageFolder(tr))
    torchrun = shutil.which("torchrun")
    cmd = [torchrun] if torchrun else [sys.executable, "-m", "torch.distributed.run"]
    script = Path(__file__).with_name("ddp_trainer_elastic.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for world, phase in ((2, "first"), (1, "rest")):
        proc = subprocess.run([*cmd, "--standalone", f"--nproc_per_node={world}", str(script), str(tr),
                               str(tmp_path), phase], capture_output=True, text=True, timeout=300, env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
    first = json.loads((tmp_path / "first.json").read_text())
    rest = json.loads((tmp_path / "rest.json").read_text())
    assert first == {**first, "world_size": 2, "samples": 2 * 2 * 64, "steps": 2, "completed": False}
    assert rest["world_size"] == 1 and rest["completed"] and rest["epoch_after"] == 1
    assert rest["samples"] == n - first["samples"]  # one rank: no padding, every image once
    assert rest["steps"] == -(-(n - first["samples"]) // 64) and rest["total_steps"] == 2 + rest["steps"]


# -- the order, computed a batch at a time --------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(p=plans, epoch=st.integers(0, 30), data=st.data())
def test_lazy_indices_batches_and_positions_equal_the_arrays(p, epoch, data):
    """Every way of asking for part of the order (at, take, batch_indices, indices_view) gives
    exactly the slice of the whole arrays it stands for."""
    plan = EpochPlan(rank=data.draw(st.integers(0, p["world_size"] - 1)), **p)
    n = plan.num_samples
    order = plan.order(epoch)
    assert order.dtype == np.int64 and sorted(order.tolist()) == list(range(n))
    start = data.draw(st.integers(0, n + 3))
    idx = plan.indices(epoch, start)
    assert np.array_equal(idx, plan.indices(epoch, start, order=order))
    view = plan.indices_view(epoch, start)
    assert isinstance(view, RankIndices) and len(view) == len(idx) == plan.samples_per_rank(start)
    assert np.array_equal(np.asarray(view), idx) and view.tolist() == idx.tolist() == list(view)
    a, b = data.draw(st.integers(-3, len(idx) + 3)), data.draw(st.integers(-3, len(idx) + 3))
    step = data.draw(st.sampled_from([None, 1, 2, -1]))
    assert np.array_equal(view[a:b:step], idx[a:b:step])
    assert np.array_equal(plan.take(epoch, a, b, start), idx[max(a, 0) : max(b, 0)])
    if len(idx):
        i = data.draw(st.integers(-len(idx), len(idx) - 1))
        assert view[i] == idx[i]
    with pytest.raises(IndexError):
        view[len(idx)]
    for bno in range(plan.num_batches(start) + 1):
        assert np.array_equal(plan.batch_indices(epoch, bno, start), plan.batch(idx, bno))
        assert np.array_equal(plan.batch(view, bno), plan.batch(idx, bno))
    if n:
        pos = np.asarray(data.draw(st.lists(st.integers(0, 3 * n), max_size=20)), dtype=np.int64)
        assert np.array_equal(plan.at(epoch, pos), order[pos % n])


def test_order_version_1_is_the_permutation_older_fastloads_drew():
    for n, seed, epoch in ((30, 3, 2), (1000, 7, 0), (1, 0, 5)):
        plan = EpochPlan(n, seed=seed, order_version=1)
        want = np.random.default_rng([seed, epoch]).permutation(n)
        assert np.array_equal(plan.order(epoch), want)
        assert np.array_equal(plan.replace(world_size=3, rank=2).indices(epoch), np.resize(want, n + 2)[2::3])
    # version 2 is another order (the test pins it); shuffle=False is 0..N-1 in both
    assert not np.array_equal(EpochPlan(1000, seed=7).order(0), EpochPlan(1000, seed=7, order_version=1).order(0))
    assert EpochPlan(10, seed=0).order(0).tolist() == [5, 2, 4, 7, 3, 9, 1, 6, 8, 0]
    for version in (1, ORDER_VERSION):
        assert EpochPlan(5, shuffle=False, order_version=version).order(3).tolist() == [0, 1, 2, 3, 4]
    for bad in (0, 3, 1.0, True):
        with pytest.raises(ValueError, match="order_version"):
            EpochPlan(5, order_version=bad)


def test_epochs_and_seeds_give_different_orders():
    orders = {EpochPlan(1000, seed=s).order(e).tobytes() for s in range(4) for e in range(4)}
    assert len(orders) == 16


@pytest.mark.timeout(60)
def test_an_epoch_of_a_trillion_samples_starts_at_the_cost_of_a_batch():
    """Nothing is O(N): a plan, an Order, the torch sampler and fastload's DataLoader (per-sample
    path) over 10**12 samples hand out batches at once (a permutation of them could not even be
    allocated), and the next epoch's first batch is as cheap as any other."""
    n = 10**12
    plan = EpochPlan(n, batch_size=64, seed=1, world_size=8, rank=5)
    first = plan.batch_indices(3, 0)
    assert len(first) == 64 and len(set(first.tolist())) == 64 and ((first >= 0) & (first < n)).all()
    assert np.array_equal(plan.at(3, 5 + 8 * np.arange(64)), first)
    last = plan.num_batches() - 1
    assert len(plan.batch_indices(3, last)) == plan.batch_len(last)
    order = Order(plan)
    order.set_epoch(3)
    epoch, b, view = order.begin()
    assert (epoch, b, len(view)) == (3, 0, plan.samples_per_rank())
    assert np.array_equal(order.batch(view, 0), first)
    sampler = DistributedEpochSampler(n, seed=1, world_size=8, rank=5)
    sampler.set_epoch(3)
    it = iter(sampler)
    assert [next(it) for _ in range(64)] == first.tolist()
    state = sampler.state_dict()
    again = DistributedEpochSampler(n, seed=1, world_size=8, rank=5)
    again.load_state_dict(state)
    assert next(iter(again)) == plan.batch_indices(3, 1)[0]
    loader = DataLoader(Indices(n), plan=plan, num_workers=0, pin_memory=False)
    loader.set_epoch(3)
    got = _run(loader, 2)
    assert got == [first.tolist(), plan.batch_indices(3, 1).tolist()]
    state = loader.state_dict()
    assert state["order"]["position"] == 2 * 64 * 8
    loader.load_state_dict({"order": {**state["order"], "position": plan.consumed(last)}})  # the last batch
    assert _run(loader) == [plan.batch_indices(3, last).tolist()]
    assert loader.epoch == 4 and _run(loader, 1) == [plan.batch_indices(4, 0).tolist()]


def test_a_plan_pickles_without_its_per_epoch_cache():
    import pickle

    plan = EpochPlan(1000, batch_size=8, seed=2)
    first = plan.batch_indices(3, 1)
    legacy = plan.replace(order_version=1)
    legacy.order(3)  # caches the whole order of epoch 3
    for p in (plan, legacy):
        copy = pickle.loads(pickle.dumps(p))
        assert copy == p and "_epoch_memo" not in copy.__dict__
        assert len(pickle.dumps(p)) < 1000
    assert np.array_equal(pickle.loads(pickle.dumps(plan)).batch_indices(3, 1), first)
