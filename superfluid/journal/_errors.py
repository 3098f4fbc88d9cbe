"""Journal errors. Log damage is :class:`~superfluid.proto.WalCorrupt`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..proto._wal import WalCorrupt

if TYPE_CHECKING:
    from pathlib import Path

__all__ = ["JournalClosed", "JournalError", "JournalLocked", "JournalWriteError", "SessionStateError", "WalCorrupt"]


class JournalError(Exception):
    """Base class of the session journal's own errors."""


class JournalLocked(JournalError):
    """Another server holds ``<dir>/serve.lock``."""

    def __init__(self, directory: Path, pid: int | None) -> None:
        self.directory = directory
        self.pid = pid
        holder = f"pid {pid}" if pid is not None else "another process"
        super().__init__(
            f"sessions directory {directory} is in use by another superfluid server ({holder} holds "
            f"{directory / 'serve.lock'}); stop that server or pass a different --sessions directory"
        )

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.directory, self.pid))


class JournalClosed(JournalError):
    """The journal was closed; it accepts no more records."""


class JournalWriteError(JournalError):
    """A write or fsync of ``wal.log`` failed. The journal then refuses every
    later append until its probe finds the disk writable again (see
    :class:`~superfluid.journal.Journal`). ``errno`` is the failure's
    (``ENOSPC``, ``EDQUOT``, ``EIO``...), None if unknown."""

    def __init__(self, message: str, *, errno: int | None = None) -> None:
        super().__init__(message)
        self.errno = errno

    @property
    def out_of_space(self) -> bool:
        import errno

        return self.errno in (errno.ENOSPC, errno.EDQUOT)


class SessionStateError(JournalError):
    """An append that breaks a session's rules: the first event must be
    ``Created``, a session is created once, and a finished session takes no
    more events."""
