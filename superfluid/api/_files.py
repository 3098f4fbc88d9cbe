"""The files routes (OpenAI's Files API; SPEC.md §7, "Files"); the store is ``sessions/_files.py``.

* ``POST /v1/files``: multipart/form-data with a ``file`` part and a ``purpose``
  field, in either order; the File object. The body is parsed as it arrives
  (python-multipart's streaming parser, fed each ASGI body message) and the
  file part's bytes go straight to the store: an upload is never held whole in
  memory. The guard admits multipart here only, and only from a non-browser
  (``api/_guard.py``, rule 6).
* ``GET /v1/files?purpose=&after=&limit=&order=``: the tenant's files, a page.
* ``GET /v1/files/{id}``, ``DELETE /v1/files/{id}``, ``GET /v1/files/{id}/content``
  (the bytes, streamed a MiB at a time).

A file belongs to the tenant that uploaded it (or to the batch's tenant, for
its output): for any other tenant its id is an unknown one (404
``file_not_found``).

Limits: a file part over ``--files-max-bytes`` is 413 ``payload_too_large``;
an upload that would take the tenant past ``--files-quota-gb`` is 413
``files_quota_exceeded``. Both are answered once the rest of the body is read
and dropped (up to the body's own limit), so the client reads the answer
instead of a reset mid-upload; nothing of the upload stays on disk. Each piece
of the body must arrive within ``--body-timeout`` of the one before (408):
the flag bounds a stalled body, not the length of an upload (200 MiB over a
slow link takes more than its 30 s).
"""

from __future__ import annotations

import errno
import logging
import re
from contextlib import aclosing
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs

import attrs
import trio
from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, parse_options_header

from ..sessions._files import UPLOAD_PURPOSES, FilesQuotaExceeded, StoredFile
from ._http import BODY_TIMEOUT, DEFAULT_BODY_TIMEOUT_S, ApiError, ClientGone, Receive, Send, header, send_json
from ._principal import principal_of

if TYPE_CHECKING:
    from ._host import App

__all__ = ["route_files"]

MAX_LIST = 10_000
BODY_SLACK = 1 << 20   # a body may exceed its file by this much (the other fields, the parts' heads)
MAX_PARTS = 16
MAX_FIELD_BYTES = 1024  # a field that is not the file (purpose, and any other we ignore)
MAX_FILENAME = 1024     # characters
_READ = 1 << 20         # bytes of a file's content sent at once
_CLOSE = ((b"connection", b"close"),)
_ROUTE = re.compile(r"/v1/files(?:/([^/]+)(/content)?)?")

# The parser's own warnings (one per malformed body, offsets and bytes) repeat the 400 we answer,
# and any client could fill the log with them: its instances log to a logger that keeps nothing.
_SILENT = logging.Logger("superfluid.files.multipart", logging.CRITICAL + 1)


def _not_found(fid: str) -> ApiError:
    return ApiError(404, f"No such File object: {fid}", code="file_not_found", param="file_id")


def _bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, f"invalid request: {message}", param=param)


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"the file exceeds the {limit}-byte limit (--files-max-bytes)", code="payload_too_large",
                    param="file")


def _quota(exc: FilesQuotaExceeded) -> ApiError:
    return ApiError(413, f"this upload would take your files past their quota: {exc.used} bytes are stored "
                         f"of the {exc.quota} allowed (--files-quota-gb), and the upload passed that at "
                         f"{exc.upload} bytes; delete some first",
                    code="files_quota_exceeded", type="quota_exceeded", param="file")


async def route_files(app: App, scope: dict[str, Any], receive: Receive, send: Send) -> bool:
    """Serve a files route; False if the path is not one."""
    m = _ROUTE.fullmatch(scope["path"])
    if m is None:
        return False
    method, (fid, content) = scope["method"], m.groups()
    tenant = principal_of(scope).tenant
    if fid is None and method == "POST":
        f = await _upload(app, scope, receive, tenant)
        await send_json(send, 200, f.public())
    elif fid is None and method == "GET":
        await send_json(send, 200, _list(app, scope, tenant))
    elif fid is not None and content and method == "GET":
        await _content(app, send, _own(app, tenant, fid))
    elif fid is not None and not content and method == "GET":
        await send_json(send, 200, _own(app, tenant, fid).public())
    elif fid is not None and not content and method == "DELETE":
        if not await app.files.delete(tenant, fid):
            raise _not_found(fid)
        await send_json(send, 200, {"id": fid, "object": "file", "deleted": True})
    else:
        raise ApiError(405, f"method {method} not allowed on {scope['path']}")
    return True


def _own(app: App, tenant: str, fid: str) -> StoredFile:
    f = app.files.get(tenant, fid)
    if f is None:
        raise _not_found(fid)
    return f


# ---- GET ----

def _list(app: App, scope: dict[str, Any], tenant: str) -> dict[str, Any]:
    query = parse_qs(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)

    def one(name: str) -> str | None:
        values = query.get(name)
        if values is not None and len(values) != 1:
            raise _bad(f"{name} given more than once", name)
        return values[0] if values else None

    purpose, after, raw_limit, order = one("purpose"), one("after"), one("limit"), one("order") or "desc"
    if order not in ("asc", "desc"):
        raise _bad("order must be asc or desc", "order")
    try:
        limit = MAX_LIST if raw_limit is None else int(raw_limit)
    except ValueError:
        limit = 0
    if not 1 <= limit <= MAX_LIST:
        raise _bad(f"limit must be an integer in 1..{MAX_LIST}", "limit")
    if after is not None and app.files.get(tenant, after) is None:
        raise _bad(f"after names no file of yours: {after!r}", "after")  # (another tenant's id is no cursor)
    files = app.files.list(tenant, purpose=purpose, after=after, limit=limit + 1, order=order)
    page = files[:limit]
    return {"object": "list", "data": [f.public() for f in page], "first_id": page[0].id if page else None,
            "last_id": page[-1].id if page else None, "has_more": len(files) > limit}


async def _content(app: App, send: Send, f: StoredFile) -> None:
    """``f``'s bytes, a MiB at a time: opened first, so a delete meanwhile does not cut it short."""
    try:
        fh = await trio.open_file(app.files.path(f), "rb")
    except FileNotFoundError:
        raise _not_found(f.id) from None  # deleted between the lookup and the open
    kind = b"application/jsonl" if f.filename.endswith(".jsonl") else b"application/octet-stream"
    async with fh:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", kind), (b"content-length", str(f.bytes).encode())]})
        sent = 0
        while sent < f.bytes:
            chunk = await fh.read(min(_READ, f.bytes - sent))
            if not chunk:
                break  # (shorter than its metadata says: the client sees a short body, not a hang)
            sent += len(chunk)
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})


# ---- POST ----

class _Form:
    """The multipart body of an upload, parsed as it arrives: ``fields`` (``purpose``), the
    file part's name, and its bytes, taken from :attr:`pending` after each body message (at
    most one message's worth)."""

    def __init__(self, boundary: bytes, file_limit: int) -> None:
        self.parser = MultipartParser(boundary, callbacks={
            "on_part_begin": self._part_begin, "on_header_field": self._header_field,
            "on_header_value": self._header_value, "on_header_end": self._header_end,
            "on_headers_finished": self._headers_finished, "on_part_data": self._part_data,
            "on_part_end": self._part_end, "on_end": self._end})
        self.parser.logger = _SILENT
        self.file_limit = file_limit
        self.fields: dict[str, str] = {}
        self.filename: str | None = None   # set once the file part's head is read
        self.file_bytes = 0
        self.pending: list[bytes] = []
        self.ended = False
        self._parts = 0
        self._field = bytearray()
        self._value = bytearray()
        self._headers: dict[str, str] = {}
        self._part: str | None = None      # "file", a field's name, or "" (a field we ignore)
        self._data = bytearray()

    def write(self, chunk: bytes) -> None:
        """Raises:
            ApiError: 400 a malformed body or part; 413 the file part is over its limit."""
        if self.ended:
            return  # an epilogue after the closing boundary: ignored (RFC 2046)
        try:
            self.parser.write(chunk)
        except FormParserError as exc:
            raise _bad(f"malformed multipart/form-data body: {exc}") from None

    def take(self) -> bytes:
        data = b"".join(self.pending)
        self.pending.clear()
        return data

    def _part_begin(self) -> None:
        self._parts += 1
        if self._parts > MAX_PARTS:
            raise _bad(f"more than {MAX_PARTS} parts")
        self._headers.clear()
        self._part = None
        self._data.clear()

    def _header_field(self, data: bytes, start: int, end: int) -> None:
        self._field += data[start:end]  # (the parser bounds a header's size and count)

    def _header_value(self, data: bytes, start: int, end: int) -> None:
        self._value += data[start:end]

    def _header_end(self) -> None:
        self._headers[self._field.decode("latin-1").strip().lower()] = self._value.decode("latin-1").strip()
        self._field.clear()
        self._value.clear()

    def _headers_finished(self) -> None:
        kind, options = parse_options_header(self._headers.get("content-disposition", ""))
        name = options.get(b"name")
        if kind != b"form-data" or name is None:
            raise _bad("each part needs Content-Disposition: form-data; name=...")
        field = name.decode("utf-8", "replace")
        if field == "file":
            if self.filename is not None:
                raise _bad("more than one file part", "file")
            raw = options.get(b"filename")
            filename = raw.decode("utf-8", "replace") if raw else "file"
            if len(filename) > MAX_FILENAME:
                raise _bad(f"the file name is longer than {MAX_FILENAME} characters", "file")
            self.filename = filename
            self._part = "file"
        elif field == "purpose":
            if field in self.fields:
                raise _bad("purpose given more than once", "purpose")
            self._part = field
        else:
            self._part = ""  # expires_after[...] and anything else: read and dropped

    def _part_data(self, data: bytes, start: int, end: int) -> None:
        if self._part == "file":
            self.file_bytes += end - start
            if self.file_bytes > self.file_limit:
                raise _too_large(self.file_limit)
            self.pending.append(data[start:end])
        elif self._part:
            self._data += data[start:end]
            if len(self._data) > MAX_FIELD_BYTES:
                raise _bad(f"{self._part} is longer than {MAX_FIELD_BYTES} bytes", self._part)

    def _part_end(self) -> None:
        if self._part and self._part != "file":
            self.fields[self._part] = self._data.decode("utf-8", "replace")
        self._part = None

    def _end(self) -> None:
        self.ended = True


class _Body:
    """The request body, message by message, each within ``--body-timeout`` of the one
    before, at most ``limit`` bytes in all."""

    def __init__(self, scope: dict[str, Any], receive: Receive, limit: int) -> None:
        self.receive = receive
        self.timeout = scope.get(BODY_TIMEOUT, DEFAULT_BODY_TIMEOUT_S)
        self.limit = limit
        self.read = 0
        self.done = False

    async def next(self) -> bytes:
        """Raises:
            ApiError: 408 a stalled body; 413 a body over its limit (both close the connection).
            ClientGone: the client left."""
        with trio.move_on_after(self.timeout):
            message = await self.receive()
            if message["type"] == "http.disconnect":
                raise ClientGone()
            chunk: bytes = message.get("body", b"")
            self.read += len(chunk)
            if self.read > self.limit:
                raise ApiError(413, f"request body exceeds the {self.limit}-byte limit (--files-max-bytes and "
                                    f"{BODY_SLACK} bytes for the other fields)", code="payload_too_large",
                               headers=_CLOSE)
            self.done = not message.get("more_body", False)
            return chunk
        raise ApiError(408, f"the request body stalled for {self.timeout:g} s (--body-timeout)",
                       code="request_timeout", headers=_CLOSE)

    async def drain(self) -> None:
        """Read the rest and drop it, so the client reads our answer rather than a reset mid-upload.

        Raises:
            ApiError, ClientGone: as :meth:`next` (past the limit the answer goes out, and the connection closes).
        """
        while not self.done:
            await self.next()


async def _file_data(body: _Body, form: _Form) -> AsyncIterator[bytes]:
    """The file part's bytes as they arrive, to the end of the body.

    Raises:
        ApiError: 400 a malformed body (one that ends before its closing boundary included).
    """
    while True:
        data = form.take()
        if data:
            yield data
        if body.done:
            break
        form.write(await body.next())
    if not form.ended:
        raise _bad("the multipart/form-data body ended before its closing boundary")


async def _upload(app: App, scope: dict[str, Any], receive: Receive, tenant: str) -> StoredFile:
    """``POST /v1/files``: the stored file. A refusal found before the body's end is
    answered once the rest is read and dropped (:meth:`_Body.drain`).

    Raises:
        ApiError: 400 (``param`` names the field), 408, 413, 507 a full disk.
    """
    kind, options = parse_options_header(header(scope, "content-type") or "")
    if kind != b"multipart/form-data":
        raise _bad("POST /v1/files takes multipart/form-data with the fields file and purpose", "file")
    boundary = options.get(b"boundary")
    if not boundary or len(boundary) > 70:  # RFC 2046: 1 to 70 characters
        raise _bad("the multipart/form-data content type needs a boundary of 1 to 70 characters")
    file_limit = app.config.files_max_bytes
    limit = file_limit + BODY_SLACK
    declared = header(scope, "content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"request body of {declared} bytes exceeds the {limit}-byte limit (--files-max-bytes "
                            f"and {BODY_SLACK} bytes for the other fields)", code="payload_too_large",
                       headers=_CLOSE)
    body = _Body(scope, receive, limit)
    form = _Form(boundary, file_limit)
    try:
        return await _store(app, tenant, body, form)
    except ApiError as exc:
        if body.done or exc.headers:  # read to its end, or the connection closes anyway (408, the body's 413)
            raise
        refusal = exc
    try:
        await body.drain()
    except ApiError:
        raise attrs.evolve(refusal, headers=_CLOSE) from None
    raise refusal


async def _store(app: App, tenant: str, body: _Body, form: _Form) -> StoredFile:
    while form.filename is None and not body.done:  # up to the file part's head: its name, and a purpose before it
        form.write(await body.next())
        _check_purpose(form)
    if form.filename is None:
        if not form.ended:
            raise _bad("the multipart/form-data body ended before its closing boundary")
        raise _bad("missing required field: file", "file")
    try:
        async with aclosing(_file_data(body, form)) as chunks:
            upload = await app.files.receive(tenant, chunks)
    except FilesQuotaExceeded as exc:
        raise _quota(exc) from None
    except OSError as exc:
        raise _disk(exc) from None
    try:
        _check_purpose(form)
        purpose = form.fields.get("purpose")
        if purpose is None:
            raise _bad("missing required field: purpose", "purpose")
        return await app.files.commit(upload, filename=form.filename, purpose=purpose)
    except OSError as exc:
        raise _disk(exc) from None
    finally:
        app.files.discard(upload)  # (a no-op once committed)


def _check_purpose(form: _Form) -> None:
    purpose = form.fields.get("purpose")
    if purpose is not None and purpose not in UPLOAD_PURPOSES:
        raise _bad(f"purpose must be one of {', '.join(sorted(UPLOAD_PURPOSES))}; got {purpose!r}", "purpose")


def _disk(exc: OSError) -> ApiError:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return ApiError(507, f"the files directory is full: {exc.strerror}", code="insufficient_storage")
    return ApiError(503, f"the file could not be stored: {exc.strerror or exc}", code="files_write_failed")
