"""Shared benchmark plumbing: start a server in its own process group, wait for
it, stream completions with timestamps, stop it. Loopback only."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import trio

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    def __init__(self, name: str, argv: list[str], port: int, env: dict[str, str] | None = None,
                 log: Path | None = None) -> None:
        self.name, self.argv, self.port = name, argv, port
        self.url = f"http://127.0.0.1:{port}"
        self.log = log or Path(f"/tmp/bench-{name}-{port}.log")
        self.proc = subprocess.Popen(argv, stdout=open(self.log, "wb"), stderr=subprocess.STDOUT,
                                     start_new_session=True, env={**os.environ, **(env or {})})

    def wait_ready(self, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited early; see {self.log}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"{self.name} not ready after {timeout}s")

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(15)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()


def superfluid_argv(model: str, port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "superfluid", "serve", model, "--http", f"127.0.0.1:{port}", "--no-tui",
            "--log-level", "WARNING", *extra]


async def stream_request(client: httpx.AsyncClient, path: str, body: dict[str, Any],
                         headers: dict[str, str] | None = None) -> dict[str, Any]:
    """Stream one request; returns ttft, wall, tokens (chunks with text), usage, error."""
    t0 = trio.current_time()
    out: dict[str, Any] = {"ttft": None, "tokens": 0, "usage": None, "error": None, "stamps": []}
    async with client.stream("POST", path, json={**body, "stream": True}, headers=headers or {}) as r:
        if r.status_code != 200:
            out["error"] = f"http {r.status_code}: {(await r.aread())[:200]!r}"
            return out
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if "error" in obj:
                out["error"] = obj["error"]
                continue
            if obj.get("usage"):
                out["usage"] = obj["usage"]
            for ch in obj.get("choices") or []:
                text = ch.get("text") or (ch.get("delta") or {}).get("content")
                if text:
                    now = trio.current_time()
                    if out["ttft"] is None:
                        out["ttft"] = now - t0
                    out["tokens"] += 1
                    out["stamps"].append(now - t0)
    out["wall"] = trio.current_time() - t0
    return out


def median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2
