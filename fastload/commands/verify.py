"""``fastload verify DEST``: recompute shard checksums, check the index, optionally decode all."""

from __future__ import annotations

import sys
from pathlib import Path

from . import add_remote_args, location, remote_kwargs

import numpy as np

_MAX_LINES = 50


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "verify", help="check a packed dataset's checksums (and decode every record)",
        description="Recompute every shard's SHA-256 and check the index; --decode also decodes "
        "every record. Exit 0 if all is well, 1 with one line per problem otherwise.",
    )
    p.add_argument("dest", type=location, metavar="DEST", help="packed dataset directory, or its s3://, gs://, az:// URL")
    p.add_argument("--decode", action="store_true", help="decode every record with the pack's codec")
    add_remote_args(p)
    p.set_defaults(run=run)


def verify_pack(dest: str | Path, *, decode: bool = False, notes: list[str] | None = None,
                **remote) -> tuple[list[str], int]:
    """Problems found in the pack at ``dest`` (empty = healthy) and the number of records.
    A URL ``dest`` (``remote``: its store options) streams every shard and checks its SHA-256.

    Local packs: sizes and SHA-256 of every file, each shard's pack id, labels inside the class
    list, shapes, every record against its checksum (streamed), the index files against the
    shards, one shard at a time (memory does not grow with the number of records); the
    manifest's own rules (its checksum, no shard listed twice, plain file names) hold on open.
    ``notes`` collects what is not a problem but worth saying (a pack without checksums)."""
    from ..codecs import get_codec
    from ..storage.base import check_labels, record_checksum
    from ..errors import FastloadError, FormatError
    from ..image import shape_problem
    from ..storage import open_pack
    from ..storage.remote import is_url

    if is_url(dest):
        return _verify_remote(str(dest), decode=decode, **remote)

    try:
        r = open_pack(dest, check_files=False)
    except FormatError as exc:
        from .inspect import unfinished_hint

        raise FormatError(f"{exc}{unfinished_hint(Path(dest))}") from None
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
    ids = [m.pack_id for m in r.manifests for _ in m.shards]
    # Constant memory in the number of records: each shard's own index is read, compared with
    # its slice of its part's index file (whose touched pages are then dropped from the map),
    # its records streamed, and then dropped. Nothing of size N is kept.
    parts = _IndexParts(r, bad) if r.index_entries else None
    if parts is not None:
        problems += parts.problems
    old_noted = False
    for k, s in enumerate(r.shard_entries):
        if s.file in bad:
            continue  # never parse a file whose bytes we know are wrong (LMDB trusts its pages)
        reader = r.shard_reader(k)
        where = r.root / s.file
        try:
            idx = reader.read_index()
        except FastloadError as exc:
            problems.append(str(exc))
            _done(reader)
            continue
        try:
            check_labels(idx.labels, n_classes, where=str(where))
        except FastloadError as exc:
            problems.append(str(exc))
        if ids[k] is not None and len(idx):
            try:
                reader.get(0)  # the first open checks the shard's pack id against the manifest's
            except FastloadError as exc:
                problems.append(str(exc))  # another pack's shard: its records say nothing more
                idx = None
                _done(reader)
                continue
        if parts is not None:
            problems += parts.compare(k, idx)
        if len(idx) and (idx.shapes.min() < 1 or np.any(idx.shapes[:, 2] != 3)):
            problems.append(f"{where}: index holds impossible shapes (expected H, W >= 1 and 3 channels)")
        if r.image_shape is not None and len(idx) and np.any(idx.shapes != np.asarray(r.image_shape)):
            problems.append(f"{where}: record shapes differ from the manifest's image_shape {r.image_shape}")
        sums = idx.checksums
        if sums is None and not old_noted:
            old_noted = True
            if notes is not None:
                notes.append(f"{r.root}: no record checksums: packed by an older fastload; repack to get read-time checks")
        if codec is None and sums is None:
            idx = sums = None  # before the next shard's index is read: one shard's worth at a time
            _done(reader)
            continue
        try:
            for i, buf in enumerate(reader.iter_payloads()):  # streamed: one record in memory at a time
                shape = tuple(int(v) for v in idx.shapes[i])
                if sums is not None and record_checksum(buf, label=idx.labels[i], record=i, shape=shape) != int(sums[i]):
                    problems.append(f"{where}: record {i} ({idx.paths[i]}): checksum mismatch (its bytes, "
                                    "label or shape are damaged)")
                    continue
                if codec is None:
                    continue
                try:
                    img = codec.decode(buf, shape=shape)
                except (FastloadError, ValueError) as exc:
                    problems.append(f"{where}: record {i} ({idx.paths[i]}): does not decode: {exc}")
                    continue
                # the rule every reader applies (fastload.image.shape_problem); an original JPEG
                # decodes turned by its EXIF orientation, as the readers turn it
                mismatch = shape_problem(img.shape, shape)
                if mismatch is not None:
                    problems.append(f"{where}: record {i} ({idx.paths[i]}): {mismatch.split(': run ')[0]}")
        except FastloadError as exc:
            problems.append(str(exc))
        idx = sums = buf = None  # before the next shard's index is read: one shard's worth at a time
        _done(reader)
    r.close()
    return problems, len(r)


class _IndexParts:
    """The parts' index files, checked shard by shard against the shards' own indexes: after
    each comparison the pages it touched are dropped from the map (a file-backed page that
    was touched counts in RSS while it stays mapped), so checking N records holds one shard's
    worth of index at a time."""

    def __init__(self, r, bad: set[str]) -> None:
        from ..errors import FastloadError
        from ..storage.pack_index import PackIndex

        self.r = r
        self.problems: list[str] = []
        self.index = PackIndex([(r.root / (m.index.file if m.index else ""), m.num_samples, m.pack_id)
                                for m in r.manifests])
        self.skip: set[int] = set()  # parts already reported (unreadable or not matching): one line each
        self.damaged: set[int] = set()
        self._parts: dict = {}  # part -> its ShardIndex (maps of its file, parsed and checked once)
        for m, mf in enumerate(r.manifests):
            if mf.index is None:
                self.skip.add(m)  # a part packed before index files: nothing to compare
                continue
            if mf.index.file in bad:
                self.damaged.add(m)  # its SHA-256 is wrong (reported): say what else, but not "differs"
            try:
                self._parts[m] = self.index.part(m)  # header, section bounds, record count, pack id
                _drop_pages(self._parts[m])
            except FastloadError as exc:
                self.problems.append(str(exc))
                self.skip.add(m)
        self.part_of = [m for m, mf in enumerate(r.manifests) for _ in mf.shards]
        self.first = []  # shard k's first record inside its part
        for mf in r.manifests:
            at = 0
            for s in mf.shards:
                self.first.append(at)
                at += s.num_samples

    def compare(self, k: int, idx) -> list[str]:
        """Problems of shard ``k``'s slice of its part's index file against the shard's ``idx``."""
        from ..errors import FastloadError
        from ..storage.base import check_labels

        m = self.part_of[k]
        if m in self.skip:
            return []
        name = self.r.root / self.r.manifests[m].index.file
        lo = self.first[k]
        hi = lo + len(idx)
        try:
            part = self._parts.get(m) or self._parts.setdefault(m, self.index.part(m))
            labels, shapes = part.labels[lo:hi], part.shapes[lo:hi]
            check_labels(labels, len(self.r.classes), where=str(name), first=lo)
            o0, o1 = int(part.paths.offsets[lo]), int(part.paths.offsets[hi])
            same = (np.array_equal(labels, idx.labels) and np.array_equal(shapes, idx.shapes)
                    and np.array_equal(part.paths.offsets[lo : hi + 1] - o0, idx.paths.offsets)
                    and np.array_equal(part.paths.blob[o0:o1], idx.paths.blob)
                    and (part.checksums is None) == (idx.checksums is None)
                    and (part.checksums is None or np.array_equal(part.checksums[lo:hi], idx.checksums)))
        except FastloadError as exc:
            self.skip.add(m)
            return [str(exc)]
        except (ValueError, IndexError) as exc:  # bounds were checked at parse: belt and braces
            self.skip.add(m)
            return [f"{name}: damaged index file ({exc}); repack"]
        finally:
            labels = shapes = None
            _drop_pages(part)  # the pages this comparison touched leave the RSS (not the page cache)
        if same or m in self.damaged:
            return []
        self.skip.add(m)
        return [f"{name}: index file does not match the shards' records (rebuilt or replaced?); repack"]


def _drop_pages(index) -> None:
    """Drop the pages of an index file's map that this process touched (they stay in the page
    cache): verify walks the whole file, which would otherwise end up counted in its RSS."""
    import mmap

    base = getattr(index, "labels", None) if index is not None else None
    while base is not None and not isinstance(base, mmap.mmap):
        base = getattr(base, "base", None)
    advice = getattr(mmap, "MADV_DONTNEED", None)
    if base is not None and advice is not None and not base.closed:
        base.madvise(advice)


def _done(reader) -> None:
    """Close a shard verify is done with, and give the heap glibc keeps after its structure
    walk and index back to the system (the arrays are freed, but glibc holds freed memory
    below its raised mmap threshold: ~100 MB per 1M-record shard, measured)."""
    from ..storage.lmdb_backend import trim_heap

    reader.close()
    trim_heap()


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


def run(args) -> int:
    notes: list[str] = []
    problems, n = verify_pack(args.dest, decode=args.decode, notes=notes, **remote_kwargs(args))
    for note in notes:
        print(f"fastload verify: note: {note}")
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
