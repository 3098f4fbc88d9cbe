"""Pure encoders for streamed HTTP bodies (SSE (WHATWG) and NDJSON), and the one SSE
decoder every reader of a stream uses (client, suite, tests, fuzz, bench; over an async
byte stream through ``superfluid.client.aiter_sse``)."""

from __future__ import annotations

import json
from collections.abc import Collection
from typing import Any, NamedTuple

__all__ = ["SSE_DONE", "SSE_PING", "SseDecoder", "SseEvent", "SseLineTooLong", "encode_ndjson", "encode_sse",
           "encode_sse_json"]

SSE_DONE = b"data: [DONE]\n\n"
SSE_PING = b": ping\n\n"


def _field(name: str, value: str) -> str:
    if "\r" in value or "\n" in value:
        raise ValueError(f"SSE {name} must not contain CR or LF")
    return f"{name}: {value}\n"


def encode_sse(*, data: str, event: str | None = None, id: str | None = None, retry: int | None = None) -> bytes:
    """One SSE event: optional ``event``/``id``/``retry`` fields, one ``data:``
    line per line of ``data``, and the blank-line terminator."""
    out = []
    if event is not None:
        out.append(_field("event", event))
    if id is not None:
        out.append(_field("id", id))
    if retry is not None:
        out.append(f"retry: {int(retry)}\n")
    for line in data.replace("\r\n", "\n").replace("\r", "\n").split("\n"):
        out.append(f"data: {line}\n")
    out.append("\n")
    return "".join(out).encode()


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def encode_sse_json(obj: Any, *, event: str | None = None, id: str | None = None) -> bytes:
    return encode_sse(data=_dumps(obj), event=event, id=id)


def encode_ndjson(obj: Any) -> bytes:
    return (_dumps(obj) + "\n").encode()


class SseLineTooLong(ValueError):
    """A line (no LF yet) grew past the decoder's ``max_line``."""


class SseEvent(NamedTuple):
    event: str | None  # the ``event:`` field (None: a plain message)
    id: str | None
    data: str  # the ``data:`` lines joined with LF
    extra: tuple[tuple[str, str], ...] = ()  # non-standard fields the decoder was asked to keep

    def json(self) -> Any:
        return json.loads(self.data)

    def field(self, name: str) -> str | None:
        """The last value of a kept non-standard field (``SseDecoder(keep=...)``), or None."""
        return next((v for k, v in reversed(self.extra) if k == name), None)


class SseDecoder:
    """Server-sent events from bytes, as they arrive: ``feed`` returns the events that
    a blank line completed, ``end`` what the end of the body completed. An event with
    neither data, nor a name, nor a kept field is not dispatched; comments (``: ping``)
    and unknown fields are skipped unless named in ``keep`` (e.g. llama-server's
    ``error:``). Memory is bounded by ``max_line``."""

    def __init__(self, *, max_line: int = 16 * 1024 * 1024, keep: Collection[str] = ()) -> None:
        self.max_line = max_line
        self.keep = frozenset(keep)
        self._buf = bytearray()
        self._data: list[str] = []
        self._event: str | None = None
        self._id: str | None = None
        self._extra: list[tuple[str, str]] = []

    def feed(self, data: bytes) -> list[SseEvent]:
        """Raises SseLineTooLong past ``max_line`` bytes without a line end."""
        self._buf += data
        events: list[SseEvent] = []
        while True:
            nl = self._buf.find(b"\n")
            if nl < 0:
                if len(self._buf) > self.max_line:
                    raise SseLineTooLong(f"an SSE line longer than {self.max_line} bytes")
                return events
            line = bytes(self._buf[:nl]).rstrip(b"\r").decode("utf-8", "replace")
            del self._buf[: nl + 1]
            self._line(line, events)

    def end(self) -> list[SseEvent]:
        """The body ended: its last line, even without a line end, and the event it
        leaves open are dispatched (leniently: a stream cut before its blank line
        still yields what it said)."""
        events: list[SseEvent] = []
        if self._buf:
            line = bytes(self._buf).rstrip(b"\r").decode("utf-8", "replace")
            self._buf.clear()
            self._line(line, events)
        self._line("", events)
        return events

    def _line(self, line: str, events: list[SseEvent]) -> None:
        if not line:
            if self._data or self._event is not None or self._extra:
                events.append(SseEvent(self._event, self._id, "\n".join(self._data), tuple(self._extra)))
            self._data, self._event, self._id, self._extra = [], None, None, []
            return
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value
        elif name == "id":
            self._id = value
        elif name in self.keep:
            self._extra.append((name, value))

