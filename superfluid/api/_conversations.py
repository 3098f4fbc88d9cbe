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

The session tree (SPEC.md §7, "The session tree"):

* ``PATCH /v1/sessions/{id}`` ``{title?, archived?, qos?, expected_version?}``:
  the new info; a stale ``expected_version`` is 409 ``version_conflict``.
* ``GET /v1/sessions?view=tree[&include_archived=1]``: every conversation of
  the caller's tenant with ``parent`` and ``fork_at``.
* ``POST …/rebase`` ``{edits, id?}`` and ``POST …/trim`` ``{to, id?}``: 201, a
  branch (the source is never rewritten).
* ``DELETE /v1/sessions/{id}?mode=cascade|reroot&expected_version=V`` (default
  ``reroot``): purged, with its descendants (cascade) or making its children
  roots (reroot); running turns are stopped first.
* ``GET …/subscribe?after=N``: SSE of committed events and the running turn's
  text (``api/_watch.py``).
* ``GET …/tool_calls``, ``POST …/tool_results`` and ``POST …/tool_calls/{call_id}/cancel``: the tool
  ledger (a cancel is a ``tool_cancel`` event; the call stays open until answered).
* ``POST …/permissions`` ``{tool_call_id?, tool?, arguments?, reason?}`` (201), ``POST
  …/permissions/{pid}`` ``{allow, note?}``, ``GET …/permissions``: permission requests and their
  answers (``permission_request``, ``permission_response`` events).
* ``POST …/pin`` ``{ttl_s}`` (0 unpins, at most a day): ``{pinned_until}``; a pinned conversation
  holds its model loaded (``daemon/_lifetime.py``).

Every conversation belongs to the tenant that created it; for any other
tenant its id answers as an unknown one (:func:`own_conversation`).
* For a conversation, ``GET /v1/sessions/{id}`` describes it, ``GET
  …/stream`` follows its current or last turn from a token cursor, and
  ``DELETE …/generation`` stops its running turn.

The same operations serve the WebSocket ops ``create``, ``append``,
``generate`` (with ``session`` naming a conversation), ``events``, ``fork``.
"""

from __future__ import annotations

import contextlib
import re
import time
import uuid
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs

import trio

from ..journal import SessionStateError
from ..proto._wal import body_conversation, body_fork
from ..proto._wal_conversation import (
    MAX_TITLE, PERMISSION_REQUEST, PERMISSION_RESPONSE, PURGE_MODES, TOOL_CANCEL, body_permission_request,
    body_permission_response, body_pin, body_tool_cancel,
)
from ..sched import parse_qos
from ..sessions._conversations import size_of
from ..proto import encode_sse_json
from ._lane import check_log
from ._sse import SseResponse
from ._watch import watch
from ._http import ApiError, Receive, Send, header, read_json, send_json
from ._chat import parse_messages, parse_tools
from ._params import check_loggable, template_kwargs_from
from ._sessions import cancel_generation
from ._principal import principal_of
from ._tenancy import chosen_id, public_id, resolve
from ._turns import (
    LAND_WAIT_S, SAMPLING_FIELDS, busy_error, check_quota, check_room, check_sampling, conversation_log, load_turn,
    send_turn, start_turn, stream_turn,
)

if TYPE_CHECKING:
    from ._host import App

__all__ = ["append_messages", "conversation_info", "create_conversation", "events_page", "fork_conversation",
           "own_conversation", "permissions", "pin_conversation", "request_permission", "respond_permission", "route_conversations",
           "tool_cancel"]
CREATE_FIELDS = frozenset({"model", "system", "tools", "sampling", "messages", "chat_template_kwargs", "id"})
MAX_EVENTS_PAGE = 10_000
_ROUTE = re.compile(r"/v1/sessions(?:/([A-Za-z0-9_.-]+)(/[a-z_]+)?(?:/([^/]{1,256})(/cancel)?)?)?")


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


def _meta_info(app: App, cid: str) -> dict[str, Any]:
    store = app.conversations
    meta, (parent, fork_at) = store.meta(cid), store.parent(cid)
    return {"title": meta["title"], "archived": meta["archived"], "qos": meta["qos"], "version": meta["version"],
            "parent": None if parent is None else public_id(parent), "fork_at": fork_at,
            "pinned_until": store.pinned(cid, time.time())}


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
            "generating": app.conversations.busy(cid), "generation": last["generation"] if last else None,
            "created": slog.first_ts // 1000, "updated": slog.last_ts // 1000, **_meta_info(app, cid)}


def conversation_tree(app: App, scope: dict[str, Any], *, include_archived: bool = False) -> dict[str, Any]:
    """``GET /v1/sessions?view=tree``: the caller's tenant's conversations with parent and fork point."""
    store = app.conversations
    data = []
    for cid in store.conversations(principal_of(scope).tenant):
        slog = store.get(cid)
        assert slog is not None and slog.conversation is not None
        meta = _meta_info(app, cid)
        if meta["archived"] and not include_archived:
            continue
        data.append({"id": public_id(cid), "parent": meta["parent"], "fork_at": meta["fork_at"],
                     "title": meta["title"], "archived": meta["archived"], "qos": meta["qos"],
                     "model": slog.conversation["model"], "version": meta["version"],
                     "last_event_id": slog.last_event_id, "created": slog.first_ts // 1000,
                     "updated": slog.last_ts // 1000})
    return {"object": "list", "data": data}


def _expected_version(app: App, cid: str, value: Any) -> None:
    """Raises ApiError 400 a bad ``expected_version``, 409 ``version_conflict`` a stale one."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ApiError(400, "invalid request: expected_version must be an integer >= 0", param="expected_version")
    version = app.conversations.meta(cid)["version"]
    if value != version:
        raise ApiError(409, f"conversation '{public_id(cid)}' is at version {version}, not {value}; read it again",
                       code="version_conflict", param="expected_version")


async def patch_meta(app: App, scope: dict[str, Any], cid: str, body: dict[str, Any]) -> dict[str, Any]:
    """``PATCH /v1/sessions/{id}`` ``{title?, archived?, qos?, expected_version?}``: the new info.

    Raises:
        ApiError: 404; 400 a bad field; 403 ``qos_class_not_allowed``; 409 ``version_conflict``.
    """
    conversation_log(app, cid)
    _only(body, frozenset({"title", "archived", "qos", "expected_version"}))
    updates: dict[str, Any] = {}
    if "title" in body:
        title = body["title"]
        if title is not None and (not isinstance(title, str) or len(title) > MAX_TITLE):
            raise ApiError(400, f"invalid request: title must be a string of at most {MAX_TITLE} characters or null",
                           param="title")
        updates["title"] = title
    if "archived" in body:
        if not isinstance(body["archived"], bool):
            raise ApiError(400, "invalid request: archived must be a boolean", param="archived")
        updates["archived"] = body["archived"]
    if "qos" in body:
        qos = body["qos"]
        if qos is not None:
            try:
                qos = parse_qos(qos).name.lower() if isinstance(qos, str) else None
            except ValueError:
                qos = None
            if qos is None:
                raise ApiError(400, "invalid request: qos must be one of interactive, completion, agent, background "
                               "or null", param="qos")
            principal_of(scope).qos(parse_qos(qos), app.config.default_qos)  # 403 above the key's max_class
        updates["qos"] = qos
    store = app.conversations
    async with store.ordered(cid):
        conversation_log(app, cid)
        _expected_version(app, cid, body.get("expected_version"))
        try:
            await store.set_meta({cid: {**store.meta(cid), **updates}})
        except ValueError as exc:  # what the log cannot hold (a lone surrogate in a title)
            raise ApiError(400, f"invalid request: {exc}", param="title" if "title" in updates else None) from None
    return conversation_info(app, cid)


def _branch_info(app: App, new: str, cid: str, at: int) -> dict[str, Any]:
    return {**conversation_info(app, new), "forked_from": {"id": public_id(cid), "at": at}}


async def rebase_conversation(app: App, scope: dict[str, Any], cid: str, body: dict[str, Any]) -> dict[str, Any]:
    """``POST /v1/sessions/{id}/rebase`` ``{edits, id?}``: 201 a new conversation, ``cid``'s events
    with the edits applied (a branch of it).

    Raises:
        ApiError: 404; 400 bad edits (naming ``edits[i]``) or ``id``; 409 ``session_exists``; 413.
    """
    slog = conversation_log(app, cid)
    _only(body, frozenset({"edits", "id"}))
    edits = body.get("edits")
    if not isinstance(edits, list) or not edits:
        raise ApiError(400, "invalid request: edits must be a non-empty array", param="edits")
    canonical = []
    end = slog.last_event_id + 1
    for i, edit in enumerate(edits):
        kind = next(iter(edit)) if isinstance(edit, dict) and len(edit) == 1 else None
        span = edit.get(kind) if kind in ("drop", "replace") else None
        if not isinstance(span, dict):
            raise ApiError(400, f'invalid request: edits[{i}] must be {{"drop": {{from, to}}}} or '
                           '{"replace": {from, to, message}}', param=f"edits[{i}]")
        item = dict(span)
        if kind == "replace":
            item["message"] = parse_messages({"messages": [span.get("message")]})[0] if isinstance(
                span.get("message"), dict) else None
            if item["message"] is None:
                raise ApiError(400, f"invalid request: edits[{i}].replace.message must be a message object",
                               param=f"edits[{i}].replace.message")
            if size_of(item["message"]) > app.config.max_message_bytes:
                raise ApiError(413, f"edits[{i}].replace.message is over --max-message-bytes",
                               code="message_too_large", param=f"edits[{i}].replace.message")
        hi = item.get("to")
        if isinstance(hi, int) and not isinstance(hi, bool) and hi > end:
            raise ApiError(400, f"invalid request: edits[{i}].{kind}.to must be at most {end}",
                           param=f"edits[{i}]")
        canonical.append({kind: item})
    try:
        edits = body_fork(source=cid, at=slog.last_event_id, edits=canonical)["edits"]
    except ValueError as exc:
        raise ApiError(400, f"invalid request: {exc}".replace("fork.edits", "edits"), param="edits") from None
    new = _new_id(app, scope, body.get("id"))
    check_quota(app, conversations=1, nbytes=app.conversations.size(cid))
    try:
        await app.conversations.rebase(cid, edits, new)
    except SessionStateError:
        raise _exists(new) from None
    except ValueError as exc:
        raise ApiError(400, f"invalid request: {exc}", param="edits") from None
    return {**_branch_info(app, new, cid, slog.last_event_id), "edits": edits}


async def trim_conversation(app: App, scope: dict[str, Any], cid: str, body: dict[str, Any]) -> dict[str, Any]:
    """``POST /v1/sessions/{id}/trim`` ``{to, id?}``: 201 a new conversation holding the events before ``to``.

    Raises:
        ApiError: 404; 400 a bad ``to`` or ``id``; 409 ``session_exists``.
    """
    slog = conversation_log(app, cid)
    _only(body, frozenset({"to", "id"}))
    to = body.get("to")
    if isinstance(to, bool) or not isinstance(to, int) or not 1 <= to <= slog.last_event_id + 1:
        raise ApiError(400, f"invalid request: to must be an event id in 1..{slog.last_event_id + 1}", param="to")
    return await fork_conversation(app, scope, cid, {"at": to - 1, **({"id": body["id"]} if "id" in body else {})})


def descendants(app: App, cid: str) -> list[str]:
    """The conversations branched off ``cid``, at any depth (children before theirs)."""
    store = app.conversations
    slog = store.get(cid)
    if slog is None:
        return []
    children: dict[str, list[str]] = {}
    for other in store.conversations(slog.tenant):
        parent, _at = store.parent(other)
        if parent is not None:
            children.setdefault(parent, []).append(other)
    out: list[str] = []
    todo = list(children.get(cid, ()))
    while todo:
        child = todo.pop(0)
        if child not in out:
            out.append(child)
            todo += children.get(child, ())
    return out


async def purge_conversation(app: App, scope: dict[str, Any], cid: str, *, mode: str,
                             expected_version: Any = None) -> dict[str, Any]:
    """Delete ``cid`` (``DELETE /v1/sessions/{id}?mode=cascade|reroot&expected_version=V``).

    ``cascade`` purges its descendants too; ``reroot`` makes its children roots. A
    running turn of any purged conversation is stopped first (what it said lands).

    Raises:
        ApiError: 404; 400 a bad ``mode``; 409 ``version_conflict``.
    """
    conversation_log(app, cid)
    if mode not in PURGE_MODES:
        raise ApiError(400, "invalid request: mode must be cascade or reroot", param="mode")
    store = app.conversations
    _expected_version(app, cid, expected_version)
    gone = [cid, *(descendants(app, cid) if mode == "cascade" else [])]
    for victim in gone:  # stop running turns, and wait (bounded) for what they said to land
        slog = store.get(victim)
        if slog is not None and slog.open_turn >= 0:
            turn = await load_turn(app, victim, slog.open_turn)
            if turn is not None and not turn.landed:
                with contextlib.suppress(ApiError):
                    await cancel_generation(app, scope, turn.generation)
                with trio.move_on_after(LAND_WAIT_S):
                    await turn.wait_landed()
    async with store.ordered(cid):
        conversation_log(app, cid)
        _expected_version(app, cid, expected_version)
        gone = [v for v in gone if store.get(v) is not None]
        tenant = conversation_log(app, cid).tenant
        rerooted = {} if mode == "cascade" else {
            child: store.meta(child) for child in store.conversations(tenant) if store.parent(child)[0] == cid}
        await store.purge(gone, mode, rerooted)
    return {"id": public_id(cid), "object": "session.deleted", "deleted": True,
            "purged": [public_id(v) for v in gone], "rerooted": [public_id(c) for c in rerooted]}


def tool_calls(app: App, cid: str) -> dict[str, Any]:
    """``GET /v1/sessions/{id}/tool_calls``: the calls of the last assistant message that have no result yet,
    ``status`` ``open`` or ``cancel_requested`` (a ``tool_cancel`` event after that message names it)."""
    slog = conversation_log(app, cid)
    messages = app.conversations.fold(cid).messages
    last = max((i for i, (_eid, m) in enumerate(messages) if m.get("role") == "assistant"), default=-1)
    if last < 0:
        return {"object": "list", "data": []}
    answered = {m.get("tool_call_id") for _eid, m in messages[last + 1:] if m.get("role") == "tool"}
    cancelled = {r.body["call_id"] for r in slog.records(messages[last][0]) if r.body["type"] == TOOL_CANCEL}
    data = [{"id": c.get("id"), "name": (c.get("function") or {}).get("name"),
             "arguments": (c.get("function") or {}).get("arguments"),
             "status": "cancel_requested" if c.get("id") in cancelled else "open"}
            for c in messages[last][1].get("tool_calls") or [] if c.get("id") not in answered]
    return {"object": "list", "data": data}


async def tool_cancel(app: App, cid: str, call_id: str, body: dict[str, Any]) -> dict[str, Any]:
    """``POST /v1/sessions/{id}/tool_calls/{call_id}/cancel``: log a ``tool_cancel`` event for an open
    call; the call stays open (``cancel_requested``) until a result or an outcome answers it.

    Raises:
        ApiError: 404 the conversation, 404 ``tool_call_not_found`` (no open call has that id); 409
            ``cancel_already_requested``; 400 a field in the body.
    """
    conversation_log(app, cid)
    _only(body, frozenset())
    store = app.conversations
    async with store.ordered(cid):
        call = next((c for c in tool_calls(app, cid)["data"] if c["id"] == call_id), None)
        if call is None:
            raise ApiError(404, f"no open tool call '{call_id}' in conversation '{public_id(cid)}'",
                           code="tool_call_not_found", param="call_id")
        if call["status"] == "cancel_requested":
            raise ApiError(409, f"tool call '{call_id}' already has a cancel requested; answer it with a result "
                           "or the outcome cancelled", code="cancel_already_requested", param="call_id")
        rec = await store.log_event(cid, body_tool_cancel(call_id=call_id))
    return {"id": public_id(cid), "object": "session.tool_call", "tool_call_id": call_id,
            "status": "cancel_requested", "event": rec.event_id}


MAX_PIN_S = 86_400   # a pin holds a model at most a day; pin again to hold it longer


async def pin_conversation(app: App, cid: str, body: dict[str, Any]) -> dict[str, Any]:
    """``POST /v1/sessions/{id}/pin`` ``{ttl_s}``: a ``pin`` event; until it runs out the conversation
    holds its model loaded (``daemon/_lifetime.py``). ``ttl_s`` 0 unpins.

    Raises:
        ApiError: 404; 400 a bad ``ttl_s``.
    """
    conversation_log(app, cid)
    _only(body, frozenset({"ttl_s"}))
    ttl = body.get("ttl_s")
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not 0 <= ttl <= MAX_PIN_S:
        raise ApiError(400, f"invalid request: ttl_s must be a number of seconds in 0..{MAX_PIN_S} (0 unpins)",
                       param="ttl_s")
    store = app.conversations
    async with store.ordered(cid):
        conversation_log(app, cid)
        check_room(app, cid, [], events=1)
        await store.log_event(cid, body_pin(deadline=int((time.time() + ttl) * 1000) if ttl > 0 else 0))
    app.registry.pins(store.pinned_until)  # look at the models' expiries again
    return {"id": public_id(cid), "object": "session.pin", "pinned_until": store.pinned(cid, time.time())}


MAX_PENDING_PERMISSIONS = 256   # pending permission requests per conversation
MAX_PERMISSION_TEXT = 4096      # characters of a request's reason or an answer's note
_PERMISSION_FIELDS = frozenset({"tool_call_id", "tool", "arguments", "reason"})


def permissions(app: App, cid: str) -> dict[str, Any]:
    """``GET /v1/sessions/{id}/permissions``: every permission request, oldest first, with its
    ``status`` (``pending``, ``allowed``, ``denied``) from the conversation's events."""
    slog = conversation_log(app, cid)
    held: dict[str, dict[str, Any]] = {}
    for rec in slog.records():
        body = rec.body
        if body["type"] == PERMISSION_REQUEST:
            held[body["permission"]] = {"id": body["permission"], "object": "session.permission", "tool_call_id": body["tool_call_id"],
                                "tool": body["tool"], "arguments": body["arguments"], "reason": body["reason"],
                                "status": "pending", "note": None, "event": rec.event_id, "answer_event": None,
                                "created": rec.ts // 1000}
        elif body["type"] == PERMISSION_RESPONSE and body["permission"] in held:
            held[body["permission"]].update(status="allowed" if body["allow"] else "denied", note=body["note"],
                                    answer_event=rec.event_id)
    return {"object": "list", "data": list(held.values())}


def _permission(app: App, cid: str, pid: str) -> dict[str, Any]:
    """Raises ApiError 404 ``permission_not_found``."""
    found = next((p for p in permissions(app, cid)["data"] if p["id"] == pid), None)
    if found is None:
        raise ApiError(404, f"no permission request '{pid}' in conversation '{public_id(cid)}'",
                       code="permission_not_found", param="permission")
    return found


def _text(body: dict[str, Any], name: str, limit: int) -> str | None:
    value = body.get(name)
    if value is not None and (not isinstance(value, str) or len(value) > limit):
        raise ApiError(400, f"invalid request: {name} must be a string of at most {limit} characters or null",
                       param=name)
    return value


async def request_permission(app: App, cid: str, body: dict[str, Any]) -> dict[str, Any]:
    """``POST /v1/sessions/{id}/permissions`` ``{tool_call_id?, tool?, arguments?, reason?}``: a
    ``permission_request`` event; the new request, ``pending``.

    Raises:
        ApiError: 404; 400 a bad field; 413 too large; 429 ``too_many_pending_permissions``.
    """
    conversation_log(app, cid)
    _only(body, _PERMISSION_FIELDS)
    tool_call_id, tool = _text(body, "tool_call_id", 256), _text(body, "tool", 256)
    why = _text(body, "reason", MAX_PERMISSION_TEXT)
    arguments = body.get("arguments")
    check_loggable(arguments, "arguments")
    if size_of(arguments) > app.config.max_message_bytes:
        raise ApiError(413, f"arguments take more than {app.config.max_message_bytes} bytes (--max-message-bytes)",
                       code="message_too_large", param="arguments")
    store = app.conversations
    async with store.ordered(cid):
        conversation_log(app, cid)
        pending = sum(p["status"] == "pending" for p in permissions(app, cid)["data"])
        if pending >= MAX_PENDING_PERMISSIONS:
            raise ApiError(429, f"conversation '{public_id(cid)}' has {pending} permission requests pending; "
                           f"the limit is {MAX_PENDING_PERMISSIONS}: answer some first",
                           code="too_many_pending_permissions")
        check_room(app, cid, [], events=1)
        pid = "perm-" + uuid.uuid4().hex
        try:
            await store.log_event(cid, body_permission_request(permission=pid, tool_call_id=tool_call_id, tool=tool,
                                                               arguments=arguments, reason=why))
        except ValueError as exc:  # what the log cannot hold
            raise ApiError(400, f"invalid request: {exc}") from None
    return _permission(app, cid, pid)


async def respond_permission(app: App, cid: str, pid: str, body: dict[str, Any]) -> dict[str, Any]:
    """``POST /v1/sessions/{id}/permissions/{pid}`` ``{allow, note?}``: a ``permission_response``
    event; the answered request.

    Raises:
        ApiError: 404 the conversation or ``permission_not_found``; 400 a bad field; 409
            ``already_answered``.
    """
    conversation_log(app, cid)
    _only(body, frozenset({"allow", "note"}))
    allow = body.get("allow")
    if not isinstance(allow, bool):
        raise ApiError(400, "invalid request: allow must be a boolean", param="allow")
    note = _text(body, "note", MAX_PERMISSION_TEXT)
    store = app.conversations
    async with store.ordered(cid):
        conversation_log(app, cid)
        if _permission(app, cid, pid)["status"] != "pending":
            raise ApiError(409, f"permission request '{pid}' was answered already", code="already_answered",
                           param="permission")
        check_room(app, cid, [], events=1)
        try:
            await store.log_event(cid, body_permission_response(permission=pid, allow=allow, note=note))
        except ValueError as exc:
            raise ApiError(400, f"invalid request: {exc}", param="note") from None
    return _permission(app, cid, pid)


TOOL_OUTCOMES = frozenset({"failed", "cancelled"})


async def tool_result(app: App, cid: str, body: dict[str, Any]) -> dict[str, Any]:
    """``POST /v1/sessions/{id}/tool_results`` ``{tool_call_id, content}`` or ``{tool_call_id,
    outcome: failed|cancelled, note?}``: a ``tool`` message answering an open call.

    Raises:
        ApiError: 404 the conversation, or 404 ``tool_call_not_found`` (no open call has that id);
            400 a bad field; 409 ``session_busy``.
    """
    conversation_log(app, cid)
    _only(body, frozenset({"tool_call_id", "content", "outcome", "note"}))
    call_id = body.get("tool_call_id")
    if not isinstance(call_id, str) or not call_id:
        raise ApiError(400, "invalid request: tool_call_id must be a string", param="tool_call_id")
    outcome, note = body.get("outcome"), body.get("note")
    if outcome is None:
        if "note" in body:
            raise ApiError(400, "invalid request: note goes with an outcome", param="note")
        content = body.get("content")
        if not isinstance(content, str):
            raise ApiError(400, "invalid request: content must be a string (or give an outcome)", param="content")
    else:
        if "content" in body:
            raise ApiError(400, "invalid request: give content or an outcome, not both", param="outcome")
        if outcome not in TOOL_OUTCOMES:
            raise ApiError(400, "invalid request: outcome must be failed or cancelled", param="outcome")
        if note is not None and not isinstance(note, str):
            raise ApiError(400, "invalid request: note must be a string", param="note")
        content = f"The tool call {outcome}" + (f": {note}" if note else ".")
    if call_id not in {c["id"] for c in tool_calls(app, cid)["data"]}:
        raise ApiError(404, f"no open tool call '{call_id}' in conversation '{public_id(cid)}'",
                       code="tool_call_not_found", param="tool_call_id")
    return await append_messages(app, cid, {"messages": [{"role": "tool", "tool_call_id": call_id,
                                                          "content": content}]})


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
    method, (cid, tail, item, action) = scope["method"], m.groups()
    if item is not None:  # …/tool_calls/{call_id}/cancel, …/permissions/{pid}
        if (tail, action) not in (("/tool_calls", "/cancel"), ("/permissions", None)):
            return False
        tail += "/cancel" if action else "/answer"
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
    wanted = {"/messages": "POST", "/generate": "POST", "/fork": "POST", "/events": "GET", "/rebase": "POST",
              "/trim": "POST", "/subscribe": "GET", "/tool_calls": "GET", "/tool_results": "POST",
              "/tool_calls/cancel": "POST", "/permissions/answer": "POST", "/pin": "POST",
              "/permissions": method if method in ("GET", "POST") else "POST"}.get(tail or "")
    if tail is None and method in ("PATCH", "DELETE"):
        if method == "PATCH":
            check_log(app)
        wanted = method
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
    elif tail in ("/rebase", "/trim"):
        body = await read_json(scope, receive)
        with _whole():
            info = await (rebase_conversation if tail == "/rebase" else trim_conversation)(app, scope, cid, body)
        await send_json(send, 201, info)
    elif tail is None and method == "PATCH":
        body = await read_json(scope, receive)
        with _whole():
            info = await patch_meta(app, scope, cid, body)
        await send_json(send, 200, info)
    elif tail is None and method == "DELETE":
        query = parse_qs(scope.get("query_string", b"").decode())
        mode = (query.get("mode") or ["reroot"])[0]
        raw = (query.get("expected_version") or [None])[0]
        expected = None if raw is None else (int(raw) if raw.isdigit() else -1)
        check_log(app)
        with _whole():
            done = await purge_conversation(app, scope, cid, mode=mode, expected_version=expected)
        await send_json(send, 200, done)
    elif tail == "/subscribe":
        await _subscribe(app, scope, send, cid)
    elif tail == "/tool_calls":
        await send_json(send, 200, tool_calls(app, cid))
    elif tail == "/tool_calls/cancel":
        assert item is not None
        body = await _optional_json(scope, receive)
        with _whole():
            done = await tool_cancel(app, cid, item, body)
        await send_json(send, 200, done)
    elif tail == "/pin":
        body = await read_json(scope, receive)
        with _whole():
            done = await pin_conversation(app, cid, body)
        await send_json(send, 200, done)
    elif tail == "/permissions" and method == "GET":
        await send_json(send, 200, permissions(app, cid))
    elif tail == "/permissions":
        body = await _optional_json(scope, receive)
        with _whole():
            done = await request_permission(app, cid, body)
        await send_json(send, 201, done)
    elif tail == "/permissions/answer":
        assert item is not None
        body = await read_json(scope, receive)
        with _whole():
            done = await respond_permission(app, cid, item, body)
        await send_json(send, 200, done)
    elif tail == "/tool_results":
        body = await read_json(scope, receive)
        with _whole():
            done = await tool_result(app, cid, body)
        await send_json(send, 200, done)
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


async def _subscribe(app: App, scope: dict[str, Any], send: Send, cid: str) -> None:
    """``GET /v1/sessions/{id}/subscribe?after=N`` (or ``Last-Event-ID``): SSE ``committed`` (``id:`` the
    event id), ``provisional`` and, last, ``ended`` events (``api/_watch.py``)."""
    raw = header(scope, "last-event-id")
    after = _query_int(scope, "after", -1, -1, 2**62) if raw is None else (int(raw) if raw.isdigit() else -2)
    if after < -1:
        raise ApiError(400, f"invalid Last-Event-ID {raw!r}: an event id", param="after")
    sse = SseResponse(send, done=False)
    await sse.start([(b"x-superfluid-conversation", public_id(cid).encode())])

    async def emit(kind: str, data: dict[str, Any]) -> None:
        frame = encode_sse_json(data, event=kind, id=str(data["id"]) if kind == "committed" else None)
        if kind == "ended":
            await sse.end(frame)
        else:
            await sse.send(frame)

    await watch(app, cid, after, emit)


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

