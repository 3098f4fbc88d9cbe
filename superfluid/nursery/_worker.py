"""One worker process, handshaken, with its link reader.

``open_worker`` is the only way to get a :class:`WorkerHandle`; leaving its
``async with`` always ends the process (protocol ``Shutdown``, then the
:func:`graceful_kill` ladder) and reaps it.

Nursery tree inside ``open_worker``::

    worker nursery
    ├── run_process(worker argv)      owns the OS process; deliver_cancel = graceful_kill
    └── reader                        stdout -> WorkerLink -> the actor's worker-event channel (bounded)
"""

from __future__ import annotations

import logging
import math
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import Any, NoReturn

import attrs
import trio

from .. import _defaults as D
from .._errors import first_leaf
from ..proto import SpecConfig
from ..proto import (
    DAEMON,
    NEED_DATA,
    Event,
    Hello,
    HelloAck,
    LoadFailed,
    ProtocolError,
    Shutdown,
    WorkerLink,
)
from ..sched import LinkLost
from ._kill import graceful_kill, kill_now, worker_env

Deliver = Callable[[int, Any], Awaitable[None]]   # (generation, event) to the model's actor

log = logging.getLogger(__name__)

__all__ = ["WorkerDied", "WorkerHandle", "WorkerLoadFailed", "WorkerSpawnFailed", "WorkerSpec", "open_worker",
           "raise_one_failure", "worker_argv"]

READ_SIZE = 256 * 1024


class WorkerDied(LinkLost):
    """The worker process exited, hung, or broke the link protocol."""


class WorkerLoadFailed(Exception):
    """The worker could not load its model (it answered ``LoadFailed``)."""


class WorkerSpawnFailed(WorkerDied):
    """The worker process could not be started: the daemon is out of file descriptors,
    processes or memory (``EMFILE``, ``ENFILE``, ``EAGAIN``, ``ENOMEM``), or the spawn failed
    otherwise. Not the worker's fault: the actor retries with back-off, and requests fail
    typed (503 ``resources_exhausted``) meanwhile."""


@attrs.frozen(kw_only=True)
class WorkerSpec:
    runtime: str
    model: str
    max_batch: int = D.MAX_BATCH
    max_context: int = D.MAX_CONTEXT
    threads: int = D.THREADS
    host_cache_mb: int = 0  # off unless the daemon asks (--host-cache-mb)
    park_dir: str = ""      # --park: finished sequences' KV on disk here (<sessions>/park); "": off
    park_budget_mb: int = 0
    stream_interval_ms: int = D.STREAM_INTERVAL_MS
    agent_stream_interval_ms: int = D.AGENT_STREAM_INTERVAL_MS
    deterministic: bool = False
    kv_bits: int = 16           # --kv-bits: the KV cache's width (8: llama.cpp's q8_0 K and V)
    pooling: str = ""           # embeddings: mean|cls|last ("": the model's own, else mean)
    speculate: str = "off"      # off|auto|prompt-lookup (the worker resolves it for its model)
    spec_gates: SpecConfig = attrs.field(factory=SpecConfig)
    start_timeout_s: float = D.WORKER_START_TIMEOUT_S
    shutdown_grace_s: float = 2.0
    term_grace_s: float = 3.0
    # the command prefix that starts the worker (an install's interpreter with -m superfluid.worker,
    # or a SUPERFLUID_WORKER_<ID> executable); empty: this interpreter
    command: tuple[str, ...] = ()


def worker_argv(spec: WorkerSpec) -> list[str]:
    argv = [
        *(spec.command or (sys.executable, "-m", "superfluid.worker")), f"superfluid-worker-{spec.runtime}",
        "--model", spec.model, "--max-batch", str(spec.max_batch), "--max-context", str(spec.max_context),
    ]
    if spec.threads:
        argv += ["--threads", str(spec.threads)]
    if spec.host_cache_mb:
        argv += ["--host-cache-mb", str(spec.host_cache_mb)]
    if spec.park_dir and spec.park_budget_mb > 0:
        argv += ["--park-dir", spec.park_dir, "--park-budget-mb", str(spec.park_budget_mb)]
    argv += ["--stream-interval-ms", str(spec.stream_interval_ms),
             "--agent-stream-interval-ms", str(spec.agent_stream_interval_ms)]
    if spec.deterministic:
        argv.append("--deterministic")
    if spec.kv_bits != 16:
        argv += ["--kv-bits", str(spec.kv_bits)]
    if spec.pooling:
        argv += ["--pooling", spec.pooling]
    if spec.speculate != "off":
        argv += ["--speculate", spec.speculate, *spec.spec_gates.to_argv()]
    return argv


class WorkerHandle:
    """A live worker (a :class:`~superfluid.sched.LinkHandle`). One writer: after the
    handshake only the task that first sends (the model's actor) writes to it; another
    task's send is an ``AssertionError``, two overlapping sends ``trio.BusyResourceError``.
    Events go to the ``deliver`` the caller passed to :func:`open_worker`, as
    ``(generation, event)``; a lost worker is announced as ``(generation, WorkerDied)``."""

    def __init__(self, *, process: trio.Process, link: WorkerLink, ack: HelloAck, generation: int) -> None:
        self.process = process
        self.link = link
        self.ack = ack
        self.generation = generation
        self._writer: trio.lowlevel.Task | None = None
        self._sending = False
        self.dead = False
        # a worker that takes no message for this long (it stopped reading its stdin and the
        # pipe is full) is hung: the scheduler sets --hang-timeout here, because while it is
        # blocked in a send its tick timer does not run
        self.send_timeout_s = math.inf

    @property
    def pid(self) -> int:
        return self.process.pid

    async def send(self, *events: Event) -> None:
        """Write ``events`` in order, in one write (one wake-up of the worker).

        Raises:
            WorkerDied: the pipe is gone (the reader will also report it), or the message
                waited ``send_timeout_s`` for the pipe (the worker is then killed).
        """
        task = trio.lowlevel.current_task()
        if self._writer is None:
            self._writer = task
        assert task is self._writer, f"worker pid {self.pid}: the link has one writer, the model's actor"
        if self._sending:
            raise trio.BusyResourceError("another send to this worker is in progress")
        if self.dead:
            await trio.lowlevel.checkpoint()
            raise WorkerDied("worker is gone")
        with trio.move_on_after(self.send_timeout_s):
            await self._send(events)
            return
        self.kill()
        raise WorkerDied(f"worker hung: it took no message for {self.send_timeout_s:g}s")

    async def _send(self, events: tuple[Event, ...]) -> None:
        self._sending = True
        try:
            await self._write(b"".join(self.link.send(event) for event in events))
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            self.link.send_failed()
            self.dead = True
            raise WorkerDied(f"write to worker failed: {exc!r}") from None
        except BaseException:   # cancelled mid-frame: the link is in ERROR, the worker is let go
            self.link.send_failed()
            self.dead = True
            raise
        finally:
            self._sending = False

    async def _write(self, data: bytes) -> None:
        assert self.process.stdin is not None
        await self.process.stdin.send_all(data)

    def kill(self) -> None:
        """SIGKILL at once (a hung worker)."""
        self.dead = True
        kill_now(self.process)


async def _read_event(process: trio.Process, link: WorkerLink) -> Event:
    assert process.stdout is not None
    while (event := link.next_event()) is NEED_DATA:
        link.receive_data(await process.stdout.receive_some(READ_SIZE))
    await trio.lowlevel.checkpoint_if_cancelled()   # (events already read come without a wait)
    assert isinstance(event, Event)
    return event


async def _serve_reader(handle: WorkerHandle, deliver: Deliver) -> None:
    """The worker's stdout, event by event, to the model's actor (its own channel:
    this task never waits behind request handlers' commands)."""
    gen = handle.generation
    try:
        while True:
            event = await _read_event(handle.process, handle.link)
            try:
                await deliver(gen, event)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return  # the model's actor closed (an unload): the actor shuts this worker down
    except (ProtocolError, trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
        handle.dead = True
        kill_now(handle.process)  # a protocol error ends the worker; it is respawned
        rc = await handle.process.wait()
        try:
            await deliver(gen, WorkerDied(f"{exc} (exit status {rc})"))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass


@asynccontextmanager
async def open_worker(
    spec: WorkerSpec, deliver: Deliver, *, generation: int, env: dict[str, str] | None = None
) -> AsyncIterator[WorkerHandle]:
    """Start a worker, handshake, and yield its handle.

    Raises:
        WorkerLoadFailed: the worker reported that its model did not load.
        WorkerDied: the worker died or broke the protocol during the handshake.
        trio.TooSlowError: no handshake within ``spec.start_timeout_s``.

    Cancellation: leaving the block (normally, by error or by cancellation)
    sends ``Shutdown``, escalates to SIGTERM and SIGKILL, and reaps the process.
    """
    link = WorkerLink(DAEMON)
    argv = worker_argv(spec)
    child_env = worker_env(os.environ if env is None else env)
    try:
        async with _open_worker_nursery(spec, argv, child_env, link, deliver, generation) as handle:
            yield handle
    except BaseExceptionGroup as group:
        raise_one_failure(group)


def raise_one_failure(group: BaseExceptionGroup[BaseException]) -> NoReturn:
    """Hide a worker's nursery: its failure surfaces as one LinkLost (WorkerDied),
    WorkerLoadFailed or TooSlowError; a cancel from outside stays the cancel it is."""
    failures, rest = group.split((LinkLost, WorkerLoadFailed, trio.TooSlowError))
    if rest is not None:
        if rest.split(trio.Cancelled)[1] is None:
            # cancelled from outside (an unload) as the worker failed: the cancel is what
            # happened; the failure beside it is moot (raised, it made the actor "fail")
            raise rest from None
        raise group
    if failures is None:
        raise group
    raise first_leaf(failures) from group


@asynccontextmanager
async def _open_worker_nursery(
    spec: WorkerSpec, argv: list[str], child_env: dict[str, str], link: WorkerLink,
    deliver: Deliver, generation: int,
) -> AsyncIterator[WorkerHandle]:
    process: trio.Process | None = None
    try:
        async with trio.open_nursery() as nursery:
            try:
                process = await nursery.start(
                    partial(
                        trio.run_process, argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, check=False,
                        env=child_env,
                        deliver_cancel=partial(graceful_kill, grace_s=spec.shutdown_grace_s, term_s=spec.term_grace_s),
                    )
                )
            except OSError as exc:  # os.pipe/fork/exec: trio has closed whatever it had opened
                raise WorkerSpawnFailed(f"could not start the worker process: {exc}") from None
            handle: WorkerHandle | None = None
            try:
                assert process.stdin is not None
                with trio.fail_after(spec.start_timeout_s):
                    gone = False
                    try:
                        await process.stdin.send_all(link.send(Hello()))
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        gone = True  # it exited before reading a byte (a worker that cannot start)
                    if gone:
                        rc = await process.wait()
                        raise WorkerDied(f"worker exited during startup (exit status {rc}): {' '.join(argv[:1])}")
                    broken: ProtocolError | None = None
                    try:
                        ack = await _read_event(process, link)
                    except ProtocolError as exc:
                        broken = exc
                    if broken is not None:  # (awaited outside the except: a cancel must not hide it)
                        rc = await process.wait()
                        raise WorkerDied(f"worker died during startup (exit status {rc}): {broken}")
                if isinstance(ack, LoadFailed):
                    raise WorkerLoadFailed(ack.message)
                if not isinstance(ack, HelloAck):
                    raise WorkerDied(f"worker answered the handshake with {type(ack).__name__}")
                handle = WorkerHandle(process=process, link=link, ack=ack, generation=generation)
                nursery.start_soon(_serve_reader, handle, deliver)
                yield handle
            finally:
                with trio.move_on_after(spec.shutdown_grace_s, shield=True):
                    if process.returncode is None:
                        try:
                            if handle is not None:
                                # the actor's own task (one writer); cancelled mid-send, the handle is dead
                                await handle.send(Shutdown())
                            else:
                                assert process.stdin is not None
                                await process.stdin.send_all(link.send(Shutdown()))
                        except (WorkerDied, ProtocolError, trio.BrokenResourceError, trio.ClosedResourceError,
                                trio.BusyResourceError, OSError):
                            pass
                nursery.cancel_scope.cancel()
    finally:
        if process is not None:
            log.debug("worker pid %d (generation %d) reaped: exit status %s", process.pid, generation,
                      process.returncode)
            # run_process leaves the pipes of stdin/stdout=PIPE to the caller: close them when
            # the generation ends, not when the garbage collector breaks a cycle that holds them
            with trio.move_on_after(1, shield=True):  # closing two pipe fds; bounded all the same
                for pipe in (process.stdin, process.stdout):
                    if pipe is not None:
                        await pipe.aclose()
