"""The blocking flavour: the same sans-IO core over plain sockets.

No threads and no event loop: each ``next()`` reads the socket until a delta
is complete. Sleeping and the outage clock use ``time`` because there is no
trio clock here.
"""

from __future__ import annotations

import socket
import time
from types import TracebackType
from typing import Any

from ._core import ChatState, Dropped, Exchange, ResumePolicy, StateView

__all__ = ["SyncChatStream", "stream_chat"]

READ_SIZE = 65536


class SyncChatStream(StateView):
    """An iterator of text deltas that survives dropped connections (see :func:`stream_chat`)."""

    def __init__(self, state: ChatState) -> None:
        self._state = state
        self._sock: socket.socket | None = None
        self._exchange: Exchange | None = None
        self._next: Exchange | None = None

    def __iter__(self) -> SyncChatStream:
        return self

    def __next__(self) -> str:
        st = self._state
        while True:
            if st.pending:
                return st.pending.popleft()
            if st.failure is not None:
                self.close()
                raise st.failure
            if st.done:
                self.close()
                raise StopIteration
            if self._sock is None:
                self._connect()
                continue
            assert self._exchange is not None
            try:
                data = self._sock.recv(READ_SIZE)
                nxt = self._exchange.feed(data)
            except (Dropped, OSError) as exc:  # socket.timeout is an OSError
                exchange = self._exchange
                self.close()
                st.lost(time.monotonic(), exchange, str(exc) or type(exc).__name__)
                continue
            if nxt is not None:
                self.close()
                self._next = nxt

    def _connect(self) -> None:
        st = self._state
        delay = st.before_connect(time.monotonic())
        if delay:
            time.sleep(delay)
        exchange, self._next = self._next or st.exchange(), None
        try:
            sock = socket.create_connection((st.target.host, st.target.port), timeout=st.policy.connect_timeout_s)
        except OSError as exc:
            st.lost(time.monotonic(), None, str(exc))  # nothing was sent
            return
        try:
            sock.settimeout(st.policy.read_timeout_s)
            sock.sendall(exchange.request())
        except OSError as exc:
            sock.close()
            st.lost(time.monotonic(), exchange, str(exc))
            return
        self._sock, self._exchange = sock, exchange

    def close(self) -> None:
        """Close the current connection (idempotent). A resumable generation goes on on the server."""
        sock, self._sock, self._exchange = self._sock, None, None
        if sock is not None:
            sock.close()

    def __enter__(self) -> SyncChatStream:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def stream_chat(url: str, body: dict[str, Any] | None = None, *, headers: dict[str, str] | None = None,
                policy: ResumePolicy | None = None, session: str | None = None,
                last_event_id: str | None = None) -> SyncChatStream:
    """Stream a chat completion as text deltas, resuming across dropped connections.

    The blocking twin of :func:`~superfluid.client.open_chat_stream` (same
    arguments and behaviour)::

        with stream_chat("http://127.0.0.1:8453", body) as stream:
            for delta in stream:
                print(delta, end="", flush=True)

    Raises:
        ValueError: a URL that is not ``http://``, or neither body nor session.

    Iterating raises ``ChatStreamError`` (the server failed the chat) or
    ``StreamLost`` (the stream dropped and could not be resumed).
    """
    return SyncChatStream(ChatState(url, body, headers=headers, policy=policy, session=session,
                                    last_event_id=last_event_id))
