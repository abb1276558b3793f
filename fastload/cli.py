"""The ``fastload`` command line: argparse front-ends that call the library.

Every user error (a FastloadError or an OSError) is printed as one line on stderr with a
non-zero exit code; a traceback means a bug in fastload.
"""

from __future__ import annotations

import argparse
import os
import sys

from . import __version__
from .errors import FastloadError

EXIT_USAGE = 2
EXIT_ERROR = 1
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, what a shell reports for a tool killed by it


class _OneLineErrors(argparse.ArgumentParser):
    """argparse, but a usage error is one line (plus a hint), not the whole usage block."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _OneLineErrors(prog="fastload", description="Fast image data loading for PyTorch.")
    p.add_argument("--version", action="version", version=f"fastload {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
    # Each sub-command module adds its own parser and a `run(args) -> int`.
    from .commands import register_all

    register_all(sub)
    return p



def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except KeyboardInterrupt:
        hint = "; rerun the same command to resume" if args.command == "pack" else ""
        print(f"fastload {args.command}: interrupted{hint}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader went away (`fastload inspect DEST | head`): stop quietly, like any Unix tool.
        # Point stdout at /dev/null so Python's final flush does not complain again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except FastloadError as exc:
        print(f"fastload {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except OSError as exc:
        where = f" {exc.filename}:" if getattr(exc, "filename", None) else ""
        print(f"fastload {args.command}: error:{where} {exc.strerror or exc}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
