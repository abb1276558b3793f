"""``fastload pack SRC DEST``: convert an ImageFolder tree or a CSV/TSV into shards."""

from __future__ import annotations

import argparse
import logging
import re
import sys

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b)?\s*$", re.I)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_bytes(text: str) -> int:
    """'1G' -> 1073741824; accepts K/M/G/T (binary) with optional B/iB; rejects <= 0."""
    m = _SIZE_RE.match(text)
    if not m:
        raise argparse.ArgumentTypeError(f"invalid size {text!r} (examples: 1G, 512M, 100000)")
    value = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive, got {text!r}")
    return value


def parse_hw(text: str) -> tuple[int, int]:
    """'224x224' -> (224, 224) (height x width)."""
    m = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", text)
    if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: expected HxW with positive integers, e.g. 224x224")
    return int(m.group(1)), int(m.group(2))


def parse_part(text: str) -> tuple[int, int]:
    """'3/8' -> (3, 8): 0-based part I of N."""
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"invalid part {text!r}: expected I/N with 0 <= I < N, e.g. 0/4")
    i, n = int(m.group(1)), int(m.group(2))
    if n < 1 or i >= n:
        raise argparse.ArgumentTypeError(f"invalid part {text!r}: need 0 <= I < N (I is 0-based)")
    if n > 99999:
        raise argparse.ArgumentTypeError(f"invalid part {text!r}: at most 99999 parts")
    return i, n


def _positive_int(name: str):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {text!r}") from None
        if v < 1:
            raise argparse.ArgumentTypeError(f"{name} must be >= 1, got {v}")
        return v

    return parse


def _quality(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"quality must be an integer in 1..100, got {text!r}") from None
    if not 1 <= v <= 100:
        raise argparse.ArgumentTypeError(f"quality must be in 1..100, got {v}")
    return v


def register(subparsers) -> None:
    from . import add_remote_args, location

    p = subparsers.add_parser(
        "pack",
        help="pack an image folder or CSV into LMDB/HDF5 shards",
        description="Pack an ImageFolder tree (SRC/<class>/<image>) or a CSV/TSV of path,label rows "
        "into shards plus a manifest.json. Rerun the same command to resume an interrupted pack.",
    )
    p.add_argument("src", type=location, metavar="SRC", help="ImageFolder directory, or CSV/TSV file of path,label rows")
    p.add_argument("dest", type=location, metavar="DEST", help="output directory, or an s3://, gs://, az:// URL")
    p.add_argument("--format", dest="backend", choices=("lmdb", "hdf5"), default="lmdb", help="shard format (default lmdb)")
    p.add_argument("--payload", choices=("jpeg", "bmp", "png", "raw", "original"), default="jpeg",
                   help="record encoding (default jpeg)")
    p.add_argument("--quality", type=_quality, default=90, help="JPEG quality 1..100 (default 90)")
    p.add_argument("--no-restart-markers", dest="restart_markers", action="store_false",
                   help="jpeg payload without restart markers: ~2-6%% smaller and ~8%% faster to decode "
                   "whole, but crops decode ~17%% slower with fastload's turbo-crop decoder")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--resize", type=_positive_int("--resize"), metavar="N", help="resize the shorter side to N pixels")
    g.add_argument("--size", type=parse_hw, metavar="HxW", help="resize and center-crop to exactly HxW")
    p.add_argument("--shard-size", type=parse_bytes, default=1 << 30, metavar="BYTES",
                   help="cap on the payload bytes of each shard, e.g. 512M, 1G (default 1G): a shard ends "
                   "before the record that would pass the cap, and a single record larger than the cap gets "
                   "a shard of its own. The file is larger by the index and the format's overhead: ~1%% for "
                   "HDF5 with photos; LMDB stores each record over ~2 KB in whole 4 KiB pages (with 25 KB "
                   "JPEGs, LMDB files come out up to ~15%% over the cap)")
    p.add_argument("--max-file-size", type=parse_bytes, default=256 << 20, metavar="BYTES",
                   help="skip (and list in the manifest) source files larger than this, never reading "
                   "them (default 256M)")
    p.add_argument("--workers", type=_positive_int("--workers"), default=None, metavar="N",
                   help="encoding processes (default: all cores)")
    p.add_argument("--part", type=parse_part, default=(0, 1), metavar="I/N",
                   help="pack only part I (0-based) of N: the I-th of N equal contiguous ranges of the "
                   "inputs in order (run the N jobs into one DEST; a CSV part keeps only its own rows)")
    p.add_argument("--on-error", choices=("skip", "fail"), default="skip",
                   help="skip unreadable images (listed in the manifest) or stop at the first one")
    p.add_argument("--overwrite", action="store_true", help="replace an existing pack in DEST")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar, no warnings")
    p.add_argument("--staging", default=None, metavar="DIR",
                   help="with a URL DEST: where to pack before uploading (default: under the fastload cache dir)")
    add_remote_args(p, cache=False)
    p.set_defaults(run=run, _parser=p)


def run(args) -> int:
    from ..config import OnError, PackConfig
    from ..pack import pack
    from . import remote_kwargs

    try:
        cfg = PackConfig(
            backend=args.backend, payload=args.payload, quality=args.quality,
            restart_markers=args.restart_markers, resize=args.resize,
            size=args.size, shard_size=args.shard_size, workers=args.workers,
            part=args.part[0], parts=args.part[1], on_error=OnError(args.on_error),
            overwrite=args.overwrite, progress=not args.quiet, max_file_size=args.max_file_size,
        )
        remote = remote_kwargs(args)
    except ValueError as exc:
        args._parser.error(str(exc))  # exits 2 with the usage line, like any bad option
    _log_to_stderr(quiet=args.quiet)
    summary = pack(args.src, args.dest, config=cfg, staging=args.staging, **remote)
    # a terminal that cannot show every character of DEST gets escapes, not a traceback
    enc = sys.stdout.encoding or "utf-8"
    print(summary.line().encode(enc, "backslashreplace").decode(enc, "replace"))
    return 0


def _log_to_stderr(*, quiet: bool) -> None:
    log = logging.getLogger("fastload")
    if not any(getattr(h, "_fastload_cli", False) for h in log.handlers):
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter("fastload pack: warning: %(message)s"))
        h._fastload_cli = True
        log.addHandler(h)
        log.propagate = False
    log.setLevel(logging.ERROR if quiet else logging.WARNING)
