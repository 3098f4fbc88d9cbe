"""Scheduling: QoS classes, the pure tick planner, jobs and the scheduler loop."""

from __future__ import annotations

from ._job import Job as Job
from ._job import JobError as JobError
from ._job import JobState as JobState
from ._job import cache_partition as cache_partition
from ._loop import EmbedRefused as EmbedRefused
from ._loop import InjectedBug as InjectedBug
from ._loop import LinkHandle as LinkHandle
from ._loop import LinkLost as LinkLost
from ._loop import QueueFull as QueueFull
from ._loop import Scheduler as Scheduler
from ._loop import SchedulerConfig as SchedulerConfig
from ._loop import Unavailable as Unavailable
from ._plan import JobView as JobView
from ._plan import LaneView as LaneView
from ._plan import Plan as Plan
from ._plan import Planner as Planner
from ._plan import PlannerConfig as PlannerConfig
from ._qos import QosClass as QosClass
from ._qos import parse_qos as parse_qos
