"""``fastload demo``: the whole path on the built-in sample photos, end to end.

generate an ImageFolder tree (train and held-out val) -> pack it -> measure the loader alone
-> train a small CNN with :class:`~fastload.train.Trainer` -> report images/s, data stall,
accuracy, and write ``summary.json``. Runs on a CPU in a minute or two; on a GPU the same
code uses the CUDA prefetcher (or DALI with ``backend="dali"``) and mixed precision.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from ..config import usable_cpus
from ..normalization import IMAGENET

__all__ = ["DemoConfig", "run_demo"]


@dataclass(frozen=True)
class DemoConfig:
    """Sizes of one demo run. The defaults take about a minute on a 2-core CPU."""

    workdir: Path = Path("fastload-demo")
    backend: str = "cpu"  # "cpu" (DataLoader + prefetcher) or "dali"
    classes: int = 8
    train_per_class: int = 250
    val_per_class: int = 50
    image_size: tuple[int, int] = (375, 500)  # (h, w) of the generated JPEGs (ImageNet-like)
    pack_resize: int = 80  # shorter side stored in the pack (pre-resized once, not every epoch)
    crop: int = 64  # training/eval resolution
    epochs: int = 4
    batch_size: int = 64
    lr: float = 3e-3
    arch: str = "small_cnn"
    workers: int | None = None  # loader worker processes (None = one per core)
    precision: str = "auto"  # auto = bf16 on a GPU that supports it, else fp16 on GPU, fp32 on CPU
    device: str | None = None
    seed: int = 0
    fresh: bool = False  # regenerate and repack even if the workdir has a matching run

    def __post_init__(self):
        if self.backend not in ("cpu", "dali"):
            raise ValueError(f"backend must be 'cpu' or 'dali', got {self.backend!r}")
        for name in ("classes", "train_per_class", "val_per_class", "pack_resize", "crop", "epochs", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.classes < 2:
            raise ValueError("classes must be >= 2")
        if self.pack_resize < self.crop:
            raise ValueError(f"pack_resize ({self.pack_resize}) must be >= crop ({self.crop})")
        if min(self.image_size) < self.pack_resize:
            h, w = self.image_size
            raise ValueError(f"image size {h}x{w} (HxW) has a side shorter than the packed size {self.pack_resize}: "
                             f"both sides must be >= {self.pack_resize}")
        if self.train_per_class * self.classes < self.batch_size:
            raise ValueError(f"{self.train_per_class * self.classes} training images are fewer than one "
                             f"batch of {self.batch_size}: lower --batch-size")

    @classmethod
    def small(cls, **kw) -> DemoConfig:
        """A seconds-long run (tests, a first try): 4 classes, tiny images, one epoch."""
        base = dict(classes=4, train_per_class=24, val_per_class=8, image_size=(64, 80), pack_resize=40, crop=32,
                    epochs=1, batch_size=16)
        return cls(**{**base, **kw})

    def data_key(self) -> dict[str, Any]:
        """What the generated and packed data depend on (a match lets a rerun reuse them)."""
        return {k: v for k, v in asdict(self).items()
                if k in ("classes", "train_per_class", "val_per_class", "image_size", "pack_resize", "seed")}


def _pick_precision(name: str, device: torch.device) -> str:
    if name != "auto":
        return name
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    return "fp32"  # bf16 autocast on CPUs without AMX is slower than fp32


def _du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _prepare_data(cfg: DemoConfig, say: Callable[[str], None]) -> tuple[Path, Path, dict[str, Any]]:
    """Generate and pack train/val, or reuse them when a previous run used the same sizes."""
    from ..config import PackConfig
    from ..pack import pack
    from ..sample import make_image_folder

    work = Path(cfg.workdir)
    if work.exists() and not work.is_dir():
        raise ValueError(f"--workdir {work}: exists and is not a directory")
    images, packed = work / "images", work / "packed"
    stamp = work / "data.json"
    key = cfg.data_key()
    key["image_size"] = list(key["image_size"])
    info: dict[str, Any] = {}
    if not cfg.fresh and stamp.is_file():
        try:
            old = json.loads(stamp.read_text())
        except (OSError, ValueError):
            old = None
        if old and old.get("key") == key and (packed / "train").is_dir() and (packed / "val").is_dir():
            say(f"reusing the packed sample data in {packed} (pass --fresh to rebuild)")
            return packed / "train", packed / "val", old.get("info", {})
    for d in (images, packed):
        if d.exists():
            shutil.rmtree(d)
    stamp.unlink(missing_ok=True)
    n_train, n_val = cfg.classes * cfg.train_per_class, cfg.classes * cfg.val_per_class
    t0 = time.perf_counter()
    say(f"generating {n_train} + {n_val} sample JPEGs ({cfg.classes} classes, {cfg.image_size[0]}x"
        f"{cfg.image_size[1]} HxW) from the bundled photos into {images}")
    make_image_folder(images / "train", num_classes=cfg.classes, per_class=cfg.train_per_class,
                      size=cfg.image_size, seed=cfg.seed, workers=cfg.workers)
    make_image_folder(images / "val", num_classes=cfg.classes, per_class=cfg.val_per_class,
                      size=cfg.image_size, seed=cfg.seed + 1000, workers=cfg.workers)
    info["generate_seconds"] = time.perf_counter() - t0
    pcfg = PackConfig(backend="lmdb", payload="jpeg", quality=90, resize=cfg.pack_resize, workers=cfg.workers,
                      progress=False, overwrite=True)
    for split in ("train", "val"):
        s = pack(images / split, packed / split, config=pcfg)
        say(f"  {s.line()}")
        info[f"pack_{split}"] = {"images": s.packed, "bytes": s.bytes, "seconds": s.seconds,
                                 "images_per_sec": s.images_per_s}
    info["source_bytes"] = _du(images)
    stamp.parent.mkdir(parents=True, exist_ok=True)
    stamp.write_text(json.dumps({"key": key, "info": info}, indent=1))
    return packed / "train", packed / "val", info


def _loader_throughput(loader) -> tuple[float, int]:
    """Images/s of the loader alone over one epoch, and the images timed.

    The clock starts when the first batch arrives: worker start-up is paid once per run,
    not per epoch, so it is not part of the rate (the first batch is not counted either).
    """
    n = first = 0
    x = None
    t_start = time.perf_counter()
    t0 = None
    for x, _ in loader:
        if t0 is None:
            if x.is_cuda:
                torch.cuda.synchronize(x.device)
            t0, first = time.perf_counter(), x.shape[0]
            continue
        n += x.shape[0]
    if x is not None and x.is_cuda:
        torch.cuda.synchronize(x.device)
    if n == 0:  # a single batch: nothing to time after it, so count the start-up too
        n, t0 = first, t_start
    dt = time.perf_counter() - t0 if t0 is not None else 0.0
    return (n / dt if dt > 0 else 0.0), n


def run_demo(cfg: DemoConfig, *, say: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the demo; returns the summary (also written to ``workdir/summary.json``)."""
    from ..loaders import make_loader
    from . import Trainer, TrainConfig, available_models, get_model, seed_everything

    if cfg.arch not in available_models():
        raise ValueError(f"unknown model {cfg.arch!r}; choose from {', '.join(available_models())}")
    t_start = time.perf_counter()
    device = torch.device(cfg.device) if cfg.device else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda requested but CUDA is not available")
    precision = _pick_precision(cfg.precision, device)
    workers = cfg.workers if cfg.workers is not None else usable_cpus()
    train_dir, val_dir, data_info = _prepare_data(cfg, say)

    common = dict(backend=cfg.backend, crop=cfg.crop, normalization=IMAGENET, device=device,
                  seed=cfg.seed, num_workers=workers)
    train_loader = make_loader(train_dir, batch_size=cfg.batch_size, train=True, **common)
    val_loader = make_loader(val_dir, batch_size=cfg.batch_size, train=False, **common)
    batches = len(train_loader)
    how = "DALI" if cfg.backend == "dali" else f"fastload DataLoader ({workers} workers) + " + (
        "CUDAPrefetcher" if device.type == "cuda" else "prefetch thread")
    say(f"loading with {how} on {device}; training {cfg.arch} at {cfg.crop}x{cfg.crop}, batch {cfg.batch_size}, "
        f"{precision}, {cfg.epochs} epoch{'s' if cfg.epochs != 1 else ''}")

    # The loader alone first: this is the ceiling the training step can reach.
    train_loader.set_epoch(0)
    loader_ips, loader_n = _loader_throughput(train_loader)
    say(f"loader alone: {loader_ips:,.0f} images/s ({loader_n} images)")

    seed_everything(cfg.seed)
    num_classes = cfg.classes
    model = get_model(cfg.arch, num_classes=num_classes)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=5e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=cfg.lr, total_steps=cfg.epochs * batches)
    tcfg = TrainConfig(precision=precision, channels_last=device.type == "cuda")
    trainer = Trainer(model, opt, config=tcfg, device=device, scheduler=sched, log=say)
    hist = trainer.fit(train_loader, epochs=cfg.epochs, val_loader=val_loader)

    train_s = sum(h["train"]["seconds"] for h in hist)
    train_n = sum(h["train"]["samples"] for h in hist)
    data_s = sum(h["train"]["data_seconds"] for h in hist)
    # The first epoch includes warm-up (allocator, cuDNN autotuning, compilation); report the
    # steady state when there is one, images/s and data stall over the same epochs.
    steady = hist[1:] or hist
    steady_s = max(1e-9, sum(h["train"]["seconds"] for h in steady))
    steady_ips = sum(h["train"]["samples"] for h in steady) / steady_s
    steady_stall = sum(h["train"]["data_seconds"] for h in steady) / steady_s
    if len(hist) > 1:
        first, last = steady[0]["epoch"], steady[-1]["epoch"]
        over = f"epoch{'s' if last > first else ''} {first}{f'-{last}' if last > first else ''}; " \
               f"epoch {hist[0]['epoch']} was warm-up"
    else:
        over = f"epoch {hist[0]['epoch']}, including warm-up"
    final = hist[-1]["val"]
    work = Path(cfg.workdir)
    summary = {
        "config": {**asdict(cfg), "workdir": str(cfg.workdir), "precision": precision, "workers": workers},
        "device": str(device),
        "torch": torch.__version__,
        "packed": {"train": str(train_dir), "val": str(val_dir), "bytes": _du(train_dir) + _du(val_dir)},
        "data": data_info,
        "loader_images_per_sec": loader_ips,
        "train_images_per_sec": steady_ips,
        "train_images_per_sec_all_epochs": train_n / train_s if train_s > 0 else 0.0,
        "data_stall": steady_stall,
        "data_stall_all_epochs": data_s / train_s if train_s > 0 else 0.0,
        "steady_epochs": [h["epoch"] for h in steady],
        "val_acc1": final["acc1"],
        "val_loss": final["loss"],
        "chance_acc1": 1.0 / num_classes,
        "epochs": hist,
        "total_seconds": time.perf_counter() - t_start,
    }
    out = work / "summary.json"
    out.write_text(json.dumps(summary, indent=1, default=str))
    summary["summary_path"] = str(out)
    say("")
    say(f"loader:   {loader_ips:,.0f} images/s (alone, no model)")
    say(f"training: {steady_ips:,.0f} images/s ({over}), waiting for data "
        f"{summary['data_stall']:.0%} of that time")
    say(f"accuracy: {final['acc1']:.1%} top-1 on {final['samples']} held-out images "
        f"(chance {1 / num_classes:.0%})")
    say(f"packed data: {train_dir} and {val_dir} ({summary['packed']['bytes'] / 2**20:.1f} MiB)")
    say(f"throughput summary: {out}  ({summary['total_seconds']:.0f} s in all)")
    return summary


def with_overrides(cfg: DemoConfig, **kw) -> DemoConfig:
    """``cfg`` with the given fields replaced (None values ignored)."""
    return replace(cfg, **{k: v for k, v in kw.items() if v is not None})
