"""Ollama dialect: ``/``, ``/api/version``, ``/api/tags``, ``/api/ps``,
``/api/show``, ``/api/chat``, ``/api/generate`` (``/api/embed`` is in ``_embed.py``),
and 501s for model management.

Streams are NDJSON by default (``"stream": false`` gives one object);
durations are nanoseconds; tool calls arrive whole, with ``arguments`` as an
object, on one ``done: false`` record before the terminal one. Errors are
``{"error": "..."}`` with the real status before the body, or one such line
mid-stream. Discovery (tags, ps, show) never loads a cold model.
"""

from __future__ import annotations

import hashlib
import json
import time
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

import trio

from .. import __version__
from ..chat import Delta, ToolCall
from ..proto import encode_ndjson
from ._generate import access_log
from ._http import ApiError, Receive, Send, send_json, send_text, answer_errors
from ._chat import ChatRequest, Reply, open_reply, parse_tool_choice, parse_tools, qos_of, thinking_kwargs
from ._tenancy import Owner, owner_of
from ._params import MAX_STOP_CHARS, number, sampling_from
from ._principal import principal_of
from ..daemon._lifetime import FOREVER, expires_at_wall, parse_keep_alive

if TYPE_CHECKING:
    from ..daemon._model import ServedModel
    from ._host import App

__all__ = ["api_chat", "api_generate", "api_ps", "api_show", "api_tags", "api_version", "managed",
           "root"]

NDJSON_HEADERS = [(b"content-type", b"application/x-ndjson"), (b"cache-control", b"no-cache")]
_CHAT_FIELDS = {"model", "messages", "tools", "stream", "format", "options", "keep_alive", "think", "logprobs",
                "top_logprobs", "truncate", "shift", "cache_salt"}
_GENERATE_FIELDS = {"model", "prompt", "suffix", "system", "template", "context", "stream", "raw", "format", "images",
                    "options", "keep_alive", "think", "logprobs", "top_logprobs", "truncate", "shift", "cache_salt"}
_OPTIONS = {"num_predict", "num_ctx", "temperature", "top_p", "min_p", "top_k", "seed", "repeat_penalty",
            "presence_penalty", "frequency_penalty", "stop"}


def _now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def _method(scope: dict[str, Any], *allowed: str) -> None:
    if scope["method"] not in allowed:
        raise ApiError(405, f"method {scope['method']} not allowed on {scope['path']}")


def _name(app: App, name: Any) -> str:
    if not isinstance(name, str) or not name:
        raise ApiError(400, "model is required")
    reg = app.registry
    if name not in reg.loaded and name not in reg.known and name.endswith(":latest"):
        return name.removesuffix(":latest")
    return name


def _details(model: ServedModel | None) -> dict[str, Any]:
    arch = model.info.get("architecture", "") if model is not None else ""
    return {"parent_model": "", "format": "gguf", "family": arch, "families": [arch] if arch else [],
            "parameter_size": "", "quantization_level": ""}


def _entry(name: str, model: ServedModel | None) -> dict[str, Any]:
    return {"name": name, "model": name, "modified_at": _now(), "size": 0,
            "digest": hashlib.sha256(name.encode()).hexdigest(), "details": _details(model)}


async def root(app: App, scope: dict[str, Any], receive: Receive, send: Send, body: dict[str, Any]) -> None:
    _method(scope, "GET", "HEAD")
    await send_text(send, 200, "superfluid is running")


async def api_version(app: App, scope: dict[str, Any], receive: Receive, send: Send, body: dict[str, Any]) -> None:
    _method(scope, "GET", "HEAD")
    await send_json(send, 200, {"version": __version__, "server": "superfluid", "compatibility": "ollama-inference"})


async def api_tags(app: App, scope: dict[str, Any], receive: Receive, send: Send, body: dict[str, Any]) -> None:
    _method(scope, "GET", "HEAD")
    reg = app.registry
    names = sorted(n for n in set(reg.loaded) | set(reg.known) if principal_of(scope).may_use(n))
    await send_json(send, 200, {"models": [_entry(n, reg.loaded.get(n)) for n in names]})


async def api_ps(app: App, scope: dict[str, Any], receive: Receive, send: Send, body: dict[str, Any]) -> None:
    """Loaded models with their memory (weights + KV cache; all of it on the CPU, so
    ``size_vram`` 0) and when they unload if no request comes (``_lifetime.py``). A model
    whose keep-alive has run out with no request holding it is being unloaded: it is not listed."""
    _method(scope, "GET", "HEAD")
    reg = app.registry
    models = []
    for n, m in sorted(reg.loaded.items()):
        if not principal_of(scope).may_use(n):
            continue
        at = expires_at_wall(m, default=reg.default, idle_timeout_s=reg.idle_timeout_s)
        if at <= time.time() and not (m.holds or m.owner.session_tasks):
            continue  # its last request has ended: it goes as soon as its scheduler has settled
        models.append({**_entry(n, m), "size": m.size, "size_vram": 0, "context_length": m.n_ctx,
                       "expires_at": _wall(FOREVER_AT if at == FOREVER else at)})
    await send_json(send, 200, {"models": models})


FOREVER_AT = 253402300799.0   # 9999-12-31T23:59:59Z: Ollama's answer for a model kept for good is as far off


def _wall(at: float) -> str:
    return datetime.fromtimestamp(at, timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _keep_alive(body: dict[str, Any]) -> float | None:
    try:
        return parse_keep_alive(body.get("keep_alive"))
    except ValueError as exc:
        raise ApiError(400, str(exc), param="keep_alive") from None


async def api_show(app: App, scope: dict[str, Any], receive: Receive, send: Send, body: dict[str, Any]) -> None:
    async def run(send: Send) -> None:
        name = _name(app, body.get("model", body.get("name")))
        principal_of(scope).check_model(name)
        model = app.registry.loaded.get(name)
        if model is None and name not in app.registry.known:
            raise ApiError(404, f"model '{name}' not found")
        caps = ["completion"]
        info: dict[str, Any] = {}
        template = ""
        if model is not None:
            caps.append("tools")
            template = model.template.source
            if "<think>" in template or "enable_thinking" in template:
                caps.append("thinking")
            arch = model.info.get("architecture", "")
            info = {"general.architecture": arch, f"{arch}.context_length": model.n_ctx}
        await send_json(send, 200, {"modelfile": "", "parameters": "", "template": template,
                                    "details": _details(model), "model_info": info, "capabilities": caps,
                                    "modified_at": _now()})

    await answer_errors(send, run, lambda exc: {"error": exc.message})


async def managed(app: App, scope: dict[str, Any], receive: Receive, send: Send, body: dict[str, Any]) -> None:
    """``/api/pull|push|create|copy|delete``: superfluid serves model files it is given; it manages none."""
    await send_json(send, 501, {"error": f"{scope['path']} is not supported: superfluid serves the model files "
                                         "it is started with (see `superfluid serve --model`) and manages no registry"})


def _sampling_body(model: ServedModel, body: dict[str, Any]) -> tuple[dict[str, Any], int | None]:
    """Ollama ``options`` as OpenAI-style sampling fields, and the token budget.

    Raises:
        ApiError: an unsupported or out-of-range option.
    """
    opts = body.get("options") or {}
    if not isinstance(opts, dict):
        raise ApiError(400, "options must be an object", param="options")
    for key, value in opts.items():
        if key not in _OPTIONS and value is not None:
            raise ApiError(400, f"unsupported option: {key}", param=f"options.{key}")
    out: dict[str, Any] = {k: opts.get(k) for k in ("temperature", "top_p", "min_p", "top_k", "repeat_penalty",
                                                     "presence_penalty", "frequency_penalty")}
    seed = opts.get("seed")
    out["seed"] = None if seed in (None, -1) else seed
    stop = opts.get("stop")
    if stop is not None and (not isinstance(stop, list) or len(stop) > 4
                             or not all(isinstance(s, str) and len(s) <= MAX_STOP_CHARS for s in stop)):
        raise ApiError(400, f"options.stop must be at most 4 strings of at most {MAX_STOP_CHARS} characters",
                       param="options.stop")
    out["stop"] = stop
    num_ctx = opts.get("num_ctx")
    if num_ctx is not None and (not isinstance(num_ctx, int) or num_ctx > model.n_ctx):
        raise ApiError(400, f"options.num_ctx may not exceed the server's window of {model.n_ctx}",
                       param="options.num_ctx")
    predict = opts.get("num_predict")
    if predict is not None and (not isinstance(predict, int) or isinstance(predict, bool)
                                or (predict <= 0 and predict not in (-1, -2))):
        raise ApiError(400, "options.num_predict must be > 0, or -1/-2 to fill the context",
                       param="options.num_predict")
    number(out, "temperature", lo=0.0, hi=100.0)
    return out, (predict if predict and predict > 0 else None)


def _grammar(fmt: Any) -> str:
    if fmt in (None, ""):
        return ""
    if fmt == "json":
        return "json"
    if isinstance(fmt, dict):
        return "json_schema:" + json.dumps(fmt)
    raise ApiError(400, 'format must be "json" or a JSON schema object')


def _think(model: ServedModel, think: Any) -> dict[str, Any]:
    if think is None:
        return {}
    if isinstance(think, bool):
        return thinking_kwargs(model.template.source, {}, enable=think)
    if think in ("minimal", "low", "medium", "high"):
        return thinking_kwargs(model.template.source, {}, enable=True, effort=think, param="think")
    raise ApiError(400, 'think must be a boolean or one of "minimal", "low", "medium", "high"')


def _messages(raw: Any) -> list[dict[str, Any]]:
    if not isinstance(raw, list):
        raise ApiError(400, "messages must be an array")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "tool"):
            raise ApiError(400, f"messages[{i}] needs a role of system, user, assistant or tool")
        if m.get("images"):
            raise ApiError(400, "this model takes text only; images are not supported", code="unsupported_input")
        content = m.get("content") or ""
        if not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content must be a string")
        msg: dict[str, Any] = {"role": m["role"], "content": content}
        calls = []
        for k, c in enumerate(m.get("tool_calls") or ()):
            fn = c.get("function") if isinstance(c, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise ApiError(400, f"messages[{i}].tool_calls[{k}].function.name is required")
            args = fn.get("arguments", {})
            calls.append({"id": str(c.get("id") or f"call_{i}_{k}"), "type": "function",
                          "function": {"name": fn["name"],
                                       "arguments": args if isinstance(args, str) else json.dumps(args)}})
        if calls:
            msg["tool_calls"] = calls
        if m["role"] == "tool":
            msg["tool_call_id"] = str(m.get("tool_call_id") or "")
            if isinstance(m.get("tool_name"), str):
                msg["name"] = m["tool_name"]
        if isinstance(m.get("thinking"), str) and m["thinking"]:
            msg["reasoning_content"] = m["thinking"]
        out.append(msg)
    return out


def _check_fields(body: dict[str, Any], allowed: set[str]) -> None:
    for key, value in body.items():
        if key not in allowed and value is not None:
            raise ApiError(400, f"unsupported parameter: {key}")


async def api_chat(app: App, scope: dict[str, Any], receive: Receive, send: Send, body: dict[str, Any]) -> None:
    async def run(send: Send) -> None:
        _check_fields(body, _CHAT_FIELDS)
        owner = owner_of(scope, body)
        keep_alive = _keep_alive(body)
        model = await app.resolve_model(_name(app, body.get("model")))
        app.registry.keep_alive(model, keep_alive)
        messages = _messages(body.get("messages") or [])
        if not messages:
            await _loaded(send, model, "message", body.get("stream", True), keep_alive)
            return
        fields, budget = _sampling_body(model, body)
        tools = parse_tools(body.get("tools"))
        req = ChatRequest(
            messages=messages, sampling=sampling_from(fields, n_vocab=int(model.info.get("n_vocab", 1 << 30))),
            max_tokens=budget, tools=tools, choice=parse_tool_choice(None, tools), grammar=_grammar(body.get("format")),
            grammar_param="format", template_kwargs=_think(model, body.get("think")), stops=fields["stop"] or [])
        await _run(app, scope, receive, send, model, req, "message", body.get("stream", True), owner)

    await answer_errors(send, run, lambda exc: {"error": exc.message})


async def api_generate(app: App, scope: dict[str, Any], receive: Receive, send: Send, body: dict[str, Any]) -> None:
    async def run(send: Send) -> None:
        _check_fields(body, _GENERATE_FIELDS)
        owner = owner_of(scope, body)
        keep_alive = _keep_alive(body)
        model = await app.resolve_model(_name(app, body.get("model")))
        app.registry.keep_alive(model, keep_alive)
        if body.get("suffix"):
            raise ApiError(400, "suffix (fill-in-the-middle) is not supported by this model",
                           code="unsupported_parameter")
        if body.get("template") or body.get("context") or body.get("images"):
            key = "template" if body.get("template") else ("context" if body.get("context") else "images")
            raise ApiError(400, f"unsupported parameter: {key}")
        prompt = body.get("prompt") or ""
        if not isinstance(prompt, str):
            raise ApiError(400, "prompt must be a string")
        if not prompt:
            await _loaded(send, model, "response", body.get("stream", True), keep_alive)
            return
        fields, budget = _sampling_body(model, body)
        raw = bool(body.get("raw"))
        if raw and (body.get("system") or body.get("format") or body.get("think") is not None):
            raise ApiError(400, "raw prompts take no system, format or think")
        messages = ([{"role": "system", "content": str(body["system"])}] if body.get("system") else [])
        messages.append({"role": "user", "content": prompt})
        req = ChatRequest(
            messages=messages, sampling=sampling_from(fields, n_vocab=int(model.info.get("n_vocab", 1 << 30))),
            max_tokens=budget, grammar=_grammar(body.get("format")), grammar_param="format",
            template_kwargs=_think(model, body.get("think")), stops=fields["stop"] or [],
            raw_prompt=prompt if raw else "")
        await _run(app, scope, receive, send, model, req, "response", body.get("stream", True), owner)

    await answer_errors(send, run, lambda exc: {"error": exc.message})


async def _loaded(send: Send, model: ServedModel, kind: str, stream: Any, keep_alive: float | None) -> None:
    """An empty prompt or message list preloads (``done_reason: load``), or with
    ``keep_alive: 0`` unloads (``done_reason: unload``) once the response has ended."""
    reason = "unload" if keep_alive == 0 else "load"
    record: dict[str, Any] = {"model": model.name, "created_at": _now(), "done": True, "done_reason": reason}
    record.update({"message": {"role": "assistant", "content": ""}} if kind == "message" else {"response": ""})
    if stream is False:
        await send_json(send, 200, record)
    else:
        await send({"type": "http.response.start", "status": 200, "headers": NDJSON_HEADERS})
        await send({"type": "http.response.body", "body": encode_ndjson(record)})


def _stats(reply: Reply) -> dict[str, Any]:
    job = reply.job
    now = trio.current_time()
    first = job.first_token_at or now
    admitted = job.admitted_at or job.created
    return {"done_reason": "length" if reply.finish == "length" else "stop",
            "total_duration": int((now - job.created) * 1e9), "load_duration": 0,
            "prompt_eval_count": len(job.prompt), "prompt_eval_cached_count": job.cached,
            "prompt_eval_duration": int(max(0.0, first - admitted) * 1e9), "eval_count": len(job.tokens),
            "eval_duration": int(max(0.0, now - first) * 1e9)}


def _ollama_calls(calls: list[ToolCall]) -> list[dict[str, Any]]:
    return [{"id": c.id, "function": {"index": i, "name": c.name, "arguments": c.input}} for i, c in enumerate(calls)]


def _record(model: str, kind: str, text: str, thinking: str, calls: list[ToolCall] | None = None) -> dict[str, Any]:
    rec: dict[str, Any] = {"model": model, "created_at": _now()}
    if kind == "message":
        msg: dict[str, Any] = {"role": "assistant", "content": text}
        if thinking:
            msg["thinking"] = thinking
        if calls:
            msg["tool_calls"] = _ollama_calls(calls)
        rec["message"] = msg
    else:
        rec["response"] = text
        if thinking:
            rec["thinking"] = thinking
    return rec


async def _run(app: App, scope: dict[str, Any], receive: Receive, send: Send, model: ServedModel, req: ChatRequest,
               kind: str, stream: Any, owner: Owner) -> None:
    if not isinstance(stream, bool):
        raise ApiError(400, "stream must be a boolean")
    async with open_reply(app, model, req, receive, klass=qos_of(app, scope), owner=owner) as reply:
        if not stream:
            text, thinking, _rows = await reply.collect()
            record = _record(model.name, kind, text, thinking, reply.calls)
            await send_json(send, 200, {**record, "done": True, **_stats(reply)})
        else:
            await _stream_ndjson(send, reply, model.name, kind)
    # outside the disconnect scope: the server reports a finished exchange as a disconnect
    access_log(scope["path"], model, reply.job, 200)


async def _stream_ndjson(send: Send, reply: Reply, model: str, kind: str) -> None:
    await reply.wait_admitted()
    await send({"type": "http.response.start", "status": 200, "headers": NDJSON_HEADERS})
    try:
        while True:
            events, _rows, done = await reply.next()
            text_now = "".join(e.text for e in events if isinstance(e, Delta) and e.channel == "content")
            think_now = "".join(e.text for e in events if isinstance(e, Delta) and e.channel == "reasoning")
            if text_now or think_now:
                await send({"type": "http.response.body", "more_body": True,
                            "body": encode_ndjson({**_record(model, kind, text_now, think_now), "done": False})})
            if done:
                break
        tail = b""
        if reply.calls:
            tail = encode_ndjson({**_record(model, kind, "", "", reply.calls), "done": False})
        final = tail + encode_ndjson({**_record(model, kind, "", ""), "done": True, **_stats(reply)})
    except ApiError as exc:
        final = encode_ndjson({"error": exc.message})
    await send({"type": "http.response.body", "body": final, "more_body": False})
