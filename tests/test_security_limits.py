"""Limits everywhere (issue #17): no single request takes a model or the daemon down.

One test per rule: the prompt-size limit before tokenizing, a long prompt that
freezes nothing, tokenize answers that never outgrow a link frame, the request
body deadline, the WebSocket limits, the bounded queue, and a resumable request
whose client never got its id. The daemon runs in-process on the mock runtime;
timeouts are configured small and checked with generous bounds.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import trio
from trio_websocket import ConnectionClosed, open_websocket_url

from superfluid.api import _ws
from superfluid.suite._client import metric_sum

from .conftest import Daemon, mock_config, sse_events, start_daemon, stream_text, worker_pids

CHAT = {"model": "mock", "temperature": 0, "max_tokens": 40, "ignore_eos": True}


def ws_url(d: Daemon) -> str:
    return d.url.replace("http://", "ws://") + "/v1/ws"


async def metric(d: Daemon, name: str, **labels: str) -> float:
    """The samples of ``name`` with these labels, summed over the others (0 when absent)."""
    return metric_sum((await d.client.get("/metrics")).text, name, **labels) or 0.0


def messages(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


async def ws_reply(d: Daemon, msg: dict[str, Any]) -> dict[str, Any]:
    async with open_websocket_url(ws_url(d)) as ws:
        await ws.send_message(json.dumps(msg))
        return json.loads(await ws.get_message())


# -- 1. the prompt size, checked before tokenizing -------------------------------------------------------------------


async def test_a_prompt_over_the_byte_limit_is_413_in_every_dialect_before_tokenizing(
        nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch) -> None:
    from superfluid.sched import Scheduler

    tokenized: list[int] = []
    real = Scheduler.tokenize

    async def counting(self: Scheduler, segments: list[tuple[str, bool]], **kw: Any) -> list[int]:
        tokenized.append(sum(len(t) for t, _ in segments))
        return await real(self, segments, **kw)

    monkeypatch.setattr(Scheduler, "tokenize", counting)
    d = await start_daemon(nursery, mock_config(max_prompt_bytes=4096))
    big = "é" * 2100  # 4200 bytes in 2100 characters: the limit counts UTF-8 bytes
    c = d.client
    with trio.fail_after(60):
        for path, body in [
            ("/v1/chat/completions", {**CHAT, "messages": messages(big)}),
            ("/v1/chat/completions", {**CHAT, "messages": messages(big), "stream": True}),
            ("/v1/completions", {**CHAT, "prompt": big}),
            ("/v1/responses", {"model": "mock", "input": big}),
            ("/api/chat", {"model": "mock", "messages": messages(big), "stream": False}),
            ("/api/generate", {"model": "mock", "prompt": big, "stream": False}),
            ("/v1/tokenize", {"model": "mock", "text": big}),
        ]:
            r = await c.post(path, json=body)
            assert r.status_code == 413, (path, r.text)
            error = r.json()["error"]
            message = error if isinstance(error, str) else error["message"]
            assert "4096-byte limit" in message and "--max-prompt-bytes" in message, (path, message)
            if path.startswith("/v1/") and path != "/v1/tokenize":
                assert error["code"] == "prompt_too_large", (path, error)
        r = await c.post("/v1/messages", json={"model": "mock", "max_tokens": 8, "messages": messages(big)})
        assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large", r.text
        reply = await ws_reply(d, {"op": "generate", "id": 1, "body": {**CHAT, "messages": messages(big)}})
        assert reply["op"] == "error" and reply["error"]["code"] == "prompt_too_large", reply
        r = await c.post("/v1/sessions", json={"model": "mock", "messages": messages(big)})
        assert r.status_code == 201, r.text
        r = await c.post(f"/v1/sessions/{r.json()['id']}/generate", json={"max_tokens": 4})
        assert r.status_code == 413 and r.json()["error"]["code"] == "prompt_too_large", r.text
        assert tokenized == []  # none of them reached the tokenizer
        # just under the limit, a prompt is served
        r = await c.post("/v1/chat/completions", json={**CHAT, "messages": messages("é" * 1800)})
        assert r.status_code == 200, r.text
    d.scope.cancel()


async def test_a_prompt_longer_than_the_context_is_400_context_length_exceeded(nursery: trio.Nursery) -> None:
    d = await start_daemon(nursery, mock_config("mock?step_ms=1&prefill_us=5&n_ctx=256"))
    with trio.fail_after(60):
        r = await d.client.post("/v1/chat/completions", json={**CHAT, "messages": messages("x" * 300_000)})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "context_length_exceeded"
        assert "256 tokens" in r.json()["error"]["message"]
    d.scope.cancel()


# -- 2 and 3. a long prompt freezes nothing and kills no worker ------------------------------------------------------


async def _stream_gaps(d: Daemon, started: trio.Event, stop: trio.Event, gaps: list[float], out: list[str]) -> None:
    """Stream a long chat; record the gaps between chunks from ``started`` until ``stop``."""
    body = {**CHAT, "messages": messages("keep talking"), "max_tokens": 100_000, "stream": True}
    async with d.client.stream("POST", "/v1/chat/completions", json=body) as r:
        last = None
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            now = trio.current_time()
            if last is not None and started.is_set():
                gaps.append(now - last)
            last = now
            if stop.is_set():
                out.append("stopped")
                return


async def test_a_long_prompt_does_not_freeze_other_streams(nursery: trio.Nursery) -> None:
    """A 4 MB prompt (4 M mock tokens: a tokenize answer of ~8 MB, one frame before the
    fix) is tokenized, checked and refused while another stream keeps its chunks flowing."""
    d = await start_daemon(nursery, mock_config("mock?step_ms=2&prefill_us=5", hang_timeout_s=60.0,
                                                max_prompt_bytes=8 << 20, stream_interval_ms=20,
                                                agent_stream_interval_ms=20))
    big = httpx.Request("POST", "/", json={**CHAT, "messages": messages("\u00ff" * 2_000_000)}).content
    started, stop = trio.Event(), trio.Event()
    gaps: list[float] = []
    out: list[str] = []
    with trio.fail_after(240):
        async with trio.open_nursery() as inner:
            inner.start_soon(_stream_gaps, d, started, stop, gaps, out)
            await trio.sleep(0.5)
            started.set()
            r = await d.client.post("/v1/chat/completions", content=big,
                                    headers={"content-type": "application/json"}, timeout=240)
            stop.set()
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert out == ["stopped"] and len(gaps) > 10
    assert max(gaps) < 1.5, f"a stream waited {max(gaps):.2f} s for a chunk while the prompt was processed"
    d.scope.cancel()


async def test_a_9mb_prompt_kills_no_worker_and_64_streams_complete(nursery: trio.Nursery) -> None:
    """A ~9 MB prompt's tokens (~18 MB of msgpack) go back in pieces under the link's
    frame limit: the worker lives, 64 other streams end as they would alone, and the
    big request gets a typed 400."""
    d = await start_daemon(nursery, mock_config("mock?step_ms=1&prefill_us=1", max_batch=8, hang_timeout_s=60.0,
                                                max_prompt_bytes=12 << 20))
    bodies = [{**CHAT, "messages": messages(f"stream {i}"), "max_tokens": 24} for i in range(64)]
    expected = []
    for body in bodies[:4]:
        r = await d.client.post("/v1/chat/completions", json=body)
        expected.append(r.json()["choices"][0]["message"]["content"])
    pids = worker_pids()
    respawns = await metric(d, "superfluid_worker_respawns_total")
    big = httpx.Request("POST", "/", json={**CHAT, "messages": messages("\u00ff" * 4_600_000)}).content
    assert len(big) > 9_000_000
    texts: dict[int, str] = {}

    async def one(i: int) -> None:
        async with d.client.stream("POST", "/v1/chat/completions", json={**bodies[i], "stream": True},
                                   timeout=300) as r:
            assert r.status_code == 200
            texts[i] = stream_text(await sse_events(r))

    with trio.fail_after(300):
        async with trio.open_nursery() as inner:
            for i in range(64):
                inner.start_soon(one, i)
            r = await d.client.post("/v1/chat/completions", content=big,
                                    headers={"content-type": "application/json"}, timeout=300)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert len(texts) == 64 and all(texts[i] == expected[i] for i in range(4))
    assert all(texts[i] == texts[i % 4] or bodies[i] != bodies[i % 4] for i in range(64))
    assert all(len(t) > 0 for t in texts.values())
    assert worker_pids() == pids
    assert await metric(d, "superfluid_worker_respawns_total") == respawns
    d.scope.cancel()


def test_a_tokenize_answer_goes_in_pieces_under_the_frame_limit() -> None:
    """Pure: however long the answer, every frame fits the link's limit, and the
    request stays pending on the link until its last piece."""
    from superfluid.proto import (DAEMON, DEFAULT_MAX_FRAME, TOKENIZED_PIECE, WORKER, Hello, HelloAck, Tokenize,
                                  Tokenized, WorkerLink, tokenized_pieces)

    tokens = [2**32 - 1] * (4 * TOKENIZED_PIECE + 5)  # 5 bytes each in msgpack: ~21 MB in one frame
    pieces = tokenized_pieces(7, tokens)
    assert [p.more for p in pieces] == [True] * 4 + [False]
    assert [t for p in pieces for t in p.tokens] == tokens
    assert tokenized_pieces(7, []) == [Tokenized(req=7, tokens=[])]
    daemon, worker = WorkerLink(DAEMON), WorkerLink(WORKER)
    worker.receive_data(daemon.send(Hello()))
    worker.next_event()
    daemon.receive_data(worker.send(HelloAck(version=1, runtime="mock", runtime_version="0", model={},
                                             capabilities={}, limits={})))
    daemon.next_event()
    worker.receive_data(daemon.send(Tokenize(req=7, segments=[("x", False)])))
    worker.next_event()
    for piece in pieces:
        frame = worker.send(piece)
        assert len(frame) < DEFAULT_MAX_FRAME // 16
        daemon.receive_data(frame)
        assert daemon.next_event() == piece
        assert daemon.statistics().pending_tokenize == (1 if piece.more else 0)


# -- 4. the request body deadline --------------------------------------------------------------------------------------


async def test_a_stalled_request_body_is_408_and_the_connection_closes(nursery: trio.Nursery) -> None:
    d = await start_daemon(nursery, mock_config(body_timeout_s=0.5))
    host, port = d.url.removeprefix("http://").rsplit(":", 1)
    stream = await trio.open_tcp_stream(host, int(port))
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000\r\n\r\n{\"model\":")
    received = b""
    with trio.fail_after(20):
        await stream.send_all(head)
        while True:  # the server answers, then closes: read to EOF
            data = await stream.receive_some(65536)
            if not data:
                break
            received += data
    await stream.aclose()
    status, _, rest = received.partition(b"\r\n")
    assert status.startswith(b"HTTP/1.1 408"), received
    assert b"connection: close" in rest.lower()
    assert json.loads(rest.partition(b"\r\n\r\n")[2])["error"]["code"] == "request_timeout"
    d.scope.cancel()


# -- 5. WebSocket limits -------------------------------------------------------------------------------------------


async def test_ws_oversized_message_is_refused_while_read_by_the_server(nursery: trio.Nursery) -> None:
    """hypercorn's own limit is ours: it refuses the frame as it reads it (1009 with no
    reason), so no socket buffers up to hypercorn's 16 MiB default first."""
    d = await start_daemon(nursery, mock_config())
    with trio.fail_after(20):
        async with open_websocket_url(ws_url(d), max_message_size=1 << 24) as ws:
            await ws.send_message("x" * (_ws.LIMITS.max_message + 1024))
            with pytest.raises(ConnectionClosed) as info:
                await ws.get_message()
    assert info.value.reason.code == 1009
    assert not info.value.reason.reason  # ours (after buffering) names the size; the reader's says nothing
    d.scope.cancel()


async def test_ws_idle_socket_is_closed_but_one_following_a_session_is_not(nursery: trio.Nursery) -> None:
    d = await start_daemon(nursery, mock_config("mock?step_ms=20&prefill_us=5", ws_idle_timeout_s=0.5))
    with trio.fail_after(30):
        async with open_websocket_url(ws_url(d)) as ws:
            t0 = trio.current_time()
            with pytest.raises(ConnectionClosed) as info:
                await ws.get_message()
            assert info.value.reason.code == 1001 and "idle" in info.value.reason.reason
            assert trio.current_time() - t0 >= 0.4
        async with open_websocket_url(ws_url(d)) as ws:
            await ws.send_message(json.dumps({"op": "generate", "body": {
                **CHAT, "messages": messages("a story"), "max_tokens": 100}}))
            t0 = trio.current_time()
            ops = []
            while not ops or ops[-1] != "done":
                ops.append(json.loads(await ws.get_message())["op"])
            assert trio.current_time() - t0 > 1.0  # followed well past the idle timeout
            assert ops[0] == "started" and "delta" in ops
            with pytest.raises(ConnectionClosed) as info:  # then idle again
                await ws.get_message()
            assert info.value.reason.code == 1001
    d.scope.cancel()


# -- 6. a bounded queue per class --------------------------------------------------------------------------------------


async def test_a_full_queue_is_429_queue_full_with_retry_after_in_every_dialect(nursery: trio.Nursery) -> None:
    d = await start_daemon(nursery, mock_config("mock?step_ms=20&prefill_us=5", max_batch=1, max_queue=2))
    c = d.client
    long = {**CHAT, "max_tokens": 100_000, "stream": True}
    with trio.fail_after(60):
        async with trio.open_nursery() as held:
            async def hold(i: int) -> None:
                async with c.stream("POST", "/v1/chat/completions", json={**long, "messages": messages(f"{i}")}):
                    await trio.sleep_forever()

            for i in range(3):  # one runs, two wait
                held.start_soon(hold, i)
            while await metric(d, "superfluid_queue_depth", **{"class": "foreground_agent"}) < 2:
                await trio.sleep(0.05)
            for path, body in [
                ("/v1/chat/completions", {**CHAT, "messages": messages("one more")}),
                ("/v1/completions", {**CHAT, "prompt": "one more"}),
                ("/v1/responses", {"model": "mock", "input": "one more"}),
                ("/api/chat", {"model": "mock", "messages": messages("one more"), "stream": False}),
                ("/v1/messages", {"model": "mock", "max_tokens": 8, "messages": messages("one more")}),
            ]:
                r = await c.post(path, json=body)
                assert r.status_code == 429, (path, r.text)
                assert r.headers["retry-after"] == "1", path
                error = r.json()["error"]
                if path == "/v1/messages":
                    assert error["type"] == "rate_limit_error", error
                elif path != "/api/chat":
                    assert error["code"] == "queue_full" and "--max-queue 2" in error["message"], error
            reply = await ws_reply(d, {"op": "generate", "body": {**CHAT, "messages": messages("one more")}})
            assert reply["op"] == "error" and reply["error"]["code"] == "queue_full", reply
            cid = (await c.post("/v1/sessions", json={"model": "mock", "messages": messages("hi")})).json()["id"]
            r = await c.post(f"/v1/sessions/{cid}/generate", json={"max_tokens": 4})
            assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full", r.text
            # another class has its own queue (and an interactive request takes the agent's lane)
            r = await c.post("/v1/chat/completions", json={**CHAT, "messages": messages("x"), "max_tokens": 2},
                             headers={"x-superfluid-qos": "interactive"})
            assert r.status_code == 200, r.text
            held.cancel_scope.cancel()
    assert await metric(d, "superfluid_queue_full_total", **{"class": "foreground_agent"}) == 7
    d.scope.cancel()


# -- 7. a resumable request whose client never got its id ----------------------------------------------------------


async def test_a_resumable_request_whose_client_left_before_its_id_is_cancelled(nursery: trio.Nursery) -> None:
    d = await start_daemon(nursery, mock_config("mock?step_ms=20&prefill_us=5", max_batch=1))
    c = d.client
    agent = {"class": "foreground_agent"}
    resumable = {"x-superfluid-resumable": "true"}
    with trio.fail_after(60):
        async with trio.open_nursery() as held:
            async def hold(*, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
                body = {**CHAT, "messages": messages("hold"), "max_tokens": 100_000, "stream": True}
                async with c.stream("POST", "/v1/chat/completions", json=body):
                    task_status.started()
                    await trio.sleep_forever()

            await held.start(hold)  # a plain stream holds the only lane
            client = trio.CancelScope()

            async def waiting() -> None:
                body = {**CHAT, "messages": messages("resume me"), "stream": True}
                with client:
                    async with c.stream("POST", "/v1/chat/completions", json=body, headers=resumable):
                        raise AssertionError("the response began while its job waited for the lane")

            held.start_soon(waiting)
            while await metric(d, "superfluid_queue_depth", **agent) < 1:
                await trio.sleep(0.05)
            client.cancel()  # its client goes away before any response: it never learns the id
            while await metric(d, "superfluid_queue_depth", **agent) > 0:
                await trio.sleep(0.05)  # without the fix it stays queued behind the lane (and would run)
            held.cancel_scope.cancel()
        # once the client has the id, a disconnect leaves the generation running
        body = {**CHAT, "messages": messages("resume me"), "max_tokens": 100_000, "stream": True}
        async with c.stream("POST", "/v1/chat/completions", json=body, headers=resumable) as r:
            sid = r.headers["x-superfluid-session"]
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    break
        await trio.sleep(0.3)
        info = (await c.get(f"/v1/sessions/{sid}")).json()
        assert info["generating"], info
        assert (await c.delete(f"/v1/sessions/{sid}/generation")).status_code == 200
    d.scope.cancel()
