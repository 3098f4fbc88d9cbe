"""OpenAI's Batches API (SPEC.md §7, "Batches"): a file of requests run in the background class.

* ``POST /v1/batches`` ``{input_file_id, endpoint, completion_window: "24h", metadata?}``: a
  batch of the tenant's ``batch`` file, each line ``{custom_id, method: "POST", url, body}``
  with ``url`` the batch's endpoint (``/v1/chat/completions``, ``/v1/completions``,
  ``/v1/embeddings``, ``/v1/responses``). Durable before the reply (``sessions/_batches.py``).
* ``GET /v1/batches`` (``after``, ``limit``), ``GET /v1/batches/{id}``,
  ``POST /v1/batches/{id}/cancel``.

Every line runs through :meth:`App.dispatch`: the same route and checks as the request sent
over HTTP (the key's models and ``max_concurrent``, the body limits, tenancy), as the batch's
owner, in the ``background`` class (``agent`` when the batch was made with
``x-superfluid-qos: agent`` and the key may ask it), so an interactive request preempts a
batch's lanes. A line that is not a valid request is an error line, never a failed batch; a
reply refused for want of room (429 ``concurrency_limit_exceeded``, 503, 507) is tried again
later, not written.

The runner (:class:`BatchService`, in the daemon's root nursery) starts up to
:data:`MAX_RUNNING` batches at once, oldest first; each batch runs in a cancel scope of its
own, its lines up to its concurrency at once. A line's result is logged (fsynced) before the
next result of the batch; a restart (SIGKILL included) re-runs only the lines whose result was
not logged, so each input line is in the output or the error file exactly once. Cancel is
the batch's cancel scope: its lines' requests end as a client leaving ends them, and the
batch finalizes with what finished.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
import time
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import parse_qs

import trio

from ..proto._batch import FINAL_STATUSES
from ..sched import QosClass, parse_qos
from ..sessions._batches import Batch, BatchStore, input_lines
from ._http import ApiError, Receive, Send, header, read_json, send_json
from ._principal import ANONYMOUS, Principal, principal_of

if TYPE_CHECKING:
    from ._host import App as _App

    class App(_App, Protocol):
        """What the batch routes and runner see of the application: the app, and its runner."""

        batches: BatchService

__all__ = ["ENDPOINTS", "MAX_LINES", "MAX_PENDING", "MAX_RUNNING", "BatchService", "route_batches"]

log = logging.getLogger("superfluid.batches")

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
WINDOWS = {"24h": 24 * 3600}
MAX_LINES = 50_000              # input lines per batch (OpenAI's limit)
MAX_LINE_BYTES = 16 << 20       # one input line (a request body and its envelope)
MAX_REPLY_BYTES = 64 << 20      # one line's reply, as kept in the batch's log
MAX_RUNNING = 4                 # batches running at once; later ones wait in ``validating``
MAX_PENDING = 256               # batches not yet ended, all tenants: more is 429 ``batch_queue_full``
MAX_METADATA = 16
RETRY_AFTER_S = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0)  # a line refused for room, tried again after these
RETRY_BATCH_S = 30.0            # a batch stopped by an error (a full disk) starts again after this
_ROUTE = re.compile(r"/v1/batches(?:/([A-Za-z0-9_-]{1,64})(/cancel)?)?")


def _now() -> int:
    return int(time.time())


def public(batch: Batch) -> dict[str, Any]:
    """The OpenAI ``batch`` object."""
    c, st = batch.state.created, batch.state
    final = st.final or {}
    status = st.status
    at = final.get("at")
    errors = st.errors
    return {
        "id": batch.id, "object": "batch", "endpoint": c["endpoint"],
        "errors": {"object": "list", "data": errors} if errors else None,
        "input_file_id": c["input_file_id"], "completion_window": c["completion_window"], "status": status,
        "output_file_id": final.get("output_file_id"), "error_file_id": final.get("error_file_id"),
        "created_at": c["at"], "in_progress_at": st.in_progress_at, "expires_at": c["expires_at"],
        "finalizing_at": final.get("finalizing_at"),
        "completed_at": at if status == "completed" else None, "failed_at": at if status == "failed" else None,
        "expired_at": at if status == "expired" else None, "cancelling_at": st.cancelling_at,
        "cancelled_at": at if status == "cancelled" else None,
        "request_counts": {"total": st.total or 0, "completed": st.completed, "failed": st.failed},
        "metadata": c.get("metadata"),
    }


def _line_error(index: int, custom_id: Any, code: str, message: str) -> dict[str, Any]:
    return {"t": "line", "i": index, "ok": False, "out": json.dumps({
        "id": f"batch_req_{secrets.token_hex(12)}", "custom_id": custom_id if isinstance(custom_id, str) else None,
        "response": None, "error": {"code": code, "message": f"line {index + 1}: {message}"}},
        ensure_ascii=False).encode()}


def _line_reply(index: int, custom_id: str, status: int, reply: bytes) -> dict[str, Any]:
    try:
        body: Any = json.loads(reply)
    except ValueError:
        body = reply.decode("utf-8", "replace")
    return {"t": "line", "i": index, "ok": 200 <= status < 300, "out": json.dumps({
        "id": f"batch_req_{secrets.token_hex(12)}", "custom_id": custom_id,
        "response": {"status_code": status, "request_id": f"req_{secrets.token_hex(12)}", "body": body},
        "error": None}, ensure_ascii=False).encode()}


def _code(reply: bytes) -> str:
    try:
        err = json.loads(reply).get("error")
    except (ValueError, AttributeError):
        return ""
    return str(err.get("code") or "") if isinstance(err, dict) else ""


def _retryable(status: int, reply: bytes) -> bool:
    """A refusal for want of room now (the key's slots, a full queue, a stopping or degraded
    daemon, a worker down), not an answer about the request itself."""
    if status in (503, 507):
        return True
    return status == 429 and _code(reply) in ("concurrency_limit_exceeded", "queue_full", "too_many_models")


class BatchService:
    """Runs the batches of a :class:`BatchStore`; one per App."""

    def __init__(self, app: App, store: BatchStore) -> None:
        self.app = app
        self.store = store
        self._running: dict[str, trio.CancelScope] = {}
        self._wake = trio.Event()
        self.lines_run = 0   # requests dispatched (a line tried again counts each time): tests read it

    def wake(self) -> None:
        self._wake.set()

    def pending(self) -> int:
        return sum(1 for b in self.store.batches.values() if not b.state.done)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Start batches as room frees, oldest first, until cancelled (the daemon's root)."""
        async with trio.open_nursery() as nursery:
            task_status.started()
            while True:
                waiting = sorted((b for b in self.store.batches.values()
                                  if not b.state.done and b.id not in self._running),
                                 key=lambda b: (b.state.created["at"], b.id))
                for batch in waiting:
                    # a batch being cancelled before it ran only finalizes: it takes no room
                    if len(self._running) < MAX_RUNNING or batch.state.cancelling_at is not None:
                        scope = trio.CancelScope()
                        self._running[batch.id] = scope
                        nursery.start_soon(self._run, batch, scope)
                await self._wake.wait()
                self._wake = trio.Event()

    async def cancel(self, batch: Batch) -> None:
        """Log the cancel (the client's answer says ``cancelling``), then end the batch's scope."""
        if batch.state.cancelling_at is None:
            await batch.append({"t": "cancel", "at": _now()})
        scope = self._running.get(batch.id)
        if scope is not None:
            scope.cancel()
        self.wake()

    async def _run(self, batch: Batch, scope: trio.CancelScope) -> None:
        """One batch's task: its failure boundary (a full disk, a bug: logged, and the daemon
        goes on; the batch stays as its log says and is tried again after a pause)."""
        try:
            status, errors = "cancelled", []
            if batch.state.cancelling_at is None:
                with scope:
                    status, errors = await self._lines(batch)
                if scope.cancelled_caught:
                    status = "cancelled"
            await self._finalize(batch, status, errors)
        except Exception:  # boundary: one batch
            log.exception("batch %s: stopped by an error; it is tried again in %g s", batch.id, RETRY_BATCH_S)
            await trio.sleep(RETRY_BATCH_S)
        finally:
            del self._running[batch.id]
            self.wake()

    def _owner(self, batch: Batch) -> Principal | None:
        """The batch's owner as the daemon's keys stand now; None if its key is gone."""
        name = batch.state.created.get("key")
        keys = self.app.config.api_keys
        if not keys:
            return ANONYMOUS if name in (None, "") else None
        for key in keys:
            if key.name == name:
                return Principal(name=key.name, tenant=key.name, key=key)
        return None

    async def _lines(self, batch: Batch) -> tuple[str, list[dict[str, Any]]]:
        """Run the batch's lines not yet done; the status it ends in and its errors."""
        owner = self._owner(batch)
        if owner is None:
            return "failed", [{"code": "key_not_found", "message": "the API key that created this batch is no "
                                                                  "longer configured", "param": None, "line": None}]
        if batch.state.total is None:
            total = 0
            async for _i, _line in input_lines(batch.input_path, MAX_LINE_BYTES, per_read=4096):
                total += 1
            if total == 0:
                return "failed", [{"code": "empty_file", "message": "the input file has no request lines",
                                   "param": "input_file_id", "line": None}]
            if total > MAX_LINES:
                return "failed", [{"code": "too_many_requests", "message": f"the input file has {total} request "
                                   f"lines; a batch takes at most {MAX_LINES}", "param": "input_file_id", "line": None}]
            await batch.append({"t": "started", "total": total, "at": _now()})
        created = batch.state.created
        klass = QosClass(int(created["qos"]))
        lanes = max(1, self.app.config.max_batch)
        if owner.key is not None and owner.key.max_concurrent:
            lanes = min(lanes, owner.key.max_concurrent)
        left = created["expires_at"] - time.time()
        with trio.move_on_after(max(0.0, left)) as window:
            send_line, receive_line = trio.open_memory_channel[tuple[int, Any, bytes | None]](0)
            async with trio.open_nursery() as nursery:
                for _ in range(lanes):
                    nursery.start_soon(self._worker, batch, owner, klass, receive_line.clone())
                receive_line.close()
                async with send_line:
                    await self._feed(batch, send_line)
        return ("expired" if window.cancelled_caught else "completed"), []

    async def _feed(self, batch: Batch, out: trio.MemorySendChannel[tuple[int, Any, bytes | None]]) -> None:
        """Each input line not yet done, with its ``custom_id`` checked unique (read in order,
        done lines included, so a restart sees the same duplicates)."""
        seen: set[str] = set()
        async for index, line in input_lines(batch.input_path, MAX_LINE_BYTES):
            request: Any = None
            error: tuple[str, str] | None = None
            if line is None:
                error = ("line_too_large", f"the line exceeds {MAX_LINE_BYTES} bytes")
            else:
                try:
                    request = json.loads(line)
                except ValueError:
                    error = ("invalid_json", "the line is not JSON")
            cid = request.get("custom_id") if isinstance(request, dict) else None
            if error is None and not isinstance(request, dict):
                error = ("invalid_request", "the line is not a JSON object")
            elif error is None and (not isinstance(cid, str) or not cid):
                error = ("missing_custom_id", "custom_id must be a non-empty string")
            elif error is None and cid in seen:
                error = ("duplicate_custom_id", f"custom_id {cid!r} is used by an earlier line")
            if isinstance(cid, str) and error is None:
                seen.add(cid)
            if index in batch.state.lines:
                continue
            await out.send((index, request, None) if error is None else (index, cid, json.dumps(error).encode()))

    async def _worker(self, batch: Batch, owner: Principal, klass: QosClass,
                      lines: trio.MemoryReceiveChannel[tuple[int, Any, bytes | None]]) -> None:
        endpoint = batch.state.created["endpoint"]
        async with lines:
            async for index, request, error in lines:
                if error is not None:
                    code, message = json.loads(error)
                    await batch.append(_line_error(index, request, code, message))
                    continue
                await batch.append(await self._one(index, request, endpoint, owner, klass))

    async def _one(self, index: int, request: dict[str, Any], endpoint: str, owner: Principal,
                   klass: QosClass) -> dict[str, Any]:
        cid = request["custom_id"]
        if request.get("method", "POST") != "POST":
            return _line_error(index, cid, "invalid_method", "method must be POST")
        if request.get("url") != endpoint:
            return _line_error(index, cid, "invalid_url", f"url must be the batch's endpoint {endpoint}")
        body = request.get("body")
        if not isinstance(body, dict):
            return _line_error(index, cid, "invalid_body", "body must be a JSON object")
        if body.get("stream"):
            return _line_error(index, cid, "stream_unsupported", "a batch line cannot stream")
        raw = json.dumps(body, ensure_ascii=False).encode()
        for wait in (*RETRY_AFTER_S, None):
            self.lines_run += 1
            status, reply = await self.app.dispatch(owner, endpoint, raw, qos=klass, limit=MAX_REPLY_BYTES)
            if wait is None or not _retryable(status, reply):
                return _line_reply(index, cid, status, reply)
            await trio.sleep(wait)
        raise AssertionError("unreachable")

    async def _finalize(self, batch: Batch, status: str, errors: list[dict[str, Any]]) -> None:
        """Write the output and error files of what finished, then the ``final`` record."""
        finalizing_at = _now()
        ids: dict[str, str | None] = {"output_file_id": None, "error_file_id": None}
        st = batch.state
        files = self.app.files
        for ok, field, name in ((True, "output_file_id", "output"), (False, "error_file_id", "error")):
            if (st.completed if ok else st.failed):
                made = await files.create(batch.tenant, f"{batch.id}_{name}.jsonl", "batch_output",
                                          batch.outputs(ok=ok), quota=False)
                ids[field] = made.id
        await batch.append({"t": "final", "status": status, "at": _now(), "finalizing_at": finalizing_at,
                            "errors": errors, **ids})
        log.info("batch %s %s: %d completed, %d failed of %d", batch.id, status, st.completed, st.failed,
                 st.total or 0)


# --- routes ------------------------------------------------------------------------------------------


def _qos(app: App, scope: dict[str, Any]) -> QosClass:
    """``background``, or ``agent`` when the batch is made with ``x-superfluid-qos: agent``
    and the key may ask it."""
    value = header(scope, "x-superfluid-qos")
    if value is None or not app.config.http_qos_header:
        return QosClass.BACKGROUND
    try:
        asked = parse_qos(value)
    except ValueError as exc:
        raise ApiError(400, str(exc), param="x-superfluid-qos") from None
    if asked < QosClass.AGENT:
        raise ApiError(403, "a batch runs in the background or agent class", code="qos_class_not_allowed",
                       param="x-superfluid-qos", type="permission_error")
    return principal_of(scope).qos(asked, QosClass.BACKGROUND)


def _metadata(value: Any) -> dict[str, str] | None:
    if value is None:
        return None
    if (not isinstance(value, dict) or len(value) > MAX_METADATA
            or not all(isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512
                       for k, v in value.items())):
        raise ApiError(400, f"metadata must map at most {MAX_METADATA} keys (64 characters) to strings "
                            "(512 characters)", param="metadata")
    return dict(value)


async def _create(app: App, scope: dict[str, Any], receive: Receive, send: Send) -> None:
    body = await read_json(scope, receive)
    for key in body:
        if key not in ("input_file_id", "endpoint", "completion_window", "metadata"):
            raise ApiError(400, f"invalid request: unknown field {key!r}", param=key)
    endpoint = body.get("endpoint")
    if endpoint not in ENDPOINTS:
        raise ApiError(400, f"endpoint must be one of {', '.join(ENDPOINTS)}", param="endpoint")
    window = body.get("completion_window")
    if window not in WINDOWS:
        raise ApiError(400, "completion_window must be 24h", param="completion_window")
    metadata = _metadata(body.get("metadata"))
    klass = _qos(app, scope)
    principal = principal_of(scope)
    fid = body.get("input_file_id")
    stored = app.files.get(principal.tenant, fid) if isinstance(fid, str) else None
    if stored is None:
        raise ApiError(404, f"no file {fid!r}", code="file_not_found", param="input_file_id")
    if stored.purpose != "batch":
        raise ApiError(400, f"file {fid} has purpose {stored.purpose!r}; a batch reads a file of purpose 'batch'",
                       param="input_file_id")
    service = app.batches
    if service.pending() >= MAX_PENDING:
        raise ApiError(429, f"{MAX_PENDING} batches are waiting or running; try again when one has ended",
                       code="batch_queue_full", type="rate_limit_error")
    app.sessions.journal.check_writable()  # a full disk: 507, as for every write
    now = _now()
    created = {"t": "created", "id": f"batch_{secrets.token_hex(12)}", "tenant": principal.tenant,
               "key": principal.name, "endpoint": endpoint, "input_file_id": fid, "completion_window": window,
               "metadata": metadata, "at": now, "expires_at": now + WINDOWS[window], "qos": int(klass)}
    try:
        batch = await service.store.create(created, app.files.path(stored))
    except OSError as exc:
        raise ApiError(507, f"the batch could not be stored: {exc.strerror}", code="insufficient_storage") from None
    service.wake()
    await send_json(send, 200, public(batch))


def _page(app: App, scope: dict[str, Any]) -> dict[str, Any]:
    query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
    raw_limit = (query.get("limit") or ["20"])[0]
    if not raw_limit.isdigit() or not 1 <= int(raw_limit) <= 100:
        raise ApiError(400, "limit must be an integer from 1 to 100", param="limit")
    after = (query.get("after") or [None])[0]
    tenant = principal_of(scope).tenant
    mine = sorted((b for b in app.batches.store.batches.values() if b.tenant == tenant),
                  key=lambda b: (b.state.created["at"], b.id), reverse=True)
    if after is not None:
        ids = [b.id for b in mine]
        mine = mine[ids.index(after) + 1:] if after in ids else []
    page = mine[:int(raw_limit)]
    data = [public(b) for b in page]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": len(mine) > len(page)}


async def route_batches(app: App, scope: dict[str, Any], receive: Receive, send: Send) -> bool:
    """Serve ``scope`` if it is a batches route; False if it is not one."""
    m = _ROUTE.fullmatch(scope["path"])
    if m is None:
        return False
    method, bid, tail = scope["method"], m.group(1), m.group(2)
    if bid is None:
        if method == "POST":
            await _create(app, scope, receive, send)
        elif method == "GET":
            await send_json(send, 200, _page(app, scope))
        else:
            raise ApiError(405, f"method {method} not allowed on {scope['path']}")
        return True
    batch = app.batches.store.of(principal_of(scope).tenant, bid)
    if (tail is None and method != "GET") or (tail is not None and method != "POST"):
        raise ApiError(405, f"method {method} not allowed on {scope['path']}")
    if batch is None:
        raise ApiError(404, f"no batch {bid!r}", code="batch_not_found", param="batch_id")
    if tail is not None:
        if batch.state.status in FINAL_STATUSES:
            raise ApiError(409, f"batch {bid} has ended ({batch.state.status}) and cannot be cancelled",
                           code="batch_not_cancellable")
        await app.batches.cancel(batch)
    await send_json(send, 200, public(batch))
