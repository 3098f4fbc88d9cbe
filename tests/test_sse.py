"""The one SSE writer (api/_sse.SseResponse) and the one SSE reader (proto.SseDecoder, client.aiter_sse)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import trio

from superfluid.api._http import ApiError
from superfluid.api._sse import SSE_HEADERS, SseResponse
from superfluid.client import aiter_sse
from superfluid.proto import SSE_DONE, SseDecoder, SseEvent, encode_sse_json


class Wire:
    """An ASGI ``send`` that keeps what it was given, and the body as a client reads it."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []

    async def __call__(self, message: dict[str, Any]) -> None:
        self.messages.append(message)

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.messages if m["type"] == "http.response.body")


async def test_a_stream_has_one_head_its_events_and_one_end_with_done() -> None:
    wire = Wire()
    sse = SseResponse(wire)
    await sse.start([(b"x-superfluid-session", b"s1")])
    await sse.send(encode_sse_json({"n": 1}, id="1"))
    await sse.end(encode_sse_json({"n": 2}))
    head, *bodies = wire.messages
    assert head == {"type": "http.response.start", "status": 200,
                    "headers": [*SSE_HEADERS, (b"x-superfluid-session", b"s1")]}
    assert [m["more_body"] for m in bodies] == [True, False]
    assert wire.body.endswith(SSE_DONE)
    events = SseDecoder().feed(wire.body)
    assert [e.data for e in events] == ['{"n":1}', '{"n":2}', "[DONE]"] and events[0].id == "1"


async def test_a_failure_after_the_head_is_the_dialects_error_frame_then_the_end() -> None:
    exc = ApiError(500, "the worker crashed", code="worker_crashed")
    wire = Wire()
    sse = SseResponse(wire)
    await sse.start()
    await sse.fail(exc)
    events = SseDecoder().feed(wire.body)
    assert events[0].json() == exc.body() and events[-1].data == "[DONE]"
    assert wire.messages[-1]["more_body"] is False
    # a dialect without [DONE] (Anthropic) and its own error event
    wire = Wire()
    sse = SseResponse(wire, done=False, error=lambda e: encode_sse_json({"type": "error"}, event="error"))
    await sse.start()
    await sse.fail(exc)
    assert SseDecoder().feed(wire.body) == [SseEvent("error", None, '{"type":"error"}')]


async def _chunks(data: bytes, size: int) -> AsyncIterator[bytes]:
    for i in range(0, len(data), size):
        await trio.lowlevel.checkpoint()   # as a socket would: each chunk after a schedule point
        yield data[i : i + size]


async def test_the_reader_yields_the_same_events_however_the_bytes_arrive() -> None:
    body = (b": ping\n\nid: 3\ndata: {\"a\":1}\n\nevent: error\r\ndata: x\r\ndata: y\r\n\r\n"
            + b"error: {\"message\":\"boom\"}\n\n" + b"data: [DONE]")   # the last event is cut before its blank line
    want = [SseEvent(None, "3", '{"a":1}'), SseEvent("error", None, "x\ny"),
            SseEvent(None, None, "", (("error", '{"message":"boom"}'),)), SseEvent(None, None, "[DONE]")]
    for size in (1, 2, 7, len(body)):
        got = [e async for e in aiter_sse(_chunks(body, size), keep=("error",))]
        assert got == want, size
    assert got[2].field("error") == '{"message":"boom"}'
    # without keep, a non-standard field is skipped and its event (nothing else in it) is not dispatched
    assert [e.data async for e in aiter_sse(_chunks(body, 5))] == ['{"a":1}', "x\ny", "[DONE]"]
