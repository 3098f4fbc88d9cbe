"""The scheduler core: one model's queues, lanes and requests as a state machine.

Sans-I/O, as h11 is for HTTP: :class:`SchedulerCore` is a synchronous object
with no trio, no clock and no I/O. Commands from request handlers
(:class:`Reserve`, :class:`Queue`, :class:`TokenizeRequest`,
:class:`EmbedRequest`), stops, worker events and commit results go in; frames
for the worker (:meth:`SchedulerCore.take_frames`, :meth:`SchedulerCore.plan`),
rounds to make durable (:meth:`SchedulerCore.emit`) and replies (through each
command's ``reply``) come out. Time comes in as ``now`` arguments.

The actor (``_loop.py``) alone holds a core: it feeds it from its channels,
writes the frames to the worker and hands rounds to the commit task, whose
results come back to the actor and are applied here
(:meth:`SchedulerCore.committed`). Nothing else writes this state.

Jobs (``_job.py``) are the core's records of requests; readers follow them by
cursor and are woken when the core publishes progress.
"""

from __future__ import annotations

import collections
import itertools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import attrs

from .. import _defaults as D
from ..proto import (
    FAULT_BUG,
    Admit,
    Admitted,
    Cancel,
    Embed,
    Embedded,
    Emit,
    Fault,
    SlotAction,
    SlotDone,
    Telemetry,
    Tick,
    TickDone,
    Tokenize,
    Tokenized,
)
from ._jobtypes import JobError, JobState
from ._plan import JobView, LaneView, Planner, PlannerConfig
from ._qos import QosClass

if TYPE_CHECKING:
    from ._job import Job

__all__ = [
    "EmbedRefused", "EmbedRequest", "InjectedBug", "MetricsSink", "Queue", "QueueFull", "Reply", "Reserve",
    "Round", "SchedulerConfig", "SchedulerCore", "SlotRequest", "TokenizeRequest", "Unavailable",
]

log = logging.getLogger("superfluid.sched")
_F = TypeVar("_F", bound=Callable[..., Any])
HOLD_MIN_SHARED = 1024      # a queued job sharing this many prompt tokens with a prefilling lane waits for it
HOLD_MAX_TICKS = 400        # ticks a held job waits at most (~20 s of short ticks)
RETRY_AFTER_S = 1           # a full queue's Retry-After: a lane frees every few hundred ms at full load
FINISH_MAP = {"eos": "stop", "length": "length", "context": "length"}
TOKENIZE_ATTEMPTS = 3       # workers a tokenize is sent to before it fails (each died holding it)
# tokenizes and embeddings at the worker at once; the rest wait here, the most urgent class first
# (1,024 agents starting together put ~600 in the worker's pipe, and a chat's waited 0.3-1 s)
TOKENIZE_IN_FLIGHT = 32


class InjectedBug(Exception):
    """A fault injected for tests and the fuzzer (the mock's ``[[mock:bug_after=N]]``):
    the worker reports it and the loop raises this, as a bug in the model's actor would."""


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


class MetricsSink(Protocol):
    """What the core reports to (the daemon's per-model metrics view)."""

    def inc(self, name: str, amount: float = 1, **labels: str) -> None: ...
    def set(self, name: str, value: float, **labels: str) -> None: ...
    def observe(self, name: str, value: float, **labels: str) -> None: ...


class CpuPolicy(Protocol):
    """The daemon's CPU policy (``superfluid/_cpu.py``): told whether a request here waits."""

    def note(self, owner: object, *, urgent: bool) -> None: ...


class Reply(Protocol):
    """A command's answer slot: set once with a value or an error."""

    def set(self, value: Any = None) -> None: ...
    def fail(self, error: BaseException) -> None: ...


@attrs.frozen(kw_only=True)
class SchedulerConfig:
    planner: PlannerConfig = attrs.field(factory=PlannerConfig)
    hang_timeout_s: float = D.HANG_TIMEOUT_S
    lost_limit: int = 3
    max_queue: int = D.MAX_QUEUE  # jobs waiting per class; a new one beyond is refused (QueueFull)
    max_prompt_bytes: int = 0   # the prompt-size limit the API checks before tokenize (0: from the context)


# -- commands (what a request handler asks of the actor) -----------------------------------------


@attrs.frozen(eq=False)
class Reserve:
    """Hold a place in the job's class queue while its request logs the session."""

    job: Job
    reply: Reply


@attrs.frozen(eq=False)
class Queue:
    """Queue the job (its reserved place is used up). No reply: follow the job."""

    job: Job


@attrs.frozen(eq=False)
class TokenizeRequest:
    segments: list[tuple[str, bool]]
    add_special: bool
    reply: Reply
    klass: QosClass = QosClass.INTERACTIVE
    ids: tuple[int, ...] = ()     # only these ids' bytes (a detokenize)
    pieces: bool = False          # the answer is ``(id, bytes)`` pairs


@attrs.frozen(eq=False)
class EmbedRequest:
    inputs: list[list[int]]
    normalize: bool
    reply: Reply
    klass: QosClass = QosClass.COMPLETION


@attrs.frozen(eq=False)
class SlotRequest:
    """A slot action (``POST /slots/{id}``) for the worker; the reply is its ``SlotDone``.
    It goes with the tokenizes (their ids, their cap on what the worker holds, their retry)."""

    action: str
    seq: int
    filename: str
    cache_salt: str
    reply: Reply
    klass: QosClass = QosClass.INTERACTIVE


Command = Reserve | Queue | TokenizeRequest | EmbedRequest | SlotRequest


@attrs.define(eq=False)
class _Pending:
    command: TokenizeRequest | EmbedRequest | SlotRequest
    sent: bool = False
    attempts: int = 0
    parts: list[Any] = attrs.field(factory=list)  # the answer's pieces so far (Tokenized.more)


@attrs.define(eq=False)
class Round:
    """Engine rounds applied by the core, to be made durable before readers see them."""

    spans: dict[int, tuple[Job, list[int], list[bytes]]]  # job id -> (job, new tokens, their pieces)
    ended: list[tuple[Job, str]]              # (job, the worker's finish): what the log records
    finishes: list[tuple[Job, str]]           # (job, finish) to show readers once durable

    @property
    def counts(self) -> list[tuple[Job, int]]:
        return [(job, len(tokens)) for job, tokens, _pieces in self.spans.values()]


def _writes(method: _F) -> _F:
    """Mark a method that changes the core: it runs the holder's ``guard`` first
    (the actor's one-writer check), so a write from anywhere else is caught at once."""

    def checked(self: SchedulerCore, *args: Any, **kwargs: Any) -> Any:
        if self.guard is not None:
            self.guard()
        return method(self, *args, **kwargs)

    checked.__name__, checked.__doc__, checked.__wrapped__ = method.__name__, method.__doc__, method  # type: ignore[attr-defined]
    return checked  # type: ignore[return-value]


class SchedulerCore:
    """One model's scheduling state. Every method is synchronous and total: it
    changes the state, queues frames for the worker, answers replies, and
    returns. The actor that holds it is its only caller."""

    def __init__(self, name: str, config: SchedulerConfig, metrics: MetricsSink,
                 cpu: CpuPolicy | None = None, *, cpu_owner: object = None) -> None:
        self.name = name
        self.config = config
        self.metrics = metrics
        self.cpu = cpu
        self._cpu_owner = self if cpu_owner is None else cpu_owner
        self.planner = Planner(config.planner)
        self.queues: dict[QosClass, collections.deque[Job]] = {k: collections.deque() for k in QosClass}
        self._reserved: collections.Counter[QosClass] = collections.Counter()  # see reserve()
        self._places: dict[int, QosClass] = {}      # job id -> the class whose queue place it holds
        self.running: dict[int, Job] = {}           # lane -> job
        self._settling: dict[int, Job] = {}         # job id -> a job off its lane whose finish awaits its commit
        self.tick_no = 0
        self._lane_ids = itertools.count(1)
        self._seq = itertools.count(1)
        self._req_ids = itertools.count(1)
        self._tokenize: dict[int, _Pending] = {}
        # tokenize ids not sent yet, by class (stale ids, answered or failed, are skipped when met)
        self._tokenize_waiting: dict[QosClass, collections.deque[int]] = {k: collections.deque() for k in QosClass}
        self._tokenize_sent = 0      # pendings with ``sent`` (at most TOKENIZE_IN_FLIGHT)
        self._frames: list[Any] = []                # for the worker, with the next write
        self._stopping: list[tuple[Job, int | None]] = []  # (job, lane) stopped since the last write
        self.link_up = False                        # a worker is there to take frames
        self.demand = False                         # a request wants a worker (since reset by the actor)
        self._prefill_rate = 0.0
        self.last_tick: dict[str, float] = {}
        self._spec_seen: dict[str, int] = {}   # the worker's cumulative speculation counts, as last reported
        self._park_seen: dict[str, float] = {}   # and its park counts (--park)
        self.park: dict[str, Any] = {}           # its last park report
        self.spec: dict[str, Any] = {}         # its last speculation report (gates, totals)
        self.unavailable: str | None = None
        self.unavailable_code = "worker_unavailable"
        self.closed: JobError | None = None    # set by close(): the model was unloaded or failed
        self.guard: Callable[[], None] | None = None   # the holder's one-writer check, run by every write

    # -- commands -----------------------------------------------------------------------

    @_writes
    def apply(self, command: Command, now: float) -> None:
        """Apply one handler command (a reply says how it went)."""
        if isinstance(command, Queue):
            self._unreserve(command.job)
            self.demand = True
            self.submit(command.job, now)
        elif isinstance(command, Reserve):
            try:
                self._reserve(command.job)
            except (QueueFull, Unavailable) as exc:
                command.reply.fail(exc)
            else:
                command.reply.set()
        else:
            if self.closed is not None:
                command.reply.fail(self._closed_error())
                return
            req = next(self._req_ids)
            self._tokenize[req] = _Pending(command)
            self._tokenize_waiting[command.klass].append(req)
            self.demand = True
            self._send_tokenizes()
            self._note_cpu()

    @_writes
    def stop(self, job: Job) -> None:
        """Stop ``job`` (idempotent): a reserved place is given back, a queued or
        not yet queued job ends now (``cancelled``), a running one at the next
        engine step (its Cancel goes out with the next write)."""
        if self._unreserve(job) and not job.done:
            job.cancelled = True
            job.finish_with("cancelled")
        self.cancel(job)

    def _closed_error(self) -> Unavailable:
        assert self.closed is not None
        return Unavailable(self.closed.message, code=self.closed.code or "model_unloaded")

    def _reserve(self, job: Job) -> None:
        if self.closed is not None:
            raise self._closed_error()
        if job.done or job.cancelled:
            return   # stopped before its reservation arrived (stops overtake commands): nothing to hold
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

    def _unreserve(self, job: Job) -> bool:
        klass = self._places.pop(job.id, None)
        if klass is None:
            return False
        self._reserved[klass] -= 1
        return True

    # -- tokenizes and embeddings ------------------------------------------------------

    def _send_tokenizes(self) -> None:
        """Queue frames for the waiting tokenizes and embeds the worker has room for,
        the most urgent class first, in arrival order within a class."""
        if not self.link_up:
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

    def _tokenize_frame(self, req: int, pending: _Pending) -> Tokenize | Embed | SlotAction:
        """The frame of a pending tokenize or embed request (they share ids and retries)."""
        pending.sent = True
        self._tokenize_sent += 1
        pending.attempts += 1
        cmd = pending.command
        if isinstance(cmd, EmbedRequest):
            return Embed(req=req, inputs=cmd.inputs, normalize=cmd.normalize)
        if isinstance(cmd, SlotRequest):
            return SlotAction(req=req, action=cmd.action, seq=cmd.seq, filename=cmd.filename,
                              cache_salt=cmd.cache_salt)
        return Tokenize(req=req, segments=cmd.segments, add_special=cmd.add_special, ids=cmd.ids,
                        pieces=cmd.pieces)

    def _fail_tokenizes(self, error: Unavailable, *, unsent_only: bool = False) -> None:
        for req, pending in list(self._tokenize.items()):
            if not (unsent_only and pending.sent):
                self._tokenize_done(req)
                pending.command.reply.fail(error)
        for klass, waiting in self._tokenize_waiting.items():   # no stale ids pile up meanwhile
            self._tokenize_waiting[klass] = collections.deque(req for req in waiting if req in self._tokenize)
        self._note_cpu()

    @property
    def tokenizes_pending(self) -> bool:
        return bool(self._tokenize)

    # -- job state ----------------------------------------------------------------------

    @_writes
    def submit(self, job: Job, now: float) -> None:
        if self.closed is not None:  # the request resolved the model before it was unloaded
            job.finish_with(error=self.closed)
            return
        if job.done:  # stopped before it was queued
            return
        job.state = JobState.QUEUED
        job.queued_tick = self.tick_no
        job.seq = next(self._seq)
        job.created = job.created or now
        if len(job.prompt) > HOLD_MIN_SHARED and job.prefix_key is None:
            job.prefix_key = hash((job.partition, tuple(job.prompt[:HOLD_MIN_SHARED])))
        self.queues[job.klass].append(job)
        self._gauges()

    @_writes
    def cancel(self, job: Job) -> None:
        """Stop ``job`` (idempotent). A queued job ends now; a running one at
        the next engine step (:meth:`take_frames` has its ``Cancel``)."""
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
        else:   # running: its Cancel goes out with the next write (the list stays within the lanes)
            self._stopping.append((job, job.lane))

    @_writes
    def set_worker(self, up: bool, *, unavailable: str | None = None, code: str = "worker_unavailable") -> None:
        """Whether a worker takes frames; ``unavailable``: why none can be had now (503 ``code``)."""
        self.link_up = up
        self.unavailable = unavailable
        self.unavailable_code = code
        if up:  # tokenizes that waited for a worker go to this one
            self._send_tokenizes()

    @_writes
    def worker_lost(self, reason: str) -> None:
        """Return running jobs to the head of their queues (or fail the ones that
        keep killing workers); tokenizes it held go to the next worker (or fail
        after ``TOKENIZE_ATTEMPTS``)."""
        self.link_up = False
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
        self._stopping.clear()
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

    @_writes
    def evacuate(self) -> list[Job | TokenizeRequest | EmbedRequest | SlotRequest]:
        """Everything waiting here, taken out for another scheduler of the same model (a
        fleet node that is gone: SPEC.md §14). Called between workers (``worker_lost``
        has put the running jobs back in their queues): the queued jobs, in class order
        and queue order, and the tokenizes and embeds not answered, as their commands.
        A job whose tokens are still being committed stays (its rounds land here first,
        so the log keeps its tokens in order); a reserved place stays (its request
        queues here, and the next evacuation takes the job)."""
        assert not self.link_up, "evacuate runs between workers"
        moved: list[Job] = []
        for q in self.queues.values():
            keep = [job for job in q if job.staged]
            moved += [job for job in q if not job.staged]
            q.clear()
            q.extend(keep)
        for job in moved:
            job.view = job.queue_view = None
            job.held_since = None
        out: list[Job | TokenizeRequest | EmbedRequest | SlotRequest] = [*moved]
        out += [pending.command for pending in self._tokenize.values()]
        self._tokenize.clear()
        self._tokenize_sent = 0
        for waiting in self._tokenize_waiting.values():
            waiting.clear()
        self._gauges()
        return out

    @_writes
    def fail_all(self, message: str, *, code: str) -> None:
        """Fail every queued and running job typed (503), and those whose finish is still
        being committed: the model is going away."""
        for job in [*self.running.values(), *self._settling.values()]:
            if not job.done:
                job.finish_with(error=JobError(status=503, message=message, code=code))
        self.running.clear()
        self._settling.clear()
        for q in self.queues.values():
            while q:
                q.popleft().finish_with(error=JobError(status=503, message=message, code=code))
        self._gauges()

    @_writes
    def close(self, message: str, *, code: str) -> None:
        """The model is going away for good (unloaded, or its actor failed): fail
        every job and tokenize (503 ``code``); later commands are refused typed. Idempotent."""
        if self.closed is not None:
            return
        self.closed = JobError(status=503, message=message, code=code)
        self.fail_all(message, code=code)
        self._fail_tokenizes(Unavailable(message, code=code))
        self._places.clear()
        self._reserved.clear()
        self.set_worker(False, unavailable=message)

    @_writes
    def fail_queued(self, message: str, *, code: str = "worker_unavailable") -> None:
        """No worker can be had: fail queued jobs and tokenizes that wait for one (503 ``code``)."""
        for q in self.queues.values():
            while q:
                q.popleft().finish_with(error=JobError(status=503, message=message, code=code))
        self._fail_tokenizes(Unavailable(message, code=code), unsent_only=True)
        self._gauges()

    # -- frames for the worker -----------------------------------------------------------

    @_writes
    def take_frames(self) -> list[Any]:
        """What commands left for the worker (tokenizes) and the Cancels of stopped jobs, to go in one write."""
        frames, self._frames = self._frames, []
        # the jobs stopped since (not every running job: 1,024 lanes twice a loop turn)
        stopping, self._stopping = self._stopping, []
        for job, lane in stopping:
            if self.running.get(lane) is job and not job.cancel_sent:
                job.cancel_sent = True
                frames.append(Cancel(lane=lane, publish=True))
        return frames

    @_writes
    def plan(self, now: float, *, send_tick: bool) -> tuple[list[Any], bool]:
        """Plan: the plan's preemptions and admissions and (if ``send_tick`` and
        there is work) its Tick, as frames for one write; and whether a Tick is among them."""
        if not send_tick and not (any(self.queues.values()) and self._may_admit(len(self.running))):
            return [], False  # nothing to admit or preempt and no tick to send: the plan would be empty
        lanes = self._lane_views()
        # when nothing can be admitted, the planner reads of the queue only that it is not empty
        # (a tick's budgets), so one job's view stands for all: a view of each of 960 queued agents
        # at every tick was a sixth of the daemon's time at 1,024 streams on 64 lanes
        plan = self.planner.plan(tick=self.tick_no, queued=self._job_views(full=self._may_admit(len(lanes))),
                                 lanes=lanes, prefill_tok_s=self._prefill_rate, held=self._held())
        # the plan is of this state, applied with nothing in between: its lanes and jobs are there
        frames: list[Any] = []
        for lane in plan.preempts:
            self.running[lane].preempted = True
            self.metrics.inc("superfluid_preemptions_total")
            frames.append(Cancel(lane=lane, publish=True))
        order = list(plan.prefill_order)
        for job_id in plan.admits:
            job = self._dequeue(job_id)
            lane = next(self._lane_ids)
            order.append(lane)
            frames.append(self._admit(job, lane, now))
        ticked = send_tick and bool(plan.prefill_budget or plan.max_rounds)
        if ticked:
            self.tick_no += 1
            self.metrics.inc("superfluid_ticks_total")
            frames.append(Tick(seq=self.tick_no, prefill_budget=plan.prefill_budget, max_rounds=plan.max_rounds,
                               time_budget_ms=plan.time_budget_ms, prefill_lanes=tuple(order)))
        return frames, ticked

    def _may_admit(self, busy: int) -> bool:
        """Whether a plan could admit or preempt with ``busy`` lanes taken: a lane is free, or a
        job that preempts waits. (Every lane busy and only agents waiting, as under a backlog,
        was a plan of 256 ``LaneView``s per worker event that came out empty.)"""
        q = self.queues
        return busy < self.config.planner.max_batch or bool(q[QosClass.INTERACTIVE] or q[QosClass.COMPLETION])

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

    def preemptor_waiting(self) -> bool:
        """An interactive or completion job waits for a lane held by a lower class (worth an Interrupt)."""
        urgent = self.queues[QosClass.INTERACTIVE] or self.queues[QosClass.COMPLETION]
        if len(self.running) < self.config.planner.max_batch:
            return bool(urgent)
        return bool(urgent) and any(j.klass > QosClass.COMPLETION and not j.preempted for j in self.running.values())

    def _admit(self, job: Job, lane: int, now: float) -> Admit:
        job.state = JobState.RUNNING
        job.lane = lane
        job.kv_seq = -1   # until the worker's Admitted names it
        job.preempted = False
        job.cancel_sent = False
        generated = job.generated()
        job.prefill_left = len(job.prompt) + len(generated)
        job.tokens_at_admit = len(generated)
        job.admitted_at = job.admitted_at or now
        self.running[lane] = job
        self._gauges()
        return Admit(
            lane=lane, tokens=job.prompt + generated, n_prompt=len(job.prompt),
            max_new=job.max_new, sampling=job.sampling, ignore_eos=job.ignore_eos, priority=int(job.klass),
            cache_salt=job.partition, stops=job.stops,
        )

    def _dequeue(self, job_id: int) -> Job:
        """The queued job ``job_id``, taken off its queue."""
        job = next(j for q in self.queues.values() for j in q if j.id == job_id)
        self.queues[job.klass].remove(job)
        return job

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

    # -- worker events ---------------------------------------------------------------------

    @_writes
    def tick_done(self, done: TickDone) -> None:
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
                          "rounds": done.rounds, "kv_used": done.kv_used, "kv_total": done.kv_total}
        if done.spec:
            self._spec_report(done.spec)
        if done.park:
            self._park_report(done.park)

    def _park_report(self, park: dict[str, Any]) -> None:
        """The worker's cumulative park counts (from zero in each worker generation) become
        counter increments; the directory's bytes a gauge."""
        counters = {"parks": "superfluid_parks_total", "resumes": "superfluid_resumes_total",
                    "resume_tokens": "superfluid_resume_tokens_total",
                    "restore_s": "superfluid_park_restore_seconds_total", "evicted": "superfluid_park_evictions_total",
                    "export_s": "superfluid_park_export_seconds_total"}
        seen = self._park_seen
        for key, name in counters.items():
            now = float(park.get(key, 0))
            before = seen.get(key, 0.0)
            self.metrics.inc(name, now - before if now >= before else now)
            seen[key] = now
        for reason, n in dict(park.get("fallbacks", {})).items():
            key = f"fallback:{reason}"
            now, before = float(n), seen.get(key, 0.0)
            self.metrics.inc("superfluid_park_fallbacks_total", now - before if now >= before else now, reason=str(reason))
            seen[key] = now
        self.metrics.set("superfluid_park_bytes", float(park.get("bytes", 0)))
        self.park = park

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

    @_writes
    def new_worker(self) -> None:
        """A new worker generation: its speculation counts start from zero."""
        self._spec_seen = {}
        self._park_seen = {}

    @_writes
    def handle(self, event: Any) -> None:
        """Apply one worker event other than ``Emit`` and ``TickDone``.

        Raises:
            InjectedBug: the worker reported the injected fault.
        """
        if isinstance(event, Telemetry):
            park = _park_counts(event.values)
            if park:
                self._park_report(park)
        elif isinstance(event, Admitted):
            job = self.running.get(event.lane)
            if job is not None:
                job.kv_seq = event.seq
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
        elif isinstance(event, SlotDone):
            pending = self._tokenize.get(event.req)
            if pending is not None:
                self._tokenize_done(event.req)
                pending.command.reply.set(event)
                self._note_cpu()
        elif isinstance(event, Tokenized):
            pending = self._tokenize.get(event.req)
            if pending is not None:
                cmd = pending.command
                wants = isinstance(cmd, TokenizeRequest) and (cmd.pieces or bool(cmd.ids))
                pending.parts += zip(event.tokens, event.pieces, strict=False) if wants else event.tokens
                if not event.more:
                    self._tokenize_done(event.req)
                    pending.command.reply.set(pending.parts)
                    self._note_cpu()
        else:
            log.warning("model %s: the worker sent %s while serving; ignored", self.name, type(event).__name__)

    @_writes
    def emit(self, events: list[Emit], now: float) -> Round | None:
        """Apply engine rounds: stage their tokens and free the lanes that ended. Returns
        the round to make durable (None when nothing changed): readers see it after
        :meth:`committed`."""
        spans: dict[int, tuple[Job, list[int], list[bytes]]] = {}
        ended: list[tuple[Job, str]] = []
        for event in events:
            self._apply_round(event, spans, ended)
        if not (spans or ended):
            return None
        finishes = self._settle(ended, now)
        for job, _finish in finishes:
            self._settling[job.id] = job
        return Round(spans=spans, ended=ended, finishes=finishes)

    def _apply_round(self, event: Emit, spans: dict[int, tuple[Job, list[int], list[bytes]]],
                     ended: list[tuple[Job, str]]) -> None:
        decoding = 0
        for lane, token, piece, finish, lp, *spec in event.items:
            job = self.running.get(lane)
            if job is None:
                continue
            if spec:
                job.spec = (int(spec[0][0]), int(spec[0][1]))
            if token >= 0 and finish not in ("eos", "cancelled", "error"):
                stopped = bool(job.stops) and job.completes_stop(piece)
                job.staged.append((token, piece, lp))
                span = spans.setdefault(job.id, (job, [], []))
                span[1].append(token)
                span[2].append(piece)
                decoding += 1
                if stopped:
                    # The job ends here, with this token (usage counts it, as llama-server's does):
                    # the lane is free now and its Cancel goes out with the next write, ahead of any
                    # Admit; what the worker emits for it until then (a draft's tail) is dropped.
                    del self.running[lane]
                    ended.append((job, "stop"))
                    if finish is None:
                        job.cancel_sent = True
                        self._frames.append(Cancel(lane=lane, publish=True))
                    continue
            if finish is not None:
                del self.running[lane]
                ended.append((job, finish))
        if decoding > 1:
            self.metrics.inc("superfluid_batched_rounds_total")

    def _settle(self, ended: list[tuple[Job, str]], now: float) -> list[tuple[Job, str]]:
        """The scheduler's side of jobs that left their lanes: preempted ones
        requeue now; the others end for readers once their round is durable."""
        finishes = []
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

    # -- commit results --------------------------------------------------------------------

    @_writes
    def committed(self, rounds: list[Round], failure: JobError | None, now: float) -> None:
        """``rounds`` are durable (``failure`` None) or the log refused them: show
        their tokens and finishes to readers, or end their jobs typed."""
        counts: dict[int, list[Any]] = {}
        for rnd in rounds:
            for job, n in rnd.counts:
                counts.setdefault(job.id, [job, 0])[1] += n
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
                self._settling.pop(job.id, None)
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
        if job.lane is not None:   # (before finish_with, which lets go of the lane number)
            self._stopping.append((job, job.lane))
        job.finish_with(error=error)

    # -- what the daemon reads ------------------------------------------------------------

    def _note_cpu(self) -> None:
        """Tell the daemon's CPU policy whether a request here waits for its
        first token (see ``superfluid/_cpu.py``). Called wherever that can
        change: ``_gauges`` (queues and lanes), tokenizes and commits."""
        if self.cpu is not None:
            urgent = bool(self._tokenize) or any(self.queues.values()) or any(
                job.first_token_at is None for job in self.running.values())
            self.cpu.note(self._cpu_owner, urgent=urgent)

    def _gauges(self) -> None:
        # a preempted lane is on its way out (its Cancel precedes the preemptor's Admit on the
        # link): counting it would show more lanes than --max-batch until the worker acks
        self.metrics.set("superfluid_lanes_active", sum(1 for j in self.running.values() if not j.preempted))
        for k, q in self.queues.items():
            self.metrics.set("superfluid_queue_depth", len(q), **{"class": k.label})
        self._note_cpu()

    @property
    def active(self) -> bool:
        """A request has something here: a job queued or running, a reserved place, or a tokenize pending."""
        return bool(self.running or self._tokenize or +self._reserved or any(self.queues.values()))

    def describe(self) -> str:
        queues = {k.label: [j.id for j in q] for k, q in self.queues.items() if q}
        running = {lane: (job.id, job.state.name, job.started, job.n_generated, job.prefill_left)
                   for lane, job in self.running.items()}
        tokenize = {req: (p.sent, p.attempts) for req, p in self._tokenize.items()}
        return (f"unavailable {self.unavailable!r}, closed {self.closed is not None}, queued {queues}, "
                f"reserved {dict(self._reserved)}, running {running}, tokenize {tokenize}, tick {self.tick_no}")


def _shared_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b)) - 1
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _park_counts(values: dict[str, float]) -> dict[str, Any]:
    """A ``Telemetry`` event's park counts (``park.<count>``, ``park.fallback.<reason>``; sent by
    worker/_park.py) in ``TickDone.park``'s form; {} if it has none."""
    out: dict[str, Any] = {}
    fallbacks: dict[str, float] = {}
    for key, value in values.items():
        if key.startswith("park.fallback."):
            fallbacks[key[len("park.fallback."):]] = value
        elif key.startswith("park."):
            out[key[len("park."):]] = value
    if out:
        out["fallbacks"] = fallbacks
    return out
