"""Sessions: every generation runs as a logged session in the journal.

The write-ahead rule: a session's ``Created`` and ``Prompt`` records are
fsynced before it is queued, and each engine round's tokens are fsynced (one
``append_many`` for every lane in the round: group commit) before any reader
sees them. :class:`SessionStore` is the scheduler's committer and the index of
live sessions that clients can resume by id.

After a daemon restart, :meth:`SessionStore.restore` re-admits every session
the log shows as interrupted (its model loaded): generation continues from the
last committed token, into the log, and clients resume it by id.
"""

from __future__ import annotations

import codecs
import logging
import uuid
from typing import TYPE_CHECKING, Any

import attrs
import trio

from ..journal import Journal, SessionStateError
from ..proto import Sampling
from ..proto._wal import body_cancelled, body_created, body_finished, body_generated, body_prompt
from ..sched import Job, QosClass

if TYPE_CHECKING:
    from ..serving import Registry

__all__ = ["LiveSession", "SessionStore"]

END_LOG_S = 5.0   # what a watcher gives the log to record its ended session
log = logging.getLogger("superfluid.sessions")


@attrs.define(eq=False)
class LiveSession:
    """A session whose job is in this daemon: followed by zero or more clients."""

    id: str
    job: Job
    model: str
    kind: str                          # "chat" or "completion"
    stops: list[str]
    resumable: bool
    attached: int = 0
    attach_changed: trio.Event = attrs.field(factory=trio.Event)

    @property
    def tenant(self) -> str:
        return self.job.tenant

    def attach(self) -> None:
        self.attached += 1
        self._changed()

    def detach(self) -> None:
        self.attached -= 1
        self._changed()

    def _changed(self) -> None:
        event, self.attach_changed = self.attach_changed, trio.Event()
        event.set()


class SessionStore:
    def __init__(self, journal: Journal, *, resume_ttl_s: float, max_live: int = 4096) -> None:
        self.journal = journal
        self.resume_ttl_s = resume_ttl_s
        self.max_live = max_live
        # sessions whose job runs here, and ended resumable ones (at most max_live); a plain
        # session whose request retired after its end is dropped (lookup rebuilds it from the
        # log), so this does not hold one entry per request ever served
        self.live: dict[str, LiveSession] = {}
        self._decoders: dict[int, Any] = {}

    # -- opening -----------------------------------------------------------------

    async def open(self, job: Job, *, model: str, kind: str, stops: list[str], resumable: bool) -> LiveSession:
        """Log ``Created`` and ``Prompt`` (fsynced) and index the session."""
        job.session = job.session or "s-" + uuid.uuid4().hex
        params = {**job.sampling.to_dict(), "max_new": job.max_new, "ignore_eos": job.ignore_eos,
                  "stops": list(stops), "kind": kind, "resumable": resumable}
        if job.cache_salt:
            params["cache_salt"] = job.cache_salt
        await self.journal.append_many([
            (job.session, body_created(params=params, klass=job.klass.name.lower(), model=model, tenant=job.tenant)),
            (job.session, body_prompt(tokens=job.prompt)),
        ])
        session = LiveSession(id=job.session, job=job, model=model, kind=kind, stops=list(stops),
                              resumable=resumable)
        self._index(session)
        return session

    def _index(self, session: LiveSession) -> None:
        self.live[session.id] = session
        if len(self.live) > self.max_live:
            for sid in [s for s, ls in self.live.items() if ls.job.done][: len(self.live) - self.max_live]:
                del self.live[sid]

    # -- the scheduler's committer ----------------------------------------------------

    async def commit(self, spans: list[tuple[Job, list[int], list[bytes]]], ended: list[tuple[Job, str]]) -> None:
        """Make these rounds' tokens and finishes durable: one write, one fsync.
        Sessions whose end is already logged (an unload failed them) are skipped."""
        items: list[tuple[str, dict[str, Any]]] = []
        finishing = {job.id: finish for job, finish in ended if finish not in ("cancelled",)}
        for job, tokens, pieces in spans:
            if not job.session or job.log_ended:
                continue
            dec = self._decoders.get(job.id)
            if dec is None:
                dec = self._decoders[job.id] = codecs.getincrementaldecoder("utf-8")(errors="replace")
            finish = finishing.pop(job.id, None)
            text = dec.decode(b"".join(pieces), final=finish is not None)
            items.append((job.session, body_generated(tokens=tokens, text=text, finish=finish)))
            if finish is not None:
                job.log_ended = True
                self._decoders.pop(job.id, None)
        for job, finish in ended:
            if not job.session or job.log_ended:
                continue
            if finish == "cancelled" and job.cancelled:
                items.append((job.session, body_cancelled()))
                job.log_ended = True
                self._decoders.pop(job.id, None)
            elif job.id in finishing:
                dec = self._decoders.pop(job.id, None)
                tail = dec.decode(b"", final=True) if dec is not None else ""
                items.append((job.session, body_generated(tokens=[], text=tail, finish=finish)))
                job.log_ended = True
        if items:
            await self.journal.append_many(items)
        else:
            await trio.lowlevel.checkpoint()

    async def end(self, job: Job) -> None:
        """Record how a session ended if the scheduler did not (cancel, error).
        A plain (not resumable) session is no longer indexed once its request is
        over: a later lookup reads it from the log. Resumable ones stay (up to
        ``max_live``): a client resuming mid-span needs their exact pieces."""
        session = self.live.get(job.session)
        if session is not None and session.job is job and not session.resumable and session.attached <= 0:
            del self.live[job.session]
        if not job.session or job.log_ended:
            await trio.lowlevel.checkpoint_if_cancelled()
            return
        job.log_ended = True
        self._decoders.pop(job.id, None)
        if job.error is not None:
            body = body_finished(finish="error", error={"message": job.error.message, "code": job.error.code})
        elif job.finish == "cancelled" or not job.done:
            body = body_cancelled()
        else:
            body = body_finished(finish=job.finish or "stop")
        try:
            await self.journal.append(job.session, body)
        except SessionStateError:
            await trio.lowlevel.checkpoint_if_cancelled()  # the log already shows it ended

    # -- after a restart --------------------------------------------------------------

    def models_to_resume(self) -> set[str]:
        """The models of the resumable sessions the log shows as interrupted (a fleet head
        waits for their nodes before :meth:`restore`)."""
        return {str((slog.created or {}).get("model", "")) for slog in self.journal.interrupted()
                if ((slog.created or {}).get("params") or {}).get("resumable")}

    async def restore(self, registry: Registry) -> list[LiveSession]:
        """Re-admit the resumable sessions the log shows as interrupted. Returns them.

        A session that did not opt in (``x-superfluid-resumable``) lost its only
        client with the daemon, and without the opt-in a disconnect cancels: it is
        logged ``cancelled`` (its committed events still replay by id). Re-running
        it would also be unwelcome work beside the requests of the restarted
        daemon: a greedy resend must decode as alone as it did before the crash.
        """
        restored = []
        for slog in self.journal.interrupted():
            created = slog.created or {}
            if not (created.get("params") or {}).get("resumable"):
                try:
                    await self.journal.append(slog.session, body_cancelled())
                except SessionStateError:
                    pass  # the log already shows it ended
                continue
            model = registry.loaded.get(created.get("model", ""))
            if model is None or not slog.prompt_tokens:
                continue
            session = self._from_log(slog)
            job = session.job
            self._decoders[job.id] = codecs.getincrementaldecoder("utf-8")(errors="replace")
            if len(job.tokens) >= job.max_new:
                job.finish_with("length")   # it had produced everything; only its end went unlogged
                continue
            await model.scheduler.queue(job)
            restored.append(session)
            log.info("session %s resumed after restart at token %d", slog.session, len(job.tokens))
        await trio.lowlevel.checkpoint_if_cancelled()
        return restored

    def lookup(self, sid: str) -> LiveSession | None:
        """A live session, or a finished one rebuilt from the log (so a client can
        replay it from any cursor after a restart)."""
        session = self.live.get(sid)
        if session is not None:
            return session
        slog = self.journal.sessions.get(sid)
        if slog is None or not slog.done or not slog.prompt_tokens:
            return None
        session = self._from_log(slog)
        session.job.finish_with(slog.finish or "stop")
        session.job.log_ended = True
        return session

    def _from_log(self, slog: Any) -> LiveSession:
        created = slog.created or {}
        params = dict(created.get("params") or {})
        sampling_keys = {f.name for f in attrs.fields(Sampling)}
        sampling = Sampling(**{k: v for k, v in params.items() if k in sampling_keys})
        job = Job(prompt=list(slog.prompt_tokens), sampling=sampling, max_new=int(params.get("max_new", 256)),
                  klass=QosClass[str(created.get("klass", "agent")).upper()],
                  ignore_eos=bool(params.get("ignore_eos", False)), session=slog.session,
                  tenant=slog.tenant, cache_salt=str(params.get("cache_salt", "")), created=trio.current_time(),
                  stops=tuple(s for s in params.get("stops") or () if s))
        job.tokens = list(slog.generated_tokens)
        job.pieces = _pieces(slog)
        job.started = True
        session = LiveSession(id=slog.session, job=job, model=str(created.get("model", "")),
                              kind=str(params.get("kind", "chat")), stops=list(params.get("stops") or []),
                              resumable=True)
        self._index(session)
        return session


def _pieces(slog: Any) -> list[bytes]:
    """Per-token bytes rebuilt from the logged spans: each span's text goes on
    its last token (the concatenation is exact)."""
    pieces: list[bytes] = []
    for rec in slog.events:
        body = rec.body
        if body.get("type") != "generated":
            continue
        toks = body.get("tokens") or []
        text = (body.get("text") or "").encode()
        if toks:
            pieces += [b""] * (len(toks) - 1) + [text]
        elif text and pieces:
            pieces[-1] += text
    return pieces


async def serve_resume_ttl(store: SessionStore, session: LiveSession) -> None:
    """Stop a resumable generation that no client follows for ``resume_ttl_s``.

    Waits for its job to end or a client to attach (under ``move_on_after(ttl)``
    while nobody follows), and returns as soon as the job ended: it holds
    nothing of the session after that. Owned by the model's sessions
    sub-nursery (``ModelActor.start_session``): unloading the model ends it,
    and a failure in it is contained there (logged, the job stopped).
    """
    while not session.job.done:
        if session.attached > 0:
            await _attach_changed_or_ended(session)
            continue
        with trio.move_on_after(store.resume_ttl_s) as scope:
            await _attach_changed_or_ended(session)
        job = session.job
        if scope.cancelled_caught and session.attached == 0 and not job.done:
            log.info("session %s: nobody followed it for %.0fs; cancelling", session.id, store.resume_ttl_s)
            if job.scheduler is not None:
                job.scheduler.stop(job)  # never waits (a gone model's close ended the job already)
            break
    if session.job.done and not session.job.log_ended:
        # its handler is long gone: the log must show how it ended (an unload, a crash loop),
        # or every restart re-admits a request that already failed
        with trio.move_on_after(END_LOG_S, shield=True):
            await store.end(session.job)
    await trio.lowlevel.checkpoint_if_cancelled()


async def _attach_changed_or_ended(session: LiveSession) -> None:
    """Wait until a client attaches or detaches, or the session's job ends."""
    async with trio.open_nursery() as nursery:
        async def first(wait: Any) -> None:
            await wait()
            nursery.cancel_scope.cancel()

        nursery.start_soon(first, session.attach_changed.wait)
        nursery.start_soon(first, session.job.ended.wait)
