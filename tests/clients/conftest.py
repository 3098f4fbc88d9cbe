"""The client conformance suite: real client libraries and tools, each driven against a daemon
the way its users drive it (issue 47). One daemon per module, started as ``superfluid serve``
in a subprocess on a free port: the mock runtime as ``mock`` (the default model) and, where
llama-cpp-python and the GGUF are here, SmolLM2 as ``smol`` for what needs a real model's text or
a grammar (forced tool calls, fill-in-the-middle). Tests on ``smol`` carry ``@pytest.mark.real``.

Everything runs offline: each client is pointed at the daemon, with telemetry and tracing off and
its config under a temporary directory."""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from ..conftest import REAL_GGUF

MOCK = "mock"
SMOL = "smol"
# a fast mock: 1 ms a decode step, so a client's whole exchange takes milliseconds
MOCK_SPEC = "mock?step_ms=1&prefill_us=5"
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _has_smol() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None and REAL_GGUF.exists()


class Served:
    """A ``superfluid serve`` process: ``url`` (no trailing slash) and its log."""

    def __init__(self, url: str, proc: subprocess.Popen[bytes], log: Path) -> None:
        self.url = url
        self.proc = proc
        self.log = log

    @property
    def v1(self) -> str:
        return self.url + "/v1"


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the daemon's process group (its workers too), then SIGKILL what is left."""
    for sig, wait in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(wait)
            break
        except subprocess.TimeoutExpired:
            continue


@pytest.fixture(scope="module")
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """One daemon for the module: ``mock`` (the default model: what a request naming none gets)
    always, ``smol`` (SmolLM2) where the module has a ``real`` test to run and it can run."""
    home = tmp_path_factory.mktemp("superfluid")
    port = _free_port()
    argv = [sys.executable, "-m", "superfluid", "serve", MOCK_SPEC, "--http", f"127.0.0.1:{port}",
            "--sessions", str(home / "sessions"), "--offline", "--no-tui", "--shutdown-grace", "1",
            "--max-batch", "4", "--max-context", "2048"]
    wants_smol = any(item.get_closest_marker("real") for item in request.session.items
                     if getattr(item, "module", None) is request.module)
    if wants_smol and _has_smol():
        # one engine thread: llama.cpp's spinning barrier slows many times over when its threads share
        # the cores with the client and the daemon (2 cores in CI); --alias: the short name the tests use
        argv += ["--model", str(REAL_GGUF), "--alias", f"{SMOL}={REAL_GGUF.stem}", "--threads", "1"]
    log = home / "serve.log"
    env = {**os.environ, "SUPERFLUID_HOME": str(home)}
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the daemon exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the daemon did not answer /health in 60 s:\n{log.read_text()[-3000:]}")
            time.sleep(0.1)
        yield Served(url, proc, log)
    finally:
        _stop(proc)
