"""Files only the daemon's user may read: the sessions directory (every prompt and
completion) and the models cache directory.

Modes are passed to ``os.open``/``os.mkdir`` so a file or directory never exists with
looser ones (the umask can only take bits away)."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["DIR_MODE", "FILE_MODE", "make_private_dir"]

DIR_MODE = 0o700
FILE_MODE = 0o600


def make_private_dir(directory: Path) -> None:
    """Create ``directory`` and any missing parent with mode 0700 (existing ones are left alone)."""
    missing = []
    while not directory.exists():
        missing.append(directory)
        if directory.parent == directory:
            break
        directory = directory.parent
    for path in reversed(missing):
        try:
            os.mkdir(path, DIR_MODE)
        except FileExistsError:
            pass  # made meanwhile by someone else: theirs, as it is
