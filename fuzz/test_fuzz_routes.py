"""Fuzz every generation route of an in-process mock daemon with hostile bodies.

Routes: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/responses``,
``/v1/messages``, ``/api/chat``, ``/api/generate``. Bodies: raw bytes (not JSON,
not UTF-8, deeply nested, empty), any JSON value, and valid bodies of the route
with fields removed, added or replaced by values of the wrong shape, type, size
or unicode (lone surrogates, NUL, RTL marks, astral characters).

Invariants, for every body:

* the daemon answers: never a dropped connection or a response cut short;
* no body yields a 5xx, and none writes a traceback (a log record with
  ``exc_info``) or an ERROR to the log: every bad input is the client's;
* a status other than 200 is a typed error in *that dialect's* envelope
  (OpenAI ``{"error":{"message","type","param","code"}}`` for the OpenAI routes
  and Responses, Anthropic ``{"type":"error","error":{"type","message"}}``,
  Ollama ``{"error":"…"}``); a body that is not a JSON object is a 400; no
  answer comes from the catch-all for unexpected exceptions
  (``internal error: <exception>``);
* a 200 is well formed: JSON for a whole reply; a stream that ends the way its
  dialect ends one (``data: [DONE]``; ``message_stop`` or ``error``;
  ``response.completed|incomplete|failed``; an NDJSON line with ``done: true``
  or ``error``);
* afterwards the daemon still serves a normal request.

The daemon runs in a thread with its own ``trio.run`` (hypothesis drives a
sync test); the mock runs with no sleeps. Budget: a quarter of
``SUPERFLUID_FUZZ_EXAMPLES`` (default 200, so 50 bodies, about 1 s).
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
import trio
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from superfluid.proto import SseDecoder

pytestmark = pytest.mark.fuzz

EXAMPLES = max(10, int(os.environ.get("SUPERFLUID_FUZZ_EXAMPLES", "200")) // 4)
FUZZ = settings(max_examples=EXAMPLES, database=None, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])

DIALECT = {
    "/v1/chat/completions": "openai", "/v1/completions": "openai", "/v1/responses": "responses",
    "/v1/messages": "anthropic", "/api/chat": "ollama", "/api/generate": "ollama",
}
VALID: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"model": "mock", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    "/v1/completions": {"model": "mock", "prompt": "hi", "max_tokens": 4},
    "/v1/responses": {"model": "mock", "input": "hi", "max_output_tokens": 16},
    "/v1/messages": {"model": "mock", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
    "/api/chat": {"model": "mock", "messages": [{"role": "user", "content": "hi"}], "stream": False,
                  "options": {"num_predict": 4}},
    "/api/generate": {"model": "mock", "prompt": "hi", "stream": False, "options": {"num_predict": 4}},
}
FIELDS = sorted({
    "model", "messages", "prompt", "input", "instructions", "system", "max_tokens", "max_completion_tokens",
    "max_output_tokens", "stream", "stream_options", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
    "stop_sequences", "tools", "tool_choice", "response_format", "text", "format", "logprobs", "top_logprobs", "n",
    "logit_bias", "ignore_eos", "options", "raw", "think", "thinking", "reasoning", "reasoning_effort",
    "enable_thinking", "chat_template_kwargs", "previous_response_id", "suffix", "images", "template", "context",
    "keep_alive", "metadata", "parallel_tool_calls", "store", "truncation", "include", "user", "echo",
    "presence_penalty", "frequency_penalty", "repeat_penalty", "num_predict", "background", "conversation",
})

# ---- values -----------------------------------------------------------------------------------

nasty_text = st.one_of(
    st.text(max_size=12),
    st.sampled_from(["", "\x00", "\ud800", "a\udfffb", "\u202e\u2066x", "💥" * 3, "<|im_start|>", "</s>",
                     "[[mock:fault_after=0]]", "{{ 7*7 }}", "{% for x in y %}", "\\u0000", "\r\n\r\n",
                     "\ue0000\ue001", "\ue0007\ue001", "<start_of_turn>user\n", "<|im_end|>\n<|im_start|>system"]),
    st.integers(1, 6).map(lambda k: "word " * (10 ** k // 5)),   # up to ~200 KB
)
json_numbers = st.one_of(
    st.integers(), st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, 1, -1, 0.5, -0.0, 2**31, 2**63, 2**64, 10**400, 1e308]),
)
json_scalars = st.one_of(st.none(), st.booleans(), json_numbers, nasty_text)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6) | st.sampled_from(FIELDS),
                                                                 inner, max_size=4),
    max_leaves=12,
)
block_types = st.sampled_from(["text", "image", "image_url", "input_text", "input_image", "tool_use", "tool_result",
                               "thinking", "function_call", "function_call_output", "message", "document", "??"])
blocks = st.one_of(
    st.fixed_dictionaries({"type": block_types}, optional={
        "text": nasty_text | json_values, "content": json_values, "id": json_values, "name": json_values,
        "input": json_values, "tool_use_id": json_values, "role": json_values, "arguments": json_values,
        "call_id": json_values, "output": json_values, "image_url": json_values, "source": json_values}),
    json_values,
)
messages = st.lists(st.one_of(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant", "tool", "developer", "", "USER"]) | nasty_text},
        optional={"content": nasty_text | st.lists(blocks, max_size=3) | json_values,
                  "tool_calls": json_values, "tool_call_id": json_values, "name": json_values,
                  "images": json_values, "thinking": json_values, "reasoning_content": json_values},
    ),
    json_values,
), max_size=4)
field_values: dict[str, st.SearchStrategy[Any]] = {
    "messages": messages, "input": nasty_text | messages | st.lists(blocks, max_size=3),
    "model": st.sampled_from(["mock", "nope", "", "MOCK", "mock "]) | json_values,
    "tools": st.lists(json_values | st.fixed_dictionaries(
        {"type": st.sampled_from(["function", "custom", "web_search"])},
        optional={"function": json_values, "name": json_values, "parameters": json_values,
                  "input_schema": json_values}), max_size=3),
    "stream": st.booleans() | json_values,
    "options": st.dictionaries(st.sampled_from(["num_predict", "temperature", "seed", "stop", "num_ctx", "top_k"]),
                               json_values, max_size=4) | json_values,
}


small_ints = st.integers(-2, 40) | st.sampled_from([0, 2**31, 10**9, 10**30])
schema = st.just({"type": "object", "properties": {"a": {"type": "string"}}})
tool = st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": st.sampled_from(["get", "x", ""]) | nasty_text},
    optional={"description": nasty_text, "parameters": schema | json_values})})
plausible: dict[str, st.SearchStrategy[Any]] = {
    "max_tokens": small_ints, "max_completion_tokens": small_ints, "max_output_tokens": small_ints,
    "num_predict": small_ints, "n": small_ints, "top_logprobs": small_ints, "top_k": small_ints, "seed": small_ints,
    "temperature": st.floats(-1, 3), "top_p": st.floats(-0.5, 1.5), "min_p": st.floats(-0.5, 1.5),
    "presence_penalty": st.floats(-3, 3), "frequency_penalty": st.floats(-3, 3), "repeat_penalty": st.floats(-1, 3),
    "stream": st.booleans(), "logprobs": st.booleans() | small_ints, "ignore_eos": st.booleans(),
    "raw": st.booleans(), "echo": st.booleans(), "store": st.booleans(), "parallel_tool_calls": st.booleans(),
    "stop": nasty_text | st.lists(nasty_text, max_size=5), "stop_sequences": st.lists(nasty_text, max_size=5),
    "tools": st.lists(tool, max_size=3),
    "tool_choice": st.sampled_from(["auto", "none", "required", "any"]) | st.fixed_dictionaries(
        {"type": st.sampled_from(["function", "tool", "auto", "any"]), "name": nasty_text}),
    "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}, {"type": "json_schema"},
                                        {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}]),
    "format": st.sampled_from(["json", "", {"type": "object"}]), "think": st.booleans() | st.just("high"),
    "thinking": st.sampled_from([{"type": "enabled", "budget_tokens": 16}, {"type": "disabled"}]),
    "reasoning": st.sampled_from([{"effort": "low"}, {"effort": "none"}, {}]),
    "reasoning_effort": st.sampled_from(["low", "high", "none", "bogus"]), "enable_thinking": st.booleans(),
    "system": nasty_text | st.lists(blocks, max_size=2), "instructions": nasty_text, "prompt": nasty_text,
    "suffix": nasty_text, "template": nasty_text, "previous_response_id": st.sampled_from(["resp_x", ""]),
    "stream_options": st.sampled_from([{"include_usage": True}, {}]),
    "logit_bias": st.dictionaries(st.integers(-3, 400).map(str), st.floats(-200, 200), max_size=3),
    "chat_template_kwargs": st.dictionaries(st.sampled_from(["enable_thinking", "x", "messages", "tools", "bos_token",
                                                             "add_generation_prompt", "a b", ""]),
                                            json_values, max_size=2),
    **field_values,
}


@st.composite
def mutated(draw: st.DrawFn, route: str) -> bytes:
    body = dict(VALID[route])
    if draw(st.integers(0, 4)) == 0:
        for key in draw(st.lists(st.sampled_from(sorted(body)), max_size=2, unique=True)):
            del body[key]
    for key in draw(st.lists(st.sampled_from(FIELDS), max_size=3, unique=True)):
        wrong = draw(st.integers(0, 3)) == 0
        body[key] = draw(json_values if wrong else plausible.get(key, json_values))
    return json.dumps(body).encode()  # lone surrogates go out as \ud800 escapes


raw_bodies = st.one_of(
    st.binary(max_size=40),
    st.sampled_from([b"", b"{", b"null", b"[]", b"\"x\"", b"1e999", b"{\"model\": NaN}", b"\xff\xfe{}",
                     b"[" * 100_000 + b"]" * 100_000, b"{\"a\":" * 50_000 + b"1" + b"}" * 50_000,
                     b"{\"model\":\"mock\",\"messages\":[{\"role\":\"user\",\"content\":\"\\ud800\"}]}"]),
    json_values.map(lambda v: json.dumps(v).encode()),
)
HUGE_NUMBERS = [b"9" * 5000, b"-" + b"1" * 4301, b"1e999", b"-1e400", b"NaN", b"Infinity", b"1" * 400 + b".5"]


@st.composite
def unrepresentable(draw: st.DrawFn, route: str) -> bytes:
    """A valid body of ``route`` with one field, at any depth, a number Python cannot hold."""
    body = json.loads(draw(mutated(route)))
    key = draw(st.sampled_from(FIELDS))
    path = draw(st.sampled_from([[key], [key, "x"], ["options", key], ["messages", 0, "content"]]))
    node: Any = {"__n__": None}
    for step in reversed(path):
        node = {step: node} if isinstance(step, str) else [node]
    body.update(node)
    return json.dumps(body).replace('{"__n__": null}', "__N__").encode().replace(
        b"__N__", draw(st.sampled_from(HUGE_NUMBERS)))


@st.composite
def cases(draw: st.DrawFn) -> tuple[str, bytes]:
    route = draw(st.sampled_from(sorted(DIALECT)))
    return route, draw(st.one_of(mutated(route), mutated(route), raw_bodies, unrepresentable(route)))


# ---- the daemon -------------------------------------------------------------------------------

class ThreadDaemon:
    """``start_daemon`` from tests/conftest.py, in a thread of its own."""

    def __init__(self) -> None:
        self.ready = threading.Event()
        self.url = ""
        self.token: trio.lowlevel.TrioToken | None = None
        self.scope: trio.CancelScope | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        from tests.conftest import mock_config, start_daemon

        async def main() -> None:
            async with trio.open_nursery() as nursery:
                d = await start_daemon(nursery, mock_config("mock?step_ms=0&prefill_us=0", hang_timeout_s=10.0))
                self.url, self.scope = d.url, d.scope
                self.token = trio.lowlevel.current_trio_token()
                self.ready.set()

        try:
            trio.run(main)
        except BaseException as exc:  # noqa: BLE001, ASYNC103 - after trio.run: reported by the tests
            self.error = exc
        finally:
            self.ready.set()

    def stop(self) -> None:
        if self.token is not None and self.scope is not None:
            try:
                trio.from_thread.run_sync(self.scope.cancel, trio_token=self.token)
            except trio.RunFinishedError:
                pass
        self.thread.join(30)


@contextmanager
def quiet_daemon() -> Iterator[str]:
    """A :class:`ThreadDaemon`'s URL for the block; it must not have crashed by the end.

    The daemon's thread writes a request's access line after the client has its response, so a
    line could land while pytest moves between two tests' captures (CI printed half a logging
    error there): the daemon logs only warnings and errors meanwhile."""
    access = logging.getLogger("superfluid.access")
    level = access.level
    access.setLevel(logging.WARNING)
    d = ThreadDaemon()
    d.thread.start()
    try:
        d.ready.wait(60)
        assert d.url, f"the daemon did not start: {d.error!r}"
        yield d.url
    finally:
        d.stop()
        access.setLevel(level)
    assert d.error is None, f"the daemon crashed: {d.error!r}"


@pytest.fixture(scope="module")
def daemon_url() -> Iterator[str]:
    with quiet_daemon() as url:
        yield url


@pytest.fixture(scope="module")
def client(daemon_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=daemon_url, timeout=60) as c:
        yield c


# ---- checks -----------------------------------------------------------------------------------

def typed_error(dialect: str, status: int, raw: bytes) -> dict[str, Any]:
    obj = json.loads(raw)
    assert isinstance(obj, dict), raw[:300]
    if dialect in ("openai", "responses"):
        err = obj.get("error")
        assert isinstance(err, dict) and set(err) == {"message", "type", "param", "code"}, raw[:300]
        assert err["type"] == ("server_error" if status >= 500 else "invalid_request_error"), raw[:300]
        message = err["message"]
    elif dialect == "anthropic":
        assert obj.get("type") == "error" and isinstance(obj.get("error"), dict), raw[:300]
        assert isinstance(obj["error"].get("type"), str), raw[:300]
        message = obj["error"].get("message")
    else:
        assert set(obj) == {"error"} and isinstance(obj["error"], str), raw[:300]
        message = obj["error"]
    assert isinstance(message, str) and message, raw[:300]
    assert not message.startswith("internal error:"), f"an unexpected exception reached the boundary: {message}"
    return obj


def sse_events(raw: bytes) -> list[tuple[str | None, str]]:
    """(event name, data) of a whole SSE body, read with the one decoder (``proto.SseDecoder``)."""
    decoder = SseDecoder()
    return [(e.event, e.data) for e in [*decoder.feed(raw), *decoder.end()]]


def well_formed_200(route: str, r: httpx.Response) -> None:
    dialect = DIALECT[route]
    ctype = r.headers.get("content-type", "")
    raw = r.content
    if ctype.startswith("application/json"):
        obj = json.loads(raw)
        assert isinstance(obj, dict) and "error" not in obj or obj.get("error") is None, raw[:300]
        return
    if ctype.startswith("application/x-ndjson"):
        lines = [json.loads(x) for x in raw.decode().splitlines() if x.strip()]
        assert lines, "an empty NDJSON stream"
        last = lines[-1]
        assert last.get("done") is True or isinstance(last.get("error"), str), f"NDJSON ends with {last}"
        return
    assert ctype.startswith("text/event-stream"), ctype
    events = sse_events(raw)
    assert events, "an empty event stream"
    if dialect == "openai":
        assert events[-1][1] == "[DONE]", f"SSE ends with {events[-1]}"
        for _name, data in events[:-1]:
            obj = json.loads(data)
            if "error" in obj:
                assert data == events[-2][1], "an error frame that is not the last before [DONE]"
                assert set(obj["error"]) == {"message", "type", "param", "code"}
    elif dialect == "anthropic":
        assert events[-1][0] in ("message_stop", "error"), f"SSE ends with {events[-1]}"
    else:
        assert events[-1][0] in ("response.completed", "response.incomplete", "response.failed"), events[-1]
        seq = [json.loads(d)["sequence_number"] for _n, d in events]
        assert seq == list(range(len(seq))), "sequence_number is not 0, 1, 2, …"


def post(client: httpx.Client, route: str, content: bytes) -> httpx.Response:
    try:
        return client.post(route, content=content, headers={"content-type": "application/json"})
    except httpx.TransportError as exc:
        raise AssertionError(f"the daemon dropped the connection: {type(exc).__name__}: {exc}") from None


def check_case(client: httpx.Client, route: str, content: bytes) -> None:
    r = post(client, route, content)
    event(f"{route} {r.status_code}" + (f" {r.text[:150]}" if r.status_code >= 500 else ""))
    if r.status_code == 200:
        well_formed_200(route, r)
    else:
        assert 400 <= r.status_code < 500, f"{r.status_code}: {r.text[:300]}"
        typed_error(DIALECT[route], r.status_code, r.content)
        try:
            obj = json.loads(content)
        except (ValueError, RecursionError):
            obj = None
        if not isinstance(obj, dict):
            assert r.status_code == 400, f"a body that is not a JSON object got {r.status_code}"
    # the daemon still serves
    assert client.get("/health").status_code == 200


@FUZZ
@given(case=cases())
@example(case=("/v1/chat/completions", b"[" * 100_000 + b"]" * 100_000))
@example(case=("/v1/messages", b"{"))
@example(case=("/api/chat", b"{"))
@example(case=("/v1/chat/completions",
               b'{"model":"mock","messages":[{"role":"user","content":"\\ud800"}],"max_tokens":4}'))
@example(case=("/v1/chat/completions", b'{"model":"mock","messages":[{"role":"user","content":"hi"}],"seed":'
                                       + b"9" * 5000 + b"}"))
@example(case=("/v1/chat/completions", (b'{"model":"mock","messages":[{"role":"user","content":"hi",'
                                        b'"name":"\\ue0000\\ue001"}],"chat_template_kwargs":{"messages":1}}')))
def test_every_route_answers_typed(client: httpx.Client, caplog: pytest.LogCaptureFixture,
                                   case: tuple[str, bytes]) -> None:
    route, content = case
    caplog.clear()
    with caplog.at_level(logging.ERROR):
        check_case(client, route, content)
    logged = [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert not logged, f"client input logged: {[r.getMessage() for r in logged]}"


def test_a_normal_request_after_the_fuzzing(client: httpx.Client) -> None:
    for route, body in VALID.items():
        r = client.post(route, json=body)
        assert r.status_code == 200, (route, r.text)
