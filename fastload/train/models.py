"""A few image classifiers that need nothing but torch (torchvision is optional).

``small_cnn`` and ``resnet_small`` are sized for the demo and tests on a CPU; ``resnet18``
and ``resnet50`` follow the torchvision layout (same parameter names), so a training script
works the same whether torchvision is installed or not. :func:`get_model` prefers
torchvision's model of the same name when it is importable.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

__all__ = ["BUILTIN_MODELS", "ResNet", "SmallCNN", "available_models", "get_model", "resnet18", "resnet50",
           "resnet_small", "small_cnn"]


def _conv_bn(cin: int, cout: int, *, stride: int = 1) -> list[nn.Module]:
    return [nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]


class SmallCNN(nn.Module):
    """Four conv-BN-ReLU stages and a linear head: learns small images in seconds on a CPU.

    ``batch_norm=False`` gives a BN-free net, whose gradients do not depend on how a batch
    is split (used to test gradient accumulation).
    """

    def __init__(self, *, num_classes: int, width: int = 32, in_channels: int = 3, batch_norm: bool = True):
        super().__init__()
        if num_classes < 1 or width < 1:
            raise ValueError("num_classes and width must be >= 1")
        layers: list[nn.Module] = []
        cin = in_channels
        for i, cout in enumerate((width, width * 2, width * 4, width * 4)):
            if batch_norm:
                layers += _conv_bn(cin, cout, stride=1 if i == 0 else 2)
            else:
                layers += [nn.Conv2d(cin, cout, 3, stride=1 if i == 0 else 2, padding=1), nn.ReLU(inplace=True)]
            cin = cout
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.features(x)), 1))


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, cin: int, width: int, *, stride: int = 1):
        super().__init__()
        cout = width * self.expansion
        self.conv1 = nn.Conv2d(cin, width, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = _shortcut(cin, cout, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        idt = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + idt)


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin: int, width: int, *, stride: int = 1):
        super().__init__()
        cout = width * self.expansion
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)  # stride on 3x3 (v1.5)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = _shortcut(cin, cout, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        idt = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        return self.relu(self.bn3(self.conv3(out)) + idt)


def _shortcut(cin: int, cout: int, stride: int) -> nn.Module | None:
    if stride == 1 and cin == cout:
        return None
    return nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))


class ResNet(nn.Module):
    """ResNet v1.5 with torchvision's parameter names (conv1, bn1, layer1..4, fc).

    ``small_input=True`` swaps the 7x7/2 stem and max-pool for a 3x3/1 stem, the usual
    change for 32-64 pixel images. The last BN of each residual branch starts at zero
    (Goyal et al.), which helps large-batch training.
    """

    def __init__(self, block: type[BasicBlock] | type[Bottleneck], layers: tuple[int, ...], *, num_classes: int,
                 widths: tuple[int, ...] = (64, 128, 256, 512), small_input: bool = False):
        super().__init__()
        if len(layers) != len(widths):
            raise ValueError("layers and widths must have the same length")
        stem = widths[0]
        if small_input:
            self.conv1 = nn.Conv2d(3, stem, 3, padding=1, bias=False)
            self.maxpool: nn.Module = nn.Identity()
        else:
            self.conv1 = nn.Conv2d(3, stem, 7, stride=2, padding=3, bias=False)
            self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        self.bn1 = nn.BatchNorm2d(stem)
        self.relu = nn.ReLU(inplace=True)
        cin = stem
        for i, (n, w) in enumerate(zip(layers, widths)):
            blocks = []
            for j in range(n):
                blocks.append(block(cin, w, stride=2 if (j == 0 and i > 0) else 1))
                cin = w * block.expansion
            setattr(self, f"layer{i + 1}", nn.Sequential(*blocks))
        self.num_stages = len(layers)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        for m in self.modules():
            if isinstance(m, (BasicBlock, Bottleneck)):
                last_bn = m.bn3 if isinstance(m, Bottleneck) else m.bn2
                nn.init.zeros_(last_bn.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        for i in range(self.num_stages):
            x = getattr(self, f"layer{i + 1}")(x)
        return self.fc(torch.flatten(self.avgpool(x), 1))


def small_cnn(*, num_classes: int, **kw) -> nn.Module:
    return SmallCNN(num_classes=num_classes, **kw)


def resnet_small(*, num_classes: int, **kw) -> nn.Module:
    """A 3-stage ResNet (BasicBlock x [1,1,1], widths 32/64/128) for small images."""
    return ResNet(BasicBlock, (1, 1, 1), num_classes=num_classes, widths=(32, 64, 128), small_input=True, **kw)


def resnet18(*, num_classes: int = 1000, **kw) -> nn.Module:
    return ResNet(BasicBlock, (2, 2, 2, 2), num_classes=num_classes, **kw)


def resnet50(*, num_classes: int = 1000, **kw) -> nn.Module:
    return ResNet(Bottleneck, (3, 4, 6, 3), num_classes=num_classes, **kw)


BUILTIN_MODELS: dict[str, Callable[..., nn.Module]] = {
    "small_cnn": small_cnn,
    "resnet_small": resnet_small,
    "resnet18": resnet18,
    "resnet50": resnet50,
}


def _torchvision_models():
    try:
        import torchvision.models as tvm
    except Exception:  # not installed, or no build for this torch
        return None
    return tvm


def available_models() -> list[str]:
    """Names :func:`get_model` accepts: the built-ins, plus torchvision's when importable."""
    names = set(BUILTIN_MODELS)
    tvm = _torchvision_models()
    if tvm is not None:
        names |= set(tvm.list_models(module=tvm))
    return sorted(names)


def get_model(name: str, *, num_classes: int, prefer_torchvision: bool = True) -> nn.Module:
    """Build model ``name`` with ``num_classes`` outputs (randomly initialised).

    A name torchvision knows is built by torchvision when it is importable; the small
    built-ins (``small_cnn``, ``resnet_small``) are always ours.
    """
    tvm = _torchvision_models() if prefer_torchvision else None
    if tvm is not None and name not in ("small_cnn", "resnet_small") and name in tvm.list_models(module=tvm):
        return tvm.get_model(name, weights=None, num_classes=num_classes)
    if name not in BUILTIN_MODELS:
        raise ValueError(f"unknown model {name!r}; choose from {', '.join(available_models())}")
    return BUILTIN_MODELS[name](num_classes=num_classes)
