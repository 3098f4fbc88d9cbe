"""The model owner: a worker supervisor composed with a scheduler loop.

Nursery tree for one model::

    model owner (serve)
    ├── scheduler.run_commits()                 the session log's group commits
    └── worker generation N: open_worker(...)   process + link reader
        └── scheduler.run(worker)               until the worker dies

When a generation ends with :class:`WorkerDied`, the scheduler returns its
running jobs to their queues, the restart policy is consulted, and the next
generation starts; queued and resumed jobs are served by it without outside
help. When the policy refuses (a restart storm), queued jobs fail typed (503)
and the owner waits for the next request before trying again.
"""

from __future__ import annotations

import logging
from typing import Any

import trio

from ..sched import Scheduler
from ._policy import RestartPolicy, RestartTracker
from ._worker import WorkerDied, WorkerLoadFailed, WorkerSpawnFailed, WorkerSpec, first_leaf, open_worker

__all__ = ["ModelOwner"]

log = logging.getLogger("superfluid.owner")


class ModelOwner:
    def __init__(self, name: str, spec: WorkerSpec, scheduler: Scheduler, *, policy: RestartPolicy) -> None:
        self.name = name
        self.spec = spec
        self.scheduler = scheduler
        self.policy = policy
        self.generation = 0
        self.ack: Any = None
        self.pid: int | None = None
        self.respawns = 0

    @property
    def info(self) -> dict[str, Any]:
        return dict(self.ack.model) if self.ack is not None else {}

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run worker generations until cancelled.

        Raises:
            WorkerLoadFailed: the *first* worker could not load the model
                (surfaces from ``nursery.start``; later failures are retried).

        Cancellation: cancelling ends the current worker (Shutdown, then the
        kill ladder) and returns.
        """
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self.scheduler.run_commits)
                await self._generations(task_status)
        except BaseExceptionGroup as group:
            # hide the nursery: the first load's failure surfaces as itself
            failures, rest = group.split((WorkerDied, WorkerLoadFailed, trio.TooSlowError))
            if rest is not None or failures is None:
                raise
            raise first_leaf(failures) from group

    async def _generations(self, task_status: trio.TaskStatus[None]) -> None:
        tracker = RestartTracker(self.policy)
        started = False
        spawn_failures = 0
        sched = self.scheduler
        while True:
            self.generation += 1
            try:
                async with open_worker(self.spec, sched.inbox_send, generation=self.generation) as worker:
                    spawn_failures = 0
                    self.ack = worker.ack
                    self.pid = worker.pid
                    if not started:
                        started = True
                        task_status.started()
                    log.info("model %s: worker pid %d ready (generation %d)", self.name, worker.pid, self.generation)
                    await sched.run(worker)
            except WorkerSpawnFailed as exc:
                if not started:
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
                await trio.sleep(delay)
            except (WorkerDied, WorkerLoadFailed, trio.TooSlowError) as exc:
                if not started:
                    raise
                reason = str(exc) or type(exc).__name__
                sched.set_worker(None)
                sched.worker_lost(reason)
                self.pid = None
                if tracker.allow(trio.current_time()):
                    self.respawns += 1
                    sched.metrics.inc("superfluid_worker_respawns_total")
                    log.warning("model %s: engine worker died (%s); respawning a fresh one", self.name, reason)
                    await trio.sleep(self.policy.backoff_s)
                    continue
                message = f"engine worker unavailable (respawn failed): {reason}"
                log.error("model %s: %s", self.name, message)
                sched.set_worker(None, unavailable=message)
                sched.fail_queued(message)
                await self._wait_for_demand()
                sched.set_worker(None)
                tracker.reset()

    async def _wait_for_demand(self) -> None:
        sched = self.scheduler
        while True:
            tag, _event = await sched.inbox.receive()
            if tag is None:
                return
