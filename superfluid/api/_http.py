"""Minimal ASGI plumbing: bounded body reads, JSON replies, typed errors."""

from __future__ import annotations

import json
import math
import re
import threading
from typing import TYPE_CHECKING, Any, Awaitable, Callable

import attrs
import trio
from trio.lowlevel import RunVar

from .. import _defaults as D

try:  # the fast path (one pass over the bytes, no text copy); without it the stdlib parses every body
    import msgspec
except ImportError:  # pragma: no cover - a dependency; the same answers, slower, twice the memory
    msgspec = None

if TYPE_CHECKING:
    from ..sched import JobError

__all__ = ["ApiError", "BODIES", "MAX_BODY", "MAX_BODY_ELEMENTS", "Receive", "Send", "decode_json", "read_json", "send_json", "send_text"]

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


async def read_body(scope: dict[str, Any], receive: Receive, *, limit: int = MAX_BODY,
                    held: Held | None = None) -> bytearray:
    """Read the whole request body, refusing more than ``limit`` bytes (413),
    one that has not all arrived within ``scope[BODY_TIMEOUT]`` seconds (408, and
    the connection closes: the rest of the body may still come), or one that
    would take the bytes of bodies held at once past :data:`BODIES`' capacity
    (503 ``server_busy``). The bytes stay counted in ``held`` (the caller
    releases it once the body is parsed and dropped); without one, until return.
    """
    declared = header(scope, "content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"request body of {declared} bytes exceeds the {limit}-byte limit", code="payload_too_large")
    own = held is None
    held = Held(BODIES) if held is None else held
    try:
        timeout = scope.get(BODY_TIMEOUT, DEFAULT_BODY_TIMEOUT_S)
        with trio.move_on_after(timeout):
            return await _read_body(receive, limit, held)
        raise ApiError(408, f"the request body did not arrive within {timeout:g} s (--body-timeout)",
                       code="request_timeout", headers=((b"connection", b"close"),))
    finally:
        if own:
            held.release()


async def _read_body(receive: Receive, limit: int, held: Held) -> bytearray:
    body = bytearray()  # grows in place (amortized): no list of chunks, no join doubling the peak
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone()
        chunk = message.get("body", b"")
        if len(body) + len(chunk) > limit:
            raise ApiError(413, f"request body exceeds the {limit}-byte limit", code="payload_too_large")
        held.grow(len(body) + len(chunk))
        body += chunk
        if not message.get("more_body", False):
            return body


# --- the cost of a body: bytes held at once, elements per body, one big parse at a time ------------------

BODY_BYTES_IN_FLIGHT = 256 << 20  # bytes of request bodies read or parsing at once (2.5 maximal bodies)
MAX_BODY_ELEMENTS = 1 << 20       # brackets, commas and strings (outside strings) in one body
INLINE_PARSE_BYTES = 64 << 10     # smaller bodies parse on the event loop: a thread costs more than they do
_WINDOW = 1 << 20                 # bytes (or characters) one C call scans: the GIL goes round between windows


class InFlight:
    """The bytes of request bodies held at once (read, waiting to parse, or parsing).

    One JSON body costs a few times its size while it parses; several maximal
    bodies at once would reach the OOM killer. A body that does not fit is
    refused (503), not queued: a queue of bodies is memory too. Thread-safe: a
    parse abandoned by its request (the client left) releases its bytes from its
    thread when it ends, not when its request did.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0
        self._lock = threading.Lock()

    def take(self, n: int) -> bool:
        with self._lock:
            if self.used + n > self.capacity:
                return False
            self.used += n
            return True

    def give(self, n: int) -> None:
        with self._lock:
            self.used -= n


BODIES = InFlight(BODY_BYTES_IN_FLIGHT)


class Held:
    """One request's share of an :class:`InFlight`: grows as its body arrives, released once."""

    def __init__(self, pool: InFlight) -> None:
        self.pool = pool
        self.n = 0

    def grow(self, total: int) -> None:
        """Hold ``total`` bytes (no-op if already held); 503 ``server_busy`` if the pool is full."""
        if total <= self.n:
            return
        if not self.pool.take(total - self.n):
            raise ApiError(503, f"the server is reading or parsing {self.pool.capacity} bytes of request bodies "
                                "already; retry shortly", code="server_busy",
                           headers=((b"retry-after", b"1"), (b"connection", b"close")))
        self.n = total

    def release(self) -> None:
        """Give the bytes back (once: the request's task and its parse thread may both call it)."""
        with self.pool._lock:
            n, self.n = self.n, 0
            self.pool.used -= n


_PARSE_SLOT: RunVar[trio.CapacityLimiter] = RunVar("superfluid.parse_slot")


def _parse_slot() -> trio.CapacityLimiter:
    """One big body parses at a time (per trio run): the C parser holds the GIL
    while it builds objects, so two at once only add their memory."""
    try:
        return _PARSE_SLOT.get()
    except LookupError:
        _PARSE_SLOT.set(slot := trio.CapacityLimiter(1))
        return slot


async def read_json(scope: dict[str, Any], receive: Receive, *, empty: dict[str, Any] | None = None) -> dict[str, Any]:
    """The request body as a JSON object (:func:`decode_json`'s refusals), read
    within :data:`BODIES`; ``empty``, if given, answers an empty or blank body.

    A body over :data:`INLINE_PARSE_BYTES` parses in a worker thread, one at a
    time, while the event loop serves every other stream; the wait for it is
    cancellable (a parse abandoned by a request that left finishes on its own
    and then gives its bytes back).
    """
    held = Held(BODIES)
    try:
        box = [await read_body(scope, receive, held=held)]
    except BaseException:
        held.release()
        raise
    if empty is not None and (not box[0] or box[0].isspace()):  # (strip() would copy a big body)
        held.release()
        return empty
    if len(box[0]) <= INLINE_PARSE_BYTES:
        try:
            return _decode(box, "body", None)
        finally:
            held.release()
    try:
        return await trio.to_thread.run_sync(_decode_and_release, box, held, abandon_on_cancel=True,
                                             limiter=_parse_slot())
    except BaseException:
        if box:  # cancelled while it waited for the slot: no thread will release it
            held.release()
        raise


def _decode_and_release(box: list[bytes | bytearray], held: Held) -> dict[str, Any]:
    try:
        return _decode(box, "body", None)
    finally:
        held.release()


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


def _path_of(obj: Any, bad: Callable[[Any], bool]) -> tuple[str, Any] | None:
    """``(path, value)`` of the first value or key in ``obj`` for which ``bad``
    holds (iteratively: ``obj`` may be deep); ``None`` if none."""
    stack: list[tuple[str, Any]] = [("", obj)]
    while stack:
        path, value = stack.pop()
        if bad(value):
            return path, value
        if isinstance(value, dict):
            for k in value:
                if bad(k):
                    return (f"{path}.{k!r}" if path else repr(k)), k
            stack += [(f"{path}.{k}" if path else str(k), v) for k, v in reversed(value.items())]
        elif isinstance(value, list):
            stack += [(f"{path}[{i}]", v) for i, v in reversed(list(enumerate(value)))]
    return None


def _has_surrogate(value: Any) -> bool:
    """A lone UTF-16 surrogate in a string (a Python string holds no pairs:
    JSON's escaped pairs decode to one character). Window by window, so a long
    string does not hold the GIL for one long encode."""
    if not isinstance(value, str) or value.isascii():
        return False
    for i in range(0, len(value), _WINDOW):
        try:
            value[i:i + _WINDOW].encode("utf-8")
        except UnicodeEncodeError:
            return True
    return False


# the characters an element needs: the quick count over every byte (strings included) bounds the exact one
_NOT_STRUCTURAL = bytes(b for b in range(256) if b not in b'{[,"')
_NOT_OPENER_OR_COMMA = bytes(b for b in range(256) if b not in b"{[,")


def _elements(raw: bytes | bytearray, cap: int) -> int:
    """How many brackets, commas and strings ``raw`` holds outside strings, or
    some number over ``cap`` once it is clear there are more: a bound on the
    objects a parse would build (a 3-byte ``{},`` is a 64-byte dict), counted
    without building them, a window at a time (the GIL goes round between)."""
    if len(raw) <= cap:
        return len(raw)  # every element takes a byte
    quick = 0
    for i in range(0, len(raw), _WINDOW):
        quick += len(raw[i:i + _WINDOW].translate(None, _NOT_STRUCTURAL))
    if quick <= cap:
        return quick
    n, pos, end = 0, 0, len(raw)  # exact: skip the strings (a long prompt's commas are text)
    while pos < end and n <= cap:
        quote = raw.find(b'"', pos)
        stop = end if quote < 0 else quote
        for i in range(pos, stop, _WINDOW):
            n += len(raw[i:min(i + _WINDOW, stop)].translate(None, _NOT_OPENER_OR_COMMA))
        if quote < 0:
            break
        n += 1  # the string itself
        pos = _string_end(raw, quote + 1)
    return n


def _string_end(raw: bytes | bytearray, pos: int) -> int:
    """The index after the quote that closes the string whose text starts at ``pos``."""
    while True:
        quote = raw.find(b'"', pos)
        if quote < 0:
            return len(raw)
        back = quote
        while back > pos and raw[back - 1] == 0x5C:  # backslashes before it: an odd run escapes it
            back -= 1
        if (quote - back) % 2 == 0:
            return quote + 1
        pos = quote + 1


def decode_json(raw: bytes | bytearray, *, what: str = "body", code: str | None = None) -> dict[str, Any]:
    """A request body (or WebSocket message: ``what``) as a JSON object.

    Raises:
        ApiError: 413 ``too_many_elements`` (with ``code`` if given) if it holds
            more than :data:`MAX_BODY_ELEMENTS` elements; 400 (with ``code``) if
            it is not JSON, is nested deeper than the decoder's recursion limit,
            is not an object, holds a number with no finite value (over
            :data:`MAX_INT_DIGITS` digits, ``1e999``, ``NaN``; ``param`` names
            where) or a lone surrogate.
    """
    return _decode([raw], what, code)


def _decode(box: list[bytes | bytearray], what: str, code: str | None) -> dict[str, Any]:
    """:func:`decode_json` of the body in ``box``, which it empties so the raw
    bytes are freed once they are text (the peak is two copies, not three)."""
    raw = box.pop()
    count = _elements(raw, MAX_BODY_ELEMENTS)
    if count > MAX_BODY_ELEMENTS:
        raise ApiError(413, f"invalid request: the {what} holds more than {MAX_BODY_ELEMENTS} JSON elements "
                            "(brackets, commas and strings outside strings)", code=code or "too_many_elements")
    if msgspec is not None:
        try:  # refuses every number, surrogate and encoding the stdlib path below refuses (and says why)
            obj = msgspec.json.decode(raw)
        except (msgspec.DecodeError, RecursionError):
            pass
        else:
            if not isinstance(obj, dict):
                raise ApiError(400, f"invalid request: {what} must be a JSON object", code=code)
            return obj
    unrepresentable: list[str] = []

    def number(parse: Callable[[str], Any]) -> Callable[[str], Any]:
        def hook(literal: str) -> Any:
            value = parse(literal)
            if isinstance(value, _Unrepresentable):
                unrepresentable.append(literal)
            return value
        return hook

    try:
        text = raw.decode(json.detect_encoding(raw), "surrogatepass")  # what json.loads does with bytes
        del raw
        maybe_surrogate = not text.isascii() or _ESCAPED_SURROGATE.search(text) is not None
        obj = json.loads(text, parse_int=number(_parse_int), parse_float=number(_parse_float),
                         parse_constant=number(_Unrepresentable))
        del text
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:  # RecursionError: nested too deep
        reason = "it is nested too deeply" if isinstance(exc, RecursionError) else exc
        raise ApiError(400, f"invalid request: {what} is not valid JSON ({reason})", code=code) from None
    if not isinstance(obj, dict):
        raise ApiError(400, f"invalid request: {what} must be a JSON object", code=code)
    bad = _path_of(obj, lambda v: isinstance(v, _Unrepresentable)) if unrepresentable else None
    if bad is not None:  # (a duplicate key may have dropped the only one: then the body is fine)
        path, literal = bad[0], bad[1].literal
        shown = literal if len(literal) <= 24 else f"{literal[:12]}…({len(literal)} characters)"
        raise ApiError(400, f"invalid request: {path} is the number {shown}, which has no finite value here "
                            f"(at most {MAX_INT_DIGITS} digits, no overflow, no NaN or Infinity)",
                       code=code, param=path)
    # json.loads lets lone surrogates through; nothing downstream can encode them
    lone = _path_of(obj, _has_surrogate) if maybe_surrogate else None
    if lone is not None:
        raise ApiError(400, f"invalid request: the {what} holds a lone UTF-16 surrogate (\\ud800-\\udfff), "
                            f"which is not Unicode text, at {lone[0] or 'its top'}", code=code, param=lone[0] or None)
    return obj


_ESCAPED_SURROGATE = re.compile(r"\\u[dD][89a-fA-F]")


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
