"""The session log through the daemon: write-ahead records, resumable streams,
resume by id after a daemon SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import trio

from superfluid.journal import open_journal
from superfluid.proto import SseDecoder

from .conftest import mock_config, sse_events, start_daemon, stream_text, wait_healthy

CHAT = {"model": "mock", "messages": [{"role": "user", "content": "tell me a long story"}], "temperature": 0,
        "max_tokens": 200, "ignore_eos": True}
RESUMABLE = {"x-superfluid-resumable": "true"}


async def read_sse(response: httpx.Response, *, limit: int | None = None) -> tuple[list[tuple[str | None, dict]], bool]:
    """(id, payload) pairs; stops after ``limit`` content events. Returns (events, saw_done)."""
    out: list[tuple[str | None, dict]] = []
    current_id = None  # the last event id persists (WHATWG)
    decoder = SseDecoder()
    async for chunk in response.aiter_bytes():
        for event in decoder.feed(chunk):
            current_id = event.id if event.id is not None else current_id
            if event.data == "[DONE]":
                return out, True
            out.append((current_id, event.json()))
            if limit is not None and sum(1 for _i, e in out if _content(e)) >= limit:
                return out, False
    return out, False


def _content(e: dict) -> str:
    return "".join((c.get("delta") or {}).get("content") or c.get("text") or "" for c in e.get("choices") or [])


async def test_every_request_is_a_logged_session(nursery: trio.Nursery, tmp_path: Path) -> None:
    d = await start_daemon(nursery, mock_config(sessions=tmp_path))
    r = (await d.client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 12})).json()
    text = r["choices"][0]["message"]["content"]
    d.scope.cancel()
    await trio.sleep(0.5)
    async with open_journal(tmp_path) as journal:
        [slog] = journal.sessions.values()
        types = [rec.body["type"] for rec in slog.events]
        assert types[:2] == ["created", "prompt"]
        assert "generated" in types
        assert slog.done and slog.text == text
        assert len(slog.generated_tokens) == 12
        ids = [rec.event_id for rec in slog.events]
        assert ids == list(range(len(ids)))


async def test_resumable_stream_survives_a_client_reconnect(nursery: trio.Nursery) -> None:
    d = await start_daemon(nursery, mock_config("mock?step_ms=5&prefill_us=5", agent_stream_interval_ms=40))
    async with d.client.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as r:
        reference = stream_text(await sse_events(r))
    async with d.client.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True},
                               headers=RESUMABLE) as r:
        sid = r.headers["x-superfluid-session"]
        first, done = await read_sse(r, limit=10)
    assert not done
    last_id = first[-1][0]
    assert last_id is not None and int(last_id) >= 10
    await trio.sleep(0.3)  # generation goes on with nobody following
    info = (await d.client.get(f"/v1/sessions/{sid}")).json()
    assert info["completion_tokens"] > int(last_id)
    async with d.client.stream("GET", f"/v1/sessions/{sid}/stream", headers={"Last-Event-ID": last_id}) as r:
        rest, done = await read_sse(r)
    assert done
    text = "".join(_content(e) for _i, e in first) + "".join(_content(e) for _i, e in rest)
    assert text == reference
    ids = [int(i) for i, _e in first + rest if i is not None]
    assert ids == sorted(ids)
    # a session that ended: 409 on cancel, and ?after=0 replays everything
    assert (await d.client.delete(f"/v1/sessions/{sid}/generation")).status_code == 409
    async with d.client.stream("GET", f"/v1/sessions/{sid}/stream?after=0") as r:
        again, done = await read_sse(r)
    assert done and "".join(_content(e) for _i, e in again) == reference
    d.scope.cancel()


async def test_explicit_stop_and_resume_ttl(nursery: trio.Nursery) -> None:
    d = await start_daemon(nursery, mock_config("mock?step_ms=5", resume_ttl_s=0.5))
    body = {**CHAT, "max_tokens": 100000, "stream": True}
    async with d.client.stream("POST", "/v1/chat/completions", json=body, headers=RESUMABLE) as r:
        sid_a = r.headers["x-superfluid-session"]
        await read_sse(r, limit=2)
    r = await d.client.delete(f"/v1/sessions/{sid_a}/generation")
    assert r.status_code == 200
    async with d.client.stream("POST", "/v1/chat/completions", json=body, headers=RESUMABLE) as r:
        sid_b = r.headers["x-superfluid-session"]
        await read_sse(r, limit=2)
    with trio.fail_after(10):  # nobody follows b: cancelled after the TTL
        while (await d.client.get(f"/v1/sessions/{sid_b}")).json()["generating"]:
            await trio.sleep(0.1)
    for sid in (sid_a, sid_b):
        assert (await d.client.get(f"/v1/sessions/{sid}")).json()["finish_reason"] == "cancelled"
    d.scope.cancel()


def _spawn(port: int, sessions: Path, log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "superfluid", "serve", "mock?step_ms=10&prefill_us=5", "--runtime", "mock",
         "--http", f"127.0.0.1:{port}", "--sessions", str(sessions), "--log-level", "WARNING",
         "--agent-stream-interval-ms", "40"],  # these tests act in the middle of a stream
        stdout=open(log, "ab"), stderr=subprocess.STDOUT, start_new_session=True,
    )


def _reap(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL a daemon's whole process group (workers too) and reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


async def _wait_ready(url: str, proc: subprocess.Popen[bytes]) -> None:
    with trio.fail_after(60):
        await wait_healthy(url, proc)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_daemon_sigkill_then_resume_each_session_by_id(tmp_path: Path) -> None:
    """SIGKILL the daemon's process group mid-streams, restart it on the same
    sessions dir, resume each session by id: the text equals an uninterrupted run."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    sessions = tmp_path / "sessions"
    log = tmp_path / "daemon.log"
    bodies = [{**CHAT, "messages": [{"role": "user", "content": f"story {i}"}], "max_tokens": 150, "stream": True}
              for i in range(4)]
    proc = _spawn(port, sessions, log)
    try:
        await _wait_ready(url, proc)
        async with httpx.AsyncClient(base_url=url, timeout=30) as c:
            refs = []
            for b in bodies:
                async with c.stream("POST", "/v1/chat/completions", json=b) as r:
                    refs.append(stream_text(await sse_events(r)))
            seen: dict[str, tuple[str, str]] = {}

            async def partial(i: int) -> None:
                async with c.stream("POST", "/v1/chat/completions", json=bodies[i], headers=RESUMABLE) as r:
                    sid = r.headers["x-superfluid-session"]
                    events, _done = await read_sse(r, limit=15)
                    seen[sid] = ("".join(_content(e) for _i, e in events), events[-1][0] or "0")
                    refs_by_sid[sid] = refs[i]

            refs_by_sid: dict[str, str] = {}
            async with trio.open_nursery() as n:
                for i in range(4):
                    n.start_soon(partial, i)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        proc = _spawn(port, sessions, log)
        await _wait_ready(url, proc)
        async with httpx.AsyncClient(base_url=url, timeout=30) as c:
            for sid, (head, last_id) in seen.items():
                async with c.stream("GET", f"/v1/sessions/{sid}/stream", headers={"Last-Event-ID": last_id}) as r:
                    assert r.status_code == 200, await r.aread()
                    rest, done = await read_sse(r)
                assert done
                assert head + "".join(_content(e) for _i, e in rest) == refs_by_sid[sid]
    finally:
        _reap(proc)
    async with open_journal(sessions) as journal:
        for sid in seen:
            ids = [rec.event_id for rec in journal.sessions[sid].events]
            assert ids == list(range(len(ids))), "no duplicate or missing event ids"
            assert journal.sessions[sid].text == refs_by_sid[sid]


def test_corrupt_log_refuses_to_start_and_sessions_cache_starts_fresh(tmp_path: Path) -> None:
    sessions = tmp_path / "s"
    sessions.mkdir()
    from superfluid.proto._wal import MAGIC, WalRecord, body_created, encode_record

    recs = [encode_record(WalRecord(session="a", event_id=i, epoch=1, ts=0,
                                    body=body_created(params={}, klass="agent", model="mock") if i == 0 else
                                    {"type": "cancelled"})) for i in range(2)]
    data = bytearray(MAGIC + recs[0] + recs[1])
    data[len(MAGIC) + 20] ^= 0xFF  # flip a byte inside the first record's payload
    (sessions / "wal.log").write_bytes(bytes(data))
    argv = [sys.executable, "-m", "superfluid", "serve", "--runtime", "mock", "--http", "127.0.0.1:0",
            "--sessions", str(sessions)]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "--sessions-cache" in r.stderr
    proc = subprocess.Popen([*argv, "--sessions-cache"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        import time

        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not any(p.name.startswith("wal.log.corrupt") for p in sessions.iterdir()):
            time.sleep(0.1)
        assert any(p.name.startswith("wal.log.corrupt") for p in sessions.iterdir())
        assert proc.poll() is None
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(15)


async def test_a_finished_session_replays_from_the_log_after_a_restart(nursery: trio.Nursery, tmp_path: Path) -> None:
    d = await start_daemon(nursery, mock_config(sessions=tmp_path))
    async with d.client.stream("POST", "/v1/chat/completions", json={**CHAT, "max_tokens": 30, "stream": True},
                               headers=RESUMABLE) as r:
        sid = r.headers["x-superfluid-session"]
        events, done = await read_sse(r)
    assert done
    text = "".join(_content(e) for _i, e in events)
    d.scope.cancel()
    await trio.sleep(0.5)
    d2 = await start_daemon(nursery, mock_config(sessions=tmp_path))
    async with d2.client.stream("GET", f"/v1/sessions/{sid}/stream", headers={"Last-Event-ID": "10"}) as r:
        assert r.status_code == 200
        rest, done = await read_sse(r)
    assert done
    assert text.endswith("".join(_content(e) for _i, e in rest))
    assert rest[-1][1]["choices"][0]["finish_reason"] == "length"
    d2.scope.cancel()


async def test_after_a_restart_only_resumable_sessions_generate_on(tmp_path: Path) -> None:
    """A stream that did not opt in lost its client with the daemon: on restart
    it is logged cancelled, not re-run (a resend then decodes as alone as it did
    before the crash); one that opted in continues into the log."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    sessions = tmp_path / "sessions"
    log = tmp_path / "daemon.log"
    body = {**CHAT, "max_tokens": 400, "stream": True}
    proc = _spawn(port, sessions, log)
    try:
        await _wait_ready(url, proc)
        sids: dict[bool, str] = {}
        reading = [trio.Event(), trio.Event()]
        killed = trio.Event()
        async with httpx.AsyncClient(base_url=url, timeout=30) as c:
            async def cut(resumable: bool) -> None:
                # the client is still connected when the daemon dies
                async with c.stream("POST", "/v1/chat/completions", json=body,
                                    headers=RESUMABLE if resumable else {}) as r:
                    sids[resumable] = r.headers.get("x-superfluid-session", "")
                    await read_sse(r, limit=5)
                    reading[resumable].set()
                    await killed.wait()

            with trio.fail_after(20):
                async with trio.open_nursery() as n:
                    n.start_soon(cut, True)
                    n.start_soon(cut, False)
                    for event in reading:
                        await event.wait()
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    killed.set()
        proc = _spawn(port, sessions, log)
        await _wait_ready(url, proc)
        async with httpx.AsyncClient(base_url=url, timeout=30) as c:
            async with c.stream("GET", f"/v1/sessions/{sids[True]}/stream") as r:
                _rest, done = await read_sse(r)
            assert done
    finally:
        _reap(proc)
    async with open_journal(sessions) as journal:
        kept = journal.sessions[sids[True]]
        [dropped] = [s for s in journal.sessions.values()
                     if s.created is not None and not s.created["params"]["resumable"]]
        assert kept.finish == "length" and len(kept.generated_tokens) == 400
        assert dropped.finish == "cancelled" and 0 < len(dropped.generated_tokens) < 400
