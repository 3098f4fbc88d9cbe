"""OpenAI dialect (``/v1/chat/completions``, ``/v1/completions``,
``/v1/embeddings``) and the chat core every dialect shares.

The core: a dialect parses its request into a :class:`ChatRequest`
(OpenAI-shaped messages, :class:`~superfluid.chat.Tool` list, tool choice,
structured-output grammar, template arguments); :func:`open_reply` renders
it, submits the job to the model's scheduler and yields a :class:`Reply`
whose :meth:`Reply.next` returns typed events (content and reasoning deltas,
whole tool calls). Disconnects cancel the job; leaving the block cancels it.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import attrs

from ..chat import (
    Delta, ForcedCallParser, ReasoningSplitter, ReplyParser, TemplateRenderError, Tool, ToolCall, ToolCallParser,
    ToolChoice, ToolWire, call_markers, call_schema, detect_wire, flatten_tool_messages, forced_prefill, reasoning_tags,
    render_chatml, template_knows_tools,
)
from ..proto import SSE_DONE, Sampling, encode_sse_json
from ..sched import QosClass, parse_qos
from ._sessions import run_resumable
from ._generate import Follower, access_log, open_lane, prepare, resumable_requested, watch_disconnect
from ._http import ApiError, Receive, Send, header, send_json
from ._params import integer, sampling_from, stops_from, template_kwargs_from
from ._principal import principal_of
from ._tenancy import Owner, owner_of

if TYPE_CHECKING:
    from ..daemon._model import ServedModel
    from ..sched import Job
    from ._app import App

__all__ = ["ChatRequest", "Rendered", "Reply", "chat_completions", "completions", "open_reply"]

_ids = itertools.count(1)
SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"),
               (b"x-accel-buffering", b"no")]
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")


# --- the shared chat core ------------------------------------------------------------------------------------

@attrs.frozen(kw_only=True)
class ChatRequest:
    """A chat turn in dialect-neutral form.

    ``messages`` are OpenAI-shaped: ``role`` (system/user/assistant/tool),
    ``content`` (a string), and optionally ``tool_calls`` (OpenAI entries with
    ``function.arguments`` as JSON text), ``tool_call_id``,
    ``reasoning_content``. ``grammar`` is the structured-output constraint
    (``""``, ``"json"``, ``"json_schema:…"``); a forced tool choice replaces it.
    ``raw_prompt`` (Ollama ``raw``) bypasses the template: markers in it are
    parsed, as the client asked.
    """

    messages: list[dict[str, Any]]
    sampling: Sampling
    max_tokens: int | None
    tools: list[Tool] = attrs.field(factory=list)
    choice: ToolChoice = ToolChoice()
    grammar: str = ""
    grammar_param: str = "response_format"
    template_kwargs: dict[str, Any] = attrs.field(factory=dict)
    stops: list[str] = attrs.field(factory=list)
    ignore_eos: bool = False
    raw_prompt: str = ""


def qos_of(app: App, scope: dict[str, Any]) -> QosClass:
    """The request's class: ``x-superfluid-qos``, else its key's ``class``, else
    ``--http-default-qos``. Raises ApiError 400 (unknown name), 403 (above the key's ``max_class``)."""
    value = header(scope, "x-superfluid-qos")
    asked = None
    if value is not None and app.config.http_qos_header:
        try:
            asked = parse_qos(value)
        except ValueError as exc:
            raise ApiError(400, str(exc), param="x-superfluid-qos") from None
    return principal_of(scope).qos(asked, app.config.default_qos)


def require_grammar(model: ServedModel, param: str) -> None:
    """Raises ApiError 400 ``unsupported_parameter`` if the runtime cannot constrain output."""
    ack = model.owner.ack
    cap = ack.capabilities.get("grammar", True) if ack else True
    if cap is not True:
        raise ApiError(400, f"constrained output is not available on this runtime: {cap}",
                       code="unsupported_parameter", param=param)


def _for_template(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as HF tool templates expect them: call arguments as objects."""
    out = []
    for m in messages:
        calls = []
        for c in m.get("tool_calls") or ():
            fn = dict(c.get("function") or {})
            try:
                fn["arguments"] = json.loads(fn.get("arguments") or "{}")
            except (TypeError, ValueError):
                pass
            calls.append({**c, "function": fn})
        out.append({**m, "tool_calls": calls} if calls else m)
    return out


@attrs.frozen
class Rendered:
    """One chat turn ready to submit: prompt segments, reply parser, grammar and extra stops."""

    segments: list[tuple[str, bool]]
    parser: ReplyParser
    grammar: str = ""
    stops: list[str] = attrs.field(factory=list)


def render_chat(model: ServedModel, req: ChatRequest) -> Rendered:
    """Render one chat turn for ``model``.

    When calls are not allowed (``tool_choice: none``, or tool history with
    no tools declared) but the model may still imitate its history, the
    wire's call markers become stop strings: a call the client did not allow
    ends the reply instead of leaking its wire into content.

    Raises:
        ApiError: the template refused the conversation, or a bad tool choice.
    """
    if req.raw_prompt:
        return Rendered([(req.raw_prompt, True)], ReplyParser(), req.grammar)
    template = model.template
    source = template.source
    shown = [] if req.choice.mode == "none" else req.tools
    history = any(m.get("tool_calls") or m["role"] == "tool" for m in req.messages)
    wire = ToolWire.HERMES
    try:
        if shown or history:
            if template_knows_tools(source):
                wire = detect_wire(source)
                segments = template.render(_for_template(req.messages), tools=[t.to_openai() for t in shown],
                                           kwargs=req.template_kwargs)
            elif "<|im_start|>" in model.info.get("special_tokens", {}) and "<|im_start|>" in source:
                segments = render_chatml(req.messages, shown)
            else:
                segments = template.render(flatten_tool_messages(req.messages, shown), kwargs=req.template_kwargs)
        else:
            segments = template.render(req.messages, kwargs=req.template_kwargs)
    except TemplateRenderError as exc:
        raise ApiError(400, f"invalid request: {exc}", code="template_error") from None
    grammar = req.grammar
    tools: ToolCallParser | ForcedCallParser | None = ToolCallParser(wire, shown) if shown else None
    if req.choice.forced:
        args_key = "parameters" if wire is ToolWire.LLAMA3 else "arguments"
        try:
            schema = call_schema(req.tools, req.choice, args_key=args_key)
        except ValueError as exc:
            raise ApiError(400, f"invalid request: {exc}", param="tool_choice") from None
        grammar = "json_schema:" + json.dumps(schema)
        tools = ForcedCallParser(schema, req.tools, args_key)
        if forced_prefill(wire):
            segments = [*segments, (forced_prefill(wire), True)]
    tags = reasoning_tags(source)
    reasoning = None
    if tags and not grammar:
        tail = next((text for text, special in reversed(segments) if special), "")
        reasoning = ReasoningSplitter(tags[0], tags[1], inside=tail.rstrip().endswith(tags[0]))
    stops = call_markers(wire) if not shown and (req.tools or history) else []
    return Rendered(segments, ReplyParser(reasoning, tools), grammar, stops)


class Reply:
    """A running chat generation, read as typed events."""

    def __init__(self, model: ServedModel, job: Job, follower: Follower, parser: ReplyParser) -> None:
        self.model = model
        self.job = job
        self.follower = follower
        self.parser = parser
        self.finish: str | None = None

    @property
    def calls(self) -> list[ToolCall]:
        return self.parser.calls

    async def wait_admitted(self) -> None:
        """Raises ApiError if the worker refused the job before any token (a status-code error)."""
        await self.job.wait_started()
        error = self.job.error
        if error is not None and not self.job.tokens:
            raise ApiError.of_job(error)

    async def collect(self) -> tuple[str, str, list[Any]]:
        """Run to the end: ``(content, reasoning, logprob rows)``."""
        content: list[str] = []
        reasoning: list[str] = []
        rows: list[Any] = []
        while True:
            events, lps, done = await self.next()
            rows += lps
            for ev in events:
                if isinstance(ev, Delta):
                    (reasoning if ev.channel == "reasoning" else content).append(ev.text)
            if done:
                return "".join(content), "".join(reasoning), rows

    async def next(self) -> tuple[list[Delta | ToolCall], list[Any], bool]:
        """Wait for progress: ``(events, logprob rows, done)``; sets :attr:`finish` when done.

        Raises:
            ApiError: the generation failed (worker fault, overflow).
        """
        text, rows, done = await self.follower.next_delta()
        events = self.parser.feed(text) if text else []
        if done:
            events += self.parser.finish()
            finish = self.follower.finish or "stop"
            calls = self.parser.calls
            if calls and finish != "length" and not any(c.recovered for c in calls):
                finish = "tool_calls"
            self.finish = finish
        return events, rows, done


@asynccontextmanager
async def open_reply(app: App, model: ServedModel, req: ChatRequest, receive: Receive, *,
                     klass: QosClass, owner: Owner) -> AsyncIterator[Reply]:
    """Render, submit and follow one chat turn.

    Raises:
        ApiError: before the block, a refusal (template, window, grammar on a
            runtime without one); inside it, whatever the block raises.

    Cancellation: a client disconnect cancels the block; leaving the block
    (normally, by error or cancellation) retires the job's lane (stops it).
    """
    rendered = render_chat(model, req)
    sampling = req.sampling
    if rendered.grammar:
        require_grammar(model, "tool_choice" if req.choice.forced else req.grammar_param)
        sampling = attrs.evolve(sampling, grammar=rendered.grammar)
    add_special = bool(req.raw_prompt) and bool(model.info.get("add_bos", False))
    job = await prepare(model, rendered.segments, sampling=sampling, max_tokens=req.max_tokens, klass=klass,
                        owner=owner, ignore_eos=req.ignore_eos, add_special=add_special)
    stops = [*req.stops, *rendered.stops]
    async with open_lane(app, model, job, kind="chat", stops=stops), watch_disconnect(receive):
        yield Reply(model, job, Follower(job, stops), rendered.parser)


def usage_of(job: Job) -> dict[str, Any]:
    n = len(job.tokens)
    return {"prompt_tokens": len(job.prompt), "completion_tokens": n, "total_tokens": len(job.prompt) + n,
            "prompt_tokens_details": {"cached_tokens": job.cached}}


def thinking_kwargs(template_source: str, kwargs: dict[str, Any], *, enable: Any = None, effort: Any = None,
                    param: str = "reasoning_effort") -> dict[str, Any]:
    """Template arguments for thinking: explicit ``chat_template_kwargs`` win.

    Raises:
        ApiError: an unknown effort level.
    """
    out = dict(kwargs)
    if enable is not None and "enable_thinking" not in out:
        if not isinstance(enable, bool):
            raise ApiError(400, "invalid request: enable_thinking must be a boolean", param="enable_thinking")
        out["enable_thinking"] = enable
    if effort is not None:
        if effort not in EFFORTS:
            raise ApiError(400, f"invalid request: {param} must be one of {', '.join(EFFORTS)}", param=param)
        if "reasoning_effort" in template_source:
            out.setdefault("reasoning_effort", effort)
        if effort == "none" and "enable_thinking" in template_source:
            out.setdefault("enable_thinking", False)
    return out


# --- OpenAI request parsing ----------------------------------------------------------------------------------

def _content_text(content: Any, index: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict):
                raise ApiError(400, f"invalid request: messages[{index}].content parts must be objects",
                               param=f"messages[{index}].content")
            kind = part.get("type")
            if kind in ("text", "input_text", "output_text") and isinstance(part.get("text"), str):
                parts.append(part["text"])
            elif kind in ("image_url", "input_audio", "image", "input_image"):
                raise ApiError(400, f"this model takes text only; {kind} is not supported",
                               code="unsupported_input", param=f"messages[{index}].content")
            else:
                raise ApiError(400, f"invalid request: unknown content part type {kind!r}",
                               param=f"messages[{index}].content")
        return "".join(parts)
    raise ApiError(400, f"invalid request: messages[{index}].content must be a string or an array",
                   param=f"messages[{index}].content")


def _tool_calls(value: Any, index: int) -> list[dict[str, Any]]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise ApiError(400, f"invalid request: messages[{index}].tool_calls must be an array",
                       param=f"messages[{index}].tool_calls")
    out = []
    for k, call in enumerate(value):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ApiError(400, f"invalid request: messages[{index}].tool_calls[{k}].function.name is required",
                           param=f"messages[{index}].tool_calls")
        args = fn.get("arguments", "{}")
        out.append({"id": str(call.get("id") or f"call_{k}"), "type": "function",
                    "function": {"name": fn["name"],
                                 "arguments": args if isinstance(args, str) else json.dumps(args)}})
    return out


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
        msg: dict[str, Any] = {"role": role, "content": _content_text(m.get("content"), i)}
        calls = _tool_calls(m.get("tool_calls"), i) if role == "assistant" else []
        if calls:
            msg["tool_calls"] = calls
        for key in ("tool_call_id", "name"):
            if isinstance(m.get(key), str):
                msg[key] = m[key]
        reasoning = m.get("reasoning_content", m.get("reasoning"))
        if isinstance(reasoning, str) and reasoning:
            msg["reasoning_content"] = reasoning
        out.append(msg)
    return out


def parse_tools(value: Any, *, param: str = "tools") -> list[Tool]:
    """OpenAI ``tools`` (``{"type":"function","function":{...}}``; also flat ``{type,name,parameters}``)."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise ApiError(400, f"invalid request: {param} must be an array", param=param)
    tools: list[Tool] = []
    for i, t in enumerate(value):
        if not isinstance(t, dict) or t.get("type", "function") != "function":
            kind = t.get("type") if isinstance(t, dict) else None
            raise ApiError(400, f"invalid request: {param}[{i}] of type {kind!r} is not supported",
                           code="unsupported_tool", param=f"{param}[{i}]")
        fn = t.get("function") if isinstance(t.get("function"), dict) else t
        tools.append(tool_from(fn.get("name"), fn.get("description"), fn.get("parameters"), f"{param}[{i}]"))
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise ApiError(400, f"invalid request: duplicate tool names in {param}", param=param)
    return tools


def tool_from(name: Any, description: Any, parameters: Any, param: str) -> Tool:
    if not isinstance(name, str) or not name:
        raise ApiError(400, f"invalid request: {param} needs a name", param=param)
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise ApiError(400, f"invalid request: {param} parameters must be a JSON schema object", param=param)
    return Tool(name, description if isinstance(description, str) else "", parameters)


def parse_tool_choice(value: Any, tools: list[Tool], *, param: str = "tool_choice") -> ToolChoice:
    """``auto|none|required|{type:function,function:{name}}`` (also ``{type:function,name}``); ``None`` is ``auto``.

    Raises:
        ApiError: any other value, a forced choice without tools, or naming an undeclared tool.
    """
    choice = ToolChoice()
    if value in ("none", "required"):
        choice = ToolChoice(value)
    elif isinstance(value, dict) and value.get("type") in ("function", "tool"):
        fn = value.get("function") if isinstance(value.get("function"), dict) else value
        if not isinstance(fn.get("name"), str):
            raise ApiError(400, f"invalid request: {param} names no function (a string name is required)",
                           param=param)
        choice = ToolChoice("named", fn["name"])
    elif value not in (None, "auto"):
        raise ApiError(400, f"invalid request: {param} must be \"auto\", \"none\", \"required\" or "
                            "{\"type\": \"function\", \"function\": {\"name\": …}}", param=param)
    if choice.forced and not tools:
        raise ApiError(400, f"invalid request: {param} requires a tool call but no tools are declared", param=param)
    if choice.mode == "named" and choice.name not in {t.name for t in tools}:
        raise ApiError(400, f"invalid request: {param} names {choice.name!r}, which is not a declared tool",
                       param=param)
    return choice


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
        schema = spec.get("schema") if isinstance(spec, dict) else rf.get("schema")
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


def _chat_logprobs(rows: list[Any]) -> list[dict[str, Any]]:
    out = []
    for piece, (token_lp, top) in rows:
        out.append({"token": piece.decode("utf-8", "replace"), "logprob": token_lp, "bytes": list(piece),
                    "top_logprobs": [{"token": p.decode("utf-8", "replace"), "logprob": v, "bytes": list(p)}
                                     for _t, p, v in top]})
    return out


def _completion_logprobs(rows: list[Any], offset: int) -> tuple[dict[str, Any], int]:
    """The legacy completions ``logprobs`` object for ``rows``, whose text starts
    at ``offset`` characters into the completion; and the offset after them."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for piece, (token_lp, top) in rows:
        text = piece.decode("utf-8", "replace")
        tokens.append(text)
        token_lps.append(token_lp)
        tops.append({p.decode("utf-8", "replace"): v for _t, p, v in top})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}, offset


def openai_delta(events: list[Any], n_calls: int) -> tuple[dict[str, Any], int]:
    """A chat.completion.chunk ``delta`` for parsed reply events, and the
    running count of tool calls (their ``index``) after them."""
    delta: dict[str, Any] = {}
    for ev in events:
        if isinstance(ev, ToolCall):
            delta.setdefault("tool_calls", []).append(openai_call(ev, n_calls))
            n_calls += 1
        else:
            key = "reasoning_content" if ev.channel == "reasoning" else "content"
            delta[key] = delta.get(key, "") + ev.text
    return delta, n_calls


def openai_call(call: ToolCall, index: int) -> dict[str, Any]:
    return {"index": index, "id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


# --- handlers ------------------------------------------------------------------------------------------------

async def chat_completions(app: App, scope: dict[str, Any], receive: Receive, send: Send, body: dict[str, Any]) -> None:
    await _generate(app, scope, receive, send, body, chat=True)


async def completions(app: App, scope: dict[str, Any], receive: Receive, send: Send, body: dict[str, Any]) -> None:
    await _generate(app, scope, receive, send, body, chat=False)


async def _generate(app: App, scope: dict[str, Any], receive: Receive, send: Send, body: dict[str, Any], *,
                    chat: bool) -> None:
    model = await app.resolve_model(body.get("model"))
    klass = qos_of(app, scope)
    owner = owner_of(scope, body)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "invalid request: stream must be a boolean", param="stream")
    n = integer(body, "n", lo=1, hi=128, default=1)
    if n != 1:
        raise ApiError(400, "n > 1 is not supported yet", code="unsupported_parameter", param="n")
    sampling = sampling_from(body, n_vocab=int(model.info.get("n_vocab", 1 << 30)),
                             want_logprobs=_logprobs_want(body, chat))
    if chat:
        tools = parse_tools(body.get("tools"))
        kwargs = template_kwargs_from(body)
        req = ChatRequest(
            messages=parse_messages(body), sampling=sampling, max_tokens=_max_tokens(body), tools=tools,
            choice=parse_tool_choice(body.get("tool_choice"), tools),
            grammar=grammar_from_response_format(body.get("response_format")),
            template_kwargs=thinking_kwargs(model.template.source, kwargs, enable=body.get("enable_thinking"),
                                            effort=body.get("reasoning_effort")),
            stops=stops_from(body), ignore_eos=bool(body.get("ignore_eos", False)))
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise ApiError(400, "invalid request: prompt must be a non-empty string", param="prompt")
        grammar = grammar_from_response_format(body.get("response_format"))
        if grammar:
            require_grammar(model, "response_format")
            sampling = attrs.evolve(sampling, grammar=grammar)
        job = await prepare(model, [(prompt, True)], sampling=sampling, max_tokens=_max_tokens(body), klass=klass,
                            owner=owner, ignore_eos=bool(body.get("ignore_eos", False)),
                            add_special=bool(model.info.get("add_bos", False)))
        if stream and resumable_requested(scope):
            await run_resumable(app, model, job, kind="completion", stops=stops_from(body), receive=receive, send=send)
            return
        opts = body.get("stream_options")
        usage = isinstance(opts, dict) and opts.get("include_usage") is True
        await _run_completion(app, model, job, receive, send, stops_from(body), stream=stream, usage=usage)
        return
    route = "/v1/chat/completions"
    rid = f"chatcmpl-superfluid-{next(_ids)}"
    created = int(time.time())
    if stream and resumable_requested(scope):
        if req.tools:
            raise ApiError(400, "resumable streams do not carry tool calls yet", code="unsupported_parameter",
                           param="tools")
        rendered = render_chat(model, req)
        sampling = req.sampling
        if rendered.grammar:
            require_grammar(model, req.grammar_param)
            sampling = attrs.evolve(sampling, grammar=rendered.grammar)
        job = await prepare(model, rendered.segments, sampling=sampling, max_tokens=req.max_tokens, klass=klass,
                            owner=owner, ignore_eos=req.ignore_eos)
        await run_resumable(app, model, job, kind="chat", stops=[*req.stops, *rendered.stops], receive=receive,
                            send=send)
        return
    async with open_reply(app, model, req, receive, klass=klass, owner=owner) as reply:
        if stream:
            await _stream_chat(send, reply, rid=rid, created=created)
        else:
            await _whole_chat(send, reply, rid=rid, created=created)
    # outside the disconnect scope: the server reports a finished exchange as a disconnect
    access_log(route, model, reply.job, 200)


async def _whole_chat(send: Send, reply: Reply, *, rid: str, created: int) -> None:
    text, reasoning, lps = await reply.collect()
    message: dict[str, Any] = {"role": "assistant", "content": text if text or not reply.calls else None}
    if reasoning:
        message["reasoning_content"] = reasoning
    if reply.calls:
        message["tool_calls"] = [openai_call(c, i) for i, c in enumerate(reply.calls)]
    choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": reply.finish, "logprobs": None}
    if lps:
        choice["logprobs"] = {"content": _chat_logprobs(lps)}
    obj = {"id": rid, "object": "chat.completion", "created": created, "model": reply.model.name,
           "system_fingerprint": "superfluid", "choices": [choice], "usage": usage_of(reply.job)}
    await send_json(send, 200, obj, headers=[(b"x-superfluid-warm", str(reply.job.cached).encode())])


async def _stream_chat(send: Send, reply: Reply, *, rid: str, created: int) -> None:
    def chunk(delta: dict[str, Any], finish: str | None, rows: list[Any] | None = None,
              usage: bool = False) -> bytes:
        choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        if rows:
            choice["logprobs"] = {"content": _chat_logprobs(rows)}
        obj: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk", "created": created,
                               "model": reply.model.name, "system_fingerprint": "superfluid", "choices": [choice]}
        if usage:
            obj["usage"] = usage_of(reply.job)
        return encode_sse_json(obj)

    await reply.wait_admitted()  # errors before admission (an uncompilable grammar) are HTTP errors
    await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
    n_calls = 0
    try:
        await send({"type": "http.response.body", "body": chunk({"role": "assistant", "content": ""}, None),
                    "more_body": True})
        while True:
            events, rows, done = await reply.next()
            delta, n_calls = openai_delta(events, n_calls)
            if delta or rows:
                await send({"type": "http.response.body", "body": chunk(delta, None, rows), "more_body": True})
            if done:
                break
        final = chunk({}, reply.finish, usage=True)
    except ApiError as exc:
        final = encode_sse_json(exc.body())
    await send({"type": "http.response.body", "body": final + SSE_DONE, "more_body": False})


async def _run_completion(app: App, model: ServedModel, job: Job, receive: Receive, send: Send,
                          stops: list[str], *, stream: bool, usage: bool = False) -> None:
    rid = f"cmpl-superfluid-{next(_ids)}"
    created = int(time.time())
    follower = Follower(job, stops)
    async with open_lane(app, model, job, kind="completion", stops=stops):
        async with watch_disconnect(receive):
            if stream:
                await _stream_completion(send, job, follower, rid=rid, created=created, model=model.name,
                                         usage=usage)
            else:
                parts: list[str] = []
                rows: list[Any] = []
                while True:
                    text, got, done = await follower.next_delta()
                    parts.append(text)
                    rows += got
                    if done:
                        break
                logprobs = _completion_logprobs(rows, 0)[0] if job.sampling.n_logprobs >= 0 else None
                obj = {"id": rid, "object": "text_completion", "created": created, "model": model.name,
                       "choices": [{"index": 0, "text": "".join(parts), "logprobs": logprobs,
                                    "finish_reason": follower.finish}], "usage": usage_of(job)}
                await send_json(send, 200, obj, headers=[(b"x-superfluid-warm", str(job.cached).encode())])
        # outside the disconnect scope: the server reports a finished exchange as a disconnect
        access_log("/v1/completions", model, job, 200)


async def _stream_completion(send: Send, job: Job, follower: Follower, *, rid: str, created: int, model: str,
                             usage: bool = False) -> None:
    """Completion chunks; with ``stream_options.include_usage`` a last chunk
    with empty ``choices`` carries ``usage`` (as OpenAI does)."""
    def chunk(text: str, finish: str | None, logprobs: dict[str, Any] | None = None) -> bytes:
        return encode_sse_json({"id": rid, "object": "text_completion", "created": created, "model": model,
                                "system_fingerprint": "superfluid",
                                "choices": [{"index": 0, "text": text, "finish_reason": finish,
                                             "logprobs": logprobs}]})

    want_logprobs = job.sampling.n_logprobs >= 0
    offset = 0
    held: list[Any] = []

    await job.wait_started()
    if job.error is not None and not job.tokens:
        raise ApiError.of_job(job.error)
    await send({"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
    try:
        while True:
            text, rows, done = await follower.next_delta()
            held += rows   # tokens whose text is held back (a possible stop) go with the text
            if text:
                logprobs = None
                if want_logprobs:
                    logprobs, offset = _completion_logprobs(held, offset)
                held = []
                await send({"type": "http.response.body", "body": chunk(text, None, logprobs), "more_body": True})
            if done:
                break
        final = chunk("", follower.finish, _completion_logprobs(held, offset)[0] if want_logprobs and held else None)
        if usage:
            final += encode_sse_json({"id": rid, "object": "text_completion", "created": created, "model": model,
                                      "choices": [], "usage": usage_of(job)})
    except ApiError as exc:
        final = encode_sse_json(exc.body())
    await send({"type": "http.response.body", "body": final + SSE_DONE, "more_body": False})
