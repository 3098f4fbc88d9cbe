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
task (it lands the reply) reads on, unaware.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

import attrs
import trio

from ._http import ApiError

if TYPE_CHECKING:
    from ..sched import Job

__all__ = ["Exchange", "Stopping", "access_line", "current_exchange", "detach_exchange", "fail", "note_job",
           "shutting_down", "wait_beyond", "wait_started"]

log = logging.getLogger("superfluid.access")

SHUTTING_DOWN = "server_shutting_down"


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
        self._hooks: dict[int, Callable[[], None]] = {}          # WebSockets' "close for shutdown"
        self._idle = trio.Event()
        self._idle.set()

    def begin(self) -> None:
        """Stop every request-side reader now (each sees ``server_shutting_down``
        at its next wait) and ask open WebSockets to close."""
        self.started = True
        for job in list(self._jobs):
            job.publish()  # wakes its readers; the job itself goes on
        for hook in list(self._hooks.values()):
            hook()

    def watch(self, job: Job) -> None:
        self._jobs.add(job)

    def on_begin(self, key: int, hook: Callable[[], None]) -> Callable[[], None]:
        """Run ``hook`` when the shutdown begins (at once if it has). Returns the unregister function."""
        self._hooks[key] = hook
        if self.started:
            hook()
        return lambda: self._hooks.pop(key, None) and None

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


def detach_exchange() -> None:
    """For a task that outlives the request that started it (a turn's owner):
    its waits are not the request's and do not end at shutdown."""
    _CURRENT.set(None)


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
