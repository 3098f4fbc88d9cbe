"""A fleet node's worker, as the head's model actor sees it.

A node (``fleet/_node.py``) relays one worker process's link over an encrypted
channel (``fleet/_channel.py``), byte for byte: the worker link of SPEC.md §3 runs
end to end between the head's actor and the node's worker, framing, state table
and all. So the head needs no second protocol: :func:`open_remote_worker` is
:func:`~superfluid.nursery.open_worker` with a channel where the pipes were, and
a lost channel (EOF, a lease that ran out, a record that does not decrypt) is a
dead worker (:class:`~superfluid.nursery.WorkerDied`), which the actor already
knows how to survive.

Nursery tree inside ``open_remote_worker``::

    remote worker nursery
    ├── keepalive          a record every lease/3 while the actor sends nothing (the node's lease)
    └── reader             channel -> WorkerLink -> the actor's worker-event channel (bounded)
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import attrs
import msgpack
import trio

from ..nursery import WorkerDied, WorkerHandle, WorkerLoadFailed, raise_one_failure
from ..proto import DAEMON, NEED_DATA, Event, Hello, HelloAck, LoadFailed, ProtocolError, Shutdown, WorkerLink
from ._channel import Channel, ChannelLost

__all__ = ["NodeConnection", "NodeHello", "RemoteWorker", "open_remote_worker", "read_hello", "send_hello"]

log = logging.getLogger("superfluid.fleet")
Deliver = Callable[[int, Any], Awaitable[None]]
HELLO_VERSION = 1
MAX_HELLO = 4096


@attrs.frozen(kw_only=True)
class NodeHello:
    """What a node says of itself after the handshake (its first record)."""

    identity: str      # stable while the node process lives: a re-dial is the same node
    model: str         # the name the head serves its model under
    runtime: str
    lanes: int
    n_ctx: int

    def to_wire(self) -> bytes:
        return msgpack.packb({"v": HELLO_VERSION, **attrs.asdict(self)})

    @classmethod
    def from_wire(cls, data: bytes) -> NodeHello:
        """Raises ValueError: not a node hello of this version."""
        try:
            obj = msgpack.unpackb(data)
        except Exception as exc:  # noqa: BLE001 - msgpack raises several types for garbage
            raise ValueError(f"undecodable node hello: {exc}") from None
        if not isinstance(obj, dict) or obj.get("v") != HELLO_VERSION:
            raise ValueError(f"not a version {HELLO_VERSION} node hello")
        try:
            hello = cls(identity=str(obj["identity"]), model=str(obj["model"]), runtime=str(obj["runtime"]),
                        lanes=int(obj["lanes"]), n_ctx=int(obj["n_ctx"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed node hello: {exc!r}") from None
        if not hello.identity or not hello.model or len(hello.identity) > 200 or len(hello.model) > 200:
            raise ValueError("malformed node hello: empty or overlong identity or model")
        return hello


async def send_hello(channel: Channel, hello: NodeHello) -> str:
    """The node's side: send ``hello``; returns the head's refusal ("" when accepted).

    Raises:
        ChannelLost: the channel ended first.
    """
    await channel.send_all(hello.to_wire())
    answer = await channel.receive_some()
    if not answer:
        raise ChannelLost("the head closed the link after the hello")
    try:
        obj = msgpack.unpackb(answer)
    except Exception:  # noqa: BLE001
        raise ChannelLost("undecodable answer to the node hello") from None
    return "" if obj.get("ok") else str(obj.get("error", "refused"))


async def read_hello(channel: Channel) -> NodeHello:
    """The head's side: the node's hello (not yet answered: :meth:`NodeConnection.accept`).

    Raises:
        ChannelLost, ValueError.
    """
    data = await channel.receive_some()
    if not data:
        raise ChannelLost("the node closed the link before its hello")
    if len(data) > MAX_HELLO:
        raise ValueError(f"node hello of {len(data)} bytes (at most {MAX_HELLO})")
    return NodeHello.from_wire(data)


@attrs.define(eq=False)
class NodeConnection:
    """One authenticated link to a node, handed to that node's actor; ``closed`` is set
    when the actor is done with it (its dialer, if the head dialled, dials again)."""

    channel: Channel
    hello: NodeHello
    address: str
    closed: trio.Event = attrs.field(factory=trio.Event)

    async def accept(self) -> None:
        await self.channel.send_all(msgpack.packb({"ok": True}))

    async def refuse(self, why: str) -> None:
        with trio.move_on_after(1):
            try:
                await self.channel.send_all(msgpack.packb({"ok": False, "error": why}))
            except ChannelLost:
                pass
        await self.channel.aclose()
        self.closed.set()


class RemoteWorker(WorkerHandle):
    """A node's worker behind its channel. One writer (the actor), as for a local worker."""

    def __init__(self, *, conn: NodeConnection, link: WorkerLink, ack: HelloAck, generation: int) -> None:
        super().__init__(process=None, link=link, ack=ack, generation=generation)  # type: ignore[arg-type]
        self.conn = conn

    @property
    def pid(self) -> int:
        return 0   # not a process of this machine

    async def _write(self, data: bytes) -> None:
        try:
            await self.conn.channel.send_all(data)
        except ChannelLost as exc:
            raise trio.BrokenResourceError(str(exc)) from None

    def kill(self) -> None:
        """Drop the link at once (a hung node): the node fences its lanes (kills its worker)."""
        self.dead = True
        self.conn.channel.abort()


async def _read_event(channel: Channel, link: WorkerLink) -> Event:
    while (event := link.next_event()) is NEED_DATA:
        data = await channel.receive_some()
        link.receive_data(data)   # b"": the node closed (EOF); the link says whether that was clean
    await trio.lowlevel.checkpoint_if_cancelled()
    assert isinstance(event, Event)
    return event


async def _serve_reader(handle: RemoteWorker, deliver: Deliver) -> None:
    gen = handle.generation
    try:
        while True:
            event = await _read_event(handle.conn.channel, handle.link)
            try:
                await deliver(gen, event)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return  # the model's actor closed
    except (ProtocolError, ChannelLost) as exc:
        handle.dead = True
        handle.conn.channel.abort()
        try:
            await deliver(gen, WorkerDied(f"node {handle.conn.hello.identity} ({handle.conn.address}): {exc}"))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass


@asynccontextmanager
async def open_remote_worker(conn: NodeConnection, deliver: Deliver, *, generation: int,
                             start_timeout_s: float) -> AsyncIterator[RemoteWorker]:
    """Handshake the node's worker over ``conn`` and yield its handle.

    Raises:
        WorkerLoadFailed: the node's worker could not load its model.
        WorkerDied: the link ended or broke the protocol during the handshake.
        trio.TooSlowError: no handshake within ``start_timeout_s``.

    Cancellation: leaving the block sends ``Shutdown`` (bounded, shielded) and closes the
    channel; ``conn.closed`` is set.
    """
    try:
        async with _open(conn, deliver, generation, start_timeout_s) as handle:
            yield handle
    except BaseExceptionGroup as group:
        raise_one_failure(group)


@asynccontextmanager
async def _open(conn: NodeConnection, deliver: Deliver, generation: int,
                start_timeout_s: float) -> AsyncIterator[RemoteWorker]:
    link = WorkerLink(DAEMON)
    channel = conn.channel
    handle: RemoteWorker | None = None
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(channel.keepalive)
            try:
                with trio.fail_after(start_timeout_s):
                    broken: Exception | None = None
                    try:
                        await channel.send_all(link.send(Hello()))
                        ack = await _read_event(channel, link)
                    except (ChannelLost, ProtocolError) as exc:
                        broken = exc
                    if broken is not None:
                        raise WorkerDied(f"node {conn.hello.identity} ({conn.address}): link lost during the "
                                         f"worker's handshake: {broken}")
                if isinstance(ack, LoadFailed):
                    raise WorkerLoadFailed(f"node {conn.hello.identity}: {ack.message}")
                if not isinstance(ack, HelloAck):
                    raise WorkerDied(f"node {conn.hello.identity} answered the handshake with {type(ack).__name__}")
                handle = RemoteWorker(conn=conn, link=link, ack=ack, generation=generation)
                nursery.start_soon(_serve_reader, handle, deliver)
                yield handle
            finally:
                with trio.move_on_after(1, shield=True):
                    if handle is not None and not handle.dead:
                        try:
                            await handle.send(Shutdown())
                        except (WorkerDied, ProtocolError, trio.BusyResourceError):
                            pass
                    await channel.aclose()
                nursery.cancel_scope.cancel()
    finally:
        channel.abort()
        conn.closed.set()
