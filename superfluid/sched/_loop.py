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

One writer: everything that reaches the loop arrives on one bounded inbox,
worker events tagged with the worker generation and *commands* from request
handlers tagged ``None`` (:meth:`Scheduler.reserve`, :meth:`Scheduler.queue`,
:meth:`Scheduler.stop`, :meth:`Scheduler.tokenize`). Only the model's actor
task (the loop while a worker runs, :meth:`Scheduler.idle` between workers)
applies them and changes the queues, and only it writes to the worker link
(a :class:`LinkHandle`). A handler awaits its command's reply (an event and a
slot); a handler cancelled while it waits leaves the command in the inbox,
where the actor applies it as if the handler were there, and the handler's
lane retirement (a ``stop`` sent after it, FIFO) undoes it. Commands are per
request, never per token. The synchronous methods (``submit``, ``cancel``,
``close``, ...) are the actor's side, called by its task only (and by tests
that drive the loop step by step).
"""

from __future__ import annotations

import collections
import itertools
import logging
import math
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import attrs
import trio

from .. import _defaults as D
from ..proto import (
    FAULT_BUG,
    MAX_TICKS_IN_FLIGHT,
    Admit,
    Admitted,
    Cancel,
    Embed,
    Embedded,
    Emit,
    Event,
    Fault,
    Interrupt,
    Tick,
    TickDone,
    Tokenize,
    Tokenized,
)
from ._job import Job, JobError, JobState
from ._plan import JobView, LaneView, Planner, PlannerConfig
from ._qos import QosClass

if TYPE_CHECKING:
    from .._cpu import CpuYield
    from ..daemon._metrics import Metrics

__all__ = ["Committer", "EmbedRefused", "InjectedBug", "LinkHandle", "LinkLost", "QueueFull", "Scheduler", "SchedulerConfig",
           "Unavailable"]

log = logging.getLogger("superfluid.sched")
INBOX_SIZE = 512
DRAIN_BATCH = 64            # inbox items taken at once
COMMIT_QUEUE = 16           # rounds waiting for the commit task before the loop waits for the log
HOLD_MIN_SHARED = 1024      # a queued job sharing this many prompt tokens with a prefilling lane waits for it
HOLD_MAX_TICKS = 400        # ticks a held job waits at most (~20 s of short ticks)
RETRY_AFTER_S = 1           # a full queue's Retry-After: a lane frees every few hundred ms at full load
FINISH_MAP = {"eos": "stop", "length": "length", "context": "length"}
TOKENIZE_ATTEMPTS = 3       # workers a tokenize is sent to before it fails (each died holding it)
# tokenizes and embeddings at the worker at once; the rest wait here, the most urgent class first
# (1,024 agents starting together put ~600 in the worker's pipe, and a chat's waited 0.3-1 s)
TOKENIZE_IN_FLIGHT = 32


class LinkLost(Exception):
    """The worker behind a :class:`LinkHandle` is gone: it exited, hung, or broke the protocol."""


class InjectedBug(Exception):
    """A fault injected for tests and the fuzzer (the mock's ``[[mock:bug_after=N]]``):
    the worker reports it and the loop raises this, as a bug in the model's actor would."""


@runtime_checkable
class LinkHandle(Protocol):
    """The loop's view of one worker generation. The loop is its only writer
    (:meth:`send`); the worker's events arrive on :attr:`Scheduler.inbox_send`
    as ``(generation, event)``, a lost worker as ``(generation, LinkLost)``."""

    generation: int
    dead: bool
    send_timeout_s: float

    @property
    def pid(self) -> int: ...

    async def send(self, *events: Event) -> None:
        """Write ``events`` in order. Raises :class:`LinkLost` when the worker is gone."""

    def kill(self) -> None:
        """End the worker at once (it hung)."""


class Unavailable(Exception):
    """The model's worker cannot be (re)started; requests fail typed (503 ``code``)."""

    def __init__(self, message: str, *, code: str = "worker_unavailable") -> None:
        super().__init__(message)
        self.code = code


class EmbedRefused(Exception):
    """The worker could not embed the inputs (too long, no embedding support): a 400."""


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
    hang_timeout_s: float = D.HANG_TIMEOUT_S
    lost_limit: int = 3
    max_queue: int = D.MAX_QUEUE  # jobs waiting per class; a new one beyond is refused (QueueFull)
    max_prompt_bytes: int = 0   # the prompt-size limit the API checks before tokenize (0: from the context)


@attrs.define(eq=False)
class _Reply:
    """A command's answer: one slot and the event that says it is filled."""

    event: trio.Event = attrs.field(factory=trio.Event)
    value: Any = None
    error: BaseException | None = None

    def set(self, value: Any = None) -> None:
        if not self.event.is_set():
            self.value = value
            self.event.set()

    def fail(self, error: BaseException) -> None:
        if not self.event.is_set():
            self.error = error
            self.event.set()

    async def wait(self) -> Any:
        await self.event.wait()
        if self.error is not None:
            raise self.error
        return self.value


@attrs.frozen(eq=False)
class _Reserve:
    job: Job
    reply: _Reply


@attrs.frozen(eq=False)
class _Queue:
    job: Job


@attrs.frozen(eq=False)
class _Stop:
    job: Job


@attrs.frozen(eq=False)
class _Tokenize:
    segments: list[tuple[str, bool]]
    add_special: bool
    reply: _Reply
    klass: QosClass = QosClass.INTERACTIVE


@attrs.frozen(eq=False)
class _Embed:
    inputs: list[list[int]]
    normalize: bool
    reply: _Reply
    klass: QosClass = QosClass.COMPLETION


@attrs.define(eq=False)
class _Pending:
    command: _Tokenize | _Embed
    sent: bool = False
    attempts: int = 0
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
        self.worker: LinkHandle | None = None
        self._lane_ids = itertools.count(1)
        self._seq = itertools.count(1)
        self._req_ids = itertools.count(1)
        self._tokenize: dict[int, _Pending] = {}
        # tokenize ids not sent yet, by class (stale ids, answered or failed, are skipped when met)
        self._tokenize_waiting: dict[QosClass, collections.deque[int]] = {k: collections.deque() for k in QosClass}
        self._tokenize_sent = 0      # pendings with ``sent`` (at most TOKENIZE_IN_FLIGHT)
        self._places: dict[int, QosClass] = {}      # job id -> the class whose queue place it holds
        self._frames: list[Any] = []                # for the worker, sent with the loop's next write
        self._stopping: list[Job] = []              # jobs stopped since the last write (their Cancels)
        self._demand = False
        self._prefill_rate = 0.0
        self.last_tick: dict[str, float] = {}
        self._spec_seen: dict[str, int] = {}   # the worker's cumulative speculation counts, as last reported
        self.spec: dict[str, Any] = {}         # its last speculation report (gates, totals)

    # -- commands: what request handlers call (each one a message to the actor) ---------------

    async def _command(self, command: Any) -> None:
        """Put ``command`` on the inbox (waits while it is full: bounded).

        Raises:
            Unavailable: the model is gone (its actor closed the inbox).
        """
        try:
            await self.inbox_send.send((None, command))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            closed = self.closed
            raise Unavailable(closed.message if closed else f"model {self.name!r} is gone",
                              code=closed.code or "model_unloaded" if closed else "model_unloaded") from None

    async def reserve(self, job: Job) -> None:
        """Hold a place in ``job``'s class queue while its request logs the session;
        then :meth:`queue` it (or :meth:`stop` it to give the place back). The bound
        counts new requests only: jobs coming back (preempted, orphaned) always requeue.

        Raises:
            QueueFull: ``max_queue`` jobs of the class wait (or hold a place) already.
            Unavailable: the model was unloaded or failed.

        Cancellation: the place may still be taken after the caller left; the
        caller's ``stop`` (sent after, applied after) gives it back.
        """
        reply = _Reply()
        await self._command(_Reserve(job, reply))
        await reply.wait()

    async def queue(self, job: Job) -> None:
        """Queue ``job`` (a place reserved for it is used up). A model that is
        gone ends it typed (503), as its actor would have. No reply: follow the job."""
        try:
            await self._command(_Queue(job))
        except Unavailable as exc:
            job.finish_with(error=self.closed or JobError(status=503, message=str(exc), code=exc.code))

    async def stop(self, job: Job) -> None:
        """Stop ``job`` (idempotent): a queued one ends now, a running one at the
        next engine step, a reserved place is given back. No reply."""
        await self._command(_Stop(job))

    async def tokenize(self, segments: list[tuple[str, bool]], *, add_special: bool = False,
                       klass: QosClass = QosClass.INTERACTIVE) -> list[int]:
        """Tokenize in the worker, retried on the next worker if one dies holding it. At most
        TOKENIZE_IN_FLIGHT go to the worker at once, the most urgent ``klass`` first.

        Raises:
            Unavailable: no worker could take the request.

        Cancellation: the worker still answers; the answer is dropped.
        """
        reply = _Reply()
        await self._command(_Tokenize(list(segments), add_special, reply, klass))
        result: list[int] = await reply.wait()
        return result

    async def embed(self, inputs: list[list[int]], *, normalize: bool = True) -> tuple[int, list[bytes]]:
        """One vector per input (token ids) from the worker: ``(dim, vectors)``, each
        vector ``dim`` little-endian float32. Sent to the next worker if one dies holding it.

        Raises:
            EmbedRefused: the worker could not embed them (the reason, for a 400).
            Unavailable: no worker could take the request.

        Cancellation: the worker still answers; the answer is dropped.
        """
        reply = _Reply()
        await self._command(_Embed([list(t) for t in inputs], normalize, reply))
        dim, vectors = await reply.wait()
        return dim, vectors

    # -- the actor's side: applying commands -------------------------------------------

    def _apply(self, command: Any) -> None:
        """Apply one handler command (no checkpoint: the loop's state stays consistent)."""
        if isinstance(command, _Queue):
            self._unreserve(command.job)
            self._demand = True
            self.submit(command.job)
        elif isinstance(command, _Stop):
            job = command.job
            if self._unreserve(job) and not job.done:
                job.cancelled = True
                job.finish_with("cancelled")
            self.cancel(job)
        elif isinstance(command, _Reserve):
            try:
                self._reserve(command.job)
            except (QueueFull, Unavailable) as exc:
                command.reply.fail(exc)
            else:
                command.reply.set()
        elif isinstance(command, (_Tokenize, _Embed)):
            if self.closed is not None:
                command.reply.fail(Unavailable(self.closed.message, code=self.closed.code or "model_unloaded"))
                return
            req = next(self._req_ids)
            self._tokenize[req] = _Pending(command)
            self._tokenize_waiting[command.klass].append(req)
            self._demand = True
            self._send_tokenizes()
            self._note_cpu()

    def _reserve(self, job: Job) -> None:
        if self.closed is not None:
            raise Unavailable(self.closed.message, code=self.closed.code or "model_unloaded")
        klass = job.klass
        # places beyond the free lanes wait: requests that arrive together must not count the
        # ones about to run against the queue (their reservations are applied in one batch)
        free = max(0, self.config.planner.max_batch - len(self.running))
        waiting = len(self.queues[klass]) + self._reserved[klass]
        if waiting - free >= self.config.max_queue:
            self.metrics.inc("superfluid_queue_full_total", **{"class": klass.label})
            raise QueueFull(f"model {self.name!r}: {waiting} {klass.label} requests are waiting already "
                            f"(--max-queue {self.config.max_queue}); retry later", retry_after_s=RETRY_AFTER_S)
        self._reserved[klass] += 1
        self._places[job.id] = klass
        job.scheduler = self

    def _unreserve(self, job: Job) -> bool:
        klass = self._places.pop(job.id, None)
        if klass is None:
            return False
        self._reserved[klass] -= 1
        return True

    def _send_tokenizes(self) -> None:
        """Queue frames for the waiting tokenizes and embeds the worker has room for,
        the most urgent class first, in arrival order within a class."""
        if self.worker is None or self.worker.dead:
            return
        for waiting in self._tokenize_waiting.values():
            while waiting and self._tokenize_sent < TOKENIZE_IN_FLIGHT:
                req = waiting.popleft()
                pending = self._tokenize.get(req)
                if pending is not None and not pending.sent:
                    self._frames.append(self._tokenize_frame(req, pending))

    def _tokenize_done(self, req: int) -> _Pending:
        """``req`` is answered (or failed): it leaves, and the next waiting one may go."""
        pending = self._tokenize.pop(req)
        if pending.sent:
            self._tokenize_sent -= 1
            self._send_tokenizes()
        return pending

    def _tokenize_frame(self, req: int, pending: _Pending) -> Tokenize | Embed:
        """The frame of a pending tokenize or embed request (they share ids and retries)."""
        pending.sent = True
        self._tokenize_sent += 1
        pending.attempts += 1
        cmd = pending.command
        if isinstance(cmd, _Embed):
            return Embed(req=req, inputs=cmd.inputs, normalize=cmd.normalize)
        return Tokenize(req=req, segments=cmd.segments, add_special=cmd.add_special)

    def _fail_tokenizes(self, error: Unavailable, *, unsent_only: bool = False) -> None:
        for req, pending in list(self._tokenize.items()):
            if not (unsent_only and pending.sent):
                self._tokenize_done(req)
                pending.command.reply.fail(error)
        for klass, waiting in self._tokenize_waiting.items():   # no stale ids pile up meanwhile
            self._tokenize_waiting[klass] = collections.deque(req for req in waiting if req in self._tokenize)
        self._note_cpu()

    async def idle(self, *, until_demand: bool = False) -> None:
        """Apply commands while no worker runs (a respawn's back-off, a model
        that cannot start). With ``until_demand``, return once a request wants
        a worker (a job queued or a tokenize asked): the owner tries again."""
        self._demand = False
        while not (until_demand and self._demand):
            tag, item = await self.inbox.receive()
            if tag is None and item is not None:
                self._apply(item)

    # -- the actor's side: job state ----------------------------------------------------

    def submit(self, job: Job) -> None:
        job.scheduler = self
        if self.closed is not None:  # the request resolved the model before it was unloaded
            job.finish_with(error=self.closed)
            return
        if job.done:  # stopped before it was queued
            return
        job.state = JobState.QUEUED
        job.queued_tick = self.tick_no
        job.seq = next(self._seq)
        job.created = job.created or trio.current_time()
        if len(job.prompt) > HOLD_MIN_SHARED and job.prefix_key is None:
            job.prefix_key = hash((job.partition, tuple(job.prompt[:HOLD_MIN_SHARED])))
        self.queues[job.klass].append(job)
        self._gauges()

    def cancel(self, job: Job) -> None:
        """Stop ``job`` (idempotent). A queued job ends now; a running one at
        the next engine step (the loop sends its ``Cancel``)."""
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
        elif job.lane is not None:
            self._stopping.append(job)   # only jobs holding a lane: the list stays within the lanes

    unavailable: str | None = None
    unavailable_code = "worker_unavailable"
    closed: JobError | None = None      # set by close(): the model was unloaded or failed

    def set_worker(self, worker: LinkHandle | None, *, unavailable: str | None = None,
                   code: str = "worker_unavailable") -> None:
        """``unavailable``: why no worker can be had now (requests fail 503 ``code``)."""
        self.worker = worker
        self.unavailable = unavailable
        self.unavailable_code = code
        if worker is not None:  # tokenizes that waited for a worker go to this one
            self._send_tokenizes()

    def _poke(self) -> None:
        """Wake the loop (the commit task failed a running job: its Cancel must go out)."""
        try:
            self.inbox_send.send_nowait((None, None))
        except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the loop re-reads job state after every inbox item

    # -- worker generations --------------------------------------------------------

    def worker_lost(self, reason: str) -> None:
        """Return running jobs to the head of their queues (or fail the ones that
        keep killing workers); tokenizes it held go to the next worker (or fail
        after ``TOKENIZE_ATTEMPTS``)."""
        for req, pending in list(self._tokenize.items()):
            pending.sent = False
            pending.parts = []
            if pending.attempts >= TOKENIZE_ATTEMPTS:
                del self._tokenize[req]
                pending.command.reply.fail(Unavailable(f"model {self.name!r}: no worker could tokenize the "
                                                       f"request ({reason})"))
        # every one left waits again, in its class's order
        self._tokenize_sent = 0
        for waiting in self._tokenize_waiting.values():
            waiting.clear()
        for req, pending in self._tokenize.items():
            self._tokenize_waiting[pending.command.klass].append(req)
        self._frames.clear()
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
        """The model is going away for good (unloaded, or its actor failed): fail
        every job (503 ``code``), every command waiting in the inbox and every later
        one (they raise :class:`Unavailable`), and close the inbox. Idempotent."""
        if self.closed is not None:
            return
        self.closed = JobError(status=503, message=message, code=code)
        self.fail_all(message, code=code)
        error = Unavailable(message, code=code)
        self._fail_tokenizes(error)
        while True:
            try:
                tag, item = self.inbox.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                break
            if tag is None and item is not None:
                self._apply(item)  # with ``closed`` set, each command ends typed
        self.inbox.close()
        self._places.clear()
        self._reserved.clear()
        self.set_worker(None, unavailable=message)

    def fail_queued(self, message: str, *, code: str = "worker_unavailable") -> None:
        """No worker can be had: fail queued jobs and tokenizes that wait for one (503 ``code``)."""
        for q in self.queues.values():
            while q:
                q.popleft().finish_with(error=JobError(status=503, message=message, code=code))
        self._fail_tokenizes(Unavailable(message, code=code), unsent_only=True)
        self._gauges()

    # -- the loop -----------------------------------------------------------------

    async def run(self, worker: LinkHandle) -> None:
        """Serve jobs on ``worker`` until it dies, applying commands as they come.

        Raises:
            LinkLost: the worker exited, hung past ``hang_timeout_s`` or broke the link.
            InjectedBug: the worker reported the injected fault.
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
            batch = await self._next_events(gen, timed=in_flight > 0 or bool(self._tokenize), worker=worker)
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

    async def _plan_and_send(self, worker: LinkHandle, *, send_tick: bool) -> bool:
        """Plan, send the plan's preemptions and admissions, and (if
        ``send_tick``) its Tick. Returns True when a Tick was sent."""
        if not send_tick and not (any(self.queues.values()) and self._may_admit(len(self.running))):
            return False  # nothing to admit or preempt and no tick to send: the plan would be empty
        lanes = self._lane_views()
        # when nothing can be admitted, the planner reads of the queue only that it is not empty
        # (a tick's budgets), so one job's view stands for all: a view of each of 960 queued agents
        # at every tick was a sixth of the daemon's time at 1,024 streams on 64 lanes
        plan = self.planner.plan(tick=self.tick_no, queued=self._job_views(full=self._may_admit(len(lanes))),
                                 lanes=lanes, prefill_tok_s=self._prefill_rate, held=self._held())
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

    def _may_admit(self, busy: int) -> bool:
        """Whether a plan could admit or preempt with ``busy`` lanes taken: a lane is free, or a
        job that preempts waits. (Every lane busy and only agents waiting, as under a backlog,
        was a plan of 256 ``LaneView``s per worker event that came out empty.)"""
        q = self.queues
        return busy < self.config.planner.max_batch or bool(q[QosClass.INTERACTIVE] or q[QosClass.COMPLETION])

    async def _next_events(self, gen: int, *, timed: bool, worker: LinkHandle) -> list[Any]:
        """Wait for the next inbox item, then take whatever else is already
        there (up to a bound), so a backlog of rounds commits with one fsync.
        Commands among them are applied here, in order.

        Raises:
            LinkLost: the worker died, or (``timed``) went silent past ``hang_timeout_s``.
        """
        with trio.move_on_after(self.config.hang_timeout_s if timed else math.inf) as scope:
            first = await self.inbox.receive()
        if scope.cancelled_caught:
            worker.kill()
            raise LinkLost(f"worker hung: no answer within {self.config.hang_timeout_s:g}s of a tick or tokenize")
        items = [first]
        while len(items) < DRAIN_BATCH:
            try:
                items.append(self.inbox.receive_nowait())
            except trio.WouldBlock:
                break
        out = []
        lost: LinkLost | None = None
        for tag, event in items:
            if tag is None:
                if event is not None:
                    self._apply(event)  # every command drained is applied, also behind a death report
                continue
            if tag != gen or lost is not None:
                continue  # a dead generation's leftovers
            if isinstance(event, LinkLost):
                lost = event
            elif event is not None:
                out.append(event)
        if lost is not None:
            raise lost
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

    async def _send_cancels(self, worker: LinkHandle) -> None:
        """Send what commands left for the worker (tokenizes) and the Cancels of stopped jobs, in one write."""
        frames, self._frames = self._frames, []
        # the jobs stopped since (not every running job: 1,024 lanes twice a loop turn)
        stopping, self._stopping = self._stopping, []
        for job in stopping:
            lane = job.lane
            if lane is not None and self.running.get(lane) is job and not job.cancel_sent:
                job.cancel_sent = True
                frames.append(Cancel(lane=lane, publish=True))
        if frames:
            await worker.send(*frames)

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

    def _job_views(self, *, full: bool = True) -> list[JobView]:
        # a queued job's view is rebuilt only when it changed, as a lane's is
        views = []
        for q in self.queues.values():
            for j in q:
                v = j.queue_view
                suspect = j.suspect
                if (v is None or v.queued_tick != j.queued_tick or v.klass is not j.klass or v.seq != j.seq
                        or v.suspect != suspect or v.prompt_tokens != len(j.prompt)):
                    v = j.queue_view = JobView(job=j.id, klass=j.klass, queued_tick=j.queued_tick, seq=j.seq,
                                               prompt_tokens=len(j.prompt), suspect=suspect)
                views.append(v)
                if not full:
                    return views
        return views

    def _lane_views(self) -> list[LaneView]:
        # a lane's view is rebuilt only when it changed (a LaneView for each of 256 lanes at
        # every plan was 3% of the daemon's time)
        views = []
        for lane, j in self.running.items():
            if j.preempted:
                continue
            v = j.view
            fresh = j.n_generated == j.tokens_at_admit
            if (v is None or v.lane != lane or v.prefill_left != j.prefill_left or v.queued_tick != j.queued_tick
                    or v.fresh != fresh):
                v = j.view = LaneView(lane=lane, job=j.id, klass=j.klass, admitted_seq=lane,
                                      prefill_left=j.prefill_left, queued_tick=j.queued_tick, fresh=fresh,
                                      suspect=j.lost_without_progress > 0)
            views.append(v)
        return views

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
        self.metrics.inc("superfluid_prefill_steps_aborted_total", done.aborted)
        self.metrics.inc("superfluid_engine_busy_seconds_total", done.busy_ms / 1000)
        self.metrics.set("superfluid_kv_used_tokens", done.kv_used)
        self.metrics.set("superfluid_kv_total_tokens", done.kv_total)
        self.last_tick = {"busy_ms": done.busy_ms, "prefill": done.prefill_tokens, "decode": done.decode_tokens,
                          "rounds": done.rounds}
        if done.spec:
            self._spec_report(done.spec)

    def _spec_report(self, spec: dict[str, Any]) -> None:
        """Speculation's cumulative counts (per worker generation: a new worker starts again
        from zero) become counter increments; the gates' verdicts become gauges."""
        for key in ("proposed", "accepted"):
            now = int(spec.get(key, 0))
            before = self._spec_seen.get(key, 0)
            self.metrics.inc(f"superfluid_spec_{key}_total", now - before if now >= before else now)
            self._spec_seen[key] = now
        for lanes, (verdict, speedup) in dict(spec.get("counts", {})).items():
            state = {"on": 1.0, "off": 0.0}.get(verdict, 0.5)
            self.metrics.set("superfluid_spec_gate_state", state, lanes=str(lanes))
            if speedup:
                self.metrics.set("superfluid_spec_gate_speedup", speedup, lanes=str(lanes))
        self.spec = spec

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
            if event.kind == FAULT_BUG:
                raise InjectedBug(f"model {self.name!r}: injected fault: {event.message}")
            job = self.running.pop(event.lane, None) if event.lane >= 0 else None
            if job is not None:
                status = 400 if event.kind == "admit" else 500
                job.finish_with(error=JobError(status=status, message=f"{event.kind}: {event.message}",
                                               type="invalid_request_error" if status == 400 else "server_error"))
                self.metrics.inc("superfluid_requests_total", outcome="error")
                self._gauges()
            else:
                log.warning("worker fault (%s): %s", event.kind, event.message)
        elif isinstance(event, Embedded):
            pending = self._tokenize.get(event.req)
            if pending is not None:
                pending.parts += event.vectors
                if event.error:
                    self._tokenize_done(event.req)
                    pending.command.reply.fail(EmbedRefused(event.error))
                    self._note_cpu()
                elif not event.more:
                    self._tokenize_done(event.req)
                    pending.command.reply.set((event.dim, pending.parts))
                    self._note_cpu()
        elif isinstance(event, Tokenized):
            pending = self._tokenize.get(event.req)
            if pending is not None:
                pending.parts += event.tokens
                if not event.more:
                    self._tokenize_done(event.req)
                    pending.command.reply.set(pending.parts)
                    self._note_cpu()

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
        for lane, token, piece, finish, lp, *spec in event.items:
            job = self.running.get(lane)
            if job is None:
                continue
            if spec:
                job.spec = (int(spec[0][0]), int(spec[0][1]))
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
        if job.lane is not None:
            self._stopping.append(job)
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

    @property
    def active(self) -> bool:
        """A request has something here: a job queued or running, a reserved place, a
        tokenize or embedding pending, or a command not applied yet (idle unload waits)."""
        return bool(self.running or self._tokenize or +self._reserved or any(self.queues.values())
                    or self.inbox_send.statistics().current_buffer_used)

    def statistics(self) -> dict[str, Any]:
        return {"lanes_active": len(self.running), "queued": sum(len(q) for q in self.queues.values()),
                "ticks": self.tick_no, **self.last_tick}

    def describe(self) -> str:
        """One line for a person debugging a stuck request (SIGUSR2): worker, queues,
        reservations, running lanes ``lane: (job, state, started, generated, prefill left)``
        and pending tokenizes ``req: (sent, attempts)``."""
        worker = self.worker
        queues = {k.label: [j.id for j in q] for k, q in self.queues.items() if q}
        running = {lane: (job.id, job.state.name, job.started, job.n_generated, job.prefill_left)
                   for lane, job in self.running.items()}
        tokenize = {req: (p.sent, p.attempts) for req, p in self._tokenize.items()}
        return (f"worker {'none' if worker is None else worker.generation}{' dead' if worker and worker.dead else ''}"
                f", unavailable {self.unavailable!r}, closed {self.closed is not None}, queued {queues}, "
                f"reserved {dict(self._reserved)}, running {running}, tokenize {tokenize}, tick {self.tick_no}")


def _shared_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b)) - 1
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
