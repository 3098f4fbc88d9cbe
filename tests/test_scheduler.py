"""The scheduler core's own decisions, driven directly: no trio, no worker, no clock."""

from __future__ import annotations

from superfluid.serving import Metrics
from superfluid.proto import Admit, Emit, Sampling, TickDone
from superfluid.sched import Job, QosClass, SchedulerConfig
from superfluid.sched._core import SchedulerCore


class _Worker:
    """Records the frames the core hands out for the worker."""

    def __init__(self, core: SchedulerCore) -> None:
        self.core = core
        self.sent: list[object] = []

    def plan(self, *, send_tick: bool) -> None:
        frames, _ticked = self.core.plan(0.0, send_tick=send_tick)
        self.sent += frames

    def admitted(self) -> list[int]:
        return [e.lane for e in self.sent if isinstance(e, Admit)]


def _burst(shared: int, n: int) -> list[Job]:
    system = list(range(10, 10 + shared))
    return [Job(prompt=[*system, 5000 + i, 6000 + i], sampling=Sampling(), max_new=4, klass=QosClass.AGENT)
            for i in range(n)]


def _core(cpu: object = None) -> SchedulerCore:
    return SchedulerCore("m", SchedulerConfig(), Metrics().for_model("m"), cpu)  # type: ignore[arg-type]


def _submitted_burst(n: int) -> tuple[SchedulerCore, _Worker, list[Job]]:
    """A core that took a burst of ``n`` jobs on one 1,500-token prefix and planned once."""
    core = _core()
    worker = _Worker(core)
    jobs = _burst(1500, n)
    for job in jobs:
        core.submit(job, 0.0)
    worker.plan(send_tick=True)
    return core, worker, jobs


def test_a_burst_on_one_long_prefix_waits_for_the_leaders_prefill() -> None:
    core, worker, jobs = _submitted_burst(4)
    [leader_lane] = worker.admitted()
    assert core.running[leader_lane] is jobs[0]

    # a tick that ended before the worker opened the leader's lane says nothing about it:
    # the followers keep waiting (they were released at once, and prefilled the prefix again)
    core.tick_done(TickDone(seq=1, prefill_left={}))
    worker.plan(send_tick=False)
    assert worker.admitted() == [leader_lane]

    core.tick_done(TickDone(seq=2, prefill_left={leader_lane: 700}))   # 802 of 1,502 done
    worker.plan(send_tick=False)
    assert worker.admitted() == [leader_lane]

    core.tick_done(TickDone(seq=3, prefill_left={leader_lane: 2}))     # the shared 1,500 are in
    worker.plan(send_tick=False)
    assert len(worker.admitted()) == 4
    assert {id(j) for j in core.running.values()} == {id(j) for j in jobs}


def test_urgent_classes_never_wait_for_a_shared_prefix() -> None:
    core = _core()
    worker = _Worker(core)
    leader, follower = _burst(1500, 2)
    follower.klass = QosClass.INTERACTIVE
    core.submit(leader, 0.0)
    worker.plan(send_tick=True)
    core.submit(follower, 0.0)
    worker.plan(send_tick=False)
    assert len(worker.admitted()) == 2


def test_a_hold_is_bounded_in_ticks_not_in_plans() -> None:
    """Plans happen on every event (a burst of arrivals makes hundreds); the
    bound must not run out before the leader's prefill could finish."""
    from superfluid.sched._core import HOLD_MAX_TICKS

    core, worker, jobs = _submitted_burst(3)
    for _ in range(3 * HOLD_MAX_TICKS):
        worker.plan(send_tick=False)
    assert len(worker.admitted()) == 1
    core.tick_no += HOLD_MAX_TICKS
    worker.plan(send_tick=False)
    assert len(worker.admitted()) == 3


class _Cpu:
    """Records what the scheduler tells the daemon's CPU policy (urgent while any owner is)."""

    def __init__(self) -> None:
        self.urgent: list[bool] = []
        self._owners: set[int] = set()

    def note(self, owner: object, *, urgent: bool) -> None:
        if urgent:
            self._owners.add(id(owner))
        else:
            self._owners.discard(id(owner))
        self.urgent.append(bool(self._owners))


def test_the_cpu_policy_hears_when_a_request_waits_for_its_first_token() -> None:
    """Queued, then admitted without a token: urgent (the daemon must answer at
    once); once the first token is committed: not (it only relays tokens)."""
    cpu = _Cpu()
    core = _core(cpu)
    worker = _Worker(core)
    job = Job(prompt=[1, 2, 3], sampling=Sampling(), max_new=4, klass=QosClass.INTERACTIVE)
    core.submit(job, 0.0)
    assert cpu.urgent[-1] is True
    worker.plan(send_tick=True)
    [lane] = worker.admitted()
    assert cpu.urgent[-1] is True
    rnd = core.emit([Emit(items=[[lane, 7, b"x", None, None]])], 0.0)
    assert rnd is not None
    core.committed([rnd], None, 0.0)
    assert job.tokens == [7] and cpu.urgent[-1] is False
    second = Job(prompt=[4, 5], sampling=Sampling(), max_new=4, klass=QosClass.AGENT)
    core.submit(second, 0.0)
    assert cpu.urgent[-1] is True
    core.cancel(second)   # it leaves the queue: nothing waits any more
    assert cpu.urgent[-1] is False


async def test_a_requests_last_commit_runs_with_the_daemon_responsive() -> None:
    """The commit that ends a request is waited for (its client, and at low
    concurrency the next request): the policy is urgent during it, and only then."""
    from superfluid.sched import Scheduler

    cpu = _Cpu()
    during: list[bool] = []

    class _Committer:
        async def commit(self, spans: object, ended: object) -> None:
            during.append(cpu.urgent[-1])

    sched = Scheduler("m", SchedulerConfig(), Metrics().for_model("m"), _Committer(), cpu=cpu)  # type: ignore[arg-type]
    core = sched.core
    worker = _Worker(core)
    job = Job(prompt=[1, 2, 3], sampling=Sampling(), max_new=3, klass=QosClass.AGENT)
    core.submit(job, 0.0)
    worker.plan(send_tick=True)
    [lane] = worker.admitted()
    for row in ([lane, 7, b"a", None, None], [lane, 8, b"b", None, None], [lane, 9, b"c", "length", None]):
        rnd = core.emit([Emit(items=[row])], 0.0)
        assert rnd is not None
        core.committed([rnd], await sched._commit([rnd]), 0.0)
    # the first token's commit: a request waits for its first token; the middle one relays
    # only; the last one ends the request
    assert during == [True, False, True]
    assert job.tokens == [7, 8, 9] and job.done and cpu.urgent[-1] is False


def test_the_daemon_thread_runs_batch_only_while_nothing_is_urgent() -> None:
    import os

    import pytest

    from superfluid._cpu import CpuYield

    if not hasattr(os, "SCHED_BATCH"):
        pytest.skip("scheduling policies are Linux's")
    cpu = CpuYield(enabled=True)
    try:
        assert os.sched_getscheduler(0) == os.SCHED_BATCH
        cpu.note("a", urgent=True)
        cpu.note("b", urgent=True)
        cpu.note("a", urgent=False)
        assert os.sched_getscheduler(0) == os.SCHED_OTHER   # b still waits
        cpu.note("b", urgent=False)
        assert os.sched_getscheduler(0) == os.SCHED_BATCH and cpu.switches == 3
    finally:
        cpu.close()
    assert os.sched_getscheduler(0) == os.SCHED_OTHER
    off = CpuYield(enabled=False)
    off.note("a", urgent=False)
    assert os.sched_getscheduler(0) == os.SCHED_OTHER
