"""A request sent alone gets one greedy reply, whatever came before it (issue 51; SPEC.md §5
"Determinism"): default settings (no ``--deterministic``), SmolLM2 on llama.cpp, a ~4,000-token
conversation of four messages.

A fresh daemon; a short request whose prompt shares the conversation's first 1 token; the
conversation cold; again warm; a third copy cut by a SIGKILL of the daemon's process group
mid-stream; a restart on the same sessions directory, where the cut copy resumes to its end; the
conversation again and warm again: five identical replies. Then, on the restarted daemon, short
requests sharing 10 and 63 tokens before the conversation cold and warm (each in its own cache
partition, ``cache_salt``, so the conversation is cold there): the same reply again. The first
token after the restart (the resumed copy's, which prefills the conversation cold and replays its
delivered tokens) is no slower than the cold one before the crash, within the machine's noise.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from superfluid.models._files import model_name
from superfluid.worker._executor import last_step

from .conftest import REAL_GGUF
from superfluid.proto import SseDecoder

from .test_sessions import RESUMABLE, _content, _free_port, _reap, _wait_ready

pytestmark = [pytest.mark.real, pytest.mark.slow]

MODEL = model_name(str(REAL_GGUF), "llamacpp")
MAX_TOKENS = 128
HEAD_EVENTS = 6


def _spawn(port: int, sessions: Path, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "superfluid", "serve", str(REAL_GGUF), "--http", f"127.0.0.1:{port}",
             "--sessions", str(sessions), "--max-batch", "4", "--max-context", "8192", "--log-level", "INFO",
             # a fixed thread count (the promise holds at any fixed --threads): 2, the cores CI has (4
             # cold prefills of 4k tokens: 120 s, 462 s on one thread); llama.cpp's spinning barrier
             # slows ~40x when its threads share the cores with other busy processes, so this test
             # wants the machine to itself, as CI's one-at-a-time run gives it
             "--threads", "2"],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )


_SENTENCES = [
    "The buffer on the intake line was drained and refilled before the morning shift.",
    "A technician logged a pressure drop of four percent near the second valve.",
    "Nobody could explain why the north pump hummed louder after the storm.",
    "The spare gasket arrived late, so the repair waited until Thursday.",
    "Readings from the east tank stayed flat for the whole week.",
    "The buffer overflowed once when the sensor froze, and the alarm stayed silent.",
    "Maria replaced the cracked gauge and wrote the serial number in the margin.",
    "The night crew reported a smell of burnt rubber that faded by noon.",
    "Flow through the bypass doubled while the main filter was cleaned.",
    "An inspector asked for the calibration records of every meter on site.",
    "The old controller rebooted twice and lost its schedule both times.",
    "Someone left the hatch on the settling basin open overnight.",
]


def _conversation() -> list[dict[str, str]]:
    entries = [f"Entry {i}: {_SENTENCES[i % 12]} {_SENTENCES[(i * 5 + 3) % 12]}" for i in range(118)]
    return [
        {"role": "system", "content": "You are a careful assistant for a water treatment plant. Answer from the "
                                      "notes you are given, and say which entries you used."},
        {"role": "user", "content": "Here are the maintenance notes for the month.\n\n" + "\n".join(entries)},
        {"role": "assistant", "content": "I have read the notes. What would you like to know about them?"},
        {"role": "user", "content": "What happened to the buffer this month, and which entries say so? "
                                    "Then list three other problems the crew should follow up on."},
    ]


def _prompt_tokens(messages: list[dict[str, str]]) -> list[int]:
    """The conversation's prompt as the daemon builds it (its template's segments, tokenized in order)."""
    from superfluid.chat import ChatTemplate, pick_template
    from superfluid.worker._llamacpp import LlamaEngine

    engine = LlamaEngine(str(REAL_GGUF), max_batch=1, max_context=64, threads=1)
    try:
        info = engine.info
        source, kind = pick_template(info.chat_template, info.special_tokens)
        by_id = {v: k for k, v in info.special_tokens.items()}
        template = ChatTemplate(source, kind=kind, bos_token=by_id.get(info.bos, ""),
                                eos_token=by_id.get(info.eog[0], "") if info.eog else "", specials=info.special_tokens)
        tokens: list[int] = []
        for text, special in template.render(messages):
            tokens += engine.tokenize(text, add_special=False, parse_special=special)
        filler = engine.tokenize(" Say hello, briefly.", add_special=False, parse_special=False)
    finally:
        engine.close()
    return tokens + [-1] + filler   # the prompt, a separator, then a filler for the warm-ups


class _Reply:
    def __init__(self) -> None:
        self.text = ""
        self.ttft = 0.0
        self.cached = -1
        self.prompt_tokens = -1
        self.session = ""
        self.cursor = ""


async def _chat(c: httpx.AsyncClient, messages: list[dict[str, str]], salt: str, *,
                resumable: bool = False, stop_after: int | None = None) -> _Reply:
    """Stream the conversation; with ``stop_after``, return after that many content events
    (the caller kills the daemon then)."""
    body = {"model": MODEL, "messages": messages, "temperature": 0, "seed": 1, "max_tokens": MAX_TOKENS,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}, "cache_salt": salt}
    out = _Reply()
    t0 = time.monotonic()
    done = False
    pieces = 0
    async with c.stream("POST", "/v1/chat/completions", json=body, headers=RESUMABLE if resumable else {}) as r:
        assert r.status_code == 200, await r.aread()
        out.session = r.headers.get("x-superfluid-session", "")
        decoder = SseDecoder()
        async for chunk in r.aiter_bytes():
            for event in decoder.feed(chunk):
                out.cursor = event.id if event.id is not None else out.cursor
                if event.data == "[DONE]":
                    done = True
                    continue
                e = event.json()
                piece = _content(e)
                if piece and not out.text:
                    out.ttft = time.monotonic() - t0
                out.text += piece
                pieces += bool(piece)
                if e.get("usage"):
                    out.cached = e["usage"]["prompt_tokens_details"]["cached_tokens"]
                    out.prompt_tokens = e["usage"]["prompt_tokens"]
            if stop_after is not None and pieces >= stop_after:
                break
    assert done == (stop_after is None)
    return out


async def _warm_up(c: httpx.AsyncClient, prompt: list[int], shared: int, filler: list[int], salt: str) -> None:
    """A short request whose prompt shares exactly ``shared`` leading tokens with the conversation."""
    assert filler[0] != prompt[shared]
    r = await c.post("/v1/completions", json={"model": MODEL, "prompt": prompt[:shared] + filler, "max_tokens": 4,
                                              "temperature": 0, "cache_salt": salt})
    assert r.status_code == 200, r.text


async def test_a_conversation_sent_alone_gets_one_reply_cold_warm_after_others_and_after_a_crash(
        tmp_path: Path) -> None:
    messages = _conversation()
    rendered = _prompt_tokens(messages)
    cut = rendered.index(-1)
    prompt, filler = rendered[:cut], rendered[cut + 1:]
    assert len(prompt) >= 4000
    # what a warm resend reuses: whole cells short of the prompt's last step (its last cell and,
    # when that one is partial, the full cell before it: one pass of at least 64 rows)
    whole = last_step(len(prompt))
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    sessions = tmp_path / "sessions"
    log = tmp_path / "daemon.log"
    timeout = httpx.Timeout(900)
    proc = _spawn(port, sessions, log)
    try:
        await _wait_ready(url, proc)
        async with httpx.AsyncClient(base_url=url, timeout=timeout) as c:
            await _warm_up(c, prompt, 1, filler, "w1")
            cold = await _chat(c, messages, "w1")
            assert cold.prompt_tokens == len(prompt), "the test renders the prompt as the daemon does"
            assert cold.cached == 0
            ref = cold.text
            assert len(ref) > 100, ref
            # warm: the whole prompt's KV and its last step's logits were kept (a tail): nothing computed
            warm = await _chat(c, messages, "w1")
            assert warm.cached == len(prompt)
            assert warm.text == ref
            head = await _chat(c, messages, "w1", resumable=True, stop_after=HEAD_EVENTS)
            assert head.session and head.text and ref.startswith(head.text)
            _reap(proc)   # SIGKILL: the daemon and its worker, mid-stream

        proc = _spawn(port, sessions, log)
        await _wait_ready(url, proc)
        t_ready = time.monotonic()
        async with httpx.AsyncClient(base_url=url, timeout=timeout) as c:
            # the cut copy was re-admitted at startup (resumable): its rest from the last cursor
            async with c.stream("GET", f"/v1/sessions/{head.session}/stream",
                                headers={"Last-Event-ID": head.cursor}) as r:
                assert r.status_code == 200, await r.aread()
                rest: list[str] = []
                first_after_restart = 0.0
                async for cursor_event in _events(r):
                    piece = _content(cursor_event)
                    if piece and not rest:
                        first_after_restart = time.monotonic() - t_ready
                    if piece:
                        rest.append(piece)
            assert head.text + "".join(rest) == ref
            # the resumed copy kept whole cells (its last step drew no token: it was committed)
            again = await _chat(c, messages, "w1")
            assert again.cached == whole and again.text == ref
            warm_again = await _chat(c, messages, "w1")
            assert warm_again.cached == len(prompt) and warm_again.text == ref
            others = {}
            for shared in (10, 63):
                salt = f"w{shared}"
                await _warm_up(c, prompt, shared, filler, salt)
                others[shared] = cold_here = await _chat(c, messages, salt)
                assert cold_here.cached == 0 and cold_here.text == ref, shared
                assert (await _chat(c, messages, salt)).text == ref, shared
        print(f"\nprompt {len(prompt)} tokens; first token: cold {cold.ttft:.1f} s, warm {warm.ttft:.2f} s, "
              f"after the restart {first_after_restart:.1f} s (resumed copy: cold prefill and replay), "
              f"again {again.ttft:.2f} s, cold after 10/63 shared {others[10].ttft:.1f}/{others[63].ttft:.1f} s")
        # no slower than cold, within a shared machine's noise (the resumed copy also replays its head)
        assert first_after_restart <= 1.5 * cold.ttft + 5, (first_after_restart, cold.ttft)
    finally:
        _reap(proc)


async def _events(r: httpx.Response) -> Any:
    decoder = SseDecoder()
    async for chunk in r.aiter_bytes():
        for event in decoder.feed(chunk):
            if event.data == "[DONE]":
                return
            yield event.json()
