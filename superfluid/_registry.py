"""The model registry: which models are loaded, which are known, and the
nursery that owns every model owner.

Loading starts a model owner in the registry's nursery (its worker must
handshake before ``load`` returns). Unloading fails every queued and running
job of that model typed (503 ``model_unloaded``), then cancels the owner's
scope, which shuts its worker down. An unloaded model stays *known* and is
loaded again on demand by the next request that names it.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import trio

from ._config import ModelSource, ServeConfig
from ._metrics import Metrics
from ._model import ServedModel
from .nursery import ModelOwner, RestartPolicy, WorkerSpec
from .sched import Scheduler, SchedulerConfig

if TYPE_CHECKING:
    from ._cpu import CpuYield
    from .sched._loop import Committer

__all__ = ["ModelRegistry"]

log = logging.getLogger("superfluid.models")


class ModelRegistry:
    def __init__(self, config: ServeConfig, metrics: Metrics, models_nursery: trio.Nursery,
                 committer: Committer | None = None, cpu: CpuYield | None = None) -> None:
        """``models_nursery`` owns every model owner task; it must outlive the registry's use.
        ``committer`` makes every model's tokens durable (the session store); ``cpu`` is
        the daemon's CPU policy, told by each scheduler when a request awaits its first token."""
        self.config = config
        self.committer = committer
        self.cpu = cpu
        self.metrics = metrics
        self.models_nursery = models_nursery
        self.loaded: dict[str, ServedModel] = {}
        self.known: dict[str, ModelSource] = {}
        self.default: str | None = None
        self._lock = trio.Lock()

    async def load(self, source: ModelSource, *, make_default: bool = False) -> ServedModel:
        """Start the model's owner and wait for its worker's handshake.

        Raises:
            WorkerLoadFailed: the worker could not load the model.
        """
        async with self._lock:
            if source.name in self.loaded:
                return self.loaded[source.name]
            cfg = self.config
            spec = WorkerSpec(runtime=source.runtime, model=source.spec, max_batch=cfg.max_batch,
                              max_context=cfg.max_context, threads=cfg.threads, host_cache_mb=cfg.host_cache_mb,
                              stream_interval_ms=cfg.stream_interval_ms,
                              agent_stream_interval_ms=cfg.agent_stream_interval_ms,
                              start_timeout_s=cfg.worker_start_timeout_s)
            sched = Scheduler(source.name, SchedulerConfig(planner=cfg.planner, hang_timeout_s=cfg.hang_timeout_s,
                                                               max_queue=cfg.max_queue,
                                                               max_prompt_bytes=cfg.max_prompt_bytes),
                              self.metrics, self.committer, cpu=self.cpu)
            owner = ModelOwner(source.name, spec, sched,
                               policy=RestartPolicy(max_restarts=cfg.max_restarts, window_s=cfg.restart_window_s))
            scope = trio.CancelScope()

            async def run_owner(*, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
                with scope:
                    await owner.serve(task_status=task_status)

            await self.models_nursery.start(run_owner)
            model = ServedModel(name=source.name, runtime=source.runtime, path=source.spec, owner=owner,
                                created=int(time.time()), scope=scope)
            self.loaded[source.name] = model
            self.known[source.name] = source
            if make_default or self.default is None:
                self.default = source.name
            log.info("model %s loaded on %s (worker pid %s)", source.name, source.runtime, owner.pid)
            return model

    async def unload(self, name: str) -> bool:
        """Returns False if ``name`` was not loaded.

        Raises:
            ValueError: it is the last loaded model.
        """
        async with self._lock:
            model = self.loaded.get(name)
            if model is None:
                return False
            if len(self.loaded) == 1:
                raise ValueError("cannot unload the last remaining model")
            del self.loaded[name]
            if self.default == name:
                self.default = next(iter(self.loaded))
            model.scheduler.close(f"model '{name}' was unloaded", code="model_unloaded")
            model.scope.cancel()
            log.info("model %s unloaded", name)
            return True

    async def get(self, name: str) -> ServedModel | None:
        """A loaded model, loading a known one on demand; None if unknown.

        Raises:
            WorkerLoadFailed: a known model failed to load again.
        """
        model = self.loaded.get(name)
        if model is not None:
            return model
        source = self.known.get(name)
        if source is None:
            return None
        return await self.load(source)

