"""The HTTP listener: hypercorn's trio worker, with the connection limits it lacks.

hypercorn (``hypercorn.trio.run.worker_serve``) accepts every connection it can
and holds each as long as its client likes. Here the same pieces run under
our own accept loop, which adds:

- the listen backlog (``--backlog``): hypercorn's 100 reset a third of a burst
  of 1,024 connects (the kernel drops what the accept queue cannot hold);
- a cap on the connections one client IP holds open at once
  (``--max-connections-per-client``): one more is answered 429
  ``too_many_connections`` and closed before anything of it is read.
  Loopback clients are not counted: any local process may pick any of
  127.0.0.0/8 as its source address, so a per-address cap stops no local
  client, and the local load tools and agents (1,024 streams) are the users;
- one line, not a traceback every 100 ms, when accept runs out of file
  descriptors (trio's ``serve_listeners`` logs one per retry);
- :class:`_Connection`: a connection whose client closed it while idle is
  closed at once (hypercorn kept it, in CLOSE_WAIT, until its keep-alive timer);
- :func:`head_limited`: a request head over :data:`MAX_HEAD_BYTES` is 431
  (h11's ``max_incomplete_event_size`` only bounds a head still arriving, so
  one that comes in a single read passed up to 64 KiB).

The header timeout (``--header-timeout``) is hypercorn's keep-alive timer,
which runs from a connection's accept, and again from the end of each
response, until a complete request head has arrived: a connection that sends
its head slowly (slowloris) or none at all is closed when it fires.

:func:`raise_nofile` lifts the soft open-files limit to the hard one at start.
"""

from __future__ import annotations

import errno
import ipaddress
import json
import logging
import os
import resource
from collections.abc import Awaitable, Callable
from typing import Any

import trio
from hypercorn.app_wrappers import ASGIWrapper
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.utils import repr_socket_addr

from ..api._http import ApiError, send_json, ws_denial

__all__ = ["MAX_HEAD_BYTES", "PeerCounts", "head_bytes", "head_limited", "is_loopback", "raise_nofile",
           "serve_http"]

log = logging.getLogger("superfluid")

MAX_HEAD_BYTES = 16 * 1024      # a request line and its headers, as read (SPEC §10)
ACCEPT_RETRY_S = 0.1            # out of descriptors: accept again this often (as trio's serve_listeners)
REFUSAL_LINGER_S = 1.0          # a refused connection is read (and dropped) this long before its close
MAX_LINGERING = 64              # refusals lingering at once; beyond, one closes at once
_CAPACITY_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})

ASGIApp = Callable[[dict[str, Any], Any, Any], Awaitable[None]]


def is_loopback(peer: str) -> bool:
    """Whether a client address is this machine's loopback (127.0.0.0/8, ::1, ::ffff:127.x)."""
    try:
        ip = ipaddress.ip_address(peer.split("%", 1)[0])
    except ValueError:
        return False  # a unix socket's peer, say: counted
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


class PeerCounts:
    """Open connections per client IP, at most ``cap`` each (0: no cap). Pure: the
    listener calls :meth:`admit` at accept and :meth:`release` when the
    connection ends; only addresses with a connection open are kept."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self._open: dict[str, int] = {}

    def admit(self, peer: str) -> bool:
        """Count one more connection of ``peer``; False (nothing counted) when it holds ``cap``."""
        held = self._open.get(peer, 0)
        if self.cap and held >= self.cap:
            return False
        self._open[peer] = held + 1
        return True

    def release(self, peer: str) -> None:
        held = self._open.pop(peer) - 1
        if held:
            self._open[peer] = held

    def held(self, peer: str) -> int:
        return self._open.get(peer, 0)


def too_many_connections(cap: int) -> bytes:
    """The whole 429 answer to a connection over the cap: written before any of its request is read."""
    exc = ApiError(429, f"too_many_connections: this client already holds {cap} open connections, the most "
                        "--max-connections-per-client allows; reuse or close one", code="too_many_connections",
                   type="rate_limit_error")
    body = json.dumps(exc.body(), separators=(",", ":")).encode()
    return (b"HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\nretry-after: 1\r\nconnection: close\r\n\r\n%s" % (len(body), body))


def raise_nofile() -> tuple[int, int]:
    """Lift the soft RLIMIT_NOFILE to the hard limit (where the hard one is unlimited, to the
    largest the kernel takes): every connection and every worker's pipes is a descriptor, and
    the usual soft 1,024 runs out at a few hundred idle clients. Returns (before, after)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    for want in (hard, 1 << 20, 1 << 16, 10240):
        if want == resource.RLIM_INFINITY or (hard != resource.RLIM_INFINITY and want > hard) or want <= soft:
            continue
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError):
            continue  # macOS: above kern.maxfilesperproc
        return soft, want
    return soft, soft


class _Connection(TCPServer):
    """hypercorn's connection, closed as soon as its reading ends.

    When the client closes an idle keep-alive connection, hypercorn's reader
    ends but its keep-alive timer task goes on, and the connection's nursery
    (so the socket's close) waits for it: the fd stayed in CLOSE_WAIT for the
    whole keep-alive time. The reader's end stops the timer here."""

    async def _read_data(self) -> None:
        await super()._read_data()
        await self.idle_task.stop()


def head_bytes(scope: dict[str, Any]) -> int:
    """The size of a request's head as read: its request line and one ``name: value`` line
    per header, each with its CRLF, and the blank line (h11 strips the whitespace around
    values, so a head padded with it counts a little less than it took)."""
    target = len(scope.get("raw_path") or b"") + (1 + len(scope["query_string"]) if scope.get("query_string") else 0)
    line = len(scope.get("method", "GET")) + 1 + target + len(" HTTP/") + len(scope.get("http_version", "1.1")) + 2
    return line + sum(len(name) + len(value) + 4 for name, value in scope.get("headers", ())) + 2


def head_limited(app: ASGIApp, limit: int = MAX_HEAD_BYTES) -> ASGIApp:
    """``app`` behind the request-head limit: a head over ``limit`` bytes is 431
    ``request_header_too_large`` (a WebSocket handshake too), before any of the app runs."""

    async def asgi(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket") or head_bytes(scope) <= limit:
            await app(scope, receive, send)
            return
        exc = ApiError(431, f"request_header_too_large: the request line and headers come to {head_bytes(scope)} "
                            f"bytes; at most {limit} are read", code="request_header_too_large")
        if scope["type"] == "websocket":
            await receive()  # websocket.connect
            if "websocket.http.response" not in scope.get("extensions", {}):
                await send({"type": "websocket.close", "code": 1008})  # before accept: HTTP 403
                return
            send = ws_denial(send)
        await send_json(send, 431, exc.body(), [(b"connection", b"close")])

    return asgi


class _Listener:
    """One ``serve_http``: the accept loops, the per-client counts, the connections' nursery."""

    def __init__(self, app: ASGIApp, config: HypercornConfig, per_client: int) -> None:
        self.app = ASGIWrapper(app)  # type: ignore[arg-type]
        self.config = config
        self.context = WorkerContext(None)
        self.peers = PeerCounts(per_client)
        self.lingering = 0
        self.refusal = too_many_connections(per_client)

    async def accept(self, listener: trio.SocketListener, connections: trio.Nursery) -> None:
        """Accept until cancelled; out of descriptors, wait and retry, said once per shortage."""
        short = False
        async with listener:
            while True:
                try:
                    stream = await listener.accept()
                except OSError as exc:
                    if exc.errno not in _CAPACITY_ERRNOS:
                        raise
                    if not short:
                        log.warning("accept returned %s (%s); retrying every %g s until it works (said once); "
                                    "the open-files limit is %d", errno.errorcode[exc.errno], os.strerror(exc.errno),
                                    ACCEPT_RETRY_S, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
                    short = True
                    await trio.sleep(ACCEPT_RETRY_S)
                    continue
                if short:
                    log.info("accept works again")
                    short = False
                connections.start_soon(self.connection, stream)

    async def connection(self, stream: trio.SocketStream) -> None:
        try:
            try:
                peer = str(stream.socket.getpeername()[0])
            except (OSError, IndexError, TypeError):
                peer = ""  # gone already, or a unix socket: not counted
            counted = bool(peer) and not is_loopback(peer)
            if counted and not self.peers.admit(peer):
                await self.refuse(stream)
                return
            try:
                await _Connection(self.app, self.config, self.context, {}, stream)  # type: ignore[arg-type]
            finally:
                if counted:
                    self.peers.release(peer)
        finally:
            await trio.aclose_forcefully(stream)

    async def refuse(self, stream: trio.SocketStream) -> None:
        """Answer 429 and close; what the client sent meanwhile is read first (a while, for
        a few at once), so that the close is a FIN the client reads the answer before,
        not a reset that may drop it."""
        linger = self.lingering < MAX_LINGERING
        self.lingering += linger
        try:
            with trio.move_on_after(REFUSAL_LINGER_S if linger else 0.05):
                await stream.send_all(self.refusal)
                await stream.send_eof()
                while linger and await stream.receive_some(65536):
                    pass
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
        finally:
            self.lingering -= linger


async def serve_http(app: ASGIApp, config: HypercornConfig, *, per_client: int,
                     shutdown_trigger: Callable[[], Awaitable[object]],
                     task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve ``app`` on ``config.bind`` (plain HTTP/1.1, h2c, WebSocket), listening with
    ``config.backlog``, until ``shutdown_trigger`` returns; then accept no more and give the
    open connections ``config.graceful_timeout`` (an idle one closes at once, a busy one
    after its response). Returns (via ``task_status``) the bound addresses.

    Cancellation: cancelling closes the listeners and every connection at once.
    """
    server = _Listener(head_limited(app), config, per_client)
    sockets = config.create_sockets().insecure_sockets
    for sock in sockets:
        sock.listen(config.backlog)
    binds = [f"http://{repr_socket_addr(sock.family, sock.getsockname())}" for sock in sockets]
    listeners = [trio.SocketListener(trio.socket.from_stdlib_socket(sock)) for sock in sockets]
    async with trio.open_nursery() as connections:
        async with trio.open_nursery() as accepting:
            for listener in listeners:
                accepting.start_soon(server.accept, listener, connections)
            task_status.started(binds)
            await shutdown_trigger()
            accepting.cancel_scope.cancel()
        await server.context.terminated.set()  # idle connections close; busy ones after their response
        connections.cancel_scope.deadline = trio.current_time() + config.graceful_timeout
