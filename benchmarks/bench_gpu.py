"""GPU feeding benchmark: a ResNet-50 AMP training step fed three ways.

(a) plain ``torch.utils.data.DataLoader`` over JPEG files (PIL decode, CPU float conversion
    and normalisation in the workers, as in torchvision's classic recipe), ``.cuda()`` in the loop;
(b) fastload: packed LMDB -> ``fastload.DataLoader`` (uint8 batches) -> ``CUDAPrefetcher``
    (side-stream H2D copy, conversion and normalisation on the GPU);
(c) fastload DALI: the same pack through ``fastload.dali.DALILoader(device="gpu")`` (nvJPEG).

For each: images/s, the fraction of step time the training loop waits for data, and for (b)
how much of the host-to-device copy is hidden behind compute. Each step ends with a
synchronisation of the compute stream only, so a step's time splits into "waiting for the
next batch" (host time in ``next()``) and "computing", while (b)'s side-stream copies still
overlap. A reference row runs the same step on one batch already on the GPU: the floor any
feeder can reach. The GPU idle column compares each feeder's step with it, which also counts
waits the host does not see (the compute stream waiting on a copy's event), and the hidden
H2D figure for (b) charges any extra compute-part time to the copy.

Without CUDA the script says plainly that the GPU figures are still to be measured (and
writes that into RESULTS.md); ``--smoke`` then runs every feeder for a few steps of a tiny
model on the CPU to check the code paths, without recording figures.

    python benchmarks/bench_gpu.py                      # full run on a GPU machine
    python benchmarks/bench_gpu.py --smoke              # a quick functional check anywhere
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # measure this checkout, not another install
from _results import ensure_pack, table, write_section  # noqa: E402

from fastload.normalization import IMAGENET  # noqa: E402

MEAN, STD = IMAGENET.mean, IMAGENET.std  # for the baseline's own float normalisation


# -- (a) the baseline dataset: files, PIL, CPU float normalisation ----------------------------


class PILFolder(torch.utils.data.Dataset):
    """torchvision ``ImageFolder`` + RandomResizedCrop/flip/ToTensor/Normalize, without
    torchvision (no CPU build here); uses torchvision when it is importable."""

    def __init__(self, root: Path, crop: int, seed: int = 0):
        self.root = Path(root)
        classes = sorted(d.name for d in self.root.iterdir() if d.is_dir())
        self.samples = [
            (str(p), i) for i, c in enumerate(classes) for p in sorted((self.root / c).iterdir()) if p.is_file()
        ]
        self.crop = crop
        self.seed = seed
        self.mean = torch.tensor(MEAN).view(3, 1, 1)
        self.std = torch.tensor(STD).view(3, 1, 1)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int):
        from PIL import Image

        from fastload.transforms import RandomResizedCrop

        path, label = self.samples[i]
        img = Image.open(path).convert("RGB")
        rng = np.random.default_rng([self.seed, i, int(time.time_ns() & 0xFFFF)])
        top, left, h, w = RandomResizedCrop(self.crop).get_params((img.height, img.width), rng)
        img = img.resize((self.crop, self.crop), Image.BILINEAR, box=(left, top, left + w, top + h))
        if rng.random() < 0.5:
            img = img.transpose(Image.FLIP_LEFT_RIGHT)
        x = torch.from_numpy(np.asarray(img).copy()).permute(2, 0, 1).float().div_(255)
        return (x - self.mean) / self.std, label


def baseline_loader(source: Path, batch: int, crop: int, workers: int):
    try:
        import torchvision
        from torchvision import transforms as T

        ds = torchvision.datasets.ImageFolder(
            str(source),
            T.Compose([T.RandomResizedCrop(crop), T.RandomHorizontalFlip(), T.ToTensor(), T.Normalize(MEAN, STD)]),
        )
    except Exception:  # torchvision not importable here: the same recipe by hand
        ds = PILFolder(source, crop)
    return torch.utils.data.DataLoader(
        ds, batch_size=batch, shuffle=True, num_workers=workers, pin_memory=torch.cuda.is_available(),
        drop_last=True, persistent_workers=workers > 0,
    )


# -- the training step -------------------------------------------------------------------------


def make_step(model_name: str, num_classes: int, device: torch.device):
    from fastload.train.models import get_model

    model = get_model(model_name, num_classes=num_classes).to(device).to(memory_format=torch.channels_last)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # fixed shapes: the usual recipe (fastload's Trainer does it too)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-5)
    cuda = device.type == "cuda"
    amp_dtype = torch.bfloat16 if not cuda or torch.cuda.is_bf16_supported() else torch.float16
    scaler = torch.amp.GradScaler("cuda", enabled=cuda and amp_dtype == torch.float16)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        with torch.autocast(device.type, dtype=amp_dtype, enabled=cuda):
            loss = loss_fn(model(x), y)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    return step


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()  # the compute stream only


def run_feeder(name: str, loader, step, device: torch.device, *, steps: int, warmup: int, copy_in_loop: bool):
    """Time ``steps`` training steps after ``warmup``; returns images/s and the data-wait fraction."""
    print(f"{name}: {warmup} warm-up + {steps} timed steps ...", flush=True)
    t_start = time.perf_counter()
    wait = total = 0.0
    images = done = 0
    epoch = 0
    while done < warmup + steps:
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(epoch)
        it = iter(loader)
        while done < warmup + steps:
            t0 = time.perf_counter()
            try:
                x, y = next(it)
            except StopIteration:
                break
            if copy_in_loop:
                x = x.to(device, non_blocking=True).contiguous(memory_format=torch.channels_last)
                y = y.to(device, non_blocking=True)
                _sync(device)  # the copy shares the compute stream: it is data time
            t1 = time.perf_counter()
            step(x, y)
            _sync(device)
            t2 = time.perf_counter()
            if done >= warmup:
                wait += t1 - t0
                total += t2 - t0
                images += len(y)
            done += 1
            if done % 10 == 0:
                print(f"  step {done}/{warmup + steps}", flush=True)
        del it
        epoch += 1
    print(f"  {images / total:,.0f} images/s, data wait {100 * wait / total:.1f}% "
          f"({time.perf_counter() - t_start:.0f} s)", flush=True)
    return {"feeder": name, "images_per_s": images / total, "wait_fraction": wait / total,
            "wait_ms": 1000 * wait / steps, "step_ms": 1000 * total / steps}


def resident_step_ms(step, device: torch.device, *, batch: int, crop: int, num_classes: int,
                     steps: int, warmup: int) -> float:
    """ms per step on one batch already on the device (synchronised like :func:`run_feeder`)."""
    x = torch.randn(batch, 3, crop, crop, device=device).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, num_classes, (batch,), device=device)
    for _ in range(warmup):
        step(x, y)
    _sync(device)
    t = time.perf_counter()
    for _ in range(steps):
        step(x, y)
        _sync(device)
    return 1000 * (time.perf_counter() - t) / steps


def h2d_ms(batch: int, crop: int, device: torch.device, reps: int = 20) -> float:
    """Time of one pinned uint8 batch's copy + conversion + normalisation, measured alone.

    The per-channel constants are built once, as CUDAPrefetcher does (``normalize`` would copy
    them from pageable memory, a stream synchronisation, on every call)."""
    from fastload.gpu.transforms import apply_scale_shift

    scale, shift = (torch.tensor(v, dtype=torch.float32, device=device).view(3, 1, 1)
                    for v in IMAGENET.scale_shift(3))
    x = torch.randint(0, 256, (batch, 3, crop, crop), dtype=torch.uint8).pin_memory()

    def one() -> None:
        apply_scale_shift(x.to(device, non_blocking=True), scale, shift, dtype=torch.float32, channels_last=True)

    for _ in range(3):
        one()
    torch.cuda.synchronize(device)
    t = time.perf_counter()
    for _ in range(reps):
        one()
    torch.cuda.synchronize(device)
    return 1000 * (time.perf_counter() - t) / reps


def prepare_data(args, work: Path) -> tuple[Path, Path]:
    from fastload.config import PackConfig
    from fastload.sample import make_image_folder

    source = Path(args.source) if args.source else work / "source"
    if not args.source and not source.exists():
        print(f"making {args.classes} x {args.per_class} sample JPEGs under {source} ...", flush=True)
        make_image_folder(source, num_classes=args.classes, per_class=args.per_class, size=tuple(args.size), seed=0)
    packed = Path(args.pack) if args.pack else work / "pack-lmdb"
    if not args.pack:
        ensure_pack(source, packed, PackConfig(backend="lmdb", payload="jpeg", progress=False), f"{source} -> {packed}")
    return source, packed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", help="ImageFolder tree of JPEGs for (a) (default: generated)")
    ap.add_argument("--pack", help="fastload pack of the same images for (b), (c) (default: packed from --source)")
    ap.add_argument("--workdir", help="where generated data goes (default: a temp dir)")
    ap.add_argument("--classes", type=int, default=16)
    ap.add_argument("--per-class", type=int, default=400)
    ap.add_argument("--size", type=int, nargs=2, default=(375, 500), metavar=("H", "W"))
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--crop", type=int, default=224)
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--workers", type=int, default=None, help="loader workers (default: all cores)")
    ap.add_argument("--feeders", default="a,b,c", help="which of a,b,c to run")
    ap.add_argument("--smoke", action="store_true", help="tiny CPU run of every feeder; records nothing")
    args = ap.parse_args(argv)

    cuda = torch.cuda.is_available()
    if args.smoke:
        args.classes, args.per_class, args.size = 2, 8, (96, 128)
        args.batch_size, args.crop, args.model, args.steps, args.warmup = 4, 32, "resnet_small", 3, 1
        args.workers = 1 if args.workers is None else args.workers
    workers = args.workers if args.workers is not None else (os.cpu_count() or 2)

    if not cuda:
        note = ("No CUDA GPU on this machine: the GPU figures (images/s, data-wait fraction, hidden H2D "
                "time for (a) plain DataLoader + .cuda(), (b) fastload + CUDAPrefetcher, (c) DALI mixed "
                "decode) are still to be measured. Run `python benchmarks/bench_gpu.py` on a GPU machine.")
        print(note)
        if not args.smoke:
            write_section("bench_gpu", note)
            return 0

    device = torch.device("cuda" if cuda else "cpu")
    if args.workdir:
        return _bench(args, device, workers, Path(args.workdir))
    with tempfile.TemporaryDirectory(prefix="fastload-bench-gpu-") as tmp:
        return _bench(args, device, workers, Path(tmp))


def _bench(args, device: torch.device, workers: int, work: Path) -> int:
    cuda = device.type == "cuda"
    source, packed = prepare_data(args, work)
    num_classes = len([d for d in source.iterdir() if d.is_dir()])
    step = make_step(args.model, num_classes, device)
    wanted = set(args.feeders.split(","))
    rows = []
    if "a" in wanted:
        loader = baseline_loader(source, args.batch_size, args.crop, workers)
        rows.append(run_feeder("(a) torch DataLoader + .cuda()", loader, step, device,
                               steps=args.steps, warmup=args.warmup, copy_in_loop=True))
        del loader
    if "b" in wanted:
        from fastload.loaders import make_loader

        loader = make_loader(packed, backend="cpu", batch_size=args.batch_size, crop=args.crop,
                             normalization=IMAGENET, device=device, num_workers=workers)
        rows.append(run_feeder("(b) fastload + CUDAPrefetcher", loader, step, device,
                               steps=args.steps, warmup=args.warmup, copy_in_loop=False))
        del loader
    notes = []
    if "c" in wanted:
        name = "(c) fastload DALI (nvJPEG)" if cuda else "(c) fastload DALI (CPU)"
        loader = None
        try:
            from fastload.loaders import make_loader

            loader = make_loader(packed, backend="dali", batch_size=args.batch_size, crop=args.crop,
                                 normalization=IMAGENET, device=device, num_workers=min(workers, 16))
            rows.append(run_feeder(name, loader, step, device, steps=args.steps, warmup=args.warmup,
                                   copy_in_loop=False))
        except ImportError as exc:  # DALI not installed: the message says what to pip install
            print(f"(c) skipped: {exc}", flush=True)
            notes.append(f"(c) not run: {exc}")
        except Exception as exc:  # keep (a) and (b)'s figures: report DALI's failure and go on
            traceback.print_exc()
            first = str(exc).splitlines()[0] if str(exc) else ""
            print(f"(c) failed: {type(exc).__name__}: {first}", flush=True)
            notes.append(f"(c) failed: {type(exc).__name__}: {first}")
        del loader

    print("(ref) the same step on a batch already on the device ...", flush=True)
    floor = resident_step_ms(step, device, batch=args.batch_size, crop=args.crop, num_classes=num_classes,
                             steps=args.steps, warmup=args.warmup)
    base = rows[0]["images_per_s"] if rows and rows[0]["feeder"].startswith("(a)") else None
    body_rows = [["(ref) data already on the device", 1000 * args.batch_size / floor, "-", "-", f"{floor:.1f}",
                  "0.0%", f"{1000 * args.batch_size / floor / base:.2f}x" if base else "-"]]
    body_rows += [
        [r["feeder"], r["images_per_s"], f"{100 * r['wait_fraction']:.1f}%", f"{r['wait_ms']:.1f}",
         f"{r['step_ms']:.1f}", f"{100 * max(0.0, 1 - floor / r['step_ms']):.1f}%",
         f"{r['images_per_s'] / base:.2f}x" if base else "-"]
        for r in rows
    ]
    text = table(["feeder", "images/s", "data wait", "wait ms/step", "step ms", "GPU idle", "vs (a)"], body_rows)
    extra = ""
    if cuda and any(r["feeder"].startswith("(b)") for r in rows):
        copy = h2d_ms(args.batch_size, args.crop, device)
        b = next(r for r in rows if r["feeder"].startswith("(b)"))
        exposed = max(0.0, b["step_ms"] - b["wait_ms"] - floor)  # compute part longer than with resident data
        hidden = max(0.0, min(1.0, 1 - exposed / copy)) if copy > 0 else 0.0
        extra = (f"\nH2D copy + uint8->float + normalise of one batch, measured alone: {copy:.2f} ms; "
                 f"(b)'s compute part is {exposed:.2f} ms longer than with resident data, "
                 f"so about {100 * hidden:.0f}% of the copy is hidden behind compute.")
    extra += "".join(f"\n{n}" for n in notes)
    print(text + extra)
    if args.smoke:
        print("(smoke run on the CPU: figures are not recorded)" if not cuda else "(smoke run: not recorded)")
        return 0
    setup = (f"{args.model}, batch {args.batch_size}, crop {args.crop}, AMP, channels_last, SGD; "
             f"{num_classes} classes of {args.size[0]}x{args.size[1]} JPEGs; {workers} loader workers; "
             f"{args.steps} timed steps after {args.warmup} warm-up steps.")
    write_section("bench_gpu", setup + "\n\n" + text + "\n" + extra)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
