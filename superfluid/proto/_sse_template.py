"""Pre-encoded SSE events whose shape is fixed but for one string.

A streamed chunk differs from the next only in its text: encoding the whole
object with ``json.dumps`` for every chunk rebuilt the same bytes around it.
A :class:`SseTemplate` encodes the object once with a marker in the text's
place, keeps the bytes before and after it, and fills in only the text's JSON
per chunk. The result is byte for byte ``encode_sse_json(obj)`` with the text
in place (JSON never holds a raw CR or LF, so the SSE framing is one ``data:``
line around it).
"""

from __future__ import annotations

import json
from typing import Any

from ._sse import encode_sse_json

__all__ = ["SseTemplate"]

MARKER = "\x00superfluid-template\x00"


class SseTemplate:
    """``fill(text)`` == ``encode_sse_json(build(text))`` for a ``build`` that puts
    ``text`` in one place of an otherwise fixed object.

    Raises:
        ValueError: the marker does not appear exactly once in ``build(MARKER)``
            (a fixed field holds it: build such chunks the plain way).
    """

    __slots__ = ("_prefix", "_suffix")

    def __init__(self, obj: Any) -> None:
        encoded = encode_sse_json(obj)
        parts = encoded.split(_dumps(MARKER).encode())
        if len(parts) != 2:
            raise ValueError("the template marker must appear exactly once")
        self._prefix, self._suffix = parts

    def fill(self, text: str) -> bytes:
        return self._prefix + _dumps(text).encode() + self._suffix


def _dumps(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)
