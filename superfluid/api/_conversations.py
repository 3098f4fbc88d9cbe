"""The conversation routes: server-side chat histories (SPEC.md §7, "Conversations").

* ``POST /v1/sessions`` ``{model, system?, tools?, sampling?, messages?,
  chat_template_kwargs?, id?}``: 201, a new conversation ``c-<hex>``. ``id``
  names it only when keys are configured (the name is the tenant's own:
  ``api/_tenancy.py``; one it already uses is 409 ``session_exists``); with
  no keys it is 400 (ids are server-made).
* ``POST /v1/sessions/{id}/messages`` ``{messages}``: append (validated as
  chat messages); the new event ids. 409 ``session_busy`` while a turn runs.
* ``POST /v1/sessions/{id}/generate`` ``{stream?, qos?, tool_choice?,
  max_tokens?, temperature?…}``: a turn (``api/_turns.py``): SSE chunks with
  ``id:`` cursors, or one chat.completion once the reply has joined the
  conversation; ``x-superfluid-session`` names the generation session.
* ``GET /v1/sessions/{id}/events?after=N&limit=L``: the events after ``N``.
* Limits (``check_room``, before anything is logged): a message over
  ``--max-message-bytes``, or a conversation that would pass
  ``--max-conversation-bytes`` or ``--max-conversation-events``, is 413.
* ``POST /v1/sessions/{id}/fork`` ``{at?, id?}``: 201, a new conversation
  holding the events up to ``at`` (default: all; a turn still running then
  is left out); ``id`` as for create.

Every conversation belongs to the tenant that created it; for any other
tenant its id answers as an unknown one (:func:`own_conversation`).
* For a conversation, ``GET /v1/sessions/{id}`` describes it, ``GET
  …/stream`` follows its current or last turn from a token cursor, and
  ``DELETE …/generation`` stops its running turn.

The same operations serve the WebSocket ops ``create``, ``append``,
``generate`` (with ``session`` naming a conversation), ``events``, ``fork``.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs

import trio

from ..journal import SessionStateError
from ..proto._wal import body_conversation
from ._lane import check_log
from ._http import ApiError, Receive, Send, header, read_json, send_json
from ._chat import parse_messages, parse_tools
from ._params import check_loggable, template_kwargs_from
from ._sessions import cancel_generation
from ._principal import principal_of
from ._tenancy import chosen_id, public_id, resolve
from ._turns import (
    SAMPLING_FIELDS, busy_error, check_quota, check_room, check_sampling, conversation_log, load_turn, send_turn, start_turn, stream_turn,
)

if TYPE_CHECKING:
    from ._host import App

__all__ = ["append_messages", "conversation_info", "create_conversation", "events_page", "fork_conversation",
           "own_conversation", "route_conversations"]
CREATE_FIELDS = frozenset({"model", "system", "tools", "sampling", "messages", "chat_template_kwargs", "id"})
MAX_EVENTS_PAGE = 10_000
_ROUTE = re.compile(r"/v1/sessions(?:/([A-Za-z0-9_.-]+)(/[a-z]+)?)?")


def _only(body: dict[str, Any], allowed: frozenset[str]) -> None:
    for key in body:
        if key not in allowed:
            raise ApiError(400, f"invalid request: unknown field {key!r}", param=key)


def _new_id(app: App, scope: dict[str, Any], name: Any) -> str:
    """A fresh ``c-<hex>`` id, or the stored id of the client's name if its tenant does not use it yet.

    Raises:
        ApiError: 400 a name with no keys configured, or a bad name; 409 ``session_exists``.
    """
    if name is None:
        return app.conversations.new_id()
    sid = chosen_id(app, scope, name, "id")
    if sid in app.sessions.journal.sessions or sid in app.sessions.live:
        raise _exists(sid)
    return sid


def _exists(sid: str) -> ApiError:
    return ApiError(409, f"session '{public_id(sid)}' already exists; name a new one", code="session_exists",
                    param="id")


def own_conversation(app: App, scope: dict[str, Any], cid: str) -> str:
    """The stored id of the conversation the scope's tenant calls ``cid``.

    Raises:
        ApiError: 404 ``session_not_found``, the same for another tenant's as for none.
    """
    own = resolve(app, scope, cid)
    if own is None or app.conversations.get(own) is None:
        raise ApiError(404, f"conversation '{cid}' not found", code="session_not_found")
    return own


def conversation_info(app: App, cid: str) -> dict[str, Any]:
    """What ``GET /v1/sessions/{id}`` reports for a conversation.

    Raises:
        ApiError: 404 ``session_not_found``.
    """
    slog = conversation_log(app, cid)
    state = app.conversations.fold(cid)
    last = state.turns.get(state.last_turn)
    header_ = state.header
    return {"id": public_id(cid), "object": "session", "kind": "conversation", "model": header_["model"],
            "system": header_["system"], "tools": header_["tools"], "sampling": header_["sampling"],
            "events": slog.event_count, "last_event_id": slog.last_event_id, "messages": len(state.messages),
            "generating": app.conversations.busy(cid), "generation": last["generation"] if last else None}


async def create_conversation(app: App, scope: dict[str, Any], body: dict[str, Any]) -> dict[str, Any]:
    """Create a conversation owned by the scope's tenant; its info.

    Raises:
        ApiError: 400 naming ``param``; 404 unknown model; 409 ``session_exists``.
    """
    _only(body, CREATE_FIELDS)
    model = await app.resolve_model(body.get("model"))
    cid = _new_id(app, scope, body.get("id"))
    system = body.get("system")
    if system is not None and not isinstance(system, str):
        raise ApiError(400, "invalid request: system must be a string", param="system")
    tools = parse_tools(body.get("tools"))
    sampling = body.get("sampling") or {}
    if not isinstance(sampling, dict):
        raise ApiError(400, "invalid request: sampling must be an object", param="sampling")
    for key in sampling:
        if key not in SAMPLING_FIELDS:
            raise ApiError(400, f"invalid request: unknown field sampling.{key}", param=f"sampling.{key}")
    check_sampling(model, sampling, "sampling.")
    kwargs = template_kwargs_from(body)
    messages = parse_messages(body) if body.get("messages") not in (None, []) else []
    logged_tools = [t.to_openai() for t in tools] if tools else None
    for param, value in (("tools", logged_tools), ("sampling", sampling), ("chat_template_kwargs", kwargs)):
        check_loggable(value, param)   # as the conversation's first record holds it
    try:
        head = body_conversation(model=model.name, system=system, tools=logged_tools, sampling=sampling,
                                 template_kwargs=kwargs, tenant=principal_of(scope).tenant)
    except ValueError as exc:  # anything else its record cannot hold
        raise ApiError(400, f"invalid request: {exc}") from None
    check_room(app, None, messages, header=head)
    try:
        await app.conversations.create(cid, head, messages)
    except SessionStateError:
        raise _exists(cid) from None
    except ValueError as exc:  # a value the log cannot hold (e.g. an oversized record)
        raise ApiError(400, f"invalid request: {exc}") from None
    return conversation_info(app, cid)


async def append_messages(app: App, cid: str, body: dict[str, Any]) -> dict[str, Any]:
    """Append messages; the new event ids.

    Raises:
        ApiError: 404; 409 ``session_busy``; 400 bad messages.
    """
    store = app.conversations
    conversation_log(app, cid)
    _only(body, frozenset({"messages"}))
    messages = parse_messages(body)
    if store.busy(cid):
        raise busy_error(cid)
    async with store.ordered(cid):
        if store.busy(cid):
            raise busy_error(cid)
        check_room(app, cid, messages)
        try:
            records = await store.append(cid, messages)
        except ValueError as exc:
            raise ApiError(400, f"invalid request: {exc}", param="messages") from None
    return {"id": public_id(cid), "object": "session.messages", "events": [r.event_id for r in records]}


def events_page(app: App, cid: str, *, after: int = -1, limit: int = 1000) -> dict[str, Any]:
    """The conversation's events after event ``after`` (at most ``limit``).

    Raises:
        ApiError: 404.
    """
    slog = conversation_log(app, cid)
    records = slog.records(after)
    events = [{"id": r.event_id, "type": r.body["type"], "ts": r.ts, **r.body} for r in records[:limit]]
    return {"object": "session.events", "id": public_id(cid), "events": events, "has_more": len(records) > limit,
            "last_event_id": slog.last_event_id, "generating": app.conversations.busy(cid)}


async def fork_conversation(app: App, scope: dict[str, Any], cid: str, body: dict[str, Any]) -> dict[str, Any]:
    """Fork ``cid`` at event ``body["at"]`` (default: its last); the new conversation's info.

    Raises:
        ApiError: 404; 400 a bad ``at`` or ``id``; 409 ``session_exists``.
    """
    slog = conversation_log(app, cid)
    _only(body, frozenset({"at", "id"}))
    at = body.get("at", slog.last_event_id)
    if isinstance(at, bool) or not isinstance(at, int) or not 0 <= at <= slog.last_event_id:
        raise ApiError(400, f"invalid request: at must be an event id in 0..{slog.last_event_id}", param="at")
    new = _new_id(app, scope, body.get("id"))
    check_quota(app, conversations=1, nbytes=app.conversations.size(cid))  # (at most what the fork copies)
    try:
        await app.conversations.fork(cid, at, new)
    except SessionStateError:
        raise _exists(new) from None
    return {**conversation_info(app, new), "forked_from": {"id": public_id(cid), "at": at}}


def _query_int(scope: dict[str, Any], name: str, default: int, lo: int, hi: int) -> int:
    raw = (parse_qs(scope.get("query_string", b"").decode()).get(name) or [None])[0]
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = lo - 1
    if not lo <= value <= hi:
        raise ApiError(400, f"invalid request: {name} must be an integer in {lo}..{hi}", param=name)
    return value


async def _optional_json(scope: dict[str, Any], receive: Receive) -> dict[str, Any]:
    return await read_json(scope, receive, empty={})


def _whole() -> trio.CancelScope:
    """A write to the log (and its index) that a client leaving does not cut in two:
    the request's scope (api/_lifecycle.py) is cancelled only after it."""
    return trio.CancelScope(shield=True)


async def route_conversations(app: App, scope: dict[str, Any], receive: Receive, send: Send) -> bool:
    """Serve a conversation route; False if the request is not one (the session routes take it)."""
    m = _ROUTE.fullmatch(scope["path"])
    if m is None:
        return False
    method, (cid, tail) = scope["method"], m.groups()
    if method == "POST":
        check_log(app)  # every POST here writes the log: a full disk refuses it typed (507)
    if cid is None:
        if method != "POST":
            raise ApiError(405, f"method {method} not allowed on /v1/sessions")
        body = await read_json(scope, receive)
        with _whole():
            info = await create_conversation(app, scope, body)
        await send_json(send, 201, info)
        return True
    wanted = {"/messages": "POST", "/generate": "POST", "/fork": "POST", "/events": "GET"}.get(tail or "")
    if wanted is not None and method != wanted:
        raise ApiError(405, f"method {method} not allowed on {scope['path']}")
    if wanted is not None:
        cid = own_conversation(app, scope, cid)
    else:
        own = resolve(app, scope, cid)
        if own is None or app.conversations.get(own) is None:
            return False  # a generation session (or none the caller owns): GET /v1/sessions/{id}, …/stream, …
        cid = own
    if tail == "/messages":
        body = await read_json(scope, receive)
        with _whole():
            done = await append_messages(app, cid, body)
        await send_json(send, 200, done)
    elif tail == "/generate":
        body = await _optional_json(scope, receive)
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise ApiError(400, "invalid request: stream must be a boolean", param="stream")
        with _whole():
            turn = await start_turn(app, scope, cid, body)
        await (stream_turn(send, receive, turn, 0) if stream else send_turn(send, receive, turn))
    elif tail == "/fork":
        body = await _optional_json(scope, receive)
        with _whole():
            info = await fork_conversation(app, scope, cid, body)
        await send_json(send, 201, info)
    elif tail == "/events":
        page = events_page(app, cid, after=_query_int(scope, "after", -1, -1, 2**62),
                           limit=_query_int(scope, "limit", 1000, 1, MAX_EVENTS_PAGE))
        await send_json(send, 200, page)
    elif tail is None and method == "GET":
        await send_json(send, 200, conversation_info(app, cid))
    elif tail == "/stream" and method == "GET":
        await _stream(app, scope, receive, send, cid)
    elif tail == "/generation" and method == "DELETE":
        slog = conversation_log(app, cid)
        if slog.open_turn < 0:
            raise ApiError(409, f"conversation '{public_id(cid)}' has no turn running", code="no_generation")
        generation = app.conversations.fold(cid).turns[slog.open_turn]["generation"]
        await cancel_generation(app, scope, generation)
        await send_json(send, 200, {"id": public_id(cid), "object": "session.generation", "generation": generation,
                                    "cancelled": True})
    else:
        return False
    return True


async def _stream(app: App, scope: dict[str, Any], receive: Receive, send: Send, cid: str) -> None:
    """``GET /v1/sessions/{conversation}/stream``: its current or last turn from a token cursor."""
    state = app.conversations.fold(cid)
    if state.last_turn < 0:
        raise ApiError(409, f"conversation '{cid}' has no turn yet", code="no_generation")
    turn = await load_turn(app, cid, state.last_turn)
    if turn is None or turn.session is None:
        raise ApiError(404, f"the generation of conversation '{cid}''s last turn is no longer in the log",
                       code="session_not_found")
    raw = header(scope, "last-event-id")
    if raw is None:
        raw = (parse_qs(scope.get("query_string", b"").decode()).get("after") or ["0"])[0]
    n = len(turn.session.job.tokens)
    try:
        cursor = int(raw)
    except ValueError:
        cursor = -1
    if not 0 <= cursor <= n:
        raise ApiError(400, f"invalid Last-Event-ID / after {raw!r}: a token cursor in 0..{n}", param="after")
    await stream_turn(send, receive, turn, cursor)

