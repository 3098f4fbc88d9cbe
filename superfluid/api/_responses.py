"""OpenAI Responses dialect: ``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``.

Input items become chat messages for the shared core; output is
``reasoning``, ``message`` and ``function_call`` items. Streams are typed
``response.*`` SSE events with a ``sequence_number`` from 0 and no ``[DONE]``;
a failure after the stream began is an ``error`` event then
``response.failed``.

A finished response is stored unless the request said ``store: false``
(OpenAI's default is to store): ``previous_response_id`` continues its
conversation, ``GET /v1/responses/{id}`` returns it and ``DELETE`` forgets it.
Only its tenant sees it: for another key it is an unknown id (404). The store
is in memory (per app), bounded per tenant by count and bytes with the oldest
evicted first, and by bytes across tenants: it does not survive a restart
until the session log carries responses.
"""

from __future__ import annotations

import json
import re
import secrets
import time
import weakref
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import attrs

from ..chat import ToolCall
from ..proto import encode_sse_json
from ._http import ApiError, Receive, Send, send_json
from ._principal import principal_of
from ._chat import (
    ChatRequest, Reply, grammar_from_response_format, open_reply, parse_tool_choice, qos_of, thinking_kwargs,
    tool_from,
)
from ._sse import SseResponse
from ._tenancy import partition_of
from ._params import integer, sampling_from

if TYPE_CHECKING:
    from ._host import App

__all__ = ["ResponseStore", "responses", "route_responses"]

MAX_STORED = 1024                 # responses kept per tenant; the oldest goes first
MAX_STORED_BYTES = 64 << 20       # bytes of them (as JSON) per tenant
MAX_TOTAL_BYTES = 256 << 20       # bytes of them across tenants
_UNSUPPORTED = ("background", "conversation", "prompt")
_ROUTE = re.compile(r"/v1/responses/([A-Za-z0-9_-]{1,128})")


@attrs.frozen
class _Stored:
    model: str
    messages: list[dict[str, Any]]  # the conversation after this response, without instructions
    tenant: str = ""                # only its tenant may continue, read or delete it
    response: dict[str, Any] = attrs.field(factory=dict)   # the response object, as GET returns it
    size: int = 0                   # bytes it holds (JSON of ``messages`` and ``response``)


class ResponseStore:
    """Bounded in-memory store of finished responses: per tenant at most ``limit``
    of them and ``max_bytes`` of JSON, across tenants ``max_total_bytes``; the
    oldest (of the tenant, then of all) is evicted first."""

    def __init__(self, limit: int = MAX_STORED, max_bytes: int = MAX_STORED_BYTES,
                 max_total_bytes: int = MAX_TOTAL_BYTES) -> None:
        self.limit = limit
        self.max_bytes = max_bytes
        self.max_total_bytes = max_total_bytes
        self._items: OrderedDict[str, _Stored] = OrderedDict()     # every tenant's, oldest first
        self._tenants: dict[str, OrderedDict[str, None]] = {}      # each tenant's ids, oldest first
        self._bytes: dict[str, int] = {}
        self.total_bytes = 0

    def get(self, rid: str, tenant: str | None = None) -> _Stored | None:
        """The stored response ``rid``; None if there is none, or (given ``tenant``) it is another tenant's."""
        item = self._items.get(rid)
        return None if item is None or (tenant is not None and item.tenant != tenant) else item

    def put(self, rid: str, item: _Stored) -> None:
        if item.size > min(self.max_bytes, self.max_total_bytes):
            return  # larger than its tenant may keep: not stored (a later GET answers 404)
        self.delete(rid)
        self._items[rid] = item
        self._tenants.setdefault(item.tenant, OrderedDict())[rid] = None
        self._bytes[item.tenant] = self._bytes.get(item.tenant, 0) + item.size
        self.total_bytes += item.size
        mine = self._tenants[item.tenant]
        while len(mine) > self.limit or self._bytes[item.tenant] > self.max_bytes:
            self.delete(next(iter(mine)))
        while self.total_bytes > self.max_total_bytes:
            self.delete(next(iter(self._items)))

    def delete(self, rid: str, tenant: str | None = None) -> bool:
        """Forget ``rid`` (given ``tenant``, only if it is that tenant's); whether it was stored."""
        item = self.get(rid, tenant)
        if item is None:
            return False
        del self._items[rid]
        mine = self._tenants[item.tenant]
        del mine[rid]
        self._bytes[item.tenant] -= item.size
        self.total_bytes -= item.size
        if not mine:
            del self._tenants[item.tenant], self._bytes[item.tenant]
        return True

    def usage(self, tenant: str) -> tuple[int, int]:
        """``(responses, bytes)`` the tenant keeps."""
        return len(self._tenants.get(tenant, ())), self._bytes.get(tenant, 0)


_STORES: weakref.WeakKeyDictionary[Any, ResponseStore] = weakref.WeakKeyDictionary()


def _store(app: App) -> ResponseStore:
    store = _STORES.get(app)
    if store is None:
        store = _STORES[app] = ResponseStore()
    return store


def _parts_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"invalid request: {where}.content must be a string or an array", param="input")
    out = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text"):
            out.append(str(part.get("text", "")))
        elif kind in ("input_image", "input_audio", "input_file"):
            raise ApiError(400, f"this model takes text only; {kind} is not supported",
                           code="unsupported_input", param="input")
        else:
            raise ApiError(400, f"invalid request: unknown content part {kind!r} in {where}", param="input")
    return "".join(out)


def input_messages(value: Any, history: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Responses ``input`` (a string or items) as OpenAI-shaped messages, after ``history``.

    Raises:
        ApiError: malformed or unsupported items.
    """
    out: list[dict[str, Any]] = [dict(m) for m in history or ()]
    if isinstance(value, str):
        return [*out, {"role": "user", "content": value}]
    if not isinstance(value, list):
        raise ApiError(400, "invalid request: input must be a string or an array of items", param="input")
    reasoning = ""
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise ApiError(400, f"invalid request: input[{i}] must be an object", param="input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            role = "system" if role == "developer" else role   # (a list or object role is refused below)
            if role not in ("system", "user", "assistant"):
                raise ApiError(400, f"invalid request: input[{i}].role {str(role)[:80]!r} is not supported",
                               param=f"input[{i}].role")
            msg: dict[str, Any] = {"role": role, "content": _parts_text(item.get("content"), f"input[{i}]")}
            if role == "assistant" and reasoning:
                msg["reasoning_content"], reasoning = reasoning, ""
            out.append(msg)
        elif kind == "function_call":
            call = {"id": str(item.get("call_id", "")), "type": "function",
                    "function": {"name": str(item.get("name", "")), "arguments": str(item.get("arguments", "{}"))}}
            if out and out[-1]["role"] == "assistant":  # calls after an assistant message join its turn
                out[-1]["tool_calls"] = [*out[-1].get("tool_calls", ()), call]
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
            if reasoning:
                out[-1]["reasoning_content"], reasoning = reasoning, ""
        elif kind == "function_call_output":
            output = item.get("output", "")
            out.append({"role": "tool", "tool_call_id": str(item.get("call_id", "")),
                        "content": output if isinstance(output, str) else _parts_text(output, f"input[{i}]")})
        elif kind == "reasoning":
            parts = item.get("content") or []
            if not isinstance(parts, list):
                raise ApiError(400, f"invalid request: input[{i}].content must be an array", param=f"input[{i}].content")
            reasoning += "".join(str(c.get("text", "")) for c in parts if isinstance(c, dict))
        else:
            raise ApiError(400, f"input item type {kind!r} is not supported", code="unsupported_parameter",
                           param="input")
    return out


def _tools(value: Any) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise ApiError(400, "invalid request: tools must be an array", param="tools")
    tools = []
    for i, t in enumerate(value):
        kind = t.get("type") if isinstance(t, dict) else None
        if kind == "function":
            tools.append(tool_from(t.get("name"), t.get("description"), t.get("parameters"), f"tools[{i}]"))
        elif kind == "namespace":
            for member in t.get("tools") or ():
                tools.append(tool_from(f"{t.get('name')}.{member.get('name')}", member.get("description"),
                                       member.get("parameters"), f"tools[{i}]"))
        else:
            raise ApiError(400, f"built-in tool {kind!r} is not supported", code="unsupported_tool", param=f"tools[{i}]")
    return tools


def _text_grammar(text: Any) -> str:
    if text is None:
        return ""
    fmt = text.get("format") if isinstance(text, dict) else None
    if not isinstance(fmt, dict) or fmt.get("type") in (None, "text"):
        return ""
    if fmt.get("type") == "json_schema":
        return grammar_from_response_format({"type": "json_schema", "json_schema": {"schema": fmt.get("schema")}})
    return grammar_from_response_format(fmt)


def _new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


async def responses(app: App, scope: dict[str, Any], receive: Receive, send: Send, body: dict[str, Any]) -> None:
    for key in _UNSUPPORTED:
        if body.get(key):
            raise ApiError(400, f"{key} is not supported", code="unsupported_parameter", param=key)
    store = _store(app)
    partition = partition_of(scope, body)
    prev_id = body.get("previous_response_id")
    history: list[dict[str, Any]] = []
    model_name = body.get("model")
    if prev_id is not None:
        prev = store.get(prev_id) if isinstance(prev_id, str) else None
        if prev is None or prev.tenant != partition.tenant:  # another tenant's answers as a missing one
            raise ApiError(400, f"previous response '{prev_id}' not found", code="previous_response_not_found",
                           param="previous_response_id")
        history = list(prev.messages)
        model_name = model_name or prev.model
    model = await app.resolve_model(model_name)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "invalid request: stream must be a boolean", param="stream")
    conversation = input_messages(body.get("input", []), history)
    if not conversation:
        raise ApiError(400, "invalid request: input must not be empty", param="input")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise ApiError(400, "invalid request: instructions must be a string", param="instructions")
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + conversation
    tools = _tools(body.get("tools"))
    reasoning = body.get("reasoning") if isinstance(body.get("reasoning"), dict) else {}
    req = ChatRequest(
        messages=messages, sampling=sampling_from({k: body.get(k) for k in ("temperature", "top_p", "seed")},
                                                  n_vocab=int(model.info.get("n_vocab", 1 << 30))),
        max_tokens=integer(body, "max_output_tokens", lo=1, hi=10_000_000), tools=tools,
        choice=parse_tool_choice(body.get("tool_choice"), tools), grammar=_text_grammar(body.get("text")),
        grammar_param="text.format",
        template_kwargs=thinking_kwargs(model.template.source, {}, effort=reasoning.get("effort"),
                                        param="reasoning.effort"))
    base = {
        "id": _new_id("resp"), "object": "response", "created_at": int(time.time()), "model": model.name,
        "previous_response_id": prev_id, "store": body.get("store", True) is not False,
        "instructions": instructions, "metadata": body.get("metadata") or {},
        "parallel_tool_calls": body.get("parallel_tool_calls", True) is not False,
        "temperature": body.get("temperature"), "top_p": body.get("top_p"),
        "tool_choice": body.get("tool_choice") or "auto", "tools": body.get("tools") or [],
        "text": body.get("text") or {"format": {"type": "text"}}, "max_output_tokens": body.get("max_output_tokens"),
        "truncation": body.get("truncation") or "disabled", "error": None, "incomplete_details": None,
        "output": [], "status": "in_progress", "usage": None,
    }
    async with open_reply(app, model, req, klass=qos_of(app, scope), partition=partition) as reply:
        if stream:
            final = await _stream(send, reply, base)
        else:
            final = await _whole(reply, base)
        if final["store"] and final["status"] in ("completed", "incomplete"):
            kept = conversation + _as_messages(final["output"])
            size = len(json.dumps(kept, ensure_ascii=False)) + len(json.dumps(final, ensure_ascii=False))
            store.put(final["id"], _Stored(model.name, kept, partition.tenant, final, size))
        if not stream:
            await send_json(send, 200, final)


async def route_responses(app: App, scope: dict[str, Any], receive: Receive, send: Send) -> bool:
    """``GET`` / ``DELETE /v1/responses/{id}``; False if the path is not one. Another tenant's
    response, one stored with ``store: false`` and one evicted are all unknown ids (404)."""
    m = _ROUTE.fullmatch(scope["path"])
    if m is None:
        return False
    rid, method, store = m.group(1), scope["method"], _store(app)
    tenant = principal_of(scope).tenant
    if method == "GET":
        item = store.get(rid, tenant)
        if item is None:
            raise _not_found(rid)
        await send_json(send, 200, item.response)
    elif method == "DELETE":
        if not store.delete(rid, tenant):
            raise _not_found(rid)
        await send_json(send, 200, {"id": rid, "object": "response", "deleted": True})
    else:
        raise ApiError(405, f"method {method} not allowed on {scope['path']}")
    return True


def _not_found(rid: str) -> ApiError:
    return ApiError(404, f"Response with id '{rid}' not found.", code="response_not_found", param="response_id")


def _as_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    msg: dict[str, Any] = {"role": "assistant", "content": ""}
    for item in output:
        if item["type"] == "message":
            msg["content"] += "".join(p["text"] for p in item["content"])
        elif item["type"] == "function_call":
            msg.setdefault("tool_calls", []).append({"id": item["call_id"], "type": "function", "function": {
                "name": item["name"], "arguments": item["arguments"]}})
        elif item["type"] == "reasoning":
            msg["reasoning_content"] = "".join(p["text"] for p in item.get("content") or ())
    return [msg]


def _finished(base: dict[str, Any], reply: Reply, output: list[dict[str, Any]]) -> dict[str, Any]:
    job = reply.job
    reasoning_tokens = 0
    incomplete = reply.finish == "length"
    return {**base, "output": output, "status": "incomplete" if incomplete else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "usage": {"input_tokens": len(job.prompt), "input_tokens_details": {"cached_tokens": job.cached,
                                                                                "cache_write_tokens": 0},
                      "output_tokens": len(job.tokens), "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
                      "total_tokens": len(job.prompt) + len(job.tokens)}}


def _call_item(call: ToolCall, status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": "fc_" + call.id.removeprefix("call_"), "call_id": call.id,
            "name": call.name, "arguments": call.arguments, "status": status}


def _text_item(mid: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": mid, "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _reasoning_item(rid: str, text: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": rid, "summary": [], "content": [{"type": "reasoning_text", "text": text}]}


async def _whole(reply: Reply, base: dict[str, Any]) -> dict[str, Any]:
    content, thinking, _rows = await reply.collect()
    output: list[dict[str, Any]] = []
    if thinking:
        output.append(_reasoning_item(_new_id("rs"), thinking))
    if content.strip() or not reply.calls:
        output.append(_text_item(_new_id("msg"), content))
    output += [_call_item(c) for c in reply.calls]
    return _finished(base, reply, output)


async def _stream(send: Send, reply: Reply, base: dict[str, Any]) -> dict[str, Any]:
    seq = 0
    sse = SseResponse(send, done=False)

    def frame(kind: str, **fields: Any) -> bytes:
        nonlocal seq
        data = encode_sse_json({"type": kind, "sequence_number": seq, **fields}, event=kind)
        seq += 1
        return data

    async def emit(kind: str, more: bool = True, **fields: Any) -> None:
        data = frame(kind, **fields)
        await (sse.send(data) if more else sse.end(data))

    await reply.wait_admitted()
    await sse.start()
    await emit("response.created", response=base)
    await emit("response.in_progress", response=base)
    output: list[dict[str, Any]] = []
    current: dict[str, Any] | None = None  # the open reasoning or message item
    acc = ""

    async def close() -> None:
        nonlocal current, acc
        if current is None:
            return
        idx, iid = len(output), current["id"]
        if current["type"] == "reasoning":
            item = _reasoning_item(iid, acc)
            await emit("response.reasoning_text.done", item_id=iid, output_index=idx, content_index=0, text=acc)
        else:
            item = _text_item(iid, acc)
            await emit("response.output_text.done", item_id=iid, output_index=idx, content_index=0, text=acc,
                       logprobs=[])
        await emit("response.content_part.done", item_id=iid, output_index=idx, content_index=0,
                   part=item["content"][0])
        await emit("response.output_item.done", output_index=idx, item=item)
        output.append(item)
        current, acc = None, ""

    try:
        while True:
            events, _rows, done = await reply.next()
            for ev in events:
                if isinstance(ev, ToolCall):
                    await close()
                    idx, item = len(output), _call_item(ev)
                    await emit("response.output_item.added", output_index=idx,
                               item={**item, "arguments": "", "status": "in_progress"})
                    await emit("response.function_call_arguments.delta", item_id=item["id"], output_index=idx,
                               delta=ev.arguments)
                    await emit("response.function_call_arguments.done", item_id=item["id"], output_index=idx,
                               arguments=ev.arguments, name=ev.name)
                    await emit("response.output_item.done", output_index=idx, item=item)
                    output.append(item)
                    continue
                kind = "reasoning" if ev.channel == "reasoning" else "message"
                if current is not None and current["type"] != kind:
                    await close()
                idx = len(output)
                if current is None:
                    if kind == "message" and not ev.text.strip():
                        continue  # no message item for whitespace alone
                    current = ({"type": "reasoning", "id": _new_id("rs"), "summary": [], "content": []}
                               if kind == "reasoning" else
                               {"type": "message", "id": _new_id("msg"), "role": "assistant",
                                "status": "in_progress", "content": []})
                    await emit("response.output_item.added", output_index=idx, item=current)
                    part = ({"type": "reasoning_text", "text": ""} if kind == "reasoning"
                            else {"type": "output_text", "text": "", "annotations": [], "logprobs": []})
                    await emit("response.content_part.added", item_id=current["id"], output_index=idx,
                               content_index=0, part=part)
                acc += ev.text
                if kind == "reasoning":
                    await emit("response.reasoning_text.delta", item_id=current["id"], output_index=idx,
                               content_index=0, delta=ev.text)
                else:
                    await emit("response.output_text.delta", item_id=current["id"], output_index=idx,
                               content_index=0, delta=ev.text, logprobs=[])
            if done:
                break
        await close()
        final = _finished(base, reply, output)
        await emit("response.completed" if final["status"] == "completed" else "response.incomplete", more=False,
                   response=final)
        return final
    except ApiError as exc:
        failed = {**base, "status": "failed", "output": output,
                  "error": {"code": exc.code or "server_error", "message": exc.message}}
        await sse.fail(exc, frame("error", code=exc.code, message=exc.message, param=exc.param)
                       + frame("response.failed", response=failed))
        return failed
