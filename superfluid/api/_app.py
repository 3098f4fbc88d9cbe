"""The ASGI application: one router for every dialect on one port."""

from __future__ import annotations

import json
import logging
import re
from urllib.parse import parse_qs
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Iterable

import trio

from ._http import BODY_TIMEOUT, ApiError, ClientGone, Receive, Send, read_json, send_json, send_text, ws_denial
from ._lane import log_refusal
from ._lifecycle import Exchange, Stopping, access_line, open_request, set_exchange, shutting_down
from ._guard import Guard, refusal_headers
from ._principal import (PRINCIPAL, QOS, Principal, authenticate, current_principal, presented_key, principal_of,
                         set_current_principal)
from ._openai import chat_completions, completions
from ._sessions import delete_generation, get_session, stream_session
from ._session_list import list_sessions
from ._conversations import conversation_tree, route_conversations
from ._files import route_files
from ._batches import BatchService, route_batches
from ._anthropic import count_tokens, messages
from ._anthropic import error_body as anthropic_error_body
from ._ollama import (api_chat, api_copy, api_delete, api_generate, api_ps, api_pull, api_show, api_tags,
                      api_version, managed, root)
from ._embed import ollama_embed, ollama_embeddings, openai_embeddings
from ._responses import responses, route_responses
from ._infill import completion as llama_completion
from ._infill import detokenize, infill, slot_action_route, slots_route, tokenize_route
from ._ui import route_ui

from ..sessions._batches import BatchStore
from ..sessions._conversations import ConversationStore
from ..sessions._files import FileStore
from ..serving import InsufficientMemory, TooManyModels
from ..journal import JournalWriteError
from ..nursery import WorkerDied, WorkerLoadFailed
from ..sched import QosClass

if TYPE_CHECKING:
    from ..serving import Metrics, Registry, ServedModel, ServeConfig
    from ..sessions._resumable import SessionStore

__all__ = ["App"]

log = logging.getLogger("superfluid.http")
Handler = Callable[["App", dict[str, Any], Receive, Send, dict[str, Any]], Awaitable[None]]

_POST_JSON: dict[str, Handler] = {
    "/v1/chat/completions": chat_completions,
    "/chat/completions": chat_completions,
    "/v1/completions": completions,
    "/completions": completions,
    "/v1/embeddings": openai_embeddings,
    "/embeddings": openai_embeddings,
    "/v1/responses": responses,
    "/v1/messages": messages,
    "/v1/messages/count_tokens": count_tokens,
    "/api/chat": api_chat,
    "/api/generate": api_generate,
    "/api/show": api_show,
    "/api/embed": ollama_embed,
    "/api/embeddings": ollama_embeddings,
    "/api/pull": api_pull,
    "/api/push": managed,
    "/api/create": managed,
    "/api/copy": api_copy,
    "/infill": infill,                    # llama-server's own (api/_infill.py)
    "/completion": llama_completion,
    "/tokenize": tokenize_route,
    "/detokenize": detokenize,
}
# Routes served without a JSON body (Ollama discovery, and DELETE /api/delete); each handler checks its method.
_GET_JSON: dict[str, Handler] = {
    "/": root,
    "/api/version": api_version,
    "/api/tags": api_tags,
    "/api/ps": api_ps,
    "/api/delete": api_delete,
    "/slots": slots_route,                # llama-server's slot list (api/_infill.py)
}


# a (re)load on demand fails typed (503 model_load_failed) whether the model did not load,
# the worker died during its handshake, or the handshake timed out
_LOAD_FAILURES = (WorkerLoadFailed, WorkerDied, trio.TooSlowError)


def _too_many(exc: TooManyModels) -> ApiError:
    return ApiError(429, str(exc), code="too_many_models")


def _no_memory(exc: InsufficientMemory) -> ApiError:
    return ApiError(507, str(exc), code="insufficient_memory")


# the models the current request holds (resolve_model); released when its response ends
_HELD: ContextVar[list[ServedModel] | None] = ContextVar("superfluid_held_models", default=None)


def _error_body(path: str, exc: ApiError) -> dict[str, Any]:
    """An error answered here (before a dialect's handler ran: a body that is not JSON,
    a wrong method, draining) in the envelope of the route's dialect."""
    if path.startswith("/v1/messages"):
        return anthropic_error_body(exc)
    if path.startswith("/api/"):
        return {"error": exc.message}
    return exc.body()


_GENERATING = frozenset({"/v1/chat/completions", "/chat/completions", "/v1/completions", "/completions",
                         "/v1/responses", "/v1/messages", "/api/chat", "/api/generate", "/infill",
                         "/completion"})


# routes that start no generation: still answered while the daemon stops
_NOT_GENERATING = frozenset({"/v1/tokenize", "/tokenize", "/detokenize"})


def _logged_at_info(exchange: Exchange) -> bool:
    """Generating routes and the session routes are access-logged at INFO; the rest at DEBUG."""
    return bool(exchange.jobs) or exchange.path in _GENERATING or exchange.path.startswith("/v1/sessions")


class App:
    def __init__(self, config: ServeConfig, registry: Registry, metrics: Metrics,
                 sessions: SessionStore) -> None:
        self.config = config
        self.registry = registry
        self.sessions = sessions
        self.conversations = ConversationStore(sessions.journal)
        registry.pins(self.conversations.pinned_until)  # a pinned conversation holds its model (daemon/_lifetime.py)
        self.metrics = metrics
        self.accepting = True
        self.stopping = Stopping()  # SIGTERM/SIGINT: readers end typed, then the daemon exits (_lifecycle.py)
        self.guard = Guard(config)
        self.files = FileStore.open(sessions.journal.directory / "files",  # /v1/files (api/_files.py)
                                    quota_bytes=int(config.files_quota_gb * (1 << 30)))
        self.batches = BatchService(self, BatchStore.open(sessions.journal.directory / "batches"))

    async def resolve_model(self, name: Any) -> ServedModel:
        """The named model, loaded on demand if it is known but unloaded.

        Raises:
            ApiError: 400 missing/invalid, 404 unknown, 503 failed to load.
        """
        if name is None or name == "":
            raise ApiError(400, "missing required field: model", param="model")
        if not isinstance(name, str):
            raise ApiError(400, "invalid request: model must be a string", param="model")
        current_principal().check_model(self.registry.resolve_alias(name))
        try:
            model = await self.registry.get(name)
        except TooManyModels as exc:
            raise _too_many(exc) from None
        except InsufficientMemory as exc:
            raise _no_memory(exc) from None
        except _LOAD_FAILURES as exc:
            raise ApiError(503, f"model '{name}' could not be loaded: {exc}", code="model_load_failed") from None
        if model is None:
            loaded = ", ".join(self.registry.loaded) or "none"
            served = ", ".join(sorted({*self.registry.known, *self.registry.aliases}))
            raise ApiError(404, f"model '{name}' not found; loaded: {loaded}; served: {served}",
                           code="model_not_found", param="model")
        held = _HELD.get()
        if held is not None:  # not idle until this request's response has ended (daemon/_lifetime.py)
            self.registry.hold(model)
            held.append(model)
        return model

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self._serve(scope, receive, send)
            return
        held: list[ServedModel] = []
        token = _HELD.set(held)
        try:
            await self._serve(scope, receive, send)
        finally:
            _HELD.reset(token)
            for model in held:
                self.registry.release(model)

    async def _serve(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] not in ("http", "websocket"):
            return
        exchange = Exchange(method=scope.get("method", "WS"), path=scope.get("path", ""),
                            started=trio.current_time(), stopping=self.stopping)
        set_exchange(exchange)
        self.stopping.enter()
        try:
            await self._exchange(scope, receive, send, exchange)
        finally:
            self.stopping.leave()
            if scope["type"] == "http":
                access_line(exchange, level=logging.INFO if _logged_at_info(exchange) else logging.DEBUG)

    async def _exchange(self, scope: dict[str, Any], receive: Receive, send: Send, exchange: Exchange) -> None:
        if scope["type"] in ("http", "websocket"):
            refusal = self.guard.admit(scope)  # api/_guard.py: Host, Origin, key, rate, content type, admin
            if scope["type"] == "http":
                send = self.guard.cors(scope, send)
            if refusal is not None:
                exchange.status = refusal.status
                if scope["type"] == "websocket":
                    await receive()  # websocket.connect
                    if "websocket.http.response" not in scope.get("extensions", {}):
                        await send({"type": "websocket.close", "code": 1008})  # before accept: HTTP 403
                        return
                    send = ws_denial(send)  # the refusal itself (401, 403, 429 with Retry-After), as over HTTP
                await send_json(send, refusal.status, _error_body(scope["path"], refusal), refusal_headers(refusal))
                return
            set_current_principal(principal_of(scope))
            if scope["type"] == "http" and scope["method"] == "OPTIONS":  # a CORS preflight (Origin checked)
                await send({"type": "http.response.start", "status": 204,
                            "headers": self.guard.preflight_headers(scope)})
                await send({"type": "http.response.body", "body": b""})
                return
        if scope["type"] == "websocket":  # GET /v1/ws (api/_ws.py); other paths are refused
            from ._ws import serve_websocket

            await serve_websocket(self, scope, receive, send)
            return
        if scope["type"] != "http":
            return
        await self._http(scope, receive, send, exchange)

    async def _http(self, scope: dict[str, Any], receive: Receive, send: Send, exchange: Exchange) -> None:
        """One HTTP request past the guard: its request scope, its route, its typed errors."""
        scope[BODY_TIMEOUT] = self.config.body_timeout_s  # read_body's deadline
        started = False

        async def tracked_send(message: dict[str, Any]) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                exchange.status = message["status"]
            await send(message)

        try:
            # one scope for the whole request, cancelled when the client leaves (watched once the
            # body is read): a load, a tokenize or a wait for a gone client stops there
            async with open_request(receive, tracked_send) as request:
                await self._route(scope, request.receive, request.send)
            if request.scope.cancelled_caught and request.stopped and not request.gone:
                # a wait no helper watched, ended by the shutdown's backstop: typed, if we still can
                raise shutting_down()
        except ClientGone:
            return
        except ApiError as exc:
            if not started:
                exchange.status, exchange.error = exc.status, exc.code
                await send_json(send, exc.status, _error_body(scope["path"], exc), list(exc.headers))
        except JournalWriteError as exc:  # a full disk reached a route that did not check first: still typed
            if not started:
                refusal = log_refusal(exc)
                exchange.status, exchange.error = refusal.status, refusal.code
                await send_json(send, refusal.status, _error_body(scope["path"], refusal))
        except trio.Cancelled:
            raise
        except Exception as exc:  # boundary: one request; the daemon goes on
            log.exception("unhandled error on %s %s", scope.get("method"), scope.get("path"))
            if not started:
                exchange.status = 500
                await send_json(send, 500, _error_body(
                    scope["path"], ApiError(500, f"internal error: {type(exc).__name__}: {exc}")))

    async def _route(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        method, path = scope["method"], scope["path"]
        if await route_ui(self.config.ui, scope, send, lambda: list(self.registry.loaded.values()),
                          current_principal().may_use):  # the built-in page, /ui (api/_ui.py)
            return
        if self.stopping.started and method in ("POST", "PUT") and path not in _NOT_GENERATING:
            raise shutting_down()  # 503 server_shutting_down: nothing new starts while the daemon stops
        if path == "/health" and method in ("GET", "HEAD"):
            models = {"models_loaded": len(self.registry.loaded), "models_known": len(self.registry.known)}
            if self.config.api_keys and authenticate(self.config.api_keys, presented_key(scope)) is None:
                models = {}  # /health needs no key; what is loaded is told only to one
            reason = self.sessions.journal.degraded
            if reason is not None:  # nothing can be generated: the log takes no writes
                await send_json(send, 503, {"status": "degraded", "reason": reason, **models})
            else:
                await send_json(send, 200, {"status": "ok", **models})
            return
        if path in ("/v1/models", "/models") and method == "GET":
            await send_json(send, 200, {"object": "list", "data": await self._with_facts(self._model_list())})
            return
        if path in ("/v1/models/load", "/v1/models/unload") and method == "POST":
            body = await read_json(scope, receive)
            await (self._load if path.endswith("load") and not path.endswith("unload") else self._unload)(send, body)
            return
        m = re.fullmatch(r"/v1/models/(.+)", path)
        if m and method == "GET":
            name = self.registry.resolve_alias(m.group(1))
            current_principal().check_model(name)
            model = self.registry.loaded.get(name)
            if model is not None:
                await send_json(send, 200, (await self._with_facts([model.describe()]))[0])
            elif name in self.registry.known:
                await send_json(send, 200, (await self._with_facts([self._known(name)]))[0])
            else:
                raise ApiError(404, f"model '{m.group(1)}' not found", code="model_not_found")
            return
        if m and method == "DELETE":
            await self._unload(send, {"id": m.group(1)})
            return
        if path in ("/metrics", "/v1/metrics") and method == "GET":
            text = self.metrics.render(current_principal().may_use)  # a key sees only its models' series
            await send_text(send, 200, text, b"text/plain; version=0.0.4; charset=utf-8")
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
        handler = _GET_JSON.get(path)
        if handler is not None:
            await handler(self, scope, receive, send, {})
            return
        if path == "/v1/sessions" and method == "GET":
            query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
            if (query.get("view") or [None])[0] == "tree":
                archived = (query.get("include_archived") or ["0"])[0] in ("1", "true")
                await send_json(send, 200, conversation_tree(self, scope, include_archived=archived))
            else:
                await send_json(send, 200, list_sessions(self, scope))
            return
        if await slot_action_route(self, scope, receive, send):   # POST /slots/{id} (llama-server's)
            return
        if await route_responses(self, scope, receive, send):
            return
        if await route_batches(self, scope, receive, send):
            return
        if await route_files(self, scope, receive, send):
            return
        if await route_conversations(self, scope, receive, send):
            return
        m = re.fullmatch(r"/v1/sessions/([A-Za-z0-9_.-]+)(/stream|/generation)?", path)
        if m:
            sid, tail = m.group(1), m.group(2)
            if tail is None and method == "GET":
                await get_session(self, scope, send, sid)
                return
            if tail == "/stream" and method == "GET":
                await stream_session(self, scope, receive, send, sid)
                return
            if tail == "/generation" and method == "DELETE":
                await delete_generation(self, scope, send, sid)
                return
            raise ApiError(405, f"method {method} not allowed on {path}")
        if path == "/v1/tokenize" and method == "POST":
            body = await read_json(scope, receive)
            await self._tokenize(send, body)
            return
        raise ApiError(404, f"no route for {method} {path}", code="not_found")

    async def dispatch(self, principal: Principal, path: str, body: bytes, *, qos: QosClass,
                       limit: int) -> tuple[int, bytes]:
        """``POST path`` with ``body``, run here as ``principal`` in class ``qos``: a batch's
        line (``api/_batches.py``). It goes through the route and every check a request
        from the network meets past the guard (the key's models, its ``max_concurrent``
        slot, body limits, tenancy), without a socket: the answer is the status and the
        body, at most ``limit`` bytes of it (more is 500 ``response_too_large``).

        Cancellation: cancelling the caller ends the request as a client leaving does
        (its job is cancelled, its lane freed)."""
        status = 0
        out = bytearray()
        delivered = False
        too_large = ApiError(500, f"the response exceeds {limit} bytes", code="response_too_large")
        overflowed = False

        async def receive() -> dict[str, Any]:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            await trio.sleep_forever()  # the client never leaves: the caller's cancel ends it
            raise AssertionError("unreachable")

        async def send(message: dict[str, Any]) -> None:  # noqa: ASYNC124 - an ASGI send: async by contract
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body":
                nonlocal overflowed
                chunk = message.get("body", b"")
                if overflowed or len(out) + len(chunk) > limit:
                    overflowed = True
                    raise too_large  # ends the handler (its job is cancelled as when a client leaves)
                out.extend(chunk)

        scope: dict[str, Any] = {
            "type": "http", "http_version": "1.1", "method": "POST", "scheme": "http", "path": path,
            "raw_path": path.encode(), "query_string": b"", "root_path": "", "client": None, "server": None,
            "headers": [(b"content-type", b"application/json")], PRINCIPAL: principal, QOS: qos,
        }
        exchange = Exchange(method="POST", path=path, started=trio.current_time())
        set_exchange(exchange)
        set_current_principal(principal)
        held: list[ServedModel] = []
        token = _HELD.set(held)
        try:
            await self._http(scope, receive, send, exchange)
        finally:
            _HELD.reset(token)
            for model in held:
                self.registry.release(model)
        if overflowed:
            return too_large.status, json.dumps(too_large.body()).encode()
        return status, bytes(out)

    def open_turns(self) -> dict[tuple[str, int], str]:
        """After a restart: the conversation turns the log shows open, each with the
        generation session it holds (``api/_turns.py``)."""
        from ._turns import open_turns

        return open_turns(self)

    async def restore_turns(self, turns: Iterable[tuple[str, int]]) -> None:
        """Give each of ``turns`` (from :meth:`open_turns`) an owner (``api/_turns.py``)."""
        from ._turns import restore_turns

        await restore_turns(self, turns)

    def _known(self, name: str) -> dict[str, Any]:
        src = self.registry.known[name]
        return {"id": name, "object": "model", "created": 0, "owned_by": "superfluid", "loaded": False,
                "runtime": {"id": src.runtime}}

    async def _with_facts(self, entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``entries`` with each model file's ``size`` (bytes on disk) and ``quantization``
        (read in a thread, once per file version; extra fields, which OpenAI clients ignore)."""
        from ..models._gguf import model_facts

        reg = self.registry
        files: dict[str, str] = {}
        for e in entries:
            name = e.get("alias_of", e["id"])
            model, source = reg.loaded.get(name), reg.known.get(name)
            if model is not None and model.runtime != "mock" and model.group is None:
                files[e["id"]] = model.path
            elif model is None and source is not None and source.runtime != "mock":
                files[e["id"]] = source.spec
        if not files:
            return entries
        facts = await trio.to_thread.run_sync(lambda: {n: model_facts(f) for n, f in files.items()})
        return [{**e, "size": facts[e["id"]].size, "quantization": facts[e["id"]].quantization_level}
                if e["id"] in facts else e for e in entries]

    def _model_list(self) -> list[dict[str, Any]]:
        reg = self.registry
        data = [reg.loaded[reg.default].describe()] if reg.default in reg.loaded else []
        data += [m.describe() for name, m in sorted(reg.loaded.items()) if name != reg.default]
        data += [self._known(name) for name in sorted(reg.known) if name not in reg.loaded]
        data = [d for d in data if current_principal().may_use(d["id"])]
        # --alias names, for clients that look for their hard-coded name in the list
        return data + [{"id": alias, "object": "model", "created": 0, "owned_by": "superfluid",
                        "loaded": target in reg.loaded, "alias_of": target}
                       for alias, target in sorted(reg.aliases.items()) if current_principal().may_use(target)]

    async def _load(self, send: Send, body: dict[str, Any]) -> None:
        ident = body.get("id") or body.get("model") or body.get("name")
        if not isinstance(ident, str) or not ident:
            raise ApiError(400, "missing model `id`", param="id")
        runtime = body.get("runtime")
        if runtime is not None and not isinstance(runtime, str):
            raise ApiError(400, "invalid request: runtime must be a string", param="runtime")
        reg = self.registry
        from ..runtime._choose import _runtime_refusal, _selector_refusal

        refusal = _selector_refusal(runtime)
        if refusal is not None:
            raise ApiError(400, refusal, code="unsupported_runtime", param="runtime")
        source = reg.lookup(ident, runtime)
        if source is None:
            # the same answer whether or not such a file exists: no oracle for paths outside
            # the allowed directories, and nothing outside them reaches a worker
            raise ApiError(404, f"model '{ident}' not found (not a known model, nor a model file in a "
                                "--model-dir or the models cache directory)", code="model_not_found", param="id")
        if ident not in reg.known:
            # checked on the allowed file only: a format read never tells of a file outside them
            refusal = _runtime_refusal(source.spec, runtime)
            if refusal is not None:
                raise ApiError(400, refusal, code="unsupported_runtime", param="runtime")
        if ident in reg.known and runtime is not None and runtime != source.runtime:
            raise ApiError(400, f"model '{ident}' is loaded on runtime {source.runtime}", code="unsupported_runtime")
        try:
            model = await reg.load(source, make_default=True)
        except TooManyModels as exc:
            raise _too_many(exc) from None
        except InsufficientMemory as exc:
            raise _no_memory(exc) from None
        except _LOAD_FAILURES as exc:
            raise ApiError(503, f"model '{ident}' could not be loaded: {exc}", code="model_load_failed") from None
        reg.default = model.name
        await send_json(send, 200, model.describe())

    async def _unload(self, send: Send, body: dict[str, Any]) -> None:
        ident = body.get("id") or body.get("model") or body.get("name")
        if not isinstance(ident, str) or not ident:
            raise ApiError(400, "missing model `id`", param="id")
        try:
            deleted = await self.registry.unload(ident)
        except ValueError as exc:
            raise ApiError(400, str(exc)) from None
        await send_json(send, 200, {"id": ident, "object": "model", "deleted": deleted})

    async def _tokenize(self, send: Send, body: dict[str, Any]) -> None:
        model = await self.resolve_model(body.get("model") or self.registry.default)
        text = body.get("text", body.get("content"))
        if not isinstance(text, str):
            raise ApiError(400, "invalid request: text must be a string", param="text")
        from ._lane import tokenize

        tokens = await tokenize(model, [(text, False)], add_special=False)
        await send_json(send, 200, {"tokens": tokens, "count": len(tokens)})
