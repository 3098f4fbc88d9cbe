"""``superfluid launch [AGENT]`` and ``superfluid stop``: a coding agent pointed at the daemon.

``launch`` finds the daemon on ``--http`` (default ``$SUPERFLUID_HTTP``, else
127.0.0.1:8453); when nothing answers there it starts ``superfluid serve`` in
the background (its own session, log ``$SUPERFLUID_HOME/logs/serve.log``, pid
file ``$SUPERFLUID_HOME/launch/serve.pid``) and waits until it lists models.
It then builds the agent's environment (base URL, token, model, context size),
writes any per-run config under ``$SUPERFLUID_HOME/launch/`` (never the agent's
own), warns when the model's window is smaller than the agent needs, and execs
the agent. ``--print`` shows the environment and command instead.

``stop`` stops the server ``launch`` started, and only that one: the pid file
names it, and its process must still be that process (same start time, a
``superfluid serve`` command line), so a reused pid or a server someone
started by hand is never signalled.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import psutil

from .._private import FILE_MODE, make_private_dir
from ._flags import nonneg_float, positive_float

__all__ = ["AGENTS", "add_launch_parsers", "launch_main", "split_agent_args", "stop_main"]

DEFAULT_HTTP = "127.0.0.1:8453"
PLACEHOLDER_KEY = "superfluid"   # agents that insist on a token get this one when the daemon has no keys
KEEP_RUNS = 20                   # per-run config directories kept under launch/


class LaunchError(Exception):
    """A run-time failure of launch/stop: one line, exit 1."""


def home() -> Path:
    value = os.environ.get("SUPERFLUID_HOME")
    return Path(value) if value else Path.home() / ".superfluid"


def pid_file() -> Path:
    return home() / "launch" / "serve.pid"


def log_file() -> Path:
    return home() / "logs" / "serve.log"


@attrs.frozen(kw_only=True)
class Target:
    """What the agent is pointed at."""

    address: str        # host:port
    model: str
    n_ctx: int
    key: str | None

    @property
    def base(self) -> str:
        return f"http://{self.address}"

    @property
    def token(self) -> str:
        return self.key or PLACEHOLDER_KEY


@attrs.frozen(kw_only=True)
class Plan:
    command: list[str]
    set_env: dict[str, str]
    unset_env: tuple[str, ...] = ()
    files: dict[str, str] = attrs.field(factory=dict)   # written per run (name -> text), never an agent's own


@attrs.frozen(kw_only=True)
class Agent:
    name: str
    binary: str
    api: str
    aliases: tuple[str, ...] = ()
    min_ctx: int = 0
    install: str = ""
    plan: Callable[[Target, Path, list[str]], Plan]


def _openai_env(t: Target) -> dict[str, str]:
    return {"OPENAI_BASE_URL": f"{t.base}/v1", "OPENAI_API_BASE": f"{t.base}/v1", "OPENAI_API_KEY": t.token,
            "OPENAI_MODEL": t.model}


def _common_env(t: Target) -> dict[str, str]:
    env = {"SUPERFLUID_BASE_URL": t.base, "SUPERFLUID_MODEL": t.model, "SUPERFLUID_CONTEXT": str(t.n_ctx)}
    if t.key:
        env["SUPERFLUID_API_KEY"] = t.key
    return env


def _claude(t: Target, run_dir: Path, args: list[str]) -> Plan:
    tiers = ("ANTHROPIC_MODEL", "ANTHROPIC_SMALL_FAST_MODEL", "ANTHROPIC_DEFAULT_OPUS_MODEL",
             "ANTHROPIC_DEFAULT_SONNET_MODEL", "ANTHROPIC_DEFAULT_HAIKU_MODEL", "CLAUDE_CODE_SUBAGENT_MODEL")
    env = {"ANTHROPIC_BASE_URL": t.base, "ANTHROPIC_AUTH_TOKEN": t.token, **{v: t.model for v in tiers},
           "CLAUDE_CODE_MAX_CONTEXT_TOKENS": str(t.n_ctx), "CLAUDE_CODE_AUTO_COMPACT_WINDOW": str(t.n_ctx),
           "CLAUDE_CODE_ATTRIBUTION_HEADER": "0", "CLAUDE_CODE_AUTO_MODE_SERVER": "0",
           "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}
    return Plan(command=["claude", *args], set_env={**_common_env(t), **env}, unset_env=("ANTHROPIC_API_KEY",))


def _toml(value: str | int) -> str:
    return json.dumps(value)  # a JSON string or integer is a TOML one


def _codex(t: Target, run_dir: Path, args: list[str]) -> Plan:
    provider = {"name": "superfluid", "base_url": f"{t.base}/v1", "wire_api": "responses",
                "env_key": "SUPERFLUID_API_KEY"}
    # web_search: a built-in tool the daemon does not run (refused 400 unsupported_tool)
    flags = [f"model_provider={_toml('superfluid')}", f"model={_toml(t.model)}",
             f"model_context_window={t.n_ctx}", f"web_search={_toml('disabled')}",
             *(f"model_providers.superfluid.{k}={_toml(v)}" for k, v in provider.items())]
    command = ["codex"]
    for flag in flags:
        command += ["-c", flag]
    return Plan(command=[*command, *args],
                set_env={**_common_env(t), "SUPERFLUID_API_KEY": t.token})


def _opencode(t: Target, run_dir: Path, args: list[str]) -> Plan:
    config = {
        "$schema": "https://opencode.ai/config.json",
        "provider": {"superfluid": {
            "npm": "@ai-sdk/openai-compatible", "name": "superfluid",
            "options": {"baseURL": f"{t.base}/v1", "apiKey": "{env:SUPERFLUID_API_KEY}"},
            "models": {t.model: {"name": t.model, "limit": {"context": t.n_ctx,
                                                             "output": max(256, min(8192, t.n_ctx // 4))}}},
        }},
        "model": f"superfluid/{t.model}", "small_model": f"superfluid/{t.model}",
    }
    path = run_dir / "opencode.json"
    return Plan(command=["opencode", *args],
                set_env={**_common_env(t), "SUPERFLUID_API_KEY": t.token, "OPENCODE_CONFIG": str(path)},
                files={"opencode.json": json.dumps(config, indent=2) + "\n"})


def _chat(binary: str) -> Callable[[Target, Path, list[str]], Plan]:
    def plan(t: Target, run_dir: Path, args: list[str]) -> Plan:
        return Plan(command=[binary, *args], set_env={**_common_env(t), **_openai_env(t)})

    return plan


def _ollama(t: Target, run_dir: Path, args: list[str]) -> Plan:
    return Plan(command=["ollama", *(args or ["run", t.model])],
                set_env={**_common_env(t), "OLLAMA_HOST": t.base})


AGENTS: dict[str, Agent] = {a.name: a for a in (
    Agent(name="claude", binary="claude", api="Anthropic /v1/messages", aliases=("claude-code",), min_ctx=32768,
          install="npm install -g @anthropic-ai/claude-code", plan=_claude),
    # codex's instructions and tools alone are some 18k tokens
    Agent(name="codex", binary="codex", api="Responses /v1/responses", aliases=("codex-cli",), min_ctx=32768,
          install="npm install -g @openai/codex", plan=_codex),
    Agent(name="pi", binary="pi", api="Chat Completions", aliases=("pi-coding-agent",),
          install="npm install -g @mariozechner/pi-coding-agent", plan=_chat("pi")),
    Agent(name="opencode", binary="opencode", api="Chat Completions", install="npm install -g opencode-ai",
          plan=_opencode),
    Agent(name="hermes", binary="hermes", api="Chat Completions", aliases=("hermes-agent",), min_ctx=65536,
          plan=_chat("hermes")),
    Agent(name="cline", binary="cline", api="Chat Completions", aliases=("cline-cli",), install="npm install -g cline",
          plan=_chat("cline")),
    Agent(name="openclaw", binary="openclaw", api="Chat Completions", aliases=("clawdbot", "moltbot"),
          install="npm install -g openclaw", plan=_chat("openclaw")),
    Agent(name="ollama", binary="ollama", api="Ollama /api", install="https://ollama.com/download", plan=_ollama),
)}
_BY_NAME = {alias: a for a in AGENTS.values() for alias in (a.name, *a.aliases)}


def add_launch_parsers(sub: Any) -> None:
    names = ", ".join(AGENTS)
    p = sub.add_parser("launch", usage="superfluid launch [AGENT] [options] [-- AGENT ARGS]", help="start a coding agent pointed at this daemon (starting it if needed)",
                       description=f"Point a coding agent ({names}) at the daemon on --http and exec it. If nothing "
                                   "answers there, `superfluid serve` starts in the background first (log "
                                   "$SUPERFLUID_HOME/logs/serve.log; `superfluid stop` stops it). With no agent, "
                                   "list the agents and whether each is installed.")
    p.add_argument("agent", nargs="?", help=f"one of {names} (or an alias)")
    p.set_defaults(agent_args=[])  # what follows `--` (split off before parsing: split_agent_args)
    p.add_argument("--model", help="the model to use (default: the server's default model; a server launch starts "
                                   "serves this one: a GGUF path, or 'mock')")
    p.add_argument("--http", metavar="HOST:PORT",
                   help=f"the daemon's address (default: $SUPERFLUID_HTTP, else {DEFAULT_HTTP})")
    p.add_argument("--api-key", metavar="KEY", help="the daemon's API key (default: $SUPERFLUID_API_KEY)")
    p.add_argument("--print", action="store_true", dest="print_only",
                   help="show the environment and command instead of running the agent (starts no server)")
    p.add_argument("--wait", type=positive_float, default=180.0, metavar="SEC",
                   help="seconds to wait for a server launch starts to list its models (default 180)")
    p.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                   help="an extra argument for the `superfluid serve` launch starts (repeatable), "
                        "e.g. --serve-arg=--max-context=32768")
    p.set_defaults(run=launch_main)
    s = sub.add_parser("stop", help="stop the server `superfluid launch` started (never another one)")
    s.add_argument("--timeout", type=nonneg_float, default=30.0, metavar="SEC",
                   help="seconds to wait for it to exit after SIGTERM before SIGKILL (default 30)")
    s.set_defaults(run=stop_main)


def split_agent_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """``launch ... -- ARGS``: (the arguments to parse, the agent's arguments)."""
    if argv[:1] == ["launch"] and "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1:]
    return argv, []


# -- talking to the daemon ---------------------------------------------------------------------


def _get(url: str, key: str | None, timeout: float = 2.0, body: dict[str, Any] | None = None) -> tuple[int | None, Any]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    data = None
    if body is not None:
        data, headers["content-type"] = json.dumps(body).encode(), "application/json"
    request = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310 - user-given http URL
            raw = response.read(8 << 20)
            status = response.status
    except urllib.error.HTTPError as exc:
        return exc.code, None
    except (OSError, ValueError):
        return None, None
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, None


def _models(address: str, key: str | None) -> tuple[int | None, list[dict[str, Any]]]:
    status, body = _get(f"http://{address}/v1/models", key)
    data = body.get("data") if isinstance(body, dict) else None
    return status, [m for m in data if isinstance(m, dict)] if isinstance(data, list) else []


def _context(address: str, key: str | None, model: str, listed: list[dict[str, Any]]) -> int:
    for entry in listed:
        if entry.get("id") == model:
            n = (entry.get("meta") or {}).get("n_ctx")
            if isinstance(n, int) and n > 0:
                return n
    _status, body = _get(f"http://{address}/api/show", key, body={"model": model})
    info = body.get("model_info") if isinstance(body, dict) else None
    for name, value in (info or {}).items():
        if name.endswith(".context_length") and isinstance(value, int):
            return value
    return 0


def _owned(record: dict[str, Any]) -> psutil.Process | None:
    """The process the pid file names, if it is still the server launch started."""
    try:
        proc = psutil.Process(int(record["pid"]))
        same = abs(proc.create_time() - float(record["create_time"])) < 0.5
        cmdline = proc.cmdline()
    except (psutil.Error, KeyError, TypeError, ValueError):
        return None
    if same and "serve" in cmdline and any("superfluid" in part for part in cmdline):
        return proc
    return None


def _read_pid_file() -> dict[str, Any] | None:
    try:
        record = json.loads(pid_file().read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def start_server(address: str, model: str | None, key: str | None, extra: list[str], wait_s: float) -> subprocess.Popen[bytes]:
    """Start ``superfluid serve`` detached on ``address`` and wait until it lists models.

    Raises:
        LaunchError: it exited, or listed nothing in ``wait_s`` (then it is stopped).
    """
    make_private_dir(log_file().parent)
    make_private_dir(pid_file().parent)
    command = [sys.executable, "-m", "superfluid", "serve", *([model] if model else []), "--http", address,
               "--no-tui", *extra]
    env = dict(os.environ)
    if key:
        env["SUPERFLUID_API_KEY"] = key
    log_fd = os.open(log_file(), os.O_WRONLY | os.O_CREAT | os.O_APPEND, FILE_MODE)
    try:
        os.write(log_fd, f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} superfluid launch: {shlex.join(command)}\n"
                 .encode())
        proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log_fd, stderr=log_fd, env=env,
                                start_new_session=True, close_fds=True)
    finally:
        os.close(log_fd)
    record = {"pid": proc.pid, "create_time": psutil.Process(proc.pid).create_time(), "http": address,
              "command": command}
    fd = os.open(pid_file(), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
    with open(fd, "w") as f:
        json.dump(record, f)
    print(f"superfluid: started `superfluid serve` on {address} (pid {proc.pid}, log {log_file()}); "
          "`superfluid stop` stops it", file=sys.stderr)
    try:
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            code = proc.poll()
            if code is not None:
                raise LaunchError(f"the server exited with code {code} before it served; see {log_file()}")
            status, listed = _models(address, key)
            if status == 200 and listed:
                return proc
            time.sleep(0.2)
        raise LaunchError(f"the server on {address} listed no model within {wait_s:g}s (a longer --wait waits "
                          f"longer); see {log_file()}")
    except BaseException:  # Ctrl-C included: a server nobody will use is not left behind
        stop_started(proc)
        raise


def stop_started(proc: subprocess.Popen[bytes], grace_s: float = 10.0) -> None:
    """Stop a server this launch started (SIGTERM, then SIGKILL after ``grace_s``) and forget it."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        print(f"superfluid: launch: stopped the server it started (pid {proc.pid})", file=sys.stderr)
    pid_file().unlink(missing_ok=True)


# -- the commands ------------------------------------------------------------------------------


def list_agents() -> int:
    print(f"{'agent':10} {'API':26} {'installed':40} aliases")
    for agent in AGENTS.values():
        where = shutil.which(agent.binary)
        state = where or "no" + (f" ({agent.install})" if agent.install else "")
        print(f"{agent.name:10} {agent.api:26} {state:40} {', '.join(agent.aliases)}")
    print("\nsuperfluid launch AGENT [--model M] [--print] [-- ARGS]")
    return 0


def _mask(name: str, value: str, key: str | None) -> str:
    return "<your API key>" if key and value == key else value


def show(plan: Plan, run_dir: Path, key: str | None) -> str:
    lines = [f"# per-run file {run_dir / name}:\n{text.rstrip()}" for name, text in plan.files.items()]
    lines += [f"unset {name}" for name in plan.unset_env]
    lines += [f"export {name}={shlex.quote(_mask(name, value, key))}" for name, value in sorted(plan.set_env.items())]
    lines.append(shlex.join(plan.command))
    return "\n".join(lines)


def _run_dir(agent: str) -> Path:
    base = home() / "launch"
    make_private_dir(base)
    old = sorted((d for d in base.iterdir() if d.is_dir()), key=lambda d: d.stat().st_mtime)
    for stale in old[:-KEEP_RUNS] if len(old) >= KEEP_RUNS else []:
        shutil.rmtree(stale, ignore_errors=True)
    run = base / f"{agent}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    make_private_dir(run)
    return run


def launch(args: argparse.Namespace) -> int:
    if not args.agent:
        return list_agents()
    agent = _BY_NAME.get(args.agent.lower())
    if agent is None:
        close = difflib.get_close_matches(args.agent.lower(), list(_BY_NAME), n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        print(f"superfluid: launch: unknown agent {args.agent!r}{hint}; agents: {', '.join(AGENTS)}",
              file=sys.stderr)
        return 2
    # the agent before any server: a missing one must not leave a server behind it
    binary = shutil.which(agent.binary)
    if binary is None and not args.print_only:
        how = f": {agent.install}" if agent.install else ""
        raise LaunchError(f"{agent.name} is not installed (no {agent.binary!r} on PATH){how}")
    address = args.http or os.environ.get("SUPERFLUID_HTTP") or DEFAULT_HTTP
    address = address.removeprefix("http://").rstrip("/")
    key = args.api_key if args.api_key is not None else os.environ.get("SUPERFLUID_API_KEY") or None
    status, listed = _models(address, key)
    if status in (401, 403):
        raise LaunchError(f"the server on {address} wants an API key: --api-key KEY or $SUPERFLUID_API_KEY")
    note = ""
    started = None
    if status is None:
        if args.print_only:
            note = f"# nothing answers on {address}: launch would start `superfluid serve` there first"
        else:
            started = start_server(address, args.model, key, args.serve_arg, args.wait)
    try:
        if started is not None:
            status, listed = _models(address, key)
        return _exec_agent(args, agent, address, key, status, listed, note, started is not None)
    except BaseException:  # the agent did not start: nor does the server it was started for stay
        if started is not None:
            stop_started(started)
        raise


def _exec_agent(args: argparse.Namespace, agent: Agent, address: str, key: str | None, status: int | None,
                listed: list[dict[str, Any]], note: str, started: bool) -> int:
    ids = [str(m.get("id")) for m in listed]
    model = args.model if args.model and (args.model in ids or not ids) else (ids[0] if ids else "default")
    if args.model and ids and args.model not in ids:
        # a server launch started names its model by file (or 'mock'); another server may load it on demand
        named = [i for i in ids if i and i in args.model]
        model = named[0] if named else args.model
    n_ctx = _context(address, key, model, listed) if status is not None else 0
    if agent.min_ctx and n_ctx and n_ctx < agent.min_ctx:
        how = (f"`superfluid stop`, then launch with --serve-arg=--max-context={agent.min_ctx}" if started
               else f"serve it with --max-context {agent.min_ctx}")
        print(f"superfluid: warning: {model} has a {n_ctx}-token context; {agent.name} wants at least "
              f"{agent.min_ctx} ({how})", file=sys.stderr)
    run_dir = _run_dir(agent.name)
    plan = agent.plan(Target(address=address, model=model, n_ctx=n_ctx, key=key), run_dir, list(args.agent_args))
    for name, text in plan.files.items():
        fd = os.open(run_dir / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
        with open(fd, "w") as f:
            f.write(text)
    if args.print_only:
        print((note + "\n" if note else "") + show(plan, run_dir, key))
        return 0
    binary = shutil.which(plan.command[0])
    if binary is None:
        how = f": {agent.install}" if agent.install else ""
        raise LaunchError(f"{agent.name} is not installed (no {plan.command[0]!r} on PATH){how}")
    env = {k: v for k, v in os.environ.items() if k not in plan.unset_env}
    env.update(plan.set_env)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(binary, plan.command, env)
    return 0  # not reached


def launch_main(args: argparse.Namespace) -> int:
    try:
        return launch(args)
    except LaunchError as exc:
        print(f"superfluid: launch: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"superfluid: launch: {exc}", file=sys.stderr)
        return 1


def stop_main(args: argparse.Namespace) -> int:
    record = _read_pid_file()
    if record is None:
        print("superfluid: stop: no server started by `superfluid launch` is recorded; nothing stopped "
              "(a server started with `superfluid serve` is never stopped by this)", file=sys.stderr)
        return 1
    proc = _owned(record)
    if proc is None:
        pid_file().unlink(missing_ok=True)
        print(f"superfluid: stop: the server `superfluid launch` started (pid {record.get('pid')}) is no longer "
              "running; nothing stopped", file=sys.stderr)
        return 1
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=args.timeout)
    except psutil.TimeoutExpired:
        proc.kill()
        print(f"superfluid: stop: pid {proc.pid} did not exit within {args.timeout:g}s; killed", file=sys.stderr)
    pid_file().unlink(missing_ok=True)
    print(f"superfluid: stopped the server on {record.get('http')} (pid {proc.pid})", file=sys.stderr)
    return 0
