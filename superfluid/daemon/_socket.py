"""The unix socket (``--socket PATH``): the WebSocket's ops as newline-delimited JSON.

Each line a client writes is one ``/v1/ws`` message (``{"op": …}``); each line
the daemon writes is one reply or stream frame, exactly as the WebSocket sends
them (``api/_ws.py``: the same ops, the same error frames). The socket file is
made 0600 before it listens: file permissions are the credential, and whoever
may open it is the admin principal, tenant ``""`` (with keys configured, the
conversations the socket creates are that tenant's, not a key's). A line
longer than the WebSocket's message limit ends the connection, as 1009 closes
a WebSocket. A client that ends its side (EOF) still gets the replies to the
lines it sent; its subscriptions end with it, as a WebSocket's do when it goes.

Lifetimes: :func:`serve_socket` runs in the daemon's root nursery; it owns a
nursery with its accept loop and one task per connection (each runs a
:class:`~superfluid.api._ws` socket in a nursery of its own). Cancelling it
closes every connection and removes the file.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket as stdsocket
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from ..api._principal import ANONYMOUS, PRINCIPAL
from ..api._ws import LIMITS, serve_stream

if TYPE_CHECKING:
    from ..api import App

__all__ = ["open_socket_listener", "serve_socket"]

log = logging.getLogger("superfluid.socket")
READ_CHUNK = 65536


async def open_socket_listener(path: Path) -> trio.SocketListener:
    """Bind ``path`` 0600 and listen. A stale socket file (nobody listening) is replaced;
    anything else there is refused.

    Raises:
        OSError: the path is taken (a live socket, or not a socket) or cannot be bound.
    """
    path = Path(path)
    try:
        st = path.lstat()
    except FileNotFoundError:
        pass
    else:
        if not stat.S_ISSOCK(st.st_mode):
            raise OSError(errno.EEXIST, f"--socket {path}: the path exists and is not a socket")
        probe = stdsocket.socket(stdsocket.AF_UNIX, stdsocket.SOCK_STREAM)
        try:
            probe.connect(str(path))
        except OSError:
            path.unlink()  # stale: nobody listens on it
        else:
            raise OSError(errno.EADDRINUSE, f"--socket {path}: another server listens on it")
        finally:
            probe.close()
    sock = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
    try:
        await sock.bind(str(path))
        # 0600 before it listens: until then a connect is refused whatever the mode (no umask
        # change: it is the process's, and other threads create files)
        os.chmod(path, 0o600)
        sock.listen(128)
    except BaseException:
        sock.close()
        raise
    return trio.SocketListener(sock)


async def serve_socket(app: App, path: Path, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve the unix socket at ``path`` until cancelled; started with the path once listening.

    Resource handling: the socket file is removed when this returns.
    """
    listener = await open_socket_listener(path)
    try:
        async with listener, trio.open_nursery() as nursery:
            task_status.started(str(path))
            while True:
                stream = await listener.accept()
                nursery.start_soon(_connection, app, stream)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)


async def _connection(app: App, stream: trio.SocketStream) -> None:
    """One client: lines in as WebSocket messages, frames out as lines (a boundary: a failure ends only it)."""
    scope: dict[str, Any] = {"type": "websocket", "path": "/v1/ws", "client": ("unix", 0), "headers": [],
                             PRINCIPAL: ANONYMOUS}
    buffer = bytearray()
    limit = LIMITS.max_message
    eof = False      # the client wrote its last line (what it sent is still answered)
    closed = False   # we closed, or the client cannot take more: nothing more is written

    async def receive() -> dict[str, Any]:
        nonlocal eof
        while True:
            line_end = buffer.find(b"\n")
            if line_end >= 0:
                line = bytes(buffer[:line_end])
                del buffer[:line_end + 1]
                if line.strip():
                    return {"type": "websocket.receive", "bytes": line}
                continue
            if len(buffer) > limit:  # a line past the limit: the socket reads it as too big (closes)
                line = bytes(buffer)
                buffer.clear()
                return {"type": "websocket.receive", "bytes": line}
            if eof or closed:
                return {"type": "websocket.disconnect", "code": 1000}
            try:
                data = await stream.receive_some(READ_CHUNK)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                data = b""
            if not data:
                eof = True
                if buffer.strip():
                    line = bytes(buffer)
                    buffer.clear()
                    return {"type": "websocket.receive", "bytes": line}
                return {"type": "websocket.disconnect", "code": 1000}
            buffer.extend(data)

    async def send(message: dict[str, Any]) -> None:
        nonlocal closed
        if closed and message["type"] != "websocket.close":
            return
        try:
            if message["type"] == "websocket.send":
                await stream.send_all(message["text"].encode() + b"\n")
            elif message["type"] == "websocket.close":
                closed = True
                with contextlib.suppress(OSError):
                    stream.socket.shutdown(trio.socket.SHUT_WR)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            closed = True

    try:
        async with stream:
            await serve_stream(app, scope, receive, send)
    except Exception:  # noqa: BLE001 -- boundary: one connection; the daemon goes on
        log.exception("unix socket connection failed")
