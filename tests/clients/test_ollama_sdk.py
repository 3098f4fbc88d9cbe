"""The official ``ollama`` Python client on ``/api/*``: list, chat, generate, each whole and streamed."""

from __future__ import annotations

import ollama

from .conftest import MOCK, Served

GREEDY = {"temperature": 0, "num_predict": 12, "seed": 1}


def client(served: Served) -> ollama.Client:
    return ollama.Client(host=served.url, timeout=60)


def test_list_names_the_served_model(served: Served) -> None:
    names = [m.model for m in client(served).list().models]
    assert any(n.split(":")[0] == MOCK for n in names), names


def test_chat_whole_and_streamed(served: Served) -> None:
    c = client(served)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    whole = c.chat(MOCK, messages=messages, options=GREEDY)
    assert whole.done and whole.message.role == "assistant" and whole.message.content
    assert whole.done_reason in ("stop", "length") and whole.eval_count and whole.prompt_eval_count
    parts = list(c.chat(MOCK, messages=messages, options=GREEDY, stream=True))
    assert parts[-1].done and not any(p.done for p in parts[:-1])
    assert "".join(p.message.content or "" for p in parts) == whole.message.content
    # the conversation goes on with the reply in it, as a chat front end sends it
    messages += [{"role": "assistant", "content": whole.message.content}, {"role": "user", "content": "more"}]
    assert c.chat(MOCK, messages=messages, options=GREEDY).message.content


def test_generate_whole_and_streamed(served: Served) -> None:
    c = client(served)
    whole = c.generate(MOCK, "Once upon a time", options=GREEDY)
    assert whole.done and whole.response and whole.eval_count
    parts = list(c.generate(MOCK, "Once upon a time", options=GREEDY, stream=True))
    assert parts[-1].done and "".join(p.response for p in parts) == whole.response


def test_options_a_front_end_sends_are_accepted(served: Served) -> None:
    """Options Ollama accepts whatever the runtime (GPU layers, threads, mirostat, a window past the
    model's): Ollama ignores what does not apply and clamps ``num_ctx``; so must the daemon."""
    options = {**GREEDY, "num_ctx": 1 << 20, "num_gpu": 99, "num_thread": 4, "mirostat": 0,
               "repeat_last_n": 64, "typical_p": 1.0, "num_keep": 4}
    r = client(served).chat(MOCK, messages=[{"role": "user", "content": "hi"}], options=options)
    assert r.done and r.message.content
