"""Anthropic Messages dialect: ``/v1/messages`` and ``/v1/messages/count_tokens``.

Blocks map onto the shared chat core: ``text`` is content, ``thinking`` is
reasoning, ``tool_use`` is an assistant call and ``tool_result`` a tool turn.
Every failure this handler answers uses Anthropic's envelope
``{"type":"error","error":{"type":…,"message":…}}``; a failure after the
stream began is an ``event: error``. Keys may come as ``x-api-key`` or
Bearer; none is enforced here. No access-log line (as in the reference).
"""

from __future__ import annotations

import itertools
import json
from typing import TYPE_CHECKING, Any

from ..chat import Delta, ToolCall, ToolChoice
from ..proto import encode_sse_json
from ._lane import tokenize
from ._http import ApiError, Receive, Send, send_json, answer_errors
from ._chat import ChatRequest, Reply, open_reply, parse_tool_choice, qos_of, render_chat, thinking_kwargs, tool_from
from ._sse import SseResponse
from ._tenancy import partition_of
from ._params import integer, sampling_from, stops_from

if TYPE_CHECKING:
    from ..serving import ServedModel
    from ._host import App

__all__ = ["count_tokens", "messages"]

_ids = itertools.count(1)
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def error_body(exc: ApiError) -> dict[str, Any]:
    kind = _ERROR_TYPES.get(exc.status, "api_error" if exc.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": exc.message}}


def _string(block: dict[str, Any], key: str, where: str) -> str:
    """A block's text field: a string (absent is empty); anything else is the client's 400, naming it."""
    value = block.get(key, "")
    if not isinstance(value, str):
        raise ApiError(400, f"invalid request: {where}.{key} must be a string", param=f"{where}.{key}")
    return value


def _text_of(content: Any, where: str) -> str:
    """A string, or the text of an array's ``text`` blocks (``where`` names it in a refusal)."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if not isinstance(content, list):
        raise ApiError(400, f"invalid request: {where} must be a string or an array of blocks", param=where)
    return "".join(_string(b, "text", f"{where}.{j}") for j, b in enumerate(content)
                   if isinstance(b, dict) and b.get("type") == "text")


def parse_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """Anthropic ``system`` + ``messages`` as OpenAI-shaped messages.

    Raises:
        ApiError: malformed messages or an image block (text-only runtimes).
    """
    out: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        if isinstance(system, list):
            system = "\n".join(_string(b, "text", f"system.{j}") for j, b in enumerate(system)
                               if isinstance(b, dict) and b.get("type") == "text")
        if not isinstance(system, str):
            raise ApiError(400, "invalid request: system must be a string or text blocks", param="system")
        out.append({"role": "system", "content": system})
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ApiError(400, "invalid request: messages must be a non-empty array", param="messages")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise ApiError(400, f"invalid request: messages.{i}.role must be user or assistant", param="messages")
        content = m.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise ApiError(400, f"invalid request: messages.{i}.content must be a string or an array")
        text: list[str] = []
        thinking: list[str] = []
        calls: list[dict[str, Any]] = []
        for j, b in enumerate(blocks):
            kind = b.get("type") if isinstance(b, dict) else None
            if kind == "text":
                text.append(_string(b, "text", f"messages.{i}.content.{j}"))
            elif kind == "thinking":
                thinking.append(_string(b, "thinking", f"messages.{i}.content.{j}"))
            elif kind == "tool_use" and m["role"] == "assistant":
                calls.append({"id": str(b.get("id", "")), "type": "function",
                              "function": {"name": str(b.get("name", "")),
                                           "arguments": json.dumps(b.get("input") or {}, ensure_ascii=False)}})
            elif kind == "tool_result":
                out.append({"role": "tool", "tool_call_id": str(b.get("tool_use_id", "")),
                            "content": _text_of(b.get("content"), f"messages.{i}.content.{j}.content")})
            elif kind in ("image", "document"):
                raise ApiError(400, f"this model takes text only; {kind} blocks are not supported",
                               code="unsupported_input", param=f"messages.{i}.content")
        if m["role"] == "user" and not text and any(isinstance(b, dict) and b.get("type") == "tool_result"
                                                     for b in blocks):
            continue
        msg: dict[str, Any] = {"role": m["role"], "content": "".join(text)}
        if calls:
            msg["tool_calls"] = calls
        if thinking:
            msg["reasoning_content"] = "".join(thinking)
        out.append(msg)
    return out


def _request(model: ServedModel, body: dict[str, Any], *, counting: bool = False) -> ChatRequest:
    max_tokens = integer(body, "max_tokens", lo=1, hi=10_000_000)
    if max_tokens is None and not counting:
        raise ApiError(400, "max_tokens: field required", param="max_tokens")
    raw_tools = body.get("tools") or []
    if not isinstance(raw_tools, list):
        raise ApiError(400, "invalid request: tools must be an array", param="tools")
    tools = []
    for i, t in enumerate(raw_tools):
        if not isinstance(t, dict) or t.get("type", "custom") not in ("custom", None) or "input_schema" not in t:
            raise ApiError(400, f"invalid request: tools.{i} is not a client tool with an input_schema",
                           code="unsupported_tool", param=f"tools.{i}")
        tools.append(tool_from(t.get("name"), t.get("description"), t.get("input_schema"), f"tools.{i}"))
    choice = ToolChoice()
    tc = body.get("tool_choice")
    if tc is not None:
        kind = tc.get("type") if isinstance(tc, dict) else None
        if kind == "tool":
            choice = parse_tool_choice({"type": "function", "name": tc.get("name")}, tools)
        elif kind in ("auto", "none", "any"):
            choice = parse_tool_choice({"auto": "auto", "none": "none", "any": "required"}[kind], tools)
        else:
            raise ApiError(400, "invalid request: tool_choice must be an object of type auto, any, tool or none",
                           param="tool_choice")
    thinking = body.get("thinking")
    enable = None
    if isinstance(thinking, dict) and thinking.get("type") in ("enabled", "disabled"):
        enable = thinking["type"] == "enabled"
    return ChatRequest(
        messages=parse_messages(body),
        sampling=sampling_from({k: body.get(k) for k in ("temperature", "top_p", "top_k")},
                               n_vocab=int(model.info.get("n_vocab", 1 << 30))),
        max_tokens=max_tokens, tools=tools, choice=choice, stops=stops_from(body, "stop_sequences"),
        template_kwargs=thinking_kwargs(model.template.source, {}, enable=enable))


async def count_tokens(app: App, scope: dict[str, Any], receive: Receive, send: Send, body: dict[str, Any]) -> None:
    async def run(send: Send) -> None:
        model = await app.resolve_model(body.get("model"))
        rendered = render_chat(model, _request(model, body, counting=True))
        tokens = await tokenize(model, rendered.segments, add_special=False)
        await send_json(send, 200, {"input_tokens": len(tokens)})

    await answer_errors(send, run, error_body)


async def messages(app: App, scope: dict[str, Any], receive: Receive, send: Send, body: dict[str, Any]) -> None:
    async def run(send: Send) -> None:
        partition = partition_of(scope, body)
        model = await app.resolve_model(body.get("model"))
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise ApiError(400, "invalid request: stream must be a boolean", param="stream")
        req = _request(model, body)
        mid = f"msg_superfluid_{next(_ids)}"
        async with open_reply(app, model, req, klass=qos_of(app, scope), partition=partition) as reply:
            await (_stream if stream else _whole)(send, reply, mid, req.stops)

    await answer_errors(send, run, error_body)


def _stop_reason(reply: Reply, stops: list[str]) -> tuple[str, str | None]:
    """Anthropic's ``stop_reason`` and ``stop_sequence``: which of the client's
    ``stop_sequences`` ended the reply, if one did (a tool-call marker that
    ended it is ``end_turn``)."""
    matched = _matched_stop(reply, stops) if reply.finish == "stop" else None
    if matched is not None:
        return "stop_sequence", matched
    return {"length": "max_tokens", "tool_calls": "tool_use"}.get(reply.finish or "", "end_turn"), None


def _stop_fields(reply: Reply, stops: list[str]) -> dict[str, Any]:
    reason, sequence = _stop_reason(reply, stops)
    return {"stop_reason": reason, "stop_sequence": sequence}


def _matched_stop(reply: Reply, stops: list[str]) -> str | None:
    """The client stop sequence found where the released text ends. The reply's
    text stream cuts at the first stop string it finds and keeps no record of
    which, so it is read off the generated text there (the first listed, of
    several starting at that point)."""
    stream = reply.follower.text
    if not stream.stopped:
        return None
    generated = b"".join(reply.job.pieces[: reply.follower.cursor]).decode("utf-8", errors="replace")
    rest = generated[len(stream.text):]
    return next((s for s in stops if rest.startswith(s)), None)


def _usage(reply: Reply) -> dict[str, Any]:
    job = reply.job
    return {"input_tokens": len(job.prompt) - job.cached, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": job.cached, "output_tokens": len(job.tokens)}


def _tool_block(call: ToolCall) -> dict[str, Any]:
    return {"type": "tool_use", "id": "toolu_" + call.id.removeprefix("call_"), "name": call.name,
            "input": call.input}


async def _whole(send: Send, reply: Reply, mid: str, stops: list[str]) -> None:
    blocks: list[dict[str, Any]] = []
    while True:
        events, _rows, done = await reply.next()
        for ev in events:
            if isinstance(ev, ToolCall):
                blocks.append(_tool_block(ev))
                continue
            kind, key = ("thinking", "thinking") if ev.channel == "reasoning" else ("text", "text")
            if blocks and blocks[-1]["type"] == kind:
                blocks[-1][key] += ev.text
            else:
                blocks.append({"type": kind, key: ev.text, **({"signature": ""} if kind == "thinking" else {})})
        if done:
            break
    if not blocks:
        blocks.append({"type": "text", "text": ""})
    await send_json(send, 200, {
        "id": mid, "type": "message", "role": "assistant", "model": reply.model.name, "content": blocks,
        **_stop_fields(reply, stops), "usage": _usage(reply)})


async def _stream(send: Send, reply: Reply, mid: str, stops: list[str]) -> None:
    sse = SseResponse(send, done=False, error=_error_frame)

    async def emit(kind: str, obj: dict[str, Any], more: bool = True) -> None:
        frame = encode_sse_json({"type": kind, **obj}, event=kind)
        await (sse.send(frame) if more else sse.end(frame))

    await reply.wait_admitted()
    await sse.start()
    usage = {**_usage(reply), "output_tokens": 0}
    await emit("message_start", {"message": {
        "id": mid, "type": "message", "role": "assistant", "model": reply.model.name, "content": [],
        "stop_reason": None, "stop_sequence": None, "usage": usage}})
    index = -1
    open_kind: str | None = None

    async def close() -> None:
        nonlocal open_kind
        if open_kind == "thinking":
            await emit("content_block_delta", {"index": index, "delta": {"type": "signature_delta", "signature": ""}})
        if open_kind is not None:
            await emit("content_block_stop", {"index": index})
        open_kind = None

    async def start(block: dict[str, Any]) -> None:
        nonlocal index, open_kind
        await close()
        index += 1
        open_kind = block["type"]
        await emit("content_block_start", {"index": index, "content_block": block})

    try:
        while True:
            events, _rows, done = await reply.next()
            for ev in events:
                if isinstance(ev, ToolCall):
                    block = _tool_block(ev)
                    await start({**block, "input": {}})
                    await emit("content_block_delta", {"index": index, "delta": {
                        "type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)}})
                    await close()
                    continue
                assert isinstance(ev, Delta)
                kind = "thinking" if ev.channel == "reasoning" else "text"
                if open_kind != kind:
                    await start({"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking"
                                else {"type": "text", "text": ""})
                delta = ({"type": "thinking_delta", "thinking": ev.text} if kind == "thinking"
                         else {"type": "text_delta", "text": ev.text})
                await emit("content_block_delta", {"index": index, "delta": delta})
            if done:
                break
        await close()
        await emit("message_delta", {"delta": _stop_fields(reply, stops), "usage": _usage(reply)})
        await emit("message_stop", {}, more=False)
    except ApiError as exc:
        await sse.fail(exc)


def _error_frame(exc: ApiError) -> bytes:
    """An error after the stream started, as Anthropic sends it: an ``error`` event."""
    return encode_sse_json(error_body(exc), event="error")
