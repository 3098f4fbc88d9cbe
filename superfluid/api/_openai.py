"""OpenAI dialect: ``/v1/chat/completions``, ``/v1/completions`` (``/v1/embeddings`` is in ``_embed.py``).

Chat requests parse into the neutral :class:`~superfluid.api._chat.ChatRequest`
and run through :func:`~superfluid.api._chat.open_reply`; this module holds
only the OpenAI wire: logprobs, chunks and whole responses.
"""

from __future__ import annotations

import itertools
import time
from typing import TYPE_CHECKING, Any

import attrs

from ..chat import document_schema
from ..proto import encode_sse_json
from ._chat import (
    ChatRequest, Reply, grammar_from_response_format, max_tokens_from, open_reply, openai_call, openai_delta,
    parse_messages, parse_tool_choice, parse_tools, qos_of, render_chat, require_grammar, thinking_kwargs, usage_of,
)
from ..proto._sse_template import MARKER as SSE_TEMPLATE_MARKER
from ..proto._sse_template import SseTemplate
from ._sessions import run_resumable
from ._lane import (
    Follower, open_lane, prepare, resumable_requested, wait_admitted, with_extras,
)
from ._http import ApiError, Receive, Send, send_json
from ._params import integer, sampling_from, stops_from, template_kwargs_from
from ._sse import SseResponse
from ._tenancy import partition_of

if TYPE_CHECKING:
    from ..serving import ServedModel
    from ..sched import Job
    from ._host import App

__all__ = ["chat_completions", "completions"]

_ids = itertools.count(1)


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


# --- handlers ------------------------------------------------------------------------------------------------

async def chat_completions(app: App, scope: dict[str, Any], receive: Receive, send: Send, body: dict[str, Any]) -> None:
    await _generate(app, scope, receive, send, body, chat=True)


async def completions(app: App, scope: dict[str, Any], receive: Receive, send: Send, body: dict[str, Any]) -> None:
    await _generate(app, scope, receive, send, body, chat=False)


async def _generate(app: App, scope: dict[str, Any], receive: Receive, send: Send, body: dict[str, Any], *,
                    chat: bool) -> None:
    model = await app.resolve_model(body.get("model"))
    klass = qos_of(app, scope)
    partition = partition_of(scope, body)
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
            messages=parse_messages(body), sampling=sampling, max_tokens=max_tokens_from(body), tools=tools,
            choice=parse_tool_choice(body.get("tool_choice"), tools),
            grammar=grammar_from_response_format(body.get("response_format")),
            template_kwargs=thinking_kwargs(model.template.source, kwargs, enable=body.get("enable_thinking"),
                                            effort=body.get("reasoning_effort")),
            stops=stops_from(body), ignore_eos=bool(body.get("ignore_eos", False)))
    else:
        prompt = _completion_prompt(body.get("prompt"), n_vocab=int(model.info.get("n_vocab", 1 << 30)))
        grammar = grammar_from_response_format(body.get("response_format"))
        if grammar:
            require_grammar(model, "response_format")
            sampling = attrs.evolve(sampling, grammar=grammar)
        segments, ids = ([(prompt, True)], None) if isinstance(prompt, str) else ([], prompt)
        job = await prepare(model, segments, tokens=ids, sampling=sampling, max_tokens=max_tokens_from(body),
                            klass=klass, partition=partition, ignore_eos=bool(body.get("ignore_eos", False)),
                            add_special=bool(model.info.get("add_bos", False)))
        if stream and resumable_requested(scope):
            await run_resumable(app, model, job, kind="completion", stops=stops_from(body), receive=receive, send=send)
            return
        usage, continuous = _stream_options(body)
        await _run_completion(app, model, job, send, stops_from(body), stream=stream, usage=usage,
                              continuous=continuous)
        return
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
                            partition=partition, ignore_eos=req.ignore_eos)
        await run_resumable(app, model, job, kind="chat", stops=[*req.stops, *rendered.stops], receive=receive,
                            send=send)
        return
    async with open_reply(app, model, req, klass=klass, partition=partition) as reply:
        if stream:
            await _stream_chat(send, reply, rid=rid, created=created, continuous=_stream_options(body)[1])
        else:
            await _whole_chat(send, reply, rid=rid, created=created)


def _completion_prompt(prompt: Any, *, n_vocab: int) -> str | list[int]:
    """``prompt`` of ``/v1/completions``: a string or an array of token ids, either alone or as the
    only member of an array (OpenAI's batch form, which takes several prompts in one request)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return prompt
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        bad = next((t for t in prompt if not 0 <= t < n_vocab), None)
        if bad is not None:
            raise ApiError(400, f"invalid request: prompt token {bad} is outside the vocabulary (0..{n_vocab - 1})",
                           param="prompt")
        return prompt
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise ApiError(400, "several prompts in one request are not supported yet: send one per request",
                       code="unsupported_parameter", param="prompt")
    raise ApiError(400, "invalid request: prompt must be a non-empty string or a non-empty array of token ids",
                   param="prompt")


def _stream_options(body: dict[str, Any]) -> tuple[bool, bool]:
    """``stream_options``: ``include_usage`` (a last chunk with usage) and ``continuous_usage_stats``
    (every chunk carries the usage so far: an accepted draft arrives as one chunk of several tokens)."""
    opts = body.get("stream_options")
    if not isinstance(opts, dict):
        return False, False
    return opts.get("include_usage") is True, opts.get("continuous_usage_stats") is True


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
    await send_json(send, 200, with_extras(obj, reply.job),
                    headers=[(b"x-superfluid-warm", str(reply.job.cached).encode())])


async def _stream_chat(send: Send, reply: Reply, *, rid: str, created: int, continuous: bool = False) -> None:
    def obj(delta: dict[str, Any], finish: str | None, rows: list[Any] | None = None,
            usage: bool = continuous) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        if rows:
            choice["logprobs"] = {"content": _chat_logprobs(rows)}
        out: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk", "created": created,
                               "model": reply.model.name, "system_fingerprint": "superfluid", "choices": [choice]}
        if usage:
            out["usage"] = usage_of(reply.job)
            with_extras(out, reply.job)
        return out

    def chunk(delta: dict[str, Any], finish: str | None, rows: list[Any] | None = None,
              usage: bool = continuous) -> bytes:
        return encode_sse_json(obj(delta, finish, rows, usage))

    # a content-only chunk (most of them); with continuous usage each chunk is built whole
    plain = None if continuous else _template(lambda text: obj({"content": text}, None))

    await reply.wait_admitted()  # errors before admission (an uncompilable grammar) are HTTP errors
    sse = SseResponse(send)
    await sse.start()
    n_calls = 0
    try:
        await sse.send(chunk({"role": "assistant", "content": ""}, None))
        while True:
            events, rows, done = await reply.next()
            delta, n_calls = openai_delta(events, n_calls)
            if plain is not None and not rows and len(delta) == 1 and "content" in delta:
                await sse.send(plain.fill(delta["content"]))
            elif delta or rows:
                await sse.send(chunk(delta, None, rows))
            if done:
                break
    except ApiError as exc:
        await sse.fail(exc)
        return
    await sse.end(chunk({}, reply.finish, usage=True))


def _template(build: Any, *args: Any) -> SseTemplate | None:
    """The :class:`SseTemplate` of ``build(text, *args)``; None if a fixed field (a
    model name) holds the template's marker, and chunks are built the plain way."""
    try:
        return SseTemplate(build(SSE_TEMPLATE_MARKER, *args))
    except ValueError:
        return None


async def _run_completion(app: App, model: ServedModel, job: Job, send: Send,
                          stops: list[str], *, stream: bool, usage: bool = False, continuous: bool = False) -> None:
    rid = f"cmpl-superfluid-{next(_ids)}"
    created = int(time.time())
    follower = Follower(job, stops, document=document_schema(job.sampling.grammar))
    async with open_lane(app, model, job, kind="completion", stops=stops):  # a disconnect cancels the request
        if stream:
            await _stream_completion(send, job, follower, rid=rid, created=created, model=model.name,
                                     usage=usage, continuous=continuous)
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
            await send_json(send, 200, with_extras(obj, job), headers=[(b"x-superfluid-warm", str(job.cached).encode())])


async def _stream_completion(send: Send, job: Job, follower: Follower, *, rid: str, created: int, model: str,
                             usage: bool = False, continuous: bool = False) -> None:
    """Completion chunks; with ``stream_options.include_usage`` a last chunk
    with empty ``choices`` carries ``usage`` (as OpenAI does), and with
    ``continuous_usage_stats`` every chunk carries the usage so far."""
    def obj(text: str, finish: str | None, logprobs: dict[str, Any] | None) -> dict[str, Any]:
        out = {"id": rid, "object": "text_completion", "created": created, "model": model,
               "system_fingerprint": "superfluid",
               "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": logprobs}]}
        if continuous:
            out["usage"] = usage_of(job)
        return out

    # a text-only chunk: its bytes but the text are fixed (not with usage in every chunk)
    plain = None if continuous else _template(obj, None, None)

    def chunk(text: str, finish: str | None, logprobs: dict[str, Any] | None = None) -> bytes:
        if plain is not None and finish is None and logprobs is None:
            return plain.fill(text)
        return encode_sse_json(obj(text, finish, logprobs))

    want_logprobs = job.sampling.n_logprobs >= 0
    offset = 0
    held: list[Any] = []

    await wait_admitted(job)
    sse = SseResponse(send)
    await sse.start()
    try:
        while True:
            text, rows, done = await follower.next_delta()
            held += rows   # tokens whose text is held back (a possible stop) go with the text
            if text:
                logprobs = None
                if want_logprobs:
                    logprobs, offset = _completion_logprobs(held, offset)
                held = []
                await sse.send(chunk(text, None, logprobs))
            if done:
                break
    except ApiError as exc:
        await sse.fail(exc)
        return
    lps = _completion_logprobs(held, offset)[0] if want_logprobs and held else None
    final = (encode_sse_json(with_extras(obj("", follower.finish, lps), job)) if job.spec is not None
             else chunk("", follower.finish, lps))
    if usage:
        final += encode_sse_json({"id": rid, "object": "text_completion", "created": created, "model": model,
                                  "choices": [], "usage": usage_of(job)})
    await sse.end(final)
