"""Fill-in-the-middle as code-completion clients send it: llama.vscode's (and llama.vim's)
``POST /infill`` in llama-server's shape, Ollama's ``/api/generate`` with ``suffix`` through the
``ollama`` client, and OpenAI's legacy completions ``suffix``. On the mock, which declares
StarCoder's FIM tokens (SmolLM2's GGUF names none, so it refuses FIM); llama.vscode names no model
and gets the default one, the mock."""

from __future__ import annotations

import httpx
import ollama
import openai

from .conftest import MOCK, Served

PREFIX = "def add(a, b):\n    \"\"\"The sum of a and b.\"\"\"\n"
LINE = "    return "  # the cursor's line up to the cursor (llama.vscode's "prompt")
SUFFIX = "\n\n\nprint(add(1, 2))\n"
# llama.vscode's ring of chunks from other open files, sent as input_extra
EXTRA = [{"filename": "util.py", "text": "def sub(a, b):\n    return a - b\n", "time": 1733500000000}]


def infill_body(n_predict: int) -> dict:
    """The body llama.vscode posts to ``{endpoint}/infill``: its default sampling parameters, the
    cursor's context, and its time limits; no ``model`` (llama-server serves one)."""
    return {"input_prefix": PREFIX, "input_suffix": SUFFIX, "input_extra": EXTRA, "prompt": LINE,
            "n_predict": n_predict, "top_k": 40, "top_p": 0.99, "stream": False, "n_indent": 4,
            "samplers": ["top_k", "top_p", "infill"], "cache_prompt": True, "t_max_prompt_ms": 500,
            "t_max_predict_ms": 1000}


def test_llama_vscode_infill(served: Served) -> None:
    with httpx.Client(base_url=served.url, timeout=60) as c:
        r = c.post("/infill", json=infill_body(16))
        assert r.status_code == 200, r.text
        body = r.json()
        assert isinstance(body["content"], str)  # sampled as llama.vscode asks (top_k, top_p): may be ""


def test_llama_vscode_cache_warmup(served: Served) -> None:
    """After an accepted completion llama.vscode asks for the next one's prompt with ``n_predict:
    0`` and no samplers, to have it cached: llama-server documents ``n_predict`` 0 as "evaluate
    the prompt into the cache, generate nothing", and answers 200 with empty ``content``."""
    body = {**infill_body(0), "samplers": [], "t_max_predict_ms": 1}
    r = httpx.post(served.url + "/infill", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["content"] == ""


def test_ollama_generate_with_suffix(served: Served) -> None:
    c = ollama.Client(host=served.url, timeout=60)
    options = {"temperature": 0, "num_predict": 16}
    whole = c.generate(MOCK, PREFIX + LINE, suffix=SUFFIX, options=options)
    assert whole.done and isinstance(whole.response, str) and whole.eval_count is not None
    parts = list(c.generate(MOCK, PREFIX + LINE, suffix=SUFFIX, options=options, stream=True))
    assert parts[-1].done and "".join(p.response for p in parts) == whole.response


def test_openai_completions_suffix_reaches_the_prompt(served: Served) -> None:
    """A suffix given to the legacy completions route is part of the prompt (it was ignored)."""
    c = openai.OpenAI(base_url=served.v1, api_key="unused", max_retries=0, timeout=60)
    kw = dict(model=MOCK, prompt=PREFIX + LINE, max_tokens=8, temperature=0)
    alone = c.completions.create(**kw)
    fim = c.completions.create(**kw, suffix=SUFFIX)
    assert fim.usage.prompt_tokens > alone.usage.prompt_tokens
    assert isinstance(fim.choices[0].text, str)
