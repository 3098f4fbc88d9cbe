"""``serve --chat-template-file [MODEL=]PATH`` (issue 47): a Jinja chat template that
replaces a model's own, rendered in the same sandbox; a bad file is one line and
exit 2 at startup."""

from __future__ import annotations

from pathlib import Path

import pytest

from superfluid.cli._main import _chat_templates, build_parser, main
from superfluid.serving import ModelSource

from .conftest import mock_config, open_daemon

# every message's content, and nothing else: the prompt of "hi" is then the completion prompt "hi"
BARE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"


def _serve(*args: str) -> int:
    return main(["serve", "mock", "--runtime", "mock", "--http", "127.0.0.1:0", *args])


def test_a_bad_template_file_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for message in messages %}{{ message['content'] }}")   # no endfor
    binary = tmp_path / "binary.jinja"
    binary.write_bytes(b"\xff\xfe{{ x }}")
    good = tmp_path / "good.jinja"
    good.write_text(BARE)
    cases = [
        ((str(tmp_path / "missing.jinja"),), f"{tmp_path / 'missing.jinja'}: No such file or directory"),
        ((str(broken),), f"{broken}: chat template does not compile: Unexpected end of template."),
        ((str(binary),), f"{binary}: not UTF-8 text (byte 0)"),
        ((f"nope={good}",), f"--chat-template-file nope={good}: no model 'nope' is served (models: mock)"),
        ((str(good), "--chat-template-file", str(good)), "every model already has a template file"),
    ]
    for args, said in cases:
        assert _serve("--chat-template-file", *args) == 2, args
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and err[0].startswith("superfluid: ") and said in err[0], err


def test_the_flag_reads_each_file_for_its_model(tmp_path: Path) -> None:
    path = tmp_path / "t.jinja"
    path.write_text(BARE)
    args = build_parser().parse_args(["serve", "mock", "--runtime", "mock", "--alias", "gpt=mock",
                                      "--chat-template-file", str(path), "--chat-template-file", f"gpt={path}"])
    sources = (ModelSource(spec="mock", runtime="mock", name="mock"),)
    assert _chat_templates(args, sources) == (("", BARE), ("mock", BARE))   # an alias names its model


async def test_the_file_replaces_the_models_template_for_its_model_only() -> None:
    other = ModelSource(spec="mock?name=other", runtime="mock", name="other")
    config = mock_config(chat_templates=(("mock", BARE),))
    config = mock_config(models=(*config.models, other), chat_templates=config.chat_templates)
    async with open_daemon(config) as d:
        c = d.client
        raw = (await c.post("/v1/completions", json={"model": "mock", "prompt": "hi", "max_tokens": 1})).json()
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        mine = (await c.post("/v1/chat/completions", json={**chat, "model": "mock"})).json()
        theirs = (await c.post("/v1/chat/completions", json={**chat, "model": "other"})).json()
        assert mine["usage"]["prompt_tokens"] == raw["usage"]["prompt_tokens"]
        assert theirs["usage"]["prompt_tokens"] > raw["usage"]["prompt_tokens"]   # ChatML, the model's own
        # still the sandbox: a special token typed by the client stays text (one token per byte, not one)
        special = (await c.post("/v1/chat/completions", json={
            **chat, "model": "mock", "messages": [{"role": "user", "content": "<|im_start|>"}]})).json()
        assert special["usage"]["prompt_tokens"] == len("<|im_start|>")
        shown = (await c.post("/api/show", json={"model": "mock"})).json()
        assert shown["template"] == BARE
