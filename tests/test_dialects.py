"""One port, three dialects: the official ``openai``, ``anthropic`` and
``ollama`` clients against the daemon, on the mock runtime and on SmolLM2.

Every response is validated against the SDK's own (pydantic) types from the
raw body, not only through the SDK's lenient construction.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import trio

from superfluid.proto import SseDecoder
from superfluid.suite._client import metric_sum

from .conftest import REAL_GGUF, Daemon, mock_config, start_daemon

TOOL_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
OPENAI_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                                  "parameters": TOOL_SCHEMA}}]
CITY_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
               "required": ["city", "population"], "additionalProperties": False}
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'},
]


def _openai(url: str) -> Any:
    import openai

    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def _anthropic(url: str) -> Any:
    import anthropic

    return anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)


def _ollama(url: str) -> Any:
    import ollama

    return ollama.Client(host=url)


def _sse_events(text: str) -> list[dict[str, Any]]:
    return [event.json() for event in SseDecoder().feed(text.encode()) if event.data != "[DONE]"]


# --- OpenAI ------------------------------------------------------------------------------------------------

def _openai_mock(url: str) -> None:
    import openai
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    client = _openai(url)
    for messages in ([{"role": "user", "content": "hi"}], HISTORY):
        raw = client.chat.completions.with_raw_response.create(model="mock", messages=messages, tools=OPENAI_TOOLS,
                                                               max_tokens=12, temperature=0)
        whole = ChatCompletion.model_validate(json.loads(raw.http_response.text))
        assert whole.choices[0].message.content and whole.choices[0].finish_reason in ("stop", "length")
        text = ""
        for chunk in client.chat.completions.create(model="mock", messages=messages, tools=OPENAI_TOOLS,
                                                    max_tokens=12, temperature=0, stream=True):
            ChatCompletionChunk.model_validate(chunk.model_dump(exclude_unset=True))
            text += "".join(c.delta.content or "" for c in chunk.choices)
        assert text == whole.choices[0].message.content
    for bad in ({"tool_choice": "required"},
                {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
                {"response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": CITY_SCHEMA}}}):
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as info:
                client.chat.completions.create(model="mock", messages=HISTORY, tools=OPENAI_TOOLS, max_tokens=4,
                                               stream=stream, **bad)
            assert info.value.code == "unsupported_parameter"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="mock", messages=HISTORY, tools=OPENAI_TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
    assert info.value.param == "tool_choice"
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(model="mock", input="hi", dimensions=3)
    assert info.value.code == "unsupported_parameter" and info.value.param == "dimensions"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="mock", messages=HISTORY, reasoning_effort="bogus")  # type: ignore[arg-type]
    assert info.value.param == "reasoning_effort"
    ok = client.chat.completions.create(model="mock", messages=HISTORY, reasoning_effort="low", max_tokens=4,
                                        extra_body={"chat_template_kwargs": {"enable_thinking": False},
                                                    "enable_thinking": True})
    assert ok.choices[0].message.content


async def test_openai_client_with_tools_on_the_mock(daemon: Daemon) -> None:
    await trio.to_thread.run_sync(_openai_mock, daemon.url)


# --- Anthropic ---------------------------------------------------------------------------------------------

ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "Weather for a city", "input_schema": TOOL_SCHEMA}]
ANTHROPIC_HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": [{"type": "thinking", "thinking": "use the tool", "signature": ""},
                                      {"type": "text", "text": "Checking."},
                                      {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                       "input": {"city": "Paris"}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": '{"temp_c": 21}'},
                                 {"type": "text", "text": "And now?"}]},
]


def _anthropic_mock(url: str) -> None:
    import anthropic
    from anthropic.types import Message, MessageTokensCount

    client = _anthropic(url)
    for messages in ([{"role": "user", "content": "hi"}], ANTHROPIC_HISTORY):
        raw = client.messages.with_raw_response.create(model="mock", max_tokens=12, messages=messages,
                                                       system=[{"type": "text", "text": "Be brief."}],
                                                       tools=ANTHROPIC_TOOLS)
        msg = Message.model_validate(json.loads(raw.http_response.text))
        assert msg.content[0].type == "text" and msg.stop_reason in ("end_turn", "max_tokens")
        with client.messages.stream(model="mock", max_tokens=12, messages=messages, tools=ANTHROPIC_TOOLS) as s:
            streamed = "".join(s.text_stream)
            final = s.get_final_message()
        assert streamed == final.content[0].text and final.usage.output_tokens >= 1
        count = client.messages.count_tokens(model="mock", messages=messages, tools=ANTHROPIC_TOOLS)
        assert MessageTokensCount.model_validate(count.model_dump()).input_tokens > 10
    with pytest.raises(anthropic.NotFoundError) as nf:
        client.messages.create(model="nope", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert nf.value.body["type"] == "error" and nf.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model="mock", max_tokens=4, messages=[{"role": "user", "content": "hi"}],
                               tools=ANTHROPIC_TOOLS, tool_choice={"type": "any"})
    assert bad.value.body["error"]["type"] == "invalid_request_error"
    r = httpx.post(url + "/v1/messages", json={"model": "mock", "messages": [{"role": "user", "content": "hi"}]},
                   headers={"x-api-key": "k"})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("max_tokens")


async def test_anthropic_client_on_the_mock(daemon: Daemon) -> None:
    await trio.to_thread.run_sync(_anthropic_mock, daemon.url)


# --- Ollama ------------------------------------------------------------------------------------------------

def _ollama_mock(url: str) -> None:
    import ollama
    from ollama import ChatResponse, GenerateResponse, ListResponse, ProcessResponse, ShowResponse

    client = _ollama(url)
    assert [m.model for m in ListResponse.model_validate(client.list().model_dump()).models] == ["mock"]
    assert ProcessResponse.model_validate(client.ps().model_dump()).models[0].context_length > 0
    assert "completion" in ShowResponse.model_validate(client.show("mock:latest").model_dump(by_alias=True)).capabilities
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather",
                                                                               "arguments": {"city": "Paris"}}}]},
               {"role": "tool", "content": '{"temp_c": 21}', "tool_name": "get_weather"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                               "parameters": TOOL_SCHEMA}}]
    for messages in ([{"role": "user", "content": "hi"}], history):
        whole = client.chat("mock", messages=messages, tools=tools, options={"num_predict": 12, "temperature": 0})
        ChatResponse.model_validate(whole.model_dump())
        assert whole.done and whole.message.content and whole.done_reason in ("stop", "length")
        assert whole.eval_count >= 1 and whole.total_duration > 0
        parts = list(client.chat("mock", messages=messages, tools=tools, stream=True,
                                 options={"num_predict": 12, "temperature": 0}))
        assert parts[-1].done and not any(p.done for p in parts[:-1])
        assert "".join(p.message.content or "" for p in parts) == whole.message.content
    gen = client.generate("mock", "hi", system="Be brief.", options={"num_predict": 8, "seed": 3})
    GenerateResponse.model_validate(gen.model_dump())
    streamed = "".join(p.response for p in client.generate("mock", "hi", system="Be brief.", stream=True,
                                                           options={"num_predict": 8, "seed": 3}))
    assert streamed == gen.response and gen.eval_count == 8
    for call, status in ((lambda: client.chat("mock", messages=history, format="json"), 400),
                         (lambda: client.chat("mock", messages=history, options={"num_gpu": "all"}), 400),
                         (lambda: client.embed("mock", [""]), 400),
                         (lambda: client.chat("nope", messages=history), 404),
                         (lambda: client.pull("mock"), 400),  # not a Hugging Face id (tests/test_pulls.py)
                         (lambda: client.delete("mock"), 404),  # nothing pulled or copied by that name
                         (lambda: client.push("mock"), 501)):
        with pytest.raises(ollama.ResponseError) as info:
            call()
        assert info.value.status_code == status, info.value
    assert httpx.get(url + "/").text == "superfluid is running"
    assert httpx.get(url + "/api/version").json()["server"] == "superfluid"
    loaded = client.chat("mock", messages=[])
    assert loaded.done_reason == "load"


async def test_ollama_client_on_the_mock(daemon: Daemon) -> None:
    await trio.to_thread.run_sync(_ollama_mock, daemon.url)


# --- Responses ---------------------------------------------------------------------------------------------

def _responses_mock(url: str) -> None:
    import openai
    from openai.types.responses import Response

    client = _openai(url)
    tools = [{"type": "function", "name": "get_weather", "parameters": TOOL_SCHEMA, "strict": False}]
    raw = client.responses.with_raw_response.create(model="mock", input="hi", instructions="Be brief.",
                                                    max_output_tokens=10, tools=tools)
    first = Response.model_validate(json.loads(raw.http_response.text))
    assert first.output_text and first.status in ("completed", "incomplete")
    second = client.responses.create(previous_response_id=first.id, max_output_tokens=10, instructions="Be brief.",
                                     tools=tools,
                                     input=[{"type": "function_call", "call_id": "c1", "name": "get_weather",
                                             "arguments": '{"city": "Paris"}'},
                                            {"type": "function_call_output", "call_id": "c1", "output": "21C"}])
    assert second.previous_response_id == first.id and second.model == "mock"
    assert second.usage.input_tokens > first.usage.input_tokens
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens  # the turn was append-stable
    events = list(client.responses.create(model="mock", input="hi", max_output_tokens=10, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = Response.model_validate(events[-1].response.model_dump(exclude_unset=True))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == final.output_text
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="mock", input="hi", previous_response_id="resp_missing")
    assert info.value.code == "previous_response_not_found"
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="mock", input="hi", tools=[{"type": "web_search"}])
    assert info.value.code == "unsupported_tool"
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="mock", input="hi", text={"format": {"type": "json_object"}})
    assert info.value.code == "unsupported_parameter"


async def test_responses_client_on_the_mock(daemon: Daemon) -> None:
    await trio.to_thread.run_sync(_responses_mock, daemon.url)


# --- failures and disconnects in each dialect's own shape ------------------------------------------------

async def test_streamed_failures_use_each_dialects_error_event(daemon: Daemon) -> None:
    c = daemon.client
    poison = "[[mock:fault_after=3]] hi"
    r = await c.post("/v1/messages", json={"model": "mock", "max_tokens": 50, "stream": True,
                                           "messages": [{"role": "user", "content": poison}]})
    assert "event: error" in r.text and '"type":"error"' in r.text
    r = await c.post("/api/chat", json={"model": "mock", "messages": [{"role": "user", "content": poison}],
                                        "options": {"num_predict": 50}})
    assert "error" in json.loads(r.text.strip().splitlines()[-1])
    r = await c.post("/v1/responses", json={"model": "mock", "input": poison, "stream": True, "max_output_tokens": 50})
    kinds = [e["type"] for e in _sse_events(r.text)]
    assert kinds[-2:] == ["error", "response.failed"]


async def test_disconnect_cancels_on_every_dialect(nursery: trio.Nursery) -> None:
    d = await start_daemon(nursery, mock_config("mock?step_ms=2&prefill_us=5&eos_every=1000000"))
    long = [{"role": "user", "content": "go"}]
    for path, body in (("/v1/messages", {"model": "mock", "max_tokens": 3000, "stream": True, "messages": long}),
                       ("/api/chat", {"model": "mock", "messages": long, "options": {"num_predict": 3000}}),
                       ("/v1/responses", {"model": "mock", "input": "go", "stream": True,
                                          "max_output_tokens": 3000})):
        async with d.client.stream("POST", path, json=body) as r:
            async for _line in r.aiter_lines():
                break
            assert metric_sum((await d.client.get("/metrics")).text, "superfluid_lanes_active", model="mock") == 1
        with trio.fail_after(5):
            while metric_sum((await d.client.get("/metrics")).text, "superfluid_lanes_active", model="mock") != 0:
                await trio.sleep(0.02)
    await d.client.aclose()
    d.scope.cancel()


# --- the real model ----------------------------------------------------------------------------------------

def _real_clients(url: str) -> None:
    from anthropic.types import Message
    from ollama import ChatResponse
    from openai.types.chat import ChatCompletion
    from openai.types.responses import Response

    oc, ac, olc = _openai(url), _anthropic(url), _ollama(url)
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    # OpenAI: a named call, buffered and streamed
    kw: dict[str, Any] = dict(model="smol", messages=ask, tools=OPENAI_TOOLS, temperature=0, max_tokens=48,
                              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    whole = ChatCompletion.model_validate(json.loads(
        oc.chat.completions.with_raw_response.create(**kw).http_response.text))
    (call,) = whole.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and "city" in json.loads(call.function.arguments)
    assert whole.choices[0].finish_reason == "tool_calls" and not whole.choices[0].message.content
    args = "".join(tc.function.arguments or "" for chunk in oc.chat.completions.create(**kw, stream=True)
                   for ch in chunk.choices for tc in ch.delta.tool_calls or ())
    assert json.loads(args) == json.loads(call.function.arguments)
    # OpenAI: structured output, buffered and streamed
    rf = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY_SCHEMA}}
    kw = dict(model="smol", messages=[{"role": "user", "content": "Largest city of Japan as JSON."}],
              temperature=0, max_tokens=60, response_format=rf)
    doc = json.loads(oc.chat.completions.create(**kw).choices[0].message.content)
    assert set(doc) == {"city", "population"}
    streamed = "".join(c.choices[0].delta.content or "" for c in oc.chat.completions.create(**kw, stream=True)
                       if c.choices)
    assert json.loads(streamed) == doc
    # Anthropic: a forced tool, buffered and streamed (input_json_delta reassembled by the SDK)
    akw: dict[str, Any] = dict(model="smol", max_tokens=48, messages=ask, extra_body={"temperature": 0},
                               tools=ANTHROPIC_TOOLS, tool_choice={"type": "tool", "name": "get_weather"})
    msg = Message.model_validate(json.loads(ac.messages.with_raw_response.create(**akw).http_response.text))
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert msg.stop_reason == "tool_use" and uses and isinstance(uses[0].input, dict)
    with ac.messages.stream(**akw) as s:
        final = s.get_final_message()
    assert [b.input for b in final.content if b.type == "tool_use"] == [uses[0].input]
    # Ollama: format schema and tools
    japan = [{"role": "user", "content": "Largest city of Japan as JSON."}]
    res = olc.chat("smol", messages=japan, format=CITY_SCHEMA, options={"temperature": 0, "num_predict": 60})
    ChatResponse.model_validate(res.model_dump())
    assert set(json.loads(res.message.content)) == {"city", "population"}
    parts = list(olc.chat("smol", messages=japan, format=CITY_SCHEMA, stream=True,
                          options={"temperature": 0, "num_predict": 60}))
    assert json.loads("".join(p.message.content for p in parts)) == json.loads(res.message.content)
    res = olc.chat("smol", messages=ask, tools=OPENAI_TOOLS, options={"temperature": 0, "num_predict": 24})
    assert ChatResponse.model_validate(res.model_dump()).done
    # Responses: a named call and text.format
    resp = oc.responses.create(model="smol", input="What is the weather in Paris?", temperature=0,
                               max_output_tokens=48, tool_choice={"type": "function", "name": "get_weather"},
                               tools=[{"type": "function", "name": "get_weather", "parameters": TOOL_SCHEMA,
                                       "strict": True}])
    resp = Response.model_validate(resp.model_dump(exclude_unset=True))
    assert [o.name for o in resp.output if o.type == "function_call"] == ["get_weather"]
    resp = oc.responses.create(model="smol", input="Largest city of Japan as JSON.", temperature=0,
                               max_output_tokens=60,
                               text={"format": {"type": "json_schema", "name": "city", "schema": CITY_SCHEMA}})
    assert set(json.loads(resp.output_text)) == {"city", "population"}


@pytest.mark.real
async def test_every_client_on_the_real_model(nursery: trio.Nursery) -> None:
    from .test_real_daemon import real_config

    # deterministic: each buffered reply is compared with the same request streamed, which finds the
    # prompt warm in the prefix cache; only with --deterministic is that identical (SPEC.md §5)
    d = await start_daemon(nursery, real_config(REAL_GGUF, "smol", deterministic=True))
    await trio.to_thread.run_sync(_real_clients, d.url)
    d.scope.cancel()
