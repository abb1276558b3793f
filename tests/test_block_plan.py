"""BlockShufflePlan: a shard-windowed order under EpochPlan's dealing, and the shard helpers
(shard_of, shards_ahead, working_set) a download-ahead over a shard cache uses."""

from __future__ import annotations

import pickle
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastload.data.loader import DataLoader
from fastload.data.order import Order
from fastload.data.plan import ORDER_VERSION, BlockShufflePlan, EpochPlan, shard_of

from _data_helpers import Indices

# Shard layouts with odd sizes and some empty shards.
layouts = st.lists(st.integers(0, 12), min_size=1, max_size=15).map(
    lambda sizes: tuple(np.concatenate([[0], np.cumsum(sizes)]).tolist()))

plans = st.fixed_dictionaries({
    "shard_starts": layouts, "window": st.integers(1, 5), "world_size": st.integers(1, 5),
    "batch_size": st.integers(1, 7), "drop_last": st.booleans(), "seed": st.integers(0, 2**31),
    "shuffle": st.booleans(), "order_version": st.sampled_from([1, ORDER_VERSION]),
})


def _block(p: dict, **changes) -> BlockShufflePlan:
    p = {**p, **changes}
    return BlockShufflePlan(p["shard_starts"][-1], **p)


def _first_use(values) -> list[int]:
    return list(dict.fromkeys(int(v) for v in values))


# -- the order ------------------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(p=plans, epoch=st.integers(0, 30), other=plans)
def test_the_order_is_a_permutation_set_by_seed_and_epoch_alone(p, epoch, other):
    plan = _block(p)
    order = plan.order(epoch)
    assert order.dtype == np.int64
    assert sorted(order.tolist()) == list(range(plan.num_samples))
    assert np.array_equal(order, plan.order(epoch)), "deterministic"
    # any rank, world size, batch size or drop_last gives the same global order
    same = plan.replace(world_size=other["world_size"], rank=other["world_size"] - 1,
                        batch_size=other["batch_size"], drop_last=other["drop_last"])
    assert np.array_equal(same.order(epoch), order)
    assert np.array_equal(pickle.loads(pickle.dumps(plan)).order(epoch), order)
    if not plan.shuffle:
        assert order.tolist() == list(range(plan.num_samples))
        assert plan.shard_order(epoch).tolist() == list(range(plan.num_shards))


@settings(max_examples=150, deadline=None)
@given(p=plans, epoch=st.integers(0, 30))
def test_each_window_holds_exactly_the_samples_of_its_shards(p, epoch):
    """The prefix property: the first k windows of the order are the samples of the first
    k * window shards of the shard order, and nothing else."""
    plan = _block(p)
    starts = np.asarray(plan.shard_starts)
    order, shards = plan.order(epoch), plan.shard_order(epoch)
    assert sorted(shards.tolist()) == list(range(plan.num_shards))
    sizes = np.diff(starts)[shards]
    bounds = np.concatenate([[0], np.cumsum(sizes)])[:: plan.window].tolist() + [plan.num_samples]
    for w, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        mine = shards[w * plan.window : (w + 1) * plan.window]
        want = sorted(i for k in mine for i in range(starts[k], starts[k + 1]))
        assert sorted(order[a:b].tolist()) == want
        assert set(shard_of(order[a:b], starts).tolist()) <= set(mine.tolist())
        # prefix: k windows cover exactly the first k * window shards
        prefix = shards[: (w + 1) * plan.window]
        assert set(shard_of(order[:b], starts).tolist()) == {int(k) for k in prefix if starts[k + 1] > starts[k]}


def test_orders_differ_across_epochs_and_from_a_full_shuffle():
    starts = tuple(range(0, 1001, 50))  # 20 shards of 50
    plan = BlockShufflePlan(1000, shard_starts=starts, window=4, seed=7)
    orders = [plan.order(e) for e in range(6)]
    assert len({o.tobytes() for o in orders}) == 6
    assert len({plan.shard_order(e).tobytes() for e in range(6)}) == 6
    assert len({plan.replace(seed=s).order(0).tobytes() for s in range(5)}) == 5
    # within a window the samples are mixed, not left in shard order
    window = orders[0][:200]
    assert not np.array_equal(window, np.sort(window))
    # one window holding every shard is a full shuffle, drawn from another stream than EpochPlan's
    whole = plan.replace(window=20)
    for e in range(3):
        assert not np.array_equal(whole.order(e), EpochPlan(1000, seed=7).order(e))


@settings(max_examples=100, deadline=None)
@given(p=plans, epoch=st.integers(0, 30), data=st.data())
def test_positions_batches_and_lazy_indices_are_slices_of_the_order(p, epoch, data):
    plan = _block(p, rank=data.draw(st.integers(0, p["world_size"] - 1)))
    n = plan.num_samples
    order = plan.order(epoch)
    if n:
        pos = np.asarray(data.draw(st.lists(st.integers(0, 2 * n), max_size=30)), dtype=np.int64)
        assert np.array_equal(plan.at(epoch, pos), order[pos % n])
    start = data.draw(st.integers(0, n + 2))
    idx = plan.indices(epoch, start, order=order)
    assert np.array_equal(plan.indices(epoch, start), idx)
    view = plan.indices_view(epoch, start)
    assert np.array_equal(np.asarray(view), idx)
    for b in range(plan.num_batches(start)):
        assert np.array_equal(plan.batch_indices(epoch, b, start), plan.batch(idx, b))
        assert np.array_equal(plan.batch(view, b), plan.batch(idx, b))


def test_order_version_1_is_the_block_order_older_fastloads_drew():
    plan = BlockShufflePlan(30, shard_starts=(0, 7, 7, 19, 30), window=2, seed=11, order_version=1)
    assert plan.order(2).tolist() == [0, 1, 3, 2, 5, 4, 6, 29, 19, 12, 21, 27, 22, 14, 20, 18, 7, 13, 8, 25, 17,
                                      24, 15, 10, 26, 16, 11, 9, 23, 28]  # fastload 0.2's order
    new = plan.replace(order_version=ORDER_VERSION)
    assert np.array_equal(new.shard_order(2), plan.shard_order(2)), "the same shard order; new within-window order"
    assert not np.array_equal(new.order(2), plan.order(2))
    assert EpochPlan(20, seed=4, order_version=1).order(1).tolist() == [4, 7, 11, 16, 17, 0, 5, 15, 12, 14, 18, 10,
                                                                        1, 6, 2, 9, 13, 19, 3, 8]


def test_each_window_is_shuffled_evenly():
    """Over many seeds, each sample of a window lands in each quarter of the window's positions
    about equally often (within 6 standard deviations of a fair 4-way draw)."""
    starts = (0, 16, 32, 48, 64)  # one window of 4 shards
    seeds = 1200
    counts = np.zeros((64, 4), dtype=np.int64)
    for seed in range(seeds):
        order = BlockShufflePlan(64, shard_starts=starts, window=4, seed=seed).order(0)
        counts[order, np.arange(64) // 16] += 1
    assert np.abs(counts - seeds / 4).max() < 6 * np.sqrt(seeds * 0.25 * 0.75)


@pytest.mark.timeout(60)
def test_a_block_plan_of_a_trillion_samples_costs_its_shards_and_a_batch():
    """The shard order is O(num_shards) once per epoch; a batch is O(batch): a trillion
    samples in 10,000 shards hand out batches at once, each within at most two windows."""
    starts = tuple(range(0, 10**12 + 1, 10**8))
    plan = BlockShufflePlan(10**12, batch_size=256, world_size=8, rank=3, shard_starts=starts, window=4, seed=2)
    for epoch in (0, 1):
        for b in (0, 1, 10**6, plan.num_batches() - 1):
            idx = plan.batch_indices(epoch, b)
            assert len(idx) == 256 and len(set(idx.tolist())) == 256
            shards = set(shard_of(idx, starts).tolist())
            order = plan.shard_order(epoch).tolist()
            windows = {order.index(k) // plan.window for k in shards}
            assert len(windows) <= 2 and max(windows) - min(windows) <= 1
        assert plan.shards_ahead(epoch, first_batch=5, batches=2) == _first_use(
            shard_of(np.concatenate([plan.batch_indices(epoch, 5), plan.batch_indices(epoch, 6)]), starts))


def test_the_layout_is_validated():
    for bad in ((), (0, 5, 4, 10), (1, 10), (0, 9), (0.0, 10.0)):
        with pytest.raises(ValueError, match="shard_starts"):
            BlockShufflePlan(10, shard_starts=bad)
    for window in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="window"):
            BlockShufflePlan(10, shard_starts=(0, 10), window=window)
    plan = BlockShufflePlan(10, shard_starts=np.array([0, 4, 4, 10]), window=np.int64(2))
    assert plan.shard_starts == (0, 4, 4, 10) and plan.window == 2 and plan.num_shards == 3
    assert BlockShufflePlan(0, shard_starts=(0,)).order(3).tolist() == []


# -- EpochPlan's guarantees through the inherited dealing ------------------------------------


@settings(max_examples=150, deadline=None)
@given(p=plans, epoch=st.integers(0, 30))
def test_ranks_are_disjoint_cover_the_epoch_and_agree_on_batches(p, epoch):
    ranks = [_block(p, rank=r) for r in range(p["world_size"])]
    n, w, b = ranks[0].num_samples, ranks[0].world_size, ranks[0].batch_size
    assert len({pl.num_batches() for pl in ranks}) == 1
    parts = [pl.indices(epoch) for pl in ranks]
    allidx = np.concatenate(parts)
    if p["drop_last"]:
        assert len(np.unique(allidx)) == len(allidx)
        assert n - len(allidx) < w * b
    elif n:
        kept = np.concatenate([x[: len(x) - pl.num_padded()] for x, pl in zip(parts, ranks)])
        assert sorted(kept.tolist()) == list(range(n))
    # the ranks together read a prefix of the order, dealt round-robin
    order = ranks[0].order(epoch)
    for r, x in enumerate(parts):
        assert x.tolist() == [order[(r + j * w) % n] for j in range(len(x))]


@settings(max_examples=150, deadline=None)
@given(p=plans, epoch=st.integers(0, 5), w2=st.integers(1, 5), b2=st.integers(1, 7), k=st.integers(0, 8))
def test_resume_on_another_world_size_covers_the_rest_exactly_once(p, epoch, w2, b2, k):
    first = [_block(p, rank=r) for r in range(p["world_size"])]
    k = min(k, first[0].num_batches())
    position = first[0].consumed(k)
    seen = Counter(i for pl in first for i in pl.indices(epoch)[: k * pl.batch_size].tolist())
    n = first[0].num_samples
    order = first[0].order(epoch)
    assert set(seen) == set(order[: min(position, n)].tolist()), "the first part is a prefix of the order"
    rest = [_block(p, rank=r, world_size=w2, batch_size=b2) for r in range(w2)]
    resumed = Counter(i for pl in rest for i in pl.indices(epoch, position).tolist())
    both = seen + resumed
    if p["drop_last"]:
        assert max(both.values(), default=1) == 1
    elif position <= n:
        assert set(both) == set(range(n))
        assert sum(both.values()) - n == sum(pl.num_padded(position) for pl in rest)
    if w2 == p["world_size"] and b2 == p["batch_size"] and not p["drop_last"]:
        for pl, r in zip(first, rest):  # the same world reproduces the uninterrupted run
            assert pl.indices(epoch)[k * pl.batch_size :].tolist() == r.indices(epoch, position).tolist()


# -- shards ahead and the working set ---------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(p=plans, epoch=st.integers(0, 5), data=st.data())
def test_shards_ahead_are_the_distinct_shards_of_those_batches_in_first_use_order(p, epoch, data):
    plan = _block(p, rank=data.draw(st.integers(0, p["world_size"] - 1)))
    start = data.draw(st.integers(0, plan.num_samples + 2))
    nb = plan.num_batches(start)
    first = data.draw(st.integers(0, nb + 1))
    batches = data.draw(st.integers(0, nb + 1))
    idx = plan.indices(epoch, start)
    read = [plan.batch(idx, b) for b in range(first, first + batches)]
    want = _first_use(shard_of(np.concatenate([np.zeros(0, np.int64), *read]), plan.shard_starts))
    assert plan.shards_ahead(epoch, first_batch=first, batches=batches, start=start) == want
    assert plan.shards_ahead(epoch, first_batch=first, batches=batches, start=start,
                             order=plan.order(epoch)) == want
    # a full shuffle has the same helper, given the layout
    full = EpochPlan(**{f: getattr(plan, f) for f in ("num_samples", "batch_size", "seed", "shuffle", "rank",
                                                       "world_size", "drop_last")})
    fidx = full.indices(epoch, start)
    fwant = _first_use(shard_of(fidx[first * full.batch_size : (first + batches) * full.batch_size],
                                plan.shard_starts))
    assert full.shards_ahead(epoch, first_batch=first, batches=batches, start=start,
                             shard_starts=plan.shard_starts) == fwant


def test_shard_of_and_the_helpers_check_their_arguments():
    starts = (0, 3, 3, 7)
    assert shard_of([0, 2, 3, 6], starts).tolist() == [0, 0, 2, 2]  # the empty shard 1 holds nothing
    assert shard_of(np.zeros(0, np.int64), starts).tolist() == []
    for bad in ([7], [-1]):
        with pytest.raises(ValueError, match="sample indices"):
            shard_of(bad, starts)
    with pytest.raises(ValueError, match="shard_starts"):
        EpochPlan(7).shards_ahead(0)
    with pytest.raises(ValueError, match="shard_starts"):
        EpochPlan(7).working_set(0, shard_starts=(0, 6))
    with pytest.raises(ValueError, match="batches"):
        BlockShufflePlan(7, shard_starts=starts).shards_ahead(0, batches=-1)


def _working_set(plan: EpochPlan, epoch: int, ahead: int) -> int:
    """Brute force: shards live in each batch (from ``ahead`` batches before first use to last use)."""
    idx = plan.indices(epoch)
    nb = plan.num_batches()
    uses: dict[int, list[int]] = {}
    for b in range(nb):
        for k in shard_of(plan.batch(idx, b), plan.shard_starts).tolist():
            uses.setdefault(k, []).append(b)
    return max((sum(1 for u in uses.values() if min(u) - ahead <= t <= max(u)) for t in range(nb)), default=0)


@settings(max_examples=100, deadline=None)
@given(p=plans, epoch=st.integers(0, 5), ahead=st.integers(0, 4))
def test_working_set_counts_the_shards_held_at_once(p, epoch, ahead):
    plan = _block(p)
    assert plan.working_set(epoch, ahead=ahead) == _working_set(plan, epoch, ahead)


def test_a_block_shuffle_needs_a_few_shards_cached_a_full_shuffle_all():
    starts = tuple(range(0, 6401, 100))  # 64 shards of 100
    block = BlockShufflePlan(6400, batch_size=16, world_size=4, rank=1, shard_starts=starts, window=4, seed=3,
                             drop_last=True)
    full = EpochPlan(6400, batch_size=16, world_size=4, rank=1, seed=3, drop_last=True)
    for epoch in range(3):
        # a batch spans at most two windows, so a rank holds at most the current and the next window
        assert block.working_set(epoch) <= 2 * block.window
        node = block.replace(rank=0, world_size=1, batch_size=16 * 4)  # all four ranks together
        assert block.window <= node.working_set(epoch) <= 2 * block.window
        assert node.working_set(epoch, ahead=2) <= 3 * block.window
        assert full.working_set(epoch, shard_starts=starts) >= 60  # nearly every shard, all epoch


# -- resume checks ------------------------------------------------------------------------------


def test_identity_names_the_window_and_a_stable_hash_of_the_layout():
    plan = BlockShufflePlan(10, shard_starts=(0, 4, 10), window=3, seed=2)
    ident = plan.identity()
    assert ident["plan"] == "block-shuffle" and ident["window"] == 3 and ident["num_shards"] == 2
    assert ident["shard_layout"] == "16fa904218118f21"  # sha1 of the int64 offsets: stable across runs
    assert plan.replace(shard_starts=(0, 5, 10)).identity()["shard_layout"] != ident["shard_layout"]


def test_check_resume_refuses_another_window_layout_or_order():
    plan = BlockShufflePlan(30, batch_size=4, shard_starts=(0, 10, 20, 30), window=2, seed=3)
    state = {"epoch": 1, "position": 8, **plan.identity()}
    plan.check_resume(state)
    plan.replace(world_size=3, rank=2, batch_size=5, drop_last=True).check_resume(state)  # elastic
    others = {
        "window": plan.replace(window=3),
        "shard_layout": plan.replace(shard_starts=(0, 15, 20, 30)),
        "seed": plan.replace(seed=4),
        "shuffle": plan.replace(shuffle=False),
    }
    for key, other in others.items():
        with pytest.raises(ValueError, match=key):
            other.check_resume(state)
    full = EpochPlan(30, batch_size=4, seed=3)
    with pytest.raises(ValueError, match="plan"):
        plan.check_resume({"epoch": 1, "position": 8, **full.identity()})
    with pytest.raises(ValueError, match="plan"):
        full.check_resume(state)
    with pytest.raises(ValueError, match="plan"):  # a state from before plans were named was a full shuffle
        plan.check_resume({"epoch": 1, "batches": 2, "seed": 3, "num_samples": 30, "shuffle": True})
    # ... drawn by the old algorithm (order_version 1): a plan of that version finishes its epoch,
    # today's refuses mid-epoch and accepts it at an epoch boundary
    old = {"epoch": 1, "batches": 2, "seed": 3, "num_samples": 30, "shuffle": True}
    full.replace(order_version=1).check_resume(old)
    with pytest.raises(ValueError, match="order_version=1"):
        full.check_resume(old)
    full.check_resume({**old, "batches": 0})
    with pytest.raises(ValueError, match="order_version"):
        plan.replace(order_version=1).check_resume(state)


# -- the real DataLoader with a BlockShufflePlan ---------------------------------------------


def _run(loader, limit: int | None = None) -> list[list[int]]:
    out = []
    for _, targets in loader:
        out.append(targets.tolist())
        if limit is not None and len(out) >= limit:
            break
    return out


def _loader_elastic(p: dict, epoch: int, k: int, w2: int, b2: int, workers: int):
    """k batches on p's world size, checkpoint, the rest on w2 ranks with batch size b2."""
    n = p["shard_starts"][-1]
    first, states = [], []
    for r in range(p["world_size"]):
        plan = _block(p, rank=r)
        with DataLoader(Indices(n), plan=plan, num_workers=workers, pin_memory=False) as loader:
            assert len(loader) == plan.num_batches() and loader.batch_size == plan.batch_size
            loader.set_epoch(epoch)
            first.append(_run(loader, k) if k else [])
            assert sum(first[-1], []) == plan.indices(epoch)[: k * plan.batch_size].tolist()
            states.append(loader.state_dict())
    assert all(s == states[0] for s in states)
    rest = []
    for r in range(w2):
        plan = _block(p, rank=r, world_size=w2, batch_size=b2)
        with DataLoader(Indices(n), plan=plan, num_workers=workers, pin_memory=False) as loader:
            loader.load_state_dict(states[0])
            loader.set_epoch(epoch)
            got = _run(loader)
            assert sum(got, []) == plan.indices(epoch, states[0]["order"]["position"]).tolist()
            assert all(len(x) == b2 for x in got[:-1])
            rest.append(got)
    return first, rest, states[0]["order"]["position"]


def _check_covered(p: dict, first, rest, position: int, w2: int, b2: int) -> None:
    n = p["shard_starts"][-1]
    both = Counter(sum((sum(x, []) for x in first + rest), []))
    if p["drop_last"]:
        assert max(both.values(), default=1) == 1
    elif position <= n:
        assert set(both) == set(range(n))
        assert sum(both.values()) - n == sum(_block(p, rank=r, world_size=w2, batch_size=b2).num_padded(position)
                                             for r in range(w2))


@settings(max_examples=40, deadline=None)
@given(p=plans.filter(lambda p: p["shard_starts"][-1] > 0), epoch=st.integers(0, 3), w2=st.integers(1, 4),
       b2=st.integers(1, 6), k=st.integers(0, 6))
def test_the_dataloader_follows_a_block_plan_and_resumes_elastically(p, epoch, w2, b2, k):
    k = min(k, _block(p).num_batches())
    first, rest, position = _loader_elastic(p, epoch, k, w2, b2, workers=0)
    _check_covered(p, first, rest, position, w2, b2)


@pytest.mark.parametrize("w1,w2", [(2, 3), (3, 1)])
def test_the_dataloader_with_worker_processes_follows_a_block_plan(w1, w2):
    p = {"shard_starts": (0, 7, 7, 19, 30, 41, 45, 60), "window": 2, "world_size": w1, "batch_size": 4,
         "drop_last": False, "seed": 11, "shuffle": True}
    first, rest, position = _loader_elastic(p, 2, 2, w2, 3, workers=2)
    assert position == 2 * 4 * w1
    _check_covered(p, first, rest, position, w2, 3)


def test_the_dataloader_checks_the_plan_against_the_dataset_and_its_states():
    plan = BlockShufflePlan(30, batch_size=4, shard_starts=(0, 10, 30), seed=1)
    with pytest.raises(ValueError, match="num_samples"):
        DataLoader(Indices(31), plan=plan, num_workers=0)
    with pytest.raises(ValueError, match="batch_size"):
        DataLoader(Indices(30), num_workers=0)
    # the plan wins over the loader's own arguments
    loader = DataLoader(Indices(30), 8, plan=plan, seed=5, distributed=(1, 2), num_workers=0, pin_memory=False)
    assert (loader.batch_size, loader.seed, loader.rank, loader.world_size) == (4, 1, 0, 1)
    full = DataLoader(Indices(30), 4, seed=1, num_workers=0, pin_memory=False)
    with pytest.raises(ValueError, match="plan"):
        loader.load_state_dict(full.state_dict())
    with pytest.raises(ValueError, match="plan"):
        full.load_state_dict(loader.state_dict())
    other = DataLoader(Indices(30), plan=plan.replace(window=2), num_workers=0, pin_memory=False)
    with pytest.raises(ValueError, match="window"):
        other.load_state_dict(loader.state_dict())


@dataclass(frozen=True, kw_only=True)
class _Recording(BlockShufflePlan):
    """A BlockShufflePlan that notes when it is asked to prepare an epoch, and after which batch."""

    log: list = field(default_factory=list, compare=False, repr=False)

    def prepare(self, epoch: int) -> None:
        self.log.append(epoch)
        super().prepare(epoch)


def test_the_order_prepares_the_next_epoch_half_way_through_this_one():
    """The shard layout of epoch e + 1 (O(num_shards)) is computed in the middle of epoch e,
    not at its first batch; preparing changes no batch."""
    starts = tuple(range(0, 401, 10))
    plan = _Recording(400, batch_size=10, shard_starts=starts, window=4, seed=3)
    want = [plan.batch_indices(e, b).tolist() for e in (0, 1) for b in range(plan.num_batches())]
    order = Order(plan.replace(log=[]))
    got, log_at = [], {}
    for _ in range(2):
        epoch, first, idx = order.begin()
        for b in range(first, first + order.batches_left()):
            got.append(order.batch(idx, b).tolist())
            order.advance(epoch, b)
            for e in order.plan.log:
                log_at.setdefault(e, (epoch, b))
        order.finish(epoch)
    assert got == want
    assert log_at == {1: (0, 20), 2: (1, 20)}  # 40 batches an epoch: after batch 20 of the one before
    # resumed mid-epoch, the rest of the pass is halved
    order = Order(plan.replace(log=[]))
    order.load_state_dict({"epoch": 0, "position": 300, **plan.identity()})
    epoch, first, idx = order.begin()
    for b in range(order.batches_left()):
        order.advance(epoch, b)
        if order.plan.log:
            break
    assert (b, order.plan.log) == (5, [1])
