"""DALILoader: real DALI CPU pipelines over real LMDB/HDF5 packs (skipped when DALI is absent)."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from fastload.config import PackConfig
from fastload.data.sampler import epoch_indices
from fastload.gpu.transforms import IMAGENET_MEAN, IMAGENET_STD

from _dali_helpers import needs_dali

MEAN = np.asarray(IMAGENET_MEAN).reshape(1, 3, 1, 1)
STD = np.asarray(IMAGENET_STD).reshape(1, 3, 1, 1)


def _pack(source: Path, dest: Path, **cfg) -> Path:
    from fastload.pack import pack

    pack(source, dest, config=PackConfig(progress=False, workers=1, **cfg))
    return dest


@pytest.fixture(scope="module")
def packs(tmp_path_factory, sample_tree) -> dict[str, Path]:
    """JPEG packs in both backends, and a raw pack of fixed 32x32 images."""
    root = tmp_path_factory.mktemp("dali_packs")
    return {
        "lmdb": _pack(sample_tree, root / "lmdb", backend="lmdb"),
        "hdf5": _pack(sample_tree, root / "hdf5", backend="hdf5"),
        "raw": _pack(sample_tree, root / "raw", backend="hdf5", payload="raw", size=(32, 32)),
    }


def _loader(root, batch_size=5, **kw):
    from fastload.dali import DALILoader

    kw.setdefault("device", "cpu")
    kw.setdefault("num_threads", 1)
    kw.setdefault("py_num_workers", 1)
    return DALILoader(root, batch_size, **kw)


def _labels(root) -> np.ndarray:
    from fastload.storage import open_pack

    return open_pack(root).index.labels


@needs_dali
@pytest.mark.parametrize("backend", ["lmdb", "hdf5"])
def test_cpu_pipeline_labels_shapes_dtypes_ranges(packs, backend):
    root = packs[backend]
    loader = _loader(root, crop=40, mean=IMAGENET_MEAN, std=IMAGENET_STD, seed=3)
    labels = _labels(root)
    assert len(loader) == 5  # 24 samples, batches of 5, partial last batch
    got, sizes = [], []
    for images, targets in loader:
        sizes.append(len(targets))
        assert images.shape == (len(targets), 3, 40, 40)
        assert images.dtype == torch.float32 and targets.dtype == torch.int64
        assert images.device.type == "cpu"
        assert images.is_contiguous(memory_format=torch.channels_last)
        assert torch.isfinite(images).all()
        # normalised pixels lie within [(0 - mean)/std, (1 - mean)/std]
        lo = torch.tensor((0 - MEAN) / STD, dtype=torch.float32)
        hi = torch.tensor((1 - MEAN) / STD, dtype=torch.float32)
        assert (images >= lo - 1e-4).all() and (images <= hi + 1e-4).all()
        assert images.std() > 0.1  # real photos, not a constant
        got.extend(targets.tolist())
    assert sizes == [5, 5, 5, 5, 4]
    # the exact order fastload's sampler gives for epoch 0
    assert got == labels[epoch_indices(len(labels), seed=3, epoch=0)].tolist()


@needs_dali
def test_raw_pack_eval_images_equal_the_stored_pixels_in_sampler_order(packs):
    from fastload.storage import open_pack

    root = packs["raw"]
    pack = open_pack(root)
    stored = np.stack([np.frombuffer(pack.get(i), np.uint8).reshape(32, 32, 3) for i in range(len(pack))])
    loader = _loader(root, batch_size=7, crop=32, train=False, resize_ratio=1.0, seed=11,
                     mean=IMAGENET_MEAN, std=IMAGENET_STD, channels_last=False)
    for epoch in (0, 1):
        order = epoch_indices(len(pack), seed=11, epoch=epoch)
        images = torch.cat([x for x, _ in loader]).numpy()
        expected = (stored[order].transpose(0, 3, 1, 2) / 255.0 - MEAN) / STD
        np.testing.assert_allclose(images, expected, atol=1e-4)
    assert loader.epoch == 2


@needs_dali
def test_same_label_multiset_as_fastload_loader_for_one_epoch(packs):
    from fastload.data.dataset import ImageFolder
    from fastload.data.sampler import DistributedEpochSampler

    root = packs["lmdb"]
    dali_labels = Counter(t for _, y in _loader(root, batch_size=4, crop=32) for t in y.tolist())
    from fastload.data.loader import DataLoader
    from fastload.transforms import Compose, Resize

    ds = ImageFolder(root, transform=Compose([Resize((16, 16))]))
    fl = Counter(int(t) for _, y in DataLoader(ds, 4, shuffle=True, seed=0, num_workers=0) for t in y.tolist())
    # and through the sampler the loader uses, straight from the dataset's targets
    assert fl == Counter(int(ds.targets[i]) for i in DistributedEpochSampler(len(ds), seed=0))
    assert dali_labels == fl
    assert sum(dali_labels.values()) == 24


@needs_dali
@pytest.mark.parametrize("kind", ["lmdb", "raw"])
def test_training_crops_and_flips_are_the_cpu_loaders(packs, kind):
    """DALI draws each sample's RandomResizedCrop box and flip from fastload's per-sample hash,
    so its training batches are the CPU loader's up to the resampling filter; a different
    epoch (other boxes) is far off."""
    from fastload.data.dataset import ImageFolder
    from fastload.data.loader import DataLoader
    from fastload.transforms import Compose, RandomHorizontalFlip, RandomResizedCrop

    root = packs[kind]
    crop = 24
    ds = ImageFolder(root, transform=Compose([RandomResizedCrop(crop), RandomHorizontalFlip()]))
    cpu = DataLoader(ds, 6, shuffle=True, seed=5, num_workers=0)
    dali = _loader(root, batch_size=6, crop=crop, seed=5, channels_last=False)

    def epoch(loader):
        xs, ys = zip(*[(x.float() / (255.0 if x.dtype == torch.uint8 else 1.0), y) for x, y in loader])
        return torch.cat(xs), torch.cat(ys)

    c0, y0 = epoch(cpu)
    c1, _ = epoch(cpu)
    d0, yd = epoch(dali)
    assert torch.equal(y0, yd)
    same = (c0 - d0).abs().mean(dim=(1, 2, 3))
    other = (c1 - d0).abs().mean(dim=(1, 2, 3))
    assert float(same.max()) < 0.06, same
    assert float(same.mean()) < 0.3 * float(other.mean()), (same.mean(), other.mean())


@needs_dali
@pytest.mark.parametrize("drop_last", [False, True])
def test_ddp_sharding_two_ranks_like_the_sampler(packs, drop_last):
    root = packs["hdf5"]
    labels = _labels(root)
    n = len(labels)
    per_rank = {}
    for rank in (0, 1):
        loader = _loader(root, batch_size=5, crop=24, seed=7, drop_last=drop_last, distributed=(rank, 2))
        loader.set_epoch(2)
        batches = [y.tolist() for _, y in loader]
        assert len(batches) == len(loader)
        want = labels[epoch_indices(n, seed=7, epoch=2, rank=rank, world_size=2, drop_last=drop_last)]
        assert sum(batches, []) == want[: len(sum(batches, []))].tolist()
        if drop_last:
            assert all(len(b) == 5 for b in batches)
        else:
            assert sum(batches, []) == want.tolist()
        per_rank[rank] = batches
    assert len(per_rank[0]) == len(per_rank[1])  # equal batch counts: no rank waits at the end
    if not drop_last:  # together the ranks cover every sample
        idx = np.concatenate([epoch_indices(n, seed=7, epoch=2, rank=r, world_size=2) for r in (0, 1)])
        assert set(idx.tolist()) == set(range(n))


@needs_dali
def test_num_padded_matches_fastloads_loader(packs):
    """24 samples over 5 ranks: 5 per rank, so 1 of the 25 reads repeats; evaluation leaves
    the repeats out through num_padded, the same figure as fastload's DataLoader."""
    from fastload.data.dataset import ImageFolder
    from fastload.data.loader import DataLoader

    root = packs["hdf5"]
    ds = ImageFolder(root)
    pads = []
    for rank in range(5):
        dali = _loader(root, batch_size=2, crop=24, distributed=(rank, 5))
        assert dali.num_padded == DataLoader(ds, 2, distributed=(rank, 5), num_workers=0).num_padded
        assert _loader(root, batch_size=2, crop=24, distributed=(rank, 5), drop_last=True).num_padded == 0
        pads.append(dali.num_padded)
    assert pads == [0, 0, 0, 0, 1]


@needs_dali
def test_set_epoch_reshuffles_and_early_break_resumes_the_epoch(packs):
    root = packs["lmdb"]
    labels = _labels(root)
    n = len(labels)
    loader = _loader(root, batch_size=4, crop=24, seed=5)
    loader.set_epoch(3)
    e3 = [t for _, y in loader for t in y.tolist()]
    assert e3 == labels[epoch_indices(n, seed=5, epoch=3)].tolist()
    assert loader.epoch == 4  # a finished epoch moves on by itself
    e4 = [t for _, y in loader for t in y.tolist()]
    assert e4 == labels[epoch_indices(n, seed=5, epoch=4)].tolist()
    # break after two batches, then iterate again: the rest of epoch 5
    first = []
    for i, (_, y) in enumerate(loader):
        first += y.tolist()
        if i == 1:
            break
    state = loader.state_dict()
    assert (state["order"]["epoch"], state["order"]["position"]) == (5, 2 * 4)
    rest = [t for _, y in loader for t in y.tolist()]
    assert first + rest == labels[epoch_indices(n, seed=5, epoch=5)].tolist()
    # a new loader resumed from the state reads exactly the rest of that epoch
    fresh = _loader(root, batch_size=4, crop=24, seed=5)
    fresh.load_state_dict(state)
    assert [t for _, y in fresh for t in y.tolist()] == rest
    with pytest.raises(ValueError, match="seed"):
        _loader(root, batch_size=4, crop=24, seed=6).load_state_dict(state)


@needs_dali
def test_float16_and_bfloat16_outputs(packs):
    for dtype in (torch.float16, torch.bfloat16):
        x, y = next(iter(_loader(packs["raw"], batch_size=6, crop=16, dtype=dtype)))
        assert x.dtype == dtype and x.shape == (6, 3, 16, 16)
        assert 0 <= float(x.min()) and float(x.max()) <= 1  # no mean/std: scaled to 0..1


@needs_dali
def test_bad_arguments_and_inputs(packs, tmp_path):
    from fastload.errors import FormatError

    with pytest.raises(ValueError, match="device"):
        _loader(packs["lmdb"], device="tpu")
    with pytest.raises(ValueError, match="batch_size"):
        _loader(packs["lmdb"], batch_size=0)
    with pytest.raises(ValueError, match="rank"):
        _loader(packs["lmdb"], distributed=(2, 2))
    with pytest.raises(ValueError, match="no batch"):
        _loader(packs["lmdb"], batch_size=100, drop_last=True)
    with pytest.raises(FormatError, match="manifest"):
        _loader(tmp_path)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA"):
            _loader(packs["lmdb"], device="gpu")


def test_import_fastload_does_not_import_dali_and_missing_dali_says_what_to_install(tmp_path):
    code = (
        "import sys, fastload, fastload.gpu.prefetcher, fastload.loaders\n"
        "assert 'nvidia.dali' not in sys.modules, 'import fastload pulled in DALI'\n"
        "sys.modules['nvidia.dali'] = None  # as if DALI were not installed\n"
        "try:\n"
        "    import fastload.dali\n"
        "except ImportError as e:\n"
        "    print('ERR', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "pip install nvidia-dali-cuda120" in out.stdout


@pytest.mark.cuda
@needs_dali
def test_gpu_mixed_decode(packs):
    from fastload.dali import DALILoader

    root = packs["lmdb"]
    labels = _labels(root)
    loader = DALILoader(root, 8, device="gpu", crop=64, mean=IMAGENET_MEAN, std=IMAGENET_STD, seed=2,
                        dtype=torch.float16)
    got = []
    for x, y in loader:
        assert x.is_cuda and y.is_cuda
        assert x.dtype == torch.float16 and x.shape[1:] == (3, 64, 64)
        assert x.is_contiguous(memory_format=torch.channels_last)
        got += y.cpu().tolist()
    assert got == labels[epoch_indices(len(labels), seed=2, epoch=0)].tolist()
    # eval mode on the GPU gives the same pixels as on the CPU (raw records: no decoder),
    # within one intensity level for the GPU and CPU resize kernels' rounding
    cpu = _loader(packs["raw"], batch_size=6, crop=32, train=False, resize_ratio=1.0, shuffle=False)
    gpu = DALILoader(packs["raw"], 6, device="gpu", crop=32, train=False, resize_ratio=1.0, shuffle=False)
    for (xc, yc), (xg, yg) in zip(cpu, gpu, strict=True):
        assert torch.equal(yc, yg.cpu())
        torch.testing.assert_close(xc, xg.cpu(), atol=1.01 / 255, rtol=0)
