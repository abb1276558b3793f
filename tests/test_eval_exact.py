"""Validation under DDP counts every image exactly once (in-process: ranks simulated with
``distributed=(rank, world_size)``; the real torchrun run is in test_train_ddp.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from fastload import train
from fastload.data.loader import DataLoader
from fastload.data.sampler import epoch_indices
from fastload.gpu.prefetcher import CUDAPrefetcher
from fastload.gpu.transforms import IMAGENET_MEAN, IMAGENET_STD
from fastload.train.loop import _padded_tail


class IndexDataset:
    """n items whose value is their index (what the sampler hands out, nothing to decode)."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i


def _distinct_part(n: int, rank: int, world: int, *, shuffle: bool, seed: int, epoch: int, batch: int = 3):
    loader = DataLoader(IndexDataset(n), batch, shuffle=shuffle, seed=seed, distributed=(rank, world),
                        num_workers=0, collate_fn=list)
    idx = loader.plan.indices(epoch)
    assert np.array_equal(idx, epoch_indices(n, seed=seed, epoch=epoch, shuffle=shuffle, rank=rank,
                                             world_size=world))
    return idx, idx[: len(idx) - loader.num_padded]


@pytest.mark.parametrize("n", [0, 1, 2, 3, 5, 7, 100, 101, 102, 103])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("shuffle", [False, True])
def test_padding_is_each_ranks_tail_and_the_rest_covers_every_index_once(n, world, shuffle):
    parts = [_distinct_part(n, r, world, shuffle=shuffle, seed=3, epoch=1) for r in range(world)]
    assert len({len(full) for full, _ in parts}) == 1  # every rank still runs the same batches
    distinct = np.concatenate([d for _, d in parts]) if parts else np.zeros(0)
    assert sorted(distinct.tolist()) == list(range(n))  # union = all indices, no duplicates


@settings(max_examples=200, deadline=None)
@given(n=st.integers(0, 500), world=st.integers(1, 9), shuffle=st.booleans(), seed=st.integers(0, 2**31),
       epoch=st.integers(0, 50))
def test_padding_rule_property(n, world, shuffle, seed, epoch):
    distinct = [_distinct_part(n, r, world, shuffle=shuffle, seed=seed, epoch=epoch)[1] for r in range(world)]
    got = np.concatenate(distinct)
    assert len(got) == n and set(got.tolist()) == set(range(n))


def test_drop_last_pads_nothing():
    assert DataLoader(IndexDataset(101), 4, drop_last=True, distributed=(1, 2), num_workers=0).num_padded == 0


def test_padding_is_found_through_a_wrapping_loader():
    inner = DataLoader(IndexDataset(101), 4, distributed=(1, 2), num_workers=0)
    assert inner.num_padded == 1 and _padded_tail(inner) == 1
    assert _padded_tail(CUDAPrefetcher(inner, "cpu")) == 1
    assert _padded_tail([(torch.zeros(1), torch.zeros(1))]) == 0  # a plain iterable repeats nothing


class ImageDataset:
    """Random uint8 images with random labels (7 classes): a model gets some right, not all."""

    def __init__(self, n: int, seed: int = 0):
        g = np.random.default_rng(seed)
        self.images = g.integers(0, 256, (n, 8, 8, 3), dtype=np.uint8)
        self.labels = g.integers(0, 7, n)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return self.images[i], int(self.labels[i])


def _trainer():
    train.seed_everything(0)
    model = nn.Sequential(nn.Conv2d(3, 6, 3), nn.BatchNorm2d(6), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), nn.Linear(6, 7))
    return train.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), device="cpu")


@pytest.mark.parametrize("n", [1, 3, 101])
@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("batch_size", [1, 8])
@pytest.mark.parametrize("shuffle", [False, True])
def test_simulated_ranks_evaluate_each_image_once(n, world, batch_size, shuffle):
    ds = ImageDataset(n)
    trainer = _trainer()
    whole = trainer.evaluate(DataLoader(ds, 16, shuffle=False, distributed=False, num_workers=0))
    assert whole.samples == n
    stats = []
    for r in range(world):  # no process group: each rank's sums are its own, added up here
        loader = DataLoader(ds, batch_size, shuffle=shuffle, seed=4, distributed=(r, world), num_workers=0)
        if r % 2:
            loader = CUDAPrefetcher(loader, "cpu", mean=IMAGENET_MEAN, std=IMAGENET_STD)  # padding found through it
        try:
            stats.append(trainer.evaluate(loader))
        except ValueError as exc:  # a rank whose only sample is padding
            assert n < world and "no samples" in str(exc)
    assert sum(s.samples for s in stats) == n
    assert round(sum(s.acc1 * s.samples for s in stats)) == round(whole.acc1 * n)
    assert round(sum(s.acc5 * s.samples for s in stats)) == round(whole.acc5 * n)
    assert sum(s.loss * s.samples for s in stats) == pytest.approx(whole.loss * n, rel=1e-6)
