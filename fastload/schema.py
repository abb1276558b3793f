"""The on-disk schema of a packed dataset: manifest, shard entries, and naming.

A packed directory holds shard files plus a manifest written last: a directory with no
manifest is, by definition, incomplete. A pack made with ``--part I/N`` writes one manifest
per part (``manifest-pIIIII-of-NNNNN.json``); readers open all parts as one dataset once
every part's manifest is present.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import FormatError

FORMAT_NAME = "fastload"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
_PART_MANIFEST_RE = re.compile(r"^manifest-p(\d{5})-of-(\d{5})\.json$")

BACKENDS = ("lmdb", "hdf5")
SHARD_SUFFIX = {"lmdb": ".lmdb", "hdf5": ".h5"}


def part_prefix(part: int, parts: int) -> str:
    """File-name prefix of one part's files ('' for an unpartitioned pack)."""
    return "" if parts == 1 else f"p{part:05d}-of-{parts:05d}-"


def manifest_name(part: int, parts: int) -> str:
    return MANIFEST_NAME if parts == 1 else f"manifest-p{part:05d}-of-{parts:05d}.json"


def shard_name(backend: str, part: int, parts: int, index: int) -> str:
    return f"{part_prefix(part, parts)}shard-{index:05d}{SHARD_SUFFIX[backend]}"


@dataclass(frozen=True)
class ShardEntry:
    """One shard file: its name (relative to the pack), record count, size and SHA-256."""

    file: str
    num_samples: int
    bytes: int
    sha256: str


@dataclass(frozen=True)
class SkippedInput:
    """A source file that was not packed, and why."""

    path: str
    reason: str


@dataclass(frozen=True)
class Manifest:
    """Everything a reader needs to know about one packed (part of a) dataset."""

    backend: str
    payload: str
    num_samples: int
    classes: tuple[str, ...]
    shards: tuple[ShardEntry, ...]
    image_shape: tuple[int, int, int] | None = None
    options: dict[str, Any] = field(default_factory=dict)
    skipped: tuple[SkippedInput, ...] = ()
    part: int = 0
    parts: int = 1
    source_count: int = 0
    source: str = ""  # absolute folder the records' source paths are relative to
    index: ShardEntry | None = None  # the part's index file (labels, shapes, paths); None in older packs
    format: str = FORMAT_NAME
    version: int = FORMAT_VERSION

    @property
    def class_to_idx(self) -> dict[str, int]:
        return {c: i for i, c in enumerate(self.classes)}

    @property
    def total_bytes(self) -> int:
        return sum(s.bytes for s in self.shards)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["classes"] = list(self.classes)
        d["class_to_idx"] = self.class_to_idx
        d["image_shape"] = list(self.image_shape) if self.image_shape else None
        # Put the identifying keys first so `head manifest.json` tells what this is.
        head = {k: d.pop(k) for k in ("format", "version", "backend", "payload", "num_samples")}
        return {**head, **d}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=False) + "\n"

    @classmethod
    def from_dict(cls, d: dict[str, Any], *, where: str = "manifest") -> Manifest:
        if not isinstance(d, dict):
            raise FormatError(f"{where}: not a fastload manifest (a JSON {type(d).__name__}, not an object)")
        if d.get("format") != FORMAT_NAME:
            raise FormatError(f"{where}: not a fastload manifest (format={d.get('format')!r})")
        version = d.get("version")
        if not isinstance(version, int) or version > FORMAT_VERSION or version < 1:
            raise FormatError(
                f"{where}: format version {version!r} is not supported by this fastload "
                f"(reads versions 1..{FORMAT_VERSION}); upgrade fastload or repack"
            )
        try:
            m = cls(
                backend=str(d["backend"]),
                payload=str(d["payload"]),
                num_samples=int(d["num_samples"]),
                classes=tuple(str(c) for c in d["classes"]),
                shards=tuple(_shard_entry(s, where) for s in d["shards"]),
                image_shape=tuple(d["image_shape"]) if d.get("image_shape") else None,
                options=dict(d.get("options") or {}),
                skipped=tuple(SkippedInput(**s) for s in d.get("skipped") or ()),
                part=int(d.get("part", 0)),
                parts=int(d.get("parts", 1)),
                source_count=int(d.get("source_count", 0)),
                source=str(d.get("source", "")),
                index=_shard_entry(d["index"], where) if d.get("index") else None,
                version=version,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise FormatError(f"{where}: malformed manifest ({exc!r})") from exc
        if m.backend not in BACKENDS:
            raise FormatError(f"{where}: unknown backend {m.backend!r}")
        if sum(s.num_samples for s in m.shards) != m.num_samples:
            raise FormatError(f"{where}: shard sample counts do not add up to num_samples")
        if m.index is not None and m.index.num_samples != m.num_samples:
            raise FormatError(f"{where}: the index file lists {m.index.num_samples} records, num_samples is {m.num_samples}")
        return m


def _shard_entry(s: dict[str, Any], where: str) -> ShardEntry:
    e = ShardEntry(**s)
    if not (isinstance(e.file, str) and isinstance(e.sha256, str)
            and type(e.num_samples) is int and type(e.bytes) is int):
        raise FormatError(f"{where}: malformed manifest (bad shard entry {s!r})")
    return e


def write_manifest(path: Path, manifest: Manifest) -> None:
    """Write atomically (temp file, fsync, rename) so a reader never sees half a manifest."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(manifest.to_json())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_manifest(path: Path) -> Manifest:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FormatError(f"{path}: manifest not found") from None
    except UnicodeDecodeError as exc:
        raise FormatError(f"{path}: manifest is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    try:
        d = json.loads(text)
    except json.JSONDecodeError as exc:
        raise FormatError(f"{path}: manifest is not valid JSON ({exc})") from exc
    return Manifest.from_dict(d, where=str(path))


def find_manifests(root: Path) -> list[Manifest]:
    """The manifests of a packed directory, in part order; raises if the pack is incomplete."""
    root = Path(root)
    if not root.exists():
        raise FormatError(f"{root}: no such directory")
    if not root.is_dir():
        raise FormatError(f"{root}: not a directory (expected a packed dataset directory)")
    single = root / MANIFEST_NAME
    if single.exists():
        return [read_manifest(single)]
    found: dict[int, Path] = {}
    counts: set[int] = set()
    for p in root.iterdir():
        m = _PART_MANIFEST_RE.match(p.name)
        if m:
            found[int(m.group(1))] = p
            counts.add(int(m.group(2)))
    if not found:
        raise FormatError(
            f"{root}: no {MANIFEST_NAME} (not a fastload pack, or its packing never finished)"
        )
    if len(counts) != 1:
        raise FormatError(f"{root}: part manifests disagree on the number of parts: {sorted(counts)}")
    (n,) = counts
    missing = sorted(set(range(n)) - set(found))
    if missing:
        raise FormatError(
            f"{root}: pack incomplete: {len(missing)} of {n} parts missing (parts {missing[:10]}"
            f"{'...' if len(missing) > 10 else ''}); run their `fastload pack --part I/{n}` jobs"
        )
    manifests = [read_manifest(found[i]) for i in range(n)]
    first = manifests[0]
    for m in manifests[1:]:
        if (m.backend, m.payload, m.classes) != (first.backend, first.payload, first.classes):
            raise FormatError(
                f"{root}: parts were packed with different backend, payload or classes; repack them"
            )
    return manifests
