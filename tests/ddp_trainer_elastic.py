"""Run under torchrun: a Trainer checkpointed mid-epoch on 2 ranks resumes on 1.

Usage: torchrun --nproc_per_node=W tests/ddp_trainer_elastic.py TRAIN_PACK OUT_DIR first|rest
"first" (2 ranks) trains 2 optimizer steps of epoch 0 and checkpoints; "rest" (1 rank) loads the
checkpoint and finishes the epoch. Each writes OUT_DIR/<phase>.json (rank 0): what it trained.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _train_helpers import DIGITS_NORMALIZATION  # noqa: E402

from fastload import train  # noqa: E402
from fastload.data.dataset import ImageFolder  # noqa: E402
from fastload.data.loader import DataLoader  # noqa: E402
from fastload.train.models import SmallCNN  # noqa: E402


def main() -> None:
    pack, out, phase = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    torch.set_num_threads(1)
    info = train.init_distributed()
    torch.manual_seed(0)
    model = SmallCNN(num_classes=10, width=8)
    trainer = train.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.05), dist=info,
                            config=train.TrainConfig(normalization=DIGITS_NORMALIZATION))
    loader = DataLoader(ImageFolder(pack), 64, seed=1, num_workers=1)
    ckpt = out / "mid.pt"
    if phase == "first":
        stats = trainer.train_epoch(loader, max_steps=2)
        trainer.save_checkpoint(ckpt, loader=loader)
    else:
        trainer.load_checkpoint(ckpt, loader=loader)
        stats = trainer.train_epoch(loader)
    if info.is_main:
        (out / f"{phase}.json").write_text(json.dumps({
            "world_size": info.world_size, "samples": stats.samples, "steps": stats.steps,
            "completed": stats.completed, "epoch_after": trainer.epoch, "total_steps": trainer.step,
        }))
    train.cleanup_distributed()


if __name__ == "__main__":
    main()
