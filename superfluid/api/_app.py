"""The ASGI application: one router for every dialect on one port."""

from __future__ import annotations

import logging
import re
from typing import TYPE_CHECKING, Any, Awaitable, Callable

import trio

from ._http import ApiError, ClientGone, Receive, Send, read_json, send_json, send_text
from ._openai import chat_completions, completions

if TYPE_CHECKING:
    from .._config import ServeConfig
    from .._metrics import Metrics
    from .._model import ServedModel

__all__ = ["App"]

log = logging.getLogger("superfluid.http")
Handler = Callable[["App", dict[str, Any], Receive, Send, dict[str, Any]], Awaitable[None]]

_POST_JSON: dict[str, Handler] = {
    "/v1/chat/completions": chat_completions,
    "/chat/completions": chat_completions,
    "/v1/completions": completions,
    "/completions": completions,
}


class App:
    def __init__(self, config: ServeConfig, models: list[ServedModel], metrics: Metrics) -> None:
        self.config = config
        self.models = {m.name: m for m in models}
        self.default = models[0].name if models else None
        self.metrics = metrics
        self.accepting = True

    def resolve_model(self, name: Any) -> ServedModel:
        if name is None or name == "":
            raise ApiError(400, "missing required field: model", param="model")
        if not isinstance(name, str):
            raise ApiError(400, "invalid request: model must be a string", param="model")
        model = self.models.get(name)
        if model is None:
            loaded = ", ".join(self.models) or "none"
            raise ApiError(404, f"model '{name}' not found; loaded: {loaded}", code="model_not_found", param="model")
        return model

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        started = False

        async def tracked_send(message: dict[str, Any]) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self._route(scope, receive, tracked_send)
        except ClientGone:
            return
        except ApiError as exc:
            if not started:
                await send_json(send, exc.status, exc.body())
        except trio.Cancelled:
            raise
        except Exception as exc:  # boundary: one request; the daemon goes on
            log.exception("unhandled error on %s %s", scope.get("method"), scope.get("path"))
            if not started:
                await send_json(send, 500, ApiError(500, f"internal error: {type(exc).__name__}: {exc}").body())

    async def _route(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        method, path = scope["method"], scope["path"]
        if path == "/health" and method in ("GET", "HEAD"):
            await send_json(send, 200, {"status": "ok", "models_loaded": len(self.models),
                                        "models_known": len(self.models)})
            return
        if path in ("/v1/models", "/models") and method == "GET":
            data = [self.models[self.default].describe()] if self.default else []
            data += [m.describe() for name, m in sorted(self.models.items()) if name != self.default]
            await send_json(send, 200, {"object": "list", "data": data})
            return
        m = re.fullmatch(r"/v1/models/(.+)", path)
        if m and method == "GET":
            await send_json(send, 200, self.resolve_model(m.group(1)).describe())
            return
        if path in ("/metrics", "/v1/metrics") and method == "GET":
            await send_text(send, 200, self.metrics.render(), b"text/plain; version=0.0.4; charset=utf-8")
            return
        handler = _POST_JSON.get(path)
        if handler is not None:
            if method != "POST":
                raise ApiError(405, f"method {method} not allowed on {path}")
            if not self.accepting:
                raise ApiError(503, "the server is draining and accepts no new requests", code="draining")
            body = await read_json(scope, receive)
            await handler(self, scope, receive, send, body)
            return
        if path == "/v1/tokenize" and method == "POST":
            body = await read_json(scope, receive)
            await self._tokenize(send, body)
            return
        raise ApiError(404, f"no route for {method} {path}", code="not_found")

    async def _tokenize(self, send: Send, body: dict[str, Any]) -> None:
        model = self.resolve_model(body.get("model") or self.default)
        text = body.get("text", body.get("content"))
        if not isinstance(text, str):
            raise ApiError(400, "invalid request: text must be a string", param="text")
        from ._generate import tokenize

        tokens = await tokenize(model, [(text, False)], add_special=False)
        await send_json(send, 200, {"tokens": tokens, "count": len(tokens)})
