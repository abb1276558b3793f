"""Run under torchrun: phase "first" on 2 ranks reads 3 batches each of epoch 1 and saves the
loader state (rank 0); phase "rest" on 1 rank loads it and reads the rest of the epoch.

Usage: torchrun --nproc_per_node=W tests/ddp_elastic_resume.py OUT_DIR N first|rest
Each rank writes the dataset indices it saw (the labels are the indices) to OUT_DIR/<phase><rank>.npy.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from fastload.data.loader import DataLoader

sys.path.insert(0, str(Path(__file__).parent))
from _data_helpers import Indices  # noqa: E402


def main() -> None:
    out, n, phase = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    loader = DataLoader(Indices(n), 4, num_workers=1, seed=3)  # rank and world from torch.distributed
    seen = []
    if phase == "first":
        loader.set_epoch(1)
        for images, targets in loader:
            seen.append(targets)
            if len(seen) == 3:
                break
        state = loader.state_dict()
        if rank == 0:
            (out / "state.json").write_text(json.dumps(state))
    else:
        loader.load_state_dict(json.loads((out / "state.json").read_text()))
        loader.set_epoch(1)
        seen = [t for _, t in loader]
    np.save(out / f"{phase}{rank}.npy", torch.cat(seen).numpy() if seen else np.zeros(0, np.int64))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
