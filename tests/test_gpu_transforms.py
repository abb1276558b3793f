"""Batch helpers of fastload.gpu.transforms, tested on CPU tensors (the same code runs on CUDA)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fastload.gpu.transforms import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    BatchAugment,
    flip_batch,
    normalize,
    random_flip,
    random_resized_crop,
    sample_crop_boxes,
    uniform,
)
from fastload.data.draws import flip_flags


def _batch(n=6, h=20, w=30, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 3, h, w), dtype=torch.uint8, generator=g)


def test_normalize_values_layout_and_dtype():
    x = _batch()
    out = normalize(x, mean=IMAGENET_MEAN, std=IMAGENET_STD, channels_last=True)
    ref = (x.double() / 255 - torch.tensor(IMAGENET_MEAN).double().view(1, 3, 1, 1)) / torch.tensor(
        IMAGENET_STD
    ).double().view(1, 3, 1, 1)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=0)
    assert out.is_contiguous(memory_format=torch.channels_last)
    assert normalize(x, dtype=torch.bfloat16).dtype == torch.bfloat16
    assert float(normalize(x).max()) <= 1.0 and float(normalize(x).min()) >= 0.0
    chw = normalize(x[0], mean=(0.5,), std=(0.5,))
    assert chw.shape == (3, 20, 30) and float(chw.min()) >= -1 and float(chw.max()) <= 1
    with pytest.raises(ValueError, match="uint8"):
        normalize(x.float())
    with pytest.raises(ValueError, match="channels"):
        normalize(x, mean=(0.1, 0.2))
    with pytest.raises(ValueError, match="std"):
        normalize(x, std=(1, 0, 1))


def test_uniform_depends_only_on_seed_epoch_index():
    a = uniform(1, 2, [5, 9, 13], stream=1, draws=3)
    b = uniform(1, 2, [13, 5], stream=1, draws=3)
    np.testing.assert_array_equal(a[[2, 0]], b)  # same sample, same numbers, whatever the batch
    assert not np.array_equal(uniform(1, 3, [5], stream=1), uniform(1, 2, [5], stream=1))
    assert not np.array_equal(uniform(2, 2, [5], stream=1), uniform(1, 2, [5], stream=1))
    assert not np.array_equal(uniform(1, 2, [5], stream=2), uniform(1, 2, [5], stream=1))
    big = uniform(0, 0, np.arange(200_000), stream=1)
    assert big.min() >= 0 and big.max() < 1
    assert abs(big.mean() - 0.5) < 0.005 and abs(big.var() - 1 / 12) < 0.002


def test_random_flip_is_seeded_per_sample_and_flips_exactly_the_chosen():
    x = _batch(n=64)
    idx = np.arange(100, 164)
    out, flips = random_flip(x, seed=3, epoch=1, indices=idx)
    assert 10 < flips.sum() < 54
    for k in range(64):
        want = x[k].flip(-1) if flips[k] else x[k]
        assert torch.equal(out[k], want)
    # the same samples in another batch order get the same decisions
    perm = np.random.default_rng(0).permutation(64)
    _, flips2 = random_flip(x[perm], seed=3, epoch=1, indices=idx[perm])
    np.testing.assert_array_equal(flips2, flips[perm])
    assert torch.equal(flip_batch(x, torch.ones(64, dtype=torch.bool)), x.flip(-1))
    with pytest.raises(ValueError, match="indices"):
        random_flip(x, seed=0, epoch=0, indices=[1, 2])


@settings(max_examples=60, deadline=None)
@given(
    h=st.integers(1, 400), w=st.integers(1, 400), seed=st.integers(0, 2**32), epoch=st.integers(0, 1000),
    smin=st.floats(0.01, 1.0), ratio_hi=st.floats(1.0, 3.0),
)
def test_crop_boxes_always_inside_the_image(h, w, seed, epoch, smin, ratio_hi):
    boxes = sample_crop_boxes(h, w, seed=seed, epoch=epoch, indices=np.arange(16), scale=(smin, 1.0),
                              ratio=(1 / ratio_hi, ratio_hi))
    top, left, bh, bw = boxes.T
    assert (bh >= 1).all() and (bw >= 1).all()
    assert (top >= 0).all() and (left >= 0).all()
    assert (top + bh <= h).all() and (left + bw <= w).all()


def test_crop_boxes_follow_scale_and_ratio():
    boxes = sample_crop_boxes(200, 300, seed=0, epoch=0, indices=np.arange(5000), scale=(0.25, 0.5))
    area = boxes[:, 2] * boxes[:, 3] / (200 * 300)
    aspect = boxes[:, 3] / boxes[:, 2]
    assert area.min() > 0.23 and area.max() < 0.52
    assert aspect.min() > 0.74 and aspect.max() < 1.35


def test_random_resized_crop_full_box_is_identity_and_matches_the_box():
    x = normalize(_batch(n=4, h=24, w=32))
    # scale=(1,1), ratio = image's: every box is the whole image, so the crop is the image
    out = random_resized_crop(x, (24, 32), seed=0, epoch=0, indices=np.arange(4), scale=(1.0, 1.0),
                              ratio=(32 / 24, 32 / 24))
    torch.testing.assert_close(out, x, atol=1e-5, rtol=0)
    # with flip_p=1 every image is mirrored
    out = random_resized_crop(x, (24, 32), seed=0, epoch=0, indices=np.arange(4), scale=(1.0, 1.0),
                              ratio=(32 / 24, 32 / 24), flip_p=1.0)
    torch.testing.assert_close(out, x.flip(-1), atol=1e-5, rtol=0)


def test_random_resized_crop_samples_the_right_box():
    # a box crop resized to its own size reproduces the pixels inside the box
    x = normalize(_batch(n=8, h=40, w=40, seed=5))
    idx = np.arange(50, 58)
    boxes = sample_crop_boxes(40, 40, seed=2, epoch=4, indices=idx, scale=(0.2, 0.2), ratio=(1.0, 1.0))
    side = int(boxes[0, 2])
    assert (boxes[:, 2] == side).all() and (boxes[:, 3] == side).all()
    out = random_resized_crop(x, side, seed=2, epoch=4, indices=idx, scale=(0.2, 0.2), ratio=(1.0, 1.0))
    for k, (t, l, bh, bw) in enumerate(boxes):
        torch.testing.assert_close(out[k], x[k, :, t : t + bh, l : l + bw], atol=1e-5, rtol=0)


def test_gpu_crop_and_flip_are_the_cpu_transforms_draws():
    """For the same (seed, epoch, index) the batch helper picks the box and flip that
    fastload.transforms picks on the CPU: outputs agree up to the resampling filter."""
    import cv2

    from fastload.data.draws import SampleDraws
    from fastload.transforms import Compose, RandomHorizontalFlip, RandomResizedCrop

    rng = np.random.default_rng(0)
    n, h, w, out = 24, 48, 64, 20
    # smooth images, so bilinear (GPU) and area (CPU) resampling of the same box agree closely
    hwc = np.stack([cv2.GaussianBlur(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), (0, 0), 2.0) for _ in range(n)])
    idx = np.arange(n) * 13 + 5
    tf = Compose([RandomResizedCrop(out), RandomHorizontalFlip()])
    cpu = torch.from_numpy(np.stack([tf(hwc[k], rng=SampleDraws.single(3, 7, int(i))) for k, i in enumerate(idx)]))
    cpu = cpu.permute(0, 3, 1, 2).float() / 255
    batch = normalize(torch.from_numpy(hwc).permute(0, 3, 1, 2).contiguous())
    gpu = random_resized_crop(batch, out, seed=3, epoch=7, indices=idx, flip_p=0.5)
    other = random_resized_crop(batch, out, seed=3, epoch=8, indices=idx, flip_p=0.5)
    same = (gpu - cpu).abs().mean(dim=(1, 2, 3))
    far = (other - cpu).abs().mean(dim=(1, 2, 3))
    assert float(same.max()) < 0.02, same
    assert float(same.mean()) < 0.2 * float(far.mean())


def test_antialiased_crop_equals_pil_crop_then_bilinear_resize():
    """antialias=True is PIL's (and torchvision's antialias=True) bilinear: crop the box, then
    resize with the triangle filter widened where it shrinks. PIL rounds to uint8 between its
    two passes, hence the 1-level tolerance."""
    from PIL import Image

    rng = np.random.default_rng(4)
    n, h, w = 12, 60, 80
    hwc = rng.integers(0, 256, (n, h, w, 3), dtype=np.uint8)
    x = torch.from_numpy(hwc).permute(0, 3, 1, 2).float()
    idx = np.arange(n) * 7
    for out in ((24, 24), (50, 70), (90, 30)):  # shrink both ways, mixed, grow one way
        got = random_resized_crop(x, out, seed=1, epoch=2, indices=idx, flip_p=0.5)
        boxes = sample_crop_boxes(h, w, seed=1, epoch=2, indices=idx)
        flips = flip_flags(1, 2, idx, 0.5)
        for k, (t, l, bh, bw) in enumerate(boxes):
            ref = Image.fromarray(hwc[k]).crop((l, t, l + bw, t + bh)).resize((out[1], out[0]), Image.BILINEAR)
            ref = np.asarray(ref)[:, ::-1] if flips[k] else np.asarray(ref)
            diff = np.abs(got[k].permute(1, 2, 0).numpy() - ref.astype(np.float32))
            assert diff.max() <= 1.0 + 1e-3, (out, k, diff.max())


def test_antialias_removes_aliasing_of_a_strong_downscale():
    """Alternating 0/1 columns shrunk 4x: the antialiased crop averages them (0.5 everywhere);
    grid_sample's 2-tap bilinear picks a few columns and comes out far from 0.5."""
    stripes = torch.zeros(2, 3, 64, 64)
    stripes[..., 1::2] = 1.0
    kw = dict(seed=0, epoch=0, indices=[0, 1], scale=(1.0, 1.0), ratio=(1.0, 1.0))
    smooth = random_resized_crop(stripes, 13, **kw)
    aliased = random_resized_crop(stripes, 13, antialias=False, **kw)
    assert float((smooth - 0.5).abs().max()) < 0.05
    assert float((aliased - 0.5).abs().mean()) > 0.2


def test_random_resized_crop_errors_and_dtypes():
    x = _batch(n=2)
    with pytest.raises(ValueError, match="float"):
        random_resized_crop(x, 8, seed=0, epoch=0, indices=[0, 1])
    xh = normalize(x, dtype=torch.float16, channels_last=True)
    out = random_resized_crop(xh, 8, seed=0, epoch=0, indices=[0, 1])
    assert out.dtype == torch.float16 and out.shape == (2, 3, 8, 8)
    assert out.is_contiguous(memory_format=torch.channels_last)
    with pytest.raises(ValueError, match="size"):
        random_resized_crop(xh, 0, seed=0, epoch=0, indices=[0, 1])


def test_batch_augment_is_deterministic_and_batch_independent():
    x = _batch(n=8, h=48, w=64)
    aug = BatchAugment(32, seed=7, dtype=torch.float32)
    idx = np.arange(8) + 1000
    a = aug(x, epoch=3, indices=idx)
    b = aug(x, epoch=3, indices=idx)
    assert torch.equal(a, b)
    assert a.shape == (8, 3, 32, 32) and a.is_contiguous(memory_format=torch.channels_last)
    # sample k alone gives the same result as inside the batch
    one = aug(x[5:6], epoch=3, indices=idx[5:6])
    torch.testing.assert_close(one[0], a[5], atol=1e-6, rtol=0)
    assert not torch.equal(aug(x, epoch=4, indices=idx), a)  # a new epoch, new crops


@pytest.mark.cuda
def test_cuda_helpers_match_cpu():
    x = _batch(n=8, h=48, w=64)
    idx = np.arange(8)
    aug = BatchAugment(32, seed=1)
    torch.testing.assert_close(aug(x.cuda(), epoch=0, indices=idx).cpu(), aug(x, epoch=0, indices=idx),
                               atol=1e-4, rtol=0)
    torch.testing.assert_close(normalize(x.cuda(), mean=IMAGENET_MEAN, std=IMAGENET_STD).cpu(),
                               normalize(x, mean=IMAGENET_MEAN, std=IMAGENET_STD))
