"""OpenAI dialect: ``/v1/chat/completions``, ``/v1/completions`` (``/v1/embeddings`` is in ``_embed.py``).

Chat requests parse into the neutral :class:`~superfluid.api._chat.ChatRequest`
and run through :func:`~superfluid.api._chat.open_reply`; this module holds
only the OpenAI wire: logprobs, chunks and whole responses.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import attrs
import trio

from .._errors import leaves
from ..chat import document_schema
from ..proto import encode_sse_json
from ._chat import (
    ChatRequest, Reply, choices_from, grammar_from_response_format, max_tokens_from, open_replies, open_reply,
    open_siblings, openai_call, openai_delta, parse_messages, parse_tool_choice, parse_tools, qos_of, render_chat,
    require_grammar, thinking_kwargs, usage_of, usage_of_choices,
)
from ..proto._sse_template import MARKER as SSE_TEMPLATE_MARKER
from ..proto._sse_template import SseTemplate
from ._sessions import run_resumable
from ._lane import (
    Follower, open_lane, prepare, resumable_requested, wait_admitted, with_extras,
)
from ._http import ApiError, Receive, Send, send_json
from ._infill import DEFAULT_FIM_TOKENS, fim_prompt, fim_qos, fim_tokens, grammar_of
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
    n = choices_from(body)
    if n > 1 and stream and resumable_requested(scope):
        raise ApiError(400, "a resumable stream carries one choice: n must be 1", code="unsupported_parameter",
                       param="n")
    sampling = sampling_from(body, n_vocab=int(model.info.get("n_vocab", 1 << 30)),
                             want_logprobs=_logprobs_want(body, chat))
    if chat:
        tools = parse_tools(body.get("tools"))
        kwargs = template_kwargs_from(body)
        req = ChatRequest(
            messages=parse_messages(body), sampling=sampling, max_tokens=max_tokens_from(body), tools=tools,
            choice=parse_tool_choice(body.get("tool_choice"), tools),
            grammar=_grammar(body), grammar_param="grammar" if body.get("grammar") else "response_format",
            template_kwargs=thinking_kwargs(model.template.source, kwargs, enable=body.get("enable_thinking"),
                                            effort=body.get("reasoning_effort")),
            stops=stops_from(body), ignore_eos=bool(body.get("ignore_eos", False)))
    else:
        prompt = _completion_prompt(body.get("prompt"), n_vocab=int(model.info.get("n_vocab", 1 << 30)))
        grammar = _grammar(body)
        if grammar:
            require_grammar(model, "response_format" if body.get("response_format") else "grammar")
            sampling = attrs.evolve(sampling, grammar=grammar)
        max_tokens = max_tokens_from(body)
        segments, ids = ([(prompt, True)], None) if isinstance(prompt, str) else ([], prompt)
        fim = _fim_mode(model, body)
        if fim is not None:
            if not isinstance(prompt, str):
                raise ApiError(400, "a suffix (fill-in-the-middle) takes a text prompt, not token ids",
                               code="unsupported_parameter", param="prompt")
            klass = fim_qos(app, scope)
            max_tokens = DEFAULT_FIM_TOKENS if max_tokens is None else max_tokens
            segments = []
            ids, _cut = await fim_prompt(model, prefix=prompt, suffix=body["suffix"], spm=fim == "spm",
                                         max_new=max_tokens, klass=klass)
        job = await prepare(model, segments, tokens=ids, sampling=sampling, max_tokens=max_tokens,
                            klass=klass, partition=partition, ignore_eos=bool(body.get("ignore_eos", False)),
                            add_special=bool(model.info.get("add_bos", False)))
        if stream and resumable_requested(scope):
            await run_resumable(app, model, job, kind="completion", stops=stops_from(body), receive=receive, send=send)
            return
        usage, continuous = _stream_options(body)
        if n > 1:
            await _run_completions(app, model, job, n, send, stops_from(body), stream=stream, usage=usage,
                                   continuous=continuous)
            return
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
    if n > 1:
        async with open_replies(app, model, req, n, klass=klass, partition=partition) as replies:
            if stream:
                await _stream_chats(send, replies, rid=rid, created=created, continuous=_stream_options(body)[1])
            else:
                await _whole_chats(send, replies, rid=rid, created=created)
        return
    async with open_reply(app, model, req, klass=klass, partition=partition) as reply:
        if stream:
            await _stream_chat(send, reply, rid=rid, created=created, continuous=_stream_options(body)[1])
        else:
            await _whole_chat(send, reply, rid=rid, created=created)


def _grammar(body: dict[str, Any]) -> str:
    """The output constraint: ``response_format``, or a raw GBNF ``grammar`` (llama-server's field).

    Raises:
        ApiError: 400 for both at once, or a bad value.
    """
    fmt, gbnf = grammar_from_response_format(body.get("response_format")), grammar_of(body)
    if fmt and gbnf:
        raise ApiError(400, "invalid request: give a response_format or a grammar, not both", param="grammar")
    return fmt or gbnf


def _fim_mode(model: ServedModel, body: dict[str, Any]) -> str | None:
    """``psm``/``spm`` for a fill-in-the-middle request (a ``suffix``), None for a plain one. An empty
    suffix on a model without FIM markers is a plain completion (clients send one at the end of a file).

    Raises:
        ApiError: 400 a bad ``suffix``/``fim_mode``, or ``fim_unsupported``.
    """
    suffix, mode = body.get("suffix"), body.get("fim_mode")
    if suffix is not None and not isinstance(suffix, str):
        raise ApiError(400, "invalid request: suffix must be a string", param="suffix")
    if mode is not None and mode not in ("psm", "spm"):
        raise ApiError(400, 'invalid request: fim_mode must be "psm" or "spm"', code="invalid_value",
                       param="fim_mode")
    if suffix is None:
        if mode is not None:
            raise ApiError(400, "fim_mode needs a suffix", code="unsupported_parameter", param="fim_mode")
        return None
    if not suffix:
        try:
            fim_tokens(model)
        except ApiError:
            return None
    fim_tokens(model)
    return mode or "psm"


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


# --- n > 1: a request's choices, each its own job (api/_chat.py ``open_siblings``) ----------------------------

@asynccontextmanager
async def _interleaved(steps: list[Callable[[], Awaitable[tuple[Any, ...]]]]
                       ) -> AsyncIterator[trio.MemoryReceiveChannel[tuple[int, Any]]]:
    """Follow each choice at once: ``steps[i]()`` is choice ``i``'s next progress (a tuple whose
    last item is ``done``), run until done in this block's own nursery. The block reads
    ``(index, progress)``, or ``(index, ApiError)`` for a choice that failed. The channel holds
    one item a choice: a slow client holds back its readers, never the lanes (the jobs run on).

    Raises:
        whatever the block raised (not wrapped in an exception group; as ``open_request``).
    """
    out, into = trio.open_memory_channel[tuple[int, Any]](len(steps))

    async def follow(index: int, step: Callable[[], Awaitable[tuple[Any, ...]]],
                     out: trio.MemorySendChannel[tuple[int, Any]]) -> None:
        async with out:
            while True:
                try:
                    got = await step()
                except ApiError as exc:
                    await out.send((index, exc))
                    return
                await out.send((index, got))
                if got[-1]:
                    return

    try:
        async with trio.open_nursery() as nursery:
            async with out:
                for index, step in enumerate(steps):
                    nursery.start_soon(follow, index, step, out.clone())
            try:
                yield into
            finally:
                nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        failures = leaves(group)
        errors = [exc for exc in failures if not isinstance(exc, trio.Cancelled)]
        if len(errors) == 1:
            failures = errors
        if len(failures) > 1:
            raise
        raise failures[0] from None  # noqa: ASYNC123 - the block's own exception; the group is this nursery's


def _chat_choice(index: int, reply: Reply, text: str, reasoning: str, lps: list[Any]) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": text if text or not reply.calls else None}
    if reasoning:
        message["reasoning_content"] = reasoning
    if reply.calls:
        message["tool_calls"] = [openai_call(c, i) for i, c in enumerate(reply.calls)]
    choice: dict[str, Any] = {"index": index, "message": message, "finish_reason": reply.finish, "logprobs": None}
    if lps:
        choice["logprobs"] = {"content": _chat_logprobs(lps)}
    return choice


async def _whole_chats(send: Send, replies: list[Reply], *, rid: str, created: int) -> None:
    """One chat.completion of every choice (the jobs run at once; each is read to its end in turn)."""
    choices = []
    for index, reply in enumerate(replies):
        text, reasoning, lps = await reply.collect()
        choices.append(_chat_choice(index, reply, text, reasoning, lps))
    first = replies[0]
    obj = {"id": rid, "object": "chat.completion", "created": created, "model": first.model.name,
           "system_fingerprint": "superfluid", "choices": choices,
           "usage": usage_of_choices([r.job for r in replies])}
    await send_json(send, 200, with_extras(obj, first.job),
                    headers=[(b"x-superfluid-warm", str(first.job.cached).encode())])


async def _stream_chats(send: Send, replies: list[Reply], *, rid: str, created: int,
                        continuous: bool = False) -> None:
    """Chunks of every choice as they come, each naming its ``index``; a choice's last chunk has its
    ``finish_reason``, and the last of all carries the usage of all."""
    jobs = [r.job for r in replies]
    n_calls = [0] * len(replies)

    def chunk(index: int, delta: dict[str, Any], finish: str | None, rows: list[Any] | None = None,
              usage: bool = continuous) -> bytes:
        choice: dict[str, Any] = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": None}
        if rows:
            choice["logprobs"] = {"content": _chat_logprobs(rows)}
        out: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk", "created": created,
                               "model": replies[0].model.name, "system_fingerprint": "superfluid",
                               "choices": [choice]}
        if usage:
            out["usage"] = usage_of_choices(jobs)
        return encode_sse_json(out)

    await replies[0].wait_admitted()  # errors before admission (an uncompilable grammar) are HTTP errors
    sse = SseResponse(send)
    await sse.start()
    await sse.send(b"".join(chunk(i, {"role": "assistant", "content": ""}, None) for i in range(len(replies))))
    left = len(replies)
    last = b""
    async with _interleaved([r.next for r in replies]) as progress:
        async for index, got in progress:
            if isinstance(got, ApiError):
                await sse.fail(got)
                return
            events, rows, done = got
            delta, n_calls[index] = openai_delta(events, n_calls[index])
            if delta or rows:
                await sse.send(chunk(index, delta, None, rows))
            if done:
                left -= 1
                if left:
                    await sse.send(chunk(index, {}, replies[index].finish))
                else:
                    last = chunk(index, {}, replies[index].finish, usage=True)
    await sse.end(last)


async def _run_completions(app: App, model: ServedModel, first: Job, n: int, send: Send, stops: list[str], *,
                           stream: bool, usage: bool = False, continuous: bool = False) -> None:
    """``/v1/completions`` with ``n`` choices: ``first`` and its siblings, one prefill."""
    rid = f"cmpl-superfluid-{next(_ids)}"
    created = int(time.time())
    async with open_lane(app, model, first, kind="completion", stops=stops):  # a disconnect cancels every choice
        async with open_siblings(app, model, first, n, kind="completion", stops=stops) as siblings:
            jobs = [first, *siblings]
            followers = [Follower(job, stops, document=document_schema(job.sampling.grammar)) for job in jobs]
            if stream:
                await _stream_completions(send, jobs, followers, rid=rid, created=created, model=model.name,
                                          usage=usage, continuous=continuous)
                return
            choices = []
            for index, (job, follower) in enumerate(zip(jobs, followers, strict=True)):
                parts: list[str] = []
                rows: list[Any] = []
                while True:
                    text, got, done = await follower.next_delta()
                    parts.append(text)
                    rows += got
                    if done:
                        break
                logprobs = _completion_logprobs(rows, 0)[0] if job.sampling.n_logprobs >= 0 else None
                choices.append({"index": index, "text": "".join(parts), "logprobs": logprobs,
                                "finish_reason": follower.finish})
            obj = {"id": rid, "object": "text_completion", "created": created, "model": model.name,
                   "choices": choices, "usage": usage_of_choices(jobs)}
            await send_json(send, 200, with_extras(obj, first),
                            headers=[(b"x-superfluid-warm", str(first.cached).encode())])


async def _stream_completions(send: Send, jobs: list[Job], followers: list[Follower], *, rid: str, created: int,
                              model: str, usage: bool = False, continuous: bool = False) -> None:
    """Completion chunks of every choice as they come, each naming its ``index``; usage as
    :func:`_stream_completion` sends it, summed over the choices."""
    def chunk(index: int, text: str, finish: str | None, logprobs: dict[str, Any] | None = None) -> bytes:
        out: dict[str, Any] = {"id": rid, "object": "text_completion", "created": created, "model": model,
                               "system_fingerprint": "superfluid",
                               "choices": [{"index": index, "text": text, "finish_reason": finish,
                                            "logprobs": logprobs}]}
        if continuous:
            out["usage"] = usage_of_choices(jobs)
        return encode_sse_json(out)

    want_logprobs = jobs[0].sampling.n_logprobs >= 0
    offsets = [0] * len(jobs)
    held: list[list[Any]] = [[] for _ in jobs]
    await wait_admitted(jobs[0])
    sse = SseResponse(send)
    await sse.start()
    async with _interleaved([f.next_delta for f in followers]) as progress:
        async for index, got in progress:
            if isinstance(got, ApiError):
                await sse.fail(got)
                return
            text, rows, done = got
            held[index] += rows   # tokens whose text is held back (a possible stop) go with the text
            if text:
                logprobs = None
                if want_logprobs:
                    logprobs, offsets[index] = _completion_logprobs(held[index], offsets[index])
                held[index] = []
                await sse.send(chunk(index, text, None, logprobs))
            if done:
                lps = (_completion_logprobs(held[index], offsets[index])[0]
                       if want_logprobs and held[index] else None)
                await sse.send(chunk(index, "", followers[index].finish, lps))
    final = b""
    if usage:
        final = encode_sse_json({"id": rid, "object": "text_completion", "created": created, "model": model,
                                 "choices": [], "usage": usage_of_choices(jobs)})
    await sse.end(final)
