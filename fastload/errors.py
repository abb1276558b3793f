"""Exceptions fastload raises on bad input, so callers (and the CLI) can tell them from bugs."""

from __future__ import annotations


class FastloadError(Exception):
    """Base class: a user-facing problem with input, options or files. The CLI prints it as one line."""


class PackError(FastloadError):
    """Packing cannot go on (bad source, bad options, existing destination, full disk...)."""


class FormatError(FastloadError):
    """A packed directory is missing, incomplete, corrupt, or of a version we cannot read."""


class CorruptRecordError(FormatError):
    """A record's bytes, or its label or shape in the index, differ from what was packed (its
    stored checksum does not match). ``detail``: the message without the record's name, for a
    caller that names the record its own way."""

    def __init__(self, message: str, *, detail: str = ""):
        super().__init__(message)
        self.detail = detail or message


class DecodeError(FastloadError):
    """A payload (or a source image) could not be decoded."""


class MissingDependencyError(FastloadError, ImportError):
    """An optional dependency is needed for this feature; the message says what to install."""


class PerformanceWarning(UserWarning):
    """fastload fell off a fast path (the message says why and what to do)."""


# How to get the C extensions when pip skipped them (no compiler or libjpeg-turbo headers at install).
BUILD_EXTENSIONS = ("apt-get install gcc libjpeg62-turbo-dev && pip install -e . "
                    "(or rerun bash tools/install.sh)")
_NOT_BUILT_ENV = "FASTLOAD_WARNED_NOT_BUILT"  # names already warned about, inherited by spawned workers
_said_not_built: set[str] = set()


def warn_not_built(extension: str, fallback: str, *, stacklevel: int = 3) -> None:
    """Say once per process tree that ``fastload.<extension>`` was not built and ``fallback``
    does its work (slower), with the command that builds it. Called where the fallback is
    first taken, not at import: a user who never takes that path hears nothing."""
    if extension in _said_not_built:  # the per-sample fallback calls this: keep it one set lookup
        return
    _said_not_built.add(extension)
    import os
    import warnings

    seen = os.environ.get(_NOT_BUILT_ENV, "").split(",")
    if extension in seen:
        return
    os.environ[_NOT_BUILT_ENV] = ",".join([*filter(None, seen), extension])
    warnings.warn(f"fastload.{extension} (a C extension) was not built, so {fallback}: {BUILD_EXTENSIONS}",
                  PerformanceWarning, stacklevel=stacklevel)


def require(module: str, pip_name: str, feature: str):
    """Import an optional dependency where it is used, or raise an error naming the pip package."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise MissingDependencyError(
            f"{feature} needs the '{module}' module: pip install {pip_name} ({exc})"
        ) from exc
