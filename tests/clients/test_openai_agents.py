"""The ``openai-agents`` SDK: an Agent with a function tool, run by ``Runner.run`` against the
daemon as its default OpenAI client, on the Responses API (the SDK's default) and on Chat
Completions (``set_default_openai_api("chat_completions")``, what most local-server guides set)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import trio
from agents import (
    Agent, ModelSettings, Runner, function_tool, set_default_openai_api, set_default_openai_client,
    set_tracing_disabled,
)
from agents.items import ToolCallItem, ToolCallOutputItem
from openai import AsyncOpenAI

from .conftest import SMOL, Served

pytestmark = pytest.mark.real

CALLS: list[str] = []


@function_tool
def get_weather(city: str) -> str:
    """The weather in a city.

    Args:
        city: the city's name.
    """
    CALLS.append(city)
    return f"21 degrees and clear in {city}"


@pytest.fixture(autouse=True)
def agents_sdk(served: Served) -> Iterator[None]:
    # offline: no trace export to OpenAI; the daemon is the default client
    set_tracing_disabled(True)
    set_default_openai_client(AsyncOpenAI(base_url=served.v1, api_key="unused", max_retries=0, timeout=60),
                              use_for_tracing=False)
    CALLS.clear()
    yield
    set_default_openai_api("responses")


def agent() -> Agent:
    # the first turn must call the tool (a small model would not always choose to); the SDK resets
    # tool_choice after a tool ran (reset_tool_choice), so the next turn answers in text. Room enough
    # for that answer: on the Responses API a reply cut by max_tokens is "incomplete", which the SDK raises
    return Agent(name="weather", instructions="Answer with the weather tool's result.", model=SMOL,
                 tools=[get_weather],
                 model_settings=ModelSettings(tool_choice="get_weather", temperature=0, max_tokens=96))


@pytest.mark.parametrize("api", ["responses", "chat_completions"])
async def test_agent_calls_its_tool_then_answers(served: Served, api: str) -> None:
    set_default_openai_api(api)
    # the SDK runs on asyncio: a thread of its own, as a trio program would call it
    result = await trio.to_thread.run_sync(lambda: Runner.run_sync(agent(), "What is the weather in Paris?",
                                                                   max_turns=4))
    assert len(CALLS) == 1 and CALLS[0]
    kinds = [type(item) for item in result.new_items]
    assert ToolCallItem in kinds and ToolCallOutputItem in kinds
    assert isinstance(result.final_output, str) and result.final_output.strip()
