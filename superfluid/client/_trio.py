"""The trio flavour: h11 over ``trio.open_tcp_stream``, no background tasks."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import trio

from ._core import ChatState, Dropped, Exchange, ResumePolicy, StateView

__all__ = ["ChatStream", "open_chat_stream"]

READ_SIZE = 65536
CLOSE_S = 1.0


class ChatStream(StateView):
    """An async iterator of text deltas that survives dropped connections.

    Attributes mirror the state: ``session_id``, ``last_event_id``,
    ``finish_reason``, ``usage``, ``reconnects``.
    """

    def __init__(self, state: ChatState) -> None:
        self._state = state
        self._stream: trio.SocketStream | None = None
        self._exchange: Exchange | None = None
        self._next: Exchange | None = None

    def __aiter__(self) -> ChatStream:
        return self

    async def __anext__(self) -> str:
        """The next text delta.

        Raises:
            ChatStreamError: the server failed the chat (typed, not retried).
            StreamLost: the stream dropped and could not be resumed.
            StopAsyncIteration: the stream is complete.

        Cancellation: safe; the stream can be read again or closed.
        """
        st = self._state
        while True:
            if st.pending:
                return st.pending.popleft()
            if st.failure is not None:
                await self.aclose()
                raise st.failure
            if st.done:
                await self.aclose()
                raise StopAsyncIteration
            if self._stream is None:
                await self._connect()
                continue
            assert self._exchange is not None
            try:
                with trio.fail_after(st.policy.read_timeout_s):
                    data = await self._stream.receive_some(READ_SIZE)
                nxt = self._exchange.feed(data)
            except (Dropped, trio.TooSlowError, trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                exchange = self._exchange
                await self.aclose()
                st.lost(trio.current_time(), exchange, str(exc) or type(exc).__name__)
                continue
            if nxt is not None:
                await self.aclose()
                self._next = nxt

    async def _connect(self) -> None:
        st = self._state
        delay = st.before_connect(trio.current_time())
        if delay:
            await trio.sleep(delay)
        exchange, self._next = self._next or st.exchange(), None
        try:
            with trio.fail_after(st.policy.connect_timeout_s):
                stream = await trio.open_tcp_stream(st.target.host, st.target.port)
        except (OSError, trio.TooSlowError) as exc:
            st.lost(trio.current_time(), None, str(exc))  # nothing was sent
            return
        try:
            await stream.send_all(exchange.request())
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            await _close(stream)
            st.lost(trio.current_time(), exchange, str(exc))
            return
        self._stream, self._exchange = stream, exchange

    async def aclose(self) -> None:
        """Close the current connection (idempotent). A resumable generation goes on on the server."""
        stream, self._stream, self._exchange = self._stream, None, None
        if stream is not None:
            await _close(stream)


async def _close(stream: trio.SocketStream) -> None:
    with trio.move_on_after(CLOSE_S, shield=True):
        await stream.aclose()


@asynccontextmanager
async def open_chat_stream(url: str, body: dict[str, Any] | None = None, *, headers: dict[str, str] | None = None,
                           policy: ResumePolicy | None = None, session: str | None = None,
                           last_event_id: str | None = None) -> AsyncIterator[ChatStream]:
    """Stream a chat completion as text deltas, resuming across dropped connections.

    ``POST {url}/v1/chat/completions`` with ``x-superfluid-resumable: true``
    (``body`` is an OpenAI chat body; ``stream`` is forced on). When the
    connection drops, or the daemon restarts (connections refused while it
    comes back), the stream reconnects with exponential backoff to
    ``GET /v1/sessions/{id}/stream`` with ``Last-Event-ID``: the deltas go on
    with nothing repeated or lost. With ``session`` (and ``last_event_id``)
    and no body, it resumes a stream started elsewhere.

    Args:
        url: the daemon's base URL, ``http://HOST:PORT``.
        body: the chat completion request.
        headers: extra request headers (e.g. ``x-superfluid-qos``).
        policy: reconnect limits and timeouts.
        session: resume this session instead of starting one.
        last_event_id: with ``session``, the last SSE id already consumed.

    Returns:
        A context manager yielding a :class:`ChatStream` (``async for delta in stream``).

    Raises:
        ValueError: a URL that is not ``http://``, or neither body nor session.

    Cancellation: leaving the block closes the connection; the generation
    itself runs on on the server (resumable) until its ``--resume-ttl``.

    Resource handling: at most one connection is open at a time; it is closed
    when the stream ends, fails, or the block exits.
    """
    stream = ChatStream(ChatState(url, body, headers=headers, policy=policy, session=session,
                                  last_event_id=last_event_id))
    try:
        yield stream
    finally:
        await stream.aclose()
