"""``litellm`` against an OpenAI-compatible base URL (``openai/<model>`` with ``api_base``), as
its users point it at a local server: a completion, a stream, and a tool call."""

from __future__ import annotations

import json
import os

import pytest

# before the import: litellm fetches its model price map from the network at import unless told not to
os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
os.environ.setdefault("LITELLM_LOG", "ERROR")

import litellm  # noqa: E402

from .conftest import MOCK, SMOL, WEATHER_SCHEMA, Served  # noqa: E402

litellm.telemetry = False  # older releases phone home unless told not to; the newer ones have no telemetry
litellm.drop_params = False  # send what the test asks for, drop nothing silently
# litellm builds pydantic models lazily, on first use, and pydantic warns about its TypedDicts each time
pytestmark = pytest.mark.filterwarnings("ignore:Items? .* using the `ReadOnly` qualifier:UserWarning")


def kw(served: Served, model: str) -> dict:
    return dict(model=f"openai/{model}", api_base=served.v1, api_key="unused", num_retries=0, timeout=60)


def test_completion_and_stream(served: Served) -> None:
    messages = [{"role": "user", "content": "a story"}]
    r = litellm.completion(**kw(served, MOCK), messages=messages, max_tokens=12, temperature=0)
    text = r.choices[0].message.content
    assert text and r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens > 0
    chunks = list(litellm.completion(**kw(served, MOCK), messages=messages, max_tokens=12, temperature=0,
                                     stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    # litellm rebuilds the whole response from the chunks
    rebuilt = litellm.stream_chunk_builder(chunks, messages=messages)
    assert rebuilt.choices[0].message.content == text


@pytest.mark.real
def test_tool_call(served: Served) -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                               "parameters": WEATHER_SCHEMA}}]
    r = litellm.completion(**kw(served, SMOL), messages=[{"role": "user", "content": "Weather in Oslo?"}],
                           tools=tools, tool_choice={"type": "function", "function": {"name": "get_weather"}},
                           max_tokens=40, temperature=0)
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    assert isinstance(json.loads(call.function.arguments)["city"], str)
