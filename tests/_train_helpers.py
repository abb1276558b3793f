"""Data for the training tests: scikit-learn's bundled 8x8 digits, packed by fastload.

Nothing is downloaded: ``sklearn.datasets.load_digits`` ships with scikit-learn. Images are
upsampled to 32x32 RGB and written as an ImageFolder tree of PNGs, then packed.
"""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np
import torch

from fastload.normalization import Normalization


def write_digits_tree(root: Path, *, size: int = 32) -> tuple[Path, Path]:
    """train/ and val/ ImageFolder trees (a fixed 75/25 split of the 1797 digits)."""
    from sklearn.datasets import load_digits

    d = load_digits()
    imgs = (d.images / 16.0 * 255).round().astype(np.uint8)
    order = np.random.default_rng(0).permutation(len(imgs))
    n_train = len(imgs) * 3 // 4
    for split, idx in (("train", order[:n_train]), ("val", order[n_train:])):
        for i in idx:
            big = cv2.resize(imgs[i], (size, size), interpolation=cv2.INTER_LINEAR)
            rgb = np.repeat(big[:, :, None], 3, axis=2)
            out = root / "src" / split / f"digit_{d.target[i]}" / f"{i:04d}.png"
            out.parent.mkdir(parents=True, exist_ok=True)
            cv2.imwrite(str(out), rgb)
    return root / "src" / "train", root / "src" / "val"


def pack_digits(root: Path, *, payload: str = "png") -> tuple[Path, Path]:
    """Pack the digits tree with fastload; returns (train pack dir, val pack dir)."""
    from fastload.config import PackConfig
    from fastload.pack import pack

    src_train, src_val = write_digits_tree(root)
    cfg = PackConfig(payload=payload, workers=1, progress=False)
    pack(src_train, root / "train", config=cfg)
    pack(src_val, root / "val", config=cfg)
    return root / "train", root / "val"


DIGITS_EPOCHS = 6
DIGITS_NORMALIZATION = Normalization.from_255((128.0,), (64.0,))  # (x - 128) / 64, every channel


def digits_recipe(train_loader, val_loader, *, dist=None, seed: int = 0, before_fit=None, **config):
    """The learning-test recipe: SmallCNN, AdamW + one-cycle, 6 epochs (~3 s on 2 cores).

    Returns (trainer, history). Same seed on every rank gives the same initial weights.
    ``before_fit(trainer)`` runs before training (to register a DDP comm hook, say).
    """
    from fastload import train
    from fastload.train.models import SmallCNN

    train.seed_everything(seed)
    model = SmallCNN(num_classes=10, width=16)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=DIGITS_EPOCHS * len(train_loader))
    cfg = train.TrainConfig(normalization=DIGITS_NORMALIZATION, **config)
    trainer = train.Trainer(model, opt, scheduler=sched, config=cfg, dist=dist,
                            device=None if dist is not None else "cpu")
    if before_fit is not None:
        before_fit(trainer)
    hist = trainer.fit(train_loader, epochs=DIGITS_EPOCHS, val_loader=val_loader)
    return trainer, hist
