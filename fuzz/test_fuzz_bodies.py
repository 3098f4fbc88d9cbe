"""No request body yields a 5xx or a logged traceback (SPEC.md §10 "Input", issue #41).

Every dialect's routes take valid bodies with fields mutated: replaced by a
value of the wrong type, an integer past 64 bits, nesting from 8 to 990 levels,
odd unicode (NUL, bidi controls, astral and combining runs, a lone surrogate),
removed, or joined by a field of another dialect. Routes: OpenAI chat and
completions, Responses, Anthropic messages and count_tokens, Ollama chat,
generate, show and copy, conversations (create, messages, generate),
embeddings (OpenAI and Ollama), tokenize; and the WebSocket ops.

Invariants, for every body: the status is below 500; a 4xx is JSON in its
dialect's error envelope (``typed_error`` of test_fuzz_routes.py: OpenAI
``{message, type, param, code}``, Anthropic ``{type: error, error: {type}}``,
Ollama ``{error}``), never ``internal error: …``; nothing is logged at ERROR or
with a traceback; a WebSocket op answers with a typed ``error`` frame or its
reply, and the socket is never closed 1011.

One daemon on the mock runtime (no sleeps) serves the whole module, in a thread
(hypothesis drives sync tests). Budget: ``SUPERFLUID_FUZZ_EXAMPLES`` (default
200) x 0.7 bodies per route, 15 routes: 2,100 bodies, and a quarter as many
WebSocket ops. With the default budget the run is derandomized (the same
bodies every run, so CI is reproducible); setting ``SUPERFLUID_FUZZ_EXAMPLES``
draws new ones each run.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from trio_websocket import ConnectionClosed, open_websocket_url

from .test_fuzz_routes import quiet_daemon, typed_error

pytestmark = pytest.mark.fuzz

BUDGET = int(os.environ.get("SUPERFLUID_FUZZ_EXAMPLES", "200"))
PER_ROUTE = max(10, BUDGET * 7 // 10)
FUZZ = settings(max_examples=PER_ROUTE, database=None, deadline=None,
                derandomize="SUPERFLUID_FUZZ_EXAMPLES" not in os.environ,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture, HealthCheck.filter_too_much])

TOOLS = [{"type": "function", "function": {"name": "get_w", "description": "w", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CHAT_MESSAGES = [
    {"role": "system", "content": "sys"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_w", "arguments": "{\"city\":\"x\"}"}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"}, {"role": "user", "content": "ok", "name": "bob"}]
ANTHROPIC = {
    "model": "mock", "max_tokens": 3, "system": [{"type": "text", "text": "sys"}], "stop_sequences": ["zz"],
    "temperature": 0.5, "top_k": 5, "thinking": {"type": "disabled"}, "tool_choice": {"type": "auto"},
    "tools": [{"name": "get_w", "description": "w", "input_schema": {"type": "object", "properties": {
        "city": {"type": "string"}}}}],
    "messages": [
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_w", "input": {"city": "x"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                      "content": [{"type": "text", "text": "sunny"}]}]}]}
CONVERSATION = {"model": "mock", "system": "s", "tools": TOOLS, "chat_template_kwargs": {"x": 1},
                "sampling": {"max_tokens": 3, "temperature": 0.5, "stop": ["zz"], "logit_bias": {"5": 1}},
                "messages": [{"role": "user", "content": "hi"}]}
# route -> (dialect, a valid body); {cid} is the module's conversation
BASES: dict[str, tuple[str, dict[str, Any]]] = {
    "/v1/chat/completions": ("openai", {
        "model": "mock", "max_tokens": 3, "temperature": 0.5, "top_p": 0.9, "seed": 1, "stop": ["zz"],
        "logit_bias": {"5": 1}, "tools": TOOLS, "tool_choice": "auto", "response_format": {"type": "text"},
        "chat_template_kwargs": {"x": 1}, "cache_salt": "s", "messages": CHAT_MESSAGES}),
    "/v1/completions": ("openai", {"model": "mock", "prompt": "hello", "max_tokens": 3, "logprobs": 2,
                                   "stop": ["zz"], "echo": False, "seed": 2}),
    "/v1/responses": ("responses", {
        "model": "mock", "max_output_tokens": 3, "instructions": "be nice", "temperature": 0.5,
        "tools": [{"type": "function", "name": "get_w", "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}}}}],
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
                  {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "hm"}]},
                  {"type": "function_call", "call_id": "c1", "name": "get_w", "arguments": "{}"},
                  {"type": "function_call_output", "call_id": "c1", "output": "sunny"}],
        "text": {"format": {"type": "text"}}, "reasoning": {"effort": "low"}}),
    "/v1/messages": ("anthropic", ANTHROPIC),
    "/v1/messages/count_tokens": ("anthropic", {k: v for k, v in ANTHROPIC.items() if k != "max_tokens"}),
    "/api/chat": ("ollama", {
        "model": "mock", "stream": False, "keep_alive": "5m", "format": "", "tools": TOOLS,
        "options": {"num_predict": 3, "temperature": 0.5, "stop": ["zz"], "seed": 3},
        "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"},
                     {"role": "assistant", "content": "", "tool_calls": [
                         {"function": {"name": "get_w", "arguments": {"city": "x"}}}]},
                     {"role": "tool", "content": "sunny", "tool_name": "get_w"}]}),
    "/api/generate": ("ollama", {"model": "mock", "prompt": "hi", "system": "s", "stream": False,
                                 "options": {"num_predict": 3}, "keep_alive": "5m", "think": False}),
    "/api/show": ("ollama", {"model": "mock", "verbose": False}),
    "/api/copy": ("ollama", {"source": "library-model", "destination": "copied"}),
    "/v1/sessions": ("openai", CONVERSATION),
    "/v1/sessions/{cid}/messages": ("openai", {"messages": [{"role": "user", "content": "more"}]}),
    "/v1/sessions/{cid}/generate": ("openai", {"max_tokens": 3, "temperature": 0.5, "stop": ["zz"],
                                               "logit_bias": {"5": 1}, "tool_choice": "auto", "stream": False}),
    "/v1/embeddings": ("openai", {"model": "mock", "input": ["a", "b"], "encoding_format": "float"}),
    "/api/embed": ("ollama", {"model": "mock", "input": ["a"], "truncate": True}),
    "/v1/tokenize": ("openai", {"model": "mock", "text": "hi"}),
}
OTHER_FIELDS = ["stream", "n", "seed", "stop", "stop_sequences", "tools", "tool_choice", "options", "format",
                "chat_template_kwargs", "logit_bias", "previous_response_id", "input", "messages", "system",
                "sampling", "id", "qos", "raw", "images", "context", "dimensions", "cache_salt", "keep_alive"]

# ---- values -----------------------------------------------------------------------------------

HUGE_INTS = [2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63) - 1, 10**30, -(10**30),
             int("9" * 4300)]   # 4,300 digits: the most the decoder takes
ODD_TEXT = ["", "\x00", "a\x00b", "\u202e\u2066evil\u2069", "\ufeff", "\U0001F600" * 60, "e" + "\u0301" * 50,
            "a\u200bb", "\uffff", "\U000e0001", "\U0001D54F" * 300, "\r\n\r\n", "<|im_start|>system\n",
            "\ue0000\ue001", "{{ 7*7 }}", "x" * 100_000, "../../etc/passwd", "%00", "mock\n"]
wrong_scalars = st.sampled_from([None, True, False, 0, -1, 1.5, -0.0, 5e-324, 1e308, -1e308, "", "x", [], {}, [1],
                                 {"a": 1}, ["x", 1], [[]], [{}]])
odd_text = st.sampled_from(ODD_TEXT) | st.text(max_size=8) | st.just("\ud800")  # a lone surrogate: dumped as \\ud800
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8)
DEPTHS = [8, 31, 32, 33, 34, 64, 200, 600, 990]
deep = st.builds(lambda d, kind, leaf: f"@@DEEP-{d}-{kind}-{leaf}@@", st.sampled_from(DEPTHS),
                 st.sampled_from(["object", "array", "schema"]), st.sampled_from(["1", "huge", "str"]))
wrong_values = st.one_of(wrong_scalars, st.sampled_from(HUGE_INTS), odd_text, deep, json_values)


def _nested(depth: int, kind: str, leaf: str) -> str:
    """JSON text nested ``depth`` levels (written as text: json.dumps itself recurses)."""
    inner = {"1": "1", "huge": str(2**64), "str": '"x"'}[leaf]
    if kind == "array":
        return "[" * depth + inner + "]" * depth
    if kind == "schema":   # a JSON schema nested the way tools' parameters nest (2 levels per step)
        return '{"type":"object","properties":{"a":' * (depth // 2) + inner + "}}" * (depth // 2)
    return '{"a":' * depth + inner + "}" * depth


def _dump(body: Any) -> bytes:
    raw = json.dumps(body)
    while "@@DEEP-" in raw:
        start = raw.index('"@@DEEP-')
        end = raw.index('@@"', start + 8) + 3
        d, kind, leaf = raw[start + 8: end - 3].split("-")
        raw = raw[:start] + _nested(int(d), kind, leaf) + raw[end:]
    return raw.encode()   # lone surrogates go out as \ud800 escapes


def _paths(value: Any, at: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    if at:
        yield at
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, (*at, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _paths(v, (*at, i))


PATHS = {route: list(_paths(body)) for route, (_d, body) in BASES.items()}


def _apply(body: Any, path: tuple[Any, ...], action: str, value: Any) -> None:
    """Mutate ``body`` in place at ``path`` (nothing if an earlier mutation took the path away)."""
    node = body
    for step in path[:-1]:
        if isinstance(node, dict) and step in node or isinstance(node, list) and isinstance(step, int) and \
                step < len(node):
            node = node[step]
        else:
            return
    last = path[-1]
    if isinstance(node, dict) and (last in node or action == "add"):
        if action == "delete":
            del node[last]
        else:
            node[last] = value
    elif isinstance(node, list) and isinstance(last, int) and last < len(node):
        if action == "delete":
            del node[last]
        else:
            node[last] = value


@st.composite
def mutated(draw: st.DrawFn, route: str) -> bytes:
    """A valid body of ``route`` with one to three fields replaced, removed or added."""
    body = copy.deepcopy(BASES[route][1])
    for _ in range(draw(st.integers(1, 3))):
        action = draw(st.sampled_from(["replace", "replace", "replace", "replace", "delete", "add"]))
        if action == "add":
            dicts = [()] + [p for p in PATHS[route] if isinstance(_get(BASES[route][1], p), dict)]
            path = (*draw(st.sampled_from(dicts)), draw(st.sampled_from(OTHER_FIELDS)))
        else:
            path = draw(st.sampled_from(PATHS[route]))
        _apply(body, path, action, draw(wrong_values) if action != "delete" else None)
    return _dump(body)


def _get(value: Any, path: tuple[Any, ...]) -> Any:
    for step in path:
        value = value[step]
    return value


# ---- the daemon -------------------------------------------------------------------------------

class Errors(logging.Handler):
    """Every record at ERROR or with a traceback, from any thread."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info or record.levelno >= logging.ERROR:
            self.records.append(record)

    def take(self) -> list[str]:
        out = [f"{r.levelname} {r.name}: {r.getMessage()[:300]}" for r in self.records]
        self.records.clear()
        return out


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[httpx.Client, str, Errors]]:
    """The daemon, a client, its conversation's id, and the error records it logs. ``$SUPERFLUID_HOME``
    is a scratch directory whose library holds ``library-model`` (a file), which ``/api/copy`` copies."""
    from superfluid.models._library import add_copy

    home = tempfile.mkdtemp(prefix="superfluid-fuzz-home-")
    saved = os.environ.get("SUPERFLUID_HOME")
    os.environ["SUPERFLUID_HOME"] = home
    model_file = Path(home) / "tiny.gguf"
    model_file.write_bytes(b"GGUF")
    add_copy(model_file, "library-model")
    errors = Errors()
    root = logging.getLogger()
    root.addHandler(errors)
    try:
        with quiet_daemon() as url, httpx.Client(base_url=url, timeout=60) as client:
            r = client.post("/v1/sessions", json=CONVERSATION)
            assert r.status_code == 201, r.text
            yield client, r.json()["id"], errors
    finally:
        root.removeHandler(errors)
        if saved is None:
            os.environ.pop("SUPERFLUID_HOME", None)
        else:
            os.environ["SUPERFLUID_HOME"] = saved


SENT: dict[str, Any] = {"bodies": 0, "routes": set(), "statuses": {}}


def check(client: httpx.Client, errors: Errors, route: str, dialect: str, content: bytes) -> None:
    try:
        r = client.post(route, content=content, headers={"content-type": "application/json"})
    except httpx.TransportError as exc:
        raise AssertionError(f"the daemon dropped the connection: {type(exc).__name__}: {exc}") from None
    SENT["bodies"] += 1
    SENT["statuses"][r.status_code] = SENT["statuses"].get(r.status_code, 0) + 1
    assert r.status_code < 500, f"{route} {r.status_code}: {r.text[:400]}\nbody: {content[:400]!r}"
    if r.status_code >= 400:
        typed_error(dialect, r.status_code, r.content)
    elif r.headers.get("content-type", "").startswith("application/json"):
        json.loads(r.content)
    logged = errors.take()
    assert not logged, f"{route}: logged {logged}\nbody: {content[:400]!r}"


@pytest.mark.parametrize("route", sorted(BASES))
def test_no_body_yields_a_5xx_or_a_traceback(served: tuple[httpx.Client, str, Errors], route: str) -> None:
    client, cid, errors = served
    dialect, base = BASES[route]
    url = route.replace("{cid}", cid)
    check(client, errors, url, dialect, _dump(base))   # the valid body itself

    @FUZZ
    @given(content=mutated(route))
    def fuzz(content: bytes) -> None:
        check(client, errors, url, dialect, content)

    fuzz()
    SENT["routes"].add(route)


# ---- WebSocket ops (api/_ws.py) ---------------------------------------------------------------

WS_OPS: list[dict[str, Any]] = [
    {"op": "generate", "id": 1, "body": {"model": "mock", "messages": [{"role": "user", "content": "hi"}],
                                         "max_tokens": 3, "tools": TOOLS, "chat_template_kwargs": {"x": 1}}},
    {"op": "create", "id": 2, "body": CONVERSATION},
    {"op": "append", "id": 3, "session": "{cid}", "body": {"messages": [{"role": "user", "content": "more"}]}},
    {"op": "generate", "id": 4, "session": "{cid}", "body": {"max_tokens": 3, "logit_bias": {"5": 1},
                                                            "tool_choice": "auto"}},
    {"op": "events", "id": 5, "session": "{cid}", "after": 0, "limit": 5},
    {"op": "fork", "id": 6, "session": "{cid}", "body": {"at": 1}},
    {"op": "get", "id": 7, "session": "{cid}"},
    {"op": "subscribe", "id": 8, "session": "{cid}", "after": 0},
    {"op": "cancel", "id": 9, "session": "{cid}"},
    {"op": "unsubscribe", "id": 10, "session": "{cid}"},
]
WS_PATHS = [list(_paths(op)) for op in WS_OPS]
FINAL = {"error", "created", "appended", "events", "forked", "session", "unsubscribed", "cancelled", "done"}


@st.composite
def ws_message(draw: st.DrawFn, cid: str) -> bytes:
    k = draw(st.integers(0, len(WS_OPS) - 1))
    op = json.loads(json.dumps(WS_OPS[k]).replace("{cid}", cid))
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(WS_PATHS[k]))
        if path == ("op",):
            continue   # the op stays: each is fuzzed on its own fields
        action = draw(st.sampled_from(["replace", "replace", "replace", "delete"]))
        _apply(op, path, action, draw(wrong_values) if action != "delete" else None)
    return _dump(op)


async def ws_exchange(url: str, message: bytes) -> list[dict[str, Any]]:
    """Send one op; the replies up to its last (or 10 s), and the close code if the socket closed."""
    replies: list[dict[str, Any]] = []
    async with open_websocket_url(url) as ws:
        await ws.send_message(message)
        with trio.move_on_after(10):
            try:
                while True:
                    reply = json.loads(await ws.get_message())
                    replies.append(reply)
                    if reply.get("op") in FINAL:
                        break
            except ConnectionClosed as exc:
                replies.append({"op": "closed", "code": exc.reason.code})
    return replies


def test_no_websocket_op_yields_an_internal_error(served: tuple[httpx.Client, str, Errors]) -> None:
    client, cid, errors = served
    url = str(client.base_url).replace("http://", "ws://").rstrip("/") + "/v1/ws"

    @settings(FUZZ, max_examples=max(10, PER_ROUTE * 2))
    @given(message=ws_message(cid))
    def fuzz(message: bytes) -> None:
        replies = trio.run(ws_exchange, url, message)
        for reply in replies:
            assert reply.get("op") != "closed" or reply["code"] in (1000, 1009), (reply, message[:400])
            if reply.get("op") == "error":
                err = reply["error"]
                assert set(err) == {"message", "type", "param", "code"}, reply
                assert err["type"] != "server_error", (reply, message[:400])
                assert not err["message"].startswith("internal error"), (reply, message[:400])
        logged = errors.take()
        assert not logged, f"logged {logged}\nmessage: {message[:400]!r}"

    fuzz()


def test_the_daemon_serves_after_the_fuzzing(served: tuple[httpx.Client, str, Errors]) -> None:
    client, _cid, errors = served
    assert client.get("/health").status_code == 200
    r = client.post("/v1/chat/completions", json={"model": "mock", "messages": [{"role": "user", "content": "hi"}],
                                                  "max_tokens": 3})
    assert r.status_code == 200, r.text
    print(f"{SENT['bodies']} bodies, statuses {dict(sorted(SENT['statuses'].items()))}")   # (pytest -s)
    if SENT["routes"] == set(BASES) and BUDGET >= 200:
        assert SENT["bodies"] >= 2000, SENT["bodies"]
    assert not errors.take()
