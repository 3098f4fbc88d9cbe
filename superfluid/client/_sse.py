"""The one SSE reader over an async byte stream (tests, fuzzers, benchmarks, httpx users)."""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Collection

from ..proto import SseDecoder, SseEvent

__all__ = ["aiter_sse"]


async def aiter_sse(chunks: AsyncIterable[bytes], *, max_line: int = 16 * 1024 * 1024,
                    keep: Collection[str] = ()) -> AsyncIterator[SseEvent]:
    """The events of a streamed body as they arrive, e.g. ``aiter_sse(response.aiter_bytes())``
    with httpx; the end of the body dispatches a last event cut before its blank line
    (:meth:`superfluid.proto.SseDecoder.end`). ``keep`` names non-standard fields to keep."""
    decoder = SseDecoder(max_line=max_line, keep=keep)
    async for chunk in chunks:
        for event in decoder.feed(chunk):
            yield event
    for event in decoder.end():
        yield event
