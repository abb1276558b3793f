"""What the read-time record checks cost: the same loader with them on and off, in one run.

    python benchmarks/bench_integrity.py --images 5000 --workers 2 --batch 256

Every record read is checked against the XXH3-64 checksum stored when it was packed (payload,
label, shape, place in its shard), and every decoded image's shape against the index. This
runs fastload's DataLoader (RandomResizedCrop 224 + flip, uint8 batches, ``--workers``
processes, the ring path) over ``jpeg`` at ``--resize 256`` and ``raw`` at ``--size 256x256``
LMDB packs of the sample generator's tree, with the record checksum on (the default) and off
(``PackReader.verify_records = False``), alternating, each measurement in a fresh process
(one warm-up epoch, then the best of three timed epochs), ``--rounds`` times. Prints images/s
and the cost, and writes the ``bench_integrity`` section of RESULTS.md.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # measure this checkout, not another install
from _results import ensure_pack, ensure_tree, table, write_section  # noqa: E402

OUT = 224
EPOCHS = 3


def _measure(pack: str, verify: bool, workers: int, batch: int, queue) -> None:
    import fastload.transforms as T
    from fastload.data.dataset import ImageFolder
    from fastload.data.loader import DataLoader

    ds = ImageFolder(pack, T.Compose([T.RandomResizedCrop(OUT), T.RandomHorizontalFlip()]))
    ds.reader.verify_records = verify
    best = 0.0
    with DataLoader(ds, batch, num_workers=workers, seed=0, pin_memory=False) as loader:
        assert loader.mode == "ring", loader.mode
        for epoch in range(EPOCHS + 1):
            t0 = time.perf_counter()
            n = sum(len(y) for _, y in loader)
            rate = n / (time.perf_counter() - t0)
            if epoch:  # the first pass warms the page cache and starts the workers
                best = max(best, rate)
    queue.put(best)


def _per_read(pack: str, queue) -> None:
    """Median microseconds per ``PackReader.get`` with the check off and on (alternating
    passes over the same 4,000 random records, pages warm): the check's own cost, free of the
    loader's scheduling noise."""
    import numpy as np

    from fastload.storage import open_pack

    r = open_pack(pack)
    idx = np.random.default_rng(0).permutation(len(r))[:4000].tolist()
    for i in idx:
        bytes(r.get(i))  # warm the page cache and the shard maps
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(7):
        for flag in (False, True):
            r.verify_records = flag
            t0 = time.perf_counter()
            for i in idx:
                r.get(i)
            times[flag].append((time.perf_counter() - t0) / len(idx) * 1e6)
    queue.put((statistics.median(times[False]), statistics.median(times[True])))


def per_read(pack: Path) -> tuple[float, float]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_per_read, args=(str(pack), queue))
    proc.start()
    out = queue.get(timeout=600)
    proc.join()
    return out


def measure(pack: Path, verify: bool, workers: int, batch: int) -> float:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_measure, args=(str(pack), verify, workers, batch, queue))
    proc.start()
    rate = queue.get(timeout=600)
    proc.join()
    return rate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=5000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3, help="on/off pairs per payload (default 3)")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()

    from fastload.config import PackConfig

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="fl-bench-integrity-"))
    src, n = ensure_tree(workdir, args.images, workers=args.workers)
    packs = {
        "jpeg@256": ensure_pack(src, workdir / "jpeg256", PackConfig(payload="jpeg", resize=256, workers=args.workers,
                                                                      progress=False), "jpeg@256"),
        "raw@256": ensure_pack(src, workdir / "raw256", PackConfig(payload="raw", size=(256, 256),
                                                                    workers=args.workers, progress=False), "raw@256"),
    }
    rows = []
    for name, pack in packs.items():
        on, off = [], []
        for r in range(args.rounds):
            first, second = (True, False) if r % 2 == 0 else (False, True)  # alternate who goes first
            for flag in (first, second):
                rate = measure(pack, flag, args.workers, args.batch)
                (on if flag else off).append(rate)
                print(f"{name} checks {'on ' if flag else 'off'}: {rate:,.0f} img/s", flush=True)
        m_on, m_off = statistics.median(on), statistics.median(off)
        get_off, get_on = per_read(pack)
        per_image = 1e6 * args.workers / m_off  # worker-microseconds per image, checks off
        rows.append([name, m_off, m_on, f"{100 * (1 - m_on / m_off):+.1f}%",
                     f"{min(on):,.0f}-{max(on):,.0f}", f"{min(off):,.0f}-{max(off):,.0f}",
                     f"{get_off:.2f} / {get_on:.2f}", f"{100 * (get_on - get_off) / per_image:.1f}%"])
    headers = ["payload (LMDB)", "checks off img/s", "checks on img/s", "loader cost", "on: range", "off: range",
               "get() us off / on", "check / image time"]
    text = table(headers, rows)
    print(text)
    if not args.no_write:
        body = (
            f"{n} images, RandomResizedCrop {OUT} + flip, batch {args.batch}, {args.workers} workers, ring path; "
            f"median of {args.rounds} fresh-process runs each (best of {EPOCHS} epochs after a warm-up), on and off "
            "alternating. *loader cost* = 1 - on/off: the record checksum (XXH3-64 over payload, label, shape and "
            "place) on every read, which is the default. On 2 shared cores the loader figures move by +-10% from "
            "run to run, more than the check costs, so the check is also timed on its own: *get() us* is the median "
            "time of one `PackReader.get` over 4,000 random records with the check off and on (7 alternating "
            "passes, pages warm), and *check / image time* is that difference over a worker's time per image "
            "(workers / loader img/s with the check off).\n\n" + text
        )
        write_section("bench_integrity", body)


if __name__ == "__main__":
    main()
