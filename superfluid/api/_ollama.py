"""Ollama dialect: ``/``, ``/api/version``, ``/api/tags``, ``/api/ps``,
``/api/show``, ``/api/chat``, ``/api/generate``, ``/api/pull`` (from Hugging Face),
``/api/delete``, ``/api/copy``, and 501s for push and create (``/api/embed`` is in ``_embed.py``).

Streams are NDJSON by default (``"stream": false`` gives one object);
durations are nanoseconds; tool calls arrive whole, with ``arguments`` as an
object, on one ``done: false`` record before the terminal one. Errors are
``{"error": "..."}`` with the real status before the body, or one such line
mid-stream. Discovery (tags, ps, show) never loads a cold model.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
import weakref
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

import attrs
import trio

from .. import __version__
from .._errors import first_leaf
from .._printable import printable
from ..chat import Delta, ToolCall
from ..models._gguf import ModelFacts, model_facts
from ..proto import encode_ndjson
from ._admission import granted_keep_alive
from ._http import ApiError, Receive, Send, read_json, send_json, send_text, answer_errors
from ._chat import (ChatRequest, Reply, open_reply, parse_tool_choice, parse_tools, qos_of, render_chat,
                    thinking_kwargs)
from ._lane import tokenize
from ._tenancy import Partition, partition_of
from ._infill import DEFAULT_FIM_TOKENS, fim_prompt, fim_qos, fim_tokens, open_token_reply
from ._params import MAX_STOP_CHARS, number, sampling_from
from ._principal import principal_of
from ..serving import FOREVER, expires_at_wall, parse_keep_alive

if TYPE_CHECKING:
    from ..sched import QosClass
    from ..serving import ServedModel
    from ._host import App

__all__ = ["api_chat", "api_copy", "api_delete", "api_generate", "api_ps", "api_pull", "api_show",
           "api_tags", "api_version", "managed", "root"]

NDJSON_HEADERS = [(b"content-type", b"application/x-ndjson"), (b"cache-control", b"no-cache")]
_CHAT_FIELDS = {"model", "messages", "tools", "stream", "format", "options", "keep_alive", "think", "logprobs",
                "top_logprobs", "truncate", "shift", "cache_salt"}
_GENERATE_FIELDS = {"model", "prompt", "suffix", "system", "template", "context", "stream", "raw", "format", "images",
                    "options", "keep_alive", "think", "logprobs", "top_logprobs", "truncate", "shift", "cache_salt"}
# Ollama's options (api/types.go) and the JSON type each must have: Ollama refuses a wrong type
# (400 here) and ignores, with a warning, a name it does not know
_INT, _FLOAT, _BOOL, _STRINGS = "integer", "number", "boolean", "array of strings"
_OPTION_TYPES = {
    **dict.fromkeys(("num_keep", "seed", "num_predict", "top_k", "repeat_last_n", "num_ctx", "num_batch", "num_gpu",
                     "main_gpu", "num_thread", "draft_num_predict"), _INT),
    **dict.fromkeys(("top_p", "min_p", "typical_p", "temperature", "repeat_penalty", "presence_penalty",
                     "frequency_penalty"), _FLOAT),
    "use_mmap": _BOOL, "stop": _STRINGS}
# options earlier Ollama versions had (recent ones ignore them as unknown): named as such in the log
_FORMER = {"numa", "low_vram", "f16_kv", "logits_all", "vocab_only", "use_mlock", "embedding_only", "mirostat",
           "mirostat_tau", "mirostat_eta", "penalize_newline", "tfs_z"}
# what the engine does with them; every other option (runner placement, mirostat, typical_p, ...) does not apply
_MAPPED = {"num_predict", "num_ctx", "temperature", "top_p", "min_p", "top_k", "seed", "repeat_penalty",
           "presence_penalty", "frequency_penalty", "stop"}
_IGNORED_LOGGED_MAX = 256   # names logged per daemon: a client inventing names cannot grow the set without bound
_ignored_logged: weakref.WeakKeyDictionary[Any, set[str]] = weakref.WeakKeyDictionary()
log = logging.getLogger("superfluid.ollama")


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
        name = name.removesuffix(":latest")
    return reg.resolve_alias(name)  # (an --alias, hf.co/org/repo:QUANT, ...: the model's own name)


def _details(facts: ModelFacts | None, model: ServedModel | None = None) -> dict[str, Any]:
    family = (facts.family if facts is not None else "") or (model.info.get("architecture", "") if model else "")
    return {"parent_model": "", "format": facts.format if facts is not None else "gguf", "family": family,
            "families": [family] if family else [],
            "parameter_size": facts.parameter_size if facts is not None else "",
            "quantization_level": facts.quantization_level if facts is not None else ""}


def _file_of(app: App, name: str) -> str | None:
    """The file (or directory) model ``name`` loads from; None for the mock or a fleet model."""
    reg = app.registry
    model = reg.loaded.get(name)
    if model is not None:
        return None if model.runtime == "mock" or model.group is not None else model.path
    source = reg.known.get(name)
    return None if source is None or source.runtime == "mock" else source.spec


async def _facts(app: App, names: list[str]) -> dict[str, ModelFacts]:
    """What each model's file says of it (size, quantisation, parameters, family), read in a thread."""
    files = {n: f for n in names if (f := _file_of(app, n)) is not None}
    if not files:
        return {}
    return await trio.to_thread.run_sync(lambda: {n: model_facts(f) for n, f in files.items()})


def _entry(name: str, model: ServedModel | None, facts: ModelFacts | None) -> dict[str, Any]:
    # a loaded model file's digest is the sha256 of its real path: `superfluid models`/`rm` match files by it
    import os

    key = os.path.realpath(model.path) if model is not None and model.runtime != "mock" else name
    modified = _wall(facts.modified) if facts is not None and facts.modified else _now()
    return {"name": name, "model": name, "modified_at": modified, "size": facts.size if facts is not None else 0,
            "digest": hashlib.sha256(key.encode()).hexdigest(), "details": _details(facts, model)}


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
    facts = await _facts(app, names)
    await send_json(send, 200, {"models": [_entry(n, reg.loaded.get(n), facts.get(n)) for n in names]})


async def api_ps(app: App, scope: dict[str, Any], receive: Receive, send: Send, body: dict[str, Any]) -> None:
    """Loaded models with their memory (weights + KV cache; all of it on the CPU, so
    ``size_vram`` 0) and when they unload if no request comes (``_lifetime.py``). A model
    whose keep-alive has run out with no request holding it is being unloaded: it is not listed."""
    _method(scope, "GET", "HEAD")
    reg = app.registry
    models = []
    facts = await _facts(app, list(reg.loaded))
    for n, m in sorted(reg.loaded.items()):
        if not principal_of(scope).may_use(n):
            continue
        at = expires_at_wall(m, default=reg.default, idle_timeout_s=reg.idle_timeout_s,
                             pinned_until=reg.pinned_until(n, time.time()))
        if at <= time.time() and not (m.holds or m.actor.session_tasks):
            continue  # its last request has ended: it goes as soon as its scheduler has settled
        models.append({**_entry(n, m, facts.get(n)), "size": m.size, "size_vram": 0, "context_length": m.n_ctx,
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
        facts = (await _facts(app, [name])).get(name)
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
        if facts is not None and facts.parameters:
            info["general.parameter_count"] = facts.parameters
        await send_json(send, 200, {"modelfile": "", "parameters": "", "template": template,
                                    "details": _details(facts, model), "model_info": info, "capabilities": caps,
                                    "modified_at": _now()})

    await answer_errors(send, run, lambda exc: {"error": exc.message})


async def managed(app: App, scope: dict[str, Any], receive: Receive, send: Send, body: dict[str, Any]) -> None:
    """``/api/push|create``: superfluid pulls from Hugging Face and pushes to no registry."""
    await send_json(send, 501, {"error": f"{scope['path']} is not supported: superfluid serves the model files "
                                         "it is started with (see `superfluid serve --model`) and manages no registry"})


def _ignored(app: App, key: str) -> None:
    """Log once per daemon that option ``key`` does not apply here (Ollama logs each request)."""
    seen = _ignored_logged.setdefault(app, set())
    if key in seen or len(seen) >= _IGNORED_LOGGED_MAX:
        return
    seen.add(key)
    if key in _OPTION_TYPES or key in _FORMER:
        log.info("ollama option %s does not apply to this server and is ignored (logged once)", key)
    else:
        log.warning("unknown ollama option %s is ignored, as Ollama does (logged once)", printable(key[:100]))


def _typed_option(key: str, value: Any) -> Any:
    """``value`` as option ``key``'s type, as Ollama converts it (a JSON number is an integer
    option's, truncated).

    Raises:
        ApiError: the wrong type, which Ollama refuses too.
    """
    kind = _OPTION_TYPES[key]
    number_ = isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == _INT and number_ and math.isfinite(value):
        return int(value)
    if kind == _FLOAT and number_:
        return value
    if kind == _BOOL and isinstance(value, bool):
        return value
    if kind == _STRINGS and isinstance(value, list) and all(isinstance(s, str) for s in value):
        return value
    raise ApiError(400, f"option {key!r} must be of type {kind}", param=f"options.{key}")


def _sampling_body(model: ServedModel, body: dict[str, Any], app: App | None = None,
                   ) -> tuple[dict[str, Any], int | None]:
    """Ollama ``options`` as OpenAI-style sampling fields, and the token budget. An option
    that does not apply here (GPU placement, threads, mirostat, ...) or that Ollama does not
    know is ignored, and logged once per name.

    Raises:
        ApiError: an option of the wrong type, or out of range.
    """
    raw = body.get("options") or {}
    if not isinstance(raw, dict):
        raise ApiError(400, "options must be an object", param="options")
    opts: dict[str, Any] = {}
    for key, value in raw.items():
        if value is None:
            continue  # Ollama skips a null as unset
        if key in _OPTION_TYPES:
            value = _typed_option(key, value)
        if key in _MAPPED:
            opts[key] = value
        elif app is not None:
            _ignored(app, key)
    out: dict[str, Any] = {k: opts.get(k) for k in ("temperature", "top_p", "min_p", "top_k", "repeat_penalty",
                                                     "presence_penalty", "frequency_penalty")}
    seed = opts.get("seed")
    out["seed"] = None if seed in (None, -1) else seed
    stop = opts.get("stop")
    if stop is not None and (len(stop) > 4 or not all(len(s) <= MAX_STOP_CHARS for s in stop)):
        raise ApiError(400, f"options.stop must be at most 4 strings of at most {MAX_STOP_CHARS} characters",
                       param="options.stop")
    out["stop"] = stop
    predict = opts.get("num_predict")
    if predict is not None and predict <= 0 and predict not in (-1, -2):
        raise ApiError(400, "options.num_predict must be > 0, or -1/-2 to fill the context",
                       param="options.num_predict")
    number(out, "temperature", lo=0.0, hi=100.0)
    return out, (predict if predict and predict > 0 else None)


def _flag(body: dict[str, Any], key: str) -> bool:
    value = body.get(key)
    if value is not None and not isinstance(value, bool):
        raise ApiError(400, f"{key} must be a boolean", param=key)
    return value is not False


async def _prompt_tokens(model: ServedModel, req: ChatRequest, klass: QosClass) -> int:
    rendered = render_chat(model, req)
    add_special = bool(req.raw_prompt) and bool(model.info.get("add_bos", False))
    return len(await tokenize(model, rendered.segments, add_special=add_special, klass=klass))


async def _fit(app: App, scope: dict[str, Any], model: ServedModel, req: ChatRequest,
               body: dict[str, Any]) -> tuple[ChatRequest, list[str]]:
    """``options.num_ctx`` as Ollama applies it, and the warnings the reply carries.

    Above the model's window it is clamped to it. A conversation longer than it loses its
    oldest messages, as Ollama drops them (system messages and the last message stay); one
    still longer is refused with ``truncate: false`` and otherwise sent whole (a warning
    says so: superfluid cuts no message). With ``shift: false`` the reply ends (``length``)
    where the window is full; by default it goes on, as Ollama's context shift lets it,
    within the model's window. No ``num_ctx``: the model's window, as for any request.

    Raises:
        ApiError: a prompt longer than ``num_ctx`` with ``truncate: false``; a bad flag.
    """
    truncate, shift = _flag(body, "truncate"), _flag(body, "shift")
    asked = (body.get("options") or {}).get("num_ctx")   # an integer: _sampling_body checked it
    if asked is None or int(asked) <= 0 or model.n_ctx <= 0:
        return req, []
    window, warnings = int(asked), []
    if window > model.n_ctx:
        warnings.append(f"options.num_ctx {window} is more than this server's context window of {model.n_ctx} "
                        f"tokens: clamped to {model.n_ctx}")
        window = model.n_ctx
    klass = qos_of(app, scope)
    count = await _prompt_tokens(model, req, klass)
    if count >= window and truncate and len(req.messages) > 1 and not req.raw_prompt:
        messages = req.messages

        async def tokens_from(i: int) -> int | None:
            """The prompt's tokens from message ``i`` on, with the system messages before it."""
            kept = [m for m in messages[:i] if m["role"] == "system"] + messages[i:]
            try:
                return await _prompt_tokens(model, attrs.evolve(req, messages=kept), klass)
            except ApiError:
                return None   # the template takes no conversation that starts there

        # the earliest start that fits, as Ollama's walk back from the last message finds it
        # (server/prompt.go chatPrompt), by bisection: a long history costs log2(n) tokenizations
        lo, hi, found = 1, len(messages) - 1, None
        while lo <= hi:
            mid = (lo + hi) // 2
            n = await tokens_from(mid)
            if n is not None and n < window:
                found, hi = (mid, n), mid - 1
            else:
                lo = mid + 1
        if found is None:   # the last message stays, even alone and too long
            n = await tokens_from(len(messages) - 1)
            found = (len(messages) - 1, n) if n is not None else None
        if found is not None:
            start, count = found
            fitted = [m for m in messages[:start] if m["role"] == "system"] + messages[start:]
            warnings.append(f"options.num_ctx {window}: the {len(messages) - len(fitted)} oldest messages did not "
                            "fit and were left out")
            req = attrs.evolve(req, messages=fitted)
    if count >= window:
        if not truncate:
            raise ApiError(400, f"the prompt of {count} tokens exceeds options.num_ctx of {window} tokens",
                           code="context_length_exceeded", param="options.num_ctx")
        warnings.append(f"the prompt of {count} tokens is longer than options.num_ctx {window}: sent whole")
    if not shift:
        room = max(1, window - count)
        req = attrs.evolve(req, max_tokens=min(req.max_tokens or room, room))
    return req, warnings


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
        raw_calls = m.get("tool_calls") or []
        if not isinstance(raw_calls, list):
            raise ApiError(400, f"messages[{i}].tool_calls must be an array", param=f"messages[{i}].tool_calls")
        calls = []
        for k, c in enumerate(raw_calls):
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
        partition = partition_of(scope, body)
        keep_alive = granted_keep_alive(principal_of(scope).admin, _keep_alive(body))
        model = await app.resolve_model(_name(app, body.get("model")))
        app.registry.keep_alive(model, keep_alive)
        messages = _messages(body.get("messages") or [])
        if not messages:
            await _loaded(send, model, "message", body.get("stream", True), keep_alive)
            return
        fields, budget = _sampling_body(model, body, app)
        tools = parse_tools(body.get("tools"))
        req = ChatRequest(
            messages=messages, sampling=sampling_from(fields, n_vocab=int(model.info.get("n_vocab", 1 << 30))),
            max_tokens=budget, tools=tools, choice=parse_tool_choice(None, tools), grammar=_grammar(body.get("format")),
            grammar_param="format", template_kwargs=_think(model, body.get("think")), stops=fields["stop"] or [])
        req, warnings = await _fit(app, scope, model, req, body)
        await _run(app, scope, receive, send, model, req, "message", body.get("stream", True), partition, warnings)

    await answer_errors(send, run, lambda exc: {"error": exc.message})


async def api_generate(app: App, scope: dict[str, Any], receive: Receive, send: Send, body: dict[str, Any]) -> None:
    async def run(send: Send) -> None:
        _check_fields(body, _GENERATE_FIELDS)
        partition = partition_of(scope, body)
        keep_alive = granted_keep_alive(principal_of(scope).admin, _keep_alive(body))
        model = await app.resolve_model(_name(app, body.get("model")))
        app.registry.keep_alive(model, keep_alive)
        if body.get("template") or body.get("context") or body.get("images"):
            key = "template" if body.get("template") else ("context" if body.get("context") else "images")
            raise ApiError(400, f"unsupported parameter: {key}")
        prompt = body.get("prompt") or ""
        if not isinstance(prompt, str):
            raise ApiError(400, "prompt must be a string")
        if body.get("suffix") is not None:
            await _fill_in(app, scope, receive, send, body, model, prompt, partition)
            return
        if not prompt:
            await _loaded(send, model, "response", body.get("stream", True), keep_alive)
            return
        fields, budget = _sampling_body(model, body, app)
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
        req, warnings = await _fit(app, scope, model, req, body)
        await _run(app, scope, receive, send, model, req, "response", body.get("stream", True), partition, warnings)

    await answer_errors(send, run, lambda exc: {"error": exc.message})


async def _fill_in(app: App, scope: dict[str, Any], receive: Receive, send: Send, body: dict[str, Any],
                   model: ServedModel, prompt: str, partition: Partition) -> None:
    """``/api/generate`` with a ``suffix``: the prompt is the code before the cursor, the
    suffix the code after it; the model's FIM markers frame them (``api/_infill.py``)."""
    suffix = body["suffix"]
    if not isinstance(suffix, str):
        raise ApiError(400, "suffix must be a string")
    for key in ("system", "format", "think"):
        if body.get(key) is not None and body.get(key) != "":
            raise ApiError(400, f"a suffix (fill-in-the-middle) takes no {key}", code="unsupported_parameter")
    fim_tokens(model)  # a model without FIM markers is refused before anything is tokenized
    fields, budget = _sampling_body(model, body, app)
    budget = DEFAULT_FIM_TOKENS if budget is None else budget
    klass = fim_qos(app, scope)
    ids, _cut = await fim_prompt(model, prefix=prompt, suffix=suffix, max_new=budget, klass=klass)
    sampling = sampling_from(fields, n_vocab=int(model.info.get("n_vocab", 1 << 30)))
    stream = body.get("stream", True)
    if not isinstance(stream, bool):
        raise ApiError(400, "stream must be a boolean")
    async with open_token_reply(app, model, ids, sampling=sampling, max_tokens=budget, klass=klass,
                                partition=partition, stops=fields["stop"] or []) as reply:
        await _answer(send, reply, model, "response", stream)


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
               kind: str, stream: Any, partition: Partition, warnings: list[str] | None = None) -> None:
    if not isinstance(stream, bool):
        raise ApiError(400, "stream must be a boolean")
    # what the server did otherwise than asked rides on the last record, in a field Ollama clients ignore
    extra = {"superfluid": {"warnings": warnings}} if warnings else {}
    async with open_reply(app, model, req, klass=qos_of(app, scope), partition=partition) as reply:
        await _answer(send, reply, model, kind, stream, extra)


async def _answer(send: Send, reply: Reply, model: ServedModel, kind: str, stream: bool,
                  extra: dict[str, Any] | None = None) -> None:
    extra = extra or {}
    if not stream:
        text, thinking, _rows = await reply.collect()
        record = _record(model.name, kind, text, thinking, reply.calls)
        await send_json(send, 200, {**record, "done": True, **_stats(reply), **extra})
    else:
        await _stream_ndjson(send, reply, model.name, kind, extra)


async def _stream_ndjson(send: Send, reply: Reply, model: str, kind: str, extra: dict[str, Any] | None = None) -> None:
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
        final = tail + encode_ndjson({**_record(model, kind, "", ""), "done": True, **_stats(reply), **(extra or {})})
    except ApiError as exc:
        final = encode_ndjson({"error": exc.message})
    await send({"type": "http.response.body", "body": final, "more_body": False})


# -- model management: pull, delete, copy (admin routes: api/_guard.py) ------------------------------------------

_PULL_STATUS = {"not_found": 404, "ambiguous": 400, "unreachable": 502, "integrity": 502, "failed": 502}


def _register(app: App, name: str, path: Any) -> None:
    from ..serving import ModelSource

    app.registry.known[name] = ModelSource(spec=str(path), runtime="llamacpp", name=name)


async def api_pull(app: App, scope: dict[str, Any], receive: Receive, send: Send, body: dict[str, Any]) -> None:
    """``/api/pull``: an ``org/repo[:QUANT]`` from Hugging Face (``models/_hub.py``), its
    progress as NDJSON in Ollama's shape, or one object with ``stream: false``. A client
    that disconnects cancels the pull (what arrived is kept, and the next pull resumes it)."""
    from ..models._hub import PullError, PullProgress, fetch_async, parse_hub_id, resolve_async

    async def run(send: Send) -> None:
        raw = body.get("model", body.get("name"))
        if not isinstance(raw, str) or not raw:
            raise ApiError(400, "model is required")
        stream = body.get("stream", True)
        if not isinstance(stream, bool):
            raise ApiError(400, "stream must be a boolean")
        principal_of(scope).check_model(raw)
        ref = parse_hub_id(raw.removesuffix(":latest"), disk=False)
        if ref is None:
            raise ApiError(400, f"'{raw}' is not a Hugging Face model id: superfluid pulls org/repo[:QUANT] "
                                "(e.g. unsloth/Qwen3-4B-GGUF:Q4_K_M)")
        progress = PullProgress()
        # a client that leaves cancels the request's scope (api/_lifecycle.py), and so the pull
        try:
            plan = await resolve_async(ref)
            if not stream:
                pulled = await fetch_async(plan, progress)
        except PullError as exc:
            raise ApiError(_PULL_STATUS.get(exc.kind, 502), str(exc)) from None
        if not stream:
            _register(app, pulled.name, pulled.path)
            await send_json(send, 200, {"status": "success"})
            return
        await send({"type": "http.response.start", "status": 200, "headers": NDJSON_HEADERS})
        await _stream_pull(app, send, plan, progress)

    await answer_errors(send, run, lambda exc: {"error": exc.message})


async def _stream_pull(app: App, send: Send, plan: Any, progress: Any) -> None:
    from ..models._hub import PullError, fetch_async

    async def line(obj: dict[str, Any], more: bool = True) -> None:
        await send({"type": "http.response.body", "body": encode_ndjson(obj), "more_body": more})

    await line({"status": "pulling manifest"})
    result: list[Any] = []

    async def report() -> None:
        last: tuple[Any, ...] = ()
        while True:
            state = (progress.status, progress.digest, progress.total, progress.completed)
            if state != last and progress.index:
                last = state
                digest = progress.digest
                if progress.status.startswith(("pulling ", "writing", "verifying")):
                    await line({"status": f"pulling {digest.removeprefix('sha256:')[:12]}", "digest": digest,
                                "total": progress.total, "completed": progress.completed})
                else:
                    await line({"status": progress.status})
            await trio.sleep(0.25)

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(report)
            result.append(await fetch_async(plan, progress))
            nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        failed, rest = group.split(PullError)
        if rest is not None or failed is None:
            raise
        await line({"error": str(first_leaf(failed))}, more=False)
        return
    pulled = result[0]
    _register(app, pulled.name, pulled.path)
    digest = progress.digest
    await line({"status": f"pulling {digest.removeprefix('sha256:')[:12]}", "digest": digest,
                "total": progress.total, "completed": progress.total})
    await line({"status": "verifying sha256 digest"})
    await line({"status": "writing manifest"})
    await line({"status": "success"}, more=False)


# a copy is the library record <percent-encoded name>.json, written through <name>.<pid>.tmp
# (models/_library.py): with that suffix it must fit one file name, 255 bytes (ext4, APFS, ...)
RECORD_STEM_MAX = 255 - len(".4194304.tmp")


def _record_stem(name: str) -> bytes:
    from urllib.parse import quote

    return quote(name, safe="").encode()


def _library_entry(app: App, name: str) -> Any:
    """The pulled, copied or cached model ``name`` names (``:latest`` allowed), or None."""
    from ..models._library import find

    return find(name) or (find(name.removesuffix(":latest")) if name.endswith(":latest") else None)


def _same_file(app: App, entry: Any) -> tuple[list[str], list[str]]:
    """The loaded and the known models whose file is ``entry``'s (blocking: resolves paths)."""
    import os

    real = os.path.realpath(entry.path)
    reg = app.registry
    loaded = [n for n, m in reg.loaded.items() if m.runtime != "mock" and os.path.realpath(m.path) == real]
    known = [n for n, s in reg.known.items() if s.runtime != "mock" and os.path.realpath(s.spec) == real]
    return loaded, known


async def api_delete(app: App, scope: dict[str, Any], receive: Receive, send: Send, body: dict[str, Any]) -> None:
    """``DELETE /api/delete``: remove a pulled or copied model (or a file of the models
    cache directory); one this daemon has loaded is unloaded first (409 if it is the
    only one loaded)."""
    from ..models._library import remove

    async def run(send: Send) -> None:
        _method(scope, "DELETE")
        payload = await read_json(scope, receive)
        name = payload.get("model", payload.get("name"))
        if not isinstance(name, str) or not name:
            raise ApiError(400, "model is required")
        principal_of(scope).check_model(name)
        entry = await trio.to_thread.run_sync(_library_entry, app, name)
        if entry is None:
            raise ApiError(404, f"model '{name}' not found")
        reg = app.registry
        loaded, known = await trio.to_thread.run_sync(_same_file, app, entry)
        for other in loaded if entry.kind != "copy" else ():
            try:
                await reg.unload(other)
            except ValueError:
                raise ApiError(409, f"model '{name}' is the only model loaded; load another one first") from None
        await trio.to_thread.run_sync(remove, entry)
        for other in {entry.name, *(known if entry.kind != "copy" else ())}:
            if other not in reg.loaded:
                reg.known.pop(other, None)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"0")]})
        await send({"type": "http.response.body", "body": b""})

    await answer_errors(send, run, lambda exc: {"error": exc.message})


async def api_copy(app: App, scope: dict[str, Any], receive: Receive, send: Send, body: dict[str, Any]) -> None:
    """``/api/copy``: ``destination`` becomes another name of ``source``'s file, kept in the
    library (``$SUPERFLUID_HOME/library``) across restarts."""
    from pathlib import Path

    from ..models._library import add_copy

    async def run(send: Send) -> None:
        source, dest = body.get("source"), body.get("destination")
        if not isinstance(source, str) or not source or not isinstance(dest, str) or not dest:
            raise ApiError(400, "source and destination are required")
        if len(_record_stem(dest)) > RECORD_STEM_MAX:
            raise ApiError(400, f"destination is too long: percent-encoded it takes {len(_record_stem(dest))} bytes, "
                                f"more than {RECORD_STEM_MAX}", param="destination")
        principal_of(scope).check_model(source)
        principal_of(scope).check_model(dest)
        if dest in app.registry.known or dest in app.registry.loaded:
            raise ApiError(409, f"a model named '{dest}' already exists")
        entry = await trio.to_thread.run_sync(_library_entry, app, source)
        origin: Any = entry
        if entry is None:
            known = app.registry.known.get(_name(app, source))
            if known is None:
                raise ApiError(404, f"model '{source}' not found")
            if known.runtime == "mock":
                raise ApiError(400, f"model '{source}' runs on the mock runtime and has no file to name")
            origin = Path(known.spec)
        try:
            copy = await trio.to_thread.run_sync(add_copy, origin, dest)
        except ValueError as exc:
            raise ApiError(409 if "exists" in str(exc) else 400, str(exc)) from None
        _register(app, copy.name, copy.path)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"0")]})
        await send({"type": "http.response.body", "body": b""})

    await answer_errors(send, run, lambda exc: {"error": exc.message})
