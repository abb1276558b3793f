"""The small training helpers compute the same function as the model they transform."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch import nn

from fastload import train
from fastload.train.models import ResNet, SmallCNN, resnet18, resnet50, resnet_small


def _with_running_stats(model: nn.Module, x: torch.Tensor, steps: int = 3) -> nn.Module:
    """Give every BN non-trivial running statistics and affine parameters."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.weight.copy_(torch.rand(m.num_features, generator=g) + 0.5)
                m.bias.copy_(torch.randn(m.num_features, generator=g))
        model.train()
        for _ in range(steps):
            model(x)
    return model


def test_seed_everything_repeats_python_numpy_torch():
    def draw():
        return random.random(), float(np.random.rand()), float(torch.rand(()))

    train.seed_everything(123)
    a = draw()
    train.seed_everything(123)
    b = draw()
    train.seed_everything(124)
    c = draw()
    assert a == b
    assert a != c
    train.seed_everything(5, deterministic=True)
    assert torch.backends.cudnn.deterministic and torch.are_deterministic_algorithms_enabled()
    train.seed_everything(5)
    assert not torch.backends.cudnn.deterministic and not torch.are_deterministic_algorithms_enabled()
    with pytest.raises(ValueError):
        train.seed_everything(-1)


def test_same_seed_gives_identical_model_init():
    train.seed_everything(3)
    a = resnet_small(num_classes=5).state_dict()
    train.seed_everything(3)
    b = resnet_small(num_classes=5).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_relu_inplace_same_outputs_and_gradients():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 3), nn.ReLU(),
                          nn.Flatten(), nn.LazyLinear(3))
    x = torch.randn(4, 3, 12, 12)
    model(x)  # materialise the lazy layer
    ref = [p.detach().clone() for p in model.parameters()]
    out_ref = model(x)
    out_ref.sum().backward()
    grads_ref = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    train.relu_inplace(model)
    assert all(m.inplace for m in model.modules() if isinstance(m, nn.ReLU))
    out = model(x)
    out.sum().backward()
    assert torch.allclose(out, out_ref)
    assert all(torch.allclose(g, r) for g, r in zip((p.grad for p in model.parameters()), grads_ref))
    assert all(torch.equal(p, r) for p, r in zip(model.parameters(), ref))


@pytest.mark.parametrize("make", [lambda: SmallCNN(num_classes=6), lambda: resnet_small(num_classes=6)])
def test_fuse_conv_bn_matches_eval_model(make):
    torch.manual_seed(1)
    x = torch.randn(8, 3, 16, 16)
    model = _with_running_stats(make(), x).eval()
    n_bn = sum(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    with torch.no_grad():
        ref = model(x)
        train.fuse_conv_bn(model)
        out = model(x)
    assert n_bn > 0
    assert not any(isinstance(m, nn.BatchNorm2d) for m in model.modules()), "every conv->BN pair fused"
    assert torch.allclose(out, ref, atol=1e-4, rtol=1e-4)


def test_fuse_conv_bn_eval_single_pair_with_bias_and_groups():
    torch.manual_seed(2)
    conv = nn.Conv2d(4, 8, 3, padding=1, groups=2, bias=True)
    bn = nn.BatchNorm2d(8)
    x = torch.randn(5, 4, 9, 9)
    _with_running_stats(nn.Sequential(conv, bn), x)
    bn.eval()
    with torch.no_grad():
        assert torch.allclose(train.fuse_conv_bn_eval(conv, bn)(x), bn(conv(x)), atol=1e-5)


def test_fuse_conv_bn_refuses_training_mode_and_bad_pairs():
    with pytest.raises(ValueError, match="eval"):
        train.fuse_conv_bn(SmallCNN(num_classes=2).train())
    with pytest.raises(ValueError, match="output channels"):
        train.fuse_conv_bn_eval(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(5))


def test_drop_conv_bias_before_bn_same_function_train_and_eval():
    torch.manual_seed(3)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, bias=True), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 4, 3, bias=True))
    with torch.no_grad():
        model[0].bias.uniform_(-2, 2)
    x = torch.randn(6, 3, 10, 10)
    _with_running_stats(model, x)
    model.eval()
    with torch.no_grad():
        ref_eval = model(x)
    model.train()
    before = {k: v.clone() for k, v in model[1].state_dict().items()}
    ref_train = model(x)
    model[1].load_state_dict(before)  # undo that forward's statistics update
    train.drop_conv_bias_before_bn(model)
    assert model[0].bias is None
    assert model[3].bias is not None, "a conv not followed by BN keeps its bias"
    model.eval()
    with torch.no_grad():
        assert torch.allclose(model(x), ref_eval, atol=1e-5)
    model.train()
    assert torch.allclose(model(x), ref_train, atol=1e-5)


@pytest.mark.parametrize("blocks", [("features",), ("layer1", "layer3")])
def test_activation_checkpointing_same_gradients_and_bn_stats(blocks):
    make = (lambda: SmallCNN(num_classes=4)) if blocks == ("features",) else (lambda: resnet_small(num_classes=4))
    torch.manual_seed(4)
    ref_model = make()
    model = make()
    model.load_state_dict(ref_model.state_dict())
    train.apply_activation_checkpointing(model, blocks)
    assert list(model.state_dict()) == list(ref_model.state_dict()), "parameter names unchanged"
    x, y = torch.randn(8, 3, 16, 16), torch.randint(0, 4, (8,))
    for m in (ref_model, model):
        nn.functional.cross_entropy(m(x), y).backward()
    for (n, p), q in zip(model.named_parameters(), ref_model.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-6), n
    for (n, b), c in zip(model.named_buffers(), ref_model.buffers()):
        assert torch.equal(b, c), f"{n}: recomputation must not update BN statistics twice"
    with pytest.raises(ValueError, match="no submodule"):
        train.apply_activation_checkpointing(model, ["nope"])


def test_models_forward_shapes():
    x = torch.randn(2, 3, 64, 64)
    for m in (SmallCNN(num_classes=7), resnet_small(num_classes=7), resnet18(num_classes=7),
              resnet50(num_classes=7)):
        assert m(x).shape == (2, 7)
    r18 = resnet18(num_classes=1000)
    assert sum(p.numel() for p in r18.parameters()) == 11_689_512  # torchvision's resnet18
    assert isinstance(train.get_model("resnet_small", num_classes=3), ResNet)
    assert "small_cnn" in train.available_models()
    with pytest.raises(ValueError, match="unknown model"):
        train.get_model("alexnet2000", num_classes=3)


def test_check_batch_geometry():
    assert train.check_batch_geometry(100, batch_size=10, world_size=2, accum_steps=2) == 5
    assert train.check_batch_geometry(105, batch_size=10, world_size=2, drop_last=True) == 5
    with pytest.raises(ValueError, match=r"10 x world size 4 x accumulation 2 = 80 images.*only 50"):
        train.check_batch_geometry(50, batch_size=10, world_size=4, accum_steps=2)
    with pytest.raises(ValueError, match="batch_size"):
        train.check_batch_geometry(50, batch_size=0)


def test_train_config_validates():
    assert train.TrainConfig(precision="bf16").precision is train.Precision.BF16
    for bad in ({"accum_steps": 0}, {"precision": "fp8"}, {"grad_clip": 0.0},
                {"normalization": (0.5, 0.5)}):
        with pytest.raises(ValueError):
            train.TrainConfig(**bad)
