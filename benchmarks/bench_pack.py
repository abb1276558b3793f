"""Packing throughput: images/s with 1 and 2 workers for each payload, and output size.

    python benchmarks/bench_pack.py                # ~2000 ImageNet-like JPEGs (375x500)
    python benchmarks/bench_pack.py --images 200   # a quick smoke run

Packs a sample tree made by fastload.sample.make_image_folder (in a temp dir) into LMDB
shards; the 2-vs-1 worker ratio is the packer's parallel speed-up (target >= 1.8x on an idle
2-core machine). Prints a table and writes the ``bench_pack`` section of RESULTS.md.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _results import table, write_section  # noqa: E402

from fastload.config import PackConfig  # noqa: E402
from fastload.pack import pack  # noqa: E402
from fastload.sample import make_image_folder  # noqa: E402

CASES = [  # (label, PackConfig keyword arguments)
    ("jpeg q90, --resize 256", dict(payload="jpeg", quality=90, resize=256)),
    ("bmp", dict(payload="bmp")),
    ("png", dict(payload="png")),
    ("raw, --size 256x256", dict(payload="raw", size=(256, 256))),
    ("original", dict(payload="original")),
]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=2000, help="images in the sample tree (default 2000)")
    ap.add_argument("--format", default="lmdb", choices=("lmdb", "hdf5"))
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="worker counts to compare (default 1 2)")
    ap.add_argument("--no-write", action="store_true", help="print only; leave RESULTS.md alone")
    args = ap.parse_args(argv)
    classes = 10 if args.images >= 100 else 1
    per_class = max(1, args.images // classes)
    n = classes * per_class
    with tempfile.TemporaryDirectory(prefix="bench_pack_") as tmp:
        src = Path(tmp) / "src"
        t0 = time.perf_counter()
        make_image_folder(src, num_classes=classes, per_class=per_class, size=(375, 500), seed=0)
        src_bytes = sum(p.stat().st_size for p in src.rglob("*.jpg"))
        print(f"sample tree: {n} JPEGs 375x500 q90, {src_bytes / 2**20:.1f} MiB, made in {time.perf_counter() - t0:.1f} s")
        rows = []
        for label, kw in CASES:
            rates, size = {}, 0
            for w in args.workers:
                dest = Path(tmp) / f"out-{kw['payload']}-{w}"
                s = pack(src, dest, config=PackConfig(backend=args.format, workers=w, progress=False, **kw))
                if s.skipped or s.packed != n:
                    raise SystemExit(f"{label}: packed {s.packed}/{n}, skipped {s.skipped}")
                rates[w], size = s.images_per_s, s.bytes
                print(f"  {label:24s} workers={w}: {s.images_per_s:8.0f} images/s  {s.seconds:6.2f} s", flush=True)
            ratio = rates[args.workers[-1]] / rates[args.workers[0]] if len(args.workers) > 1 else 1.0
            rows.append([label, *(rates[w] for w in args.workers), f"{ratio:.2f}x",
                         f"{size / 2**20:.1f}", f"{size / n / 1024:.1f}", f"{size / src_bytes:.2f}"])
    headers = ["payload", *(f"{w} worker{'s' if w > 1 else ''} (img/s)" for w in args.workers),
               f"{args.workers[-1]} vs {args.workers[0]}", "output MiB", "KiB/image", "vs source"]
    body = table(headers, rows)
    print()
    print(body)
    if not args.no_write:
        note = (f"{n} sample JPEGs (375x500, q90, {src_bytes / 2**20:.1f} MiB) packed into {args.format} shards. "
                "'vs source' is output size / source size.")
        write_section("bench_pack", f"{note}\n\n{body}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
