"""A fleet node: one model's worker, relayed to a head over an encrypted link.

The node owns nothing durable and speaks no protocol of its own after the hello:
for each link it starts a fresh worker process (``python -m superfluid.worker``,
exactly as ``serve`` would) and relays the worker link (SPEC.md §3) byte for byte
between the channel and the worker's pipes. The head's model actor is the
worker's daemon. So the node's failure rules are few and structural:

- the link is lost (EOF without a close record, a lease that ran out, a record
  that does not decrypt): the worker is SIGKILLed at once. This is the fence: a
  head that lost the node re-places its sessions elsewhere, and nothing this node
  generated after that can reach anyone;
- the worker exits: the link is closed (the head's actor sees a dead worker);
- the head closes the link: it sent ``Shutdown`` first; the worker gets the usual
  grace (``graceful_kill``).

Two ways to meet a head: ``node join [HEAD]`` dials it (found by mDNS when HEAD is
omitted) and dials again whenever the link ends (:func:`join`); ``node serve
--listen`` waits for the head's dial (:func:`serve_node`), one head at a time: a
newer link fences the older one.

Nursery tree of one link (:func:`relay`)::

    link nursery
    ├── run_process(worker argv)     deliver_cancel = graceful_kill; SIGKILL on a lost link
    ├── downstream                   channel -> worker stdin
    ├── upstream                     worker stdout -> channel
    └── keepalive                    a record every lease/3 while nothing else is sent
"""

from __future__ import annotations

import logging
import os
import subprocess
from functools import partial

import attrs
import trio

from ..nursery import WorkerSpec, graceful_kill, kill_now, worker_argv, worker_env
from ._channel import Channel, ChannelLost, HandshakeFailed, handshake
from ._remote import NodeHello, send_hello

__all__ = ["NodeConfig", "join", "relay", "serve_node"]

log = logging.getLogger("superfluid.fleet")
READ_SIZE = 256 * 1024
REDIAL_S = 2.0


@attrs.frozen(kw_only=True)
class NodeConfig:
    spec: WorkerSpec
    hello: NodeHello
    key: bytes | None = attrs.field(repr=False)
    lease_s: float = 6.0
    handshake_timeout_s: float = 10.0


async def relay(channel: Channel, spec: WorkerSpec) -> str:
    """Serve one link: a fresh worker, relayed until either side ends. Returns how it ended."""
    start = partial(trio.run_process, worker_argv(spec), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                    check=False, env=worker_env(os.environ),
                    deliver_cancel=partial(graceful_kill, grace_s=spec.shutdown_grace_s, term_s=spec.term_grace_s))
    link = _Relay(channel, spec)
    try:
        async with trio.open_nursery() as nursery:
            link.run(nursery, await nursery.start(start))
    except OSError as exc:   # os.pipe/fork/exec: trio closed what it had opened
        await channel.aclose()
        return f"the worker could not be started: {exc}"
    with trio.move_on_after(1, shield=True):
        await link.close()
    return link.ended


class _Relay:
    """One link's pumps (:func:`relay`)."""

    def __init__(self, channel: Channel, spec: WorkerSpec) -> None:
        self.channel = channel
        self.spec = spec
        self.ended = "the worker exited"
        self.process: trio.Process | None = None
        self.nursery: trio.Nursery | None = None

    def run(self, nursery: trio.Nursery, process: trio.Process) -> None:
        self.nursery, self.process = nursery, process
        nursery.start_soon(self._downstream)
        nursery.start_soon(self._upstream)
        nursery.start_soon(self.channel.keepalive)

    def _fence(self, why: str) -> None:
        assert self.process is not None and self.nursery is not None
        self.ended = why
        kill_now(self.process)   # nothing it generates from now on reaches anyone
        self.nursery.cancel_scope.cancel()

    async def _downstream(self) -> None:
        assert self.process is not None and self.process.stdin is not None and self.nursery is not None
        try:
            while data := await self.channel.receive_some():
                await self.process.stdin.send_all(data)
        except ChannelLost as exc:
            self._fence(f"link lost: {exc}")
            return
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return   # the worker exited: upstream closes the link
        self.ended = "the head closed the link"
        with trio.move_on_after(self.spec.shutdown_grace_s):
            await self.process.wait()   # (it was told Shutdown: it exits by itself)
        self.nursery.cancel_scope.cancel()

    async def _upstream(self) -> None:
        assert self.process is not None and self.process.stdout is not None and self.nursery is not None
        try:
            while data := await self.process.stdout.receive_some(READ_SIZE):
                await self.channel.send_all(data)
        except ChannelLost as exc:
            self._fence(f"link lost: {exc}")
            return
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        await self.channel.aclose()   # the worker's end is the link's end
        self.nursery.cancel_scope.cancel()

    async def close(self) -> None:
        if self.process is not None:
            for pipe in (self.process.stdin, self.process.stdout):
                if pipe is not None:
                    await pipe.aclose()
            log.info("fleet: link ended (%s); worker exit status %s", self.ended, self.process.returncode)
        await self.channel.aclose()


async def _serve_channel(channel: Channel, config: NodeConfig) -> str:
    refusal = await send_hello(channel, config.hello)
    if refusal:
        await channel.aclose()
        return f"the head refused this node: {refusal}"
    log.info("fleet: joined the head at %s as %s (model %s)", channel.peer, config.hello.identity,
             config.hello.model)
    return await relay(channel, config.spec)


async def join(config: NodeConfig, head: tuple[str, int] | None, *, redial_s: float = REDIAL_S,
               find: bool = True, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Dial the head (found by mDNS when ``head`` is None) and serve its link; dial again
    whenever it ends, until cancelled."""
    task_status.started()
    while True:
        address = head
        if address is None:
            from ._mdns import DiscoveryError, find_head

            try:
                address = await find_head(timeout_s=10.0)
            except DiscoveryError as exc:
                log.warning("fleet: %s", exc)
                await trio.sleep(redial_s)
                continue
        host, port = address
        try:
            with trio.fail_after(config.handshake_timeout_s):
                stream = await trio.open_tcp_stream(host, port)
        except (OSError, trio.TooSlowError) as exc:
            log.warning("fleet: head %s:%d unreachable (%s); dialling again in %gs", host, port, exc, redial_s)
            await trio.sleep(redial_s)
            continue
        try:
            channel = await handshake(stream, config.key, initiator=True, lease_s=config.lease_s,
                                      timeout_s=config.handshake_timeout_s)
        except HandshakeFailed as exc:
            log.error("fleet: head %s:%d refused the handshake (%s): is the fleet token the same on both?",
                      host, port, exc)
            await trio.sleep(redial_s)
            continue
        try:
            why = await _serve_channel(channel, config)
        except ChannelLost as exc:
            why = f"link lost: {exc}"
        finally:
            channel.abort()
        log.warning("fleet: %s; dialling %s:%d again", why, host, port)
        await trio.sleep(redial_s)


async def serve_node(config: NodeConfig, host: str, port: int, *,
                     task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
    """Wait for heads' links on ``host:port`` (dial mode); one head at a time, a newer link
    fences the older. ``task_status`` gets the bound port."""
    listeners = await trio.open_tcp_listeners(port, host=host or None)
    bound = listeners[0].socket.getsockname()[1]
    current: list[Channel] = []

    async def handle(stream: trio.abc.Stream) -> None:
        try:
            channel = await handshake(stream, config.key, initiator=False, lease_s=config.lease_s,
                                      timeout_s=config.handshake_timeout_s)
        except HandshakeFailed as exc:
            log.warning("fleet: a link was refused at the handshake: %s", exc)
            return
        for older in current:
            older.abort()      # a newer head link: the older one's worker is fenced (killed) at once
        current.append(channel)
        try:
            why = await _serve_channel(channel, config)
            log.info("fleet: %s", why)
        except ChannelLost as exc:
            log.warning("fleet: link lost: %s", exc)
        finally:
            current.remove(channel)
            channel.abort()

    log.info("fleet: node %s (model %s) waits for a head at %s:%d", config.hello.identity, config.hello.model,
             host, bound)
    task_status.started(bound)
    await trio.serve_listeners(handle, listeners)
