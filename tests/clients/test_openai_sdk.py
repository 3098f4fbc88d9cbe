"""The official ``openai`` SDK: a chat, a stream with usage, ``n`` choices, and a tool loop."""

from __future__ import annotations

import json

import openai
import pytest

from .conftest import MOCK, SMOL, WEATHER_SCHEMA, Served

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                           "parameters": WEATHER_SCHEMA}}]


def client(served: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.v1, api_key="unused", max_retries=0, timeout=60)


def test_chat_and_models(served: Served) -> None:
    c = client(served)
    assert MOCK in [m.id for m in c.models.list()]
    r = c.chat.completions.create(model=MOCK, messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                                  temperature=0)
    (choice,) = r.choices
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert r.usage is not None and 0 < r.usage.completion_tokens <= 8


def test_stream_with_usage_matches_the_whole_reply(served: Served) -> None:
    c = client(served)
    kw = dict(model=MOCK, messages=[{"role": "user", "content": "a story"}], max_tokens=16, temperature=0)
    whole = c.chat.completions.create(**kw).choices[0].message.content
    chunks = list(c.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == whole
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0


def test_n_choices_whole_and_streamed(served: Served) -> None:
    c = client(served)
    kw = dict(model=MOCK, messages=[{"role": "user", "content": "hi"}], max_tokens=8, n=3, seed=7)
    r = c.chat.completions.create(**kw)
    assert sorted(ch.index for ch in r.choices) == [0, 1, 2]
    assert all(ch.message.content for ch in r.choices)
    streamed: dict[int, str] = {}
    for chunk in c.chat.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            streamed[ch.index] = streamed.get(ch.index, "") + (ch.delta.content or "")
    assert sorted(streamed) == [0, 1, 2] and all(streamed.values())


@pytest.mark.real
def test_tool_loop(served: Served) -> None:
    """The model calls get_weather (forced, as an agent's first step does), the caller runs it
    and sends the result back; the model answers in text. The call is streamed as well."""
    c = client(served)
    messages: list[dict] = [{"role": "user", "content": "What is the weather in Paris?"}]
    forced = {"type": "function", "function": {"name": "get_weather"}}
    r = c.chat.completions.create(model=SMOL, messages=messages, tools=TOOLS, tool_choice=forced,
                                  temperature=0, max_tokens=40)
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    assert isinstance(args["city"], str)
    # streamed: the SDK's deltas reassemble the same call
    pieces = {"id": "", "name": "", "arguments": ""}
    for chunk in c.chat.completions.create(model=SMOL, messages=messages, tools=TOOLS, tool_choice=forced,
                                           temperature=0, max_tokens=40, stream=True):
        for ch in chunk.choices:
            for tc in ch.delta.tool_calls or ():
                pieces["id"] = tc.id or pieces["id"]
                pieces["name"] += (tc.function.name or "") if tc.function else ""
                pieces["arguments"] += (tc.function.arguments or "") if tc.function else ""
    assert pieces["name"] == "get_weather" and json.loads(pieces["arguments"]) == args and pieces["id"]
    messages.append(r.choices[0].message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp_c": 21, "sky": "clear"})})
    final = c.chat.completions.create(model=SMOL, messages=messages, tools=TOOLS, tool_choice="none",
                                      temperature=0, max_tokens=24)
    assert final.choices[0].message.content and not final.choices[0].message.tool_calls
