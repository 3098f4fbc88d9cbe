"""Fill-in-the-middle: llama-server's ``/infill``, OpenAI ``suffix``, Ollama ``suffix`` (api/_infill.py).

The mock runtime declares StarCoder-style markers (``fim=0`` declares none); the prompt's
layout is checked against the mock's own tokenizer, and a real model without markers
(SmolLM2-135M: its vocabulary has ``<repo_name>`` and ``<file_sep>`` but no FIM
prefix/suffix/middle) is refused typed.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import trio

from superfluid.api._http import ApiError
from superfluid.api._infill import fim_prompt, fim_tokens
from superfluid.sched import QosClass
from superfluid.worker._mock import FIM_IDS, MockEngine

from .conftest import REAL_GGUF, mock_config, open_daemon

ENGINE = MockEngine("mock", n_seq=4)


def tok(text: str) -> list[int]:
    return ENGINE.tokenize(text, add_special=False, parse_special=False)


class _Sched:
    config = SimpleNamespace(max_prompt_bytes=0)

    async def tokenize(self, segments: list[tuple[str, bool]], *, add_special: bool, klass: QosClass) -> list[int]:
        assert segments[0][1] is False and not add_special   # marker text in code stays text
        return tok(segments[0][0])


def fake_model(n_ctx: int = 4096, **info: Any) -> Any:
    base = {"n_vocab": 400, "special_tokens": {}, "extra": {"fim": dict(FIM_IDS)}}
    base.update(info)
    return SimpleNamespace(name="m", info=base, n_ctx=n_ctx, scheduler=_Sched())


PRE, SUF, MID, REP, SEP = (FIM_IDS[k] for k in ("pre", "suf", "mid", "rep", "sep"))


async def test_layout_psm_spm_and_repo_chunks() -> None:
    model = fake_model()
    ids, cut = await fim_prompt(model, prefix="def f(", suffix=")\n", prompt="x", max_new=16,
                                klass=QosClass.COMPLETION, extra=[("a.py", "import os")])
    head = [REP, *tok("myproject\n"), SEP, *tok("a.py\n"), *tok("import os"), SEP, *tok("filename\n")]
    assert ids == [*head, PRE, *tok("def f("), SUF, *tok(")\n"), MID, *tok("x")] and not cut
    ids, _ = await fim_prompt(model, prefix="a", suffix="b", spm=True, max_new=16, klass=QosClass.COMPLETION)
    assert ids == [REP, *tok("myproject\n"), SEP, *tok("filename\n"), SUF, *tok("b"), PRE, *tok("a"), MID]
    # without repo markers (CodeLlama-style): chunks are snippets; the model's BOS leads
    plain = fake_model(extra={"fim": {"pre": PRE, "suf": SUF, "mid": MID}}, add_bos=True, bos=1)
    ids, _ = await fim_prompt(plain, prefix="a", suffix="b", extra=[("x", "y")], max_new=16,
                              klass=QosClass.COMPLETION)
    assert ids == [1, *tok("\n\n--- snippet ---\n\n"), *tok("y"), PRE, *tok("a"), SUF, *tok("b"), MID]


async def test_marker_text_in_code_is_not_a_marker() -> None:
    ids, _ = await fim_prompt(fake_model(extra={"fim": {"pre": PRE, "suf": SUF, "mid": MID}}),
                              prefix="<fim_middle>", suffix="", max_new=8, klass=QosClass.COMPLETION)
    assert ids.count(MID) == 1 and ids[-1] == MID


async def test_long_inputs_are_cut_to_the_window() -> None:
    model = fake_model(n_ctx=64, extra={"fim": {"pre": PRE, "suf": SUF, "mid": MID}})
    prefix, suffix = "a" * 200, "b" * 200   # one mock token a byte
    ids, cut = await fim_prompt(model, prefix=prefix, suffix=suffix, max_new=16, klass=QosClass.COMPLETION)
    assert cut and len(ids) <= 64 - 16
    assert ids[0] == PRE and ids[1:ids.index(SUF)] == tok("a") * (ids.index(SUF) - 1)  # the prefix's end kept
    assert ids.index(SUF) - 1 > ids.index(MID) - ids.index(SUF) - 1                   # 3:1 for the prefix
    # a max_tokens beyond the window leaves the code half of it, not nothing
    ids, cut = await fim_prompt(model, prefix=prefix, suffix=suffix, max_new=10**7, klass=QosClass.COMPLETION)
    assert cut and len(ids) == 32 and ids.index(SUF) > 16


def test_spellings_from_special_tokens_and_refusal() -> None:
    # a runtime reporting only its special tokens (MLX): the Qwen spelling is found
    specials = {"<|fim_prefix|>": 10, "<|fim_suffix|>": 11, "<|fim_middle|>": 12, "<|repo_name|>": 13}
    fim = fim_tokens(fake_model(extra={}, special_tokens=specials))
    assert (fim.pre, fim.suf, fim.mid, fim.rep, fim.sep) == (10, 11, 12, 13, None)
    with pytest.raises(ApiError) as exc:
        fim_tokens(fake_model(extra={"fim": {}}, special_tokens={"<repo_name>": 3, "<file_sep>": 5}))
    assert exc.value.status == 400 and exc.value.code == "fim_unsupported"


async def _access(caplog: pytest.LogCaptureFixture, path: str) -> dict[str, Any]:
    """The last access line of ``path`` (written as the exchange ends, just after the client has its answer)."""
    with trio.move_on_after(5):
        while not (rows := [r.access for r in caplog.records if getattr(r, "access", {}).get("path") == path]):
            await trio.sleep(0.01)
    assert rows, f"no access line for {path}"
    return rows[-1]


async def test_infill_openai_and_ollama_suffix_on_mock(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="superfluid.access")
    expected = [REP, *tok("myproject\n"), SEP, *tok("a.py\n"), *tok("x = 1"), SEP, *tok("filename\n"),
                PRE, *tok("def add(a, b):\n    return"), SUF, *tok("\n\nprint(add(1, 2))\n"), MID]
    async with open_daemon(mock_config()) as d:
        models = (await d.client.get("/v1/models")).json()["data"]
        assert models[0]["capabilities"]["fim"] is True
        r = await d.client.post("/infill", json={
            "input_prefix": "def add(a, b):\n    return", "input_suffix": "\n\nprint(add(1, 2))\n",
            "input_extra": [{"filename": "a.py", "text": "x = 1"}], "n_predict": 8, "temperature": 0,
            "cache_prompt": True, "t_max_predict_ms": 500, "samplers": ["top_k"]})   # llama.vscode's extras
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["stop"] is True and isinstance(body["content"], str) and body["tokens_predicted"] <= 8
        assert body["tokens_evaluated"] == len(expected) and body["stop_type"] in ("eos", "limit")
        line = await _access(caplog, "/infill")
        assert line["qos"] == "completion" and line["prompt_tokens"] == len(expected)

        # streamed: llama-server's chunks, the last with stop: true, no [DONE]
        async with d.client.stream("POST", "/infill", json={"input_prefix": "a", "input_suffix": "b",
                                                           "n_predict": 6, "stream": True}) as resp:
            assert resp.status_code == 200
            frames = [json.loads(line[6:]) async for line in resp.aiter_lines() if line.startswith("data: ")]
        assert frames[-1]["stop"] is True and all(f["stop"] is False for f in frames[:-1])

        # OpenAI /v1/completions suffix: no longer ignored (the prompt is framed), completion class
        r = await d.client.post("/v1/completions", json={"model": "mock", "prompt": "def add(a, b):\n    return",
                                                         "suffix": "\n\nprint(add(1, 2))\n", "max_tokens": 5})
        assert r.status_code == 200, r.text
        fim_only = expected[expected.index(SEP, expected.index(SEP) + 1):]   # no extra chunk here
        assert r.json()["usage"]["prompt_tokens"] == len([REP, *tok("myproject\n")]) + len(fim_only)
        assert (await _access(caplog, "/v1/completions"))["qos"] == "completion"
        r = await d.client.post("/v1/completions", json={"model": "mock", "prompt": "a", "suffix": "b",
                                                         "fim_mode": "xyz"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_value"

        # Ollama /api/generate suffix: was a 400
        r = await d.client.post("/api/generate", json={"model": "mock", "prompt": "def f(", "suffix": ")",
                                                       "stream": False, "options": {"num_predict": 4}})
        assert r.status_code == 200, r.text
        assert r.json()["done"] is True and r.json()["prompt_eval_count"] > 0
        r = await d.client.post("/api/generate", json={"model": "mock", "prompt": "a", "suffix": "b",
                                                       "system": "x"})
        assert r.status_code == 400 and "error" in r.json()

        r = await d.client.post("/infill", json={"input_prefix": 3})
        assert r.status_code == 400 and r.json()["error"]["param"] == "input_prefix"
        r = await d.client.post("/infill", json={"input_prefix": "a", "input_extra": [{"text": 1}]})
        assert r.status_code == 400


async def test_model_without_fim_markers_is_refused_on_mock() -> None:
    config = mock_config("mock?step_ms=1&prefill_us=5&fim=0")
    async with open_daemon(config) as d:
        models = (await d.client.get("/v1/models")).json()["data"]
        assert models[0]["capabilities"]["fim"] == "the mock was started with fim=0"
        for path, body in (("/infill", {"input_prefix": "a", "input_suffix": "b"}),
                           ("/v1/completions", {"model": "mock", "prompt": "a", "suffix": "b"})):
            r = await d.client.post(path, json=body)
            assert r.status_code == 400 and r.json()["error"]["code"] == "fim_unsupported", r.text
        r = await d.client.post("/api/generate", json={"model": "mock", "prompt": "a", "suffix": "b"})
        assert r.status_code == 400 and "fill-in-the-middle" in r.json()["error"]
        # an empty suffix on such a model is a plain completion (clients send one at a file's end)
        r = await d.client.post("/v1/completions", json={"model": "mock", "prompt": "a", "suffix": "",
                                                         "max_tokens": 3})
        assert r.status_code == 200, r.text


@pytest.mark.real
async def test_smollm2_has_no_fim_markers_and_is_refused() -> None:
    from .test_real_daemon import real_config

    async with open_daemon(real_config(REAL_GGUF, "smol", max_batch=1)) as d:
        r = await d.client.post("/infill", json={"input_prefix": "def f(", "input_suffix": ")"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "fim_unsupported", r.text
        assert "fill-in-the-middle" in (await d.client.get("/v1/models")).json()["data"][0]["capabilities"]["fim"]
        r = await d.client.post("/api/generate", json={"model": "smol", "prompt": "a", "suffix": "b"})
        assert r.status_code == 400


# --- a raw GBNF ``grammar`` (llama-server's field) on chat, completions, /completion and /infill ------------------

YES_NO = 'root ::= "yes" | "no"'


async def test_grammar_field_is_checked_and_refused_on_the_mock() -> None:
    async with open_daemon(mock_config()) as d:
        c = d.client
        chat = {"model": "mock", "messages": [{"role": "user", "content": "hi"}]}
        for path, body in (("/v1/chat/completions", chat), ("/v1/completions", {"model": "mock", "prompt": "a"}),
                           ("/completion", {"prompt": "a"}), ("/infill", {"input_prefix": "a"})):
            r = await c.post(path, json={**body, "grammar": YES_NO})   # the mock has no grammar engine
            assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_parameter", (path, r.text)
            assert r.json()["error"]["param"] == "grammar"
            r = await c.post(path, json={**body, "grammar": 3})
            assert r.status_code == 400 and r.json()["error"]["param"] == "grammar", (path, r.text)
        r = await c.post("/v1/chat/completions", json={**chat, "grammar": YES_NO,
                                                       "response_format": {"type": "json_object"}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "grammar"
        r = await c.post("/v1/completions", json={"model": "mock", "prompt": "a", "grammar": "json"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "grammar"   # not GBNF: no "::="


@pytest.mark.real
async def test_grammar_constrains_smollm2_and_a_bad_one_is_a_400() -> None:
    from .test_real_daemon import real_config

    async with open_daemon(real_config(REAL_GGUF, "smol", max_batch=1)) as d:
        c = d.client
        r = await c.post("/v1/chat/completions", json={
            "model": "smol", "messages": [{"role": "user", "content": "Is the sky green?"}], "grammar": YES_NO,
            "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] in ("yes", "no")
        r = await c.post("/v1/completions", json={"model": "smol", "prompt": "Answer:", "grammar": YES_NO,
                                                  "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] in ("yes", "no"), r.text
        r = await c.post("/completion", json={"prompt": "Answer:", "grammar": YES_NO, "n_predict": 4,
                                              "temperature": 0})
        assert r.status_code == 200 and r.json()["content"] in ("yes", "no"), r.text
        for path, body in (("/v1/completions", {"model": "smol", "prompt": "a"}), ("/completion", {"prompt": "a"})):
            r = await c.post(path, json={**body, "grammar": "root ::= ( \"a\""})
            assert r.status_code == 400 and "grammar" in r.json()["error"]["message"], (path, r.text)


# --- a real llama.cpp model with FIM markers: SmolLM2 with tokenizer.ggml.fim_*_token_id added ---------------------

_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def _skip_value(data: bytes, at: int, kind: int) -> int:
    if kind == 8:   # string: u64 length, bytes
        return at + 8 + int.from_bytes(data[at:at + 8], "little")
    if kind == 9:   # array: u32 element type, u64 count, elements
        inner, count = int.from_bytes(data[at:at + 4], "little"), int.from_bytes(data[at + 4:at + 12], "little")
        at += 12
        if inner in _SIZES:
            return at + count * _SIZES[inner]
        for _ in range(count):
            at = _skip_value(data, at, inner)
        return at
    return at + _SIZES[kind]


def with_fim_metadata(src: Path, dst: Path, ids: dict[str, int]) -> None:
    """Copy GGUF ``src`` to ``dst`` with ``tokenizer.ggml.fim_<k>_token_id`` entries added (u32):
    the KV section grows, the tensor infos follow unchanged, the data is re-aligned (32)."""
    import struct

    data = src.read_bytes()
    assert data[:4] == b"GGUF"
    n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)
    at = 24
    for _ in range(n_kv):
        at += 8 + int.from_bytes(data[at:at + 8], "little")           # the key
        kind = int.from_bytes(data[at:at + 4], "little")
        at = _skip_value(data, at + 4, kind)
    kv_end = at
    for _ in range(n_tensors):
        at += 8 + int.from_bytes(data[at:at + 8], "little")           # the name
        n_dims = int.from_bytes(data[at:at + 4], "little")
        at += 4 + 8 * n_dims + 4 + 8
    infos_end, align = at, 32
    data_start = (infos_end + align - 1) // align * align
    extra = b"".join(struct.pack("<Q", len(k)) + k + struct.pack("<II", 4, v)
                     for k, v in ((f"tokenizer.ggml.fim_{name}_token_id".encode(), tid) for name, tid in ids.items()))
    head = data[:16] + struct.pack("<Q", n_kv + len(ids)) + data[24:kv_end] + extra + data[kv_end:infos_end]
    with dst.open("wb") as f:
        f.write(head + b"\0" * (-len(head) % align))
        f.write(memoryview(data)[data_start:])


@pytest.mark.real
async def test_infill_on_llamacpp_with_fim_markers(tmp_path: Path) -> None:
    from .test_real_daemon import real_config

    # SmolLM2's control tokens 6, 7, 8 (<filename>, <gh_stars>, <issue_start>) declared as FIM markers
    model = tmp_path / "smol-fim.gguf"
    with_fim_metadata(REAL_GGUF, model, {"pre": 6, "suf": 7, "mid": 8})
    async with open_daemon(real_config(model, "smol-fim", max_batch=1)) as d:
        fim = d.client
        assert (await fim.get("/v1/models")).json()["data"][0]["capabilities"]["fim"] is True
        r = await fim.post("/infill", json={"input_prefix": "def add(a, b):\n    return ", "input_suffix": "\n",
                                            "n_predict": 3, "temperature": 0})
        assert r.status_code == 200, r.text
        pre = (await fim.post("/tokenize", json={"content": "def add(a, b):\n    return ", "parse_special": False}))
        suf = (await fim.post("/tokenize", json={"content": "\n", "parse_special": False}))
        repo = (await fim.post("/tokenize", json={"content": "myproject\n", "parse_special": False}))
        # llama.cpp finds SmolLM2's <reponame> (4) as the repo marker by its spelling: the repo-level head leads
        n = 1 + len(repo.json()["tokens"]) + 1 + len(pre.json()["tokens"]) + 1 + len(suf.json()["tokens"]) + 1
        assert r.json()["tokens_evaluated"] == n
        r = await fim.post("/api/generate", json={"model": "smol-fim", "prompt": "x = ", "suffix": "\n",
                                                  "stream": False, "options": {"num_predict": 2}})
        assert r.status_code == 200, r.text
