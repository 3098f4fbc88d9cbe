"""The scheduler loop: plan a tick, send it, commit what comes back.

One :class:`Scheduler` per model. It outlives worker processes: the model
owner runs :meth:`Scheduler.run` once per worker generation, and calls
:meth:`Scheduler.worker_lost` when one dies, which puts every running job back
at the head of its queue with the tokens it already committed, so the next
worker continues it (nothing repeated, nothing lost).

Commits are off the loop's path: :meth:`Scheduler._emit` stages each round's
tokens on its jobs, frees the lanes that ended and hands the round to
:meth:`Scheduler.run_commits` over a bounded channel; that task makes the
rounds durable (one write and one fsync for whatever is waiting: group
commit), and only then shows their tokens and finishes to readers. The engine
keeps running while the log syncs; a slow disk fills the channel and then
holds the loop (back-pressure, never an unbounded buffer).

Everything that reaches the loop arrives on one bounded inbox: worker events
tagged with the worker generation, and *pokes* (``(None, None)``) from
request handlers that submitted or cancelled a job. Pokes are best-effort:
after any inbox item the loop re-reads job state, so a poke dropped on a full
inbox loses nothing.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import math
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

import attrs
import trio

from ..proto import (
    MAX_TICKS_IN_FLIGHT, Admit, Admitted, Cancel, Emit, Fault, Interrupt, Tick, TickDone, Tokenize, Tokenized,
)
from ._job import Job, JobError, JobState
from ._plan import JobView, LaneView, Planner, PlannerConfig
from ._qos import QosClass

if TYPE_CHECKING:
    from .._cpu import CpuYield
    from .._metrics import Metrics
    from ..nursery._worker import WorkerHandle

__all__ = ["Committer", "QueueFull", "Scheduler", "SchedulerConfig", "Unavailable"]

log = logging.getLogger("superfluid.sched")
INBOX_SIZE = 512
DRAIN_BATCH = 64            # inbox items taken at once
COMMIT_QUEUE = 16           # rounds waiting for the commit task before the loop waits for the log
HOLD_MIN_SHARED = 1024      # a queued job sharing this many prompt tokens with a prefilling lane waits for it
HOLD_MAX_TICKS = 400        # ticks a held job waits at most (~20 s of short ticks)
RETRY_AFTER_S = 1           # a full queue's Retry-After: a lane frees every few hundred ms at full load
FINISH_MAP = {"eos": "stop", "length": "length", "context": "length"}


class Unavailable(Exception):
    """The model's worker cannot be (re)started; requests fail typed (503 ``code``)."""

    def __init__(self, message: str, *, code: str = "worker_unavailable") -> None:
        super().__init__(message)
        self.code = code


class QueueFull(Exception):
    """A class's queue holds ``max_queue`` jobs already; the request fails typed (429)."""

    def __init__(self, message: str, *, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Committer(Protocol):
    async def commit(self, spans: list[tuple[Job, list[int], list[bytes]]], ended: list[tuple[Job, str]]) -> None:
        """Make each ``(job, new_tokens, their_pieces)`` and each ``(job, finish)``
        durable before any reader sees them (the write-ahead rule)."""


class _NullCommitter:
    async def commit(self, spans: list[tuple[Job, list[int], list[bytes]]], ended: list[tuple[Job, str]]) -> None:
        return None


@attrs.define(eq=False)
class _Round:
    """Engine rounds applied by the loop, waiting for their commit."""

    spans: list[tuple[Job, int]]              # (job, tokens this round staged on it)
    ended: list[tuple[Job, str]]              # (job, the worker's finish): what the log records
    finishes: list[tuple[Job, str]]           # (job, finish) to show readers once durable


@attrs.frozen(kw_only=True)
class SchedulerConfig:
    planner: PlannerConfig = attrs.field(factory=PlannerConfig)
    hang_timeout_s: float = 60.0
    lost_limit: int = 3
    max_queue: int = 256        # jobs waiting per class; a new one beyond is refused (QueueFull)
    max_prompt_bytes: int = 0   # the prompt-size limit the API checks before tokenize (0: from the context)


@attrs.define(eq=False)
class _Pending:
    event: trio.Event = attrs.field(factory=trio.Event)
    result: list[int] | None = None
    parts: list[int] = attrs.field(factory=list)  # ids of the answer's pieces so far (Tokenized.more)


class Scheduler:
    def __init__(self, name: str, config: SchedulerConfig, metrics: Metrics, committer: Committer | None = None,
                 cpu: CpuYield | None = None) -> None:
        self.name = name
        self.cpu = cpu
        self._ending = object()  # the CPU policy's owner key while a request's last commit runs
        self.config = config
        self.metrics = metrics
        self.committer: Committer = committer or _NullCommitter()
        self.planner = Planner(config.planner)
        self.queues: dict[QosClass, collections.deque[Job]] = {k: collections.deque() for k in QosClass}
        self._reserved: collections.Counter[QosClass] = collections.Counter()  # see reserve()
        self.running: dict[int, Job] = {}
        self.inbox_send, self.inbox = trio.open_memory_channel[Any](INBOX_SIZE)
        self._commit_send, self._commit_recv = trio.open_memory_channel[_Round](COMMIT_QUEUE)
        self.tick_no = 0
        self.worker: WorkerHandle | None = None
        self._lane_ids = itertools.count(1)
        self._seq = itertools.count(1)
        self._req_ids = itertools.count(1)
        self._tokenize: dict[int, _Pending] = {}
        self._prefill_rate = 0.0
        self.worker_changed = trio.Event()
        self.last_tick: dict[str, float] = {}

    # -- called by request handlers ---------------------------------------------

    @contextlib.contextmanager
    def reserve(self, klass: QosClass) -> Iterator[None]:
        """Hold a place in ``klass``'s queue while a request logs its session,
        then :meth:`submit` in the block. The bound counts new requests only:
        jobs coming back (a preempted or orphaned one) always requeue.

        Raises:
            QueueFull: ``max_queue`` jobs of the class wait (or hold a place) already.
        """
        waiting = len(self.queues[klass]) + self._reserved[klass]
        if waiting >= self.config.max_queue:
            self.metrics.inc("superfluid_queue_full_total", **{"class": klass.label})
            raise QueueFull(f"model {self.name!r}: {waiting} {klass.label} requests are waiting already "
                            f"(--max-queue {self.config.max_queue}); retry later", retry_after_s=RETRY_AFTER_S)
        self._reserved[klass] += 1
        try:
            yield
        finally:
            self._reserved[klass] -= 1

    def submit(self, job: Job) -> None:
        job.scheduler = self
        if self.closed is not None:  # the request resolved the model before it was unloaded
            job.finish_with(error=self.closed)
            return
        job.state = JobState.QUEUED
        job.queued_tick = self.tick_no
        job.seq = next(self._seq)
        job.created = job.created or trio.current_time()
        if len(job.prompt) > HOLD_MIN_SHARED and job.prefix_key is None:
            job.prefix_key = hash((job.partition, tuple(job.prompt[:HOLD_MIN_SHARED])))
        self.queues[job.klass].append(job)
        self._gauges()
        self._poke()

    def cancel(self, job: Job) -> None:
        """Stop ``job`` (idempotent). A queued job ends now; a running one at
        the next engine step."""
        if job.done or job.cancelled:
            return
        job.cancelled = True
        if job.state is JobState.QUEUED:
            try:
                self.queues[job.klass].remove(job)
            except ValueError:
                pass
            job.finish_with("cancelled")
            self._gauges()
        self._poke()

    async def tokenize(self, segments: list[tuple[str, bool]], *, add_special: bool = False) -> list[int]:
        """Tokenize in the worker, retrying across a worker respawn.

        Raises:
            Unavailable: no worker could take the request.
        """
        for _attempt in range(3):
            worker = await self.wait_worker()
            req = next(self._req_ids)
            pending = self._tokenize[req] = _Pending()
            self._note_cpu()
            try:
                await worker.send(Tokenize(req=req, segments=segments, add_special=add_special))
                with trio.move_on_after(self.config.hang_timeout_s) as waited:
                    await pending.event.wait()
                if waited.cancelled_caught:  # no answer: hung (an idle model has no tick timer running)
                    log.warning("model %s: worker pid %d did not answer a tokenize within %gs; killing it",
                                self.name, worker.pid, self.config.hang_timeout_s)
                    worker.kill()
            except Exception as exc:  # noqa: BLE001 - WorkerDied or a link error: retry on the next worker
                log.debug("tokenize retry after %r", exc)
            finally:
                self._tokenize.pop(req, None)
                self._note_cpu()
            if pending.result is not None:
                return pending.result
        raise Unavailable(f"model {self.name!r}: no worker could tokenize the request")

    async def wait_worker(self) -> WorkerHandle:
        """Wait for a live worker. If the model is unavailable, ask the owner
        for one more try (a poke is demand) before giving up.

        Raises:
            Unavailable: the retry failed too.
        """
        retried = False
        while self.worker is None or self.worker.dead:
            if self.closed is not None:
                raise Unavailable(self.closed.message)
            if self.unavailable is not None:
                if retried:
                    raise Unavailable(self.unavailable, code=self.unavailable_code)
                retried = True
                self._poke()
            await self.worker_changed.wait()
        return self.worker

    unavailable: str | None = None
    unavailable_code = "worker_unavailable"
    closed: JobError | None = None      # set by close(): the model was unloaded

    def set_worker(self, worker: WorkerHandle | None, *, unavailable: str | None = None,
                   code: str = "worker_unavailable") -> None:
        """``unavailable``: why no worker can be had now (requests fail 503 ``code``)."""
        self.worker = worker
        self.unavailable = unavailable
        self.unavailable_code = code
        event, self.worker_changed = self.worker_changed, trio.Event()
        event.set()

    def _poke(self) -> None:
        try:
            self.inbox_send.send_nowait((None, None))
        except trio.WouldBlock:
            pass  # the loop re-reads job state after every inbox item

    # -- worker generations --------------------------------------------------------

    def worker_lost(self, reason: str) -> None:
        """Return running jobs to the head of their queues (or fail the ones that
        keep killing workers), and release tokenize waiters."""
        for pending in self._tokenize.values():
            pending.event.set()
        for job in sorted(self.running.values(), key=lambda j: j.seq, reverse=True):
            job.lane = None
            if job.cancelled:
                job.finish_with("cancelled")
                continue
            if job.n_generated == job.tokens_at_admit:
                job.lost_without_progress += 1
            else:
                job.lost_without_progress = 0
            if job.lost_without_progress >= self.config.lost_limit:
                job.finish_with(error=JobError(
                    status=500, code="worker_crashed",
                    message=f"engine worker died {job.lost_without_progress} times while serving this request "
                            f"without progress ({reason})",
                ))
                self.metrics.inc("superfluid_requests_total", outcome="error")
                continue
            job.state = JobState.QUEUED
            self.queues[job.klass].appendleft(job)
        self.running.clear()
        self._gauges()

    def fail_all(self, message: str, *, code: str) -> None:
        """Fail every queued and running job typed (503): the model is going away."""
        for job in list(self.running.values()):
            job.finish_with(error=JobError(status=503, message=message, code=code))
        self.running.clear()
        for q in self.queues.values():
            while q:
                q.popleft().finish_with(error=JobError(status=503, message=message, code=code))
        self._gauges()

    def close(self, message: str, *, code: str) -> None:
        """The model is going away for good: fail every job (503 ``code``) and every
        later submission, and release tokenize waiters (they raise :class:`Unavailable`).
        Its owner is cancelled next, so nothing else would ever wake them."""
        self.closed = JobError(status=503, message=message, code=code)
        self.fail_all(message, code=code)
        for pending in self._tokenize.values():
            pending.event.set()
        self.set_worker(None, unavailable=message)

    def fail_queued(self, message: str, *, code: str = "worker_unavailable") -> None:
        for q in self.queues.values():
            while q:
                q.popleft().finish_with(error=JobError(status=503, message=message, code=code))
        self._gauges()

    # -- the loop -----------------------------------------------------------------

    async def run(self, worker: WorkerHandle) -> None:
        """Serve jobs on ``worker`` until it dies.

        Raises:
            WorkerDied: the worker exited, hung past ``hang_timeout_s`` or broke the link.
        """
        gen = worker.generation
        worker.send_timeout_s = self.config.hang_timeout_s  # a full pipe is a hang too
        self.set_worker(worker)
        in_flight = 0
        interrupted = False
        while True:
            await self._send_cancels(worker)
            # admissions and preemptions go out as soon as anything changes (the
            # worker applies them between engine steps); ticks keep the engine
            # fed: tick N+1 is planned while tick N runs
            while await self._plan_and_send(worker, send_tick=in_flight < MAX_TICKS_IN_FLIGHT):
                in_flight += 1
                interrupted = False
            batch = await self._next_events(gen, timed=in_flight > 0, worker=worker)
            # in order, but consecutive rounds commit together (one fsync)
            rounds: list[Emit] = []
            for event in [*batch, None]:
                if isinstance(event, Emit):
                    rounds.append(event)
                    continue
                if rounds:
                    await self._emit(rounds)
                    rounds = []
                if isinstance(event, TickDone):
                    in_flight -= 1
                    self._tick_done(event)
                elif event is not None:
                    await self._handle(event)
            await self._send_cancels(worker)
            if in_flight and not interrupted and self._preemptor_waiting():
                interrupted = True
                await worker.send(Interrupt())

    async def _plan_and_send(self, worker: WorkerHandle, *, send_tick: bool) -> bool:
        """Plan, send the plan's preemptions and admissions, and (if
        ``send_tick``) its Tick. Returns True when a Tick was sent."""
        plan = self.planner.plan(tick=self.tick_no, queued=self._job_views(), lanes=self._lane_views(),
                                 prefill_tok_s=self._prefill_rate, held=self._held())
        # the plan is applied with no checkpoint in between and goes out in one write (one
        # wake-up of the worker: an admission and its tick used to cost two, ~1 ms apart)
        frames: list[Any] = []
        for lane in plan.preempts:
            victim = self.running.get(lane)
            if victim is None:
                continue
            victim.preempted = True
            self.metrics.inc("superfluid_preemptions_total")
            frames.append(Cancel(lane=lane, publish=True))
        order = list(plan.prefill_order)
        for job_id in plan.admits:
            job = self._dequeue(job_id)
            if job is None:
                continue
            lane = next(self._lane_ids)
            order.append(lane)
            frames.append(self._admit(job, lane))
        ticked = send_tick and bool(plan.prefill_budget or plan.max_rounds)
        if ticked:
            self.tick_no += 1
            self.metrics.inc("superfluid_ticks_total")
            frames.append(Tick(seq=self.tick_no, prefill_budget=plan.prefill_budget, max_rounds=plan.max_rounds,
                               time_budget_ms=plan.time_budget_ms, prefill_lanes=tuple(order)))
        if frames:
            await worker.send(*frames)
        return ticked

    async def _next_events(self, gen: int, *, timed: bool, worker: WorkerHandle) -> list[Any]:
        """Wait for the next inbox item, then take whatever else is already
        there (up to a bound), so a backlog of rounds commits with one fsync.

        Raises:
            WorkerDied: the worker died, or (``timed``) went silent past ``hang_timeout_s``.
        """
        from ..nursery._worker import WorkerDied

        with trio.move_on_after(self.config.hang_timeout_s if timed else math.inf) as scope:
            first = await self.inbox.receive()
        if scope.cancelled_caught:
            worker.kill()
            raise WorkerDied(f"worker hung: no answer within {self.config.hang_timeout_s:g}s of a tick")
        items = [first]
        while len(items) < DRAIN_BATCH:
            try:
                items.append(self.inbox.receive_nowait())
            except trio.WouldBlock:
                break
        out = []
        for tag, event in items:
            if tag is not None and tag != gen:
                continue  # a dead generation's leftovers, or a poke
            if isinstance(event, WorkerDied):
                raise event
            if event is not None:
                out.append(event)
        return out

    def _held(self) -> frozenset[int]:
        """Jobs that should wait for a lane prefilling the prefix they share, so
        a burst on one long system prompt prefills it about once. Among queued
        jobs with the same prefix and no such lane, only the earliest goes ahead.
        Interactive and completion jobs never wait; nobody waits past
        ``HOLD_MAX_TICKS``."""
        held: set[int] = set()
        leaders: dict[int, Job] = {}
        for job in self.running.values():
            if job.prefix_key is not None and not job.preempted and job.prefill_left > 0:
                leaders.setdefault(job.prefix_key, job)
        for q in self.queues.values():
            for job in q:
                if job.prefix_key is None or job.klass.preempts or (
                        job.held_since is not None and self.tick_no - job.held_since >= HOLD_MAX_TICKS):
                    continue
                leader = leaders.get(job.prefix_key)
                if leader is None:
                    leaders[job.prefix_key] = job      # the first of its group goes ahead
                    continue
                if leader.state is JobState.RUNNING:
                    done = len(leader.prompt) + leader.n_generated - leader.prefill_left
                    if done >= _shared_len(job.prompt, leader.prompt):
                        continue
                held.add(job.id)
                if job.held_since is None:
                    job.held_since = self.tick_no
        return frozenset(held)

    def _preemptor_waiting(self) -> bool:
        if len(self.running) < self.config.planner.max_batch:
            return bool(self.queues[QosClass.INTERACTIVE] or self.queues[QosClass.COMPLETION])
        urgent = self.queues[QosClass.INTERACTIVE] or self.queues[QosClass.COMPLETION]
        return bool(urgent) and any(j.klass > QosClass.COMPLETION and not j.preempted for j in self.running.values())

    async def _send_cancels(self, worker: WorkerHandle) -> None:
        for lane, job in list(self.running.items()):
            if job.cancelled and not job.cancel_sent:
                job.cancel_sent = True
                await worker.send(Cancel(lane=lane, publish=True))

    def _admit(self, job: Job, lane: int) -> Admit:
        job.state = JobState.RUNNING
        job.lane = lane
        job.preempted = False
        job.cancel_sent = False
        generated = job.generated()
        job.prefill_left = len(job.prompt) + len(generated)
        job.tokens_at_admit = len(generated)
        job.admitted_at = job.admitted_at or trio.current_time()
        self.running[lane] = job
        self._gauges()
        return Admit(
            lane=lane, tokens=job.prompt + generated, n_prompt=len(job.prompt),
            max_new=job.max_new, sampling=job.sampling, ignore_eos=job.ignore_eos, priority=int(job.klass),
            cache_salt=job.partition,
        )

    def _dequeue(self, job_id: int) -> Job | None:
        """The queued job ``job_id``, taken off its queue; None if it left the queue."""
        for q in self.queues.values():
            for job in q:
                if job.id == job_id:
                    q.remove(job)
                    return job
        return None

    def _job_views(self) -> list[JobView]:
        return [JobView(job=j.id, klass=j.klass, queued_tick=j.queued_tick, seq=j.seq, prompt_tokens=len(j.prompt))
                for q in self.queues.values() for j in q]

    def _lane_views(self) -> list[LaneView]:
        return [LaneView(lane=lane, job=j.id, klass=j.klass, admitted_seq=lane,
                         prefill_left=j.prefill_left, queued_tick=j.queued_tick)
                for lane, j in self.running.items() if not j.preempted]

    def _tick_done(self, done: TickDone) -> None:
        for lane, job in self.running.items():
            # a lane admitted after the tick ended is not in its report: it has not begun
            job.prefill_left = done.prefill_left.get(lane, job.prefill_left)
        if done.prefill_tokens and done.busy_ms > 0:
            rate = done.prefill_tokens / (done.busy_ms / 1000)
            self._prefill_rate = rate if not self._prefill_rate else 0.7 * self._prefill_rate + 0.3 * rate
        self.metrics.inc("superfluid_prefill_tokens_total", done.prefill_tokens)
        self.metrics.inc("superfluid_decode_tokens_total", done.decode_tokens)
        self.metrics.inc("superfluid_engine_rounds_total", done.rounds)
        self.metrics.inc("superfluid_engine_busy_seconds_total", done.busy_ms / 1000)
        self.metrics.set("superfluid_kv_used_tokens", done.kv_used)
        self.metrics.set("superfluid_kv_total_tokens", done.kv_total)
        self.last_tick = {"busy_ms": done.busy_ms, "prefill": done.prefill_tokens, "decode": done.decode_tokens,
                          "rounds": done.rounds}

    async def _handle(self, event: Any) -> None:
        if event is None:
            return
        if isinstance(event, Emit):
            await self._emit([event])
        elif isinstance(event, Admitted):
            job = self.running.get(event.lane)
            if job is not None:
                if not job.started:
                    job.cached = event.cached
                    self.metrics.inc("superfluid_warm_prefix_tokens_total", event.cached)
                    job.started = True
                job.publish()
        elif isinstance(event, Fault):
            job = self.running.pop(event.lane, None) if event.lane >= 0 else None
            if job is not None:
                status = 400 if event.kind == "admit" else 500
                job.finish_with(error=JobError(status=status, message=f"{event.kind}: {event.message}",
                                               type="invalid_request_error" if status == 400 else "server_error"))
                self.metrics.inc("superfluid_requests_total", outcome="error")
                self._gauges()
            else:
                log.warning("worker fault (%s): %s", event.kind, event.message)
        elif isinstance(event, Tokenized):
            pending = self._tokenize.get(event.req)
            if pending is not None:
                pending.parts += event.tokens
                if not event.more:
                    pending.result, pending.parts = pending.parts, []
                    pending.event.set()

    async def _emit(self, events: list[Emit]) -> None:
        """Apply engine rounds: stage their tokens, free the lanes that ended,
        and queue the rounds for the commit task (which shows them to readers)."""
        spans: dict[int, list[Any]] = {}
        ended: list[tuple[Job, str]] = []
        for event in events:
            self._apply_round(event, spans, ended)
        if not (spans or ended):
            return
        finishes = self._settle(ended)
        await self._commit_send.send(_Round(spans=[(job, n) for job, n in spans.values()], ended=ended,
                                            finishes=finishes))

    def _apply_round(self, event: Emit, spans: dict[int, list[Any]], ended: list[tuple[Job, str]]) -> None:
        decoding = 0
        for lane, token, piece, finish, lp in event.items:
            job = self.running.get(lane)
            if job is None:
                continue
            if token >= 0 and finish not in ("eos", "cancelled", "error"):
                job.staged.append((token, piece, lp))
                spans.setdefault(job.id, [job, 0])[1] += 1
                decoding += 1
            if finish is not None:
                del self.running[lane]
                ended.append((job, finish))
        if decoding > 1:
            self.metrics.inc("superfluid_batched_rounds_total")

    def _settle(self, ended: list[tuple[Job, str]]) -> list[tuple[Job, str]]:
        """The scheduler's side of jobs that left their lanes: preempted ones
        requeue now; the others end for readers once their round is durable."""
        finishes = []
        now = trio.current_time()
        for job, finish in ended:
            if job.done:  # failed meanwhile (an unload's fail_all)
                continue
            if finish == "cancelled":
                if job.preempted and not job.cancelled:
                    job.lane = None
                    job.state = JobState.QUEUED
                    job.queued_tick = self.tick_no
                    self.queues[job.klass].appendleft(job)
                    continue
                self.metrics.inc("superfluid_requests_total", outcome="cancelled")
            else:
                job.done_at = now
                self.metrics.inc("superfluid_requests_total", outcome="ok")
            finishes.append((job, FINISH_MAP.get(finish, finish)))
        self._gauges()
        return finishes

    # -- the commit task --------------------------------------------------------------

    async def run_commits(self) -> None:
        """Make rounds durable in order, then show them to readers. Rounds that
        queued during one commit share the next (one write, one fsync).

        Owned by the model owner, beside the worker generations: staged rounds
        survive a worker's death. A failed commit (the log refuses writes) ends
        the jobs of its rounds typed (``JobError.log_failed``: 507 when the disk is full).
        """
        async for first in self._commit_recv:
            rounds = [first]
            while len(rounds) < DRAIN_BATCH:
                try:
                    rounds.append(self._commit_recv.receive_nowait())
                except trio.WouldBlock:
                    break
            await self._commit(rounds)

    async def _commit(self, rounds: list[_Round]) -> None:
        counts: dict[int, list[Any]] = {}
        for rnd in rounds:
            for job, n in rnd.spans:
                counts.setdefault(job.id, [job, 0])[1] += n
        ended = [pair for rnd in rounds for pair in rnd.ended]
        spans = [(job, [t for t, _p, _l in job.staged[:n]], [p for _t, p, _l in job.staged[:n]])
                 for job, n in counts.values()]
        failure: JobError | None = None
        # A request's last tokens: its client (and at low concurrency the next request) waits
        # for this commit. The daemon thread stays responsive through it: on SCHED_BATCH the
        # wake-up after the fsync waited for a running engine thread's slice (10-11 ms, one
        # commit in five at 1 concurrent, against ~0.4 ms).
        responsive = self.cpu if any(rnd.finishes for rnd in rounds) else None
        if responsive is not None:
            responsive.note(self._ending, urgent=True)
        try:
            await self.committer.commit(spans, ended)
        except Exception as exc:  # noqa: BLE001 - any log failure ends these jobs typed, never silently
            log.error("model %s: session log commit failed: %s", self.name, exc)
            failure = JobError.log_failed(exc)
        finally:
            if responsive is not None:
                responsive.note(self._ending, urgent=False)
        now = trio.current_time()
        for job, n in counts.values():
            if failure is not None or job.done:
                job.staged = job.staged[n:]
                if failure is not None and not job.done:
                    self._fail_running(job, failure)
                continue
            if job.first_token_at is None and n:
                job.first_token_at = now
                self.metrics.observe("superfluid_ttft_seconds", now - job.created)
            job.commit_staged(n)
        for rnd in rounds:
            for job, finish in rnd.finishes:
                if not job.done:
                    if failure is not None:
                        job.finish_with(error=failure)
                    else:
                        job.finish_with(finish)
        for job, _n in counts.values():
            if not job.done:
                job.publish()
        self._note_cpu()

    def _fail_running(self, job: Job, error: JobError) -> None:
        """End ``job`` typed now; if it still holds a lane, stop it there too."""
        if job.state is JobState.QUEUED:
            try:
                self.queues[job.klass].remove(job)
            except ValueError:
                pass
        job.cancelled = True
        job.finish_with(error=error)
        self._poke()

    def _note_cpu(self) -> None:
        """Tell the daemon's CPU policy whether a request here waits for its
        first token (see ``superfluid/_cpu.py``). Called wherever that can
        change: ``_gauges`` (queues and lanes), ``tokenize`` and ``_commit``."""
        if self.cpu is not None:
            urgent = bool(self._tokenize) or any(self.queues.values()) or any(
                job.first_token_at is None for job in self.running.values())
            self.cpu.note(self, urgent=urgent)

    def _gauges(self) -> None:
        # a preempted lane is on its way out (its Cancel precedes the preemptor's Admit on the
        # link): counting it would show more lanes than --max-batch until the worker acks
        self.metrics.set("superfluid_lanes_active", sum(1 for j in self.running.values() if not j.preempted))
        for k, q in self.queues.items():
            self.metrics.set("superfluid_queue_depth", len(q), **{"class": k.label})
        self._note_cpu()

    def statistics(self) -> dict[str, Any]:
        return {"lanes_active": len(self.running), "queued": sum(len(q) for q in self.queues.values()),
                "ticks": self.tick_no, **self.last_tick}


def _shared_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b)) - 1
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
