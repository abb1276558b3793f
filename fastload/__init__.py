"""fastload: make PyTorch image training stop waiting for data.

Pack an image folder into LMDB/HDF5 shards (``fastload pack``), read them with a drop-in
``ImageFolder`` and a fast ``DataLoader``, and feed the GPU with ``CUDAPrefetcher`` or DALI.

Names that need torch are imported lazily, so ``import fastload`` (and the CLI) stays cheap
and never imports DALI, h5py or jpeg4py.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# name -> module that defines it (relative to this package)
_LAZY = {
    "BlockShufflePlan": ".data.plan",
    "CUDAPrefetcher": ".gpu.prefetcher",
    "CorruptRecordError": ".errors",
    "DataLoader": ".data.loader",
    "DecodeError": ".errors",
    "DistributedEpochSampler": ".data.sampler",
    "EpochPlan": ".data.plan",
    "FastloadError": ".errors",
    "FormatError": ".errors",
    "IMAGENET": ".normalization",
    "ImageFolder": ".data.dataset",
    "Manifest": ".schema",
    "Normalization": ".normalization",
    "OnError": ".config",
    "OnRecordError": ".data.protocols",
    "PerformanceWarning": ".errors",
    "PackConfig": ".config",
    "PackError": ".errors",
    "PackReader": ".storage",
    "PackSummary": ".pack",
    "SharedMemoryFull": ".data.shm",
    "WorkerError": ".data.loader",
    "WorkerTimeout": ".data.loader",
    "collate_uint8": ".data.collate",
    "epoch_indices": ".data.sampler",
    "get_codec": ".codecs",
    "make_image_folder": ".sample",
    "make_loader": ".loaders",
    "open_pack": ".storage",
    "scan_source": ".pack",
}

# Public submodules, also imported on first attribute access (``fastload.transforms``,
# ``fastload.gpu``).
_SUBMODULES = ("dali", "gpu", "pack", "train", "transforms")

__all__ = sorted([*_LAZY, *_SUBMODULES, "__version__"])


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        value = importlib.import_module(f".{name}", __name__)
        globals()[name] = value
        return value
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'fastload' has no attribute {name!r}")
    value = getattr(importlib.import_module(mod, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # pragma: no cover
    from . import dali, gpu, pack, train, transforms
    from .config import OnError, PackConfig
    from .pack import PackSummary, scan_source
    from .codecs import get_codec
    from .data.dataset import ImageFolder
    from .data.collate import collate_uint8
    from .data.loader import DataLoader, WorkerError, WorkerTimeout
    from .data.shm import SharedMemoryFull
    from .data.plan import BlockShufflePlan, EpochPlan
    from .data.protocols import OnRecordError
    from .data.sampler import DistributedEpochSampler, epoch_indices
    from .gpu.prefetcher import CUDAPrefetcher
    from .loaders import make_loader
    from .errors import CorruptRecordError, DecodeError, FastloadError, FormatError, PackError, PerformanceWarning
    from .normalization import IMAGENET, Normalization
    from .sample import make_image_folder
    from .schema import Manifest
    from .storage import PackReader, open_pack
