"""The tick planner: a pure function from scheduler state to the next tick.

No I/O, no clocks: the loop passes the tick number and measured rates in, and
carries the returned :class:`Plan` out. Rules (see SPEC.md, "Scheduler"):

* **Admission**: while a lane is free, admit the head of the queue with the
  best *effective* class whose class is under its lane cap. Effective class =
  ``class - min(waited_ticks // starvation_ticks, class)`` (aging), ties go
  to the earliest-queued job; interactive and completion jobs always come
  before agent and background ones (aging orders each group, never across).
* **Preemption**: when every lane is busy, walk the waiting jobs in admission
  order (skipping held jobs and jobs whose class is at its cap); while the next
  one is ``interactive`` or ``completion`` and a lane of a strictly lower class
  exists, stop that lane (decoding before prefilling, then the lowest class,
  then the newest) and reserve the freed lane for that job. The first job that
  cannot preempt ends preemption for the tick, so a freed lane always goes to
  the job it was freed for.
* **Quarantine**: a job that was running without progress when a worker
  died is a *suspect* (it may be what kills workers). A suspect is admitted
  only when every lane has produced a token since its admission, and alone;
  while it runs without a token, nothing else is admitted or preempted. A
  worker death then charges only the suspect, so a request that crashes the
  engine fails typed after ``lost_limit`` deaths without taking innocent
  requests admitted beside it along (SPEC.md, "Faults").
* **Shared-prefix hold**: the loop passes ``held``, the jobs that share a long
  prefix with a lane still prefilling it; they wait and are then seeded from it.
* **Budgets**: while a newcomer could join at the end of the tick (a queue is
  non-empty), a tick prefills at most ``latency_prefill_s`` of work; ticks are
  short (``tick_free_ms``) while a job waits and longer (``tick_busy_ms``)
  otherwise (a newcomer for a free lane is admitted mid-tick, so a free lane
  needs no short tick, and every tick boundary costs the engine ~1-2.5 ms). Prefill order: starving lanes, then class, then shortest
  remaining prompt.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs

from .. import _defaults as D
from ._qos import QosClass

__all__ = ["JobView", "LaneView", "Plan", "Planner", "PlannerConfig"]


@attrs.frozen(kw_only=True)
class JobView:
    job: int
    klass: QosClass
    queued_tick: int
    seq: int                   # FIFO order within and across classes (lower = earlier)
    prompt_tokens: int = 0
    suspect: bool = False      # a worker died while it ran, and it made no progress since


@attrs.frozen(kw_only=True)
class LaneView:
    lane: int
    job: int
    klass: QosClass
    admitted_seq: int          # higher = newer
    prefill_left: int          # tokens still to prefill; 0 = decoding
    queued_tick: int = 0       # when its job was queued (for starvation order)
    fresh: bool = False        # no token generated since this admission
    suspect: bool = False      # its job is a suspect on probation (see "Quarantine")


@attrs.frozen(kw_only=True)
class Plan:
    admits: tuple[int, ...] = ()       # job ids, in admission order
    preempts: tuple[int, ...] = ()     # lane ids
    prefill_budget: int = 0
    max_rounds: int = 0
    time_budget_ms: int = 0
    prefill_order: tuple[int, ...] = ()

    @property
    def empty(self) -> bool:
        return not (self.admits or self.preempts or self.prefill_budget or self.max_rounds)


@attrs.frozen(kw_only=True)
class PlannerConfig:
    max_batch: int = D.MAX_BATCH
    class_lanes: Mapping[QosClass, int] = attrs.field(factory=dict)
    starvation_ticks: int = D.STARVATION_TICKS
    prefill_budget: int = D.PREFILL_BUDGET
    prefill_chunk: int = 512
    latency_prefill_s: float = 0.5
    tick_free_ms: int = 50
    tick_busy_ms: int = D.TICK_TARGET_MS
    max_rounds: int = 64

    def cap(self, klass: QosClass) -> int:
        return max(1, min(self.class_lanes.get(klass, self.max_batch), self.max_batch))


class Planner:
    def __init__(self, config: PlannerConfig) -> None:
        self.config = config

    def order(self, job: JobView, tick: int) -> tuple[int, int, int]:
        """A queued job's place in admission order: interactive and completion jobs first
        (aging never puts an agent or background job ahead of a job that preempts: under a
        backlog every agent ages to class 0, and an interactive request waited behind all
        of them, 3.5-10 s at 1,024 streams), then effective class, then FIFO."""
        return (0 if job.klass.preempts else 1, self.effective_class(job, tick), job.seq)

    def effective_class(self, job: JobView, tick: int) -> int:
        waited = max(0, tick - job.queued_tick)
        return int(job.klass) - min(waited // max(1, self.config.starvation_ticks), int(job.klass))

    def plan(
        self,
        *,
        tick: int,
        queued: Sequence[JobView],
        lanes: Sequence[LaneView],
        prefill_tok_s: float = 0.0,
        held: frozenset[int] = frozenset(),
    ) -> Plan:
        """Plan the next tick. Jobs in ``held`` (waiting for a lane that is
        still prefilling their shared prefix) are not admitted this tick."""
        cfg = self.config
        per_class = {k: 0 for k in QosClass}
        for ln in lanes:
            per_class[ln.klass] += 1
        waiting = sorted(queued, key=lambda j: self.order(j, tick))
        free = cfg.max_batch - len(lanes)

        # preemption: one victim per waiting preemptor, only when no lane is free
        # preemption: one victim per waiting preemptor that can take the freed
        # lane (its class under its cap); the freed lane is reserved for it
        preempts: list[int] = []
        admits: list[int] = []
        remaining = list(waiting)
        probing = any(ln.suspect and ln.fresh for ln in lanes)
        fresh = any(ln.fresh for ln in lanes)
        if probing:
            free = 0
        elif free <= 0:
            capped: set[QosClass] = set()   # classes of capped jobs ahead: freeing their lanes would skip the line
            for job in waiting:
                if job.job in held:
                    continue
                if per_class[job.klass] >= cfg.cap(job.klass):
                    capped.add(job.klass)
                    continue
                # the next job in admission order gets the freed lane, so only a
                # preemptor with a strictly lower-class victim may free one
                victims = [ln for ln in lanes
                           if ln.klass > job.klass and ln.klass not in capped and ln.lane not in preempts]
                if not job.klass.preempts or not victims:
                    break
                victim = max(victims, key=lambda ln: (ln.prefill_left == 0, int(ln.klass), ln.admitted_seq))
                if job.suspect and (admits or any(ln.fresh for ln in lanes if ln.lane != victim.lane)):
                    break  # a suspect waits until every other lane has produced a token
                preempts.append(victim.lane)
                per_class[victim.klass] -= 1
                per_class[job.klass] += 1
                admits.append(job.job)
                remaining.remove(job)
                if job.suspect:
                    break

        while free > 0 and remaining:
            pick = next((j for j in remaining if j.job not in held and per_class[j.klass] < cfg.cap(j.klass)), None)
            if pick is None:
                break
            if pick.suspect and (fresh or admits):
                break  # it waits (and holds the line) until every lane has produced a token
            admits.append(pick.job)
            per_class[pick.klass] += 1
            remaining.remove(pick)
            free -= 1
            if pick.suspect:
                break  # alone: nothing else is admitted beside a suspect

        # budgets
        admitted = {j.job: j for j in waiting if j.job in admits}
        still_live = [ln for ln in lanes if ln.lane not in preempts]
        any_prefill = any(ln.prefill_left > 0 for ln in still_live) or bool(admitted)
        any_decode = any(ln.prefill_left == 0 for ln in still_live) or bool(admitted)
        # while a lane runs, a newcomer may be admitted mid-tick (into a free lane, a lane its
        # request left, or a preempted one): keep a prefill budget for it. (With every lane busy
        # a tick had none: at 1,024 lanes a chat's prompt waited ~1 s for a tick planned after it.)
        budget = cfg.prefill_budget if any_prefill or still_live else 0
        if budget and (remaining or any(ln.klass.preempts for ln in still_live)):
            if prefill_tok_s > 0:
                by_time = int(prefill_tok_s * cfg.latency_prefill_s) // cfg.prefill_chunk * cfg.prefill_chunk
                budget = min(budget, max(cfg.prefill_chunk, by_time))
            else:
                budget = min(budget, cfg.prefill_chunk)
        order_keys = []
        for ln in still_live:
            if ln.prefill_left > 0:
                starving = tick - ln.queued_tick >= cfg.starvation_ticks * 4
                order_keys.append(((not starving, int(ln.klass), ln.prefill_left), ln.lane))
        order = tuple(lane for _key, lane in sorted(order_keys))
        return Plan(
            admits=tuple(admits),
            preempts=tuple(preempts),
            prefill_budget=budget,
            max_rounds=cfg.max_rounds if any_decode else 0,
            time_budget_ms=cfg.tick_free_ms if remaining else cfg.tick_busy_ms,
            prefill_order=order,
        )
