"""Sessions over WebSocket (``GET /v1/ws``): generate and follow, subscribe
from a cursor, cancel, refusals, and the inbound/outbound bounds."""

from __future__ import annotations

import json
from typing import Any

import attrs
import pytest
import trio
from trio_websocket import ConnectionClosed, WebSocketConnection, open_websocket_url

from superfluid.serving import ApiKey
from superfluid.api import _ws

from .conftest import Daemon, mock_config, sse_events, start_daemon, stream_text

CHAT = {"model": "mock", "messages": [{"role": "user", "content": "tell me a long story"}], "temperature": 0,
        "max_tokens": 120, "ignore_eos": True}


def ws_url(d: Daemon) -> str:
    return d.url.replace("http://", "ws://") + "/v1/ws"


async def put(ws: WebSocketConnection, **msg: Any) -> None:
    await ws.send_message(json.dumps(msg))


async def get(ws: WebSocketConnection) -> dict[str, Any]:
    return json.loads(await ws.get_message())


async def expect(ws: WebSocketConnection, op: str) -> dict[str, Any]:
    msg = await get(ws)
    assert msg["op"] == op, msg
    return msg


async def follow(ws: WebSocketConnection, sid: str, *, limit: int | None = None) -> tuple[str, int, dict | None]:
    """Read deltas of ``sid``: (text, last cursor, the done message or None if stopped at ``limit`` deltas)."""
    parts: list[str] = []
    cursor = 0
    while True:
        msg = await get(ws)
        assert msg.get("session") == sid, msg
        if msg["op"] == "delta":
            assert msg["cursor"] > cursor
            cursor = msg["cursor"]
            parts.append(msg["text"])
            if limit is not None and len(parts) >= limit:
                return "".join(parts), cursor, None
        elif msg["op"] == "done":
            assert msg["cursor"] >= cursor
            return "".join(parts), msg["cursor"], msg
        else:
            raise AssertionError(msg)


async def reference(d: Daemon, body: dict[str, Any]) -> str:
    async with d.client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        return stream_text(await sse_events(r))


async def test_ws_generate_follows_to_done(nursery: trio.Nursery) -> None:
    d = await start_daemon(nursery, mock_config())
    ref = await reference(d, CHAT)
    with trio.fail_after(20):
        async with open_websocket_url(ws_url(d)) as ws:
            await put(ws, op="generate", id="a", body=CHAT)
            started = await expect(ws, "started")
            assert started["id"] == "a" and started["model"] == "mock" and started["resumable"] is False
            text, cursor, done = await follow(ws, started["session"])
            assert text == ref
            assert done is not None and done["finish_reason"] == "length"
            assert cursor == done["usage"]["completion_tokens"] == CHAT["max_tokens"]
            # the socket goes on: a second generation on the same socket
            await put(ws, op="generate", body={**CHAT, "max_tokens": 5})
            again = await expect(ws, "started")
            assert "id" not in again and again["session"] != started["session"]
            _text, _cursor, done = await follow(ws, again["session"])
            assert done is not None and done["usage"]["completion_tokens"] == 5
    d.scope.cancel()


async def test_ws_subscribe_from_a_cursor_after_reconnect(nursery: trio.Nursery) -> None:
    d = await start_daemon(nursery, mock_config("mock?step_ms=5&prefill_us=5", agent_stream_interval_ms=40))
    ref = await reference(d, CHAT)
    with trio.fail_after(30):
        async with open_websocket_url(ws_url(d)) as ws:
            await put(ws, op="generate", body=CHAT, resumable=True)
            sid = (await expect(ws, "started"))["session"]
            head, cursor, done = await follow(ws, sid, limit=8)
        assert done is None and 0 < cursor < CHAT["max_tokens"]
        await trio.sleep(0.2)  # the generation runs on with nobody following
        info = (await d.client.get(f"/v1/sessions/{sid}")).json()
        assert info["generating"] and info["completion_tokens"] > cursor and info["followers"] == 0
        async with open_websocket_url(ws_url(d)) as ws:
            await put(ws, op="subscribe", id=7, session=sid, after=cursor)
            ack = await expect(ws, "subscribed")
            assert ack == {"op": "subscribed", "session": sid, "cursor": cursor, "id": 7}
            tail, _cursor, done = await follow(ws, sid)
            assert done is not None and done["finish_reason"] == "length"
            assert head + tail == ref
            # a finished session replays whole from cursor 0
            await put(ws, op="subscribe", session=sid, after=0)
            await expect(ws, "subscribed")
            whole, _cursor, _done = await follow(ws, sid)
            assert whole == ref
            await put(ws, op="get", id="g", session=sid)
            got = await expect(ws, "session")
            assert got["id"] == "g" and got["session"]["text"] == ref and not got["session"]["generating"]
    d.scope.cancel()


async def test_ws_cancel_and_unsubscribe(nursery: trio.Nursery) -> None:
    d = await start_daemon(nursery, mock_config("mock?step_ms=5&prefill_us=5"))
    long = {**CHAT, "max_tokens": 100000}
    with trio.fail_after(20):
        async with open_websocket_url(ws_url(d)) as ws:
            await put(ws, op="generate", body=long, resumable=True)
            a = (await expect(ws, "started"))["session"]
            await put(ws, op="generate", body=long, resumable=True)
            while (msg := await get(ws))["op"] != "started":
                assert msg["session"] == a  # a's deltas go on meanwhile
            b = msg["session"]
            # unsubscribe b: an ack, and nothing of b after it
            await put(ws, op="unsubscribe", session=b)
            while (msg := await get(ws))["op"] != "unsubscribed":
                pass
            assert msg["session"] == b
            await put(ws, op="cancel", id=1, session=a)
            seen_cancelled = False
            while True:
                msg = await get(ws)
                assert msg.get("session") == a, msg  # b sends nothing more
                if msg["op"] == "cancelled":
                    seen_cancelled = True
                elif msg["op"] == "done":
                    assert msg["finish_reason"] == "cancelled"
                    break
            assert seen_cancelled
            await put(ws, op="cancel", session=a)
            err = await expect(ws, "error")
            assert err["error"]["code"] == "no_generation" and err["session"] == a
            await put(ws, op="unsubscribe", session=a)
            assert (await expect(ws, "error"))["error"]["code"] == "not_subscribed"
            assert (await d.client.get(f"/v1/sessions/{b}")).json()["generating"]
            await put(ws, op="cancel", session=b)
            assert (await expect(ws, "cancelled"))["session"] == b
    d.scope.cancel()


async def test_ws_close_cancels_only_non_resumable(nursery: trio.Nursery) -> None:
    d = await start_daemon(nursery, mock_config("mock?step_ms=5&prefill_us=5"))
    long = {**CHAT, "max_tokens": 100000}
    with trio.fail_after(20):
        async with open_websocket_url(ws_url(d)) as ws:
            await put(ws, op="generate", id="keep", body=long, resumable=True)
            await put(ws, op="generate", id="drop", body=long)
            started = {}
            while len(started) < 2:
                msg = await get(ws)
                if msg["op"] == "started":
                    started[msg["id"]] = msg["session"]
        while (await d.client.get(f"/v1/sessions/{started['drop']}")).json()["generating"]:
            await trio.sleep(0.02)
        assert (await d.client.get(f"/v1/sessions/{started['drop']}")).json()["finish_reason"] == "cancelled"
        keep = (await d.client.get(f"/v1/sessions/{started['keep']}")).json()
        assert keep["generating"] and keep["followers"] == 0
        assert (await d.client.delete(f"/v1/sessions/{started['keep']}/generation")).status_code == 200
    d.scope.cancel()


async def test_ws_second_generate_and_second_subscribe_are_refused(nursery: trio.Nursery) -> None:
    # a client names a session only when keys are configured (tests/test_security_tenancy.py)
    keys = (ApiKey.from_secret("t", "kt"),)
    d = await start_daemon(nursery, attrs.evolve(mock_config("mock?step_ms=5&prefill_us=5"), api_keys=keys))
    long = {**CHAT, "max_tokens": 100000}
    auth = [("authorization", "Bearer kt")]
    with trio.fail_after(20):
        async with open_websocket_url(ws_url(d), extra_headers=auth) as ws, \
                open_websocket_url(ws_url(d), extra_headers=auth) as other:
            await put(ws, op="generate", body=long, resumable=True, session="story-1")
            assert (await expect(ws, "started"))["session"] == "story-1"
            # from another socket too
            await put(other, op="generate", id="x", body=long, session="story-1")
            err = await expect(other, "error")
            assert err["id"] == "x" and err["error"]["code"] == "session_busy" and "story-1" in err["error"]["message"]
            await put(other, op="subscribe", session="story-1", after=0)
            await expect(other, "subscribed")
            await put(other, op="subscribe", session="story-1", after=0)
            while (msg := await get(other))["op"] != "error":
                assert msg["op"] == "delta"
            assert msg["error"]["code"] == "already_subscribed"
            await put(ws, op="cancel", session="story-1")
            while (msg := await get(ws))["op"] != "done":
                pass
            await put(ws, op="generate", body=long, session="story-1")
            while (msg := await get(ws))["op"] != "error":
                pass
            assert msg["error"]["code"] == "session_exists"
            await put(ws, op="generate", body={**CHAT, "max_tokens": 3}, session="bad id!")
            while (msg := await get(ws))["op"] != "error":
                pass
            assert msg["error"]["param"] == "session"
    d.scope.cancel()


async def test_ws_malformed_messages_are_errors_and_the_socket_stays(nursery: trio.Nursery) -> None:
    d = await start_daemon(nursery, mock_config())
    with trio.fail_after(20):
        async with open_websocket_url(ws_url(d)) as ws:
            await ws.send_message("{not json")
            assert (await expect(ws, "error"))["error"]["code"] == "invalid_message"
            await ws.send_message(b"\xff\xfe")
            assert (await expect(ws, "error"))["error"]["code"] == "invalid_message"
            await put(ws, op="dance", id=3)
            err = await expect(ws, "error")
            assert err["id"] == 3 and err["error"]["code"] == "unknown_op"
            await ws.send_message("[1, 2]")
            assert (await expect(ws, "error"))["error"]["code"] == "invalid_message"
            await put(ws, op="subscribe", session="nope")
            assert (await expect(ws, "error"))["error"]["code"] == "session_not_found"
            await put(ws, op="generate", body={"model": "mock"})
            assert (await expect(ws, "error"))["error"]["param"] == "messages"
            await put(ws, op="generate", body={**CHAT, "model": "absent"})
            assert (await expect(ws, "error"))["error"]["code"] == "model_not_found"
            await put(ws, op="generate", body=CHAT, resumable="yes")
            assert (await expect(ws, "error"))["error"]["param"] == "resumable"
            await put(ws, op="generate", body={**CHAT, "max_tokens": 4})
            sid = (await expect(ws, "started"))["session"]
            _text, _cursor, done = await follow(ws, sid)
            assert done is not None
    d.scope.cancel()


async def test_ws_oversized_message_closes_with_1009(nursery: trio.Nursery) -> None:
    d = await start_daemon(nursery, mock_config())
    with trio.fail_after(20):
        async with open_websocket_url(ws_url(d)) as ws:
            await put(ws, op="get", session="nope")
            await expect(ws, "error")
            await ws.send_message("x" * (_ws.LIMITS.max_message + 1))
            with pytest.raises(ConnectionClosed) as info:
                await ws.get_message()
            assert info.value.reason.code == 1009
    d.scope.cancel()


async def test_ws_other_paths_are_refused(nursery: trio.Nursery) -> None:
    from trio_websocket import HandshakeError

    d = await start_daemon(nursery, mock_config())
    with trio.fail_after(20), pytest.raises(HandshakeError):
        async with open_websocket_url(d.url.replace("http://", "ws://") + "/v1/other"):
            pass
    d.scope.cancel()


async def test_ws_a_client_that_does_not_read_is_closed_with_1008(nursery: trio.Nursery,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The outbox is bounded: a socket whose client stops reading stops its
    followers after ``send_stall_s`` and closes with 1008; nothing buffers
    without bound, and the resumable generation it followed goes on."""
    monkeypatch.setattr(_ws, "LIMITS", attrs.evolve(_ws.LIMITS, outbox=4, send_stall_s=0.5))
    d = await start_daemon(nursery, mock_config("mock?step_ms=0.05&prefill_us=1"))
    async with d.client.stream("POST", "/v1/chat/completions", json={**CHAT, "max_tokens": 4000, "stream": True},
                               headers={"x-superfluid-resumable": "true"}) as r:
        big_sid = r.headers["x-superfluid-session"]
        await r.aread()
    with trio.fail_after(60):
        async with open_websocket_url(ws_url(d), message_queue_size=1, max_message_size=1 << 22) as ws:
            await put(ws, op="generate", body={**CHAT, "max_tokens": 100000}, resumable=True)
            live = (await expect(ws, "started"))["session"]
            for _ in range(600):  # each reply carries ~20 KB: more than the socket buffers hold
                await put(ws, op="get", session=big_sid)
            while (await d.client.get(f"/v1/sessions/{live}")).json()["followers"]:
                await trio.sleep(0.05)  # the server gave up on this client while it still reads nothing
            n = 0
            with pytest.raises(ConnectionClosed) as info:
                while True:
                    await ws.get_message()
                    n += 1
            assert info.value.reason.code == 1008
            assert n < 600
        assert (await d.client.get(f"/v1/sessions/{live}")).json()["generating"]
        assert (await d.client.delete(f"/v1/sessions/{live}/generation")).status_code == 200
    d.scope.cancel()
