"""Issue #19, many models: several models served at once, idle unload (``--idle-timeout``),
Ollama ``keep_alive``, the memory check before a load, ``--alias``. Mock runtime; the memory
check reads a small GGUF header written here (no model is loaded)."""

from __future__ import annotations

import math
import os
import struct
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio

from superfluid.serving import ModelSource
from superfluid.daemon._lifetime import FOREVER, Lifetimes, parse_keep_alive
from superfluid.models._gguf import memory_need, read_metadata

from .conftest import mock_config, start_daemon


def worker_pids() -> list[int]:
    """Live mock workers (one exiting may be a zombie for a moment: not counted)."""
    import psutil

    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE and "superfluid-worker-mock" in " ".join(p.cmdline()):
                out.append(p.pid)
        except psutil.Error:
            continue
    return out

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def mocks(*names: str, step_ms: int = 1) -> tuple[ModelSource, ...]:
    return tuple(ModelSource(spec=f"mock?name={n}&step_ms={step_ms}&eos_every=100000", runtime="mock", name=n) for n in names)


# ---- keep_alive values ---------------------------------------------------------------------------


@pytest.mark.parametrize(("value", "seconds"), [
    (None, None), (0, 0.0), ("0", 0.0), (-1, FOREVER), ("-1", FOREVER), ("-1m", FOREVER), (30, 30.0),
    (2.5, 2.5), ("30", 30.0), ("30s", 30.0), ("5m", 300.0), ("1h30m", 5400.0), ("500ms", 0.5), ("1.5h", 5400.0),
])
def test_keep_alive_values(value: Any, seconds: float | None) -> None:
    assert parse_keep_alive(value) == seconds


@pytest.mark.parametrize("value", [True, "soon", "5 m", "5x", "", "m", [], {}, float("nan"), "1e999", 10**400, -(10**400)])
def test_keep_alive_refused(value: Any) -> None:
    with pytest.raises(ValueError, match="keep_alive"):
        parse_keep_alive(value)


# ---- the lifetimes task, in virtual time -----------------------------------------------------------


@attrs.define(eq=False)
class StubModel:
    name: str
    last_used: float = 0.0
    keep_alive_s: float | None = None
    in_use: bool = False


@attrs.define
class StubRegistry:
    default: str | None = "main"
    idle_timeout_s: float = 10.0
    loaded: dict[str, StubModel] = attrs.field(factory=dict)
    unloads: list[tuple[str, float]] = attrs.field(factory=list)

    async def expire(self, name: str, model: StubModel) -> bool:
        del self.loaded[name]
        self.unloads.append((name, trio.current_time()))
        return True


async def test_idle_unload_timing_in_virtual_time(autojump_clock: trio.abc.Clock, nursery: trio.Nursery) -> None:
    reg = StubRegistry()
    t0 = trio.current_time()
    for m in (StubModel("main", t0), StubModel("side", t0), StubModel("busy", t0, in_use=True),
              StubModel("kept", t0, keep_alive_s=FOREVER), StubModel("short", t0, keep_alive_s=2.0)):
        reg.loaded[m.name] = m
    lifetimes = Lifetimes(reg)
    await nursery.start(lifetimes.run)
    await trio.sleep(10.5)
    assert [(n, round(t - t0, 3)) for n, t in reg.unloads] == [("short", 2.0), ("side", 10.0)]
    # a model in use is never unloaded; its idle time starts when it is no longer in use
    await trio.sleep(30)
    assert set(reg.loaded) == {"main", "busy", "kept"}
    reg.loaded["busy"].in_use = False
    freed = trio.current_time()
    await trio.sleep(11)
    assert reg.unloads[-1][0] == "busy" and freed + 10 - 0.5 <= reg.unloads[-1][1] - 0 <= freed + 10 + 2.6
    # keep_alive 0 on the default: unloaded as soon as it is idle and the task is woken
    reg.loaded["main"].keep_alive_s = 0.0
    lifetimes.wake()
    await trio.sleep(0.001)
    assert reg.unloads[-1] == ("main", pytest.approx(trio.current_time(), abs=0.01))
    assert set(reg.loaded) == {"kept"}


# ---- two models at once, idle unload, reload on demand (real time: worker processes) --------------


@pytest.mark.slow
async def test_two_models_idle_unload_and_reload(nursery: trio.Nursery) -> None:
    d = await start_daemon(nursery, mock_config(models=mocks("main", "side", step_ms=5), idle_timeout_s=0.6))
    assert len(worker_pids()) == 2
    for name in ("main", "side"):  # both answer, at once
        r = await d.client.post("/v1/chat/completions", json={**CHAT, "model": name})
        assert r.status_code == 200 and r.json()["model"] == name
    with trio.fail_after(10):
        while "side" in (await d.client.get("/api/ps")).text:
            await trio.sleep(0.1)
    listed = {m["id"]: m["loaded"] for m in (await d.client.get("/v1/models")).json()["data"]}
    assert listed == {"main": True, "side": False}  # still known: listed as available
    with trio.fail_after(10):
        while len(worker_pids()) != 1:  # its worker is gone
            await trio.sleep(0.05)
    await trio.sleep(1.0)  # the default is never idle-unloaded
    assert (await d.client.get("/health")).json()["models_loaded"] == 1
    r = await d.client.post("/v1/chat/completions", json={**CHAT, "model": "side"})  # loads on demand
    assert r.status_code == 200 and r.json()["model"] == "side"
    assert len(worker_pids()) == 2
    # a request still generating (~2 s) keeps its model loaded past the timeout
    body = {**CHAT, "model": "side", "stream": True, "max_tokens": 400, "temperature": 0}
    async with d.client.stream("POST", "/v1/chat/completions", json=body) as response:
        await trio.sleep(1.5)
        assert "side" in (await d.client.get("/api/ps")).text
        assert b"[DONE]" in b"".join([chunk async for chunk in response.aiter_bytes()])
    with trio.fail_after(10):
        while "side" in (await d.client.get("/api/ps")).text:
            await trio.sleep(0.1)
    d.scope.cancel()


# ---- Ollama keep_alive through the official client -------------------------------------------------


def _running_only(client: Any, names: list[str], timeout_s: float = 5.0) -> None:
    """``keep_alive: 0`` unloads once the response has ended: the client may ask before the
    daemon has released the request (a race of a few ms), so wait for it, bounded."""
    import time

    deadline = time.monotonic() + timeout_s
    while (running := [m.model for m in client.ps().models]) != names and time.monotonic() < deadline:
        time.sleep(0.02)
    assert running == names


def _ollama_keep_alive(url: str) -> None:
    import ollama

    client = ollama.Client(host=url)
    client.generate("side", "hi", options={"num_predict": 2}, keep_alive="5m")
    ps = {m.model: m for m in client.ps().models}
    assert set(ps) == {"main", "side"}
    left = (ps["side"].expires_at - datetime.now(ps["side"].expires_at.tzinfo)).total_seconds()
    assert 290 < left <= 300, left
    assert ps["main"].expires_at.year == 9999  # the default: never idle-unloaded
    assert ps["side"].size == 0 and ps["side"].size_vram == 0  # the mock holds no weights
    client.chat("side", messages=[{"role": "user", "content": "hi"}], options={"num_predict": 2}, keep_alive=0)
    _running_only(client, ["main"])
    assert "side" in [m.model for m in client.list().models]  # still known
    # an empty request with keep_alive loads (for good), or unloads with 0
    assert client.generate("side", "", keep_alive=-1).done_reason == "load"
    ps = {m.model: m for m in client.ps().models}
    assert ps["side"].expires_at.year == 9999
    assert client.generate("side:latest", "", keep_alive=0).done_reason == "unload"
    _running_only(client, ["main"])
    with pytest.raises(ollama.ResponseError) as info:
        client.generate("side", "hi", keep_alive="soon")
    assert info.value.status_code == 400 and "keep_alive" in str(info.value)


async def test_ollama_keep_alive_loads_and_unloads(nursery: trio.Nursery) -> None:
    d = await start_daemon(nursery, mock_config(models=mocks("main", "side")))
    await trio.to_thread.run_sync(_ollama_keep_alive, d.url)
    with trio.fail_after(10):
        while len(worker_pids()) != 1:  # the unloaded model's worker is gone
            await trio.sleep(0.05)
    d.scope.cancel()


# ---- the memory check --------------------------------------------------------------------------------


def write_gguf(path: Path, *, n_layer: int = 30, n_embd: int = 576, heads: int = 9, heads_kv: int = 3,
               context: int = 8192, size: int = 4096) -> Path:
    """A GGUF file with only a header (the keys the memory check reads, and a vocabulary array it
    skips), padded to ``size`` bytes: no model, but what a load is checked against."""
    def string(s: str) -> bytes:
        return struct.pack("<Q", len(s)) + s.encode()

    kv = [("general.architecture", 8, string("llama")), ("llama.block_count", 4, struct.pack("<I", n_layer)),
          ("llama.embedding_length", 4, struct.pack("<I", n_embd)),
          ("llama.attention.head_count", 4, struct.pack("<I", heads)),
          ("llama.attention.head_count_kv", 4, struct.pack("<I", heads_kv)),
          ("llama.context_length", 4, struct.pack("<I", context)),
          ("tokenizer.ggml.tokens", 9, struct.pack("<IQ", 8, 3) + b"".join(string(t) for t in ("a", "b", "c")))]
    body = b"GGUF" + struct.pack("<IQQ", 3, 0, len(kv))
    body += b"".join(string(k) + struct.pack("<I", t) + v for k, t, v in kv)
    path.write_bytes(body + b"\0" * max(0, size - len(body)))
    return path


def test_memory_need_from_the_header(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", size=1 << 20)
    assert read_metadata(path)["tokenizer.ggml.tokens"] is None  # long arrays skipped, not read
    need = memory_need(path, n_seq=10, n_ctx_seq=4096)
    # SmolLM2-135M's shape: 30 layers x (3 kv heads x 64) x (k + v) x f16 per cell
    assert need.cells == 40960 and need.kv == 40960 * 30 * 2 * 192 * 2 and need.weights == 1 << 20
    assert memory_need(path, n_seq=10, n_ctx_seq=100_000).cells == 10 * 8192  # capped by the trained context


async def test_a_load_that_does_not_fit_is_refused_typed(nursery: trio.Nursery, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    models = tmp_path / "models"
    models.mkdir()
    write_gguf(models / "big.gguf")
    monkeypatch.setenv("SUPERFLUID_MEMORY_AVAILABLE", "100M")
    d = await start_daemon(nursery, mock_config(model_dirs=(models,)))
    before = worker_pids()
    for path, body in (("/v1/chat/completions", {**CHAT, "model": "big"}),
                       ("/v1/models/load", {"model": "big"})):
        r = await d.client.post(path, json=body)
        assert r.status_code == 507, r.text
        error = r.json()["error"]
        assert error["code"] == "insufficient_memory"
        assert "needs 540.0 MiB" in error["message"] and "100.0 MiB is free" in error["message"], error
    r = await d.client.post("/api/chat", json={"model": "big", "messages": CHAT["messages"]})
    assert r.status_code == 507 and "insufficient" not in r.text and "needs 540.0 MiB" in r.json()["error"]
    assert worker_pids() == before  # no worker was started for it
    monkeypatch.setenv("SUPERFLUID_MEMORY_AVAILABLE", "2G")  # it fits: the worker says it is no model
    r = await d.client.post("/v1/chat/completions", json={**CHAT, "model": "big"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "model_load_failed"
    d.scope.cancel()


def test_a_startup_model_that_does_not_fit_is_one_line(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "big.gguf")
    proc = subprocess.run([sys.executable, "-m", "superfluid", "serve", str(path), "--port", "0",
                           "--sessions", str(tmp_path / "s"), "--log-level", "ERROR"],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "SUPERFLUID_MEMORY_AVAILABLE": "1M"})
    assert proc.returncode == 3, proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("superfluid: model did not load: model 'big' needs 900.0 MiB")


# ---- --alias ------------------------------------------------------------------------------------------


async def test_alias_names_a_model(nursery: trio.Nursery) -> None:
    d = await start_daemon(nursery, mock_config(models=mocks("main", "side"), aliases=(("gpt-4o-mini", "side"),)))
    r = await d.client.post("/v1/chat/completions", json={**CHAT, "model": "gpt-4o-mini"})
    assert r.status_code == 200 and r.json()["model"] == "side"
    r = await d.client.post("/api/chat", json={"model": "gpt-4o-mini:latest", "messages": CHAT["messages"],
                                               "stream": False, "options": {"num_predict": 2}})
    assert r.status_code == 200 and r.json()["model"] == "side"
    listed = {m["id"]: m.get("alias_of") for m in (await d.client.get("/v1/models")).json()["data"]}
    assert listed == {"main": None, "side": None, "gpt-4o-mini": "side"}
    assert (await d.client.get("/v1/models/gpt-4o-mini")).json()["id"] == "side"
    r = await d.client.post("/v1/chat/completions", json={**CHAT, "model": "gpt-5"})
    assert r.status_code == 404
    message = r.json()["error"]["message"]
    assert "gpt-4o-mini, main, side" in message and r.json()["error"]["code"] == "model_not_found"
    d.scope.cancel()


def test_alias_to_an_unknown_model_is_a_usage_error(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "superfluid", "serve", "--runtime", "mock",
                           "--alias", "gpt-4=nope", "--sessions", str(tmp_path / "s")],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "SUPERFLUID_HOME": str(tmp_path / "home")})  # no pulled models
    assert proc.returncode == 2 and proc.stderr.strip() == (
        "superfluid: --alias gpt-4=nope: no model 'nope' is served (models: mock)")


def test_expiry_is_forever_constant() -> None:
    assert math.isinf(FOREVER) and time.time() < 253402300799.0
    assert httpx is not None
