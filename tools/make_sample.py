#!/usr/bin/env python3
"""Expand fastload's bundled photographs into an ImageFolder tree (see fastload.sample).

    python tools/make_sample.py /tmp/sample --classes 10 --per-class 500
"""

from __future__ import annotations

import argparse
import time

from fastload.sample import make_image_folder


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("root", help="output directory (created)")
    p.add_argument("--classes", type=int, default=8)
    p.add_argument("--per-class", type=int, default=100)
    p.add_argument("--size", default="375x500", help="HxW of the generated images (default 375x500)")
    p.add_argument("--quality", type=int, default=90)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=None)
    a = p.parse_args()
    h, w = (int(x) for x in a.size.lower().split("x"))
    t = time.perf_counter()
    make_image_folder(a.root, num_classes=a.classes, per_class=a.per_class, size=(h, w),
                      seed=a.seed, quality=a.quality, workers=a.workers)
    n = a.classes * a.per_class
    print(f"wrote {n} images in {a.classes} classes to {a.root} ({time.perf_counter() - t:.1f}s)")


if __name__ == "__main__":
    main()
