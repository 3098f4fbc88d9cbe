"""Pure encoders for streamed HTTP bodies: SSE (WHATWG) and NDJSON."""

from __future__ import annotations

import json
from typing import Any

__all__ = ["SSE_DONE", "SSE_PING", "encode_ndjson", "encode_sse", "encode_sse_json"]

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
