"""LangChain's ``ChatOpenAI`` (``langchain-openai``) on the daemon's base URL: a tool-calling agent
loop as LangChain's docs write it (the model calls a tool, the tool's ToolMessage goes back, the
model answers), and a plain stream."""

from __future__ import annotations

import os

import pytest

os.environ["LANGCHAIN_TRACING_V2"] = "false"  # no LangSmith trace export (offline)
os.environ["LANGSMITH_TRACING"] = "false"

from langchain_core.messages import AIMessage, HumanMessage, ToolMessage  # noqa: E402
from langchain_core.tools import tool  # noqa: E402
from langchain_openai import ChatOpenAI  # noqa: E402

from .conftest import MOCK, SMOL, Served  # noqa: E402

CALLS: list[str] = []


@tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    CALLS.append(city)
    return f"21 degrees and clear in {city}"


def chat(served: Served, model: str, **kw: object) -> ChatOpenAI:
    return ChatOpenAI(model=model, base_url=served.v1, api_key="unused", temperature=0, max_retries=0,
                      timeout=60, **kw)


def test_invoke_and_stream(served: Served) -> None:
    llm = chat(served, MOCK, max_tokens=12)
    whole = llm.invoke("a story")
    assert isinstance(whole, AIMessage) and whole.content
    assert whole.usage_metadata and whole.usage_metadata["output_tokens"] > 0
    assert "".join(chunk.content for chunk in llm.stream("a story")) == whole.content


@pytest.mark.real
def test_tool_calling_agent_loop(served: Served) -> None:
    CALLS.clear()
    llm = chat(served, SMOL, max_tokens=64)
    tools = {"get_weather": get_weather}
    # first step forced, as an agent that must look something up does (a small model would not
    # always choose the tool on its own); then the loop runs until the model answers in text
    step = llm.bind_tools([get_weather], tool_choice="get_weather")
    messages: list = [HumanMessage("What is the weather in Paris?")]
    for _turn in range(3):
        ai = step.invoke(messages)
        messages.append(ai)
        if not ai.tool_calls:
            break
        for call in ai.tool_calls:
            result = tools[call["name"]].invoke(call)  # a ToolMessage carrying the call's id
            assert isinstance(result, ToolMessage) and result.tool_call_id == call["id"]
            messages.append(result)
        step = llm.bind_tools([get_weather], tool_choice="none")
    assert len(CALLS) == 1 and CALLS[0]
    assert isinstance(messages[-1], AIMessage) and not messages[-1].tool_calls and messages[-1].content
