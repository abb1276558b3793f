"""Listing a pack source: an ImageFolder tree or a CSV/TSV file of ``path,label`` rows.

Only names are read here (no image is opened), so every ``--part`` job can afford to scan
the whole source and agree on the same global order.
"""

from __future__ import annotations

import csv
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import PackError
from .image import IMG_EXTENSIONS

_CSV_SUFFIXES = (".csv", ".tsv", ".txt")
_PATH_HEADERS = {"path", "file", "filename", "filepath", "image", "img", "name"}
_LABEL_HEADERS = {"label", "class", "target", "category", "y"}


@dataclass(frozen=True)
class SourceListing:
    """The samples of a source in pack order: ``base / relpaths[i]`` has label ``labels[i]``."""

    base: Path  # folder the relative paths are resolved against
    classes: tuple[str, ...]
    relpaths: tuple[str, ...]
    labels: np.ndarray  # int64

    def __len__(self) -> int:
        return len(self.relpaths)

    def resolve(self, relpath: str) -> Path:
        return self.base / relpath  # an absolute relpath (CSV) stays absolute


def scan_source(source: str | Path) -> tuple[tuple[str, ...], list[str], np.ndarray]:
    """``(classes, relpaths, labels)`` of an ImageFolder directory or a CSV/TSV file.

    The order is torchvision ImageFolder's, so ``labels`` and sample order match what users
    of ``torchvision.datasets.ImageFolder`` already have.
    """
    listing = list_source(source)
    return listing.classes, list(listing.relpaths), listing.labels


def list_source(source: str | Path) -> SourceListing:
    src = Path(source)
    if not src.exists():
        raise PackError(f"{src}: source does not exist")
    if src.is_dir():
        return _scan_image_folder(src)
    if src.is_file():
        return _scan_csv(src)
    raise PackError(f"{src}: source is neither a directory nor a CSV/TSV file")


def _scan_image_folder(root: Path) -> SourceListing:
    try:
        classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
    except OSError as exc:
        raise PackError(f"{root}: cannot list source folder ({exc.strerror or exc})") from None
    if not classes:
        raise PackError(
            f"{root}: no class sub-folders (expected an ImageFolder tree SRC/<class>/<image>)"
        )
    relpaths: list[str] = []
    labels: list[int] = []
    for idx, cls in enumerate(classes):
        cls_dir = root / cls
        found = 0
        for dirpath, _, fnames in sorted(os.walk(cls_dir, followlinks=True)):
            for fname in sorted(fnames):
                if fname.lower().endswith(IMG_EXTENSIONS):
                    rel = os.path.relpath(os.path.join(dirpath, fname), root)
                    relpaths.append(Path(rel).as_posix())
                    labels.append(idx)
                    found += 1
        if not found:
            raise PackError(
                f"{cls_dir}: class folder has no image files ({', '.join(IMG_EXTENSIONS)}); "
                "remove it or add images"
            )
    return SourceListing(root, tuple(classes), tuple(relpaths), np.asarray(labels, dtype=np.int64))


def _scan_csv(path: Path) -> SourceListing:
    try:
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError:
        raise PackError(
            f"{path}: not a UTF-8 text file; SRC must be an ImageFolder directory or a CSV/TSV of path,label rows"
        ) from None
    lines = text.splitlines()
    first = next((ln for ln in lines if ln.strip()), "")
    delimiter = "\t" if path.suffix.lower() == ".tsv" or ("\t" in first and "," not in first) else ","
    rows = []
    for lineno, row in enumerate(csv.reader(lines, delimiter=delimiter), start=1):
        if not row or all(not c.strip() for c in row):
            continue
        if len(row) != 2:
            raise PackError(f"{path}:{lineno}: expected 2 columns (path{delimiter}label), got {len(row)}")
        rows.append((lineno, row[0].strip(), row[1].strip()))
    if rows and (rows[0][1].lower() in _PATH_HEADERS or rows[0][2].lower() in _LABEL_HEADERS):
        rows = rows[1:]  # a header row
    if not rows:
        raise PackError(f"{path}: no rows (expected path{delimiter}label lines)")
    for lineno, p, lab in rows:
        if not p:
            raise PackError(f"{path}:{lineno}: empty path")
        if not lab:
            raise PackError(f"{path}:{lineno}: empty label")
    raw_labels = [lab for _, _, lab in rows]
    if all(_is_index(lab) for lab in raw_labels):
        ints = np.asarray([int(lab) for lab in raw_labels], dtype=np.int64)
        classes = tuple(str(i) for i in range(int(ints.max()) + 1))
    else:
        classes = tuple(sorted(set(raw_labels)))
        to_idx = {c: i for i, c in enumerate(classes)}
        ints = np.asarray([to_idx[lab] for lab in raw_labels], dtype=np.int64)
    relpaths = tuple(p for _, p, _ in rows)
    return SourceListing(path.parent, classes, relpaths, ints)


def _is_index(s: str) -> bool:
    return s.isascii() and s.isdigit()
