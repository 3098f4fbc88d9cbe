"""The model actor: one nursery holding everything of one model.

Nursery tree for one model (its supervisor, ``_supervisor.py``, runs it in the
registry's models nursery)::

    model actor (ModelActor.serve)
    ├── sessions                          resume-TTL watchers, conversation-turn owners (each its own boundary)
    └── core
        ├── scheduler.run_commits()       the session log's group commits
        └── generations (the actor task)  the only writer of the scheduler's state
            └── worker generation N: open_worker(...)   process + link reader
                └── scheduler.run(worker)                until the worker dies
                    (between generations: scheduler.idle() applies commands)

When a generation ends with :class:`WorkerDied`, the scheduler returns its
running jobs to their queues, the restart policy is consulted, and the next
generation starts; queued and resumed jobs are served by it without outside
help. When the policy refuses (a restart storm), queued jobs fail typed (503)
and the actor waits for the next request before trying again.

:meth:`ModelActor.stop` (an unload) ends the actor: the actor task fails every
job typed (503 ``model_unloaded``) and leaves; the sessions sub-nursery gets a
bounded moment to see its jobs end (a turn lands its error, a watcher
returns), then the whole actor is cancelled. An unexpected exception in the
core ends every job typed (503 ``model_failed``) the same way and leaves the
actor with :class:`ModelFailed`, for the supervisor to log and restart;
anything else the actor raises (its sessions sub-nursery included) reaches the
supervisor too, which ends the jobs the same way (``supervise``).

A session task (:meth:`ModelActor.start_session`) is its own boundary: an
exception in it is logged (one traceback), its job is stopped, and the model
goes on. It starts from an empty ``contextvars`` context: nothing of the
request that started it (its exchange, the models it holds) follows it. Once
the actor is not running (stopped, failed, between restarts) no session task
starts: ``start_session`` refuses typed (:class:`~superfluid.sched.Unavailable`).
"""

from __future__ import annotations

import contextvars
import logging
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Any, Protocol

import trio

from ..sched import JobError, LinkLost, Scheduler, Unavailable
from ._policy import RestartPolicy, RestartTracker
from .._errors import first_leaf
from ._worker import WorkerLoadFailed, WorkerSpawnFailed, WorkerSpec, open_worker

if TYPE_CHECKING:
    from ..sched import Job

__all__ = ["ModelActor", "ModelFailed", "RemoteSource"]

log = logging.getLogger("superfluid.actor")
SESSIONS_GRACE_S = 2.0   # after its jobs ended, what a model's sessions get to finish (land a turn, log an end)


class RemoteSource(Protocol):
    """Where a fleet node's actor gets its workers (``fleet/_head.py``): the node's links."""

    async def connection(self) -> Any:
        """The node's next link (waits while there is none)."""

    def open(self, conn: Any, deliver: Callable[[int, Any], Awaitable[None]], *,
             generation: int) -> AbstractAsyncContextManager[Any]:
        """The worker behind ``conn`` (a :class:`~superfluid.sched.LinkHandle`), as ``open_worker``."""

    def describe(self, conn: Any) -> str: ...

    def up(self) -> None:
        """A link serves: the model's other nodes may shed to this one now."""

    def shed(self, scheduler: Scheduler) -> None:
        """Between links: move what waits in ``scheduler`` to the model's other nodes."""


class ModelFailed(Exception):
    """The model's actor raised unexpectedly; its jobs ended typed (503 ``model_failed``)."""


class ModelActor:
    def __init__(self, name: str, spec: WorkerSpec, scheduler: Scheduler, *, policy: RestartPolicy,
                 remote: RemoteSource | None = None) -> None:
        self.name = name
        self.remote = remote   # a fleet node's actor: its workers come over the node's links
        self.spec = spec
        self.scheduler = scheduler
        self.policy = policy
        self.generation = 0
        self.ack: Any = None
        self.pid: int | None = None
        self.respawns = 0
        self.started = False
        self._stop: tuple[str, str] | None = None
        self._main = trio.CancelScope()
        self._sessions: trio.Nursery | None = None
        self._session_tasks = 0
        self._sessions_idle = trio.Event()

    @property
    def info(self) -> dict[str, Any]:
        return dict(self.ack.model) if self.ack is not None else {}

    def renew(self, scheduler: Scheduler) -> None:
        """Ready the actor for a restart: a fresh scheduler, nothing of the failed run."""
        self.scheduler = scheduler
        self._main = trio.CancelScope()
        self._sessions = None

    def start_session(self, fn: Callable[..., Awaitable[object]], *args: Any, job: Job | None = None) -> None:
        """Run ``fn(*args)`` in the model's sessions sub-nursery (a resume-TTL watcher,
        a conversation turn's owner): unloading or restarting the model cancels it.
        ``job`` is the one it serves: an exception in the task stops it (the model goes on).
        The task starts from an empty ``contextvars`` context, not the caller's.

        Raises:
            Unavailable: the actor is not running (stopped, failed, or between restarts).
        """
        if self._sessions is None:
            message, code = self._stop or (f"model '{self.name}' is not running (it failed and restarts)",
                                           "model_failed")
            raise Unavailable(message, code=code)
        contextvars.Context().run(self._sessions.start_soon, self._session, fn, args, job)
        self._session_tasks += 1

    async def _session(self, fn: Callable[..., Awaitable[object]], args: tuple[Any, ...], job: Job | None) -> None:
        """One session task, and its boundary: a failure is logged, its job stopped, and the model goes on."""
        try:
            await fn(*args)
        except* Exception as failures:  # noqa: BLE001 - the session's boundary (a cancel passes on)
            shown = failures.exceptions[0] if len(failures.exceptions) == 1 else failures
            log.error("model %s: session task %s failed; its job is stopped, the model goes on", self.name,
                      getattr(fn, "__qualname__", fn), exc_info=shown)
            if job is not None and job.scheduler is not None and not job.done:
                # its readers see a typed 500, not a cancel they never asked for
                job.abort = JobError(status=500, code="session_failed",
                                     message=f"the session's task failed ({type(shown).__name__}); the model goes "
                                             "on: send the request again")
                job.scheduler.stop(job)
        finally:
            self._session_tasks -= 1
            if not self._session_tasks:
                self._sessions_idle.set()
                self._sessions_idle = trio.Event()
        await trio.lowlevel.checkpoint_if_cancelled()   # (a task that failed at once did not wait)

    @property
    def session_tasks(self) -> int:
        """How many session tasks the model holds now (tests: an unload leaves none)."""
        return self._session_tasks

    async def sessions_idle(self) -> None:
        """Wait until the model holds no session task."""
        while self._session_tasks:
            await self._sessions_idle.wait()
        await trio.lowlevel.checkpoint_if_cancelled()

    @property
    def stopped(self) -> bool:
        return self._stop is not None

    @property
    def stop_reason(self) -> tuple[str, str]:
        """(message, code) the jobs of a stopped model end with."""
        return self._stop or ("", "model_unloaded")

    def stop(self, message: str, *, code: str = "model_unloaded") -> None:
        """End the actor (an unload): every job of the model ends typed (503 ``code``)."""
        self._stop = (message, code)
        self._main.cancel()

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:  # noqa: ASYNC128 - passed on to the first generation
        """Run the model until stopped or cancelled.

        Raises:
            WorkerLoadFailed: the *first* worker could not load the model
                (surfaces from ``nursery.start``; later failures are retried).
            ModelFailed: an unexpected exception in the actor after it started
                (its jobs have ended typed, 503 ``model_failed``).

        Cancellation: cancelling ends the current worker (Shutdown, then the
        kill ladder) and returns; jobs are left as they are (a daemon shutdown:
        the session log resumes them on the next start).
        """
        failure: BaseException | None = None
        try:
            async with trio.open_nursery() as actor:
                self._sessions = await actor.start(self._serve_sessions)
                try:
                    async with trio.open_nursery() as core:
                        core.start_soon(self.scheduler.run_commits)
                        with self._main:
                            await self._generations(task_status)
                        core.cancel_scope.cancel()
                except Exception as exc:  # noqa: BLE001 - the core's failure: its jobs end typed, raised below
                    failure = first_leaf(exc)
                    if self.started:
                        self.scheduler.close(f"model '{self.name}' failed ({type(failure).__name__}: {failure}); "
                                             "it restarts", code="model_failed")
                if self.started and (self._stop is not None or failure is not None):
                    with trio.move_on_after(SESSIONS_GRACE_S):
                        await self.sessions_idle()
                self._sessions = None  # no session task starts into the cancelled nursery
                actor.cancel_scope.cancel()
        finally:
            self._sessions = None
        if failure is not None:
            if not self.started:
                raise failure  # the first load's failure, as itself
            raise ModelFailed(f"model '{self.name}': {type(failure).__name__}: {failure}") from failure

    async def _serve_sessions(self, *, task_status: trio.TaskStatus[trio.Nursery]) -> None:
        sessions: trio.Nursery | None = None
        try:
            async with trio.open_nursery() as sessions:
                task_status.started(sessions)
                await trio.sleep_forever()
        finally:
            if sessions is not None and self._sessions is sessions:
                self._sessions = None  # closed (the actor is ending): no task is spawned into it

    async def _generations(self, task_status: trio.TaskStatus[None]) -> None:  # noqa: ASYNC128 - passed on
        try:
            await self._run_generations(task_status)
        finally:
            if self._stop is not None:  # the actor task is the scheduler's writer: it ends the jobs
                self.scheduler.close(self._stop[0], code=self._stop[1])

    async def _run_generations(self, task_status: trio.TaskStatus[None]) -> None:
        if self.remote is not None:
            await self._run_remote_generations(self.remote, task_status)
            return
        tracker = RestartTracker(self.policy)
        spawn_failures = 0
        sched = self.scheduler
        while True:
            self.generation += 1
            try:
                async with open_worker(self.spec, sched.deliver, generation=self.generation) as worker:
                    spawn_failures = 0
                    self.ack = worker.ack
                    self.pid = worker.pid
                    if not self.started:
                        self.started = True
                        task_status.started()
                    log.info("model %s: worker pid %d ready (generation %d)", self.name, worker.pid, self.generation)
                    try:
                        await sched.run(worker)
                    finally:
                        if self._stop is not None:  # fail the jobs now, not after the worker's shutdown
                            sched.close(self._stop[0], code=self._stop[1])
            except WorkerSpawnFailed as exc:
                if not self.started:
                    raise
                # not a crash loop of the worker: the daemon lacks descriptors, processes or memory.
                # Requests fail typed until a spawn works; the restart intensity is not charged.
                spawn_failures += 1
                delay = self.policy.spawn_backoff(spawn_failures)
                message = f"engine worker cannot be started ({exc}); retrying in {delay:g}s"
                log.error("model %s: %s", self.name, message)
                sched.metrics.inc("superfluid_worker_spawn_failures_total")
                sched.set_worker(None, unavailable=message, code="resources_exhausted")
                sched.fail_queued(message, code="resources_exhausted")
                with trio.move_on_after(delay):
                    await sched.idle()
            except (LinkLost, WorkerLoadFailed, trio.TooSlowError) as exc:
                if not self.started:
                    raise
                reason = self._lost(exc)
                if tracker.allow(trio.current_time()):
                    self.respawns += 1
                    sched.metrics.inc("superfluid_worker_respawns_total")
                    log.warning("model %s: engine worker died (%s); respawning a fresh one", self.name, reason)
                    with trio.move_on_after(self.policy.backoff_s):
                        await sched.idle()
                    continue
                message = f"engine worker unavailable (respawn failed): {reason}"
                log.error("model %s: %s", self.name, message)
                sched.set_worker(None, unavailable=message)
                sched.fail_queued(message)
                await sched.idle(until_demand=True)
                sched.set_worker(None)
                tracker.reset()


    async def _run_remote_generations(self, remote: RemoteSource, task_status: trio.TaskStatus[None]) -> None:
        """A fleet node's generations: one per link the node gives (SPEC.md §14). Between
        links the scheduler idles and ``remote.shed`` moves what waits here to the model's
        other nodes; a job keeps its committed tokens, so the next node continues it. No
        restart intensity: a node that is gone is waited for (its link comes back or not),
        and requests go to the nodes that are there."""
        sched = self.scheduler
        while True:
            conn = await self._idle_until(remote)
            self.generation += 1
            try:
                async with remote.open(conn, sched.deliver, generation=self.generation) as worker:
                    self.ack = worker.ack
                    self.pid = worker.pid
                    if not self.started:
                        self.started = True
                        task_status.started()
                    log.info("model %s: node %s ready (generation %d)", self.name, remote.describe(conn),
                             self.generation)
                    remote.up()
                    try:
                        await sched.run(worker)
                    finally:
                        if self._stop is not None:
                            sched.close(self._stop[0], code=self._stop[1])
            except (LinkLost, WorkerLoadFailed, trio.TooSlowError) as exc:
                if not self.started:
                    raise
                reason = self._lost(exc)
                self.respawns += 1
                log.warning("model %s: %s; its requests go to the model's other nodes", self.name, reason)

    def _lost(self, exc: BaseException) -> str:
        """The worker (or node link) is gone: its running jobs go back to their queues. Returns why."""
        reason = str(exc) or type(exc).__name__
        self.scheduler.set_worker(None)
        self.scheduler.worker_lost(reason)
        self.pid = None
        return reason

    async def _idle_until(self, remote: RemoteSource) -> Any:
        """Idle (stops, commands, commits; what waits shed to other nodes) until the node's next link."""
        got: list[Any] = []
        async with trio.open_nursery() as nursery:
            async def take() -> None:
                got.append(await remote.connection())
                nursery.cancel_scope.cancel()

            nursery.start_soon(take)
            await self.scheduler.idle(shed=remote.shed)
        return got[0]
