"""Turns of a conversation: start one, own it until its reply lands, follow it.

A turn renders the conversation (system, tools, every message) with the
model's chat template exactly as ``/v1/chat/completions`` does
(:func:`~superfluid.api._chat.render_chat`), and runs as an ordinary
resumable generation session: ``Created`` and ``Prompt`` logged before it is
queued, tokens logged before anyone sees them, followed by token cursor.

Ownership: the turn's *owner* task (:func:`serve_turn`) runs in its model's
sessions sub-nursery (``ModelActor.start_session``), not in a request, so a
client leaving never cancels it (nor does ``--resume-ttl``: the conversation
keeps the reply, so the turn runs to its end); unloading the model ends the
generation typed, the owner lands that error, and the sub-nursery ends with it.
The owner is started *before* the turn is logged and handed the turn once it
is: a model that is not running refuses the turn typed (503) with nothing
logged, and a turn that is logged always has an owner, or its error is landed
by :func:`start_turn` (an unload that raced it): the conversation is never
left generating with nobody to land its reply. The owner reads the generation as the chat route does (a
:class:`~superfluid.api._chat.Reply`: content, reasoning, tool calls) and
lands it in the conversation. ``DELETE …/generation`` stops it; what it had
said lands with ``finish: "cancelled"``. A daemon restart resumes the
generation (``SessionStore.restore``) and :func:`restore_turns` gives each
open turn a new owner, so the reply still lands.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import attrs
import trio

from ..sessions._conversations import Turn, size_of
from ..chat import ToolCall
from ..proto import encode_sse_json
from ..sched import QosClass, Unavailable, parse_qos
from ._lane import Follower, admit, check_log, enqueue, open_session, prepare, reserve, retire
from ._http import ApiError, Receive, Send, send_json
from ._lifecycle import note_job, wait_beyond
from ._chat import (
    ChatRequest, Reply, max_tokens_from, openai_call, openai_delta, parse_tool_choice, parse_tools, qos_of,
    render_chat, require_grammar, usage_of,
)
from ._params import sampling_from, stops_from
from ._principal import current_principal, principal_of
from ._sse import SseResponse
from ._tenancy import Partition, public_id

if TYPE_CHECKING:
    from ..sched import Job, Scheduler
    from ..serving import ServedModel
    from ..sessions._conversations import ConversationStore
    from ._admission import Claim
    from ._host import App

__all__ = ["SAMPLING_FIELDS", "assistant_message", "busy_error", "check_quota", "check_room", "check_sampling", "conversation_log", "landed_summary",
           "load_turn", "open_turns", "restore_turns", "send_turn", "serve_turn", "start_turn", "stream_turn",
           "turn_reader"]

log = logging.getLogger("superfluid.conversations")

# The request fields a conversation's ``sampling`` holds and ``generate`` may override.
SAMPLING_FIELDS = frozenset({
    "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "max_completion_tokens", "stop",
    "repeat_penalty", "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias", "ignore_eos",
})
GENERATE_FIELDS = SAMPLING_FIELDS | {"stream", "stream_options", "qos", "tool_choice"}
CLEANUP_S = 5.0      # bound on the shielded landing of a finished turn
LAND_WAIT_S = 30.0   # a reader waits this long for the owner to land the reply


def check_sampling(model: ServedModel, fields: dict[str, Any], prefix: str = "") -> None:
    """Validate request fields as the chat route would.

    Raises:
        ApiError: 400 naming ``prefix + field``.
    """
    try:
        sampling_from(fields, n_vocab=int(model.info.get("n_vocab", 1 << 30)))
        max_tokens_from(fields)
        stops_from(fields)
        if not isinstance(fields.get("ignore_eos", False), bool):
            raise ApiError(400, "invalid request: ignore_eos must be a boolean", param="ignore_eos")
    except ApiError as exc:
        if not prefix or exc.param is None:
            raise
        named = prefix + exc.param
        raise attrs.evolve(exc, message=exc.message.replace(exc.param, named, 1), param=named) from None


def check_room(app: App, cid: str | None, messages: list[dict[str, Any]], *, header: dict[str, Any] | None = None,
               events: int = 0) -> None:
    """Refuse what would take conversation ``cid`` (None: a new one with
    ``header``) past its limits: ``messages`` and ``events`` more events.

    Raises:
        ApiError: 413 ``message_too_large`` or ``conversation_too_large``, naming the limit.
    """
    cfg, store = app.config, app.conversations
    sizes = [size_of(m) for m in messages]
    head = size_of(header) if header is not None else 0
    for param, n in ((("system", head),) if header is not None else ()) + tuple(
            (f"messages[{i}]", n) for i, n in enumerate(sizes)):
        if n > cfg.max_message_bytes:
            raise ApiError(413, f"{param} takes {n} bytes; the limit is {cfg.max_message_bytes} "
                           "(--max-message-bytes)", code="message_too_large", param=param)
    check_quota(app, conversations=int(cid is None), nbytes=head + sum(sizes))
    held = store.size(cid) if cid is not None else head
    count = (store.get(cid).event_count if cid is not None else 1) + len(messages) + events  # type: ignore[union-attr]
    if count > cfg.max_conversation_events:
        raise ApiError(413, f"the conversation would hold {count} events; the limit is "
                       f"{cfg.max_conversation_events} (--max-conversation-events)", code="conversation_too_large")
    if held + sum(sizes) > cfg.max_conversation_bytes:
        raise ApiError(413, f"the conversation would hold {held + sum(sizes)} bytes; the limit is "
                       f"{cfg.max_conversation_bytes} (--max-conversation-bytes)", code="conversation_too_large")


def check_quota(app: App, *, conversations: int = 0, nbytes: int = 0) -> None:
    """Refuse what would take the calling key's tenant past its storage quota
    (``--key-policy`` ``max_conversations``, ``max_stored_bytes``; SPEC.md §10).
    A turn asks with nothing: a tenant already at its byte quota starts none.

    Raises:
        ApiError: 429 ``conversation_quota_exceeded``; 413 ``storage_quota_exceeded``.
    """
    principal = current_principal()
    key = principal.key
    if key is None or not (key.max_conversations or key.max_stored_bytes):
        return
    count, held = app.conversations.usage(principal.tenant)
    if key.max_conversations and count + conversations > key.max_conversations:
        raise ApiError(429, f"this API key keeps {count} conversations, its quota (max_conversations "
                            f"{key.max_conversations}); delete some or let them expire", code="conversation_quota_exceeded",
                       type="rate_limit_error")
    if key.max_stored_bytes and (held + nbytes > key.max_stored_bytes or held >= key.max_stored_bytes):
        raise ApiError(413, f"this API key's conversations would take {held + nbytes} bytes; its quota is "
                            f"{key.max_stored_bytes} (max_stored_bytes)", code="storage_quota_exceeded")


def _request(model: ServedModel, header: dict[str, Any], messages: list[dict[str, Any]],
             params: dict[str, Any]) -> ChatRequest:
    """The chat request of a turn: the conversation so far and the turn's fields."""
    fields = params["sampling"]
    tools = parse_tools(header["tools"])
    shown = [{"role": "system", "content": header["system"]}] if header["system"] else []
    shown += [{**m, "content": m.get("content") or ""} for m in messages]
    return ChatRequest(
        messages=shown, sampling=sampling_from(fields, n_vocab=int(model.info.get("n_vocab", 1 << 30))),
        max_tokens=max_tokens_from(fields), tools=tools, choice=parse_tool_choice(params.get("tool_choice"), tools),
        template_kwargs=dict(header["template_kwargs"]), stops=stops_from(fields),
        ignore_eos=bool(fields.get("ignore_eos", False)))


def _klass(app: App, scope: dict[str, Any], body: dict[str, Any]) -> QosClass:
    """The turn's class: its ``qos`` field, as the ``x-superfluid-qos`` header is read
    (ignored under ``--no-http-qos-header``, above the key's ``max_class`` a 403)."""
    qos = body.get("qos")
    if qos is None:
        return qos_of(app, scope)
    if not isinstance(qos, str):
        raise ApiError(400, "invalid request: qos must be a string", param="qos")
    try:
        asked = parse_qos(qos)
    except ValueError as exc:
        raise ApiError(400, str(exc), param="qos") from None
    if not app.config.http_qos_header:
        return qos_of(app, scope)
    return principal_of(scope).qos(asked, app.config.default_qos)


def conversation_log(app: App, cid: str) -> Any:
    """Raises ApiError 404 ``session_not_found`` unless ``cid`` is a conversation."""
    slog = app.conversations.get(cid)
    if slog is None:
        raise ApiError(404, f"conversation '{public_id(cid)}' not found", code="session_not_found")
    return slog


def busy_error(cid: str) -> ApiError:
    return ApiError(409, f"conversation '{public_id(cid)}' is generating; wait for its reply or stop it "
                    f"(DELETE /v1/sessions/{public_id(cid)}/generation)", code="session_busy")


async def start_turn(app: App, scope: dict[str, Any], cid: str, body: dict[str, Any]) -> Turn:
    """Render the conversation, start the turn's owner, log the turn and its generation,
    hand the turn to its owner, and queue it.

    Raises:
        ApiError: 404 unknown conversation; 409 ``session_busy`` if a turn is
            open or starting; 400 a bad field or a template refusal (naming
            ``param``); 503 draining, no worker, or the model's actor is not
            running (nothing logged), or it went away while the turn was logged
            (the turn's error landed); whatever ``prepare`` raises.

    Cancellation: cancelled before the ``turn`` event is logged, nothing
    changes; after it and before the turn is handed to its owner, the turn is
    ended (``turn_end``, shielded); after that its owner has it, and the job
    is stopped (the owner lands what it said).

    Resource handling: the turn's owner task (:func:`serve_turn`) runs in
    the model's sessions sub-nursery and outlives this call.
    """
    store = app.conversations
    conversation_log(app, cid)
    for key in body:
        if key not in GENERATE_FIELDS:
            raise ApiError(400, f"invalid request: unknown field {key!r}", param=key)
    if not app.accepting:
        raise ApiError(503, "the server is draining and accepts no new requests", code="draining")
    check_log(app)  # before the turn is logged: a full disk refuses it typed (507)
    if store.busy(cid):
        raise busy_error(cid)
    async with store.preparing(cid):
        conversation_log(app, cid)  # (compaction may have dropped an idle one meanwhile)
        check_room(app, cid, [], events=2)  # its ``turn`` and its end
        state = store.fold(cid)
        if not state.messages:
            raise ApiError(400, "invalid request: the conversation has no messages yet", param="messages")
        model = await app.resolve_model(state.header["model"])
        default_qos = store.meta(cid)["qos"]  # the conversation's own class (PATCH qos), if set
        klass = _klass(app, scope, body if body.get("qos") is not None or default_qos is None
                       else {**body, "qos": default_qos})
        fields = {k: v for k, v in body.items() if k in SAMPLING_FIELDS}
        check_sampling(model, fields)
        params = {"sampling": {**state.header["sampling"], **fields}, "tool_choice": body.get("tool_choice"),
                  "qos": klass.name.lower()}
        req = _request(model, state.header, [m for _eid, m in state.messages], params)
        rendered = render_chat(model, req)
        sampling = req.sampling
        if rendered.grammar:
            require_grammar(model, "tool_choice" if req.choice.forced else req.grammar_param)
            sampling = attrs.evolve(sampling, grammar=rendered.grammar)
        job = await prepare(model, rendered.segments, sampling=sampling, max_tokens=req.max_tokens, klass=klass,
                            partition=Partition(tenant=state.header.get("tenant", "")), ignore_eos=req.ignore_eos)
        job.session = "s-" + uuid.uuid4().hex
        turn = Turn(conversation=cid, generation=job.session, model=model, stops=[*req.stops, *rendered.stops],
                    parser=rendered.parser)
        # as _lane.open_lane, without the --resume-ttl watcher: the turn's owner holds it to its end
        sched = model.place(len(job.prompt) + 1, job)
        with admit(app, job) as claim:  # the key's slot, held until the turn's generation ends
            await _start(app, store, sched, model, job, turn, params, claim)
    return turn


async def _start(app: App, store: ConversationStore, sched: Scheduler, model: ServedModel, job: Job, turn: Turn,
                 params: dict[str, Any], claim: Claim) -> None:
    """:func:`start_turn` from the queue place on: reserve, start the owner, log, hand over, queue."""
    await reserve(sched, job)  # 429 before the turn is logged
    try:
        hand, handed = trio.open_memory_channel[Turn](1)
        try:  # the owner first: a turn in the log always has one
            model.actor.start_session(_own_turn, app, handed, job=job)
        except Unavailable as exc:
            raise ApiError(503, str(exc), code=exc.code) from None  # nothing logged
        with hand:  # closed without a turn: the owner has nothing to own
            await store.begin(turn, params)
            gone: ApiError | None = None
            try:
                turn.open(await open_session(app, job, model=model.name, kind="chat", stops=turn.stops,
                                             resumable=True))
                hand.send_nowait(turn)
            except trio.BrokenResourceError:  # the owner ended: the model went away (an unload raced us)
                closed = sched.closed
                gone = (ApiError.of_job(closed) if closed is not None else
                        ApiError(503, f"model '{model.name}' went away", code="model_unloaded"))
            except BaseException:
                with trio.move_on_after(CLEANUP_S, shield=True):
                    await store.land(turn, None, "error", {"message": "the turn's generation could not be logged"})
                raise
            if gone is not None:  # nobody owns the logged turn: it ends here, typed
                with trio.move_on_after(CLEANUP_S, shield=True):
                    await store.land(turn, None, "error", _error_body(gone))
                raise gone
        await enqueue(sched, job, claim)
        note_job(model.name, job)
    except BaseException:
        # gives the place back (or stops the queued job: its owner lands it); retire's
        # stop never waits and its logging is shielded and bounded itself
        await retire(app, sched, job)  # noqa: ASYNC102
        raise


def _error_body(exc: ApiError) -> dict[str, Any]:
    """A turn's error as its ``turn_end`` logs it."""
    return {"message": exc.message, "code": exc.code, "status": exc.status, "type": exc.error_type}


async def _own_turn(app: App, handed: trio.MemoryReceiveChannel[Turn]) -> None:
    """A turn's owner from before the turn is logged: serve the turn :func:`start_turn`
    hands over once it is (none: it was not logged, there is nothing to own)."""
    with handed:
        try:
            turn = await handed.receive()
        except trio.EndOfChannel:
            return
    await serve_turn(app, turn)


def assistant_message(content: str, reasoning: str, calls: list[ToolCall]) -> dict[str, Any] | None:
    """The reply as an OpenAI assistant message (None when it said nothing)."""
    if not (content or reasoning or calls):
        return None
    message: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None}
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = [{k: v for k, v in openai_call(c, i).items() if k != "index"}
                                 for i, c in enumerate(calls)]
    return message


async def serve_turn(app: App, turn: Turn) -> None:
    """Own a turn: read its generation to the end and land the reply in the conversation.

    A failure here (a bug, or the journal refusing the write) is logged and
    ends only this turn's owner: the log then still shows the turn open, and
    the next start lands it.

    Cancellation: cancelled (daemon shutdown) before the generation ended,
    it lands nothing: the log still shows the turn open and the generation
    unfinished, and the next start resumes both. Once the reply is read,
    landing it is shielded (bounded by ``CLEANUP_S``).
    """
    assert turn.session is not None
    job = turn.session.job
    try:
        message, finish, error = await _read_reply(turn)
        with trio.move_on_after(CLEANUP_S, shield=True):
            await app.conversations.land(turn, message, finish, error)
    except Exception:  # noqa: BLE001 -- boundary: one turn; the daemon goes on
        log.exception("conversation %s: turn %d failed to land", turn.conversation, turn.event_id)
    finally:
        # log how the generation ended if nobody did (shielded and bounded inside retire)
        await retire(app, job.scheduler, job, keep=True)  # noqa: ASYNC102


async def _read_reply(turn: Turn) -> tuple[dict[str, Any] | None, str, dict[str, Any] | None]:
    """Read the turn's generation as the chat route does: ``(message, finish, error)``."""
    assert turn.session is not None
    job = turn.session.job
    reply = Reply(turn.model, job, Follower(job, turn.stops), turn.reader())  # type: ignore[arg-type]
    try:
        content, reasoning, _rows = await reply.collect()
    except ApiError as exc:
        return None, "error", _error_body(exc)
    if not job.done and job.scheduler is not None:
        job.scheduler.stop(job)  # a stop string ended the reply before the generation did
    return assistant_message(content, reasoning, reply.calls), reply.finish or "stop", None


def open_turns(app: App) -> dict[tuple[str, int], str]:
    """After a restart: the turns the log shows open, ``(conversation, turn)`` to the
    generation session each holds (the daemon starts no ``--resume-ttl`` watcher for
    those: :func:`restore_turns` gives each an owner)."""
    return {(cid, slog.open_turn): app.conversations.fold(cid).turns[slog.open_turn]["generation"]
            for cid, slog in list(app.sessions.journal.sessions.items())
            if slog.conversation is not None and slog.open_turn >= 0}


async def restore_turns(app: App, turns: Iterable[tuple[str, int]]) -> None:
    """Give each open turn an owner: one short task per turn, in a nursery of this
    call's own, loads its model and hands the turn to that model's sessions
    sub-nursery (its owner runs there). Returns when every turn was handed on, or
    could not be (its error landed, or logged: each task is its own boundary)."""
    async with trio.open_nursery() as restorers:
        for cid, turn_id in turns:
            restorers.start_soon(_resume_turn, app, cid, turn_id)


async def _resume_turn(app: App, cid: str, turn_id: int) -> None:
    try:
        try:
            turn = await load_turn(app, cid, turn_id)
        except ApiError as exc:  # its model cannot load, or its template now refuses the conversation
            await app.conversations.end_turn(cid, turn_id, None, "error",
                                             {"message": f"the turn could not resume after a restart: {exc.message}"})
            return
        if turn is None or turn.landed:
            return
        if turn.session is None:  # the crash came before its generation was logged (or it left the log)
            await app.conversations.land(turn, None, "error", {"message": "the turn could not resume after a restart"})
            return
    except Exception:  # noqa: BLE001 -- boundary: one turn; the daemon goes on
        log.exception("conversation %s: turn %d could not be restored", cid, turn_id)
        return
    log.info("conversation %s: turn %d resumes with generation %s", cid, turn_id, turn.generation)
    try:
        turn.model.actor.start_session(serve_turn, app, turn, job=turn.session.job)
    except Unavailable:  # the model went away meanwhile: the turn stays open in the log
        log.warning("conversation %s: turn %d could not resume: model %s is not running", cid, turn_id,
                    turn.model.name)


async def load_turn(app: App, cid: str, turn_id: int) -> Turn | None:
    """The turn ``turn_id`` of conversation ``cid``, live or rebuilt from the log.

    Returns None if it is not a turn of ``cid``. A rebuilt turn that has
    ended is landed already; one whose generation left the log (or never
    reached it) has ``session`` None.

    Raises:
        ApiError: its model cannot be loaded, or its template refuses the conversation.
    """
    store = app.conversations
    if store.get(cid) is None:
        return None
    state = store.fold(cid)
    spec = state.turns.get(turn_id)
    if spec is None:
        return None
    held = store.turn(spec["generation"])
    if held is not None:
        return held
    model = await app.resolve_model(state.header["model"])
    req = _request(model, state.header, state.messages_before(turn_id), spec["params"])
    rendered = render_chat(model, req)
    session = app.sessions.live.get(spec["generation"]) or app.sessions.lookup(spec["generation"])
    turn = Turn(conversation=cid, event_id=turn_id, generation=spec["generation"], model=model,
                stops=session.stops if session is not None else [*req.stops, *rendered.stops],
                parser=rendered.parser, session=session)
    end_rec = spec["end"]
    if end_rec is not None:
        b = end_rec.body
        turn.mark_landed(end_rec.event_id, b.get("message"), b["finish"], b.get("error"))
    return store.index(turn)


async def landed_summary(turn: Turn) -> dict[str, Any]:
    """What a reader reports when the turn's generation is done: the reply that joined the conversation."""
    with trio.move_on_after(LAND_WAIT_S):
        await turn.wait_landed()
    return {"conversation": public_id(turn.conversation), "turn": turn.event_id, "event": turn.end_event if turn.landed else None,
            "message": turn.message}


def turn_reader(turn: Turn, cursor: int) -> Reply:
    """A reader of the turn's generation after ``cursor`` tokens: its stop filter and parser primed."""
    assert turn.session is not None
    job = turn.session.job
    follower = Follower(job, turn.stops)
    parser = turn.reader()
    parser.feed("".join(follower.text.feed(piece) for piece in job.pieces[:cursor]))
    follower.cursor = cursor
    return Reply(turn.model, job, follower, parser)  # type: ignore[arg-type]


async def stream_turn(send: Send, receive: Receive, turn: Turn, cursor: int) -> None:
    """Stream the turn's generation from ``cursor`` as chat.completion.chunk SSE with ``id:`` cursors.

    The last chunk (``finish_reason``, ``usage``, and ``superfluid``: the
    conversation event the reply landed as) is sent once the reply is in
    the conversation (waiting at most ``LAND_WAIT_S`` for it).

    Raises:
        ApiError: the generation was refused before any token (before the
            response starts); later failures are an SSE error frame.

    Cancellation: a client leaving (or the caller cancelling) stops only
    this reader; the turn goes on.
    """
    assert turn.session is not None
    session, reply = turn.session, turn_reader(turn, cursor)
    rid, created = f"chatcmpl-superfluid-{turn.generation}", int(time.time())
    name = session.model

    def chunk(delta: dict[str, Any], finish: str | None = None, extra: dict[str, Any] | None = None) -> bytes:
        obj = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": name,
               "system_fingerprint": "superfluid",
               "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}], **(extra or {})}
        return encode_sse_json(obj, id=str(reply.follower.cursor))

    if cursor == 0:
        await reply.wait_admitted()  # refused before any token: an HTTP error
    sse = SseResponse(send)
    await sse.start([(b"x-superfluid-session", turn.generation.encode()),
                     (b"x-superfluid-conversation", turn.conversation.encode())])
    session.attach()
    try:
        if cursor == 0:
            await sse.send(chunk({"role": "assistant", "content": ""}))
        n_calls = 0
        try:
            while True:
                events, _rows, done = await reply.next()
                delta, n_calls = openai_delta(events, n_calls)
                if delta:
                    await sse.send(chunk(delta))
                if done:
                    break
            final = chunk({}, reply.finish, {"usage": usage_of(session.job),
                                             "superfluid": await landed_summary(turn)})
        except ApiError as exc:
            await sse.fail(exc)
        else:
            await sse.end(final)
    finally:
        session.detach()


async def send_turn(send: Send, receive: Receive, turn: Turn) -> None:
    """Wait for the turn's reply to land and answer it as one chat.completion.

    Raises:
        ApiError: the turn failed (its error), or its reply was not logged in time.
    """
    assert turn.session is not None
    job = turn.session.job
    # a client that leaves cancels its request scope here; the turn goes on
    while not (job.done or turn.landed):
        await wait_beyond(job, len(job.tokens))  # (server_shutting_down once the daemon stops)
    with trio.move_on_after(LAND_WAIT_S):
        await turn.wait_landed()
    if not turn.landed:
        raise ApiError(500, "the turn's reply could not be added to the conversation", code="journal_error")
    if turn.message is None and isinstance(turn.error, dict):
        err = turn.error
        raise ApiError(int(err.get("status") or 500), str(err.get("message")), code=err.get("code"),
                       type=str(err.get("type") or ""))
    message = turn.message or {"role": "assistant", "content": ""}
    obj = {"id": f"chatcmpl-superfluid-{turn.generation}", "object": "chat.completion", "created": int(time.time()),
           "model": turn.session.model, "system_fingerprint": "superfluid",
           "choices": [{"index": 0, "message": message, "finish_reason": turn.finish, "logprobs": None}],
           "usage": usage_of(job), "superfluid": await landed_summary(turn)}
    await send_json(send, 200, obj, headers=[(b"x-superfluid-session", turn.generation.encode()),
                                             (b"x-superfluid-conversation", turn.conversation.encode())])
