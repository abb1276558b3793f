"""``fastload verify DEST``: recompute shard checksums, check the index, optionally decode all."""

from __future__ import annotations

import sys
from pathlib import Path

from . import add_remote_args, remote_kwargs

import numpy as np

_MAX_LINES = 50


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "verify", help="check a packed dataset's checksums (and decode every record)",
        description="Recompute every shard's SHA-256 and check the index; --decode also decodes "
        "every record. Exit 0 if all is well, 1 with one line per problem otherwise.",
    )
    p.add_argument("dest", metavar="DEST", help="packed dataset directory")
    p.add_argument("--decode", action="store_true", help="decode every record with the pack's codec")
    add_remote_args(p)
    p.set_defaults(run=run)


def verify_pack(dest: str | Path, *, decode: bool = False, **remote) -> tuple[list[str], int]:
    """Problems found in the pack at ``dest`` (empty = healthy) and the number of records.
    A URL ``dest`` (``remote``: its store options) streams every shard and checks its SHA-256."""
    from ..codecs import get_codec
    from ..errors import FastloadError
    from ..storage import open_pack
    from ..storage.remote import is_url

    if is_url(dest):
        return _verify_remote(str(dest), decode=decode, **remote)

    r = open_pack(dest, check_files=False)
    problems: list[str] = []
    bad: set[str] = set()
    for s in r.shard_entries:
        p = r.root / s.file
        if not p.exists():
            problems.append(f"{p}: shard missing")
            bad.add(s.file)
        elif p.stat().st_size != s.bytes:
            problems.append(f"{p}: size {p.stat().st_size} bytes, manifest says {s.bytes} (truncated or replaced)")
            bad.add(s.file)
    for msg in r.verify_checksums():
        name = Path(msg.split(": ", 1)[0]).name
        if name not in bad:  # a missing or wrong-sized shard is already reported: one line each
            problems.append(msg)
            bad.add(name)
    codec = get_codec(r.payload) if decode else None
    n_classes = len(r.classes)
    shard_indexes = []
    for k, s in enumerate(r.shard_entries):
        if s.file in bad:
            continue  # never parse a file whose bytes we know are wrong (LMDB trusts its pages)
        reader = r.shard_reader(k)
        where = r.root / s.file
        try:
            idx = reader.read_index()
        except FastloadError as exc:
            problems.append(str(exc))
            continue
        shard_indexes.append(idx)
        if len(idx) and (idx.labels.min() < 0 or idx.labels.max() >= n_classes):
            problems.append(f"{where}: labels outside 0..{n_classes - 1}")
        if len(idx) and (idx.shapes.min() < 1 or np.any(idx.shapes[:, 2] != 3)):
            problems.append(f"{where}: index holds impossible shapes (expected H, W >= 1 and 3 channels)")
        if r.image_shape is not None and len(idx) and np.any(idx.shapes != np.asarray(r.image_shape)):
            problems.append(f"{where}: record shapes differ from the manifest's image_shape {r.image_shape}")
        if codec is None:
            continue
        try:
            for i, buf in enumerate(reader.iter_payloads()):
                shape = tuple(int(v) for v in idx.shapes[i])
                try:
                    img = codec.decode(buf, shape=shape)
                except (FastloadError, ValueError) as exc:
                    problems.append(f"{where}: record {i} ({idx.paths[i]}): does not decode: {exc}")
                    continue
                if tuple(img.shape) != shape:
                    problems.append(f"{where}: record {i} ({idx.paths[i]}): decodes to {img.shape}, index says {shape}")
        except FastloadError as exc:
            problems.append(str(exc))
    if r.index_entries and not bad and len(shard_indexes) == len(r.shard_entries):
        problems += _index_files_match(r, shard_indexes)
    r.close()
    return problems, len(r)


def _verify_remote(url: str, *, decode: bool, **remote) -> tuple[list[str], int]:
    """Stream every shard of the pack at ``url`` through SHA-256 (into a temporary file that is
    removed at once; the index files were checked when the pack was opened)."""
    import tempfile

    from ..errors import FastloadError
    from ..storage import open_pack

    if decode:
        raise ValueError(f"{url}: --decode is for local packs; verify the checksums here, or decode a local copy")
    r = open_pack(url, **remote)
    problems = []
    with tempfile.TemporaryDirectory(prefix="fastload-verify-", dir=r.remote.cache.directory) as tmp:
        for e in r.shard_entries:
            dest = Path(tmp) / "shard"
            try:
                r.remote.store.download(e.file, dest, size=e.bytes, sha256=e.sha256)
            except FastloadError as exc:
                problems.append(str(exc))
            finally:
                dest.unlink(missing_ok=True)
    return problems, len(r)


def _index_files_match(r, shard_indexes) -> list[str]:
    """The parts' index files hold exactly what the shards' own indexes say (compared as arrays)."""
    from ..errors import FastloadError
    from ..storage import ShardIndex

    try:
        files = r.index
    except FastloadError as exc:
        return [str(exc)]
    shards = ShardIndex.concat(shard_indexes)
    same = (np.array_equal(files.labels, shards.labels) and np.array_equal(files.shapes, shards.shapes)
            and np.array_equal(files.paths.offsets, shards.paths.offsets)
            and np.array_equal(files.paths.blob, shards.paths.blob))
    if same:
        return []
    names = ", ".join(str(r.root / e.file) for e in r.index_entries)
    return [f"{names}: index file does not match the shards' records (rebuilt or replaced?); repack"]


def run(args) -> int:
    problems, n = verify_pack(args.dest, decode=args.decode, **remote_kwargs(args))
    if problems:
        for msg in problems[:_MAX_LINES]:
            print(f"fastload verify: {msg}", file=sys.stderr)
        if len(problems) > _MAX_LINES:
            print(f"fastload verify: ... and {len(problems) - _MAX_LINES} more problems", file=sys.stderr)
        print(f"FAILED: {args.dest}: {len(problems)} problem{'s' if len(problems) != 1 else ''}", file=sys.stderr)
        return 1
    what = "checksums and index match" + (", every record decodes" if args.decode else "")
    print(f"OK: {args.dest}: {n} records, {what}")
    return 0
