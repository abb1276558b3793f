"""fastload.data.draws: per-sample random numbers shared by the CPU, GPU and DALI paths."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastload.data.draws import (
    RRC_ATTEMPTS,
    STREAM_CROP,
    STREAM_FLIP,
    STREAM_STEP,
    BatchDraws,
    SampleDraws,
    rrc_box,
    rrc_boxes,
    take,
    uniform,
)
from fastload.transforms import Compose, Lambda, RandomHorizontalFlip, RandomResizedCrop


@settings(max_examples=80, deadline=None)
@given(
    heights=st.lists(st.integers(1, 700), min_size=1, max_size=12),
    seed=st.integers(-(2**63), 2**64 - 1), epoch=st.integers(0, 10**6),
    smin=st.floats(0.01, 1.0), smax_extra=st.floats(0.0, 1.0), ratio_lo=st.floats(0.2, 1.0), ratio_hi=st.floats(1.0, 5.0),
)
def test_scalar_and_batched_boxes_are_identical(heights, seed, epoch, smin, smax_extra, ratio_lo, ratio_hi):
    rng = np.random.default_rng(len(heights))
    h = np.asarray(heights)
    w = rng.integers(1, 700, size=h.size)
    scale = (smin, min(1.0, smin + smax_extra))
    ratio = (ratio_lo, ratio_hi)
    u = uniform(seed, epoch, np.arange(h.size) * 7919, stream=STREAM_CROP, draws=4 * RRC_ATTEMPTS)
    boxes = rrc_boxes(h, w, u, scale=scale, ratio=ratio)
    for k in range(h.size):
        assert tuple(boxes[k]) == rrc_box(int(h[k]), int(w[k]), u[k].tolist(), scale=scale, ratio=ratio)
        t, l, bh, bw = boxes[k]
        assert 0 <= t and 0 <= l and 1 <= bh and 1 <= bw and t + bh <= h[k] and l + bw <= w[k]


def test_fallback_is_the_centre_crop_clamped_to_the_ratio():
    u = [0.999] * (4 * RRC_ATTEMPTS)  # every attempt asks for a box too wide for a tall image
    assert rrc_box(400, 100, u, scale=(1.0, 1.0), ratio=(0.75, 1.333)) == (133, 0, 133, 100)
    assert rrc_box(100, 400, u, scale=(1.0, 1.0), ratio=(0.75, 1.333)) == (0, 133, 100, 133)
    assert tuple(rrc_boxes([400, 100], [100, 400], np.array([u, u]), scale=(1.0, 1.0), ratio=(0.75, 1.333))[1]) == (
        0, 133, 100, 133)


def test_batch_rows_are_each_samples_own_numbers():
    idx = np.array([5, 900, 3, 5])
    batch = BatchDraws(7, 2, idx)
    for j, i in enumerate(idx):
        assert batch.sample(j).take(STREAM_CROP, 8) == SampleDraws.single(7, 2, int(i)).take(STREAM_CROP, 8)
    assert batch.sample(0).take(STREAM_FLIP, 1) == batch.sample(3).take(STREAM_FLIP, 1)  # same index
    assert batch.sample(0).take(STREAM_FLIP, 1) != batch.sample(1).take(STREAM_FLIP, 1)
    assert BatchDraws(8, 2, idx).sample(0).take(STREAM_FLIP, 1) != batch.sample(0).take(STREAM_FLIP, 1)


def test_a_second_transform_of_the_same_kind_gets_the_next_stream():
    s = SampleDraws.single(1, 0, 42)
    first, second = s.take(STREAM_FLIP, 3), s.take(STREAM_FLIP, 3)
    assert first != second
    assert second == uniform(1, 0, [42], stream=STREAM_FLIP + STREAM_STEP, draws=3)[0].tolist()
    # the crop stream has its own count
    assert s.take(STREAM_CROP, 2) == uniform(1, 0, [42], stream=STREAM_CROP, draws=2)[0].tolist()


def test_generator_methods_are_seeded_by_the_sample():
    a, b = SampleDraws.single(3, 1, 10), SampleDraws.single(3, 1, 10)
    assert a.normal(size=4).tolist() == b.normal(size=4).tolist()
    assert a.integers(0, 10**9) == b.integers(0, 10**9)
    assert SampleDraws.single(3, 1, 11).normal() != SampleDraws.single(3, 1, 10).normal()
    with pytest.raises(AttributeError):
        _ = a._no_such_thing
    # a plain Generator works wherever SampleDraws does
    g = np.random.default_rng(0)
    vals = take(g, STREAM_CROP, 5)
    assert len(vals) == 5 and all(0 <= v < 1 for v in vals)


def test_transforms_draw_from_the_sample_hash():
    tf = Compose([RandomResizedCrop(16), RandomHorizontalFlip()])
    for i in range(50):
        plan = tf.plan((60, 80), SampleDraws.single(9, 4, i))
        u = uniform(9, 4, [i], stream=STREAM_CROP, draws=4 * RRC_ATTEMPTS)[0].tolist()
        t, l, h, w = rrc_box(60, 80, u, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3))
        assert (plan.top, plan.left, plan.h, plan.w) == (t, l, h, w)
        assert plan.flip == (uniform(9, 4, [i], stream=STREAM_FLIP)[0, 0] < 0.5)
    flips = [tf.plan((60, 80), SampleDraws.single(0, 0, i)).flip for i in range(4000)]
    assert abs(np.mean(flips) - 0.5) < 0.03


def test_lambda_with_rng_gets_a_numpy_generator():
    seen = []
    tf = Compose([Lambda(lambda img, rng: seen.append(rng) or img, takes_rng=True)])
    tf(np.zeros((4, 4, 3), np.uint8), rng=SampleDraws.single(0, 0, 1))
    assert isinstance(seen[0], np.random.Generator)


def test_crop_area_and_aspect_follow_the_arguments():
    u = uniform(0, 0, np.arange(20000), stream=STREAM_CROP, draws=4 * RRC_ATTEMPTS)
    boxes = rrc_boxes(400, 400, u, scale=(0.1, 0.3), ratio=(0.5, 2.0))  # every first try fits
    area = boxes[:, 2] * boxes[:, 3] / 160000
    aspect = boxes[:, 3] / boxes[:, 2]
    assert 0.09 < area.min() and area.max() < 0.31
    assert 0.49 < aspect.min() and aspect.max() < 2.05
    # log-uniform aspect: as many boxes wider than tall as taller than wide
    assert abs(np.mean(np.log(aspect))) < 0.02
    assert math.isclose(np.mean(area), 0.2, abs_tol=0.005)
