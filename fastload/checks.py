"""Argument checks shared by both loaders (fastload's DataLoader and the DALI loader) and by
``make_loader``: one public module both sides import, so neither imports the other."""

from __future__ import annotations

__all__ = ["check_batch_args", "resolve_distributed"]


def resolve_distributed(distributed) -> tuple[int, int]:
    """``(rank, world_size)`` from a loader's ``distributed`` argument: None reads
    ``torch.distributed`` when it is initialised (else a single process), False means a single
    process, True requires an initialised process group, and a pair sets them."""
    if distributed is False:
        return 0, 1
    if distributed is None or distributed is True:
        try:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                return dist.get_rank(), dist.get_world_size()
        except ImportError:  # pragma: no cover
            pass
        if distributed is True:
            raise ValueError("distributed=True but torch.distributed is not initialised")
        return 0, 1
    try:
        rank, world = (int(x) for x in distributed)
    except (TypeError, ValueError):
        raise ValueError(f"distributed must be None, a bool or (rank, world_size), got {distributed!r}") from None
    if not 0 <= rank < world:
        raise ValueError(f"distributed=(rank, world_size) needs 0 <= rank < world_size, got {distributed!r}")
    return rank, world


def check_batch_args(*, batch_size, crop, resize_ratio) -> None:
    """Validate the batch geometry both backends take (ValueError naming the bad value)."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    if isinstance(crop, bool) or not isinstance(crop, int) or crop < 1:
        raise ValueError(f"crop must be a positive int, got {crop!r}")
    if not 0 < resize_ratio <= 1:
        raise ValueError(f"resize_ratio must be in (0, 1], got {resize_ratio}")
