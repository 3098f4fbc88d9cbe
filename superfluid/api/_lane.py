"""The dialect-independent half of a generation request.

``prepare`` turns rendered segments into a :class:`Job`; :func:`open_lane`
is the scope a job runs in (reserved, logged, queued on entry; retired on
exit, whatever the reason); :class:`Follower` turns the job's committed
tokens into client text deltas (stop strings held back). A client that goes
away cancels its request's scope (``api/_lifecycle.open_request``), which
leaves the lane.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AbstractContextManager, asynccontextmanager
from typing import TYPE_CHECKING, Any

import attrs
import trio

from ..sessions._resumable import serve_resume_ttl
from ..chat import TextStream, close_json
from ..journal import JournalWriteError
from ..proto import Sampling
from ..sched import Job, JobError, QosClass, QueueFull, Unavailable
from ._http import ApiError
from ._lifecycle import note_job, wait_beyond, wait_started
from ._principal import current_principal

if TYPE_CHECKING:
    from ..serving import ServedModel
    from ._admission import Claim
    from ..sessions._resumable import LiveSession
    from ..sched import Scheduler
    from ._host import App
    from ._tenancy import Partition

__all__ = ["MAX_PROMPT_BYTES", "PROMPT_BYTES_FLOOR", "PROMPT_BYTES_PER_TOKEN", "Follower", "Lane",
           "admit", "enqueue", "open_lane", "prepare", "prompt_limit", "reserve", "retire", "usage_of", "wait_admitted"]

# The prompt-size limit checked before tokenizing (--max-prompt-bytes 0): no tokenizer we serve
# makes a token of more than a few dozen bytes of text, so a prompt over this many bytes per token
# of the context cannot fit it, and the floor keeps small-context models generous.
PROMPT_BYTES_PER_TOKEN = 64
PROMPT_BYTES_FLOOR = 1 << 20
# The most any setting allows: a Tokenize frame carries the prompt (16 MiB link frames).
MAX_PROMPT_BYTES = 12 << 20
RETIRE_S = 5.0   # bound on the shielded logging of a retired lane's session end (the stop itself never waits)


def prompt_limit(model: ServedModel) -> int:
    """Bytes of rendered prompt ``model`` takes: ``--max-prompt-bytes``, or from its context."""
    configured = model.scheduler.config.max_prompt_bytes
    auto = max(PROMPT_BYTES_FLOOR, PROMPT_BYTES_PER_TOKEN * model.n_ctx)
    return min(configured or auto, MAX_PROMPT_BYTES)


def _check_size(model: ServedModel, segments: list[tuple[str, bool]]) -> None:
    """Refuse a prompt too long to tokenize (413), by its UTF-8 length: cheap
    next to the tokenizer, whose answer for it could take seconds."""
    limit = prompt_limit(model)
    chars = sum(len(text) for text, _special in segments)
    if chars <= limit // 4:  # a character is at most 4 bytes: no need to encode
        return
    size = chars if chars > limit else sum(len(text.encode("utf-8", "surrogatepass")) for text, _ in segments)
    if size > limit:
        raise ApiError(413, f"the prompt is {'at least ' if chars > limit else ''}{size} bytes, over the "
                            f"{limit}-byte limit for model '{model.name}' (--max-prompt-bytes)",
                       code="prompt_too_large", param="messages")


async def tokenize(model: ServedModel, segments: list[tuple[str, bool]], *, add_special: bool,
                   klass: QosClass = QosClass.INTERACTIVE) -> list[int]:
    """The prompt's token ids (a request of ``klass``: the worker tokenizes the most urgent first).

    Raises:
        ApiError: 413 ``prompt_too_large`` (see :func:`prompt_limit`); 503 if no worker can serve.
    """
    _check_size(model, segments)
    try:
        return await model.scheduler.tokenize(segments, add_special=add_special, klass=klass)
    except Unavailable as exc:
        raise ApiError(503, str(exc), code=exc.code) from None


async def prepare(
    model: ServedModel,
    segments: list[tuple[str, bool]],
    *,
    sampling: Sampling,
    max_tokens: int | None,
    klass: QosClass,
    partition: Partition,
    ignore_eos: bool = False,
    add_special: bool = False,
    tokens: list[int] | None = None,
) -> Job:
    """Tokenize, check the window, and build (not yet submit) the job, owned
    by ``partition`` (its tenant and prefix-cache partition). ``tokens`` (the
    caller checked each is in the vocabulary) is the prompt as given, with
    ``segments`` empty: nothing is tokenized and nothing is added.

    Raises:
        ApiError: 400 ``context_length_exceeded``; 503 if no worker can serve.
    """
    prompt = list(tokens) if tokens is not None else await tokenize(model, segments, add_special=add_special,
                                                                     klass=klass)
    if not prompt:
        raise ApiError(400, "invalid request: the prompt is empty after tokenization")
    n_ctx = model.n_ctx
    room = n_ctx - len(prompt)
    if room < 1:
        raise ApiError(
            400, f"prompt of {len(prompt)} tokens exceeds the model's context window of {n_ctx} tokens",
            code="context_length_exceeded", param="messages",
        )
    max_new = room if max_tokens is None else min(max_tokens, room)
    return Job(prompt=prompt, sampling=sampling, max_new=max(1, max_new), klass=klass, ignore_eos=ignore_eos,
               tenant=partition.tenant, cache_salt=partition.cache_salt, created=trio.current_time())


@attrs.define(eq=False)
class Lane:
    """A job inside its request's scope (:func:`open_lane`)."""

    job: Job
    session: LiveSession
    keep: bool = False   # set by the handler: the generation outlives the block (a resumable one, id delivered)


@asynccontextmanager
async def open_lane(app: App, model: ServedModel, job: Job, *, kind: str, stops: list[str],
                    resumable: bool = False) -> AsyncIterator[Lane]:
    """The scope of one generation: reserve its queue place, log the session
    (``Created`` + ``Prompt``, fsynced), queue the job; leaving the block for
    any reason (done, client gone, error, unload) retires it (:func:`retire`):
    the job is stopped unless the handler set ``lane.keep``.

    A resumable session's generation may outlive the block: a watcher in the
    model's sessions sub-nursery, started before the job is queued, stops it
    after ``--resume-ttl`` with no follower (and ends with the job).

    Raises:
        ApiError: 429 ``queue_full`` (nothing logged) when the job's class has
            ``--max-queue`` waiting; 503 when the model is gone (or, for a resumable
            job, its actor is not running to watch it); 507 when the log takes no writes.
    """
    sched = model.place(len(job.prompt) + 1, job)   # (a fleet model: the node placement picks, SPEC.md §14)
    lane: Lane | None = None
    refused = False
    note_job(model.name, job)
    with admit(app, job) as claim:  # 429 concurrency_limit_exceeded: nothing reserved, nothing logged
        try:
            try:
                await reserve(sched, job)
            except ApiError:
                refused = True  # no place was taken: nothing to give back
                raise
            session = await open_session(app, job, model=model.name, kind=kind, stops=stops, resumable=resumable)
            if resumable:
                try:
                    model.actor.start_session(serve_resume_ttl, app.sessions, session, job=job)
                except Unavailable as exc:  # unloaded, or between restarts: nothing would watch it
                    with trio.move_on_after(RETIRE_S, shield=True):
                        try:
                            await app.sessions.end(job)  # logged cancelled: no restart resumes it
                        except JournalWriteError:
                            pass  # the log takes no writes: the next start logs it cancelled
                    raise ApiError(503, str(exc), code=exc.code) from None
            await enqueue(sched, job, claim)
            lane = Lane(job=job, session=session)
            yield lane
        finally:
            if not refused:  # (retire's stop never waits; its logging is shielded and bounded itself)
                await retire(app, sched, job, keep=lane is not None and lane.keep)  # noqa: ASYNC102


def admit(app: App, job: Job) -> AbstractContextManager[Claim]:
    """The one admission point of a generation, on every path (``open_lane``, a
    conversation turn): one of the calling key's ``max_concurrent`` slots,
    held by the block and, once :func:`enqueue` gave the job to the scheduler,
    until the job ends (``api/_admission.py``).

    Raises:
        ApiError: 429 ``concurrency_limit_exceeded``.
    """
    return app.guard.slots.claim(current_principal().key, job)


async def enqueue(sched: Scheduler, job: Job, claim: Claim) -> None:
    """Queue ``job`` (its place reserved): from here its end, however it comes, frees its slot."""
    await sched.queue(job)
    claim.queued = True


async def reserve(sched: Scheduler, job: Job) -> None:
    """A place in ``sched``'s queue for ``job``; then log its session and ``queue`` it.

    Raises:
        ApiError: 429 ``queue_full``; 503 the model is gone.
    """
    try:
        await sched.reserve(job)
    except QueueFull as exc:
        raise ApiError(429, str(exc), code="queue_full", type="rate_limit_error",
                       headers=((b"retry-after", str(exc.retry_after_s).encode()),)) from None
    except Unavailable as exc:
        raise ApiError(503, str(exc), code=exc.code) from None


async def retire(app: App, sched: Scheduler, job: Job, *, keep: bool = False) -> None:
    """The request is over: stop its job unless ``keep`` (its reserved place
    goes back too), and log how the session ended if the scheduler did not.
    It runs on every way out of a lane, cancelled ones too: the stop is a
    request that never waits and is never dropped (``Scheduler.stop``), and
    logging the end is shielded and bounded (``RETIRE_S``)."""
    if not keep and not job.done:  # (a done job holds no lane and no place)
        sched.stop(job)
    with trio.move_on_after(RETIRE_S, shield=True):
        if job.done:
            try:
                await app.sessions.end(job)
            except JournalWriteError:
                pass  # the log takes no writes: it shows the session unfinished (cancelled on the next start)


def check_log(app: App) -> None:
    """Refuse typed while the session log takes no writes (a full disk: 507
    ``insufficient_storage``): nothing is generated that could not be logged.

    Raises:
        ApiError: the journal is degraded.
    """
    try:
        app.sessions.journal.check_writable()
    except JournalWriteError as exc:
        raise log_refusal(exc) from None


def log_refusal(exc: JournalWriteError) -> ApiError:
    """The typed refusal of a request the session log cannot take (507 or 503)."""
    return ApiError.of_job(JobError.log_failed(exc))


async def open_session(app: App, job: Job, **kw: Any) -> LiveSession:
    """``SessionStore.open``, refused typed as :func:`check_log` says. The job
    takes the session's stop strings: its lane ends at the token completing one."""
    job.stops = tuple(s for s in kw.get("stops", ()) if s)
    try:
        return await app.sessions.open(job, **kw)
    except JournalWriteError as exc:
        raise log_refusal(exc) from None


def resumable_requested(scope: dict[str, Any]) -> bool:
    from ._http import header

    return (header(scope, "x-superfluid-resumable") or "").strip().lower() in ("1", "true", "yes", "on")


def usage_of(job: Job) -> dict[str, Any]:
    """A job's OpenAI-shaped ``usage`` (prompt, completion and cached tokens)."""
    n = len(job.tokens)
    return {"prompt_tokens": len(job.prompt), "completion_tokens": n, "total_tokens": len(job.prompt) + n,
            "prompt_tokens_details": {"cached_tokens": job.cached}}


def extras_of(job: Job) -> dict[str, Any]:
    """The ``superfluid`` object of a reply: ``spec`` when the request drafted."""
    if job.spec is None:
        return {}
    proposed, accepted = job.spec
    return {"spec": {"proposed": proposed, "accepted": accepted,
                     "acceptance_rate": round(accepted / proposed, 3) if proposed else 0.0}}


def with_extras(obj: dict[str, Any], job: Job) -> dict[str, Any]:
    extras = extras_of(job)
    if extras:
        obj["superfluid"] = extras
    return obj


async def wait_admitted(job: Job) -> None:
    """Wait until the worker took or refused ``job``.

    Raises:
        ApiError: the job failed before its first token (a refused grammar, a full
            context): an HTTP error, since no response has started yet.
    """
    await wait_started(job)  # (server_shutting_down in a request once the daemon stops)
    if job.error is not None and not job.tokens:
        raise ApiError.of_job(job.error)


class Follower:
    """Reads a job by cursor and yields text deltas. With ``document`` (a JSON
    schema: the reply is a ``response_format`` document), a reply cut by its
    token budget ends with the text that closes the document legally
    (``close_json``, as a forced tool call's arguments get), in the last delta."""

    def __init__(self, job: Job, stops: list[str], *, document: dict[str, Any] | None = None) -> None:
        self.job = job
        self.text = TextStream(stops)
        self.cursor = 0
        self.finish: str | None = None
        self.document = document

    async def next_delta(self) -> tuple[str, list[Any], bool]:
        """Wait for progress. Returns ``(text, logprob rows, done)``; a row is
        ``(piece, [logprob, [[token, piece, logprob], ...]])`` for each new token."""
        job = self.job
        await wait_beyond(job, self.cursor)  # raises server_shutting_down in a request once the daemon stops
        end = len(job.pieces)
        lps = []
        if len(job.logprobs) > self.cursor:
            lps = list(zip(job.pieces[self.cursor :], job.logprobs[self.cursor : len(job.tokens)], strict=False))
        out = [self.text.feed_many(job.pieces[self.cursor : end])]
        self.cursor = end
        if self.text.stopped:
            self.finish = "stop"
            return "".join(out), lps, True
        if job.done:
            if job.error is not None:
                raise ApiError.of_job(job.error)
            out.append(self.text.finish())
            self.finish = job.finish or "stop"
            if self.document is not None and self.finish == "length":
                out.append(close_json(self.text.text, self.document) or "")   # (None: no legal ending)
            return "".join(out), lps, True
        return "".join(out), lps, False
