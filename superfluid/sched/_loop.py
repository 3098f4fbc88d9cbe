"""The model's actor: the only task that holds the scheduler core and does its I/O.

One :class:`Scheduler` per model. It outlives worker processes: the model
owner runs :meth:`Scheduler.run` once per worker generation (and
:meth:`Scheduler.idle` between them), and calls :meth:`Scheduler.worker_lost`
when one dies, which puts every running job back at the head of its queue
with the tokens it already committed, so the next worker continues it.

Everything the state machine (``_core.py``) needs comes to the actor on four
paths, each drained every turn, and a doorbell rings when any of them gets
something:

* **stops** (:meth:`Scheduler.stop`): a plain method that records the job and
  rings. It never waits and is never dropped: a cancelled request's lane is
  given back even while the actor is held up (a slow disk, a full inbox).
  Bounded by the jobs that exist (each job once).
* **commands** (:meth:`reserve`, :meth:`queue`, :meth:`tokenize`,
  :meth:`embed`): a bounded inbox; a handler waits while it is full
  (back-pressure on new work only). Each carries its reply.
* **worker events**: their own channel, so the worker's reader never waits
  behind handlers' commands (a reader blocked on the command inbox while the
  actor blocks writing to the worker was a cycle broken only by the hang
  timeout).
* **commit results**: the commit task (:meth:`run_commits`) makes rounds
  durable and hands the outcome back here; only the actor shows tokens to
  readers and changes jobs. At most ``COMMIT_QUEUE`` rounds are in flight; a
  slow disk then stops the actor taking worker events (back-pressure on the
  engine), never stops or commands.

One writer: while the actor runs, any change of the core from another task is
an ``AssertionError`` (:meth:`Scheduler._writing`); the worker link checks the
same of its writes.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import attrs
import trio

from ..proto import MAX_TICKS_IN_FLIGHT, Emit, Event, Interrupt, TickDone
from ._core import (
    EmbedRefused,
    EmbedRequest,
    InjectedBug,
    MetricsSink,
    Queue,
    QueueFull,
    Reserve,
    Round,
    SchedulerConfig,
    SchedulerCore,
    SlotRequest,
    TokenizeRequest,
    Unavailable,
)
from ._job import Job, JobError
from ._qos import QosClass

if TYPE_CHECKING:
    from ._core import CpuPolicy

__all__ = ["Committer", "EmbedRefused", "InjectedBug", "LinkHandle", "LinkLost", "QueueFull", "Scheduler",
           "SchedulerConfig", "Unavailable"]

log = logging.getLogger("superfluid.sched")
INBOX_SIZE = 512            # handler commands waiting for the actor
DRAIN_BATCH = 64            # commands or events taken at once
COMMIT_QUEUE = 16           # rounds in flight to the commit task before the actor stops taking worker events
# worker events not yet taken: the protocol bounds what a worker sends unasked (MAX_TICKS_IN_FLIGHT
# ticks of at most 64 rounds, TOKENIZE_IN_FLIGHT answers in pieces, an Admitted or Fault per admission)
EVENTS_SIZE = 4096


class LinkLost(Exception):
    """The worker behind a :class:`LinkHandle` is gone: it exited, hung, or broke the protocol."""


@runtime_checkable
class LinkHandle(Protocol):
    """The actor's view of one worker generation. The actor is its only writer
    (:meth:`send`); the worker's events arrive through :meth:`Scheduler.deliver`
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


class Committer(Protocol):
    async def commit(self, spans: list[tuple[Job, list[int], list[bytes]]], ended: list[tuple[Job, str]]) -> None:
        """Make each ``(job, new_tokens, their_pieces)`` and each ``(job, finish)``
        durable before any reader sees them (the write-ahead rule)."""


class _NullCommitter:
    async def commit(self, spans: list[tuple[Job, list[int], list[bytes]]], ended: list[tuple[Job, str]]) -> None:
        await trio.lowlevel.checkpoint()


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


class Scheduler:
    def __init__(self, name: str, config: SchedulerConfig, metrics: MetricsSink, committer: Committer | None = None,
                 cpu: CpuPolicy | None = None) -> None:
        self.name = name
        self.config = config
        self.metrics = metrics
        self.cpu = cpu
        self.committer: Committer = committer or _NullCommitter()
        self.core = SchedulerCore(name, config, metrics, cpu, cpu_owner=self)
        self.core.guard = self._writing
        self._ending = object()  # the CPU policy's owner key while a request's last commit runs
        self.inbox_send, self._inbox = trio.open_memory_channel[Any](INBOX_SIZE)
        self._events_send, self._events = trio.open_memory_channel[tuple[int, Any]](EVENTS_SIZE)
        self._stops: dict[int, Job] = {}
        self._adopted: list[Job | TokenizeRequest | EmbedRequest | SlotRequest] = []   # from a gone node's scheduler (adopt)
        self._bell = trio.Event()
        self._commit_send, self._commit_recv = trio.open_memory_channel[Round](COMMIT_QUEUE + DRAIN_BATCH)
        self._results_send, self._results = trio.open_memory_channel[tuple[list[Round], JobError | None]](
            COMMIT_QUEUE + DRAIN_BATCH)
        self._in_flight_rounds = 0
        self._writer: trio.lowlevel.Task | None = None
        self.worker: LinkHandle | None = None

    # -- what request handlers call ------------------------------------------------------

    def _ring(self) -> None:
        self._bell.set()

    def ring(self) -> None:
        """Wake the actor (another node of the model came up: a gone one's actor may shed to it)."""
        self._ring()

    async def _command(self, command: Any) -> None:
        """Put ``command`` on the inbox (waits while it is full: bounded).

        Raises:
            Unavailable: the model is gone (its actor closed the inbox).
        """
        try:
            await self.inbox_send.send(command)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            closed = self.closed
            raise Unavailable(closed.message if closed else f"model {self.name!r} is gone",
                              code=closed.code or "model_unloaded" if closed else "model_unloaded") from None
        self._ring()

    async def reserve(self, job: Job) -> None:
        """Hold a place in ``job``'s class queue while its request logs the session;
        then :meth:`queue` it (or :meth:`stop` it to give the place back). The bound
        counts new requests only: jobs coming back (preempted, orphaned) always requeue.

        Raises:
            QueueFull: ``max_queue`` jobs of the class wait (or hold a place) already.
            Unavailable: the model was unloaded or failed.

        Cancellation: the place may still be taken after the caller left; the
        caller's ``stop`` gives it back (a stopped job's late reservation takes nothing).
        """
        job.scheduler = self
        reply = _Reply()
        await self._command(Reserve(job, reply))
        await reply.wait()

    async def queue(self, job: Job) -> None:
        """Queue ``job`` (a place reserved for it is used up). A model that is
        gone ends it typed (503), as its actor would have. No reply: follow the job."""
        job.scheduler = self
        try:
            await self._command(Queue(job))
        except Unavailable as exc:
            job.finish_with(error=self.closed or JobError(status=503, message=str(exc), code=exc.code))
            await trio.lowlevel.checkpoint_if_cancelled()

    def stop(self, job: Job) -> None:
        """Stop ``job`` (idempotent): a queued one ends now, a running one at the
        next engine step, a reserved place is given back. Never waits, never dropped:
        the actor applies it on its next turn, before any command."""
        owner = job.scheduler
        if owner is not None and owner is not self:
            owner.stop(job)  # it moved to another node of its model (adopt): stopped where it is
            return
        if self.closed is None:
            self._stops[job.id] = job
            self._ring()

    def adopt(self, moved: list[Job | TokenizeRequest | EmbedRequest | SlotRequest]) -> None:
        """Take jobs and tokenizes another scheduler of this model gave up (its fleet node is
        gone: :meth:`SchedulerCore.evacuate`). A plain method like :meth:`stop`: it never
        waits and is never dropped; the actor applies them on its next turn, after stops. A
        job keeps its committed tokens (its next admission continues from them) and takes no
        queue place (the bound counts new requests only)."""
        closed = self.closed
        for item in moved:
            if closed is not None:   # this node's model closed meanwhile: they end typed, as its own did
                if isinstance(item, Job):
                    if not item.done:
                        item.finish_with(error=closed)
                else:
                    item.reply.fail(Unavailable(closed.message, code=closed.code or "model_unloaded"))
            elif isinstance(item, Job):
                item.scheduler = self
        if closed is None:
            self._adopted += moved
            self._ring()

    async def tokenize(self, segments: list[tuple[str, bool]], *, add_special: bool = False,
                       klass: QosClass = QosClass.INTERACTIVE) -> list[int]:
        """Tokenize in the worker, retried on the next worker if one dies holding it. At most
        TOKENIZE_IN_FLIGHT go to the worker at once, the most urgent ``klass`` first.

        Raises:
            Unavailable: no worker could take the request.

        Cancellation: the worker still answers; the answer is dropped.
        """
        reply = _Reply()
        await self._command(TokenizeRequest(list(segments), add_special, reply, klass))
        result: list[int] = await reply.wait()
        return result

    async def pieces(self, segments: list[tuple[str, bool]] | None = None, *, ids: list[int] | None = None,
                     add_special: bool = False, klass: QosClass = QosClass.INTERACTIVE) -> list[tuple[int, bytes]]:
        """``(id, bytes)`` for each token of ``segments`` tokenized, or of ``ids`` (a detokenize),
        from the worker, as :meth:`tokenize` (retried on the next worker, urgent classes first).

        Raises:
            Unavailable: no worker could take the request.
        """
        reply = _Reply()
        await self._command(TokenizeRequest(list(segments or []), add_special, reply, klass, ids=tuple(ids or ()),
                                            pieces=True))
        result: list[tuple[int, bytes]] = await reply.wait()
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
        await self._command(EmbedRequest([list(t) for t in inputs], normalize, reply))
        dim, vectors = await reply.wait()
        return dim, vectors

    async def slot(self, action: str, seq: int, *, filename: str = "", cache_salt: str = "") -> Any:
        """A slot action (``save``/``restore``/``erase``) on the worker's KV sequence ``seq``:
        its :class:`~superfluid.proto.SlotDone`. Sent as a tokenize is (the next worker if one dies).

        Raises:
            Unavailable: no worker could take the request.
        """
        reply = _Reply()
        await self._command(SlotRequest(action, seq, filename, cache_salt, reply))
        return await reply.wait()

    # -- what the worker's reader calls -----------------------------------------------------

    async def deliver(self, generation: int, event: Any) -> None:
        """A worker event (or the worker's :class:`LinkLost`) for the actor.

        Raises:
            trio.ClosedResourceError: the model is gone (its actor closed).
        """
        await self._events_send.send((generation, event))
        self._ring()

    def deliver_nowait(self, generation: int, event: Any) -> None:
        """:meth:`deliver` from synchronous code (tests' in-memory workers)."""
        self._events_send.send_nowait((generation, event))
        self._ring()

    # -- the actor's side ----------------------------------------------------------------

    def _writing(self) -> None:
        """The one-writer rule: while the actor runs, only its task changes the core."""
        if __debug__ and self._writer is not None:
            assert trio.lowlevel.current_task() is self._writer, (
                f"model {self.name!r}: the scheduler's state is the actor's alone")

    def _claim(self) -> None:
        self._writing()
        self._writer = trio.lowlevel.current_task()

    def _release(self) -> None:
        self._writer = None

    @property
    def closed(self) -> JobError | None:
        return self.core.closed

    @property
    def unavailable(self) -> str | None:
        return self.core.unavailable

    @property
    def unavailable_code(self) -> str:
        return self.core.unavailable_code

    @property
    def running(self) -> dict[int, Job]:
        return self.core.running

    @property
    def queues(self) -> dict[QosClass, Any]:
        return self.core.queues

    @property
    def spec(self) -> dict[str, Any]:
        return self.core.spec

    def submit(self, job: Job) -> None:
        """Queue ``job`` now (the actor's side of :meth:`queue`; also restored sessions at startup)."""
        job.scheduler = self
        self.core.submit(job, trio.current_time())

    def cancel(self, job: Job) -> None:
        self.core.cancel(job)

    def set_worker(self, worker: LinkHandle | None, *, unavailable: str | None = None,
                   code: str = "worker_unavailable") -> None:
        """``unavailable``: why no worker can be had now (requests fail 503 ``code``)."""
        self.core.set_worker(worker is not None and not worker.dead, unavailable=unavailable, code=code)
        self.worker = worker

    def worker_lost(self, reason: str) -> None:
        self.core.worker_lost(reason)

    def fail_queued(self, message: str, *, code: str = "worker_unavailable") -> None:
        self.core.fail_queued(message, code=code)

    def close(self, message: str, *, code: str) -> None:
        """The model is going away for good (unloaded, or its actor failed): fail
        every job (503 ``code``), every command waiting in the inbox and every later
        one (they raise :class:`Unavailable`), and close the inbox. Idempotent."""
        if self.core.closed is not None:
            return
        self.core.close(message, code=code)
        self._stops.clear()
        adopted, self._adopted = self._adopted, []
        self.adopt(adopted)   # (closed now: each ends typed)
        while True:
            try:
                command = self._inbox.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                break
            self.core.apply(command, trio.current_time())  # with ``closed`` set, each ends typed
        self._inbox.close()
        self._events.close()
        self.worker = None

    def _take_stops(self) -> None:
        stops, self._stops = self._stops, {}
        for job in stops.values():
            self.core.stop(job)

    def _take_adopted(self) -> None:
        adopted, self._adopted = self._adopted, []
        now = trio.current_time()
        for item in adopted:
            if isinstance(item, Job):
                self.core.demand = True
                self.core.submit(item, now)   # (a job stopped meanwhile ended already: submit skips it)
            else:
                self.core.apply(item, now)

    def evacuate(self) -> list[Job | TokenizeRequest | EmbedRequest | SlotRequest]:
        """The actor's side of :meth:`SchedulerCore.evacuate` (between workers)."""
        return self.core.evacuate()

    def _take_commands(self) -> None:
        now = trio.current_time()
        for _ in range(DRAIN_BATCH):
            try:
                command = self._inbox.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                return
            self.core.apply(command, now)
        self._ring()   # more may wait: the next turn takes them without waiting

    def _take_results(self) -> None:
        while True:
            try:
                rounds, failure = self._results.receive_nowait()
            except trio.WouldBlock:
                return
            self._in_flight_rounds -= len(rounds)
            self.core.committed(rounds, failure, trio.current_time())

    def _turn(self) -> None:
        """What every turn of the actor applies first: stops, commit results, commands."""
        self._bell = trio.Event()
        self._take_stops()
        self._take_results()
        self._take_adopted()
        self._take_commands()

    async def idle(self, *, until_demand: bool = False,
                   shed: Callable[[Scheduler], None] | None = None) -> None:
        """Apply stops, commands and commit results while no worker runs (a respawn's
        back-off, a model that cannot start). With ``until_demand``, return once a
        request wants a worker (a job queued or a tokenize asked): the owner tries again.
        ``shed`` (a fleet node's actor while its node is gone) runs after every turn: it
        may :meth:`evacuate` what waits here to another node of the model."""
        self._claim()
        try:
            self.core.demand = False
            while True:
                self._turn()
                self._drop_events()
                if shed is not None:
                    shed(self)
                if until_demand and self.core.demand:
                    await trio.lowlevel.checkpoint()
                    return
                await self._bell.wait()
        finally:
            self._release()

    def _drop_events(self) -> None:
        """Between workers: what dead generations left is of no use."""
        while True:
            try:
                self._events.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                return

    async def run(self, worker: LinkHandle) -> None:
        """Serve jobs on ``worker`` until it dies.

        Raises:
            LinkLost: the worker exited, hung past ``hang_timeout_s`` or broke the link.
            InjectedBug: the worker reported the injected fault.
        """
        self._claim()
        try:
            await self._serve(worker)
        finally:
            self._release()

    async def _serve(self, worker: LinkHandle) -> None:
        core = self.core
        gen = worker.generation
        worker.send_timeout_s = self.config.hang_timeout_s  # a full pipe is a hang too
        self.set_worker(worker)
        core.new_worker()
        in_flight = 0           # ticks sent, not yet done
        interrupted = False
        while True:
            self._turn()
            # admissions and preemptions go out as soon as anything changes (the worker
            # applies them between engine steps); ticks keep the engine fed: tick N+1 is
            # planned while tick N runs. Cancels, tokenizes and the plan go in one write.
            frames = core.take_frames()
            while True:
                planned, ticked = core.plan(trio.current_time(), send_tick=in_flight < MAX_TICKS_IN_FLIGHT)
                frames += planned
                if not ticked:
                    break
                in_flight += 1
                interrupted = False
            if in_flight and not interrupted and core.preemptor_waiting():
                interrupted = True
                frames.append(Interrupt())
            if frames:
                await worker.send(*frames)
                continue     # the write was a checkpoint: look again before waiting
            flowing = self._in_flight_rounds < COMMIT_QUEUE
            if flowing:
                events = self._take_events(gen)
                if events:
                    in_flight -= self._apply_events(events)
                    continue
            timed = flowing and (in_flight > 0 or core.tokenizes_pending)
            with trio.move_on_after(self.config.hang_timeout_s if timed else math.inf):
                await self._bell.wait()
                continue
            worker.kill()
            raise LinkLost(f"worker hung: no answer within {self.config.hang_timeout_s:g}s of a tick or tokenize")

    def _take_events(self, gen: int) -> list[Any]:
        """The worker events waiting (up to a bound), so a backlog of rounds commits
        together (one fsync).

        Raises:
            LinkLost: the worker died (after the events it sent before dying are taken).
        """
        out = []
        for _ in range(DRAIN_BATCH):
            try:
                tag, event = self._events.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                break
            if tag != gen:
                continue  # a dead generation's leftovers
            if isinstance(event, LinkLost):
                self._apply_events(out)
                raise event
            out.append(event)
        return out

    def _apply_events(self, events: list[Any]) -> int:
        """Apply worker events in order; consecutive rounds commit together. Returns the ticks done."""
        core = self.core
        done = 0
        rounds: list[Emit] = []
        for event in [*events, None]:
            if isinstance(event, Emit):
                rounds.append(event)
                continue
            if rounds:
                self._to_commit(core.emit(rounds, trio.current_time()))
                rounds = []
            if isinstance(event, TickDone):
                done += 1
                core.tick_done(event)
            elif event is not None:
                core.handle(event)
        return done

    def _to_commit(self, rnd: Round | None) -> None:
        if rnd is None:
            return
        self._in_flight_rounds += 1
        self._commit_send.send_nowait(rnd)   # capacity COMMIT_QUEUE + DRAIN_BATCH: never full (see _serve)

    # -- the commit task --------------------------------------------------------------------

    async def run_commits(self) -> None:
        """Make rounds durable in order and hand each outcome back to the actor. Rounds
        that queued during one commit share the next (one write, one fsync).

        Owned by the model owner, beside the worker generations: staged rounds
        survive a worker's death. A failed commit (the log refuses writes) ends
        the jobs of its rounds typed (``JobError.log_failed``: 507 when the disk is full).
        """
        async for first in self._commit_recv:
            rounds = [first]
            while len(rounds) < COMMIT_QUEUE + DRAIN_BATCH:
                try:
                    rounds.append(self._commit_recv.receive_nowait())
                except trio.WouldBlock:
                    break
            failure = await self._commit(rounds)
            self._results_send.send_nowait((rounds, failure))  # as many results as rounds in flight, at most
            self._ring()

    async def _commit(self, rounds: list[Round]) -> JobError | None:
        merged: dict[int, tuple[Job, list[int], list[bytes]]] = {}
        for rnd in rounds:
            for job, tokens, pieces in rnd.spans.values():
                span = merged.setdefault(job.id, (job, [], []))
                span[1].extend(tokens)
                span[2].extend(pieces)
        ended = [pair for rnd in rounds for pair in rnd.ended]
        # A request's last tokens: its client (and at low concurrency the next request) waits
        # for this commit. The daemon thread stays responsive through it: on SCHED_BATCH the
        # wake-up after the fsync waited for a running engine thread's slice (10-11 ms, one
        # commit in five at 1 concurrent, against ~0.4 ms).
        responsive = self.cpu if any(rnd.finishes for rnd in rounds) else None
        if responsive is not None:
            responsive.note(self._ending, urgent=True)
        failure: JobError | None = None
        try:
            await self.committer.commit(list(merged.values()), ended)
        except Exception as exc:  # noqa: BLE001 - any log failure ends these jobs typed, never silently
            log.error("model %s: session log commit failed: %s", self.name, exc)
            failure = JobError.log_failed(exc)
        finally:
            if responsive is not None:
                responsive.note(self._ending, urgent=False)
        await trio.lowlevel.checkpoint_if_cancelled()   # (a log that refused at once did not wait)
        return failure

    # -- what the daemon reads ---------------------------------------------------------------

    @property
    def active(self) -> bool:
        """A request has something here: a job queued or running, a reserved place, a
        tokenize or embedding pending, or a command or stop not applied yet (idle unload waits)."""
        return bool(self.core.active or self._stops or self.inbox_send.statistics().current_buffer_used)

    def statistics(self) -> dict[str, Any]:
        core = self.core
        return {"lanes_active": len(core.running), "queued": sum(len(q) for q in core.queues.values()),
                "ticks": core.tick_no, **core.last_tick}

    def describe(self) -> str:
        """One line for a person debugging a stuck request (SIGUSR2): worker, queues,
        reservations, running lanes ``lane: (job, state, started, generated, prefill left)``
        and pending tokenizes ``req: (sent, attempts)``."""
        worker = self.worker
        return (f"worker {'none' if worker is None else worker.generation}{' dead' if worker and worker.dead else ''}"
                f", {self.core.describe()}, stops {len(self._stops)}, commits in flight {self._in_flight_rounds}")
