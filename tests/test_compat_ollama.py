"""Ollama compatibility: ``options`` that do not apply are ignored (logged once per name),
those that do are mapped, and a wrong type is refused as Ollama refuses it (issue 47)."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from .conftest import Daemon

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
                                                  "options": {**INAPPLICABLE, "num_predict": 5}})
        assert r.status_code == 200, r.text
        assert r.json()["eval_count"] == 5 and r.json()["done"] is True
    said = [rec.getMessage() for rec in caplog.records if rec.name == "superfluid.ollama"]
    for name in INAPPLICABLE:
        assert sum(f"option {name} " in line for line in said) == 1, (name, said)
    assert not any("option num_predict " in line for line in said)


async def test_options_that_apply_are_mapped(daemon: Daemon) -> None:
    seeded = {"seed": 7, "temperature": 0.9, "top_k": 40.0, "top_p": 0.95, "min_p": 0.05, "repeat_penalty": 1.1,
              "presence_penalty": 0.5, "frequency_penalty": 0.5, "num_predict": 6.0, "num_ctx": 2048}
    one, two = (await _chat(daemon, seeded)).json(), (await _chat(daemon, seeded)).json()
    assert one["eval_count"] == 6 and one["message"] == two["message"]  # num_predict as Ollama's float: 6 tokens
    stopped = (await _chat(daemon, {"num_predict": 40, "stop": [one["message"]["content"][2:4]]})).json()
    assert stopped["eval_count"] < 40 and one["message"]["content"][2:4] not in stopped["message"]["content"]


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
