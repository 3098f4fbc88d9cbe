"""Right numbers (issue 47): a stop string ends the job in its lane at the token that
completes it, and every dialect's usage counts exactly the tokens up to that one;
a JSON document cut by ``max_tokens`` gets a legal ending; ``--spec-max-temperature``
caps only a default temperature."""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio

from superfluid.api._lane import Follower
from superfluid.api._params import sampling_from
from superfluid.api._sessions import follower_at
from superfluid.chat import document_schema
from superfluid.client import aiter_sse
from superfluid.proto import Admit, Sampling, SpecConfig, from_wire, to_wire
from superfluid.sched import Job, PlannerConfig
from superfluid.serving import ModelSource, ServeConfig
from superfluid.sessions._resumable import LiveSession
from superfluid.suite._client import metric_sum
from superfluid.worker._executor import Executor
from superfluid.worker._mock import WORD0, MockEngine

from .conftest import REAL_GGUF, Daemon, sse_events, start_daemon, stream_text

USER = [{"role": "user", "content": "tell me a story about the river"}]
REPEAT = 3


async def _metric(d: Daemon, name: str) -> float:
    return metric_sum((await d.client.get("/metrics")).text, name) or 0.0


async def _lanes_active(d: Daemon) -> float:
    return await _metric(d, "superfluid_lanes_active")


def _cut_at(pieces: list[str], stop: str) -> tuple[str, int]:
    """The text returned with ``stop`` and the tokens it counts: up to the one completing the stop."""
    text = ""
    for i, piece in enumerate(pieces):
        text += piece
        if stop in text:
            return text[: text.index(stop)], i + 1
    raise AssertionError(f"{stop!r} is not in the reply")


async def _reference(d: Daemon, **kw: Any) -> list[str]:
    """The unstopped greedy reply's tokens (as text), from its logprobs."""
    body = {"model": "mock", "messages": USER, "temperature": 0, "max_tokens": 40, "logprobs": True, **kw}
    r = (await d.client.post("/v1/chat/completions", json=body)).json()
    return [row["token"] for row in r["choices"][0]["logprobs"]["content"]]


def _stop_of(pieces: list[str]) -> str:
    """A stop string that the reply completes several tokens in (not its first word)."""
    return pieces[6].strip() or pieces[7].strip()


async def test_a_stop_ends_the_lane_and_every_dialect_counts_the_same_tokens(daemon: Daemon) -> None:
    pieces = await _reference(daemon)
    stop = _stop_of(pieces)
    want_text, want_n = _cut_at(pieces, stop)
    c = daemon.client
    chat = {"model": "mock", "messages": USER, "temperature": 0, "max_tokens": 40, "stop": [stop]}

    async def openai_whole() -> tuple[str, int]:
        r = (await c.post("/v1/chat/completions", json=chat)).json()
        assert r["choices"][0]["finish_reason"] == "stop"
        return r["choices"][0]["message"]["content"], r["usage"]["completion_tokens"]

    async def openai_stream() -> tuple[str, int]:
        async with c.stream("POST", "/v1/chat/completions",
                            json={**chat, "stream": True, "stream_options": {"include_usage": True}}) as r:
            events = await sse_events(r)
        assert events[-1]["choices"][0]["finish_reason"] == "stop"
        return stream_text(events), events[-1]["usage"]["completion_tokens"]

    anthropic = {"model": "mock", "messages": USER, "temperature": 0, "max_tokens": 40, "stop_sequences": [stop]}

    async def anthropic_whole() -> tuple[str, int]:
        r = (await c.post("/v1/messages", json=anthropic)).json()
        assert (r["stop_reason"], r["stop_sequence"]) == ("stop_sequence", stop)
        return r["content"][0]["text"], r["usage"]["output_tokens"]

    async def anthropic_stream() -> tuple[str, int]:
        async with c.stream("POST", "/v1/messages", json={**anthropic, "stream": True}) as r:
            events = [e.json() async for e in aiter_sse(r.aiter_bytes()) if e.data]
        text = "".join(e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta")
        [end] = [e for e in events if e["type"] == "message_delta"]
        return text, end["usage"]["output_tokens"]

    ollama = {"model": "mock", "messages": USER, "options": {"temperature": 0, "num_predict": 40, "stop": [stop]}}

    async def ollama_whole() -> tuple[str, int]:
        r = (await c.post("/api/chat", json={**ollama, "stream": False})).json()
        assert r["done_reason"] == "stop"
        return r["message"]["content"], r["eval_count"]

    async def ollama_stream() -> tuple[str, int]:
        async with c.stream("POST", "/api/chat", json={**ollama, "stream": True}) as r:
            lines = [json.loads(line) async for line in r.aiter_lines() if line.strip()]
        assert lines[-1]["done"]
        return "".join(x["message"]["content"] for x in lines), lines[-1]["eval_count"]

    for ask in (openai_whole, openai_stream, anthropic_whole, anthropic_stream, ollama_whole, ollama_stream):
        for _ in range(REPEAT):
            assert await ask() == (want_text, want_n), ask.__name__
            # the job ended in its lane at the stop: nothing holds a lane once the reply is out
            assert await _lanes_active(daemon) == 0, ask.__name__


async def test_a_seeded_stop_counts_the_same_on_completions_stream_or_not(daemon: Daemon) -> None:
    """Sampled with a seed on ``/v1/completions``: the same text and usage every time,
    the tokens up to the one completing the stop."""
    base = {"model": "mock", "prompt": "once upon a time", "max_tokens": 200, "temperature": 0.9, "seed": 11,
            "ignore_eos": True}
    ref = (await daemon.client.post("/v1/completions", json={**base, "logprobs": 0})).json()["choices"][0]
    pieces = ref["logprobs"]["tokens"]
    stop = _stop_of(pieces)
    want_text, want_n = _cut_at(pieces, stop)
    for _ in range(REPEAT):
        decoded = await _metric(daemon, "superfluid_decode_tokens_total")
        r = (await daemon.client.post("/v1/completions", json={**base, "stop": stop})).json()
        assert (r["choices"][0]["text"], r["usage"]["completion_tokens"]) == (want_text, want_n)
        assert r["choices"][0]["finish_reason"] == "stop"
        assert await _lanes_active(daemon) == 0
        # the engine stopped at the stop: it decoded no token past it (the first came from the prefill)
        await trio.sleep(0.1)   # (its tick's report may follow the reply)
        assert await _metric(daemon, "superfluid_decode_tokens_total") - decoded <= want_n
        async with daemon.client.stream("POST", "/v1/completions", json={
                **base, "stop": stop, "stream": True, "stream_options": {"include_usage": True}}) as s:
            events = await sse_events(s)
        assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == want_text
        assert events[-1]["usage"]["completion_tokens"] == want_n
        assert await _lanes_active(daemon) == 0


@pytest.mark.real
async def test_a_stop_counts_the_same_tokens_on_smollm2(nursery: trio.Nursery) -> None:
    """llama.cpp's tokenizer: a stop inside a word, stream or not, counts the tokens up to the one
    completing it, every time."""
    d = await start_daemon(nursery, _smol())
    try:
        chat = {"model": "smol", "messages": [{"role": "user", "content": "Describe a river in three sentences."}],
                "temperature": 0, "max_tokens": 12}
        ref = (await d.client.post("/v1/chat/completions", json={**chat, "logprobs": True})).json()
        pieces = [row["token"] for row in ref["choices"][0]["logprobs"]["content"]]
        word = next(p.strip() for p in pieces[2:] if len(p.strip()) >= 4 and p.strip().isalpha())
        stop = word[1:3]   # ends inside a token: the token completing it counts, its text is cut
        want_text, want_n = _cut_at(pieces, stop)
        for _ in range(2):
            r = (await d.client.post("/v1/chat/completions", json={**chat, "stop": stop})).json()
            assert (r["choices"][0]["message"]["content"], r["usage"]["completion_tokens"]) == (want_text, want_n)
            async with d.client.stream("POST", "/v1/chat/completions", json={
                    **chat, "stop": stop, "stream": True, "stream_options": {"include_usage": True}}) as s:
                events = await sse_events(s)
            assert (stream_text(events), events[-1]["usage"]["completion_tokens"]) == (want_text, want_n)
            assert await _lanes_active(d) == 0
    finally:
        await d.client.aclose()
        d.scope.cancel()


def _smol(max_batch: int = 2) -> ServeConfig:
    return ServeConfig(models=(ModelSource(spec=str(REAL_GGUF), runtime="llamacpp", name="smol"),), port=0,
                       max_batch=max_batch, max_context=1024, planner=PlannerConfig(max_batch=max_batch),
                       hang_timeout_s=120.0)


# --- a JSON document cut by max_tokens ---------------------------------------------------------

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {
    "type": "string"}}, "age": {"type": "integer"}}, "required": ["name", "tags", "age"]}


def _cut_job(grammar: str, pieces: list[bytes]) -> Job:
    job = Job(prompt=[1], sampling=Sampling(grammar=grammar), max_new=len(pieces))
    job.tokens = list(range(len(pieces)))
    job.pieces = list(pieces)
    return job


async def _read(follower: Follower) -> tuple[list[str], str | None]:
    deltas = []
    while True:
        text, _rows, done = await follower.next_delta()
        deltas.append(text)
        if done:
            return deltas, follower.finish


@pytest.mark.parametrize(("grammar", "pieces", "closing"), [
    ("json", [b'{"name": "Ma', b'ra", "tags": ["a', b'b'], '"]}'),
    ("json", [b'{"a": {"b": [1, 2.'], "0]}}"),
    ("json", [b"\n"], "{}"),
    ("json_schema:" + json.dumps(PERSON), [b'{"name": "Ma', b'ra", "tags": ["a'], '"],"age":0}'),
])
async def test_a_document_cut_by_max_tokens_gets_a_legal_ending_in_its_last_delta(
        grammar: str, pieces: list[bytes], closing: str) -> None:
    job = _cut_job(grammar, pieces[:1])
    follower = Follower(job, [], document=document_schema(grammar))
    first, _rows, done = await follower.next_delta()
    assert (first, done) == (pieces[0].decode(), False)
    job.tokens.append(len(pieces))
    job.pieces += pieces[1:]
    job.finish_with("length")
    deltas, finish = await _read(follower)
    assert finish == "length"
    assert deltas == ["".join(p.decode() for p in pieces[1:]) + closing]   # the closing ends the last delta
    doc = json.loads(first + deltas[-1])
    if grammar != "json":
        assert set(PERSON["required"]) <= set(doc)


async def test_a_resumed_stream_closes_a_cut_document_too() -> None:
    """A resumable session's follower (``x-superfluid-resumable``, resumed from a cursor) streams
    text and closes a cut ``response_format`` document the same way."""
    job = _cut_job("json", [b'{"a": ["x', b'", "y'])
    job.finish_with("length")
    session = LiveSession(id="s-1", job=job, model="m", kind="chat", stops=[], resumable=True)
    assert (await _read(follower_at(session, 1)))[0] == ['", "y"]}']


async def test_a_document_ended_otherwise_or_free_text_is_left_as_it_is() -> None:
    stopped = _cut_job("json", [b'{"a": 1, "b": "x'])
    stopped.finish_with("stop")       # a stop string cut it: the client asked for that text
    assert (await _read(Follower(stopped, [], document=document_schema("json"))))[0] == ['{"a": 1, "b": "x']
    text = _cut_job("", [b'{"a": "x'])
    text.finish_with("length")
    assert document_schema("") is None and document_schema('root ::= "a"') is None
    assert (await _read(Follower(text, [])))[0] == ['{"a": "x']


@pytest.mark.real
async def test_a_json_reply_cut_by_max_tokens_parses_on_smollm2(nursery: trio.Nursery) -> None:
    """``json_object`` and ``json_schema`` cut short on llama.cpp: the reply parses, with
    ``finish_reason: length``, whole and streamed (Ollama ``format`` too)."""
    d = await start_daemon(nursery, _smol())
    try:
        ask = {"model": "smol", "messages": [{"role": "user", "content": "Describe a person as JSON."}],
               "temperature": 0, "max_tokens": 8}
        for fmt in ({"type": "json_object"},
                    {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}):
            r = (await d.client.post("/v1/chat/completions", json={**ask, "response_format": fmt})).json()
            assert r["choices"][0]["finish_reason"] == "length"
            whole = r["choices"][0]["message"]["content"]
            assert isinstance(json.loads(whole), dict), whole
            async with d.client.stream("POST", "/v1/chat/completions",
                                       json={**ask, "response_format": fmt, "stream": True}) as s:
                events = await sse_events(s)
            assert stream_text(events) == whole
            assert events[-1]["choices"][0]["finish_reason"] == "length"
        r = (await d.client.post("/api/chat", json={"model": "smol", "messages": ask["messages"], "stream": False,
                                                    "format": "json", "options": {"temperature": 0,
                                                                                  "num_predict": 8}})).json()
        assert r["done_reason"] == "length"
        assert isinstance(json.loads(r["message"]["content"]), dict)
    finally:
        await d.client.aclose()
        d.scope.cancel()


# --- --spec-max-temperature caps only a default temperature ------------------------------------

def test_a_request_that_names_no_temperature_is_marked_default() -> None:
    assert sampling_from({}, n_vocab=100).temperature_default
    assert sampling_from({"temperature": None}, n_vocab=100).temperature_default
    for asked in (1.0, 0, 1.7):
        s = sampling_from({"temperature": asked}, n_vocab=100)
        assert (s.temperature, s.temperature_default) == (asked, False)
    # on the wire only when true: a worker that predates the field reads every other Sampling as before
    assert "temperature_default" not in Sampling(temperature=1.0).to_dict()
    admit = Admit(lane=1, tokens=[1, 2], n_prompt=2, max_new=4, sampling=sampling_from({}, n_vocab=100))
    assert from_wire(to_wire(admit), max_len=1 << 20) == admit


def test_spec_max_temperature_caps_a_default_temperature_never_a_requested_one() -> None:
    mock = "mock?step_ms=0&prefill_us=0&n_ctx=2048&copy=0.8"
    doc = [WORD0 + i % 20 for i in range(40)]
    capped = Executor(MockEngine(mock, n_seq=4), max_lanes=4, speculate=SpecConfig(max_temperature=0.5))
    plain = Executor(MockEngine(mock, n_seq=4), max_lanes=4)
    asks = [Sampling(temperature=1.0, temperature_default=True),   # the default: capped, so it drafts
            Sampling(temperature=1.0),                             # asked for: kept, and too hot to draft
            Sampling(temperature=0.3)]                             # asked for, cooler than the cap: drafts
    for i, s in enumerate(asks):
        capped.admit(Admit(lane=i, tokens=doc, n_prompt=len(doc), max_new=4, sampling=s))
        plain.admit(Admit(lane=i, tokens=doc, n_prompt=len(doc), max_new=4, sampling=s))
    assert [ln.sampling.temperature for ln in capped.lanes.values()] == [0.5, 1.0, 0.3]
    assert [ln.spec is not None for ln in capped.lanes.values()] == [True, False, True]
    # the cap is a speculation setting: a worker that does not speculate samples what it was sent
    assert [ln.sampling.temperature for ln in plain.lanes.values()] == [1.0, 1.0, 0.3]
