"""The session log (``wal.log``) record codec and a sans-I/O scanner.

File layout::

    b"SFWAL001"                                   8-byte magic, once
    u32 LE length | u64 LE checksum | payload     one record, repeated

``payload`` is the msgpack map ``{"session", "event_id", "epoch", "ts",
"body"}`` (keys in that order, so every payload starts with the bytes
``85 a7 "session"``). ``ts`` is unix milliseconds, supplied by the caller:
this module reads no clock. ``body`` is a map with a ``"type"`` key; the event
types and their fields are defined below (:func:`validate_body`).

Checksum: the first 8 bytes of ``hashlib.blake2b(payload, digest_size=8)``,
read as a little-endian u64. blake2b is in the standard library and fast, and
a 64-bit cryptographic digest makes an accidental match on damaged bytes
practically impossible (a crc32 widened to 64 bits still detects only 32
bits' worth).

Reading (:class:`WalReader`) ends in one of three ways:

* **clean**: the input ends exactly at a record boundary.
* **torn tail** (:class:`WalEnd` with ``torn=True`` and the ``offset`` to
  truncate to): the final record is short (the file ends inside it), or it is
  complete but fails its checksum and nothing but zero bytes follows it, or
  its length is absurd and nothing but zero bytes follows its header. These
  are the shapes a crash leaves behind mid-``write``; nothing in them was
  acknowledged, because a record is acknowledged only after its fsync.
* **corruption** (:class:`WalCorrupt`): bad magic, a complete record failing
  its checksum with non-zero data after it, a record whose checksum matches
  but whose payload does not decode, or a "torn" tail inside which a valid
  record can still be found (a damaged length field would otherwise make us
  truncate good records). The reader never guesses past damage.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Mapping, Sequence
from typing import Any, Final

import attrs
import msgpack

from ._errors import LocalProtocolError, ProtocolError
from ._link import NEED_DATA, _NeedData
from ._wal_conversation import (
    CONVERSATION,
    CONVERSATION_EVENTS,
    FORK,
    MESSAGE,
    META,
    PERMISSION_REQUEST,
    PERMISSION_RESPONSE,
    PIN,
    PURGED,
    TOOL_CANCEL,
    TURN,
    TURN_END,
    body_conversation,
    body_fork,
    body_message,
    body_meta,
    body_purged,
    body_turn,
    body_turn_end,
    validate_conversation_body,
)
from ._wal_fields import MAX_TOKEN_ID, tenant_field
from ._wal_fields import int_field as _int_field
from ._wal_fields import opt_str as _opt_str
from ._wal_fields import plain as _plain
from ._wal_fields import reason as _reason
from ._wal_fields import tokens as _tokens

__all__ = [
    "BODY_TYPES",
    "CANCELLED",
    "CONVERSATION",
    "CONVERSATION_EVENTS",
    "CREATED",
    "DAEMON_SESSION",
    "EPOCH_BUMP",
    "FINISHED",
    "FORK",
    "GENERATED",
    "GENERATION_EVENTS",
    "HEADER_SIZE",
    "MAGIC",
    "MAX_RECORD_SIZE",
    "MAX_SESSION_ID",
    "MAX_TOKEN_ID",
    "MESSAGE",
    "META",
    "PERMISSION_REQUEST",
    "PERMISSION_RESPONSE",
    "PIN",
    "PURGED",
    "PROMPT",
    "TOOL_CANCEL",
    "TURN",
    "TURN_END",
    "WalCorrupt",
    "WalEnd",
    "WalReader",
    "WalRecord",
    "body_cancelled",
    "body_conversation",
    "body_created",
    "body_epoch_bump",
    "body_finished",
    "body_fork",
    "body_generated",
    "body_message",
    "body_meta",
    "body_purged",
    "body_prompt",
    "body_turn",
    "body_turn_end",
    "encode_record",
    "ends_session",
    "read_wal",
    "validate_body",
    "wal_checksum",
]

MAGIC: Final = b"SFWAL001"
MAX_RECORD_SIZE: Final = 64 * 1024 * 1024
MAX_SESSION_ID: Final = 256
_HEADER = struct.Struct("<IQ")
HEADER_SIZE: Final = _HEADER.size
# Every payload we encode starts like this (fixmap of 5, fixstr "session");
# used only to look for surviving records inside a would-be torn tail.
_PAYLOAD_SIGNATURE = b"\x85\xa7session"
_COMPACT_AT = 1 << 20

# ---- event bodies -------------------------------------------------------------

CREATED: Final = "created"
PROMPT: Final = "prompt"
GENERATED: Final = "generated"
FINISHED: Final = "finished"
EPOCH_BUMP: Final = "epoch_bump"
CANCELLED: Final = "cancelled"
# A generation session starts with ``created`` and takes GENERATION_EVENTS; a
# conversation starts with ``conversation`` and takes CONVERSATION_EVENTS
# (``_wal_conversation.py``). The journal refuses an event of the other kind.
GENERATION_EVENTS: Final = frozenset({PROMPT, GENERATED, FINISHED, CANCELLED})
BODY_TYPES: Final = frozenset({CREATED, PROMPT, GENERATED, FINISHED, EPOCH_BUMP, CANCELLED, CONVERSATION,
                               *CONVERSATION_EVENTS})
# Journal-level records (epoch bumps) belong to no session.
DAEMON_SESSION: Final = ""


def body_created(*, params: Mapping[str, Any], klass: str, model: str, tenant: str = "") -> dict[str, Any]:
    """A session starts: sampling ``params``, QoS ``klass``, ``model`` name, and
    the ``tenant`` that owns it (absent when "": a keyless daemon's only tenant)."""
    return validate_body({"type": CREATED, "params": params, "klass": klass, "model": model, "tenant": tenant})


def body_prompt(*, tokens: Sequence[int], text: str | None = None) -> dict[str, Any]:
    """A prompt span: the exact token ids put on the model's input."""
    return validate_body({"type": PROMPT, "tokens": tokens, "text": text})


def body_generated(*, tokens: Sequence[int], text: str, finish: str | None = None) -> dict[str, Any]:
    """A committed span of generated tokens with its text; ``finish`` ends the session."""
    return validate_body({"type": GENERATED, "tokens": tokens, "text": text, "finish": finish})


def body_finished(*, finish: str, error: str | Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The session ended without a final span (error, or a finish after the fact)."""
    return validate_body({"type": FINISHED, "finish": finish, "error": error})


def body_epoch_bump() -> dict[str, Any]:
    return {"type": EPOCH_BUMP}


def body_cancelled() -> dict[str, Any]:
    return {"type": CANCELLED}


def validate_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """Check an event body and return its canonical form.

    The canonical form is a fresh dict with ``type`` first, every field of the
    type present (optional ones as ``None``), token spans as lists of ints and
    nested values msgpack-native. Decoding an encoded canonical body gives an
    equal dict. The one exception is ``tenant`` (``created``, ``conversation``):
    it is present only when not "", so a keyless daemon writes the records it
    always wrote and a record without it belongs to tenant "".

    Raises:
        ValueError: unknown type, missing or extra fields, or a bad value.
    """
    if not isinstance(body, Mapping):
        raise ValueError(f"an event body must be a map, got {type(body).__name__}")
    kind = body.get("type")
    if kind not in BODY_TYPES:
        raise ValueError(f"unknown event type {kind!r}")
    fields = set(body) - {"type"}

    def _only(allowed: set[str], required: set[str]) -> None:
        if not fields <= allowed:
            raise ValueError(f"{kind} has unexpected fields {sorted(map(str, fields - allowed))}")
        if not required <= fields:
            raise ValueError(f"{kind} is missing {sorted(required - fields)}")

    if kind == CREATED:
        _only({"params", "klass", "model", "tenant"}, {"params", "klass", "model"})
        params = body["params"]
        if not isinstance(params, Mapping):
            raise ValueError("created.params must be a map")
        klass, model = body["klass"], body["model"]
        if type(klass) is not str or type(model) is not str:
            raise ValueError("created.klass and created.model must be strings")
        return {"type": CREATED, "params": _plain(params), "klass": klass, "model": model,
                **tenant_field("created.tenant", body.get("tenant"))}
    if kind == PROMPT:
        _only({"tokens", "text"}, {"tokens"})
        return {"type": PROMPT, "tokens": _tokens(body["tokens"]), "text": _opt_str("prompt.text", body.get("text"))}
    if kind == GENERATED:
        _only({"tokens", "text", "finish"}, {"tokens", "text"})
        text = body["text"]
        if type(text) is not str:
            raise ValueError("generated.text must be a string")
        finish = body.get("finish")
        return {
            "type": GENERATED,
            "tokens": _tokens(body["tokens"]),
            "text": text,
            "finish": None if finish is None else _reason("generated.finish", finish),
        }
    if kind == FINISHED:
        _only({"finish", "error"}, {"finish"})
        error = body.get("error")
        if error is not None and type(error) is not str:
            if not isinstance(error, Mapping):
                raise ValueError("finished.error must be a string, a map or None")
            error = _plain(error)
        return {"type": FINISHED, "finish": _reason("finished.finish", body["finish"]), "error": error}
    if kind == CONVERSATION or kind in CONVERSATION_EVENTS:
        _only(*_CONVERSATION_FIELDS[kind])
        return validate_conversation_body(body)
    _only(set(), set())
    return {"type": kind}


# per conversation body type: (allowed fields, required fields)
_CONVERSATION_FIELDS: Final = {
    CONVERSATION: ({"model", "system", "tools", "sampling", "template_kwargs", "tenant"}, {"model", "sampling"}),
    MESSAGE: ({"message", "turn", "finish"}, {"message"}),
    TURN: ({"generation", "params"}, {"generation", "params"}),
    TURN_END: ({"turn", "finish", "error"}, {"turn", "finish"}),
    FORK: ({"source", "at", "edits"}, {"source", "at"}),
    META: ({"version", "title", "archived", "qos", "root"}, {"version"}),
    PURGED: ({"mode"}, {"mode"}),
    TOOL_CANCEL: ({"call_id"}, {"call_id"}),
    PERMISSION_REQUEST: ({"permission", "tool_call_id", "tool", "arguments", "reason"}, {"permission"}),
    PERMISSION_RESPONSE: ({"permission", "allow", "note"}, {"permission", "allow"}),
    PIN: ({"deadline"}, {"deadline"}),
}


def ends_session(body: Mapping[str, Any]) -> bool:
    """True for the bodies after which a session takes no more events."""
    kind = body["type"]
    return kind in (FINISHED, CANCELLED, PURGED) or (kind == GENERATED and body.get("finish") is not None)


# ---- records ------------------------------------------------------------------


def _session_id(_inst: object, _attr: attrs.Attribute[Any], value: object) -> None:
    if type(value) is not str or len(value) > MAX_SESSION_ID:
        raise ValueError(f"session must be a string of at most {MAX_SESSION_ID} characters")


def _nonneg(_inst: object, attr: attrs.Attribute[Any], value: object) -> None:
    _int_field(attr.name, value)


@attrs.frozen(kw_only=True)
class WalRecord:
    """One committed event: ``body`` is canonical (see :func:`validate_body`).

    ``session == DAEMON_SESSION`` exactly for journal-level bodies (epoch bumps).
    """

    session: str = attrs.field(validator=_session_id)
    event_id: int = attrs.field(validator=_nonneg)
    epoch: int = attrs.field(validator=_nonneg)
    ts: int = attrs.field(validator=_nonneg)
    body: dict[str, Any] = attrs.field(converter=validate_body)

    def __attrs_post_init__(self) -> None:
        if (self.session == DAEMON_SESSION) != (self.body["type"] == EPOCH_BUMP):
            raise ValueError("epoch bumps, and only they, belong to the daemon session ''")

    @property
    def type(self) -> str:
        return str(self.body["type"])


def wal_checksum(payload: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(payload, digest_size=8).digest(), "little")


def encode_record(record: WalRecord, *, max_record_size: int = MAX_RECORD_SIZE) -> bytes:
    """Return the framed bytes of ``record`` (header and payload).

    Raises:
        LocalProtocolError: the payload exceeds ``max_record_size``.
    """
    payload: bytes = msgpack.packb(
        {"session": record.session, "event_id": record.event_id, "epoch": record.epoch, "ts": record.ts,
         "body": record.body},
        use_bin_type=True,
    )
    if len(payload) > max_record_size:
        raise LocalProtocolError(f"a session-log record of {len(payload)} bytes exceeds {max_record_size}")
    return _HEADER.pack(len(payload), wal_checksum(payload)) + payload


def _decode_payload(payload: bytes, offset: int) -> WalRecord:
    n = len(payload)
    try:
        obj = msgpack.unpackb(payload, raw=False, max_bin_len=n, max_str_len=n, max_array_len=n,
                              max_map_len=n, max_ext_len=0)
    except Exception as exc:  # noqa: BLE001 - msgpack raises many types; all mean "bad bytes"
        raise WalCorrupt(f"the record's checksum matches but it does not decode ({exc})", offset=offset) from None
    if not isinstance(obj, dict) or set(obj) != {"session", "event_id", "epoch", "ts", "body"}:
        raise WalCorrupt("the record's checksum matches but it is not a session-log record", offset=offset)
    try:
        return WalRecord(**obj)
    except (TypeError, ValueError) as exc:
        raise WalCorrupt(f"the record's checksum matches but it is invalid ({exc})", offset=offset) from None


# ---- errors and the end of a scan ----------------------------------------------------


class WalCorrupt(ProtocolError):
    """The session log is damaged somewhere other than its tail.

    ``offset`` is the byte offset of the damage; ``path`` is filled in by the
    journal. The message says what to do.
    """

    def __init__(self, detail: str, *, offset: int, path: str | None = None) -> None:
        self.detail = detail
        self.offset = offset
        self.path = path
        super().__init__(self._message())

    def _message(self) -> str:
        where = self.path or "wal.log"
        return (
            f"session log {where} is corrupt at byte {self.offset}: {self.detail}. "
            "Refusing to start: records after the damage would be lost. "
            f"Either move {where} aside (it can be inspected later) and start again, "
            "or start with --sessions-cache, which keeps the damaged log as wal.log.corrupt-<n> "
            "and begins a fresh one."
        )

    def with_path(self, path: str) -> WalCorrupt:
        return WalCorrupt(self.detail, offset=self.offset, path=path)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_corrupt, (self.detail, self.offset, self.path))


def _rebuild_corrupt(detail: str, offset: int, path: str | None) -> WalCorrupt:
    return WalCorrupt(detail, offset=offset, path=path)


@attrs.frozen(kw_only=True)
class WalEnd:
    """How a scan ended. Keep ``offset`` bytes; with ``torn`` the rest is a torn
    tail (``reason`` says which kind) and should be truncated away.

    ``offset < len(MAGIC)`` means the file holds no magic yet (empty or torn
    inside it): rewrite it from scratch.
    """

    offset: int
    size: int
    torn: bool
    reason: str = ""

    @property
    def clean(self) -> bool:
        return not self.torn


# ---- the scanner --------------------------------------------------------------


def _find_record(buf: bytearray, start: int, end: int) -> int | None:
    """Offset in ``buf`` of a record with a valid checksum lying wholly in
    ``buf[start:end]``. Used only on damage, so copying the span is fine."""
    chunk = bytes(buf[start:end])
    q = chunk.find(_PAYLOAD_SIGNATURE, HEADER_SIZE)
    while q >= 0:
        length, checksum = _HEADER.unpack_from(chunk, q - HEADER_SIZE)
        if q + length <= len(chunk) and wal_checksum(chunk[q : q + length]) == checksum:
            return start + q - HEADER_SIZE
        q = chunk.find(_PAYLOAD_SIGNATURE, q + 1)
    return None


class WalReader:
    """Sans-I/O scanner for ``wal.log``: feed bytes, pull records.

    ``receive_data(b"")`` marks EOF. :meth:`next_record` returns a
    :class:`WalRecord`, ``NEED_DATA``, or (once the input is exhausted) a
    :class:`WalEnd`, which it then keeps returning; it raises only
    :class:`WalCorrupt`, and keeps raising it once raised.

    Memory: at most one incomplete record (``max_record_size`` plus a header)
    is held beyond what the caller feeds; trailing zero bytes are counted, not
    stored.
    """

    def __init__(self, *, max_record_size: int = MAX_RECORD_SIZE) -> None:
        self.max_record_size = max_record_size
        self._buf = bytearray()
        self._pos = 0  # consumed prefix of _buf
        self._base = 0  # file offset of _buf[0]
        self._eof = False
        self._magic_ok = False
        self._end: WalEnd | None = None
        self._error: WalCorrupt | None = None
        # torn-tail suspicion: the offset to truncate to, and why
        self._torn_at: int | None = None
        self._torn_reason = ""
        self._nonzero_at: int | None = None
        self._size = 0
        self.records = 0

    @property
    def offset(self) -> int:
        """File offset of the next unread byte (the end of the last good record)."""
        return self._base + self._pos

    def receive_data(self, data: bytes) -> None:
        """Feed the next bytes of the file; ``b""`` means EOF.

        Raises:
            LocalProtocolError: data after EOF.
        """
        if self._eof:
            if data:
                raise LocalProtocolError("data after EOF")
            return
        if not data:
            self._eof = True
            return
        start = self._size
        self._size += len(data)
        if self._torn_at is not None:
            self._check_zeros(data, start)
        else:
            self._buf += data

    def _check_zeros(self, data: bytes | bytearray | memoryview, start: int) -> None:
        if self._nonzero_at is None:
            stripped = bytes(data).lstrip(b"\0")
            if stripped:
                self._nonzero_at = start + len(data) - len(stripped)

    def _suspect_torn(self, at: int, reason: str, rest_from: int) -> None:
        """Everything from ``at`` is a torn tail if all bytes from buffer index
        ``rest_from`` on (and all later input) are zero."""
        self._torn_at = at
        self._torn_reason = reason
        self._check_zeros(memoryview(self._buf)[rest_from:], self._base + rest_from)
        self._buf = bytearray()
        self._base = self._size
        self._pos = 0

    def _fail(self, exc: WalCorrupt) -> WalCorrupt:
        self._error = exc
        return exc

    def _finish(self, offset: int, *, torn: bool, reason: str = "") -> WalEnd:
        self._end = WalEnd(offset=offset, size=self._size, torn=torn, reason=reason)
        self._buf = bytearray()
        return self._end

    def next_record(self) -> WalRecord | WalEnd | _NeedData:
        """Return the next record, ``NEED_DATA``, or how the log ended.

        Raises:
            WalCorrupt: damage that is not a torn tail.
        """
        if self._error is not None:
            raise self._error
        if self._end is not None:
            return self._end
        if self._torn_at is not None:
            if self._nonzero_at is not None:
                raise self._fail(WalCorrupt(
                    f"{self._torn_reason}, and non-zero data follows at byte {self._nonzero_at}",
                    offset=self._torn_at,
                ))
            if self._eof:
                return self._finish(self._torn_at, torn=True, reason=self._torn_reason)
            return NEED_DATA
        if not self._magic_ok:
            return self._read_magic()
        return self._read_record()

    def _read_magic(self) -> WalEnd | _NeedData | WalRecord:
        head = bytes(self._buf[: len(MAGIC)])
        if len(head) < len(MAGIC):
            if not self._eof:
                return NEED_DATA
            if not head:
                return self._finish(0, torn=False)
            if MAGIC.startswith(head) or not head.strip(b"\0"):
                return self._finish(0, torn=True, reason="the file ends inside its magic")
            raise self._fail(WalCorrupt(f"not a session log (starts with {head!r})", offset=0))
        if head == MAGIC:
            self._magic_ok = True
            self._pos = len(MAGIC)
            return self._read_record()
        if not head.strip(b"\0"):
            self._suspect_torn(0, "the file holds only zero bytes where its magic should be", len(MAGIC))
            return self.next_record()
        raise self._fail(WalCorrupt(f"not a session log (magic {head!r}, expected {MAGIC!r})", offset=0))

    def _read_record(self) -> WalRecord | WalEnd | _NeedData:
        buf, pos = self._buf, self._pos
        at = self._base + pos
        avail = len(buf) - pos
        if avail < HEADER_SIZE:
            if not self._eof:
                return NEED_DATA
            if avail == 0:
                return self._finish(at, torn=False)
            return self._finish(at, torn=True, reason=f"the final record's header is cut short at byte {at}")
        length, checksum = _HEADER.unpack_from(buf, pos)
        if length > self.max_record_size:
            self._suspect_torn(at, f"the record at byte {at} claims {length} bytes "
                                   f"(more than the {self.max_record_size}-byte limit)", pos + HEADER_SIZE)
            return self.next_record()
        end = pos + HEADER_SIZE + length
        if len(buf) < end:
            if not self._eof:
                return NEED_DATA
            found = _find_record(buf, pos + 1, len(buf))
            if found is not None:
                raise self._fail(WalCorrupt(
                    f"the record at byte {at} claims {length} bytes, running past the end of the file, "
                    f"but a valid record follows at byte {self._base + found} (a damaged length)",
                    offset=at,
                ))
            return self._finish(at, torn=True, reason=f"the final record at byte {at} is cut short")
        payload = bytes(buf[pos + HEADER_SIZE : end])
        if wal_checksum(payload) != checksum:
            found = _find_record(buf, pos + 1, end)
            if found is not None:
                raise self._fail(WalCorrupt(
                    f"the record at byte {at} fails its checksum, but a valid record starts inside it "
                    f"at byte {self._base + found} (a damaged length)",
                    offset=at,
                ))
            self._suspect_torn(at, f"the record at byte {at} fails its checksum", end)
            return self.next_record()
        try:
            record = _decode_payload(payload, at)
        except WalCorrupt as exc:
            raise self._fail(exc) from None
        self._pos = end
        self.records += 1
        if self._pos >= _COMPACT_AT and self._pos * 2 >= len(buf):
            del buf[: self._pos]
            self._base += self._pos
            self._pos = 0
        return record


def read_wal(data: bytes, *, max_record_size: int = MAX_RECORD_SIZE) -> tuple[list[WalRecord], WalEnd]:
    """Scan a whole file's bytes: its records and how it ended.

    Raises:
        WalCorrupt: damage that is not a torn tail.
    """
    reader = WalReader(max_record_size=max_record_size)
    reader.receive_data(data)
    reader.receive_data(b"")
    records: list[WalRecord] = []
    while True:
        item = reader.next_record()
        if isinstance(item, WalEnd):
            return records, item
        assert isinstance(item, WalRecord)  # NEED_DATA is impossible after EOF
        records.append(item)
