"""The scheduler core (``superfluid/sched/_core.py``) tested back to back, as h11 is:
no trio, no worker process, no clock. A synchronous in-memory worker answers the frames
the core hands out; a hypothesis state machine drives random interleavings of requests,
stops, tokenizes, engine steps, commits (some failing), worker deaths and an unload,
and checks the core's invariants after every step."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from superfluid.serving import Metrics
from superfluid.proto import (
    FAULT_BUG,
    Admit,
    Admitted,
    Cancel,
    Embed,
    Embedded,
    Emit,
    Fault,
    Interrupt,
    Sampling,
    SlotAction,
    SlotDone,
    Telemetry,
    Tick,
    TickDone,
    Tokenize,
    Tokenized,
)
from superfluid.sched import Job, JobError, JobState, PlannerConfig, QosClass, SchedulerConfig
from superfluid.sched._core import (
    HOLD_MAX_TICKS,
    HOLD_MIN_SHARED,
    TOKENIZE_ATTEMPTS,
    TOKENIZE_IN_FLIGHT,
    EmbedRefused,
    EmbedRequest,
    InjectedBug,
    Queue,
    QueueFull,
    Reserve,
    SchedulerCore,
    SlotRequest,
    TokenizeRequest,
    Unavailable,
)

CORE = Path(__file__).resolve().parent.parent / "superfluid" / "sched" / "_core.py"


class Reply:
    def __init__(self) -> None:
        self.value: Any = None
        self.error: BaseException | None = None
        self.answered = 0

    def set(self, value: Any = None) -> None:
        self.value = value
        self.answered += 1

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.answered += 1


class Worker:
    """A synchronous worker: lane ``L`` of a job generates ``100 + i`` at position ``i``;
    a tokenize answers one id per character, in pieces of two when ``pieces``."""

    def __init__(self, *, pieces: bool = False) -> None:
        self.lanes: dict[int, list[int]] = {}   # lane -> [position, max_new]
        self.out: list[Any] = []
        self.pieces = pieces
        self.sent: list[Any] = []
        self.ticks: list[Tick] = []

    def take(self, frames: list[Any]) -> None:
        self.sent += frames
        for frame in frames:
            if isinstance(frame, Admit):
                self.lanes[frame.lane] = [len(frame.tokens) - frame.n_prompt, frame.max_new]
                self.out.append(Admitted(lane=frame.lane, cached=1))
            elif isinstance(frame, Cancel):
                if self.lanes.pop(frame.lane, None) is not None:
                    self.out.append(Emit(items=[[frame.lane, -1, b"", "cancelled", None]]))
            elif isinstance(frame, Tokenize):
                ids = [ord(c) for text, _special in frame.segments for c in text]
                if self.pieces and len(ids) > 1:
                    self.out.append(Tokenized(req=frame.req, tokens=ids[:1], more=True))
                    ids = ids[1:]
                self.out.append(Tokenized(req=frame.req, tokens=ids))
            elif isinstance(frame, Embed):
                self.out.append(Embedded(req=frame.req, dim=1, vectors=[b"vvvv"] * len(frame.inputs)))
            elif isinstance(frame, Tick):
                self.ticks.append(frame)

    def step(self) -> None:
        """Run the oldest tick: one token for every lane."""
        if not self.ticks:
            return
        tick = self.ticks.pop(0)
        rows = []
        for lane, state in list(self.lanes.items()):
            rows.append([lane, 100 + state[0], b"p%d" % state[0], None, None])
            state[0] += 1
            if state[0] >= state[1]:
                rows[-1][3] = "length"
                del self.lanes[lane]
        if rows:
            self.out.append(Emit(items=rows))
        self.out.append(TickDone(seq=tick.seq, prefill_left={lane: 0 for lane in self.lanes}, prefill_tokens=3,
                                 decode_tokens=len(rows), rounds=1, busy_ms=2.0))


def feed(core: SchedulerCore, worker: Worker, rounds: list[Any]) -> None:
    """Hand every worker event to the core, as the actor does."""
    events, worker.out = worker.out, []
    for event in events:
        if isinstance(event, Emit):
            rnd = core.emit([event], 1.0)
            if rnd is not None:
                rounds.append(rnd)
        elif isinstance(event, TickDone):
            core.tick_done(event)
        else:
            core.handle(event)


def _job(klass: QosClass = QosClass.AGENT, max_new: int = 3, prompt: list[int] | None = None) -> Job:
    return Job(prompt=prompt or [1, 2, 3], sampling=Sampling(), max_new=max_new, klass=klass)


def _core(max_batch: int = 2, **kw: Any) -> SchedulerCore:
    return SchedulerCore("m", SchedulerConfig(planner=PlannerConfig(max_batch=max_batch), **kw),
                         Metrics().for_model("m"))


def run_to_end(core: SchedulerCore, worker: Worker, *, limit: int = 200) -> None:
    rounds: list[Any] = []
    for _ in range(limit):
        frames = core.take_frames()
        frames += core.plan(2.0, send_tick=not worker.ticks)[0]
        worker.take(frames)
        worker.step()
        feed(core, worker, rounds)
        if rounds:
            core.committed(rounds, None, 3.0)
            rounds = []
        if not core.active:
            return


# --- the state machine --------------------------------------------------------------------


class CoreMachine(RuleBasedStateMachine):
    """Random interleavings of everything that reaches the core."""

    @initialize(max_batch=st.integers(1, 3), max_queue=st.integers(1, 4))
    def start(self, max_batch: int, max_queue: int) -> None:
        self.core = _core(max_batch, max_queue=max_queue, lost_limit=2)
        self.worker = Worker(pieces=True)
        self.core.set_worker(True)
        self.jobs: list[Job] = []
        self.replies: list[Reply] = []
        self.unqueued: list[Job] = []     # reserved, not queued yet
        self.rounds: list[Any] = []
        self.closed = False

    @rule(klass=st.sampled_from(list(QosClass)), max_new=st.integers(1, 5), queue=st.booleans())
    def request(self, klass: QosClass, max_new: int, queue: bool) -> None:
        job = _job(klass, max_new)
        reply = Reply()
        self.core.apply(Reserve(job, reply), 0.0)
        assert reply.answered == 1
        if reply.error is not None:    # QueueFull, or Unavailable after an unload: the handler gives up
            assert isinstance(reply.error, (QueueFull, Unavailable))
            return
        self.jobs.append(job)
        if queue:
            self.core.apply(Queue(job), 0.0)
        else:
            self.unqueued.append(job)

    @precondition(lambda self: self.unqueued)
    @rule(data=st.data())
    def queue_reserved(self, data: st.DataObject) -> None:
        """A handler that reserved a place queues its job (once), maybe after it was stopped."""
        job = data.draw(st.sampled_from(self.unqueued))
        self.unqueued.remove(job)
        self.core.apply(Queue(job), 0.0)

    @precondition(lambda self: self.jobs)
    @rule(data=st.data())
    def stop(self, data: st.DataObject) -> None:
        self.core.stop(data.draw(st.sampled_from(self.jobs)))

    @rule(text=st.text("ab", min_size=0, max_size=3), embed=st.booleans())
    def tokenize(self, text: str, embed: bool) -> None:
        reply = Reply()
        command = EmbedRequest([[1]], True, reply) if embed else TokenizeRequest([(text, False)], False, reply)
        self.core.apply(command, 0.0)
        self.replies.append(reply)

    @rule(tick=st.booleans())
    def engine(self, tick: bool) -> None:
        frames = self.core.take_frames()
        frames += self.core.plan(1.0, send_tick=tick and len(self.worker.ticks) < 2)[0]
        if self.core.link_up:
            self.worker.take(frames)
        self.worker.step()
        if self.core.link_up:
            feed(self.core, self.worker, self.rounds)

    @precondition(lambda self: self.rounds)
    @rule(fail=st.booleans(), n=st.integers(1, 3))
    def commit(self, fail: bool, n: int) -> None:
        """The oldest ``n`` rounds come back from the log, in order."""
        rounds, self.rounds = self.rounds[:n], self.rounds[n:]
        failure = JobError.log_failed(OSError("disk full")) if fail else None
        self.core.committed(rounds, failure, 2.0)

    @rule()
    def worker_dies(self) -> None:
        self.core.worker_lost("killed")
        self.worker = Worker(pieces=True)
        self.core.set_worker(True)

    @precondition(lambda self: not self.closed)
    @rule()
    def unload(self) -> None:
        self.core.close("model 'm' was unloaded", code="model_unloaded")
        self.closed = True

    @invariant()
    def lanes_and_queues_agree(self) -> None:
        core = self.core
        assert len(core.running) <= core.config.planner.max_batch + sum(j.preempted for j in core.running.values())
        for lane, job in core.running.items():
            if job.done:   # failed by the log: it holds its lane until the worker confirms the Cancel
                assert job.cancelled and job.error is not None
            else:
                assert job.state is JobState.RUNNING and job.lane == lane
        queued = [job for q in core.queues.values() for job in q]
        assert len(queued) == len({id(j) for j in queued})
        for job in queued:
            assert job.state is JobState.QUEUED and not job.done
            assert job not in core.running.values()
        assert all(v >= 0 for v in core._reserved.values())
        assert sum(core._reserved.values()) == len(core._places)
        assert core._tokenize_sent <= TOKENIZE_IN_FLIGHT
        assert core._tokenize_sent == sum(p.sent for p in core._tokenize.values())

    @invariant()
    def nothing_lost_nothing_repeated(self) -> None:
        for job in self.jobs:
            # committed tokens are the worker's sequence from the start, never a gap or a repeat
            assert job.tokens == [100 + i for i in range(len(job.tokens))], job.tokens
            assert job.pieces == [b"p%d" % i for i in range(len(job.pieces))]
            assert len(job.tokens) <= job.max_new
            if job.done and job.error is None and job.finish == "length":
                assert len(job.tokens) == job.max_new

    @invariant()
    def replies_answered_once(self) -> None:
        for reply in self.replies:
            assert reply.answered <= 1

    def teardown(self) -> None:
        """Whatever happened, the model drains: every job ends, every reply is answered."""
        for job in self.unqueued:      # every handler queues what it reserved
            self.core.apply(Queue(job), 0.0)
        if not self.closed:
            self.core.committed(self.rounds, None, 2.0)
            self.rounds = []
            self.core.set_worker(True)
            run_to_end(self.core, self.worker)
        assert all(job.done for job in self.jobs), [(j.id, j.state, j.finish) for j in self.jobs if not j.done]
        assert not self.core._places
        assert all(reply.answered == 1 for reply in self.replies)
        assert not self.core.running and not any(self.core.queues.values())


TestCoreMachine = CoreMachine.TestCase
TestCoreMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None, derandomize=True,
                                    suppress_health_check=[HealthCheck.too_slow])


# --- purity ------------------------------------------------------------------------------


def test_the_core_imports_no_trio_no_clock_no_io() -> None:
    tree = ast.parse(CORE.read_text(encoding="utf-8"))
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            imported.add("." * node.level + (node.module or ""))
    allowed = {"__future__", "collections", "itertools", "logging", "typing", "attrs", "collections.abc",
               "..", "..proto", "._jobtypes", "._plan", "._qos", "._job"}
    assert imported <= allowed, imported - allowed
    assert "async def" not in CORE.read_text(encoding="utf-8")


# --- branches the machine reaches rarely, pinned ---------------------------------------------


def test_a_reservation_is_refused_when_the_class_queue_is_full_and_given_back_by_a_stop() -> None:
    core = _core(max_batch=1, max_queue=1)
    first, second, third = _job(), _job(), _job()
    replies = [Reply() for _ in range(3)]
    for job, reply in zip((first, second, third), replies, strict=True):
        core.apply(Reserve(job, reply), 0.0)
    assert replies[0].error is None and replies[1].error is None      # a free lane counts as room
    assert isinstance(replies[2].error, QueueFull) and replies[2].error.retry_after_s == 1
    core.stop(second)
    assert second.done and second.finish == "cancelled" and second.cancelled
    core.apply(Reserve(third, Reply()), 0.0)
    assert third.id in core._places


def test_a_stopped_jobs_late_reservation_takes_no_place() -> None:
    core = _core()
    job = _job()
    core.stop(job)                # the stop overtook the Reserve
    reply = Reply()
    core.apply(Reserve(job, reply), 0.0)
    core.apply(Queue(job), 0.0)
    assert reply.answered == 1 and reply.error is None and not core._places and not core.active
    assert job.done and job.finish == "cancelled"


def test_commands_to_a_closed_model_are_refused_typed() -> None:
    core = _core()
    queued = _job()
    core.apply(Queue(queued), 0.0)
    core.close("model 'm' was unloaded", code="model_unloaded")
    core.close("again", code="x")   # idempotent
    assert queued.done and queued.error is not None and queued.error.code == "model_unloaded"
    reply, tok = Reply(), Reply()
    core.apply(Reserve(_job(), reply), 0.0)
    core.apply(TokenizeRequest([("a", False)], False, tok), 0.0)
    assert isinstance(reply.error, Unavailable) and reply.error.code == "model_unloaded"
    assert isinstance(tok.error, Unavailable)
    late = _job()
    core.apply(Queue(late), 0.0)
    assert late.done and late.error is not None and late.error.status == 503


def test_a_tokenize_waits_for_a_worker_and_goes_to_at_most_three() -> None:
    core = _core()
    reply = Reply()
    core.apply(TokenizeRequest([("ab", False)], False, reply), 0.0)
    assert core.take_frames() == []          # no worker yet: it waits
    for attempt in range(TOKENIZE_ATTEMPTS):
        core.set_worker(True)
        [frame] = core.take_frames()
        assert isinstance(frame, Tokenize)
        assert reply.answered == 0, attempt
        core.worker_lost("killed")           # each worker dies holding it
    assert isinstance(reply.error, Unavailable) and "no worker could tokenize" in str(reply.error)
    assert not core.tokenizes_pending


def test_tokenizes_go_the_most_urgent_class_first_in_arrival_order_within_a_class() -> None:
    core = _core()
    core.set_worker(True)
    order = [QosClass.AGENT] * (TOKENIZE_IN_FLIGHT + 2) + [QosClass.INTERACTIVE, QosClass.AGENT, QosClass.INTERACTIVE]
    replies = []
    for i, klass in enumerate(order):
        reply = Reply()
        core.apply(TokenizeRequest([(chr(65 + i % 26), False)], False, reply, klass), 0.0)
        replies.append((i, klass, reply))
    first = core.take_frames()
    assert len(first) == TOKENIZE_IN_FLIGHT and [f.req for f in first] == list(range(1, TOKENIZE_IN_FLIGHT + 1))
    worker = Worker()
    answered: list[int] = []
    while len(answered) < len(order):
        worker.take(first)
        for event in worker.out:
            core.handle(event)
            answered.append(event.req)
        worker.out = []
        first = core.take_frames()
    waiting = answered[TOKENIZE_IN_FLIGHT:]
    n = TOKENIZE_IN_FLIGHT
    # the two chats first, in their order; then the agents that waited, in theirs
    assert waiting == [n + 3, n + 5, n + 1, n + 2, n + 4]


def test_a_failed_and_a_refused_embedding_end_typed() -> None:
    core = _core()
    core.set_worker(True)
    refused = Reply()
    core.apply(EmbedRequest([[1, 2]], True, refused), 0.0)
    [frame] = core.take_frames()
    core.handle(Embedded(req=frame.req, dim=0, vectors=[], error="too long"))
    assert isinstance(refused.error, EmbedRefused)
    ok = Reply()
    core.apply(EmbedRequest([[1], [2]], True, ok), 0.0)
    [frame] = core.take_frames()
    core.handle(Embedded(req=frame.req, dim=1, vectors=[b"aaaa"], more=True))
    assert ok.answered == 0
    core.handle(Embedded(req=frame.req, dim=1, vectors=[b"bbbb"]))
    assert ok.value == (1, [b"aaaa", b"bbbb"])
    core.handle(Embedded(req=999, dim=1, vectors=[]))       # stale answers are ignored
    core.handle(Tokenized(req=999, tokens=[1]))
    waiting = Reply()
    core.apply(TokenizeRequest([("a", False)], False, waiting), 0.0)
    core.worker_lost("gone")
    core.fail_queued("no worker", code="worker_unavailable")
    assert isinstance(waiting.error, Unavailable)


def test_faults_end_their_lane_typed_and_the_injected_bug_is_raised() -> None:
    core = _core()
    core.set_worker(True)
    bad, worse = _job(), _job()
    core.submit(bad, 0.0)
    core.submit(worse, 0.0)
    frames, _ = core.plan(0.0, send_tick=True)
    lanes = [f.lane for f in frames if isinstance(f, Admit)]
    core.handle(Fault(kind="admit", lane=lanes[0], message="prompt too long"))
    core.handle(Fault(kind="step", lane=lanes[1], message="decode failed"))
    assert bad.error is not None and bad.error.status == 400 and worse.error is not None and worse.error.status == 500
    core.handle(Fault(kind="step", lane=-1, message="no lane"))    # logged only
    core.handle(Admitted(lane=12345, cached=0))                     # a lane gone: ignored
    with pytest.raises(InjectedBug):
        core.handle(Fault(kind=FAULT_BUG, lane=-1, message="bug"))


def test_a_job_that_keeps_killing_workers_fails_typed_and_spares_the_rest() -> None:
    core = _core(max_batch=1, lost_limit=2)
    killer = _job(max_new=5)
    core.submit(killer, 0.0)
    for _ in range(2):
        core.set_worker(True)
        core.plan(0.0, send_tick=True)
        assert killer.state is JobState.RUNNING
        core.worker_lost("segfault")
    assert killer.done and killer.error is not None and killer.error.code == "worker_crashed"
    progress = _job(max_new=5)
    core.submit(progress, 0.0)
    core.set_worker(True)
    frames, _ = core.plan(0.0, send_tick=True)
    [lane] = [f.lane for f in frames if isinstance(f, Admit)]
    rnd = core.emit([Emit(items=[[lane, 100, b"p0", None, None]])], 0.0)
    core.worker_lost("again")                      # it made progress: not charged
    assert progress.lost_without_progress == 0 and progress.state is JobState.QUEUED
    core.committed([rnd], None, 1.0)
    assert progress.tokens == [100]
    stopped = progress
    core.set_worker(True)
    core.plan(0.0, send_tick=True)
    core.stop(stopped)
    core.worker_lost("while stopping")             # a cancelled job does not come back
    assert stopped.done and stopped.finish == "cancelled"


def test_a_preempted_lane_requeues_and_an_urgent_job_asks_for_an_interrupt() -> None:
    core = _core(max_batch=1)
    core.set_worker(True)
    agent = _job(QosClass.BACKGROUND, max_new=50)
    core.submit(agent, 0.0)
    frames, _ = core.plan(0.0, send_tick=True)
    [lane] = [f.lane for f in frames if isinstance(f, Admit)]
    agent.prefill_left = 0
    rnd = core.emit([Emit(items=[[lane, 100, b"p0", None, None]])], 0.0)
    core.committed([rnd], None, 0.5)
    chat = _job(QosClass.INTERACTIVE)
    core.submit(chat, 0.0)
    assert core.preemptor_waiting()
    frames, _ = core.plan(1.0, send_tick=False)
    # the victim's Cancel and the chat's Admit in one write (the worker frees the lane first)
    assert frames[0] == Cancel(lane=lane, publish=True) and agent.preempted
    assert isinstance(frames[1], Admit) and frames[1].priority == 0
    core.plan(1.0, send_tick=True)    # the victim is on its way out: the planner no longer sees it
    core.emit([Emit(items=[[lane, -1, b"", "cancelled", None]])], 1.0)
    assert agent.state is JobState.QUEUED and agent.lane is None and not agent.done
    assert core.queues[QosClass.BACKGROUND][0] is agent
    core2 = _core(max_batch=2)
    core2.submit(_job(QosClass.INTERACTIVE), 0.0)
    assert core2.preemptor_waiting()               # a free lane and a chat waiting


def test_a_long_prompt_burst_holds_behind_its_leader_and_a_hold_is_bounded() -> None:
    core = _core(max_batch=4)
    prefix = list(range(HOLD_MIN_SHARED + 1))
    jobs = [_job(prompt=[*prefix, 9000 + i]) for i in range(3)]
    for job in jobs:
        core.submit(job, 0.0)
    frames, _ = core.plan(0.0, send_tick=True)
    assert len([f for f in frames if isinstance(f, Admit)]) == 1
    core.tick_no += HOLD_MAX_TICKS
    frames, _ = core.plan(0.0, send_tick=False)
    assert len([f for f in frames if isinstance(f, Admit)]) == 2


def test_tick_reports_feed_metrics_rates_and_speculation_gauges() -> None:
    core = _core()
    core.new_worker()
    core.tick_done(TickDone(seq=1, prefill_tokens=100, busy_ms=10.0, decode_tokens=4, rounds=2,
                            spec={"proposed": 10, "accepted": 5, "counts": {1: ("on", 1.3), 2: ("off", 0.0)}}))
    core.tick_done(TickDone(seq=2, prefill_tokens=100, busy_ms=20.0,
                            spec={"proposed": 3, "accepted": 1, "counts": {1: ("probing", 0.0)}}))
    assert core.spec["proposed"] == 3 and core._prefill_rate > 0
    assert core.last_tick["prefill"] == 100
    assert "tick 0" in core.describe()


def test_a_done_job_in_a_round_is_not_settled_and_eos_is_stop() -> None:
    core = _core(max_batch=2)
    a, b = _job(max_new=4), _job(max_new=4)
    core.submit(a, 0.0)
    core.submit(b, 0.0)
    frames, _ = core.plan(0.0, send_tick=True)
    la, lb = [f.lane for f in frames if isinstance(f, Admit)]
    a.finish_with(error=JobError(status=503, message="gone"))   # failed meanwhile
    rnd = core.emit([Emit(items=[[la, 5, b"x", "length", None], [lb, 7, b"y", "eos", None, (3, 2)], [99, 1, b"", None, None]])],
                    1.0)
    assert rnd is not None and rnd.finishes == [(b, "stop")]
    core.committed([rnd], None, 2.0)
    assert b.finish == "stop" and b.tokens == [] and a.tokens == [] and b.spec == (3, 2)
    assert core.emit([Emit(items=[[12345, 1, b"", None, None]])], 2.0) is None
    assert core.plan(0.0, send_tick=False) == ([], False)


def test_a_queued_job_failed_by_the_log_leaves_its_queue_and_cancel_is_idempotent() -> None:
    core = _core(max_batch=1)
    running, waiting = _job(max_new=9), _job()
    core.submit(running, 0.0)
    core.plan(0.0, send_tick=True)
    core.submit(waiting, 0.0)
    core._fail_running(waiting, JobError(status=503, message="log"))
    core._fail_running(_job(), JobError(status=503, message="never queued"))
    assert waiting.done and not any(core.queues.values())
    core.cancel(running)
    core.cancel(running)
    assert len(core.take_frames()) == 1


def test_interrupt_is_not_a_core_frame() -> None:
    """The actor adds Interrupt itself (it knows the ticks in flight); the core only says when."""
    core = _core()
    assert not any(isinstance(f, Interrupt) for f in core.take_frames())


def test_every_write_runs_the_holders_guard() -> None:
    core = _core()
    calls: list[str] = []
    core.guard = lambda: calls.append("checked")
    core.submit(_job(), 0.0)
    core.plan(0.0, send_tick=True)
    core.take_frames()
    assert calls == ["checked"] * 3

    def refuse() -> None:
        raise AssertionError("not the actor")

    core.guard = refuse
    with pytest.raises(AssertionError):
        core.stop(_job())


def test_an_unload_ends_a_job_whose_finish_is_still_being_committed() -> None:
    """Found by the state machine: a job off its lane whose finish was in flight to the log
    was in no queue and no lane, so an unload then left it waiting forever."""
    core = _core(max_batch=2)
    job, failed = _job(max_new=1), _job(max_new=9)
    core.submit(job, 0.0)
    core.submit(failed, 0.0)
    frames, _ = core.plan(0.0, send_tick=True)
    lane, other = [f.lane for f in frames if isinstance(f, Admit)]
    rnd = core.emit([Emit(items=[[lane, 100, b"p0", "length", None]])], 1.0)
    core._fail_running(failed, JobError(status=503, message="log"))   # done, still on its lane
    core.close("model 'm' was unloaded", code="model_unloaded")
    assert job.done and job.error is not None and job.error.code == "model_unloaded"
    assert failed.error is not None and failed.error.message == "log"
    core.committed([rnd] if rnd else [], None, 2.0)     # the commit lands after: nothing changes
    assert job.error is not None and job.tokens == []


def test_a_failed_commit_ends_the_jobs_it_would_have_finished() -> None:
    core = _core()
    job = _job(max_new=1)
    core.submit(job, 0.0)
    frames, _ = core.plan(0.0, send_tick=True)
    [lane] = [f.lane for f in frames if isinstance(f, Admit)]
    rnd = core.emit([Emit(items=[[lane, 100, b"p0", "eos", None]])], 1.0)   # an end with no token to show
    assert rnd is not None and not rnd.spans
    core.committed([rnd], JobError.log_failed(OSError("no space")), 2.0)
    assert job.error is not None and job.error.code == "session_log_failed" and job.tokens == []


def test_a_stopped_lane_ends_cancelled_and_its_cancel_goes_once() -> None:
    core = _core()
    job = _job(max_new=9)
    core.submit(job, 0.0)
    frames, _ = core.plan(0.0, send_tick=True)
    [lane] = [f.lane for f in frames if isinstance(f, Admit)]
    core.stop(job)
    core.stop(job)
    core._stopping.append((job, lane))       # a stop recorded twice before the write
    assert core.take_frames() == [Cancel(lane=lane, publish=True)]
    rnd = core.emit([Emit(items=[[lane, -1, b"", "cancelled", None]])], 1.0)
    assert rnd is not None and rnd.finishes == [(job, "cancelled")]
    core.committed([rnd], None, 2.0)
    assert job.done and job.finish == "cancelled"
    core._stopping.append((job, lane))       # its lane is gone: nothing to cancel
    assert core.take_frames() == []


def test_tokenizes_beyond_the_workers_room_wait_and_a_dead_workers_unsent_ones_fail() -> None:
    core = _core()
    replies = [Reply() for _ in range(TOKENIZE_IN_FLIGHT + 1)]
    core.set_worker(True)
    for reply in replies:
        core.apply(TokenizeRequest([("a", False)], False, reply), 0.0)
    frames = core.take_frames()
    assert len(frames) == TOKENIZE_IN_FLIGHT
    core.worker_lost("gone")
    core.set_worker(True)
    core.take_frames()
    core.handle(Tokenized(req=frames[0].req, tokens=[97]))
    core.fail_queued("no worker")     # sent ones still wait for their answer
    assert replies[0].value == [97] and all(r.answered == 0 for r in replies[1:])
    queued = _job()
    core.submit(queued, 0.0)
    core.set_worker(False)
    core.fail_queued("no worker", code="resources_exhausted")
    assert queued.error is not None and queued.error.code == "resources_exhausted"
    fresh = _core()
    fresh._tokenize_waiting[QosClass.INTERACTIVE].append(9999)      # a stale id is skipped
    fresh.set_worker(True)
    assert fresh.take_frames() == [] and not fresh._tokenize_waiting[QosClass.INTERACTIVE]


def test_a_follower_goes_once_its_leader_prefilled_the_shared_prefix() -> None:
    core = _core(max_batch=4)
    prefix = list(range(HOLD_MIN_SHARED + 10))
    leader, follower, other = (_job(prompt=[*prefix, 1]), _job(prompt=[*prefix, 2]),
                               _job(prompt=[*range(5000, 5000 + HOLD_MIN_SHARED + 10)]))
    for job in (leader, follower, other):
        core.submit(job, 0.0)
    frames, _ = core.plan(0.0, send_tick=True)
    assert {f.tokens[-1] for f in frames if isinstance(f, Admit)} == {1, other.prompt[-1]}
    assert follower.held_since == 0
    core.tick_done(TickDone(seq=1, prefill_left={leader.lane: 500}))
    core.plan(0.0, send_tick=False)
    assert follower.state is JobState.QUEUED and follower.held_since == 0   # held on: the same hold
    core.tick_done(TickDone(seq=2, prefill_left={leader.lane: 1}))
    frames, _ = core.plan(0.0, send_tick=False)
    assert follower.state is JobState.RUNNING


def test_a_full_house_reads_one_queued_view() -> None:
    core = _core(max_batch=1)
    for _ in range(3):
        core.submit(_job(QosClass.BACKGROUND), 0.0)
    core.plan(0.0, send_tick=True)
    frames, ticked = core.plan(0.0, send_tick=True)   # every lane busy, only agents wait
    assert ticked and not any(isinstance(f, Admit) for f in frames)
    assert len(core._job_views(full=False)) == 1


def test_the_cpu_policy_is_told_and_an_unexpected_event_is_ignored() -> None:
    class Cpu:
        def __init__(self) -> None:
            self.notes: list[bool] = []

        def note(self, owner: object, *, urgent: bool) -> None:
            self.notes.append(urgent)

    cpu = Cpu()
    core = _core()
    core.cpu = cpu
    core.submit(_job(), 0.0)
    assert cpu.notes[-1] is True
    core.tick_done(TickDone(seq=1))           # no prefill: the rate stays
    assert core._prefill_rate == 0.0
    core.handle(TickDone(seq=2))              # not handle()'s: logged and ignored


def test_a_readmitted_job_keeps_its_first_admission_and_a_done_jobs_tokens_are_dropped() -> None:
    core = _core()
    job = _job(max_new=5)
    core.submit(job, 0.0)
    frames, _ = core.plan(0.0, send_tick=True)
    [lane] = [f.lane for f in frames if isinstance(f, Admit)]
    core.handle(Admitted(lane=lane, cached=4))
    core.handle(Admitted(lane=lane, cached=9))     # a second report (a re-seed) changes nothing
    assert job.started and job.cached == 4
    rnd = core.emit([Emit(items=[[lane, 100, b"p0", None, None]])], 1.0)
    assert rnd is not None
    job.finish_with(error=JobError(status=503, message="gone"))    # ended while its commit ran
    core.committed([rnd], None, 2.0)
    assert job.tokens == [] and job.staged == []


def test_a_failed_commit_stops_the_lanes_of_its_running_jobs() -> None:
    core = _core(max_batch=2)
    a, b = _job(max_new=9), _job(max_new=9)
    core.submit(a, 0.0)
    core.submit(b, 0.0)
    frames, _ = core.plan(0.0, send_tick=True)
    la, lb = [f.lane for f in frames if isinstance(f, Admit)]
    first = core.emit([Emit(items=[[la, 100, b"p0", None, None], [lb, 100, b"p0", None, None]])], 1.0)
    core.committed([first] if first else [], None, 2.0)
    assert a.first_token_at == 2.0
    second = core.emit([Emit(items=[[la, 101, b"p1", None, None]])], 3.0)
    core.committed([second] if second else [], None, 4.0)
    assert a.first_token_at == 2.0 and a.tokens == [100, 101]        # the first token's time stays
    third = core.emit([Emit(items=[[la, 102, b"p2", None, None]])], 5.0)
    core.committed([third] if third else [], JobError.log_failed(OSError("io")), 6.0)
    assert a.done and a.error is not None and a.tokens == [100, 101] and not a.staged
    assert core.take_frames() == [Cancel(lane=la, publish=True)]
    assert not b.done


def test_a_tokenize_answered_in_pieces_is_one_reply() -> None:
    core = _core()
    core.set_worker(True)
    reply = Reply()
    core.apply(TokenizeRequest([("abc", False)], False, reply), 0.0)
    [frame] = core.take_frames()
    core.handle(Tokenized(req=frame.req, tokens=[97], more=True))
    assert reply.answered == 0
    core.handle(Tokenized(req=frame.req, tokens=[98, 99]))
    assert reply.value == [97, 98, 99] and reply.answered == 1


def test_a_stopped_jobs_late_reservation_holds_nothing_when_its_handler_never_queues() -> None:
    """The handler was cancelled while its Reserve waited: its stop overtook it, and no Queue
    follows. The late reservation holds no place: the class's queue stays open to others."""
    core = _core(max_batch=1, max_queue=1)
    gone = _job()
    core.stop(gone)
    core.apply(Reserve(gone, Reply()), 0.0)
    assert not core._places and not core.active
    replies = [Reply(), Reply()]
    for reply in replies:          # a free lane and one queue place: both fit
        core.apply(Reserve(_job(), reply), 0.0)
    assert all(r.error is None for r in replies)


def test_a_gone_nodes_core_gives_up_its_waiting_jobs_and_tokenizes_to_another() -> None:
    """SPEC.md §14: between links, a fleet node's core hands what waits to another node's:
    a job that was running continues there from its committed tokens (its admission carries
    them); a job whose tokens are still being committed stays until they land; tokenizes go
    along as their commands; a reserved place stays."""
    a, b = _core(max_batch=3), _core(max_batch=3)
    a.set_worker(True)
    worker = Worker()
    first, second, queued = _job(max_new=6), _job(max_new=6), _job(max_new=4)
    for job in (first, second):
        a.submit(job, 0.0)
    worker.take(a.take_frames() + a.plan(1.0, send_tick=True)[0])
    worker.step()
    rounds: list[Any] = []
    feed(a, worker, rounds)
    a.committed(rounds, None, 2.0)           # each has one durable token
    assert first.tokens == [100] and second.tokens == [100]
    worker.take(a.take_frames() + a.plan(2.0, send_tick=True)[0])
    worker.step()
    pending: list[Any] = []
    feed(a, worker, pending)                 # a second round of both, still being committed
    a.submit(queued, 2.5)
    reply = Reply()
    a.apply(TokenizeRequest([("ab", False)], False, reply), 3.0)
    reserved = _job()
    a.apply(Reserve(reserved, Reply()), 3.0)
    a.worker_lost("node gone")
    moved = a.evacuate()
    assert [m for m in moved if isinstance(m, Job)] == [queued]        # the others' tokens are in flight
    assert [type(m) for m in moved if not isinstance(m, Job)] == [TokenizeRequest]
    a.committed(pending, None, 3.5)
    assert first.tokens == [100, 101] and first.staged == []
    moved += a.evacuate()
    assert {m.id for m in moved if isinstance(m, Job)} == {first.id, second.id, queued.id}
    assert not any(a.queues.values()) and not a.tokenizes_pending and a.active   # the reserved place stays
    b.set_worker(True)
    for item in moved:
        if isinstance(item, Job):
            b.submit(item, 4.0)
        else:
            b.apply(item, 4.0)
    frames = b.take_frames() + b.plan(4.0, send_tick=True)[0]
    admits = {f.lane: f for f in frames if isinstance(f, Admit)}
    assert sorted(list(f.tokens[f.n_prompt:]) for f in admits.values()) == [[], [100, 101], [100, 101]]
    assert any(isinstance(f, Tokenize) for f in frames)
    with pytest.raises(AssertionError, match="between workers"):
        b.evacuate()


def test_a_token_that_completes_a_stop_ends_its_job_there_and_cancels_a_lane_the_worker_left_open() -> None:
    """The core's backstop for stop strings (SPEC.md §1): the token whose piece completes a stop
    ends the job with finish ``stop`` (and counts in its tokens); a lane the worker did not end
    itself is cancelled once, and what it emits meanwhile is dropped."""
    core = _core(max_batch=2)
    a, b = _job(max_new=9), _job(max_new=9)
    a.stops = b.stops = ("xy",)
    core.submit(a, 0.0)
    core.submit(b, 0.0)
    frames, _ = core.plan(0.0, send_tick=True)
    la, lb = [f.lane for f in frames if isinstance(f, Admit)]
    core.take_frames()
    rnd = core.emit([Emit(items=[[la, 5, b"x", None, None], [lb, 7, b"x", None, None]])], 1.0)
    assert rnd is not None and rnd.finishes == []
    core.committed([rnd], None, 1.5)
    # a's worker did not see the stop (finish None): the core ends it and cancels its lane;
    # b's worker ended its lane itself (finish "stop"): nothing to cancel
    rnd = core.emit([Emit(items=[[la, 6, b"y", None, None], [lb, 8, b"y", "stop", None]])], 2.0)
    assert rnd is not None and sorted(f for _j, f in rnd.ended) == ["stop", "stop"]
    assert core.take_frames() == [Cancel(lane=la, publish=True)]
    core.committed([rnd], None, 2.5)
    assert a.finish == b.finish == "stop" and a.tokens == [5, 6] and b.tokens == [7, 8]
    assert core.emit([Emit(items=[[la, 9, b"z", None, None]])], 3.0) is None   # the cancelled lane's tail


def test_park_counts_from_ticks_and_telemetry_become_counter_steps_and_restart_with_a_worker() -> None:
    """The worker's park counts are cumulative per worker generation (SPEC.md §5 "Park metrics"):
    the core turns them into counter steps, from a tick's ``park`` or a writer's ``Telemetry``,
    and a new worker's counts start again from zero."""
    core = _core()
    core.new_worker()
    core.tick_done(TickDone(seq=1, park={"parks": 2, "resumes": 1, "bytes": 100, "fallbacks": {"torn": 1}}))
    core.handle(Telemetry(values={"park.parks": 3, "park.bytes": 150, "park.fallback.torn": 2}))
    core.handle(Telemetry(values={"tokens_per_s": 5.0}))   # no park counts: nothing changes
    assert core.park["parks"] == 3 and core._park_seen["fallback:torn"] == 2.0
    core.new_worker()
    core.tick_done(TickDone(seq=2, park={"parks": 1, "fallbacks": {}}))
    assert core._park_seen["parks"] == 1.0 and core.park["parks"] == 1
    core.tick_done(TickDone(seq=3, park={"parks": 0, "fallbacks": {"torn": 0}}))   # went back: a fresh count
    assert core._park_seen["parks"] == 0.0


def test_a_slot_action_goes_with_the_tokenizes_and_its_answer_is_the_reply() -> None:
    core = _core()
    core.set_worker(True)
    reply = Reply()
    core.apply(SlotRequest("save", 0, "a.bin", "", reply), 0.0)
    [frame] = core.take_frames()
    assert isinstance(frame, SlotAction) and (frame.action, frame.seq, frame.filename) == ("save", 0, "a.bin")
    core.handle(SlotDone(req=frame.req + 1000, tokens=1))   # no such request: ignored
    assert reply.answered == 0
    core.handle(SlotDone(req=frame.req, tokens=7, nbytes=70))
    assert reply.answered == 1 and reply.value.tokens == 7 and not core.tokenizes_pending
