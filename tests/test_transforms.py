"""uint8 transforms: torchvision's RandomResizedCrop rule, planning == applying, seeding."""

from __future__ import annotations

import cv2
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fastload.transforms as T
from fastload.data.resize import resize as resize_into
from fastload.data.transforms import Plan, fixed_output_hw
from fastload.image import center_crop


@pytest.fixture
def img(rng):
    return rng.integers(0, 256, (90, 130, 3), dtype=np.uint8)


def test_public_module_reexports():
    for name in ("Compose", "RandomResizedCrop", "RandomHorizontalFlip", "Resize", "CenterCrop", "Normalize", "ToTensor"):
        assert hasattr(T, name)


@settings(max_examples=200, deadline=None)
@given(h=st.integers(1, 600), w=st.integers(1, 600), seed=st.integers(0, 2**32 - 1))
def test_random_resized_crop_params_follow_torchvision(h, w, seed):
    t = T.RandomResizedCrop(224)
    i, j, ch, cw = t.get_params((h, w), np.random.default_rng(seed))
    assert 0 <= i and 0 <= j and i + ch <= h and j + cw <= w and ch >= 1 and cw >= 1
    # Either a sampled crop (area and ratio within range, up to rounding) or the fallback
    # center crop clamped to the ratio range.
    fallback_i, fallback_j = (h - ch) // 2, (w - cw) // 2
    if (i, j) != (fallback_i, fallback_j) or not (ch == h or cw == w):
        area = ch * cw / (h * w)
        assert 0.08 * 0.9 - 2 / min(h, w) <= area <= 1.0
        ratio = cw / ch
        assert 3 / 4 * (1 - 2.5 / min(ch, cw)) - 1e-9 <= ratio <= 4 / 3 * (1 + 2.5 / min(ch, cw)) + 1e-9


def test_random_resized_crop_falls_back_like_torchvision():
    # Impossible scale: 10 attempts fail, then the center crop clamped to the ratio range.
    t = T.RandomResizedCrop(8, scale=(5.0, 6.0))
    assert t.get_params((100, 400), np.random.default_rng(0)) == (0, (400 - 133) // 2, 100, 133)
    assert t.get_params((400, 100), np.random.default_rng(0)) == ((400 - 133) // 2, 0, 133, 100)
    assert t.get_params((100, 120), np.random.default_rng(0)) == (0, 0, 100, 120)


def _opencv_per_axis(crop: np.ndarray, oh: int, ow: int) -> np.ndarray:
    """The "auto" filter spelt out with OpenCV: INTER_AREA where an axis shrinks, INTER_LINEAR
    where it grows, one call per axis when they differ."""
    h, w = crop.shape[:2]
    if oh <= h and ow <= w:
        return cv2.resize(crop, (ow, oh), interpolation=cv2.INTER_AREA)
    if oh < h:  # shrink height, then grow width
        crop = cv2.resize(crop, (w, oh), interpolation=cv2.INTER_AREA)
    elif ow < w:
        crop = cv2.resize(crop, (ow, h), interpolation=cv2.INTER_AREA)
    return cv2.resize(crop, (ow, oh), interpolation=cv2.INTER_LINEAR)


@pytest.mark.parametrize("out_hw", [(40, 50), (80, 100)])  # mostly shrinking / mostly enlarging boxes
@pytest.mark.parametrize("seed", range(8))
def test_planned_pipeline_equals_doing_it_step_by_step(img, seed, out_hw):
    oh, ow = out_hw
    t = T.Compose([T.RandomResizedCrop(out_hw), T.RandomHorizontalFlip(p=1.0)])
    out = t(img, rng=np.random.default_rng(seed))
    i, j, h, w = t.transforms[0].get_params(img.shape[:2], np.random.default_rng(seed))
    crop = img[i : i + h, j : j + w]
    assert out.shape == (oh, ow, 3) and out.dtype == np.uint8
    # fastload's resize, flip included, exactly; OpenCV crop-resize-flip within 1
    assert np.array_equal(out, resize_into(crop, np.empty((oh, ow, 3), np.uint8), flip=True))
    expected = _opencv_per_axis(crop, oh, ow)[:, ::-1]
    assert np.abs(out.astype(int) - expected).max() <= 1


@pytest.mark.parametrize("channels", [1, 3, 4])
def test_shrinking_crops_use_the_area_filter_within_one_of_opencv(channels):
    rng = np.random.default_rng(channels)
    img = cv2.GaussianBlur(rng.integers(0, 256, (300, 340, channels), dtype=np.uint8), (0, 0), 1.0)
    img = img.reshape(300, 340, channels)
    t = T.Compose([T.RandomResizedCrop(64, scale=(0.3, 1.0)), T.RandomHorizontalFlip()])
    for k in range(40):  # every box is at least ~150 px a side: all shrink to 64
        plan = t.plan(img.shape[:2], np.random.default_rng(k))
        out = plan.execute(img, img.shape[:2])
        box = img[int(round(plan.top)) : int(round(plan.top + plan.h)), int(round(plan.left)) : int(round(plan.left + plan.w))]
        ref = cv2.resize(box, (64, 64), interpolation=cv2.INTER_AREA).reshape(64, 64, channels)
        if plan.flip:
            ref = ref[:, ::-1]
        assert out.shape == (64, 64, channels)
        assert np.abs(out.astype(int) - ref).max() <= 1


def test_plan_writes_into_a_batch_slot_with_the_same_pixels(img):
    t = T.Compose([T.RandomResizedCrop(32), T.RandomHorizontalFlip()])
    batch = np.zeros((3, 32, 32, 3), np.uint8)
    for k in range(3):
        plan = t.plan(img.shape[:2], np.random.default_rng(k))
        plan.execute(img, img.shape[:2], dst=batch[k])
        assert np.array_equal(batch[k], t(img, rng=np.random.default_rng(k)))


def test_resize_and_center_crop_follow_torchvision_rules(img):
    assert T.Resize(45)(img).shape == (45, int(45 * 130 / 90), 3)
    assert T.Resize((20, 30))(img).shape == (20, 30, 3)
    assert np.array_equal(T.CenterCrop((50, 61))(img), center_crop(img, (50, 61)))
    padded = T.CenterCrop(100)(img)
    assert padded.shape == (100, 100, 3)
    assert (padded[:5] == 0).all() and (padded[95:] == 0).all()
    assert np.array_equal(padded[5:95], center_crop(np.pad(img, ((5, 5), (0, 0), (0, 0))), (90, 100)))


def test_flip_then_crop_composes_correctly(img):
    out = T.Compose([T.RandomHorizontalFlip(p=1.0), T.CenterCrop((90, 30))])(img)
    ref = center_crop(np.ascontiguousarray(img[:, ::-1]), (90, 30))
    assert np.array_equal(out, ref)
    # crop at an offset after a flip: a Resize to the same size keeps pixels exact
    crop_after_flip = T.Compose([T.RandomHorizontalFlip(1.0), T.Resize((90, 130)), T.CenterCrop((40, 40))])(img)
    assert np.array_equal(crop_after_flip, center_crop(np.ascontiguousarray(img[:, ::-1]), (40, 40)))


def test_same_rng_same_augmentation_and_different_rngs_differ(img):
    t = T.Compose([T.RandomResizedCrop(24), T.RandomHorizontalFlip()])
    a = [t(img, rng=np.random.default_rng(s)) for s in range(6)]
    b = [t(img, rng=np.random.default_rng(s)) for s in range(6)]
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert len({x.tobytes() for x in a}) > 1


def test_reduce_choice_keeps_the_box_at_least_output_size():
    p = Plan(0, 0, 400, 600, 100, 100)
    assert p.reduce_for((400, 600)) == 4
    assert Plan(0, 0, 150, 150, 100, 100).reduce_for((150, 150)) == 1
    assert Plan(0, 0, 200, 900, 100, 100).reduce_for((200, 900)) == 2


def test_fixed_output_hw():
    assert fixed_output_hw(T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip()])) == (224, 224)
    assert fixed_output_hw(T.Compose([T.Resize(256), T.CenterCrop(224)])) == (224, 224)
    assert fixed_output_hw(T.Compose([T.Resize(256)])) is None
    assert fixed_output_hw(T.Compose([T.RandomResizedCrop(8), T.Normalize([0.5] * 3, [0.5] * 3)])) is None


def test_normalize_and_to_tensor(img):
    out = T.Normalize([0.5, 0.25, 0.0], [0.5, 0.25, 1.0])(img)
    ref = (img.astype(np.float32) / 255 - np.array([0.5, 0.25, 0.0], np.float32)) / np.array([0.5, 0.25, 1.0], np.float32)
    assert out.dtype == np.float32 and np.allclose(out, ref, atol=1e-5)
    t = T.ToTensor()(img)
    assert tuple(t.shape) == (3, 90, 130) and float(t.max()) <= 1.0
    assert np.allclose(t.numpy().transpose(1, 2, 0), img / 255.0, atol=1e-6)
    u = T.ToTensor(scale=False)(img)
    assert np.array_equal(u.numpy().transpose(1, 2, 0), img)


@pytest.mark.parametrize(
    "factory",
    [lambda: T.RandomResizedCrop(0), lambda: T.RandomResizedCrop(8, scale=(0.5, 0.1)),
     lambda: T.RandomHorizontalFlip(1.5), lambda: T.Normalize([0.5], [0.0]), lambda: T.Resize((0, 3)),
     lambda: T.RandomResizedCrop(8, interpolation="fancy")],
)
def test_bad_arguments_raise_value_error(factory):
    with pytest.raises(ValueError):
        factory()


@settings(max_examples=60, deadline=None)
@given(h=st.integers(2, 300), w=st.integers(2, 300), seed=st.integers(0, 1000))
def test_any_input_size_gives_the_requested_output(h, w, seed):
    img = np.full((h, w, 3), 7, np.uint8)
    out = T.Compose([T.RandomResizedCrop((17, 23)), T.RandomHorizontalFlip()])(img, rng=np.random.default_rng(seed))
    assert out.shape == (17, 23, 3) and (out == 7).all()


def test_a_box_inside_the_image_stays_inside_a_reduced_decode():
    # Rounding a box's top and height separately reached one row past a reduced decode in
    # ~0.15% of boxes; 20,000 random boxes find such cases every time.
    rng = np.random.default_rng(0)
    for _ in range(20000):
        H, W = (int(x) for x in rng.integers(16, 400, 2))
        r = int(rng.choice([2, 4, 8]))
        h, w = int(rng.integers(r, H + 1)), int(rng.integers(r, W + 1))
        top, left = int(rng.integers(0, H - h + 1)), int(rng.integers(0, W - w + 1))
        reduced = np.full((-(-H // r), -(-W // r), 3), 200, np.uint8)  # what a 1/r DCT decode gives
        out = Plan(top, left, h, w, 7, 9).execute(reduced, (H, W))
        assert (out == 200).all(), f"zero padding at an edge: box {(top, left, h, w)} of {(H, W)}, reduce {r}"


@pytest.mark.parametrize("p", [0.0, 0.3, 1.0])
def test_horizontal_flip_probability(img, p):
    t = T.RandomHorizontalFlip(p)
    flipped = sum(np.array_equal(t(img, rng=np.random.default_rng(s)), img[:, ::-1]) for s in range(400))
    assert abs(flipped / 400 - p) < 0.08
