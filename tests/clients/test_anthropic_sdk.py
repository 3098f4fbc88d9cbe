"""The official ``anthropic`` SDK on ``/v1/messages``: a message, a stream, and a tool loop."""

from __future__ import annotations

import anthropic
import pytest

from .conftest import MOCK, SMOL, WEATHER_SCHEMA, Served

# this SDK has no temperature parameter; its users send it as an extra body field
GREEDY = {"temperature": 0}
TOOLS = [{"name": "get_weather", "description": "Weather for a city", "input_schema": WEATHER_SCHEMA}]


def client(served: Served) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=served.url, api_key="unused", max_retries=0, timeout=60)


def test_message(served: Served) -> None:
    msg = client(served).messages.create(model=MOCK, max_tokens=8, system="be brief",
                                         messages=[{"role": "user", "content": "hi"}])
    assert msg.role == "assistant" and msg.stop_reason in ("end_turn", "max_tokens")
    (block,) = msg.content
    assert block.type == "text" and block.text
    assert 0 < msg.usage.output_tokens <= 8 and msg.usage.input_tokens > 0


def test_stream_text_matches_the_final_message(served: Served) -> None:
    with client(served).messages.stream(model=MOCK, max_tokens=16,
                                        messages=[{"role": "user", "content": "a story"}], extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text and final.content[0].text == text
    assert final.stop_reason in ("end_turn", "max_tokens") and final.usage.output_tokens > 0


@pytest.mark.real
def test_tool_loop(served: Served) -> None:
    """A forced tool_use (streamed: the SDK reassembles input_json_delta), its tool_result sent
    back, then a text answer."""
    c = client(served)
    messages: list[dict] = [{"role": "user", "content": "What is the weather in Paris?"}]
    with c.messages.stream(model=SMOL, max_tokens=40, messages=messages, tools=TOOLS,
                           tool_choice={"type": "tool", "name": "get_weather"}, extra_body=GREEDY) as stream:
        msg = stream.get_final_message()
    (use,) = [b for b in msg.content if b.type == "tool_use"]
    assert msg.stop_reason == "tool_use" and use.name == "get_weather" and isinstance(use.input["city"], str)
    messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in msg.content]})
    messages.append({"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": use.id, "content": "21 degrees and clear"}]})
    final = c.messages.create(model=SMOL, max_tokens=24, messages=messages, tools=TOOLS,
                              tool_choice={"type": "none"}, extra_body=GREEDY)
    assert [b.type for b in final.content] == ["text"] and final.content[0].text
