"""The zero-to-serving path: a fresh virtual environment with superfluid but not its
``[llamacpp]`` extra, ``superfluid runtime install llamacpp``, then ``superfluid serve``.

Needs the package index (or pip's caches) and, without pip's wheel cache of
llama-cpp-python, a source build (about 4 minutes on 2 cores). Run it alone::

    SUPERFLUID_REQUIRE_REAL=1 python -m pytest -q tests/test_runtime_real.py
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from .conftest import REAL_GGUF

ROOT = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
@pytest.mark.real
def test_fresh_environment_installs_llamacpp_then_serves(tmp_path: Path) -> None:
    venv = tmp_path / "fresh"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    py = venv / "bin" / "python"
    subprocess.run([str(py), "-m", "pip", "install", "--quiet", str(ROOT)], check=True, timeout=900)
    probe = subprocess.run([str(py), "-c", "import llama_cpp"], capture_output=True, check=False)
    assert probe.returncode != 0, "the fresh environment must not have llama-cpp-python"
    home = tmp_path / "home"
    (home / "models").mkdir(parents=True)
    (home / "models" / REAL_GGUF.name).symlink_to(REAL_GGUF)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["SUPERFLUID_HOME"] = str(home)
    exe = str(venv / "bin" / "superfluid")

    before = subprocess.run([exe, "runtimes", "--json"], capture_output=True, text=True, env=env, timeout=120,
                            check=False)
    (llama,) = [r for r in json.loads(before.stdout)["runtimes"] if r["id"] == "llamacpp"]
    assert [i["state"] for i in llama["installs"]] == ["not installed"]
    refused = subprocess.run([exe, "serve", "--offline", "--port", "0"], capture_output=True, text=True, env=env,
                             timeout=120, check=False)
    assert refused.returncode == 2
    assert "run `superfluid runtime install llamacpp`" in refused.stderr

    install = subprocess.run([exe, "runtime", "install", "llamacpp"], capture_output=True, text=True, env=env,
                             timeout=1800, check=False)
    assert install.returncode == 0, install.stderr[-2000:]
    after = subprocess.run([exe, "runtimes", "--json"], capture_output=True, text=True, env=env, timeout=120,
                           check=False)
    (llama,) = [r for r in json.loads(after.stdout)["runtimes"] if r["id"] == "llamacpp"]
    assert [(i["install"], i["state"], i["default"]) for i in llama["installs"]] == [("0.3.36-cpu", "ready", True)]

    port = _free_port()
    serve = subprocess.Popen([exe, "serve", "--port", str(port), "--sessions", str(tmp_path / "sessions"),
                              "--max-batch", "2", "--max-context", "512"], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=120, json={
            "model": REAL_GGUF.name.removesuffix(".gguf"), "max_tokens": 4,
            "messages": [{"role": "user", "content": "Say hi"}]})
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"]["content"]
    finally:
        serve.send_signal(signal.SIGTERM)
        try:
            serve.wait(timeout=30)
        except subprocess.TimeoutExpired:
            serve.kill()
            serve.wait()
