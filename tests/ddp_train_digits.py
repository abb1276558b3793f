"""Run by tests/test_train_ddp.py under ``torchrun --nproc_per_node=2`` (gloo, CPU).

Trains the digits recipe with DDP, gradient accumulation (no_sync) and optionally activation
checkpointing, then each rank writes its
final weights and validation accuracy to OUT/rank<k>.pt for the test to compare. With
``--odd-val PACK`` (a validation set whose size does not divide by the world size) it also
evaluates the final weights on it, through a fastload DataLoader and through make_loader
(DataLoader + CUDAPrefetcher), and records those EvalStats.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

sys.path.insert(0, str(Path(__file__).parent))
from _train_helpers import digits_recipe  # noqa: E402

from fastload import train  # noqa: E402
from fastload.data.dataset import ImageFolder  # noqa: E402
from fastload.data.loader import DataLoader  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("train_pack")
    ap.add_argument("val_pack")
    ap.add_argument("out")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--checkpoint-blocks", default="", help="comma-separated submodules to recompute")
    ap.add_argument("--odd-val", default=None, help="a pack to evaluate the final weights on")
    args = ap.parse_args()
    torch.set_num_threads(1)
    info = train.init_distributed()
    assert info.world_size == int(os.environ["WORLD_SIZE"])
    # distributed=None: the loaders read rank and world size from torch.distributed.
    tl = DataLoader(ImageFolder(args.train_pack), args.batch_size, shuffle=True, seed=0, num_workers=0)
    vl = DataLoader(ImageFolder(args.val_pack), 128, shuffle=False, num_workers=0)
    assert (tl.rank, tl.world_size) == (info.rank, info.world_size)
    # Count the backward passes that all-reduce gradients: with accumulation k, no_sync() must
    # leave exactly one per optimizer step (the last micro-batch of each group).
    synced = [0]

    def counting_allreduce(state, bucket):
        if bucket.is_last():
            synced[0] += 1
        return default_hooks.allreduce_hook(state, bucket)

    def register(trainer):
        trainer._ddp.register_comm_hook(None, counting_allreduce)

    trainer, hist = digits_recipe(tl, vl, dist=info, accum_steps=args.accum, before_fit=register,
                                  checkpoint_blocks=tuple(b for b in args.checkpoint_blocks.split(",") if b))
    odd = {}
    if args.odd_val:
        from fastload.loaders import make_loader

        plain = DataLoader(ImageFolder(args.odd_val), 16, shuffle=False, num_workers=0)
        assert plain.world_size == info.world_size
        odd["loader"] = trainer.evaluate(plain).as_dict()
        made = make_loader(args.odd_val, batch_size=16, train=False, crop=32, resize_ratio=1.0, num_workers=0,
                           mean=(0.5,) * 3, std=(0.25,) * 3)
        odd["make_loader"] = trainer.evaluate(made).as_dict()
    torch.save({"rank": info.rank, "world_size": info.world_size, "state": trainer.module.state_dict(),
                "history": hist, "steps": trainer.step, "synced_backwards": synced[0], "odd_val": odd},
               Path(args.out) / f"rank{info.rank}.pt")
    train.cleanup_distributed()


if __name__ == "__main__":
    main()
