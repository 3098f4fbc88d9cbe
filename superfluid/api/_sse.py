"""Server-sent events on an ASGI ``send``: the response head every SSE route sends."""

from __future__ import annotations

__all__ = ["SSE_HEADERS"]

SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"),
               (b"x-accel-buffering", b"no")]
