"""``fastload inspect DEST``: what a packed directory holds (format, samples, classes, shards)."""

from __future__ import annotations

import json
from pathlib import Path

from . import add_remote_args, remote_kwargs

_SHOW = 5


def register(subparsers) -> None:
    p = subparsers.add_parser("inspect", help="summarise a packed dataset",
                              description="Print a packed dataset's format, samples, classes, shards and skipped inputs.")
    p.add_argument("dest", metavar="DEST", help="packed dataset directory")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    add_remote_args(p)
    p.set_defaults(run=run)


def describe(dest: str | Path, **remote) -> dict:
    """A JSON-able summary of a pack (every part together); ``remote``: options for a URL."""
    from ..errors import FormatError
    from ..storage import open_pack
    from ..storage.remote import is_url

    try:
        r = open_pack(dest, check_files=False, **remote)
    except FormatError as exc:
        hint = "" if is_url(dest) else _unfinished_hint(Path(dest))
        raise FormatError(f"{exc}{hint}") from None
    sizes = [s.bytes for s in r.shard_entries]
    shape = r.image_shape
    shape_range = None
    if shape is None and len(r):
        try:
            shapes = r.index.shapes
            shape_range = [shapes.min(axis=0).tolist(), shapes.max(axis=0).tolist()]
        except Exception:  # a damaged shard: inspect still shows the manifest (verify explains)
            shape_range = None
    skipped = r.skipped
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
        "num_skipped": len(skipped),
        "skipped": [{"path": s.path, "reason": s.reason} for s in skipped],
    }


def _unfinished_hint(dest: Path) -> str:
    if dest.is_dir() and any(p.name.startswith(".fastload-pack") for p in dest.iterdir()):
        return "; an interrupted pack is there: rerun the same `fastload pack` command to resume it"
    return ""


def run(args) -> int:
    from ..pack import human_bytes

    d = describe(args.dest, **remote_kwargs(args))
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
    ]
    lines += [f"    {s['path']}: {s['reason']}" for s in d["skipped"][:_SHOW]]
    if d["num_skipped"] > _SHOW:
        lines.append(f"    ... and {d['num_skipped'] - _SHOW} more (see manifest)")
    print("\n".join(lines))
    return 0
