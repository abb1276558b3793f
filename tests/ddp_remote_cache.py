"""Run under torchrun: every rank reads its share of a remote pack through one node cache.

Usage: torchrun --nproc_per_node=2 tests/ddp_remote_cache.py URL CACHE_DIR ENDPOINT OPTIONS_JSON OUT_DIR
Each rank writes OUT_DIR/rank<r>.json: the labels it read and its cache's download count.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import fastload.transforms as T
from fastload.data.dataset import ImageFolder
from fastload.data.loader import DataLoader


def main() -> None:
    url, cache_dir, endpoint, options, out = sys.argv[1:6]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ds = ImageFolder(url, T.RandomResizedCrop(16), cache_dir=cache_dir, endpoint_url=endpoint,
                     storage_options=json.loads(options))
    loader = DataLoader(ds, 4, num_workers=0, seed=2, pin_memory=False)  # rank/world from torch.distributed
    labels = [t for _, y in loader for t in y.tolist()]
    count = torch.tensor([len(labels)])
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    assert int(count) == len(labels)
    stats = ds.reader.remote.stats()  # with its object-store helper's download-ahead
    Path(out, f"rank{rank}.json").write_text(json.dumps({
        "labels": labels, "downloads": stats.downloads, "shards": len(ds.reader.shard_entries),
        "padded": loader.num_padded,
    }))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
