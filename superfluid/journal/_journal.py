"""The session journal: ``wal.log`` on disk, group-committed from trio.

Opening (:func:`open_journal`), in a worker thread:

1. Take ``<dir>/serve.lock`` (``flock``, non-blocking): one server per
   sessions directory; a second gets :class:`JournalLocked` naming the pid.
2. Replay ``wal.log``. A torn tail (a crash mid-write) is truncated with a
   warning; damage anywhere else raises :class:`~superfluid.proto.WalCorrupt`
   unless ``fresh=True`` (``--sessions-cache``), which keeps the damaged log
   as ``wal.log.corrupt-<n>`` (a healthy one as ``wal.log.prev``) and starts
   an empty log.
3. Append an ``epoch_bump`` with epoch = previous maximum + 1, so every
   record written from now on is distinguishable from (and fences) whatever
   was generating before the restart.

Appending (:meth:`Journal.append_many`) is a leader/follower group commit:
each call encodes its records and queues them (ids assigned in queue order),
then takes the commit lock; whoever holds the lock writes *everything*
queued with one ``write`` and one ``fsync``, so callers that queued while
an fsync was in flight share the next one. A small batch is written on the
event loop while the disk is fast (``JournalConfig.inline_sync_s``), else in
a thread. A call returns only
after its records are durable.

Retention (compaction), copied to SPEC.md:

    wal.log is rewritten when it reaches ``compact_at_bytes`` (default
    64 MiB). The rewrite keeps, in order of creation: the newest epoch bump;
    every session that is unfinished and was written to since this start, or
    that has records waiting to be written; the ``keep_interrupted`` (1000)
    most recently active unfinished sessions left over from earlier runs
    (they can still be resumed by id); the ``keep_finished`` (1000) most
    recently finished sessions; every conversation with a turn open; and the
    ``keep_conversations`` (10,000) most recently touched other conversations
    among those touched within ``conversation_ttl_s`` (30 days). Everything
    else (older finished sessions, older interrupted ones, conversations
    idle past the TTL or the count) is dropped from the file and from memory. Kept
    records are rewritten byte for byte (same ids, epochs and timestamps).
    The rewrite goes to ``wal.log.compact``, is fsynced, renamed over
    ``wal.log`` and the directory is fsynced, so a crash at any point leaves
    either the old or the new log, both complete. The next compaction
    happens at max(``compact_at_bytes``, 2 x the size after this one), so a
    large live set cannot make it run on every append. Appends wait while a
    compaction runs (one pause per ``compact_at_bytes`` written).

Durability: a record is durable when ``append_many`` returns. After a crash
replay recovers every such record; a torn tail can only hold records whose
``append_many`` had not returned.

A failed ``write``/``fsync`` (``ENOSPC``, ``EDQUOT``, ``EIO``...) fails the
records of its batch and makes the journal *degraded* (:attr:`Journal.degraded`
names why): it refuses every append (:class:`JournalWriteError`) while a probe
task in the journal's nursery retries the disk with back-off (``probe_backoff_s``
doubling up to ``probe_max_backoff_s``): it cuts ``wal.log`` back to its last
committed record, writes and syncs a probe file, and on success the journal
takes appends again, from its committed state (records of failed batches never
happened).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import trio

from ..proto._errors import LocalProtocolError
from ..proto._wal import (
    CONVERSATION, CONVERSATION_EVENTS, CREATED, DAEMON_SESSION, EPOCH_BUMP, MAX_RECORD_SIZE, PURGED, WalRecord, encode_record,
    ends_session,
)
from ..proto._wal_conversation import open_turn_after
from ._errors import JournalClosed, JournalWriteError, SessionStateError
from ._files import WAL_NAME, Opened, close_quietly, open_log, probe_space, write_and_sync, write_compacted

if TYPE_CHECKING:
    from ._sessionlog import SessionLog

__all__ = ["Journal", "JournalConfig", "JournalStatistics", "open_journal"]

log = logging.getLogger("superfluid.journal")

_MiB = 1024 * 1024
_CLOSING = -1  # in Journal._next_ids: the session's last event is queued, not yet committed


def _unix_ms() -> int:
    # Wall-clock time as record data (``ts``), never used to measure durations.
    return time.time_ns() // 1_000_000


INLINE_MAX_BYTES = 256 * 1024


def _timed_write(fd: int, data: bytes, committed: int, *, full: bool) -> float:
    """``write_and_sync`` (looked up at call time), returning how long it took."""
    t0 = time.perf_counter()
    write_and_sync(fd, data, committed, full=full)
    return time.perf_counter() - t0


@attrs.frozen(kw_only=True)
class JournalConfig:
    """Limits and policy of the session journal (see the module docstring)."""

    compact_at_bytes: int = 64 * _MiB
    keep_finished: int = 1000
    # also compact when this many finished generation sessions are in memory (at least 1.5 x
    # keep_finished): short requests fill memory long before 64 MiB of log (~1 KB of memory a short
    # finished session, packed). A compaction re-encodes every kept session (every 500 short requests:
    # ~5% of the daemon's time at 256 streams); at 2,500 it ran a third as often, but the daemon's
    # RSS keeps its high-water mark, and 20,000 requests ended +10.4% over the level after 1,000
    # (+6.6% at 1,500: the memory contract, bench/overhead.py --memory-requests).
    compact_at_finished: int = 1500
    keep_interrupted: int = 1000
    keep_conversations: int = 10_000  # at most this many idle conversations, the most recently touched...
    conversation_ttl_s: float = 30 * 86400.0  # ...and only those touched within this
    max_pending_bytes: int = 16 * _MiB  # queued, not yet written; appenders wait beyond it
    max_record_size: int = MAX_RECORD_SIZE
    full_fsync: bool = False  # F_FULLFSYNC where the platform has it (SUPERFLUID_FULLFSYNC)
    commit_shield_s: float = 60.0  # bound on the shielded write+fsync a lock holder does for others
    # a commit of at most INLINE_MAX_BYTES runs on the event loop while write+fsync has recently taken at
    # most this long (moving average); a slower disk gets a thread. 0: always a thread. See _commit_batch.
    inline_sync_s: float = 0.002
    close_timeout_s: float = 10.0
    probe_backoff_s: float = 0.25  # degraded (a write failed): first wait before probing the disk again...
    probe_max_backoff_s: float = 10.0  # ...doubling up to this
    # runs a commit handed to a thread: the daemon's CPU policy (superfluid/_cpu.py ``unyielding``) is
    # injected by the server, so the journal knows nothing of it
    in_thread: Callable[[Callable[[], float]], float] = attrs.field(default=lambda fn: fn(), eq=False)


@attrs.frozen(kw_only=True)
class JournalStatistics:
    epoch: int
    sessions: int  # in memory (= in the log)
    open_sessions: int  # of which unfinished
    records: int  # records in wal.log now
    appended: int  # records appended since open
    bytes: int  # size of wal.log
    fsyncs: int  # fsyncs of the log since open (epoch bump and compactions included)
    batches: int  # group commits: one write + one fsync each
    pending_records: int
    pending_bytes: int
    compactions: int
    replayed: int  # records read at open
    truncated_bytes: int  # torn tail cut at open


@attrs.define(eq=False)
class _Ticket:
    records: list[WalRecord]
    data: bytes
    taken: bool = False  # in a batch being (or already) written
    waiting: bool = False  # its caller is waiting as a follower (not cancelled)
    committed: bool = False
    error: BaseException | None = None

    @property
    def finished(self) -> bool:
        return self.committed or self.error is not None


class Journal:
    """An open session log. Made by :func:`open_journal`; not thread-safe
    (one trio run).

    Attributes:
        directory: the sessions directory.
        path: ``<directory>/wal.log``.
        epoch: this run's epoch (written by the opening epoch bump).
        sessions: session id -> :class:`SessionLog` of every retained session,
            updated as records commit. Read it; don't mutate it.
    """

    def __init__(self, opened: Opened, config: JournalConfig) -> None:
        self.config = config
        self._nursery: trio.Nursery | None = None  # runs the recovery probe (open_journal sets it)
        self._probing = False
        self.directory = opened.directory
        self.path = opened.directory / WAL_NAME
        self._fd = opened.fd
        self._lock_fd = opened.lock_fd
        self._state = opened.state
        self.sessions: dict[str, SessionLog] = self._state.sessions
        self.epoch = self._state.epoch
        # next event id of every session that may still be appended to
        self._next_ids = {sid: s.last_event_id + 1 for sid, s in self.sessions.items() if not s.done}
        # open turn (-1: none) of every conversation that may be appended to; marks conversations
        self._open_turns = {sid: s.open_turn for sid, s in self.sessions.items() if s.conversation is not None}
        self._finished = self._count_finished()
        self._finished_at = self._finished_limit()
        self._queue: list[_Ticket] = []
        self._pending_bytes = 0
        self._pending_records = 0
        self._space = trio.Event()
        self._leading = False  # some task is writing batches (the leader)
        self._batch_done = trio.Event()  # set (and replaced) after every batch
        self._size = opened.size
        self._compact_at = config.compact_at_bytes
        self._compact_requested = False
        self._closing = False
        self._closed = False
        self._broken: OSError | None = None
        self._fsyncs = opened.fsyncs
        self._batches = 0
        self._sync_avg_s = 0.0   # moving average of write+fsync, measured where it ran
        self._appended = 0
        self._compactions = 0
        self._replayed = opened.replayed
        self._truncated = opened.truncated

    # -- health ------------------------------------------------------------------

    @property
    def degraded(self) -> str | None:
        """Why the journal refuses appends (a write failed and the disk has not taken one
        since), or None when it is healthy."""
        if self._broken is None:
            return None
        return f"the session log cannot be written ({self._broken.strerror or self._broken})"

    def check_writable(self) -> None:
        """Raises :class:`JournalWriteError` while :attr:`degraded`."""
        if self._broken is not None:
            raise JournalWriteError(f"{self.path} failed earlier ({self._broken}); it takes no records until "
                                    "the disk takes writes again", errno=self._broken.errno)

    def _degrade(self, exc: OSError) -> None:
        self._broken = exc
        if self._nursery is not None and not self._probing and not self._closing:
            self._probing = True
            self._nursery.start_soon(self._probe)

    async def _probe(self) -> None:
        """While degraded: retry the disk with back-off until it takes a write again."""
        failures = 0
        try:
            await trio.lowlevel.checkpoint()  # a task that finds the log closing or mended already still yields once
            while self._broken is not None and not self._closing:
                failures += 1
                cfg = self.config
                await trio.sleep(min(cfg.probe_backoff_s * 2 ** (failures - 1), cfg.probe_max_backoff_s))
                if self._leading or self._queue:
                    continue  # records of before the failure are being failed: probe after them
                try:
                    await trio.to_thread.run_sync(partial(probe_space, self.directory, self._fd, self._size,
                                                          full=self.config.full_fsync))
                except OSError as exc:
                    log.debug("session log %s: still not writable (%s)", self.path, exc)
                    continue
                # from the committed state: the records of failed batches never happened
                self._next_ids = {sid: s.last_event_id + 1 for sid, s in self.sessions.items() if not s.done}
                self._open_turns = {sid: s.open_turn for sid, s in self.sessions.items()
                                    if s.conversation is not None}
                log.warning("session log %s: writable again after %s; taking appends again", self.path,
                            self._broken.strerror or self._broken)
                self._broken = None
        finally:
            self._probing = False

    def _count_finished(self) -> int:
        return sum(1 for s in self.sessions.values() if s.done and s.conversation is None)

    def _finished_limit(self) -> int:
        limit = self.config.compact_at_finished
        return max(limit, self.config.keep_finished * 3 // 2) if limit > 0 else 0

    def _too_many_finished(self) -> bool:
        return 0 < self._finished_at < self._finished

    # -- reading ------------------------------------------------------------------

    def interrupted(self) -> list[SessionLog]:
        """Unfinished sessions last written before this run (oldest first):
        generations cut off by a crash or restart, resumable from their log."""
        found = [s for s in self.sessions.values() if not s.done and s.conversation is None and s.epoch < self.epoch]
        return sorted(found, key=lambda s: s.last_seq)

    def statistics(self) -> JournalStatistics:
        return JournalStatistics(
            epoch=self.epoch,
            sessions=len(self.sessions),
            open_sessions=sum(not s.done for s in self.sessions.values()),
            records=self._state.records,
            appended=self._appended,
            bytes=self._size,
            fsyncs=self._fsyncs,
            batches=self._batches,
            pending_records=self._pending_records,
            pending_bytes=self._pending_bytes,
            compactions=self._compactions,
            replayed=self._replayed,
            truncated_bytes=self._truncated,
        )

    # -- appending ------------------------------------------------------------------

    async def append(self, session: str, body: Mapping[str, Any], *, ts: int | None = None) -> WalRecord:
        """Append one event; see :meth:`append_many`."""
        (record,) = await self.append_many([(session, body)], ts=ts)
        return record

    async def append_many(
        self, items: Iterable[tuple[str, Mapping[str, Any]]], *, ts: int | None = None
    ) -> list[WalRecord]:
        """Append ``(session, body)`` events and wait until they are durable.

        Records of one call are written contiguously, in order, with
        per-session event ids assigned here (0 for ``created``, then +1).
        Calls made while another call's fsync is in flight are written
        together by the next write and fsync (group commit).

        Args:
            items: ``(session id, event body)`` pairs; bodies as built by
                ``superfluid.proto.body_*``. Several sessions may be mixed
                (one tick's spans for all lanes).
            ts: unix ms for every record of this call (default: now).

        Returns:
            The committed records, with their event ids.

        Raises:
            ValueError: an invalid body or session id, or an oversized record.
            SessionStateError: the first event of a session is not
                ``created`` or ``conversation``, a session is created twice,
                a finished session gets another event, an event of a
                generation goes to a conversation or the other way round, or
                a conversation's turns are out of order (see
                ``open_turn_after``). Nothing of the call is queued.
            JournalWriteError: the write or fsync failed (the journal then
                refuses all further appends).
            JournalClosed: the journal is closing.

        Cancellation: a call cancelled before it queues its records (at its
        first checkpoint, or while waiting for room) writes nothing. Once
        queued, the records *will* be committed, in order, even if the caller
        is cancelled: by the leader of the moment, or by the cancelled caller
        itself under a bounded shield if nobody else is left to; the caller
        just stops waiting. :attr:`sessions` (``last_event_id``) shows what
        is committed.

        Resource handling: queued bytes are bounded by
        ``config.max_pending_bytes``; beyond it callers wait for room.
        """
        items = list(items)
        await trio.lowlevel.checkpoint_if_cancelled()
        self._check_usable()
        while self._pending_bytes >= self.config.max_pending_bytes:
            if self._leading:
                await self._space.wait()
            else:  # only orphaned records queued: write them to make room
                await self._lead()
            self._check_usable()
        if not items:
            # nothing to write: still a schedule point (the cancel point was checkpoint_if_cancelled)
            await trio.lowlevel.cancel_shielded_checkpoint()
            return []
        ticket = self._enqueue(items, _unix_ms() if ts is None else ts)
        await self._commit_through(ticket)
        if ticket.error is not None:
            if isinstance(ticket.error, JournalClosed):
                raise JournalClosed(str(ticket.error))
            raise JournalWriteError(f"writing {self.path} failed: {ticket.error}",
                                    errno=getattr(ticket.error, "errno", None)) from ticket.error
        return ticket.records

    async def compact(self) -> None:
        """Compact ``wal.log`` now, whatever its size (see the module docstring).

        Raises:
            JournalWriteError, JournalClosed: as for :meth:`append_many`.

        Cancellation: as for :meth:`append_many`: once started, the rewrite
        runs to its end.
        """
        await trio.lowlevel.checkpoint_if_cancelled()
        self._check_usable()
        self._compact_requested = True
        while self._leading:
            await self._batch_done.wait()
        if self._compact_requested:
            await self._lead()
        self._check_usable()

    def _check_usable(self) -> None:
        self.check_writable()
        if self._closing:
            raise JournalClosed(f"{self.path} is closed")

    def _enqueue(self, items: list[tuple[str, Mapping[str, Any]]], ts: int) -> _Ticket:
        """Validate, number and encode ``items`` and queue them as one ticket.
        Synchronous, so ids are assigned in queue order; all or nothing."""
        staged: dict[str, int] = {}
        turns: dict[str, int] = {}
        records: list[WalRecord] = []
        for session, body in items:
            if type(session) is not str or session == DAEMON_SESSION:
                raise ValueError(f"a session id must be a non-empty string, got {session!r}")
            kind = body.get("type") if isinstance(body, Mapping) else None
            if kind == EPOCH_BUMP:
                raise ValueError("epoch bumps are written by the journal itself")
            next_id = staged.get(session, self._next_ids.get(session))
            if next_id == _CLOSING or (next_id is None and session in self.sessions):
                raise SessionStateError(f"session {session} has finished; it takes no more events")
            if next_id is None:
                if kind not in (CREATED, CONVERSATION):
                    raise SessionStateError(f"unknown session {session}: its first event must be 'created' or "
                                            "'conversation'")
                next_id = 0
            elif kind in (CREATED, CONVERSATION):
                raise SessionStateError(f"session {session} already exists")
            record = WalRecord(session=session, event_id=next_id, epoch=self.epoch, ts=ts, body=body)
            open_turn = turns.get(session, self._open_turns.get(session))
            if kind == CONVERSATION:
                turns[session] = -1
            elif (open_turn is not None) != (kind in CONVERSATION_EVENTS):
                family = "conversation" if open_turn is not None else "generation session"
                raise SessionStateError(f"a {kind} event does not belong in {family} {session}")
            elif open_turn is not None:
                try:
                    turns[session] = open_turn_after(open_turn, next_id, record.body)
                except ValueError as exc:
                    raise SessionStateError(f"conversation {session}: {exc}") from None
            records.append(record)
            staged[session] = _CLOSING if ends_session(record.body) else next_id + 1
        try:
            data = b"".join(encode_record(r, max_record_size=self.config.max_record_size) for r in records)
        except LocalProtocolError as exc:
            raise ValueError(str(exc)) from None
        self._next_ids.update(staged)
        self._open_turns.update(turns)
        ticket = _Ticket(records, data)
        self._queue.append(ticket)
        self._pending_bytes += len(data)
        self._pending_records += len(records)
        return ticket

    async def _commit_through(self, ticket: _Ticket) -> None:
        """Return once ``ticket`` is written (or failed): lead if nobody is
        leading, else follow (wait for the leader's next batch).

        A leader writes one batch, then hands over to a waiting follower if
        the queue holds one's records (fairness: no caller commits for others
        forever); with only orphaned records queued (their callers were
        cancelled) it writes those too. A follower cancelled while its records
        are queued and nobody leads writes them itself (shielded, bounded),
        so queued records are never stranded.
        """
        while True:  # the ticket was queued just now: at least one round
            if not self._leading:
                await self._lead()
            else:
                ticket.waiting = True
                try:
                    await self._batch_done.wait()
                except trio.Cancelled:
                    ticket.waiting = False
                    if not ticket.taken and not self._leading:
                        # orphaned records, nobody leading: write them ourselves
                        with trio.move_on_after(self.config.commit_shield_s, shield=True):
                            await self._lead()
                    raise
                ticket.waiting = False
            if ticket.finished:
                return

    async def _lead(self, *, compact: bool = True) -> None:
        self._leading = True
        try:
            # Bounded shield: the write+fsync must finish for every caller
            # whose records it carries, even if *this* caller is cancelled.
            with trio.move_on_after(self.config.commit_shield_s, shield=True) as scope:
                await self._drain(compact=compact)
            if scope.cancelled_caught and self._queue:
                log.warning("session log: commit exceeded %s s; %d records wait for the next commit",
                            self.config.commit_shield_s, self._pending_records)
        finally:
            self._leading = False
            self._wake_followers()

    def _wake_followers(self) -> None:
        self._batch_done.set()
        self._batch_done = trio.Event()

    async def _drain(self, *, compact: bool) -> None:
        """Write batches until the queue is empty or holds a live follower's
        records (that follower leads next), then compact if due. A schedule
        point, whatever there is to do (never a cancel point: it runs under
        :meth:`_lead`'s shield)."""
        while True:
            if self._queue:
                await self._commit_batch()
                self._wake_followers()
            else:  # nothing queued (a compaction alone, or nothing left to do)
                await trio.lowlevel.cancel_shielded_checkpoint()
            if not self._queue or any(t.waiting for t in self._queue):
                break
        due = self._compact_requested or self._size >= self._compact_at or self._too_many_finished()
        if compact and due and not (self._closed or self._broken):
            await self._compact()

    async def _commit_batch(self) -> None:
        inline = self.config.inline_sync_s > 0 and self._sync_avg_s <= self.config.inline_sync_s
        # let every task that is ready queue its records first: they share this write and fsync (inline
        # or in a thread; a closed or failed log ends them all alike)
        await trio.lowlevel.cancel_shielded_checkpoint()
        batch, self._queue = self._queue, []
        self._pending_bytes = self._pending_records = 0
        for ticket in batch:
            ticket.taken = True
        self._space.set()
        self._space = trio.Event()
        failure: BaseException | None = None
        if self._closed:
            failure = JournalClosed(f"{self.path} closed before these records were written")
        elif self._broken is not None:
            failure = self._broken
        else:
            data = b"".join(t.data for t in batch)
            sync = partial(_timed_write, self._fd, data, self._size, full=self.config.full_fsync)
            try:
                # Waking a thread costs more than a fast fsync blocks: 0.3-1.4 ms of the event loop's
                # time on a busy two-core machine against ~0.15 ms for write+fsync of a round's
                # records. So a small commit runs here while the disk stays fast; one slow fsync
                # moves commits to a thread until the average recovers.
                if inline and len(data) <= INLINE_MAX_BYTES:
                    took = sync()
                else:
                    took = await trio.to_thread.run_sync(self.config.in_thread, sync)
            except OSError as exc:
                log.error("session log %s: write/fsync failed (%s); refusing appends until the disk takes "
                          "writes again", self.path, exc)
                failure = exc
                self._degrade(exc)
            else:
                self._sync_avg_s = 0.8 * self._sync_avg_s + 0.2 * took
                self._size += len(data)
                self._fsyncs += 1
                self._batches += 1
        for ticket in batch:
            if failure is not None:
                ticket.error = failure
                continue
            for record in ticket.records:
                self._state.apply(record)
                if self._next_ids.get(record.session) == _CLOSING and ends_session(record.body):
                    del self._next_ids[record.session]
                    self._finished += record.body["type"] != PURGED  # (finished generations: a purge drops)
            self._appended += len(ticket.records)
            ticket.committed = True

    # -- compaction ------------------------------------------------------------------

    def _retention(self) -> tuple[list[SessionLog], list[str]]:
        """Which sessions a compaction keeps (in creation order) and drops."""
        busy = {r.session for t in self._queue for r in t.records}
        keep: list[SessionLog] = []
        interrupted: list[SessionLog] = []
        finished: list[SessionLog] = []
        idle: list[SessionLog] = []  # conversations touched within the TTL, no turn open
        drop: list[str] = []
        since = _unix_ms() - int(self.config.conversation_ttl_s * 1000)
        for s in self.sessions.values():
            if s.conversation is not None:
                if s.done:  # purged
                    drop.append(s.session)
                elif s.open_turn >= 0 or s.session in busy:
                    keep.append(s)
                elif s.last_ts >= since:
                    idle.append(s)
                else:
                    drop.append(s.session)
            elif s.done:
                finished.append(s)
            elif s.epoch >= self.epoch or s.session in busy:
                keep.append(s)
            else:
                interrupted.append(s)
        for group, limit in ((finished, self.config.keep_finished), (interrupted, self.config.keep_interrupted),
                             (idle, self.config.keep_conversations)):
            group.sort(key=lambda s: s.last_seq)
            cut = max(0, len(group) - max(0, limit))
            drop += [s.session for s in group[:cut]]
            keep += group[cut:]
        keep.sort(key=lambda s: s.first_seq)
        return keep, drop

    async def _compact(self) -> None:
        self._compact_requested = False
        keep, drop = self._retention()
        head = self._state.daemon_record
        assert head is not None  # the opening epoch bump
        # Sessions being dropped take no appends while the rewrite runs.
        parked = {sid: self._next_ids.pop(sid) for sid in drop if sid in self._next_ids}
        before = self._size
        try:
            result = await trio.to_thread.run_sync(partial(
                write_compacted, self.directory, head, keep,
                full_fsync=self.config.full_fsync, max_record_size=self.config.max_record_size,
            ))
        except OSError as exc:
            self._next_ids.update(parked)
            self._compact_at = max(self._compact_at, 2 * self._size)
            self._finished_at = max(self._finished_at, 2 * self._finished) if self._finished_at else 0
            log.error("session log %s: compaction failed (%s); next attempt at %d bytes",
                      self.path, exc, self._compact_at)
            return  # noqa: ASYNC910 - run_sync yielded before its thread raised
        old, self._fd = self._fd, result.fd
        close_quietly(old)
        self._size = result.size
        self._state.records = result.records
        for sid in drop:
            del self.sessions[sid]
            self._open_turns.pop(sid, None)
        self._finished = self._count_finished()
        self._finished_at = self._finished_limit()
        self._compact_at = max(self.config.compact_at_bytes, 2 * result.size)
        self._compactions += 1
        self._fsyncs += 1
        log.info("session log %s compacted: %d -> %d bytes, kept %d sessions, dropped %d",
                 self.path, before, result.size, len(keep), len(drop))
        if result.dir_error is not None:
            log.error("session log %s: fsync of the directory after compaction failed (%s); "
                      "refusing appends until the disk takes writes again", self.path, result.dir_error)
            self._degrade(result.dir_error)

    # -- closing ---------------------------------------------------------------------

    def _close(self) -> None:
        self._closing = self._closed = True
        for ticket in self._queue:
            ticket.error = JournalClosed(f"{self.path} closed before these records were written")
        self._queue = []
        self._space.set()
        self._wake_followers()
        close_quietly(self._fd)
        close_quietly(self._lock_fd)  # closing the descriptor releases the flock
        self._fd = self._lock_fd = -1


@asynccontextmanager
async def open_journal(
    directory: Path | str, *, fresh: bool = False, config: JournalConfig | None = None
) -> AsyncIterator[Journal]:
    """Open the session log in ``directory`` for the lifetime of the block.

    Args:
        directory: the sessions directory (created if missing).
        fresh: ``--sessions-cache``: start an empty log, keeping the old one
            as ``wal.log.prev`` (or ``wal.log.corrupt-<n>`` if it was damaged).
        config: limits and retention policy.

    Returns:
        The :class:`Journal`, replayed and with this run's epoch written.

    Raises:
        JournalLocked: another server holds the directory.
        WalCorrupt: the log is damaged other than in its tail (and not ``fresh``).
        OSError: the directory or log cannot be created, read or written.

    Cancellation: the opening (lock, replay, epoch bump) runs in a thread and
    completes before a cancellation is seen; the log is then closed as below.

    Resource handling: on exit, records already queued are written (bounded
    by ``config.close_timeout_s``, shielded); later appends raise
    :class:`JournalClosed`. The log and the lock file are closed, which
    releases the lock; ``serve.lock`` itself stays (deleting it would race
    with a starting server).
    """
    config = config or JournalConfig()
    opened = await trio.to_thread.run_sync(partial(
        open_log, Path(directory), fresh=fresh, max_record_size=config.max_record_size,
        full_fsync=config.full_fsync, now_ms=_unix_ms(),
    ))
    journal = Journal(opened, config)
    failure: BaseException | None = None
    try:
        async with trio.open_nursery() as nursery:  # the recovery probe's
            journal._nursery = nursery
            try:
                yield journal
            except BaseException as exc:  # noqa: BLE001, ASYNC103 - re-raised below as itself, not in the nursery's group
                failure = exc
            finally:
                journal._closing = True
                with trio.move_on_after(config.close_timeout_s, shield=True):
                    while journal._leading:
                        await journal._batch_done.wait()
                    await journal._lead(compact=False)
                nursery.cancel_scope.cancel()  # a probe thread under way finishes first
    finally:
        journal._close()
    if failure is not None:
        raise failure
