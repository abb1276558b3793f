"""The backend choice in one place: ``make_loader(root, backend="cpu" | "dali", ...)``.

Both backends yield the same thing, ``(images, targets)`` with images float ``(N, 3, crop,
crop)`` on the device (normalised by one :class:`~fastload.Normalization` when given,
channels_last) and int64 targets, and both have ``len()``, ``set_epoch()``, ``state_dict()``
and ``load_state_dict()``. A training script switches between CPU decoding (fastload's
DataLoader + CUDAPrefetcher) and DALI (nvJPEG on the GPU) by changing one argument.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from .checks import check_batch_args
from .data.protocols import on_error_skips
from .gpu.prefetcher import resolve_device
from .normalization import Normalization, as_normalization

__all__ = ["Backend", "BatchLoader", "make_loader"]


class Backend(str, enum.Enum):
    """Where images are decoded and augmented."""

    CPU = "cpu"  # fastload ImageFolder + DataLoader workers, then CUDAPrefetcher
    DALI = "dali"  # DALI pipeline: nvJPEG (device "mixed") on a GPU, or DALI's CPU operators


class BatchLoader(Protocol):
    """What :func:`make_loader` returns, whichever the backend."""

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]: ...
    def __len__(self) -> int: ...
    def batches_left(self) -> int: ...
    def set_epoch(self, epoch: int) -> None: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...


def make_loader(
    root: str | Path,
    *,
    backend: Backend | str = Backend.CPU,
    batch_size: int,
    train: bool = True,
    crop: int = 224,
    mean: Sequence[float] | None = None,
    std: Sequence[float] | None = None,
    normalization: Normalization | None = None,
    device: torch.device | str | int | None = None,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    distributed: tuple[int, int] | None = None,
    num_workers: int | None = None,
    shuffle: bool | None = None,
    drop_last: bool | None = None,
    channels_last: bool = True,
    scale: tuple[float, float] = (0.08, 1.0),
    ratio: tuple[float, float] = (3.0 / 4.0, 4.0 / 3.0),
    resize_ratio: float = 0.875,
    depth: int = 2,
    on_error: str = "raise",
    loader_kwargs: dict[str, Any] | None = None,
) -> BatchLoader:
    """Batches of the packed dataset at ``root``, ready for the model on ``device``.

    ``train=True``: random-resized-crop to ``crop`` and random flip, shuffled, full batches
    only (``shuffle``/``drop_last`` override); ``train=False``: resize the shorter side to
    ``crop / resize_ratio``, centre-crop, in order, keeping the last partial batch.
    ``normalization`` (or ``mean``/``std`` in 0-1 units; neither: just ``x / 255``) is validated
    once and passed to either backend, so both normalise alike.
    ``device=None`` means the current CUDA device, or the CPU without CUDA. ``num_workers``
    sets the CPU backend's worker processes (DALI's CPU threads for ``"dali"``).
    ``distributed``: ``None`` reads rank and world size from ``torch.distributed`` when it is
    initialised, or pass ``(rank, world_size)``. ``on_error``: ``"raise"`` or ``"skip"`` for
    corrupt records (see :class:`fastload.DataLoader`). ``loader_kwargs`` go to the backend's loader
    (fastload ``DataLoader`` or ``DALILoader``) unchanged.
    """
    try:
        backend = Backend(backend)
    except ValueError:
        raise ValueError(f"backend must be one of {', '.join(b.value for b in Backend)}, got {backend!r}") from None
    check_batch_args(batch_size=batch_size, crop=crop, resize_ratio=resize_ratio)
    on_error_skips(on_error)
    norm = as_normalization(normalization, mean=mean, std=std)
    dev = resolve_device(device)
    shuffle = train if shuffle is None else bool(shuffle)
    drop_last = train if drop_last is None else bool(drop_last)
    extra = dict(loader_kwargs or {})

    if backend is Backend.DALI:
        from .gpu.dali import DALILoader

        if num_workers is not None:
            extra.setdefault("num_threads", num_workers)
        return DALILoader(
            root, batch_size, device="gpu" if dev.type == "cuda" else "cpu",
            device_id=dev.index if dev.type == "cuda" else None,
            shuffle=shuffle, seed=seed, drop_last=drop_last, crop=crop, normalization=norm, on_error=on_error,
            distributed=distributed, train=train, dtype=dtype, channels_last=channels_last,
            scale=scale, ratio=ratio, resize_ratio=resize_ratio, **extra,
        )

    from .data.dataset import ImageFolder
    from .data.loader import DataLoader
    from .gpu.prefetcher import CUDAPrefetcher
    from .transforms import CenterCrop, Compose, RandomHorizontalFlip, RandomResizedCrop, Resize

    if train:
        transform = Compose([RandomResizedCrop(crop, scale=scale, ratio=ratio), RandomHorizontalFlip()])
    else:
        transform = Compose([Resize(max(crop, int(round(crop / resize_ratio)))), CenterCrop(crop)])
    dataset = ImageFolder(root, transform=transform, seed=seed)
    loader = DataLoader(
        dataset, batch_size, shuffle=shuffle, seed=seed, drop_last=drop_last,
        num_workers=num_workers, distributed=distributed, on_error=on_error, **extra,
    )
    return CUDAPrefetcher(loader, dev, normalization=norm, dtype=dtype, channels_last=channels_last, depth=depth)
