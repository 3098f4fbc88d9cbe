"""One exchange's life as the operator sees it: its access-log line, and how it
ends when the daemon shuts down.

Every HTTP request and WebSocket runs with an :class:`Exchange` in a context
variable (set by the App). Handlers register the jobs they serve
(:func:`note_job`, done by ``open_lane`` and the session routes); the App
writes one ``superfluid.access`` line when the exchange ends (:func:`access_line`).

Shutdown (:class:`Stopping`): SIGTERM/SIGINT first *stops the readers*: every
request-side wait on a job (:func:`wait_beyond`, :func:`wait_started`) raises
a 503 ``server_shutting_down``, which each dialect already turns into its
error frame (then ``[DONE]``) mid-stream or its typed error body before the
response started. The jobs themselves are not touched: a resumable session's
generation goes on into the log until the daemon exits and resumes on the next
start. Only waits made inside a request see it: a conversation turn's owner
task (it lands the reply) reads on, unaware. Any other wait inside a request
(a reservation or a tokenize behind a busy actor, a model load) ends by the
request's own cancel scope, whose deadline the shutdown sets ``CANCEL_AFTER_S``
ahead; the request's boundary turns that cancel into the same 503.
:meth:`Stopping.begin` only sets flags, deadlines and an event
(:meth:`Stopping.wait_begun`): it never spawns, waits or raises; each
WebSocket watches that event in a task of its own nursery.

The request scope (:func:`open_request`): every HTTP request's handler runs in
one cancel scope that is cancelled when the client disconnects, watched from
the moment its body has been read (hypercorn never cancels the app; it only
queues ``http.disconnect``). A client that leaves during a model load, a
tokenize or a wait costs nothing more: the lane it held retires as it exits
(a resumable stream whose client has its id is kept, ``api/_lane.py``).
Once the response's last message has been handed to the server, a disconnect
no longer cancels anything: it is the server ending the exchange, not the
client leaving (:meth:`Request.send`).
"""

from __future__ import annotations

import logging
import weakref
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

import attrs
import trio

from .._errors import leaves

from ._http import ApiError, Receive, Send

if TYPE_CHECKING:
    from ..sched import Job

__all__ = ["Exchange", "Request", "Stopping", "access_line", "current_exchange", "fail", "note_job",
           "open_request", "shutting_down", "wait_beyond", "wait_started"]

log = logging.getLogger("superfluid.access")

SHUTTING_DOWN = "server_shutting_down"
# SIGTERM: a request still in its scope this long after the shutdown began is cancelled there and
# answered 503 (streams the helpers reached have ended typed long before; --shutdown-grace is 5 s)
CANCEL_AFTER_S = 1.0


def shutting_down() -> ApiError:
    # the code leads the message too: Anthropic's and Ollama's error shapes carry no code
    return ApiError(503, f"{SHUTTING_DOWN}: the daemon is stopping (SIGTERM/SIGINT); retry once it is back "
                         "(a resumable session resumes by its id)", code=SHUTTING_DOWN)


class Stopping:
    """The daemon's shutdown as request handlers see it (one per App)."""

    def __init__(self) -> None:
        self.started = False
        self.inflight = 0                 # exchanges (HTTP requests and WebSockets) not yet over
        self._jobs: weakref.WeakSet[Job] = weakref.WeakSet()   # jobs some request waits on
        self._requests: weakref.WeakSet[Request] = weakref.WeakSet()   # open HTTP request scopes
        self.cancel_after_s = CANCEL_AFTER_S
        self._begun = trio.Event()        # open WebSockets wait on it, each in its own nursery
        self._idle = trio.Event()
        self._idle.set()

    def begin(self) -> None:
        """Stop every request-side reader now (each sees ``server_shutting_down``
        at its next wait) and wake :meth:`wait_begun` (open WebSockets close).
        Never spawns, waits or raises: it runs in the daemon's stop task, and
        whatever a socket is doing (closing, say) is that socket's business."""
        self.started = True
        for job in list(self._jobs):
            job.publish()  # wakes its readers; the job itself goes on
        # the backstop: a wait that does not go through the helpers below (a reservation or a
        # tokenize behind a busy actor, a load) ends by its request's own cancel scope, and the
        # request's boundary answers 503 server_shutting_down (api/_app.py)
        deadline = trio.current_time() + self.cancel_after_s
        for request in list(self._requests):
            request.shut(deadline)
        self._begun.set()

    def opened(self, request: Request) -> None:
        """An HTTP request scope is open (:func:`open_request`): a shutdown bounds it too."""
        if self.started:
            request.shut(trio.current_time() + self.cancel_after_s)
        self._requests.add(request)

    async def wait_begun(self) -> None:
        """Until the shutdown begins (at once if it has)."""
        await self._begun.wait()

    def watch(self, job: Job) -> None:
        self._jobs.add(job)

    def enter(self) -> None:
        self.inflight += 1
        if self.inflight == 1:
            self._idle = trio.Event()

    def leave(self) -> None:
        self.inflight -= 1
        if self.inflight == 0:
            self._idle.set()

    async def wait_idle(self) -> None:
        """Until no exchange is in flight."""
        while self.inflight:
            await self._idle.wait()


@attrs.define(eq=False)
class Exchange:
    """One HTTP request (or WebSocket) as the access log and the shutdown see it."""

    method: str
    path: str
    started: float
    stopping: Stopping | None = None
    status: int | None = None
    jobs: list[tuple[str, Job]] = attrs.field(factory=list)
    error: str | None = None            # the code of an error that ended a stream after its head went out
    peer: str = ""


_CURRENT: ContextVar[Exchange | None] = ContextVar("superfluid_exchange", default=None)


def current_exchange() -> Exchange | None:
    return _CURRENT.get()


def set_exchange(exchange: Exchange | None) -> None:
    _CURRENT.set(exchange)


class Request:
    """One HTTP request's handler scope (:func:`open_request`).

    ``scope`` is cancelled once the client disconnects while the response is
    not over. ``receive`` is the handler's ASGI receive: the body's messages in
    order, then (once the client is gone) ``http.disconnect``; ``send`` its
    ASGI send. Only one task reads the connection at a time: the watcher (from
    the start, and again once the body has been read) or the handler (reading
    a body of several messages)."""

    def __init__(self, receive: Receive, nursery: trio.Nursery, send: Send | None = None) -> None:
        self._receive = receive
        self._send = send
        self._nursery = nursery
        self.scope = trio.CancelScope()
        self.gone = False                  # the client disconnected (or the server ended the exchange)
        self.responded = False             # the response's last message went to the server
        self.stopped = False               # the daemon is stopping: the scope has a deadline
        self._pending: deque[dict[str, Any]] = deque()  # body messages the watcher read (at most one)
        self._watching = False
        self._changed = trio.Event()

    def _watch(self) -> None:
        """Start the watcher (called in the request's own task, while its nursery is open)."""
        if not self._watching and not self.gone:
            self._watching = True
            self._nursery.start_soon(self._watcher)

    async def _watcher(self) -> None:
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                if self.responded:
                    self._ended()
                else:
                    self._left()
                return
            if message["type"] == "http.request":
                self._pending.append(message)  # the handler's, when it reads its body
                self._wake()
                if message.get("more_body", False):
                    self._watching = False  # the handler reads the rest; the body's end starts the watch again
                    return

    def shut(self, deadline: float) -> None:
        """The daemon stops: the handler's scope ends by ``deadline`` at the latest."""
        self.stopped = True
        self.scope.deadline = min(self.scope.deadline, deadline)

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def _left(self) -> None:
        self.gone = True
        self.scope.cancel()
        self._wake()

    def _ended(self) -> None:
        """The server ended the exchange after the response (:meth:`send`): nothing to cancel."""
        self.gone = True
        self._wake()

    async def send(self, message: dict[str, Any]) -> None:
        """The handler's ASGI send (``open_request(receive, send)``).

        The response's last message ends the exchange, and hypercorn ends it
        inside this very call, in this task: it queues ``http.disconnect`` for
        the app (the watcher takes it at once), then closes the connection
        (``Connection: close``, HTTP/1.0) or starts its keep-alive timer. Were
        that disconnect taken for the client leaving, the cancelled scope would
        cancel hypercorn's own close at its next checkpoint, and the socket would
        stay open until the client closed it: a client reading to EOF would hang.
        So the exchange counts as answered before the message goes out."""
        if self._send is None:
            raise RuntimeError("open_request(receive) was given no send")
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            self.responded = True
        await self._send(message)

    async def receive(self) -> dict[str, Any]:
        while True:
            if self._pending:
                await trio.lowlevel.checkpoint()
                return self._pending.popleft()
            if self.gone:
                await trio.lowlevel.checkpoint()
                return {"type": "http.disconnect"}
            if not self._watching:
                break
            await self._changed.wait()  # the watcher reads: the next message comes through it
        message = await self._receive()
        if message["type"] == "http.disconnect":
            self._left()
        elif message["type"] == "http.request" and not message.get("more_body", False):
            self._watch()  # the body is read: watch for the client leaving from here on
        return message


@asynccontextmanager
async def open_request(receive: Receive, send: Send | None = None) -> AsyncIterator[Request]:
    """Run the block as one HTTP request's handler (:class:`Request`): it is
    cancelled (and the block exits quietly) when the client disconnects before
    the response's end went out through ``request.send``, and at the latest
    ``CANCEL_AFTER_S`` after the daemon began to stop (``request.stopped``: the
    caller answers 503 ``server_shutting_down``).

    Raises:
        whatever the block raised (not wrapped in an exception group).

    Cancellation: the watcher task ends with the block. When an outer scope is
    cancelled while the block raises, the block's exception comes out alone: the
    watcher's ``Cancelled`` beside it is dropped, and the next checkpoint raises
    the outer cancel again (an exception group here was logged by hypercorn as a
    traceback).
    """
    try:
        async with trio.open_nursery() as nursery:
            request = Request(receive, nursery, send)
            stopping = _stopping()
            if stopping is not None:
                stopping.opened(request)
            request._watch()
            try:
                with request.scope:
                    yield request
            finally:
                nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        failures = leaves(group)
        errors = [exc for exc in failures if not isinstance(exc, trio.Cancelled)]
        if len(errors) == 1:
            failures = errors  # the block's own, beside the watcher's Cancelled from an outer cancel
        if len(failures) > 1:
            raise
        raise failures[0] from None  # noqa: ASYNC123 - the block's own exception; the group is the watcher's nursery


def note_job(model: str, job: Job) -> None:
    """The current exchange serves ``job`` of ``model`` (its access line reports it)."""
    ex = _CURRENT.get()
    if ex is not None and all(j is not job for _m, j in ex.jobs):
        ex.jobs.append((model, job))


def fail(exc: ApiError) -> None:
    """A stream of the current exchange ended with ``exc`` (after its head went out)."""
    ex = _CURRENT.get()
    if ex is not None:
        ex.error = exc.code or str(exc.status)


def _stopped() -> ApiError:
    exc = shutting_down()
    fail(exc)
    return exc


def _stopping() -> Stopping | None:
    ex = _CURRENT.get()
    return ex.stopping if ex is not None else None


async def wait_beyond(job: Job, cursor: int) -> None:
    """``job.wait_beyond(cursor)`` for a request.

    Raises:
        ApiError: 503 ``server_shutting_down`` once the daemon is stopping.
    """
    stopping = _stopping()
    if stopping is None:
        await job.wait_beyond(cursor)
        return
    stopping.watch(job)
    while len(job.tokens) <= cursor and not job.done:
        if stopping.started:
            raise _stopped()
        await job.wait_change()


async def wait_started(job: Job) -> None:
    """``job.wait_started()`` for a request.

    Raises:
        ApiError: 503 ``server_shutting_down`` once the daemon is stopping.
    """
    stopping = _stopping()
    if stopping is None:
        await job.wait_started()
        return
    stopping.watch(job)
    while not (job.started or job.done or job.tokens):
        if stopping.started:
            raise _stopped()
        await job.wait_change()


def _fields(ex: Exchange, model: str, job: Job, now: float) -> dict[str, Any]:
    ttft = (job.first_token_at - job.created) * 1000 if job.first_token_at else None
    decode_s = (now - job.first_token_at) if job.first_token_at else 0.0
    prefill_s = (job.first_token_at - (job.admitted_at or job.created)) if job.first_token_at else 0.0
    n = len(job.tokens)
    finish = ex.error or (job.error.code if job.error is not None else None) or job.finish
    return {"qos": job.klass.name.lower(), "model": model, "prompt_tokens": len(job.prompt), "cached_tokens": job.cached,
            "completion_tokens": n, "ttft_ms": None if ttft is None else round(ttft, 1),
            "prefill_tok_s": round((len(job.prompt) - job.cached) / prefill_s, 1) if prefill_s > 0 else 0.0,
            "decode_tok_s": round((n - 1) / decode_s, 1) if decode_s > 0 and n > 1 else 0.0,
            "finish": finish or ("generating" if not job.done else "?"), "session": job.session or None}


def access_line(ex: Exchange, *, level: int = logging.INFO) -> None:
    """Write the exchange's access line(s): one per job it served, or one for the request."""
    now = trio.current_time()
    total = round((now - ex.started) * 1000, 1)
    status = ex.status if ex.status is not None else 0
    head = {"method": ex.method, "path": ex.path, "status": status, "duration_ms": total}
    if not ex.jobs:
        if ex.error:
            head["error"] = ex.error
        log.log(level, "<-- %d %s %s total=%.0fms%s", status, ex.method, ex.path, total,
                f" error={ex.error}" if ex.error else "", extra={"access": head})
        return
    for model, job in ex.jobs:
        f = _fields(ex, model, job, now)
        ttft = "-" if f["ttft_ms"] is None else f"{f['ttft_ms']:.0f}ms"
        log.log(level, "<-- %d %s %s qos=%s model=%s prompt=%d cached=%d completion=%d ttft=%s prefill=%.0f tok/s "
                "decode=%.1f tok/s total=%.0fms finish=%s", status, ex.method, ex.path, f["qos"], model,
                f["prompt_tokens"], f["cached_tokens"], f["completion_tokens"], ttft, f["prefill_tok_s"],
                f["decode_tok_s"], total, f["finish"], extra={"access": {**head, **f}})
