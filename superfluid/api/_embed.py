"""Embeddings: OpenAI ``/v1/embeddings``, Ollama ``/api/embed`` and the legacy
``/api/embeddings``.

Texts are tokenized by the model's worker (with the model's BOS), then all of a
request's inputs go to the worker in one ``Embed`` command through the model
actor's inbox (``Scheduler.embed``: the actor is the link's only writer), which
batches them into as few ``llama_decode`` calls as fit. Vectors are pooled by
the worker and scaled to unit length, as OpenAI's are; the legacy Ollama route
answers the raw pooled vector, as Ollama does.
"""

from __future__ import annotations

import array
import base64
import sys
import time
from typing import TYPE_CHECKING, Any

from ..sched import EmbedRefused, Unavailable
from ._lane import tokenize
from ._admission import granted_keep_alive
from ._principal import current_principal
from ._http import ApiError, Receive, Send, answer_errors, send_json

if TYPE_CHECKING:
    from ..serving import ServedModel
    from ._host import App

__all__ = ["ollama_embed", "ollama_embeddings", "openai_embeddings"]

MAX_INPUTS = 2048            # inputs in one request (OpenAI's limit)
MAX_TOKENS = 300_000         # tokens of all a request's inputs together (OpenAI's limit)


def _floats(vector: bytes) -> list[float]:
    values = array.array("f")
    values.frombytes(vector)
    if sys.byteorder != "little":
        values.byteswap()
    return values.tolist()


def _check_model(model: ServedModel) -> None:
    ack = model.actor.ack
    able = ack.capabilities.get("embeddings", "no embedding runtime") if ack else "no embedding runtime"
    if able is not True:
        raise ApiError(400, f"model '{model.name}' does not serve embeddings: {able}", code="unsupported_model",
                       param="model")


def _inputs(raw: Any, *, param: str, tokens_allowed: bool) -> list[str | list[int]]:
    """A request's inputs: strings, or (OpenAI) token id arrays.

    Raises:
        ApiError: 400 for anything else, an empty input, or too many.
    """
    shape = ("a string, an array of strings, an array of token ids or an array of token id arrays"
             if tokens_allowed else "a string or an array of strings")
    if isinstance(raw, str):
        items: list[Any] = [raw]
    elif isinstance(raw, list) and raw and tokens_allowed and all(_is_id(t) for t in raw):
        items = [raw]
    elif isinstance(raw, list) and raw:
        items = raw
    else:
        raise ApiError(400, f"{param} must be {shape}, not empty", param=param)
    if len(items) > MAX_INPUTS:
        raise ApiError(400, f"{param} holds {len(items)} inputs; at most {MAX_INPUTS}", param=param)
    for i, item in enumerate(items):
        ok = (isinstance(item, str) and item) or (
            tokens_allowed and isinstance(item, list) and item and all(_is_id(t) for t in item))
        if not ok:
            raise ApiError(400, f"{param}[{i}] must be a non-empty string"
                           + (" or a non-empty array of token ids" if tokens_allowed else ""), param=param)
    return items


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


async def _embed(model: ServedModel, items: list[str | list[int]], *, normalize: bool,
                 truncate: bool = False) -> tuple[int, list[bytes], int]:
    """``(dim, vectors, tokens)`` for the inputs.

    Raises:
        ApiError: 400 an input the model cannot embed (too long, a token outside the
            vocabulary), 413 a text too large to tokenize, 503 no worker.
    """
    ids: list[list[int]] = []
    n_vocab = int(model.info.get("n_vocab", 0))
    for i, item in enumerate(items):
        if isinstance(item, list) and n_vocab and max(item) >= n_vocab:
            raise ApiError(400, f"input[{i}] holds token {max(item)}, outside the model's {n_vocab}-token vocabulary",
                           param="input")
        tokens = item if isinstance(item, list) else await tokenize(model, [(item, False)], add_special=True)
        if truncate and model.n_ctx and len(tokens) > model.n_ctx:
            tokens = tokens[: model.n_ctx]
        if not tokens:
            raise ApiError(400, "an input has no tokens", param="input")
        ids.append(tokens)
    total = sum(len(t) for t in ids)
    if total > MAX_TOKENS:
        raise ApiError(400, f"the inputs hold {total} tokens; at most {MAX_TOKENS} in one request", param="input")
    try:
        dim, vectors = await model.scheduler.embed(ids, normalize=normalize)
    except EmbedRefused as exc:
        raise ApiError(400, f"cannot embed the input: {exc}", code="invalid_input", param="input") from None
    except Unavailable as exc:
        raise ApiError(503, str(exc), code=exc.code) from None
    return dim, vectors, total


def _dimensions(body: dict[str, Any]) -> int | None:
    value = body.get("dimensions")
    if value is None:
        return None
    if not _is_id(value) or value == 0:
        raise ApiError(400, "dimensions must be a positive integer", param="dimensions")
    return int(value)


def _check_dimensions(model: ServedModel, wanted: int | None, dim: int) -> None:
    if wanted is not None and wanted != dim:
        raise ApiError(400, f"model '{model.name}' embeds in {dim} dimensions; dimensions {wanted} would need a "
                            "model trained to be shortened", code="unsupported_parameter", param="dimensions")


async def openai_embeddings(app: App, scope: dict[str, Any], receive: Receive, send: Send,
                            body: dict[str, Any]) -> None:
    """``/v1/embeddings``: ``input`` a string, strings, token ids or arrays of them;
    ``encoding_format`` float or base64 (little-endian float32); ``dimensions`` only
    the model's own."""
    model = await app.resolve_model(body.get("model"))
    _check_model(model)
    fmt = body.get("encoding_format") or "float"
    if fmt not in ("float", "base64"):
        raise ApiError(400, "encoding_format must be float or base64", param="encoding_format")
    wanted = _dimensions(body)
    items = _inputs(body.get("input"), param="input", tokens_allowed=True)
    dim, vectors, total = await _embed(model, items, normalize=True)
    _check_dimensions(model, wanted, dim)
    data = [{"object": "embedding", "index": i,
             "embedding": base64.b64encode(v).decode("ascii") if fmt == "base64" else _floats(v)}
            for i, v in enumerate(vectors)]
    await send_json(send, 200, {"object": "list", "data": data, "model": model.name,
                                "usage": {"prompt_tokens": total, "total_tokens": total}})


def _keep_alive(app: App, model: ServedModel, body: dict[str, Any]) -> None:
    from ..serving import parse_keep_alive

    try:
        seconds = parse_keep_alive(body.get("keep_alive"))
        app.registry.keep_alive(model, granted_keep_alive(current_principal().admin, seconds))
    except ValueError as exc:
        raise ApiError(400, str(exc), param="keep_alive") from None


def _model_name(app: App, body: dict[str, Any]) -> str:
    name = body.get("model")
    if not isinstance(name, str) or not name:
        raise ApiError(400, "model is required")
    reg = app.registry
    if name.endswith(":latest") and name not in reg.known and reg.resolve_alias(name) not in reg.known:
        return name.removesuffix(":latest")
    return name


async def ollama_embed(app: App, scope: dict[str, Any], receive: Receive, send: Send, body: dict[str, Any]) -> None:
    """Ollama ``/api/embed``: ``input`` a string or strings -> unit-length ``embeddings``;
    ``truncate`` (default true) cuts an input to the model's window, false refuses it."""
    async def run(send: Send) -> None:
        started = time.monotonic()
        model = await app.resolve_model(_model_name(app, body))
        _check_model(model)
        _keep_alive(app, model, body)
        truncate = body.get("truncate", True)
        if not isinstance(truncate, bool):
            raise ApiError(400, "truncate must be a boolean")
        wanted = _dimensions(body)
        raw = body.get("input")
        vectors: list[bytes] = []
        total = 0
        if raw not in (None, "", []):  # nothing to embed: the model is loaded, as Ollama does
            dim, vectors, total = await _embed(model, _inputs(raw, param="input", tokens_allowed=False),
                                               normalize=True, truncate=truncate)
            _check_dimensions(model, wanted, dim)
        await send_json(send, 200, {"model": model.name, "embeddings": [_floats(v) for v in vectors],
                                    "total_duration": int((time.monotonic() - started) * 1e9), "load_duration": 0,
                                    "prompt_eval_count": total})

    await answer_errors(send, run, lambda exc: {"error": exc.message})


async def ollama_embeddings(app: App, scope: dict[str, Any], receive: Receive, send: Send,
                            body: dict[str, Any]) -> None:
    """Ollama's legacy ``/api/embeddings``: ``prompt`` -> ``embedding``, not normalized (as Ollama)."""
    async def run(send: Send) -> None:
        model = await app.resolve_model(_model_name(app, body))
        _check_model(model)
        _keep_alive(app, model, body)
        prompt = body.get("prompt")
        if prompt is not None and not isinstance(prompt, str):
            raise ApiError(400, "prompt must be a string")
        vector: list[float] = []
        if prompt:
            _dim, vectors, _total = await _embed(model, [prompt], normalize=False, truncate=True)
            vector = _floats(vectors[0])
        await send_json(send, 200, {"embedding": vector})

    await answer_errors(send, run, lambda exc: {"error": exc.message})
