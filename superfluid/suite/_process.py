"""Starting, crashing and stopping a system; the context a scenario runs in.

Each server runs in its own process group (``start_new_session=True``, so the
group id is the server's pid) with its output appended to
``<run_dir>/<name>.server.log``. Its workers are the members of that group
whose command line contains the system's worker pattern. Signals go to that
group only, never to the suite's own.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import attrs
import psutil
import trio

from ._client import Client
from ._corpus import Scale
from ._systems import SystemSpec, kv_cells, model_id_guess, render_argv

__all__ = ["Context", "NotOurServer", "ScenarioError", "Server", "StartFailed", "Target"]


class StartFailed(Exception):
    """The system did not become ready."""


class NotOurServer(StartFailed):
    """The port answers from a process the suite did not start: nothing is recorded from it."""


class ScenarioError(Exception):
    """The scenario could not run as designed (verdict ``error``, not ``fail``)."""


def _port_free(port: int) -> bool:
    """Nobody listens there (bound as a server would, so TIME_WAIT leftovers do not count)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def pick_port(preferred: int) -> int:
    """The preferred port if nobody listens there, else a free one (the box is shared)."""
    if _port_free(preferred):
        return preferred
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def listener_pids(port: int) -> set[int] | None:
    """Pids of the processes listening on TCP ``port``; None where this user may not see
    other users' sockets (then only our own processes can be asked)."""
    try:
        conns = psutil.net_connections(kind="tcp")
    except psutil.AccessDenied:
        return None
    return {c.pid for c in conns if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid}


def _listens(pid: int, port: int) -> bool:
    try:
        conns = psutil.Process(pid).net_connections(kind="tcp")
    except psutil.Error:
        return False
    return any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port for c in conns)


def _with_n_ctx(spec: str, ctx: int) -> str:
    if "n_ctx=" in spec:
        return spec
    return f"{spec}{'&' if '?' in spec else '?'}n_ctx={ctx}"


class Server:
    """One system process (and its children) that the suite owns."""

    def __init__(self, spec: SystemSpec, *, lanes: int, ctx: int, run_dir: Path, companion: bool = False,
                 extra_args: tuple[str, ...] = ()) -> None:
        self.spec = spec
        self.lanes = lanes
        self.ctx = ctx
        self.run_dir = run_dir
        self.port = pick_port(spec.port)
        self.companion = companion and spec.companion is not None
        self.extra_args = extra_args
        self.proc: trio.Process | None = None
        self.model_id: str | None = spec.model_id
        self.log_path = run_dir / f"{spec.name}.server.log"
        self._log: Any = None

    def _model(self, model: str | None) -> str | None:
        if model is not None and self.spec.runtime == "mock":
            return _with_n_ctx(model, self.ctx)
        return model

    def argv(self) -> list[str]:
        values = {"python": sys.executable,
                  "root": str(self.run_dir.parent), "run_dir": str(self.run_dir), "name": self.spec.name,
                  "port": self.port, "lanes": self.lanes, "ctx": self.ctx, "kv_tokens": self.kv_cells,
                  "gguf": self.spec.model, "model": self._model(self.spec.model)}
        argv = render_argv(self.spec.argv, values)
        if self.companion:
            argv += ["--model", str(self._model(self.spec.companion))]
        return argv + list(self.extra_args)

    @property
    def kv_cells(self) -> int:
        """KV cells every system gets for this cell's lanes and context (equal memory)."""
        return kv_cells(self.lanes, self.ctx)

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    async def start(self, *, fresh_state: bool = True, timeout: float = 600.0) -> float:
        """Spawn and wait until the probe answers; returns seconds to ready.

        Raises:
            StartFailed: the port is taken, the process exited, or no readiness in time.
        """
        if self.spec.sessions:
            state = self.run_dir / f"sess-{self.spec.name}"
            if fresh_state and state.exists():
                shutil.rmtree(state)
        for _ in range(100):  # after a crash the old listener may linger a moment
            if _port_free(self.port):
                break
            await trio.sleep(0.1)
        else:
            raise StartFailed(f"port {self.port} is already in use")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self._log is not None:
            self._log.close()
        self._log = open(self.log_path, "ab")  # noqa: ASYNC230 - the child's stdout: a real file, opened once
        argv = self.argv()
        self._log.write(f"\n=== suite: starting {' '.join(argv)}\n".encode())
        self._log.flush()
        env = {**os.environ, **self.spec.env}
        started = trio.current_time()
        self.proc = await trio.lowlevel.open_process(argv, start_new_session=True, stdin=subprocess.DEVNULL,
                                                     stdout=self._log, stderr=subprocess.STDOUT, env=env)
        client = self.client()
        deadline = started + timeout
        while True:
            if self.proc.poll() is not None:
                raise StartFailed(f"exited with status {self.proc.returncode} before ready: {self.log_tail()}")
            if trio.current_time() > deadline:
                raise StartFailed(f"not ready within {timeout:.0f} s")
            status, body = await client.get_json(self.spec.probe, timeout=5.0)
            if status is not None:
                self.check_owner()  # before a single answer is believed
            if status == 200 and (self.spec.probe != "/v1/models" or _ids(body)):
                break
            await trio.sleep(0.25)
        ready = trio.current_time() - started
        if self.spec.model_id is None:
            _, body = await client.get_json("/v1/models")
            ids = _ids(body)
            avoid = model_id_guess(str(self.spec.companion)) if self.companion else None
            main = [i for i in ids if i != avoid] or ids
            self.model_id = main[0] if main else None
        warm = self.client()
        await warm.chat("Say hello.", max_tokens=8, stream=False, timeout=120.0, limit=300.0)
        return ready

    def check_owner(self) -> None:
        """Raise :class:`NotOurServer` unless whoever listens on our port is the process
        we started or one of its process group (``start_new_session``: group id = its pid).

        A port checked free before the spawn can be taken by someone else before our
        server binds it; on a shared machine a suite once recorded verdicts from another
        process's server that way."""
        assert self.proc is not None
        ours = [self.proc.pid, *self._group_members()]
        owners = listener_pids(self.port)
        foreign = set() if owners is None else owners - set(ours)
        if foreign or not any(_listens(pid, self.port) for pid in ours):
            who = ", ".join(f"pid {p} ({_cmd(p)})" for p in sorted(foreign)) or "a process we cannot see"
            raise NotOurServer(f"port {self.port} answers from {who}, not the {self.spec.name} server the "
                               f"suite started (pid {self.proc.pid}); refusing to measure it")

    def log_tail(self, n: int = 400) -> str:
        try:
            text = self.log_path.read_bytes()[-n:].decode("utf-8", "replace")
        except OSError:
            return ""
        return " ".join(text.split())

    def client(self, **kwargs: Any) -> Client:
        caps = self.spec.caps
        return Client("127.0.0.1", self.port, model=self.model_id, qos=caps.qos_header, busy=caps.busy, **kwargs)

    def worker_pids(self) -> list[int]:
        pattern = self.spec.caps.worker_pattern
        if self.proc is None or not pattern:
            return []
        out = []
        for p in psutil.process_iter(["pid", "cmdline", "status"]):
            try:
                if p.pid != self.proc.pid and os.getpgid(p.pid) == self.proc.pid \
                        and p.info["status"] != psutil.STATUS_ZOMBIE \
                        and pattern in " ".join(p.info["cmdline"] or ()):
                    out.append(p.pid)
            except (ProcessLookupError, psutil.Error, OSError):
                continue
        return sorted(out)

    def _signal_group(self, sig: int) -> None:
        if self.proc is None or self.proc.pid == os.getpgrp():
            return
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def crash(self) -> None:
        """SIGKILL the server, then its whole process group (synchronous: usable from a chunk callback)."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._signal_group(signal.SIGKILL)

    async def wait_gone(self, timeout: float = 10.0) -> None:
        """After :meth:`crash`: reap the server and wait for its group to empty."""
        if self.proc is None:
            return
        with trio.move_on_after(timeout):
            await self.proc.wait()
            while self._group_members():  # noqa: ASYNC110 - another process group: nothing to wait on
                await trio.sleep(0.05)

    def _group_members(self) -> list[int]:
        out = []
        for pid in psutil.pids():
            try:
                if self.proc is not None and os.getpgid(pid) == self.proc.pid:
                    out.append(pid)
            except OSError:
                continue
        return out

    async def stop(self, *, grace: float = 15.0) -> None:
        """SIGTERM the group, wait, SIGKILL the group, wait for the port to close."""
        if self.proc is None:
            return
        with trio.move_on_after(grace + 30, shield=True):  # each step inside is bounded too
            if self.proc.poll() is None:
                self._signal_group(signal.SIGTERM)
                with trio.move_on_after(grace):
                    await self.proc.wait()
            self._signal_group(signal.SIGKILL)
            with trio.move_on_after(10):
                await self.proc.wait()
            with trio.move_on_after(15):
                while not _port_free(self.port):  # noqa: ASYNC110 - a port another process holds
                    await trio.sleep(0.1)
            if self._log is not None:
                self._log.close()
                self._log = None
        self.proc = None


def _cmd(pid: int) -> str:
    try:
        return " ".join(psutil.Process(pid).cmdline())[:120] or "?"
    except psutil.Error:
        return "?"


def _ids(body: Any) -> list[str]:
    if not isinstance(body, dict):
        return []
    rows = body.get("data") or body.get("models") or []
    return [str(r.get("id") or r.get("name")) for r in rows if isinstance(r, dict) and (r.get("id") or r.get("name"))]


@attrs.define
class Target:
    """What a scenario talks to: a started (or attached) server and a client for it."""

    spec: SystemSpec
    client: Client
    server: Server | None = None

    @property
    def controllable(self) -> bool:
        return self.server is not None


@attrs.define
class Context:
    """Everything a scenario needs: the system, the scale, where to put state."""

    spec: SystemSpec
    scale: Scale
    run_dir: Path
    url_port: int | None = None
    note: Callable[[str], None] = print

    @property
    def controllable(self) -> bool:
        return self.url_port is None

    def sizes(self, scenario: str) -> dict[str, Any]:
        return self.scale.of(scenario)

    @asynccontextmanager
    async def launch(self, *, lanes: int, ctx: int, companion: bool = False, extra_args: tuple[str, ...] = (),
                     timeout: float = 600.0) -> AsyncIterator[Target]:
        """Start the system for one scenario (or attach to ``--url``); always stopped on exit."""
        if self.url_port is not None:
            probe = Client("127.0.0.1", self.url_port, qos=self.spec.caps.qos_header, busy=self.spec.caps.busy)
            status, body = await probe.get_json("/v1/models")
            ids = _ids(body) if status == 200 else []
            probe.model = self.spec.model_id or (ids[0] if ids else None)
            yield Target(spec=self.spec, client=probe)
            return
        server = Server(self.spec, lanes=lanes, ctx=ctx, run_dir=self.run_dir, companion=companion,
                        extra_args=extra_args)
        try:
            await server.start(timeout=timeout)
            yield Target(spec=self.spec, client=server.client(), server=server)
        finally:
            await server.stop()  # noqa: ASYNC102 - stop() shields itself, bounded
