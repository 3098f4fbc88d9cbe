"""``SessionLog``: one session's committed events, kept compactly in memory.

A long-running daemon holds up to a thousand or so sessions, each with tens
of thousands of prompt tokens, so token ids live in ``array('I')`` (4 bytes
each, not a Python int per token) and the event index is a set of parallel
arrays rather than one object per event. :meth:`SessionLog.records` rebuilds
the exact :class:`~superfluid.proto.WalRecord` values on demand (for "replay
from event N" and for compaction).
"""

from __future__ import annotations

import bisect
from array import array
from typing import Any

from ..proto._wal import (
    CANCELLED, CONVERSATION, CREATED, FINISHED, FORK, GENERATED, MESSAGE, PROMPT, TURN, TURN_END, WalRecord,
)

__all__ = ["SessionLog"]

_KINDS = (CREATED, PROMPT, GENERATED, FINISHED, CANCELLED, CONVERSATION, MESSAGE, TURN, TURN_END, FORK)
_KIND_CODE = {kind: code for code, kind in enumerate(_KINDS)}
_NO_TEXT = 0x80  # flag on a PROMPT kind code: its text was None


class SessionLog:
    """The replayable state of one session.

    Attributes:
        session: the session id.
        created: the ``Created`` body without its ``type`` (``params``,
            ``klass``, ``model``), or ``None`` if the log never had one.
        prompt_tokens: every prompt span's token ids, concatenated.
        generated_tokens: every generated span's token ids, concatenated.
        finish: ``None`` while the session is open; else the finish reason
            (``"cancelled"`` after a ``Cancelled`` event).
        error: the ``Finished`` event's error, if any.
        last_event_id: id of the newest event (``-1`` before any).
        epoch: epoch of the newest event; below the journal's epoch while
            unfinished means the generation was interrupted by a restart.
        first_ts, last_ts: unix ms of the oldest and newest event.
        first_seq, last_seq: order of the oldest/newest event among all
            records the journal has applied (for retention).
        conversation: for a conversation (SPEC.md §7), its ``conversation``
            body without ``type``; ``None`` for a generation session. A
            conversation never finishes; its events' bodies are kept whole.
        open_turn: a conversation's turn (the id of its ``turn`` event) that
            has no ``message`` or ``turn_end`` ending it yet; else ``-1``.
    """

    __slots__ = (
        "_epochs", "_extras", "_ids", "_kinds", "_prompt_len", "_prompt_text", "_text", "_text_len", "_tok_hi",
        "_tok_lo", "_ts", "_txt_hi", "_txt_lo", "conversation", "created", "epoch", "error", "finish", "first_seq",
        "first_ts", "generated_tokens", "last_event_id", "last_seq", "last_ts", "open_turn", "prompt_tokens",
        "session",
    )

    def __init__(self, session: str) -> None:
        self.session = session
        self.created: dict[str, Any] | None = None
        self.conversation: dict[str, Any] | None = None
        self.open_turn = -1
        self.prompt_tokens = array("I")
        self.generated_tokens = array("I")
        self.finish: str | None = None
        self.error: Any = None
        self.last_event_id = -1
        self.epoch = 0
        self.first_ts = self.last_ts = 0
        self.first_seq = self.last_seq = -1
        # text as parts, joined lazily; running lengths give each span's slice
        self._text: list[str] = []
        self._text_len = 0
        self._prompt_text: list[str] = []
        self._prompt_len = 0
        # the event index: parallel arrays, one slot per event
        self._ids = array("q")
        self._epochs = array("q")
        self._ts = array("q")
        self._kinds = array("B")
        self._tok_lo = array("Q")
        self._tok_hi = array("Q")
        self._txt_lo = array("Q")
        self._txt_hi = array("Q")
        self._extras: dict[int, dict[str, Any]] = {}

    def __repr__(self) -> str:
        return (f"<SessionLog {self.session!r} events={len(self._ids)} prompt={len(self.prompt_tokens)} "
                f"generated={len(self.generated_tokens)} finish={self.finish!r}>")

    # -- reading ----------------------------------------------------------------

    @property
    def tenant(self) -> str:
        """The tenant that owns the session or conversation ("" when its header says none)."""
        return str((self.created or self.conversation or {}).get("tenant", ""))

    @property
    def done(self) -> bool:
        """True once the session has ended (a finish, ``Finished`` or ``Cancelled``)."""
        return self.finish is not None

    @property
    def cancelled(self) -> bool:
        return self.finish == "cancelled"

    @property
    def text(self) -> str:
        """Every generated span's text, concatenated."""
        if len(self._text) > 1:
            self._text = ["".join(self._text)]
        return self._text[0] if self._text else ""

    @property
    def prompt_text(self) -> str:
        """Every prompt span's text (spans without text contribute nothing)."""
        if len(self._prompt_text) > 1:
            self._prompt_text = ["".join(self._prompt_text)]
        return self._prompt_text[0] if self._prompt_text else ""

    @property
    def event_count(self) -> int:
        return len(self._ids)

    @property
    def events(self) -> list[WalRecord]:
        """All events in order, rebuilt as records (a fresh list each call)."""
        return self.records()

    def records(self, after: int = -1) -> list[WalRecord]:
        """The events with ``event_id > after``, in order, as exact records."""
        start = bisect.bisect_right(self._ids, after)
        text, ptext = self.text, self.prompt_text
        return [self._record(i, text, ptext) for i in range(start, len(self._ids))]

    def _record(self, i: int, text: str, ptext: str) -> WalRecord:
        code = self._kinds[i]
        kind = _KINDS[code & ~_NO_TEXT]
        body: dict[str, Any] = {"type": kind}
        lo, hi, tlo, thi = self._tok_lo[i], self._tok_hi[i], self._txt_lo[i], self._txt_hi[i]
        if kind == PROMPT:
            body["tokens"] = self.prompt_tokens[lo:hi].tolist()
            body["text"] = None if code & _NO_TEXT else ptext[tlo:thi]
        elif kind == GENERATED:
            body["tokens"] = self.generated_tokens[lo:hi].tolist()
            body["text"] = text[tlo:thi]
            body["finish"] = None
        body.update(self._extras.get(i, ()))
        return WalRecord(session=self.session, event_id=self._ids[i], epoch=self._epochs[i], ts=self._ts[i],
                         body=body)

    # -- writing ----------------------------------------------------------------

    def apply(self, record: WalRecord, seq: int) -> bool:
        """Fold one committed record in; ``seq`` is its position among all
        records applied so far. Returns ``False`` (and changes nothing) for a
        record whose id is not newer than the last one: a duplicate.

        Replay is lenient on purpose (the log is the truth): a session whose
        ``Created`` was lost, or an event after the finish, is still applied.
        The journal enforces the rules when records are appended.
        """
        if record.event_id <= self.last_event_id:
            return False
        body = record.body
        kind = body["type"]
        code = _KIND_CODE[kind]
        tok_lo = tok_hi = txt_lo = txt_hi = 0
        if kind == CREATED:
            self.created = {k: v for k, v in body.items() if k != "type"}
            self._extras[len(self._ids)] = self.created
        elif kind == PROMPT:
            tok_lo = len(self.prompt_tokens)
            self.prompt_tokens.extend(body["tokens"])
            tok_hi = len(self.prompt_tokens)
            text = body["text"]
            txt_lo = txt_hi = self._prompt_len
            if text is None:
                code |= _NO_TEXT
            elif text:
                self._prompt_text.append(text)
                self._prompt_len = txt_hi = txt_lo + len(text)
        elif kind == GENERATED:
            tok_lo = len(self.generated_tokens)
            self.generated_tokens.extend(body["tokens"])
            tok_hi = len(self.generated_tokens)
            text = body["text"]
            txt_lo = txt_hi = self._text_len
            if text:
                self._text.append(text)
                self._text_len = txt_hi = txt_lo + len(text)
            if body["finish"] is not None:
                self.finish = body["finish"]
                self._extras[len(self._ids)] = {"finish": body["finish"]}
        elif kind == FINISHED:
            self.finish = body["finish"]
            self.error = body["error"]
            self._extras[len(self._ids)] = {"finish": body["finish"], "error": body["error"]}
        elif kind == CANCELLED:
            self.finish = "cancelled"
        else:  # a conversation's event: the body is kept whole
            extra = {k: v for k, v in body.items() if k != "type"}
            self._extras[len(self._ids)] = extra
            if kind == CONVERSATION:
                self.conversation = extra
            elif kind == TURN:
                self.open_turn = record.event_id
            elif kind == TURN_END or (kind == MESSAGE and body["turn"] is not None):
                self.open_turn = -1
        self._ids.append(record.event_id)
        self._epochs.append(record.epoch)
        self._ts.append(record.ts)
        self._kinds.append(code)
        self._tok_lo.append(tok_lo)
        self._tok_hi.append(tok_hi)
        self._txt_lo.append(txt_lo)
        self._txt_hi.append(txt_hi)
        self.last_event_id = record.event_id
        self.epoch = record.epoch
        if self.first_seq < 0:
            self.first_seq, self.first_ts = seq, record.ts
        self.last_seq, self.last_ts = seq, record.ts
        return True
