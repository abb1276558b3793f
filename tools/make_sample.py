#!/usr/bin/env python3
"""Expand fastload's bundled photographs into an ImageFolder tree (see fastload.sample).

    python tools/make_sample.py /tmp/sample --classes 10 --per-class 500
"""

from __future__ import annotations

import argparse
import time

from fastload.commands.pack import parse_hw
from fastload.sample import make_image_folder


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("root", help="output directory (created)")
    p.add_argument("--classes", type=int, default=8, help="number of classes (default 8)")
    p.add_argument("--per-class", type=int, default=100, help="images per class (default 100)")
    p.add_argument("--size", type=parse_hw, default=(375, 500), metavar="HxW",
                   help="height x width of the generated images (default 375x500; one in four is portrait)")
    p.add_argument("--quality", type=int, default=90, help="JPEG quality (default 90)")
    p.add_argument("--seed", type=int, default=0, help="(default 0)")
    p.add_argument("--workers", type=int, default=None, help="processes (default: one per core)")
    a = p.parse_args()
    h, w = a.size
    t = time.perf_counter()
    make_image_folder(a.root, num_classes=a.classes, per_class=a.per_class, size=(h, w),
                      seed=a.seed, quality=a.quality, workers=a.workers)
    n = a.classes * a.per_class
    print(f"wrote {n} images in {a.classes} classes to {a.root} ({time.perf_counter() - t:.1f}s)")


if __name__ == "__main__":
    main()
