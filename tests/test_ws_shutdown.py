"""A daemon shutdown and a WebSocket's own life (SPEC.md §2 "Daemon shutdown").

``Stopping.begin()`` runs in the daemon's stop task. It must never raise,
spawn or wait because of a socket: each socket waits for the shutdown in a
task of its own nursery and closes itself (1001). The first test is the
review's reproduction (code-review.md §2.4 D4): a shutdown that began just as
a socket's nursery had closed raised ``RuntimeError('Nursery is closed to new
arrivals')`` out of ``begin()``, failing the daemon's exit.
"""

from __future__ import annotations

import types
from typing import Any

import trio
from trio.testing import wait_all_tasks_blocked

from superfluid.api._lifecycle import Stopping
from superfluid.api._ws import LIMITS, _Socket


def _socket(stopping: Stopping) -> tuple[_Socket, list[dict[str, Any]]]:
    app = types.SimpleNamespace(stopping=stopping, config=types.SimpleNamespace(ws_idle_timeout_s=300.0))
    sent: list[dict[str, Any]] = []

    async def send(msg: dict[str, Any]) -> None:
        sent.append(msg)
        await trio.lowlevel.checkpoint()

    return _Socket(app, {}, send, LIMITS), sent  # type: ignore[arg-type]


async def _gone() -> dict[str, Any]:
    await trio.lowlevel.checkpoint()
    return {"type": "websocket.disconnect"}


async def test_a_shutdown_beginning_as_a_socket_closes_does_not_raise() -> None:
    for _ in range(20):
        stopping = Stopping()
        sock, _sent = _socket(stopping)
        errors: list[BaseException] = []
        hit: list[bool] = []

        async def shutdown_at_the_wrong_moment(sock: _Socket = sock, stopping: Stopping = stopping,
                                               errors: list[BaseException] = errors,
                                               hit: list[bool] = hit) -> None:
            while True:
                work = sock._work
                if work is not None and work._closed:  # the socket's nursery just closed
                    hit.append(True)
                    try:
                        stopping.begin()  # what daemon/_server.stop calls
                    except Exception as exc:  # noqa: BLE001 - the finding: it raised here
                        errors.append(exc)
                    return
                await trio.lowlevel.checkpoint()

        with trio.fail_after(5):
            async with trio.open_nursery() as n:
                n.start_soon(shutdown_at_the_wrong_moment)
                n.start_soon(sock.run, _gone)
        assert hit, "the shutdown never landed in the window"
        assert errors == []


async def test_a_shutdown_at_any_moment_of_a_closing_socket_ends_it_cleanly() -> None:
    """Every schedule point of a socket's close, one shutdown each: begin() never raises,
    and the socket ends (with a 1001 close frame when the shutdown came first)."""
    for k in range(40):
        stopping = Stopping()
        sock, sent = _socket(stopping)
        reads = 0

        async def receive() -> dict[str, Any]:
            nonlocal reads
            reads += 1
            for _ in range(3):
                await trio.lowlevel.checkpoint()
            return {"type": "websocket.disconnect"}

        async def shutdown_after(k: int = k, stopping: Stopping = stopping) -> None:
            for _ in range(k):
                await trio.lowlevel.checkpoint()
            stopping.begin()

        with trio.fail_after(5):
            async with trio.open_nursery() as n:
                n.start_soon(sock.run, receive)
                n.start_soon(shutdown_after)
        assert stopping.started
        closes = [m for m in sent if m["type"] == "websocket.close"]
        assert closes in ([], [{"type": "websocket.close", "code": 1001, "reason": "the server is shutting down"}])


async def test_a_shutdown_closes_an_open_socket_with_1001_from_its_own_task() -> None:
    stopping = Stopping()
    sock, sent = _socket(stopping)
    peer_closed = trio.Event()

    async def receive() -> dict[str, Any]:
        await peer_closed.wait()  # the client sends nothing until it sees our close frame
        return {"type": "websocket.disconnect"}

    async def send(msg: dict[str, Any]) -> None:
        sent.append(msg)
        if msg["type"] == "websocket.close":
            peer_closed.set()
        await trio.lowlevel.checkpoint()

    sock.send = send
    with trio.fail_after(5):
        async with trio.open_nursery() as n:
            n.start_soon(sock.run, receive)
            await wait_all_tasks_blocked()
            stopping.begin()  # only sets an event: the socket's own task closes it
    assert sent == [{"type": "websocket.close", "code": 1001, "reason": "the server is shutting down"}]
