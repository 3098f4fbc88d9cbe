"""``superfluid.client``: a resumable chat stream survives dropped connections
and a daemon SIGKILL + restart, with text equal to an uninterrupted run."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
import trio

from superfluid.client import ChatStreamError, ResumePolicy, StreamLost, open_chat_stream, stream_chat

from .conftest import Daemon, mock_config, sse_events, start_daemon, stream_text
from .test_sessions import _free_port, _reap, _spawn, _wait_ready

CHAT = {"model": "mock", "messages": [{"role": "user", "content": "tell me a long story"}], "temperature": 0,
        "max_tokens": 150, "ignore_eos": True}


class CuttingProxy:
    """A TCP proxy to the daemon that cuts its k-th connection after ``cuts[k]``
    bytes from the server (mid-event, on purpose); later connections pass whole."""

    def __init__(self, port: int, cuts: list[int]) -> None:
        self.port = port
        self.cuts = cuts
        self.connections = 0

    async def serve(self, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        task_status.started(f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}")
        await trio.serve_listeners(self._handle, listeners)

    async def _handle(self, client: trio.SocketStream) -> None:
        k, self.connections = self.connections, self.connections + 1
        cut = self.cuts[k] if k < len(self.cuts) else None
        async with client, await trio.open_tcp_stream("127.0.0.1", self.port) as upstream, \
                trio.open_nursery() as nursery:

            async def up() -> None:
                async for chunk in client:
                    await upstream.send_all(chunk)

            async def down() -> None:
                sent = 0
                async for chunk in upstream:
                    if cut is not None and sent + len(chunk) >= cut:
                        await client.send_all(chunk[: cut - sent])
                        nursery.cancel_scope.cancel()  # both sockets close: the client sees EOF mid-stream
                        return
                    sent += len(chunk)
                    await client.send_all(chunk)
                nursery.cancel_scope.cancel()

            nursery.start_soon(up)
            nursery.start_soon(down)


async def reference(d: Daemon, body: dict[str, Any]) -> str:
    async with d.client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        return stream_text(await sse_events(r))


async def test_trio_client_resumes_across_dropped_connections(nursery: trio.Nursery) -> None:
    d = await start_daemon(nursery, mock_config("mock?step_ms=3&prefill_us=5", agent_stream_interval_ms=40))
    ref = await reference(d, CHAT)
    proxy = CuttingProxy(int(d.url.rsplit(":", 1)[1]), cuts=[1500, 2500])
    url = await nursery.start(proxy.serve)
    with trio.fail_after(30):
        async with open_chat_stream(url, CHAT) as stream:
            deltas = [delta async for delta in stream]
    assert "".join(deltas) == ref
    assert stream.reconnects == 2 and proxy.connections == 3
    assert stream.session_id and stream.finish_reason == "length"
    assert stream.usage is not None and stream.usage["completion_tokens"] == CHAT["max_tokens"]
    d.scope.cancel()


async def test_sync_client_resumes_across_a_dropped_connection(nursery: trio.Nursery) -> None:
    d = await start_daemon(nursery, mock_config("mock?step_ms=3&prefill_us=5"))
    ref = await reference(d, CHAT)
    proxy = CuttingProxy(int(d.url.rsplit(":", 1)[1]), cuts=[2000])
    url = await nursery.start(proxy.serve)

    def run() -> tuple[str, int, str | None]:
        with stream_chat(url, CHAT) as stream:
            text = "".join(stream)
        return text, stream.reconnects, stream.session_id

    with trio.fail_after(30):
        text, reconnects, sid = await trio.to_thread.run_sync(run)
    assert text == ref and reconnects == 1 and sid
    d.scope.cancel()


async def test_client_gives_up_after_bounded_attempts_and_reports_typed_errors(nursery: trio.Nursery) -> None:
    nowhere = f"http://127.0.0.1:{_free_port()}"
    policy = ResumePolicy(attempts=3, initial_s=0.01)
    with trio.fail_after(10):
        with pytest.raises(StreamLost, match="3 reconnects"):
            async with open_chat_stream(nowhere, CHAT, policy=policy) as stream:
                [_ async for _ in stream]
    d = await start_daemon(nursery, mock_config())
    with trio.fail_after(10):
        with pytest.raises(ChatStreamError) as info:
            async with open_chat_stream(d.url, {**CHAT, "model": "absent"}) as stream:
                [_ async for _ in stream]
        assert info.value.status == 404 and info.value.code == "model_not_found"
        with pytest.raises(StreamLost) as lost:
            async with open_chat_stream(d.url, session="s-unknown", policy=policy) as stream:
                [_ async for _ in stream]
        assert lost.value.status == 404
    d.scope.cancel()


async def test_client_stream_survives_a_daemon_sigkill_and_restart(tmp_path: Path) -> None:
    """SIGKILL the daemon's process group mid-reply and restart it on the same
    sessions dir: the same client stream finishes, nothing repeated."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    sessions = tmp_path / "sessions"
    log = tmp_path / "daemon.log"
    proc = _spawn(port, sessions, log)
    try:
        await _wait_ready(url, proc)
        with trio.fail_after(90):
            async with open_chat_stream(url, CHAT) as stream:
                ref = "".join([d async for d in stream])
            deltas: list[str] = []
            async with open_chat_stream(url, CHAT) as stream:
                async for delta in stream:
                    deltas.append(delta)
                    if len(deltas) == 15:
                        os.killpg(proc.pid, signal.SIGKILL)
                        proc.wait()
                        proc = _spawn(port, sessions, log)  # the stream reconnects while it comes back
        assert "".join(deltas) == ref
        assert stream.reconnects >= 1
    finally:
        _reap(proc)
