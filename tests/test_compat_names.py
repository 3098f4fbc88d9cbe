"""Model names as clients write them (issue 47): a pulled model is served as the
``org/repo:QUANT`` it was asked by, and answers to that name in any case, to ``org/repo``
(its one quant) and to Ollama's ``hf.co/org/repo:QUANT`` / ``huggingface.co/...`` names.
``serve org/repo:Q4_1`` end to end (a pull from the fake hub, a real load) is
tests/test_pulls.py::test_serve_pulls_then_serves_and_starts_again_from_the_cache."""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from superfluid.serving import ModelSource

from .conftest import REAL_GGUF, Daemon, mock_config, open_daemon

SERVED = "org/repo:Q4_1"
ALIASES = (SERVED, "org/repo:q4_1", "ORG/Repo:Q4_1", "org/repo", "hf.co/org/repo:Q4_1", "huggingface.co/org/repo:Q4_1",
           "https://huggingface.co/org/repo:Q4_1", "hf.co/org/repo", "hf.co/org/repo:latest")


def test_hub_ids_take_ollamas_hf_co_prefix(tmp_path: Path) -> None:
    from superfluid.models._hub import HubRef, parse_hub_id, strip_hub_host

    for prefix in ("hf.co/", "huggingface.co/", "HF.co/", "https://huggingface.co/", "http://hf.co/"):
        assert parse_hub_id(prefix + "unsloth/Qwen3-4B-GGUF:UD-Q4_K_XL") == HubRef("unsloth/Qwen3-4B-GGUF",
                                                                                    "UD-Q4_K_XL")
        assert parse_hub_id(prefix + "org/repo") == HubRef("org/repo")
    for bad in ("hf.co/a/b/c", "hf.co/", "hf.co/org/..", "huggingface.co/org/x.gguf", "hf.co/org/repo:a:b"):
        assert parse_hub_id(bad) is None, bad
    assert strip_hub_host("hf.co/org/repo:Q8_0") == "org/repo:Q8_0" and strip_hub_host("hf.co/x") == "hf.co/x"


@pytest.fixture
async def named() -> AsyncIterator[Daemon]:
    models = (ModelSource(spec="mock?step_ms=1&prefill_us=5", runtime="mock", name=SERVED),
              ModelSource(spec="mock?step_ms=1&prefill_us=5", runtime="mock", name="mock"))
    async with open_daemon(mock_config(models=models)) as d:
        yield d


async def test_a_quant_answers_to_every_name_of_it(named: Daemon) -> None:
    c = named.client
    for name in ALIASES:
        r = await c.post("/v1/chat/completions", json={"model": name, "max_tokens": 2,
                                                       "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200 and r.json()["model"] == SERVED, (name, r.text)
        r = await c.post("/api/chat", json={"model": name, "stream": False, "options": {"num_predict": 2},
                                            "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200 and r.json()["model"] == SERVED, (name, r.text)
        r = await c.post("/api/show", json={"model": name})
        assert r.status_code == 200, (name, r.text)
        assert (await c.get(f"/v1/models/{name}")).json()["id"] == SERVED
    assert SERVED in {m["id"] for m in (await c.get("/v1/models")).json()["data"]}
    assert SERVED in {m["name"] for m in (await c.get("/api/tags")).json()["models"]}
    r = await c.post("/v1/chat/completions", json={"model": "org/repo:Q8_0", "messages": [{"role": "user",
                                                                                        "content": "hi"}]})
    assert r.status_code == 404 and f"loaded: {SERVED}" in r.json()["error"]["message"]
    assert f"served: mock, {SERVED}" in r.json()["error"]["message"]


async def test_two_quants_of_a_repo_need_the_tag() -> None:
    models = tuple(ModelSource(spec="mock?step_ms=1&prefill_us=5", runtime="mock", name=f"org/repo:{q}")
                   for q in ("Q8_0", "Q4_K_M", "Q4_1"))
    async with open_daemon(mock_config(models=models)) as d:
        async def model_of(name: str) -> Any:
            r = await d.client.post("/api/chat", json={"model": name, "stream": False, "options": {"num_predict": 1},
                                                       "messages": [{"role": "user", "content": "hi"}]})
            return r.json().get("model") if r.status_code == 200 else r.status_code

        assert await model_of("hf.co/org/repo:q8_0") == "org/repo:Q8_0"
        assert await model_of("hf.co/org/repo") == "org/repo:Q4_K_M"  # Ollama's default quant
        assert await model_of("org/repo:Q5_K_M") == 404


def test_serve_names_a_pulled_model_by_its_quant(monkeypatch: pytest.MonkeyPatch) -> None:
    """``serve org/repo:q4_1`` (or ``hf.co/...``) serves ``org/repo:Q4_1``, not ``org/repo``."""
    from superfluid.cli import _main
    from superfluid.models._hub import Pulled, parse_hub_id

    asked: list[Any] = []

    def pulled(spec: str, *, offline: bool) -> Pulled:
        ref = parse_hub_id(spec)
        asked.append(ref)
        return Pulled(ref.repo, "Q4_1", (REAL_GGUF,), "c0ffee", 1)  # type: ignore[union-attr]

    monkeypatch.setattr(_main, "hub_model", pulled)
    monkeypatch.setattr(_main, "_choose", lambda spec, selector, args: argparse.Namespace(
        info=argparse.Namespace(id="llamacpp"), worker=()))
    for spec in ("org/repo:q4_1", "hf.co/org/repo:Q4_1"):
        args = argparse.Namespace(model=spec, models=[], runtime=[], offline=True)
        source, = _main._sources(args)
        assert source.name == SERVED and source.spec == str(REAL_GGUF) and source.runtime == "llamacpp"
    assert [str(r) for r in asked] == ["org/repo:q4_1", "org/repo:Q4_1"]


def test_the_library_finds_a_model_by_its_hf_co_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``superfluid rm`` and Ollama's ``/api/delete``, ``/api/copy`` take ``hf.co/`` names too."""
    from superfluid.models._library import add_copy, find

    monkeypatch.setenv("SUPERFLUID_HOME", str(tmp_path))
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    add_copy(model, SERVED)
    for name in (SERVED, "hf.co/org/repo:Q4_1", "huggingface.co/org/repo:q4_1"):
        found = find(name)
        assert found is not None and found.name == SERVED, name


def test_an_alias_may_name_a_hub_model_as_requests_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--alias gpt=org/repo`` still works now that ``serve org/repo:Q4_1`` serves ``org/repo:Q4_1``."""
    from superfluid.cli._main import _check_limits

    monkeypatch.setenv("SUPERFLUID_HOME", str(tmp_path))
    sources = (ModelSource(spec=str(REAL_GGUF), runtime="llamacpp", name=SERVED),)

    def check(target: str) -> str | None:
        return _check_limits(argparse.Namespace(model_dirs=[], max_models=4, aliases=[("gpt", target)]), sources)

    assert check("org/repo") is None and check("hf.co/org/repo:q4_1") is None and check(SERVED) is None
    assert check("org/repo:Q8_0") == f"--alias gpt=org/repo:Q8_0: no model 'org/repo:Q8_0' is served (models: {SERVED})"
