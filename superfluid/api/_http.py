"""Minimal ASGI plumbing: bounded body reads, JSON replies, typed errors."""

from __future__ import annotations

import bisect
import codecs
import ctypes
import itertools
import json
import math
import re
import secrets
import threading
from collections.abc import Iterator
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

__all__ = ["ApiError", "BODIES", "MAX_BODY", "MAX_BODY_ELEMENTS", "Receive", "Send", "decode_json", "read_json", "send_json", "send_text",
           "ws_denial"]

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
    bytes are freed once they are text (the peak is two copies, not three).

    A body holding string literals over :data:`LONG_STRING` bytes parses as
    :func:`_decode_long` says (a UTF-16 or UTF-32 one turned into UTF-8 first, a
    window at a time): one C call decoding a 100 MB string holds the GIL, and so
    every other stream, for a quarter of a second or more.
    """
    raw = box[0]
    count = _elements(raw, MAX_BODY_ELEMENTS)
    if count > MAX_BODY_ELEMENTS:
        raise ApiError(413, f"invalid request: the {what} holds more than {MAX_BODY_ELEMENTS} JSON elements "
                            "(brackets, commas and strings outside strings)", code=code or "too_many_elements")
    encoding = json.detect_encoding(raw) if len(raw) > LONG_STRING else ""
    if encoding.startswith("utf-16") or encoding.startswith("utf-32"):  # as UTF-8, a window at a time
        try:
            box[0] = raw = _as_utf8(raw, encoding) or raw
        except _BadBytes as exc:
            raise _not_json(what, code, str(exc)) from None
        encoding = json.detect_encoding(raw)
    spans = _long_strings(raw, LONG_STRING) if encoding in ("utf-8", "utf-8-sig") else []
    del raw
    if spans:
        obj, unrepresentable, maybe_surrogate = _decode_long(box, spans, what, code)
    else:
        try:
            obj, unrepresentable, maybe_surrogate = _parse(box)
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
            raise _not_json(what, code, _reason(exc)) from None
    return _checked(obj, unrepresentable, maybe_surrogate, what, code)


def _parse(box: list[bytes | bytearray]) -> tuple[Any, bool, bool]:
    """The JSON in ``box`` (emptied: the bytes go once they are text) and
    whether it may hold an unrepresentable number and a lone surrogate: msgspec
    if it accepts it, else the stdlib (which accepts what msgspec refuses with a
    reason: :func:`_checked` then names it). Raises what ``json.loads`` raises."""
    raw = box.pop()
    if msgspec is not None:
        try:  # refuses every number, surrogate and encoding the stdlib path below refuses (and says why)
            return msgspec.json.decode(raw), False, False
        except (msgspec.DecodeError, RecursionError):
            pass
    text = raw.decode(json.detect_encoding(raw), "surrogatepass")  # what json.loads does with bytes
    del raw
    maybe_surrogate = not text.isascii() or _ESCAPED_SURROGATE.search(text) is not None
    flagged: list[str] = []
    obj = json.loads(text, parse_int=_flagging(_parse_int, flagged), parse_float=_flagging(_parse_float, flagged),
                     parse_constant=_flagging(_Unrepresentable, flagged))
    return obj, bool(flagged), maybe_surrogate


def _flagging(parse: Callable[[str], Any], flagged: list[str]) -> Callable[[str], Any]:
    def hook(literal: str) -> Any:
        value = parse(literal)
        if isinstance(value, _Unrepresentable):
            flagged.append(literal)
        return value
    return hook


def _reason(exc: Exception) -> str:
    return "it is nested too deeply" if isinstance(exc, RecursionError) else str(exc)


def _not_json(what: str, code: str | None, reason: str) -> ApiError:
    return ApiError(400, f"invalid request: {what} is not valid JSON ({reason})", code=code)


def _checked(obj: Any, unrepresentable: bool, maybe_surrogate: bool, what: str, code: str | None) -> dict[str, Any]:
    """``obj`` if it is an object with no unrepresentable number and no lone surrogate; else the 400 naming where."""
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


# --- long strings, decoded a piece at a time -------------------------------------------------------------------

LONG_STRING = 64 << 10  # a string literal longer than this (bytes) is decoded apart from the rest, in pieces


def _decode_long(box: list[bytes | bytearray], spans: list[tuple[int, int]], what: str,
                 code: str | None) -> tuple[Any, bool, bool]:
    """:func:`_parse` of a body whose long string literals are ``spans`` (their
    text, between the quotes), with no C call over more than about
    :data:`_WINDOW` bytes: the rest of the body (the skeleton, each literal's
    text replaced by a mark carrying a nonce drawn for this parse, so no client
    string can pass for one) parses first; then each literal, a piece at a time
    (cut where no escape, escaped surrogate pair or UTF-8 sequence spans the
    cut, so the pieces decode to what the whole would), each piece appended to
    the literal's string as it is decoded (the peak is the body and the
    strings, as for one parse of the whole); the strings go where their marks
    are. Any refusal is the one :func:`_parse` of the whole body would give
    (:func:`_first_error`).
    """
    _map_big_blocks()
    raw = box.pop()
    if raw[:3] == b"\xef\xbb\xbf":  # (utf-8-sig: json.loads drops the BOM, and counts from after it)
        raw = raw[3:]
        spans = [(s - 3, e - 3) for s, e in spans]
    nonce = secrets.token_hex(16)
    marks = [f"{nonce}.{i}" for i in range(len(spans))]
    skeleton, prev = bytearray(), 0
    for (start, end), mark in zip(spans, marks, strict=True):
        skeleton += raw[prev:start]
        skeleton += mark.encode()
        prev = end
    skeleton += raw[prev:]
    try:
        obj, unrepresentable, maybe_surrogate = _parse([bytes(skeleton)])
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise _first_error(raw, spans, marks, skeleton, what, code) from None
    values: dict[str, str] = {}
    for (start, end), mark in zip(spans, marks, strict=True):
        joined = ""
        for a, b in itertools.pairwise(_cuts(raw, start, end)):
            piece = _string_text(raw[a:b])
            if piece is None:
                raise _first_error(raw, spans, marks, skeleton, what, code)
            text, lone = piece
            del piece
            joined += text  # in place (CPython: the only reference), so one piece is copied, not the string so far
            del text
            maybe_surrogate = maybe_surrogate or lone
        values[mark] = joined
        del joined
    del raw, skeleton
    return _put_back(obj, values), unrepresentable, maybe_surrogate


def _map_big_blocks() -> None:
    """Have glibc map every block of a MiB or more (elsewhere: nothing), once.

    A literal's string grows a piece at a time in place (``realloc``), which
    for a mapped block moves pages, copying nothing. glibc, by default, raises
    the size it maps from after freeing such a block (a piece), up to 32 MiB,
    and serves smaller ones from its heaps, where growing a string means
    copying it: calls of 30 to 75 ms, measured, while it held the GIL, and heap
    holes that kept the daemon's RSS 60-75 MB higher after a 100 MB string."""
    global _BIG_BLOCKS_MAPPED
    if not _BIG_BLOCKS_MAPPED:
        _BIG_BLOCKS_MAPPED = True
        if _MALLOPT is not None:
            _MALLOPT(_M_MMAP_THRESHOLD, 1 << 20)  # (process-wide; glibc's own default is 128 KiB, raised as above)


def _libc(name: str) -> Callable[[int, int], int] | None:
    try:
        return getattr(ctypes.CDLL(None), name)  # type: ignore[no-any-return]
    except (OSError, AttributeError):
        return None


_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
_MALLOPT = _libc("mallopt")
_BIG_BLOCKS_MAPPED = False


def _string_text(piece: bytes | bytearray) -> tuple[str, bool] | None:
    """The text of a piece of a string literal as the whole body's parser would
    decode it, and whether it may hold a lone surrogate (for :func:`_checked`
    to name); ``None`` if the stdlib refuses it."""
    quoted = b'"' + piece + b'"'
    if msgspec is not None:
        try:
            value = msgspec.json.decode(quoted)
        except msgspec.DecodeError:
            pass
        else:
            return (value, False) if isinstance(value, str) else None
    try:
        value = json.loads(quoted.decode("utf-8", "surrogatepass"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    return (value, not value.isascii()) if isinstance(value, str) else None


def _put_back(obj: Any, values: dict[str, str]) -> Any:
    """``obj`` with each mark (a key of ``values``) replaced by its string,
    as a value or a key (a dict with one is rebuilt in order, so duplicate keys
    still end as ``json.loads`` ends them: first place, last value)."""
    if isinstance(obj, str):
        return values.get(obj, obj)
    stack = [obj]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if any(k in values for k in node):
                items = list(node.items())
                node.clear()
                for k, v in items:
                    node[values.get(k, k)] = v
            for k, v in node.items():
                if isinstance(v, str):
                    if v in values:
                        node[k] = values[v]
                elif isinstance(v, (dict, list)):
                    stack.append(v)
        elif isinstance(node, list):
            for i, v in enumerate(node):
                if isinstance(v, str):
                    if v in values:
                        node[i] = values[v]
                elif isinstance(v, (dict, list)):
                    stack.append(v)
    return obj


def _long_strings(raw: bytes | bytearray, longer_than: int) -> list[tuple[int, int]]:
    """Where the string literals of ``raw`` longer than ``longer_than`` bytes
    are: ``(start, end)`` of their text, ``end`` the closing quote (or the end
    of ``raw``, for one never closed). A window at a time: escaped backslashes
    and quotes are blanked (same length), then the quotes left alternate
    opening and closing; no window ends inside a run of backslashes."""
    spans: list[tuple[int, int]] = []
    inside, start = False, 0  # within a string? where the text since the last quote starts
    for a, b in _windows(raw):
        if raw.find(b'"', a, b) < 0:  # (find is memchr: most windows of a long string hold no quote)
            continue
        window = raw[a:b]
        if raw.find(b"\\", a, b) >= 0:
            window = window.replace(b"\\\\", b"__").replace(b'\\"', b"__")
        parts = window.split(b'"')
        if len(parts) == 1:
            continue
        lengths = list(map(len, parts))
        quote = a + lengths[0]
        if inside and quote - start > longer_than:
            spans.append((start, quote))
        inside, start = not inside, quote + 1
        if max(lengths[1:-1], default=0) > longer_than:
            for n in lengths[1:-1]:
                if inside and n > longer_than:
                    spans.append((start, start + n))
                inside, start = not inside, start + n + 1
        else:
            inside ^= len(lengths) % 2 == 1  # one flip per quote after the first
            start = b - lengths[-1]
    if inside and len(raw) - start > longer_than:
        spans.append((start, len(raw)))
    return spans


def _windows(raw: bytes | bytearray) -> Iterator[tuple[int, int]]:
    """``raw`` cut in windows of about :data:`_WINDOW` bytes, none ending inside
    a backslash escape (``\\\\`` or ``\\"``): each starts where an escape may."""
    a, end = 0, len(raw)
    while a < end:
        b = min(a + _WINDOW, end)
        if b < end and raw[b - 1] == 0x5C:
            run = a + len(raw[a:b].rstrip(b"\\"))  # where the run of backslashes ending at b starts
            b = max(run + ((b - run) & ~1), a + 2)  # after whole pairs (a run's first backslash starts an escape)
        yield a, b
        a = b


_HIGH_ESCAPE = re.compile(rb"\\u[dD][89abAB][0-9a-fA-F]{2}")
_LOW_ESCAPE = re.compile(rb"\\u[dD][c-fC-F][0-9a-fA-F]{2}")


def _cuts(raw: bytes | bytearray, start: int, end: int) -> list[int]:
    """Where to cut the text ``raw[start:end]`` of a string literal into pieces
    of about :data:`_WINDOW` bytes: ``start``, the cuts, ``end``."""
    cuts = [start]
    while end - cuts[-1] > _WINDOW:
        cuts.append(_cut(raw, cuts[-1], cuts[-1] + _WINDOW, end))
    if cuts[-1] < end:
        cuts.append(end)
    return cuts


def _cut(raw: bytes | bytearray, lo: int, at: int, end: int) -> int:
    """A point in ``(lo, end)`` near ``at`` where a string's text can be cut
    (``lo`` is one): the nearest :func:`_cuttable` one at or before ``at``
    (within 64 bytes); inside a long run of backslashes, after whole pairs;
    else the nearest after ``at``, or ``end``. In valid text one of these is
    within a few bytes; only text that is not UTF-8 is cut 64 bytes on
    regardless (any cut gives the same refusal: :func:`_utf8_error`)."""
    for p in range(at, max(lo, at - 64), -1):
        if _cuttable(raw, lo, p):
            return p
    run = lo + len(raw[lo:at].rstrip(b"\\"))  # where the backslashes ending at ``at`` start (lo if before it)
    if at - run >= 2:
        return run + ((at - run) & ~1)  # (a run's first backslash starts an escape, and so every other one)
    for p in range(at + 1, min(at + 64, end)):
        if _cuttable(raw, lo, p):
            return p
    return min(at + 64, end)  # (the end of the text is one)


def _cuttable(raw: bytes | bytearray, lo: int, p: int) -> bool:
    """Whether a string's text can be cut before ``p`` (``lo < p``, ``lo`` one
    such point): a run of backslashes starts at ``p`` (not a low surrogate's
    escape just after a high one's), or no backslash is within the 6 bytes
    before it (an escape is at most 6) and no UTF-8 sequence goes on at it."""
    if raw[p] == 0x5C:
        return raw[p - 1] != 0x5C and not (p - 6 >= lo and _HIGH_ESCAPE.fullmatch(raw, p - 6, p) is not None
                                           and _LOW_ESCAPE.match(raw, p) is not None)
    return 0x5C not in raw[max(lo, p - 6):p] and not 0x80 <= raw[p] < 0xC0


# --- the refusal of a body parsed in pieces: the one the whole body's parse gives ---------------------------------

_NOT_CONTINUATION = bytes(b for b in range(256) if not 0x80 <= b < 0xC0)


def _first_error(raw: bytes | bytearray, spans: list[tuple[int, int]], marks: list[str], skeleton: bytes | bytearray,
                 what: str, code: str | None) -> ApiError:
    """The 400 ``json.loads`` of the whole of ``raw`` would give, found a window
    or a piece at a time: the first invalid UTF-8 (it decodes the whole body
    first), else the first syntax error in the text, at the line, column and
    character it would name (a literal's text has no newline before its first
    error: a raw one is one)."""
    reason = _utf8_error(raw)
    if reason is not None:
        return _not_json(what, code, reason)
    text = skeleton.decode("utf-8", "surrogatepass")
    starts: list[int] = []  # per literal: its text's first character in raw
    shifts: list[int] = []  # and how many more characters the literals before it hold than their marks
    chars, last, shift = 0, 0, 0
    for (start, end), mark in zip(spans, marks, strict=True):
        chars += _characters(raw, last, start)
        starts.append(chars)
        shifts.append(shift)
        length = _characters(raw, start, end)
        chars, last, shift = chars + length, end, shift + length - len(mark)
    shifts.append(shift)
    placed = [c - s for c, s in zip(starts, shifts, strict=False)]  # each mark's first character in the skeleton

    def original(k: int) -> int:
        """The character of raw at the skeleton's character ``k`` (not inside a mark)."""
        i = bisect.bisect_right(placed, k)
        return k + shifts[i]

    def where(k: int, pos: int) -> str:
        n = text.rfind("\n", 0, k)
        column = pos - (original(n) if n >= 0 else -1)
        return f"line {text.count(chr(10), 0, k) + 1} column {column} (char {pos})"

    try:
        json.loads(text, parse_int=_parse_int, parse_float=_parse_float, parse_constant=_Unrepresentable)
        skeleton_error: json.JSONDecodeError | RecursionError | None = None
    except (json.JSONDecodeError, RecursionError) as exc:
        skeleton_error = exc
    limit = len(raw) + 1  # the literals whose text json.loads reads before the skeleton's error
    if isinstance(skeleton_error, json.JSONDecodeError):  # (one never closed: its text, from its opening quote)
        limit = original(skeleton_error.pos) + skeleton_error.msg.startswith("Unterminated string")
    for i, (start, end) in enumerate(spans):
        if starts[i] > limit:
            break
        cuts, offset = _cuts(raw, start, end), 0
        for a, b in itertools.pairwise(cuts):
            try:
                piece = raw[a:b].decode("utf-8", "surrogatepass")
                json.loads(f'"{piece}"' if b < len(raw) else f'"{piece}')  # (one never closed ends the text)
            except UnicodeDecodeError:  # (a cut inside a sequence: only in text that is not UTF-8, refused above)
                break
            except json.JSONDecodeError as exc:
                pos = starts[i] + offset + exc.pos - 1 if exc.pos else starts[i] - 1  # (pos 0: never closed)
                return _not_json(what, code, f"{exc.msg}: {where(placed[i], pos)}")
            offset += len(piece)
    if isinstance(skeleton_error, json.JSONDecodeError):
        pos = original(skeleton_error.pos)
        return _not_json(what, code, f"{skeleton_error.msg}: {where(skeleton_error.pos, pos)}")
    return _not_json(what, code, _reason(skeleton_error or ValueError("it is not JSON")))


def _characters(raw: bytes | bytearray, a: int, b: int) -> int:
    """How many characters the valid UTF-8 ``raw[a:b]`` holds (a window at a time)."""
    return b - a - sum(len(raw[i:min(i + _WINDOW, b)].translate(None, _NOT_CONTINUATION))
                       for i in range(a, b, _WINDOW))


def _utf8_error(raw: bytes | bytearray) -> str | None:
    """``str()`` of the error ``raw.decode("utf-8", "surrogatepass")`` raises (a window at a time), or ``None``."""
    try:
        for _ in _decoded(raw, "utf-8"):
            pass
    except _BadBytes as exc:
        return str(exc)
    return None


def _as_utf8(raw: bytes | bytearray, encoding: str) -> bytearray | None:
    """A UTF-16 or UTF-32 body as UTF-8 (a window at a time: ``json.loads``
    decodes it in one call), or ``None`` if its text starts with a BOM still
    (``json.loads`` refuses that: :func:`_parse` does, given the body as it
    came). Raises :class:`_BadBytes`."""
    utf8 = bytearray()
    for text in _decoded(raw, encoding):
        if not utf8 and text.startswith("\ufeff"):
            return None
        utf8 += text.encode("utf-8", "surrogatepass")
    return utf8


class _BadBytes(Exception):
    """A body that is not text in its encoding; ``str()`` is what decoding it whole would say."""


def _decoded(raw: bytes | bytearray, encoding: str) -> Iterator[str]:
    """``raw.decode(encoding, "surrogatepass")``, a window at a time. Raises
    :class:`_BadBytes`, at the position in ``raw`` (not in a window)."""
    decoder = codecs.getincrementaldecoder(encoding)("surrogatepass")
    for a in range(0, len(raw), _WINDOW):
        held = len(decoder.getstate()[0])  # bytes of a character the last window cut
        try:
            text = decoder.decode(raw[a:a + _WINDOW], final=a + _WINDOW >= len(raw))
        except UnicodeDecodeError as exc:
            start, end = a - held + exc.start, a - held + exc.end
            if exc.end == exc.start + 1:
                raise _BadBytes(f"'{exc.encoding}' codec can't decode byte 0x{exc.object[exc.start]:02x} "
                                f"in position {start}: {exc.reason}") from None
            raise _BadBytes(f"'{exc.encoding}' codec can't decode bytes in position {start}-{end - 1}: "
                            f"{exc.reason}") from None
        yield text


def ws_denial(send: Send) -> Send:
    """``send`` for an HTTP answer to a WebSocket handshake, before it is accepted (ASGI's
    ``websocket.http.response`` extension, which hypercorn implements): ``send_json``
    through it refuses the handshake with a status and a body of our own."""

    async def deny(message: dict[str, Any]) -> None:
        await send({**message, "type": "websocket." + message["type"]})

    return deny


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
