"""Fill-in-the-middle, and llama-server's own routes: ``/infill``, ``/completion``, ``/tokenize``, ``/detokenize``,
``/slots``.

A FIM prompt is built from the model's own marker tokens (the worker reports them:
``info.extra.fim``, from GGUF ``tokenizer.ggml.fim_*_token_id`` or the vocabulary),
never from marker text, so code that happens to contain ``<fim_prefix>`` stays text.
The layout is llama-server's: with repo-level markers (``rep``/``sep``) the extra
chunks come as files of a repository, otherwise as snippets, then

    PSM: <PRE>prefix<SUF>suffix<MID>prompt       SPM: <SUF>suffix<PRE>prefix<MID>prompt

A model without the markers is refused (400 ``fim_unsupported``), never served a
prompt it was not trained on. FIM requests run in the ``completion`` QoS class
unless the client (or its key) names one. The OpenAI ``suffix`` and Ollama
``suffix`` paths (``_openai.py``, ``_ollama.py``) use :func:`fim_prompt` too.

``/tokenize`` and ``/detokenize`` ask the model's worker (it owns the vocabulary):
a piece is a token's bytes, shown as text when they are UTF-8, else as their values.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs

import attrs
import trio

from ..chat import ReplyParser
from ..proto import SLOT_ACTIONS, SLOT_FILE, encode_sse_json
from ..sched import QosClass, Unavailable, cache_partition
from ._chat import Reply, qos_of, require_grammar
from ._http import ApiError, Receive, Send, header, read_json, send_json
from ._lane import Follower, open_lane, prepare, prompt_limit, tokenize, wait_admitted
from ._params import integer, sampling_from, stops_from
from ._principal import QOS, principal_of
from ._sse import SseResponse
from ._tenancy import Partition, partition_of

if TYPE_CHECKING:
    from ..sched import Job
    from ..serving import ServedModel
    from ._host import App

__all__ = ["DEFAULT_FIM_TOKENS", "FimTokens", "MAX_DETOKENIZE", "MAX_EXTRA_CHUNKS", "completion", "detokenize",
           "fim_prompt", "fim_qos", "fim_tokens", "grammar_of", "infill", "open_token_reply", "slot_action_route", "slot_rows", "slots_route", "tokenize_route"]

MAX_DETOKENIZE = 1 << 20         # ids in one /detokenize (a prompt's worth; the body limits allow about that)
MAX_EXTRA_CHUNKS = 256           # input_extra entries (llama.vscode sends at most a few dozen)
DEFAULT_FIM_TOKENS = 128         # a completion's length when the client names none (OpenAI and Ollama suffix)
_SNIPPET = "\n\n--- snippet ---\n\n"  # llama-server's separator of extra chunks without file markers
_REPO = "myproject\n"            # llama-server's repository name in the repo-level pattern
_ids = itertools.count(1)

# marker spellings for runtimes that report only their special tokens (MLX): Qwen/DeepSeek-style, StarCoder's
_SPELLINGS = (
    {"pre": "<|fim_prefix|>", "suf": "<|fim_suffix|>", "mid": "<|fim_middle|>", "rep": "<|repo_name|>",
     "sep": "<|file_sep|>"},
    {"pre": "<fim_prefix>", "suf": "<fim_suffix>", "mid": "<fim_middle>", "rep": "<repo_name>", "sep": "<file_sep>"},
    {"pre": "<fim-prefix>", "suf": "<fim-suffix>", "mid": "<fim-middle>"},
)


@attrs.frozen
class FimTokens:
    """A model's FIM marker ids; ``rep`` and ``sep`` (repository name, file separator) may be absent."""

    pre: int
    suf: int
    mid: int
    rep: int | None = None
    sep: int | None = None


def fim_tokens(model: ServedModel, param: str = "suffix") -> FimTokens:
    """``model``'s FIM markers.

    Raises:
        ApiError: 400 ``fim_unsupported`` when it has none.
    """
    info = model.info
    found = {k: v for k, v in ((info.get("extra") or {}).get("fim") or {}).items() if isinstance(v, int)}
    if not {"pre", "suf", "mid"} <= found.keys():
        specials: dict[str, int] = info.get("special_tokens") or {}
        for spelling in _SPELLINGS:
            if all(spelling[k] in specials for k in ("pre", "suf", "mid")):
                found = {k: specials[text] for k, text in spelling.items() if text in specials}
                break
        else:
            raise ApiError(400, f"model '{model.name}' has no fill-in-the-middle tokens: serve a code model "
                                "trained for it (e.g. Qwen2.5-Coder, StarCoder2, CodeLlama)",
                           code="fim_unsupported", param=param)
    return FimTokens(found["pre"], found["suf"], found["mid"], found.get("rep"), found.get("sep"))


def fim_qos(app: App, scope: dict[str, Any]) -> QosClass:
    """A FIM request's class: ``x-superfluid-qos`` or its key's class, else ``completion``
    (an editor waits on it, but behind a chat)."""
    if (header(scope, "x-superfluid-qos") is not None or principal_of(scope).key is not None
            or scope.get(QOS) is not None):
        return qos_of(app, scope)
    return QosClass.COMPLETION


def parse_extra(raw: Any, param: str = "input_extra") -> list[tuple[str, str]]:
    """``input_extra``: an array of ``{filename, text}`` (llama-server's defaults: ``tmp``, ``""``)."""
    if raw is None:
        return []
    if not isinstance(raw, list) or len(raw) > MAX_EXTRA_CHUNKS:
        raise ApiError(400, f"invalid request: {param} must be an array of at most {MAX_EXTRA_CHUNKS} "
                            "{filename, text} objects", param=param)
    out = []
    for i, chunk in enumerate(raw):
        if not isinstance(chunk, dict):
            raise ApiError(400, f"invalid request: {param}[{i}] must be an object", param=param)
        name, text = chunk.get("filename", "tmp"), chunk.get("text", "")
        if not isinstance(name, str) or not isinstance(text, str):
            raise ApiError(400, f"invalid request: {param}[{i}].filename and .text must be strings", param=param)
        out.append((name, text))
    return out


async def fim_prompt(model: ServedModel, *, prefix: str, suffix: str, prompt: str = "",
                     extra: list[tuple[str, str]] | None = None, spm: bool = False, max_new: int | None,
                     klass: QosClass, param: str = "suffix") -> tuple[list[int], bool]:
    """The token ids of a FIM request, and whether any input was cut to fit.

    What does not fit the window (less ``max_new`` up to half of it, or a quarter for no
    limit) is cut as llama-server cuts it: the prefix from its start, the suffix from its end
    (three quarters of the room to the prefix when both are long), then the extra
    chunks from their start.

    Raises:
        ApiError: 400 ``fim_unsupported``; 413 inputs over the prompt-size limit; 503 no worker.
    """
    fim = fim_tokens(model, param)
    extra = extra or []
    texts = [prefix, suffix, prompt, *(t for chunk in extra for t in chunk)]
    size = sum(len(t) for t in texts)
    limit = prompt_limit(model)
    if size > limit:  # (each piece is checked again, exactly, as it is tokenized)
        raise ApiError(413, f"the fill-in-the-middle inputs are {size} characters, over the {limit}-byte limit "
                            f"for model '{model.name}' (--max-prompt-bytes)", code="prompt_too_large", param=param)

    async def tok(text: str) -> list[int]:
        # marker text in code stays text: the markers are the ids above
        return await tokenize(model, [(text, False)], add_special=False, klass=klass) if text else []

    head: list[int] = []
    if fim.rep is not None:
        head += [fim.rep, *await tok(_REPO)]
    for name, text in extra:
        head += [fim.sep, *await tok(name + "\n")] if fim.sep is not None else await tok(_SNIPPET)
        head += await tok(text)
    if fim.sep is not None:
        head += [fim.sep, *await tok("filename\n")]
    pre, suf, mid = await tok(prefix), await tok(suffix), await tok(prompt)

    info = model.info
    bos = [int(info["bos"])] if info.get("add_bos") and isinstance(info.get("bos"), int) else []
    # the reply's room, but never more than half the window: a huge max_tokens must not cut the code away
    reserve = min(max_new, model.n_ctx // 2) if max_new is not None else model.n_ctx // 4
    room = max(0, model.n_ctx - reserve - len(bos) - 3 - len(mid))
    n_pre = min(len(pre), max(room * 3 // 4, room - len(suf)))
    n_suf = min(len(suf), room - n_pre)
    n_head = min(len(head), room - n_pre - n_suf)
    cut = n_pre < len(pre) or n_suf < len(suf) or n_head < len(head)
    pre, suf, head = pre[len(pre) - n_pre:], suf[:n_suf], head[len(head) - n_head:]
    first, second = ([fim.suf, *suf], [fim.pre, *pre]) if spm else ([fim.pre, *pre], [fim.suf, *suf])
    return [*bos, *head, *first, *second, fim.mid, *mid], cut


@asynccontextmanager
async def open_token_reply(app: App, model: ServedModel, prompt: list[int], *, sampling: Any,
                           max_tokens: int | None, klass: QosClass, partition: Partition,
                           stops: list[str]) -> AsyncIterator[Reply]:
    """Submit and follow a prompt given as token ids (a FIM prompt) as a :class:`Reply`
    with no chat parsing: what the dialects' chat paths read, from a plain completion."""
    if sampling.grammar:
        require_grammar(model, "grammar")
    job = await prepare(model, [], tokens=prompt, sampling=sampling, max_tokens=max_tokens, klass=klass,
                        partition=partition)
    async with open_lane(app, model, job, kind="completion", stops=stops):
        yield Reply(model, job, Follower(job, stops), ReplyParser())


def grammar_of(body: dict[str, Any]) -> str:
    """A raw GBNF ``grammar`` (llama-server's field); empty for none.

    Raises:
        ApiError: 400 for a value that is not a GBNF text.
    """
    grammar = body.get("grammar")
    if grammar in (None, ""):
        return ""
    # "json" and "json_schema:..." are the worker's names for other constraints; neither is GBNF
    if not isinstance(grammar, str) or "::=" not in grammar:
        raise ApiError(400, "invalid request: grammar must be a GBNF grammar (rules such as root ::= ...)",
                       param="grammar")
    return grammar


# --- llama-server's /infill and /completion ----------------------------------------------------------------------

def _llama_sampling(model: ServedModel, body: dict[str, Any]) -> Any:
    fields = dict(body)
    if fields.get("seed") == -1:   # llama-server's "random"
        fields.pop("seed")
    fields.setdefault("temperature", 0.8)   # llama-server's default
    sampling = sampling_from(fields, n_vocab=int(model.info.get("n_vocab", 1 << 30)))
    grammar = grammar_of(body)
    return attrs.evolve(sampling, grammar=grammar) if grammar else sampling


def _n_predict(body: dict[str, Any]) -> int | None:
    """-1 or absent: no limit; 0: llama-server's "evaluate the prompt into the cache, generate
    nothing" (llama.vscode warms the next completion's prompt this way)."""
    n = integer(body, "n_predict", lo=-1, hi=1 << 30)
    return None if n is None or n < 0 else n


def _prompt_of(model: ServedModel, raw: Any, param: str) -> str | list[int]:
    if raw is None or isinstance(raw, str):
        return raw or ""
    n_vocab = int(model.info.get("n_vocab", 1 << 30))
    if isinstance(raw, list) and raw and all(type(t) is int and 0 <= t < n_vocab for t in raw):
        return list(raw)
    raise ApiError(400, f"invalid request: {param} must be a string or an array of token ids of this model",
                   param=param)


async def infill(app: App, scope: dict[str, Any], receive: Receive, send: Send, body: dict[str, Any]) -> None:
    """``POST /infill`` (llama-server): ``input_prefix``, ``input_suffix``, ``input_extra``, ``prompt``."""
    model = await app.resolve_model(body.get("model") or app.registry.default)
    texts = {}
    for key in ("input_prefix", "input_suffix", "prompt"):
        value = body.get(key)
        if value is not None and not isinstance(value, str):
            raise ApiError(400, f"invalid request: {key} must be a string", param=key)
        texts[key] = value or ""
    extra = parse_extra(body.get("input_extra") if body.get("input_extra") is not None else body.get("extra_context"))
    sampling = _llama_sampling(model, body)
    max_new = _n_predict(body)
    klass = fim_qos(app, scope)
    ids, cut = await fim_prompt(model, prefix=texts["input_prefix"], suffix=texts["input_suffix"],
                                prompt=texts["prompt"], extra=extra, max_new=max_new, klass=klass,
                                param="input_suffix")
    await _serve_llama(app, scope, send, body, model, ids, sampling=sampling, max_new=max_new, klass=klass,
                       truncated=cut)


async def completion(app: App, scope: dict[str, Any], receive: Receive, send: Send, body: dict[str, Any]) -> None:
    """``POST /completion`` (llama-server): ``prompt`` as text or token ids, no template."""
    model = await app.resolve_model(body.get("model") or app.registry.default)
    prompt = _prompt_of(model, body.get("prompt"), "prompt")
    if not prompt:
        raise ApiError(400, "invalid request: prompt must be a non-empty string or array of token ids",
                       param="prompt")
    sampling = _llama_sampling(model, body)
    max_new = _n_predict(body)
    klass = qos_of(app, scope)
    add_bos = bool(model.info.get("add_bos", False))
    ids = (prompt if isinstance(prompt, list)
           else await tokenize(model, [(prompt, True)], add_special=add_bos, klass=klass))
    await _serve_llama(app, scope, send, body, model, ids, sampling=sampling, max_new=max_new, klass=klass,
                       truncated=False)


async def _serve_llama(app: App, scope: dict[str, Any], send: Send, body: dict[str, Any], model: ServedModel,
                       ids: list[int], *, sampling: Any, max_new: int | None, klass: QosClass,
                       truncated: bool) -> None:
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "invalid request: stream must be a boolean", param="stream")
    stops = stops_from(body)
    if max_new == 0:
        # a warm-up: the prompt is prefilled into the cache by a one-token generation whose
        # token is not returned (a lane always draws at least one token)
        async with open_token_reply(app, model, ids, sampling=sampling, max_tokens=1, klass=klass,
                                    partition=partition_of(scope, body), stops=stops) as reply:
            while not (await reply.follower.next_delta())[2]:
                pass
            final = _final(model, reply.job, reply.follower, "", truncated)
        final.update(tokens_predicted=0, stop_type="limit")
        final["timings"].update(predicted_n=0, predicted_ms=0.0, predicted_per_token_ms=0.0, predicted_per_second=0.0)
        if stream:
            sse = SseResponse(send, done=False)
            await sse.start()
            await sse.end(encode_sse_json(final))
        else:
            await send_json(send, 200, final)
        return
    async with open_token_reply(app, model, ids, sampling=sampling, max_tokens=max_new, klass=klass,
                                partition=partition_of(scope, body), stops=stops) as reply:
        follower = reply.follower
        if not stream:
            parts = []
            while True:
                text, _rows, done = await follower.next_delta()
                parts.append(text)
                if done:
                    break
            content = "".join(parts)
            await send_json(send, 200, _final(model, reply.job, follower, content, truncated))
            return
        await wait_admitted(reply.job)
        sse = SseResponse(send, done=False)   # llama-server's own streams end without [DONE]
        await sse.start()
        try:
            while True:
                text, _rows, done = await follower.next_delta()
                if text:
                    await sse.send(encode_sse_json(
                        {"index": 0, "content": text, "tokens": [], "stop": False, "id_slot": -1,
                         "tokens_predicted": len(reply.job.tokens), "tokens_evaluated": len(reply.job.prompt)}))
                if done:
                    break
        except ApiError as exc:
            await sse.fail(exc)
            return
        await sse.end(encode_sse_json(_final(model, reply.job, follower, "", truncated)))


def _final(model: ServedModel, job: Job, follower: Follower, content: str, truncated: bool) -> dict[str, Any]:
    """llama-server's last object of a completion: the text (whole, or empty at a stream's end),
    why it stopped (``eos``, ``word``, ``limit``) and timings in milliseconds."""
    word = follower.text.stopped
    stop_type = "word" if word else ("limit" if follower.finish == "length" else "eos")
    now = trio.current_time()
    first = job.first_token_at or now
    admitted = job.admitted_at or job.created
    prompt_ms = max(0.0, first - admitted) * 1e3
    predicted_ms = max(0.0, now - first) * 1e3
    n_prompt, n_new = len(job.prompt) - job.cached, len(job.tokens)
    return {
        "index": 0, "content": content, "tokens": [], "id_slot": 0, "stop": True, "model": model.name,
        "tokens_predicted": n_new, "tokens_evaluated": len(job.prompt), "prompt": "",
        "has_new_line": "\n" in content, "truncated": truncated, "stop_type": stop_type,
        "stopping_word": "", "tokens_cached": job.cached,
        "timings": {"prompt_n": n_prompt, "prompt_ms": prompt_ms,
                    "prompt_per_token_ms": prompt_ms / n_prompt if n_prompt else 0.0,
                    "prompt_per_second": n_prompt / prompt_ms * 1e3 if prompt_ms else 0.0,
                    "predicted_n": n_new, "predicted_ms": predicted_ms,
                    "predicted_per_token_ms": predicted_ms / n_new if n_new else 0.0,
                    "predicted_per_second": n_new / predicted_ms * 1e3 if predicted_ms else 0.0},
    }


# --- llama-server's /tokenize and /detokenize ---------------------------------------------------------------------

def _flag(body: dict[str, Any], key: str, default: bool) -> bool:
    value = body.get(key, default)
    if not isinstance(value, bool):
        raise ApiError(400, f"invalid request: {key} must be a boolean", param=key)
    return value


def _piece(data: bytes) -> str | list[int]:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return list(data)   # part of a character: its bytes, as llama-server shows them


async def tokenize_route(app: App, scope: dict[str, Any], receive: Receive, send: Send, body: dict[str, Any]) -> None:
    """``POST /tokenize``: ``content``, ``add_special`` (BOS; default false), ``parse_special``
    (marker text becomes marker ids; default true), ``with_pieces``; the model by ``model`` or the default."""
    model = await app.resolve_model(body.get("model") or app.registry.default)
    content = body.get("content")
    if not isinstance(content, str):
        raise ApiError(400, "invalid request: content must be a string", param="content")
    add_special, parse_special = _flag(body, "add_special", False), _flag(body, "parse_special", True)
    with_pieces = _flag(body, "with_pieces", False)
    if not with_pieces:
        ids = await tokenize(model, [(content, parse_special)], add_special=add_special, klass=qos_of(app, scope))
        await send_json(send, 200, {"tokens": ids})
        return
    limit = prompt_limit(model)
    if len(content) > limit or len(content.encode("utf-8", "surrogatepass")) > limit:
        raise ApiError(413, f"content is over the {limit}-byte limit for model '{model.name}' (--max-prompt-bytes)",
                       code="prompt_too_large", param="content")
    try:
        pairs = await model.scheduler.pieces([(content, parse_special)], add_special=add_special,
                                             klass=qos_of(app, scope))
    except Unavailable as exc:
        raise ApiError(503, str(exc), code=exc.code) from None
    await send_json(send, 200, {"tokens": [{"id": t, "piece": _piece(p)} for t, p in pairs]})


async def detokenize(app: App, scope: dict[str, Any], receive: Receive, send: Send, body: dict[str, Any]) -> None:
    """``POST /detokenize``: ``tokens`` (ids of the model's vocabulary) to ``content``."""
    model = await app.resolve_model(body.get("model") or app.registry.default)
    ids = body.get("tokens")
    n_vocab = int(model.info.get("n_vocab", 1 << 30))
    if not isinstance(ids, list) or not all(type(t) is int for t in ids):
        raise ApiError(400, "invalid request: tokens must be an array of token ids", param="tokens")
    if len(ids) > MAX_DETOKENIZE:
        raise ApiError(413, f"invalid request: more than {MAX_DETOKENIZE} tokens", code="prompt_too_large",
                       param="tokens")
    bad = next((t for t in ids if not 0 <= t < n_vocab), None)
    if bad is not None:
        raise ApiError(400, f"invalid request: token {bad} is outside the vocabulary (0..{n_vocab - 1})",
                       param="tokens")
    pairs: list[tuple[int, bytes]] = []
    if ids:
        try:
            pairs = await model.scheduler.pieces(ids=ids, klass=qos_of(app, scope))
        except Unavailable as exc:
            raise ApiError(503, str(exc), code=exc.code) from None
    await send_json(send, 200, {"content": b"".join(p for _t, p in pairs).decode("utf-8", "replace")})


def slot_rows(model: ServedModel) -> list[dict[str, Any]]:
    """``model``'s KV sequences as llama-server lists its slots (``GET /slots``): one row per
    sequence of its worker (``n_seq``: the lanes and the spares that keep cached prefixes), in
    order. A slot's ``id`` is its sequence number, the id ``POST /slots/{id}`` acts on; it is
    processing while a running job's lane is in it (the worker's ``Admitted.seq``). A fleet
    model's rows are its nodes', each with its ``node`` (slot actions are not served for a
    fleet). Prompts and outputs are never shown."""
    rows: list[dict[str, Any]] = []
    n_ctx = model.n_ctx
    nodes = list(model.group.members.items()) if model.group is not None else [("", model.actor)]
    for node, actor in nodes:
        sched = actor.scheduler
        in_seq = {job.kv_seq: job for job in list(sched.running.values()) if job.kv_seq >= 0 and not job.preempted}
        n_seq = int((actor.ack.limits if actor.ack else {}).get("n_seq", 0)) or sched.config.planner.max_batch
        for seq in range(max(n_seq, max(in_seq, default=-1) + 1)):
            job = in_seq.get(seq)
            decoded = 0 if job is None else job.n_generated
            rows.append({
                **({"node": node} if node else {}),
                "id": seq, "id_task": -1 if job is None else job.id, "n_ctx": n_ctx,
                "speculative": False, "is_processing": job is not None, "model": model.name,
                "params": {} if job is None else {"n_predict": job.max_new, "temperature": job.sampling.temperature},
                "next_token": {"has_next_token": job is not None, "has_new_line": False,
                               "n_remain": -1 if job is None else max(0, job.max_new - decoded),
                               "n_decoded": decoded, "stopping_word": ""},
            })
    return rows


async def slots_route(app: App, scope: dict[str, Any], receive: Receive, send: Send, body: dict[str, Any]) -> None:
    """``GET /slots`` (llama-server's): a JSON array of the slots of ``?model=`` (a loaded model;
    404 otherwise), or of every loaded model the key may use, each row naming its ``model``.
    ``?fail_on_no_slot=1`` answers 503 ``no_slot_available`` when no listed model has a free lane
    (every lane running a job: a new request would wait), whatever spare sequences idle."""
    if scope["method"] not in ("GET", "HEAD"):
        raise ApiError(405, f"method {scope['method']} not allowed on /slots")
    query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
    principal = principal_of(scope)
    name = (query.get("model") or [""])[0]
    if name:
        resolved = app.registry.resolve_alias(name)
        principal.check_model(resolved)
        model = app.registry.loaded.get(resolved)
        if model is None:
            raise ApiError(404, f"model '{name}' is not loaded", code="model_not_found")
        models = [model]
    else:
        models = [m for m in list(app.registry.loaded.values()) if principal.may_use(m.name)]
    rows = [row for model in models for row in slot_rows(model)]
    if (query.get("fail_on_no_slot") or ["0"])[0] in ("1", "true") and not any(
            _lane_free(model) for model in models):
        raise ApiError(503, "no slot available", code="no_slot_available")
    await send_json(send, 200, rows)


def _lane_free(model: ServedModel) -> bool:
    return any(len(actor.scheduler.running) < actor.scheduler.config.planner.max_batch for actor in model.actors)


_SLOT_PATH = re.compile(r"/slots/(\d{1,6})")


async def slot_action_route(app: App, scope: dict[str, Any], receive: Receive, send: Send) -> bool:
    """``POST /slots/{id}?action=save|restore|erase`` (llama-server's; admin-only when keys are set:
    api/_guard.py), on KV sequence ``id`` of ``?model=`` (or the default): the ``id`` of a row
    ``GET /slots`` lists for that model; any other is 404 ``slot_not_found`` (from the worker). ``save`` and ``restore``
    take ``{"filename"}``, a plain name (``[A-Za-z0-9._-]{1,128}``) in ``<sessions>/park/slots/``
    (``--park``); the worker checks a restored file as a park (worker/_executor.py ``slot_action``).
    False if the request is not for this route."""
    m = _SLOT_PATH.fullmatch(scope["path"])
    if m is None:
        return False
    if scope["method"] != "POST":
        raise ApiError(405, f"method {scope['method']} not allowed on {scope['path']}")
    query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
    action = (query.get("action") or [""])[0]
    if action not in SLOT_ACTIONS:
        raise ApiError(400, "action must be save, restore or erase", code="invalid_action", param="action")
    body = await read_json(scope, receive) if action != "erase" else {}
    filename = body.get("filename", "")
    if action != "erase" and (not isinstance(filename, str) or not SLOT_FILE.fullmatch(filename)
                              or filename in (".", "..")):
        raise ApiError(400, "filename must be a plain name: 1-128 of A-Z a-z 0-9 . _ -", code="invalid_filename",
                       param="filename")
    model = await app.resolve_model((query.get("model") or [""])[0] or app.registry.default)
    if model.group is not None:
        raise ApiError(501, "slot actions are not served for a fleet model", code="slots_unavailable")
    partition = partition_of(scope)
    seq = int(m.group(1))
    t0 = trio.current_time()
    try:
        done = await model.actor.scheduler.slot(action, seq, filename=filename,
                                                cache_salt=cache_partition(partition.tenant, partition.cache_salt))
    except Unavailable as exc:
        raise ApiError(503, str(exc), code=exc.code) from None
    if done.status:
        raise ApiError(done.status, done.message or done.error, code=done.error)
    ms = round((trio.current_time() - t0) * 1000, 3)
    if action == "save":
        out = {"id_slot": seq, "filename": filename, "n_saved": done.tokens, "n_written": done.nbytes,
               "timings": {"save_ms": ms}}
    elif action == "restore":
        out = {"id_slot": seq, "filename": filename, "n_restored": done.tokens, "n_read": done.nbytes,
               "timings": {"restore_ms": ms}}
    else:
        out = {"id_slot": seq, "n_erased": done.tokens}
    await send_json(send, 200, out)
    return True
