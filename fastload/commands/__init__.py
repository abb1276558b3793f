"""One module per CLI sub-command; each defines ``register(subparsers)``.

A sub-command module sets ``run=`` on its parser via ``set_defaults``; heavy imports happen
inside ``run`` so ``fastload --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import re

# Order is the order in `fastload --help`.
COMMANDS = ("pack", "inspect", "verify", "demo", "bench", "info")
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def register_all(subparsers: argparse._SubParsersAction) -> None:
    """Add every sub-command's parser to ``subparsers``, in :data:`COMMANDS` order."""
    for name in COMMANDS:
        importlib.import_module(f".{name}", __name__).register(subparsers)


def location(text: str) -> str:
    """An argparse ``type`` for SRC/DEST: a local path or a URL fastload can use, as typed.

    ``ftp://x/y`` or ``hdfs://...`` would otherwise be taken for a relative local path (and
    ``fastload pack`` would create a folder named ``ftp:``): refuse such schemes up front.
    """
    m = _URL.match(text)
    if m and m.group(1).lower() != "file":
        from ..storage.remote import URL_SCHEMES

        if m.group(1).lower() not in URL_SCHEMES:
            raise argparse.ArgumentTypeError(
                f"{text}: fastload does not support {m.group(1)}:// URLs; use a local path, file://, "
                "s3://, gs:// or az://")
    return text


def add_remote_args(p: argparse.ArgumentParser, *, cache: bool = True) -> None:
    """Options for a DEST that is a URL (s3://, gs://, az://): the store and the shard cache."""
    g = p.add_argument_group("object storage (DEST is a URL)")
    g.add_argument("--endpoint-url", default=None, metavar="URL",
                   help="S3-compatible endpoint (MinIO, SeaweedFS, R2...); credentials come from the environment")
    g.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE",
                   help="an obstore option (region, access_key_id, skip_signature...); repeatable")
    if cache:
        g.add_argument("--cache-dir", default=None, metavar="DIR",
                       help="node-local shard cache (default $FASTLOAD_CACHE_DIR or ~/.cache/fastload)")


def remote_kwargs(args: argparse.Namespace) -> dict:
    """``storage_options``/``endpoint_url`` (and ``cache_dir``) from :func:`add_remote_args` options."""
    options = {}
    for item in args.storage_option:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--storage-option wants KEY=VALUE, got {item!r}")
        options[key.strip()] = value
    out = {"storage_options": options or None, "endpoint_url": args.endpoint_url}
    if hasattr(args, "cache_dir"):
        out["cache_dir"] = args.cache_dir
    return out
