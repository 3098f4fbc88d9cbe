"""Sessions over WebSocket: ``GET /v1/ws``, JSON text messages.

Client to server (``id`` is an optional client reference echoed in replies):

* ``{"op":"generate","id":R,"body":{chat completion body},"resumable":false,"session":S?}``
  starts a generation as a streamed chat request does and follows it from
  cursor 0: ``started``, then ``delta``… and ``done``. With keys configured,
  ``session`` optionally names the new session (``[A-Za-z0-9_.-]{1,128}``, a
  name of the key's tenant); naming one that is generating is refused
  (``session_busy``), one that exists (``session_exists``). With no keys ids
  are server-made and ``session`` naming a new one is 400.
* ``{"op":"subscribe","session":S,"after":N}``: ``subscribed``, then replay
  after token cursor ``N`` (default 0) and follow live.
* ``{"op":"unsubscribe","session":S}``: ``unsubscribed``; no ``delta`` for S after it.
* ``{"op":"cancel","session":S}``: stop S's generation; ``cancelled`` (a
  follower then sees ``done`` with ``finish_reason: "cancelled"``).
* ``{"op":"get","session":S}``: ``{"op":"session","session":{…}}``, the body of
  ``GET /v1/sessions/{id}``.

Conversations (``api/_conversations.py``); ``body`` is the HTTP route's body:

* ``{"op":"create","body":{model, system?, tools?, sampling?, messages?, id?}}``:
  ``{"op":"created","session":C,"info":{…}}``.
* ``{"op":"append","session":C,"body":{"messages":[…]}}``:
  ``{"op":"appended","session":C,"events":[ids]}``.
* ``{"op":"generate","session":C,"body":{max_tokens?, qos?…}?}`` where ``C`` is a
  conversation: a turn; ``started`` (``session`` is its generation session,
  ``conversation`` C, ``turn`` its event id), then ``delta``… and ``done``,
  which also carries the reply that joined the conversation (``message``,
  its ``event``). The turn runs to its end whatever happens to the socket.
* ``{"op":"events","session":C,"after":N?,"limit":L?}``: ``{"op":"events",
  "session":C,"events":[…],"has_more":…}``.
* ``{"op":"fork","session":C,"body":{"at":N?,"id":new?}}``:
  ``{"op":"forked","session":new,"source":C,"info":{…}}``.

The session tree (``body`` as the HTTP route's; replies carry ``info``, the
conversation as ``GET /v1/sessions/{id}`` describes it):

* ``{"op":"rebase","session":C,"body":{edits, id?}}``: ``{"op":"rebased","session":new,"source":C,"info"}``.
* ``{"op":"trim","session":C,"body":{to, id?}}``: ``{"op":"trimmed","session":new,"source":C,"info"}``.
* ``{"op":"purge","session":C,"body":{mode?, expected_version?}}`` (or those fields beside ``op``):
  ``{"op":"purged","session":C,"purged":[ids],"rerooted":[ids]}``.
* ``{"op":"tree","body":{include_archived?}}``: ``{"op":"tree","data":[nodes]}``.
* ``{"op":"meta","session":C,"body":{title?, archived?, qos?, expected_version?}}``: ``{"op":"meta","session":C,"info"}``.
* ``{"op":"tool_calls","session":C}``: ``{"op":"tool_calls","session":C,"data":[calls]}``;
  ``{"op":"tool_result","session":C,"body":{tool_call_id, content | outcome, note?}}``:
  ``{"op":"tool_result","session":C,"events":[ids]}``;
  ``{"op":"tool_cancel","session":C,"body":{tool_call_id}}``: ``{"op":"tool_cancel","session":C,
  "tool_call_id","status":"cancel_requested","event"}``;
  ``{"op":"permission_request","session":C,"body":{tool_call_id?, tool?, arguments?, reason?}}`` and
  ``{"op":"permission_response","session":C,"body":{permission, allow, note?}}``: ``{"op":…,"session":C,
  "permission"}``; ``{"op":"permissions","session":C}``: ``{"op":"permissions","session":C,"data"}``;
  ``{"op":"pin","session":C,"body":{ttl_s}}``: ``{"op":"pin","session":C,"pinned_until"}``.
* ``{"op":"subscribe","session":C,"after":N?}`` where ``C`` is a conversation (``after`` an
  event id, default -1: from its start): ``subscribed``, then ``event {session, event}``,
  ``provisional {session, turn, text}`` and, last, ``ended {session, reason}`` (``lagged``,
  ``purged``, ``shutdown``; ``api/_watch.py``); ``unsubscribe`` ends it.

The unix socket (``--socket``, ``daemon/_socket.py``) speaks these same messages as JSON lines.

Server to client: ``delta {session, cursor, text}``, ``done {session, cursor,
finish_reason, usage}``, ``error {id?, session?, error:{message, type, param,
code}}``, and the replies above. ``cursor`` is the token cursor of the SSE
``id:`` field: subscribing ``after`` the last cursor seen continues byte for
byte. A bad message is an ``error`` reply and the socket stays open.

Limits (:class:`WsLimits`): an inbound message over ``max_message`` closes the
socket with 1009 (hypercorn's ``websocket_max_message_size`` is the same limit,
so it refuses the message while reading it, before buffering more). A socket
with no inbound message for ``--ws-idle-timeout`` seconds while it follows no
session and owns no generation is closed with 1001. Outgoing messages go through a bounded outbox to one writer
task; a producer that finds it full for ``send_stall_s`` closes the socket with
1008 (queued messages are dropped). Followers read the job by cursor, so a slow
reader only coalesces deltas and never buffers tokens. One subscription per
session per socket, at most ``max_subscriptions``.

Lifetimes, one nursery per socket::

    serve_websocket
    ├── writer        outbox -> ASGI send; then the close frame, if one is due
    └── work          cancelled when the socket closes (or must close)
        ├── reader    one message at a time, in order
        ├── follower  one per subscription, in its own cancel scope
        ├── owner     one per generation started here: enters its lane, and leaves it (retires it)
        └── shutdown  waits for the daemon's stop (an event), then closes with 1001 once followers end

Every op on an existing session or conversation answers one of another
tenant exactly as an unknown id (``api/_tenancy.py``).

Closing the socket stops only its followers: resumable generations run on into
the log (``--resume-ttl``); non-resumable ones started on this socket are
cancelled, as an HTTP disconnect cancels its request, and so is a resumable one
whose ``started`` (carrying its session id) never went out.
"""

from __future__ import annotations

import json
import logging
import weakref
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import attrs
import trio

from ..journal import JournalWriteError
from ._lane import log_refusal, open_lane, prepare
from ._http import ApiError, Receive, Send, decode_json
from ._lifecycle import Exchange, access_line, set_exchange
from ._chat import (
    ChatRequest, grammar_from_response_format, max_tokens_from, parse_messages, parse_tool_choice, parse_tools,
    qos_of, render_chat, require_grammar, thinking_kwargs, usage_of,
)
from ._params import integer, sampling_from, stops_from, template_kwargs_from
from ._guard import RateLimited
from ._principal import principal_of
from ._conversations import (
    append_messages, conversation_info, conversation_tree, create_conversation, events_page, fork_conversation,
    own_conversation, patch_meta, permissions, pin_conversation, purge_conversation, rebase_conversation, request_permission,
    respond_permission, tool_calls, tool_cancel, tool_result,
    trim_conversation,
)
from ._watch import watch
from ._sessions import cancel_generation, follower_at, live_session, session_info
from ._tenancy import chosen_id, partition_of, public_id, resolve
from ._turns import landed_summary, start_turn

if TYPE_CHECKING:
    from ..serving import ServedModel
    from ..sessions._resumable import LiveSession
    from ..sched import Job
    from ._host import App

__all__ = ["LIMITS", "WS_PATH", "WsLimits", "chat_job", "serve_stream", "serve_websocket"]

log = logging.getLogger("superfluid.ws")

WS_PATH = "/v1/ws"
CLOSE_GOING_AWAY = 1001  # here: idle for --ws-idle-timeout
CLOSE_POLICY = 1008     # RFC 6455 7.4.1: policy violation (here: the client does not read)
CLOSE_TOO_BIG = 1009    # message too big


@attrs.frozen(kw_only=True)
class WsLimits:
    max_message: int = 1 << 20        # bytes in one inbound message; more closes with 1009
    outbox: int = 32                  # outgoing messages queued for the writer
    send_stall_s: float = 10.0        # a full outbox for this long closes with 1008
    max_subscriptions: int = 64       # per socket


LIMITS = WsLimits()  # read at each connection, so tests can lower it

# Session ids named by ``generate`` between the check and ``start()`` indexing
# them, per SessionStore: two sockets cannot claim one name at once.
_claims: weakref.WeakKeyDictionary[Any, set[str]] = weakref.WeakKeyDictionary()


async def serve_websocket(app: App, scope: dict[str, Any], receive: Receive, send: Send) -> None:
    """Serve one ASGI websocket connection until either side closes it.

    Cancellation: cancelling stops every follower of this socket and cancels
    the non-resumable generations it started; resumable ones go on.

    Resource handling: the socket's tasks all live in one nursery that this
    call owns; nothing it starts outlives it except resumable generations
    (owned by the daemon's session nursery, as for HTTP).
    """
    message = await receive()
    if message["type"] != "websocket.connect":
        return
    if scope.get("path") != WS_PATH:
        await send({"type": "websocket.close", "code": CLOSE_POLICY})  # before accept: HTTP 403
        return
    await send({"type": "websocket.accept"})
    await _Socket(app, scope, send, LIMITS).run(receive)


async def serve_stream(app: App, scope: dict[str, Any], receive: Receive, send: Send) -> None:
    """Serve the ops on an accepted message stream that speaks ASGI's websocket messages
    (the unix socket, ``daemon/_socket.py``): as :func:`serve_websocket` after its accept."""
    await _Socket(app, scope, send, LIMITS).run(receive)


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def _with_ref(msg: dict[str, Any], ref: Any) -> dict[str, Any]:
    if ref is not None:
        msg["id"] = ref
    return msg


class _Socket:
    def __init__(self, app: App, scope: dict[str, Any], send: Send, limits: WsLimits) -> None:
        self.app = app
        self.scope = scope
        self.send = send
        self.limits = limits
        self.outbox, self._outbox_recv = trio.open_memory_channel[dict[str, Any]](limits.outbox)
        self.subs: dict[str, trio.CancelScope] = {}
        self.close_with: tuple[int, str] | None = None
        self.client_gone = False
        self.owned = 0                    # generations started here and not ended (see _own)
        self.announced: set[str] = set()  # sessions whose ``started`` reply went out
        self.close_after: tuple[int, str] | None = None  # a close sent after everything queued (shutdown)
        self._subs_changed = trio.Event()
        self._work: trio.Nursery | None = None

    @property
    def work(self) -> trio.Nursery:
        assert self._work is not None
        return self._work

    async def run(self, receive: Receive) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._write)
            try:
                async with trio.open_nursery() as work:
                    self._work = work
                    work.start_soon(self._close_for_shutdown)  # this socket's own task: nothing else spawns here
                    await self._read(receive)
                    work.cancel_scope.cancel()
            finally:
                self.outbox.close()  # the writer sends what is due and ends
            # Closing by our side: read (and drop) until the peer's close arrives.
            # hypercorn's connection reader waits for us to take each message,
            # so without this it never sees the peer's close frame or EOF.
            while not self.client_gone:
                self.client_gone = (await receive())["type"] == "websocket.disconnect"

    async def _close_for_shutdown(self) -> None:
        """When the daemon stops: once every follower sent its ``server_shutting_down``
        error and the writer took every message, close with 1001.

        It waits for the shutdown in the socket's ``work`` nursery, from the
        start: the stop task only sets an event (``Stopping.begin``), so a
        shutdown that begins while the socket closes finds nothing to do."""
        await self.app.stopping.wait_begun()
        while self.subs:
            self._subs_changed = trio.Event()
            await self._subs_changed.wait()
        # unlike _shut, what is queued still goes out (the errors), then the close frame
        self.close_after = (CLOSE_GOING_AWAY, "the server is shutting down")
        self.work.cancel_scope.cancel()

    def _shut(self, code: int, reason: str) -> None:
        """Close the socket: stop all work; the writer drops what is queued and sends the close frame."""
        if self.close_with is None:
            self.close_with = (code, reason)
            log.info("websocket closed with %d: %s", code, reason)
        self.work.cancel_scope.cancel()

    # -- out -------------------------------------------------------------------------------------------------------

    async def _write(self) -> None:
        async with self._outbox_recv:
            async for msg in self._outbox_recv:
                if self.close_with is not None:
                    break
                # hypercorn's send blocks (shielded) until the peer takes the bytes:
                # a non-reader stops here, and the outbox behind it fills.
                await self.send({"type": "websocket.send", "text": _dumps(msg)})
                if msg["op"] == "started" and "conversation" not in msg:  # (a turn is not owned here)
                    self.announced.add(msg["session"])
        closing = self.close_with or self.close_after
        if closing is not None:
            code, reason = closing
            await self.send({"type": "websocket.close", "code": code, "reason": reason})

    async def _emit(self, msg: dict[str, Any]) -> None:
        """Queue one message; a client that leaves the outbox full for ``send_stall_s`` is closed (1008)."""
        with trio.move_on_after(self.limits.send_stall_s):
            await self.outbox.send(msg)
            return
        self._shut(CLOSE_POLICY, f"the client read nothing for {self.limits.send_stall_s:g} s")
        await trio.lowlevel.checkpoint()  # our scope is cancelled now: this raises Cancelled

    async def _error(self, exc: ApiError, *, ref: Any = None, session: str | None = None) -> None:
        msg: dict[str, Any] = {"op": "error", "error": exc.body()["error"]}
        if isinstance(exc, RateLimited):
            msg["retry_after"] = exc.retry_after
        if session is not None:
            msg["session"] = session
        await self._emit(_with_ref(msg, ref))

    # -- in --------------------------------------------------------------------------------------------------------

    async def _read(self, receive: Receive) -> None:
        idle_s = self.app.config.ws_idle_timeout_s
        while True:
            with trio.move_on_after(idle_s) as waited:
                message = await receive()
            if waited.cancelled_caught:
                if self.subs or self.owned:
                    continue  # something to follow: not idle
                self._shut(CLOSE_GOING_AWAY, f"idle: no message and no session to follow for {idle_s:g} s")
                return
            if message["type"] == "websocket.disconnect":
                self.client_gone = True
                return
            if message["type"] != "websocket.receive":
                continue
            text = message.get("text")
            data = text.encode() if text is not None else bytes(message.get("bytes") or b"")
            if len(data) > self.limits.max_message:
                self._shut(CLOSE_TOO_BIG, f"message of {len(data)} bytes; the limit is {self.limits.max_message}")
                return
            await self._dispatch(data)

    async def _dispatch(self, data: bytes) -> None:
        ref: Any = None
        sid: str | None = None
        try:
            msg = decode_json(data, what="message", code="invalid_message")
            ref = msg.get("id")
            sid = msg.get("session") if isinstance(msg.get("session"), str) else None
            refusal = self.app.guard.charge(self.scope, principal_of(self.scope))  # each op pays, as a request does
            if refusal is not None:
                raise refusal
            op = msg.get("op")
            handler = _OPS.get(op) if isinstance(op, str) else None
            if handler is None:
                raise ApiError(400, f"unknown op {op!r}; expected one of {', '.join(sorted(_OPS))}",
                               code="unknown_op", param="op")
            await handler(self, msg, ref)
        except ApiError as exc:
            await self._error(exc, ref=ref, session=sid)
        except JournalWriteError as exc:  # a full disk: typed as over HTTP (507), no traceback
            await self._error(log_refusal(exc), ref=ref, session=sid)
        except Exception as exc:  # noqa: BLE001 -- boundary: one message; the socket goes on
            log.exception("unhandled error on a websocket message")
            await self._error(ApiError(500, f"internal error: {type(exc).__name__}: {exc}"), ref=ref, session=sid)

    # -- ops -------------------------------------------------------------------------------------------------------

    async def _op_generate(self, msg: dict[str, Any], ref: Any) -> None:
        named = msg.get("session")
        own = resolve(self.app, self.scope, named) if isinstance(named, str) else None
        if own is not None and self.app.conversations.get(own) is not None:
            await self._generate_turn(named, own, _body_of(msg), ref)
            return
        body = msg.get("body")
        if not isinstance(body, dict):
            raise ApiError(400, "invalid message: generate needs a body object (a chat completion body)",
                           code="invalid_message", param="body")
        resumable = msg.get("resumable", False)
        if not isinstance(resumable, bool):
            raise ApiError(400, "invalid message: resumable must be a boolean", code="invalid_message",
                           param="resumable")
        if not self.app.accepting:
            raise ApiError(503, "the server is draining and accepts no new requests", code="draining")
        self._check_room()
        sid = None if named is None else chosen_id(self.app, self.scope, named, "session")
        claims = _claims.setdefault(self.app.sessions, set())
        if sid is not None:
            self._check_unused(sid, claims)
            claims.add(sid)
        try:
            model, job, stops = await chat_job(self.app, self.scope, body)
            if sid is not None:
                job.session = sid
            # the lane (and the key's slot, api/_admission.py) is entered and left in ``_own``'s task;
            # a refusal (429, 503, 507) comes back here
            session = await self.work.start(self._own, model, job, stops, resumable)
        finally:
            if sid is not None:
                claims.discard(sid)
        await self._emit(_with_ref({"op": "started", "session": public_id(session.id), "model": model.name,
                                    "resumable": resumable}, ref))
        self._follow(session, 0, ack=None)

    async def _generate_turn(self, cid: str, own: str, body: dict[str, Any], ref: Any) -> None:
        self._check_room()
        turn = await start_turn(self.app, self.scope, own, body)
        assert turn.session is not None
        await self._emit(_with_ref({"op": "started", "session": turn.generation, "conversation": cid,
                                    "turn": turn.event_id, "model": turn.session.model, "resumable": True}, ref))
        self._follow(turn.session, 0, ack=None)

    async def _op_create(self, msg: dict[str, Any], ref: Any) -> None:
        info = await create_conversation(self.app, self.scope, _body_of(msg))
        await self._emit(_with_ref({"op": "created", "session": info["id"], "info": info}, ref))

    async def _op_append(self, msg: dict[str, Any], ref: Any) -> None:
        sid = _session_of(msg)
        done = await append_messages(self.app, own_conversation(self.app, self.scope, sid), _body_of(msg))
        await self._emit(_with_ref({"op": "appended", "session": sid, "events": done["events"]}, ref))

    async def _op_events(self, msg: dict[str, Any], ref: Any) -> None:
        sid = _session_of(msg)
        after, limit = msg.get("after", -1), msg.get("limit", 1000)
        for name, value, lo in (("after", after, -1), ("limit", limit, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < lo:
                raise ApiError(400, f"invalid message: {name} must be an integer >= {lo}", code="invalid_message",
                               param=name)
        page = events_page(self.app, own_conversation(self.app, self.scope, sid), after=after,
                           limit=min(limit, 10_000))
        await self._emit(_with_ref({"op": "events", "session": sid, "events": page["events"],
                                    "has_more": page["has_more"], "last_event_id": page["last_event_id"]}, ref))

    async def _op_fork(self, msg: dict[str, Any], ref: Any) -> None:
        sid = _session_of(msg)
        info = await fork_conversation(self.app, self.scope, own_conversation(self.app, self.scope, sid),
                                       _body_of(msg))
        await self._emit(_with_ref({"op": "forked", "session": info["id"], "source": sid, "info": info}, ref))

    def _check_unused(self, sid: str, claims: set[str]) -> None:
        live = self.app.sessions.live.get(sid)
        name = public_id(sid)
        if sid in claims or (live is not None and not live.job.done):
            raise ApiError(409, f"session '{name}' is generating; cancel it or wait for its done before "
                           "generating on it again", code="session_busy", param="session")
        if live is not None or sid in self.app.sessions.journal.sessions:
            raise ApiError(409, f"session '{name}' already exists; name a new session", code="session_exists",
                           param="session")

    def _check_room(self) -> None:
        if len(self.subs) >= self.limits.max_subscriptions:
            raise ApiError(429, f"this socket already follows {len(self.subs)} sessions (the limit)",
                           code="too_many_subscriptions")

    async def _op_rebase(self, msg: dict[str, Any], ref: Any) -> None:
        sid = _session_of(msg)
        info = await rebase_conversation(self.app, self.scope, own_conversation(self.app, self.scope, sid),
                                         _body_of(msg))
        await self._emit(_with_ref({"op": "rebased", "session": info["id"], "source": sid, "info": info}, ref))

    async def _op_trim(self, msg: dict[str, Any], ref: Any) -> None:
        sid = _session_of(msg)
        info = await trim_conversation(self.app, self.scope, own_conversation(self.app, self.scope, sid),
                                       _body_of(msg))
        await self._emit(_with_ref({"op": "trimmed", "session": info["id"], "source": sid, "info": info}, ref))

    async def _op_purge(self, msg: dict[str, Any], ref: Any) -> None:
        sid = _session_of(msg)
        body = {**{k: msg[k] for k in ("mode", "expected_version") if k in msg}, **_body_of(msg)}
        for key in body:
            if key not in ("mode", "expected_version"):
                raise ApiError(400, f"invalid message: unknown field {key!r}", code="invalid_message", param=key)
        done = await purge_conversation(self.app, self.scope, own_conversation(self.app, self.scope, sid),
                                        mode=body.get("mode", "reroot"), expected_version=body.get("expected_version"))
        await self._emit(_with_ref({"op": "purged", "session": sid, "purged": done["purged"],
                                    "rerooted": done["rerooted"]}, ref))

    async def _op_tree(self, msg: dict[str, Any], ref: Any) -> None:
        archived = _body_of(msg).get("include_archived", msg.get("include_archived", False))
        if not isinstance(archived, bool):
            raise ApiError(400, "invalid message: include_archived must be a boolean", code="invalid_message",
                           param="include_archived")
        tree = conversation_tree(self.app, self.scope, include_archived=archived)
        await self._emit(_with_ref({"op": "tree", "data": tree["data"]}, ref))

    async def _op_meta(self, msg: dict[str, Any], ref: Any) -> None:
        sid = _session_of(msg)
        info = await patch_meta(self.app, self.scope, own_conversation(self.app, self.scope, sid), _body_of(msg))
        await self._emit(_with_ref({"op": "meta", "session": sid, "info": info}, ref))

    async def _op_tool_calls(self, msg: dict[str, Any], ref: Any) -> None:
        sid = _session_of(msg)
        calls = tool_calls(self.app, own_conversation(self.app, self.scope, sid))
        await self._emit(_with_ref({"op": "tool_calls", "session": sid, "data": calls["data"]}, ref))

    async def _op_tool_result(self, msg: dict[str, Any], ref: Any) -> None:
        sid = _session_of(msg)
        done = await tool_result(self.app, own_conversation(self.app, self.scope, sid), _body_of(msg))
        await self._emit(_with_ref({"op": "tool_result", "session": sid, "events": done["events"]}, ref))

    async def _op_tool_cancel(self, msg: dict[str, Any], ref: Any) -> None:
        sid = _session_of(msg)
        body = _body_of(msg)
        call_id = body.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise ApiError(400, "invalid message: body.tool_call_id must be a string", code="invalid_message",
                           param="tool_call_id")
        done = await tool_cancel(self.app, own_conversation(self.app, self.scope, sid), call_id,
                                 {k: v for k, v in body.items() if k != "tool_call_id"})
        await self._emit(_with_ref({"op": "tool_cancel", "session": sid, "tool_call_id": call_id,
                                    "status": done["status"], "event": done["event"]}, ref))

    async def _op_permission_request(self, msg: dict[str, Any], ref: Any) -> None:
        sid = _session_of(msg)
        done = await request_permission(self.app, own_conversation(self.app, self.scope, sid), _body_of(msg))
        await self._emit(_with_ref({"op": "permission_request", "session": sid, "permission": done}, ref))

    async def _op_permission_response(self, msg: dict[str, Any], ref: Any) -> None:
        sid = _session_of(msg)
        body = dict(_body_of(msg))
        pid = body.pop("permission", None)
        if not isinstance(pid, str) or not pid:
            raise ApiError(400, "invalid message: body.permission must name a permission request",
                           code="invalid_message", param="permission")
        done = await respond_permission(self.app, own_conversation(self.app, self.scope, sid), pid, body)
        await self._emit(_with_ref({"op": "permission_response", "session": sid, "permission": done}, ref))

    async def _op_pin(self, msg: dict[str, Any], ref: Any) -> None:
        sid = _session_of(msg)
        done = await pin_conversation(self.app, own_conversation(self.app, self.scope, sid), _body_of(msg))
        await self._emit(_with_ref({"op": "pin", "session": sid, "pinned_until": done["pinned_until"]}, ref))

    async def _op_permissions(self, msg: dict[str, Any], ref: Any) -> None:
        sid = _session_of(msg)
        listed = permissions(self.app, own_conversation(self.app, self.scope, sid))
        await self._emit(_with_ref({"op": "permissions", "session": sid, "data": listed["data"]}, ref))

    def _watch(self, sid: str, cid: str, after: Any, ref: Any) -> None:
        """Subscribe to conversation ``cid`` (called ``sid``) from event cursor ``after``."""
        if isinstance(after, bool) or not isinstance(after, int) or after < -1:
            raise ApiError(400, "invalid message: after must be an event id (or -1: from the start)",
                           code="invalid_message", param="after")
        if sid in self.subs:
            raise ApiError(409, f"this socket already follows session '{sid}'; unsubscribe first",
                           code="already_subscribed")
        self._check_room()
        scope = trio.CancelScope()
        self.subs[sid] = scope
        self.work.start_soon(self._run_watch, sid, cid, after, scope,
                             _with_ref({"op": "subscribed", "session": sid, "after": after}, ref))

    async def _run_watch(self, sid: str, cid: str, after: int, scope: trio.CancelScope, ack: dict[str, Any]) -> None:
        async def emit(kind: str, data: dict[str, Any]) -> None:
            if kind == "committed":
                await self._emit({"op": "event", "session": sid, "event": data})
            else:
                await self._emit({"op": kind, "session": sid, **data})

        try:
            with scope:
                await self._emit(ack)
                await watch(self.app, cid, after, emit)
        finally:
            if self.subs.get(sid) is scope:
                del self.subs[sid]
                self._subs_changed.set()

    async def _op_subscribe(self, msg: dict[str, Any], ref: Any) -> None:
        named = _session_of(msg)
        own = resolve(self.app, self.scope, named)
        if own is not None and self.app.conversations.get(own) is not None:
            self._watch(named, own, msg.get("after", -1), ref)
            return
        session = live_session(self.app, self.scope, named)
        after = msg.get("after", 0)
        n = len(session.job.tokens)
        if isinstance(after, bool) or not isinstance(after, int) or not 0 <= after <= n:
            raise ApiError(400, f"invalid message: after must be a token cursor in 0..{n}", code="invalid_message",
                           param="after")
        self._follow(session, after, ack=_with_ref({"op": "subscribed", "session": public_id(session.id),
                                                    "cursor": after}, ref))

    async def _op_unsubscribe(self, msg: dict[str, Any], ref: Any) -> None:
        sid = _session_of(msg)
        scope = self.subs.pop(sid, None)
        if scope is None:
            raise ApiError(404, f"this socket does not follow session '{sid}'", code="not_subscribed")
        scope.cancel()  # its next checkpoint raises: nothing more of it reaches the outbox
        await self._emit(_with_ref({"op": "unsubscribed", "session": sid}, ref))

    async def _op_cancel(self, msg: dict[str, Any], ref: Any) -> None:
        sid = _session_of(msg)
        await cancel_generation(self.app, self.scope, sid)
        await self._emit(_with_ref({"op": "cancelled", "session": sid}, ref))

    async def _op_get(self, msg: dict[str, Any], ref: Any) -> None:
        sid = _session_of(msg)
        own = resolve(self.app, self.scope, sid)
        if own is not None and self.app.conversations.get(own) is not None:
            info = conversation_info(self.app, own)  # as GET /v1/sessions/{id} describes a conversation
        else:
            info = session_info(self.app, self.scope, sid)
        await self._emit(_with_ref({"op": "session", "session": info}, ref))

    # -- tasks -----------------------------------------------------------------------------------------------------

    def _follow(self, session: LiveSession, cursor: int, *, ack: dict[str, Any] | None) -> None:
        """Start following ``session`` after ``cursor``; ``ack`` is sent first (before any delta).

        Raises:
            ApiError: 409 ``already_subscribed``; 429 ``too_many_subscriptions``.
        """
        sid = public_id(session.id)  # a socket is one tenant's: its names do not collide
        if sid in self.subs:
            raise ApiError(409, f"this socket already follows session '{sid}'; unsubscribe first",
                           code="already_subscribed")
        self._check_room()
        scope = trio.CancelScope()
        self.subs[sid] = scope
        self.work.start_soon(self._run_follower, session, cursor, scope, ack)

    async def _run_follower(self, session: LiveSession, cursor: int, scope: trio.CancelScope,
                            ack: dict[str, Any] | None) -> None:
        sid = public_id(session.id)
        follower = follower_at(session, cursor)
        session.attach()
        exchange = Exchange(method="WS", path=WS_PATH, started=trio.current_time(), stopping=self.app.stopping,
                            status=101)
        exchange.jobs.append((session.model, session.job))
        set_exchange(exchange)  # this task's: its line, and its reads end at shutdown
        try:
            with scope:
                if ack is not None:
                    await self._emit(ack)
                while True:
                    try:
                        text, _rows, done = await follower.next_delta()
                    except ApiError as exc:
                        exchange.error = exc.code or str(exc.status)
                        await self._error(exc, session=sid)
                        return
                    if text:
                        await self._emit({"op": "delta", "session": sid, "cursor": follower.cursor, "text": text})
                    if done:
                        last = {"op": "done", "session": sid, "cursor": follower.cursor,
                                "finish_reason": follower.finish, "usage": usage_of(session.job)}
                        turn = self.app.conversations.turn(session.id)
                        if turn is not None:  # a conversation's turn: done once its reply joined it
                            last.update(await landed_summary(turn), finish_reason=turn.finish or follower.finish)
                        await self._emit(last)
                        return
        finally:
            session.detach()
            if self.subs.get(sid) is scope:
                del self.subs[sid]
                self._subs_changed.set()
            access_line(exchange)

    async def _own(self, model: ServedModel, job: Job, stops: list[str], resumable: bool, *,
                   task_status: trio.TaskStatus[LiveSession] = trio.TASK_STATUS_IGNORED) -> None:
        """Hold a generation started on this socket (its lane) until it ends or the
        socket closes; started (``task_status``, its session) once the lane is
        open. The lane is entered and left in this task. A resumable generation
        whose ``started`` never reached the client is stopped too: nobody has its
        id to resume it."""
        async with open_lane(self.app, model, job, kind="chat", stops=stops, resumable=resumable) as lane:
            self.owned += 1
            try:
                task_status.started(lane.session)
                while not job.done:
                    await job.wait_beyond(len(job.tokens))
            finally:
                self.owned -= 1
                lane.keep = resumable and job.session in self.announced  # leaving retires it unless kept
                self.announced.discard(job.session)


def _body_of(msg: dict[str, Any]) -> dict[str, Any]:
    body = msg.get("body", {})
    if not isinstance(body, dict):
        raise ApiError(400, "invalid message: body must be an object", code="invalid_message", param="body")
    return body


def _session_of(msg: dict[str, Any]) -> str:
    sid = msg.get("session")
    if not isinstance(sid, str) or not sid:
        raise ApiError(400, "invalid message: session (a session id) is required", code="invalid_message",
                       param="session")
    return sid


_OPS: dict[str, Callable[[_Socket, dict[str, Any], Any], Awaitable[None]]] = {
    "generate": _Socket._op_generate,
    "subscribe": _Socket._op_subscribe,
    "unsubscribe": _Socket._op_unsubscribe,
    "cancel": _Socket._op_cancel,
    "get": _Socket._op_get,
    "create": _Socket._op_create,
    "append": _Socket._op_append,
    "events": _Socket._op_events,
    "fork": _Socket._op_fork,
    "rebase": _Socket._op_rebase,
    "trim": _Socket._op_trim,
    "purge": _Socket._op_purge,
    "tree": _Socket._op_tree,
    "meta": _Socket._op_meta,
    "tool_calls": _Socket._op_tool_calls,
    "tool_result": _Socket._op_tool_result,
    "tool_cancel": _Socket._op_tool_cancel,
    "permission_request": _Socket._op_permission_request,
    "permission_response": _Socket._op_permission_response,
    "permissions": _Socket._op_permissions,
    "pin": _Socket._op_pin,
}


async def chat_job(app: App, scope: dict[str, Any], body: dict[str, Any]) -> tuple[ServedModel, Job, list[str]]:
    """A chat completion body as a prepared (not yet started) job and its stop strings.

    The same parsing and rendering as a resumable ``/v1/chat/completions``
    stream: text only (no ``tools``, no ``logprobs``); ``stream`` is ignored.

    Raises:
        ApiError: whatever the HTTP route would answer with a 4xx/5xx.
    """
    partition = partition_of(scope, body)
    model = await app.resolve_model(body.get("model"))
    klass = qos_of(app, scope)
    if integer(body, "n", lo=1, hi=128, default=1) != 1:
        raise ApiError(400, "n > 1 is not supported yet", code="unsupported_parameter", param="n")
    if body.get("logprobs") not in (None, False):
        raise ApiError(400, "logprobs are not carried on WebSocket streams", code="unsupported_parameter",
                       param="logprobs")
    if parse_tools(body.get("tools")):
        raise ApiError(400, "WebSocket streams do not carry tool calls yet", code="unsupported_parameter",
                       param="tools")
    parse_tool_choice(body.get("tool_choice"), [])
    kwargs = template_kwargs_from(body)
    sampling = sampling_from(body, n_vocab=int(model.info.get("n_vocab", 1 << 30)))
    req = ChatRequest(
        messages=parse_messages(body), sampling=sampling, max_tokens=max_tokens_from(body),
        grammar=grammar_from_response_format(body.get("response_format")),
        template_kwargs=thinking_kwargs(model.template.source, kwargs, enable=body.get("enable_thinking"),
                                        effort=body.get("reasoning_effort")),
        stops=stops_from(body), ignore_eos=bool(body.get("ignore_eos", False)))
    rendered = render_chat(model, req)
    if rendered.grammar:
        require_grammar(model, req.grammar_param)
        sampling = attrs.evolve(sampling, grammar=rendered.grammar)
    job = await prepare(model, rendered.segments, sampling=sampling, max_tokens=req.max_tokens, klass=klass,
                        partition=partition, ignore_eos=req.ignore_eos)
    return model, job, [*req.stops, *rendered.stops]
