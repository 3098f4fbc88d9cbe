"""What a server answered, and how it failed.

Pure code (no sockets, no clocks): the HTTP client feeds body bytes and the
arrival time of each read into a :class:`StreamReader` (SSE) or hands the
whole body to :func:`read_whole`; both fill one :class:`Reply`.

Failure classification (the scenarios judge by it):

* typed: ``http`` (a non-200 status, body kept) or ``event`` (an SSE
  ``event: error`` line, a ``data:`` object carrying ``error`` and no
  ``choices``, or llama-server's ``error: {...}`` line);
* untyped: ``truncated`` (the stream ended with neither ``[DONE]`` nor a
  ``finish_reason``), ``timeout``, ``transport`` (refused, reset, broken
  HTTP), ``malformed`` (200 with a body or data line that is not JSON).

A request the client closed on purpose (the disconnect scenarios) is
``aborted``: neither ok nor a failure.
"""

from __future__ import annotations

import itertools
import json
from typing import Any, Callable

import attrs

from ..proto import SseDecoder, SseEvent

__all__ = ["TYPED", "UNTYPED", "Reply", "StreamReader", "read_whole"]

TYPED = ("http", "event")
UNTYPED = ("truncated", "timeout", "transport", "malformed")


@attrs.define
class Reply:
    stream: bool = False
    status: int | None = None
    error_kind: str | None = None
    error: str = ""
    aborted: bool = False
    content: str = ""
    reasoning: str = ""
    tool_calls: list[dict[str, Any]] = attrs.field(factory=list)
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    timings: dict[str, Any] | None = None
    done: bool = False
    body: Any = None
    sent_at: float = 0.0
    finished_at: float = 0.0
    chunk_times: list[float] = attrs.field(factory=list)
    headers: dict[str, str] = attrs.field(factory=dict)   # response headers, names lower-cased
    last_event_id: str | None = None                     # the SSE ``id:`` of the last event read whole

    def fail(self, kind: str, message: str) -> None:
        """Record the first failure only: later symptoms follow from it."""
        if self.error_kind is None:
            self.error_kind = kind
            self.error = message[:500]

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error_kind is None and not self.aborted

    @property
    def typed_error(self) -> bool:
        return self.error_kind in TYPED

    @property
    def outcome(self) -> str:
        if self.error_kind is not None:
            return self.error_kind
        return "aborted" if self.aborted else "ok"

    @property
    def chunks(self) -> int:
        return len(self.chunk_times)

    @property
    def ttft(self) -> float | None:
        if self.chunk_times:
            return self.chunk_times[0] - self.sent_at
        if not self.stream and self.ok:
            return self.finished_at - self.sent_at
        return None

    @property
    def max_gap(self) -> float:
        times = self.chunk_times
        return max((b - a for a, b in itertools.pairwise(times)), default=0.0)

    @property
    def prompt_tokens(self) -> int | None:
        return (self.usage or {}).get("prompt_tokens")

    @property
    def completion_tokens(self) -> int | None:
        return (self.usage or {}).get("completion_tokens")

    @property
    def cached_tokens(self) -> int | None:
        """``usage.prompt_tokens_details.cached_tokens``, else llama-server's ``timings.cache_n``."""
        details = (self.usage or {}).get("prompt_tokens_details") or {}
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            return details["cached_tokens"]
        cache_n = (self.timings or {}).get("cache_n")
        return cache_n if isinstance(cache_n, int) else None

    def summary(self, *, text: bool = False) -> dict[str, Any]:
        """The numbers a result file keeps for one request."""
        out: dict[str, Any] = {
            "outcome": self.outcome, "status": self.status, "ttft_s": _r(self.ttft), "chunks": self.chunks,
            "max_gap_s": _r(self.max_gap), "seconds": _r(self.finished_at - self.sent_at),
            "finish_reason": self.finish_reason, "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens, "cached_tokens": self.cached_tokens,
        }
        if self.error_kind:
            out["error"] = self.error
        if text:
            out["text"] = self.content
        return out


def _r(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def _error_message(payload: str) -> str:
    try:
        obj = json.loads(payload)
    except ValueError:
        return payload
    err = obj.get("error", obj) if isinstance(obj, dict) else obj
    return str(err.get("message", err)) if isinstance(err, dict) else str(err)


def _merge_tool_calls(reply: Reply, deltas: list[Any]) -> None:
    for d in deltas:
        if not isinstance(d, dict):
            continue
        index = d.get("index", len(reply.tool_calls))
        while len(reply.tool_calls) <= index:
            reply.tool_calls.append({"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
        call = reply.tool_calls[index]
        if d.get("id"):
            call["id"] = d["id"]
        fn = d.get("function") or {}
        call["function"]["name"] += fn.get("name") or ""
        call["function"]["arguments"] += fn.get("arguments") or ""


class StreamReader:
    """Incremental SSE parser for OpenAI-style chat/completion streams
    (events from :class:`superfluid.proto.SseDecoder`).

    ``on_chunk(reply)`` runs after each content-bearing chunk; returning
    ``"abort"`` sets :attr:`abort` and the client closes its socket.
    """

    def __init__(self, reply: Reply, *, on_chunk: Callable[[Reply], Any] | None = None) -> None:
        self.reply = reply
        self.on_chunk = on_chunk
        self.abort = False
        # llama-server's own (non-standard) ``error:`` field reports a failed stream
        self._decoder = SseDecoder(keep=("error",))

    def feed(self, data: bytes, now: float) -> None:
        self._events(self._decoder.feed(data), now)

    def _events(self, events: list[SseEvent], now: float) -> None:
        for event in events:
            if self.abort:  # the client hangs up here; later bytes were never "received"
                return
            self._event(event, now)

    def _event(self, event: SseEvent, now: float) -> None:
        reply = self.reply
        failed = event.field("error")
        if failed is not None:
            reply.fail("event", _error_message(failed.strip()))
            return
        event_error = "error" in (event.event or "")
        payload = event.data.strip()
        if not payload:
            if event_error:  # an error event with no data line
                reply.fail("event", "event: error")
            return
        if event.id is not None:  # the cursor counts once its event's data was read
            reply.last_event_id = event.id.strip()
        if payload == "[DONE]":
            reply.done = True
            return
        try:
            obj = json.loads(payload)
        except ValueError:
            reply.fail("malformed", f"data line is not JSON: {payload[:200]}")
            return
        if not isinstance(obj, dict):
            reply.fail("malformed", f"data line is not an object: {payload[:200]}")
            return
        if event_error or ("error" in obj and not obj.get("choices")):
            reply.fail("event", _error_message(payload))
            return
        if isinstance(obj.get("usage"), dict):
            reply.usage = obj["usage"]
        if isinstance(obj.get("timings"), dict):
            reply.timings = obj["timings"]
        choices = obj.get("choices") or []
        if not choices or not isinstance(choices[0], dict):
            return
        choice = choices[0]
        bearing = False
        delta = choice.get("delta")
        if not isinstance(delta, dict):  # /v1/completions streams carry ``text``
            delta = {"content": choice.get("text")}
        if delta.get("content"):
            reply.content += delta["content"]
            bearing = True
        thought = delta.get("reasoning_content") or delta.get("reasoning")
        if thought:
            reply.reasoning += thought
            bearing = True
        if delta.get("tool_calls"):
            _merge_tool_calls(reply, delta["tool_calls"])
            bearing = True
        if choice.get("finish_reason"):
            reply.finish_reason = choice["finish_reason"]
        if bearing:
            reply.chunk_times.append(now)
            if self.on_chunk is not None and self.on_chunk(reply) == "abort":
                self.abort = True

    def end(self, now: float) -> None:
        """The body ended (cleanly or not): flush and classify truncation."""
        self._events(self._decoder.end(), now)
        reply = self.reply
        reply.finished_at = now
        if reply.error_kind is None and not reply.aborted and not reply.done and reply.finish_reason is None:
            reply.fail("truncated", "the stream ended with neither [DONE] nor a finish_reason")


def read_whole(reply: Reply, data: bytes, now: float) -> None:
    """Parse a complete non-streamed body into ``reply``."""
    reply.finished_at = now
    text = data.decode("utf-8", "replace")
    if reply.status != 200:
        reply.fail("http", f"HTTP {reply.status}: {text[:400]}")
        return
    try:
        obj = json.loads(text)
    except ValueError:
        reply.fail("malformed", f"200 with a body that is not JSON: {text[:200]}")
        return
    reply.body = obj
    if not isinstance(obj, dict):
        return
    if "error" in obj and not obj.get("choices"):
        reply.fail("http", f"HTTP 200 carrying an error: {json.dumps(obj['error'])[:400]}")
        return
    if isinstance(obj.get("usage"), dict):
        reply.usage = obj["usage"]
    if isinstance(obj.get("timings"), dict):
        reply.timings = obj["timings"]
    choices = obj.get("choices") or []
    if choices and isinstance(choices[0], dict):
        choice = choices[0]
        message = choice.get("message") if isinstance(choice.get("message"), dict) else {}
        reply.content = message.get("content") or choice.get("text") or ""
        reply.reasoning = message.get("reasoning_content") or message.get("reasoning") or ""
        reply.tool_calls = list(message.get("tool_calls") or [])
        reply.finish_reason = choice.get("finish_reason")
