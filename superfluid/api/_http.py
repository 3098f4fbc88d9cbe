"""Minimal ASGI plumbing: bounded body reads, JSON replies, typed errors."""

from __future__ import annotations

import json
import re
from typing import Any, Awaitable, Callable

import attrs
import trio

__all__ = ["ApiError", "MAX_BODY", "Receive", "Send", "decode_json", "read_json", "send_json", "send_text"]

MAX_BODY = 100 * 1024 * 1024
BODY_TIMEOUT = "superfluid.body_timeout_s"  # scope key: the App sets --body-timeout on every request
DEFAULT_BODY_TIMEOUT_S = 30.0
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


class ClientGone(Exception):
    """The client disconnected while we read its request."""


@attrs.frozen
class ApiError(Exception):
    """A typed failure: becomes an HTTP error, or an SSE error frame mid-stream."""

    status: int
    message: str
    code: str | None = None
    param: str | None = None
    type: str = ""
    headers: tuple[tuple[bytes, bytes], ...] = ()  # sent with the error response (Retry-After, Connection)

    @property
    def error_type(self) -> str:
        if self.type:
            return self.type
        return "server_error" if self.status >= 500 else "invalid_request_error"

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}}


def header(scope: dict[str, Any], name: str) -> str | None:
    key = name.lower().encode()
    for k, v in scope.get("headers", ()):
        if k.lower() == key:
            return v.decode("latin-1")
    return None


async def read_body(scope: dict[str, Any], receive: Receive, *, limit: int = MAX_BODY) -> bytes:
    """Read the whole request body, refusing more than ``limit`` bytes (413),
    or one that has not all arrived within ``scope[BODY_TIMEOUT]`` seconds
    (408, and the connection closes: the rest of the body may still come)."""
    declared = header(scope, "content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"request body of {declared} bytes exceeds the {limit}-byte limit", code="payload_too_large")
    timeout = scope.get(BODY_TIMEOUT, DEFAULT_BODY_TIMEOUT_S)
    with trio.move_on_after(timeout):
        return await _read_body(receive, limit)
    raise ApiError(408, f"the request body did not arrive within {timeout:g} s (--body-timeout)",
                   code="request_timeout", headers=((b"connection", b"close"),))


async def _read_body(receive: Receive, limit: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"request body exceeds the {limit}-byte limit", code="payload_too_large")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def read_json(scope: dict[str, Any], receive: Receive) -> dict[str, Any]:
    return decode_json(await read_body(scope, receive))


def decode_json(raw: bytes) -> dict[str, Any]:
    """A request body as a JSON object. Raises ApiError 400."""
    try:
        obj = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:  # RecursionError: nested too deep
        raise ApiError(400, f"invalid request: body is not valid JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise ApiError(400, "invalid request: body must be a JSON object")
    if _MAYBE_SURROGATE.search(raw) is not None or b"\x00" in raw[:4]:  # escapes, CESU-8 bytes, UTF-16/32
        try:  # json.loads lets lone surrogates through; nothing downstream can encode them
            json.dumps(obj, ensure_ascii=False).encode("utf-8")
        except (UnicodeEncodeError, RecursionError):
            raise ApiError(400, "invalid request: the body holds a lone UTF-16 surrogate (\\ud800-\\udfff), "
                                "which is not Unicode text") from None
    return obj


_MAYBE_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")


async def send_json(send: Send, status: int, obj: Any, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    body = json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()
    await send({
        "type": "http.response.start", "status": status,
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                    *(headers or [])],
    })
    await send({"type": "http.response.body", "body": body})


async def send_text(send: Send, status: int, text: str, content_type: bytes = b"text/plain; charset=utf-8") -> None:
    body = text.encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


async def answer_errors(send: Send, run: Callable[[Send], Awaitable[None]],
                        body_of: Callable[[ApiError], Any]) -> None:
    """Run a handler; an :class:`ApiError` raised before the response started is
    answered with ``body_of(error)`` (a dialect's own envelope). After the
    response started it propagates (the handler's stream reports it)."""
    started = False

    async def tracked(message: dict[str, Any]) -> None:
        nonlocal started
        started = started or message["type"] == "http.response.start"
        await send(message)

    try:
        await run(tracked)
    except ApiError as exc:
        if started:
            raise
        await send_json(send, exc.status, body_of(exc), list(exc.headers))
