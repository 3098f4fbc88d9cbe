"""The dialect-neutral chat core that every dialect builds on.

A dialect parses its request into a :class:`ChatRequest` (OpenAI-shaped
messages, :class:`~superfluid.chat.Tool` list, tool choice, structured-output
grammar, template arguments); :func:`open_reply` renders it, submits the job
to the model's scheduler and yields a :class:`Reply` whose :meth:`Reply.next`
returns typed events (content and reasoning deltas, whole tool calls).
Disconnects cancel the job; leaving the block cancels it.

The neutral form's messages are OpenAI-shaped, so the parsers of that shape
(messages, tools, tool choice, ``response_format``) and the OpenAI-shaped
delta of reply events live here too: the OpenAI, Responses, Anthropic and
Ollama dialects and the conversation API all use them. No dialect module
imports another (import-linter contract "api layers" in pyproject.toml).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import TYPE_CHECKING, Any

import attrs

from ..chat import (
    Delta, ForcedCallParser, ReasoningSplitter, ReplyParser, TemplateRenderError, Tool, ToolCall, ToolCallParser,
    ToolChoice, ToolWire, call_markers, call_schema, detect_wire, document_schema, flatten_tool_messages,
    forced_prefill, reasoning_tags, render_chatml, template_knows_tools,
)
from ..proto import Sampling
from ..sched import Job, QosClass, parse_qos
from ._lane import Follower, open_lane, prepare, usage_of, wait_admitted
from ._lifecycle import wait_beyond
from ._http import ApiError, header
from ._params import check_loggable, integer
from ._principal import QOS, principal_of
from ._tenancy import Partition

if TYPE_CHECKING:
    from ..serving import ServedModel
    from ._host import App

__all__ = [
    "MAX_CHOICES", "ChatRequest", "Rendered", "Reply", "choice_seed", "choices_from", "grammar_from_response_format",
    "max_tokens_from", "open_replies", "open_reply", "open_siblings", "openai_call", "openai_delta", "parse_messages",
    "parse_tool_choice", "parse_tools", "qos_of", "render_chat", "require_grammar", "thinking_kwargs", "tool_from",
    "usage_of", "usage_of_choices",
]

EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")

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
    forced = scope.get(QOS)
    if isinstance(forced, QosClass):  # a batch's line (App.dispatch): the class its batch was made with
        return forced
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
    ack = model.actor.ack
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
        await wait_admitted(self.job)

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
async def open_reply(app: App, model: ServedModel, req: ChatRequest, *,
                     klass: QosClass, partition: Partition) -> AsyncIterator[Reply]:
    """Render, submit and follow one chat turn.

    Raises:
        ApiError: before the block, a refusal (template, window, grammar on a
            runtime without one); inside it, whatever the block raises.

    Cancellation: a client disconnect cancels the request (``open_request``,
    api/_lifecycle.py), this block with it; leaving the block (normally, by
    error or cancellation) retires the job's lane (stops it).
    """
    rendered = render_chat(model, req)
    sampling = req.sampling
    if rendered.grammar:
        require_grammar(model, "tool_choice" if req.choice.forced else req.grammar_param)
        sampling = attrs.evolve(sampling, grammar=rendered.grammar)
    add_special = bool(req.raw_prompt) and bool(model.info.get("add_bos", False))
    job = await prepare(model, rendered.segments, sampling=sampling, max_tokens=req.max_tokens, klass=klass,
                        partition=partition, ignore_eos=req.ignore_eos, add_special=add_special)
    stops = [*req.stops, *rendered.stops]
    # a forced call's document is the call parser's to close (it marks the call recovered)
    document = None if req.choice.forced else document_schema(rendered.grammar)
    async with open_lane(app, model, job, kind="chat", stops=stops):
        yield Reply(model, job, Follower(job, stops, document=document), rendered.parser)


# --- n choices of one request (OpenAI ``n``) ---------------------------------------------------------------------

MAX_CHOICES = 16   # choices one request may ask for: each holds a lane, so more would crowd out other clients


def choices_from(body: dict[str, Any]) -> int:
    """OpenAI ``n``: 1 ... :data:`MAX_CHOICES` (default 1).

    Raises:
        ApiError: 400 not an integer, or out of range.
    """
    return integer(body, "n", lo=1, hi=MAX_CHOICES, default=1) or 1


def choice_seed(seed: int, index: int) -> int:
    """The sampling seed of choice ``index`` of a request seeded ``seed``: choice 0 keeps it (so ``n: 1``
    draws what it always did), the others draw independently, and a seeded request is reproducible."""
    if index == 0:
        return seed
    digest = hashlib.blake2b(f"choice:{seed}:{index}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little")


def _sibling(first: Job, index: int) -> Job:
    """Choice ``index``'s job: ``first``'s request (prompt, limits, owner) with its own seed and none of its state."""
    return Job(prompt=list(first.prompt), sampling=attrs.evolve(first.sampling,
                                                                seed=choice_seed(first.sampling.seed, index)),
               max_new=first.max_new, klass=first.klass, ignore_eos=first.ignore_eos, tenant=first.tenant,
               cache_salt=first.cache_salt, created=first.created)


@asynccontextmanager
async def open_siblings(app: App, model: ServedModel, first: Job, n: int, *, kind: str,
                        stops: list[str]) -> AsyncIterator[list[Job]]:
    """Choices 1 ... ``n - 1`` beside ``first`` (whose lane the caller opened), each in its own lane.

    They are queued once ``first`` has its first token: its prompt is then in the KV cache, and each
    sibling's lane is seeded from it (the executor copies the longest live or cached prefix), so the
    prompt is prefilled once for all ``n``. Leaving the block, for any reason, retires every sibling.

    Raises:
        ApiError: as :func:`open_lane` (429 ``queue_full`` or ``concurrency_limit_exceeded``: each
            choice holds a queue place and a slot of the key's ``max_concurrent``).
    """
    async with AsyncExitStack() as stack:
        jobs: list[Job] = []
        if n > 1:
            await wait_beyond(first, 0)   # first's prefill is done (or it ended: its prompt is cached then)
        if not (first.error is not None and not first.tokens):   # (refused: its reader raises that, alone)
            for index in range(1, n):
                job = _sibling(first, index)
                await stack.enter_async_context(open_lane(app, model, job, kind=kind, stops=stops))
                jobs.append(job)
        yield jobs


@asynccontextmanager
async def open_replies(app: App, model: ServedModel, req: ChatRequest, n: int, *,
                       klass: QosClass, partition: Partition) -> AsyncIterator[list[Reply]]:
    """``n`` independent replies to one chat turn (:func:`open_reply`, then :func:`open_siblings`:
    one render and one tokenization, one prefill). Each reply has its own parser."""
    async with open_reply(app, model, req, klass=klass, partition=partition) as first:
        rendered = [render_chat(model, req) for _ in range(n - 1)]  # (fresh parsers; the stops are the first's)
        stops = [*req.stops, *(rendered[0].stops if rendered else ())]
        async with open_siblings(app, model, first.job, n, kind="chat", stops=stops) as jobs:
            parsers = [r.parser for r in rendered][:len(jobs)]   # (no siblings when the first was refused)
            document = first.follower.document   # (a response_format document closes legally in every choice)
            yield [first, *(Reply(model, job, Follower(job, stops, document=document), p)
                            for job, p in zip(jobs, parsers, strict=True))]


def usage_of_choices(jobs: list[Job]) -> dict[str, Any]:
    """The ``usage`` of a request's choices: the prompt (and its cached part) counted once,
    the completion tokens of every choice summed."""
    usage = usage_of(jobs[0])
    completion = sum(usage_of(job)["completion_tokens"] for job in jobs)
    usage["completion_tokens"] = completion
    usage["total_tokens"] = usage["prompt_tokens"] + completion
    return usage


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


# --- the OpenAI-shaped input of the neutral form -----------------------------------------------------------------

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
        ApiError: any other value, a forced choice without tools, or naming an undeclared tool;
            one nested deeper than 8 levels or holding an integer beyond 64 bits (a conversation's
            turn logs it as sent).
    """
    check_loggable(value, param, depth=8)
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


def max_tokens_from(body: dict[str, Any]) -> int | None:
    """``max_completion_tokens``, else ``max_tokens`` (1 ... 10^7), else ``None``."""
    mt = integer(body, "max_completion_tokens", lo=1, hi=10_000_000)
    return mt if mt is not None else integer(body, "max_tokens", lo=1, hi=10_000_000)


# --- reply events as an OpenAI-shaped delta (the OpenAI dialect and conversation turns) --------------------------

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
