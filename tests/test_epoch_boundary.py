"""The ring loader crosses an epoch boundary without draining its workers (issue 16).

Once epoch ``e``'s last batches are in flight, the workers start filling epoch ``e + 1``'s
first ones under a generation of their own; the next iteration adopts them when it is the
natural continuation and drops them otherwise. These tests check what that must never
change: the batches (with or without it, any worker count, against a fresh loader), held
batches, exact resume, ``on_error="skip"`` statistics, slot accounting after the work is
dropped, and a stopped worker's timeout. Real worker processes, real packs; structural
checks, never timings.
"""

from __future__ import annotations

import gc
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import fastload.transforms as T
from fastload.data.dataset import ImageFolder
from fastload.data.loader import DataLoader, WorkerTimeout

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _data_helpers import batches_equal, collect, make_pack  # noqa: E402
from _fault_helpers import Filler, alive, first_line, kill_started, start_script, wait_gone  # noqa: E402

AUG = T.Compose([T.RandomResizedCrop((24, 32)), T.RandomHorizontalFlip()])
BS = 5  # 24 images: 5 batches an epoch, the last one short


@pytest.fixture(scope="module")
def pack(sample_tree, tmp_path_factory) -> Path:
    return make_pack(sample_tree, tmp_path_factory.mktemp("boundary") / "jpeg", payload="jpeg")


def _loader(pack: Path, **kw) -> DataLoader:
    kw.setdefault("num_workers", 2)
    kw.setdefault("pin_memory", False)
    kw.setdefault("seed", 4)
    return DataLoader(ImageFolder(pack, AUG), BS, **kw)


def _fresh_epoch(pack: Path, epoch: int) -> list:
    """Epoch ``epoch`` from a loader that never saw another one (no workers)."""
    with _loader(pack, num_workers=0) as loader:
        loader.set_epoch(epoch)
        return collect(loader)


def _slots_accounted(loader: DataLoader) -> bool:
    """Every ring slot is free, in flight to a worker (any generation), or filled ahead for the
    next epoch: nothing leaked. Call with no batch held and no pass running."""
    gc.collect()
    ring = loader._state["ring"]
    ahead = len(loader._next.done) if loader._next is not None else 0
    return ring.held == 0 and len(ring.free) + loader._outstanding + ahead == len(ring)


def _settle(loader: DataLoader, seconds: float = 10.0) -> None:
    """Wait until no worker is in the middle of a batch."""
    workers = loader._state["workers"]
    deadline = time.monotonic() + seconds
    while workers.busy_workers() and time.monotonic() < deadline:
        time.sleep(0.02)


@pytest.fixture(scope="module")
def reference(pack) -> list[list]:
    return [_fresh_epoch(pack, e) for e in range(3)]


# -- determinism -------------------------------------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers,prefetch", [(1, 1), (2, 2), (2, 4), (3, None)])
def test_every_epoch_equals_a_fresh_loaders_with_and_without_prefetching_ahead(pack, reference, workers, prefetch):
    for ahead in (True, False):
        with _loader(pack, num_workers=workers, prefetch=prefetch, prefetch_next_epoch=ahead) as loader:
            for e in range(3):
                assert batches_equal(collect(loader), reference[e]), (ahead, e)
                assert loader.epoch == e + 1
            if ahead:  # the speculative work for epoch 3 was sent, and is accounted for
                assert loader._next is not None and loader._next.sent >= 1
            assert _slots_accounted(loader)


@pytest.mark.timeout(60)
def test_without_prefetching_ahead_nothing_is_sent_past_the_epoch(pack, reference):
    with _loader(pack, prefetch_next_epoch=False) as loader:
        assert batches_equal(collect(loader), reference[0])
        assert loader._next is None and _slots_accounted(loader)
        _settle(loader)
        assert loader._outstanding == 0  # the workers are idle: nothing of epoch 1 was asked for


@pytest.mark.timeout(60)
def test_the_next_epochs_first_batch_is_sent_before_the_last_batch_is_yielded(pack, reference):
    with _loader(pack, prefetch=2) as loader:
        nb = len(loader)
        for b, _ in enumerate(loader):
            if b == nb - 1:  # epoch 0's last batch, in the caller's hands
                nxt = loader._next
                assert nxt is not None and nxt.key[0] == 1 and nxt.sent == 2  # prefetch tasks of epoch 1
        assert batches_equal(collect(loader), reference[1])


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_the_next_epochs_first_batch_is_filled_before_the_boundary(pack, reference):
    """Structural: with every worker stopped after epoch 0, epoch 1's first batch still comes
    (it was filled ahead); epoch 1's second one then needs a worker and times out."""
    with _loader(pack, prefetch=1, timeout=3) as loader:
        assert len(collect(loader)) == len(loader)
        nxt = loader._next
        assert nxt is not None and nxt.sent == 1  # prefetch=1: the first batch of epoch 1
        workers = loader._state["workers"]
        pids = [p.pid for p in workers.procs]
        deadline = time.monotonic() + 10
        while not any(workers.busy[2 * w] == nxt.gen and workers.busy[2 * w + 1] == -1 for w in range(2)):
            assert time.monotonic() < deadline, "no worker filled epoch 1's first batch"
            time.sleep(0.02)
        time.sleep(0.3)  # the worker's queue thread hands the result over
        for p in pids:
            os.kill(p, signal.SIGSTOP)
        try:
            it = iter(loader)
            first = next(it)
            assert batches_equal([(first[0].clone(), first[1].clone())], reference[1][:1])
            with pytest.raises(WorkerTimeout, match="of epoch 1"):
                next(it)
        finally:
            for p in pids:
                if alive(p):
                    os.kill(p, signal.SIGCONT)
        assert wait_gone(pids, 10)
        # the next pass starts fresh workers and continues epoch 1 after the batch received
        assert batches_equal(collect(loader), reference[1][1:])


# -- held batches --------------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.filterwarnings("ignore:the caller holds")
@pytest.mark.parametrize("ring_slots", [None, 40])
def test_held_batches_of_epoch_e_are_never_overwritten(pack, reference, ring_slots):
    """Held as ring views (``ring_slots=40``: all of them; default: the ring runs out and
    further batches are copied): epoch 1's work, sent ahead or not, never touches them."""
    with _loader(pack, prefetch=2, ring_slots=ring_slots) as loader:
        held = [b for b in loader]  # the views themselves
        assert batches_equal(collect(loader), reference[1])  # epoch 1, while epoch 0's batches are held
        assert batches_equal(collect(loader), reference[2])
        assert batches_equal(held, reference[0])
        if ring_slots:
            assert loader.stats()["copied"] == 0
        del held
        assert _slots_accounted(loader)


# -- resume --------------------------------------------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("where", ["last batch", "after the loop", "first batch of e+1"])
def test_resume_at_the_boundary_equals_the_uninterrupted_run(pack, reference, where):
    with _loader(pack) as loader:
        nb = len(loader)
        for b, _ in enumerate(loader):
            if b == nb - 1 and where == "last batch":
                state = loader.state_dict()  # epoch 0, at its end
        if where == "after the loop":
            state = loader.state_dict()  # epoch 1 from its start
        got = []
        for b, batch in enumerate(loader):
            got.append((batch[0].clone(), batch[1].clone()))
            if b == 0 and where == "first batch of e+1":
                state = loader.state_dict()
        assert batches_equal(got, reference[1])
    expect = reference[1][1:] + reference[2] if where == "first batch of e+1" else reference[1] + reference[2]
    for workers in (0, 2):
        with _loader(pack, num_workers=workers) as resumed:
            resumed.load_state_dict(state)
            resumed.set_epoch(state["order"]["epoch"])  # what a training loop does: must not rewind
            got = []
            while len(got) < len(expect):
                got += collect(resumed)
            assert batches_equal(got, expect), workers


@pytest.mark.timeout(60)
def test_reloading_the_boundary_state_keeps_the_work_sent_ahead(pack, reference):
    """``load_state_dict`` of the state the loader is at changes nothing: epoch 1's first
    batches, already filled, are still the ones that come next."""
    with _loader(pack) as loader:
        collect(loader)
        nxt = loader._next
        loader.load_state_dict(loader.state_dict())
        loader.set_epoch(1)
        assert loader._next is nxt
        assert batches_equal(collect(loader), reference[1])


# -- dropping the work sent ahead ----------------------------------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.parametrize("change", ["set_epoch", "load_state_dict mid-epoch", "load_state_dict other epoch",
                                    "order.set_epoch"])
def test_changing_the_order_between_epochs_drops_the_work_sent_ahead(pack, reference, change):
    with _loader(pack, prefetch=3) as loader:
        collect(loader)
        assert loader._next is not None and loader._next.sent == 3
        if change == "set_epoch":
            loader.set_epoch(2)
            expect = reference[2]
        elif change == "load_state_dict mid-epoch":
            with _loader(pack, num_workers=0) as other:
                collect(other, 2)
                loader.load_state_dict(other.state_dict())  # epoch 0 after its second batch
            expect = reference[0][2:]
        elif change == "order.set_epoch":  # behind the loader's back: the next pass sees another key
            loader.order.set_epoch(2)
            expect = reference[2]
        else:
            loader.load_state_dict({"order": {**loader.state_dict()["order"], "epoch": 2, "position": 0}})
            expect = reference[2]
        if change != "order.set_epoch":
            assert loader._next is None  # dropped at once: its filled slots are free again
        _settle(loader)
        assert batches_equal(collect(loader), expect)
        assert _slots_accounted(loader)
        # the stale results came back and were released: after the next epoch no slot is missing
        _settle(loader)
        collect(loader)
        assert _slots_accounted(loader)
        assert loader._outstanding <= loader.prefetch
        _settle(loader)
        assert loader._state["workers"].busy_workers() == []  # no worker is stuck with dropped work


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stop_after", [1, 3, 4])
def test_breaking_out_of_an_epoch_then_iterating_again(pack, reference, stop_after):
    """Break after ``stop_after`` of the 5 batches (3: epoch 1's work was already sent; 4: after
    the last batch): iterating again finishes epoch 0, then epoch 1 is a fresh loader's."""
    with _loader(pack, prefetch=2) as loader:
        got = collect(loader, stop_after)
        got += collect(loader)  # the rest of epoch 0 (nothing when the last batch was received)
        assert batches_equal(got, reference[0])
        assert loader.epoch == 1
        assert batches_equal(collect(loader), reference[1])
        assert _slots_accounted(loader)


# -- statistics, remote hints, cleanup -----------------------------------------------------------


@pytest.mark.timeout(120)
def test_skip_statistics_count_each_epochs_replacements_once(sample_tree, tmp_path):
    """``on_error="skip"``: a corrupt record of epoch 1 filled ahead is reported with epoch 1,
    and the counts equal a loader that does not prefetch ahead."""
    from test_corrupt_records import plant

    root = make_pack(sample_tree, tmp_path / "damaged", payload="jpeg")
    plant(root, 7, "garbage")
    counts = {}
    for ahead in (True, False):
        per_epoch = []
        with DataLoader(ImageFolder(root, AUG), BS, num_workers=2, seed=4, pin_memory=False,
                        on_error="skip", prefetch_next_epoch=ahead) as loader:
            for _ in range(3):
                collect(loader)
                per_epoch.append(loader.stats()["replaced"])
            assert [r.index for r in loader.stats()["records"]] == [7, 7, 7]
        counts[ahead] = per_epoch
    assert counts[True] == counts[False] == [1, 2, 3]


class _Hinted(Filler):
    """A Filler that records the loader's download-ahead hints (a Prefetching dataset)."""

    def __init__(self, n: int):
        super().__init__(n)
        self.hints: list[np.ndarray] = []

    def prefetch(self, indices) -> None:
        self.hints.append(np.asarray(indices).copy())

    def hold_at_most(self, n) -> None:
        pass

    def __getitem__(self, i: int):  # the per-sample path
        return np.full((*self.hw, 3), i % 256, dtype=np.uint8), i


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path", ["ring", "per-sample"])
def test_a_remote_dataset_hears_of_the_next_epochs_first_samples_before_the_boundary(path):
    from fastload.data.collate import collate_uint8

    ds = _Hinted(60)
    kw = {"collate_fn": collate_uint8} if path == "per-sample" else {}
    with DataLoader(ds, 4, num_workers=2, prefetch=2, pin_memory=False, seed=1, **kw) as loader:
        assert loader.mode == path
        plan, nb = loader.plan, len(loader)
        for b, _ in enumerate(loader):
            if b == nb - 1:
                heard = np.concatenate(ds.hints)
        first_of_next = plan.batch(plan.indices(1), 0)
        assert np.isin(first_of_next, heard).all()
        collect(loader)
        collect(loader)
        # each epoch's samples were announced once, in order, across the boundaries
        everything = np.concatenate(ds.hints)
        expect = np.concatenate([plan.indices(e) for e in range(3)])
        assert np.array_equal(everything[: len(expect)], expect)


@pytest.mark.timeout(60)
def test_close_with_work_sent_ahead_leaves_nothing(pack, tmp_path):
    with _loader(pack, ring_dir=str(tmp_path)) as loader:
        collect(loader)
        assert loader._next is not None
        pids = [p.pid for p in loader._state["workers"].procs]
        ring = loader._state["ring"].dir
    assert loader._next is None
    assert wait_gone(pids, 10) and not os.path.exists(ring)
    assert not [n for n in os.listdir(tmp_path) if n.startswith("fastload-ring-")]


# -- the per-sample path (torch's loader) ---------------------------------------------------------


def _per_sample(pack: Path, **kw) -> DataLoader:
    from fastload.data.collate import collate_uint8

    kw.setdefault("num_workers", 2)
    loader = _loader(pack, collate_fn=collate_uint8, **kw)  # a collate_fn takes torch's loader
    assert loader.mode == "per-sample"
    return loader


@pytest.mark.timeout(120)
@pytest.mark.parametrize("ahead", [True, False])
def test_per_sample_epochs_equal_a_fresh_loaders_and_torch_prefetches_across(pack, reference, ahead):
    with _per_sample(pack, prefetch=4, prefetch_next_epoch=ahead) as loader:
        nb = len(loader)
        for e in range(3):
            assert batches_equal(collect(loader), reference[e]), e
            running = loader._state.get("torch_iter")
            if ahead:  # one torch iteration runs on: it has already asked for epoch e + 1's first batches
                assert running is not None and running[1][:3] == (e + 1, 0, 0)
                assert running[0]._send_idx > (e + 1) * nb
            else:
                assert running is None


@pytest.mark.timeout(120)
@pytest.mark.parametrize("change", ["break", "set_epoch", "resume"])
def test_per_sample_changes_between_epochs_restart_torchs_iteration(pack, reference, change):
    with _per_sample(pack) as loader:
        if change == "break":  # the same torch iteration continues after the break
            got = collect(loader, 2)
            it = loader._state["torch_iter"][0]
            got += collect(loader)
            assert loader._state["torch_iter"][0] is it
            assert batches_equal(got, reference[0])
            expect = reference[1]
        elif change == "set_epoch":
            collect(loader)
            loader.set_epoch(2)
            expect = reference[2]
        else:
            collect(loader)
            with _loader(pack, num_workers=0) as other:
                other.set_epoch(1)
                collect(other, 3)
                loader.load_state_dict(other.state_dict())
            expect = reference[1][3:]
        assert batches_equal(collect(loader), expect)
        e = loader.epoch  # and the epoch after it, once the iteration was restarted
        assert batches_equal(collect(loader), reference[e] if e < 3 else _fresh_epoch(pack, e))


_AT_THE_BOUNDARY = """
    from fastload.data.loader import DataLoader
    from _fault_helpers import Filler
    loader = DataLoader(Filler(40, delay=0.5), 4, num_workers=2, ring_dir={ring_dir!r}, pin_memory=False, prefetch=4)
    for batch in loader:  # all of epoch 0: epoch 1's first batches are now with the workers
        pass
    assert loader._next is not None and loader._next.sent == 4
    print(" ".join(str(p.pid) for p in loader._state["workers"].procs), loader._state["ring"].dir, flush=True)
    time.sleep(60)
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_sigterm_while_the_next_epoch_is_filled_ahead_leaves_nothing(tmp_path):
    ring_dir = tmp_path / "shm"
    ring_dir.mkdir()
    try:
        proc = start_script(tmp_path, _AT_THE_BOUNDARY.format(ring_dir=str(ring_dir)))
        *pids, ring = first_line(proc).split()
        assert os.path.isdir(ring)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == -signal.SIGTERM, err
        assert wait_gone([int(p) for p in pids])
        assert os.listdir(ring_dir) == []
    finally:
        kill_started()


class _Squares:
    """A user's own dataset (per-sample path, default collate): image i is filled with i % 256."""

    def __len__(self) -> int:
        return 120

    def __getitem__(self, i):
        return np.full((8, 8, 3), i % 256, np.uint8), i


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["whole epochs", "break"])
def test_per_sample_close_leaves_no_prefetched_batch_in_dev_shm(how):
    """torch's workers share batches through /dev/shm files that only their receipt removes:
    batches prefetched for the next epoch (or a broken-off pass) are taken at close."""
    loader = DataLoader(_Squares(), 4, num_workers=2, pin_memory=False, prefetch=4)
    for _ in range(2):
        for k, _batch in enumerate(loader):
            if how == "break" and k == 5:
                break
    del _batch
    procs = loader._state["torch_loader"]._iterator._workers
    pids = [p.pid for p in procs]
    if how == "whole epochs":
        assert loader._state["torch_iter"][0]._tasks_outstanding > 0  # the next epoch's, in flight
    loader.close()
    gc.collect()
    assert wait_gone(pids, 10)
    left = [f for f in os.listdir("/dev/shm") if f.startswith(tuple(f"torch_{p}_" for p in pids))]
    assert left == []
