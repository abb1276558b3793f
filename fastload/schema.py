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

import xxhash

from .config import PAYLOADS
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
    # HDF5 shards: the records' contiguous data as (offset, bytes), and the XXH3-64 of every other
    # byte of the file (its metadata), checked before the HDF5 library reads the file: HDF5 can
    # hang or crash on damaged metadata. None for LMDB shards, index files and older packs.
    data_span: tuple[int, int] | None = None
    meta_xxh3: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.data_span, list):
            object.__setattr__(self, "data_span", tuple(self.data_span))


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
    pack_id: str | None = None  # written into every shard and the index file; None in older packs
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
        for e in [*d["shards"], *([d["index"]] if d["index"] else [])]:
            for k in ("data_span", "meta_xxh3"):  # only where used: older readers know the rest
                if e[k] is None:
                    del e[k]
                elif k == "data_span":
                    e[k] = list(e[k])
        # Put the identifying keys first so `head manifest.json` tells what this is.
        head = {k: d.pop(k) for k in ("format", "version", "backend", "payload", "num_samples")}
        return {**head, **d}

    def to_json(self) -> str:
        """The manifest file's text, sealed by its checksum (the last field)."""
        d = self.to_dict()
        d["checksum"] = manifest_checksum(json.loads(json.dumps(d)))  # as a reader will parse it
        return json.dumps(d, indent=1, sort_keys=False) + "\n"

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
                pack_id=_pack_id(d.get("pack_id"), where),
                version=version,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise FormatError(f"{where}: malformed manifest ({exc!r})") from exc
        if m.backend not in BACKENDS:
            raise FormatError(f"{where}: unknown backend {m.backend!r}")
        if m.payload not in PAYLOADS:
            raise FormatError(f"{where}: unknown payload {m.payload!r} (known: {', '.join(PAYLOADS)})")
        names = [s.file for s in m.shards] + ([m.index.file] if m.index is not None else [])
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise FormatError(f"{where}: lists {dup!r} twice (a shard would be read as two); repack")
        if sum(s.num_samples for s in m.shards) != m.num_samples:
            raise FormatError(f"{where}: shard sample counts do not add up to num_samples")
        if m.index is not None and m.index.num_samples != m.num_samples:
            raise FormatError(f"{where}: the index file lists {m.index.num_samples} records, num_samples is {m.num_samples}")
        return m


def check_file_name(name: str, *, where: str) -> None:
    """Refuse a shard or index file name that is not a plain file name inside the pack: a
    manifest is data, and must not make a reader open ``../elsewhere`` or ``/etc/...``."""
    if (not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name
            or os.path.isabs(name)):
        raise FormatError(f"{where}: file name {name!r} is not a plain file name inside the pack; "
                          "the manifest is damaged or was edited: repack")


def _pack_id(v: Any, where: str) -> str | None:
    if v is None:
        return None
    if not isinstance(v, str) or not re.fullmatch(r"[0-9a-f]{8,64}", v):
        raise FormatError(f"{where}: malformed manifest (pack_id {v!r})")
    return v


def _shard_entry(s: dict[str, Any], where: str) -> ShardEntry:
    e = ShardEntry(**s)
    if not (isinstance(e.file, str) and isinstance(e.sha256, str)
            and type(e.num_samples) is int and type(e.bytes) is int):
        raise FormatError(f"{where}: malformed manifest (bad shard entry {s!r})")
    check_file_name(e.file, where=where)
    span = e.data_span
    if not ((e.meta_xxh3 is None or (isinstance(e.meta_xxh3, str) and re.fullmatch(r"[0-9a-f]{16}", e.meta_xxh3)))
            and (span is None or (len(span) == 2 and all(type(v) is int and v >= 0 for v in span)))):
        raise FormatError(f"{where}: malformed manifest (bad shard entry {s!r})")
    if e.num_samples < 0 or e.bytes < 0:
        raise FormatError(f"{where}: malformed manifest (negative size in {s!r})")
    return e


# What a manifest written before checksums can hold (every field but the checksum and pack id).
_UNSEALED_FIELDS = {f.name for f in dataclasses.fields(Manifest)} - {"pack_id"} | {"class_to_idx"}


def manifest_checksum(d: dict[str, Any]) -> str:
    """``"xxh3:<hex>"`` of every field of a parsed manifest but ``"checksum"``, serialised
    canonically (sorted keys, no whitespace, ASCII): covers what no other checksum does (class
    names, source folder, skipped inputs, options, the shards' and index file's SHA-256), and
    does not depend on how the file is indented."""
    body = {k: v for k, v in d.items() if k != "checksum"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return "xxh3:" + xxhash.xxh3_64_hexdigest(text.encode("ascii"))


def _check_sealed(d: dict[str, Any], where: str) -> None:
    """Refuse a manifest whose content differs from what its checksum says. Manifests written
    before checksums (no ``checksum``, no ``pack_id``, which came first, and only the fields
    they knew) read unchecked; one with a pack id or a field this fastload does not know but
    no checksum lost it (a damaged key, as ``"checksun"``) and is refused."""
    found = d.get("checksum")
    if "checksum" not in d and d.get("pack_id") is None and set(d) <= _UNSEALED_FIELDS:
        return
    if not isinstance(found, str) or found != manifest_checksum(d):
        raise FormatError(f"{where}: manifest damaged or edited (its checksum does not match its content); "
                          "run `fastload verify` on the pack, and repack or restore the file")


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
        raise FormatError(f"{path}: manifest is not valid JSON ({exc})") from None
    m = Manifest.from_dict(d, where=str(path))  # structure first: its errors say what is wrong
    _check_sealed(d, str(path))
    return m


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
    for i, m in enumerate(manifests):
        if m.part != i or m.parts != n:
            raise FormatError(f"{found[i]}: says it is part {m.part} of {m.parts}, its name says {i} of {n}; "
                              "the file was renamed or damaged: repack that part")
        field_ = _parts_disagree(manifests[0], m) if i else None
        if field_ is not None:
            raise FormatError(
                f"{found[0]} and {found[i]} disagree on {field_}: parts of different packs, or the source "
                f"changed between the parts' runs; repack part {i} (or all parts) from the same source"
            )
    return manifests


def _parts_disagree(a: Manifest, b: Manifest) -> str | None:
    """What two parts of one pack differ on that every part must share (None: nothing): each
    part maps its records onto the same class list, with the same codec and options, out of
    the same listing of the source."""
    if a.classes != b.classes:
        shorter = min(len(a.classes), len(b.classes))
        k = next((k for k, (x, y) in enumerate(zip(a.classes, b.classes)) if x != y), shorter)
        x, y = (c[k] if k < len(c) else None for c in (a.classes, b.classes))
        return f"the classes ({len(a.classes)} vs {len(b.classes)}; first difference at class {k}: {x!r} vs {y!r})"
    for name in ("backend", "payload", "parts", "source_count", "format", "version"):
        x, y = getattr(a, name), getattr(b, name)
        if x != y:
            return f"{name} ({x!r} vs {y!r})"
    # options that shape the records; the shard size only cuts them into files differently
    x, y = ({k: v for k, v in m.options.items() if k != "shard_size"} for m in (a, b))
    if x != y:
        return f"options ({x!r} vs {y!r})"
    return None
