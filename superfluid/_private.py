"""What stays private: files only the daemon's user may read (the sessions directory, with
every prompt and completion, and the models cache directory), and the credentials a child
process (a worker, a runtime's check) never inherits.

Modes are passed to ``os.open``/``os.mkdir`` so a file or directory never exists with
looser ones (the umask can only take bits away)."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

__all__ = ["CREDENTIAL_RE", "DIR_MODE", "FILE_MODE", "fsync_dir", "make_private_dir", "scrub_env"]

DIR_MODE = 0o700
FILE_MODE = 0o600


def fsync_dir(directory: Path) -> None:
    """fsync ``directory`` itself: a file created, renamed or removed in it is durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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


# *_TOKEN, *_KEY (API, access, private, signing... keys), *_CREDENTIALS, and anything naming a
# password or a secret (SUPERFLUID_API_KEY included)
CREDENTIAL_RE = re.compile(r"((^|_)(TOKEN|API_?KEY|KEY|CREDENTIALS?)$)|PASSWORD|PASSWD|SECRET", re.I)


def scrub_env(environ: Mapping[str, str]) -> dict[str, str]:
    """Everything but credential-named variables."""
    return {k: v for k, v in environ.items() if not CREDENTIAL_RE.search(k)}
