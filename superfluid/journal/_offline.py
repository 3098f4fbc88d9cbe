"""Reading a sessions directory's log without a daemon (``superfluid session inspect|export``).

Read-only and lock-free, so it is safe beside a running daemon: it never
takes ``serve.lock``, never repairs or truncates, and opens ``wal.log`` once
(a compaction renames a new file over it; the open descriptor keeps reading
the complete old one). A record the daemon is appending at that moment is
a torn tail to this reader and ends the read: what it shows is the log as
committed when it was opened. :func:`holder` says which daemon, if any,
holds the directory.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from pathlib import Path
from typing import Any

import attrs

from ..proto._wal import WalEnd
from ._errors import WalCorrupt
from ._files import LOCK_NAME, WAL_NAME, LogState, _replay
from ._sessionlog import SessionLog

__all__ = ["OfflineLog", "holder", "read_log", "session_summary"]


@attrs.frozen(kw_only=True)
class OfflineLog:
    directory: Path
    sessions: dict[str, SessionLog]
    epoch: int            # the newest epoch in the log (a session of an older one was cut by a restart)
    end: WalEnd
    holder: int | None    # pid of the daemon holding the directory, if one does


def holder(directory: Path) -> int | None:
    """The pid of the daemon that holds ``directory``'s lock; None if none does (0 if the pid is unknown)."""
    try:
        fd = os.open(directory / LOCK_NAME, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
            text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
            return int(text) if text.isdigit() else 0
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def read_log(directory: Path, *, max_record_size: int = 64 << 20) -> OfflineLog:
    """Replay ``directory/wal.log`` read-only.

    Raises:
        FileNotFoundError: no session log there.
        WalCorrupt: a damaged record before the end (path named).
        OSError: it cannot be read.
    """
    path = directory / WAL_NAME
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        state = LogState()
        try:
            end = _replay(fd, state, max_record_size=max_record_size)
        except WalCorrupt as exc:
            raise exc.with_path(str(path)) from None
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)
    return OfflineLog(directory=directory, sessions=state.sessions, epoch=state.epoch, end=end,
                      holder=holder(directory))


def state_of(slog: SessionLog, epoch: int, *, live: bool = False) -> str:
    """``generating`` (live), ``interrupted`` (cut by a restart; a resumable one resumes at the next start),
    ``open``, ``finished``, ``cancelled``, ``failed``, ``conversation`` or ``purged`` (a deleted conversation
    the log still holds until its next compaction)."""
    if slog.conversation is not None:
        if slog.done:
            return "purged"
        return "generating" if slog.open_turn >= 0 and live else "conversation"
    if slog.finish is None:
        if live:
            return "generating"
        return "interrupted" if slog.epoch < epoch else "open"
    if slog.finish == "cancelled":
        return "cancelled"
    return "failed" if slog.error else "finished"


def session_summary(slog: SessionLog, epoch: int, *, live: bool = False) -> dict[str, Any]:
    """What ``GET /v1/sessions`` and ``session inspect`` report of one session (no content)."""
    head = slog.conversation if slog.conversation is not None else (slog.created or {})
    params = (slog.created or {}).get("params") or {}
    out: dict[str, Any] = {
        "id": slog.session.rpartition("/")[2], "object": "session",
        "kind": "conversation" if slog.conversation is not None else str(params.get("kind", "chat")),
        "state": state_of(slog, epoch, live=live), "model": head.get("model"),
        "created": slog.first_ts // 1000, "updated": slog.last_ts // 1000,
        "events": slog.event_count, "last_event_id": slog.last_event_id,
    }
    if slog.conversation is None:
        out.update(prompt_tokens=len(slog.prompt_tokens), completion_tokens=len(slog.generated_tokens),
                   finish_reason=slog.finish, qos=(slog.created or {}).get("klass"),
                   resumable=bool(params.get("resumable")))
    else:
        out["open_turn"] = slog.open_turn if slog.open_turn >= 0 else None
    return out
