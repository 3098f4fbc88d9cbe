"""Ollama compatibility: ``options`` that do not apply are ignored (logged once per name),
those that do are mapped, and a wrong type is refused as Ollama refuses it (issue 47)."""

from __future__ import annotations

import json
import logging
import struct
from pathlib import Path
from typing import Any

import pytest

from .conftest import REAL_GGUF, Daemon, mock_config, open_daemon

HI = [{"role": "user", "content": "hi"}]
# every option Ollama has had that superfluid's engine does not use, as clients send them
INAPPLICABLE = {"num_gpu": 1, "num_thread": 4, "mirostat": 2, "mirostat_eta": 0.1, "mirostat_tau": 5.0,
                "repeat_last_n": 64, "typical_p": 0.9, "num_keep": 5, "numa": False, "num_batch": 512, "main_gpu": 0,
                "use_mmap": True, "use_mlock": False, "low_vram": False, "f16_kv": True, "vocab_only": False,
                "penalize_newline": True, "tfs_z": 1.0, "logits_all": False, "embedding_only": False,
                "draft_num_predict": 3, "some_future_option": {"x": [1]}}


async def _chat(daemon: Daemon, options: dict[str, Any], **extra: Any) -> Any:
    return await daemon.client.post("/api/chat", json={"model": "mock", "messages": HI, "stream": False,
                                                       "options": options, **extra})


async def test_options_that_do_not_apply_are_ignored_and_logged_once(
        daemon: Daemon, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="superfluid.ollama")
    for route, body in (("/api/chat", {"messages": HI}), ("/api/generate", {"prompt": "hi"}),
                        ("/api/chat", {"messages": HI})):
        r = await daemon.client.post(route, json={"model": "mock", "stream": False, **body,
                                                  "options": {**INAPPLICABLE, "num_predict": 4}})
        assert r.status_code == 200, r.text
        assert r.json()["eval_count"] == 4 and r.json()["done"] is True  # (the mock may end from its 5th token)
    said = [rec.getMessage() for rec in caplog.records if rec.name == "superfluid.ollama"]
    for name in INAPPLICABLE:
        assert sum(f"option {name} " in line for line in said) == 1, (name, said)
    assert not any("option num_predict " in line for line in said)


async def test_options_that_apply_are_mapped(daemon: Daemon) -> None:
    seeded = {"seed": 7, "temperature": 0.9, "top_k": 40.0, "top_p": 0.95, "min_p": 0.05, "repeat_penalty": 1.1,
              "presence_penalty": 0.5, "frequency_penalty": 0.5, "num_predict": 6.0, "num_ctx": 2048}
    one, two = (await _chat(daemon, seeded)).json(), (await _chat(daemon, seeded)).json()
    assert one["eval_count"] == 6 and one["message"] == two["message"]  # num_predict as Ollama's float: 6 tokens
    stop = one["message"]["content"][2:4]   # (the same seed: the same first six tokens)
    stopped = (await _chat(daemon, {**seeded, "num_predict": 40, "stop": [stop]})).json()
    assert stopped["eval_count"] < 40 and stop not in stopped["message"]["content"]


@pytest.mark.parametrize(("options", "why"), [
    ({"num_gpu": "all"}, "option 'num_gpu' must be of type integer"),
    ({"num_thread": True}, "option 'num_thread' must be of type integer"),
    ({"use_mmap": "yes"}, "option 'use_mmap' must be of type boolean"),
    ({"typical_p": "high"}, "option 'typical_p' must be of type number"),
    ({"temperature": [1]}, "option 'temperature' must be of type number"),
    ({"stop": "\n"}, "option 'stop' must be of type array of strings"),
    ({"stop": ["a", 1]}, "option 'stop' must be of type array of strings"),
])
async def test_a_known_option_of_the_wrong_type_is_refused(daemon: Daemon, options: dict[str, Any], why: str) -> None:
    r = await _chat(daemon, options)
    assert r.status_code == 400 and r.json() == {"error": why}


async def test_unknown_or_null_options_of_any_type_are_ignored(daemon: Daemon) -> None:
    r = await _chat(daemon, {"mirostat": "two", "no_such_option": "x", "num_gpu": None, "num_predict": 3})
    assert r.status_code == 200 and r.json()["eval_count"] == 3


# --- model listings: sizes and quantisation from the GGUF header ---------------------------------------------


def _gguf(path: Path, tensors: dict[str, tuple[int, ...]], meta: dict[str, Any]) -> None:
    """A small GGUF v3 file: ``meta`` (strings and u32s) and tensor infos (no tensor data)."""
    def string(text: str) -> bytes:
        return struct.pack("<Q", len(text.encode())) + text.encode()

    out = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(meta))
    for key, value in meta.items():
        out += string(key) + (struct.pack("<I", 8) + string(value) if isinstance(value, str)
                              else struct.pack("<II", 4, value))
    for name, dims in tensors.items():
        out += string(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
        out += struct.pack("<IQ", 12, 0)
    path.write_bytes(out + b"\0" * 1000)


TINY = {"general.architecture": "qwen3", "general.file_type": 15, "qwen3.context_length": 2048}


async def test_tags_and_models_carry_the_files_size_and_quantisation(tmp_path: Path) -> None:
    first, second = (tmp_path / f"tiny-Q4_K_M-0000{i}-of-00002.gguf" for i in (1, 2))
    _gguf(first, {"a": (1000, 1000), "b": (1000,)}, TINY)
    _gguf(second, {"c": (500, 1000)}, {"split.no": 1})
    _gguf(tmp_path / "other.gguf", {"w": (7, 1000, 1000)}, {**TINY, "general.architecture": "llama",
                                                             "general.file_type": 1})
    async with open_daemon(mock_config(model_dirs=(tmp_path,))) as d:
        tags = {m["name"]: m for m in (await d.client.get("/api/tags")).json()["models"]}
        tiny = tags["tiny-Q4_K_M-00001-of-00002"]
        assert tiny["size"] == first.stat().st_size + second.stat().st_size
        assert tiny["details"] == {"parent_model": "", "format": "gguf", "family": "qwen3", "families": ["qwen3"],
                                   "parameter_size": "1.50M", "quantization_level": "Q4_K_M"}
        assert tags["other"]["details"]["quantization_level"] == "F16"
        assert tags["other"]["details"]["parameter_size"] == "7M" and tags["other"]["details"]["family"] == "llama"
        assert tags["mock"]["size"] == 0  # no file
        listed = {m["id"]: m for m in (await d.client.get("/v1/models")).json()["data"]}
        assert listed["other"]["size"] == tags["other"]["size"] and listed["other"]["quantization"] == "F16"
        assert listed["tiny-Q4_K_M-00001-of-00002"]["quantization"] == "Q4_K_M" and "size" not in listed["mock"]
        one = (await d.client.get("/v1/models/other")).json()
        assert one["size"] == tags["other"]["size"] and one["quantization"] == "F16"
        shown = (await d.client.post("/api/show", json={"model": "other"})).json()
        assert shown["details"]["quantization_level"] == "F16"


@pytest.mark.skipif(not REAL_GGUF.exists(), reason="needs the SmolLM2 GGUF (python -m superfluid.models)")
def test_smollm2s_facts_are_ollamas() -> None:
    from superfluid.models._gguf import model_facts

    facts = model_facts(REAL_GGUF)
    assert (facts.size, facts.quantization_level, facts.family) == (REAL_GGUF.stat().st_size, "Q4_1", "llama")
    assert facts.parameter_size == "134.52M" and facts.context_length == 8192  # what `ollama list`/show say


# --- num_ctx: clamped above the window, Ollama's truncation below the prompt -------------------------------

def _history(pairs: int) -> list[dict[str, str]]:
    out = [{"role": "system", "content": "be brief"}]
    for i in range(pairs):
        out += [{"role": "user", "content": f"question {i} " + "word " * 40},
                {"role": "assistant", "content": f"answer {i} " + "word " * 40}]
    return [*out, {"role": "user", "content": "last"}]


async def test_num_ctx_above_the_window_is_clamped_with_a_warning() -> None:
    async with open_daemon(mock_config("mock?step_ms=1&prefill_us=5&n_ctx=512")) as d:
        for stream in (False, True):
            r = await d.client.post("/api/chat", json={"model": "mock", "messages": HI, "stream": stream,
                                                       "options": {"num_ctx": 131072, "num_predict": 3}})
            assert r.status_code == 200, r.text
            last = json.loads(r.text.strip().splitlines()[-1])
            assert last["done"] and last["eval_count"] == 3
            assert last["superfluid"] == {"warnings": [
                "options.num_ctx 131072 is more than this server's context window of 512 tokens: clamped to 512"]}
        r = await _chat(d, {"num_ctx": 512, "num_predict": 3})  # within it: no warning
        assert r.status_code == 200 and "superfluid" not in r.json()


async def test_num_ctx_below_the_conversation_drops_its_oldest_messages_as_ollama_does() -> None:
    async with open_daemon(mock_config("mock?step_ms=1&prefill_us=5&eos_every=1000000")) as d:
        c = d.client

        async def chat(messages: list[dict[str, str]], options: dict[str, Any], **extra: Any) -> Any:
            return await c.post("/api/chat", json={"model": "mock", "messages": messages, "stream": False,
                                                   "options": {"num_predict": 3, **options}, **extra})

        history = _history(6)
        whole = (await chat(history, {})).json()["prompt_eval_count"]
        alone = (await chat([history[0], history[-1]], {})).json()["prompt_eval_count"]  # the system one stays
        two = (await chat([history[0], *history[-3:]], {})).json()["prompt_eval_count"]
        r = (await chat(history, {"num_ctx": two + 1})).json()
        assert r["prompt_eval_count"] == two < whole and r["eval_count"] == 3
        assert r["superfluid"]["warnings"] == [f"options.num_ctx {two + 1}: the 10 oldest messages did not fit "
                                               "and were left out"]
        r = (await chat(history, {"num_ctx": alone - 1})).json()  # the last message stays, whole
        assert r["prompt_eval_count"] == alone and len(r["superfluid"]["warnings"]) == 2
        assert r["superfluid"]["warnings"][1] == f"the prompt of {alone} tokens is longer than options.num_ctx " \
                                                 f"{alone - 1}: sent whole"
        r = await chat(history, {"num_ctx": two + 1}, truncate=False)  # Ollama's truncate: false is an error
        assert r.status_code == 400 and r.json() == {
            "error": f"the prompt of {whole} tokens exceeds options.num_ctx of {two + 1} tokens"}
        r = (await chat(history[-1:], {"num_ctx": 4096, "num_predict": 500}, shift=False)).json()
        assert r["eval_count"] == 500 and "superfluid" not in r
        last = (await chat(history[-1:], {})).json()["prompt_eval_count"]
        r = (await chat(history[-1:], {"num_ctx": last + 5, "num_predict": 500}, shift=False)).json()
        assert r["eval_count"] == 5 and r["done_reason"] == "length"  # shift: false ends at num_ctx
        r = (await chat(history[-1:], {"num_ctx": last + 5, "num_predict": 50})).json()
        assert r["eval_count"] == 50  # the default shift goes on past it, as Ollama's context shift does
        r = await c.post("/api/generate", json={"model": "mock", "prompt": "hi", "shift": "no"})
        assert r.status_code == 400 and r.json() == {"error": "shift must be a boolean"}
