"""Conversations: server-side chat histories in the session journal.

A conversation (SPEC.md §7, "Conversations") is a journal session of its
own kind (``proto/_wal_conversation.py``): a ``conversation`` header, then
``message``, ``turn``, ``turn_end`` and ``fork`` events. Each turn is answered
by an ordinary generation session (``created``, ``prompt``, ``generated``…)
whose id the ``turn`` event records; when it ends, its reply joins the
conversation as a ``message`` (or a ``turn_end`` when there is nothing to add).

The journal is the truth: what a conversation holds, and whether a turn is
open (busy), is read from its :class:`~superfluid.journal.SessionLog`.
:class:`ConversationStore` adds what only a running daemon has: the live
:class:`Turn` objects clients follow and wait on, and the per-conversation
lock that orders appends before a turn's prompt is rendered.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import attrs
import msgpack
import trio

from ..proto._wal_conversation import open_turn_after
from ..proto._wal import (
    CONVERSATION, MESSAGE, META, PIN, PURGED, TURN, TURN_END, body_fork, body_message, body_meta, body_purged,
    body_turn, body_turn_end,
)

if TYPE_CHECKING:
    from ..serving import ServedModel
    from ._resumable import LiveSession
    from ..chat import ReplyParser
    from ..journal import Journal, SessionLog
    from ..proto._wal import WalRecord

__all__ = ["ConversationStore", "Folded", "Turn", "Watcher", "rebased", "size_of"]

WATCH_QUEUE = 256  # frames a subscriber may have unread before it is ended ``lagged``


def size_of(value: Any) -> int:
    """The bytes ``value`` (an event body, a message) takes in the log."""
    return len(msgpack.packb(value, use_bin_type=True))


@attrs.define(eq=False, kw_only=True)
class Turn:
    """One turn of a conversation: a generation session answering it.

    Readers follow :attr:`session` (its job) by token cursor and parse the
    text with their own copy of :attr:`parser`; the turn's owner task lands
    the reply (:meth:`ConversationStore.land`), which sets :attr:`end_event`.
    """

    conversation: str
    event_id: int = -1                 # id of its ``turn`` event (set when it is logged)
    generation: str                    # the generation session's id
    model: ServedModel | None
    stops: list[str]
    parser: ReplyParser                # pristine: never fed; see reader()
    session: LiveSession | None = None  # None: the generation is not in the log (lost before it was logged)
    end_event: int = -1                # id of the ``message`` or ``turn_end`` that ended it
    message: dict[str, Any] | None = None
    finish: str | None = None
    error: Any = None
    _landed: trio.Event = attrs.field(factory=trio.Event)
    _opened: trio.Event = attrs.field(factory=trio.Event)  # set once ``session`` is, or the turn landed

    def __attrs_post_init__(self) -> None:
        if self.session is not None:
            self._opened.set()

    def open(self, session: LiveSession) -> None:
        """The turn's generation is in the log: readers may follow :attr:`session`."""
        self.session = session
        self._opened.set()

    async def wait_opened(self) -> None:
        """Wait until :attr:`session` is set (or the turn landed without one).

        Cancellation: a plain wait."""
        await self._opened.wait()

    @property
    def landed(self) -> bool:
        return self.end_event >= 0

    def reader(self) -> ReplyParser:
        """A fresh parser for one reader of the generation."""
        return copy.deepcopy(self.parser)

    async def wait_landed(self) -> None:
        """Wait until the turn's end is in the journal.

        Cancellation: a plain wait; cancelling it touches nothing.
        """
        await self._landed.wait()

    def mark_landed(self, event_id: int, message: dict[str, Any] | None, finish: str, error: Any) -> None:
        self.end_event, self.message, self.finish, self.error = event_id, message, finish, error
        self._landed.set()
        self._opened.set()


@attrs.frozen(kw_only=True)
class Folded:
    """A conversation's events folded into its state.

    ``messages`` are ``(event id, message)`` in order; ``turns`` maps a turn's
    event id to its ``turn`` body plus ``end``: the record that ended it, or
    None while it is open.
    """

    header: dict[str, Any]
    messages: list[tuple[int, dict[str, Any]]]
    turns: dict[int, dict[str, Any]]
    last_event_id: int

    @property
    def last_turn(self) -> int:
        return max(self.turns, default=-1)

    def messages_before(self, event_id: int) -> list[dict[str, Any]]:
        return [m for eid, m in self.messages if eid < event_id]


class Watcher:
    """One subscriber of a conversation: a bounded queue of frames ``(kind, data)``.

    ``kind`` is ``"committed"`` (data: a :class:`WalRecord`) or ``"provisional"``
    (data: ``{turn, text}``). A push that finds the queue full ends the watcher
    ``lagged`` (it re-subscribes from its cursor); :meth:`end` ends it with a
    reason (``purged``, ``shutdown``); what was queued before is still read.
    """

    def __init__(self, cid: str, capacity: int) -> None:
        self.cid = cid
        self.capacity = capacity
        self.queue: collections.deque[tuple[str, Any]] = collections.deque()
        self.ended: str | None = None
        self._changed = trio.Event()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def push(self, kind: str, data: Any) -> None:
        if self.ended is not None:
            return
        if len(self.queue) >= self.capacity:
            self.end("lagged")
            return
        self.queue.append((kind, data))
        self._wake()

    def end(self, reason: str) -> None:
        if self.ended is None:
            self.ended = reason
            self._wake()

    @property
    def roomy(self) -> bool:
        """Less than half full: a provisional reader may push (it waits otherwise, coalescing)."""
        return len(self.queue) < self.capacity // 2

    async def changed(self) -> None:
        """Wait until something is pushed, taken or the watcher ends."""
        await self._changed.wait()

    async def next(self) -> tuple[str, Any] | None:
        """The next frame; None once ended and drained."""
        await trio.lowlevel.checkpoint()
        while not self.queue:
            if self.ended is not None:
                return None
            await self.changed()
        frame = self.queue.popleft()
        self._wake()
        return frame


def rebased(records: list[WalRecord], edits: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The bodies of a rebase: ``records`` (a conversation's events, header first)
    with ``edits`` (canonical, as a ``fork`` marker holds them) applied.

    A dropped or replaced range may cut a turn from its end: a ``turn`` event whose
    end is not kept is left out, a reply whose ``turn`` event is not kept becomes a
    plain message, a ``turn_end`` without its turn is left out; kept turns are
    renumbered (``turn`` fields name the new ids). ``meta`` events are not copied.
    """
    spans = [(kind, span) for edit in edits for kind, span in edit.items()]
    kept: list[WalRecord | dict[str, Any]] = []
    pending = list(spans)

    def emit_until(event_id: int) -> None:
        while pending and pending[0][1]["from"] <= event_id:
            kind, span = pending.pop(0)
            if kind == "replace":
                kept.append(body_message(message=span["message"]))

    for rec in records:
        emit_until(rec.event_id)
        if any(span["from"] <= rec.event_id < span["to"] for _k, span in spans) or rec.body["type"] == META:
            continue
        kept.append(rec)
    emit_until(1 << 62)
    ids_kept = {r.event_id for r in kept if not isinstance(r, dict)}
    ended = {r.body["turn"] for r in kept if not isinstance(r, dict) and r.body["type"] in (MESSAGE, TURN_END)
             and r.body["turn"] is not None}
    out: list[dict[str, Any]] = []
    new_id: dict[int, int] = {}
    for r in kept:
        if isinstance(r, dict):
            out.append(r)
            continue
        body = r.body
        if body["type"] == TURN and r.event_id not in ended:
            continue
        if body["type"] == TURN_END and body["turn"] not in ids_kept:
            continue
        if body["type"] == MESSAGE and body["turn"] is not None:
            body = (body_message(message=body["message"]) if body["turn"] not in ids_kept else
                    {**body, "turn": new_id[body["turn"]]})
        elif body["type"] == TURN_END:
            body = {**body, "turn": new_id[body["turn"]]}
        new_id[r.event_id] = len(out)
        out.append(body)
    assert out and out[0]["type"] == CONVERSATION
    open_turn = -1
    for event_id, body in enumerate(out[1:], start=1):  # e.g. a message inserted between a turn and its reply
        try:
            open_turn = open_turn_after(open_turn, event_id, body)
        except ValueError as exc:
            raise ValueError(f"the edits break a turn: {exc}") from None
    return out


class ConversationStore:
    """The daemon's conversations: journal writes, live turns, per-conversation order.

    Args:
        journal: the session journal (conversations share it with generations).
        max_turns: live :class:`Turn` objects kept for readers; ended ones
            beyond this are forgotten oldest first (they rebuild from the log).
    """

    def __init__(self, journal: Journal, *, max_turns: int = 4096) -> None:
        self.journal = journal
        self.max_turns = max_turns
        self._turns: dict[str, Turn] = {}       # by generation session id
        self._locks: dict[str, trio.Lock] = {}
        self._preparing: set[str] = set()       # conversations whose turn is being rendered and logged
        self._sizes: dict[str, int] = {}        # bytes of each conversation's logged bodies, once asked
        self._watchers: dict[str, set[Watcher]] = {}
        self._pinned: set[str] | None = None    # conversations that logged a pin (built from the log once asked)

    @staticmethod
    def new_id() -> str:
        return "c-" + uuid.uuid4().hex

    # -- reading -------------------------------------------------------------------------------------------------

    def get(self, cid: str) -> SessionLog | None:
        """The conversation's log, or None if ``cid`` is not a conversation."""
        slog = self.journal.sessions.get(cid)
        return slog if slog is not None and slog.conversation is not None and not slog.done else None

    def meta(self, cid: str) -> dict[str, Any]:
        """The conversation's metadata: ``version``, ``title``, ``archived``, ``qos``, ``root``.

        Raises:
            KeyError: ``cid`` is not a conversation.
        """
        slog = self.get(cid)
        if slog is None:
            raise KeyError(cid)
        return dict(slog.meta or {"version": 0, "title": None, "archived": False, "qos": None, "root": False})

    def parent(self, cid: str) -> tuple[str | None, int | None]:
        """``(parent, fork_at)``: the conversation it branched off (while that one is kept and
        not purged, and this one was not rerooted) and the last event id they share."""
        slog = self.get(cid)
        if slog is None or slog.fork is None or (slog.meta or {}).get("root"):
            return None, None
        source = slog.fork["source"]
        return (source, slog.fork["at"]) if self.get(source) is not None else (None, None)

    def pinned(self, cid: str, now: float) -> float | None:
        """Until when (unix seconds) conversation ``cid`` is pinned, or None (not pinned, or the pin ran out)."""
        slog = self.get(cid)
        return slog.pin / 1000 if slog is not None and slog.pin / 1000 > now else None

    def pinned_until(self, model: str, now: float) -> float:
        """Until when (unix seconds) a conversation of ``model`` pins it loaded; 0 if none does."""
        if self._pinned is None:
            self._pinned = {sid for sid, slog in self.journal.sessions.items() if slog.pin}
        until = 0.0
        for cid in list(self._pinned):
            held = self.pinned(cid, now)
            if held is None:
                self._pinned.discard(cid)
            elif self.journal.sessions[cid].conversation["model"] == model:  # type: ignore[index]
                until = max(until, held)
        return until

    def conversations(self, tenant: str) -> list[str]:
        """The ids of ``tenant``'s conversations (not purged), oldest first."""
        return [sid for sid, slog in self.journal.sessions.items()
                if slog.conversation is not None and not slog.done and slog.tenant == tenant]

    # -- watching ------------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def watching(self, cid: str, capacity: int | None = None) -> Iterator[Watcher]:
        """A :class:`Watcher` of ``cid`` for the block (``capacity`` default :data:`WATCH_QUEUE`):
        every event committed to it is pushed."""
        watcher = Watcher(cid, capacity or WATCH_QUEUE)
        self._watchers.setdefault(cid, set()).add(watcher)
        try:
            yield watcher
        finally:
            held = self._watchers.get(cid)
            if held is not None:
                held.discard(watcher)
                if not held:
                    del self._watchers[cid]

    def watchers(self, cid: str) -> list[Watcher]:
        return list(self._watchers.get(cid, ()))

    def _publish(self, records: list[WalRecord]) -> None:
        for rec in records:
            for watcher in self._watchers.get(rec.session, ()):
                watcher.push("committed", rec)
                if rec.body["type"] == PURGED:
                    watcher.end("purged")

    def busy(self, cid: str) -> bool:
        """A turn is open in the log, or one is being started."""
        slog = self.get(cid)
        return cid in self._preparing or (slog is not None and slog.open_turn >= 0)

    def size(self, cid: str) -> int:
        """The bytes conversation ``cid``'s events take in the log (0 if it is none)."""
        n = self._sizes.get(cid)
        if n is None:
            n = sum(size_of(rec.body) for rec in self.records(cid))
            if self.get(cid) is not None:
                self._sizes[cid] = n
        return n

    def usage(self, tenant: str) -> tuple[int, int]:
        """How many conversations ``tenant`` keeps in the log, and the bytes they take."""
        cids = [sid for sid, slog in self.journal.sessions.items()
                if slog.conversation is not None and not slog.done and slog.tenant == tenant]
        return len(cids), sum(self.size(cid) for cid in cids)

    def _grew(self, records: list[WalRecord]) -> list[WalRecord]:
        for rec in records:
            if rec.session in self._sizes:
                self._sizes[rec.session] += size_of(rec.body)
            if rec.body["type"] == PIN and self._pinned is not None:
                self._pinned.add(rec.session)
        self._publish(records)
        return records

    def records(self, cid: str, *, after: int = -1) -> list[WalRecord]:
        slog = self.get(cid)
        return slog.records(after) if slog is not None else []

    def fold(self, cid: str) -> Folded:
        """The conversation's state from its committed events.

        Raises:
            KeyError: ``cid`` is not a conversation.
        """
        slog = self.get(cid)
        if slog is None:
            raise KeyError(cid)
        messages: list[tuple[int, dict[str, Any]]] = []
        turns: dict[int, dict[str, Any]] = {}
        for rec in slog.records():
            body = rec.body
            if body["type"] == MESSAGE:
                messages.append((rec.event_id, body["message"]))
            if body["type"] == TURN:
                turns[rec.event_id] = {**body, "end": None}
            elif body["type"] in (MESSAGE, TURN_END) and body["turn"] in turns:
                turns[body["turn"]]["end"] = rec
        assert slog.conversation is not None
        return Folded(header=slog.conversation, messages=messages, turns=turns, last_event_id=slog.last_event_id)

    def turn(self, generation: str) -> Turn | None:
        """The live turn answered by generation session ``generation``, if this daemon holds it."""
        return self._turns.get(generation)

    # -- writing -------------------------------------------------------------------------------------------------

    @asynccontextmanager
    async def ordered(self, cid: str) -> AsyncIterator[None]:
        """Hold the conversation's write order: appends, and a turn's render and ``turn`` event.

        Resource handling: the lock is forgotten when nobody holds or waits for it.
        """
        lock = self._locks.setdefault(cid, trio.Lock())
        try:
            async with lock:
                yield
        finally:
            if not lock.locked() and lock.statistics().tasks_waiting == 0:
                self._locks.pop(cid, None)

    @asynccontextmanager
    async def preparing(self, cid: str) -> AsyncIterator[None]:
        """Mark a turn as being started (:meth:`busy`) for the block, then take the write order."""
        self._preparing.add(cid)
        try:
            async with self.ordered(cid):
                yield
        finally:
            self._preparing.discard(cid)

    async def create(self, cid: str, header: Mapping[str, Any], messages: list[dict[str, Any]]) -> list[WalRecord]:
        """Log a new conversation and its first messages (one durable write).

        Raises:
            SessionStateError: a session named ``cid`` exists.
        """
        items = [(cid, header), *((cid, body_message(message=m)) for m in messages)]
        self._sizes.pop(cid, None)  # a name compaction freed and a client took again
        return self._grew(await self.journal.append_many(items))

    async def append(self, cid: str, messages: list[dict[str, Any]]) -> list[WalRecord]:
        """Log messages (one durable write); the caller holds :meth:`ordered`.

        Raises:
            SessionStateError: a turn is open.
        """
        return self._grew(await self.journal.append_many([(cid, body_message(message=m)) for m in messages]))

    async def begin(self, turn: Turn, params: Mapping[str, Any]) -> None:
        """Log the ``turn`` event and index the turn; sets ``turn.event_id``."""
        rec = await self.journal.append(turn.conversation, body_turn(generation=turn.generation, params=params))
        self._grew([rec])
        turn.event_id = rec.event_id
        self.index(turn)

    def index(self, turn: Turn) -> Turn:
        """Index a turn for readers; returns the one already indexed for its generation, if any."""
        held = self._turns.setdefault(turn.generation, turn)
        if len(self._turns) > self.max_turns:
            for gen in [g for g, t in self._turns.items() if t.landed][: len(self._turns) - self.max_turns]:
                del self._turns[gen]
        return held

    async def land(self, turn: Turn, message: dict[str, Any] | None, finish: str, error: Any = None) -> None:
        """End the turn in the log (:meth:`end_turn`) and wake its readers."""
        rec = await self.end_turn(turn.conversation, turn.event_id, message, finish, error)
        turn.mark_landed(rec.event_id, message, finish, error)

    async def end_turn(self, cid: str, turn_id: int, message: dict[str, Any] | None, finish: str,
                       error: Any = None) -> WalRecord:
        """Log the end of turn ``turn_id``: its reply joins the conversation, or a ``turn_end`` says why not.

        Raises:
            SessionStateError: ``turn_id`` is not the open turn.
        """
        if message is not None:
            body = body_message(message=message, turn=turn_id, finish=finish)
        else:
            body = body_turn_end(turn=turn_id, finish=finish, error=error)
        return self._grew([await self.journal.append(cid, body)])[0]

    async def fork(self, cid: str, at: int, new: str) -> list[WalRecord]:
        """Log conversation ``new`` holding ``cid``'s events up to ``at`` and a ``fork`` marker.

        A turn not ended by ``at`` (a running one) is not copied; it can only
        be the last event copied, so the copies keep their event ids.

        Raises:
            KeyError: ``cid`` is not a conversation.
            SessionStateError: a session named ``new`` exists.
        """
        slog = self.get(cid)
        if slog is None:
            raise KeyError(cid)
        copied = [rec for rec in slog.records() if rec.event_id <= at]
        ended = {r.body["turn"] for r in copied if r.body["type"] in (MESSAGE, TURN_END) and r.body["turn"] is not None}
        if copied[-1].body["type"] == TURN and copied[-1].event_id not in ended:
            copied.pop()
        return self._grew(await self.journal.append_many([*((new, r.body) for r in copied),
                                                          (new, body_fork(source=cid, at=at))]))

    def copyable(self, cid: str) -> list[WalRecord]:
        """``cid``'s events a branch copies: all but a turn still running (the last event then).

        Raises:
            KeyError: ``cid`` is not a conversation.
        """
        slog = self.get(cid)
        if slog is None:
            raise KeyError(cid)
        records = slog.records()
        if slog.open_turn >= 0 and records[-1].event_id == slog.open_turn:
            records.pop()
        return records

    async def rebase(self, cid: str, edits: list[dict[str, Any]], new: str) -> list[WalRecord]:
        """Log conversation ``new``: ``cid``'s events with ``edits`` applied (:func:`rebased`), and a
        ``fork`` marker holding the edits.

        Raises:
            KeyError: ``cid`` is not a conversation.
            ValueError: bad edits (one that puts a message between a turn and its end).
            SessionStateError: a session named ``new`` exists.
        """
        records = self.copyable(cid)
        marker = body_fork(source=cid, at=records[-1].event_id, edits=edits)
        bodies = rebased(records, marker["edits"])
        return self._grew(await self.journal.append_many([*((new, b) for b in bodies), (new, marker)]))

    async def log_event(self, cid: str, body: dict[str, Any]) -> WalRecord:
        """Log one event of the conversation's ledger (``tool_cancel``, ``permission_request``,
        ``permission_response``, ``pin``); the caller holds :meth:`ordered`.

        Raises:
            SessionStateError: ``cid`` is gone.
        """
        return self._grew([await self.journal.append(cid, body)])[0]

    async def set_meta(self, updates: dict[str, dict[str, Any]]) -> list[WalRecord]:
        """Log each conversation's new metadata (``{cid: whole meta}``) in one durable write;
        its version is bumped here.

        Raises:
            SessionStateError: one of them is gone.
        """
        items = [(cid, body_meta(**{**meta, "version": meta["version"] + 1})) for cid, meta in updates.items()]
        return self._grew(await self.journal.append_many(items))

    async def purge(self, purged: list[str], mode: str, rerooted: dict[str, dict[str, Any]]) -> list[WalRecord]:
        """Log ``purged`` (each a ``purged`` event) and the ``root`` metadata of ``rerooted`` in one write.

        Raises:
            SessionStateError: one of them is gone.
        """
        items = [(cid, body_meta(**{**meta, "version": meta["version"] + 1, "root": True}))
                 for cid, meta in rerooted.items()]
        items += [(cid, body_purged(mode=mode)) for cid in purged]
        records = self._grew(await self.journal.append_many(items))
        for cid in purged:
            self._sizes.pop(cid, None)
        return records
