"""``superfluid launch`` and ``superfluid stop``: each agent's environment and command
(``--print``), a fake agent executable run for real through ``launch`` against a daemon
launch started itself, and ``stop`` stopping that daemon and never another process."""

from __future__ import annotations

import json
import os
import re
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import trio

from .conftest import mock_config, open_daemon
from .test_sessions import _free_port

ROOT = Path(__file__).resolve().parent.parent


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SUPERFLUID_")}
    env.update(SUPERFLUID_HOME=str(tmp_path / "home"), PYTHONPATH=str(ROOT), **extra)
    return env


async def _cli(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[bytes]:
    return await trio.run_process([sys.executable, "-m", "superfluid", *args], capture_stdout=True,
                                  capture_stderr=True, check=False, env=_env(tmp_path, **env))


def _exports(out: str) -> dict[str, str]:
    return {m[1]: shlex.split(m[2])[0] if m[2] else "" for m in re.finditer(r"^export (\w+)=(.*)$", out, re.M)}


def _private_json(path: Path) -> dict:
    """A per-run file's JSON, after checking it is 0600 in a 0700 directory."""
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    return json.loads(path.read_text())


async def test_launch_print_for_each_agent(tmp_path: Path) -> None:
    """--print against a running daemon: base URL, token, model (in every Claude tier variable),
    context size, the per-run opencode config (0600, the key by reference only), codex's provider
    flags, Ollama's host; the small-window warning; unknown agents refused with a suggestion."""
    async with open_daemon(mock_config("mock?n_ctx=8192")) as d:
        http = d.url.removeprefix("http://")
        claude = await _cli(tmp_path, "launch", "claude", "--http", http, "--print", "--", "-p", "hi there")
        out = claude.stdout.decode()
        assert claude.returncode == 0, claude.stderr
        env = _exports(out)
        assert env["ANTHROPIC_BASE_URL"] == d.url and env["ANTHROPIC_AUTH_TOKEN"] == "superfluid"
        for tier in ("ANTHROPIC_MODEL", "ANTHROPIC_SMALL_FAST_MODEL", "ANTHROPIC_DEFAULT_OPUS_MODEL",
                     "ANTHROPIC_DEFAULT_SONNET_MODEL", "ANTHROPIC_DEFAULT_HAIKU_MODEL", "CLAUDE_CODE_SUBAGENT_MODEL"):
            assert env[tier] == "mock"
        assert env["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] == "8192" and env["CLAUDE_CODE_ATTRIBUTION_HEADER"] == "0"
        assert "unset ANTHROPIC_API_KEY" in out
        assert out.rstrip().splitlines()[-1] == "claude -p 'hi there'"
        assert "8192-token context; claude wants at least 32768" in claude.stderr.decode()

        codex = (await _cli(tmp_path, "launch", "codex-cli", "--http", http, "--print")).stdout.decode()
        command = shlex.split(codex.rstrip().splitlines()[-1])
        assert command[0] == "codex"
        flags = dict(f.split("=", 1) for f in command[2::2])
        assert flags["model_provider"] == '"superfluid"' and flags["model"] == '"mock"'
        assert flags["model_providers.superfluid.base_url"] == f'"{d.url}/v1"'
        assert flags["model_providers.superfluid.wire_api"] == '"responses"'
        assert flags["model_context_window"] == "8192"

        opencode = (await _cli(tmp_path, "launch", "opencode", "--http", http, "--print",
                               SUPERFLUID_API_KEY="")).stdout.decode()
        path = Path(_exports(opencode)["OPENCODE_CONFIG"])
        config = _private_json(path)
        assert path.is_relative_to(tmp_path / "home" / "launch")
        provider = config["provider"]["superfluid"]
        assert provider["options"] == {"baseURL": f"{d.url}/v1", "apiKey": "{env:SUPERFLUID_API_KEY}"}
        assert provider["models"]["mock"]["limit"]["context"] == 8192 and config["model"] == "superfluid/mock"

        ollama = (await _cli(tmp_path, "launch", "ollama", "--http", http, "--print")).stdout.decode()
        assert _exports(ollama)["OLLAMA_HOST"] == d.url and ollama.rstrip().endswith("ollama run mock")
        for agent in ("cline", "clawdbot"):
            chat = await _cli(tmp_path, "launch", agent, "--http", http, "--print")
            env = _exports(chat.stdout.decode())
            assert env["OPENAI_BASE_URL"] == f"{d.url}/v1" and env["OPENAI_MODEL"] == "mock", agent
            assert env["SUPERFLUID_CONTEXT"] == "8192"
        hermes = await _cli(tmp_path, "launch", "hermes", "--http", http, "--print")
        assert "hermes wants at least 65536" in hermes.stderr.decode()

        wrong = await _cli(tmp_path, "launch", "clode", "--http", http)
        assert wrong.returncode == 2 and "did you mean" in wrong.stderr.decode()
        listing = await _cli(tmp_path, "launch")
        assert listing.returncode == 0
        assert all(a in listing.stdout.decode() for a in ("claude", "codex", "opencode", "cline", "ollama"))


async def test_launch_print_with_a_key_hides_it_and_a_keyed_daemon_wants_it(tmp_path: Path) -> None:
    from superfluid.daemon._keypolicy import load_keys

    async with open_daemon(mock_config(api_keys=load_keys("sekrit", None, {}))) as d:
        http = d.url.removeprefix("http://")
        refused = await _cli(tmp_path, "launch", "claude", "--http", http, "--print")
        assert refused.returncode == 1 and "wants an API key" in refused.stderr.decode()
        ok = await _cli(tmp_path, "launch", "claude", "--http", http, "--print", SUPERFLUID_API_KEY="sekrit")
        out = ok.stdout.decode()
        assert ok.returncode == 0 and "sekrit" not in out
        assert _exports(out)["ANTHROPIC_AUTH_TOKEN"] == "<your API key>"


FAKE_AGENT = """#!{python}
import json, os, sys, urllib.request
base = os.environ["ANTHROPIC_BASE_URL"]
body = {{"model": os.environ["ANTHROPIC_MODEL"], "max_tokens": 8,
        "messages": [{{"role": "user", "content": "hello"}}]}}
req = urllib.request.Request(base + "/v1/messages", data=json.dumps(body).encode(),
                             headers={{"content-type": "application/json",
                                      "authorization": "Bearer " + os.environ["ANTHROPIC_AUTH_TOKEN"]}})
with urllib.request.urlopen(req, timeout=60) as r:
    reply = json.load(r)
json.dump({{"argv": sys.argv[1:], "env": dict(os.environ), "reply": reply}}, open({record!r}, "w"))
"""


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


async def test_launch_starts_a_daemon_runs_a_fake_agent_and_stop_stops_only_that_daemon(tmp_path: Path) -> None:
    """A fake ``claude`` on PATH records its argv and environment and asks the daemon through
    /v1/messages; launch started that daemon (nothing answered), left it running with its log and
    pid file under $SUPERFLUID_HOME; stop stops it; a second stop says there is nothing to stop."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    record = tmp_path / "agent.json"
    agent = bindir / "claude"
    agent.write_text(FAKE_AGENT.format(python=sys.executable, record=str(record)))
    agent.chmod(0o755)
    port = _free_port()
    path = f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}"
    done = await _cli(tmp_path, "launch", "claude", "--model", "mock?step_ms=1", "--http", f"127.0.0.1:{port}",
                      "--serve-arg=--sessions", f"--serve-arg={tmp_path / 'sessions'}", "--", "-p", "say hi",
                      PATH=path, ANTHROPIC_API_KEY="must-not-leak")
    assert done.returncode == 0, done.stderr.decode()
    assert "started `superfluid serve`" in done.stderr.decode()
    seen = json.loads(record.read_text())
    assert seen["argv"] == ["-p", "say hi"]
    assert seen["env"]["ANTHROPIC_BASE_URL"] == f"http://127.0.0.1:{port}"
    assert seen["env"]["ANTHROPIC_MODEL"] == "mock" and "ANTHROPIC_API_KEY" not in seen["env"]
    assert seen["reply"]["type"] == "message" and seen["reply"]["content"]
    home = tmp_path / "home"
    pid = json.loads((home / "launch" / "serve.pid").read_text())["pid"]
    assert _alive(pid)
    assert "superfluid launch:" in (home / "logs" / "serve.log").read_text()
    assert stat.S_IMODE((home / "logs" / "serve.log").stat().st_mode) == 0o600

    # a second launch finds the running daemon: no second server
    again = await _cli(tmp_path, "launch", "claude", "--http", f"127.0.0.1:{port}", PATH=path)
    assert again.returncode == 0 and "started" not in again.stderr.decode()

    stopped = await _cli(tmp_path, "stop")
    assert stopped.returncode == 0, stopped.stderr
    assert not _alive(pid)
    assert not (home / "launch" / "serve.pid").exists()
    nothing = await _cli(tmp_path, "stop")
    assert nothing.returncode == 1 and "nothing stopped" in nothing.stderr.decode()


def _sleeper(*args: str) -> subprocess.Popen[bytes]:
    """A process whose command line carries ``args`` (and does nothing for two minutes)."""
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", *args])


async def test_stop_never_signals_a_process_launch_did_not_start(tmp_path: Path) -> None:
    """The pid file must name the very process launch started: a reused pid (another start time)
    or a process that is not `superfluid serve` is left alone, and the stale pid file removed."""
    pidfile = tmp_path / "home" / "launch" / "serve.pid"
    pidfile.parent.mkdir(parents=True)
    lookalike = _sleeper("superfluid", "serve")
    other = _sleeper("something-else")
    try:
        started = psutil.Process(lookalike.pid).create_time()
        for record in ({"pid": lookalike.pid, "create_time": started - 100},       # the pid was reused
                       {"pid": other.pid, "create_time": psutil.Process(other.pid).create_time()}):  # not a serve
            pidfile.write_text(json.dumps(record))
            refused = await _cli(tmp_path, "stop")
            assert refused.returncode == 1 and "no longer running" in refused.stderr.decode()
            assert not pidfile.exists()
            assert lookalike.poll() is None and other.poll() is None
        # the same record with its true start time is ours: stopped
        pidfile.write_text(json.dumps({"pid": lookalike.pid, "create_time": started}))
        assert (await _cli(tmp_path, "stop", "--timeout", "5")).returncode == 0
        assert lookalike.wait(timeout=10) is not None
    finally:
        for proc in (lookalike, other):
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("agent", ["codex"])
async def test_launch_a_missing_agent_is_one_line(tmp_path: Path, agent: str) -> None:
    async with open_daemon(mock_config("mock?n_ctx=65536")) as d:  # a window codex is content with: no warning
        done = await _cli(tmp_path, "launch", agent, "--http", d.url.removeprefix("http://"), PATH="/nonexistent")
    err = done.stderr.decode()
    assert done.returncode == 1 and err.count("\n") == 1 and "not installed" in err and "npm install" in err
