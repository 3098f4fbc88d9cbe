"""``SessionLog``: one session's committed events, kept compactly in memory.

A long-running daemon holds up to a thousand or so sessions, each with tens
of thousands of prompt tokens, so token ids live in ``array('I')`` (4 bytes
each, not a Python int per token) and the event index is a set of parallel
arrays rather than one object per event. :meth:`SessionLog.records` rebuilds
the exact :class:`~superfluid.proto.WalRecord` values on demand (for "replay
from event N" and for compaction).

Most retained sessions are finished generations kept only for replay by id,
and most of those are short, so per-object overhead dominates them. When a
generation session ends (a ``generated`` span with a finish, ``finished`` or
``cancelled``) its log is packed once: the eight index arrays become one
``bytes`` (byte planes: a byte position that is the same in every value of
a column, such as the high bytes of ids, epochs and timestamps, is stored
once, or not at all when zero), the text parts one ``str``, the
token arrays are trimmed to their length, and the bodies of its ``created``,
``finished`` and finishing ``generated`` events are not stored when they are
the session's own ``created`` / ``finish`` / ``error`` (they are rebuilt from
those). ``created`` bodies that are equal (same params, class, model and
tenant: most sessions) are one shared dict, through a small bounded cache;
treat ``created`` as read-only. Reading a packed log decodes the index into
locals; an event applied after the end (replay is lenient) unpacks the log
first. Conversations are never packed.
"""

from __future__ import annotations

import bisect
import threading
from array import array
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from ..proto._wal import (
    CANCELLED, CONVERSATION, CREATED, FINISHED, FORK, GENERATED, MESSAGE, META, PERMISSION_REQUEST, PERMISSION_RESPONSE, PIN, PROMPT, PURGED, TOOL_CANCEL, TURN, TURN_END,
    WalRecord,
)

__all__ = ["SessionLog"]

_KINDS = (CREATED, PROMPT, GENERATED, FINISHED, CANCELLED, CONVERSATION, MESSAGE, TURN, TURN_END, FORK, META, PURGED, TOOL_CANCEL,
          PERMISSION_REQUEST, PERMISSION_RESPONSE, PIN)
_KIND_CODE = {kind: code for code, kind in enumerate(_KINDS)}
_KIND_MASK = 0x3F
_NO_TEXT = 0x80  # flag on a PROMPT kind code: its text was None
_ENDS = 0x40  # flag on a GENERATED kind code: the span carried a finish

# The index: one column per field of an event, in this order, with these typecodes.
_COLUMNS = ("q", "q", "q", "B", "Q", "Q", "Q", "Q")  # id, epoch, ts, kind, tok_lo, tok_hi, txt_lo, txt_hi

_NO_EXTRAS: Mapping[int, dict[str, Any]] = MappingProxyType({})

# Equal ``created`` bodies share one dict: repr (exact for msgpack-native values: it tells 1 from
# 1.0 and True, keeps key order) -> the body, least recently used first.
_SHARED_MAX = 128
_SHARED_KEY_MAX = 2048  # a larger body (a long grammar, say) is kept as is, not cached
_shared: dict[str, dict[str, Any]] = {}
_shared_lock = threading.Lock()  # journals replay in worker threads


def _share(created: dict[str, Any]) -> dict[str, Any]:
    key = repr(created)
    if len(key) > _SHARED_KEY_MAX:
        return created
    with _shared_lock:
        hit = _shared.pop(key, None)
        if hit is None:
            hit = created
            if len(_shared) >= _SHARED_MAX:
                del _shared[next(iter(_shared))]
        _shared[key] = hit
    return hit


def _pack_index(columns: tuple[array, ...]) -> bytes:
    """The index as one ``bytes``: the event count (4 bytes), then per column, byte planes.

    Byte ``k`` of every value of a column is a plane. A plane whose bytes are all
    equal (the high bytes of ids, epochs and timestamps; the zeros above small
    offsets) is one byte, or nothing when zero; any other plane is stored whole
    (n bytes). A column is two masks (planes stored whole, planes constant and
    not zero), the constant bytes, then the whole planes. Everything runs in C
    (slices and counts), never per event in Python.
    """
    n = len(columns[0])
    out = bytearray(n.to_bytes(4, "little"))
    for column in columns:
        raw = column.tobytes()
        width = column.itemsize
        whole = constant = 0
        constants = bytearray()
        planes = []
        for k in range(width):
            plane = raw[k::width]
            if not plane:
                continue
            first = plane[0]
            if plane.count(first) == n:
                if first:
                    constant |= 1 << k
                    constants.append(first)
            else:
                whole |= 1 << k
                planes.append(plane)
        out.append(whole)
        out.append(constant)
        out += constants
        for plane in planes:
            out += plane
    return bytes(out)


def _unpack_index(packed: bytes) -> tuple[array, ...]:
    n = int.from_bytes(packed[:4], "little")
    view = memoryview(packed)
    pos = 4
    columns = []
    for typecode in _COLUMNS:
        column = array(typecode)
        width = column.itemsize
        whole, constant = packed[pos], packed[pos + 1]
        pos += 2
        data = bytearray(width * n)
        for k in range(width):
            if constant >> k & 1:
                data[k::width] = bytes((packed[pos],)) * n
                pos += 1
        for k in range(width):
            if whole >> k & 1:
                data[k::width] = view[pos:pos + n]
                pos += n
        column.frombytes(data)
        columns.append(column)
    return tuple(columns)


_EMPTY_TOKENS = array("I").__sizeof__()


def _trimmed(tokens: array) -> array:
    """``tokens`` without the room ``extend`` left for growth (a copy of exactly its length)."""
    if tokens.__sizeof__() > _EMPTY_TOKENS + tokens.itemsize * len(tokens):
        return array(tokens.typecode, tokens)
    return tokens


def _joined(parts: list[str] | str) -> tuple[str, list[str] | str]:
    """Text kept as parts (or one str once packed): the whole text, and what to keep (one part)."""
    if type(parts) is str:
        return parts, parts
    if len(parts) > 1:
        parts = ["".join(parts)]
    return (parts[0] if parts else ""), parts


class SessionLog:
    """The replayable state of one session.

    Attributes:
        session: the session id.
        created: the ``Created`` body without its ``type`` (``params``,
            ``klass``, ``model``), or ``None`` if the log never had one.
            Read-only: sessions with equal bodies share one dict.
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
        fork: a conversation's latest ``fork`` marker body (without ``type``
            and ``edits``) plus ``event``, its id: where it branched off; None
            for a root.
        meta: a conversation's latest ``meta`` body after its latest ``fork``
            marker (without ``type``), or None (no title, not archived,
            version 0). A purged conversation has ``finish == "purged"``.
    """

    __slots__ = (
        "_extras", "_index", "_prompt_len", "_prompt_text", "_text", "_text_len", "conversation", "created", "epoch",
        "error", "finish", "first_seq", "first_ts", "fork", "generated_tokens", "last_event_id", "last_seq",
        "last_ts", "meta", "open_turn", "pin", "prompt_tokens", "session",
    )

    def __init__(self, session: str) -> None:
        self.session = session
        self.created: dict[str, Any] | None = None
        self.conversation: dict[str, Any] | None = None
        self.open_turn = -1
        self.fork: dict[str, Any] | None = None
        self.meta: dict[str, Any] | None = None
        self.pin = 0  # a conversation's latest ``pin`` deadline (unix ms) after its latest ``fork`` marker
        self.prompt_tokens = array("I")
        self.generated_tokens = array("I")
        self.finish: str | None = None
        self.error: Any = None
        self.last_event_id = -1
        self.epoch = 0
        self.first_ts = self.last_ts = 0
        self.first_seq = self.last_seq = -1
        # text as parts, joined lazily (one str once packed); running lengths give each span's slice
        self._text: list[str] | str = []
        self._text_len = 0
        self._prompt_text: list[str] | str = []
        self._prompt_len = 0
        # the event index: parallel arrays (_COLUMNS), one slot per event; bytes once packed
        self._index: tuple[array, ...] | bytes = tuple(array(tc) for tc in _COLUMNS)
        # event number -> the rest of its body; once packed, only those not rebuilt from the session's fields
        self._extras: Mapping[int, dict[str, Any]] = {}

    def __repr__(self) -> str:
        return (f"<SessionLog {self.session!r} events={self.event_count} prompt={len(self.prompt_tokens)} "
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
        out, self._text = _joined(self._text)
        return out

    @property
    def prompt_text(self) -> str:
        """Every prompt span's text (spans without text contribute nothing)."""
        out, self._prompt_text = _joined(self._prompt_text)
        return out

    @property
    def event_count(self) -> int:
        index = self._index
        return int.from_bytes(index[:4], "little") if type(index) is bytes else len(index[0])

    @property
    def events(self) -> list[WalRecord]:
        """All events in order, rebuilt as records (a fresh list each call)."""
        return self.records()

    def records(self, after: int = -1) -> list[WalRecord]:
        """The events with ``event_id > after``, in order, as exact records."""
        index = self._index
        packed = type(index) is bytes
        columns = _unpack_index(index) if packed else index
        start = bisect.bisect_right(columns[0], after)
        text, ptext = self.text, self.prompt_text
        return [self._record(i, columns, text, ptext, packed) for i in range(start, len(columns[0]))]

    def _record(self, i: int, columns: tuple[array, ...], text: str, ptext: str, packed: bool) -> WalRecord:
        ids, epochs, tss, kinds, tok_lo, tok_hi, txt_lo, txt_hi = columns
        code = kinds[i]
        kind = _KINDS[code & _KIND_MASK]
        body: dict[str, Any] = {"type": kind}
        lo, hi, tlo, thi = tok_lo[i], tok_hi[i], txt_lo[i], txt_hi[i]
        if kind == PROMPT:
            body["tokens"] = self.prompt_tokens[lo:hi].tolist()
            body["text"] = None if code & _NO_TEXT else ptext[tlo:thi]
        elif kind == GENERATED:
            body["tokens"] = self.generated_tokens[lo:hi].tolist()
            body["text"] = text[tlo:thi]
            body["finish"] = None
        extra = self._extras.get(i)
        if extra is None and packed:
            extra = self._derived_extra(code)
        if extra:
            body.update(extra)
        return WalRecord(session=self.session, event_id=ids[i], epoch=epochs[i], ts=tss[i], body=body)

    def _derived_extra(self, code: int) -> dict[str, Any] | None:
        """The rest of a body a packed log does not store (see :meth:`_pack`)."""
        kind = _KINDS[code & _KIND_MASK]
        if kind == CREATED:
            return self.created
        if kind == FINISHED:
            return {"finish": self.finish, "error": self.error}
        if kind == GENERATED and code & _ENDS:
            return {"finish": self.finish}
        return None

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
        index = self._index
        if self.finish is not None and type(index) is bytes:  # only an ended session is packed
            index = self._unpack()
        ids, epochs, tss, kinds, tok_los, tok_his, txt_los, txt_his = index
        body = record.body
        kind = body["type"]
        code = _KIND_CODE[kind]
        tok_lo = tok_hi = txt_lo = txt_hi = 0
        ends = False
        if kind == GENERATED:
            tok_lo = len(self.generated_tokens)
            self.generated_tokens.extend(body["tokens"])
            tok_hi = len(self.generated_tokens)
            text = body["text"]
            txt_lo = txt_hi = self._text_len
            if text:
                self._text.append(text)  # type: ignore[union-attr]  # a list while not packed
                self._text_len = txt_hi = txt_lo + len(text)
            if body["finish"] is not None:
                self.finish = body["finish"]
                self._extras[len(ids)] = {"finish": body["finish"]}  # type: ignore[index]
                code |= _ENDS
                ends = True
        elif kind == CREATED:
            self.created = _share({k: v for k, v in body.items() if k != "type"})
            self._extras[len(ids)] = self.created  # type: ignore[index]
        elif kind == PROMPT:
            tok_lo = len(self.prompt_tokens)
            self.prompt_tokens.extend(body["tokens"])
            tok_hi = len(self.prompt_tokens)
            text = body["text"]
            txt_lo = txt_hi = self._prompt_len
            if text is None:
                code |= _NO_TEXT
            elif text:
                self._prompt_text.append(text)  # type: ignore[union-attr]
                self._prompt_len = txt_hi = txt_lo + len(text)
        elif kind == FINISHED:
            self.finish = body["finish"]
            self.error = body["error"]
            self._extras[len(ids)] = {"finish": body["finish"], "error": body["error"]}  # type: ignore[index]
            ends = True
        elif kind == CANCELLED:
            self.finish = "cancelled"
            ends = True
        else:  # a conversation's event: the body is kept whole
            extra = {k: v for k, v in body.items() if k != "type"}
            self._extras[len(ids)] = extra  # type: ignore[index]
            if kind == CONVERSATION:
                self.conversation = extra
            elif kind == TURN:
                self.open_turn = record.event_id
            elif kind == TURN_END or (kind == MESSAGE and body["turn"] is not None):
                self.open_turn = -1
            elif kind == FORK:
                at = body["at"]
                if body.get("edits"):  # a rebase: it shares the events before its first edit
                    at = min(at, next(iter(body["edits"][0].values()))["from"] - 1)
                self.fork = {"source": body["source"], "at": at, "event": record.event_id}
                self.meta = None
                self.pin = 0
            elif kind == META:
                self.meta = extra
            elif kind == PIN:
                self.pin = body["deadline"]
            elif kind == PURGED:
                self.finish = "purged"
                self.open_turn = -1  # nobody lands a purged conversation's turn
        ids.append(record.event_id)
        epochs.append(record.epoch)
        tss.append(record.ts)
        kinds.append(code)
        tok_los.append(tok_lo)
        tok_his.append(tok_hi)
        txt_los.append(txt_lo)
        txt_his.append(txt_hi)
        self.last_event_id = record.event_id
        self.epoch = record.epoch
        if self.first_seq < 0:
            self.first_seq, self.first_ts = seq, record.ts
        self.last_seq, self.last_ts = seq, record.ts
        if ends and self.conversation is None:
            self._pack()
        return True

    def _pack(self) -> None:
        """Shrink an ended generation session's log (the module docstring says how)."""
        index = self._index
        assert type(index) is not bytes
        kinds = index[3]
        kept: dict[int, dict[str, Any]] = {}
        for i, extra in self._extras.items():
            kind = _KINDS[kinds[i] & _KIND_MASK]
            if kind == CREATED and extra is self.created:
                continue
            if (kind == FINISHED and len(extra) == 2 and extra.get("finish") is self.finish
                    and extra.get("error") is self.error):
                continue
            if kind == GENERATED and len(extra) == 1 and extra.get("finish") is self.finish:
                continue
            kept[i] = extra
        self._extras = kept or _NO_EXTRAS
        self._text = self.text
        self._prompt_text = self.prompt_text
        self.prompt_tokens = _trimmed(self.prompt_tokens)
        self.generated_tokens = _trimmed(self.generated_tokens)
        self._index = _pack_index(index)

    def _unpack(self) -> tuple[array, ...]:
        """Back to the live form, to take another event."""
        packed = self._index
        assert type(packed) is bytes
        index = _unpack_index(packed)
        extras = dict(self._extras)
        for i, code in enumerate(index[3]):
            if i not in extras:
                extra = self._derived_extra(code)
                if extra is not None:
                    extras[i] = extra
        self._extras = extras
        self._text = [self._text] if self._text else []  # type: ignore[list-item]
        self._prompt_text = [self._prompt_text] if self._prompt_text else []  # type: ignore[list-item]
        self._index = index
        return index
