"""Ctrl-C ends every in-flight stream properly (SPEC.md §2 "Daemon shutdown").

A real daemon subprocess (mock runtime, slow tokens) serves streams in every
dialect; SIGINT goes to its whole process group, as a terminal's Ctrl-C does
(workers included). Each stream must end with its dialect's typed
``server_shutting_down`` error (then ``[DONE]`` where the dialect has one), a
waiting non-streamed request with a 503 typed body, and the daemon must exit 0
within the grace; a resumable session resumes after the restart.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import trio

from .conftest import wait_healthy
from trio_websocket import ConnectionClosed, HandshakeError, open_websocket_url

pytestmark = pytest.mark.slow

GRACE_S = 3.0
MSGS = [{"role": "user", "content": "tell me a long story"}]
LONG = 5000


def _spawn(port: int, sessions: Path, err: Path, *extra: str, env: dict[str, str] | None = None,
           spec: str = "mock?step_ms=20&prefill_us=5&eos_every=100000") -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "superfluid", "serve", spec, "--port", str(port),
         "--sessions", str(sessions), "--shutdown-grace", str(GRACE_S), "--stream-interval-ms", "0",
         "--agent-stream-interval-ms", "0", *extra],
        stdout=subprocess.DEVNULL, stderr=open(err, "ab"), start_new_session=True,  # noqa: SIM115
        env=None if env is None else {**os.environ, **env})


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _wait_ready(url: str, proc: subprocess.Popen[bytes]) -> None:
    with trio.fail_after(90):
        await wait_healthy(url, proc)


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _sse_data(raw: str) -> list[str]:
    return [line[len("data: "):] for line in raw.splitlines() if line.startswith("data: ")]


async def test_ctrl_c_ends_every_stream_typed_and_a_resumable_one_resumes_after_restart(tmp_path: Path) -> None:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    sessions, err = tmp_path / "sessions", tmp_path / "daemon.err"
    proc = _spawn(port, sessions, err)
    try:
        await _wait_ready(url, proc)
        raw: dict[str, str] = {}
        status: dict[str, int] = {}
        headers: dict[str, httpx.Headers] = {}
        flowing: dict[str, trio.Event] = {}
        chat = {"model": "mock", "messages": MSGS, "max_tokens": LONG, "temperature": 0}
        requests = {
            "chat": ("/v1/chat/completions", {**chat, "stream": True}, {}),
            "completions": ("/v1/completions", {"model": "mock", "prompt": "once upon", "max_tokens": LONG,
                                                "ignore_eos": True, "stream": True}, {}),
            "anthropic": ("/v1/messages", {"model": "mock", "messages": MSGS, "max_tokens": LONG, "stream": True}, {}),
            "responses": ("/v1/responses", {"model": "mock", "input": "a story", "max_output_tokens": LONG,
                                            "stream": True}, {}),
            "ollama": ("/api/chat", {"model": "mock", "messages": MSGS, "options": {"num_predict": LONG}}, {}),
            "resumable": ("/v1/chat/completions", {**chat, "max_tokens": 200, "stream": True},
                          {"x-superfluid-resumable": "true"}),
            "whole": ("/v1/chat/completions", chat, {}),
        }

        async def run(name: str, client: httpx.AsyncClient) -> None:
            path, body, extra = requests[name]
            async with client.stream("POST", path, json=body, headers=extra) as r:
                status[name], headers[name] = r.status_code, r.headers
                parts: list[str] = []
                async for chunk in r.aiter_text():
                    parts.append(chunk)
                    if "".join(parts).count("\n") >= 6:
                        flowing[name].set()
                raw[name] = "".join(parts)
            flowing[name].set()

        ws_messages: list[dict] = []
        ws_closed: list[int | None] = []

        async def run_ws() -> None:
            async with open_websocket_url(url.replace("http", "ws") + "/v1/ws") as ws:
                await ws.send_message(json.dumps({"op": "generate", "body": {**chat, "stream": True}}))
                try:
                    while True:
                        ws_messages.append(json.loads(await ws.get_message()))
                        if sum(m["op"] == "delta" for m in ws_messages) >= 3:
                            flowing["ws"].set()
                except ConnectionClosed as exc:
                    ws_closed.append(exc.reason.code)
            flowing["ws"].set()

        with trio.fail_after(60):
            async with httpx.AsyncClient(base_url=url, timeout=60) as client, trio.open_nursery() as nursery:
                for name in requests:
                    flowing[name] = trio.Event()
                    nursery.start_soon(run, name, client)
                flowing["ws"] = trio.Event()
                nursery.start_soon(run_ws)
                for name in flowing:
                    if name != "whole":
                        await flowing[name].wait()
                assert not ws_closed
                await trio.sleep(0.3)  # the non-streamed one is admitted and generating too
                assert not any(name in raw for name in requests), ("a stream ended before the signal", {k: v[-300:] for k, v in raw.items()})
                os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the whole foreground process group
                signalled = trio.current_time()
                with trio.fail_after(GRACE_S + 10):
                    while proc.poll() is None:
                        await trio.sleep(0.05)
                exited_after = trio.current_time() - signalled
        assert proc.returncode == 0, err.read_text()
        assert exited_after < GRACE_S + 5

        for name in ("chat", "completions", "resumable"):
            data = _sse_data(raw[name])
            assert data[-1] == "[DONE]", (name, raw[name][-400:])
            assert json.loads(data[-2])["error"]["code"] == "server_shutting_down", (name, data[-2])
        anthropic = raw["anthropic"].rstrip().splitlines()
        assert anthropic[-2] == "event: error", raw["anthropic"][-400:]
        error = json.loads(anthropic[-1][len("data: "):])
        assert error["type"] == "error" and error["error"]["message"].startswith("server_shutting_down")
        events = [json.loads(d) for d in _sse_data(raw["responses"])]
        assert [e["type"] for e in events[-2:]] == ["error", "response.failed"], raw["responses"][-400:]
        assert events[-2]["code"] == "server_shutting_down"
        last = json.loads(raw["ollama"].strip().splitlines()[-1])
        assert last["error"].startswith("server_shutting_down"), raw["ollama"][-400:]
        assert ws_messages[-1]["op"] == "error" and ws_messages[-1]["error"]["code"] == "server_shutting_down"
        assert ws_closed == [1001], ws_closed
        assert status["whole"] == 503 and json.loads(raw["whole"])["error"]["code"] == "server_shutting_down"

        log = err.read_text()
        assert "Traceback" not in log and "KeyboardInterrupt" not in log, log
        assert log.count("Running on ") == 1, log  # the startup summary's; hypercorn's is dropped
        assert f"  Running on {url} " in log and "  model mock (default): runtime mock" in log, log
        assert "tokens per lane, 8 lanes" in log and f"  sessions: {sessions}\n" in log and "  auth: off" in log
        assert "Anthropic /v1/messages" in log and "Ollama /api/chat" in log
        assert f"  page: {url}/ui/ " in log, log   # the built-in page, where a browser finds it
        assert log.count("finish=server_shutting_down") == 8, log  # the WebSocket's too

        # the resumable session was not ended: after a restart it resumes from the cursor the client saw
        sid = headers["resumable"]["x-superfluid-session"]
        ids = [line[len("id: "):] for line in raw["resumable"].splitlines() if line.startswith("id: ")]
        head = "".join((json.loads(d)["choices"][0]["delta"].get("content") or "")
                       for d in _sse_data(raw["resumable"])[:-2])
        proc = _spawn(port, sessions, err)
        await _wait_ready(url, proc)
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            listed = (await client.get("/v1/sessions", params={"limit": 20})).json()["data"]
            assert {s["id"]: s["state"] for s in listed}[sid] in ("generating", "finished")
            with trio.fail_after(60):
                async with client.stream("GET", f"/v1/sessions/{sid}/stream",
                                         headers={"last-event-id": ids[-1]}) as r:
                    assert r.status_code == 200
                    tail_raw = "".join([c async for c in r.aiter_text()])
            data = _sse_data(tail_raw)
            assert data[-1] == "[DONE]" and json.loads(data[-2])["choices"][0]["finish_reason"] == "length", tail_raw
            tail = "".join((json.loads(d)["choices"][0]["delta"].get("content") or "") for d in data[:-1])
            reference = (await client.post("/v1/chat/completions", json={**chat, "max_tokens": 200})).json()
            assert head + tail == reference["choices"][0]["message"]["content"]
    finally:
        _kill_group(proc)


async def test_a_worker_whose_engine_is_stuck_does_not_outlive_a_killed_daemon(tmp_path: Path) -> None:
    """A worker whose link ends exits within its grace even when its engine thread is
    stuck inside a runtime call (SPEC.md §2 "Worker lifetime"): the daemon is SIGKILLed
    (no Shutdown, no reaping) while the mock engine hangs mid-generation; a thread cannot
    be cancelled, and without the grace the worker sat in that call for good."""
    import psutil

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _spawn(port, tmp_path / "sessions", tmp_path / "daemon.err", "--hang-timeout", "600",
                  env={"SUPERFLUID_WORKER_EXIT_GRACE_S": "1"}, spec="mock?step_ms=5&prefill_us=5&eos_every=100000")
    workers: list[psutil.Process] = []
    try:
        await _wait_ready(url, proc)
        body = {"model": "mock", "messages": [{"role": "user", "content": "[[mock:hang_after=3]] go"}],
                "max_tokens": 50, "stream": True}
        with trio.fail_after(30):
            async with httpx.AsyncClient(base_url=url, timeout=30) as client:
                async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                    seen = ""
                    chunks = r.aiter_text()   # kept: a dropped iterator is finalized, which closes the stream
                    while seen.count('"content"') < 4:   # the role chunk, then 3 tokens: the engine hangs next
                        seen += await chunks.__anext__()
                    # The stream stays open until the daemon is killed: closing it cancels the
                    # request, and a Cancel that reached the worker before token 3 spared the
                    # engine its hang (on a loaded machine the test then passed without the grace).
                    workers = [p for p in psutil.Process(proc.pid).children(recursive=True)
                               if any("superfluid-worker-mock" in part for part in p.cmdline())]
                    assert workers, "no worker found"
                    await trio.sleep(0.5)
                    assert all(w.is_running() and w.status() != psutil.STATUS_ZOMBIE for w in workers)  # stuck
                    os.kill(proc.pid, signal.SIGKILL)
                    proc.wait()
        with trio.fail_after(15):           # the grace is 1 s; without it the worker never exits
            while any(w.is_running() and w.status() != psutil.STATUS_ZOMBIE for w in workers):
                await trio.sleep(0.1)
    finally:
        _kill_group(proc)
        for w in workers:
            try:
                w.kill()
            except psutil.NoSuchProcess:
                pass


async def test_sigusr2_logs_where_every_task_waits_and_each_models_scheduler(tmp_path: Path) -> None:
    """SIGUSR2 writes the task tree (each task's await chain, with its job) and every model's
    scheduler state to the log, and the daemon serves on (SPEC.md §2, "SIGUSR2")."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    err = tmp_path / "daemon.err"
    proc = _spawn(port, tmp_path / "sessions", err, spec="mock?step_ms=50&prefill_us=5&eos_every=100000")
    try:
        await _wait_ready(url, proc)
        body = {"model": "mock", "prompt": "once upon", "max_tokens": 400, "stream": True}
        with trio.fail_after(30):
            async with httpx.AsyncClient(base_url=url, timeout=30) as client:
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    chunks = r.aiter_text()             # kept: a dropped iterator closes the response
                    await chunks.__anext__()            # one request is streaming
                    os.kill(proc.pid, signal.SIGUSR2)
                    while "SIGUSR2: tasks and schedulers" not in err.read_text():   # (one block: all of it)
                        await trio.sleep(0.05)
                assert (await client.get("/health")).status_code == 200
        text = err.read_text()
        dump = text[text.index("SIGUSR2: tasks and schedulers"):]
        [handler] = [line for line in dump.splitlines() if "completions@superfluid/api/_openai.py" in line]
        assert "[job 1]" in handler                     # the request's task, down to the frame holding its job
        assert "_serve_signals@superfluid/daemon/_server.py" in dump
        assert "running {" in dump and "'RUNNING'" in dump
    finally:
        _kill_group(proc)


async def test_sigterm_while_websockets_close_exits_0(tmp_path: Path) -> None:
    """SIGTERM landing while WebSockets close (code-review.md §2.4 D4): the stop task only sets
    an event each socket watches in its own nursery, so it never meets a socket's closed
    nursery; the daemon exits 0 with no traceback. 150 sockets close at once around the
    signal: before the fix this exited 1 with "RuntimeError: Nursery is closed to new
    arrivals" in about 4 runs of 5 (tests/test_ws_shutdown.py hits the window every time)."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    err = tmp_path / "daemon.err"
    proc = _spawn(port, tmp_path / "sessions", err)
    try:
        await _wait_ready(url, proc)
        n_sockets = 150
        opened, all_open, close_now = 0, trio.Event(), trio.Event()

        async def open_and_close() -> None:
            nonlocal opened
            with trio.move_on_after(GRACE_S + 15):  # a handshake the exiting daemon never answers
                try:
                    async with open_websocket_url(url.replace("http", "ws") + "/v1/ws"):
                        opened += 1
                        if opened == n_sockets:
                            all_open.set()
                        await close_now.wait()
                except (ConnectionClosed, HandshakeError, OSError, trio.BrokenResourceError):
                    pass  # the daemon closed (or stopped accepting) first

        with trio.fail_after(GRACE_S + 30):
            async with trio.open_nursery() as nursery:
                for _ in range(n_sockets):
                    nursery.start_soon(open_and_close)
                await all_open.wait()
                close_now.set()  # every client closes at once ...
                await trio.sleep(0.01)
                os.kill(proc.pid, signal.SIGTERM)  # ... and the signal lands while the daemon closes them
            while proc.poll() is None:
                await trio.sleep(0.05)
        assert opened == n_sockets
        assert proc.returncode == 0, err.read_text()
        assert "Traceback" not in err.read_text(), err.read_text()
    finally:
        _kill_group(proc)
