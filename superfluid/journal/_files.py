"""Blocking file work for the journal. Everything here runs in a worker
thread (``trio.to_thread.run_sync``), never on the trio thread."""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import logging
import os
import stat
from typing import TYPE_CHECKING

import attrs

from .._private import DIR_MODE, FILE_MODE, make_private_dir
from ..proto._link import NEED_DATA
from ..proto._wal import (
    DAEMON_SESSION,
    MAGIC,
    WalCorrupt,
    WalEnd,
    WalReader,
    WalRecord,
    body_epoch_bump,
    encode_record,
)
from ._errors import JournalLocked
from ._sessionlog import SessionLog

if TYPE_CHECKING:
    from pathlib import Path

__all__ = [
    "COMPACT_NAME",
    "LOCK_NAME",
    "PREV_NAME",
    "WAL_NAME",
    "FaultInjector",
    "LogState",
    "Opened",
    "close_quietly",
    "faults",
    "open_log",
    "probe_space",
    "write_and_sync",
    "write_compacted",
]

log = logging.getLogger("superfluid.journal")

WAL_NAME = "wal.log"
LOCK_NAME = "serve.lock"
COMPACT_NAME = "wal.log.compact"
PREV_NAME = "wal.log.prev"
_CHUNK = 1 << 20


PROBE_NAME = ".space-probe"
PROBE_BYTES = 64 * 1024


@attrs.define
class FaultInjector:
    """A test hook in the file layer: while ``errno`` is set, every write of the log (appends,
    compactions, the recovery probe) fails with it before touching the disk, as a full disk
    (``ENOSPC``) or a failing one (``EIO``) would. Tests set :data:`faults` and reset it."""

    errno: int | None = None

    def check(self) -> None:
        if self.errno is not None:
            raise OSError(self.errno, os.strerror(self.errno))


faults = FaultInjector()


# ---- primitives -------------------------------------------------------------------


def _sync(fd: int, *, full: bool) -> None:
    # F_FULLFSYNC (macOS) also flushes the drive's write cache; os.fsync there does not.
    if full and hasattr(fcntl, "F_FULLFSYNC"):
        fcntl.fcntl(fd, fcntl.F_FULLFSYNC)
    else:
        os.fsync(fd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _tighten_modes(directory: Path) -> None:
    """Take group and other bits off ``directory`` and every file in it (a directory made
    by an older version, or by hand), with one warning naming what changed."""
    changed = []
    entries = [(directory, DIR_MODE)]
    entries += [(directory / name, FILE_MODE) for name in sorted(os.listdir(directory))]
    for path, mode in entries:
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode) or not stat.S_IMODE(st.st_mode) & 0o077:
            continue
        if path != directory and not stat.S_ISREG(st.st_mode):
            continue
        os.chmod(path, stat.S_IMODE(st.st_mode) & mode, follow_symlinks=False)
        changed.append(f"{path} ({stat.S_IMODE(st.st_mode):04o} -> {stat.S_IMODE(st.st_mode) & mode:04o})")
    if changed:
        log.warning("sessions directory: took group/other access off %s", ", ".join(changed))


def close_quietly(fd: int) -> None:
    if fd >= 0:
        with contextlib.suppress(OSError):
            os.close(fd)


def write_and_sync(fd: int, data: bytes, committed: int, *, full: bool) -> None:
    """Append ``data`` at ``committed`` (the end of the last good record) and
    make it durable. On failure, try to cut the file back to ``committed`` so
    a half-written batch is not left behind, then re-raise."""
    try:
        faults.check()
        _write_all(fd, data)
        _sync(fd, full=full)
    except OSError:
        with contextlib.suppress(OSError):
            os.ftruncate(fd, committed)
            os.lseek(fd, committed, os.SEEK_SET)
        raise


def probe_space(directory: Path, fd: int, committed: int, *, full: bool) -> None:
    """Does the disk take writes again? Cut ``wal.log`` back to ``committed`` (a failed batch
    may have left part of itself), then write, sync and remove a probe file of PROBE_BYTES.

    Raises:
        OSError: the disk still refuses.
    """
    faults.check()
    os.ftruncate(fd, committed)
    os.lseek(fd, committed, os.SEEK_SET)
    _sync(fd, full=full)
    path = directory / PROBE_NAME
    probe = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, FILE_MODE)
    try:
        _write_all(probe, bytes(PROBE_BYTES))
        _sync(probe, full=full)
    finally:
        os.close(probe)
        with contextlib.suppress(OSError):
            os.unlink(path)
    _fsync_dir(directory)


def _take_lock(directory: Path) -> int:
    fd = os.open(directory / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, FILE_MODE)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
        finally:
            os.close(fd)
        raise JournalLocked(directory, int(text) if text.isdigit() else None) from None
    except BaseException:
        os.close(fd)
        raise
    # the pid is informational (for JournalLocked); the flock is the lock
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


# ---- replay -------------------------------------------------------------------


@attrs.define(eq=False)
class LogState:
    """What the records of ``wal.log`` add up to."""

    sessions: dict[str, SessionLog] = attrs.field(factory=dict)
    epoch: int = 0
    seq: int = 0  # records applied to sessions (orders sessions for retention)
    records: int = 0  # records in the file
    duplicates: int = 0
    daemon_record: WalRecord | None = None  # the newest epoch bump

    def apply(self, record: WalRecord) -> None:
        self.records += 1
        self.epoch = max(self.epoch, record.epoch)
        if record.session == DAEMON_SESSION:
            if self.daemon_record is None or record.event_id > self.daemon_record.event_id:
                self.daemon_record = record
            return
        session = self.sessions.get(record.session)
        if session is None:
            session = self.sessions[record.session] = SessionLog(record.session)
        if session.apply(record, self.seq):
            self.seq += 1
        else:
            self.duplicates += 1
            log.warning("session log: skipped duplicate event %d of session %s", record.event_id, record.session)


def _replay(fd: int, state: LogState, *, max_record_size: int) -> WalEnd:
    os.lseek(fd, 0, os.SEEK_SET)
    reader = WalReader(max_record_size=max_record_size)
    while True:
        reader.receive_data(os.read(fd, _CHUNK))  # b"" at EOF
        while True:
            item = reader.next_record()
            if item is NEED_DATA:
                break
            if isinstance(item, WalEnd):
                return item
            assert isinstance(item, WalRecord)
            state.apply(item)


@attrs.define(eq=False, kw_only=True)
class Opened:
    """A locked, replayed, epoch-bumped log, ready to append to."""

    directory: Path
    lock_fd: int
    fd: int
    state: LogState
    size: int
    fsyncs: int
    replayed: int
    truncated: int
    moved_aside: Path | None


def _move_aside(path: Path, *, corrupt: bool) -> Path:
    if corrupt:
        for n in itertools.count(1):
            target = path.with_name(f"{path.name}.corrupt-{n}")
            if not target.exists():
                break
    else:
        target = path.with_name(PREV_NAME)
    os.replace(path, target)
    return target


def open_log(directory: Path, *, fresh: bool, max_record_size: int, full_fsync: bool, now_ms: int) -> Opened:
    """Lock ``directory``, replay ``wal.log``, repair a torn tail, and append
    an epoch bump. See :func:`superfluid.journal.open_journal` for the rules.

    Raises:
        JournalLocked, WalCorrupt, OSError.
    """
    make_private_dir(directory)
    lock_fd = _take_lock(directory)
    fd = -1
    try:
        _tighten_modes(directory)
        for leftover in (COMPACT_NAME, PROBE_NAME):  # a compaction that never reached its rename, a probe
            with contextlib.suppress(FileNotFoundError):
                os.unlink(directory / leftover)
        path = directory / WAL_NAME
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, FILE_MODE)
        state = LogState()
        moved: Path | None = None
        try:
            end = _replay(fd, state, max_record_size=max_record_size)
        except WalCorrupt as exc:
            if not fresh:
                raise exc.with_path(str(path)) from None
            os.close(fd)
            fd = -1
            moved = _move_aside(path, corrupt=True)
            log.warning("%s\n--sessions-cache: kept the damaged log as %s and started a fresh one",
                        exc.with_path(str(path)), moved)
        else:
            if fresh and end.size > len(MAGIC):
                os.close(fd)
                fd = -1
                moved = _move_aside(path, corrupt=False)
                log.info("--sessions-cache: kept the previous session log as %s and started a fresh one", moved)
        replayed = state.records
        truncated = 0
        if moved is not None:
            # a fresh log still fences the old one's epochs
            state = LogState(epoch=state.epoch, daemon_record=state.daemon_record)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, FILE_MODE)
            end = WalEnd(offset=0, size=0, torn=False)
        elif end.torn:
            truncated = end.size - end.offset
            log.warning("session log %s: %s; truncated %d bytes of torn tail at byte %d (nothing in it "
                        "was acknowledged)", path, end.reason, truncated, end.offset)
        fsyncs = 0
        if end.offset < len(MAGIC):
            os.ftruncate(fd, 0)
            os.lseek(fd, 0, os.SEEK_SET)
            _write_all(fd, MAGIC)
            _sync(fd, full=full_fsync)
            _fsync_dir(directory)
            fsyncs += 1
            size = len(MAGIC)
        else:
            if end.torn:
                os.ftruncate(fd, end.offset)
                _sync(fd, full=full_fsync)
                fsyncs += 1
            size = end.offset
            os.lseek(fd, size, os.SEEK_SET)
        previous = state.daemon_record
        bump = WalRecord(session=DAEMON_SESSION, event_id=0 if previous is None else previous.event_id + 1,
                         epoch=state.epoch + 1, ts=now_ms, body=body_epoch_bump())
        data = encode_record(bump)
        write_and_sync(fd, data, size, full=full_fsync)
        fsyncs += 1
        state.apply(bump)
        return Opened(directory=directory, lock_fd=lock_fd, fd=fd, state=state, size=size + len(data),
                      fsyncs=fsyncs, replayed=replayed, truncated=truncated, moved_aside=moved)
    except BaseException:
        close_quietly(fd)
        close_quietly(lock_fd)
        raise


# ---- compaction -------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class Compacted:
    fd: int
    size: int
    records: int
    dir_error: OSError | None  # the rename happened, but its directory fsync failed


def write_compacted(directory: Path, head: WalRecord, sessions: list[SessionLog], *,
                    full_fsync: bool, max_record_size: int) -> Compacted:
    """Write ``head`` and the sessions' records to a temp file, fsync it and
    rename it over ``wal.log``; then fsync the directory.

    The returned descriptor is positioned at the end, ready to append to.
    Before the rename any failure leaves ``wal.log`` untouched (and raises);
    after it the new file is the log, so it is returned even if the directory
    fsync failed (``dir_error``).
    """
    faults.check()
    tmp = directory / COMPACT_NAME
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, FILE_MODE)
    try:
        buf = bytearray(MAGIC)
        count = 0
        for session in itertools.chain(((head,),), (s.records() for s in sessions)):
            for record in session:
                buf += encode_record(record, max_record_size=max_record_size)
                count += 1
                if len(buf) >= _CHUNK:
                    _write_all(fd, bytes(buf))
                    buf.clear()
        _write_all(fd, bytes(buf))
        _sync(fd, full=full_fsync)
        size = os.lseek(fd, 0, os.SEEK_END)
        os.replace(tmp, directory / WAL_NAME)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    try:
        _fsync_dir(directory)
    except OSError as exc:
        return Compacted(fd=fd, size=size, records=count, dir_error=exc)
    return Compacted(fd=fd, size=size, records=count, dir_error=None)
