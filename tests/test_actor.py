"""The model actor: one writer of scheduler state, lanes as scopes, failures contained.

The first tests drive :class:`Scheduler` through its public commands over an
in-memory worker (a :class:`LinkHandle`), in virtual time; the last ones run
the daemon with two mock models.
"""

from __future__ import annotations

import gc
import inspect
import json
import math
from typing import Any

import attrs
import httpx
import pytest
import trio
import trio.lowlevel
import trio.testing

from superfluid.client import aiter_sse
from superfluid.serving import ModelSource
from superfluid.serving import Metrics
from superfluid.suite._client import metric_sum
from superfluid.proto import (
    Admit,
    Admitted,
    Cancel,
    Emit,
    Sampling,
    Tick,
    TickDone,
    Tokenize,
    Tokenized,
)
from superfluid.sched import (
    Job,
    LinkHandle,
    LinkLost,
    PlannerConfig,
    QosClass,
    QueueFull,
    Scheduler,
    SchedulerConfig,
    Unavailable,
)

from .conftest import mock_config, open_daemon

# --- the scheduler over an in-memory link ---------------------------------------------------------


class FakeLink:
    """An in-memory worker: answers every frame the loop writes, on the loop's inbox.
    Each lane generates ``100, 101, ...`` one token per tick until its ``max_new``;
    a tokenize answers one id per character."""

    def __init__(self, sched: Scheduler, generation: int = 1, *, answer_tokenize: bool = True) -> None:
        self.generation = generation
        self.dead = False
        self.send_timeout_s = math.inf
        self.pid = 0
        self.sent: list[Any] = []
        self.lanes: dict[int, list[int]] = {}   # lane -> [generated, max_new]
        self.answer_tokenize = answer_tokenize
        self._sched = sched

    def _event(self, event: Any) -> None:
        self._sched.deliver_nowait(self.generation, event)

    async def send(self, *events: Any) -> None:
        if self.dead:
            raise LinkLost("gone")
        self.sent += events
        for event in events:
            if isinstance(event, Admit):
                self.lanes[event.lane] = [0, event.max_new]
                self._event(Admitted(lane=event.lane, cached=0))
            elif isinstance(event, Cancel):
                if self.lanes.pop(event.lane, None) is not None:
                    self._event(Emit(items=[[event.lane, -1, b"", "cancelled", None]]))
            elif isinstance(event, Tokenize) and self.answer_tokenize:
                text = "".join(t for t, _special in event.segments)
                self._event(Tokenized(req=event.req, tokens=[ord(c) for c in text]))
            elif isinstance(event, Tick):
                rows = []
                for lane, state in list(self.lanes.items()):
                    state[0] += 1
                    done = state[0] >= state[1]
                    rows.append([lane, 99 + state[0], b"t", "length" if done else None, None])
                    if done:
                        del self.lanes[lane]
                if rows:
                    self._event(Emit(items=rows))
                self._event(TickDone(seq=event.seq))
        await trio.lowlevel.checkpoint()

    def die(self) -> None:
        self.dead = True
        self._event(LinkLost("the fake worker died"))

    def kill(self) -> None:
        self.die()


def _job(max_new: int = 3, klass: QosClass = QosClass.AGENT) -> Job:
    return Job(prompt=[1, 2, 3], sampling=Sampling(), max_new=max_new, klass=klass)


async def _run_generation(sched: Scheduler, link: FakeLink) -> None:
    try:
        await sched.run(link)
    except LinkLost:
        sched.set_worker(None)
        sched.worker_lost("test")


def test_the_fake_link_is_a_link_handle() -> None:
    assert isinstance(FakeLink(Scheduler("m", SchedulerConfig(), Metrics().for_model("m"))), LinkHandle)


async def test_handlers_reach_the_scheduler_only_by_commands(autojump_clock: trio.testing.MockClock) -> None:
    """reserve -> queue -> tokens -> done, all applied by the loop; the worker's only writer is the loop."""
    sched = Scheduler("m", SchedulerConfig(), Metrics().for_model("m"))
    link = FakeLink(sched)
    job = _job(max_new=3)
    async with trio.open_nursery() as n:
        n.start_soon(sched.run_commits)
        n.start_soon(_run_generation, sched, link)
        assert await sched.tokenize([("hey", False)]) == [ord(c) for c in "hey"]
        await sched.reserve(job)
        assert job.state.value == "queued" and not sched.queues[QosClass.AGENT]  # a place, not yet queued
        await sched.queue(job)
        with trio.fail_after(5):
            await job.ended.wait()
        n.cancel_scope.cancel()
    assert job.tokens == [100, 101, 102] and job.finish == "length" and job.error is None
    assert [type(e).__name__ for e in link.sent][:3] == ["Tokenize", "Admit", "Tick"]


ONE_LANE = PlannerConfig(max_batch=1)


async def test_queue_full_is_the_reply_to_reserve(autojump_clock: trio.testing.MockClock) -> None:
    """One lane, one queue place: the third request is refused."""
    sched = Scheduler("m", SchedulerConfig(max_queue=1, planner=ONE_LANE), Metrics().for_model("m"))
    runs, first, second = _job(), _job(), _job()
    async with trio.open_nursery() as n:
        n.start_soon(sched.idle)   # no worker: commands are applied all the same
        await sched.reserve(runs)
        await sched.reserve(first)
        with pytest.raises(QueueFull):
            await sched.reserve(second)
        sched.stop(first)                  # the place goes back ...
        await sched.reserve(second)        # ... so the next request gets it
        n.cancel_scope.cancel()
    assert first.done and first.finish == "cancelled"


async def test_a_handler_cancelled_while_waiting_leaves_nothing_behind(
        autojump_clock: trio.testing.MockClock) -> None:
    """The command stays in the inbox and is applied; the handler's retirement
    (a stop sent after it) undoes it: its place is free, its job ended, no lane used."""
    sched = Scheduler("m", SchedulerConfig(max_queue=1, planner=ONE_LANE), Metrics().for_model("m"))
    link = FakeLink(sched)
    job = _job(max_new=50)
    with trio.move_on_after(1):
        await sched.reserve(job)   # nobody applies commands yet: the reply never comes
    sched.stop(job)                # what leaving the lane's scope sends
    async with trio.open_nursery() as n:
        n.start_soon(sched.run_commits)
        n.start_soon(_run_generation, sched, link)
        with trio.fail_after(5):
            await job.ended.wait()
        other, third = _job(max_new=2), _job(max_new=2)
        await sched.reserve(other)   # one lane + one queue place: the cancelled handler's place was given back
        await sched.reserve(third)
        await sched.queue(other)
        await sched.queue(third)
        with trio.fail_after(5):
            await other.ended.wait()
            await third.ended.wait()
        n.cancel_scope.cancel()
    assert job.finish == "cancelled" and not job.tokens
    assert len([e for e in link.sent if isinstance(e, Admit)]) == 2  # only the other two ran
    assert other.tokens == [100, 101] and third.tokens == [100, 101]


async def test_a_tokenize_held_by_a_dying_worker_goes_to_the_next(autojump_clock: trio.testing.MockClock) -> None:
    sched = Scheduler("m", SchedulerConfig(hang_timeout_s=100), Metrics().for_model("m"))
    silent = FakeLink(sched, 1, answer_tokenize=False)
    result: list[list[int]] = []
    answered = trio.Event()

    async def ask() -> None:
        result.append(await sched.tokenize([("ab", False)]))
        answered.set()

    async with trio.open_nursery() as n:
        n.start_soon(ask)
        n.start_soon(_run_generation, sched, silent)
        await trio.testing.wait_all_tasks_blocked()
        assert any(isinstance(e, Tokenize) for e in silent.sent)
        silent.die()
        await trio.testing.wait_all_tasks_blocked()
        n.start_soon(_run_generation, sched, FakeLink(sched, 2))
        with trio.fail_after(5):
            await answered.wait()
        n.cancel_scope.cancel()
    assert result == [[ord("a"), ord("b")]]


async def test_a_chats_tokenize_goes_before_agents_waiting_for_theirs(
        autojump_clock: trio.testing.MockClock) -> None:
    """At most TOKENIZE_IN_FLIGHT tokenizes are at the worker; the rest wait in the daemon, the
    most urgent class first. (1,024 agents starting together once put ~600 in the worker's pipe,
    and a chat's tokenize waited 0.3-1 s behind them.)"""
    from superfluid.sched._core import TOKENIZE_IN_FLIGHT

    sched = Scheduler("m", SchedulerConfig(hang_timeout_s=100), Metrics().for_model("m"))
    link = FakeLink(sched, answer_tokenize=False)
    n_agents = TOKENIZE_IN_FLIGHT + 8
    done: list[str] = []

    async def ask(name: str, klass: QosClass) -> None:
        await sched.tokenize([(name, False)], klass=klass)
        done.append(name)

    async with trio.open_nursery() as n:
        n.start_soon(_run_generation, sched, link)
        for i in range(n_agents):
            n.start_soon(ask, f"agent{i:02d}", QosClass.AGENT)
            await trio.testing.wait_all_tasks_blocked()
        n.start_soon(ask, "chat", QosClass.INTERACTIVE)
        await trio.testing.wait_all_tasks_blocked()
        sent = [e for e in link.sent if isinstance(e, Tokenize)]
        assert len(sent) == TOKENIZE_IN_FLIGHT           # the rest wait in the daemon
        first = sent[0]
        link._event(Tokenized(req=first.req, tokens=[1]))  # one answer frees one place...
        await trio.testing.wait_all_tasks_blocked()
        sent = [e for e in link.sent if isinstance(e, Tokenize)]
        assert "".join(t for t, _ in sent[-1].segments) == "chat"   # ...and the chat takes it
        for e in sent[1:]:
            link._event(Tokenized(req=e.req, tokens=[1]))
        await trio.testing.wait_all_tasks_blocked()
        for e in [e for e in link.sent if isinstance(e, Tokenize)][len(sent):]:
            link._event(Tokenized(req=e.req, tokens=[1]))
        await trio.testing.wait_all_tasks_blocked()
        n.cancel_scope.cancel()
    assert len(done) == n_agents + 1 and done.index("chat") < done.index(f"agent{TOKENIZE_IN_FLIGHT:02d}")
    assert sched.core._tokenize_sent == 0 and not sched.core._tokenize


async def test_commands_to_a_closed_model_fail_typed(autojump_clock: trio.testing.MockClock) -> None:
    sched = Scheduler("m", SchedulerConfig(), Metrics().for_model("m"))
    queued = _job()
    await sched.queue(queued)          # waiting in the inbox when the model goes
    sched.close("model 'm' was unloaded", code="model_unloaded")
    assert queued.done and queued.error is not None and queued.error.code == "model_unloaded"
    with pytest.raises(Unavailable) as caught:
        await sched.reserve(_job())
    assert caught.value.code == "model_unloaded"


# --- the daemon: two models, one fails ------------------------------------------------------------

SPEC = "mock?step_ms=3&prefill_us=5"


def two_models(**kw: Any) -> Any:
    cfg = mock_config(SPEC, hang_timeout_s=5.0, **kw)
    return attrs.evolve(cfg, models=cfg.models + (ModelSource(spec=SPEC + "&name=m2", runtime="mock", name="m2"),))


def body(model: str, content: str, max_tokens: int = 40, **kw: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": content}], "temperature": 0,
            "max_tokens": max_tokens, "ignore_eos": True, **kw}


async def stream(client: httpx.AsyncClient, payload: dict[str, Any], headers: dict[str, str] | None = None
                 ) -> tuple[int, str, dict[str, Any] | None]:
    """``(status, text, error)`` of a chat stream (the error of an SSE error frame or of the response)."""
    text, error = [], None
    async with client.stream("POST", "/v1/chat/completions", json={**payload, "stream": True},
                             headers=headers or {}) as r:
        if r.status_code != 200:
            await r.aread()
            return r.status_code, "", r.json()["error"]
        async for event in aiter_sse(r.aiter_bytes()):
            if not event.data or event.data == "[DONE]":
                continue
            obj = event.json()
            if "error" in obj:
                error = obj["error"]
                continue
            text += [c["delta"].get("content") or "" for c in obj["choices"]]
    return 200, "".join(text), error


def _app(url: str) -> Any:
    """The daemon's App (the test's window on its registry and sessions)."""
    from superfluid.api import App

    gc.collect()
    port = int(url.rsplit(":", 1)[1])
    [app] = [o for o in gc.get_objects() if isinstance(o, App) and o.config.port in (0, port)
             and o.registry.loaded and not getattr(o, "_seen_by_test", False)]
    app._seen_by_test = True
    return app


async def test_a_fault_in_one_model_ends_only_its_requests_and_it_restarts() -> None:
    async with open_daemon(two_models()) as d:
        c = d.client
        prompts = [f"story {i}" for i in range(3)]
        reference = {p: (await stream(c, body("mock", p)))[1] for p in prompts}
        assert all(reference.values())
        results: dict[str, tuple[int, str, dict[str, Any] | None]] = {}
        started = trio.Event()

        async def run(key: str, payload: dict[str, Any]) -> None:
            results[key] = await stream(c, payload)

        with trio.fail_after(60):
            async with trio.open_nursery() as n:
                for p in prompts:
                    n.start_soon(run, "mock " + p, body("mock", p))
                    n.start_soon(run, "m2 " + p, body("m2", p, max_tokens=400))
                await trio.sleep(0.2)
                started.set()
                n.start_soon(run, "fault", body("m2", "boom [[mock:bug_after=2]]"))
        # the faulty model's requests ended typed 503 model_failed
        for key in ["fault", *("m2 " + p for p in prompts)]:
            status, _text, error = results[key]
            assert error is not None and error["code"] == "model_failed", (key, results[key])
            assert status in (200, 503)
        # the other model's streams are exactly what they are alone
        for p in prompts:
            assert results["mock " + p] == (200, reference[p], None)
        # a request sent at once (the actor is down for its restart back-off) waits for the restarted
        # actor instead of meeting the failed one's 503; the other model serves throughout
        with trio.fail_after(30):
            status, text, error = await stream(c, body("m2", "again", max_tokens=5))
        assert (status, error) == (200, None) and text
        assert (await stream(c, body("mock", "after")))[2] is None
        text = (await c.get("/metrics")).text
        assert metric_sum(text, "superfluid_model_failures_total", model="m2") == 1
        assert metric_sum(text, "superfluid_model_failures_total", model="mock") == 0


async def test_a_ttl_watcher_ends_with_its_job_not_with_its_ttl() -> None:
    cfg = attrs.evolve(mock_config(SPEC), resume_ttl_s=600.0)
    async with open_daemon(cfg) as d:
        app = _app(d.url)
        actor = app.registry.loaded["mock"].actor
        async with d.client.stream("POST", "/v1/chat/completions", json={**body("mock", "short", max_tokens=30),
                                                                          "stream": True},
                                   headers={"x-superfluid-resumable": "true"}) as r:
            sid = r.headers["x-superfluid-session"]
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    break   # the client leaves: the generation runs on, watched
        assert actor.session_tasks == 1
        job = app.sessions.live[sid].job
        with trio.fail_after(30):
            await job.ended.wait()
            await actor.sessions_idle()   # long before --resume-ttl
        assert job.finish == "length" and job.error is None


# --- unload releases everything -------------------------------------------------------------------

async def test_unload_ends_the_models_sessions_turns_and_watchers_and_releases_their_jobs() -> None:
    cfg = attrs.evolve(two_models(), resume_ttl_s=600.0)
    async with open_daemon(cfg) as d:
        c = d.client
        app = _app(d.url)
        ref = (await stream(c, body("mock", "calm")))[1]
        # a resumable stream on m2 whose client left (its TTL watcher alive) ...
        async with c.stream("POST", "/v1/chat/completions", json={**body("m2", "left", max_tokens=100000),
                                                                   "stream": True},
                            headers={"x-superfluid-resumable": "true"}) as r:
            sid = r.headers["x-superfluid-session"]
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    break
        # ... a conversation turn running on m2 ...
        r = await c.post("/v1/sessions", json={"model": "m2", "sampling": {"temperature": 0,
                                                                          "max_tokens": 100000, "ignore_eos": True}})
        cid = r.json()["id"]
        await c.post(f"/v1/sessions/{cid}/messages", json={"messages": [{"role": "user", "content": "hi"}]})
        async with c.stream("POST", f"/v1/sessions/{cid}/generate", json={"stream": True}) as r:
            turn_gen = r.headers["x-superfluid-session"]
        actor = app.registry.loaded["m2"].actor
        assert actor.session_tasks == 2   # the watcher and the turn's actor
        jobs = [app.sessions.live[sid].job, app.sessions.live[turn_gen].job]
        results: dict[str, Any] = {}

        async def plain() -> None:
            results["plain"] = await stream(c, body("m2", "plain", max_tokens=100000))

        async def other() -> None:
            results["other"] = await stream(c, body("mock", "calm"))

        with trio.fail_after(30):
            async with trio.open_nursery() as n:
                n.start_soon(plain)
                await trio.sleep(0.2)
                n.start_soon(other)
                r = await c.post("/v1/models/unload", json={"model": "m2"})
                assert r.status_code == 200, r.text
        # all three ended typed
        assert results["plain"][2] is not None and results["plain"][2]["code"] == "model_unloaded"
        for job in jobs:
            assert job.done and job.error is not None and job.error.code == "model_unloaded", job.error
        events = (await c.get(f"/v1/sessions/{cid}/events")).json()["events"]
        assert events[-1]["type"] == "turn_end" and "model_unloaded" in json.dumps(events[-1]), events[-1]
        # and nothing of the model holds them: no session task, no frame or coroutine refers to a job
        with trio.fail_after(10):
            await actor.sessions_idle()
        gc.collect()
        for job in jobs:
            holders = [h for h in gc.get_referrers(job) if inspect.isframe(h) or inspect.iscoroutine(h)]
            assert not holders, holders
        # the other model did not notice
        assert results["other"] == (200, ref, None)


# --- cancellation never waits behind back-pressure (code review D2) -----------------------------------


class _SlowDisk:
    """A session log whose fsync stalls until ``back`` is set."""

    def __init__(self) -> None:
        self.back = trio.Event()

    async def commit(self, spans: object, ended: object) -> None:
        await self.back.wait()


class _FreezableLink(FakeLink):
    """A FakeLink whose pipe can freeze: a write waits until ``thaw`` is set."""

    def __init__(self, sched: Scheduler) -> None:
        super().__init__(sched)
        self.frozen = False
        self.thaw = trio.Event()

    async def send(self, *events: Any) -> None:
        if self.frozen:
            await self.thaw.wait()
        await super().send(*events)


async def test_a_stop_reaches_a_stalled_actor_behind_a_full_inbox(autojump_clock: trio.testing.MockClock) -> None:
    """A slow disk holds the commit queue, the actor is blocked writing to a worker whose pipe is
    full, and other requests' commands fill the inbox; a client leaves. Its stop is a plain call
    that cannot wait or be dropped: once the write returns the actor applies it before any
    command, the lane's Cancel goes out while the disk still stalls, and the job ends
    ``cancelled`` (it generated 500 of 500 tokens for no reader when the stop shared the inbox)."""
    from superfluid.sched._loop import INBOX_SIZE

    disk = _SlowDisk()
    sched = Scheduler("m", SchedulerConfig(planner=ONE_LANE, max_queue=10_000), Metrics().for_model("m"), disk)
    link = _FreezableLink(sched)
    job = _job(max_new=500, klass=QosClass.INTERACTIVE)
    async with trio.open_nursery() as n:
        n.start_soon(sched.run_commits)
        n.start_soon(_run_generation, sched, link)
        await sched.reserve(job)
        await sched.queue(job)
        await trio.sleep(1)          # it generates; its commits stall: the actor takes no more rounds
        assert 0 < job.n_generated < 100 and not job.tokens
        link.frozen = True
        n.start_soon(sched.tokenize, [("x", False)])   # the actor's write of it blocks on the full pipe
        await trio.testing.wait_all_tasks_blocked()
        for _ in range(INBOX_SIZE + 8):  # other requests' reservations fill the inbox meanwhile
            n.start_soon(sched.reserve, _job())
        await trio.testing.wait_all_tasks_blocked()
        assert sched.inbox_send.statistics().current_buffer_used == INBOX_SIZE
        sched.stop(job)              # the client left: what the lane's retirement does
        link.thaw.set()
        await trio.testing.wait_all_tasks_blocked()
        cancels = [e for e in link.sent if isinstance(e, Cancel)]
        assert cancels and not disk.back.is_set()   # out while the disk still stalls
        disk.back.set()
        with trio.fail_after(600):
            await job.ended.wait()
        n.cancel_scope.cancel()
    assert job.cancelled and job.finish == "cancelled" and len(job.tokens) < 100


async def test_handlers_cannot_write_the_schedulers_state_while_its_actor_runs(
        autojump_clock: trio.testing.MockClock) -> None:
    """One writer, checked: a change of the core from a task other than the actor's is an
    AssertionError while the actor runs (the pre-actor design had handlers apply commands)."""
    sched = Scheduler("m", SchedulerConfig(), Metrics().for_model("m"))
    async with trio.open_nursery() as n:
        n.start_soon(sched.idle)
        await trio.testing.wait_all_tasks_blocked()
        for write in (lambda: sched.submit(_job()), lambda: sched.cancel(_job()),
                      lambda: sched.fail_queued("x"), lambda: sched.worker_lost("x")):
            with pytest.raises(AssertionError, match="the actor's alone"):
                write()
        n.cancel_scope.cancel()
    sched.submit(_job())   # with no actor running (startup, tests), the caller is the only task


class _AnswerThenDie(FakeLink):
    """A worker that answers a tokenize and dies at once: the answer and the death report
    reach the actor in one batch."""

    async def send(self, *events: Any) -> None:
        await super().send(*events)
        if any(isinstance(e, Tokenize) for e in events):
            self.die()


async def test_a_workers_answers_before_its_death_report_are_applied(autojump_clock: trio.testing.MockClock) -> None:
    """A death report ends the actor's run after the events the worker sent before it: the
    tokenize it answered is answered (the next worker, which answers none, never sees it),
    and the next worker serves on."""
    sched = Scheduler("m", SchedulerConfig(hang_timeout_s=100), Metrics().for_model("m"))
    first, second = _AnswerThenDie(sched, 1), FakeLink(sched, 2, answer_tokenize=False)
    job = _job(max_new=2)
    async with trio.open_nursery() as n:
        n.start_soon(sched.run_commits)
        n.start_soon(_run_generation, sched, first)
        with trio.fail_after(5):
            assert await sched.tokenize([("ab", False)]) == [ord("a"), ord("b")]
        await trio.testing.wait_all_tasks_blocked()
        assert first.dead
        n.start_soon(_run_generation, sched, second)
        await sched.reserve(job)
        await sched.queue(job)
        with trio.fail_after(5):
            await job.ended.wait()
        n.cancel_scope.cancel()
    assert not any(isinstance(e, Tokenize) for e in second.sent)
    assert job.tokens == [100, 101] and job.error is None
