"""The converter: scan -> slice -> load -> pre-resize -> encode -> write, as small stages.

Workers (a process pool) read, decode, resize and encode; the main process writes records in
input order, so the output is byte-identical for any number of workers. Shards appear under
their final names only when complete, a journal records finished shards so an interrupted
run resumes, and the manifest is written last: a DEST without one is never complete.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import json
import logging
import multiprocessing
import os
import re
import signal
import stat
import struct
import sys
from contextlib import contextmanager
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .config import OnError, PackConfig, usable_cpus
from .errors import DecodeError, FastloadError, PackError
from .scan import SourceListing, list_source, scan_source
from .storage.index_file import index_name, write_index_file
from .schema import (
    FORMAT_VERSION,
    Manifest,
    ShardEntry,
    SkippedInput,
    manifest_name,
    part_prefix,
    read_manifest,
    shard_name,
    write_manifest,
)

__all__ = [
    "PackSummary", "UnreadableSource", "check_dest_outside_source", "file_stamp", "journal_name", "pack",
    "read_source_file", "scan_source", "shown", "stamps_digest",
]

log = logging.getLogger("fastload.pack")

_DISK_FULL = {errno.ENOSPC, errno.EFBIG, getattr(errno, "EDQUOT", errno.ENOSPC)}
_DISK_FULL_TEXT = ("no space left", "file too large", "quota exceeded")


@dataclass(frozen=True)
class PackSummary:
    """What one ``pack`` run produced."""

    packed: int
    skipped: int
    bytes: int
    seconds: float
    dest: Path
    manifest: Path
    shards: int = 0
    resumed_from: int = 0  # inputs taken over from an interrupted run
    resumed_shards: int = 0  # finished shards taken over from an interrupted run
    packed_before: int = 0  # images in those shards (not packed by this run)

    @property
    def images_per_s(self) -> float:
        """The rate of this run: images it packed itself over its own time (a resumed run
        does not count the images an earlier run packed)."""
        done = self.packed - self.packed_before
        return done / self.seconds if self.seconds > 0 else 0.0

    def line(self) -> str:
        """The one-line summary the CLI prints."""
        resumed = ""
        if self.resumed_shards:
            resumed = (
                f", resumed after {self.resumed_shards} of {self.shards} shards "
                f"({self.packed - self.packed_before} images packed by this run)"
            )
        return (
            f"packed {self.packed} images ({self.skipped} skipped) into {self.shards} shard"
            f"{'' if self.shards == 1 else 's'}, {human_bytes(self.bytes)}{resumed} in {self.seconds:.1f} s "
            f"({self.images_per_s:.0f} images/s) -> {self.dest}"
        )


def journal_name(part: int, parts: int) -> str:
    """The resume journal of one part (a hidden file; readers ignore it)."""
    return ".fastload-pack.json" if parts == 1 else f".fastload-pack-p{part:05d}-of-{parts:05d}.json"


# ---------------------------------------------------------------------------- worker stage


@dataclass(frozen=True)
class _Encoding:
    """What a worker needs to turn one source file into a payload (pickled per chunk: small)."""

    base: str
    payload: str
    quality: int
    restart_markers: bool
    resize: int | None
    size: tuple[int, int] | None
    max_file_size: int


class UnreadableSource(Exception):
    """A source file that is not read; the message is the reason listed in the manifest."""


_KINDS = (
    (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"),
)


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def read_source_file(path: str, *, max_bytes: int) -> bytes:
    """The bytes of one source file, refusing anything that could hang or exhaust memory.

    Only regular files are read: the check runs on the opened descriptor (``fstat`` after a
    non-blocking open that follows links), so a FIFO, ``/dev/zero`` or a file swapped for one
    after the scan cannot block or stream forever. Files over ``max_bytes`` are refused, and
    at most ``max_bytes + 1`` bytes are ever read, so a file that grows meanwhile is caught.
    Raises :class:`UnreadableSource` with a short reason.
    """
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOCTTY", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise UnreadableSource("broken symbolic link (its target is missing)" if os.path.islink(path)
                       else "file not found") from None
    except OSError as exc:
        try:
            mode = os.stat(path).st_mode
        except OSError:
            mode = stat.S_IFREG
        if not stat.S_ISREG(mode):
            raise UnreadableSource(f"not a regular file ({_kind(mode)})") from None
        raise UnreadableSource(f"unreadable ({exc.strerror or exc})") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnreadableSource(f"not a regular file ({_kind(st.st_mode)})")
        if st.st_size > max_bytes:
            raise UnreadableSource(f"file too large ({human_bytes(st.st_size)}, over the --max-file-size "
                           f"limit of {human_bytes(max_bytes)})")
        try:
            data = f.read(max_bytes + 1)
        except OSError as exc:
            raise UnreadableSource(f"unreadable ({exc.strerror or exc})") from None
    if len(data) > max_bytes:
        raise UnreadableSource(f"file too large (grew past the --max-file-size limit of {human_bytes(max_bytes)})")
    return data


def file_stamp(path: str | Path) -> tuple[int, int]:
    """``(size, mtime_ns)`` of a source file (links followed), ``(-1, -1)`` if it cannot be
    stat'ed: what a resume compares to notice a file edited in place since it was packed."""
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return -1, -1
    return st.st_size, st.st_mtime_ns


def _process(enc: _Encoding, relpath: str) -> tuple[bytes | None, tuple[int, int, int] | str, tuple[int, int]]:
    """Read, decode, resize, encode one input: ``(payload, shape, stamp)`` or
    ``(None, reason, stamp)``; the stamp is taken here, in parallel, not in a pass before."""
    path = os.path.join(enc.base, relpath)
    stamp = file_stamp(path)
    try:
        data = read_source_file(path, max_bytes=enc.max_file_size)
    except UnreadableSource as exc:
        return None, str(exc), stamp
    try:
        img = _load(enc, data, relpath)
    except DecodeError as exc:
        return None, str(exc).removeprefix(f"{relpath}: "), stamp
    if enc.payload == "original":
        return data, img.shape, stamp
    from .codecs import get_codec

    codec = get_codec(enc.payload)
    if enc.payload == "jpeg":
        out = codec.encode(img, quality=enc.quality, restart=enc.restart_markers)
    else:
        out = codec.encode(img)
    return out, img.shape, stamp


def stamps_digest(stamps) -> str:
    """One hash of the ``file_stamp`` of each input of a shard, in order (kept in the journal)."""
    h = hashlib.sha256()
    for size, mtime in stamps:
        h.update(struct.pack("<qq", size, mtime))
    return h.hexdigest()


def _load(enc: _Encoding, data: bytes, relpath: str) -> np.ndarray:
    from .image import load_source, resize_center_crop, resize_shorter

    img = load_source(data, name=relpath)
    if enc.resize is not None:
        img = resize_shorter(img, enc.resize)
    elif enc.size is not None:
        img = resize_center_crop(img, enc.size)
    return np.ascontiguousarray(img)


def _init_worker(parent: int) -> None:
    # Ctrl-C reaches the whole process group; only the main process handles it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent(parent)


def die_with_parent(parent: int) -> None:
    """Make this (worker) process end when ``parent`` dies, even by ``kill -9``.

    Without it, workers of a killed pack each print a BrokenPipeError traceback when they next
    write a result. Linux delivers SIGKILL on parent death (``PR_SET_PDEATHSIG``); the check
    that ``parent`` still exists closes the race of a parent that died before the call (it
    asks about ``parent`` itself, not ``getppid``, which is a fork server's pid under
    ``forkserver``).
    """
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
        except (OSError, AttributeError):  # pragma: no cover - no libc prctl: best effort
            pass
    try:
        os.kill(parent, 0)
    except ProcessLookupError:
        os._exit(0)
    except OSError:  # pragma: no cover - exists, but not ours to signal
        pass


class _Feeder:
    """Hands tasks to ``Pool.imap`` at most ``window`` ahead of the writer, so results
    cannot pile up in memory when writing is slower than encoding."""

    def __init__(self, items, window: int):
        self._items = items
        self._sem = threading.Semaphore(window)
        self._stop = False

    def __iter__(self):
        for item in self._items:
            self._sem.acquire()
            if self._stop:
                return
            yield item

    def consumed(self) -> None:
        self._sem.release()

    def stop(self) -> None:
        self._stop = True
        self._sem.release()


# ---------------------------------------------------------------------------- destination


def _own_patterns(part: int, parts: int) -> list[re.Pattern]:
    pre = re.escape(part_prefix(part, parts))
    tail = r"(\.tmp|\.blob\.tmp|\.tmp-lock)?"
    return [
        re.compile(rf"^{pre}shard-\d{{5}}\.(lmdb|h5){tail}$"),
        re.compile(rf"^{re.escape(index_name(part_prefix(part, parts)))}(\.tmp)?$"),
        re.compile(rf"^{re.escape(manifest_name(part, parts))}(\.tmp)?$"),
        re.compile(rf"^{re.escape(journal_name(part, parts))}(\.tmp)?$"),
    ]


def _sibling_patterns(parts: int) -> list[re.Pattern]:
    """Files other parts of the same ``--part I/N`` set may put in DEST."""
    if parts == 1:
        return []
    n = f"{parts:05d}"
    tail = r"(\.tmp|\.blob\.tmp|\.tmp-lock)?"
    return [
        re.compile(rf"^p\d{{5}}-of-{n}-shard-\d{{5}}\.(lmdb|h5){tail}$"),
        re.compile(rf"^p\d{{5}}-of-{n}-index\.fli(\.tmp)?$"),
        re.compile(rf"^manifest-p\d{{5}}-of-{n}\.json(\.tmp)?$"),
        re.compile(rf"^\.fastload-pack-p\d{{5}}-of-{n}\.json(\.tmp|\.lock)?$"),
    ]


_ANY_FASTLOAD = [
    re.compile(r"^(p\d{5}-of-\d{5}-)?shard-\d{5}\.(lmdb|h5)(\.tmp|\.blob\.tmp|\.tmp-lock)?$"),
    re.compile(r"^(p\d{5}-of-\d{5}-)?index\.fli(\.tmp)?$"),
    re.compile(r"^manifest(-p\d{5}-of-\d{5})?\.json(\.tmp)?$"),
    re.compile(r"^\.fastload-pack(-p\d{5}-of-\d{5})?\.json(\.tmp|\.lock)?$"),
]


def _matches(name: str, patterns) -> bool:
    return any(p.match(name) for p in patterns)


def _remove(paths) -> None:
    for p in paths:
        Path(p).unlink(missing_ok=True)


@contextmanager
def _part_lock(dest: Path, cfg: PackConfig):
    """Hold an exclusive lock on this part of DEST while packing, so a second run of the same
    command (or the same ``--part``) into DEST fails at once instead of corrupting the first."""
    if dest.exists() and not dest.is_dir():
        raise PackError(f"{dest}: destination exists and is not a directory")
    dest.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX: no lock
        yield
        return
    path = dest / (journal_name(cfg.part, cfg.parts) + ".lock")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            what = "this DEST" if cfg.parts == 1 else f"part {cfg.part}/{cfg.parts} of this DEST"
            raise PackError(
                f"{dest}: another fastload pack is writing {what} now ({path.name} is locked); "
                "wait for it to finish or stop it"
            ) from None
        try:
            yield
        finally:
            path.unlink(missing_ok=True)  # while still held, so a later run locks a fresh file
    finally:
        os.close(fd)


def _prepare_dest(dest: Path, cfg: PackConfig, key: str, stamps_between) -> dict | None:
    """Make DEST ready; returns the journal to resume from, or None for a fresh start.
    ``stamps_between(lo, hi)``: the ``stamps_digest`` of this part's inputs ``lo..hi-1`` now."""
    own = _own_patterns(cfg.part, cfg.parts)
    siblings = _sibling_patterns(cfg.parts)
    lock = journal_name(cfg.part, cfg.parts) + ".lock"
    names = sorted(n for n in os.listdir(dest) if n != lock)
    mine = [n for n in names if _matches(n, own)]
    foreign = [n for n in names if not _matches(n, own) and not _matches(n, siblings)]
    if cfg.overwrite:
        # Remove our own files and fastload files that cannot belong to the same pack; never
        # anything else (DEST may be a folder the user keeps other things in).
        _remove(dest / n for n in mine + [f for f in foreign if _matches(f, _ANY_FASTLOAD)])
        return None
    mname = manifest_name(cfg.part, cfg.parts)
    if mname in names:
        raise PackError(
            f"{dest}: already holds a finished pack ({mname}); use --overwrite to replace it"
        )
    if foreign:
        raise PackError(
            f"{dest}: destination is not empty ({len(foreign)} other entr{'y' if len(foreign) == 1 else 'ies'}, "
            f"e.g. {foreign[0]!r}); use --overwrite or an empty folder"
        )
    jpath = dest / journal_name(cfg.part, cfg.parts)
    journal = _read_journal(jpath)
    if journal is None:
        if any(not n.endswith((".tmp", ".tmp-lock")) for n in mine):
            raise PackError(
                f"{dest}: holds shards of an unknown earlier pack (no journal); use --overwrite"
            )
        _remove(dest / n for n in mine)
        return None
    if journal.get("key") != key:
        log.warning("%s: the unfinished pack there used other options or another source; restarting", dest)
        _remove(dest / n for n in mine)
        return None
    return _validate_resume(dest, journal, mine, jpath.name, stamps_between)


def _read_journal(path: Path) -> dict | None:
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {"key": None}  # unreadable journal: treated as a mismatch (restart)
    return d if isinstance(d, dict) else {"key": None}


def _validate_resume(dest: Path, journal: dict, mine: list[str], jname: str, stamps_between) -> dict | None:
    """Keep the journal's finished shards whose bytes still match and whose source files are
    unchanged (size and mtime, checked only for these inputs); drop everything after."""
    from .storage.base import file_sha256

    try:
        entries = [ShardEntry(**e) for e in journal["shards"]]
        ends = [int(x) for x in journal["ends"]]
        skipped = [(int(pos), SkippedInput(**s)) for pos, s in journal["skipped"]]
        shapes = journal["shapes"]
        stamps = [str(x) for x in journal["stamps"]]
        if not len(entries) == len(ends) == len(shapes) == len(stamps):
            raise ValueError("journal lists differ in length")
    except (KeyError, TypeError, ValueError):
        log.warning("%s: unreadable pack journal; restarting", dest)
        _remove(dest / n for n in mine)
        return None
    good = 0
    for k, e in enumerate(entries):
        p = dest / e.file
        if not p.is_file() or p.stat().st_size != e.bytes or file_sha256(p) != e.sha256:
            break
        if stamps_between(ends[k - 1] if k else 0, ends[k]) != stamps[k]:
            log.warning("%s: a source file of %s changed since it was packed; repacking from there", dest, e.file)
            break
        good += 1
    keep = {e.file for e in entries[:good]} | {jname}
    _remove(dest / n for n in mine if n not in keep)
    end = ends[good - 1] if good else 0
    return {
        "shards": entries[:good],
        "ends": ends[:good],
        "skipped": [(pos, s) for pos, s in skipped if pos < end],
        "shapes": shapes[:good],
        "stamps": stamps[:good],
        "position": end,
    }


def _write_journal(path: Path, doc: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _source_key(cfg: PackConfig, listing: SourceListing) -> str:
    """A hash of the options, classes and the part's listing (with where it sits in the
    source and the source's size): what must match for a resume. Files edited
    in place are caught per shard (``stamps_digest``), with no stat pass over every input
    before the first image is packed."""
    h = hashlib.sha256()
    head = {
        "version": FORMAT_VERSION,
        "backend": cfg.backend,
        "payload": cfg.payload,
        "options": cfg.output_options(),
        "part": cfg.part,
        "parts": cfg.parts,
        "max_file_size": cfg.max_file_size,
        "classes": list(listing.classes),
        "base": str(listing.base.resolve()),
        "start": listing.start,
        "total": listing.total,
    }
    h.update(json.dumps(head, sort_keys=True).encode())
    h.update(np.ascontiguousarray(listing.relpaths.offsets, dtype="<i8"))
    h.update(np.ascontiguousarray(listing.relpaths.blob, dtype=np.uint8))
    h.update(np.ascontiguousarray(listing.labels, dtype="<i8"))
    return h.hexdigest()


# ---------------------------------------------------------------------------- the pack run


def pack(source: str | Path, dest: str | Path, *, config: PackConfig | None = None,
         storage_options: dict | None = None, endpoint_url: str | None = None,
         staging: str | Path | None = None) -> PackSummary:
    """Pack ``source`` (ImageFolder dir or CSV/TSV of path,label) into shards under ``dest``.

    Rerunning the same call after an interruption resumes from the last finished shard; the
    result is byte-identical to an uninterrupted run, for any ``config.workers``.

    ``dest`` may be a URL (``s3://bucket/prefix``): the part is packed into a local staging
    folder (``staging``, default under the fastload cache dir, stable per URL and part), then
    uploaded shard by shard, the manifest last (see :mod:`fastload.storage.remote_pack`).
    ``storage_options``/``endpoint_url`` configure the store.
    """
    cfg = config or PackConfig()
    from .storage.remote import is_url

    if is_url(dest):
        return _pack_to_url(source, str(dest), cfg, storage_options=storage_options, endpoint_url=endpoint_url,
                            staging=staging)
    t0 = time.perf_counter()
    dest = Path(dest)
    try:
        str(dest).encode("utf-8")
    except UnicodeEncodeError:  # source names may be any bytes; LMDB and HDF5 need a UTF-8 DEST
        raise PackError(f"{dest}: DEST name is not valid UTF-8; choose another folder name") from None
    check_dest_outside_source(source, dest)
    listing = list_source(source, part=cfg.part, parts=cfg.parts)  # this part's inputs only
    if listing.total == 0:
        raise PackError(f"{source}: no images found")
    for s in listing.skipped:
        if cfg.on_error is OnError.FAIL:
            raise PackError(f"{shown(listing.resolve(s.path))}: {s.reason}; {_SKIP_HINT}")
        log.warning("skipped %s: %s", shown(s.path), s.reason)
    start, stop = 0, len(listing)  # indices into the part's listing
    key = _source_key(cfg, listing)
    created = not dest.exists()
    try:
        with _part_lock(dest, cfg):
            try:
                def stamps_between(lo: int, hi: int) -> str:
                    return stamps_digest(file_stamp(listing.resolve(r)) for r in listing.iter_relpaths(start + lo, start + hi))

                resume = _prepare_dest(dest, cfg, key, stamps_between)
                run = _PackRun(cfg, listing, dest, key, start, stop, resume)
                run.execute()
            except FastloadError:
                _remove_unstarted_journal(dest, cfg)  # while the lock is ours
                raise
    except FastloadError:
        if created:
            try:
                dest.rmdir()  # only if empty: a failed run leaves no half-made DEST behind
            except OSError:
                pass
        raise
    seconds = time.perf_counter() - t0
    resumed = resume["shards"] if resume else []
    return PackSummary(
        packed=run.packed,
        skipped=len(run.skipped) + len(run.scan_skipped),
        bytes=sum(e.bytes for e in run.entries),
        seconds=seconds,
        dest=dest,
        manifest=dest / manifest_name(cfg.part, cfg.parts),
        shards=len(run.entries),
        resumed_from=run.resumed_from,
        resumed_shards=len(resumed),
        packed_before=sum(e.num_samples for e in resumed),
    )


def shown(path: str | Path) -> str:
    """A file name for a one-line message: as is when printable, else quoted with escapes (a
    newline in a name must not split the line; a non-UTF-8 byte shows as ``\\udcXX``)."""
    text = str(path)
    return text if text.isprintable() else repr(text)


_SKIP_HINT = "rerun with --on-error skip to skip unreadable inputs (they are listed in the manifest)"


def check_dest_outside_source(source: str | Path, dest: str | Path) -> None:
    """Refuse a DEST inside an ImageFolder SRC (the next pack of SRC would scan the shards'
    folder as a class) and a SRC inside DEST (``--overwrite`` cleans DEST). A CSV source names
    its files row by row and nothing is scanned, so DEST may sit beside it."""
    src = Path(source)
    if not src.is_dir():
        return
    s, d = os.path.realpath(src), os.path.realpath(dest)
    if d == s or d.startswith(s.rstrip(os.sep) + os.sep):
        raise PackError(
            f"{dest}: DEST is inside SRC {src}; the next pack of SRC would scan it as a class folder. "
            "Choose a DEST outside SRC"
        )
    if s.startswith(d.rstrip(os.sep) + os.sep):
        raise PackError(f"{dest}: SRC {src} is inside DEST; choose a DEST outside SRC")


def _remove_unstarted_journal(dest: Path, cfg: PackConfig) -> None:
    """After a failed run: if DEST holds no finished shard of this part (nothing worth
    resuming), remove the part's journal, so DEST is left as it was before the run."""
    own = _own_patterns(cfg.part, cfg.parts)
    jname = journal_name(cfg.part, cfg.parts)
    try:
        names = os.listdir(dest)
    except OSError:
        return
    if not any(_matches(n, own) and not n.startswith(jname) for n in names):
        _remove(dest / n for n in names if n in (jname, jname + ".tmp"))


class _PackRun:
    """State of one pack run: the current shard writer, finished entries and the journal."""

    def __init__(self, cfg, listing: SourceListing, dest: Path, key: str, start: int, stop: int, resume):
        self.cfg, self.listing, self.dest, self.key = cfg, listing, dest, key
        self.start, self.stop = start, stop
        self.jpath = dest / journal_name(cfg.part, cfg.parts)
        self.entries: list[ShardEntry] = list(resume["shards"]) if resume else []
        self.ends: list[int] = list(resume["ends"]) if resume else []
        self.skipped: list[tuple[int, SkippedInput]] = list(resume["skipped"]) if resume else []
        # what the scan could not list (unreadable folders...): the first part's manifest lists them
        self.scan_skipped: tuple[SkippedInput, ...] = listing.skipped if cfg.part == 0 else ()
        self.shapes: list = list(resume["shapes"]) if resume else []  # per shard: [h,w,c] | "mixed" | None
        self.stamps: list[str] = list(resume["stamps"]) if resume else []  # per shard: stamps_digest
        self.shard_stamps: list[tuple[int, int]] = []  # file_stamp of each input since the last shard
        self.position = resume["position"] if resume else 0  # inputs of the slice consumed
        self.resumed_from = self.position
        self.packed = sum(e.num_samples for e in self.entries)
        self.writer = None
        self.writer_shape = None  # common shape of the current shard, "mixed", or None if empty
        # The pack id is the run's key: the same for a resumed run and for any worker count (so
        # output stays byte-identical), different whenever the output would differ.
        self.pack_id = key[:32]

    # -- journal / shards

    def _journal(self) -> None:
        _write_journal(
            self.jpath,
            {
                "name": self.jpath.name,
                "key": self.key,
                "shards": [e.__dict__ for e in self.entries],
                "ends": self.ends,
                "skipped": [[pos, s.__dict__] for pos, s in self.skipped],
                "shapes": self.shapes,
                "stamps": self.stamps,
            },
        )

    def _open_writer(self) -> None:
        from .storage import make_shard_writer

        name = shard_name(self.cfg.backend, self.cfg.part, self.cfg.parts, len(self.entries))
        self.writer = make_shard_writer(self.cfg.backend, self.dest / name, shard_size=self.cfg.shard_size,
                                        pack_id=self.pack_id)
        self.writer_shape = None

    def _finish_shard(self) -> None:
        entry = self.writer.finish()
        self.writer = None
        self.entries.append(entry)
        self.ends.append(self.position)
        self.shapes.append(self.writer_shape)
        self.stamps.append(stamps_digest(self.shard_stamps))
        self.shard_stamps = []
        self._journal()

    def _write_index(self) -> ShardEntry:
        """The part's index file, from its finished shards (before the manifest, which lists it)."""
        from .storage import ShardIndex, make_shard_reader

        name = index_name(part_prefix(self.cfg.part, self.cfg.parts))
        index = ShardIndex.concat(
            make_shard_reader(self.cfg.backend, self.dest / e.file, e.num_samples).read_index() for e in self.entries
        )
        if self.cfg.backend == "lmdb":
            from .storage.lmdb_backend import with_record_locations

            index = with_record_locations(index, [(self.dest / e.file, e.num_samples) for e in self.entries])
        size, digest = write_index_file(self.dest / name, index, pack_id=self.pack_id)
        return ShardEntry(file=name, num_samples=len(index), bytes=size, sha256=digest)

    def _tmp_size(self) -> int:
        try:
            return self.writer.tmp_path.stat().st_size if self.writer is not None else 0
        except OSError:
            return 0

    def _remove_own_tmp(self) -> None:
        own = _own_patterns(self.cfg.part, self.cfg.parts)
        try:
            names = os.listdir(self.dest)
        except OSError:
            return
        _remove(self.dest / n for n in names if n.endswith(("tmp", "tmp-lock")) and _matches(n, own))

    def _abort_writer(self) -> None:
        if self.writer is not None:
            try:
                self.writer.abort()
            finally:
                self.writer = None

    # -- main loop

    def execute(self) -> None:
        try:
            self._journal()
            self._loop()
            if self.writer is not None and len(self.writer):
                self._finish_shard()
            if self.packed == 0 and self.skipped:
                raise PackError(
                    f"{self.listing.base}: none of the {len(self.skipped)} inputs could be read "
                    f"(first: {self.skipped[0][1].path}: {self.skipped[0][1].reason})"
                )
            index = self._write_index()
            write_manifest(self.dest / manifest_name(self.cfg.part, self.cfg.parts), self._manifest(index))
            self.jpath.unlink(missing_ok=True)
        except BaseException as exc:
            tmp_size = self._tmp_size()
            self._abort_writer()
            self._remove_own_tmp()  # an interrupt can land between creating a file and tracking it
            if isinstance(exc, Exception) and not isinstance(exc, FastloadError):
                err = _write_failure(exc, self.dest, tmp_size)
                if err is not None:
                    raise err from None
            raise

    def _loop(self) -> None:
        cfg, listing = self.cfg, self.listing
        enc = _Encoding(
            base=str(listing.base), payload=cfg.payload, quality=cfg.quality,
            restart_markers=cfg.restart_markers, resize=cfg.resize, size=cfg.size,
            max_file_size=cfg.max_file_size,
        )
        first = self.start + self.position
        relpaths = listing.iter_relpaths(first, self.stop)
        labels = listing.labels[first : self.stop]
        todo = self.stop - first
        workers = min(cfg.workers or usable_cpus(), max(1, todo))
        fn = functools.partial(_process, enc)
        bar = _progress(cfg, total=self.stop - self.start, initial=self.position)
        pool = feeder = None
        finished = False
        try:
            if workers <= 1:
                results = map(fn, relpaths)
            else:
                chunk = max(1, min(16, todo // (workers * 8)))
                feeder = _Feeder(relpaths, window=workers * chunk * 8)
                pool = multiprocessing.get_context().Pool(workers, initializer=_init_worker, initargs=(os.getpid(),))
                results = pool.imap(fn, feeder, chunksize=chunk)
            for relpath, label, (payload, info, stamp) in zip(listing.iter_relpaths(first, self.stop), labels, results):
                if feeder is not None:
                    feeder.consumed()
                self._take(relpath, int(label), payload, info, stamp)
                if bar is not None:
                    bar.update(1)
            finished = True
        finally:
            if bar is not None:
                bar.close()
            if feeder is not None:
                feeder.stop()
            if pool is not None:
                # Every task done: let the workers exit on their own. terminate() is for an
                # error or Ctrl-C only: it races with the pool's own thread, which can start a
                # replacement for a worker it sees die after terminate() has signalled them
                # all, and join() then waits for that worker forever.
                if finished:
                    pool.close()
                else:
                    pool.terminate()
                pool.join()

    def _take(self, relpath: str, label: int, payload: bytes | None, info, stamp: tuple[int, int]) -> None:
        pos = self.position
        if payload is None:
            if self.cfg.on_error is OnError.FAIL:
                raise PackError(f"{shown(self.listing.resolve(relpath))}: {info}; {_SKIP_HINT}")
            log.warning("skipped %s: %s", shown(relpath), info)
            self.skipped.append((pos, SkippedInput(path=relpath, reason=str(info))))
            self.shard_stamps.append(stamp)
            self.position = pos + 1
            return
        if self.writer is not None and len(self.writer) and self.writer.payload_bytes + len(payload) > self.cfg.shard_size:
            self._finish_shard()  # the cap holds: this record starts the next shard
        if self.writer is None:
            self._open_writer()
        shape = tuple(int(s) for s in info)
        self.writer.append(payload, label=label, shape=shape, path=relpath)
        self.shard_stamps.append(stamp)
        if self.writer_shape is None:
            self.writer_shape = list(shape)
        elif self.writer_shape != "mixed" and self.writer_shape != list(shape):
            self.writer_shape = "mixed"
        self.packed += 1
        self.position = pos + 1
        if self.writer.payload_bytes >= self.cfg.shard_size:
            self._finish_shard()

    def _manifest(self, index: ShardEntry) -> Manifest:
        image_shape = None
        if self.shapes and isinstance(self.shapes[0], list) and all(s == self.shapes[0] for s in self.shapes):
            image_shape = tuple(self.shapes[0])
        return Manifest(
            backend=self.cfg.backend,
            payload=self.cfg.payload,
            num_samples=self.packed,
            classes=tuple(self.listing.classes),
            shards=tuple(self.entries),
            image_shape=image_shape,
            options=self.cfg.output_options(),
            skipped=self.scan_skipped + tuple(s for _, s in self.skipped),
            part=self.cfg.part,
            parts=self.cfg.parts,
            source_count=self.listing.total,
            source=str(Path(self.listing.base).resolve()),
            index=index,
            pack_id=self.pack_id,
        )


def _pack_to_url(source, url: str, cfg: PackConfig, *, storage_options, endpoint_url, staging) -> PackSummary:
    """Pack one part locally, upload it, remove the staging copy (see :func:`pack`)."""
    from .storage.remote import RemoteStore
    from .storage.remote_pack import remove_staging, staging_dir, upload_pack

    t0 = time.perf_counter()
    url = url.rstrip("/")
    store = RemoteStore(url, storage_options=storage_options, endpoint_url=endpoint_url)
    mname = manifest_name(cfg.part, cfg.parts)
    if store.head(mname) is not None:
        if not cfg.overwrite:
            raise PackError(f"{url}: already holds a finished pack ({mname}); use --overwrite to replace it")
        store.delete(mname)  # from here on the remote pack no longer looks complete
    local = Path(staging) if staging is not None else staging_dir(url, cfg.part, cfg.parts)
    if (local / mname).exists() and not _staged_for(local / mname, source, cfg):
        remove_staging(local)
    local.parent.mkdir(parents=True, exist_ok=True)
    if (local / mname).exists():  # packed by an earlier run whose upload was interrupted
        summary = None
    else:
        summary = pack(source, local, config=cfg)
    manifest = read_manifest(local / mname)
    if cfg.overwrite:  # objects of an earlier pack of this part that the new one does not have
        own = _own_patterns(cfg.part, cfg.parts)
        keep = {e.file for e in manifest.shards} | ({manifest.index.file} if manifest.index else set())
        for key, _ in store.list():
            if "/" not in key and _matches(key, own) and key not in keep and key != mname:
                store.delete(key)
    upload_pack(local, store, part=cfg.part, parts=cfg.parts)
    remove_staging(local)
    return PackSummary(
        packed=manifest.num_samples,
        skipped=len(manifest.skipped),
        bytes=manifest.total_bytes,
        seconds=time.perf_counter() - t0,
        dest=url,  # type: ignore[arg-type]
        manifest=f"{url}/{mname}",  # type: ignore[arg-type]
        shards=len(manifest.shards),
        resumed_from=summary.resumed_from if summary is not None else manifest.source_count,
    )


def _staged_for(mpath: Path, source, cfg: PackConfig) -> bool:
    """Whether the finished staging pack at ``mpath`` was made from ``source`` with ``cfg``."""
    try:
        m = read_manifest(mpath)
    except FastloadError:
        return False
    src = Path(source)
    base = src.parent if src.is_file() else src
    return (m.options == cfg.output_options() and m.source == str(base.resolve())
            and (m.backend, m.payload, m.part, m.parts) == (cfg.backend, cfg.payload, cfg.part, cfg.parts))


def _progress(cfg: PackConfig, *, total: int, initial: int):
    if not cfg.progress or not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, unit="img", desc="packing", file=sys.stderr, smoothing=0.1)


def _write_failure(exc: Exception, dest: Path, tmp_size: int) -> PackError | None:
    """A one-line PackError for a failed write (full disk above all), or None if not one."""
    text = str(exc).lower()
    from_lmdb = type(exc).__module__.startswith("lmdb")
    full = (isinstance(exc, OSError) and exc.errno in _DISK_FULL) or any(t in text for t in _DISK_FULL_TEXT)
    io_error = (isinstance(exc, OSError) and exc.errno == errno.EIO) or (from_lmdb and "input/output error" in text)
    if io_error and not full:
        # LMDB turns a short write (what a full disk or a file-size limit gives) into EIO.
        full = _looks_full(dest, tmp_size)
    # One line whatever the library gave (h5py's messages carry HDF5's error stack).
    why = " ".join(str(getattr(exc, "strerror", None) or exc).split())
    if full:
        return PackError(
            f"{dest}: disk full while writing ({why}); free space and rerun the same command to resume"
        )
    if io_error or from_lmdb:
        return PackError(f"{dest}: writing a shard failed ({why}); rerun the same command to resume")
    return None


def _looks_full(dest: Path, tmp_size: int) -> bool:
    import resource

    try:
        st = os.statvfs(dest)
        if st.f_bavail * st.f_frsize < (16 << 20):
            return True
    except OSError:
        pass
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    return soft != resource.RLIM_INFINITY and tmp_size >= soft - 65536


def human_bytes(n: float) -> str:
    """A byte count for people: 1.5 MiB (shared by pack summaries and inspect)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover
