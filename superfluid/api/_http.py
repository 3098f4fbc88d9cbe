"""Minimal ASGI plumbing: bounded body reads, JSON replies, typed errors."""

from __future__ import annotations

import json
import math
import re
from typing import TYPE_CHECKING, Any, Awaitable, Callable

import attrs
import trio

from .. import _defaults as D

if TYPE_CHECKING:
    from ..sched import JobError

__all__ = ["ApiError", "MAX_BODY", "Receive", "Send", "decode_json", "read_json", "send_json", "send_text"]

MAX_BODY = 100 * 1024 * 1024
BODY_TIMEOUT = "superfluid.body_timeout_s"  # scope key: the App sets --body-timeout on every request
DEFAULT_BODY_TIMEOUT_S = D.BODY_TIMEOUT_S
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

    @classmethod
    def of_job(cls, error: JobError) -> ApiError:
        """A job's typed failure (the scheduler's ``JobError``) as the API's error: the one mapping."""
        return cls(error.status, error.message, code=error.code, type=error.type)

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


MAX_INT_DIGITS = 4300  # Python's default int_max_str_digits: past it int() raises


class _Unrepresentable:
    """A JSON number with no finite value here (too many digits, overflow, NaN)."""

    def __init__(self, literal: str) -> None:
        self.literal = literal


def _parse_int(literal: str) -> int | _Unrepresentable:
    return int(literal) if len(literal) <= MAX_INT_DIGITS else _Unrepresentable(literal)


def _parse_float(literal: str) -> float | _Unrepresentable:
    value = float(literal)
    return value if math.isfinite(value) else _Unrepresentable(literal)


def _path_of_unrepresentable(obj: Any) -> tuple[str, str] | None:
    """``(path, literal)`` of the first :class:`_Unrepresentable` in ``obj`` (iteratively: ``obj`` may be deep)."""
    stack: list[tuple[str, Any]] = [("", obj)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, _Unrepresentable):
            return path, value.literal
        if isinstance(value, dict):
            stack += [(f"{path}.{k}" if path else str(k), v) for k, v in reversed(value.items())]
        elif isinstance(value, list):
            stack += [(f"{path}[{i}]", v) for i, v in reversed(list(enumerate(value)))]
    return None


def decode_json(raw: bytes, *, what: str = "body", code: str | None = None) -> dict[str, Any]:
    """A request body (or WebSocket message: ``what``) as a JSON object.

    Raises:
        ApiError: 400 (with ``code``) if it is not JSON, is nested deeper than
            the decoder's recursion limit, is not an object, holds a number
            with no finite value (over :data:`MAX_INT_DIGITS` digits, ``1e999``,
            ``NaN``; ``param`` names where) or a lone surrogate.
    """
    try:
        obj = json.loads(raw, parse_int=_parse_int, parse_float=_parse_float, parse_constant=_Unrepresentable)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:  # RecursionError: nested too deep
        reason = "it is nested too deeply" if isinstance(exc, RecursionError) else exc
        raise ApiError(400, f"invalid request: {what} is not valid JSON ({reason})", code=code) from None
    if not isinstance(obj, dict):
        raise ApiError(400, f"invalid request: {what} must be a JSON object", code=code)
    bad = _path_of_unrepresentable(obj) if _MAYBE_NUMBER.search(raw) is not None else None
    if bad is not None:
        path, literal = bad
        shown = literal if len(literal) <= 24 else f"{literal[:12]}…({len(literal)} characters)"
        raise ApiError(400, f"invalid request: {path} is the number {shown}, which has no finite value here "
                            f"(at most {MAX_INT_DIGITS} digits, no overflow, no NaN or Infinity)",
                       code=code, param=path)
    if _MAYBE_SURROGATE.search(raw) is not None or b"\x00" in raw[:4]:  # escapes, CESU-8 bytes, UTF-16/32
        try:  # json.loads lets lone surrogates through; nothing downstream can encode them
            json.dumps(obj, ensure_ascii=False).encode("utf-8")
        except (UnicodeEncodeError, RecursionError):
            raise ApiError(400, f"invalid request: the {what} holds a lone UTF-16 surrogate (\\ud800-\\udfff), "
                                "which is not Unicode text", code=code) from None
    return obj


# a run of digits long enough to overflow a float, a 3-digit exponent, NaN or Infinity: worth the walk
_MAYBE_NUMBER = re.compile(rb"\d{300}|[eE][+-]?\d{3}|NaN|Infinity")


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
