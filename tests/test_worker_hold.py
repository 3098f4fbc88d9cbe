"""The worker's row hold (``--stream-interval-ms``): a lane's first and last
tokens go at once with that lane's held rows only; frames about one request
(``Admitted``, a tokenize answer) send no held rows; ``TickDone`` sends the watched
lanes' rows and the agent lanes' whose own hold is up."""

from __future__ import annotations

import collections
import os

from superfluid.proto import WORKER, Admitted, Emit, FrameDecoder, TickDone, WorkerLink, from_wire
from superfluid.proto._state import READY
from superfluid.worker._main import AGENT_HOLD_MAX_S, AGENT_HOLD_SLOTS, DUE, _Worker


def _frames(fd: int) -> list:
    decoder = FrameDecoder()
    try:
        decoder.receive_data(os.read(fd, 1 << 20))
    except BlockingIOError:
        return []
    out = []
    while (body := decoder.next_frame()) is not None:
        out.append(from_wire(body, max_len=1 << 24))
    return out


def test_only_the_urgent_lane_leaves_the_hold() -> None:
    r, w = os.pipe()
    os.set_blocking(r, False)
    link = WorkerLink(WORKER)
    link.state = READY                      # past the handshake, lanes 1 and 2 admitted
    link._lanes.update({1: False, 2: False, 3: False})
    link._ticks_in_flight = 1
    worker = _Worker(None, None, w, link, "mock", max_ops=8, hold_s=60.0, agent_hold_s=60.0)  # type: ignore[arg-type]
    try:
        worker.emit([[1, 10, b" a", None, None], [2, 20, b" b", None, None]])
        worker.emit([[1, 11, b" c", None, None], [2, 21, b" d", None, None]])
        assert _frames(r) == []             # held: nothing urgent, the hold is not up
        worker.send(Admitted(lane=3, cached=0), lanes=())
        assert _frames(r) == [Admitted(lane=3, cached=0)]   # a newcomer's admission takes no rows along
        worker.fresh.add(3)
        worker.emit([[3, 30, b" e", None, None], [1, 12, b" f", "length", None]])
        [emit] = _frames(r)                 # lane 3's first token and lane 1's end: at once, with lane 1's rows
        assert isinstance(emit, Emit)
        assert sorted(row[:2] for row in emit.items) == [(1, 10), (1, 11), (1, 12), (3, 30)]
        assert [row[1] for row in emit.items if row[0] == 1] == [10, 11, 12]   # a lane's rows in order
        worker.send(TickDone(seq=1))
        emit, done = _frames(r)             # the tick's end sends what is still held
        assert [row[:2] for row in emit.items] == [(2, 20), (2, 21)] and isinstance(done, TickDone)
    finally:
        os.close(r)
        os.close(w)


def test_an_interrupt_ends_the_tick_but_aborts_no_step() -> None:
    """Only an Admit of a more urgent class aborts a running prompt step (SPEC.md §5,
    "Aborted steps"). The daemon sends an Interrupt whenever a preemptor waits, also when
    its plan then admits nothing; when an Interrupt aborted the step too, every tick's
    step was aborted and a worker kill beside six chats hung (fuzz seed 3156)."""
    from superfluid.proto import Admit, Interrupt
    from superfluid.worker._main import NOTHING_ARRIVED

    worker = _Worker(None, None, -1, WorkerLink(WORKER), "mock", max_ops=8, hold_s=0.0, agent_hold_s=0.0)  # type: ignore[arg-type]
    worker.take_command(Interrupt())
    assert worker.interrupt and worker._arrived() == NOTHING_ARRIVED
    worker.take_command(Admit(lane=1, tokens=[5, 6], n_prompt=2, max_new=4, priority=0))
    assert worker._arrived() == 0 and worker.ops.qsize() == 1


def _held_worker(w: int, *, agent_hold_s: float) -> _Worker:
    link = WorkerLink(WORKER)
    link.state = READY
    link._lanes.update({lane: False for lane in range(1, 1100)})
    link._ticks_in_flight = 1
    return _Worker(None, None, w, link, "mock", max_ops=8, hold_s=60.0, agent_hold_s=agent_hold_s)  # type: ignore[arg-type]


def test_agent_lanes_wait_longer_with_many_lanes_and_not_all_at_once() -> None:
    """An agent lane's rows wait at least --agent-stream-interval-ms, longer with many agent
    lanes (up to a second), each lane until its own phase of the hold: at 1,024 lanes a 100 ms
    hold made ~1,600 chunks a second, and every frame woke every stream at once."""
    worker = _held_worker(-1, agent_hold_s=0.1)
    now = 1000.0
    worker.agents.update(range(1, 9))
    few = [worker._agent_due(lane, now) - now for lane in range(1, 9)]
    assert all(0 < d <= 0.1 + 1e-9 for d in few)              # 8 lanes: the configured hold...
    assert len({round(d, 6) for d in few}) == 1              # ...ending for all of them in one frame
    worker.agents.update(range(1, 1025))
    many = sorted(worker._agent_due(lane, now) - now for lane in range(1, 1025))
    assert 0 < many[0] and 0.9 < many[-1] <= AGENT_HOLD_MAX_S + 1e-9   # 1,024 lanes: up to a second
    # spread over the hold in AGENT_HOLD_SLOTS frames, each with about an equal share of the lanes
    # (one frame a lane's own phase would be a frame every round; all in one, a thousand wake-ups)
    shares = collections.Counter(round(d, 6) for d in many)
    assert len(shares) == AGENT_HOLD_SLOTS and max(shares.values()) < 1.3 * len(many) / AGENT_HOLD_SLOTS


def test_a_ticks_end_sends_watched_rows_and_only_the_agent_rows_that_are_due() -> None:
    r, w = os.pipe()
    os.set_blocking(r, False)
    worker = _held_worker(w, agent_hold_s=60.0)
    try:
        worker.agents.update({5, 6})
        worker.emit([[1, 10, b" a", None, None], [5, 50, b" b", None, None], [6, 60, b" c", None, None]])
        assert _frames(r) == []
        worker.send(TickDone(seq=1), lanes=DUE)
        emit, done = _frames(r)            # the watched lane's row goes with the tick's end...
        assert [row[:2] for row in emit.items] == [(1, 10)] and isinstance(done, TickDone)
        worker.emit([[5, 51, b" d", "length", None]])   # ...an agent's last token takes its held rows
        [emit] = _frames(r)
        assert [row[:2] for row in emit.items] == [(5, 50), (5, 51)]
        worker.agent_due[6] = 0.0          # lane 6's hold is up
        worker.agent_next = 0.0
        worker.link._ticks_in_flight = 1
        worker.send(TickDone(seq=2), lanes=DUE)
        emit, done = _frames(r)
        assert [row[:2] for row in emit.items] == [(6, 60)] and not worker.agent_rows
    finally:
        os.close(r)
        os.close(w)
