"""A/B: full JPEG decode (simplejpeg) vs decoding only the crop box (turbo-crop), same run,
on the jpeg payload packed with and without restart markers.

    python benchmarks/bench_jpegcrop.py --images 1000 --rounds 5

One process, a ceiling-style tight loop over a jpeg@256 LMDB pack (the sample generator's
photos re-encoded at shorter side 256, q90): record get + decode + RandomResizedCrop(224) +
flip into a reused batch buffer, i.e. ``ImageFolder.fill_batch``. The same photos are packed
twice: as ``fastload pack`` does by default (restart markers every 1-2 MCUs, so turbo-crop
entropy-decodes only the segments under the box) and ``--no-restart-markers``. Each decoder
runs on both; the runs alternate A, B, C, D, A... so a machine shared with other work
disturbs all alike; the table gives each one's best and median microseconds per image over
the rounds. Writes the ``bench_jpegcrop`` section of RESULTS.md unless ``--no-write``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # measure this checkout, not another install
from _results import ensure_pack, table, write_section  # noqa: E402

OUT = 224


def _epoch_us(ds, order: np.ndarray, epoch: int) -> float:
    chunk = 64
    images = np.empty((chunk, *ds.batch_image_shape()), np.uint8)
    targets = np.empty(chunk, np.int64)
    t0 = time.perf_counter()
    for s in range(0, len(order), chunk):
        idx = order[s : s + chunk]
        ds.fill_batch(idx, images[: len(idx)], targets[: len(idx)], epoch=epoch)
    return (time.perf_counter() - t0) / len(order) * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--images", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=5, help="A/B alternations (default 5)")
    ap.add_argument("--workdir", type=Path, default=None, help="where to build the tree and pack (default: a temp dir)")
    ap.add_argument("--no-write", action="store_true", help="print only; do not update RESULTS.md")
    args = ap.parse_args(argv)

    from fastload.codecs import jpegcrop
    from fastload.config import PackConfig
    from fastload.data.dataset import ImageFolder
    from fastload.sample import make_image_folder
    from fastload.transforms import Compose, RandomHorizontalFlip, RandomResizedCrop

    if not jpegcrop.available():
        print("fastload._jpegcrop is not built (needs libjpeg-turbo headers); nothing to compare", file=sys.stderr)
        return 1
    tmp = args.workdir or Path(tempfile.mkdtemp(prefix="bench_jpegcrop-"))
    tmp.mkdir(parents=True, exist_ok=True)
    src = tmp / "src"
    classes = 8 if args.images >= 80 else 2
    if not src.exists():
        print(f"generating {classes * math.ceil(args.images / classes)} JPEGs in {src} ...", flush=True)
        make_image_folder(src, num_classes=classes, per_class=math.ceil(args.images / classes))
    packs = {}
    for markers in (True, False):
        dest = tmp / ("jpeg_256_lmdb" if markers else "jpeg_256_norst_lmdb")
        cfg = PackConfig(backend="lmdb", payload="jpeg", resize=256, quality=90, restart_markers=markers,
                         progress=False)
        packs[markers] = ensure_pack(src, dest, cfg, f"jpeg@256 (lmdb{'' if markers else ', --no-restart-markers'})")

    aug = Compose([RandomResizedCrop(OUT), RandomHorizontalFlip()])
    sets = {(name, markers): ImageFolder(packs[markers], aug, decoder=name)
            for name in ("simplejpeg", "turbo-crop") for markers in (False, True)}
    order = np.random.default_rng(0).permutation(len(sets["simplejpeg", False]))
    for ds in sets.values():  # warm-up: page cache, shard open, code paths
        _epoch_us(ds, order, epoch=1)
    times: dict[tuple[str, bool], list[float]] = {key: [] for key in sets}
    for r in range(args.rounds):
        for key, ds in sets.items():
            times[key].append(_epoch_us(ds, order, epoch=r))
        print(f"round {r + 1}: " + ", ".join(f"{n}{' +rst' if m else ''} {t[-1]:.0f} us/img"
                                             for (n, m), t in times.items()), flush=True)

    med = {key: statistics.median(t) for key, t in times.items()}
    base = med["simplejpeg", False]
    sizes = {m: sum(sh["bytes"] for sh in json.loads((packs[m] / "manifest.json").read_text())["shards"])
             for m in packs}
    rows = [[name, "restart markers" if markers else "--no-restart-markers", f"{min(times[name, markers]):.0f}",
             f"{med[name, markers]:.0f}", f"{1e6 / med[name, markers]:.0f}", f"{base / med[name, markers]:.2f}x"]
            for (name, markers) in sets]
    body = (
        f"{len(order)} images of jpeg@256 (LMDB), one process, get + decode + RandomResizedCrop({OUT}) + "
        f"flip into a reused buffer (`ImageFolder.fill_batch`); the four runs alternated over {args.rounds} rounds. "
        f"Packed with restart markers the shard is {sizes[True] / sizes[False] - 1:+.1%} bytes.\n\n"
        + table(["decoder", "pack", "best us/img", "median us/img", "images/s (median)", "vs simplejpeg, no markers"],
                rows)
        + f"\n\nturbo-crop vs simplejpeg on fastload's default pack (median): "
        f"{med['simplejpeg', True] / med['turbo-crop', True]:.2f}x; the restart-segment grid alone "
        f"(turbo-crop with vs without markers): {med['turbo-crop', False] / med['turbo-crop', True]:.2f}x\n"
    )
    print(body)
    if not args.no_write:
        write_section("bench_jpegcrop", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
