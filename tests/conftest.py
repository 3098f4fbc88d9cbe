from __future__ import annotations

import os
import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
import trio

from superfluid.models._files import cache_dir
from superfluid.serving import ModelSource, ServeConfig
from superfluid.daemon._server import serve
from superfluid.client import aiter_sse
from superfluid.sched import PlannerConfig
from superfluid.worker._mlx import preload_blas

# In-process MLX engines (tests/test_mlx.py) run as a worker does: OpenBLAS bound before the
# first mlx import, so their 4-bit weights run as f32 (about 25x faster on a Linux CPU).
preload_blas()

REAL_GGUF = Path(os.environ.get("SUPERFLUID_TEST_GGUF", cache_dir() / "SmolLM2-135M-Instruct.Q4_1.gguf"))
GEMMA_GGUF = Path(os.environ.get("SUPERFLUID_TEST_GEMMA", cache_dir() / "gemma-3-270m-q4_k_m.gguf"))
MLX_DIR = Path(os.environ.get("SUPERFLUID_TEST_MLX", cache_dir() / "SmolLM2-135M-Instruct-mlx"))
REQUIRE_REAL = os.environ.get("SUPERFLUID_REQUIRE_REAL") == "1"  # CI: what a real test needs must be there


def pytest_runtest_setup(item: pytest.Item) -> None:
    """``@pytest.mark.real`` (optionally ``real(GEMMA_GGUF, ...)``, the models it needs; SmolLM2
    by default): skipped when llama-cpp-python or a model is missing, failed under
    ``SUPERFLUID_REQUIRE_REAL=1``."""
    marker = item.get_closest_marker("real")
    if marker is None:
        return
    import importlib.util

    missing = [] if importlib.util.find_spec("llama_cpp") else ["llama-cpp-python"]
    if MLX_DIR in marker.args and not importlib.util.find_spec("mlx_lm"):
        missing.append("mlx-lm")
    missing += [str(path) for path in (marker.args or (REAL_GGUF,)) if not Path(path).exists()]
    if missing:
        why = (f"missing {', '.join(missing)} (pip install -e '.[llamacpp,mlx]'; "
               "python -m superfluid.models --mlx)")
        if REQUIRE_REAL:
            pytest.fail(f"SUPERFLUID_REQUIRE_REAL=1 and {why}", pytrace=False)
        pytest.skip(why)


class Daemon:
    """A daemon served in-process on an ephemeral port, for integration tests."""

    def __init__(self, url: str, scope: trio.CancelScope) -> None:
        self.url = url
        self.scope = scope
        self.client = httpx.AsyncClient(base_url=url, timeout=60)


def mock_config(spec: str = "mock?step_ms=1&prefill_us=5", *, max_batch: int = 4, **kw: object) -> ServeConfig:
    planner = PlannerConfig(max_batch=max_batch)
    base = dict(models=(ModelSource(spec=spec, runtime="mock", name="mock"),), host="127.0.0.1", port=0,
                max_batch=max_batch, planner=planner, hang_timeout_s=5.0)
    base.update(kw)
    return ServeConfig(**base)  # type: ignore[arg-type]


async def start_daemon(nursery: trio.Nursery, config: ServeConfig) -> Daemon:
    if config.sessions is None:
        import tempfile

        import attrs

        config = attrs.evolve(config, sessions=Path(tempfile.mkdtemp(prefix="superfluid-test-sessions-")))
    scope = trio.CancelScope()

    async def run(*, task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
        with scope:
            await serve(config, handle_signals=False, task_status=task_status)

    binds = await nursery.start(run)
    return Daemon(binds[0], scope)


@asynccontextmanager
async def open_daemon(config: ServeConfig) -> AsyncIterator[Daemon]:
    """A daemon for the block; leaving it cancels ``serve`` and waits for it to end
    (every model's actor, worker and session task gone)."""
    async with trio.open_nursery() as nursery:
        d = await start_daemon(nursery, config)
        try:
            yield d
        finally:
            with trio.move_on_after(5, shield=True):
                await d.client.aclose()
            d.scope.cancel()


@pytest.fixture
async def daemon(nursery: trio.Nursery) -> AsyncIterator[Daemon]:
    d = await start_daemon(nursery, mock_config())
    yield d
    await d.client.aclose()
    d.scope.cancel()


def worker_pids(runtime: str = "mock") -> list[int]:
    import psutil

    me = psutil.Process()
    return [p.pid for p in me.children(recursive=True)
            if any(f"superfluid-worker-{runtime}" in part for part in p.cmdline())]


async def sse_events(response: httpx.Response) -> list[dict]:
    """Collect the JSON payloads of an SSE response; asserts it ends with [DONE]."""
    events: list[dict] = []
    done = False
    async for event in aiter_sse(response.aiter_bytes()):
        if not event.data:
            continue
        if event.data == "[DONE]":
            done = True
            continue
        assert not done, "data after [DONE]"
        events.append(event.json())
    assert done, "stream ended without [DONE]"
    return events


def stream_text(events: list[dict]) -> str:
    return "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e.get("choices"))


async def wait_healthy(url: str, proc: subprocess.Popen[bytes]) -> None:
    """Wait until a daemon started as a subprocess answers ``/health`` 200 (it must not exit first);
    the caller bounds the wait."""
    while True:
        assert proc.poll() is None, "daemon exited"
        try:
            async with httpx.AsyncClient() as c:
                if (await c.get(url + "/health")).status_code == 200:
                    return
        except httpx.HTTPError:
            pass
        await trio.sleep(0.1)
