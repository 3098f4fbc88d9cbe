"""The client's sans-IO core: requests, SSE parsing and resume decisions.

A :class:`ChatState` is one logical chat stream; it makes one
:class:`Exchange` (one HTTP/1.1 request on its own connection, via h11) per
attempt. The first attempt is ``POST /v1/chat/completions`` with
``x-superfluid-resumable: true``; the reply names the session
(``x-superfluid-session``) and each SSE event carries ``id: <token cursor>``.
After a drop, each attempt is ``GET /v1/sessions/{id}/stream`` with
``Last-Event-ID`` set to the id of the last event whose text was handed out,
so the server replays exactly what was missed: nothing is repeated.

The IO drivers (``_trio.py``, ``_sync.py``) only move bytes, sleep and read
clocks; they pass the time in, so everything here is deterministic.
"""

from __future__ import annotations

import json
from collections import deque
from typing import Any
from urllib.parse import quote, urlsplit

import attrs
import h11

from ..proto._sse import SseDecoder, SseLineTooLong

__all__ = ["ChatState", "ChatStreamError", "Dropped", "Exchange", "ResumePolicy", "SseParser", "StreamLost"]

MAX_LINE = 16 * 1024 * 1024     # an SSE line longer than this is a protocol error
MAX_ERROR_BODY = 1024 * 1024    # bytes of a non-200 body kept for the error message
RETRY_STATUSES = (502, 503, 504)


@attrs.frozen(kw_only=True)
class ResumePolicy:
    """How hard the client tries to get a dropped stream back.

    Each outage (from the first failure to the next successful response) may
    use at most ``attempts`` reconnects and ``total_s`` seconds; the delay
    before reconnect ``k`` (0-based) is ``min(max_delay_s, initial_s * factor**k)``.
    """

    attempts: int = 12
    initial_s: float = 0.1
    factor: float = 2.0
    max_delay_s: float = 5.0
    total_s: float = 120.0
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 300.0   # a stream silent this long counts as dropped

    def delay(self, attempt: int) -> float:
        return float(min(self.max_delay_s, self.initial_s * self.factor ** attempt))


class ChatStreamError(Exception):
    """The server refused or failed the chat (a typed error); not retried."""

    def __init__(self, message: str, *, status: int | None = None, code: str | None = None,
                 body: Any = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.body = body


class StreamLost(ChatStreamError):
    """The stream dropped and could not be resumed (gave up, or nothing to resume)."""


class Dropped(Exception):
    """Internal: this attempt's connection is gone; the driver reconnects."""


class SseParser:
    """Server-sent events from bytes (``proto.SseDecoder``): ``feed`` returns complete
    ``(id, data)`` messages; a line past ``MAX_LINE`` drops the connection."""

    def __init__(self) -> None:
        self._decoder = SseDecoder(max_line=MAX_LINE)

    def feed(self, data: bytes) -> list[tuple[str | None, str]]:
        try:
            return [(e.id, e.data) for e in self._decoder.feed(data) if e.data or e.event is None]
        except SseLineTooLong as exc:
            raise Dropped(str(exc)) from None


@attrs.define
class Target:
    host: str
    port: int
    prefix: str

    @classmethod
    def parse(cls, url: str) -> Target:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"expected http://HOST[:PORT] (the daemon's base URL), got {url!r}")
        prefix = parts.path.rstrip("/")
        if prefix.endswith("/v1"):
            prefix = prefix[: -len("/v1")]
        return cls(parts.hostname, parts.port or 80, prefix)

    @property
    def authority(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


class ChatState:
    """One logical chat stream across any number of connections.

    Drivers read :attr:`pending` (text deltas, in order) before anything else,
    then raise :attr:`failure` if set, then stop when :attr:`done`.
    """

    def __init__(self, url: str, body: dict[str, Any] | None, *, headers: dict[str, str] | None = None,
                 policy: ResumePolicy | None = None, session: str | None = None,
                 last_event_id: str | None = None) -> None:
        if body is None and session is None:
            raise ValueError("give a chat body to start a stream, or a session id to resume one")
        self.target = Target.parse(url)
        self.body = None if body is None else json.dumps({**body, "stream": True}).encode()
        self.stops = bool(body and body.get("stop"))
        self.headers = dict(headers or {})
        self.policy = policy or ResumePolicy()
        self.session_id = session
        self.last_event_id = last_event_id
        self.pending: deque[str] = deque()
        self.failure: ChatStreamError | None = None
        self.done = False
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        self.model: str | None = None
        self.received: list[str] = []       # every delta handed out (for the log fallback)
        self.reconnects = 0
        self._outage_since: float | None = None
        self._attempts = 0

    # -- the outage ledger -----------------------------------------------------------------------------------------

    def before_connect(self, now: float) -> float:
        """Seconds to wait before the next attempt (0 outside an outage).

        Raises:
            StreamLost: this outage used its attempts or its time.
        """
        if self._outage_since is None:
            return 0.0
        delay = self.policy.delay(self._attempts)
        spent = now - self._outage_since
        if self._attempts >= self.policy.attempts or spent + delay > self.policy.total_s:
            raise StreamLost(f"the stream dropped and {self._attempts} reconnects over {spent:.1f} s did not get it "
                             f"back (session {self.session_id})")
        self._attempts += 1
        self.reconnects += 1
        return delay

    def lost(self, now: float, exchange: Exchange | None, reason: str) -> None:
        """This attempt failed (``exchange`` is None if nothing was sent).

        Raises:
            StreamLost: nothing can be resumed: the start request went out (and
                may have started a generation) but no session id came back.
        """
        if self.session_id is None and exchange is not None and exchange.status in (None, 200):
            raise StreamLost(f"the connection dropped before the server named the session ({reason}); "
                             "resending could start a second generation")
        if self._outage_since is None:
            self._outage_since = now

    def _recovered(self) -> None:
        self._outage_since = None
        self._attempts = 0

    # -- exchanges ---------------------------------------------------------------------------------------------------

    def exchange(self) -> Exchange:
        """The next request: start, resume, or (resume refused) read the session from the log."""
        return Exchange(self, "start" if self.session_id is None else "resume")

    def _deliver(self, text: str) -> None:
        if text:
            self.pending.append(text)
            self.received.append(text)


class Exchange:
    """One request and its response on one connection (h11, ``Connection: close``)."""

    def __init__(self, state: ChatState, kind: str) -> None:
        self.state = state
        self.kind = kind                   # "start", "resume", or "info"
        self.conn = h11.Connection(h11.CLIENT)
        self.status: int | None = None
        self.sse = SseParser()
        self._body: list[bytes] = []
        self._size = 0

    def request(self) -> bytes:
        st = self.state
        t = st.target
        head = [("Host", t.authority), ("User-Agent", "superfluid-client"), ("Connection", "close"),
                *st.headers.items()]
        if self.kind == "start":
            assert st.body is not None
            head += [("Content-Type", "application/json"), ("Content-Length", str(len(st.body))),
                     ("Accept", "text/event-stream"), ("x-superfluid-resumable", "true")]
            out = self.conn.send(h11.Request(method="POST", target=t.prefix + "/v1/chat/completions", headers=head))
            out += self.conn.send(h11.Data(data=st.body))
        else:
            sid = quote(st.session_id or "", safe="")
            path = f"{t.prefix}/v1/sessions/{sid}" + ("/stream" if self.kind == "resume" else "")
            if self.kind == "resume":
                head.append(("Accept", "text/event-stream"))
                if st.last_event_id is not None:
                    head.append(("Last-Event-ID", st.last_event_id))
            out = self.conn.send(h11.Request(method="GET", target=path, headers=head))
        return out + self.conn.send(h11.EndOfMessage())

    def feed(self, data: bytes) -> Exchange | None:
        """Take bytes from the connection (``b""`` at EOF). Deltas go to ``state.pending``.

        Returns:
            None, or the exchange to run next when this one decided so (the log fallback).

        Raises:
            Dropped: the connection ended before the stream did; reconnect.
        """
        try:
            self.conn.receive_data(data)
            while True:
                event = self.conn.next_event()
                if event is h11.NEED_DATA:
                    if data == b"":
                        raise Dropped("EOF")
                    return None
                if isinstance(event, h11.Response):
                    self._response(event)
                elif isinstance(event, h11.Data):
                    if self.status == 200 and self.kind != "info":
                        self._events(bytes(event.data))
                        if self.state.done or self.state.failure is not None:
                            return None
                    else:
                        self._size += len(event.data)
                        if self._size <= MAX_ERROR_BODY:
                            self._body.append(bytes(event.data))
                elif isinstance(event, h11.EndOfMessage):
                    return self._end()
                elif isinstance(event, h11.ConnectionClosed):
                    raise Dropped("connection closed")
        except h11.RemoteProtocolError as exc:
            raise Dropped(f"broken HTTP: {exc}") from None

    def _response(self, event: h11.Response) -> None:
        st = self.state
        self.status = event.status_code
        if self.status != 200:
            return
        if self.kind == "start":
            sid = dict(event.headers).get(b"x-superfluid-session")
            st.session_id = sid.decode() if sid else None
        st._recovered()

    def _events(self, data: bytes) -> None:
        st = self.state
        for event_id, payload in self.sse.feed(data):
            if payload == "[DONE]":
                st.done = True
                return
            try:
                obj = json.loads(payload)
            except ValueError:
                raise Dropped(f"undecodable SSE data: {payload[:80]!r}") from None
            if isinstance(obj, dict) and "error" in obj:
                err = obj["error"] if isinstance(obj["error"], dict) else {"message": str(obj["error"])}
                st.failure = ChatStreamError(str(err.get("message")), code=err.get("code"), body=obj)
                return
            st.model = obj.get("model", st.model)
            for choice in obj.get("choices") or ():
                delta = choice.get("delta") or {}
                st._deliver(delta.get("content") or choice.get("text") or "")
                st.finish_reason = choice.get("finish_reason") or st.finish_reason
            if obj.get("usage"):
                st.usage = obj["usage"]
            if event_id is not None:
                st.last_event_id = event_id

    def _end(self) -> Exchange | None:
        st = self.state
        if self.status == 200 and self.kind != "info":
            if not st.done and st.failure is None:
                raise Dropped("the stream ended without [DONE]")
            return None
        body: Any = b"".join(self._body)
        try:
            body = json.loads(body)
        except ValueError:
            body = body.decode("utf-8", "replace")
        if self.kind == "info" and self.status == 200 and isinstance(body, dict):
            self._finish_from_log(body)
            return None
        if self.status in RETRY_STATUSES:
            raise Dropped(f"HTTP {self.status}")
        err = body.get("error") if isinstance(body, dict) else None
        message = err.get("message") if isinstance(err, dict) else str(body)[:500]
        code = err.get("code") if isinstance(err, dict) else None
        if self.kind == "resume" and self.status == 404 and code == "session_not_found":
            st._recovered()
            return Exchange(st, "info")  # the daemon holds no live session: read what the log has
        cls = StreamLost if self.kind != "start" else ChatStreamError
        raise cls(f"HTTP {self.status}: {message}", status=self.status, code=code, body=body)

    def _finish_from_log(self, info: dict[str, Any]) -> None:
        """The session ended before we got its tail, and only the log has it."""
        st = self.state
        seen = "".join(st.received)
        text = info.get("text") or ""
        if info.get("generating") or st.stops or not text.startswith(seen):
            raise StreamLost(f"session {st.session_id} is not live on the server and its log cannot complete "
                             "this stream", body=info)
        st._deliver(text[len(seen):])
        st.finish_reason = info.get("finish_reason") or st.finish_reason
        st.done = True


class StateView:
    """What both stream flavours expose of their :class:`ChatState`."""

    _state: ChatState

    @property
    def session_id(self) -> str | None:
        return self._state.session_id

    @property
    def last_event_id(self) -> str | None:
        return self._state.last_event_id

    @property
    def finish_reason(self) -> str | None:
        return self._state.finish_reason

    @property
    def usage(self) -> dict[str, Any] | None:
        return self._state.usage

    @property
    def reconnects(self) -> int:
        return self._state.reconnects
