"""OpenAI dialect: ``/v1/chat/completions`` and ``/v1/completions``."""

from __future__ import annotations

import itertools
import json
import time
from typing import TYPE_CHECKING, Any

import attrs
import trio

from ..chat import TemplateRenderError
from ..proto import SSE_DONE, encode_sse_json
from ..sched import QosClass, parse_qos
from ._generate import Follower, access_log, prepare, watch_disconnect
from ._http import ApiError, Receive, Send, header, send_json
from ._params import integer, sampling_from, stops_from

if TYPE_CHECKING:
    from ._app import App

__all__ = ["chat_completions", "completions"]

_ids = itertools.count(1)
SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"),
               (b"x-accel-buffering", b"no")]


def qos_of(app: App, scope: dict[str, Any]) -> QosClass:
    value = header(scope, "x-superfluid-qos")
    if value is None or not app.config.http_qos_header:
        return app.config.default_qos
    try:
        return parse_qos(value)
    except ValueError as exc:
        raise ApiError(400, str(exc), param="x-superfluid-qos") from None


def _content_text(content: Any, index: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict):
                raise ApiError(400, f"invalid request: messages[{index}].content parts must be objects")
            kind = part.get("type")
            if kind == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            elif kind in ("image_url", "input_audio", "image", "input_image"):
                raise ApiError(400, f"this model takes text only; {kind} is not supported",
                               code="unsupported_input", param=f"messages[{index}].content")
            else:
                raise ApiError(400, f"invalid request: unknown content part type {kind!r}",
                               param=f"messages[{index}].content")
        return "".join(parts)
    raise ApiError(400, f"invalid request: messages[{index}].content must be a string or an array")


def parse_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise ApiError(400, "invalid request: messages must be an array" if messages is not None
                       else "missing required field: messages", param="messages")
    if not messages:
        raise ApiError(400, "messages must be non-empty", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, f"invalid request: messages[{i}] must be an object with a role", param=f"messages[{i}]")
        role = m["role"]
        if role == "developer":
            role = "system"
        if role not in ("system", "user", "assistant", "tool"):
            raise ApiError(400, f"invalid request: messages[{i}].role {role!r} is not supported", param=f"messages[{i}].role")
        out.append({**m, "role": role, "content": _content_text(m.get("content"), i)})
    return out


def grammar_from_response_format(rf: Any) -> str:
    """``""`` (free text), ``"json"``, or ``"json_schema:<schema>"`` for the worker.

    Raises:
        ApiError: a malformed ``response_format``.
    """
    if rf is None:
        return ""
    if not isinstance(rf, dict):
        raise ApiError(400, "invalid request: response_format must be an object", param="response_format")
    kind = rf.get("type")
    if kind == "text":
        return ""
    if kind == "json_object":
        return "json"
    if kind == "json_schema":
        spec = rf.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise ApiError(400, "invalid request: response_format.json_schema.schema must be an object",
                           param="response_format")
        return "json_schema:" + json.dumps(schema)
    raise ApiError(400, f"invalid request: unknown response_format type {kind!r}", param="response_format")


def _max_tokens(body: dict[str, Any]) -> int | None:
    mt = integer(body, "max_completion_tokens", lo=1, hi=10_000_000)
    return mt if mt is not None else integer(body, "max_tokens", lo=1, hi=10_000_000)


def _logprobs_want(body: dict[str, Any], chat: bool) -> int:
    if chat:
        if body.get("logprobs") is True:
            return integer(body, "top_logprobs", lo=0, hi=20, default=0) or 0
        if body.get("logprobs") not in (None, False):
            raise ApiError(400, "invalid request: logprobs must be a boolean", param="logprobs")
        return -1
    lp = integer(body, "logprobs", lo=0, hi=20)
    return -1 if lp is None else lp


def _usage(job: Any) -> dict[str, Any]:
    n = len(job.tokens)
    return {"prompt_tokens": len(job.prompt), "completion_tokens": n, "total_tokens": len(job.prompt) + n,
            "prompt_tokens_details": {"cached_tokens": job.cached}}


def _chat_logprobs(rows: list[Any]) -> list[dict[str, Any]]:
    out = []
    for lp in rows:
        token_lp, top = lp
        out.append({"token": "", "logprob": token_lp, "bytes": None,
                    "top_logprobs": [{"token": p.decode("utf-8", "replace"), "logprob": v, "bytes": list(p)}
                                     for _t, p, v in top]})
    return out


async def chat_completions(app: App, scope: dict[str, Any], receive: Receive, send: Send, body: dict[str, Any]) -> None:
    await _generate(app, scope, receive, send, body, chat=True)


async def completions(app: App, scope: dict[str, Any], receive: Receive, send: Send, body: dict[str, Any]) -> None:
    await _generate(app, scope, receive, send, body, chat=False)


async def _generate(app: App, scope: dict[str, Any], receive: Receive, send: Send, body: dict[str, Any], *,
                    chat: bool) -> None:
    model = await app.resolve_model(body.get("model"))
    klass = qos_of(app, scope)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "invalid request: stream must be a boolean", param="stream")
    n = integer(body, "n", lo=1, hi=128, default=1)
    if n != 1:
        raise ApiError(400, "n > 1 is not supported yet", code="unsupported_parameter", param="n")
    ignore_eos = bool(body.get("ignore_eos", False))
    stops = stops_from(body)
    sampling = sampling_from(body, n_vocab=int(model.info.get("n_vocab", 1 << 30)),
                             want_logprobs=_logprobs_want(body, chat))
    if body.get("tools"):
        raise ApiError(400, "tools are not supported yet", code="unsupported_parameter", param="tools")
    grammar = grammar_from_response_format(body.get("response_format"))
    if grammar:
        cap = model.owner.ack.capabilities.get("grammar", True) if model.owner.ack else True
        if cap is not True:
            raise ApiError(400, f"structured output is not available on this runtime: {cap}",
                           code="unsupported_parameter", param="response_format")
        sampling = attrs.evolve(sampling, grammar=grammar)
    if chat:
        messages = parse_messages(body)
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise ApiError(400, "invalid request: chat_template_kwargs must be an object", param="chat_template_kwargs")
        try:
            segments = model.template.render(messages, add_generation_prompt=True, **kwargs)
        except TemplateRenderError as exc:
            raise ApiError(400, f"invalid request: {exc}") from None
        add_special = False
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise ApiError(400, "invalid request: prompt must be a non-empty string", param="prompt")
        segments = [(prompt, True)]
        add_special = bool(model.info.get("add_bos", False))
    job = await prepare(model, segments, sampling=sampling, max_tokens=_max_tokens(body), klass=klass,
                        ignore_eos=ignore_eos, add_special=add_special)
    sched = model.scheduler
    route = "/v1/chat/completions" if chat else "/v1/completions"
    rid = f"{'chatcmpl' if chat else 'cmpl'}-superfluid-{next(_ids)}"
    created = int(time.time())
    follower = Follower(job, stops)
    sched.submit(job)
    try:
        async with watch_disconnect(receive):
            if stream:
                await _stream(send, job, follower, rid=rid, created=created, model=model.name, chat=chat)
            else:
                await _whole(send, job, follower, rid=rid, created=created, model=model.name, chat=chat)
            access_log(route, model, job, 200)
    finally:
        sched.cancel(job)


async def _whole(send: Send, job: Any, follower: Follower, *, rid: str, created: int, model: str, chat: bool) -> None:
    parts: list[str] = []
    lps: list[Any] = []
    while True:
        text, rows, done = await follower.next_delta()
        parts.append(text)
        lps += rows
        if done:
            break
    text = "".join(parts)
    if chat:
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                  "finish_reason": follower.finish, "logprobs": None}
        if lps:
            choice["logprobs"] = {"content": _chat_logprobs(lps)}
        obj = {"id": rid, "object": "chat.completion", "created": created, "model": model,
               "system_fingerprint": "superfluid", "choices": [choice], "usage": _usage(job)}
    else:
        obj = {"id": rid, "object": "text_completion", "created": created, "model": model,
               "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": follower.finish}],
               "usage": _usage(job)}
    await send_json(send, 200, obj, headers=[(b"x-superfluid-warm", str(job.cached).encode())])


async def _stream(send: Send, job: Any, follower: Follower, *, rid: str, created: int, model: str, chat: bool) -> None:
    obj_name = "chat.completion.chunk" if chat else "text_completion"

    def chunk(delta_text: str | None, finish: str | None, *, role: bool = False, rows: list[Any] | None = None,
              usage: bool = False) -> bytes:
        if chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            if delta_text:
                delta["content"] = delta_text
            choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            if rows:
                choice["logprobs"] = {"content": _chat_logprobs(rows)}
        else:
            choice = {"index": 0, "text": delta_text or "", "finish_reason": finish, "logprobs": None}
        obj: dict[str, Any] = {"id": rid, "object": obj_name, "created": created, "model": model,
                               "system_fingerprint": "superfluid", "choices": [choice]}
        if usage:
            obj["usage"] = _usage(job)
        return encode_sse_json(obj)

    # errors before the worker admitted the job (e.g. an uncompilable grammar) are HTTP errors
    await job.wait_started()
    if job.error is not None and not job.tokens:
        raise ApiError(job.error.status, job.error.message, code=job.error.code, type=job.error.type)
    await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
    try:
        if chat:
            await send({"type": "http.response.body", "body": chunk(None, None, role=True), "more_body": True})
        while True:
            text, rows, done = await follower.next_delta()
            if text or rows:
                await send({"type": "http.response.body", "body": chunk(text, None, rows=rows), "more_body": True})
            if done:
                break
        final = chunk(None, follower.finish, usage=True)
    except ApiError as exc:
        final = encode_sse_json(exc.body())
    except trio.Cancelled:
        raise
    await send({"type": "http.response.body", "body": final + SSE_DONE, "more_body": False})
