"""Run under ``torchrun --nproc_per_node=2``: each rank writes the dataset indices it saw.

Usage: torchrun --nproc_per_node=2 tests/ddp_loader_indices.py OUT_DIR N BATCH
The dataset's label is its index, so the targets are the indices. Rank r writes
OUT_DIR/rank{r}.npy with one row per batch-concatenated epoch (epochs 0 and 1).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from fastload.data.loader import DataLoader

sys.path.insert(0, str(Path(__file__).parent))
from _data_helpers import Indices  # noqa: E402


def main() -> None:
    out, n, batch = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    loader = DataLoader(Indices(n), batch, num_workers=1, seed=3)  # distributed=None: from torch.distributed
    assert (loader.rank, loader.world_size) == (rank, dist.get_world_size())
    epochs = []
    for epoch in range(2):
        loader.set_epoch(epoch)
        seen = [t for _, t in loader]
        count = torch.tensor([len(seen)])
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        if int(count) != len(seen):
            raise SystemExit(f"rank {rank}: {len(seen)} batches, another rank had {int(count)}")
        epochs.append(torch.cat(seen).numpy())
    np.save(out / f"rank{rank}.npy", np.stack(epochs))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
