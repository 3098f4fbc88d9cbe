"""simonw's ``llm`` command-line tool, configured as its docs say for an OpenAI-compatible server:
an ``extra-openai-models.yaml`` in its config directory (``LLM_USER_PATH``, here a temporary one)
naming the daemon's ``api_base``, then ``llm -m NAME "prompt"``."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import openai
import pytest

from .conftest import MOCK, Served

OPTIONS = ["-o", "temperature", "0", "-o", "max_tokens", "12"]


@pytest.fixture(scope="module")
def llm(served: Served, tmp_path_factory: pytest.TempPathFactory) -> Callable[..., str]:
    home = tmp_path_factory.mktemp("llm")
    (home / "extra-openai-models.yaml").write_text(
        f"- model_id: superfluid-mock\n  model_name: {MOCK}\n  api_base: \"{served.v1}\"\n")
    env = {**os.environ, "LLM_USER_PATH": str(home), "HOME": str(home)}
    env.pop("OPENAI_API_KEY", None)
    exe = Path(sys.executable).with_name("llm")  # the console script beside this Python, as a user runs it

    def run(*args: str) -> str:
        done = subprocess.run([str(exe), *args], env=env, capture_output=True, text=True, timeout=60, check=False)
        assert done.returncode == 0, done.stderr
        return done.stdout

    return run


def test_prompt_streams_the_daemons_reply_and_the_conversation_goes_on(served: Served, llm: Callable[..., str]) -> None:
    """``llm -m NAME -s SYSTEM "prompt"`` prints the reply the SDK gets for the same request;
    ``llm -c --no-stream`` continues that conversation (llm sends its history)."""
    expected = openai.OpenAI(base_url=served.v1, api_key="unused", max_retries=0).chat.completions.create(
        model=MOCK, messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "a story"}],
        temperature=0, max_tokens=12,
    ).choices[0].message.content
    assert llm("-m", "superfluid-mock", "-s", "be brief", *OPTIONS, "a story").rstrip("\n") == expected.rstrip("\n")
    assert llm("-c", "--no-stream", *OPTIONS, "and then?").strip()
    # the daemon's access lines: the continued turn's prompt holds the first turn's
    first, second = [int(n) for n in re.findall(r"prompt=(\d+)", served.log.read_text())][-2:]
    assert second > first
