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

import copy
import uuid
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import attrs
import msgpack
import trio

from ..proto._wal import MESSAGE, TURN, TURN_END, body_fork, body_message, body_turn, body_turn_end

if TYPE_CHECKING:
    from ..serving import ServedModel
    from ._resumable import LiveSession
    from ..chat import ReplyParser
    from ..journal import Journal, SessionLog
    from ..proto._wal import WalRecord

__all__ = ["ConversationStore", "Folded", "Turn", "size_of"]


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

    @staticmethod
    def new_id() -> str:
        return "c-" + uuid.uuid4().hex

    # -- reading -------------------------------------------------------------------------------------------------

    def get(self, cid: str) -> SessionLog | None:
        """The conversation's log, or None if ``cid`` is not a conversation."""
        slog = self.journal.sessions.get(cid)
        return slog if slog is not None and slog.conversation is not None else None

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
                if slog.conversation is not None and slog.tenant == tenant]
        return len(cids), sum(self.size(cid) for cid in cids)

    def _grew(self, records: list[WalRecord]) -> list[WalRecord]:
        for rec in records:
            if rec.session in self._sizes:
                self._sizes[rec.session] += size_of(rec.body)
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
        return await self.journal.append_many([*((new, r.body) for r in copied), (new, body_fork(source=cid, at=at))])
