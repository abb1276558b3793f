"""Packing throughput: images/s with 1 and 2 workers for each payload, and output size.

    python benchmarks/bench_pack.py                # ~2000 ImageNet-like JPEGs (375x500)
    python benchmarks/bench_pack.py --images 200   # a quick smoke run

Packs a sample tree made by fastload.sample.make_image_folder (in a temp dir) into LMDB
shards; the 2-vs-1 worker ratio is the packer's parallel speed-up (target >= 1.8x on an idle
2-core machine). Prints a table and writes the ``bench_pack`` section of RESULTS.md.

With ``--workers 1`` everything runs in one process (no pool). With N workers, N processes
decode/encode and the main process receives every payload through a pipe and writes it, in
order. The table reports the CPU each side spends per image (getrusage: main process vs pool
children) and the speed-up that CPU split allows on 2 cores, ``min(2/(W+E), 1/W) * C1``
(W: writer CPU/img, E: encoder CPU/img, C1: CPU/img of the 1-worker run): when the writer's
share is large (big payloads: bmp, raw) the writer, not the encoders, is the limit.
"""

from __future__ import annotations

import argparse
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # measure this checkout, not another install

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


def _cpu(who: int) -> float:
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


def _bound(c1: float, writer: float, encoders: float, cores: int = 2) -> float:
    """Speed-up over the 1-worker run that the measured CPU per image allows on ``cores``."""
    per_s = min(cores / (writer + encoders), 1.0 / writer) if writer > 0 else 0.0
    return per_s * c1


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
            rates, cpu, size = {}, {}, 0
            for w in args.workers:
                dest = Path(tmp) / f"out-{kw['payload']}-{w}"
                main0, kids0 = _cpu(resource.RUSAGE_SELF), _cpu(resource.RUSAGE_CHILDREN)
                s = pack(src, dest, config=PackConfig(backend=args.format, workers=w, progress=False, **kw))
                main1, kids1 = _cpu(resource.RUSAGE_SELF), _cpu(resource.RUSAGE_CHILDREN)
                if s.skipped or s.packed != n:
                    raise SystemExit(f"{label}: packed {s.packed}/{n}, skipped {s.skipped}")
                rates[w], size = s.images_per_s, s.bytes
                cpu[w] = ((main1 - main0) / n * 1000, (kids1 - kids0) / n * 1000)  # ms/image
                print(f"  {label:24s} workers={w}: {s.images_per_s:8.0f} images/s  {s.seconds:6.2f} s  "
                      f"CPU/img: main {cpu[w][0]:.2f} ms, workers {cpu[w][1]:.2f} ms", flush=True)
            lo, hi = args.workers[0], args.workers[-1]
            ratio = rates[hi] / rates[lo] if len(args.workers) > 1 else 1.0
            writer, encoders = cpu[hi]
            c1 = sum(cpu[lo])
            rows.append([label, *(rates[w] for w in args.workers), f"{ratio:.2f}x",
                         f"{writer:.2f} / {encoders:.2f}", f"{writer / (writer + encoders):.0%}",
                         f"{_bound(c1, writer, encoders):.2f}x" if lo == 1 else "-",
                         f"{size / 2**20:.1f}", f"{size / n / 1024:.1f}", f"{size / src_bytes:.2f}"])
    headers = ["payload", *(f"{w} worker{'s' if w > 1 else ''} (img/s)" for w in args.workers),
               f"{args.workers[-1]} vs {args.workers[0]}", f"CPU ms/img writer / encoders ({args.workers[-1]}w)",
               "writer share", "CPU bound", "output MiB", "KiB/image", "vs source"]
    body = table(headers, rows)
    print()
    print(body)
    if not args.no_write:
        note = (
            f"{n} sample JPEGs (375x500, q90, {src_bytes / 2**20:.1f} MiB) packed into {args.format} shards. "
            "'vs source' is output size / source size.\n\n"
            "Why the 2-vs-1 ratio stays under 1.8x for big payloads (Amdahl): with 1 worker one process "
            "does everything; with 2, two encoder processes share the 2 cores with the writer (the main "
            "process), which receives every payload through a pipe, copies it into LMDB, commits, fsyncs "
            "and SHA-256-hashes the shard, all in input order. 'writer / encoders' is the CPU each side "
            "spends per image in the 2-worker run; 'CPU bound' is the best ratio that split allows on 2 "
            "cores, min(2/(W+E), 1/W) x (1-worker CPU per image). Writer CPU grows with payload bytes "
            "(~5-6 ms per MB on a 2-core VM), encoder CPU with pixels, so jpeg and png (small output, "
            "costly encode) scale to ~1.8-2x, while bmp (552 KiB/image: the writer's share is over half) "
            "and raw and original (cheap encode, so the writer's per-image cost weighs more) cannot. "
            "Tried and dropped: LMDB writemap=True (more CPU: page faults on the fresh map). Not done: "
            "handing payloads over through files or shared memory instead of the pool's pipe (a "
            "microbenchmark cut the writer's receive cost from 0.62 to 0.17 ms per 552 KiB payload)."
        )
        write_section("bench_pack", f"{note}\n\n{body}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
