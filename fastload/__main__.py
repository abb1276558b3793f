"""``python -m fastload`` is the ``fastload`` command."""

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
