"""Server-sent events on an ASGI ``send``: the one response helper every SSE route uses.

A route opens an :class:`SseResponse`, sends its head with :meth:`~SseResponse.start`,
its events with :meth:`~SseResponse.send`, and ends it exactly once: with its last
events (:meth:`~SseResponse.end`) or, when the generation fails after the head went
out, with the dialect's error frame (:meth:`~SseResponse.fail`). OpenAI-shaped
streams (the OpenAI dialect, resumable sessions, conversation turns) close with
``data: [DONE]``; the Anthropic and Responses streams end on their own last event.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from ..proto import SSE_DONE, encode_sse_json
from ._http import ApiError, Send

__all__ = ["SSE_HEADERS", "SseResponse", "openai_error_frame"]

SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"),
               (b"x-accel-buffering", b"no")]


def openai_error_frame(exc: ApiError) -> bytes:
    """An error mid-stream as OpenAI sends it: a ``data:`` frame holding the error envelope."""
    return encode_sse_json(exc.body())


class SseResponse:
    """One ``text/event-stream`` response: a head, events, one end.

    ``done`` appends ``data: [DONE]`` to the last frame; ``error`` renders an
    :class:`ApiError` as the dialect's error frame(s).
    """

    def __init__(self, send: Send, *, done: bool = True,
                 error: Callable[[ApiError], bytes] = openai_error_frame) -> None:
        self._send = send
        self._done = done
        self._error = error
        self.started = False
        self.ended = False

    async def start(self, headers: Iterable[tuple[bytes, bytes]] = ()) -> None:
        """Send the 200 head (``SSE_HEADERS`` plus ``headers``)."""
        assert not self.started, "SSE response started twice"
        self.started = True
        await self._send({"type": "http.response.start", "status": 200, "headers": [*SSE_HEADERS, *headers]})

    async def send(self, frames: bytes) -> None:
        """Send encoded events (``encode_sse_json``) and keep the response open."""
        assert self.started and not self.ended, "SSE event outside the response"
        await self._send({"type": "http.response.body", "body": frames, "more_body": True})

    async def end(self, frames: bytes = b"") -> None:
        """Send the last events (then ``[DONE]`` if this stream uses it) and close the body."""
        assert self.started and not self.ended, "SSE response ended twice"
        self.ended = True
        await self._send({"type": "http.response.body", "body": frames + (SSE_DONE if self._done else b""),
                          "more_body": False})

    async def fail(self, exc: ApiError, frames: bytes | None = None) -> None:
        """End with the dialect's error frame for ``exc`` (or the given ``frames``, already rendered)."""
        await self.end(self._error(exc) if frames is None else frames)
