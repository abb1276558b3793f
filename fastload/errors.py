"""Exceptions fastload raises on bad input, so callers (and the CLI) can tell them from bugs."""

from __future__ import annotations


class FastloadError(Exception):
    """Base class: a user-facing problem with input, options or files. The CLI prints it as one line."""


class PackError(FastloadError):
    """Packing cannot go on (bad source, bad options, existing destination, full disk...)."""


class FormatError(FastloadError):
    """A packed directory is missing, incomplete, corrupt, or of a version we cannot read."""


class DecodeError(FastloadError):
    """A payload (or a source image) could not be decoded."""


class MissingDependencyError(FastloadError, ImportError):
    """An optional dependency is needed for this feature; the message says what to install."""


def require(module: str, pip_name: str, feature: str):
    """Import an optional dependency where it is used, or raise an error naming the pip package."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise MissingDependencyError(
            f"{feature} needs the '{module}' module: pip install {pip_name} ({exc})"
        ) from exc
