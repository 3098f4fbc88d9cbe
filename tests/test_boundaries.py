"""A model is a supervised subtree: failure boundaries, session spawns, unload races.

* A bug in a model's session task (a resume-TTL watcher, a turn actor) is
  contained by the task's own boundary: logged, its job stopped, the model
  goes on (code-review D1: the daemon exited).
* Anything else the whole actor raises (its sessions sub-nursery included)
  reaches the model's supervisor, which ends the jobs typed and restarts it.
* A conversation turn whose model is unloaded while it is being logged is
  answered typed (503) and never wedges the conversation (code-review D3).
* The registry's lock is not held across a worker's handshake; two loads of
  one name share one; ``unload`` returns once the old worker is gone.
"""

from __future__ import annotations

import contextvars
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import attrs
import psutil
import pytest
import trio
import trio.testing

import superfluid.api._lane as generate
import superfluid.api._turns as turns
import superfluid.nursery._actor as owner_module
from superfluid.serving import ModelSource
from superfluid.nursery import ModelActor, RestartPolicy, supervise
from superfluid.sessions._conversations import ConversationStore
from superfluid.suite._client import metric_sum

from .conftest import open_daemon, worker_pids
from .test_actor import _app, body, stream, two_models

# --- session tasks and the supervisor -------------------------------------------------------------


async def _leave_a_resumable_stream(client: Any, model: str) -> str:
    """Start a long resumable stream on ``model`` and leave after its first event; its session id."""
    async with client.stream("POST", "/v1/chat/completions",
                             json={**body(model, "left", max_tokens=100000), "stream": True},
                             headers={"x-superfluid-resumable": "true"}) as r:
        assert r.status_code == 200
        sid = r.headers["x-superfluid-session"]
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                break
    return sid


async def test_a_bug_in_a_session_task_stops_its_job_and_the_model_goes_on(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, logger="superfluid.actor")
    raised, left = trio.Event(), trio.Event()

    async def buggy_watcher(store: Any, session: Any) -> None:
        await left.wait()   # once the client has gone (its head was 200 and an event came)
        raised.set()
        raise ValueError("a bug in a session task")

    monkeypatch.setattr(generate, "serve_resume_ttl", buggy_watcher)
    async with open_daemon(two_models()) as d:
        app = _app(d.url)
        actor = app.registry.loaded["m2"].actor
        sid = await _leave_a_resumable_stream(d.client, "m2")
        job = app.sessions.live[sid].job
        left.set()
        with trio.fail_after(30):
            await raised.wait()
            await job.ended.wait()   # the boundary stopped the job nobody watches any more
            await actor.sessions_idle()
        # typed: its readers see a 500 session_failed, not a cancel nobody asked for
        assert job.finish is None and job.error is not None, (job.finish, job.error)
        assert (job.error.status, job.error.code) == (500, "session_failed"), job.error
        # the daemon and the model go on: the same actor, no model failure
        assert (await d.client.get("/health")).status_code == 200
        assert app.registry.loaded["m2"].actor is actor
        status, text, error = await stream(d.client, body("m2", "after", max_tokens=5))
        assert (status, error) == (200, None) and text
        metrics = (await d.client.get("/metrics")).text
        assert metric_sum(metrics, "superfluid_model_failures_total", model="m2") == 0
    failures = [r for r in caplog.records if "session task" in r.getMessage()]
    assert len(failures) == 1 and failures[0].exc_info is not None, [r.getMessage() for r in caplog.records]


async def test_a_failure_in_the_sessions_nursery_restarts_the_model_not_the_daemon(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, logger="superfluid.actor")
    boom = trio.Event()
    real = ModelActor._serve_sessions

    async def failing_sessions(self: ModelActor, *, task_status: Any) -> None:
        if self.name != "m2" or boom.is_set():
            await real(self, task_status=task_status)
            return
        async with trio.open_nursery() as sessions:
            task_status.started(sessions)
            await boom.wait()
            raise ValueError("a bug beside the model's sessions")

    monkeypatch.setattr(ModelActor, "_serve_sessions", failing_sessions)
    async with open_daemon(two_models()) as d:
        c = d.client
        m2 = _app(d.url).registry.loaded["m2"]
        ref = (await stream(c, body("mock", "calm")))[1]
        results: dict[str, Any] = {}

        async def run(key: str, payload: dict[str, Any]) -> None:
            results[key] = await stream(c, payload)

        with trio.fail_after(60):
            async with trio.open_nursery() as n:
                n.start_soon(run, "m2", body("m2", "long", max_tokens=100000))
                n.start_soon(run, "mock", body("mock", "calm"))
                while not any(job.tokens for job in m2.scheduler.running.values()):
                    await trio.sleep(0.01)
                boom.set()
        # the failed model's stream ended typed; the other model's is exactly what it is alone
        assert results["m2"][2] is not None and results["m2"][2]["code"] == "model_failed", results["m2"]
        assert results["mock"] == (200, ref, None)
        # the model restarted (a new actor run), the daemon never noticed
        with trio.fail_after(30):
            status, text, error = await stream(c, body("m2", "again", max_tokens=5))
        assert (status, error) == (200, None) and text
        metrics = (await c.get("/metrics")).text
        assert metric_sum(metrics, "superfluid_model_failures_total", model="m2") == 1
    tracebacks = [r for r in caplog.records if "its actor failed" in r.getMessage()]
    assert len(tracebacks) == 1 and tracebacks[0].exc_info is not None


@attrs.define
class _FakeScheduler:
    closed: tuple[str, str] | None = None
    failures: int = 0

    def close(self, message: str, *, code: str) -> None:
        if self.closed is None:
            self.closed = (message, code)

    @property
    def metrics(self) -> Any:
        outer = self

        class _Metrics:
            def inc(self, name: str) -> None:
                assert name == "superfluid_model_failures_total"
                outer.failures += 1
        return _Metrics()


@attrs.define
class _FakeActor:
    """The surface of a ModelActor the supervisor uses; its runs fail as ``runs`` says."""

    runs: list[str]
    name: str = "m"
    policy: RestartPolicy = RestartPolicy(max_restarts=2, window_s=60.0, backoff_s=0.5)
    scheduler: _FakeScheduler = attrs.field(factory=_FakeScheduler)
    schedulers: list[_FakeScheduler] = attrs.field(factory=list)
    started: bool = False
    stopped: bool = False
    stop_reason: tuple[str, str] = ("", "model_unloaded")

    def renew(self, scheduler: _FakeScheduler) -> None:
        self.schedulers.append(self.scheduler)
        self.scheduler = scheduler

    async def serve(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        run = self.runs.pop(0)
        if run == "load_fails":
            raise OSError("the first worker did not start")
        self.started = True
        task_status.started()
        if run == "sessions_fail":   # as the actor nursery raises it: a group
            async with trio.open_nursery() as actor:
                async def session() -> None:
                    await trio.lowlevel.checkpoint()
                    raise ValueError("a bug in a session task")
                actor.start_soon(session)
                await trio.sleep_forever()
        await trio.sleep(1)  # "stop": an unload


async def test_the_supervisor_catches_a_group_from_the_whole_actor_and_gives_up_past_the_intensity(
        autojump_clock: trio.testing.MockClock) -> None:
    actor = _FakeActor(runs=["sessions_fail", "sessions_fail", "sessions_fail"])
    given_up: list[Any] = []
    await supervise(actor, _FakeScheduler, on_give_up=given_up.append)  # type: ignore[arg-type]
    # each failure ended its scheduler's jobs typed and was counted; the third is past the intensity
    assert [s.closed[1] if s.closed else None for s in actor.schedulers] == ["model_failed"] * 3
    assert sum(s.failures for s in actor.schedulers) == 3
    assert given_up == [actor] and actor.scheduler.closed is not None and actor.scheduler.closed[1] == "model_failed"
    # and after one failure it restarts, then returns when the actor is stopped
    actor = _FakeActor(runs=["sessions_fail", "stopped"])
    await supervise(actor, _FakeScheduler, on_give_up=given_up.append)  # type: ignore[arg-type]
    assert actor.runs == [] and len(given_up) == 1


async def test_the_first_loads_failure_reaches_the_loader(autojump_clock: trio.testing.MockClock) -> None:
    actor = _FakeActor(runs=["load_fails"])
    async with trio.open_nursery() as n:
        with pytest.raises(OSError, match="did not start"):
            await n.start(partial(supervise, actor, _FakeScheduler, on_give_up=print))  # type: ignore[arg-type]


async def test_a_session_task_starts_in_a_clean_context_and_none_starts_once_the_actor_ended() -> None:
    from superfluid.sched import Unavailable

    probe: contextvars.ContextVar[str] = contextvars.ContextVar("probe", default="clean")
    seen: list[str] = []

    async def record() -> None:
        await trio.lowlevel.checkpoint()
        seen.append(probe.get())

    async with open_daemon(two_models()) as d:
        app = _app(d.url)
        actor = app.registry.loaded["m2"].actor
        probe.set("the request's")  # as a handler's exchange and held models are
        actor.start_session(record)
        with trio.fail_after(10):
            await actor.sessions_idle()
        assert seen == ["clean"]
        assert (await d.client.post("/v1/models/unload", json={"model": "m2"})).status_code == 200
        with pytest.raises(Unavailable) as caught:
            actor.start_session(trio.sleep, 0)
        assert caught.value.code == "model_unloaded"
        assert actor.session_tasks == 0


# --- conversation turns racing an unload ----------------------------------------------------------


async def _conversation(client: Any) -> str:
    r = await client.post("/v1/sessions", json={"model": "m2", "sampling": {"temperature": 0, "max_tokens": 5}})
    cid = r.json()["id"]
    await client.post(f"/v1/sessions/{cid}/messages", json={"messages": [{"role": "user", "content": "hi"}]})
    return str(cid)


async def _not_wedged(client: Any, cid: str) -> None:
    """The conversation is not generating; DELETE of its generation agrees; a next turn works."""
    info = (await client.get(f"/v1/sessions/{cid}")).json()
    assert info["generating"] is False, info
    r = await client.delete(f"/v1/sessions/{cid}/generation")
    assert r.status_code == 409 and r.json()["error"]["code"] == "no_generation", r.text
    with trio.fail_after(30):
        r = await client.post(f"/v1/sessions/{cid}/generate", json={"stream": False})
    assert r.status_code == 200, r.text
    assert (await client.get(f"/v1/sessions/{cid}")).json()["generating"] is False


async def test_an_unload_while_a_turn_is_logged_answers_503_and_the_conversation_goes_on(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(owner_module, "SESSIONS_GRACE_S", 0.2)
    async with open_daemon(two_models()) as d:
        c = d.client
        cid = await _conversation(c)
        real_begin = ConversationStore.begin
        old_pids: list[int] = []

        async def begin_then_unload(self: ConversationStore, turn: Any, params: Any) -> None:
            await real_begin(self, turn, params)
            old_pids.append(turn.model.actor.pid)
            assert (await c.post("/v1/models/unload", json={"model": "m2"})).status_code == 200
            with trio.fail_after(20):  # (the unload returns once the worker is gone: no wait here)
                while psutil.pid_exists(old_pids[0]):
                    await trio.sleep(0.01)
            await trio.sleep(0.3)  # the actor ends just after its worker: its sessions nursery is closed

        monkeypatch.setattr(ConversationStore, "begin", begin_then_unload)
        r = await c.post(f"/v1/sessions/{cid}/generate", json={"stream": False})
        monkeypatch.setattr(ConversationStore, "begin", real_begin)
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_unloaded", r.text
        events = (await c.get(f"/v1/sessions/{cid}/events")).json()["events"]
        assert events[-1]["type"] == "turn_end" and "model_unloaded" in str(events[-1]), events[-1]
        await _not_wedged(c, cid)


async def test_a_turn_whose_model_stopped_before_it_was_logged_is_refused_with_nothing_logged(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(owner_module, "SESSIONS_GRACE_S", 0.2)
    async with open_daemon(two_models()) as d:
        c = d.client
        cid = await _conversation(c)
        before = (await c.get(f"/v1/sessions/{cid}/events")).json()["events"]
        real_reserve = turns.reserve

        async def reserve_then_unload(sched: Any, job: Any) -> None:
            await real_reserve(sched, job)
            assert (await c.post("/v1/models/unload", json={"model": "m2"})).status_code == 200

        monkeypatch.setattr(turns, "reserve", reserve_then_unload)
        r = await c.post(f"/v1/sessions/{cid}/generate", json={"stream": False})
        monkeypatch.setattr(turns, "reserve", real_reserve)
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_unloaded", r.text
        assert (await c.get(f"/v1/sessions/{cid}/events")).json()["events"] == before
        await _not_wedged(c, cid)


# --- the registry's lock and loading marker --------------------------------------------------------


async def test_a_handshake_holds_no_lock_two_loads_share_it_and_unload_waits_for_the_worker(
        monkeypatch: pytest.MonkeyPatch) -> None:
    release = trio.Event()
    handshakes: list[str] = []
    real_open_worker = owner_module.open_worker

    @asynccontextmanager
    async def slow_worker(spec: Any, *args: Any, **kw: Any) -> AsyncIterator[Any]:
        await release.wait()
        async with real_open_worker(spec, *args, **kw) as worker:
            yield worker

    def slow_open_worker(spec: Any, *args: Any, **kw: Any) -> Any:
        handshakes.append(spec.model)
        return (slow_worker if "name=slow" in spec.model else real_open_worker)(spec, *args, **kw)

    monkeypatch.setattr(owner_module, "open_worker", slow_open_worker)
    cfg = attrs.evolve(two_models(), max_models=3)
    async with open_daemon(cfg) as d:
        app = _app(d.url)
        registry = app.registry
        slow = ModelSource(spec="mock?step_ms=3&name=slow", runtime="mock", name="slow")
        loaded: list[Any] = []
        m2_pid = registry.loaded["m2"].actor.pid
        handshakes.clear()
        with trio.fail_after(30):
            async with trio.open_nursery() as n:
                async def load() -> None:
                    loaded.append(await registry.load(slow))
                n.start_soon(load)
                n.start_soon(load)
                while not handshakes:
                    await trio.sleep(0.01)
                # while the handshake waits, the registry serves: an unload completes (its worker gone)
                assert await registry.unload("m2")
                assert m2_pid not in worker_pids() and "m2" not in registry.loaded
                release.set()
        assert len(loaded) == 2 and loaded[0] is loaded[1] and registry.loaded["slow"] is loaded[0]
        assert handshakes == [slow.spec]   # one handshake for both loads
