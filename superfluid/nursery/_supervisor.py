"""A model's supervisor: the failure boundary around the whole of its actor.

Supervision tree (the registry starts one supervisor per loaded model in its
models nursery, ``daemon/_registry.py``)::

    models nursery (ModelRegistry.run)
    └── supervisor × N (supervise)        restarts its model's actor under the RestartPolicy
        └── model actor (ModelActor.serve)   sessions + core: everything of one model

The supervisor runs the actor in its own task and catches *everything* the
actor raises (its core, its worker generations and its sessions sub-nursery):
the model's jobs end typed (503 ``model_failed``; the core's failure has
ended them already), one traceback is logged, and the actor restarts with a
fresh scheduler under the model's :class:`RestartPolicy`. Past the policy's
intensity the model is given up (``on_give_up``: the registry forgets it, a
request naming it loads it again). Nothing above the supervisor (the other
models, the HTTP listener, the daemon) sees a model's failure. A cancel (the
daemon's shutdown) passes through.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import trio

from ._policy import RestartTracker
from .._errors import first_leaf

if TYPE_CHECKING:
    from ..sched import Scheduler
    from ._actor import ModelActor

__all__ = ["supervise"]

log = logging.getLogger("superfluid.actor")


async def supervise(actor: ModelActor, fresh: Callable[[], Scheduler], *,
                    on_give_up: Callable[[ModelActor], None],
                    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:  # noqa: ASYNC128 - passed on
    """Run ``actor``'s actor until it is stopped (an unload); restart it after a failure.

    ``fresh()`` makes the scheduler a restarted actor starts with; ``on_give_up(actor)``
    is called when the restart intensity is exceeded (the model is then gone for good).

    Raises:
        WorkerLoadFailed: (and the like) the first worker did not start: the load fails
            (raised before ``task_status.started``, to the caller of ``nursery.start``).
    """
    tracker = RestartTracker(actor.policy)
    while True:
        try:
            await actor.serve(task_status=task_status)
            return  # stopped (an unload)
        except Exception as exc:  # noqa: BLE001 - the model's boundary: the whole actor, its sessions included
            if not actor.started:
                raise  # the first load's failure: load() reports it
            failure = first_leaf(exc)
            # the actor has ended (its task is this one): the jobs of its scheduler end typed
            actor.scheduler.close(f"model '{actor.name}' failed ({type(failure).__name__}: {failure}); it restarts",
                                  code="model_failed")
            log.error("model %s: its actor failed; its requests ended (503 model_failed)", actor.name,
                      exc_info=exc.__cause__ if exc.__cause__ is not None else exc)
            actor.scheduler.metrics.inc("superfluid_model_failures_total")
        # a fresh scheduler at once: requests that arrive while the actor is down wait in its
        # inbox for the restarted actor instead of meeting the failed one's 503
        actor.renew(fresh())
        task_status = trio.TASK_STATUS_IGNORED
        if not tracker.allow(trio.current_time()):
            log.error("model %s failed %d times within %gs: unloaded (a request naming it loads it again)",
                      actor.name, actor.policy.max_restarts, actor.policy.window_s)
            actor.scheduler.close(f"model '{actor.name}' failed {actor.policy.max_restarts} times and was "
                                  "unloaded; a request naming it loads it again", code="model_failed")
            on_give_up(actor)
            await trio.lowlevel.checkpoint_if_cancelled()
            return
        await trio.sleep(actor.policy.backoff_s)
        if actor.stopped:  # unloaded while it was down
            message, code = actor.stop_reason
            actor.scheduler.close(message, code=code)
            return
        log.warning("model %s: restarting its actor", actor.name)
