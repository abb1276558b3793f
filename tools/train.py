#!/usr/bin/env python
"""Train an image classifier on packed data, in the style of the PyTorch ImageNet example.

DIR holds ``train/`` and ``val/``, each a dataset packed by ``fastload pack``. Runs as a plain
process or under torchrun, on one or several nodes::

    python tools/train.py DIR --arch resnet18 --epochs 90 --batch-size 256 --lr 0.1 --amp bf16
    torchrun --nproc_per_node=8 tools/train.py DIR --arch resnet50 --amp bf16 --backend dali
    torchrun --nnodes=2 --node_rank=0 --rdzv_endpoint=HOST:29400 --nproc_per_node=8 tools/train.py DIR ...

DIR may also be a URL prefix in object storage (``s3://bucket/imagenet`` holding
``s3://bucket/imagenet/train`` and ``.../val``, each written by ``fastload pack SRC URL``):
shards are read through the node-local cache (``--cache-dir``, ``--cache-limit``), and
``--shuffle block`` keeps the training set's working set to a few shards per node when that
cache cannot hold the whole pack::

    python tools/train.py s3://bucket/imagenet --cache-dir /nvme/cache --cache-limit 200GB --shuffle block

``--batch-size`` is per process; the learning rate is not rescaled for you. Every epoch prints
the training loss, images/s over all processes, the data-stall fraction (time the step
waited for data) and validation Acc@1/Acc@5; a checkpoint (model, optimizer, scaler,
scheduler, loader position) is written after every epoch, and ``--resume`` continues it.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

from fastload.commands import add_remote_args, location, remote_kwargs
from fastload.storage.remote import is_url


class _HelpWithDefaults(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` shows every option's default, except where there is none to show (None, a
    flag's False, "") or the help text already says it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or action.default == "" \
                or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=_HelpWithDefaults)
    p.add_argument("data", metavar="DIR", type=location, help="folder (or URL prefix: s3://bucket/prefix) with train/ and val/ "
                   "packed datasets")
    p.add_argument("-a", "--arch", default="resnet18",
                   help="model: a torchvision name when torchvision is importable, else small_cnn, resnet_small, "
                        "resnet18, resnet50 (default resnet18)")
    p.add_argument("--epochs", type=int, default=90, help="epochs to train")
    p.add_argument("-b", "--batch-size", type=int, default=256, help="images per process per micro-batch")
    p.add_argument("--lr", type=float, default=0.1, help="peak learning rate (SGD, cosine decay)")
    p.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
    p.add_argument("--wd", "--weight-decay", type=float, default=1e-4, dest="weight_decay", help="SGD weight decay")
    p.add_argument("--warmup-epochs", type=float, default=0.0, help="linear warm-up before the cosine decay")
    p.add_argument("--label-smoothing", type=float, default=0.0, help="cross-entropy label smoothing")
    p.add_argument("--amp", choices=("off", "bf16", "fp16"), default="off", help="autocast precision")
    p.add_argument("--accum", type=int, default=1, help="gradient accumulation: micro-batches per optimizer step")
    p.add_argument("--backend", choices=("cpu", "dali"), default="cpu",
                   help="cpu: fastload DataLoader + CUDA prefetcher; dali: DALI pipeline")
    p.add_argument("-j", "--workers", type=int, default=None, help="loader processes (DALI threads) per process")
    p.add_argument("--shuffle", choices=("full", "block"), default="full",
                   help="training order: full (a permutation of all samples per epoch) or block (shards "
                        "shuffled in windows of --shuffle-window shards: for a remote pack larger than the cache)")
    p.add_argument("--shuffle-window", type=int, default=4, metavar="N", help="shards per window of --shuffle block")
    p.add_argument("--crop", type=int, default=224, help="training and validation resolution")
    p.add_argument("--min-scale", type=float, default=0.08, help="smallest RandomResizedCrop area fraction")
    p.add_argument("--channels-last", action="store_true", help="NHWC memory format (faster on tensor cores)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--sync-bn", action="store_true", help="SyncBatchNorm across processes (CUDA only)")
    p.add_argument("--checkpoint-blocks", default="", help="comma-separated submodules to recompute in backward "
                   "(activation checkpointing), e.g. layer1,layer2")
    p.add_argument("--checkpoint", type=Path, default=Path("checkpoint.pt"), help="where to save after every epoch")
    p.add_argument("--resume", type=Path, default=None, help="continue from this checkpoint")
    p.add_argument("-e", "--evaluate", action="store_true", help="only evaluate (with --resume weights)")
    p.add_argument("--seed", type=int, default=0, help="seeds the model, the order and the augmentation")
    p.add_argument("-p", "--print-freq", type=int, default=0, help="optimizer steps between progress lines")
    p.add_argument("--deterministic", action="store_true", help="deterministic kernels (slower)")
    add_remote_args(p)
    p.add_argument("--cache-limit", default=None, metavar="SIZE",
                   help="most bytes of shards in the node cache, e.g. 200GB (default 80%% of its disk's free space)")
    return p.parse_args(argv)


def split_dir(data: str, split: str) -> str | Path:
    """``DIR/split``: a local folder, or the pack under a URL prefix (``s3://b/x`` -> ``s3://b/x/train``)."""
    return f"{data.rstrip('/')}/{split}" if is_url(data) else Path(data) / split


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from fastload import train
    from fastload.errors import FastloadError
    from fastload.loaders import make_loader
    from fastload.normalization import IMAGENET
    from fastload.storage import open_pack

    info = None
    try:
        train_dir, val_dir = split_dir(args.data, "train"), split_dir(args.data, "val")
        for d in (train_dir, val_dir):
            if not is_url(d) and not d.is_dir():
                raise FastloadError(f"{d}: missing; DIR must hold train/ and val/ packed datasets")
        remote = {**remote_kwargs(args), "cache_limit": args.cache_limit}
        train_pack, val_pack = open_pack(train_dir, **remote), open_pack(val_dir, **remote)
        train_pack.close()  # only their sizes and classes are needed here
        val_pack.close()
        if list(train_pack.classes) != list(val_pack.classes):
            raise FastloadError(f"{args.data}: train/ and val/ have different classes")
        num_classes = len(train_pack.classes)
        info = train.init_distributed()
        log = print if info.is_main else (lambda *a, **k: None)
        train.check_batch_geometry(len(train_pack), batch_size=args.batch_size, world_size=info.world_size,
                                   accum_steps=args.accum, drop_last=True)
        train.seed_everything(args.seed, deterministic=args.deterministic)  # same initial weights on every rank
        model = train.get_model(args.arch, num_classes=num_classes)
        if args.checkpoint_blocks and args.compile:
            raise ValueError("--checkpoint-blocks and --compile together are not supported; pick one")

        common = dict(backend=args.backend, crop=args.crop, normalization=IMAGENET,
                      device=info.device, seed=args.seed, num_workers=args.workers,
                      channels_last=args.channels_last, **remote)
        train_loader = make_loader(train_dir, batch_size=args.batch_size, train=True, shuffle=args.shuffle,
                                   shuffle_window=args.shuffle_window, scale=(args.min_scale, 1.0), **common)
        val_loader = make_loader(val_dir, batch_size=args.batch_size, train=False, **common)

        steps_per_epoch = math.ceil(len(train_loader) / args.accum)
        total = max(1, args.epochs * steps_per_epoch)
        warm = int(args.warmup_epochs * steps_per_epoch)

        def lr_factor(step: int) -> float:
            if step < warm:
                return (step + 1) / warm
            return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warm) / max(1, total - warm))))

        # No weight decay on BatchNorm and bias parameters (the usual ImageNet recipe).
        decay = [p for p in model.parameters() if p.ndim > 1]
        no_decay = [p for p in model.parameters() if p.ndim <= 1]
        opt = torch.optim.SGD([{"params": decay, "weight_decay": args.weight_decay},
                               {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, momentum=args.momentum)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
        cfg = train.TrainConfig(
            precision="fp32" if args.amp == "off" else args.amp, accum_steps=args.accum,
            channels_last=args.channels_last, compile=args.compile, sync_batchnorm=args.sync_bn,
            checkpoint_blocks=tuple(b for b in args.checkpoint_blocks.split(",") if b),
            log_interval=args.print_freq,
        )
        loss_fn = torch.nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)
        trainer = train.Trainer(model, opt, config=cfg, dist=info, scheduler=sched, loss_fn=loss_fn, log=log)
        log(f"{args.arch}: {len(train_pack)} training / {len(val_pack)} validation images, {num_classes} classes; "
            f"{info.world_size} process{'es' if info.world_size > 1 else ''} on {info.device}, batch "
            f"{args.batch_size} x {info.world_size} x accum {args.accum} = "
            f"{args.batch_size * info.world_size * args.accum} per step, {args.amp}, backend {args.backend}"
            + (f", block shuffle over {args.shuffle_window} shards" if args.shuffle == "block" else ""))
        if args.resume is not None:
            trainer.load_checkpoint(args.resume, loader=train_loader)
            log(f"resumed from {args.resume}: epoch {trainer.epoch}, step {trainer.step}")
        if args.evaluate:
            ev = trainer.evaluate(val_loader)
            log(f"val: loss {ev.loss:.4f}  Acc@1 {ev.acc1:.2%}  Acc@5 {ev.acc5:.2%}  ({ev.samples} images)")
            return 0
        best = max((h.get("val", {}).get("acc1", 0.0) for h in trainer.history), default=0.0)
        while trainer.epoch < args.epochs:
            t0 = time.perf_counter()
            st = trainer.train_epoch(train_loader)
            ev = trainer.evaluate(val_loader)
            trainer.history.append({"epoch": st.epoch, "train": st.as_dict(), "val": ev.as_dict()})
            best = max(best, ev.acc1)
            trainer.save_checkpoint(args.checkpoint, loader=train_loader)
            log(f"epoch {st.epoch}: train loss {st.loss:.4f}  {st.images_per_sec:,.0f} img/s  "
                f"data stall {st.data_stall:.0%}  peak mem {st.peak_memory_bytes / 2**20:,.0f} MiB | "
                f"val loss {ev.loss:.4f}  Acc@1 {ev.acc1:.2%}  Acc@5 {ev.acc5:.2%} (best {best:.2%})  "
                f"[{time.perf_counter() - t0:.0f} s]")
        log(f"done: best Acc@1 {best:.2%}; checkpoint {args.checkpoint}")
        return 0
    except (FastloadError, ValueError, OSError) as exc:
        where = f"{exc.filename}: " if isinstance(exc, OSError) and exc.filename else ""
        msg = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        print(f"train.py: error: {where}{msg}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("train.py: interrupted", file=sys.stderr)
        return 130
    finally:
        if info is not None:
            train.cleanup_distributed()


if __name__ == "__main__":
    sys.exit(main())
