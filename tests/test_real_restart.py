"""A real-model daemon (SmolLM2-135M on llama.cpp) SIGKILLed mid-streams and
restarted on the same sessions dir (``--deterministic``): each session resumes by id
to the text an uninterrupted run gives, and resending the conversation gets the same reply."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import trio

from superfluid.models._files import model_name
from superfluid.journal import open_journal
from superfluid.proto import SseDecoder

from .conftest import REAL_GGUF, sse_events, stream_text
from .test_sessions import RESUMABLE, _content, _free_port, _reap, _wait_ready, read_sse

pytestmark = pytest.mark.real

MAX_TOKENS = 64
HEAD_EVENTS = 8  # content events each stream must have seen before the kill
MODEL = model_name(str(REAL_GGUF), "llamacpp")


def _spawn(port: int, sessions: Path, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "superfluid", "serve", str(REAL_GGUF), "--http", f"127.0.0.1:{port}",
             "--sessions", str(sessions), "--max-batch", "4", "--max-context", "1024", "--log-level", "INFO",
             # one engine thread: llama.cpp's spinning thread barrier slows ~40x when its threads
             # share the cores with other busy processes (a parallel test, a CI neighbour)
             "--threads", "1", "--agent-stream-interval-ms", "40",
             # identity across a restart is promised only in deterministic mode (SPEC §5
             # "Determinism"): without it a row's logits depend on its batch neighbours, and the
             # head (4 lanes) and the reference (8 requests) ran in different batches
             "--deterministic"],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )


def _body(i: int, **kw: object) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": f"Tell a long story about a robot named R{i}."}],
            "temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True, **kw}


async def _follow(response: httpx.Response, into: list[tuple[int, dict]], enough: trio.Event) -> None:
    """Append (cursor, payload) for each SSE event until the connection drops;
    set ``enough`` after HEAD_EVENTS content events. [DONE] is appended as (-1, {})."""
    cursor = -1
    decoder = SseDecoder()
    async for chunk in response.aiter_bytes():
        for event in decoder.feed(chunk):
            cursor = int(event.id) if event.id is not None else cursor
            if event.data == "[DONE]":
                into.append((-1, {}))
                continue
            into.append((cursor, event.json()))
            if sum(1 for _c, e in into if _content(e)) >= HEAD_EVENTS:
                enough.set()


def _content_cursors(events: list[tuple[int, dict]]) -> list[int]:
    return [c for c, e in events if _content(e)]


async def test_daemon_sigkill_mid_streams_then_resume_by_id_matches_uninterrupted(tmp_path: Path) -> None:
    """Four resumable greedy streams, the daemon's process group SIGKILLed once
    each has shown HEAD_EVENTS deltas; after a restart on the same sessions dir,
    each resumes by id from its last cursor. Head + rest equals the same request
    run uninterrupted on the restarted daemon (and a plain resend of it), the
    cursors never repeat, and the log's event ids run on without a gap."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    sessions = tmp_path / "sessions"
    log = tmp_path / "daemon.log"
    heads: list[list[tuple[int, dict]]] = [[] for _ in range(4)]
    sids: list[str] = [""] * 4
    proc = _spawn(port, sessions, log)
    try:
        await _wait_ready(url, proc)
        async with httpx.AsyncClient(base_url=url, timeout=30) as c:
            enough = [trio.Event() for _ in range(4)]

            async def partial(i: int) -> None:
                async with c.stream("POST", "/v1/chat/completions", json=_body(i, stream=True),
                                    headers=RESUMABLE) as r:
                    assert r.status_code == 200, await r.aread()
                    sids[i] = r.headers["x-superfluid-session"]
                    try:
                        await _follow(r, heads[i], enough[i])
                    except httpx.TransportError:
                        pass  # the daemon died under us

            with trio.fail_after(30):
                async with trio.open_nursery() as n:
                    for i in range(4):
                        n.start_soon(partial, i)
                    for e in enough:
                        await e.wait()
                    os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        for i, head in enumerate(heads):
            cursors = _content_cursors(head)
            assert head[-1][0] != -1, f"stream {i} finished before the kill; nothing was interrupted"
            assert len(cursors) >= HEAD_EVENTS and cursors[-1] < MAX_TOKENS, cursors

        proc = _spawn(port, sessions, log)
        await _wait_ready(url, proc)
        async with httpx.AsyncClient(base_url=url, timeout=30) as c:
            resumed: dict[int, str] = {}
            refs: dict[int, str] = {}
            resent: dict[int, str] = {}

            async def resume(i: int) -> None:
                async with c.stream("GET", f"/v1/sessions/{sids[i]}/stream",
                                    headers={"Last-Event-ID": str(heads[i][-1][0])}) as r:
                    assert r.status_code == 200, await r.aread()
                    rest, done = await read_sse(r)
                assert done, f"session {i}: resumed stream ended without [DONE]"
                cursors = _content_cursors(heads[i]) + [int(c) for c, e in rest if _content(e)]
                assert cursors == sorted(set(cursors)), f"session {i}: repeated or out-of-order ids {cursors}"
                final = rest[-1][1]
                assert final["choices"][0]["finish_reason"] == "length"
                assert final["usage"]["completion_tokens"] == MAX_TOKENS
                assert rest[-1][0] == str(MAX_TOKENS), "the last id is the full token count"
                resumed[i] = "".join(_content(e) for _c, e in heads[i]) + "".join(_content(e) for _c, e in rest)

            async def reference(i: int) -> None:
                async with c.stream("POST", "/v1/chat/completions", json=_body(i, stream=True)) as r:
                    refs[i] = stream_text(await sse_events(r))

            async def resend(i: int) -> None:
                r = (await c.post("/v1/chat/completions", json=_body(i))).json()
                resent[i] = r["choices"][0]["message"]["content"]

            with trio.fail_after(30):
                async with trio.open_nursery() as n:
                    for i in range(4):
                        n.start_soon(resume, i)
                async with trio.open_nursery() as n:
                    for i in range(4):
                        n.start_soon(reference, i)
                        n.start_soon(resend, i)
        assert resumed == refs
        assert resent == refs
    finally:
        _reap(proc)
    async with open_journal(sessions) as journal:
        for i, sid in enumerate(sids):
            slog = journal.sessions[sid]
            ids = [rec.event_id for rec in slog.events]
            assert ids == list(range(len(ids))), "no duplicate or missing event ids across the restart"
            assert slog.done and slog.text == refs[i] and len(slog.generated_tokens) == MAX_TOKENS
