"""Public uint8 augmentation: ``fastload.transforms.Compose([RandomResizedCrop(224), ...])``.

Thin re-export of :mod:`fastload.data.transforms` (see there for how transforms are planned
before decoding and seeded per sample). Importing this module does not import torch.
"""

from __future__ import annotations

from .data.transforms import (
    CenterCrop,
    Compose,
    Lambda,
    Normalize,
    Plan,
    RandomHorizontalFlip,
    RandomResizedCrop,
    Resize,
    ToTensor,
    Transform,
)

__all__ = [
    "CenterCrop",
    "Compose",
    "Lambda",
    "Normalize",
    "Plan",
    "RandomHorizontalFlip",
    "RandomResizedCrop",
    "Resize",
    "ToTensor",
    "Transform",
]
