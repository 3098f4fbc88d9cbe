"""Owners of lifetimes: worker processes, model actors and their supervisors (the failure boundaries)."""

from __future__ import annotations

from ._kill import scrub_env as scrub_env
from ._kill import worker_env as worker_env
from ._actor import ModelFailed as ModelFailed
from ._actor import ModelActor as ModelActor
from ._policy import RestartKind as RestartKind
from ._policy import RestartPolicy as RestartPolicy
from ._policy import RestartTracker as RestartTracker
from ._supervisor import supervise as supervise
from ._worker import WorkerDied as WorkerDied
from ._worker import WorkerHandle as WorkerHandle
from ._worker import WorkerLoadFailed as WorkerLoadFailed
from ._worker import WorkerSpawnFailed as WorkerSpawnFailed
from ._worker import WorkerSpec as WorkerSpec
from ._worker import open_worker as open_worker
from ._worker import worker_argv as worker_argv
from ._kill import graceful_kill as graceful_kill
from ._kill import kill_now as kill_now
from ._actor import RemoteSource as RemoteSource
from ._worker import raise_one_failure as raise_one_failure
