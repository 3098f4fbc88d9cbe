"""A batch's own write-ahead log, as bytes and as state (pure: no I/O, no clocks).

Each batch (``/v1/batches``, SPEC.md §7 "Batches") keeps ``<sessions>/batches/<id>/log``:
records ``u32 length | u32 crc32 | msgpack map``, appended and fsynced one at a
time by the batch's one writer. The first record is ``created`` (everything the
request said, and who said it); then ``started`` (the input's line count),
``line`` (one per finished input line: its index and its output or error line,
as the bytes that go into the output file), ``cancel`` (a client asked),
``final`` (the batch ended: the status and the file ids). A crash can only tear
the last record: :func:`decode` stops at the first record that does not check
(``BatchLog.good_end``), and the writer cuts the file there before appending.

:func:`replay` folds the records into a :class:`BatchState`. Lines are keyed by
their index in the input: a second ``line`` record for an index (a line re-run
because its result was never logged) cannot happen through the writer, and
replay keeps the first, so a line is never in the output twice.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Mapping
from typing import Any

import attrs
import msgpack

__all__ = ["BATCH_STATUSES", "FINAL_STATUSES", "BatchLog", "BatchState", "LineRecord", "decode", "encode", "replay"]

_HEAD = struct.Struct(">II")
MAX_RECORD = 256 << 20  # a record holds one output line (a reply or an embedding); larger is damage

BATCH_STATUSES = ("validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling",
                  "cancelled")
FINAL_STATUSES = frozenset({"failed", "completed", "expired", "cancelled"})


def encode(record: Mapping[str, Any]) -> bytes:
    """One record's bytes: length, crc32 of the body, the msgpack body."""
    body = msgpack.packb(dict(record), use_bin_type=True)
    return _HEAD.pack(len(body), zlib.crc32(body)) + body


@attrs.frozen
class LineRecord:
    """Where a finished line's output sits in the log (read back at finalizing)."""

    index: int
    ok: bool          # in the output file (a 2xx reply) or the error file
    offset: int       # of the record in the log
    length: int       # of the whole record


@attrs.frozen
class BatchLog:
    records: list[tuple[int, int, dict[str, Any]]]  # (offset, length, body)
    good_end: int                                   # bytes that decoded; anything after is a torn tail


def decode(data: bytes | bytearray | memoryview) -> BatchLog:
    """Every whole record of ``data``; a short or failing record ends the log there."""
    out: list[tuple[int, int, dict[str, Any]]] = []
    view = memoryview(data)
    pos = 0
    while pos + _HEAD.size <= len(view):
        length, crc = _HEAD.unpack_from(view, pos)
        end = pos + _HEAD.size + length
        if length > MAX_RECORD or end > len(view):
            break
        body = bytes(view[pos + _HEAD.size:end])
        if zlib.crc32(body) != crc:
            break
        try:
            value = msgpack.unpackb(body, raw=False)
        except (ValueError, msgpack.UnpackException):
            break
        if not isinstance(value, dict) or not isinstance(value.get("t"), str):
            break
        out.append((pos, end - pos, value))
        pos = end
    return BatchLog(out, pos)


def line_output(body: Mapping[str, Any]) -> bytes:
    """The output line a ``line`` record carries."""
    out = body["out"]
    return out if isinstance(out, bytes) else str(out).encode()


@attrs.define
class BatchState:
    """A batch as its log tells it."""

    created: dict[str, Any]
    total: int | None = None                     # input lines, once counted (``started``)
    lines: dict[int, LineRecord] = attrs.field(factory=dict)
    completed: int = 0
    failed: int = 0
    in_progress_at: int | None = None
    cancelling_at: int | None = None
    final: dict[str, Any] | None = None          # the ``final`` record
    errors: list[dict[str, Any]] = attrs.field(factory=list)

    @property
    def status(self) -> str:
        if self.final is not None:
            return str(self.final["status"])
        if self.cancelling_at is not None:
            return "cancelling"
        if self.total is None:
            return "validating"
        return "in_progress"

    @property
    def done(self) -> bool:
        return self.final is not None

    def apply(self, offset: int, length: int, body: Mapping[str, Any]) -> None:
        kind = body["t"]
        if kind == "started" and self.total is None:
            self.total = int(body["total"])
            self.in_progress_at = int(body["at"])
        elif kind == "line":
            index = int(body["i"])
            if index in self.lines:
                return  # the first result of a line is the one (see the module docstring)
            ok = bool(body["ok"])
            self.lines[index] = LineRecord(index, ok, offset, length)
            if ok:
                self.completed += 1
            else:
                self.failed += 1
        elif kind == "cancel" and self.cancelling_at is None:
            self.cancelling_at = int(body["at"])
        elif kind == "final" and self.final is None:
            self.final = dict(body)
            self.errors = list(body.get("errors") or [])


def replay(log: BatchLog) -> BatchState | None:
    """The state of a batch's log; None when it holds no ``created`` record (a batch
    whose creation never became durable: it was never acknowledged)."""
    if not log.records or log.records[0][2]["t"] != "created":
        return None
    state = BatchState(created=dict(log.records[0][2]))
    for offset, length, body in log.records[1:]:
        state.apply(offset, length, body)
    return state
