"""Resumable streams and the session routes.

A streamed chat or completion that opts in with ``x-superfluid-resumable:
true`` runs as a *live session*: its reply carries ``x-superfluid-session``,
each SSE event carries ``id: <token cursor>``, and a client disconnect does
not cancel it (it runs on into the log for ``--resume-ttl`` seconds with
nobody following). Routes:

* ``GET /v1/sessions/{id}``: what the log holds (tokens, text, finish).
* ``GET /v1/sessions/{id}/stream`` with ``Last-Event-ID: N`` (or ``?after=N``):
  replay from token ``N`` and follow live; ``[DONE]`` when it ends.
* ``DELETE /v1/sessions/{id}/generation``: stop it (409 if none is running).

The cursor is the number of committed tokens consumed; text is rebuilt by
feeding the first ``N`` token pieces through a fresh stop-string filter, so a
resumed stream continues byte for byte where the first one stopped.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs

import trio

from ..chat import document_schema
from ..proto import encode_sse_json
from ._lane import Follower, open_lane, usage_of, wait_admitted
from ._lifecycle import note_job
from ._http import ApiError, Receive, Send, header, send_json
from ._sse import SseResponse
from ._tenancy import public_id, resolve

if TYPE_CHECKING:
    from ..serving import ServedModel
    from ..sessions._resumable import LiveSession
    from ..sched import Job
    from ._host import App

__all__ = ["cancel_generation", "delete_generation", "follower_at", "get_session", "live_session", "run_resumable",
           "session_info", "stream_live", "stream_session"]


def follower_at(session: LiveSession, cursor: int) -> Follower:
    """A follower positioned after ``cursor`` tokens, its stop filter primed. A session
    streams text, never parsed calls: a cut ``response_format`` document is closed."""
    follower = Follower(session.job, session.stops, document=document_schema(session.job.sampling.grammar))
    for piece in session.job.pieces[:cursor]:
        follower.text.feed(piece)
    follower.cursor = cursor
    return follower


async def stream_live(send: Send, session: LiveSession, follower: Follower, *, model: str, rid: str,
                      first: bool) -> None:
    """Stream a live session as OpenAI chunks with ``id:`` cursors; the caller sent no headers yet."""
    job = session.job
    chat = session.kind == "chat"
    created = int(time.time())
    obj_name = "chat.completion.chunk" if chat else "text_completion"

    def chunk(text: str | None, finish: str | None, *, role: bool = False, usage: bool = False) -> dict[str, Any]:
        if chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            if text:
                delta["content"] = text
            choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
        obj: dict[str, Any] = {"id": rid, "object": obj_name, "created": created, "model": model,
                               "system_fingerprint": "superfluid", "choices": [choice]}
        if usage:
            obj["usage"] = usage_of(job)
        return obj

    sse = SseResponse(send)
    await sse.start([(b"x-superfluid-session", public_id(session.id).encode())])
    session.attach()
    try:
        if first and chat:
            await sse.send(encode_sse_json(chunk(None, None, role=True), id=str(follower.cursor)))
        while True:
            try:
                text, _rows, done = await follower.next_delta()
            except ApiError as exc:
                await sse.fail(exc)
                return
            if text:
                await sse.send(encode_sse_json(chunk(text, None), id=str(follower.cursor)))
            if done:
                break
        await sse.end(encode_sse_json(chunk(None, follower.finish, usage=True), id=str(follower.cursor)))
    finally:
        session.detach()


async def run_resumable(app: App, model: ServedModel, job: Job, *, kind: str, stops: list[str], receive: Receive,
                        send: Send) -> None:
    """Serve a streamed request as a resumable session: a disconnect stops only
    this follower; the generation runs on into the log (``--resume-ttl``).

    Only once the client has its session id (the response's head and first
    event went out): a client gone before that could never resume, so its
    generation is cancelled as a plain request's is."""
    async with open_lane(app, model, job, kind=kind, stops=stops, resumable=True) as lane:
        session = lane.session

        async def tracked(message: dict[str, Any]) -> None:
            await send(message)
            if message["type"] == "http.response.body":  # the head goes out with it
                lane.keep = True

        # a disconnect cancels the request's scope (api/_lifecycle.py); the lane then keeps the job if lane.keep
        await wait_admitted(job)
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        await stream_live(tracked, session, follower_at(session, 0), model=model.name,
                          rid=f"{prefix}-superfluid-{session.id}", first=True)


def not_found(sid: str) -> ApiError:
    """What every route answers for a session the caller's tenant does not own (or nobody does)."""
    return ApiError(404, f"session '{sid}' not found", code="session_not_found")


def live_session(app: App, scope: dict[str, Any], sid: str) -> LiveSession:
    """The live session the scope's tenant calls ``sid``. Raises ApiError 404 ``session_not_found``."""
    own = resolve(app, scope, sid)
    session = app.sessions.lookup(own) if own is not None else None
    if session is None:
        raise not_found(sid)
    return session


async def stream_session(app: App, scope: dict[str, Any], receive: Receive, send: Send, sid: str) -> None:
    session = live_session(app, scope, sid)
    raw = header(scope, "last-event-id")
    if raw is None:
        raw = (parse_qs(scope.get("query_string", b"").decode()).get("after") or ["0"])[0]
    try:
        cursor = int(raw)
    except ValueError:
        raise ApiError(400, f"invalid Last-Event-ID / after: {raw!r}", param="after") from None
    if not 0 <= cursor <= len(session.job.tokens):
        raise ApiError(400, f"cursor {cursor} is outside the session's {len(session.job.tokens)} tokens",
                       param="after")
    follower = follower_at(session, cursor)
    note_job(session.model, session.job)
    # a follower leaving cancels only this request (api/_lifecycle.py), never the generation
    await stream_live(send, session, follower, model=session.model, rid=f"sess-{sid}", first=cursor == 0)


def session_info(app: App, scope: dict[str, Any], sid: str) -> dict[str, Any]:
    """What ``GET /v1/sessions/{id}`` (and the WebSocket ``get``) reports.

    Raises:
        ApiError: 404 ``session_not_found``.
    """
    own = resolve(app, scope, sid)
    if own is None:
        raise not_found(sid)
    live = app.sessions.live.get(own)
    slog = app.sessions.journal.sessions.get(own)
    if live is not None:
        job = live.job
        text = b"".join(job.pieces).decode("utf-8", "replace")
        return {"id": sid, "object": "session", "model": live.model, "generating": not job.done,
                "prompt_tokens": len(job.prompt), "completion_tokens": len(job.tokens), "text": text,
                "finish_reason": job.finish, "followers": live.attached}
    assert slog is not None
    return {"id": sid, "object": "session", "model": (slog.created or {}).get("model"), "generating": False,
            "prompt_tokens": len(slog.prompt_tokens), "completion_tokens": len(slog.generated_tokens),
            "text": slog.text, "finish_reason": slog.finish, "followers": 0}


async def get_session(app: App, scope: dict[str, Any], send: Send, sid: str) -> None:
    await send_json(send, 200, session_info(app, scope, sid))


async def cancel_generation(app: App, scope: dict[str, Any], sid: str) -> None:
    """Stop a live session's generation (``DELETE …/generation``, WebSocket ``cancel``).

    Raises:
        ApiError: 404 ``session_not_found``; 409 ``no_generation`` if it is not generating.
    """
    job = live_session(app, scope, sid).job
    if job.done:
        raise ApiError(409, f"session '{sid}' has no generation in flight", code="no_generation")
    if job.scheduler is not None:
        job.scheduler.stop(job)  # a request that never waits (a gone model's close ended the job already)
    await trio.lowlevel.checkpoint()


async def delete_generation(app: App, scope: dict[str, Any], send: Send, sid: str) -> None:
    await cancel_generation(app, scope, sid)
    await send_json(send, 200, {"id": sid, "object": "session.generation", "cancelled": True})
