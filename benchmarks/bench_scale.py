"""Scale: what fastload's per-epoch and per-dataset work costs as the dataset grows, measured
without a pack of that size where the work does not read images.

    python benchmarks/bench_scale.py                      # every section
    python benchmarks/bench_scale.py --sections epoch     # one section

Each section writes its own part of RESULTS.md (``bench_scale_<name>``) through
``_results.write_section``; add a section by writing a function ``(args) -> body`` and
listing it in ``SECTIONS`` (with its own ``--<name>-...`` options in ``add_arguments``).

Sections:

* ``epoch``: the epoch boundary. Time from the last batch of epoch ``e`` to the first of
  ``e + 1`` against the median batch, and the memory that boundary allocates, for N = 1M,
  10M and 100M samples on 1 and 8 ranks: the order stage alone (what the ring loader and the
  DALI source ask of it; also with a BlockShufflePlan), the per-sample path through a real
  ``fastload.DataLoader`` over an in-memory dataset of N samples, a rank's whole
  ``plan.indices`` (the O(N/W) array API), and a real DataLoader with worker processes over
  a small real pack. "old" rows run the code fastload <= 0.2 ran, in the same process: the
  whole order (``rng.permutation(N)``) plus the rank's gather when an epoch began, and for
  the per-sample path the list of ``(epoch, index)`` keys of every batch. The acceptance
  bound: an epoch boundary within 2x a normal batch at 1M and 10M.
* ``index``: one shared copy of a pack's index per node (issue 16). On synthetic packs of
  N = 10k, 1M and 10M records (copies of a 1M-record shard up to N, index and manifest as
  the packer writes them): ImageFolder open time and added RSS, private memory per DataLoader
  worker with fork and spawn, and the peak RSS of ``fastload inspect`` and ``verify``.
  Targets: under 50 MB private per worker at 10M, inspect under 1 GB.
* ``pack``: the pack scan at scale (issue 16). Time to the first packed record and peak RSS
  of ``fastload pack`` (whole and ``--part 0/N``) for a 1M-file ImageFolder tree (hard links
  to a few 8x8 JPEGs) and a 10M-row CSV, with the scan alone beside it; ``--pack-full`` also
  packs the whole tree and takes ``fastload inspect``'s peak RSS. Targets: first image within
  5 s at 1M files; peak RSS under 1 GB for a 10M-row CSV.
"""

from __future__ import annotations

import argparse
import collections
import gc
import itertools
import os
import statistics
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # measure this checkout, not another install
from _results import ensure_pack, ensure_tree, table, write_section  # noqa: E402

MB = 1 << 20
BOUNDARIES = 15  # epoch boundaries measured per row (the median is reported: a shared machine stalls at random)


def _timed(fn: Callable[[], object]) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def _peak_bytes(fn: Callable[[], object]) -> int:
    """Peak bytes allocated (numpy and Python) while ``fn`` runs, beyond what it returns freed."""
    return _timed_peak(fn)[1]


def _timed_peak(fn: Callable[[], object]) -> tuple[float, int]:
    """``(seconds, peak bytes)`` of ``fn`` under tracemalloc (the collection before is not timed)."""
    gc.collect()
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        seconds, keep = _timed(fn)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    del keep
    return seconds, peak


class _Sized:
    """An in-memory dataset of ``n`` tiny samples (the targets are the indices): the loader's
    own work, without decoding."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return np.zeros((4, 4, 3), np.uint8), i


# -- section: epoch ------------------------------------------------------------------------------


def _old_begin(plan, epoch: int) -> np.ndarray:
    """What fastload <= 0.2 did when an epoch began: the whole permutation, then this rank's
    gather (``Order.begin`` -> ``plan.indices(epoch)``)."""
    order = np.random.default_rng([plan.seed, epoch]).permutation(plan.num_samples).astype(np.int64)
    pos = plan.rank + plan.world_size * np.arange(plan.samples_per_rank(), dtype=np.int64)
    return np.ascontiguousarray(order[pos % plan.num_samples])


def _old_per_sample_keys(plan, epoch: int) -> list:
    """... and on the per-sample path, the batch sampler's lists of ``(epoch, index)`` keys."""
    idx = _old_begin(plan, epoch)
    bs = plan.batch_size
    return [[(epoch, i) for i in idx[b * bs : (b + 1) * bs].tolist()] for b in range(plan.num_batches())]


def _order_rows(plan, reps: int, old: bool, scenario: str = "order stage") -> list[list]:
    """The order stage as a loader drives it: the last batches of epoch ``e - 1`` (resumed
    near its end), then ``finish``, ``begin`` epoch ``e`` and slice its first batch (timed);
    against the median batch slice. Old: the permutation and gather fastload <= 0.2's
    ``Order.begin`` did (``plan.indices`` under order version 1)."""
    from fastload.data.order import Order

    gc.collect()  # the garbage of the rows before is not this row's
    n, world = plan.num_samples, plan.world_size
    nb = plan.num_batches()
    rng = np.random.default_rng(0)
    order = Order(plan)

    def end_of(epoch: int) -> None:
        """Read the last 4 batches of ``epoch`` (the order prepares the next one on the way)."""
        order.load_state_dict({"epoch": epoch, "position": plan.consumed(max(nb - 4, 0)), **plan.identity()})
        e, first, view = order.begin()
        for b in range(first, first + order.batches_left()):
            order.batch(view, b)
            order.advance(e, b)

    def first_batch(epoch: int):
        order.finish(epoch - 1)  # the previous epoch ended: what the loader does after its last batch
        e, b, view = order.begin()
        return order.batch(view, b)

    firsts = []
    for e in range(1, reps + 1):
        end_of(e - 1)
        firsts.append(_timed(lambda e=e: first_batch(e))[0])
    e, _, view = order.begin()
    picks = rng.integers(0, nb, size=200)
    per_batch = [_timed(lambda b=int(b): order.batch(view, b))[0] for b in picks]
    med = statistics.median(per_batch)
    end_of(reps)
    mem = _peak_bytes(lambda: first_batch(reps + 1))
    rows = [[scenario, f"{n:,}", world, "new (pointwise)", statistics.median(firsts) * 1e3, med * 1e3,
             statistics.median(firsts) / med, mem / MB]]
    if old:
        legacy = plan.replace(order_version=1)  # a fresh plan: nothing of the epoch is cached yet
        t, old_mem = _timed_peak(lambda: legacy.indices(reps + 2))
        idx = legacy.indices(reps + 2)
        del legacy
        old_batch = statistics.median(_timed(lambda b=int(b): plan.batch(idx, b))[0] for b in picks)
        del idx
        # its per-batch work was a slice of that array: the ratio says nothing, see the DataLoader rows
        rows.append([scenario, f"{n:,}", world, "old (whole order)", t * 1e3 + old_batch * 1e3,
                     old_batch * 1e3, None, old_mem / MB])
    return rows


def _per_sample_rows(n: int, world: int, batch: int, tail: int, old: bool) -> list[list]:
    """A real fastload.DataLoader (per-sample path, torch's loader, no workers) over ``n``
    in-memory samples: the last ``tail`` batches of an epoch, then the next epoch's first."""
    from fastload.data.loader import DataLoader
    from fastload.data.plan import EpochPlan

    gc.collect()
    plan = EpochPlan(n, batch_size=batch, seed=1, world_size=world, rank=world - 1)
    loader = DataLoader(_Sized(n), plan=plan, num_workers=0, pin_memory=False)
    nb = plan.num_batches()
    gaps, boundary = [], []
    for epoch in range(BOUNDARIES):
        loader.load_state_dict({"order": {**loader.state_dict()["order"], "epoch": epoch,
                                          "position": plan.consumed(nb - tail)}})
        t = None
        for _ in loader:
            now = time.perf_counter()
            if t is not None:  # the first one also started the pass
                gaps.append(now - t)
            t = now
        it = iter(loader)  # epoch + 1 begins
        next(it)
        boundary.append(time.perf_counter() - t)
        del it
    med = statistics.median(gaps)
    first = statistics.median(boundary)
    rows = [["per-sample DataLoader", f"{n:,}", world, "new (lazy batch sampler)", first * 1e3, med * 1e3,
             first / med, None]]
    if old:
        t_old, _ = _timed(lambda: _old_per_sample_keys(plan, 7))
        mem = _peak_bytes(lambda: _old_per_sample_keys(plan, 8))
        rows.append(["per-sample DataLoader", f"{n:,}", world, "old (keys of every batch)", (t_old + med) * 1e3,
                     med * 1e3, (t_old + med) / med, mem / MB])
    loader.close()
    return rows


def _indices_rows(n: int, world: int, old: bool) -> list[list]:
    """A rank's whole share as one array (``plan.indices``): O(N / world) by design."""
    from fastload.data.plan import EpochPlan

    plan = EpochPlan(n, seed=1, world_size=world, rank=world - 1)
    # one pass each under tracemalloc: both are a few large numpy operations per chunk, which it barely slows
    t, mem = _timed_peak(lambda: plan.indices(3))
    rows = [["plan.indices (whole rank)", f"{n:,}", world, "new (pointwise)", t * 1e3, None, None, mem / MB]]
    if old:
        t_old, mem_old = _timed_peak(lambda: _old_begin(plan, 3))
        rows.append(["plan.indices (whole rank)", f"{n:,}", world, "old (whole order)", t_old * 1e3, None, None,
                     mem_old / MB])
    return rows


def _pack_rows(args) -> list[list]:
    """A real DataLoader (ring path, worker processes) over a small real pack: per-batch
    arrival times over ``BOUNDARIES + 1`` epochs, and the gap at each boundary; with the next
    epoch's first batches filled ahead (the default) and without (``prefetch_next_epoch=False``,
    what fastload <= 0.2 did), one loader after the other; on the ring path and on the
    per-sample path (torch's loader, chosen by passing a ``collate_fn``)."""
    from fastload.config import PackConfig
    from fastload.data.collate import collate_uint8
    from fastload.data.dataset import ImageFolder
    from fastload.data.loader import DataLoader
    from fastload.transforms import RandomResizedCrop

    with tempfile.TemporaryDirectory(prefix="bench_scale_epoch_") as tmp:
        work = Path(args.workdir) / "epoch" if args.workdir else Path(tmp)  # a given workdir is kept and reused
        src, _ = ensure_tree(work, args.epoch_pack_images, workers=2)
        pack = ensure_pack(src, work / "pack", PackConfig(workers=2, progress=False), "a small jpeg pack")
        ds = ImageFolder(pack, RandomResizedCrop(64))
        n = len(ds)
        gaps: dict[tuple, list] = collections.defaultdict(list)
        boundary: dict[tuple, list] = collections.defaultdict(list)
        # one loader at a time: the next iteration starts right after the last batch
        for path, ahead in itertools.product(("ring", "per-sample"), (False, True)):
            collate = collate_uint8 if path == "per-sample" else None  # a collate_fn takes torch's loader
            with DataLoader(ds, args.epoch_pack_batch, num_workers=2, seed=1, pin_memory=False,
                            prefetch_next_epoch=ahead, collate_fn=collate) as loader:
                assert loader.mode == path
                t = time.perf_counter()
                for epoch in range(BOUNDARIES + 1):
                    loader.set_epoch(epoch)
                    for b, _ in enumerate(loader):
                        now = time.perf_counter()
                        if epoch:  # epoch 0 starts the workers
                            (boundary if b == 0 else gaps)[path, ahead].append(now - t)
                        t = now
        del ds
    rows = []
    for path, ahead in itertools.product(("ring", "per-sample"), (False, True)):
        label = "new (next epoch filled ahead)" if ahead else "old (pipeline drains at the boundary)"
        med = statistics.median(gaps[path, ahead])
        first = statistics.median(boundary[path, ahead])
        rows.append([f"DataLoader, 2 workers, real pack, {path} path", f"{n:,}", 1, label, first * 1e3, med * 1e3,
                     first / med, None])
    return rows


def section_epoch(args) -> str:
    load = os.getloadavg()[0]  # other work on the machine: the old/new ratios matter, not the absolute ms
    sizes = [int(float(s)) for s in args.epoch_sizes.split(",")]
    worlds = [int(w) for w in args.epoch_worlds.split(",")]
    old_max = int(float(args.epoch_old_max))
    from fastload.data.plan import BlockShufflePlan, EpochPlan

    rows: list[list] = []
    for n in sizes:
        for w in worlds:
            print(f"  order stage N={n:,} W={w}", flush=True)
            plan = EpochPlan(n, batch_size=args.epoch_batch, seed=1, world_size=w, rank=w - 1)
            # the old permutation costs the same on any number of ranks: above 10M it runs once, not per W
            rows += _order_rows(plan, reps=BOUNDARIES, old=n <= old_max and (n <= 10**7 or w == worlds[0]))
    shards = args.epoch_block_shards
    for n in sizes:
        for w in worlds:
            print(f"  block-shuffle order stage N={n:,} W={w}", flush=True)
            starts = tuple(np.linspace(0, n, shards + 1).astype(np.int64).tolist())
            plan = BlockShufflePlan(n, batch_size=args.epoch_batch, seed=1, world_size=w, rank=w - 1,
                                    shard_starts=starts, window=8)
            rows += _order_rows(plan, reps=BOUNDARIES, old=n <= min(old_max, 10**7),
                                scenario=f"order stage, block shuffle ({shards:,} shards, window 8)")
    for n in sizes:
        for w in worlds:
            print(f"  per-sample DataLoader N={n:,} W={w}", flush=True)
            # the old key lists hold ~100 bytes per sample: 10M is the most this runs them at
            rows += _per_sample_rows(n, w, args.epoch_batch, tail=10, old=n <= min(old_max, 10**7))
    for n in sizes:
        for w in worlds:
            if n // w <= int(float(args.epoch_indices_max)):
                print(f"  plan.indices N={n:,} W={w}", flush=True)
                rows += _indices_rows(n, w, old=n <= min(old_max, 10**7))  # 100M: see the order stage rows
    if args.epoch_pack_images:
        print("  real pack", flush=True)
        rows += _pack_rows(args)
    headers = ["scenario", "N", "ranks", "order", "epoch's first batch (ms)", "median batch (ms)",
               "boundary / batch", "peak memory at the boundary (MB)"]
    cells = [[_cell(c, ratio=i == 6) for i, c in enumerate(r)] for r in rows]
    return (
        f"Batch size {args.epoch_batch}; the last rank of W. \"epoch's first batch\": from the end of epoch e's last "
        "batch to epoch e + 1's first batch indices (order stage: fastload's Order, which the ring loader and the "
        "DALI source use, driven through the last 4 batches of epoch e first; block shuffle: a BlockShufflePlan "
        "over equal shards), or to its first collated batch (per-sample "
        "DataLoader, torch's loader without workers over in-memory samples; real pack: 2 worker processes, "
        "ring path or per-sample path (torch's loader), RandomResizedCrop(64); \"old\" is prefetch_next_epoch=False). \"old\" runs fastload <= 0.2's epoch start in the same process "
        "(the whole order -- rng.permutation(N), or a block shuffle's per-window rng shuffles -- and the rank's "
        "gather; per-sample: plus the (epoch, index) key lists of every "
        "batch), its first batch = that work + a median batch; the old order stage's per-batch work was a slice of "
        "that array, so its ratio is left out. Memory: peak bytes allocated at the boundary (tracemalloc). "
        "plan.indices is the O(N/W) array API (not on a loader's path): one pass each, under tracemalloc. "
        f"Each new row is the median of {BOUNDARIES} boundaries; load average {load:.1f} on {os.cpu_count()} cores "
        "when the run began (absolute times are noisy on a shared machine).\n\n"
        + table(headers, cells) + "\n\n"
        "At an epoch boundary the plan now costs one batch's indices (order stage and per-sample rows). On the "
        "real pack, without prefetching ahead the workers have no task between the last batch of epoch e and the "
        "next iteration, so the first batch of e + 1 waits for one whole fill instead of 1/workers of one; with "
        "it (the default) the ring loader sends epoch e + 1's first batches once e's last ones are in flight, "
        "and the per-sample path keeps one torch iteration running across epochs.\n"
    )


# -- section: index ------------------------------------------------------------------------------

_SYNTH_CLASSES = 1000
_SYNTH_PACK_ID = "5ca1ab1e0000000000000000000000ff"  # hex, like the packer's


def synth_pack(dest: Path, n: int, *, copies: int = 1) -> Path:
    """A valid LMDB pack of ``n * copies`` tiny JPEG records at ``dest``, made without source
    files: one shard of ``n`` records written through the storage writer (16 small JPEGs of
    varied sizes, 1000 classes), ``copies - 1`` copies of it under the next shard names,
    and the index file and manifest written by the code the packer uses (``fastload verify``
    passes). Kept if ``dest`` already holds it."""
    import shutil

    from fastload.codecs import jpeg
    from fastload.schema import Manifest, ShardEntry, manifest_name, read_manifest, shard_name, write_manifest
    from fastload.storage import ShardIndex, make_shard_writer
    from fastload.storage.index_file import index_name, write_index_file

    mpath = dest / manifest_name(0, 1)
    if mpath.exists() and read_manifest(mpath).num_samples == n * copies:
        return dest
    dest.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    payloads = []
    for k in range(16):
        h, w = 8 + k % 4 * 4, 8 + k // 4 * 4
        payloads.append((jpeg.encode(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), quality=80), (h, w, 3)))
    first = dest / shard_name("lmdb", 0, 1, 0)
    writer = make_shard_writer("lmdb", first, shard_size=1 << 40, pack_id=_SYNTH_PACK_ID)
    for i in range(n):
        data, shape = payloads[i % 16]
        label = i % _SYNTH_CLASSES
        writer.append(data, label=label, shape=shape, path=f"n{label:04d}/img_{i:08d}.JPEG")
    entry = writer.finish()
    one = writer.index()
    del writer
    entries = [entry]
    for c in range(1, copies):
        name = shard_name("lmdb", 0, 1, c)
        # A copy, not a hard link: LMDB refuses to open one file (inode) twice in a process.
        shutil.copyfile(first, dest / name)
        entries.append(ShardEntry(file=name, num_samples=entry.num_samples, bytes=entry.bytes, sha256=entry.sha256))
    index = one if copies == 1 else ShardIndex.concat([one] * copies)
    del one
    from fastload.storage.lmdb_backend import with_record_locations  # as the packer does (issue 16)

    index = with_record_locations(index, [(dest / e.file, e.num_samples) for e in entries])
    iname = index_name("")
    size, digest = write_index_file(dest / iname, index, pack_id=_SYNTH_PACK_ID)
    del index
    write_manifest(mpath, Manifest(
        backend="lmdb", payload="jpeg", num_samples=n * copies,
        classes=tuple(f"n{c:04d}" for c in range(_SYNTH_CLASSES)), shards=tuple(entries),
        source_count=n * copies, source="/synthetic", index=ShardEntry(file=iname, num_samples=n * copies,
                                                                        bytes=size, sha256=digest),
        pack_id=_SYNTH_PACK_ID,
    ))
    return dest


# Runs in a fresh interpreter per measurement, so nothing else this script did is counted.
_OPEN_PROBE = r"""
import json, sys, time
import numpy as np
import fastload
from fastload.data.dataset import ImageFolder

def mem():
    d = dict(l.split(":", 1) for l in open("/proc/self/status").read().splitlines() if ":" in l)
    return {k: int(d[k].split()[0]) / 1024 for k in ("VmRSS", "RssAnon", "RssFile")}

before = mem()
t0 = time.perf_counter()
ds = ImageFolder(sys.argv[1])
t_open = time.perf_counter() - t0
opened = mem()
int(np.asarray(ds.targets).sum()); int(ds._shapes[:, 0].sum()); ds.path(len(ds) - 1)
touched = mem()
ds[len(ds) // 2]  # opens a shard: what that costs is the storage's, not the index's
read = mem()
print(json.dumps({"n": len(ds), "open_s": t_open, "before": before, "opened": opened, "touched": touched,
                  "read": read}))
"""

_WORKER_PROBE = r"""
import functools, json, os, sys, time
from pathlib import Path
import numpy as np
import torch
from fastload.data.dataset import ImageFolder
from fastload.transforms import CenterCrop

def status(pid):
    d = dict(l.split(":", 1) for l in open(f"/proc/{pid}/status").read().splitlines() if ":" in l)
    r = dict(l.split(":", 1) for l in open(f"/proc/{pid}/smaps_rollup").read().splitlines()[1:] if ":" in l)
    kb = lambda v: int(v.split()[0]) / 1024
    return {"rss": kb(d["VmRSS"]), "anon": kb(d["RssAnon"]), "file": kb(d["RssFile"]),
            "private": kb(r["Private_Clean"]) + kb(r["Private_Dirty"]), "private_dirty": kb(r["Private_Dirty"]),
            "pss": kb(r["Pss"])}

def touch(out, worker_id):  # what a whole epoch reads of the index in a worker: every label and shape
    ds = torch.utils.data.get_worker_info().dataset
    int(np.asarray(ds.targets).sum()); int(ds._shapes[:, 0].sum())
    Path(out, f"w{worker_id}").write_text(str(os.getpid()))

if __name__ == "__main__":
    pack, method, out = sys.argv[1:4]
    ds = ImageFolder(pack, CenterCrop(8))
    int(np.asarray(ds.targets).sum())  # the parent touched them too (a sampler, targets for a split)
    loader = torch.utils.data.DataLoader(ds, batch_size=64, shuffle=True, num_workers=2,
                                         multiprocessing_context=method,
                                         worker_init_fn=functools.partial(touch, out))
    it = iter(loader)
    for _ in range(20):
        next(it)
    pids = [int(p.read_text()) for p in sorted(Path(out).glob("w*"))]
    print(json.dumps({"n": len(ds), "workers": [status(p) for p in pids], "parent": status(os.getpid())}))
    del it
"""


def _probe(code: str, *argv: str) -> dict:
    """Run ``code`` as a script file (spawned workers re-import their parent's main module) in a
    fresh interpreter; its last output line is JSON."""
    import json
    import os
    import subprocess

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    with tempfile.TemporaryDirectory() as d:
        script = Path(d) / "probe.py"
        script.write_text(code)
        out = subprocess.run([sys.executable, str(script), *argv], capture_output=True, text=True, env=env,
                             timeout=900)
    if out.returncode:
        raise RuntimeError(f"probe failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _peak_rss_mb(*cmd: str) -> tuple[float, str]:
    """Peak RSS (MB) of ``python -m fastload cmd`` run in a fresh process, and its last output line."""
    code = ("import resource, subprocess, sys; p = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
            "print((p.stdout + p.stderr).strip().splitlines()[-1][:200]); "
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    import os
    import subprocess

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}

    p = subprocess.run([sys.executable, "-c", code, sys.executable, "-m", "fastload", *cmd], capture_output=True,
                       text=True, env=env, timeout=1800)
    last, peak = p.stdout.strip().splitlines()[-2:]
    return int(peak) / 1024, last


def section_index(args) -> str:
    import shutil
    import tempfile as tf

    sizes = [int(float(s)) for s in args.index_sizes.split(",")]
    per_shard = int(float(args.index_shard_records))
    work = Path(args.workdir) if args.workdir else Path(tf.mkdtemp(prefix="bench_scale_index_"))
    open_rows, worker_rows, cli_rows = [], [], []
    anon: dict[tuple[int, str], float] = {}  # (N, start method) -> largest worker RssAnon (MB)
    touched, first_read, inspect_peak = {}, {}, {}
    made = []
    try:
        for n in sizes:
            copies = max(1, n // per_shard)
            dest = work / f"index-pack-{n}"
            print(f"  synthesising a pack of {n:,} records ({copies} x {min(n, per_shard):,}) ...", flush=True)
            t0 = time.perf_counter()
            synth_pack(dest, min(n, per_shard), copies=copies)
            made.append(dest)
            print(f"  ... {time.perf_counter() - t0:.0f} s", flush=True)
            o = _probe(_OPEN_PROBE, str(dest))
            open_rows.append([f"{o['n']:,}", o["open_s"] * 1e3,
                              o["opened"]["VmRSS"] - o["before"]["VmRSS"], o["opened"]["RssAnon"] - o["before"]["RssAnon"],
                              o["touched"]["VmRSS"] - o["before"]["VmRSS"], o["touched"]["RssAnon"] - o["before"]["RssAnon"],
                              o["read"]["RssAnon"] - o["touched"]["RssAnon"]])
            for method in ("fork", "spawn"):
                with tf.TemporaryDirectory() as out:
                    w = _probe(_WORKER_PROBE, str(dest), method, out)
                for k, s in enumerate(w["workers"]):
                    worker_rows.append([f"{w['n']:,}", method, k, s["private"], s["private_dirty"], s["anon"], s["file"],
                                        s["pss"]])
                anon[(n, method)] = max(s["anon"] for s in w["workers"])
            touched[n] = o["touched"]["RssAnon"] - o["before"]["RssAnon"]
            first_read[n] = o["read"]["RssAnon"] - o["touched"]["RssAnon"]
            print(f"  inspect / verify {n:,} ...", flush=True)
            peak, line = _peak_rss_mb("inspect", str(dest))
            inspect_peak[n] = peak
            cli_rows.append([f"{n:,}", "inspect", peak, line])
            if n <= int(float(args.index_verify_max)):
                peak, line = _peak_rss_mb("verify", str(dest))
                cli_rows.append([f"{n:,}", "verify", peak, line])
    finally:
        if not args.index_keep:
            for d in made:
                shutil.rmtree(d, ignore_errors=True)
    lo, hi = min(sizes), max(sizes)
    summary = (
        f"**At N = {hi:,}:** the index adds {touched[hi]:.1f} MB of private memory (RssAnon) to a process that "
        f"opened the dataset and touched every label, shape and a path ({touched[lo]:.1f} MB at {lo:,}). A "
        f"DataLoader worker's RssAnon is {anon[(hi, 'fork')] - anon[(lo, 'fork')]:+.0f} MB (fork) and "
        f"{anon[(hi, 'spawn')] - anon[(lo, 'spawn')]:+.0f} MB (spawn) over its {lo:,}-record baseline, of which "
        f"opening a shard of {min(hi, per_shard):,} records accounts for {first_read[hi]:.0f} MB per shard "
        f"(storage, not the index). `fastload inspect` peaks at {inspect_peak[hi]:.0f} MB RSS (target: under 1 GB; "
        "most of it is the mapped shapes section, shared page cache).\n\n"
    )
    return (
        summary
        + "Synthetic LMDB packs of tiny JPEGs (8..20 px, 1000 classes): one shard written through the storage "
        f"writer, copied ({per_shard:,} records per shard) up to N, with the index file and manifest the "
        "packer writes; `fastload verify` passes on them. Each figure comes from a fresh process. RSS counts "
        "the index file's pages once they are touched (file-backed, shared by every process on the node and "
        "dropped by the kernel under pressure); RssAnon is private heap: what grew with N before issue 16.\n\n"
        "ImageFolder open (MB added to a process that imported fastload; \"touched\": after reading every label, "
        "every shape and one path; \"first record\": RssAnon the first read adds, opening its shard):\n\n"
        + table(["N", "open (ms)", "RSS added", "RssAnon added", "RSS, all touched", "RssAnon, all touched",
                 "RssAnon, first record"], open_rows)
        + "\n\nDataLoader workers (torch, 2 workers, each touched every label and shape in worker_init_fn, "
        "then 20 batches of 64 with CenterCrop(8)); per worker, MB. private = Private_Clean + Private_Dirty "
        "(smaps_rollup: pages no other process maps), anon = RssAnon, file = RssFile. The 10k rows are a "
        "worker's own baseline (interpreter, torch; a spawned worker imports everything again); what N adds "
        "is the difference, and the open table's \"first record\" column says how much of it opening shards "
        "costs:\n\n"
        + table(["N", "start", "worker", "private", "private dirty", "anon", "file", "PSS"], worker_rows)
        + "\n\nCLI peak RSS (MB, getrusage of a fresh process):\n\n"
        + table(["N", "command", "peak RSS (MB)", "output (last line)"], cli_rows)
        + "\n"
    )


# ---------------------------------------------------------------------------- pack section (issue 16)

_SCAN_PROBE = r"""
import json, sys, time
from fastload.scan import list_source

def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024

part, parts = map(int, sys.argv[2].split("/"))
base = hwm()
t0 = time.perf_counter()
listing = list_source(sys.argv[1], part=part, parts=parts)
print(json.dumps({"seconds": time.perf_counter() - t0, "n": len(listing), "total": listing.total,
                  "peak_mb": hwm(), "base_mb": base}))
"""


def _tiny_jpegs(folder: Path, count: int = 4) -> list[Path]:
    """Distinct 8x8 JPEGs: the sources the many names link to."""
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for k in range(count):
        arr = ((np.arange(8 * 8 * 3).reshape(8, 8, 3) * (k + 3) + k) % 256).astype(np.uint8)
        p = folder / f"src{k}.jpg"
        Image.fromarray(arr).save(p, quality=90)
        out.append(p)
    return out


def _linked_tree(root: Path, n: int, classes: int) -> Path:
    """An ImageFolder tree of ``n`` names (``classes`` folders), each a hard link to one of a
    few tiny JPEGs: a million-file listing costs its directory entries, not a million images."""
    import os

    done = root / ".complete"
    if done.exists():
        return root
    # a filesystem caps the links to one inode (ext4: 65,000): at most 30,000 names per JPEG
    srcs = [os.fspath(p) for p in _tiny_jpegs(root.parent / "tiny", count=max(4, -(-n // 30_000)))]
    per = -(-n // classes)
    made = 0
    for c in range(classes):
        d = root / f"class{c:05d}"
        d.mkdir(parents=True, exist_ok=True)
        ds = os.fspath(d)
        for i in range(min(per, n - made)):
            try:
                os.link(srcs[(c + i) % len(srcs)], f"{ds}/img{i:07d}.jpg")
            except FileExistsError:
                pass
        made += min(per, n - made)
    done.touch()
    return root


def _big_csv(path: Path, rows: int, classes: int) -> Path:
    """A CSV of ``rows`` path,label rows pointing at a few real tiny JPEGs, repeated."""
    if path.exists():
        return path
    names = [f"tiny/{p.name}" for p in _tiny_jpegs(path.parent / "tiny")]
    tmp = path.with_suffix(".tmp")
    step = 100_000
    with open(tmp, "w") as f:
        f.write("path,label\n")
        for lo in range(0, rows, step):
            f.write("".join(f"{names[i % len(names)]},label{i % classes:04d}\n" for i in range(lo, min(rows, lo + step))))
    tmp.replace(path)
    return path


def _proc_kb(pid: int, field: str) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _pack_probe(src: Path, dest: Path, *extra: str, full: bool = False, shard_size: str = "1M") -> dict:
    """Run ``fastload pack`` in a fresh process and watch DEST: the time its first record
    reaches the shard writer (the shard's temporary file appears: the writer is opened for the
    first record), the time its first shard is finished (the journal lists it), and the main
    process's peak RSS (VmHWM) by then. Unless ``full``, the run is then stopped with Ctrl-C
    (SIGINT), as a user would stop it."""
    import json
    import os
    import shutil
    import signal
    import subprocess

    shutil.rmtree(dest, ignore_errors=True)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    cmd = [sys.executable, "-m", "fastload", "pack", str(src), str(dest), "-q", "--shard-size", shard_size, *extra]
    t0 = time.perf_counter()
    # a benchmark started in the background inherits SIGINT ignored; the pack must get Ctrl-C
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    first = shard = None
    hwm = 0
    try:
        while p.poll() is None:
            hwm = max(hwm, _proc_kb(p.pid, "VmHWM"))
            try:
                names = os.listdir(dest)
            except OSError:
                names = []
            now = time.perf_counter() - t0
            if first is None and any("shard-" in n and n.endswith(".tmp") for n in names):
                first = now
            if shard is None and first is not None:
                for n in names:
                    if n.startswith(".fastload-pack") and n.endswith(".json"):
                        try:
                            if json.loads((dest / n).read_text()).get("shards"):
                                shard = now
                        except (OSError, ValueError):
                            pass
            if shard is not None and not full:
                p.send_signal(signal.SIGINT)
                break
            time.sleep(0.01)
        out, _ = p.communicate(timeout=600)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    total = time.perf_counter() - t0
    return {"first": first, "shard": shard, "hwm_mb": hwm / 1024, "total": total, "rc": p.returncode,
            "last": (out or "").strip().splitlines()[-1][:160] if (out or "").strip() else ""}


def section_pack(args) -> str:
    """Issue 16, pack part: time to the first packed record and peak RSS of the pack at scale."""
    import shutil
    import tempfile as tf

    files = int(float(args.pack_files))
    rows = int(float(args.pack_csv_rows))
    parts = args.pack_parts
    work = Path(args.workdir) / "pack-scale" if args.workdir else Path(tf.mkdtemp(prefix="bench_scale_pack_"))
    work.mkdir(parents=True, exist_ok=True)
    scan_rows, pack_rows, inspect_rows = [], [], []
    try:
        t0 = time.perf_counter()
        tree = _linked_tree(work / "tree", files, classes=1000)
        print(f"  tree of {files:,} linked files: {time.perf_counter() - t0:.0f} s", flush=True)
        t0 = time.perf_counter()
        csv = _big_csv(work / "list.csv", rows, classes=1000)
        print(f"  CSV of {rows:,} rows: {time.perf_counter() - t0:.0f} s", flush=True)
        cases = [(f"ImageFolder, {files:,} files", tree), (f"CSV, {rows:,} rows", csv)]
        for label, src in cases:
            for part in ("0/1", f"0/{parts}"):
                s = _probe(_SCAN_PROBE, str(src), part)
                scan_rows.append([label, part, f"{s['n']:,}", s["seconds"], s["peak_mb"]])
                print(f"  scan {label} {part}: {s}", flush=True)
                extra = [] if part == "0/1" else ["--part", part]
                r = _pack_probe(src, work / "dest", *extra)
                pack_rows.append([label, part, r["first"], r["shard"], r["hwm_mb"]])
                print(f"  pack {label} {part}: {r}", flush=True)
        if args.pack_full:
            dest = work / "full"
            print(f"  full pack of the {files:,}-file tree ...", flush=True)
            r = _pack_probe(tree, dest, full=True, shard_size="64M")
            pack_rows.append([f"ImageFolder, {files:,} files, whole pack", "0/1", r["first"], r["shard"], r["hwm_mb"]])
            print(f"  {r}", flush=True)
            if r["rc"] == 0:
                peak, line = _peak_rss_mb("inspect", str(dest))
                inspect_rows.append([f"{files:,}", peak, line])
    finally:
        if not args.pack_keep:
            shutil.rmtree(work, ignore_errors=True)
    body = (
        f"Sources: an ImageFolder tree of {files:,} names in 1000 class folders, every name a hard link to one "
        f"of a few dozen 8x8 JPEGs, and a CSV of {rows:,} rows (1000 labels) naming four of them over and over. "
        "Each figure is a fresh process. \"scan\": `fastload.scan.list_source` alone (seconds, and the process's "
        "peak RSS in MB, interpreter and numpy included). \"pack\": `fastload pack SRC DEST --shard-size 1M` "
        "with the default workers, watched from outside: *first record* is when the first encoded record "
        "reaches the shard writer (its temporary shard file appears), *first shard* when the journal lists a "
        "finished shard; the run is then stopped with Ctrl-C. Peak RSS is the pack's main process (VmHWM); "
        "the workers fork after the scan and share its pages. Times on a shared 2-core machine with other jobs "
        "running are noisy (seconds); memory figures are stable. A part (`--part 0/N`) of a CSV streams the "
        "file twice and keeps only its rows; a part of a tree lists every name and keeps its share. The "
        "whole-pack row runs to the end with `--shard-size 64M`; its peak RSS is the whole run's, higher than at "
        f"the first shard by what the run accumulates (per-input stamps, the {files:,}-entry index written at "
        "the end) "
        "and the pages of the LMDB shard being written that its memory map touches (not broken down here).\n\n"
        "Scan:\n\n"
        + table(["source", "part", "inputs listed", "seconds", "peak RSS (MB)"], scan_rows)
        + "\n\nPack (targets: first image within 5 s at 1M files; peak RSS under 1 GB for a 10M-row CSV):\n\n"
        + table(["source", "part", "first record (s)", "first shard (s)", "peak RSS (MB)"], pack_rows)
        + "\n"
    )
    if inspect_rows:
        body += ("\n`fastload inspect` of the whole pack (peak RSS, MB, getrusage of a fresh process):\n\n"
                 + table(["N", "peak RSS (MB)", "output (last line)"], inspect_rows) + "\n")
    return body


def _cell(c: object, *, ratio: bool = False) -> str:
    if c is None:
        return "-"
    if not isinstance(c, float):
        return str(c)
    if ratio:
        return f"{c:,.1f}x"
    return f"{c:,.0f}" if c >= 100 else f"{c:.3g}"


SECTIONS: dict[str, Callable[[argparse.Namespace], str]] = {"epoch": section_epoch, "index": section_index,
                                                         "pack": section_pack}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("epoch section")
    g.add_argument("--epoch-sizes", default="1e6,1e7,1e8", help="dataset sizes (default 1e6,1e7,1e8)")
    g.add_argument("--epoch-worlds", default="1,8", help="world sizes (default 1,8)")
    g.add_argument("--epoch-batch", type=int, default=256)
    g.add_argument("--epoch-old-max", default="1e8", help="largest N to run the old algorithm at (default 1e8)")
    g.add_argument("--epoch-indices-max", default="1.3e7", help="largest N/W for the plan.indices rows")
    g.add_argument("--epoch-pack-images", type=int, default=400, help="images of the real-pack run (0: skip)")
    g.add_argument("--epoch-pack-batch", type=int, default=32)
    g.add_argument("--epoch-block-shards", type=int, default=10_000, help="shards of the block-shuffle rows")
    g = ap.add_argument_group("index section")
    g.add_argument("--index-sizes", default="1e4,1e6,1e7", help="pack sizes (default 1e4,1e6,1e7)")
    g.add_argument("--index-shard-records", default="1e6", help="records per synthetic shard (copies make up N)")
    g.add_argument("--index-verify-max", default="1e7", help="largest N to run `fastload verify` on")
    g.add_argument("--index-keep", action="store_true", help="keep the synthetic packs in --workdir")
    g = ap.add_argument_group("pack section")
    g.add_argument("--pack-files", default="1e6", help="files of the linked ImageFolder tree (default 1e6)")
    g.add_argument("--pack-csv-rows", default="1e7", help="rows of the CSV source (default 1e7)")
    g.add_argument("--pack-parts", type=int, default=8, help="N of the --part 0/N rows (default 8)")
    g.add_argument("--pack-full", action="store_true", help="also pack the whole tree and inspect it")
    g.add_argument("--pack-keep", action="store_true", help="keep the tree, CSV and packs in --workdir")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {', '.join(SECTIONS)}")
    ap.add_argument("--workdir", type=Path, default=None, help="where generated data goes (default: a temp dir)")
    ap.add_argument("--no-write", action="store_true", help="print only; do not update RESULTS.md")
    add_arguments(ap)
    args = ap.parse_args(argv)
    names = [s for s in args.sections.split(",") if s]
    unknown = [s for s in names if s not in SECTIONS]
    if unknown:
        ap.error(f"unknown section(s) {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
    for name in names:
        print(f"section {name} ...", flush=True)
        t0 = time.perf_counter()
        body = SECTIONS[name](args)
        print(body)
        print(f"section {name}: {time.perf_counter() - t0:.0f} s", flush=True)
        if not args.no_write:
            write_section(f"bench_scale_{name}", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
