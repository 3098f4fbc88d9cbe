"""A newcomer's first run has no dead end (#47): `launch` checks the agent before it starts a
server and stops what it started when launching fails; a path that is not a model is told so
before any install advice."""

from __future__ import annotations

import os
import re
import socket
import sys
from pathlib import Path

import pytest

from superfluid.cli._errors import CliError
from superfluid.cli._main import _sources, build_parser
from superfluid.runtime import _choose
from superfluid.runtime._status import RuntimeUnavailable

from .test_launch import FAKE_AGENT, _alive, _cli
from .test_sessions import _free_port


def _listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


async def test_launch_checks_the_agent_before_starting_a_server(tmp_path: Path) -> None:
    port = _free_port()
    done = await _cli(tmp_path, "launch", "claude", "--model", "mock", "--http", f"127.0.0.1:{port}",
                      PATH="/nonexistent")
    err = done.stderr.decode()
    assert done.returncode == 1 and err.count("\n") == 1, err
    assert "claude is not installed" in err and "npm install" in err and "started" not in err
    home = tmp_path / "home"
    assert not (home / "launch" / "serve.pid").exists() and not (home / "logs" / "serve.log").exists()
    assert not _listening(port)


async def test_launch_stops_the_server_it_started_when_launching_fails(tmp_path: Path) -> None:
    """The server it started lists no model within --wait: launch fails and that server goes with it."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    agent = bindir / "claude"
    agent.write_text(FAKE_AGENT.format(python=sys.executable, record=str(tmp_path / "agent.json")))
    agent.chmod(0o755)
    port = _free_port()
    done = await _cli(tmp_path, "launch", "claude", "--model", "mock", "--http", f"127.0.0.1:{port}", "--wait", "0.05",
                      f"--serve-arg=--sessions={tmp_path / 'sessions'}",
                      PATH=f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}")
    err = done.stderr.decode()
    assert done.returncode == 1, err
    pid = int(re.search(r"\(pid (\d+),", err)[1])  # type: ignore[index]
    assert "listed no model within" in err and f"stopped the server it started (pid {pid})" in err, err
    assert not _alive(pid) and not (tmp_path / "agent.json").exists()
    assert not (tmp_path / "home" / "launch" / "serve.pid").exists()


@pytest.mark.parametrize("kind", ["directory", "text file", "GGUF named file"])
def test_a_path_that_is_not_a_model_is_told_so_before_install_advice(
        kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """With llama.cpp not installed, a checkout directory or a README got "runtime llamacpp is not
    installed: run `superfluid runtime install llamacpp`" (and without --offline, an install)."""
    def not_installed(rid: str, install: str | None) -> tuple[str, ...]:
        raise RuntimeUnavailable(f"runtime {rid} is not installed: run `superfluid runtime install {rid}`",
                                 installable=True)

    monkeypatch.setattr(_choose, "worker_command", not_installed)
    model = {"directory": tmp_path, "text file": tmp_path / "README.md",
             "GGUF named file": tmp_path / "model.gguf"}[kind]
    if kind != "directory":
        model.write_text("# superfluid\n")
    for offline in (["--offline"], []):  # offline first: an old build would install on the second
        with pytest.raises(CliError) as exc:
            _sources(build_parser().parse_args(["serve", str(model), *offline]))
        assert exc.value.code == 1 and f"{model} is not a model" in exc.value.message
        assert "install" not in exc.value.message + capsys.readouterr().err


def test_the_quickstart_names_every_step_of_a_fresh_clone() -> None:
    """README's Quickstart, top to bottom on a bare machine: the clone, the Python pyproject.toml
    requires, the toolchain `.[llamacpp]` compiles with and how long, a line per platform."""
    import tomllib

    root = Path(__file__).resolve().parent.parent
    readme = (root / "README.md").read_text()
    quick = readme[readme.index("## Quickstart"):readme.index("\n## ", readme.index("## Quickstart") + 1)]
    needs = tomllib.loads((root / "pyproject.toml").read_text())["project"]["requires-python"]
    assert needs.startswith(">=") and f"Python {needs[2:]} or newer" in quick
    for step in ("git clone", "python3 -m venv", 'pip install -e ".[llamacpp]"', "superfluid serve", "cmake",
                 "about 4 minutes on 2 cores", "apt-get install git python3-venv build-essential cmake",
                 "xcode-select --install", "brew install cmake", "curl -s localhost:8453"):
        assert step in quick, step
    steps = quick[quick.index("git clone"):]  # the commands, in the order they run
    order = [steps.index(s) for s in ("git clone", "python3 -m venv", "pip install -e", "superfluid serve\n")]
    assert order == sorted(order)


async def test_the_startup_summary_stays_above_the_monitor(tmp_path: Path) -> None:
    """In a terminal the monitor takes the (alternate) screen: the startup block, logged before
    it, showed only after the server exited. Now every frame carries it, and serve.log has it."""
    from .test_monitor import alternate_on, press, tmux, wait_screen

    port = _free_port()
    command = (f"{sys.executable} -m superfluid serve --runtime mock --http 127.0.0.1:{port} "
               f"--sessions {tmp_path / 'sessions'}")
    with tmux(command, tmp_path) as name:
        shown = await wait_screen(name, r"lanes 0/8")
        assert alternate_on(name)
        for line in (f"Running on http://127.0.0.1:{port}", "model mock (default): runtime mock",
                     "dialects: OpenAI", f"sessions: {tmp_path / 'sessions'}", "auth: off"):
            assert line in shown, shown
        assert shown.index("auth: off") < shown.index("lanes 0/8")  # above the models' rows
        press(name, "q")
        assert "EXIT=0" in await wait_screen(name, r"^TTY=")
    log = (tmp_path / "sessions" / "logs" / "serve.log").read_text()
    assert f"Running on http://127.0.0.1:{port}" in log and "auth: off" in log


FAKE_UV = """#!{python}
import os, sys, time
args = sys.argv[1:]
if args[0] == "venv":  # uv venv --quiet --python PY ENV
    env = args[-1]
    os.makedirs(os.path.join(env, "lib", "python%d.%d" % sys.version_info[:2], "site-packages"))
    sys.exit(0)
for line in ("Collecting sfbuild==1.0 (from -r requirements.txt)", "  Downloading sfbuild-1.0.tar.gz (76.6 MB)",
             "  Installing build dependencies: started", "Building wheels for collected packages: sfbuild",
             "  Building wheel for sfbuild (pyproject.toml): started", "RAW-COMPILER-NOISE cc -O3 ggml.c"):
    print(line, flush=True)
    time.sleep(0.05)
time.sleep({linger})
print("error: the compile failed", flush=True)
sys.exit(1)
"""


@pytest.mark.parametrize("tty", [False, True])
def test_a_runtime_build_shows_phases_and_keeps_pip_output_in_a_log(
        tty: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`serve` installing a runtime on first use: a line per phase (on a terminal a live line with
    the phase and its seconds), pip's raw output only in the log, whose path is printed and which
    outlives a failed install."""
    import io
    import shutil

    import trio

    from superfluid.cli._runtimes import _TermProgress
    from superfluid.runtime import _install as inst, _registry as registry

    monkeypatch.setenv("SUPERFLUID_HOME", str(tmp_path / "home"))
    uv = tmp_path / "uv"
    uv.write_text(FAKE_UV.format(python=sys.executable, linger=1.3 if tty else 0))  # a tty sees a heartbeat
    uv.chmod(0o755)
    which = shutil.which
    monkeypatch.setattr(inst.shutil, "which", lambda name, *a, **k: str(uv) if name == "uv" else which(name, *a, **k))
    source = registry.PythonSource(version="1.0", packages=(registry.Package("sfbuild", "1.0", ("0" * 64,),
                                                                                binary=False),),
                                   index="http://127.0.0.1:9/simple")
    info = registry.register(registry.RuntimeInfo(id="sfbuild", aliases=(), engine="superfluid.worker._mock",
                                                  formats=(), requires=("sfbuild",), source=source))

    class Stream(io.StringIO):
        def isatty(self) -> bool:
            return tty

    stream = Stream()
    try:
        with pytest.raises(inst.InstallError) as exc:
            trio.run(lambda: inst.install(inst.make_plan("sfbuild"), progress=_TermProgress(stream)))
    finally:
        del registry.RUNTIMES[info.id]
    out = stream.getvalue()
    kept = tmp_path / "home" / "runtimes" / "sfbuild" / "install-1.0-cpu.failed.log"
    assert "RAW-COMPILER-NOISE" not in out and "Collecting" not in out, out
    assert "RAW-COMPILER-NOISE" in kept.read_text() and str(kept) in str(exc.value)
    assert "sfbuild builds from source" in out and "pip's output: " in out
    phases = ["downloading sfbuild==1.0", "preparing the build", "building sfbuild from source"]
    if tty:  # the live line: phase and seconds, rewritten in place
        assert re.search(r"\r\x1b\[K  \[3/6\] fetch: building sfbuild from source \(a C/C\+\+ compile: minutes\) "
                         r"[1-9]\d*s", out), out
        assert all(f"fetch: {p}" in out for p in phases)
    else:  # a line per phase, in order
        lines = [line.strip() for line in out.splitlines()]
        at = [next(i for i, line in enumerate(lines) if line.startswith(p)) for p in phases]
        assert at == sorted(at), out


def test_the_sessions_directory_follows_superfluid_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A first run with ``SUPERFLUID_HOME`` set keeps everything there: the models went to
    ``$SUPERFLUID_HOME/models`` but the sessions to ``~/.superfluid/sessions`` (found walking the README)."""
    from superfluid.serving import default_sessions_dir
    monkeypatch.setenv("SUPERFLUID_HOME", str(tmp_path))
    assert default_sessions_dir() == tmp_path / "sessions"
    monkeypatch.delenv("SUPERFLUID_HOME")
    assert default_sessions_dir() == Path.home() / ".superfluid" / "sessions"
