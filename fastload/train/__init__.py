"""``fastload.train``: the AMP/DDP training step and loop, small models, and helpers.

Typical use (also under ``torchrun``)::

    from fastload import train
    info = train.init_distributed()
    train.seed_everything(0)                       # same initial weights on every rank
    model = train.get_model("resnet_small", num_classes=10)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    trainer = train.Trainer(model, opt, dist=info,
                            config=train.TrainConfig(precision="bf16", accum_steps=2))
    trainer.fit(train_loader, epochs=5, val_loader=val_loader, checkpoint_path="ckpt.pt")
"""

from __future__ import annotations

from .distributed import DistInfo, cleanup_distributed, init_distributed
from .loop import (EpochStats, EvalStats, Precision, TrainConfig, Trainer, apply_activation_checkpointing,
                   check_batch_geometry)
from .models import available_models, get_model
from .utils import (drop_conv_bias_before_bn, fuse_conv_bn, fuse_conv_bn_eval, peak_memory_bytes, relu_inplace,
                    seed_everything)

__all__ = [
    "DistInfo",
    "EpochStats",
    "EvalStats",
    "Precision",
    "TrainConfig",
    "Trainer",
    "apply_activation_checkpointing",
    "available_models",
    "check_batch_geometry",
    "cleanup_distributed",
    "drop_conv_bias_before_bn",
    "fuse_conv_bn",
    "fuse_conv_bn_eval",
    "get_model",
    "init_distributed",
    "peak_memory_bytes",
    "relu_inplace",
    "seed_everything",
]
