"""A job: one generation request as the scheduler sees it.

The job is the daemon's record of a generation: its prompt ids, the tokens
committed so far and how it ended. Tokens arrive *staged* (the scheduler's
view: a re-admission continues from them) and become visible to readers
only when the commit task has made them durable. Readers (HTTP handlers, session
subscribers) follow it by cursor with :meth:`Job.wait_beyond`; the scheduler
never blocks on a reader, so a slow client can only fall behind its own
cursor, never stall a lane.
"""

from __future__ import annotations

import itertools
from typing import Any

import attrs
import trio

from ..chat import StopScan
from ..proto import Sampling
from ._jobtypes import JobError, JobState, cache_partition
from ._qos import QosClass

__all__ = ["Job", "JobError", "JobState", "cache_partition"]

_ids = itertools.count(1)


@attrs.define(eq=False, kw_only=True)
class Job:
    prompt: list[int]
    sampling: Sampling
    max_new: int
    klass: QosClass = QosClass.AGENT
    ignore_eos: bool = False
    id: int = attrs.field(factory=lambda: next(_ids))
    session: str = ""
    tenant: str = ""                # who made it (principal_of(scope).tenant); "" with no keys
    cache_salt: str = ""            # the request's ``cache_salt``; with ``tenant``, its prefix-cache partition
    tokens: list[int] = attrs.field(factory=list)        # committed: durable, what readers see
    pieces: list[bytes] = attrs.field(factory=list)
    logprobs: list[Any] = attrs.field(factory=list)
    staged: list[tuple[int, bytes, Any]] = attrs.field(factory=list)  # generated, commit in flight
    finish: str | None = None
    error: JobError | None = None
    cached: int = 0
    state: JobState = JobState.QUEUED
    lane: int | None = None
    cancelled: bool = False
    preempted: bool = False
    cancel_sent: bool = False
    started: bool = False           # a worker admitted it (its request was valid for the runtime)
    log_ended: bool = False         # the session log shows how it ended (SessionStore: no record after it)
    view: Any = None                # the planner's LaneView of it while running (Scheduler._lane_views)
    queue_view: Any = None          # its JobView while queued (Scheduler._job_views)
    prefix_key: int | None = None
    scheduler: Any = None           # the Scheduler it was submitted to (for cancel by session id)
    held_since: int | None = None   # the tick a shared-prefix hold began (counted in ticks, not plans)
    prefill_left: int = 0
    queued_tick: int = 0
    seq: int = 0
    kv_seq: int = -1                # the worker's KV sequence for its lane (Admitted.seq; /slots' id), -1 until told
    tokens_at_admit: int = 0
    lost_without_progress: int = 0
    created: float = 0.0
    first_token_at: float | None = None
    admitted_at: float | None = None
    done_at: float | None = None
    spec: tuple[int, int] | None = None   # speculation: (draft tokens proposed, accepted), from the worker
    stops: tuple[str, ...] = ()     # stop strings: its lane ends at the token that completes one (SchedulerCore.emit)
    stop_scan: Any = None           # their StopScan over what it generated, from its first token scanned
    abort: JobError | None = None   # why it was stopped, when not by its reader: it ends with this, not "cancelled"
    _changed: trio.Event = attrs.field(factory=trio.Event)
    ended: trio.Event = attrs.field(factory=trio.Event)   # set once, when the job is done

    @property
    def partition(self) -> str:
        return cache_partition(self.tenant, self.cache_salt)

    @property
    def done(self) -> bool:
        return self.state is JobState.DONE

    @property
    def n_generated(self) -> int:
        """Tokens generated so far: committed plus staged (the scheduler's view)."""
        return len(self.tokens) + len(self.staged)

    @property
    def suspect(self) -> bool:
        """A worker died while it ran and it has produced no token since (quarantine, SPEC.md "Faults")."""
        return self.lost_without_progress > 0 and self.n_generated == self.tokens_at_admit

    def generated(self) -> list[int]:
        return self.tokens + [token for token, _piece, _lp in self.staged]

    def completes_stop(self, piece: bytes) -> bool:
        """Whether ``piece``, the next token generated, completes one of :attr:`stops`
        (the scan starts from what it generated before: a job restored from the log)."""
        scan = self.stop_scan
        if scan is None:
            scan = self.stop_scan = StopScan(self.stops)
            for before in [*self.pieces, *(p for _t, p, _lp in self.staged)]:
                scan.feed(before)
        return bool(scan.feed(piece))

    def commit_staged(self, n: int) -> None:
        """Make the first ``n`` staged tokens visible (their commit is durable)."""
        moved, self.staged = self.staged[:n], self.staged[n:]
        for token, piece, lp in moved:
            self.tokens.append(token)
            self.pieces.append(piece)
            if lp is not None:
                self.logprobs.append(lp)

    def publish(self) -> None:
        """Wake every reader waiting on this job."""
        event, self._changed = self._changed, trio.Event()
        event.set()

    async def wait_beyond(self, cursor: int) -> None:
        """Wait until more than ``cursor`` tokens are committed or the job is done.

        Cancellation: always a cancel point (a schedule point when it waits: a reader
        that finds tokens ready takes them at once); cancelling it touches nothing.
        """
        while len(self.tokens) <= cursor and not self.done:
            await self._changed.wait()
        await trio.lowlevel.checkpoint_if_cancelled()

    async def wait_change(self) -> None:
        """Wait for the next :meth:`publish` (progress, the end, or a reader
        woken on purpose: api/_lifecycle.py at shutdown)."""
        await self._changed.wait()

    async def wait_started(self) -> None:
        """Wait until a worker admitted the job, or it ended (possibly refused)."""
        while not (self.started or self.done or self.tokens):
            await self._changed.wait()
        await trio.lowlevel.checkpoint_if_cancelled()

    def finish_with(self, finish: str | None = None, error: JobError | None = None) -> None:
        if finish == "cancelled" and self.abort is not None:
            finish, error = None, self.abort   # stopped by a failure (SPEC.md §2 "Failure boundaries"): typed
        self.state = JobState.DONE
        self.finish = finish
        self.error = error
        self.lane = None
        self.ended.set()
        self.publish()
