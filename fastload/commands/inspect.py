"""``fastload inspect DEST``: what a packed directory holds (format, samples, classes, shards)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from . import add_remote_args, location, remote_kwargs

_SHOW = 5


def register(subparsers) -> None:
    p = subparsers.add_parser("inspect", help="summarise a packed dataset",
                              description="Print a packed dataset's format, samples, classes, shards and skipped inputs.")
    p.add_argument("dest", type=location, metavar="DEST", help="packed dataset directory, or its s3://, gs://, az:// URL")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    add_remote_args(p)
    p.set_defaults(run=run)


def describe(dest: str | Path, *, skipped_limit: int | None = None, **remote) -> dict:
    """A JSON-able summary of a pack (every part together); ``remote``: options for a URL.
    ``skipped_limit``: list at most that many skipped inputs (``num_skipped`` counts them all).
    Memory stays small whatever the pack's size: no index is loaded (see :func:`shape_range_of`)."""
    from ..errors import FormatError
    from ..storage import open_pack
    from ..storage.remote import is_url

    try:
        r = open_pack(dest, check_files=False, **remote)
    except FormatError as exc:
        hint = "" if is_url(dest) else unfinished_hint(Path(dest))
        raise FormatError(f"{exc}{hint}") from None
    sizes = [s.bytes for s in r.shard_entries]
    shape = r.image_shape
    shape_range = None
    if shape is None and len(r):
        try:
            shape_range = shape_range_of(r)
        except Exception:  # a damaged shard: inspect still shows the manifest (verify explains)
            shape_range = None
    skipped = r.skipped if skipped_limit is None else r.skipped[:skipped_limit]
    num_skipped = sum(len(m.skipped) for m in r.manifests)
    try:
        checksums = r.has_checksums
    except FormatError:  # a damaged index: inspect still shows the manifest (verify explains)
        checksums = None
    return {
        "dest": str(dest),
        "format": r.manifests[0].format,
        "version": r.manifests[0].version,
        "backend": r.backend,
        "payload": r.payload,
        "num_samples": len(r),
        "source_count": r.manifests[0].source_count,
        "source": r.manifests[0].source or None,
        "parts": len(r.manifests),
        "num_classes": len(r.classes),
        "classes": list(r.classes),
        "num_shards": len(sizes),
        "bytes": sum(sizes),
        "shard_bytes": sizes,
        "image_shape": list(shape) if shape else None,
        "image_shape_range": shape_range,
        "options": r.options,
        "num_skipped": num_skipped,
        "skipped": [{"path": s.path, "reason": s.reason} for s in skipped],
        "record_checksums": checksums,
        "pack_ids": [m.pack_id for m in r.manifests],
    }


_CHUNK = 1 << 18  # records per step of shape_range_of: ~3 MB of shapes, whatever the pack's size


def shape_range_of(r, *, chunk: int = _CHUNK) -> list[list[int]] | None:
    """``[min (H, W, C), max (H, W, C)]`` over every record of pack reader ``r``, in constant
    memory: chunk by chunk over each part's memory-mapped index file (the labels and paths
    are never read), or shard by shard for packs made before index files."""
    from ..storage.pack_index import PackIndex

    lo = hi = None

    def take(block) -> None:
        nonlocal lo, hi
        if len(block):
            bmin, bmax = block.min(axis=0), block.max(axis=0)
            lo = bmin if lo is None else np.minimum(lo, bmin)
            hi = bmax if hi is None else np.maximum(hi, bmax)

    if r.index_entries and len(r.index_entries) == len(r.manifests):
        for m in r.manifests:
            shapes = PackIndex([(r.root / m.index.file, m.num_samples, m.pack_id)]).shapes
            for start in range(0, len(shapes), chunk):
                take(shapes[start : start + chunk])
    else:
        for k in range(len(r.shard_entries)):
            take(r.shard_reader(k).read_index().shapes)
    if lo is None:
        return None
    return [lo.tolist(), hi.tolist()]


def unfinished_hint(dest: Path) -> str:
    """What to add to "no manifest" when DEST holds an interrupted pack (inspect and verify say it)."""
    if dest.is_dir() and any(p.name.startswith(".fastload-pack") for p in dest.iterdir()):
        return "; an interrupted pack is there: rerun the same `fastload pack` command to resume it"
    return ""


def run(args) -> int:
    from ..pack import human_bytes

    # Text shows the first few skipped inputs; only --json lists them all.
    d = describe(args.dest, skipped_limit=None if args.json else _SHOW, **remote_kwargs(args))
    if args.json:
        print(json.dumps(d, indent=1))
        return 0
    cls = d["classes"]
    more = f", ... (+{len(cls) - _SHOW})" if len(cls) > _SHOW else ""
    sizes = d["shard_bytes"]
    if d["image_shape"]:
        shape = "x".join(map(str, d["image_shape"])) + " (all records)"
    elif d["image_shape_range"]:
        lo, hi = d["image_shape_range"]
        shape = f"varies, {lo[0]}x{lo[1]} .. {hi[0]}x{hi[1]} (HxW)"
    else:
        shape = "varies"
    opts = " ".join(f"{k}={v}" for k, v in d["options"].items())
    lines = [
        f"{d['dest']}: {d['format']} pack, version {d['version']}",
        f"  format:      {d['backend']}",
        f"  payload:     {d['payload']}",
        f"  samples:     {d['num_samples']} (of {d['source_count']} source inputs"
        + (f", {d['parts']} parts" if d["parts"] > 1 else "") + ")",
        f"  source:      {d['source'] or 'not recorded'}",
        f"  classes:     {d['num_classes']}: {', '.join(cls[:_SHOW])}{more}",
        f"  shards:      {d['num_shards']}, {human_bytes(d['bytes'])} total"
        + (f" (smallest {human_bytes(min(sizes))}, largest {human_bytes(max(sizes))})" if sizes else ""),
        f"  image shape: {shape}",
        f"  options:     {opts}",
        f"  skipped:     {d['num_skipped']}",
        "  integrity:   " + ("record checksums checked on every read" if d["record_checksums"]
                             else "no record checksums: packed by an older fastload; repack to get read-time checks"
                             if d["record_checksums"] is False else "index unreadable (run `fastload verify`)"),
    ]
    lines += [f"    {s['path']}: {s['reason']}" for s in d["skipped"][:_SHOW]]
    if d["num_skipped"] > _SHOW:
        lines.append(f"    ... and {d['num_skipped'] - _SHOW} more (see manifest)")
    print("\n".join(lines))
    return 0
