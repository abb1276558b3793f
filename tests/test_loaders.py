"""make_loader: one argument picks the backend, both give the same batches API."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from fastload.config import PackConfig
from fastload.data.order import find_order_state
from fastload.data.sampler import epoch_indices
from fastload.gpu.transforms import IMAGENET_MEAN, IMAGENET_STD
from fastload.loaders import Backend, make_loader

from _dali_helpers import HAVE_DALI

BACKENDS = [
    "cpu",
    pytest.param("dali", marks=pytest.mark.skipif(not HAVE_DALI, reason="nvidia.dali is not installed")),
]


@pytest.fixture(scope="module")
def packed(tmp_path_factory, sample_tree) -> Path:
    from fastload.pack import pack

    dest = tmp_path_factory.mktemp("loaders") / "lmdb"
    pack(sample_tree, dest, config=PackConfig(progress=False, workers=1))
    return dest


def _labels(root) -> np.ndarray:
    from fastload.storage import open_pack

    return open_pack(root).index.labels


def _kw(backend):
    # small and quick on a 2-core machine; DALI gets one CPU thread and one Python worker
    if backend == "dali":
        return {"num_workers": 1, "loader_kwargs": {"py_num_workers": 1}}
    return {"num_workers": 0}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("train", [True, False])
def test_same_batches_api_for_both_backends(packed, backend, train):
    loader = make_loader(packed, backend=backend, batch_size=5, train=train, crop=32, seed=4,
                         mean=IMAGENET_MEAN, std=IMAGENET_STD, device="cpu", **_kw(backend))
    labels = _labels(packed)
    n = len(labels)
    assert len(loader) == (n // 5 if train else -(-n // 5))  # train drops the last partial batch
    loader.set_epoch(1)
    got = []
    for images, targets in loader:
        assert images.shape == (len(targets), 3, 32, 32)
        assert images.dtype == torch.float32 and images.device.type == "cpu"
        assert images.is_contiguous(memory_format=torch.channels_last)
        assert targets.dtype == torch.int64
        assert -2.2 < float(images.min()) and float(images.max()) < 2.7  # ImageNet-normalised 0..1 pixels
        got += targets.tolist()
    order = epoch_indices(n, seed=4, epoch=1, shuffle=train, drop_last=train)
    want = labels[order][: len(loader) * 5].tolist()
    assert got == want
    state = loader.state_dict()
    assert _pos(loader) == (2, 0)
    find_order_state(state).update(epoch=1, position=15)  # 3 batches of 5 on one rank
    loader.load_state_dict(state)
    rest = [t for _, y in loader for t in y.tolist()]
    assert rest == want[15:]


def _pos(loader) -> tuple[int, int]:
    """(epoch, global position) of a loader's state, whichever stages nest it."""
    order = find_order_state(loader.state_dict())
    return order["epoch"], order["position"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_break_then_iterate_again_reads_the_rest_of_the_epoch(packed, backend):
    """A loop that breaks off mid-epoch and iterates again sees every batch once: neither
    backend skips the batches it had prefetched past the break."""
    loader = make_loader(packed, backend=backend, batch_size=3, train=True, crop=16, seed=6, device="cpu",
                         **_kw(backend))
    labels = _labels(packed)
    want = labels[epoch_indices(len(labels), seed=6, epoch=0, drop_last=True)][: len(loader) * 3].tolist()
    first = []
    for i, (_, y) in enumerate(loader):
        first += y.tolist()
        if i == 1:
            break
    assert _pos(loader) == (0, 6)
    rest = [t for _, y in loader for t in y.tolist()]
    assert first + rest == want
    assert _pos(loader) == (1, 0)


@pytest.mark.skipif(not HAVE_DALI, reason="nvidia.dali is not installed")
def test_backends_agree_on_labels_per_epoch(packed):
    kw = dict(batch_size=4, train=True, crop=24, seed=9, device="cpu", drop_last=False)
    cpu = make_loader(packed, backend="cpu", **kw, **_kw("cpu"))
    dali = make_loader(packed, backend=Backend.DALI, **kw, **_kw("dali"))
    for epoch in range(2):
        cpu.set_epoch(epoch)
        dali.set_epoch(epoch)
        a = [t for _, y in cpu for t in y.tolist()]
        b = [t for _, y in dali for t in y.tolist()]
        assert a == b  # same sampler, same order: only the pixels' augmentation differs
    assert Counter(a) == Counter(_labels(packed).tolist())


@pytest.mark.parametrize("backend", BACKENDS)
def test_two_ranks_cover_the_dataset_with_equal_batch_counts(packed, backend):
    n = len(_labels(packed))
    seen, counts = [], []
    for rank in (0, 1):
        loader = make_loader(packed, backend=backend, batch_size=5, train=False, crop=16, device="cpu",
                             distributed=(rank, 2), **_kw(backend))
        batches = [y.tolist() for _, y in loader]
        counts.append(len(batches))
        seen += sum(batches, [])
    assert counts[0] == counts[1]
    assert len(seen) == n and Counter(seen) == Counter(_labels(packed).tolist())


def test_bad_choices(packed):
    with pytest.raises(ValueError, match="backend must be one of cpu, dali"):
        make_loader(packed, backend="tpu", batch_size=4)
    with pytest.raises(ValueError, match="batch_size"):
        make_loader(packed, batch_size=0)
    with pytest.raises(ValueError, match="crop"):
        make_loader(packed, batch_size=2, crop=0)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            make_loader(packed, batch_size=2, device="cuda")


@pytest.mark.cuda
def test_cuda_prefetcher_over_fastload_ring_equals_synchronous_copies(packed):
    """The ring's page-locked slots are recycled when their views die: the prefetcher must keep
    them alive until the async copy is done. Compare with the loader's private copies."""
    from fastload.data.dataset import ImageFolder
    from fastload.data.loader import DataLoader
    from fastload.gpu.prefetcher import CUDAPrefetcher
    from fastload.gpu.transforms import normalize
    from fastload.transforms import Compose, RandomResizedCrop

    ds = ImageFolder(packed, transform=Compose([RandomResizedCrop(64)]), seed=1)
    ref = DataLoader(ds, 4, seed=1, num_workers=2, copy=True)
    fast = CUDAPrefetcher(DataLoader(ds, 4, seed=1, num_workers=2, pin_memory=True), "cuda",
                          mean=IMAGENET_MEAN, std=IMAGENET_STD, depth=3)
    for epoch in range(3):
        ref.set_epoch(epoch)
        fast.set_epoch(epoch)
        for (x, y), (xg, yg) in zip(ref, fast, strict=True):
            a = torch.randn(1024, 1024, device="cuda")
            for _ in range(4):
                a = a @ a / 1024
            assert torch.equal(xg, normalize(x.cuda(), mean=IMAGENET_MEAN, std=IMAGENET_STD, channels_last=True))
            assert torch.equal(yg.cpu(), y)


@pytest.mark.cuda
@pytest.mark.parametrize("backend", BACKENDS)
def test_cuda_make_loader_both_backends(packed, backend):
    loader = make_loader(packed, backend=backend, batch_size=8, crop=32, dtype=torch.float16,
                         mean=IMAGENET_MEAN, std=IMAGENET_STD)
    for images, targets in loader:
        assert images.is_cuda and targets.is_cuda
        assert images.dtype == torch.float16 and images.shape[1:] == (3, 32, 32)
