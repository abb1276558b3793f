"""The bounded ring: fixed slots reserved up front, a clear error when they do not fit, copies
(never growth) when the caller holds too many batches, and the per-sample path made visible."""

from __future__ import annotations

import gc
import os
import warnings

import numpy as np
import pytest
import torch

import fastload.transforms as T
from fastload.data.dataset import ImageFolder
from fastload.data.loader import DataLoader, PerformanceWarning
from fastload.data.ring import Ring, RingSpaceError, slot_bytes

from _data_helpers import collect, make_pack
from _fault_helpers import mounted_tmpfs

AUG = T.Compose([T.RandomResizedCrop((24, 32)), T.RandomHorizontalFlip()])


@pytest.fixture(scope="module")
def jpeg_pack(sample_tree, tmp_path_factory):
    return make_pack(sample_tree, tmp_path_factory.mktemp("ring") / "jpeg", payload="jpeg")


@pytest.fixture
def small_tmpfs(tmp_path):
    """A real 64 MB tmpfs (Docker's default /dev/shm size), mounted for the test."""
    with mounted_tmpfs(tmp_path, "64m") as mnt:
        yield mnt


def test_ring_reserves_every_slot_up_front(tmp_path):
    ring = Ring((4, 8, 8, 3), slots=3, shared=True, directory=str(tmp_path))
    files = sorted(os.listdir(ring.dir))
    assert files == ["slot-0000", "slot-0001", "slot-0002"]
    for f in files:  # allocated, not sparse: st_blocks covers the whole slot
        st = os.stat(os.path.join(ring.dir, f))
        assert st.st_size == slot_bytes((4, 8, 8, 3)) and st.st_blocks * 512 >= st.st_size
    assert [ring.acquire() for _ in range(4)] == [0, 1, 2, None]  # bounded: no fourth slot
    ring.release(1)
    assert ring.acquire() == 1
    ring.close()
    assert not os.path.exists(os.path.dirname(ring.paths[0]) if ring.paths else "/nonexistent")


def test_a_ring_that_does_not_fit_is_a_clear_error_at_start(small_tmpfs, jpeg_pack):
    """256 x 224 x 224 x 3 batches (38.5 MB a slot) cannot have 8 slots (prefetch 4 + 4) in 64 MB: the loader
    says so before any worker starts, with what is needed, what is free and what to do."""
    ds = ImageFolder(jpeg_pack, T.Compose([T.RandomResizedCrop(224)]))
    loader = DataLoader(ds, 256, num_workers=2, ring_dir=str(small_tmpfs), pin_memory=False)
    with pytest.raises(RingSpaceError) as err:
        next(iter(loader))
    msg = str(err.value)
    assert "8 slots x 36.8 MB" in msg and "is free" in msg and "--shm-size" in msg and "ring_dir" in msg
    assert "\n" not in msg
    assert "workers" not in loader._state  # failed before starting workers
    assert os.listdir(small_tmpfs) == []  # nothing left behind
    loader.close()


def test_a_ring_that_fits_runs_normally_in_64_mb(small_tmpfs, jpeg_pack):
    ds = ImageFolder(jpeg_pack, AUG)
    ref = collect(DataLoader(ds, 8, num_workers=0, seed=1, pin_memory=False))
    with DataLoader(ds, 8, num_workers=2, seed=1, ring_dir=str(small_tmpfs), pin_memory=False) as loader:
        got = collect(loader)
        assert len(os.listdir(small_tmpfs)) == 1  # the ring's private directory
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(got, ref))
    assert len(got) == len(ref)
    assert os.listdir(small_tmpfs) == []  # closed: removed


def test_holding_every_batch_copies_instead_of_growing(jpeg_pack):
    ds = ImageFolder(jpeg_pack, AUG)
    ref = collect(DataLoader(ds, 2, num_workers=0, seed=4, pin_memory=False))
    loader = DataLoader(ds, 2, num_workers=2, seed=4, prefetch=2, pin_memory=False)
    with pytest.warns(PerformanceWarning, match="holds 4 fastload batches"):
        held = list(loader)  # every batch kept alive
    ring = loader._state["ring"]
    assert len(ring) == 6 and ring.held == 4  # the margin's views; the rest were copied
    assert loader.stats()["copied"] == len(held) - 4
    assert all(torch.equal(a[0], b[0]) for a, b in zip(held, ref)) and len(held) == len(ref)
    del held
    gc.collect()
    assert ring.held == 0
    loader.close()


def test_ring_slots_argument_is_checked():
    with pytest.raises(ValueError, match="ring_slots"):
        DataLoader(list(range(4)), 2, num_workers=2, prefetch=4, ring_slots=3)


class _NotFastloadTransform:
    def __call__(self, img):
        return img


@pytest.mark.parametrize("transform,name", [
    (T.Compose([T.RandomResizedCrop(16), T.Normalize((0.5,) * 3, (0.2,) * 3)]), "Normalize"),
    (_NotFastloadTransform(), "_NotFastloadTransform"),
    (T.Resize(20), "Resize"),
])
def test_falling_off_the_ring_path_warns_once_naming_the_transform(jpeg_pack, transform, name):
    ds = ImageFolder(jpeg_pack, transform)
    with pytest.warns(PerformanceWarning, match=name) as rec:
        loader = DataLoader(ds, 4, num_workers=0, pin_memory=False)
    assert loader.mode == "per-sample" and len(rec) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert DataLoader(ImageFolder(jpeg_pack, AUG), 4, num_workers=0).mode == "ring"  # no warning


def test_per_sample_path_keeps_the_users_seed(jpeg_pack):
    ds = ImageFolder(jpeg_pack, T.Compose([T.RandomResizedCrop(16), T.ToTensor(scale=False)]), seed=123)
    with pytest.warns(PerformanceWarning):
        loader = DataLoader(ds, 4, num_workers=0, seed=7, pin_memory=False)
    first = collect(loader)
    assert ds.seed == 123  # the loader does not overwrite the dataset's seed
    # ...but the batches follow the loader's seed, as on the ring path
    ref = ImageFolder(jpeg_pack, T.Compose([T.RandomResizedCrop(16)]))
    idx = loader.plan.indices(0)[:4]
    for img, i in zip(first[0][0], idx.tolist()):
        want = ref.load(i, epoch=0, seed=7)
        assert np.array_equal(img.permute(1, 2, 0).numpy(), want)


def test_a_ring_with_no_margin_recovers_slots_from_an_abandoned_pass(jpeg_pack):
    """ring_slots == prefetch: every batch is copied, and after a break the slots still in
    flight for the abandoned pass come back before the new pass can send work."""
    ds = ImageFolder(jpeg_pack, AUG)
    ref = collect(DataLoader(ds, 3, num_workers=0, seed=8, pin_memory=False))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PerformanceWarning)
        with DataLoader(ds, 3, num_workers=2, seed=8, prefetch=2, ring_slots=2, pin_memory=False) as loader:
            got = []
            for x, y in loader:
                got.append((x, y))
                break  # two tasks were in flight
            got += list(loader)  # the rest of the epoch
            assert loader.stats()["copied"] == len(got)
    assert len(got) == len(ref)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(got, ref))
