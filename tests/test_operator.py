"""What an operator sees: CLI errors, --version and help, access lines, JSON logs,
the session list, and session inspect/export from the log (SPEC.md §11)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import socket
import stat
import sys
from pathlib import Path

import attrs
import httpx
import pytest
import trio
from trio_websocket import open_websocket_url

import superfluid
from superfluid.cli._main import build_parser
from superfluid.daemon import _logs
from superfluid.serving import ApiKey

from .conftest import mock_config, sse_events, start_daemon

CHAT = {"model": "mock", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0}


async def _cli(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    proc = await trio.run_process([sys.executable, "-m", "superfluid", *args], check=False, capture_stdout=True,
                                  capture_stderr=True, env={**os.environ, **(env or {})})
    return proc.returncode, proc.stdout.decode(), proc.stderr.decode()


async def test_every_cli_error_is_one_line_and_an_exit_code(tmp_path: Path) -> None:
    not_gguf = tmp_path / "not-a-model.gguf"
    not_gguf.write_bytes(b"this is not a GGUF file")
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    cases: list[tuple[list[str], int, str]] = [
        (["serv"], 2, "unknown command 'serv' (did you mean serve?)"),
        (["serve", "--max-bach", "3"], 2, "unknown option --max-bach (did you mean --max-batch?)"),
        (["session", "inspekt", "x"], 2, "(did you mean inspect?)"),
        (["serve", "--runtime", "vllm"], 2, "unknown runtime 'vllm'"),
        (["serve", "--runtime", "mocc"], 2, "unknown runtime 'mocc'"),
        (["serve", "--max-batch", "x"], 2, "invalid int value: 'x'"),
        (["serve", "--log-level", "loud"], 2, "--log-level"),
        ([], 2, "missing command"),
        (["serve", str(tmp_path / "missing.gguf")], 1, "model file not found"),
        (["serve", str(tmp_path), "--sessions", str(tmp_path / "s3")], 1, "is not a model"),  # a directory
        # told by its magic before a runtime is chosen or a worker started (#47)
        (["serve", str(not_gguf), "--sessions", str(tmp_path / "s1"), "--log-level", "ERROR"], 1, "is not a model"),
        (["serve", "--runtime", "mock", "--port", str(port), "--sessions", str(tmp_path / "s2")], 1,
         f"cannot listen on 127.0.0.1:{port}: the address is already in use"),
        (["session", "inspect", "s-nope", "--sessions", str(tmp_path / "none")], 1, "no session log"),
    ]
    if os.geteuid() != 0:  # root reads anything
        locked = tmp_path / "locked.gguf"
        locked.write_bytes(b"x")
        locked.chmod(0)
        cases.append((["serve", str(locked)], 1, "is not readable"))
    results: dict[int, tuple[int, str, str]] = {}

    async def run(i: int) -> None:
        results[i] = await _cli(*cases[i][0])

    with trio.fail_after(180):
        async with trio.open_nursery() as nursery:
            for i in range(len(cases)):
                nursery.start_soon(run, i)
    busy.close()
    for i, (args, code, text) in enumerate(cases):
        rc, _out, err = results[i]
        assert rc == code, (args, rc, err)
        assert text in err, (args, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("superfluid"), (args, err)


async def test_version_and_every_serve_flag_has_help_with_its_default() -> None:
    rc, out, _err = await _cli("--version")
    assert rc == 0 and out.strip() == f"superfluid {superfluid.__version__}"
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    serve = sub.choices["serve"]
    formatter = serve._get_formatter()
    for action in serve._actions:
        if not action.option_strings or action.dest == "help":
            continue
        text = formatter._get_help_string(action) or ""
        assert len(text) > 15, f"{action.option_strings[0]} has no help"
        switch = isinstance(action, (argparse._StoreTrueAction, argparse.BooleanOptionalAction))
        assert switch or "default" in text, f"{action.option_strings[0]}: no default in {text!r}"
    assert "(default: 8453)" in " ".join(serve.format_help().split())


async def test_every_generating_route_writes_an_access_line_with_its_qos(nursery: trio.Nursery,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="superfluid.access")
    d = await start_daemon(nursery, mock_config())
    qos = {"x-superfluid-qos": "background"}
    await d.client.post("/v1/chat/completions", json=CHAT, headers=qos)
    await d.client.post("/v1/completions", json={"model": "mock", "prompt": "hi", "max_tokens": 5})
    await d.client.post("/v1/messages", json={**CHAT, "stream": False})
    await d.client.post("/v1/responses", json={"model": "mock", "input": "hi", "max_output_tokens": 5})
    await d.client.post("/api/generate", json={"model": "mock", "prompt": "hi", "stream": False,
                                               "options": {"num_predict": 5}})
    await d.client.post("/api/chat", json={"model": "mock", "messages": CHAT["messages"], "stream": False,
                                           "options": {"num_predict": 5}})
    async with d.client.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True},
                               headers={"x-superfluid-resumable": "true", "x-superfluid-qos": "interactive"}) as r:
        sid = r.headers["x-superfluid-session"]
        await sse_events(r)
    async with d.client.stream("GET", f"/v1/sessions/{sid}/stream") as r:
        await sse_events(r)
    conv = (await d.client.post("/v1/sessions", json={"model": "mock", "messages": CHAT["messages"]})).json()["id"]
    assert (await d.client.post(f"/v1/sessions/{conv}/generate", json={"max_tokens": 5})).status_code == 200
    async with open_websocket_url(d.url.replace("http", "ws") + "/v1/ws") as ws:
        await ws.send_message(json.dumps({"op": "generate", "body": CHAT}))
        while json.loads(await ws.get_message())["op"] != "done":
            pass
    await d.client.post("/v1/chat/completions", json={"model": "nope", "messages": CHAT["messages"]})
    await d.client.get("/health")

    def lines() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "superfluid.access"]

    with trio.fail_after(5):
        while len(lines()) < 12:
            await trio.sleep(0.01)
    pattern = re.compile(r"<-- (\d+) (POST|GET|WS) (\S+) qos=(\w+) model=mock prompt=\d+ cached=\d+ completion=(\d+) "
                         r"ttft=\d+ms prefill=[\d.]+ tok/s decode=[\d.]+ tok/s total=\d+ms finish=(\w+)")
    seen = {(m.group(2), m.group(3), m.group(4)) for m in map(pattern.fullmatch, lines()) if m}
    assert seen >= {
        ("POST", "/v1/chat/completions", "background"), ("POST", "/v1/completions", "agent"),
        ("POST", "/v1/messages", "agent"), ("POST", "/v1/responses", "agent"), ("POST", "/api/generate", "agent"),
        ("POST", "/api/chat", "agent"), ("POST", "/v1/chat/completions", "interactive"),
        ("GET", f"/v1/sessions/{sid}/stream", "interactive"), ("POST", f"/v1/sessions/{conv}/generate", "agent"),
        ("WS", "/v1/ws", "agent"),
    }, "\n".join(lines())
    assert any(re.fullmatch(r"<-- 404 POST /v1/chat/completions total=\d+ms error=model_not_found", x) for x in lines())
    assert not any("/health" in x for x in lines())  # not a generating route: DEBUG
    d.scope.cancel()


def test_log_dir_writes_private_rotated_json_lines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_logs, "ROTATE_BYTES", 4096)
    directory = tmp_path / "logs"
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    try:
        _logs.configure_logging("INFO", directory, stream=open(os.devnull, "w"))  # noqa: SIM115
        access = logging.getLogger("superfluid.access")
        for i in range(60):
            access.info("<-- 200 POST /v1/messages", extra={"access": {
                "method": "POST", "path": "/v1/messages", "status": 200, "qos": "agent", "model": "mock",
                "prompt_tokens": i, "completion_tokens": 5, "duration_ms": 12.5, "ttft_ms": 3.0}})
        logging.getLogger("superfluid").debug("not written at INFO")
    finally:
        _logs.close_logging()
        root.setLevel(level)
        root.handlers[:] = handlers
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    files = sorted(directory.iterdir())
    assert [f.name for f in files][:2] == ["superfluid.jsonl", "superfluid.jsonl.1"]  # rotated by size
    assert all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files)
    records = [json.loads(line) for f in reversed(files) for line in f.read_text().splitlines()]
    assert [r["prompt_tokens"] for r in records] == list(range(60 - len(records), 60))
    assert {"ts", "level", "logger", "msg", "method", "path", "status", "qos", "model", "completion_tokens",
            "duration_ms", "ttft_ms"} <= set(records[-1])


KEYS = (ApiKey.from_secret("a", "ka"), ApiKey.from_secret("b", "kb"))


async def test_sessions_list_is_paged_newest_first_and_per_tenant(nursery: trio.Nursery) -> None:
    d = await start_daemon(nursery, attrs.evolve(mock_config(), api_keys=KEYS))
    a = httpx.AsyncClient(base_url=d.url, headers={"authorization": "Bearer ka"})
    b = httpx.AsyncClient(base_url=d.url, headers={"authorization": "Bearer kb"})
    made = []
    for n in (3, 4, 5):
        r = await a.post("/v1/chat/completions", json={**CHAT, "max_tokens": n})
        made.append((r.json()["usage"]["prompt_tokens"], n))
        await trio.sleep(0.002)
    conv = (await a.post("/v1/sessions", json={"model": "mock"})).json()["id"]
    await b.post("/v1/chat/completions", json=CHAT)
    first = (await a.get("/v1/sessions", params={"limit": 2})).json()
    assert first["has_more"] and [s["kind"] for s in first["data"]] == ["conversation", "chat"]
    assert first["data"][0]["id"] == conv and first["data"][0]["state"] == "conversation"
    newest = first["data"][1]
    assert newest["state"] == "finished" and newest["model"] == "mock" and newest["completion_tokens"] == 5
    assert newest["qos"] == "agent" and isinstance(newest["created"], int) and newest["finish_reason"] == "length"
    rest = (await a.get("/v1/sessions", params={"limit": 2, "after": first["last_id"]})).json()
    assert not rest["has_more"] and [s["completion_tokens"] for s in rest["data"]] == [4, 3]
    theirs = (await b.get("/v1/sessions")).json()["data"]
    assert len(theirs) == 1 and theirs[0]["id"] not in {s["id"] for s in first["data"] + rest["data"]}
    bad = await b.get("/v1/sessions", params={"after": conv})  # another tenant's id is no cursor
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "after"
    assert (await a.get("/v1/sessions", params={"limit": 0})).status_code == 400
    assert (await httpx.AsyncClient(base_url=d.url).get("/v1/sessions")).status_code == 401
    for c in (a, b):
        await c.aclose()
    d.scope.cancel()


async def test_session_inspect_and_export_read_the_log_offline_beside_a_running_daemon(
        nursery: trio.Nursery, tmp_path: Path) -> None:
    sessions = tmp_path / "sessions"
    d = await start_daemon(nursery, mock_config(sessions=sessions))
    async with d.client.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True},
                               headers={"x-superfluid-resumable": "true"}) as r:
        sid = r.headers["x-superfluid-session"]
        text = "".join(e["choices"][0]["delta"].get("content") or "" for e in await sse_events(r) if e["choices"])
    with trio.fail_after(5):  # the session's end is logged after the stream's last byte
        while (await d.client.get(f"/v1/sessions/{sid}")).json()["generating"]:
            await trio.sleep(0.01)
    rc, out, err = await _cli("session", "inspect", sid, "--json", "--sessions", str(sessions))
    assert rc == 0, err
    info = json.loads(out)
    assert info["id"] == sid and info["state"] == "finished" and info["model"] == "mock"
    assert info["completion_tokens"] == 5 and info["resumable"] and info["daemon_pid"] == os.getpid()
    rc, out, err = await _cli("session", "inspect", sid, "--sessions", str(sessions))
    assert rc == 0 and out.startswith(f"session {sid} (chat): finished, finish length"), out
    out_dir = tmp_path / "exports"
    rc, _out, err = await _cli("session", "export", sid, "--format", "jsonl", "--out", str(out_dir),
                               "--sessions", str(sessions))
    assert rc == 0, err
    target = out_dir / f"{sid}.jsonl"
    assert stat.S_IMODE(out_dir.stat().st_mode) == 0o700 and stat.S_IMODE(target.stat().st_mode) == 0o600
    events = [json.loads(line) for line in target.read_text().splitlines()]
    assert [e["type"] for e in events][:2] == ["created", "prompt"] and events[-1]["type"] in ("finished", "generated")
    assert [e["event_id"] for e in events] == list(range(len(events)))
    assert not any("text" in e or "tokens" in e for e in events) and sum(
        e.get("n_tokens", 0) for e in events if e["type"] == "generated") == 5
    rc, out, err = await _cli("session", "export", sid, "--include-content", "--sessions", str(sessions))
    assert rc == 0, err
    full = [json.loads(line) for line in out.splitlines()]
    assert "".join(e["text"] for e in full if e["type"] == "generated") == text
    d.scope.cancel()
