"""The backend choice in one place: ``make_loader(root, backend="cpu" | "dali", ...)``.

Both backends yield the same thing, ``(images, targets)`` with images float ``(N, 3, crop,
crop)`` on the device (normalised by one :class:`~fastload.Normalization` when given,
channels_last) and int64 targets, and both have ``len()``, ``set_epoch()``, ``state_dict()``
and ``load_state_dict()``. A training script switches between CPU decoding (fastload's
DataLoader + CUDAPrefetcher) and DALI (nvJPEG on the GPU) by changing one argument. Either
reads a local pack or one at a URL (``s3://...``, through the node-local shard cache), in a
full shuffle or a shard-aware block shuffle (:class:`Shuffle`).
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from .checks import check_batch_args, resolve_distributed
from .data.plan import BlockShufflePlan
from .data.protocols import on_error_skips
from .gpu.prefetcher import resolve_device
from .normalization import Normalization, as_normalization

__all__ = ["Backend", "BatchLoader", "Shuffle", "make_loader"]


class Backend(str, enum.Enum):
    """Where images are decoded and augmented."""

    CPU = "cpu"  # fastload ImageFolder + DataLoader workers, then CUDAPrefetcher
    DALI = "dali"  # DALI pipeline: nvJPEG (device "mixed") on a GPU, or DALI's CPU operators


class Shuffle(str, enum.Enum):
    """How a shuffled epoch is ordered (``make_loader(shuffle=...)``; ``False``: in order)."""

    FULL = "full"  # a fresh permutation of all samples per epoch (EpochPlan); also shuffle=True
    BLOCK = "block"  # shards shuffled, samples shuffled within windows of shards (BlockShufflePlan)


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
    shuffle: bool | Shuffle | str | None = None,
    shuffle_window: int = 4,
    drop_last: bool | None = None,
    channels_last: bool = True,
    scale: tuple[float, float] = (0.08, 1.0),
    ratio: tuple[float, float] = (3.0 / 4.0, 4.0 / 3.0),
    resize_ratio: float = 0.875,
    depth: int = 2,
    on_error: str = "raise",
    loader_kwargs: dict[str, Any] | None = None,
    cache_dir: str | Path | None = None,
    cache_limit: int | str | None = None,
    storage_options: dict | None = None,
    endpoint_url: str | None = None,
    retry_seconds: float = 60.0,
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

    ``root`` may be a URL (``s3://bucket/prefix``, ``gs://``, ``az://``): both backends read the
    pack through the node-local shard cache ``cache_dir`` (at most ``cache_limit`` bytes of
    shards), with ``storage_options``/``endpoint_url``/``retry_seconds`` for the store (see
    :class:`fastload.ImageFolder`).

    ``shuffle``: ``True`` or ``"full"`` is a fresh permutation of all samples every epoch (the
    default for ``train=True``, and the best mixing); ``False`` reads in order. ``"block"``
    follows a :class:`~fastload.data.plan.BlockShufflePlan` over the pack's shards: each epoch
    shuffles the shards, cuts them into windows of ``shuffle_window`` shards and shuffles the
    samples within each window. Use it for a pack read from object storage whose cache cannot
    hold all of it: a full shuffle reads every shard all the time, so each shard would be
    downloaded again and again, while a block shuffle's working set is about ``shuffle_window``
    shards per node at any moment (two windows while crossing from one to the next). The price
    is mixing: a batch draws from the samples of one window (two at a boundary), and a pack
    stores an image folder class by class, so a small window puts few classes in a batch;
    choose the largest window the cache holds. Size ``cache_limit`` for about three windows plus
    the shards of the batches loaded ahead (each reader holds the shards of up to two windows
    while it reads them). Seeded by ``seed``; resume is elastic over world sizes as for a full
    shuffle, but a checkpoint resumes only under the same shuffle and window.
    """
    try:
        backend = Backend(backend)
    except ValueError:
        raise ValueError(f"backend must be one of {', '.join(b.value for b in Backend)}, got {backend!r}") from None
    check_batch_args(batch_size=batch_size, crop=crop, resize_ratio=resize_ratio)
    on_error_skips(on_error)
    norm = as_normalization(normalization, mean=mean, std=std)
    dev = resolve_device(device)
    order = _shuffle(train if shuffle is None else shuffle)
    if isinstance(shuffle_window, bool) or not isinstance(shuffle_window, int) or shuffle_window < 1:
        raise ValueError(f"shuffle_window must be an int >= 1 (shards), got {shuffle_window!r}")
    shuffle = order is not None
    drop_last = train if drop_last is None else bool(drop_last)
    extra = dict(loader_kwargs or {})
    remote = dict(cache_dir=cache_dir, cache_limit=cache_limit, storage_options=storage_options,
                  endpoint_url=endpoint_url, retry_seconds=retry_seconds)

    def block_plan(shard_starts) -> BlockShufflePlan:
        rank, world_size = resolve_distributed(distributed)
        return BlockShufflePlan(int(shard_starts[-1]), batch_size=batch_size, seed=seed, rank=rank,
                                world_size=world_size, drop_last=drop_last,
                                shard_starts=tuple(int(x) for x in shard_starts), window=shuffle_window)

    if backend is Backend.DALI:
        from .gpu.dali import DALILoader

        if num_workers is not None:
            extra.setdefault("num_threads", num_workers)
        if order is Shuffle.BLOCK:  # the plan needs the pack's shard layout before the loader exists
            from .storage import open_pack

            probe = open_pack(root, check_files=False, **remote)
            try:
                extra["plan"] = block_plan(probe.shard_starts)
            finally:
                probe.close()
        return DALILoader(
            root, batch_size, device="gpu" if dev.type == "cuda" else "cpu",
            device_id=dev.index if dev.type == "cuda" else None,
            shuffle=shuffle, seed=seed, drop_last=drop_last, crop=crop, normalization=norm, on_error=on_error,
            distributed=distributed, train=train, dtype=dtype, channels_last=channels_last,
            scale=scale, ratio=ratio, resize_ratio=resize_ratio, **remote, **extra,
        )

    from .data.dataset import ImageFolder
    from .data.loader import DataLoader
    from .gpu.prefetcher import CUDAPrefetcher
    from .transforms import CenterCrop, Compose, RandomHorizontalFlip, RandomResizedCrop, Resize

    if train:
        transform = Compose([RandomResizedCrop(crop, scale=scale, ratio=ratio), RandomHorizontalFlip()])
    else:
        transform = Compose([Resize(max(crop, int(round(crop / resize_ratio)))), CenterCrop(crop)])
    dataset = ImageFolder(root, transform=transform, seed=seed, **remote)
    if order is Shuffle.BLOCK:
        extra["plan"] = block_plan(dataset.reader.shard_starts)
    loader = DataLoader(
        dataset, batch_size, shuffle=shuffle, seed=seed, drop_last=drop_last,
        num_workers=num_workers, distributed=distributed, on_error=on_error, **extra,
    )
    return CUDAPrefetcher(loader, dev, normalization=norm, dtype=dtype, channels_last=channels_last, depth=depth)


def _shuffle(value: bool | Shuffle | str) -> Shuffle | None:
    """The order a ``shuffle`` argument asks for: None (in order), FULL or BLOCK."""
    if isinstance(value, bool):
        return Shuffle.FULL if value else None
    try:
        return Shuffle(value)
    except ValueError:
        raise ValueError(f"shuffle must be a bool, 'full' or 'block', got {value!r}") from None
