"""The suite measures only servers it started (issue #16: on a shared machine a run once
recorded verdicts from another process's server that had taken its port)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import trio

from superfluid.suite._process import NotOurServer, Server
from superfluid.suite._systems import Caps, SystemSpec

_OK = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{}"


async def _impostor(listeners: list[trio.SocketListener]) -> None:
    async def answer(stream: trio.abc.Stream) -> None:
        async with stream:
            await stream.receive_some(65536)
            await stream.send_all(_OK)

    await trio.serve_listeners(answer, listeners)


def _spec(port: int, argv: tuple[str, ...]) -> SystemSpec:
    return SystemSpec(name="impostor-test", argv=argv, caps=Caps(family="other"), port=port)


async def test_a_port_taken_after_the_spawn_is_refused_not_measured(tmp_path: Path) -> None:
    # The spawned "server" never binds; an impostor in this process binds the port right after
    # the spawn and answers every probe 200. The suite must refuse it, not record a cell from it.
    server = Server(_spec(0, (sys.executable, "-c", "import time; time.sleep(60)")), lanes=1, ctx=64,
                    run_dir=tmp_path)
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    server.port = listeners[0].socket.getsockname()[1]
    for lst in listeners:  # a free port, taken again only once the spawn happened
        await lst.aclose()

    async def take_port_after_spawn() -> None:
        while server.proc is None:
            await trio.sleep(0.01)
        impostor.start_soon(_impostor, await trio.open_tcp_listeners(server.port, host="127.0.0.1"))

    async with trio.open_nursery() as impostor:
        impostor.start_soon(take_port_after_spawn)
        try:
            with pytest.raises(NotOurServer, match="not the impostor-test server the suite started"):
                await server.start(timeout=30.0)
        finally:
            impostor.cancel_scope.cancel()
    await server.stop(grace=1.0)


async def test_the_server_the_suite_started_passes_the_ownership_check(tmp_path: Path) -> None:
    # the positive control: a child that binds the port itself is ours
    script = tmp_path / "own_server.py"
    script.write_text("import socket, sys\ns = socket.socket()\ns.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
                      "s.bind(('127.0.0.1', int(sys.argv[1])))\ns.listen()\nwhile True:\n"
                      f"    c, _ = s.accept(); c.recv(65536); c.sendall({_OK!r}); c.close()\n")
    server = Server(_spec(0, (sys.executable, str(script), "{port}")), lanes=1, ctx=64, run_dir=tmp_path)
    with trio.socket.socket() as probe:
        await probe.bind(("127.0.0.1", 0))
        server.port = probe.getsockname()[1]
    server.proc = None
    try:
        with trio.fail_after(30):
            # start() also warms with a chat; the fake answers {} (no reply), which the client
            # reports as a failed chat, not an exception, so readiness and ownership are what count
            await server.start(timeout=20.0)
        server.check_owner()
    finally:
        await server.stop(grace=1.0)  # noqa: ASYNC102 - stop() shields itself, bounded
