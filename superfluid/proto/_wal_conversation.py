"""Session-log event bodies of conversations (SPEC.md §7, "Conversations").

A conversation is a session of its own kind in ``wal.log``. Its first event
is ``conversation`` and every later one is in :data:`CONVERSATION_EVENTS`;
it never ends (compaction bounds how many are kept). Bodies:

* ``conversation{model, system, tools, sampling, template_kwargs, tenant}``:
  the model, an optional system prompt, OpenAI ``tools`` (or None), the
  default request fields of each turn (``temperature``, ``max_tokens``,
  ``stop``...), chat-template arguments and the tenant that owns it (absent
  for the tenant "").
* ``message{message, turn, finish}``: one OpenAI chat message joins the
  conversation. ``turn`` (the id of a ``turn`` event) and ``finish`` are set
  exactly on the assistant reply that ends that turn.
* ``turn{generation, params}``: a turn starts; ``generation`` is the id of the
  generation session (``created``, ``prompt``, ``generated``...) that answers
  the conversation so far; ``params`` are the turn's request fields.
* ``turn_end{turn, finish, error}``: the turn ended with no reply to add.
* ``fork{source, at, edits?}``: the events before this one are copies of the
  events of ``source`` up to ``at`` (same ids); with ``edits`` (a rebase),
  copies of ``source``'s events up to ``at`` with those edits applied
  (``[{"drop": {"from", "to"}} | {"replace": {"from", "to", "message"}}]``,
  half-open ranges of ``source``'s event ids), renumbered. The conversation's
  parent is ``source``, its metadata starts afresh after this marker.
* ``meta{version, title, archived, qos, root}``: the conversation's metadata
  from now on (the whole of it, not a change): ``version`` counts meta changes
  since its start or its latest ``fork`` marker; ``root`` true once its parent
  was purged with ``reroot`` (it is then a root of the tree).
* ``purged{mode}``: the conversation is deleted (``cascade`` or ``reroot``,
  how its descendants went); it takes no more events, answers as unknown and
  is dropped by the next compaction.
* ``tool_cancel{call_id}``: a client asked that the open tool call
  ``call_id`` be cancelled; the call stays open until a ``tool`` message
  answers it (an outcome ``cancelled``, or its result).
* ``permission_request{permission, tool_call_id, tool, arguments, reason}``: a
  client asks a person (another client) to allow a tool call; ``permission`` (``perm-…``)
  names it, the rest is optional and free-form (``arguments`` any plain value).
* ``permission_response{permission, allow, note}``: the request is answered
  (each request once; the API checks that).
* ``pin{deadline}``: until ``deadline`` (unix milliseconds; 0: unpinned) the
  conversation holds its model loaded (no idle unload). A ``fork`` marker
  ends a pin its copies carry.

The order rules (one open turn at a time, nothing but its end while it is
open) are the journal's; this module checks each body alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

from ._wal_fields import MAX_INT, error_field, int_field, map_field, opt_str, plain, reason, tenant_field

__all__ = [
    "CONVERSATION", "CONVERSATION_EVENTS", "FORK", "MESSAGE", "MESSAGE_ROLES", "META", "PURGED", "PURGE_MODES",
    "PERMISSION_REQUEST", "PERMISSION_RESPONSE", "PIN", "TOOL_CANCEL", "TURN", "TURN_END", "body_conversation", "body_fork", "body_message", "body_meta", "body_permission_request",
    "body_permission_response", "body_pin", "body_purged", "body_tool_cancel",
    "body_turn", "body_turn_end", "open_turn_after", "validate_conversation_body",
]

CONVERSATION: Final = "conversation"
MESSAGE: Final = "message"
TURN: Final = "turn"
TURN_END: Final = "turn_end"
FORK: Final = "fork"
META: Final = "meta"
PURGED: Final = "purged"
TOOL_CANCEL: Final = "tool_cancel"
PERMISSION_REQUEST: Final = "permission_request"
PERMISSION_RESPONSE: Final = "permission_response"
PIN: Final = "pin"
CONVERSATION_EVENTS: Final = frozenset({MESSAGE, TURN, TURN_END, FORK, META, PURGED, TOOL_CANCEL, PERMISSION_REQUEST,
                                        PERMISSION_RESPONSE, PIN})
PURGE_MODES: Final = frozenset({"cascade", "reroot"})
EDIT_KINDS: Final = frozenset({"drop", "replace"})
MAX_TITLE: Final = 1024
MESSAGE_ROLES: Final = frozenset({"system", "user", "assistant", "tool"})
_MAX_ID: Final = 256  # as MAX_SESSION_ID in _wal.py


def body_conversation(*, model: str, system: str | None = None, tools: Sequence[Mapping[str, Any]] | None = None,
                      sampling: Mapping[str, Any] | None = None,
                      template_kwargs: Mapping[str, Any] | None = None, tenant: str = "") -> dict[str, Any]:
    """A conversation starts, owned by ``tenant``."""
    return validate_conversation_body({"type": CONVERSATION, "model": model, "system": system, "tools": tools,
                                       "sampling": sampling or {}, "template_kwargs": template_kwargs or {},
                                       "tenant": tenant})


def body_message(*, message: Mapping[str, Any], turn: int | None = None, finish: str | None = None) -> dict[str, Any]:
    """A message joins the conversation; with ``turn`` and ``finish``, the reply that ends that turn."""
    return validate_conversation_body({"type": MESSAGE, "message": message, "turn": turn, "finish": finish})


def body_turn(*, generation: str, params: Mapping[str, Any]) -> dict[str, Any]:
    """A turn starts: the generation session ``generation`` answers."""
    return validate_conversation_body({"type": TURN, "generation": generation, "params": params})


def body_turn_end(*, turn: int, finish: str, error: str | Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A turn ended with no reply to add (it failed, or was cancelled before any text)."""
    return validate_conversation_body({"type": TURN_END, "turn": turn, "finish": finish, "error": error})


def body_fork(*, source: str, at: int, edits: Sequence[Mapping[str, Any]] | None = None) -> dict[str, Any]:
    """The events before this one are ``source``'s up to ``at`` (with ``edits`` applied, renumbered)."""
    body: dict[str, Any] = {"type": FORK, "source": source, "at": at}
    if edits is not None:
        body["edits"] = edits
    return validate_conversation_body(body)


def body_meta(*, version: int, title: str | None = None, archived: bool = False, qos: str | None = None,
              root: bool = False) -> dict[str, Any]:
    """The conversation's metadata from now on."""
    return validate_conversation_body({"type": META, "version": version, "title": title, "archived": archived,
                                       "qos": qos, "root": root})


def body_purged(*, mode: str) -> dict[str, Any]:
    """The conversation is deleted; ``mode`` says how its descendants went."""
    return validate_conversation_body({"type": PURGED, "mode": mode})


def body_tool_cancel(*, call_id: str) -> dict[str, Any]:
    """A client asked that open tool call ``call_id`` be cancelled."""
    return validate_conversation_body({"type": TOOL_CANCEL, "call_id": call_id})


def body_permission_request(*, permission: str, tool_call_id: str | None = None, tool: str | None = None,
                            arguments: Any = None, reason: str | None = None) -> dict[str, Any]:
    """A client asks that a tool call be allowed; ``permission`` names the request."""
    return validate_conversation_body({"type": PERMISSION_REQUEST, "permission": permission, "tool_call_id": tool_call_id,
                                       "tool": tool, "arguments": arguments, "reason": reason})


def body_permission_response(*, permission: str, allow: bool, note: str | None = None) -> dict[str, Any]:
    """Permission request ``permission`` is answered."""
    return validate_conversation_body({"type": PERMISSION_RESPONSE, "permission": permission, "allow": allow, "note": note})


def body_pin(*, deadline: int) -> dict[str, Any]:
    """The conversation holds its model until ``deadline`` (unix ms; 0: unpinned)."""
    return validate_conversation_body({"type": PIN, "deadline": deadline})


def _edits(value: object) -> list[dict[str, Any]]:
    """A rebase's edits, canonical: sorted, non-overlapping half-open ranges, never event 0."""
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError("fork.edits must be a non-empty list")
    out: list[dict[str, Any]] = []
    last = 1
    for i, edit in enumerate(value):
        if not isinstance(edit, Mapping) or len(edit) != 1 or next(iter(edit)) not in EDIT_KINDS:
            raise ValueError(f"fork.edits[{i}] must be {{\"drop\": ...}} or {{\"replace\": ...}}")
        kind, span = next(iter(edit.items()))
        if not isinstance(span, Mapping) or set(span) != ({"from", "to", "message"} if kind == "replace"
                                                          else {"from", "to"}):
            raise ValueError(f"fork.edits[{i}].{kind} must have from, to" + (", message" if kind == "replace" else ""))
        lo, hi = int_field(f"fork.edits[{i}].{kind}.from", span["from"]), int_field(f"fork.edits[{i}].{kind}.to",
                                                                                     span["to"])
        if lo < last or hi < lo or (kind == "drop" and hi == lo):
            raise ValueError(f"fork.edits[{i}]: ranges are half-open, sorted, non-overlapping, never event 0 "
                             f"(got {lo}..{hi})")
        last = hi
        item: dict[str, Any] = {"from": lo, "to": hi}
        if kind == "replace":
            message = map_field(f"fork.edits[{i}].replace.message", span["message"])
            if message.get("role") not in MESSAGE_ROLES:
                raise ValueError(f"fork.edits[{i}].replace.message.role must be one of {sorted(MESSAGE_ROLES)}")
            item["message"] = message
        out.append({kind: item})
    return out


def _session_id(name: str, value: object) -> str:
    if type(value) is not str or not 0 < len(value) <= _MAX_ID:
        raise ValueError(f"{name} must be a session id of 1 to {_MAX_ID} characters")
    return value


def validate_conversation_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """The canonical form of a conversation body (fields already checked by name).

    Raises:
        ValueError: a bad value.
    """
    kind = body["type"]
    if kind == CONVERSATION:
        model = body["model"]
        if type(model) is not str or not model:
            raise ValueError("conversation.model must be a non-empty string")
        tools = body.get("tools")
        if tools is not None and not (isinstance(tools, (list, tuple)) and all(isinstance(t, Mapping) for t in tools)):
            raise ValueError("conversation.tools must be a list of maps or None")
        return {"type": CONVERSATION, "model": model, "system": opt_str("conversation.system", body.get("system")),
                "tools": None if tools is None else plain(tools),
                "sampling": map_field("conversation.sampling", body["sampling"]),
                "template_kwargs": map_field("conversation.template_kwargs", body.get("template_kwargs") or {}),
                **tenant_field("conversation.tenant", body.get("tenant"))}
    if kind == MESSAGE:
        message = map_field("message.message", body["message"])
        if message.get("role") not in MESSAGE_ROLES:
            raise ValueError(f"message.message.role must be one of {sorted(MESSAGE_ROLES)}")
        opt_str("message.message.content", message.get("content"))
        turn, finish = body.get("turn"), body.get("finish")
        if (turn is None) != (finish is None) or (turn is not None and message["role"] != "assistant"):
            raise ValueError("message.turn and message.finish go together, on an assistant reply")
        return {"type": MESSAGE, "message": message, "turn": None if turn is None else int_field("message.turn", turn),
                "finish": None if finish is None else reason("message.finish", finish)}
    if kind == TURN:
        return {"type": TURN, "generation": _session_id("turn.generation", body["generation"]),
                "params": map_field("turn.params", body["params"])}
    if kind == TURN_END:
        return {"type": TURN_END, "turn": int_field("turn_end.turn", body["turn"]),
                "finish": reason("turn_end.finish", body["finish"]), "error": error_field("turn_end.error",
                                                                                          body.get("error"))}
    if kind == FORK:
        out = {"type": FORK, "source": _session_id("fork.source", body["source"]),
               "at": int_field("fork.at", body["at"], hi=MAX_INT)}
        if body.get("edits") is not None:
            out["edits"] = _edits(body["edits"])
        return out
    if kind == META:
        title, archived, qos, root = body.get("title"), body.get("archived", False), body.get("qos"), body.get("root",
                                                                                                            False)
        if title is not None and (type(title) is not str or len(title) > MAX_TITLE):
            raise ValueError(f"meta.title must be a string of at most {MAX_TITLE} characters or None")
        if type(archived) is not bool or type(root) is not bool:
            raise ValueError("meta.archived and meta.root must be booleans")
        return {"type": META, "version": int_field("meta.version", body["version"]), "title": title,
                "archived": archived, "qos": None if qos is None else reason("meta.qos", qos), "root": root}
    if kind == PURGED:
        if body["mode"] not in PURGE_MODES:
            raise ValueError(f"purged.mode must be one of {sorted(PURGE_MODES)}")
        return {"type": PURGED, "mode": body["mode"]}
    if kind == PERMISSION_REQUEST:
        return {"type": PERMISSION_REQUEST, "permission": _session_id("permission_request.permission", body["permission"]),
                "tool_call_id": opt_str("permission_request.tool_call_id", body.get("tool_call_id")),
                "tool": opt_str("permission_request.tool", body.get("tool")),
                "arguments": plain(body.get("arguments")),
                "reason": opt_str("permission_request.reason", body.get("reason"))}
    if kind == PERMISSION_RESPONSE:
        if type(body["allow"]) is not bool:
            raise ValueError("permission_response.allow must be a boolean")
        return {"type": PERMISSION_RESPONSE, "permission": _session_id("permission_response.permission",
                                                                            body["permission"]),
                "allow": body["allow"], "note": opt_str("permission_response.note", body.get("note"))}
    if kind == PIN:
        return {"type": PIN, "deadline": int_field("pin.deadline", body["deadline"])}
    if kind == TOOL_CANCEL:
        return {"type": TOOL_CANCEL, "call_id": _session_id("tool_cancel.call_id", body["call_id"])}
    raise ValueError(f"unknown event type {kind!r}")


def open_turn_after(open_turn: int, event_id: int, body: Mapping[str, Any]) -> int:
    """The conversation's open turn (``-1``: none) after event ``event_id`` with
    canonical ``body``, given the one before it: a turn starts only when none is
    open; while one is open only its end (its reply, or ``turn_end``), a
    ``fork`` marker, ``meta`` or ``purged`` may follow.

    Raises:
        ValueError: the event breaks these rules.
    """
    kind = body["type"]
    if kind == TURN:
        if open_turn >= 0:
            raise ValueError(f"turn {open_turn} is still open; a second turn cannot start")
        return event_id
    ends = body.get("turn") if kind in (MESSAGE, TURN_END) else None
    if ends is not None:
        if ends != open_turn:
            raise ValueError(f"event {event_id} ends turn {ends}, but the open turn is {open_turn}")
        return -1
    if kind == MESSAGE and open_turn >= 0:
        raise ValueError(f"turn {open_turn} is open; only its reply can join the conversation")
    return open_turn
