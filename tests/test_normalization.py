"""fastload.Normalization: one value in 0-1 units, the same floats from every consumer.

Wrong-unit values are refused wherever they enter (Normalization, TrainConfig, CUDAPrefetcher,
make_loader, DALILoader, the GPU and CPU transforms), and one Normalization gives the same
tensors from the CPU ``Normalize`` transform, the GPU ``normalize`` helper, ``CUDAPrefetcher``,
``Trainer._prepare`` and the DALI CPU pipeline, all fed the pixels of one real raw pack.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fastload
from fastload import train
from fastload.config import PackConfig
from fastload.gpu.prefetcher import CUDAPrefetcher
from fastload.gpu.transforms import IMAGENET_MEAN, IMAGENET_STD, BatchAugment, normalize
from fastload.loaders import make_loader
from fastload.normalization import IMAGENET, SCALE_ONLY, Normalization, as_normalization, scale_shift
from fastload.transforms import Normalize

from _dali_helpers import needs_dali

IMAGENET_255 = ((123.675, 116.28, 103.53), (58.395, 57.12, 57.375))  # the same statistics in 0-255 units
SIZE = 24  # stored (square) image size of the raw pack; DALI crops exactly this, so no resampling

NORMALIZATIONS = {
    "imagenet": IMAGENET,
    "one-channel": Normalization((0.5,), (0.25,)),
    "from-255": Normalization.from_255((128.0, 120.0, 100.0), (64.0, 60.0, 50.0)),
}


# -- the value itself --------------------------------------------------------------------


def test_public_names_and_imagenet():
    assert fastload.Normalization is Normalization and fastload.IMAGENET is IMAGENET
    assert {"IMAGENET", "Normalization"} <= set(fastload.__all__)
    assert IMAGENET == Normalization((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    assert (IMAGENET_MEAN, IMAGENET_STD) == (IMAGENET.mean, IMAGENET.std)
    with pytest.raises(dataclasses.FrozenInstanceError):
        IMAGENET.mean = (0.5,)  # type: ignore[misc]
    assert hash(Normalization([0.5], np.array([0.25]))) == hash(Normalization((0.5,), (0.25,)))


def test_values_become_tuples_of_floats_and_bad_shapes_are_refused():
    n = Normalization(np.array([0, 1]), torch.tensor([0.5, 1.0]))
    assert n.mean == (0.0, 1.0) and n.std == (0.5, 1.0)
    assert all(type(v) is float for v in (*n.mean, *n.std))
    for mean, std, match in [
        ((), (), "same length"),
        ((0.5, 0.5), (0.25,), "same length"),
        ((0.5,), (0.0,), "> 0"),
        ((0.5,), (-0.1,), "> 0"),
        ((float("nan"),), (0.5,), "finite"),
        ("abc", (0.5,) * 3, "sequence of numbers"),
        (0.5, 0.25, "sequence of numbers"),
    ]:
        with pytest.raises(ValueError, match=match):
            Normalization(mean, std)


@pytest.mark.parametrize("mean, std", [IMAGENET_255, ((0.5,) * 3, (64.0,) * 3), ((128.0,), (0.5,))])
def test_values_in_0_255_units_are_refused_and_the_error_names_from_255(mean, std):
    with pytest.raises(ValueError, match=r"0-1 units.*from_255"):
        Normalization(mean, std)


def test_from_255_converts_and_refuses_values_in_0_1_units():
    n = Normalization.from_255(*IMAGENET_255)
    np.testing.assert_allclose(n.mean, IMAGENET.mean, rtol=1e-12)
    np.testing.assert_allclose(n.std, IMAGENET.std, rtol=1e-12)
    np.testing.assert_allclose(IMAGENET.mean_255, IMAGENET_255[0], rtol=1e-12)
    np.testing.assert_allclose(IMAGENET.std_255, IMAGENET_255[1], rtol=1e-12)
    with pytest.raises(ValueError, match=r"0-255 units.*Normalization\(mean, std\)"):
        Normalization.from_255(IMAGENET.mean, IMAGENET.std)
    with pytest.raises(ValueError, match="0-255 units"):
        Normalization.from_255((0.0,), (1.0,))


def test_scale_shift_broadcasts_one_channel_and_refuses_other_mismatches():
    one = Normalization((0.5,), (0.25,))
    assert one.broadcast(3) == Normalization((0.5,) * 3, (0.25,) * 3)
    assert one.scale_shift(3) == ((1 / (255 * 0.25),) * 3, (2.0,) * 3)
    assert IMAGENET.broadcast(3) is IMAGENET
    with pytest.raises(ValueError, match="3 channels but the images have 4 channels"):
        IMAGENET.scale_shift(4)
    assert scale_shift(None, 2) == ((1 / 255,) * 2, (0.0,) * 2)  # None: x / 255 only
    assert SCALE_ONLY.scale_shift(1) == scale_shift(None, 1)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.floats(0.0, 1.0), st.floats(1e-3, 1.0)), min_size=1, max_size=4),
    st.integers(0, 255),
)
def test_scale_shift_is_the_normalisation_formula(pairs, x):
    n = Normalization(tuple(m for m, _ in pairs), tuple(s for _, s in pairs))
    scale, shift = n.scale_shift(len(pairs))
    for a, b, m, s in zip(scale, shift, n.mean, n.std):
        assert x * a - b == pytest.approx((x / 255 - m) / s, rel=1e-9, abs=1e-9)


def test_as_normalization_is_the_one_check_of_user_input():
    assert as_normalization() is None
    assert as_normalization(IMAGENET) is IMAGENET
    assert as_normalization(mean=[0.5, 0.4], std=[0.2, 0.1]) == Normalization((0.5, 0.4), (0.2, 0.1))
    assert as_normalization(mean=(0.5, 0.4)) == Normalization((0.5, 0.4), (1.0, 1.0))
    assert as_normalization(std=(0.5,)) == Normalization((0.0,), (0.5,))
    with pytest.raises(ValueError, match="not both"):
        as_normalization(IMAGENET, mean=(0.5,) * 3)
    with pytest.raises(ValueError, match="fastload.Normalization"):
        as_normalization((0.5, 0.25))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="from_255"):
        as_normalization(mean=IMAGENET_255[0], std=IMAGENET_255[1])


def test_importing_the_module_pulls_neither_torch_nor_numpy():
    code = ("import sys, json, fastload.normalization; "
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


# -- every consumer refuses the wrong unit ----------------------------------------------------


def test_consumers_refuse_0_255_values_given_as_0_1():
    mean, std = IMAGENET_255
    x = torch.zeros(1, 3, 4, 4, dtype=torch.uint8)
    for build in (
        lambda: normalize(x, mean=mean, std=std),
        lambda: BatchAugment(8, mean=mean, std=std),
        lambda: Normalize(mean, std),
        lambda: CUDAPrefetcher([], "cpu", mean=mean, std=std),
        lambda: CUDAPrefetcher([], "cpu", mean=mean),
        lambda: train.TrainConfig(normalization=Normalization(mean, std)),
    ):
        with pytest.raises(ValueError, match=r"0-1 units.*from_255"):
            build()


def test_train_config_takes_one_normalization_and_drops_the_0_255_keywords():
    assert train.TrainConfig().normalization is IMAGENET
    assert train.TrainConfig(normalization=None).normalization is None
    with pytest.raises(ValueError, match="fastload.Normalization"):
        train.TrainConfig(normalization=IMAGENET.mean)  # type: ignore[arg-type]
    with pytest.raises(TypeError):  # the old 0-255 keyword fails loudly instead of training on wrong inputs
        train.TrainConfig(mean=IMAGENET_255[0])  # type: ignore[call-arg]


@pytest.mark.parametrize("backend", ["cpu", "dali"])
def test_make_loader_refuses_the_wrong_unit_before_building_anything(tmp_path, backend):
    missing = tmp_path / "no_pack_here"  # never opened: the check comes first
    with pytest.raises(ValueError, match=r"0-1 units.*from_255"):
        make_loader(missing, backend=backend, batch_size=2, mean=IMAGENET_255[0], std=IMAGENET_255[1],
                    device="cpu")
    with pytest.raises(ValueError, match="not both"):
        make_loader(missing, backend=backend, batch_size=2, normalization=IMAGENET, mean=IMAGENET.mean,
                    device="cpu")


@needs_dali
def test_dali_loader_refuses_the_wrong_unit_before_opening_the_pack(tmp_path):
    from fastload.dali import DALILoader

    with pytest.raises(ValueError, match=r"0-1 units.*from_255"):
        DALILoader(tmp_path / "no_pack_here", 2, device="cpu", mean=IMAGENET_255[0], std=IMAGENET_255[1])
    with pytest.raises(ValueError, match="4 channels but the images have 3 channels"):
        DALILoader(tmp_path / "no_pack_here", 2, device="cpu", normalization=Normalization((0.5,) * 4, (0.5,) * 4))


# -- the same tensors from every consumer ------------------------------------------------------


@pytest.fixture(scope="module")
def raw_pack(tmp_path_factory, sample_tree) -> tuple[Path, np.ndarray]:
    """A raw-payload pack of SIZE x SIZE RGB images and its stored pixels, (N, H, W, 3) uint8."""
    from fastload.pack import pack
    from fastload.storage import open_pack

    root = tmp_path_factory.mktemp("norm") / "raw"
    pack(sample_tree, root, config=PackConfig(payload="raw", size=(SIZE, SIZE), workers=1, progress=False))
    reader = open_pack(root)
    pixels = np.stack([np.frombuffer(reader.get(i), np.uint8).reshape(SIZE, SIZE, 3) for i in range(len(reader))])
    reader.close()
    return root, pixels


def _reference(pixels: np.ndarray, norm: Normalization | None) -> torch.Tensor:
    """The GPU helper on CPU tensors: the arithmetic every other consumer must match."""
    return normalize(torch.from_numpy(pixels).permute(0, 3, 1, 2).contiguous(), normalization=norm)


@pytest.mark.parametrize("name", sorted(NORMALIZATIONS))
def test_torch_and_numpy_consumers_give_identical_tensors(raw_pack, name):
    norm = NORMALIZATIONS[name]
    _, pixels = raw_pack
    x = torch.from_numpy(pixels).permute(0, 3, 1, 2).contiguous()
    labels = torch.arange(len(x))
    ref = _reference(pixels, norm)
    assert ref.dtype == torch.float32 and ref.shape == (len(pixels), 3, SIZE, SIZE)
    exact = (x.double() / 255 - torch.tensor(norm.broadcast(3).mean).view(1, 3, 1, 1).double()) / torch.tensor(
        norm.broadcast(3).std).view(1, 3, 1, 1).double()
    torch.testing.assert_close(ref.double(), exact, atol=1e-5, rtol=0)

    # mean=/std= keywords and normalization= are one thing
    if norm.channels == 3:
        assert torch.equal(normalize(x, mean=norm.mean, std=norm.std), ref)

    # CPU Normalize transform, HWC float32 per image
    cpu = np.stack([Normalize(norm)(img) for img in pixels])
    assert cpu.dtype == np.float32
    assert torch.equal(torch.from_numpy(cpu).permute(0, 3, 1, 2), ref)

    # CUDAPrefetcher on the CPU
    (got, y), = list(CUDAPrefetcher([(x, labels)], "cpu", normalization=norm))
    assert torch.equal(got, ref) and torch.equal(y, labels)
    assert CUDAPrefetcher([], "cpu", normalization=norm).normalization is norm

    # the Trainer's own uint8 path
    model = torch.nn.Conv2d(3, 2, 1)
    trainer = train.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.0), device="cpu",
                            config=train.TrainConfig(normalization=norm))
    prepared, y = trainer._prepare((x, labels))
    assert torch.equal(prepared, ref) and torch.equal(y, labels)

    # BatchAugment normalises with it too (before its crop): a full-image crop without flips
    # resamples nothing, so only the normalisation is left.
    aug = BatchAugment(SIZE, scale=(1.0, 1.0), ratio=(1.0, 1.0), flip_p=0.0, normalization=norm)
    torch.testing.assert_close(aug(x, epoch=0, indices=np.arange(len(x))), ref, atol=1e-5, rtol=0)


def test_none_means_x_over_255_everywhere(raw_pack):
    _, pixels = raw_pack
    x = torch.from_numpy(pixels).permute(0, 3, 1, 2).contiguous()
    ref = x.float() / 255
    assert torch.equal(_reference(pixels, None), normalize(x, normalization=SCALE_ONLY))
    torch.testing.assert_close(_reference(pixels, None), ref, atol=1e-7, rtol=0)
    (got,) = list(CUDAPrefetcher([x], "cpu"))
    assert torch.equal(got, _reference(pixels, None))
    model = torch.nn.Conv2d(3, 2, 1)
    trainer = train.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.0), device="cpu",
                            config=train.TrainConfig(normalization=None))
    assert torch.equal(trainer._prepare((x, torch.zeros(len(x))))[0], _reference(pixels, None))


@pytest.mark.parametrize("backend", ["cpu", pytest.param("dali", marks=needs_dali)])
def test_make_loader_hands_one_normalization_to_either_backend(raw_pack, backend):
    root, _ = raw_pack
    norm = NORMALIZATIONS["from-255"]
    kw = {"loader_kwargs": {"py_num_workers": 1}} if backend == "dali" else {}
    loader = make_loader(root, backend=backend, batch_size=4, train=False, crop=SIZE, resize_ratio=1.0,
                         normalization=norm, device="cpu", num_workers=1 if backend == "dali" else 0, **kw)
    assert loader.normalization is norm
    same = make_loader(root, backend=backend, batch_size=4, train=False, crop=SIZE, resize_ratio=1.0,
                       mean=norm.mean, std=norm.std, device="cpu", num_workers=1 if backend == "dali" else 0, **kw)
    assert same.normalization == norm


@needs_dali
@pytest.mark.parametrize("name", ["imagenet", "one-channel"])
def test_dali_cpu_pipeline_gives_the_same_tensors(raw_pack, name):
    from fastload.dali import DALILoader

    norm = NORMALIZATIONS[name]
    root, pixels = raw_pack
    loader = DALILoader(root, 8, device="cpu", train=False, crop=SIZE, resize_ratio=1.0, normalization=norm,
                        shuffle=False, channels_last=False, num_threads=1, py_num_workers=1)
    images, labels = zip(*[(x.clone(), y.clone()) for x, y in loader])
    got = torch.cat(images)
    order = loader.indices(0)
    assert len(got) == len(pixels) and sorted(order.tolist()) == list(range(len(pixels)))
    torch.testing.assert_close(got, _reference(pixels[order], norm), atol=1e-5, rtol=0)
