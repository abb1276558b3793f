"""Listing a pack source: an ImageFolder tree or a CSV/TSV file of ``path,label`` rows.

Only names are read here (no image is opened). A ``--part I/N`` job gets the listing of its
own contiguous range of the global order (:func:`part_bounds`) and every part agrees on the
class list. A CSV part keeps only its own rows: a first streaming pass counts the rows and
collects the labels, a second keeps the part's range, so its memory is its share. A folder
part lists every name (the count and the order need them) and keeps only its share.

Hostile trees are part of the contract. Names are kept as ``os.fsdecode`` strings
(surrogate-escaped where they are not UTF-8), so any POSIX name packs and comes back as the
same bytes. Directory links are followed like torchvision (``followlinks=True``), but no
directory (by device and inode) is walked twice: a link loop ends, and a second link to a
folder already scanned is listed as skipped instead of duplicating its images. Two links to
one *file* are two samples, as in torchvision. Every image-named entry that is not a
directory becomes a sample even when it is a FIFO, a device or a dangling link: the packer
opens it without blocking and skips it with a reason, so nothing is silently dropped.
"""

from __future__ import annotations

import csv
import heapq
import os
import re
from array import array
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import PackError
from .image import IMG_EXTENSIONS
from .schema import SkippedInput
from .storage.base import StringTable

__all__ = ["MAX_CLASSES", "SourceListing", "list_source", "part_bounds", "scan_source"]

#: Integer CSV labels must be below this: a typo such as 4000000000 must not allocate a
#: class table of that size. 2**20 classes is far above any real classification dataset.
MAX_CLASSES = 1 << 20

_PATH_HEADERS = {"path", "file", "filename", "filepath", "image", "img", "name"}
_LABEL_HEADERS = {"label", "class", "target", "category", "y"}
_INT_RE = re.compile(r"[+-]?[0-9]+")


@dataclass(frozen=True)
class SourceListing:
    """The samples of a source (or of one part of it) in pack order: ``base / relpaths[i]``
    has label ``labels[i]`` and is input ``start + i`` of the ``total`` inputs of the source.

    ``skipped`` lists what the scan itself could not turn into samples (an unreadable folder,
    a link to a folder already scanned, an image outside any class folder), with the reason.
    """

    base: Path  # folder the relative paths are resolved against
    classes: tuple[str, ...]
    relpaths: StringTable  # one blob + offsets: 10M paths cost their bytes, not 10M str objects
    labels: np.ndarray  # int64
    skipped: tuple[SkippedInput, ...] = ()
    start: int = 0  # global index of relpaths[0]
    total: int = -1  # inputs in the whole source (-1: this listing is the whole source)

    def __post_init__(self) -> None:
        if self.total < 0:
            object.__setattr__(self, "total", len(self.relpaths))

    def __len__(self) -> int:
        return len(self.relpaths)

    def resolve(self, relpath: str) -> Path:
        return self.base / relpath  # an absolute relpath (CSV) stays absolute

    def iter_relpaths(self, start: int, stop: int):
        """The relative paths of this listing's samples ``start..stop-1``, decoded one at a time."""
        return map(self.relpaths.__getitem__, range(start, stop))

    def slice(self, start: int, stop: int) -> SourceListing:
        """Samples ``start..stop-1`` of this (whole-source) listing as their own listing, with
        copies of just their bytes, so the rest can be freed."""
        off = self.relpaths.offsets
        lo, hi = int(off[start]), int(off[stop])
        table = StringTable(self.relpaths.blob[lo:hi].copy(), off[start : stop + 1] - lo)
        return SourceListing(self.base, self.classes, table, self.labels[start:stop].copy(), self.skipped,
                             start=self.start + start, total=self.total)


def part_bounds(part: int, parts: int, n: int) -> tuple[int, int]:
    """``[start, stop)`` of part ``part`` of ``parts`` over ``n`` inputs: equal contiguous
    ranges of the global order (sizes differ by at most one), so the parts concatenated in
    part order are the whole source in order, and any source splits into any number of parts."""
    return part * n // parts, (part + 1) * n // parts


class _PathsBuilder:
    """Appends paths straight into one bytearray (surrogate-escaped, like StringTable)."""

    def __init__(self) -> None:
        self.blob = bytearray()
        self.offsets = array("q", [0])

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def append(self, path: str) -> None:
        self.blob += path.encode("utf-8", "surrogateescape")
        self.offsets.append(len(self.blob))

    def table(self) -> StringTable:
        return StringTable(np.frombuffer(self.blob, dtype=np.uint8), np.frombuffer(self.offsets, dtype=np.int64))


def scan_source(source: str | Path) -> tuple[tuple[str, ...], list[str], np.ndarray]:
    """``(classes, relpaths, labels)`` of an ImageFolder directory or a CSV/TSV file.

    The order is torchvision ImageFolder's, so ``labels`` and sample order match what users
    of ``torchvision.datasets.ImageFolder`` already have.
    """
    listing = list_source(source)
    return listing.classes, list(listing.relpaths), listing.labels


def list_source(source: str | Path, *, part: int = 0, parts: int = 1) -> SourceListing:
    """The listing of part ``part`` of ``parts`` of ``source`` (the whole source by default;
    see the module docstring for what counts as a sample and what a part reads)."""
    if not 0 <= part < parts:
        raise ValueError(f"part must satisfy 0 <= part < parts, got {part}/{parts}")
    src = Path(source)
    if not src.exists():
        if src.is_symlink():
            raise PackError(f"{src}: source is a broken symbolic link")
        raise PackError(f"{src}: source does not exist")
    if src.is_dir():
        listing = _scan_image_folder(src)
        return listing if parts == 1 else listing.slice(*part_bounds(part, parts, len(listing)))
    if src.is_file():
        return _scan_csv(src, part, parts)
    raise PackError(f"{src}: source is neither a directory nor a CSV/TSV file")


def _stamp(path: Path) -> tuple[int, int]:
    try:
        st = os.stat(path)
    except OSError as exc:
        raise PackError(f"{path}: cannot read ({exc.strerror or exc})") from None
    return st.st_size, st.st_mtime_ns


def _is_image(name: str) -> bool:
    return name.lower().endswith(IMG_EXTENSIONS)


def _is_dir(entry: os.DirEntry) -> bool:
    try:
        return entry.is_dir()  # follows links, like torchvision's find_classes and os.walk
    except OSError:
        return False


def _scan_image_folder(root: Path) -> SourceListing:
    root_s = os.fspath(root)
    try:
        with os.scandir(root_s) as it:
            entries = list(it)
    except OSError as exc:
        raise PackError(f"{root}: cannot list source folder ({exc.strerror or exc})") from None
    classes = sorted(e.name for e in entries if _is_dir(e))
    skipped = [
        SkippedInput(path=e.name, reason="image outside any class folder (expected SRC/<class>/<image>)")
        for e in sorted(entries, key=lambda e: e.name)
        if not _is_dir(e) and _is_image(e.name)
    ]
    if not classes:
        raise PackError(
            f"{root}: no class sub-folders (expected an ImageFolder tree SRC/<class>/<image>)"
        )
    # Claim every class folder first, so a link from one class into another is a second
    # link (skipped), never a way for class b's images to get class a's label.
    visited: set[tuple[int, int]] = set()
    roots: dict[str, tuple[int, int] | None] = {}
    for cls in classes:
        try:
            st = os.stat(root_s + "/" + cls)
        except OSError as exc:  # pragma: no cover - listed as a dir a moment ago
            skipped.append(SkippedInput(path=cls + "/", reason=f"unreadable folder ({exc.strerror or exc})"))
            roots[cls] = None
            continue
        key = (st.st_dev, st.st_ino)
        if key in visited:
            skipped.append(SkippedInput(path=cls + "/", reason="the same folder as an earlier class; not scanned twice"))
            roots[cls] = None
        else:
            visited.add(key)
            roots[cls] = key
    relpaths = _PathsBuilder()
    labels = array("q")
    for idx, cls in enumerate(classes):
        before, skipped_before = len(relpaths), len(skipped)
        if roots[cls] is not None:
            for rel_dir, fnames in _walk_class(root_s, cls, visited, skipped):
                prefix = rel_dir + "/"
                for f in fnames:
                    relpaths.append(prefix + f)
        labels.extend([idx] * (len(relpaths) - before))
        if len(relpaths) == before and len(skipped) == skipped_before:
            raise PackError(
                f"{os.path.join(root_s, cls)}: class folder has no image files ({', '.join(IMG_EXTENSIONS)}); "
                "remove it or add images"
            )
    return SourceListing(root, tuple(classes), relpaths.table(), np.frombuffer(labels, dtype=np.int64).copy(),
                         tuple(skipped))


def _walk_class(root: str, cls: str, visited: set, skipped: list) -> list[tuple[str, list[str]]]:
    """``(relative dir, sorted image names)`` of every folder under ``root/cls``, in the order of
    torchvision's ``sorted(os.walk(..., followlinks=True))``, each real folder once.

    Folders are visited smallest path first (a heap), so which of two links to one folder is
    walked does not depend on the order the filesystem lists entries in.
    """
    found: list[tuple[str, list[str]]] = []
    heap = [cls]
    while heap:
        rel = heapq.heappop(heap)
        full = root + "/" + rel
        if rel != cls:
            try:
                st = os.stat(full)
            except OSError as exc:
                skipped.append(SkippedInput(path=rel + "/", reason=f"unreadable folder ({exc.strerror or exc})"))
                continue
            key = (st.st_dev, st.st_ino)
            if key in visited:
                skipped.append(SkippedInput(
                    path=rel + "/",
                    reason="link to a folder already scanned (a symlink loop or a second link); not scanned twice",
                ))
                continue
            visited.add(key)
        try:
            with os.scandir(full) as it:
                entries = list(it)
        except OSError as exc:
            skipped.append(SkippedInput(
                path=rel + "/", reason=f"unreadable folder ({exc.strerror or exc}); its images are not packed",
            ))
            continue
        fnames = []
        for e in entries:
            if _is_dir(e):
                heapq.heappush(heap, rel + "/" + e.name)
            elif _is_image(e.name):
                fnames.append(e.name)
        found.append((rel, sorted(fnames)))
    return found  # already in path order: torchvision sorts os.walk's tuples by dirpath


def _scan_csv(path: Path, part: int = 0, parts: int = 1) -> SourceListing:
    """Read the CSV as a stream, labels interned as small integers. One pass for the whole
    file; for a part, a first pass counts the rows and collects every label (the class list
    needs them all) without keeping a path, and a second keeps the part's rows and stops
    after them."""
    if parts == 1:
        rows = _read_csv(path, 0, None, {})
        return _csv_listing(path, rows, 0, rows.seen)
    before = _stamp(path)
    names: dict[str, int] = {}
    total = _read_csv(path, 0, 0, names).seen
    n_labels = len(names)
    lo, hi = part_bounds(part, parts, total)
    rows = _read_csv(path, lo, hi, names, stop=hi)
    if _stamp(path) != before or rows.seen != hi or len(names) != n_labels:
        raise PackError(f"{path}: the file changed while it was read; rerun once it no longer changes")
    return _csv_listing(path, rows, lo, total)


@dataclass
class _CsvRows:
    """What one streaming pass over a CSV kept and saw."""

    relpaths: _PathsBuilder
    label_ids: array  # interned label id of each kept row
    names: dict[str, int]  # label text -> interned id, in order of first appearance (every row's)
    seen: int  # sample rows read (kept or not)


def _read_csv(path: Path, lo: int, hi: int | None, names: dict[str, int], stop: int | None = None) -> _CsvRows:
    """Keep sample rows ``lo..hi-1`` (all when ``hi`` is None) of the CSV, read one row at a
    time, to the end or until ``stop`` sample rows are read. ``names`` is extended in place,
    so a second pass gives every label the id the first pass gave it."""
    try:
        f = open(path, encoding="utf-8-sig", newline="")
    except OSError as exc:
        raise PackError(f"{path}: cannot read ({exc.strerror or exc})") from None
    reader = None
    relpaths = _PathsBuilder()
    blob, offsets = relpaths.blob, relpaths.offsets
    label_ids = array("q")
    k = 0  # sample rows so far
    if stop is None:
        stop = -1  # never reached
    keep_hi = (1 << 62) if hi is None else hi
    with f:
        try:
            first = ""
            for line in f:
                if line.strip():
                    first = line
                    break
            f.seek(0)
            tsv = path.suffix.lower() == ".tsv" or ("\t" in first and "," not in first)
            delimiter = "\t" if tsv else ","
            reader = csv.reader(f, delimiter=delimiter)
            header_checked = False
            for row in reader:
                if k == stop:
                    break
                # the common row first, with no per-row call it does not need (10M rows)
                if header_checked and len(row) == 2:
                    p, lab = row[0].strip(), row[1].strip()
                    i = names.get(lab)
                    if p and i is not None and "\0" not in p:
                        if lo <= k < keep_hi:
                            blob += p.encode("utf-8", "surrogateescape")
                            offsets.append(len(blob))
                            label_ids.append(i)
                        k += 1
                        continue
                lineno = reader.line_num
                if not row or all(not c.strip() for c in row):
                    continue
                if len(row) != 2:
                    raise PackError(
                        f"{path}:{lineno}: expected 2 columns (path{delimiter}label), got {len(row)}"
                    )
                p, lab = row[0].strip(), row[1].strip()
                if not header_checked:
                    header_checked = True
                    if p.lower() in _PATH_HEADERS or lab.lower() in _LABEL_HEADERS:
                        continue
                if not p:
                    raise PackError(f"{path}:{lineno}: empty path")
                if not lab:
                    raise PackError(f"{path}:{lineno}: empty label")
                if "\0" in p:
                    raise PackError(f"{path}:{lineno}: path contains a NUL byte")
                i = names.get(lab)
                if i is None:
                    _check_label(path, lineno, lab)
                    if len(names) >= MAX_CLASSES:
                        raise PackError(
                            f"{path}:{lineno}: more than {MAX_CLASSES} distinct labels; is the second column "
                            "really the label?"
                        )
                    i = names[lab] = len(names)
                if lo <= k < keep_hi:
                    relpaths.append(p)
                    label_ids.append(i)
                k += 1
        except UnicodeDecodeError:
            lineno = reader.line_num if reader is not None else 0
            raise PackError(
                f"{path}:{lineno + 1}: not a UTF-8 text file; SRC must be an ImageFolder directory or a UTF-8 "
                "CSV/TSV of path,label rows"
            ) from None
        except csv.Error as exc:
            raise PackError(f"{path}:{reader.line_num}: malformed CSV ({exc})") from None
        except OSError as exc:
            raise PackError(f"{path}: cannot read ({exc.strerror or exc})") from None
    if k == 0 and stop < 0:
        raise PackError(f"{path}: no rows (expected path{delimiter}label lines)")
    return _CsvRows(relpaths, label_ids, names, k)


def _csv_listing(path: Path, rows: _CsvRows, start: int, total: int) -> SourceListing:
    """The listing of the kept rows, with classes from every label of the file: integer
    labels are class indices, names are sorted (as torchvision sorts class folders)."""
    ids = np.frombuffer(rows.label_ids, dtype=np.int64)
    keys = list(rows.names)
    if all(_INT_RE.fullmatch(k) for k in keys):
        values = np.asarray([int(k) for k in keys], dtype=np.int64)
        ints = values[ids]
        classes = tuple(str(i) for i in range(int(values.max()) + 1))
    else:
        classes = tuple(sorted(keys))
        rank = {c: r for r, c in enumerate(classes)}
        ints = np.asarray([rank[k] for k in keys], dtype=np.int64)[ids]
    return SourceListing(path.parent, classes, rows.relpaths.table(), ints, start=start, total=total)


def _check_label(path: Path, lineno: int, lab: str) -> None:
    """Integer labels are class indices: refuse one that could never be (or would allocate
    a class table of billions of entries)."""
    if _INT_RE.fullmatch(lab):
        v = int(lab) if len(lab) <= 20 else MAX_CLASSES  # int() of 5000 digits raises
        if not 0 <= v < MAX_CLASSES:
            raise PackError(
                f"{path}:{lineno}: label {lab} is out of range (integer labels are class indices "
                f"0..{MAX_CLASSES - 1}); fix the row or use class names"
            )
