"""The ``fastload`` command line: argparse front-ends that call the library.

Every user error (a FastloadError or an OSError) is printed as one line on stderr with a
non-zero exit code; a traceback means a bug in fastload.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import sys

from . import __version__
from .errors import FastloadError

EXIT_USAGE = 2
EXIT_ERROR = 1
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, what a shell reports for a tool killed by it


class _OneLineErrors(argparse.ArgumentParser):
    """argparse, but a usage error is one line (plus a hint), not the whole usage block.

    Sub-command parsers are this class too (argparse makes them of the parent's class), so a
    bad value points to ``fastload pack --help``; :func:`main` sends unknown options there too.
    """

    def error(self, message: str):
        m = _INVALID_CHOICE.search(message)
        if m:  # `--format hdf` or `fastload pakc`: name the nearest choice
            message += _did_you_mean(m.group(1), _QUOTED.findall(m.group(2)))
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


_INVALID_CHOICE = re.compile(r"invalid choice: '([^']*)' \(choose from (.*)\)")
_QUOTED = re.compile(r"'([^']*)'")


def _did_you_mean(word: str, candidates: list[str]) -> str:
    # Compared without leading dashes: every option shares "--", which would make "--zz" look like "--size".
    names = {c.lstrip("-"): c for c in candidates}
    close = difflib.get_close_matches(word.lstrip("-"), list(names), n=1, cutoff=0.6)
    return f"; did you mean {names[close[0]]}?" if close else ""


def _unknown_arguments(parser: argparse.ArgumentParser, extra: list[str]) -> str:
    """``unrecognized arguments: --fromat hdf5; did you mean --format?`` for ``parser``'s options."""
    options = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
    hints = [_did_you_mean(w.split("=", 1)[0], options) for w in extra if w.startswith("-")]
    return f"unrecognized arguments: {' '.join(extra)}" + next(filter(None, hints), "")


def build_parser() -> argparse.ArgumentParser:
    p = _OneLineErrors(prog="fastload", description="Fast image data loading for PyTorch.")
    p.add_argument("--version", action="version", version=f"fastload {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
    # Each sub-command module adds its own parser and a `run(args) -> int`.
    from .commands import register_all

    register_all(sub)
    return p


def _subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[command]
    return parser  # pragma: no cover - build_parser always adds sub-commands


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # point to the sub-command's help, not the top level's
        sub = _subparser(parser, args.command)
        sub.error(_unknown_arguments(sub, extra))
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
