"""Deterministic mode (``--deterministic``): a request's output does not depend
on what runs beside it, on load, on the prefix cache or on a worker kill.

The executor half is checked on the mock (every KV entry computed in one
shape: prompt tokens in fixed grid cells, committed tokens replayed one per
decode round, only whole cells reused); the real half on llama.cpp with both
real models (SmolLM2, plain attention, per-sequence KV; Gemma 3, sliding
window, shared pool), with a CPU hog on both cores for the adverse runs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Self

import httpx
import pytest
import trio

from superfluid.serving import ModelSource, ServeConfig
from superfluid.proto import Admit, Sampling
from superfluid.sched import PlannerConfig
from superfluid.worker._engine import BatchRow
from superfluid.worker._executor import GRID, Executor
from superfluid.worker._mock import WORD0, MockEngine

from .conftest import (
    GEMMA_GGUF,
    REAL_GGUF,
    Daemon,
    mock_config,
    sse_events,
    start_daemon,
    stream_text,
    worker_pids,
)

# -- the executor's shapes, on the mock --------------------------------------------


class _Recorder(MockEngine):
    """A mock engine that records every row it decodes as (seq, pos0, n_tokens)."""

    rows: list[tuple[int, int, int]]

    def decode(self, rows: list[BatchRow]) -> list[Any]:
        self.rows.extend((r.seq, r.pos0, len(r.tokens)) for r in rows)
        return super().decode(rows)


def _executor(**kw: Any) -> tuple[Executor, _Recorder]:
    engine = _Recorder("mock?step_ms=0&prefill_us=0&n_ctx=4096", n_seq=6)
    engine.rows = []
    return Executor(engine, max_lanes=4, deterministic=True, **kw), engine


def _run(ex: Executor, admits: list[Admit], budgets: Iterator[int]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {a.lane: [] for a in admits}
    for a in admits:
        ex.admit(a)
    while ex.lanes:
        for row in ex.step(prefill_budget=next(budgets)).emits:
            out[row[0]].append(row[1])
    return out


def _admit(lane: int, prompt: list[int], generated: list[int] = (), max_new: int = 8) -> Admit:  # type: ignore[assignment]
    return Admit(lane=lane, tokens=[*prompt, *generated], n_prompt=len(prompt), max_new=max_new,
                 sampling=Sampling(), ignore_eos=True)


PROMPT = [WORD0 + i % 50 for i in range(3 * GRID + 10)]


def test_prompt_cells_are_fixed_whatever_the_budget() -> None:
    """Every prefill row of a prompt is one grid cell, under any step budget."""
    shapes = []
    for budgets in ([7, 5000], [GRID * 4], [1, 2, 3, 300]):
        ex, eng = _executor()
        _run(ex, [_admit(0, PROMPT)], iter(budgets * 100))
        shapes.append([r for r in eng.rows if r[2] > 1 or r[1] < len(PROMPT)])
    assert shapes[0] == shapes[1] == shapes[2]
    assert [(p, n) for _s, p, n in shapes[0]] == [(0, GRID), (GRID, GRID), (2 * GRID, GRID), (3 * GRID, 10)]


def test_committed_tokens_are_replayed_one_per_round() -> None:
    """A resumed lane prefills its prompt in cells and decodes its committed
    tokens one at a time, as they were first computed; it then draws what the
    uninterrupted lane drew."""
    ex, _eng = _executor()
    full = _run(ex, [_admit(0, PROMPT, max_new=12)], iter([512] * 100))[0]
    ex, eng = _executor()
    rest = _run(ex, [_admit(0, PROMPT, full[:5], max_new=12)], iter([512] * 100))[0]
    assert full[:5] + rest == full
    # no row reaches past the prompt unless it is a single token
    assert all(p + n <= len(PROMPT) or n == 1 for _s, p, n in eng.rows)
    assert [p for _s, p, _n in eng.rows if p >= len(PROMPT)][:5] == list(range(len(PROMPT), len(PROMPT) + 5))


def test_only_whole_prompt_cells_are_reused() -> None:
    """A second request reuses the first one's whole prompt cells, never its
    partial last cell or its generated tokens (computed in another shape); the
    same whole prompt again takes it all with its last step's logits (a tail hit)."""
    ex, eng = _executor()
    _run(ex, [_admit(0, PROMPT, max_new=4)], iter([512] * 100))
    eng.rows.clear()
    lane = ex.admit(_admit(1, PROMPT, max_new=4))
    assert lane.cached == len(PROMPT) and lane.primed is not None
    ex.cancel(1, publish=True)
    lane = ex.admit(_admit(1, PROMPT[:-1], max_new=4))   # no tail for it: whole cells only
    assert lane.cached == 3 * GRID
    longer = ex.admit(_admit(2, PROMPT + [WORD0 + 1] * GRID, max_new=4))
    assert longer.cached == 3 * GRID


# -- default settings over a grid engine (llama.cpp per-sequence KV): exact mode -------------


def _grid_executor(host: int = 0) -> tuple[Executor, _Recorder]:
    """A default-mode executor over a mock that says, as llama.cpp per sequence does, that its
    rows depend on the pass's shape (``grid``)."""
    engine = _Recorder("mock?step_ms=0&prefill_us=0&n_ctx=4096", n_seq=6)
    engine.rows = []
    engine.grid = True   # type: ignore[attr-defined]
    return Executor(engine, max_lanes=4, host_cache_bytes=host), engine


LONG = [WORD0 + i % 50 for i in range(9 * GRID + 23)]


def _prompt_rows(eng: _Recorder, n_prompt: int) -> list[tuple[int, int]]:
    return [(p, n) for _s, p, n in eng.rows if p < n_prompt]


def test_default_prompt_cells_end_on_the_grid_and_the_last_one_goes_alone() -> None:
    """Without --deterministic, over a grid engine, a step takes as many whole cells as its
    budget allows (at least one), never a part, and the last step (the cell holding the last prompt
    token, with the full cell before it when that one is partial: 64 + 23 rows, flash attention's
    tiled kernel) goes alone: whatever the budgets and whatever a short earlier request left in
    the cache, that step is computed in one shape, and the draws are the same."""
    outs, lasts = [], []
    for shared, budgets in ((0, [2048]), (0, [7, 300]), (1, [100]), (10, [2048]), (63, [1, 5000]),
                            (GRID + 5, [130]), (4 * GRID, [2048])):
        ex, eng = _grid_executor()
        if shared:
            _run(ex, [_admit(0, LONG[:shared] + [WORD0 + 49] * 3, max_new=2)], iter([2048] * 100))
            eng.rows.clear()
        got = _run(ex, [_admit(1, LONG, max_new=6)], iter(budgets * 100))[1]
        rows = _prompt_rows(eng, len(LONG))
        assert rows[0][0] == shared // GRID * GRID   # reuse cut back to whole cells
        assert all(p % GRID == 0 and (n % GRID == 0 or p + n == len(LONG)) for p, n in rows), rows
        lasts.append(rows[-1])
        outs.append(got)
    assert set(lasts) == {(8 * GRID, GRID + 23)}
    assert all(o == outs[0] for o in outs)


def test_default_reuse_keeps_only_whole_prompt_cells_from_a_slot_a_copy_and_host_memory() -> None:
    """A finished lane keeps its whole prompt cells (not its generated tokens, decoded in another
    shape), and its whole prompt with its last step's logits (a tail: the same prompt again takes
    it all); a copy from a running lane and a host-memory import are cut to whole cells, and none
    reaches into the new prompt's last step."""
    ex, _eng = _grid_executor(host=64 << 20)

    def drain() -> None:
        while ex.lanes:
            ex.step(prefill_budget=2048)

    _run(ex, [_admit(0, LONG, max_new=4)], iter([2048] * 100))
    assert max(len(slot.tokens) for slot in ex.slots) == len(LONG)
    assert max(slot.exact for slot in ex.slots if slot.held) == 9 * GRID
    warm = ex.admit(_admit(1, LONG, max_new=4))
    assert warm.cached == len(LONG)   # a tail hit
    follow = ex.admit(_admit(2, LONG + [WORD0 + 7] * 40, max_new=4))   # copied from lane 1's sequence
    assert follow.cached == 8 * GRID and follow.seq != warm.seq
    drain()
    # host memory: the only sequence overwritten by another prompt, then asked again; the new
    # prompt parts from the entry mid-cell
    engine = _Recorder("mock?step_ms=0&prefill_us=0&n_ctx=4096", n_seq=1)
    engine.rows, engine.grid = [], True   # type: ignore[attr-defined]
    ex = Executor(engine, max_lanes=1, host_cache_bytes=64 << 20)
    _run(ex, [_admit(0, LONG, max_new=4)], iter([2048] * 100))
    _run(ex, [_admit(1, [WORD0 + 45] * (3 * GRID), max_new=1)], iter([2048] * 100))
    assert len(ex.host) == 1
    back = ex.admit(_admit(2, LONG[: 5 * GRID + 30] + [WORD0 + 3] * (GRID + 10), max_new=2))
    assert back.cached == 5 * GRID and ex.host.stats["hits"] == 1


def test_default_resumed_lane_replays_its_committed_tokens_one_per_round() -> None:
    """Over a grid engine a resumed lane (after a worker or daemon crash) prefills its prompt on
    the grid and decodes its committed tokens one per round, as they were first computed."""
    ex, _eng = _grid_executor()
    full = _run(ex, [_admit(0, LONG, max_new=12)], iter([2048] * 100))[0]
    ex, eng = _grid_executor()
    rest = _run(ex, [_admit(0, LONG, full[:5], max_new=12)], iter([2048] * 100))[0]
    assert full[:5] + rest == full
    assert all(p + n <= len(LONG) or n == 1 for _s, p, n in eng.rows)
    assert _prompt_rows(eng, len(LONG))[-1] == (8 * GRID, GRID + 23)


def test_an_engine_without_the_grid_keeps_plain_chunks_and_reuse() -> None:
    """The mock (no ``grid``: its rows do not depend on the pass) and llama.cpp's shared pool
    (whole-sequence reuse only) keep plain chunking and reuse."""
    engine = _Recorder("mock?step_ms=0&prefill_us=0&n_ctx=4096", n_seq=6)
    engine.rows = []
    ex = Executor(engine, max_lanes=4)
    assert not ex.exact
    _run(ex, [_admit(0, LONG, max_new=2)], iter([300] * 100))
    assert [n for _s, p, n in engine.rows if p < len(LONG)] == [300, len(LONG) - 300]
    assert ex.admit(_admit(1, LONG, max_new=2)).cached == len(LONG) - 1


async def test_the_flag_reaches_the_worker_and_a_killed_stream_continues_identically(
        nursery: trio.Nursery) -> None:
    """``ServeConfig.deterministic`` starts the worker with ``--deterministic``;
    on the mock a stream whose worker is SIGKILLed continues to the reference."""
    import psutil

    d = await start_daemon(nursery, mock_config("mock?step_ms=10&prefill_us=5", deterministic=True,
                                                stream_interval_ms=0, agent_stream_interval_ms=0))
    body = {"model": "mock", "messages": [{"role": "user", "content": "count " * 100}], "max_tokens": 64,
            "ignore_eos": True, "temperature": 0, "stream": True}
    ref = await _text(d, body)
    assert all("--deterministic" in psutil.Process(pid).cmdline() for pid in worker_pids("mock"))
    head, events = await _kill_after(d, body, chunks=10, runtime="mock")
    assert stream_text(events) == ref and ref.startswith(head)
    d.scope.cancel()


# -- llama.cpp, both real models --------------------------------------------------


def _real_ready(path: Path) -> bool:
    if os.environ.get("SUPERFLUID_REQUIRE_REAL") == "1":
        return True
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return path.exists()


MODELS = [pytest.param(REAL_GGUF, id="smollm2", marks=[pytest.mark.real, pytest.mark.skipif(
              not _real_ready(REAL_GGUF), reason=f"no llama_cpp or no model at {REAL_GGUF}")]),
          pytest.param(GEMMA_GGUF, id="gemma3", marks=[pytest.mark.real, pytest.mark.skipif(
              not _real_ready(GEMMA_GGUF), reason=f"no llama_cpp or no model at {GEMMA_GGUF}")])]
SMOL = MODELS[:1]
TOKENS = 40


class _Hog:
    """A busy loop on every core, for the test's duration (processes this test starts and ends)."""

    def __enter__(self) -> Self:
        self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                      for _ in range(os.cpu_count() or 2)]
        return self

    def __exit__(self, *exc: object) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait()


# every engine round is a chunk (no coalescing in the worker), as llama-server streams: a kill
# "at the N-th chunk" then lands N rounds in, whatever the class's stream interval
EVERY_ROUND = {"stream_interval_ms": 0, "agent_stream_interval_ms": 0}


async def _daemon(nursery: trio.Nursery, path: Path, *, max_batch: int = 8) -> Daemon:
    # one engine thread: llama.cpp's spinning thread barrier slows ~40x when its threads
    # share the cores with a busy process (the hog)
    cfg = ServeConfig(models=(ModelSource(spec=str(path), runtime="llamacpp", name="m"),), port=0,
                      max_batch=max_batch, max_context=1024, threads=1, planner=PlannerConfig(max_batch=max_batch),
                      hang_timeout_s=300.0, deterministic=True, **EVERY_ROUND)
    d = await start_daemon(nursery, cfg)
    d.client.timeout = httpx.Timeout(600)
    return d


def _body(text: str, **kw: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": text}], "temperature": 0, "stream": True,
            "max_tokens": TOKENS, "ignore_eos": True, **kw}


async def _text(d: Daemon, body: dict[str, Any]) -> str:
    async with d.client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        events = await sse_events(r)
    assert not any("error" in e for e in events), events[-1]
    return stream_text(events)


async def _kill_after(d: Daemon, body: dict[str, Any], chunks: int,
                      runtime: str = "llamacpp") -> tuple[str, list[dict[str, Any]]]:
    """Stream ``body``; SIGKILL every worker at its ``chunks``-th content chunk. Returns the
    text delivered before the kill and every event (the stream's own end included)."""
    events: list[dict[str, Any]] = []
    head = ""
    killed = False
    async with d.client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            events.append(event)
            if stream_text([event]) and not killed and sum(1 for e in events if stream_text([e])) == chunks:
                head = stream_text(events)
                pids = worker_pids(runtime)
                assert pids
                for pid in pids:
                    os.kill(pid, signal.SIGKILL)
                killed = True
    assert killed, f"the stream ended before its {chunks}th chunk"
    return head, events


OTHERS = [f"Question {i}: explain topic number {i} in detail, please." for i in range(7)]
STORY = "Tell a long story about a clockmaker who builds a mechanical bird."


@pytest.mark.parametrize("path", MODELS)
async def test_greedy_text_is_the_same_alone_beside_seven_warm_and_after_a_kill(nursery: trio.Nursery,
                                                                                path: Path) -> None:
    """The same greedy request gives identical text alone on a quiet machine,
    then, with a CPU hog on every core: beside 7 other concurrent requests (on
    Gemma at ``--max-batch 7``), from
    a warm prefix cache, and with its worker SIGKILLed mid-stream (the stream
    continues on a new worker)."""
    # Gemma's decode rows diverge in batches of 8 (SPEC.md "Determinism"): 7 lanes, the 8th request queues
    d = await _daemon(nursery, path, max_batch=7 if path == GEMMA_GGUF else 8)
    ref = await _text(d, _body(STORY))
    with _Hog():
        beside: dict[int, str] = {}

        async def one(i: int, text: str) -> None:
            beside[i] = await _text(d, _body(text))

        async with trio.open_nursery() as n:
            for i, text in enumerate([STORY, *OTHERS]):
                n.start_soon(one, i, text)
        assert beside[0] == ref
        assert await _text(d, _body(STORY)) == ref   # warm: its whole prompt cells come from the cache
        head, events = await _kill_after(d, _body(STORY), chunks=8)
        assert stream_text(events) == ref and ref.startswith(head)
    d.scope.cancel()


@pytest.mark.parametrize("path", SMOL)
async def test_seeded_sampled_streams_are_the_same_after_a_worker_kill(nursery: trio.Nursery, path: Path) -> None:
    """Four concurrent sampled streams (temperature 0.8, each its own seed) give
    the same texts when their worker is SIGKILLed midway as without the kill."""
    d = await _daemon(nursery, path, max_batch=4)
    bodies = [_body(f"Tell a story about a robot named R{i}.", temperature=0.8, seed=100 + i) for i in range(4)]

    async def run(kill: bool) -> dict[int, str]:
        out: dict[int, str] = {}

        async def one(i: int) -> None:
            if kill and i == 0:
                _head, events = await _kill_after(d, bodies[0], chunks=6)
                assert not any("error" in e for e in events)
                out[0] = stream_text(events)
            else:
                out[i] = await _text(d, bodies[i])

        async with trio.open_nursery() as n:
            for i in range(4):
                n.start_soon(one, i)
        return out

    ref = await run(kill=False)
    assert len(set(ref.values())) == 4
    assert await run(kill=True) == ref
    d.scope.cancel()


@pytest.mark.parametrize("path", SMOL)
async def test_original_suite_worker_kill_passes_under_load(nursery: trio.Nursery, path: Path) -> None:
    """The original suite's ``worker_kill`` exactly: lanes 4, ctx 4096, a
    400-token greedy stream (seed 1, no ignore_eos), every worker SIGKILLed at
    its 60th content chunk, with a CPU hog on every core. Pass: the cut stream
    ended typed or completed identical to the reference; the delivered text is
    a prefix of the reference; the next identical request is identical."""
    cfg = ServeConfig(models=(ModelSource(spec=str(path), runtime="llamacpp", name="m"),), port=0, max_batch=4,
                      max_context=4096, threads=1, planner=PlannerConfig(max_batch=4), hang_timeout_s=300.0,
                      deterministic=True, **EVERY_ROUND)
    d = await start_daemon(nursery, cfg)
    d.client.timeout = httpx.Timeout(600)
    body = {"model": "m", "messages": [{"role": "user", "content": "Write a Python function that returns the "
                                        "n-th Fibonacci number, and explain how it works."}],
            "max_tokens": 400, "temperature": 0, "seed": 1, "stream": True,
            "stream_options": {"include_usage": True}, "chat_template_kwargs": {"enable_thinking": False}}
    ref = await _text(d, body)
    with _Hog():
        head, events = await _kill_after(d, body, chunks=60)
        typed = any("error" in e for e in events)
        got = stream_text(events)
        assert typed or got == ref
        assert ref.startswith(got)
        assert ref.startswith(head)
        assert await _text(d, body) == ref
    d.scope.cancel()
