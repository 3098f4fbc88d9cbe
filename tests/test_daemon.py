"""The daemon end to end on the mock runtime: HTTP in, worker process out."""

from __future__ import annotations

import logging
import os
import re
import signal

import httpx
import psutil
import pytest
import trio

from superfluid.client import aiter_sse
from superfluid.sched import PlannerConfig

from superfluid.suite._client import metric_sum

from .conftest import Daemon, mock_config, sse_events, start_daemon, stream_text, worker_pids

CHAT = {"model": "mock", "messages": [{"role": "user", "content": "tell me a story"}], "temperature": 0}


async def metric(d: Daemon, name: str, **labels: str) -> float:
    """The sum of the samples of ``name`` whose labels include ``labels``."""
    return metric_sum((await d.client.get("/metrics")).text, name, **labels) or 0.0


async def test_health_and_models(daemon: Daemon) -> None:
    r = await daemon.client.get("/health")
    assert r.json() == {"status": "ok", "models_loaded": 1, "models_known": 1}
    models = (await daemon.client.get("/v1/models")).json()["data"]
    assert [m["id"] for m in models] == ["mock"]
    assert models[0]["runtime"]["id"] == "mock"
    assert models[0]["capabilities"]["grammar"] != True  # noqa: E712 - a reason string
    [pid] = worker_pids()  # a child process named superfluid-worker-mock
    # in the daemon's process group: a signal to the group (Ctrl-C, a supervisor) reaches it too
    assert os.getpgid(pid) == os.getpgid(0)


async def test_non_streamed_and_streamed_agree(daemon: Daemon) -> None:
    whole = (await daemon.client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 24})).json()
    text = whole["choices"][0]["message"]["content"]
    assert text and whole["usage"]["completion_tokens"] <= 24
    async with daemon.client.stream("POST", "/v1/chat/completions",
                                    json={**CHAT, "max_tokens": 24, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = await sse_events(r)
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert stream_text(events) == text
    final = events[-1]
    assert final["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert final["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"]
    # the repeat was seeded from the prefix cache
    assert final["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


async def test_completions_and_stop_strings(daemon: Daemon) -> None:
    base = {"model": "mock", "prompt": "once upon a time", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    full = (await daemon.client.post("/v1/completions", json=base)).json()["choices"][0]["text"]
    words = full.split()
    stop = " " + words[len(words) // 2]
    cut = full[: full.index(stop)]
    r = (await daemon.client.post("/v1/completions", json={**base, "stop": [stop]})).json()
    assert r["choices"][0]["text"] == cut
    assert r["choices"][0]["finish_reason"] == "stop"
    async with daemon.client.stream("POST", "/v1/completions", json={**base, "stop": stop, "stream": True}) as s:
        events = await sse_events(s)
    assert "".join(e["choices"][0]["text"] for e in events) == cut


async def test_completions_logprobs_in_the_legacy_shape(daemon: Daemon) -> None:
    """``logprobs: N`` on /v1/completions: per token its text (joining to the
    completion), its logprob, the N best as a dict and its text offset; the
    stream carries the same rows chunk by chunk, a held-back stop included."""
    base = {"model": "mock", "prompt": "once upon a time", "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "logprobs": 2}
    whole = (await daemon.client.post("/v1/completions", json=base)).json()["choices"][0]
    lp = whole["logprobs"]
    n = len(lp["tokens"])
    assert n == 12 and "".join(lp["tokens"]) == whole["text"]
    assert len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n
    assert all(len(top) <= 2 and all(v <= 0 for v in top.values()) for top in lp["top_logprobs"])
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(n)]
    stop = lp["tokens"][6] + lp["tokens"][7]
    cut = whole["text"][: whole["text"].index(stop)]
    async with daemon.client.stream("POST", "/v1/completions", json={**base, "stop": [stop], "stream": True}) as s:
        events = await sse_events(s)
    rows = [e["choices"][0]["logprobs"] for e in events if e["choices"] and e["choices"][0]["logprobs"]]
    streamed = {k: [v for r in rows for v in r[k]] for k in ("tokens", "token_logprobs", "text_offset")}
    assert "".join(e["choices"][0]["text"] for e in events) == cut
    assert streamed == {k: lp[k][: len(streamed["tokens"])] for k in streamed}
    assert "".join(streamed["tokens"]).startswith(cut) and len("".join(streamed["tokens"])) > len(cut)
    assert (await daemon.client.post("/v1/completions", json={**base, "logprobs": None})).json()[
        "choices"][0]["logprobs"] is None


async def test_bad_input_is_typed(daemon: Daemon) -> None:
    c = daemon.client
    cases = [
        (await c.post("/v1/chat/completions", content=b"{not json"), 400, None),
        (await c.post("/v1/chat/completions", content=b"[1,2]"), 400, None),
        (await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}), 400, None),
        (await c.post("/v1/chat/completions", json={**CHAT, "model": "nope"}), 404, "model_not_found"),
        (await c.post("/v1/chat/completions", json={**CHAT, "messages": []}), 400, None),
        (await c.post("/v1/chat/completions", json={**CHAT, "messages": "hi"}), 400, None),
        (await c.post("/v1/chat/completions", json={**CHAT, "temperature": "hot"}), 400, None),
        (await c.post("/v1/chat/completions", json={**CHAT, "max_tokens": -3}), 400, None),
        (await c.post("/v1/chat/completions", json={**CHAT, "stream": "yes"}), 400, None),
        (await c.post("/v1/chat/completions", json=CHAT, headers={"x-superfluid-qos": "vip"}), 400, None),
        (await c.post("/v1/chat/completions", json={**CHAT, "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]}),
         400, "unsupported_input"),
        (await c.post("/v1/chat/completions", json={**CHAT, "messages": [
            {"role": "user", "content": "word " * 5000}]}), 400, "context_length_exceeded"),
        (await c.get("/v1/nothing-here"), 404, "not_found"),
    ]
    for response, status, code in cases:
        assert response.status_code == status, response.text
        err = response.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["message"]
        assert err["code"] == code
        assert err["type"] == "invalid_request_error"
    # a huge declared body is refused before it is read
    host, port = daemon.url.removeprefix("http://").rsplit(":", 1)
    stream = await trio.open_tcp_stream(host, int(port))
    await stream.send_all(b"POST /v1/chat/completions HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\n"
                          b"content-length: 209715200\r\n\r\n{")
    raw = b""
    with trio.fail_after(5):
        while b"payload_too_large" not in raw:
            chunk = await stream.receive_some(4096)
            if not chunk:
                break
            raw += chunk
    assert raw.startswith(b"HTTP/1.1 413") and b"payload_too_large" in raw
    await stream.aclose()
    # nothing was lost: the daemon still serves
    assert (await c.post("/v1/chat/completions", json={**CHAT, "max_tokens": 4})).status_code == 200


# 50 ms a token: the 3,000 tokens asked for take 150 s, so only a cancel frees the lane in time
SLOW_MOCK = "mock?step_ms=50&prefill_us=5"
SLOW = {**CHAT, "max_tokens": 3000, "ignore_eos": True}


async def _assert_cancelled(d: Daemon) -> None:
    """The lane is freed well before the job could have finished, and the job ended cancelled."""
    with trio.fail_after(10):
        while await metric(d, "superfluid_lanes_active") != 0:
            await trio.sleep(0.02)
    assert await metric(d, "superfluid_requests_total", outcome="cancelled") == 1
    assert await metric(d, "superfluid_requests_total", outcome="ok") == 0
    assert await metric(d, "superfluid_decode_tokens_total") < 300


async def test_streamed_disconnect_cancels(nursery: trio.Nursery) -> None:
    d = await start_daemon(nursery, mock_config(SLOW_MOCK))
    async with d.client.stream("POST", "/v1/chat/completions", json={**SLOW, "stream": True}) as r:
        async for _line in r.aiter_lines():
            break
        assert await metric(d, "superfluid_lanes_active") == 1
    await _assert_cancelled(d)
    d.scope.cancel()


async def test_non_streamed_disconnect_cancels(nursery: trio.Nursery) -> None:
    d = await start_daemon(nursery, mock_config(SLOW_MOCK))
    async with trio.open_nursery() as n:
        async def post() -> None:
            await d.client.post("/v1/chat/completions", json=SLOW)
            raise AssertionError("the reply came before the client went away")

        n.start_soon(post)
        with trio.fail_after(10):
            while await metric(d, "superfluid_lanes_active") != 1:
                await trio.sleep(0.02)
        n.cancel_scope.cancel()  # the client goes away mid-generation
    await _assert_cancelled(d)
    d.scope.cancel()


async def test_worker_sigkill_mid_stream_continues(daemon: Daemon) -> None:
    """A killed worker is respawned and the stream continues with the same text."""
    body = {**CHAT, "max_tokens": 300, "ignore_eos": True, "stream": True}
    async with daemon.client.stream("POST", "/v1/chat/completions", json=body) as r:
        reference = stream_text(await sse_events(r))
    [pid] = worker_pids()
    async with daemon.client.stream("POST", "/v1/chat/completions", json=body) as r:
        events = []
        killed = False
        async for event in aiter_sse(r.aiter_bytes()):
            if event.data and event.data != "[DONE]":
                events.append(event.json())
                # a chunk may carry several tokens: kill a quarter of the way through the text
                if not killed and len(stream_text(events)) >= len(reference) // 4:
                    os.kill(pid, signal.SIGKILL)
                    killed = True
            if event.data == "[DONE]":
                break
    assert killed and not any("error" in e for e in events)
    assert stream_text(events) == reference
    assert await metric(daemon, "superfluid_worker_respawns_total") == 1
    assert worker_pids() and worker_pids() != [pid]
    ok = await daemon.client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 4})
    assert ok.status_code == 200


async def bystander(d: Daemon, body: dict, out: list[str]) -> None:
    """Stream ``body`` beside a fault; it must complete without an error. Appends its text to ``out``."""
    async with d.client.stream("POST", "/v1/chat/completions", json=body) as r:
        events = await sse_events(r)
    assert not any("error" in e for e in events), events[-1]
    out.append(stream_text(events))


async def test_request_that_keeps_killing_its_worker_fails_typed(nursery: trio.Nursery) -> None:
    """A job that kills its worker every time it runs ends 500 ``worker_crashed`` (an error
    frame when streamed), while an innocent request running beside it completes."""
    poison = {"model": "mock", "messages": [{"role": "user", "content": "[[mock:crash_after=0]] go"}],
              "max_tokens": 50, "ignore_eos": True}
    for stream in (True, False):  # a daemon each: every run spends the restart intensity
        d = await start_daemon(nursery, mock_config("mock?step_ms=5&prefill_us=5"))
        innocent: list[str] = []

        async with trio.open_nursery() as n:
            n.start_soon(bystander, d, {**CHAT, "max_tokens": 200, "ignore_eos": True, "stream": True}, innocent)
            with trio.fail_after(10):
                while await metric(d, "superfluid_lanes_active") != 1:
                    await trio.sleep(0.01)
            if stream:
                async with d.client.stream("POST", "/v1/chat/completions", json={**poison, "stream": True}) as r:
                    assert r.status_code == 200
                    events = await sse_events(r)
                assert "error" in events[-1] and "choices" not in events[-1]
                error = events[-1]["error"]
            else:
                r = await d.client.post("/v1/chat/completions", json=poison)
                assert r.status_code == 500, r.text
                error = r.json()["error"]
        assert (error["type"], error["code"]) == ("server_error", "worker_crashed"), error
        assert "worker" in error["message"]
        assert innocent and len(innocent[0]) > 0
        assert await metric(d, "superfluid_worker_respawns_total") >= 3
        ok = await d.client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 4})
        assert ok.status_code == 200
        d.scope.cancel()


async def test_a_request_admitted_beside_a_poisoned_one_completes(nursery: trio.Nursery) -> None:
    """Quarantine: a long prompt still prefilling beside a short request that kills its worker
    at its first token is, like the poisoned one, without progress at every death;
    re-admitted together they would die together until both failed ``worker_crashed``. Suspects
    are re-admitted one at a time, so the innocent completes and only the poisoned one fails."""
    d = await start_daemon(nursery, mock_config("mock?step_ms=5&prefill_us=1000"))
    story = {"model": "mock", "messages": [{"role": "user", "content": "tell me a story " * 200}],
             "max_tokens": 30, "ignore_eos": True, "stream": True}
    innocent: list[str] = []
    poison = {"model": "mock", "messages": [{"role": "user", "content": "[[mock:crash_after=0]] go"}],
              "max_tokens": 20, "ignore_eos": True}
    replies: list[httpx.Response] = []

    async def post_poison() -> None:
        replies.append(await d.client.post("/v1/chat/completions", json=poison))

    async with trio.open_nursery() as n:  # both arrive at once: admitted in one plan, both fresh at the death
        n.start_soon(bystander, d, story, innocent)  # a long prompt: the short poisoned one prefills first
        n.start_soon(post_poison)
    [r] = replies
    assert r.status_code == 500 and r.json()["error"]["code"] == "worker_crashed", r.text
    assert innocent and len(innocent[0]) > 0
    assert await metric(d, "superfluid_worker_respawns_total") >= 3
    d.scope.cancel()


async def test_a_lane_fault_ends_only_its_request(daemon: Daemon) -> None:
    """A fault inside one lane (its sampler raised) ends that request typed (500); the
    worker lives on and a stream beside it completes with its uninterrupted text."""
    body = {**CHAT, "max_tokens": 120, "ignore_eos": True, "stream": True}
    async with daemon.client.stream("POST", "/v1/chat/completions", json=body) as r:
        reference = stream_text(await sse_events(r))
    [pid] = worker_pids()
    got: list[str] = []

    async with trio.open_nursery() as n:
        n.start_soon(bystander, daemon, body, got)
        faulty = {"model": "mock", "messages": [{"role": "user", "content": "[[mock:fault_after=3]] go"}],
                  "max_tokens": 50, "ignore_eos": True}
        r = await daemon.client.post("/v1/chat/completions", json=faulty)
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error", r.text
    assert got == [reference]
    assert worker_pids() == [pid]
    assert await metric(daemon, "superfluid_worker_respawns_total") == 0


async def test_malformed_worker_frames_restart_the_worker(daemon: Daemon) -> None:
    [pid] = worker_pids()
    bad = {"model": "mock", "messages": [{"role": "user", "content": "[[mock:garbage_after=1]] go"}],
           "max_tokens": 20}
    r = await daemon.client.post("/v1/chat/completions", json=bad)
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    assert await metric(daemon, "superfluid_worker_respawns_total") >= 1
    assert pid not in worker_pids()
    ok = await daemon.client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 4})
    assert ok.status_code == 200


@pytest.mark.slow
async def test_stream_interval_coalesces_tokens_but_never_the_first(nursery: trio.Nursery) -> None:
    """--stream-interval-ms and --agent-stream-interval-ms: tokens share chunks (one daemon
    wake-up each) by the lane's class, the first text goes out alone at once, and the text is
    the same whatever the interval. Real time (a worker process paces the tokens): 10 ms a
    token, so a lagging daemon still sends most tokens alone where nothing is held."""
    body = {**CHAT, "max_tokens": 120, "ignore_eos": True, "stream": True}
    chunks: dict[tuple[int, int, str], list[str]] = {}
    for ms, agent_ms in ((0, 300), (300, 0)):
        # one-second ticks: rows leave by the hold, not with each tick's TickDone
        planner = PlannerConfig(max_batch=4, tick_free_ms=1000, tick_busy_ms=1000)
        d = await start_daemon(nursery, mock_config("mock?step_ms=10&prefill_us=5", stream_interval_ms=ms,
                                                    agent_stream_interval_ms=agent_ms, planner=planner))

        async def one(klass: str, ms: int = ms, agent_ms: int = agent_ms, d: Daemon = d) -> None:
            async with d.client.stream("POST", "/v1/chat/completions", json=body,
                                       headers={"x-superfluid-qos": klass}) as r:
                events = await sse_events(r)
            got = [e["choices"][0]["delta"].get("content") or "" for e in events if e.get("choices")]
            chunks[ms, agent_ms, klass] = [c for c in got if c]

        async with trio.open_nursery() as both:  # side by side: one class's flush leaves the other's rows
            both.start_soon(one, "interactive")
            both.start_soon(one, "background")
        d.scope.cancel()
    texts = {"".join(c) for c in chunks.values()}
    assert len(texts) == 1
    for every, held in (((0, 300, "interactive"), (0, 300, "background")),
                        ((300, 0, "background"), (300, 0, "interactive"))):
        assert len(chunks[every]) >= 40                   # about one chunk per token (fewer if the daemon lags)
        assert len(chunks[held]) <= 15                    # 120 tokens x 10 ms: the first alone, then ~300 ms each
        assert chunks[held][0] == chunks[every][0]        # the first token was not held


async def test_hung_worker_is_killed_and_replaced(nursery: trio.Nursery) -> None:
    d = await start_daemon(nursery, mock_config(hang_timeout_s=1.0))
    hang = {"model": "mock", "messages": [{"role": "user", "content": "[[mock:hang_after=1]] go"}], "max_tokens": 20}
    r = await d.client.post("/v1/chat/completions", json=hang)
    assert r.status_code == 500
    ok = await d.client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 4})
    assert ok.status_code == 200
    d.scope.cancel()


async def test_load_failure_is_reported(nursery: trio.Nursery) -> None:
    import pytest

    from superfluid.nursery import WorkerLoadFailed

    with pytest.RaisesGroup(pytest.RaisesExc(WorkerLoadFailed, match="refuse_load"), flatten_subgroups=True):
        await start_daemon(nursery, mock_config("mock?refuse_load=1"))


async def test_shutdown_reaps_workers(nursery: trio.Nursery, caplog: pytest.LogCaptureFixture) -> None:
    """Shutting down asks each worker to exit (``Shutdown`` over the link: exit status 0,
    not a signal's) and reaps it."""
    caplog.set_level(logging.DEBUG, logger="superfluid.nursery._worker")
    d = await start_daemon(nursery, mock_config())
    [pid] = worker_pids()
    d.scope.cancel()

    def reaped() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.getMessage().startswith(f"worker pid {pid} ")]

    with trio.fail_after(10):
        while not reaped():
            await trio.sleep(0.05)
    assert reaped() == [f"worker pid {pid} (generation 1) reaped: exit status 0"]
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


async def test_openai_client_streams_a_chat(daemon: Daemon) -> None:
    import openai

    def run() -> tuple[str, str]:
        client = openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused")
        parts = []
        for chunk in client.chat.completions.create(model="mock", messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=16, stream=True, temperature=0):
            if chunk.choices and chunk.choices[0].delta.content:
                parts.append(chunk.choices[0].delta.content)
        whole = client.chat.completions.create(model="mock", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=16, temperature=0)
        return "".join(parts), whole.choices[0].message.content or ""

    streamed, whole = await trio.to_thread.run_sync(run)
    assert streamed and streamed == whole


async def test_worker_env_has_no_credentials(nursery: trio.Nursery, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setenv("MY_API_KEY", "sekrit")
    monkeypatch.setenv("GITHUB_TOKEN", "sekrit")
    monkeypatch.setenv("DB_PASSWORD", "sekrit")
    monkeypatch.setenv("HARMLESS", "fine")
    d = await start_daemon(nursery, mock_config())
    [pid] = worker_pids()
    env = psutil.Process(pid).environ()
    assert env.get("HARMLESS") == "fine"
    assert not {"MY_API_KEY", "GITHUB_TOKEN", "DB_PASSWORD"} & set(env)
    d.scope.cancel()


async def test_many_concurrent_streams_are_batched(daemon: Daemon) -> None:
    async def one(i: int, out: dict[int, str]) -> None:
        body = {**CHAT, "messages": [{"role": "user", "content": f"story {i}"}], "max_tokens": 30,
                "ignore_eos": True, "stream": True}
        async with daemon.client.stream("POST", "/v1/chat/completions", json=body) as r:
            out[i] = stream_text(await sse_events(r))

    out: dict[int, str] = {}
    async with trio.open_nursery() as n:
        for i in range(6):
            n.start_soon(one, i, out)
    assert len(out) == 6
    assert await metric(daemon, "superfluid_batched_rounds_total") > 0
    # greedy output does not depend on batch composition
    for i in (0, 5):
        alone = (await daemon.client.post("/v1/chat/completions", json={
            **CHAT, "messages": [{"role": "user", "content": f"story {i}"}], "max_tokens": 30, "ignore_eos": True,
        })).json()["choices"][0]["message"]["content"]
        assert alone == out[i]


def _unused(_: httpx.Response) -> None:  # keep httpx import for type hints
    pass


async def test_unload_under_traffic_and_reload_on_demand(nursery: trio.Nursery) -> None:
    from superfluid.serving import ModelSource

    cfg = mock_config()
    import attrs

    cfg = attrs.evolve(cfg, models=cfg.models + (ModelSource(spec="mock?name=small", runtime="mock", name="small"),))
    d = await start_daemon(nursery, cfg)
    assert [m["id"] for m in (await d.client.get("/v1/models")).json()["data"]] == ["mock", "small"]
    body = {**CHAT, "max_tokens": 3000, "ignore_eos": True, "stream": True}
    results: list[list[dict]] = []

    async def stream_one() -> None:
        async with d.client.stream("POST", "/v1/chat/completions", json=body) as r:
            results.append(await sse_events(r))

    async with trio.open_nursery() as n:
        for _ in range(4):
            n.start_soon(stream_one)
        with trio.fail_after(5):
            while await metric(d, "superfluid_lanes_active") < 4:
                await trio.sleep(0.02)
        r = await d.client.post("/v1/models/unload", json={"model": "mock"})
        assert r.json() == {"id": "mock", "object": "model", "deleted": True}
    # every in-flight stream ended typed
    for events in results:
        assert events[-1]["error"]["code"] == "model_unloaded"
    assert (await d.client.post("/v1/models/unload", json={"model": "small"})).status_code == 400  # the last one
    models = (await d.client.get("/v1/models")).json()["data"]
    assert [(m["id"], m["loaded"]) for m in models] == [("small", True), ("mock", False)]
    # the next request naming it loads it again
    ok = await d.client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 4})
    assert ok.status_code == 200
    assert (await d.client.get("/health")).json() == {"status": "ok", "models_loaded": 2, "models_known": 2}
    d.scope.cancel()


async def test_shared_prefix_burst_prefills_the_prefix_about_once(nursery: trio.Nursery) -> None:
    # prefill slow enough (0.3 ms/token) that the whole burst is queued while the first prefills
    daemon = await start_daemon(nursery, mock_config("mock?step_ms=1&prefill_us=300"))
    system = "the model runs the lane and the worker keeps the cache" * 100   # ~ 1,360 tokens
    n = 8

    async def one(i: int, out: list[dict]) -> None:
        r = await daemon.client.post("/v1/chat/completions", json={
            "model": "mock", "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": f"question {i}"}]})
        out.append(r.json()["usage"])

    usages: list[dict] = []
    async with trio.open_nursery() as nursery:
        for i in range(n):
            nursery.start_soon(one, i, usages)
    prompt = usages[0]["prompt_tokens"]
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    prefix = prompt - 12
    times_prefilled = n - cached / prefix
    assert prompt > 1100
    assert times_prefilled <= 1.5, (times_prefilled, usages)
    daemon.scope.cancel()


async def chat_when_busy(d: Daemon, lanes: int, after: float, max_tokens: int, ttft: list[float]) -> None:
    """Once ``lanes`` lanes are active, wait ``after`` seconds, send an interactive chat and
    append the time to its first token with text to ``ttft``."""
    with trio.fail_after(10):
        while await metric(d, "superfluid_lanes_active") < lanes:
            await trio.sleep(0.01)
    await trio.sleep(after)
    t0 = trio.current_time()
    async with d.client.stream("POST", "/v1/chat/completions", headers={"x-superfluid-qos": "interactive"},
                               json={**CHAT, "max_tokens": max_tokens, "stream": True}) as r:
        async for line in r.aiter_lines():
            if '"content":"' in line and '"content":""' not in line:
                ttft.append(trio.current_time() - t0)
                break


async def test_interactive_chat_preempts_background_agents(nursery: trio.Nursery) -> None:
    """All lanes busy with background agents; a chat gets a lane at the next tick
    and every preempted agent stream resumes with nothing repeated or lost."""
    d = await start_daemon(nursery, mock_config("mock?step_ms=20&prefill_us=100", max_batch=2))
    agent = {"model": "mock", "max_tokens": 60, "ignore_eos": True, "stream": True, "temperature": 0}

    def agent_body(i: int) -> dict:
        return {**agent, "messages": [{"role": "user", "content": f"agent {i} " + "the lane runs " * 200}]}

    refs = {}
    for i in range(2):
        async with d.client.stream("POST", "/v1/chat/completions", json=agent_body(i)) as r:
            refs[i] = stream_text(await sse_events(r))
    got: dict[int, str] = {}
    chat_ttft: list[float] = []

    async def run_agent(i: int) -> None:
        async with d.client.stream("POST", "/v1/chat/completions", json=agent_body(i),
                                   headers={"x-superfluid-qos": "background"}) as r:
            got[i] = stream_text(await sse_events(r))

    async with trio.open_nursery() as n:
        n.start_soon(run_agent, 0)
        n.start_soon(run_agent, 1)
        n.start_soon(chat_when_busy, d, 2, 0.2, 8, chat_ttft)
    assert await metric(d, "superfluid_preemptions_total") >= 1
    assert got == refs
    # without preemption the chat would wait for an agent to finish: 60 rounds x 20 ms
    assert chat_ttft and chat_ttft[0] < 0.6, chat_ttft
    d.scope.cancel()


@pytest.mark.parametrize("lanes", [2, 1], ids=["free-lane", "preempting"])
async def test_a_chat_does_not_wait_out_an_agents_prompt_pass(nursery: trio.Nursery, lanes: int) -> None:
    """With no more urgent lane live, an agent's prompt goes in big passes (here 2 s
    each); a chat arriving meanwhile aborts the running pass, which is redone later,
    so the chat's first token comes well inside one pass and the agent's text is
    unchanged. Without the abort the chat waits for the pass to end. With one lane the
    chat preempts the agent: the preemptor's Admit aborts the pass."""
    d = await start_daemon(nursery, mock_config("mock?step_ms=5&prefill_us=4000", max_batch=lanes))
    body = {"model": "mock", "max_tokens": 12, "ignore_eos": True, "stream": True, "temperature": 0,
            "messages": [{"role": "user", "content": "agent " + "the lane runs " * 400}]}
    got: list[str] = []
    chat_ttft: list[float] = []

    async def run_agent() -> None:
        async with d.client.stream("POST", "/v1/chat/completions", json=body,
                                   headers={"x-superfluid-qos": "agent"}) as r:
            got.append(stream_text(await sse_events(r)))

    before = await metric(d, "superfluid_prefill_steps_aborted_total")
    async with trio.open_nursery() as n:
        n.start_soon(run_agent)
        # into the agent's second pass: 512 tokens, 2.0 to 4.1 s
        n.start_soon(chat_when_busy, d, 1, 2.3, 4, chat_ttft)
    assert await metric(d, "superfluid_prefill_steps_aborted_total") >= before + 1
    async with d.client.stream("POST", "/v1/chat/completions", json=body) as r:  # uncontended
        assert got == [stream_text(await sse_events(r))]
    # a pass is 512 prompt tokens at 4 ms each; the chat's own prompt is a few tokens
    assert chat_ttft and chat_ttft[0] < 0.8, chat_ttft
    d.scope.cancel()


async def test_eight_streams_survive_repeated_worker_kills(nursery: trio.Nursery) -> None:
    """SIGKILL the worker at random points during eight concurrent streams:
    every stream completes with exactly the uninterrupted text."""
    import random

    d = await start_daemon(nursery, mock_config("mock?step_ms=4&prefill_us=20", max_batch=8))
    bodies = [{**CHAT, "messages": [{"role": "user", "content": f"stream {i}"}], "max_tokens": 120,
               "ignore_eos": True, "stream": True, "temperature": 0.9 if i % 2 else 0, "seed": 1000 + i}
              for i in range(8)]
    refs: dict[int, str] = {}
    got: dict[int, str] = {}

    async def one(i: int, out: dict[int, str]) -> None:
        async with d.client.stream("POST", "/v1/chat/completions", json=bodies[i]) as r:
            events = await sse_events(r)
        assert not any("error" in e for e in events), events[-1]
        out[i] = stream_text(events)

    async with trio.open_nursery() as n:
        for i in range(8):
            n.start_soon(one, i, refs)
    rng = random.Random(7)
    async with trio.open_nursery() as n:
        for i in range(8):
            n.start_soon(one, i, got)
        for _ in range(3):
            await trio.sleep(rng.uniform(0.05, 0.2))
            for pid in worker_pids():
                os.kill(pid, signal.SIGKILL)
    assert got == refs
    assert await metric(d, "superfluid_worker_respawns_total") >= 1
    d.scope.cancel()


async def test_every_generation_writes_one_access_log_line(nursery: trio.Nursery,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="superfluid.access")
    d = await start_daemon(nursery, mock_config())
    # ignore_eos: the mock may draw its end-of-generation token within five (finish=stop, 4 tokens)
    completion = {"model": "mock", "prompt": "hi", "max_tokens": 5, "ignore_eos": True}
    chat = {**CHAT, "max_tokens": 5, "ignore_eos": True}

    async def streamed(path: str, body: dict) -> None:
        async with d.client.stream("POST", path, json={**body, "stream": True}) as r:
            await sse_events(r)

    await d.client.post("/v1/completions", json=completion)
    await streamed("/v1/completions", completion)
    await d.client.post("/v1/chat/completions", json=chat)
    await streamed("/v1/chat/completions", chat)
    r = await d.client.post("/api/chat", json={"model": "mock", "messages": CHAT["messages"], "stream": False,
                                                "options": {"num_predict": 5}})
    assert r.status_code == 200, r.text

    def lines() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "superfluid.access"]

    with trio.fail_after(5):  # a handler logs after its last byte went out
        while len(lines()) < 5:
            await trio.sleep(0.01)
    logged = lines()
    pattern = re.compile(r"<-- 200 POST (\S+) qos=agent model=mock prompt=\d+ cached=\d+ completion=5 ttft=\d+ms "
                         r"prefill=[\d.]+ tok/s decode=[\d.]+ tok/s total=\d+ms finish=length")
    # a handler logs after its last byte went out, so the next request may log first
    routes = sorted(m.group(1) for m in map(pattern.fullmatch, logged) if m)
    assert routes == ["/api/chat"] + ["/v1/chat/completions"] * 2 + ["/v1/completions"] * 2, "\n".join(logged)
    d.scope.cancel()
