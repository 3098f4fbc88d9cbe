"""The worker process: one loaded model behind the worker link.

Command line (the daemon builds it; the ``superfluid-worker-<runtime>`` word is
there so ``pgrep -f`` finds workers)::

    python -m superfluid.worker superfluid-worker-<runtime> --model M [--max-batch N] [--max-context N]

The link runs over stdin (daemon -> worker) and the original stdout (worker ->
daemon). File descriptor 1 is re-pointed at stderr before the runtime loads,
so nothing a C library prints can corrupt the link.

One nursery, two tasks: the *reader* decodes frames and answers tokenize
requests itself; Admit/Cancel/Tick go to the *engine thread* over a queue the
protocol bounds; an Interrupt sets a flag the engine thread checks between
steps. The engine thread owns the executor and writes its own answers (see
:class:`_Worker`).

Exit codes: 0 clean shutdown, 2 bad command line, 3 model did not load, 1 link failure.
"""

from __future__ import annotations

import argparse
import collections
import importlib
import json
import math
import os
import queue
import signal
import sys
import threading
import time
from functools import partial
from pathlib import Path
from typing import Any

import trio

from .. import _defaults as D
from ..proto import (
    DEFAULT_MAX_FRAME,
    FAULT_BUG,
    NEED_DATA,
    PROTOCOL_VERSION,
    WORKER,
    Admit,
    Admitted,
    Cancel,
    Embed,
    Embedded,
    Emit,
    Fault,
    Hello,
    HelloAck,
    Interrupt,
    LoadFailed,
    ProtocolError,
    Shutdown,
    Telemetry,
    Tick,
    TickDone,
    Tokenize,
    SlotAction,
    SlotDone,
    Tokenized,
    WorkerLink,
    embedded_pieces,
    tokenized_pieces,
)
from .._cpu import reset_policy
from ..runtime import _registry as registry
from ._engine import Engine
from ._executor import PREFILL_CHUNK, Executor
from ._mock import InjectedBug
from ._park import ParkStore
from ..proto import SPEC_DIRECTIVES, SPEC_FLAGS, SpecConfig

INJECTED_BUG = InjectedBug.__name__ + ":"  # how the executor words a lane fault of that type

__all__ = ["load_engine", "main"]

PARK_CLOSE_S = 3.0      # at exit, queued parks may take this long to reach the disk

_STOP = object()  # queued by the reader when the link ends: the engine thread returns

GIL_SWITCH_S = 0.0005   # see main()
INLINE_TOKENIZE = 1 << 16  # prompt characters tokenized on the reader; longer prompts go to a thread
AGENT_PRIORITY = 2      # Admit.priority of the agent class (QosClass.AGENT); background is 3
NOTHING_ARRIVED = 1 << 30   # ``_Worker.arrived`` when no Admit came in
EXIT_GRACE_ENV = "SUPERFLUID_WORKER_EXIT_GRACE_S"
EXIT_ENGINE_STUCK = 4   # the exit status when the engine outlived the link's end by the grace
# A prefill step's size when no more urgent lane is decoding: on an engine that can abort a pass (a
# more urgent arrival stops it: Executor.step's ``arrived``) its batch (``Executor.abortable_step``:
# llama.cpp's n_batch, 2,048 tokens in 512-token micro-batches, so a decode round comes between
# 2,048 prompt tokens as in llama-server; others 512), else about BIG_STEP_MS of measured work,
# 256-512 tokens. On SmolLM2, 2 cores (bench/chunk_shape.py), tokens/s
# over positions 0-2k / 2k-4k / 4k-6k by chunk: 64: 142/81/46, 256: 163/93/62, 512: 169/92/64,
# 1024: 141/88/59.
BIG_STEP_MS = 4000
BIG_STEP_MIN = 256
# An agent lane's rows wait at least --agent-stream-interval-ms, and this much per open agent
# lane, up to AGENT_HOLD_MAX_S (Worker._agent_due)
AGENT_HOLD_PER_LANE_S = 0.001
AGENT_HOLD_MAX_S = 1.0
# the lanes' waits end at one phase of a hold rounded up to AGENT_HOLD_GRAIN_S per
# AGENT_HOLD_SLOT_LANES open agent lanes (at most AGENT_HOLD_SLOTS), so lanes share frames: a phase
# of its own per lane sent a frame a round, and at 64 lanes the daemon paid more per frame (its
# commits) than the hold saved (32 -> 40 µs a token)
AGENT_HOLD_SLOTS = 4
AGENT_HOLD_SLOT_LANES = 256
AGENT_HOLD_GRAIN_S = 0.05
_GOLDEN = 0.6180339887498949


class _Due:
    """``send(..., lanes=DUE)``: the held rows whose wait is up go first (a tick's end)."""


DUE = _Due()


def load_engine(runtime: str, model: str, *, max_batch: int, max_context: int, threads: int,
                deterministic: bool = False, pooling: str = "", basert_lib: str | None = None,
                kv_bits: int = 16) -> Engine:
    """Import the runtime's engine module (the registry names it) and open the model with it.
    ``kv_bits`` other than 16 is llama.cpp's only (a quantised KV cache); another runtime refuses it."""
    info = registry.get(runtime)
    if info.engine is None:
        raise ValueError(f"runtime {info.id} has no engine in this build")
    if kv_bits != 16 and info.id != "llamacpp":
        raise ValueError(f"--kv-bits {kv_bits}: the {info.id} runtime's KV cache is 16-bit only")
    module = importlib.import_module(info.engine)
    return module.open_engine(model, max_batch=max_batch, max_context=max_context, threads=threads,  # type: ignore[no-any-return]
                              deterministic=deterministic, **({'lib': basert_lib} if basert_lib else {}),
                              **({'pooling': pooling} if pooling else {}),
                              **({'kv_bits': kv_bits} if kv_bits != 16 else {}))


class _Worker:
    """The worker's two halves.

    The *engine thread* owns the executor for the worker's life: it takes
    Admit/Cancel/Tick from ``ops`` (a queue the protocol bounds), runs ticks
    step after step and writes its answers (Admitted, Emit, Fault, TickDone)
    to the link itself. A decode round therefore costs no thread hop: on this
    class of machine waking another thread costs 0.3-0.8 ms, about 8% of a
    single-lane round, and the trio side would pay two per round.

    The *reader* (a trio task) decodes frames, answers Tokenize itself, sets
    the interrupt flag, and queues everything else for the engine thread.
    ``link_lock`` serializes the link's state machine between the two;
    ``write_lock`` keeps frames whole and in order on the pipe.
    """

    def __init__(self, engine: Engine, executor: Executor, link_fd: int, link: WorkerLink, runtime: str,
                 *, max_ops: int, hold_s: float, agent_hold_s: float) -> None:
        self.engine = engine
        self.executor = executor
        self.link = link
        self.fd = link_fd
        self.runtime = runtime
        self.link_lock = threading.Lock()
        self.write_lock = threading.Lock()
        self.ops: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.max_ops = max_ops
        self.interrupt = False
        # the most urgent Admit.priority that arrived since the engine last looked; a prefill
        # step of less urgent lanes is aborted when it drops below theirs
        self.arrived = NOTHING_ARRIVED
        # token rows not sent yet (under write_lock), apart by how long they may wait: rows of
        # lanes a person watches (interactive, completion) in one list, ``hold_s`` from the first;
        # agent and background lanes' rows per lane, each lane until its own ``agent_due``
        self.hold_s = hold_s
        self.agent_hold_s = agent_hold_s
        self.held: list[list[Any]] = []
        self.held_since = 0.0
        self.agent_rows: dict[int, list[list[Any]]] = {}
        self.agent_due: dict[int, float] = {}
        self.agent_next = math.inf   # the earliest agent_due
        self.agents: set[int] = set()     # open lanes of the agent and background classes
        self.fresh: set[int] = set()      # lanes admitted that have not emitted a token yet
        self.queued_ticks: collections.deque[Tick] = collections.deque()
        self.prefill_s_per_token = 0.0   # measured; sizes prefill steps

    # -- the link (either thread) --------------------------------------------------

    def send(self, event: Any, *, lanes: tuple[int, ...] | None | _Due = None) -> None:
        """Encode and write one frame, after held token rows (order is kept):
        all of them, only those of the lanes the frame is about (``lanes``),
        or (``DUE``, a tick's end) those whose wait is up: every watched lane's
        and the agent lanes' whose own hold is over. ``Admitted`` and
        ``Tokenized`` take none: they arrive once per request, and at 256
        lanes flushing on each of them sent ~4 tokens a chunk instead of a
        hold's worth."""
        with self.write_lock:
            self._write([*self._take_held(lanes), event])

    def emit(self, rows: list[list[Any]], *, hold: bool = False) -> None:
        """Send a step's token rows, or hold them for the next frame
        (``hold``: a frame follows at once, the tick's ``TickDone``).

        Every frame wakes the daemon, and every chunk wakes a client; on two
        cores their Python (~1 ms for a round of 8 one-token chunks, the
        client's as much again) lands on the engine's critical path. So rows
        wait up to ``hold_s`` (``--stream-interval-ms``) to go out together.
        Rows of agent and background lanes, read by programs rather than
        people, wait per lane (see ``_agent_due``): at least ``agent_hold_s``
        (``--agent-stream-interval-ms``), longer with many such lanes, and the
        lanes' waits end spread over the hold, not all in one frame.
        A lane's first token after its admission and a lane's last token go
        at once, with that lane's held rows (time to first text and the end of
        a request never wait); the other lanes' rows keep waiting: flushing
        everything on every first or last token sent ~4 tokens a chunk at 256
        lanes, where lanes start and end all the time. Any other frame sends
        the held rows first.
        """
        now = time.monotonic()
        with self.write_lock:
            urgent: set[int] = set()
            agents, agent_rows = self.agents, self.agent_rows
            for row in rows:
                lane = row[0]
                if lane in agents:
                    mine = agent_rows.get(lane)
                    if mine is None:
                        agent_rows[lane] = [row]
                        due = self.agent_due[lane] = self._agent_due(lane, now)
                        self.agent_next = min(self.agent_next, due)
                    else:
                        mine.append(row)
                else:
                    if not self.held:
                        self.held_since = now
                    self.held.append(row)
                if lane in self.fresh:
                    urgent.add(lane)
                    if row[2]:  # the first token with text: an end-of-generation piece shows nothing
                        self.fresh.discard(lane)
                if row[3] is not None:
                    urgent.add(lane)
                    self.fresh.discard(lane)
                    agents.discard(lane)
            if hold:
                return
            out: list[Any] = []
            if self.held:
                if now - self.held_since >= self.hold_s:
                    out, self.held = self.held, []
                elif urgent:
                    keep = []
                    for row in self.held:
                        (out if row[0] in urgent else keep).append(row)
                    self.held = keep  # held_since stays: the rest may go a little early, never late
            if agent_rows:
                for lane in urgent:
                    if lane in agent_rows:
                        out += self._pop_agent(lane)
                out += self._agents_due(now)
            if out:
                self._write([Emit(items=out)])

    def _agent_due(self, lane: int, now: float) -> float:
        """When an agent lane's rows held from ``now`` go out. The hold is ``agent_hold_s``,
        growing by AGENT_HOLD_PER_LANE_S a lane up to AGENT_HOLD_MAX_S: each chunk costs
        the daemon a wake-up of the request's stream (~0.4 ms of its Python all told), and at
        1,024 lanes a 100 ms hold made ~1,600 chunks a second, each of 5-6 tokens. A lane ends
        its wait at one of up to AGENT_HOLD_SLOTS phases of the hold, one per 256 lanes (lane ids
        spread by the golden ratio), so a frame carries at most a few hundred lanes' rows rather
        than a thousand: a new request's steps are not queued behind a thousand streams'
        wake-ups at the same moment."""
        hold = self.agent_hold_s
        if hold <= 0:
            return now
        n = len(self.agents)
        hold = max(hold, min(AGENT_HOLD_MAX_S, n * AGENT_HOLD_PER_LANE_S))
        hold = math.ceil(hold / AGENT_HOLD_GRAIN_S - 1e-9) * AGENT_HOLD_GRAIN_S
        slots = min(AGENT_HOLD_SLOTS, -(-n // AGENT_HOLD_SLOT_LANES)) or 1
        phase = int(lane * _GOLDEN % 1.0 * slots) / slots
        return (math.floor(now / hold + phase) + 1 - phase) * hold

    def _pop_agent(self, lane: int) -> list[list[Any]]:
        self.agent_due.pop(lane, None)
        return self.agent_rows.pop(lane, [])

    def _agents_due(self, now: float) -> list[list[Any]]:
        if now < self.agent_next:
            return []
        out: list[list[Any]] = []
        nxt = math.inf
        for lane, due in list(self.agent_due.items()):
            if due <= now:
                out += self._pop_agent(lane)
            elif due < nxt:
                nxt = due
        self.agent_next = nxt
        return out

    def _take_held(self, lanes: tuple[int, ...] | None | _Due = None) -> list[Any]:
        if not (self.held or self.agent_rows):
            return []
        if lanes is None:
            rows = self.held
            for mine in self.agent_rows.values():
                rows += mine
            self.held, self.agent_rows, self.agent_due, self.agent_next = [], {}, {}, math.inf
        elif isinstance(lanes, _Due):
            rows, self.held = self.held, []
            if self.agent_rows:
                rows += self._agents_due(time.monotonic())
        else:
            rows = [row for row in self.held if row[0] in lanes]
            if rows:
                self.held = [row for row in self.held if row[0] not in lanes]
            for lane in lanes:
                if lane in self.agent_rows:
                    rows += self._pop_agent(lane)
        return [Emit(items=rows)] if rows else []

    def _write(self, events: list[Any]) -> None:
        with self.link_lock:
            data = b"".join(self.link.send(event) for event in events)
        try:
            _write_all(self.fd, data)
        except BaseException:
            with self.link_lock:
                self.link.send_failed()
            raise

    def put(self, op: Any) -> None:
        """Queue ``op`` for the engine thread. The daemon keeps at most two
        ticks and one admit or cancel per lane outstanding, so a longer queue
        is a broken peer."""
        if self.ops.qsize() >= self.max_ops:
            raise ProtocolError(f"more than {self.max_ops} operations queued for the engine")
        self.ops.put(op)

    # -- the engine thread -----------------------------------------------------------

    def run_engine(self) -> None:
        """The engine thread's loop; returns when ``_STOP`` is taken."""
        try:
            while True:
                if self._apply(self.ops.get()):
                    return
                # ticks run back to back; one arriving mid-tick waits in queued_ticks
                while self.queued_ticks:
                    if self._tick(self.queued_ticks.popleft()):
                        return
        finally:
            self.executor.close()
            if self.executor.park is not None:
                self.executor.park.close(timeout=PARK_CLOSE_S)   # what is queued is written, within reason

    def _apply(self, op: Any) -> bool:
        """Apply one queued op; True when it is ``_STOP``."""
        if op is _STOP:
            return True
        if isinstance(op, Tick):
            self.queued_ticks.append(op)  # the link allows one queued behind the running one
        elif isinstance(op, Admit):
            try:
                lane = self.executor.admit(op)
            except ValueError as exc:
                self.send(Fault(lane=op.lane, kind="admit", message=str(exc)), lanes=(op.lane,))
            else:
                with self.write_lock:
                    self.fresh.add(op.lane)
                    if op.priority >= AGENT_PRIORITY:
                        self.agents.add(op.lane)
                self.send(Admitted(lane=op.lane, cached=lane.cached, seq=lane.seq), lanes=())
        elif isinstance(op, SlotAction):   # between steps: the sequence's KV is still
            status, error, message, tokens, nbytes = self.executor.slot_action(
                op.action, op.seq, op.filename, op.cache_salt)
            self.send(SlotDone(req=op.req, tokens=tokens, nbytes=nbytes, status=status, error=error,
                               message=message), lanes=())
        elif isinstance(op, Cancel) and self.executor.cancel(op.lane, publish=op.publish):
            self._ended(op.lane)
            self.send(Emit(items=[[op.lane, -1, b"", "cancelled", None]]), lanes=(op.lane,))
        return False

    def park_written(self) -> None:
        """The park store's index was read (at start) or its writer thread stored an artifact:
        its counts go out now as droppable ``Telemetry`` (no held token rows with it), not with
        a tick the model may never run."""
        park = self.executor.park
        if park is None:
            return
        try:
            self.send(Telemetry(values=park.telemetry()), lanes=())
        except Exception:  # noqa: BLE001 - droppable by definition: a link that ended takes none
            pass

    def _ended(self, lane: int) -> None:
        with self.write_lock:
            self.fresh.discard(lane)
            self.agents.discard(lane)

    def _tick(self, tick: Tick) -> bool:
        """Run one tick; True when ``_STOP`` arrived meanwhile."""
        t0 = time.monotonic()
        deadline = t0 + tick.time_budget_ms / 1000
        budget = tick.prefill_budget
        rounds = prefill = decode = aborted = 0
        interrupted = stop = False
        self.interrupt = False
        while True:
            # admits and cancels that arrived mid-tick apply between steps
            self.arrived = NOTHING_ARRIVED
            while not stop:
                try:
                    op = self.ops.get_nowait()
                except queue.Empty:
                    break
                stop = self._apply(op)
            if stop:
                return True
            if self.interrupt:
                interrupted = True
                # an Interrupt also voids ticks planned before the preemptor arrived
                while self.queued_ticks:
                    stale = self.queued_ticks.popleft()
                    self.send(TickDone(seq=stale.seq, interrupted=True, prefill_left=self.executor.prefill_left()),
                              lanes=DUE)
                break
            lanes = self.executor.lanes.values()
            decoding = any(ln.decoding for ln in lanes)
            prefilling = budget > 0 and any(ln.prefilling for ln in lanes)
            if not (prefilling or (decoding and rounds < tick.max_rounds)):
                break
            t_step = time.monotonic()
            # an engine that can abort a pass takes whole micro-batches: a more urgent arrival stops it
            big_step = self.executor.abortable_step if self.executor.aborts else self._step_cap(
                BIG_STEP_MS, floor=BIG_STEP_MIN, ceiling=PREFILL_CHUNK)
            try:
                res = self.executor.step(prefill_budget=budget if prefilling else 0, order=tick.prefill_lanes,
                                         max_step_tokens=big_step,
                                         yield_step_tokens=self._step_cap(tick.step_ms),
                                         arrived=self._arrived)
            except RuntimeError as exc:
                # the engine could not run the batch: fail every lane it held
                for tag in list(self.executor.lanes):
                    self.executor.cancel(tag, publish=False)
                    self._ended(tag)
                    self.send(Fault(lane=tag, kind="engine", message=str(exc)))
                break
            # the tick's last step: its rows go out with the TickDone that follows (one write)
            ending = time.monotonic() >= deadline
            if res.aborted:
                aborted += 1   # a more urgent job arrived: it is applied before the next step
                continue
            if res.emits:
                self.emit(res.emits, hold=ending)
            for tag, message in res.faults:
                self._ended(tag)
                kind = FAULT_BUG if message.startswith(INJECTED_BUG) else "lane"
                self.send(Fault(lane=tag, kind=kind, message=message), lanes=(tag,))
            if res.prefill_tokens >= 32:
                per_token = (time.monotonic() - t_step) / res.prefill_tokens
                old = self.prefill_s_per_token
                self.prefill_s_per_token = per_token if not old else 0.7 * old + 0.3 * per_token
            budget -= res.prefill_tokens
            prefill += res.prefill_tokens
            decode += res.decode_tokens
            if res.decode_tokens:
                rounds += 1
            if ending:
                break
        self.send(TickDone(
            seq=tick.seq, rounds=rounds, prefill_tokens=prefill, decode_tokens=decode,
            busy_ms=(time.monotonic() - t0) * 1000, interrupted=interrupted,
            prefill_left=self.executor.prefill_left(), kv_used=self.executor.kv_used(),
            kv_total=self.executor.pool_cells, aborted=aborted,
            spec=self.executor.gates.snapshot() if self.executor.gates is not None else {},
            park=self.executor.park.snapshot() if self.executor.park is not None else {},
        ), lanes=DUE)
        return False

    def _step_cap(self, step_ms: int, *, floor: int = 64, ceiling: int = 2048) -> int:
        """Prefill tokens one engine step may take: about ``step_ms`` of measured work,
        in multiples of 64 within ``[floor, ceiling]``."""
        if not self.prefill_s_per_token:
            return max(floor, min(ceiling, 256))
        tokens = int(step_ms / 1000 / self.prefill_s_per_token) // 64 * 64
        return max(floor, min(ceiling, tokens))

    def _arrived(self) -> int:
        return self.arrived

    # -- the reader (trio) -----------------------------------------------------------

    def _tokenized(self, event: Tokenize) -> list[Any]:
        try:
            toks = list(event.ids)
            for i, (text, parse_special) in enumerate(event.segments):
                toks += self.engine.tokenize(text, add_special=event.add_special and i == 0,
                                             parse_special=parse_special)
            pieces = [self.engine.piece(t) for t in toks] if event.pieces or event.ids else None
        except Exception as exc:  # noqa: BLE001 - boundary: answer with an empty list and a fault
            return [Fault(lane=-1, kind="tokenize", message=str(exc)), Tokenized(req=event.req, tokens=[])]
        return tokenized_pieces(event.req, toks, pieces)

    def _answer_tokenize(self, event: Tokenize) -> None:
        for answer in self._tokenized(event):
            self.send(answer, lanes=())

    def _write_answers(self, answers: list[Any]) -> None:
        with self.write_lock:
            self._write(answers)

    def _answer_embed(self, event: Embed) -> None:
        """Embed on this (a worker) thread: the engine's embedding context is its own, so
        it runs beside the engine thread's decoding (both share the CPU)."""
        try:
            dim, vectors = self.engine.embed([list(t) for t in event.inputs], normalize=event.normalize)
        except Exception as exc:  # noqa: BLE001 - boundary: the request fails with the reason
            answers: list[Any] = [Embedded(req=event.req, error=str(exc) or type(exc).__name__)]
        else:
            answers = list(embedded_pieces(event.req, dim, vectors))
        for answer in answers:
            self.send(answer)

    async def serve_engine(self) -> None:
        # not abandoned on cancel: the thread ends at its next step once the reader queues _STOP
        await trio.to_thread.run_sync(self.run_engine)

    async def serve_reader(self, recv: trio.abc.ReceiveStream) -> None:
        try:
            async with trio.open_nursery() as tokenize_nursery:
                await self._read(recv, tokenize_nursery)
        finally:
            self.ops.put(_STOP)

    async def _read(self, recv: trio.abc.ReceiveStream, tokenize_nursery: trio.Nursery) -> None:
        """Read frames until the daemon goes away or says Shutdown. A long
        prompt is tokenized on a thread in ``tokenize_nursery`` (one at a time),
        so Ticks and Cancels keep flowing to the engine meanwhile."""
        limiter = trio.CapacityLimiter(1)
        embed_limiter = trio.CapacityLimiter(1)  # one embedding batch at a time: it takes every core
        answers: list[Any] = []   # short prompts' answers, written together once the frames read are done
        while True:
            with self.link_lock:
                event = self.link.next_event()
            if answers and not isinstance(event, Tokenize):
                self._write_answers(answers)
                answers = []
            if event is NEED_DATA:
                data = await recv.receive_some(65536)
                with self.link_lock:
                    self.link.receive_data(data)
                if not data:
                    return  # the daemon went away
                continue
            if isinstance(event, Tokenize) and (sum(len(text) for text, _ in event.segments)
                                                + len(event.ids)) > INLINE_TOKENIZE:
                tokenize_nursery.start_soon(partial(trio.to_thread.run_sync, self._answer_tokenize, event,
                                                    limiter=limiter))
            elif isinstance(event, Tokenize):
                # answered from this thread (a hop to a thread costs ~1 ms), and the answers to the
                # tokenizes that arrived together in one write: the write waits for the lock while
                # the engine thread writes its rows, and at 1,024 lanes one write per answer let
                # ~500 tokenizes queue here (a chat's first token waited 0.5-1.4 s behind them)
                answers += self._tokenized(event)
            elif isinstance(event, Embed):
                tokenize_nursery.start_soon(partial(trio.to_thread.run_sync, self._answer_embed, event,
                                                    limiter=embed_limiter))
            elif isinstance(event, Shutdown):
                return
            else:
                self.take_command(event)

    def take_command(self, event: Any) -> None:
        """The reader's part for an Interrupt, Admit, Cancel or Tick.

        An Admit of a more urgent class aborts the running prompt step (``arrived``). An
        Interrupt only ends the running tick after its step: the daemon sends one whenever a
        preemptor waits, also when its plan then admits nothing (a suspect on probation, a
        capped class), and aborting every step then left the lanes no progress at all (fuzz
        seed 3156: six chats and a worker kill hung). A preemption reaches the worker as a
        Cancel and the preemptor's Admit, and that Admit aborts the step."""
        if isinstance(event, Interrupt):
            self.interrupt = True
            return
        self.put(event)
        if isinstance(event, Admit):
            # after the put: the engine resets ``arrived`` before it takes the queued ops,
            # so an Admit it has not taken always aborts (an Admit it took may abort once more)
            self.arrived = min(self.arrived, event.priority)


async def _serve(args: argparse.Namespace, link_fd: int) -> int:
    recv = trio.lowlevel.FdStream(os.dup(0))
    os.set_blocking(link_fd, True)  # frames go out with plain blocking writes, from either thread
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
                                max_context=args.max_context, threads=args.threads,
                                deterministic=args.deterministic, pooling=args.pooling,
                                basert_lib=args.basert_lib, kv_bits=args.kv_bits)
        )
    except Exception as exc:  # noqa: BLE001 - boundary: any load failure is reported, typed, then exit 3
        failed = LoadFailed(message=f"{type(exc).__name__}: {exc}")
        await trio.to_thread.run_sync(_write_all, link_fd, link.send(failed))
        return 3
    speculate, said = resolve_speculation(args, engine)
    if speculate is None and args.speculate == "prompt-lookup":
        failed = LoadFailed(message=f"--speculate prompt-lookup: {said}")
        await trio.to_thread.run_sync(_write_all, link_fd, link.send(failed))
        return 3
    park = None
    if args.park_dir and args.park_budget_mb > 0 and getattr(engine, "parks", False) is not True:
        print(f"superfluid worker: --park: the {args.runtime} runtime cannot write this model's KV state "
              "as bytes; parking is off for this model", file=sys.stderr, flush=True)
    elif args.park_dir and args.park_budget_mb > 0:
        park = await trio.to_thread.run_sync(lambda: ParkStore(
            Path(args.park_dir), args.park_budget_mb << 20, park_identity(args, engine),
            drop_covered=engine.info.kv_layout == "per_seq"))
    executor = Executor(engine, max_lanes=args.max_batch, host_cache_bytes=args.host_cache_mb << 20,
                        deterministic=args.deterministic, speculate=speculate, park=park)
    await trio.to_thread.run_sync(_write_all, link_fd, link.send(HelloAck(
        version=PROTOCOL_VERSION, runtime=args.runtime, runtime_version=_runtime_version(args.runtime),
        model=engine.info.to_dict(), capabilities={**engine.capabilities(), "speculation": said},
        limits={"max_lanes": executor.max_lanes, "max_context": engine.info.n_ctx_seq,
                "max_frame": DEFAULT_MAX_FRAME, "n_seq": engine.info.n_seq},
    )))
    worker = _Worker(engine, executor, link_fd, link, args.runtime, max_ops=4 * executor.max_lanes + 16,
                     hold_s=max(0, args.stream_interval_ms) / 1000,
                     agent_hold_s=max(0, args.agent_stream_interval_ms) / 1000)
    if park is not None:
        park.on_change = worker.park_written
        worker.park_written()   # what the index found (bytes on disk, refused files) shows before any lane runs
    engine_done = trio.Event()

    async def serve_engine() -> None:
        try:
            await worker.serve_engine()
        finally:
            engine_done.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve_engine)
        await worker.serve_reader(recv)
        # The link ended (Shutdown, or the daemon is gone): the engine thread stops at its
        # next step. One stuck inside a runtime call never gets there, and a thread cannot be
        # cancelled, so after the grace the process ends itself rather than outlive its daemon.
        with trio.move_on_after(args.exit_grace_s):
            await engine_done.wait()
        if not engine_done.is_set():
            print(f"superfluid worker: the engine did not stop within {args.exit_grace_s:g}s of the link's"
                  " end; exiting", file=sys.stderr, flush=True)
            os._exit(EXIT_ENGINE_STUCK)
    return 0


def resolve_speculation(args: argparse.Namespace, engine: Engine) -> tuple[SpecConfig | None, str]:
    """``--speculate`` for this worker's model: the config to run, and what to say
    (``prompt-lookup``, or why it decodes plainly, in the runtime's words)."""
    if args.speculate == "off":
        return None, "off"
    if args.deterministic:
        return None, ("deterministic mode computes every KV entry in one fixed shape; a verified draft is "
                      "computed in another")
    drafts = getattr(engine, "drafts", False)
    if drafts is not True:
        return None, str(drafts or f"the {args.runtime} runtime cannot verify drafts")
    given = [(flag, value) for name, flag in SPEC_FLAGS.items() if (value := getattr(args, f"spec_{name}")) is not None]
    try:
        config = SpecConfig.from_argv([x for pair in given for x in pair])
    except ValueError as exc:
        return None, f"bad speculation flags: {exc}"
    return config, "prompt-lookup"


def park_identity(args: argparse.Namespace, engine: Engine) -> str:
    """What a parked state depends on besides its tokens and salt: the model file (its real path,
    size and mtime; a model directory's (MLX): each of its files'; a spec that is no file, as the
    mock's, as given), the runtime and its build, and the KV's shape (layout, type, sliding
    window, deterministic mode's kernels)."""
    model = args.model
    try:
        st = os.stat(model)
        model = f"{os.path.realpath(model)}:{st.st_size}:{st.st_mtime_ns}"
        if os.path.isdir(args.model):
            files = sorted(p for p in Path(args.model).iterdir() if p.is_file())
            model += "".join(f"|{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in files)
    except OSError:
        pass
    extra = engine.info.extra
    kv = {k: extra[k] for k in ("kv_type", "kv_unified", "n_swa", "deterministic") if k in extra}
    return json.dumps({"model": model, "runtime": args.runtime, "build": _runtime_version(args.runtime),
                       "arch": engine.info.architecture, "n_vocab": engine.info.n_vocab,
                       "layout": engine.info.kv_layout, "kv": kv, "deterministic": bool(args.deterministic)},
                      sort_keys=True, separators=(",", ":"))


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _runtime_version(runtime: str) -> str:
    """The version of the runtime's library (its first required module), or superfluid's."""
    info = registry.get(runtime)
    if info.requires:
        try:
            module = importlib.import_module(info.requires[0])
        except ImportError:
            return "unavailable"
        return str(getattr(module, "__version__", "unknown"))
    from .. import __version__

    return __version__


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["check"]:
        from ._check import check

        return check(argv[1:])
    parser = argparse.ArgumentParser(prog="superfluid-worker")
    parser.add_argument("name", help="superfluid-worker-<runtime>")
    parser.add_argument("--model", required=True)
    parser.add_argument("--max-batch", type=int, default=D.MAX_BATCH)
    parser.add_argument("--max-context", type=int, default=D.MAX_CONTEXT)
    parser.add_argument("--threads", type=int, default=D.THREADS)
    parser.add_argument("--host-cache-mb", type=int, default=0)  # off unless the daemon asks
    parser.add_argument("--kv-bits", type=int, choices=(16, 8), default=16)   # 8: q8_0 K and V (llama.cpp)
    parser.add_argument("--park-dir", default="")          # --park: finished sequences' KV on disk here
    parser.add_argument("--park-budget-mb", type=int, default=0)
    parser.add_argument("--stream-interval-ms", type=int, default=D.STREAM_INTERVAL_MS)
    parser.add_argument("--agent-stream-interval-ms", type=int, default=D.AGENT_STREAM_INTERVAL_MS)
    parser.add_argument("--deterministic", action="store_true")
    parser.add_argument("--pooling", choices=("", "mean", "cls", "last"), default="")
    parser.add_argument("--speculate", choices=SPEC_DIRECTIVES, default="off")
    for name, flag in SPEC_FLAGS.items():   # as the daemon passes them (SpecConfig.to_argv); unset: the default
        parser.add_argument(flag, dest=f"spec_{name}", default=None)
    parser.add_argument("--basert-lib", default=None, help="libbasert to load (else $BASERT_LIB)")
    parser.add_argument("--exit-grace-s", type=float,
                        default=float(os.environ.get(EXIT_GRACE_ENV) or D.WORKER_EXIT_GRACE_S),
                        help="after the link ends, how long the engine may take to stop before the process exits")
    try:
        args = parser.parse_args(argv)
    except SystemExit:
        return 2
    prefix = "superfluid-worker-"
    if not args.name.startswith(prefix) or args.name[len(prefix):] not in registry.RUNTIMES:
        print(f"unknown worker name {args.name!r}", file=sys.stderr)
        return 2
    args.runtime = args.name[len(prefix):]
    # Two threads share the GIL: the engine thread (Python between llama.cpp calls) and the
    # reader. A thread that wants the GIL waits up to the switch interval (5 ms by default)
    # for the holder to let go; at 0.5 ms the engine's writes and the reader's answers stop
    # waiting out whole engine steps.
    sys.setswitchinterval(GIL_SWITCH_S)
    reset_policy()  # the engine never yields: the daemon may have spawned us while it ran SCHED_BATCH
    args.threads = args.threads or (os.cpu_count() or 2)
    # Ctrl-C in a terminal signals the whole process group: the daemon alone decides when
    # a worker stops (it ends its streams typed first, then sends Shutdown)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    link_fd = os.dup(1)
    os.environ["SUPERFLUID_LINK_FD"] = str(link_fd)  # for the mock's garbage_after fault
    os.dup2(2, 1)  # stray prints from C libraries land on stderr, never on the link
    try:
        return trio.run(_serve, args, link_fd)
    except Exception as exc:  # noqa: BLE001 - boundary: the process; any failure here is a link failure
        print(f"superfluid worker: link failure: {exc!r}", file=sys.stderr)
        return 1
