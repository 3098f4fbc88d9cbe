"""Subscribe: watch a conversation's committed events and its running turn's text live.

One watch is a :class:`~superfluid.sessions._conversations.Watcher` (a bounded
queue the conversation store pushes every committed event into) plus, in a
nursery the watch owns, one task that follows the running turn's generation
and pushes its text as ``provisional`` deltas (waiting while the queue is half
full, so text coalesces instead of lagging). A subscriber reads frames:

* ``("committed", event)``: one event as ``/events`` gives it (ids after the
  cursor, each once: the backlog from the log, then live, deduplicated);
* ``("provisional", {turn, text})``: the running turn's text, as deltas;
* ``("ended", {reason})`` last: ``lagged`` (the queue filled: re-subscribe from
  the last event id seen), ``purged``, ``shutdown``.

Used by ``GET /v1/sessions/{id}/subscribe`` (SSE), the WebSocket ``subscribe``
op on a conversation and the unix socket.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import trio

from ..proto._wal import TURN
from ._chat import openai_delta
from ._http import ApiError
from ._turns import LAND_WAIT_S, load_turn, turn_reader

if TYPE_CHECKING:
    from ..proto._wal import WalRecord
    from ..sessions._conversations import Watcher
    from ._host import App

__all__ = ["Emit", "event_of", "watch"]

Emit = Callable[[str, dict[str, Any]], Awaitable[None]]


def event_of(rec: WalRecord) -> dict[str, Any]:
    """One event as ``GET /v1/sessions/{id}/events`` gives it."""
    return {"id": rec.event_id, "type": rec.body["type"], "ts": rec.ts, **rec.body}


async def watch(app: App, cid: str, after: int, emit: Emit) -> None:
    """Send one subscription to conversation ``cid`` from event cursor ``after``: each
    frame ``(kind, data)`` goes to ``emit``, ``ended`` last; returns after it.

    Cancellation: cancelling ends the watch and its turn follower; nothing else
    is touched.

    Resource handling: the follower runs in a nursery this call owns.
    """
    store = app.conversations
    with store.watching(cid) as watcher:
        slog = store.get(cid)
        if slog is None:
            await emit("ended", {"reason": "purged"})
            return
        backlog = slog.records(after)
        open_turn = slog.open_turn
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_end_at_shutdown, app, watcher)
            if open_turn >= 0:
                nursery.start_soon(_provisional, app, watcher, cid, open_turn)
            cursor = after
            for rec in backlog:
                cursor = rec.event_id
                await emit("committed", event_of(rec))
            while True:
                frame = await watcher.next()
                if frame is None:
                    break
                kind, data = frame
                if kind == "committed":
                    if data.event_id <= cursor:
                        continue  # (the backlog had it)
                    cursor = data.event_id
                    if data.body["type"] == TURN:
                        nursery.start_soon(_provisional, app, watcher, cid, data.event_id)
                    await emit(kind, event_of(data))
                else:
                    await emit(kind, data)
            nursery.cancel_scope.cancel()
        await emit("ended", {"reason": watcher.ended or "shutdown"})


async def _end_at_shutdown(app: App, watcher: Watcher) -> None:
    await app.stopping.wait_begun()
    watcher.end("shutdown")


async def _provisional(app: App, watcher: Watcher, cid: str, turn_id: int) -> None:
    """Push the turn's text as deltas while it runs (a boundary: a failure ends only this)."""
    try:
        turn = await load_turn(app, cid, turn_id)
    except ApiError:
        return
    if turn is None:
        return
    with trio.move_on_after(LAND_WAIT_S):
        await turn.wait_opened()  # (a turn just logged gets its generation's session a moment later)
    if turn.session is None or turn.landed:
        return
    reply = turn_reader(turn, 0)
    n_calls = 0
    while watcher.ended is None:
        while not watcher.roomy and watcher.ended is None:
            await watcher.changed()
        try:
            events, _rows, done = await reply.next()
        except ApiError:
            return
        delta, n_calls = openai_delta(events, n_calls)
        text = delta.get("content") or ""
        if text:
            watcher.push("provisional", {"turn": turn_id, "text": text})
        if done:
            return
