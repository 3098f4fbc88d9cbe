"""The head's side of the fleet: nodes' links in, each handed to its node's actor.

Nodes reach the head two ways, and both end in :meth:`Attach` (the registry's
``attach_node``): a node dials the head's ``--fleet-listen`` address
(:func:`serve_fleet_listener`), or the head dials ``--fleet HOST:PORT,...``
(:func:`dial_nodes`, every ``RETRY_S`` while a node is unreachable). Either way
the link is authenticated and encrypted before a byte of it is read
(``fleet/_channel.py``), the node says who it is (:class:`NodeHello`), and the
link goes to that node's :class:`NodeSource`, where the node's model actor
takes it as its next worker. The task that accepted or dialled the link waits
until the actor is done with it (``conn.closed``): the link's socket belongs to
the connection's task, as trio's listeners want it.

Nursery tree (in the daemon's root nursery)::

    fleet listener      trio.serve_tcp -> one task per node link: handshake, hello, attach, wait for its end
    fleet dialer × N    per --fleet address: dial, handshake, hello, attach, wait for its end, dial again
    mdns advertiser     (--fleet-listen) _superfluid-fleet._tcp, so `node join` needs no address
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from functools import partial
from typing import TYPE_CHECKING, Any

import trio

from ._channel import Channel, ChannelLost, HandshakeFailed, handshake
from ._remote import NodeConnection, open_remote_worker, read_hello

if TYPE_CHECKING:
    from ..sched import Scheduler
    from ..serving._placement import FleetGroup

__all__ = ["Attach", "NodeSource", "dial_nodes", "serve_fleet_listener"]

log = logging.getLogger("superfluid.fleet")
RETRY_S = 10.0          # an unreachable --fleet node is dialled again after this long
REDIAL_S = 1.0          # after a link that served ends
MAX_HANDSHAKES = 64     # links authenticating at once (each has --handshake timeout); more are closed at once
Attach = Callable[[NodeConnection], Awaitable[str]]   # "" when the node's actor took the link, else why not


class NodeSource:
    """One node's links, for its actor (:class:`~superfluid.nursery.RemoteSource`).

    A newer link replaces one the actor still holds (the node dialled again, so the
    old one is dead whatever the head's side of it thinks): the old channel is
    aborted, and the actor moves on to the new one."""

    def __init__(self, identity: str, group: FleetGroup, *, start_timeout_s: float) -> None:
        self.identity = identity
        self.group = group
        self.start_timeout_s = start_timeout_s
        self._waiting: NodeConnection | None = None
        self._current: NodeConnection | None = None
        self._arrived = trio.Event()

    def offer(self, conn: NodeConnection) -> None:
        for old in (self._waiting, self._current):
            if old is not None:
                old.channel.abort()
                old.closed.set()
        self._waiting = conn
        self._arrived.set()

    async def connection(self) -> NodeConnection:
        while self._waiting is None:
            self._arrived = trio.Event()
            await self._arrived.wait()
        conn, self._waiting = self._waiting, None
        self._current = conn
        return conn

    def open(self, conn: NodeConnection, deliver: Callable[[int, Any], Awaitable[None]], *,
             generation: int) -> AbstractAsyncContextManager[Any]:
        return open_remote_worker(conn, deliver, generation=generation, start_timeout_s=self.start_timeout_s)

    def describe(self, conn: NodeConnection) -> str:
        return f"{conn.hello.identity} at {conn.address}"

    def up(self) -> None:
        self.group.up()

    def shed(self, scheduler: Scheduler) -> None:
        self.group.shed(scheduler)


def _address(stream: trio.abc.Stream) -> str:
    try:
        host, port, *_ = stream.socket.getpeername()  # type: ignore[attr-defined]
    except (AttributeError, OSError, ValueError):
        return "?"
    return f"{host}:{port}"


async def _attach(channel: Channel, address: str, attach: Attach) -> NodeConnection | None:
    try:
        hello = await read_hello(channel)
    except (ChannelLost, ValueError) as exc:
        log.warning("fleet: link from %s dropped before its hello: %s", address, exc)
        await channel.aclose()
        return None
    conn = NodeConnection(channel=channel, hello=hello, address=address)
    refusal = await attach(conn)
    if refusal:
        log.warning("fleet: node %s at %s refused: %s", hello.identity, address, refusal)
        await conn.refuse(refusal)
        return None
    return conn


async def _serve_link(stream: trio.abc.Stream, *, key: bytes | None, attach: Attach, lease_s: float,
                      handshake_timeout_s: float, handshakes: trio.CapacityLimiter) -> None:
    address = _address(stream)
    try:
        handshakes.acquire_nowait()
    except trio.WouldBlock:   # a flood of connections that never authenticate: each costs nothing
        log.warning("fleet: link from %s closed: %d handshakes are under way", address, handshakes.total_tokens)
        return
    try:
        channel = await handshake(stream, key, initiator=False, lease_s=lease_s, timeout_s=handshake_timeout_s)
    except HandshakeFailed as exc:
        log.warning("fleet: link from %s refused at the handshake: %s", address, exc)
        return
    finally:
        handshakes.release()
    conn = await _attach(channel, address, attach)
    if conn is not None:
        await conn.closed.wait()


async def serve_fleet_listener(host: str, port: int, *, key: bytes | None, attach: Attach, lease_s: float,
                               handshake_timeout_s: float = 10.0,
                               task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
    """Take nodes' links on ``host:port`` until cancelled; ``task_status`` gets the bound port."""
    listeners = await trio.open_tcp_listeners(port, host=host or None)
    bound = listeners[0].socket.getsockname()[1]
    log.info("fleet: nodes join at %s:%d (%s)", host, bound, "encrypted, token required" if key else
             "encrypted, NO authentication (--insecure-no-auth)")
    handler = partial(_serve_link, key=key, attach=attach, lease_s=lease_s, handshake_timeout_s=handshake_timeout_s,
                      handshakes=trio.CapacityLimiter(MAX_HANDSHAKES))
    await trio.serve_listeners(handler, listeners, task_status=_Started(task_status, bound))


class _Started:
    """``task_status`` for ``serve_listeners`` that reports the bound port instead."""

    def __init__(self, status: trio.TaskStatus[int], port: int) -> None:
        self._status, self._port = status, port

    def started(self, _value: object = None) -> None:
        self._status.started(self._port)


async def dial_nodes(addresses: list[tuple[str, int]], *, key: bytes | None, attach: Attach, lease_s: float,
                     handshake_timeout_s: float = 10.0, retry_s: float = RETRY_S,
                     task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Keep a link to each ``--fleet`` node: dial, and dial again when it ends."""
    async with trio.open_nursery() as nursery:
        for host, port in addresses:
            nursery.start_soon(partial(_dial_forever, host, port, key=key, attach=attach, lease_s=lease_s,
                                       handshake_timeout_s=handshake_timeout_s, retry_s=retry_s))
        task_status.started()


async def _dial_forever(host: str, port: int, *, key: bytes | None, attach: Attach, lease_s: float,
                        handshake_timeout_s: float, retry_s: float) -> None:
    address = f"{host}:{port}"
    while True:
        served = False
        try:
            async with _dial(host, port, key, lease_s, handshake_timeout_s) as channel:
                conn = await _attach(channel, address, attach)
                if conn is not None:
                    served = True
                    await conn.closed.wait()
                    log.info("fleet: link to node %s at %s ended; dialling again", conn.hello.identity, address)
        except (OSError, HandshakeFailed, trio.TooSlowError) as exc:
            log.warning("fleet: node %s unreachable (%s); trying again in %gs", address, exc, retry_s)
        await trio.sleep(REDIAL_S if served else retry_s)


@asynccontextmanager
async def _dial(host: str, port: int, key: bytes | None, lease_s: float,
                handshake_timeout_s: float) -> AsyncIterator[Channel]:
    with trio.fail_after(handshake_timeout_s):
        stream = await trio.open_tcp_stream(host, port)
    try:
        channel = await handshake(stream, key, initiator=True, lease_s=lease_s, timeout_s=handshake_timeout_s)
    except BaseException:
        await trio.aclose_forcefully(stream)
        raise
    try:
        yield channel
    finally:
        channel.abort()
