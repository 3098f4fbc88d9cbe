"""Embeddings (issue #19): ``/v1/embeddings`` through the official ``openai`` client, Ollama
``/api/embed`` and ``/api/embeddings`` through the official ``ollama`` client, bad inputs typed
400. On the mock runtime (deterministic vectors) and on SmolLM2 (a real embedding context)."""

from __future__ import annotations

import base64
import math
import struct
from typing import Any

import httpx
import pytest
import trio

from superfluid.serving import ModelSource, ServeConfig
from superfluid.sched import PlannerConfig

from .conftest import REAL_GGUF, Daemon, mock_config, start_daemon

TEXTS = ["The cat sat on the mat.", "Quarterly revenue grew by four percent."]


def cosine(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True)) / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


def _openai_checks(url: str, model: str) -> int:
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    # the client asks for base64 by default and decodes it; float is asked for explicitly
    got = client.embeddings.create(model=model, input=[TEXTS[0], TEXTS[1], TEXTS[0]])
    floats = client.embeddings.create(model=model, input=[TEXTS[0], TEXTS[1], TEXTS[0]], encoding_format="float")
    vectors = [d.embedding for d in got.data]
    dim = len(vectors[0])
    assert [d.index for d in got.data] == [0, 1, 2] and all(len(v) == dim for v in vectors)
    assert got.model == model and got.usage.prompt_tokens == got.usage.total_tokens > 3
    for v in vectors:
        assert abs(math.sqrt(sum(x * x for x in v)) - 1) < 1e-4  # unit length, as OpenAI's
    assert cosine(vectors[0], vectors[2]) > 0.9999           # a text with itself
    assert cosine(vectors[0], vectors[1]) < 0.99              # two different texts
    # one text twice in a batch: equal up to float32 rounding (its place in the batch changes the
    # kernels' summation order), and the same request twice is the same to the bit
    assert max(abs(x - y) for x, y in zip(vectors[0], vectors[2], strict=True)) < 1e-5
    assert [d.embedding for d in floats.data] == vectors      # base64 decodes to the same floats
    alone = client.embeddings.create(model=model, input=TEXTS[1], encoding_format="float").data[0].embedding
    assert max(abs(x - y) for x, y in zip(alone, vectors[1], strict=True)) < 1e-5  # batched = alone
    # token arrays: the same ids give the same vector as the text
    raw = httpx.post(url + "/v1/embeddings", json={"model": model, "input": TEXTS[0], "encoding_format": "base64"},
                     timeout=120)
    blob = base64.b64decode(raw.json()["data"][0]["embedding"])
    first = client.embeddings.create(model=model, input=TEXTS[0], encoding_format="float").data[0].embedding
    assert list(struct.unpack(f"<{dim}f", blob)) == first
    ids = httpx.post(url + "/v1/tokenize", json={"model": model, "text": TEXTS[0]}, timeout=120).json()["tokens"]
    by_ids = httpx.post(url + "/v1/embeddings", json={"model": model, "input": [ids]}, timeout=120).json()
    assert len(by_ids["data"][0]["embedding"]) == dim
    same = client.embeddings.create(model=model, input=[ids], dimensions=dim, encoding_format="float")
    assert len(same.data[0].embedding) == dim
    return dim


BAD = [
    ({}, "input"), ({"input": ""}, "input"), ({"input": []}, "input"), ({"input": [""]}, "input"),
    ({"input": [[]]}, "input"), ({"input": [1, "a"]}, "input"), ({"input": [[-1]]}, "input"),
    ({"input": {"text": "x"}}, "input"), ({"input": ["x"] * 2049}, "input"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "x", "dimensions": 0}, "dimensions"), ({"input": "x", "dimensions": "64"}, "dimensions"),
    ({"input": "x", "dimensions": 7}, "dimensions"), ({"input": [[10**9]]}, "input"),
]


async def _bad_inputs(d: Daemon, model: str) -> None:
    for extra, param in BAD:
        r = await d.client.post("/v1/embeddings", json={"model": model, **extra})
        assert r.status_code == 400, (extra, r.text)
        assert r.json()["error"]["param"] == param and r.json()["error"]["type"] == "invalid_request_error", extra
    r = await d.client.post("/v1/embeddings", json={"model": "nope", "input": "x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    for path, body in (("/api/embed", {"input": [""]}), ("/api/embed", {"input": 3}),
                       ("/api/embed", {"input": "x", "truncate": "no"}), ("/api/embeddings", {"prompt": 3}),
                       ("/api/embed", {"input": "x", "keep_alive": "soon"})):
        r = await d.client.post(path, json={"model": model, **body})
        assert r.status_code == 400 and set(r.json()) == {"error"}, (path, body, r.text)


def _ollama_checks(url: str, model: str, dim: int) -> None:
    import ollama

    client = ollama.Client(host=url, timeout=120)
    got = client.embed(model, TEXTS)
    assert len(got.embeddings) == 2 and all(len(v) == dim for v in got.embeddings)
    assert got.prompt_eval_count > 3
    single = client.embed(model + ":latest", TEXTS[0]).embeddings
    assert len(single) == 1 and max(abs(a - b) for a, b in zip(single[0], got.embeddings[0], strict=True)) < 1e-5
    legacy = client.embeddings(model, TEXTS[0]).embedding  # not normalized, the same direction
    assert len(legacy) == dim and cosine(legacy, got.embeddings[0]) > 0.9999
    assert client.embed(model, []).embeddings == []  # loads the model, embeds nothing


async def test_embeddings_on_the_mock(nursery: trio.Nursery) -> None:
    d = await start_daemon(nursery, mock_config())
    dim = await trio.to_thread.run_sync(_openai_checks, d.url, "mock")
    assert dim == 64
    await trio.to_thread.run_sync(_ollama_checks, d.url, "mock", dim)
    await _bad_inputs(d, "mock")
    # longer than the window (the mock's 4096 tokens): refused, or cut with Ollama's truncate
    long = " ".join(["word"] * 5000)
    r = await d.client.post("/v1/embeddings", json={"model": "mock", "input": long})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_input" and "window" in r.text
    r = await d.client.post("/api/embed", json={"model": "mock", "input": long})
    assert r.status_code == 200 and len(r.json()["embeddings"][0]) == dim
    r = await d.client.post("/api/embed", json={"model": "mock", "input": long, "truncate": False})
    assert r.status_code == 400 and "window" in r.json()["error"]
    d.scope.cancel()


@pytest.mark.real
async def test_embeddings_on_smollm2(nursery: trio.Nursery) -> None:
    config = ServeConfig(models=(ModelSource(spec=str(REAL_GGUF), runtime="llamacpp", name="smol"),), port=0,
                         max_batch=2, max_context=512, planner=PlannerConfig(max_batch=2), hang_timeout_s=120.0)
    d = await start_daemon(nursery, config)
    dim = await trio.to_thread.run_sync(_openai_checks, d.url, "smol")
    assert dim == 576
    await trio.to_thread.run_sync(_ollama_checks, d.url, "smol", dim)
    r = await d.client.post("/v1/embeddings", json={"model": "smol", "input": " ".join(["word"] * 600)})
    assert r.status_code == 400 and "window is 512" in r.json()["error"]["message"]
    # /api/ps: the weights (the file) and the KV cache of 4 sequences of 512 cells, none of it on a GPU
    (ps,) = (await d.client.get("/api/ps")).json()["models"]
    assert ps["size"] == REAL_GGUF.stat().st_size + 4 * 512 * 30 * 2 * 192 * 2 and ps["size_vram"] == 0
    # chat still works beside the embedding context
    r = await d.client.post("/v1/chat/completions", json={"model": "smol", "max_tokens": 3, "temperature": 0,
                                                          "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200
    d.scope.cancel()


def test_cosine_helper() -> None:
    v: list[Any] = [1.0, 0.0]
    assert cosine(v, v) == 1.0 and cosine(v, [0.0, 1.0]) == 0.0
