"""The worker process: one loaded model behind the worker link.

Command line (the daemon builds it; the ``superfluid-worker-<runtime>`` word is
there so ``pgrep -f`` finds workers)::

    python -m superfluid.worker superfluid-worker-<runtime> --model M [--max-batch N] [--max-context N]

The link runs over stdin (daemon -> worker) and the original stdout (worker ->
daemon). File descriptor 1 is re-pointed at stderr before the runtime loads,
so nothing a C library prints can corrupt the link.

Tasks (one nursery): the *reader* decodes frames and answers tokenize requests
itself; Admit/Cancel/Tick go to the *engine* task over a bounded channel; an
Interrupt sets a flag the engine checks between steps. The engine task owns
the executor and runs each step in a worker thread.

Exit codes: 0 clean shutdown, 2 bad command line, 3 model did not load, 1 link failure.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
from typing import Any

import trio

from ..proto import (
    DEFAULT_MAX_FRAME,
    NEED_DATA,
    PROTOCOL_VERSION,
    WORKER,
    Admit,
    Admitted,
    Cancel,
    Emit,
    Fault,
    Hello,
    HelloAck,
    Interrupt,
    LoadFailed,
    ProtocolError,
    Shutdown,
    Tick,
    TickDone,
    Tokenize,
    Tokenized,
    WorkerLink,
)
from ._engine import Engine
from ._executor import Executor

__all__ = ["load_engine", "main"]

RUNTIMES = ("mock", "llamacpp")


def load_engine(runtime: str, model: str, *, max_batch: int, max_context: int, threads: int) -> Engine:
    if runtime == "mock":
        from ._mock import MockEngine

        return MockEngine(model, n_seq=max(4, max_batch + 2))
    if runtime == "llamacpp":
        from ._llamacpp import LlamaEngine

        return LlamaEngine(model, max_batch=max_batch, max_context=max_context, threads=threads)
    raise ValueError(f"unknown runtime {runtime!r}")


class _Worker:
    def __init__(self, engine: Engine, executor: Executor, send_stream: trio.abc.SendStream,
                 link: WorkerLink, runtime: str) -> None:
        self.engine = engine
        self.executor = executor
        self.link = link
        self.out = send_stream
        self.runtime = runtime
        self.send_lock = trio.StrictFIFOLock()
        self.interrupt = False
        self.queued_ticks: collections.deque[Tick] = collections.deque()
        self.prefill_s_per_token = 0.0   # measured; sizes prefill steps to the tick's step_ms

    async def send(self, event: Any) -> None:
        async with self.send_lock:
            data = self.link.send(event)
            try:
                await self.out.send_all(data)
            except BaseException:
                self.link.send_failed()
                raise

    async def serve_engine(self, ops: trio.MemoryReceiveChannel[Any]) -> None:
        async for op in ops:
            if isinstance(op, Admit):
                await self._admit(op)
            elif isinstance(op, Cancel):
                if self.executor.cancel(op.lane, publish=op.publish):
                    await self.send(Emit(items=[[op.lane, -1, b"", "cancelled", None]]))
            elif isinstance(op, Tick):
                self.queued_ticks.append(op)
            # ticks run back to back; one arriving mid-tick waits in queued_ticks
            while self.queued_ticks:
                await self._tick(self.queued_ticks.popleft(), ops)

    async def _admit(self, op: Admit) -> None:
        try:
            lane = self.executor.admit(op)
        except ValueError as exc:
            await self.send(Fault(lane=op.lane, kind="admit", message=str(exc)))
            return
        await self.send(Admitted(lane=op.lane, cached=lane.cached))

    async def _tick(self, tick: Tick, ops: trio.MemoryReceiveChannel[Any]) -> None:
        t0 = trio.current_time()
        deadline = t0 + tick.time_budget_ms / 1000
        budget = tick.prefill_budget
        rounds = prefill = decode = 0
        interrupted = False
        self.interrupt = False
        while True:
            # admits and cancels that arrived mid-tick apply between steps
            while True:
                try:
                    op = ops.receive_nowait()
                except trio.WouldBlock:
                    break
                if isinstance(op, Tick):
                    self.queued_ticks.append(op)  # the link allows one queued behind this one
                elif isinstance(op, Admit):
                    await self._admit(op)
                elif isinstance(op, Cancel) and self.executor.cancel(op.lane, publish=op.publish):
                    await self.send(Emit(items=[[op.lane, -1, b"", "cancelled", None]]))
            if self.interrupt:
                interrupted = True
                # an Interrupt also voids ticks planned before the preemptor arrived
                while self.queued_ticks:
                    stale = self.queued_ticks.popleft()
                    await self.send(TickDone(seq=stale.seq, interrupted=True,
                                             prefill_left=self.executor.prefill_left()))
                break
            decoding = any(ln.pending == 1 for ln in self.executor.lanes.values())
            prefilling = budget > 0 and any(ln.pending > 1 for ln in self.executor.lanes.values())
            if not (prefilling or (decoding and rounds < tick.max_rounds)):
                break
            step_budget = budget if prefilling else 0
            step_cap = self._step_cap(tick.step_ms)
            t_step = trio.current_time()
            try:
                res = await trio.to_thread.run_sync(
                    lambda: self.executor.step(prefill_budget=step_budget, order=tick.prefill_lanes,
                                               max_step_tokens=step_cap)
                )
            except RuntimeError as exc:
                # the engine could not run the batch: fail every lane it held
                for tag in list(self.executor.lanes):
                    self.executor.cancel(tag, publish=False)
                    await self.send(Fault(lane=tag, kind="engine", message=str(exc)))
                break
            if res.prefill_tokens >= 32:
                per_token = (trio.current_time() - t_step) / res.prefill_tokens
                old = self.prefill_s_per_token
                self.prefill_s_per_token = per_token if not old else 0.7 * old + 0.3 * per_token
            budget -= res.prefill_tokens
            prefill += res.prefill_tokens
            decode += res.decode_tokens
            if res.decode_tokens:
                rounds += 1
            if res.emits:
                await self.send(Emit(items=res.emits))
            for tag, message in res.faults:
                await self.send(Fault(lane=tag, kind="lane", message=message))
            if trio.current_time() >= deadline:
                break
        await self.send(TickDone(
            seq=tick.seq, rounds=rounds, prefill_tokens=prefill, decode_tokens=decode,
            busy_ms=(trio.current_time() - t0) * 1000, interrupted=interrupted,
            prefill_left=self.executor.prefill_left(), kv_used=self.executor.kv_used(),
            kv_total=self.executor.pool_cells,
        ))

    def _step_cap(self, step_ms: int) -> int:
        """Prefill tokens one engine step may take: about ``step_ms`` of measured work."""
        if not self.prefill_s_per_token:
            return 256
        tokens = int(step_ms / 1000 / self.prefill_s_per_token) // 64 * 64
        return max(64, min(2048, tokens))

    async def serve_reader(self, recv: trio.abc.ReceiveStream, ops: trio.MemorySendChannel[Any],
                           cancel_scope: trio.CancelScope) -> None:
        async with ops:
            while True:
                event = self.link.next_event()
                if event is NEED_DATA:
                    data = await recv.receive_some(65536)
                    self.link.receive_data(data)
                    if not data:
                        cancel_scope.cancel()  # the daemon went away
                        return
                    continue
                if isinstance(event, Tokenize):
                    try:
                        toks = []
                        for i, (text, parse_special) in enumerate(event.segments):
                            toks += self.engine.tokenize(text, add_special=event.add_special and i == 0,
                                                         parse_special=parse_special)
                    except Exception as exc:  # boundary: answer with an empty list and a fault
                        toks = []
                        await self.send(Fault(lane=-1, kind="tokenize", message=str(exc)))
                    await self.send(Tokenized(req=event.req, tokens=toks))
                elif isinstance(event, Interrupt):
                    self.interrupt = True
                elif isinstance(event, Shutdown):
                    cancel_scope.cancel()
                    return
                else:
                    await ops.send(event)


async def _serve(args: argparse.Namespace, link_fd: int) -> int:
    recv = trio.lowlevel.FdStream(os.dup(0))
    out = trio.lowlevel.FdStream(link_fd)
    link = WorkerLink(WORKER, max_frame_size=DEFAULT_MAX_FRAME)
    # handshake: read Hello
    while True:
        event = link.next_event()
        if event is NEED_DATA:
            data = await recv.receive_some(65536)
            link.receive_data(data)
            continue
        break
    if not isinstance(event, Hello) or not event.min_version <= PROTOCOL_VERSION <= event.max_version:
        return 1
    try:
        engine = await trio.to_thread.run_sync(
            lambda: load_engine(args.runtime, args.model, max_batch=args.max_batch,
                                max_context=args.max_context, threads=args.threads)
        )
    except Exception as exc:  # boundary: any load failure is reported, typed, then exit 3
        await out.send_all(link.send(LoadFailed(message=f"{type(exc).__name__}: {exc}")))
        return 3
    executor = Executor(engine, max_lanes=args.max_batch, host_cache_bytes=args.host_cache_mb << 20)
    await out.send_all(link.send(HelloAck(
        version=PROTOCOL_VERSION, runtime=args.runtime, runtime_version=_runtime_version(args.runtime),
        model=engine.info.to_dict(), capabilities=engine.capabilities(),
        limits={"max_lanes": executor.max_lanes, "max_context": engine.info.n_ctx_seq,
                "max_frame": DEFAULT_MAX_FRAME, "n_seq": engine.info.n_seq},
    )))
    worker = _Worker(engine, executor, out, link, args.runtime)
    send_ops, recv_ops = trio.open_memory_channel[Any](64)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(worker.serve_engine, recv_ops)
        nursery.start_soon(worker.serve_reader, recv, send_ops, nursery.cancel_scope)
    return 0


def _runtime_version(runtime: str) -> str:
    if runtime == "llamacpp":
        try:
            import llama_cpp

            return str(llama_cpp.__version__)
        except ImportError:
            return "unavailable"
    from .. import __version__

    return __version__


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="superfluid-worker")
    parser.add_argument("name", help="superfluid-worker-<runtime>")
    parser.add_argument("--model", required=True)
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--max-context", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--host-cache-mb", type=int, default=0)
    try:
        args = parser.parse_args(argv)
    except SystemExit:
        return 2
    prefix = "superfluid-worker-"
    if not args.name.startswith(prefix) or args.name[len(prefix):] not in RUNTIMES:
        print(f"unknown worker name {args.name!r}", file=sys.stderr)
        return 2
    args.runtime = args.name[len(prefix):]
    args.threads = args.threads or (os.cpu_count() or 2)
    link_fd = os.dup(1)
    os.environ["SUPERFLUID_LINK_FD"] = str(link_fd)  # for the mock's garbage_after fault
    os.dup2(2, 1)  # stray prints from C libraries land on stderr, never on the link
    try:
        return trio.run(_serve, args, link_fd)
    except Exception as exc:  # boundary: the process; any failure here is a link failure
        print(f"superfluid worker: link failure: {exc!r}", file=sys.stderr)
        return 1
