"""``fastload bench DEST``: the loader alone on your packed data, and what settings to use.

Runs fastload's DataLoader (training augmentation: RandomResizedCrop + flip) over DEST for
every ``num_workers`` x batch size asked for, reports images/s in a table, and recommends
``num_workers`` (the fewest within 5% of the best), a batch size, and a payload, from the
measured decode cost per image against the bytes per image each payload stores.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ..config import usable_cpus
from . import location


@dataclass(frozen=True)
class BenchPoint:
    workers: int
    batch_size: int
    images: int  # timed images (after warm-up)
    seconds: float

    @property
    def images_per_sec(self) -> float:
        return self.images / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class PayloadCost:
    payload: str
    records: int  # sampled records
    bytes_per_image: float  # stored payload bytes
    decode_ms: float  # decode time per image on one core
    raw_bytes_per_image: float  # h * w * 3 of the stored images

    def as_dict(self) -> dict:
        return asdict(self)


def _int_list(text: str) -> list[int]:
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or any(v < 0 for v in vals):
        raise argparse.ArgumentTypeError(f"expected non-negative integers, got {text!r}")
    return vals


def default_workers() -> list[int]:
    n = usable_cpus()
    vals = {0, n}
    k = 1
    while k < n:
        vals.add(k)
        k *= 2
    return sorted(vals)


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "bench", help="measure the loader alone on a packed dataset and recommend settings",
        description="Measure fastload's DataLoader on DEST across num_workers and batch sizes, print a table and "
                    "recommend num_workers, batch size and payload.",
    )
    p.add_argument("dest", type=location, metavar="DEST", help="a packed dataset (output of fastload pack)")
    p.add_argument("--workers", type=_int_list, default=None,
                   help=f"comma-separated num_workers values (default: {','.join(map(str, default_workers()))})")
    p.add_argument("--batch-sizes", type=_int_list, default=[64, 256], help="comma-separated (default 64,256)")
    p.add_argument("--batches", type=int, default=20, help="timed batches per setting (default 20)")
    p.add_argument("--seconds", type=float, default=1.0,
                   help="time each setting at least this long, beyond --batches (default 1.0)")
    p.add_argument("--warmup", type=int, default=2, help="untimed batches first (worker start-up; default 2)")
    p.add_argument("--crop", type=int, default=224, help="RandomResizedCrop size (default 224)")
    p.add_argument("--decoder", default="auto", help="JPEG decoder: auto, turbo-crop, cv2, simplejpeg, jpeg4py, pil")
    p.add_argument("--plot", type=Path, default=None, help="save images/s vs workers to this PNG (needs matplotlib)")
    p.add_argument("--json", type=Path, default=None, dest="json_out", help="also write the results as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (none either when stderr is not a terminal)")
    p.set_defaults(run=run)


def measure(dataset, *, workers: int, batch_size: int, batches: int, warmup: int,
            min_seconds: float = 0.0) -> BenchPoint:
    """Time at least ``batches`` batches (and ``min_seconds``) of a fresh DataLoader after
    ``warmup`` untimed ones (worker start-up is not what we measure)."""
    from ..data.loader import DataLoader

    loader = DataLoader(dataset, batch_size, shuffle=True, seed=0, num_workers=workers, pin_memory=False)
    try:
        seen = timed = 0
        # The clock starts when the last warm-up batch has arrived (or at once without warm-up),
        # so the timed span holds exactly the timed batches.
        t0 = time.perf_counter()
        epoch = 0

        def more() -> bool:
            return seen < warmup + batches or time.perf_counter() - t0 < min_seconds

        while more():
            loader.set_epoch(epoch)
            got = False
            for x, _ in loader:
                got = True
                seen += 1
                if seen <= warmup:
                    if seen == warmup:
                        t0 = time.perf_counter()
                    continue
                timed += int(x.shape[0])
                if not more():
                    break
            if not got:
                break
            epoch += 1
        return BenchPoint(workers=workers, batch_size=batch_size, images=timed, seconds=time.perf_counter() - t0)
    finally:
        loader.close()


def payload_cost(dataset, *, samples: int = 100) -> PayloadCost:
    """Bytes per stored image and decode milliseconds per image, over up to ``samples`` records."""
    import numpy as np

    n = len(dataset)
    idx = np.linspace(0, n - 1, num=min(samples, n)).astype(np.int64)
    nbytes = 0
    for i in idx:
        nbytes += memoryview(dataset.reader.get(int(i))).nbytes
    dataset.decode(int(idx[0]))  # first call pays for opening the shard
    t0 = time.perf_counter()
    raw = 0
    for i in idx:
        img = dataset.decode(int(i))
        raw += img.size
    dt = time.perf_counter() - t0
    k = len(idx)
    return PayloadCost(payload=dataset.payload, records=k, bytes_per_image=nbytes / k, decode_ms=dt / k * 1e3,
                       raw_bytes_per_image=raw / k)


def _available_memory() -> int | None:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not Linux
        return None


def recommend(points: list[BenchPoint], cost: PayloadCost, *, num_images: int, crop: int,
              stored_short_side: float) -> dict:
    """Settings to use, each with the reason, from the measured points and payload cost."""
    if not points:
        raise ValueError("no measurements")
    best = max(points, key=lambda p: p.images_per_sec)
    # Batch size: the best one at the best worker count (larger batches only if clearly faster).
    at_w = sorted((p for p in points if p.workers == best.workers), key=lambda p: p.batch_size)
    top = max(p.images_per_sec for p in at_w)
    batch = next(p for p in at_w if p.images_per_sec >= 0.95 * top)
    # Workers: the fewest within 5% of the best at that batch size (leaves cores for the rest).
    at_b = sorted((p for p in points if p.batch_size == batch.batch_size), key=lambda p: p.workers)
    top_b = max(p.images_per_sec for p in at_b)
    workers = next(p for p in at_b if p.images_per_sec >= 0.95 * top_b)
    rec = {
        "num_workers": workers.workers,
        "batch_size": batch.batch_size,
        "images_per_sec": workers.images_per_sec,
        "why_workers": f"fewest workers within 5% of the best ({top_b:,.0f} images/s at batch {batch.batch_size})",
    }
    # Payload: decode cost per image against the bytes it stores.
    raw_total = cost.raw_bytes_per_image * num_images
    mem = _available_memory()
    per_core_ips = 1e3 / cost.decode_ms if cost.decode_ms > 0 else float("inf")
    ratio = cost.raw_bytes_per_image / max(1.0, cost.bytes_per_image)
    fits = mem is not None and raw_total < 0.5 * mem
    if cost.payload in ("jpeg", "original", "png"):
        if fits and cost.decode_ms > 0.2:
            payload, why = "raw", (
                f"decoding {cost.payload} costs {cost.decode_ms:.2f} ms/image ({per_core_ips:,.0f} images/s per core); "
                f"raw pixels are {ratio:.1f}x larger ({raw_total / 2**30:.2f} GiB in all) but fit in page cache "
                f"({mem / 2**30:.0f} GiB free), so decoding disappears")
        else:
            payload, why = cost.payload, (
                f"keep {cost.payload}: {cost.decode_ms:.2f} ms/image to decode, and raw pixels would be {ratio:.1f}x "
                f"larger ({raw_total / 2**30:.2f} GiB)" + ("" if fits else ", more than half the free memory"))
    else:
        if fits:
            payload, why = cost.payload, f"keep {cost.payload}: no decode cost and the pack fits in page cache"
        else:
            payload, why = "jpeg", (
                f"{cost.payload} stores {cost.bytes_per_image / 1024:.0f} KiB/image and the pack is larger than half the "
                f"free memory: jpeg is ~5-10x smaller, trading I/O for decode time")
    rec["payload"] = payload
    rec["why_payload"] = why
    target = int(round(crop / 0.875))
    if stored_short_side > 1.5 * target:
        rec["resize"] = target
        rec["why_resize"] = (f"stored images have a {stored_short_side:.0f}-pixel shorter side but training crops "
                             f"{crop}: `fastload pack --resize {target}` cuts decode work by ~"
                             f"{(stored_short_side / target) ** 2:.0f}x")
    return rec


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [headers, *rows]) for i in range(len(headers))]
    line = lambda r: "  ".join(c.rjust(w) for c, w in zip(r, widths))  # noqa: E731
    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def plot(points: list[BenchPoint], out: Path, *, title: str) -> None:
    """images/s vs num_workers, one line per batch size."""
    from ..errors import require

    require("matplotlib", "matplotlib", "fastload bench --plot")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for b in sorted({p.batch_size for p in points}):
        ps = sorted((p for p in points if p.batch_size == b), key=lambda p: p.workers)
        ax.plot([p.workers for p in ps], [p.images_per_sec for p in ps], marker="o", label=f"batch {b}")
    ax.set_xlabel("num_workers")
    ax.set_ylabel("images/s")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    from ..errors import FastloadError

    if args.batches < 1 or args.warmup < 0 or args.crop < 1 or args.seconds < 0:
        raise FastloadError("--batches and --crop must be >= 1, --warmup and --seconds >= 0")
    if args.plot is not None:
        from ..errors import require

        require("matplotlib", "matplotlib", "fastload bench --plot")  # fail before measuring, not after
    import numpy as np
    from tqdm import tqdm

    from ..data.dataset import ImageFolder
    from ..transforms import Compose, RandomHorizontalFlip, RandomResizedCrop

    try:
        ds = ImageFolder(args.dest, transform=Compose([RandomResizedCrop(args.crop), RandomHorizontalFlip()]),
                         decoder=args.decoder)
    except ValueError as exc:
        raise FastloadError(str(exc)) from None
    if len(ds) == 0:
        raise FastloadError(f"{args.dest}: the pack holds no images")
    workers = args.workers or default_workers()
    configs = [(w, b) for b in args.batch_sizes for w in workers]
    if any(b < 1 for b in args.batch_sizes):
        raise FastloadError("--batch-sizes must be >= 1")
    shapes = ds._shapes
    short = float(np.median(np.minimum(shapes[:, 0], shapes[:, 1])))
    print(f"{args.dest}: {len(ds)} images, {ds.payload} payload, median shorter side {short:.0f} px, "
          f"decoder {ds.decoder}; RandomResizedCrop({args.crop}) + flip; >= {args.batches} timed batches and "
          f">= {args.seconds:g} s per setting")
    cost = payload_cost(ds)
    points: list[BenchPoint] = []
    # Like `fastload pack`: no bar (and no carriage returns) in a log file or a pipe.
    bar = tqdm(configs, desc="bench", unit="setting", file=sys.stderr,
               disable=args.no_progress or not sys.stderr.isatty())
    for w, b in bar:
        bar.set_postfix_str(f"workers={w} batch={b}")
        points.append(measure(ds, workers=w, batch_size=b, batches=args.batches, warmup=args.warmup,
                              min_seconds=args.seconds))
    bar.close()
    rows = [[str(p.workers), str(p.batch_size), str(p.images), f"{p.seconds:.2f}", f"{p.images_per_sec:,.0f}"]
            for p in points]
    print(_table(["workers", "batch", "images", "seconds", "images/s"], rows))
    print(f"payload {cost.payload}: {cost.bytes_per_image / 1024:.1f} KiB/image stored, "
          f"{cost.decode_ms:.2f} ms/image to decode on one core "
          f"(raw pixels would be {cost.raw_bytes_per_image / 1024:.1f} KiB/image)")
    rec = recommend(points, cost, num_images=len(ds), crop=args.crop, stored_short_side=short)
    print(f"recommended: num_workers={rec['num_workers']} ({rec['why_workers']})")
    print(f"recommended: batch_size={rec['batch_size']} ({rec['images_per_sec']:,.0f} images/s)")
    print(f"recommended: payload={rec['payload']} ({rec['why_payload']})")
    if "resize" in rec:
        print(f"recommended: resize={rec['resize']} ({rec['why_resize']})")
    if args.plot is not None:
        plot(points, args.plot, title=f"fastload loader on {Path(args.dest).name}")
        print(f"plot: {args.plot}")
    if args.json_out is not None:
        doc = {"dest": str(args.dest), "images": len(ds), "crop": args.crop,
               "points": [{**asdict(p), "images_per_sec": p.images_per_sec} for p in points],
               "payload_cost": cost.as_dict(), "recommendation": rec}
        args.json_out.write_text(json.dumps(doc, indent=1))
        print(f"results: {args.json_out}")
    return 0
