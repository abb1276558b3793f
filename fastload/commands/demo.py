"""``fastload demo``: generate sample photos, pack them, load, train a small CNN, report speeds."""

from __future__ import annotations

import argparse
from pathlib import Path

from .pack import parse_hw  # one size syntax for every command: HxW, as torch orders it


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "demo", help="pack the built-in sample photos and train a small CNN on them, end to end",
        description="Generate an ImageFolder of sample photos, pack it, measure the loader, train a small CNN "
                    "with fastload.train, and print loader and training images/s, the data-stall fraction and "
                    "the held-out accuracy. About a minute on a 2-core CPU; uses the GPU when there is one.",
    )
    p.add_argument("--workdir", type=Path, default=Path("fastload-demo"),
                   help="where the images, the packed data and summary.json go (default: ./fastload-demo)")
    p.add_argument("--backend", choices=("cpu", "dali"), default="cpu",
                   help="cpu: fastload DataLoader + CUDA prefetcher; dali: DALI pipeline (nvJPEG on a GPU)")
    p.add_argument("--small", action="store_true", help="a seconds-long run on tiny images (for a quick check)")
    p.add_argument("--classes", type=int, help="number of classes (default 8)")
    p.add_argument("--per-class", type=int, dest="train_per_class", help="training images per class (default 250)")
    p.add_argument("--val-per-class", type=int, help="held-out images per class (default 50)")
    p.add_argument("--image-size", type=parse_hw, metavar="HxW",
                   help="generated JPEG size, height x width (default 375x500; one in four is portrait)")
    p.add_argument("--crop", type=int, help="training resolution (default 64)")
    p.add_argument("--epochs", type=int, help="training epochs (default 4)")
    p.add_argument("--batch-size", type=int, help="batch size (default 64)")
    p.add_argument("--arch", help="model: small_cnn (default), resnet_small, resnet18, ...")
    p.add_argument("--workers", type=int, help="loader worker processes (default: one per core)")
    p.add_argument("--precision", choices=("auto", "fp32", "bf16", "fp16"),
                   help="autocast precision (auto: bf16/fp16 on a GPU, fp32 on a CPU)")
    p.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda if available)")
    p.add_argument("--seed", type=int)
    p.add_argument("--fresh", action="store_true", help="regenerate and repack even if WORKDIR has matching data")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ..train.demo import DemoConfig, with_overrides

    base = DemoConfig.small() if args.small else DemoConfig()
    over = {k: getattr(args, k) for k in ("backend", "classes", "train_per_class", "val_per_class", "image_size",
                                         "crop", "epochs", "batch_size", "arch", "workers", "precision", "device",
                                         "seed")}
    try:
        cfg = with_overrides(base, workdir=args.workdir, fresh=args.fresh or None, **over)
        if args.crop is not None and args.crop > cfg.pack_resize:
            cfg = with_overrides(cfg, pack_resize=int(round(args.crop / 0.875)))
    except ValueError as exc:
        from ..errors import FastloadError

        raise FastloadError(str(exc)) from None
    from ..train.demo import run_demo

    try:
        run_demo(cfg)
    except ValueError as exc:  # bad option combinations found while running (unknown --arch, ...)
        from ..errors import FastloadError

        raise FastloadError(str(exc)) from None
    return 0
