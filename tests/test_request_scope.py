"""One cancel scope per HTTP request, cancelled when the client disconnects
(``api/_lifecycle.py``, ``open_request``; SPEC.md §2 "Client disconnects").

hypercorn never cancels the app: it only queues ``http.disconnect``. The
request's watcher reads it from the moment the body has been read, so a
client that leaves before its lane opens (during a model load or a tokenize)
costs nothing more.
"""

from __future__ import annotations

from typing import Any

import pytest
import trio
from trio.testing import wait_all_tasks_blocked

from superfluid.api import _lane
from superfluid.api._http import ApiError, ClientGone, read_body
from superfluid.api._lifecycle import open_request

from .conftest import mock_config, start_daemon

DISCONNECT = {"type": "http.disconnect"}


class Peer:
    """An ASGI receive fed by the test; it counts concurrent readers (at most one is allowed)."""

    def __init__(self) -> None:
        self.send, self.recv = trio.open_memory_channel[dict[str, Any]](16)
        self.readers = 0

    async def receive(self) -> dict[str, Any]:
        self.readers += 1
        assert self.readers == 1, "two tasks read the connection at once"
        try:
            return await self.recv.receive()
        finally:
            self.readers -= 1


def body(data: bytes, more: bool = False) -> dict[str, Any]:
    return {"type": "http.request", "body": data, "more_body": more}


async def test_a_request_without_a_body_is_cancelled_when_its_client_leaves() -> None:
    peer = Peer()
    peer.send.send_nowait(body(b""))
    async with open_request(peer.receive) as request:
        await wait_all_tasks_blocked()
        peer.send.send_nowait(DISCONNECT)
        await trio.sleep_forever()  # a handler waiting on something else (a load, a tokenize)
    assert request.gone and request.scope.cancelled_caught


async def test_the_body_is_read_in_order_and_the_watch_starts_after_it() -> None:
    peer = Peer()
    for msg in (body(b"ab", True), body(b"cd", True), body(b"ef")):
        peer.send.send_nowait(msg)
    scope = {"headers": []}
    async with open_request(peer.receive) as request:
        await wait_all_tasks_blocked()  # the watcher took the first chunk for the handler, and stopped
        assert await read_body(scope, request.receive) == b"abcdef"
        await wait_all_tasks_blocked()
        assert not request.gone
        peer.send.send_nowait(DISCONNECT)
        await trio.sleep_forever()
    assert request.gone and request.scope.cancelled_caught


async def test_a_client_gone_while_its_body_arrives_and_errors_come_out_unwrapped() -> None:
    peer = Peer()
    peer.send.send_nowait(body(b"ab", True))
    peer.send.send_nowait(DISCONNECT)
    with pytest.raises(ClientGone):
        async with open_request(peer.receive) as request:
            await read_body({"headers": []}, request.receive)
    peer = Peer()
    peer.send.send_nowait(body(b""))
    with pytest.raises(ApiError):  # not an ExceptionGroup: App._exchange answers it typed
        async with open_request(peer.receive):
            raise ApiError(400, "refused")


async def test_a_client_that_leaves_during_a_tokenize_costs_nothing_more(nursery: trio.Nursery,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The tokenize (a model load alike) is cancelled: no lane, no session logged, no generation."""
    entered, cancelled = trio.Event(), trio.Event()

    async def stuck_tokenize(*_args: Any, **_kw: Any) -> list[int]:
        entered.set()
        try:
            await trio.sleep_forever()
        except trio.Cancelled:
            cancelled.set()
            raise
        raise AssertionError("unreachable")

    monkeypatch.setattr(_lane, "tokenize", stuck_tokenize)
    d = await start_daemon(nursery, mock_config())
    chat = {"model": "mock", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50}
    with trio.fail_after(10):
        for headers in ({}, {"x-superfluid-resumable": "true"}):
            entered, cancelled = trio.Event(), trio.Event()
            async with trio.open_nursery() as n:
                async def post(headers: dict[str, str] = headers) -> None:
                    await d.client.post("/v1/chat/completions", json={**chat, "stream": True}, headers=headers)

                n.start_soon(post)
                await entered.wait()
                n.cancel_scope.cancel()  # the client goes away mid-tokenize
            await cancelled.wait()
    listed = (await d.client.get("/v1/sessions")).json()["data"]
    assert listed == []  # nothing was logged
    d.scope.cancel()


async def test_a_request_stuck_where_no_helper_watches_ends_503_on_shutdown(
        nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch) -> None:
    """A wait that is not one of the lifecycle's helpers (here a tokenize that never answers) still
    ends when the daemon stops: the request's own scope is cancelled by the shutdown's deadline and
    the request is answered 503 server_shutting_down, well before --shutdown-grace cancels the root."""
    from superfluid.daemon._server import stop

    entered = trio.Event()

    async def stuck_tokenize(*_args: Any, **_kw: Any) -> list[int]:
        entered.set()
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    monkeypatch.setattr(_lane, "tokenize", stuck_tokenize)
    d = await start_daemon(nursery, mock_config())
    chat = {"model": "mock", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
    answer: list[Any] = []

    async def post() -> None:
        answer.append(await d.client.post("/v1/chat/completions", json=chat))

    async with trio.open_nursery() as n:
        n.start_soon(post)
        with trio.fail_after(10):
            await entered.wait()
        apps = [app for app in _apps() if app.stopping.inflight]
        assert len(apps) == 1
        root = trio.CancelScope()
        began = trio.current_time()
        with root, trio.fail_after(10):
            await stop(root, apps, grace_s=30.0)
    [r] = answer
    assert r.status_code == 503 and r.json()["error"]["code"] == "server_shutting_down", r.text
    assert trio.current_time() - began < 5.0  # the backstop's second, not the 30 s grace
    d.scope.cancel()


def _apps() -> list[Any]:
    import gc

    from superfluid.api import App

    return [o for o in gc.get_objects() if isinstance(o, App)]
