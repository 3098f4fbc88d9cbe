"""The tick planner: a pure function, checked by properties over random queues and lanes."""

from __future__ import annotations

from collections import Counter
from typing import Any

import attrs
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from superfluid.sched import JobView, LaneView, Plan, Planner, PlannerConfig, QosClass, parse_qos

Q = QosClass
PROPERTIES = settings(database=None, deadline=None, max_examples=300)
classes = st.sampled_from(list(QosClass))


@st.composite
def configs(draw: st.DrawFn) -> PlannerConfig:
    max_batch = draw(st.integers(1, 6))
    return PlannerConfig(
        max_batch=max_batch,
        class_lanes=draw(st.dictionaries(classes, st.integers(0, max_batch + 1))),
        starvation_ticks=draw(st.integers(1, 12)),
        prefill_budget=draw(st.integers(0, 8192)),
        prefill_chunk=draw(st.sampled_from([64, 256, 512])),
        latency_prefill_s=draw(st.floats(0.01, 2.0)),
        tick_free_ms=50,
        tick_busy_ms=250,
        max_rounds=draw(st.integers(1, 64)),
    )


@st.composite
def scenarios(draw: st.DrawFn, *, full: bool = False) -> dict[str, Any]:
    """A config, a tick number, the queue, the lanes and a measured prefill rate."""
    cfg = draw(configs())
    tick = draw(st.integers(0, 300))
    n_lanes = cfg.max_batch if full else draw(st.integers(0, cfg.max_batch))
    lane_seqs = draw(st.lists(st.integers(0, 1000), min_size=n_lanes, max_size=n_lanes, unique=True))
    lanes = [
        LaneView(
            lane=100 + i, job=1000 + i, klass=draw(classes), admitted_seq=seq,
            prefill_left=draw(st.sampled_from([0, 0, 1, 7, 300, 5000])),
            queued_tick=draw(st.integers(0, tick)),
        )
        for i, seq in enumerate(lane_seqs)
    ]
    n_queued = draw(st.integers(0, 8))
    job_seqs = draw(st.lists(st.integers(0, 10_000), min_size=n_queued, max_size=n_queued, unique=True))
    queued = [
        JobView(job=i, klass=draw(classes), queued_tick=draw(st.integers(0, tick)), seq=seq,
                prompt_tokens=draw(st.integers(0, 4000)))
        for i, seq in enumerate(job_seqs)
    ]
    rate = draw(st.sampled_from([0.0, 0.0, 100.0, 2500.0]) | st.floats(0.0, 1e6))
    return {"cfg": cfg, "tick": tick, "queued": queued, "lanes": lanes, "prefill_tok_s": rate}


def plan_of(s: dict[str, Any]) -> Plan:
    return Planner(s["cfg"]).plan(tick=s["tick"], queued=s["queued"], lanes=s["lanes"],
                                  prefill_tok_s=s["prefill_tok_s"])


def effective(planner: Planner, job: JobView, tick: int) -> tuple[int, int, int]:
    """Admission order: jobs that preempt first, then effective class, then FIFO."""
    return (0 if job.klass.preempts else 1, planner.effective_class(job, tick), job.seq)


def final_class_counts(s: dict[str, Any], plan: Plan) -> Counter[QosClass]:
    jobs = {j.job: j for j in s["queued"]}
    counts = Counter(ln.klass for ln in s["lanes"] if ln.lane not in plan.preempts)
    counts.update(jobs[j].klass for j in plan.admits)
    return counts


# ---- admission -------------------------------------------------------------------------


@PROPERTIES
@given(scenarios())
def test_plan_admits_only_queued_jobs_once_into_free_lanes(s: dict[str, Any]) -> None:
    plan = plan_of(s)
    assert len(set(plan.admits)) == len(plan.admits)
    assert set(plan.admits) <= {j.job for j in s["queued"]}
    assert len(set(plan.preempts)) == len(plan.preempts)
    assert set(plan.preempts) <= {ln.lane for ln in s["lanes"]}
    free = s["cfg"].max_batch - len(s["lanes"])
    assert len(plan.admits) <= free + len(plan.preempts)
    assert len(s["lanes"]) - len(plan.preempts) + len(plan.admits) <= s["cfg"].max_batch


@PROPERTIES
@given(scenarios())
def test_plan_respects_class_caps(s: dict[str, Any]) -> None:
    plan = plan_of(s)
    jobs = {j.job: j for j in s["queued"]}
    counts = final_class_counts(s, plan)
    for klass in {jobs[j].klass for j in plan.admits}:
        assert counts[klass] <= s["cfg"].cap(klass)


@PROPERTIES
@given(scenarios())
def test_plan_admits_best_effective_class_first(s: dict[str, Any]) -> None:
    planner = Planner(s["cfg"])
    plan = plan_of(s)
    jobs = {j.job: j for j in s["queued"]}
    keys = [effective(planner, jobs[j], s["tick"]) for j in plan.admits]
    assert keys == sorted(keys)
    counts = final_class_counts(s, plan)
    free_left = s["cfg"].max_batch - (len(s["lanes"]) - len(plan.preempts) + len(plan.admits))
    for job in s["queued"]:
        if job.job in plan.admits:
            continue
        key = effective(planner, job, s["tick"])
        # a job is passed over only because its class is full ...
        if any(k > key for k in keys) or free_left > 0:
            assert counts[job.klass] >= s["cfg"].cap(job.klass), (job, plan)


def test_aging_admits_a_starved_background_job_before_newer_agent_jobs() -> None:
    cfg = PlannerConfig(max_batch=1, starvation_ticks=8)
    planner = Planner(cfg)
    background = JobView(job=1, klass=Q.BACKGROUND, queued_tick=0, seq=0)
    agents = [JobView(job=2 + i, klass=Q.AGENT, queued_tick=t, seq=1 + i) for i, t in enumerate((1, 10, 24))]
    assert planner.plan(tick=8 * 3, queued=[*agents, background], lanes=[]).admits == (1,)
    # not yet starved: the agent jobs go first
    assert planner.plan(tick=8 * 3 - 1, queued=[*agents, background], lanes=[]).admits == (2,)


@PROPERTIES
@given(
    starvation=st.integers(1, 20),
    waited=st.integers(0, 100),
    agents=st.lists(st.integers(0, 100), min_size=1, max_size=6),
)
def test_aging_property(starvation: int, waited: int, agents: list[int]) -> None:
    tick = waited
    planner = Planner(PlannerConfig(max_batch=1, starvation_ticks=starvation))
    background = JobView(job=0, klass=Q.BACKGROUND, queued_tick=0, seq=0)
    # agent jobs queued no earlier than the background job
    newer = [JobView(job=i + 1, klass=Q.AGENT, queued_tick=min(tick, t), seq=i + 1) for i, t in enumerate(agents)]
    plan = planner.plan(tick=tick, queued=[*newer, background], lanes=[])
    if waited >= starvation * 3:
        assert plan.admits == (0,)
    elif waited < starvation:
        assert plan.admits != (0,)


def test_aged_agents_never_hold_an_interactive_job_behind_them() -> None:
    """Under a backlog every queued agent ages to effective class 0; the interactive job still
    comes first: it preempts an agent lane at once, and takes a free lane before any of them."""
    planner = Planner(PlannerConfig(max_batch=2, starvation_ticks=2))
    agents = [JobView(job=i, klass=Q.AGENT, queued_tick=0, seq=i) for i in range(5)]
    chat = JobView(job=99, klass=Q.INTERACTIVE, queued_tick=100, seq=99)
    busy = [LaneView(lane=k, job=10 + k, klass=Q.AGENT, admitted_seq=k, prefill_left=0) for k in range(2)]
    plan = planner.plan(tick=100, queued=[*agents, chat], lanes=busy)
    assert plan.admits == (99,) and len(plan.preempts) == 1
    assert planner.plan(tick=100, queued=[*agents, chat], lanes=busy[:1]).admits == (99,)


def test_held_jobs_are_not_admitted() -> None:
    planner = Planner(PlannerConfig(max_batch=4))
    queued = [JobView(job=i, klass=Q.AGENT, queued_tick=0, seq=i) for i in range(3)]
    assert planner.plan(tick=0, queued=queued, lanes=[], held=frozenset({0, 2})).admits == (1,)


def test_effective_class_never_goes_below_interactive() -> None:
    planner = Planner(PlannerConfig(starvation_ticks=1))
    for klass in QosClass:
        job = JobView(job=0, klass=klass, queued_tick=0, seq=0)
        assert planner.effective_class(job, 10_000) == 0
        assert planner.effective_class(job, -5) == int(klass)  # a clock step backwards ages nothing


# ---- preemption --------------------------------------------------------------------------


def reference_victims(s: dict[str, Any]) -> list[int]:
    """The rule as SPEC.md states it: walk the waiting jobs in admission order,
    skipping jobs whose class is at its cap; while the next one is
    interactive/completion and a lane of strictly lower class exists, that lane
    (decoding rather than prefilling, then the lowest class, then the newest) is
    stopped for it; the first job that cannot preempt ends it."""
    planner = Planner(s["cfg"])
    cfg = s["cfg"]
    if len(s["lanes"]) < cfg.max_batch:
        return []
    per_class = {k: sum(1 for ln in s["lanes"] if ln.klass == k) for k in Q}
    victims: list[int] = []
    capped: set[Q] = set()
    for job in sorted(s["queued"], key=lambda j: effective(planner, j, s["tick"])):
        if per_class[job.klass] >= cfg.cap(job.klass):
            capped.add(job.klass)
            continue
        lower = [ln for ln in s["lanes"] if ln.klass > job.klass and ln.klass not in capped and ln.lane not in victims]
        if not job.klass.preempts or not lower:
            break
        victim = max(lower, key=lambda ln: (ln.prefill_left == 0, ln.klass, ln.admitted_seq))
        victims.append(victim.lane)
        per_class[victim.klass] -= 1
        per_class[job.klass] += 1
    return victims


@PROPERTIES
@given(scenarios())
def test_preemption_only_when_full_and_a_preemptor_waits(s: dict[str, Any]) -> None:
    plan = plan_of(s)
    if plan.preempts:
        assert len(s["lanes"]) >= s["cfg"].max_batch
        preemptors = [j for j in s["queued"] if j.klass.preempts]
        assert len(plan.preempts) <= len(preemptors)
        lanes = {ln.lane: ln for ln in s["lanes"]}
        assert all(lanes[v].klass > min(j.klass for j in preemptors) for v in plan.preempts)
        assert all(lanes[v].klass > Q.INTERACTIVE for v in plan.preempts)


@PROPERTIES
@given(scenarios(full=True), st.data())
def test_with_every_lane_busy_and_no_preemptor_waiting_one_queued_job_plans_as_all(
        s: dict[str, Any], data: st.DataObject) -> None:
    """The loop passes one job's view instead of the whole queue when every lane is busy and
    only agent and background jobs wait (Scheduler._may_admit): then the plan admits
    nothing and reads only that the queue is not empty. This holds that to the planner."""
    waiting = [attrs.evolve(j, klass=data.draw(st.sampled_from([Q.AGENT, Q.BACKGROUND])),
                            suspect=data.draw(st.booleans())) for j in s["queued"]]
    if not waiting:
        return
    lanes = [attrs.evolve(ln, fresh=data.draw(st.booleans()), suspect=data.draw(st.booleans()))
             for ln in s["lanes"]]
    held = frozenset(data.draw(st.sets(st.sampled_from([j.job for j in waiting]))))
    planner = Planner(s["cfg"])

    def plan(queued: list[JobView]) -> Plan:
        return planner.plan(tick=s["tick"], queued=queued, lanes=lanes, prefill_tok_s=s["prefill_tok_s"], held=held)

    whole = plan(waiting)
    assert not whole.admits and not whole.preempts
    for one in waiting:
        assert plan([one]) == whole


@PROPERTIES
@given(scenarios(full=True))
def test_preemption_picks_the_right_victims(s: dict[str, Any]) -> None:
    assert list(plan_of(s).preempts) == reference_victims(s)


@PROPERTIES
@given(scenarios(full=True))
@example({
    # SPEC.md: victims go *for* a waiting interactive/completion job. Here that job's class
    # is at its cap, so the freed lane goes to nobody: the background lane is stopped for
    # nothing, requeued, re-admitted next tick, and stopped again.
    "cfg": PlannerConfig(max_batch=2, class_lanes={Q.INTERACTIVE: 1}), "tick": 5, "prefill_tok_s": 0.0,
    "queued": [JobView(job=1, klass=Q.INTERACTIVE, queued_tick=5, seq=1)],
    "lanes": [LaneView(lane=0, job=10, klass=Q.INTERACTIVE, admitted_seq=1, prefill_left=0),
              LaneView(lane=1, job=11, klass=Q.BACKGROUND, admitted_seq=2, prefill_left=0)],
})
@example({
    # an aged background job (effective class 0, queued first) takes the lane an agent
    # lane was stopped to free for the interactive job
    "cfg": PlannerConfig(max_batch=1, starvation_ticks=2), "tick": 100, "prefill_tok_s": 0.0,
    "queued": [JobView(job=1, klass=Q.BACKGROUND, queued_tick=0, seq=1),
               JobView(job=2, klass=Q.INTERACTIVE, queued_tick=100, seq=2)],
    "lanes": [LaneView(lane=0, job=10, klass=Q.AGENT, admitted_seq=1, prefill_left=0)],
})
def test_every_victim_makes_room_for_a_higher_class_job(s: dict[str, Any]) -> None:
    plan = plan_of(s)
    lanes = {ln.lane: ln for ln in s["lanes"]}
    jobs = {j.job: j for j in s["queued"]}
    # a valid pairing of victims with admitted jobs of a strictly higher class exists
    # iff pairing both sorted by priority works (most urgent victim with most urgent job)
    beneficiaries = sorted(jobs[j].klass for j in plan.admits)
    for victim in sorted(lanes[v].klass for v in plan.preempts):
        assert beneficiaries and beneficiaries[0] < victim, (
            f"lane of class {victim.name} preempted but no higher-class job takes its place: {plan}"
        )
        beneficiaries.pop(0)


def test_preemption_prefers_decoding_then_lowest_class_then_newest() -> None:
    planner = Planner(PlannerConfig(max_batch=4))
    lanes = [
        LaneView(lane=0, job=10, klass=Q.BACKGROUND, admitted_seq=9, prefill_left=300),  # prefilling
        LaneView(lane=1, job=11, klass=Q.AGENT, admitted_seq=1, prefill_left=0),
        LaneView(lane=2, job=12, klass=Q.AGENT, admitted_seq=2, prefill_left=0),
        LaneView(lane=3, job=13, klass=Q.INTERACTIVE, admitted_seq=3, prefill_left=0),
    ]
    one = [JobView(job=1, klass=Q.INTERACTIVE, queued_tick=0, seq=1)]
    assert planner.plan(tick=0, queued=one, lanes=lanes).preempts == (2,)
    three = [JobView(job=i, klass=Q.INTERACTIVE, queued_tick=0, seq=i) for i in range(3)]
    assert planner.plan(tick=0, queued=three, lanes=lanes).preempts == (2, 1, 0)
    # a completion job never preempts an interactive lane, nor an agent job anything
    assert planner.plan(tick=0, queued=[JobView(job=1, klass=Q.AGENT, queued_tick=0, seq=1)],
                        lanes=lanes).preempts == ()


def test_no_preemption_while_a_lane_is_free() -> None:
    planner = Planner(PlannerConfig(max_batch=2))
    lanes = [LaneView(lane=0, job=10, klass=Q.BACKGROUND, admitted_seq=1, prefill_left=0)]
    plan = planner.plan(tick=0, queued=[JobView(job=1, klass=Q.INTERACTIVE, queued_tick=0, seq=1)],
                        lanes=lanes)
    assert plan.preempts == () and plan.admits == (1,)


# ---- budgets -------------------------------------------------------------------------------


@PROPERTIES
@given(scenarios())
def test_prefill_budget_is_capped(s: dict[str, Any]) -> None:
    cfg = s["cfg"]
    plan = plan_of(s)
    assert 0 <= plan.prefill_budget <= cfg.prefill_budget
    waiting = [j for j in s["queued"] if j.job not in plan.admits]
    if waiting and plan.prefill_budget:
        rate = s["prefill_tok_s"]
        if rate > 0:
            # at most latency_prefill_s of measured work, but always one chunk
            assert plan.prefill_budget <= max(cfg.prefill_chunk, rate * cfg.latency_prefill_s)
        else:
            assert plan.prefill_budget <= cfg.prefill_chunk


@PROPERTIES
@given(scenarios())
def test_plan_runs_only_what_there_is(s: dict[str, Any]) -> None:
    plan = plan_of(s)
    live = [ln for ln in s["lanes"] if ln.lane not in plan.preempts]
    if not plan.admits and not live:
        # nothing to prefill, and no newcomer could join this tick mid-way
        assert plan.prefill_budget == 0
    if live:
        # a newcomer may join mid-tick (a lane ends, a chat preempts): its prompt needs a budget
        assert plan.prefill_budget > 0 or s["cfg"].prefill_budget == 0
    if plan.admits or any(ln.prefill_left == 0 for ln in live):
        assert plan.max_rounds == s["cfg"].max_rounds
    else:
        assert plan.max_rounds == 0
    # short ticks while a job waits (a newcomer for a free lane is admitted mid-tick)
    waiting = [j for j in s["queued"] if j.job not in plan.admits]
    assert plan.time_budget_ms == (s["cfg"].tick_free_ms if waiting else s["cfg"].tick_busy_ms)


@PROPERTIES
@given(scenarios())
def test_prefill_order_starving_then_class_then_shortest(s: dict[str, Any]) -> None:
    cfg = s["cfg"]
    plan = plan_of(s)
    live = {ln.lane: ln for ln in s["lanes"] if ln.lane not in plan.preempts}
    assert set(plan.prefill_order) == {lane for lane, ln in live.items() if ln.prefill_left > 0}

    def key(lane: int) -> tuple[bool, int, int]:
        ln = live[lane]
        starving = s["tick"] - ln.queued_tick >= cfg.starvation_ticks * 4
        return (not starving, int(ln.klass), ln.prefill_left)

    keys = [key(lane) for lane in plan.prefill_order]
    assert keys == sorted(keys)


def test_empty_plan() -> None:
    plan = Planner(PlannerConfig()).plan(tick=0, queued=[], lanes=[])
    assert plan.empty and plan == Plan(time_budget_ms=250)   # nothing waits: no short tick


# ---- QoS names ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "klass"),
    [("interactive", Q.INTERACTIVE), ("Interactive-Chat", Q.INTERACTIVE), (" completion ", Q.COMPLETION),
     ("inline-completion", Q.COMPLETION), ("agent", Q.AGENT), ("foreground", Q.AGENT),
     ("foreground-agent", Q.AGENT), ("background", Q.BACKGROUND), ("background-agent", Q.BACKGROUND)],
)
def test_parse_qos(name: str, klass: QosClass) -> None:
    assert parse_qos(name) is klass


@pytest.mark.parametrize("name", ["", "urgent", "0"])
def test_parse_qos_rejects(name: str) -> None:
    with pytest.raises(ValueError, match="x-superfluid-qos"):
        parse_qos(name)


def test_qos_order_and_preemptors() -> None:
    assert sorted(QosClass) == [Q.INTERACTIVE, Q.COMPLETION, Q.AGENT, Q.BACKGROUND]
    assert [k.preempts for k in QosClass] == [True, True, False, False]
    assert len({k.label for k in QosClass}) == 4


# ---- quarantine ------------------------------------------------------------------------------


@st.composite
def quarantine_scenarios(draw: st.DrawFn) -> dict[str, Any]:
    """Any scenario, with some lanes fresh (no token since admission) or suspect, and some
    queued jobs suspect (a worker died while they ran without progress)."""
    s = draw(scenarios(full=draw(st.booleans())))
    s["lanes"] = [attrs.evolve(ln, fresh=draw(st.booleans()), suspect=draw(st.booleans())) for ln in s["lanes"]]
    s["queued"] = [attrs.evolve(j, suspect=draw(st.booleans())) for j in s["queued"]]
    return s


@PROPERTIES
@given(quarantine_scenarios())
def test_a_suspect_runs_alone_until_it_produces_a_token(s: dict[str, Any]) -> None:
    """While a suspect lane is fresh nothing is admitted or preempted; a suspect is admitted
    only as the one admission of its plan, and only when every lane left has produced a token."""
    plan = plan_of(s)
    if any(ln.suspect and ln.fresh for ln in s["lanes"]):
        assert plan.admits == () and plan.preempts == ()
    suspects = {j.job for j in s["queued"] if j.suspect}
    if suspects & set(plan.admits):
        assert len(plan.admits) == 1
        assert not any(ln.fresh for ln in s["lanes"] if ln.lane not in plan.preempts)


def test_suspects_are_probed_one_at_a_time() -> None:
    planner = Planner(PlannerConfig(max_batch=4))
    queued = [JobView(job=i, klass=Q.AGENT, queued_tick=0, seq=i, suspect=True) for i in range(3)]
    assert planner.plan(tick=0, queued=queued, lanes=[]).admits == (0,)
    probing = [LaneView(lane=0, job=0, klass=Q.AGENT, admitted_seq=0, prefill_left=0, fresh=True, suspect=True)]
    chat = [JobView(job=9, klass=Q.INTERACTIVE, queued_tick=0, seq=9)]
    assert planner.plan(tick=0, queued=[*queued[1:], *chat], lanes=probing).admits == ()
    cleared = [attrs.evolve(probing[0], fresh=False)]  # it produced a token: the next one goes
    assert planner.plan(tick=0, queued=queued[1:], lanes=cleared).admits == (1,)
    # a fresh innocent lane holds a waiting suspect (and the line behind it) back
    fresh = [LaneView(lane=0, job=5, klass=Q.AGENT, admitted_seq=0, prefill_left=10, fresh=True)]
    assert planner.plan(tick=0, queued=queued[1:], lanes=fresh).admits == ()
    plain = [JobView(job=7, klass=Q.AGENT, queued_tick=0, seq=0)]
    assert planner.plan(tick=0, queued=plain, lanes=fresh).admits == (7,)
