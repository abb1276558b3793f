"""Resize: cv2 INTER_AREA / INTER_LINEAR vs fastload's resize_area and resize, same run.

    python benchmarks/bench_resize.py --boxes 300 --rounds 7

RandomResizedCrop(224) boxes drawn by torchvision's rule (scale 0.08-1, ratio 3/4-4/3) from a
256x256 and a 256x341 RGB image. The first table times the boxes that shrink on both axes (the
ones the area filter is for; resize_area refuses the others); the second the boxes that grow
on an axis, resized and mirrored by OpenCV (resize + flip) and by fastload's resize(flip=True). Each method resizes every box, a
crop view of the source, into one reused 224x224x3 buffer; methods alternate per round so a
busy machine disturbs all alike, and the table gives the best and median microseconds per
image over the rounds. OpenCV runs single-threaded, as in fastload's workers. Also reports
the largest difference from INTER_AREA. Writes the ``bench_resize`` section of RESULTS.md
unless ``--no-write``.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import cv2
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # measure this checkout, not another install
from _results import table, write_section  # noqa: E402

OUT = 224


def rrc_boxes(h: int, w: int, n: int, rng: np.random.Generator) -> list[tuple[int, int, int, int]]:
    """n RandomResizedCrop boxes (top, left, h, w), torchvision's rule with default scale/ratio."""
    boxes = []
    log_r = (math.log(3 / 4), math.log(4 / 3))
    for _ in range(n):
        for _attempt in range(10):
            area = h * w * rng.uniform(0.08, 1.0)
            ar = math.exp(rng.uniform(*log_r))
            bw, bh = int(round(math.sqrt(area * ar))), int(round(math.sqrt(area / ar)))
            if 0 < bw <= w and 0 < bh <= h:
                boxes.append((int(rng.integers(0, h - bh + 1)), int(rng.integers(0, w - bw + 1)), bh, bw))
                break
        else:  # center crop, clamped to the ratio range
            bh, bw = (h, min(w, int(round(h * 4 / 3)))) if w / h > 4 / 3 else (min(h, int(round(w / (3 / 4)))), w)
            boxes.append(((h - bh) // 2, (w - bw) // 2, bh, bw))
    return boxes


def photo(h: int, w: int) -> np.ndarray:
    y, x = np.mgrid[0:h, 0:w].astype(np.float32)
    img = np.stack([128 + 100 * np.sin(x / 13), 128 + 90 * np.cos(y / 9), (3 * x + 5 * y) % 256], axis=2)
    noise = np.random.default_rng(1).normal(0, 12, img.shape)
    return np.clip(img + noise, 0, 255).astype(np.uint8)


def time_methods(methods: dict, crops: list, rounds: int) -> dict[str, list[float]]:
    """Microseconds per image of each method over ``crops``, per round (methods alternate)."""
    for f in methods.values():  # warm-up
        for c in crops:
            f(c)
    times: dict[str, list[float]] = {name: [] for name in methods}
    for r in range(rounds):
        for name, f in methods.items():
            t0 = time.perf_counter()
            for c in crops:
                f(c)
            times[name].append((time.perf_counter() - t0) / len(crops) * 1e6)
        print(f"round {r + 1}: " + ", ".join(f"{n.strip()} {t[-1]:.0f}" for n, t in times.items()) + " us/img", flush=True)
    return times


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--boxes", type=int, default=300, help="shrinking boxes per source image (default 300)")
    ap.add_argument("--rounds", type=int, default=7, help="alternations of the methods (default 7)")
    ap.add_argument("--no-write", action="store_true", help="print only; do not update RESULTS.md")
    args = ap.parse_args(argv)

    from fastload.data import resize

    cv2.setNumThreads(1)
    rng = np.random.default_rng(0)
    crops, grow, notes = [], [], []
    for h, w in [(256, 256), (256, 341)]:
        img = photo(h, w)
        drawn = rrc_boxes(h, w, 40 * args.boxes, rng)
        shrink = [b for b in drawn if b[2] >= OUT and b[3] >= OUT and (b[2], b[3]) != (OUT, OUT)]
        mixed = sum(1 for b in drawn if b[2] * b[3] > OUT * OUT and (b[2] < OUT or b[3] < OUT))
        notes.append(f"{h}x{w}: {len(shrink) / len(drawn):.1%} of boxes shrink on both axes, "
                     f"{mixed / len(drawn):.1%} shrink in area but enlarge one axis (in the second table)")
        crops += [img[t : t + bh, l : l + bw] for t, l, bh, bw in shrink[: args.boxes]]
        growing = [b for b in drawn if b[2] < OUT or b[3] < OUT]
        notes.append(f"{h}x{w}: {len(growing) / len(drawn):.1%} of boxes grow on at least one axis")
        grow += [img[t : t + bh, l : l + bw] for t, l, bh, bw in growing[: 3 * args.boxes]]
    dst = np.empty((OUT, OUT, 3), np.uint8)

    methods = {
        "cv2 INTER_AREA": lambda c: cv2.resize(c, (OUT, OUT), dst=dst, interpolation=cv2.INTER_AREA),
        "cv2 INTER_LINEAR": lambda c: cv2.resize(c, (OUT, OUT), dst=dst, interpolation=cv2.INTER_LINEAR),
        "fastload resize_area": lambda c: resize.resize_area(c, dst),
    }
    if resize.available():
        ext = resize._ext()
        methods["  same, portable C (no SIMD)"] = lambda c: ext.resize_area(c, dst, simd=False)
        kernels = ext.simd()
    else:
        kernels = "extension not built: OpenCV fallback"

    worst, differ = 0, 0
    for c in crops:
        ref = cv2.resize(c, (OUT, OUT), interpolation=cv2.INTER_AREA)
        out = resize.resize_area(c, np.empty_like(ref))
        d = np.abs(out.astype(np.int16) - ref)
        worst, differ = max(worst, int(d.max())), differ + int(np.count_nonzero(d))

    times = time_methods(methods, crops, args.rounds)
    area = statistics.median(times["cv2 INTER_AREA"])
    rows = [[name, f"{min(t):.0f}", f"{statistics.median(t):.0f}", f"{area / statistics.median(t):.2f}x"]
            for name, t in times.items()]
    sizes = np.array([c.shape[:2] for c in crops])
    body = (
        f"{len(crops)} RandomResizedCrop boxes that shrink on both axes (heights {sizes[:, 0].min()}-"
        f"{sizes[:, 0].max()}, widths {sizes[:, 1].min()}-{sizes[:, 1].max()}) from a 256x256 and a 256x341 RGB "
        f"image, each resized to {OUT}x{OUT}x3 into a reused buffer; one thread, methods alternated over "
        f"{args.rounds} rounds. Kernels: {kernels}.\n\n"
        + "\n".join(f"- {n}" for n in notes)
        + "\n\n"
        + table(["method", "best us/img", "median us/img", "speed vs INTER_AREA (median)"], rows)
        + f"\n\nresize_area vs INTER_AREA: max abs difference {worst}, "
        f"{differ / (len(crops) * OUT * OUT * 3):.3%} of values differ (rounding ties).\n"
        + grow_section(grow, args.rounds, resize)
    )
    print(body)
    if not args.no_write:
        write_section("bench_resize", body)
    return 0


def grow_section(grow: list, rounds: int, resize) -> str:
    """Boxes that grow on an axis (most RandomResizedCrop samples), resized and mirrored: what
    fastload did with OpenCV (INTER_LINEAR, or INTER_AREA when the area shrinks, then cv2.flip)
    against fastload's resize (per-axis area/bilinear, the flip in the same pass)."""
    dst = np.empty((OUT, OUT, 3), np.uint8)

    def opencv(c):
        interp = cv2.INTER_AREA if c.shape[0] * c.shape[1] > OUT * OUT else cv2.INTER_LINEAR
        cv2.flip(cv2.resize(c, (OUT, OUT), dst=dst, interpolation=interp), 1, dst=dst)

    enlarge = [c for c in grow if c.shape[0] <= OUT and c.shape[1] <= OUT]
    mixed = [c for c in grow if c.shape[0] > OUT or c.shape[1] > OUT]
    rows = []
    for label, crops in [("grow on both axes", enlarge), ("shrink one axis, grow the other", mixed)]:
        methods = {"OpenCV resize + flip": opencv, "fastload resize(flip=True)": lambda c: resize.resize(c, dst, flip=True)}
        times = time_methods(methods, crops, rounds)
        base = statistics.median(times["OpenCV resize + flip"])
        rows += [[label, f"{len(crops)}", name, f"{statistics.median(t):.0f}", f"{base / statistics.median(t):.2f}x"]
                 for name, t in times.items()]
    worst = 0
    for c in enlarge:
        ref = cv2.resize(c, (OUT, OUT), interpolation=cv2.INTER_LINEAR)[:, ::-1]
        worst = max(worst, int(np.abs(resize.resize(c, np.empty_like(ref), flip=True).astype(np.int16) - ref).max()))
    return (
        "\n\nBoxes that grow on an axis, resized to 224x224 and mirrored:\n\n"
        + table(["boxes", "count", "method", "median us/img", "speed vs OpenCV"], rows)
        + f"\n\nfastload's bilinear vs INTER_LINEAR + flip on the growing boxes: max abs difference {worst}.\n"
    )


if __name__ == "__main__":
    sys.exit(main())
