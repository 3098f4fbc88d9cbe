"""Pre-encoded SSE chunks (proto/_sse_template.py) are byte for byte what
``encode_sse_json`` makes of the same object, whatever the text holds."""

from __future__ import annotations

import json

import httpx
from hypothesis import given
from hypothesis import strategies as st

from superfluid.proto import encode_sse_json
from superfluid.proto._sse_template import MARKER, SseTemplate

from .conftest import Daemon

TEXTS = ["", "plain", 'quote " and \\ backslash', "line\nbreak\r\nand\ttab", "\x00\x01\x1f control",
         "naïve café ünïcödé", "日本語のテキスト", "emoji 🎉👍🏽", "\u2028\u2029 separators", "</script>&<>'",
         "\ufffd replacement", "data: [DONE]\n\n", "x" * 5000]


def completion(text: str, model: str = "mock") -> dict:
    return {"id": "cmpl-superfluid-1", "object": "text_completion", "created": 1764547200, "model": model,
            "system_fingerprint": "superfluid",
            "choices": [{"index": 0, "text": text, "finish_reason": None, "logprobs": None}]}


def chat(text: str, model: str = "mock") -> dict:
    return {"id": "chatcmpl-superfluid-1", "object": "chat.completion.chunk", "created": 1764547200, "model": model,
            "system_fingerprint": "superfluid",
            "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None, "logprobs": None}]}


def test_a_filled_template_is_the_json_encoding_byte_for_byte() -> None:
    for build in (completion, chat):
        for model in ("mock", "módel \"quoted\" 模型", "a\\b"):
            template = SseTemplate(build(MARKER, model))
            for text in TEXTS:
                assert template.fill(text) == encode_sse_json(build(text, model)), (build.__name__, model, text)


@given(st.text())
def test_any_text_fills_exactly(text: str) -> None:
    assert SseTemplate(chat(MARKER)).fill(text) == encode_sse_json(chat(text))


def test_a_marker_in_a_fixed_field_is_refused() -> None:
    import pytest

    with pytest.raises(ValueError):
        SseTemplate(chat(MARKER, model=MARKER))


async def test_streamed_openai_chunks_are_the_canonical_encoding(daemon: Daemon) -> None:
    """Each streamed chat and completion event is exactly ``encode_sse_json`` of its
    own parsed object: templates change no byte (key order, spacing, escaping)."""
    bodies = [("/v1/chat/completions", {"model": "mock", "messages": [{"role": "user", "content": "hé \"you\""}]}),
              ("/v1/completions", {"model": "mock", "prompt": "tell me\n a story"})]
    for path, body in bodies:
        raw = b""
        async with daemon.client.stream("POST", path, json={**body, "max_tokens": 24, "ignore_eos": True,
                                                             "stream": True}) as r:
            assert r.status_code == 200
            async for part in r.aiter_bytes():
                raw += part
        events = [e + b"\n\n" for e in raw.split(b"\n\n") if e]
        assert events[-1] == b"data: [DONE]\n\n"
        content = [e for e in events[:-1] if b'"finish_reason":null' in e]
        assert len(content) >= 2
        for event in events[:-1]:
            assert event == encode_sse_json(json.loads(event[len(b"data: "):])), event
    assert isinstance(r, httpx.Response)
