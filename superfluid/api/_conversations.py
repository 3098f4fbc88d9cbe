"""The conversation routes: server-side chat histories (SPEC.md §7, "Conversations").

* ``POST /v1/sessions`` ``{model, system?, tools?, sampling?, messages?,
  chat_template_kwargs?, id?}``: 201, a new conversation (``c-<hex>`` unless
  ``id`` names it; an id in use is 409 ``session_exists``).
* ``POST /v1/sessions/{id}/messages`` ``{messages}``: append (validated as
  chat messages); the new event ids. 409 ``session_busy`` while a turn runs.
* ``POST /v1/sessions/{id}/generate`` ``{stream?, qos?, tool_choice?,
  max_tokens?, temperature?…}``: a turn (``api/_turns.py``): SSE chunks with
  ``id:`` cursors, or one chat.completion once the reply has joined the
  conversation; ``x-superfluid-session`` names the generation session.
* ``GET /v1/sessions/{id}/events?after=N&limit=L``: the events after ``N``.
* ``POST /v1/sessions/{id}/fork`` ``{at?, id?}``: 201, a new conversation
  holding the events up to ``at`` (default: all; a turn still running then
  is left out).
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

from ..journal import SessionStateError
from ..proto._wal import body_conversation
from ._generate import check_log
from ._http import ApiError, Receive, Send, decode_json, header, read_body, send_json
from ._openai import parse_messages, parse_tools
from ._sessions import cancel_generation
from ._turns import (
    SAMPLING_FIELDS, busy_error, check_sampling, conversation_log, load_turn, send_turn, start_turn, stream_turn,
)

if TYPE_CHECKING:
    from ._app import App

__all__ = ["SESSION_ID", "append_messages", "conversation_info", "create_conversation", "events_page",
           "fork_conversation", "route_conversations"]

SESSION_ID = re.compile(r"[A-Za-z0-9_.-]{1,128}")
CREATE_FIELDS = frozenset({"model", "system", "tools", "sampling", "messages", "chat_template_kwargs", "id"})
MAX_EVENTS_PAGE = 10_000
_ROUTE = re.compile(r"/v1/sessions(?:/([A-Za-z0-9_.-]+)(/[a-z]+)?)?")


def _only(body: dict[str, Any], allowed: frozenset[str]) -> None:
    for key in body:
        if key not in allowed:
            raise ApiError(400, f"invalid request: unknown field {key!r}", param=key)


def _new_id(app: App, name: Any) -> str:
    """A fresh ``c-<hex>`` id, or the client's name if it is free.

    Raises:
        ApiError: 400 a bad name; 409 ``session_exists``.
    """
    if name is None:
        return app.conversations.new_id()
    if not isinstance(name, str) or not SESSION_ID.fullmatch(name):
        raise ApiError(400, "invalid request: id must match [A-Za-z0-9_.-]{1,128}", param="id")
    if name in app.sessions.journal.sessions or name in app.sessions.live:
        raise _exists(name)
    return name


def _exists(name: str) -> ApiError:
    return ApiError(409, f"session '{name}' already exists; name a new one", code="session_exists", param="id")


def conversation_info(app: App, cid: str) -> dict[str, Any]:
    """What ``GET /v1/sessions/{id}`` reports for a conversation.

    Raises:
        ApiError: 404 ``session_not_found``.
    """
    slog = conversation_log(app, cid)
    state = app.conversations.fold(cid)
    last = state.turns.get(state.last_turn)
    header_ = state.header
    return {"id": cid, "object": "session", "kind": "conversation", "model": header_["model"],
            "system": header_["system"], "tools": header_["tools"], "sampling": header_["sampling"],
            "events": slog.event_count, "last_event_id": slog.last_event_id, "messages": len(state.messages),
            "generating": app.conversations.busy(cid), "generation": last["generation"] if last else None}


async def create_conversation(app: App, body: dict[str, Any]) -> dict[str, Any]:
    """Create a conversation; its info.

    Raises:
        ApiError: 400 naming ``param``; 404 unknown model; 409 ``session_exists``.
    """
    _only(body, CREATE_FIELDS)
    model = await app.resolve_model(body.get("model"))
    cid = _new_id(app, body.get("id"))
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
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise ApiError(400, "invalid request: chat_template_kwargs must be an object", param="chat_template_kwargs")
    messages = parse_messages(body) if body.get("messages") not in (None, []) else []
    head = body_conversation(model=model.name, system=system, tools=[t.to_openai() for t in tools] if tools else None,
                             sampling=sampling, template_kwargs=kwargs)
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
        try:
            records = await store.append(cid, messages)
        except ValueError as exc:
            raise ApiError(400, f"invalid request: {exc}", param="messages") from None
    return {"id": cid, "object": "session.messages", "events": [r.event_id for r in records]}


def events_page(app: App, cid: str, *, after: int = -1, limit: int = 1000) -> dict[str, Any]:
    """The conversation's events after event ``after`` (at most ``limit``).

    Raises:
        ApiError: 404.
    """
    slog = conversation_log(app, cid)
    records = slog.records(after)
    events = [{"id": r.event_id, "type": r.body["type"], "ts": r.ts, **r.body} for r in records[:limit]]
    return {"object": "session.events", "id": cid, "events": events, "has_more": len(records) > limit,
            "last_event_id": slog.last_event_id, "generating": app.conversations.busy(cid)}


async def fork_conversation(app: App, cid: str, body: dict[str, Any]) -> dict[str, Any]:
    """Fork ``cid`` at event ``body["at"]`` (default: its last); the new conversation's info.

    Raises:
        ApiError: 404; 400 a bad ``at`` or ``id``; 409 ``session_exists``.
    """
    slog = conversation_log(app, cid)
    _only(body, frozenset({"at", "id"}))
    at = body.get("at", slog.last_event_id)
    if isinstance(at, bool) or not isinstance(at, int) or not 0 <= at <= slog.last_event_id:
        raise ApiError(400, f"invalid request: at must be an event id in 0..{slog.last_event_id}", param="at")
    new = _new_id(app, body.get("id"))
    try:
        await app.conversations.fork(cid, at, new)
    except SessionStateError:
        raise _exists(new) from None
    return {**conversation_info(app, new), "forked_from": {"id": cid, "at": at}}


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
    raw = await read_body(scope, receive)
    return decode_json(raw) if raw.strip() else {}


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
        await send_json(send, 201, await create_conversation(app, decode_json(await read_body(scope, receive))))
        return True
    wanted = {"/messages": "POST", "/generate": "POST", "/fork": "POST", "/events": "GET"}.get(tail or "")
    if wanted is not None and method != wanted:
        raise ApiError(405, f"method {method} not allowed on {scope['path']}")
    if tail == "/messages":
        await send_json(send, 200, await append_messages(app, cid, decode_json(await read_body(scope, receive))))
    elif tail == "/generate":
        body = await _optional_json(scope, receive)
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise ApiError(400, "invalid request: stream must be a boolean", param="stream")
        turn = await start_turn(app, scope, cid, body)
        await (stream_turn(send, receive, turn, 0) if stream else send_turn(send, receive, turn))
    elif tail == "/fork":
        await send_json(send, 201, await fork_conversation(app, cid, await _optional_json(scope, receive)))
    elif tail == "/events":
        page = events_page(app, cid, after=_query_int(scope, "after", -1, -1, 2**62),
                           limit=_query_int(scope, "limit", 1000, 1, MAX_EVENTS_PAGE))
        await send_json(send, 200, page)
    elif app.conversations.get(cid) is None:
        return False  # a generation session: GET /v1/sessions/{id}, …/stream, …/generation
    elif tail is None and method == "GET":
        await send_json(send, 200, conversation_info(app, cid))
    elif tail == "/stream" and method == "GET":
        await _stream(app, scope, receive, send, cid)
    elif tail == "/generation" and method == "DELETE":
        slog = conversation_log(app, cid)
        if slog.open_turn < 0:
            raise ApiError(409, f"conversation '{cid}' has no turn running", code="no_generation")
        generation = app.conversations.fold(cid).turns[slog.open_turn]["generation"]
        cancel_generation(app, generation)
        await send_json(send, 200, {"id": cid, "object": "session.generation", "generation": generation,
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

