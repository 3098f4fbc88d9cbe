"""OpenAI ``n``: several choices of one request on ``/v1/chat/completions`` and
``/v1/completions``, streamed and whole, on the mock runtime (issue 47).

Each choice is its own job, seeded from the request's seed (choice 0 keeps it),
queued once the first choice has prefilled the prompt, so the prompt is
prefilled once; usage counts the prompt once and sums the completions.
"""

from __future__ import annotations

from typing import Any

import trio

from superfluid.api._chat import MAX_CHOICES, choice_seed
from superfluid.suite._client import metric_sum

from .conftest import Daemon, mock_config, open_daemon, sse_events

# a prompt of about 3,000 tokens: choices queued beside the first (not after its prefill) each
# prefilled most of it again (measured: 8,039 tokens prefilled for n=3, against 3,021)
LONG = " ".join(["the river runs before the mountain and the cloud keeps the signal"] * 250)
CHAT = {"model": "mock", "messages": [{"role": "user", "content": LONG}], "temperature": 1.0, "seed": 7,
        "max_tokens": 12, "ignore_eos": True}
COMPLETION = {"model": "mock", "prompt": LONG, "temperature": 1.0, "seed": 7, "max_tokens": 12, "ignore_eos": True}


async def metric(d: Daemon, name: str, **labels: str) -> float:
    return metric_sum((await d.client.get("/metrics")).text, name, **labels) or 0.0


def _by_index(events: list[dict[str, Any]], key: str) -> dict[int, str]:
    out: dict[int, str] = {}
    for e in events:
        for c in e.get("choices") or ():
            piece = c["delta"].get("content") if key == "delta" else c.get("text")
            out[c["index"]] = out.get(c["index"], "") + (piece or "")
    return out


def test_choice_seeds_are_derived_and_choice_zero_keeps_the_request_seed() -> None:
    assert choice_seed(7, 0) == 7
    seeds = {choice_seed(7, i) for i in range(MAX_CHOICES)}
    assert len(seeds) == MAX_CHOICES and choice_seed(7, 3) == choice_seed(7, 3) != choice_seed(8, 3)


async def test_chat_n_choices_whole_and_streamed() -> None:
    # interactive: no shared-prefix hold (SPEC.md §4) would share the prompt otherwise
    async with open_daemon(mock_config("mock?step_ms=1&prefill_us=100&n_ctx=8192")) as d:
        c = d.client
        prefilled = await metric(d, "superfluid_prefill_tokens_total")
        r = await c.post("/v1/chat/completions", json={**CHAT, "n": 3}, headers={"x-superfluid-qos": "interactive"})
        assert r.status_code == 200, r.text
        body = r.json()
        assert [ch["index"] for ch in body["choices"]] == [0, 1, 2]
        texts = [ch["message"]["content"] for ch in body["choices"]]
        assert len(set(texts)) == 3, texts          # sampled independently
        assert all(ch["finish_reason"] == "length" for ch in body["choices"])
        usage = body["usage"]
        prompt = usage["prompt_tokens"]
        assert prompt > 3000
        assert usage["completion_tokens"] == 3 * 12 and usage["total_tokens"] == prompt + 36
        # the prompt was prefilled once for the three choices (the siblings were seeded from the first's KV)
        assert await metric(d, "superfluid_prefill_tokens_total") - prefilled < 1.5 * prompt

        # reproducible: the same seeded request draws the same choices; choice 0 is what n=1 draws
        again = (await c.post("/v1/chat/completions", json={**CHAT, "n": 3})).json()
        assert [ch["message"]["content"] for ch in again["choices"]] == texts
        one = (await c.post("/v1/chat/completions", json=CHAT)).json()
        assert one["choices"][0]["message"]["content"] == texts[0]

        async with c.stream("POST", "/v1/chat/completions",
                            json={**CHAT, "n": 3, "stream": True, "stream_options": {"include_usage": True}}) as s:
            events = await sse_events(s)
        assert _by_index(events, "delta") == dict(enumerate(texts))
        finishes = [(ch["index"], ch["finish_reason"]) for e in events for ch in e["choices"] if ch["finish_reason"]]
        assert sorted(finishes) == [(0, "length"), (1, "length"), (2, "length")]
        assert events[-1]["usage"]["completion_tokens"] == 36
        assert events[-1]["usage"]["prompt_tokens"] == prompt


async def test_completions_n_choices_whole_and_streamed() -> None:
    async with open_daemon(mock_config("mock?step_ms=1&prefill_us=5&n_ctx=8192")) as d:
        c = d.client
        r = await c.post("/v1/completions", json={**COMPLETION, "n": 2, "logprobs": 1})
        assert r.status_code == 200, r.text
        body = r.json()
        assert [ch["index"] for ch in body["choices"]] == [0, 1]
        texts = [ch["text"] for ch in body["choices"]]
        assert texts[0] != texts[1]
        assert all(len(ch["logprobs"]["tokens"]) == 12 for ch in body["choices"])
        assert body["usage"]["completion_tokens"] == 24
        async with c.stream("POST", "/v1/completions",
                            json={**COMPLETION, "n": 2, "stream": True,
                                  "stream_options": {"include_usage": True}}) as s:
            events = await sse_events(s)
        assert _by_index(events, "text") == dict(enumerate(texts))
        assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 24


async def test_n_is_bounded_and_typed() -> None:
    async with open_daemon(mock_config("mock?step_ms=1&prefill_us=5&n_ctx=8192")) as d:
        for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)):
            for n in (0, MAX_CHOICES + 1, "2", 1.5):
                r = await d.client.post(path, json={**body, "n": n})
                assert r.status_code == 400, (path, n, r.text)
                assert r.json()["error"]["param"] == "n"
        r = await d.client.post("/v1/chat/completions", json={**CHAT, "n": 2, "stream": True},
                                headers={"x-superfluid-resumable": "true"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_parameter"


async def test_a_disconnect_cancels_every_choice() -> None:
    # 50 ms a token: 3,000 tokens take 150 s, so only a cancel frees the lanes in time
    async with open_daemon(mock_config("mock?step_ms=50&prefill_us=5")) as d:
        slow = {**CHAT, "messages": [{"role": "user", "content": "a story"}], "max_tokens": 3000, "n": 3,
                "stream": True}
        async with d.client.stream("POST", "/v1/chat/completions", json=slow) as r:
            async for _line in r.aiter_lines():
                break
            with trio.fail_after(10):
                while await metric(d, "superfluid_lanes_active") != 3:
                    await trio.sleep(0.02)
        with trio.fail_after(10):
            while await metric(d, "superfluid_lanes_active") != 0:
                await trio.sleep(0.02)
        assert await metric(d, "superfluid_requests_total", outcome="cancelled") == 3


async def test_a_first_choice_refused_starts_no_other() -> None:
    async with open_daemon(mock_config()) as d:
        for stream in (False, True):
            r = await d.client.post("/v1/chat/completions", json={
                "model": "mock", "n": 3, "stream": stream,
                "messages": [{"role": "user", "content": "[[mock:fault_after=0]] hi"}]})
            assert r.status_code == 500 and "mock fault" in r.json()["error"]["message"]
        assert await metric(d, "superfluid_requests_total") == 2   # one job a request


def _openai_sdk(url: str) -> None:
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "tell me a story"}]
    reply = client.chat.completions.create(model="mock", messages=messages, n=3, seed=1, max_tokens=8)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert all(c.message.content for c in reply.choices)
    texts: dict[int, str] = {}
    for chunk in client.chat.completions.create(model="mock", messages=messages, n=3, seed=1, max_tokens=8,
                                                stream=True):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
    assert texts == {c.index: c.message.content for c in reply.choices}
    done = client.completions.create(model="mock", prompt="once upon", n=2, seed=1, max_tokens=8)
    assert [c.index for c in done.choices] == [0, 1]


async def test_the_openai_sdk_asks_for_n_choices() -> None:
    async with open_daemon(mock_config()) as d:
        await trio.to_thread.run_sync(_openai_sdk, d.url)
