"""--park: a finished sequence's KV on disk, restored by a later prompt that extends it.

Over the mock engine, whose next token is a pure function of the KV it holds: a
restored artifact that held anything but the prompt's tokens would change the
text, so "the same text as a cold run" checks the restore itself.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from superfluid.proto import Admit, Sampling
from superfluid.worker._executor import Executor
from superfluid.worker._mock import WORD0, MockEngine
from .conftest import mock_config, start_daemon, worker_pids
from .test_daemon import metric
from superfluid.worker._park import MAGIC, PARK_MIN_TOKENS, SUFFIX, ParkStore, park_digest, salt_key

SPEC = "mock?step_ms=0&prefill_us=0&n_ctx=2000&eos_every=0"
IDENTITY = "mock-test-identity"
PROMPT = [WORD0 + (i * 7) % 50 for i in range(400)]
NEXT = PROMPT + [WORD0 + 3] * 40     # the next turn: the parked prefix and more


def store(path: Path, budget: int = 1 << 20, **kw: Any) -> ParkStore:
    return ParkStore(path / "park", budget, kw.pop("identity", IDENTITY), **kw)


def executor(park: ParkStore | None, n_seq: int = 2) -> Executor:
    return Executor(MockEngine(SPEC, n_seq=n_seq), max_lanes=1, park=park)


def run(ex: Executor, prompt: list[int], *, lane: int = 0, salt: str = "", max_new: int = 8) -> tuple[list[int], int]:
    """(generated tokens, cached prompt tokens) of one lane run to its end."""
    got = ex.admit(Admit(lane=lane, tokens=prompt, n_prompt=len(prompt), max_new=max_new,
                         sampling=Sampling(temperature=0.0), cache_salt=salt))
    out: list[int] = []
    while ex.lanes:
        res = ex.step(prefill_budget=512)
        assert not res.faults
        out += [row[1] for row in res.emits]
    return out, got.cached


def cold(prompt: list[int], max_new: int = 8) -> list[int]:
    return run(executor(None), prompt, max_new=max_new)[0]


def parked(tmp_path: Path, salt: str = "", **kw: Any) -> tuple[ParkStore, Path]:
    """A store holding PROMPT's finished sequence; and its file."""
    st = store(tmp_path, **kw)
    run(executor(st), PROMPT, salt=salt)
    st.flush()
    files = list((tmp_path / "park").glob("*" + SUFFIX))
    assert len(files) == 1 and st.snapshot()["parks"] == 1
    return st, files[0]


def test_a_finished_sequence_is_parked_private_and_restored_after_a_restart(tmp_path: Path) -> None:
    st, path = parked(tmp_path)
    assert stat.S_IMODE(os.stat(tmp_path / "park").st_mode) == 0o700
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    raw = path.read_bytes()
    assert raw.startswith(MAGIC)
    header = json.loads(raw[len(MAGIC) + 4: len(MAGIC) + 4 + int.from_bytes(raw[8:12], "little")])
    held = header["tokens"]
    assert held[: len(PROMPT)] == PROMPT and path.name == park_digest("", IDENTITY, held) + SUFFIX
    assert header["salt"] == salt_key("") and header["identity"] == IDENTITY   # the salt's hash, not the salt
    st.close()
    # a new worker (a restart): the index comes back from the headers; the next turn restores
    st2 = store(tmp_path)
    assert len(st2) == 1
    out, cached = run(executor(st2), NEXT)
    assert cached == len(PROMPT) and out == cold(NEXT)
    snap = st2.snapshot()
    assert snap["resumes"] == 1 and snap["resume_tokens"] == len(PROMPT) and not snap["fallbacks"]
    st2.close()


def test_a_short_sequence_is_not_parked_and_a_covered_one_not_twice(tmp_path: Path) -> None:
    st = store(tmp_path)
    ex = executor(st)
    run(ex, PROMPT[: PARK_MIN_TOKENS - 20])
    st.flush()
    assert st.snapshot()["parks"] == 0
    run(ex, PROMPT)
    st.flush()
    run(ex, PROMPT)   # the same sequence again: held by the artifact already
    st.flush()
    assert st.snapshot()["parks"] == 1
    st.close()


def test_a_longer_turn_replaces_the_artifact_it_extends(tmp_path: Path) -> None:
    st, first = parked(tmp_path)
    (held,) = [e.tokens for e in st._entries.values()]
    ex = executor(st)
    run(ex, held + [WORD0 + 3] * 40)   # the next turn: the prompt, the reply and a new message
    st.flush()
    files = list((tmp_path / "park").glob("*" + SUFFIX))
    assert len(files) == 1 and files[0] != first and st.snapshot()["parks"] == 2
    st.close()


def _damage(path: Path, how: str) -> None:
    raw = bytearray(path.read_bytes())
    if how == "torn":
        path.write_bytes(raw[: len(raw) - 10])
    elif how == "checksum":
        raw[-5] ^= 0xFF
        path.write_bytes(bytes(raw))
    elif how == "garbage":
        path.write_bytes(b"not a park file at all")
    elif how == "missing":
        path.unlink()


@pytest.mark.parametrize("how,reason", [("checksum", "checksum"), ("missing", "missing"), ("torn", "torn")])
def test_a_damaged_artifact_falls_back_to_prefill_counted_and_deleted(tmp_path: Path, how: str, reason: str) -> None:
    st, path = parked(tmp_path)
    _damage(path, how)   # after the index was built: found at restore
    out, cached = run(executor(st), NEXT)
    assert cached == 0 and out == cold(NEXT)
    snap = st.snapshot()
    assert snap["resumes"] == 0 and snap["fallbacks"] == {reason: 1} and snap["artifacts"] == 0
    assert not path.exists()
    st.close()


@pytest.mark.parametrize("how", ["torn", "garbage"])
def test_a_damaged_artifact_is_refused_when_the_index_is_built(tmp_path: Path, how: str) -> None:
    st, path = parked(tmp_path)
    st.close()
    _damage(path, how)
    st2 = store(tmp_path)
    assert len(st2) == 0 and st2.snapshot()["fallbacks"] == {"torn": 1} and not path.exists()
    out, cached = run(executor(st2), NEXT)
    assert cached == 0 and out == cold(NEXT)
    st2.close()


def test_another_models_or_builds_artifact_is_never_used(tmp_path: Path) -> None:
    st, path = parked(tmp_path)
    st.close()
    other = store(tmp_path, identity="another-model")
    assert len(other) == 1 and other.best(NEXT, len(NEXT) - 1, "", whole=False) is None
    out, cached = run(executor(other), NEXT)
    assert cached == 0 and out == cold(NEXT) and path.exists()   # kept: it is the other model's
    other.close()


def test_a_header_claiming_another_salt_is_refused_as_foreign(tmp_path: Path) -> None:
    """An artifact of salt a whose header is edited to claim salt b is indexed under b, but the
    digest recomputed from b's salt differs from the file's: refused, deleted, never imported."""
    st, path = parked(tmp_path, salt="a")
    st.close()
    raw = path.read_bytes()
    n = int.from_bytes(raw[8:12], "little")
    header = json.loads(raw[12: 12 + n])
    body = json.dumps(dict(header, salt=salt_key("b")), separators=(",", ":")).encode()
    path.write_bytes(MAGIC + len(body).to_bytes(4, "little") + body + raw[12 + n:])
    st2 = store(tmp_path)
    assert st2.best(NEXT, len(NEXT) - 1, "b", whole=False) is not None   # the index trusts headers
    out, cached = run(executor(st2), NEXT, salt="b")                    # the load does not
    assert cached == 0 and out == cold(NEXT)
    assert st2.snapshot()["fallbacks"] == {"foreign": 1} and not path.exists()
    st2.close()


def test_an_import_the_engine_refuses_falls_back(tmp_path: Path) -> None:
    st, _path = parked(tmp_path)
    ex = executor(st)
    ex.engine.seq_import = lambda seq, data: False   # type: ignore[method-assign]
    out, cached = run(ex, NEXT)
    assert cached == 0 and out == cold(NEXT)
    assert st.snapshot()["fallbacks"] == {"import": 1}
    st.close()


def test_a_writer_behind_drops_the_park_and_never_blocks_the_engine(tmp_path: Path) -> None:
    st = store(tmp_path, queue_items=1)
    gate = threading.Event()
    real = st._write

    def slow(*a: Any) -> int:
        gate.wait(10)
        return real(*a)

    st._write = slow  # type: ignore[method-assign]
    ex = executor(st, n_seq=4)
    for i in range(4):   # four different conversations; the writer holds the first, the queue one more
        run(ex, [WORD0 + i] + PROMPT, lane=i)
        while i == 0 and not st._queue.empty():
            time.sleep(0.001)
    gate.set()
    st.flush()
    snap = st.snapshot()
    assert snap["parks"] == 2 and snap["fallbacks"] == {"queue_full": 2}
    st.close()


def test_a_failed_write_or_a_state_that_is_no_buffer_drops_that_park_only(tmp_path: Path) -> None:
    st = store(tmp_path)
    assert not st.put(PROMPT, "", object())   # (MLX's state is arrays: its worker turns --park off)
    real, calls = st._write, []

    def failing(*a: Any) -> int:
        calls.append(1)
        if len(calls) == 1:
            raise OSError(28, "No space left on device")
        return real(*a)

    st._write = failing  # type: ignore[method-assign]
    ex = executor(st, n_seq=4)
    run(ex, [WORD0 + 1] + PROMPT, lane=0)
    st.flush()
    run(ex, [WORD0 + 2] + PROMPT, lane=1)   # the writer lives on
    st.flush()
    snap = st.snapshot()
    assert snap["parks"] == 1 and snap["fallbacks"] == {"unsupported": 1, "write_error": 1}
    assert not list((tmp_path / "park").glob("*.tmp"))
    st.close()


def test_tenant_bs_identical_prompt_does_not_restore_tenant_as_park(tmp_path: Path) -> None:
    st, _path = parked(tmp_path, salt="tenant-a")
    st.close()
    st2 = store(tmp_path)
    out, cached = run(executor(st2), NEXT, salt="tenant-b")
    assert cached == 0 and out == cold(NEXT) and st2.snapshot()["resumes"] == 0
    out, cached = run(executor(st2), NEXT, salt="tenant-a")   # the positive control
    assert cached == len(PROMPT) and st2.snapshot()["resumes"] == 1
    st2.close()


def test_a_thousand_parked_sessions_stay_within_the_budget(tmp_path: Path) -> None:
    """1,000 conversations of 256 tokens (about 1.6 KB each on the mock) in a 64 KiB budget:
    the directory never holds more, the newest are the ones kept, and each still restores."""
    budget = 64 << 10
    st = store(tmp_path, budget=budget, queue_items=1 << 12)
    ex = executor(st, n_seq=2)
    prompts = [[WORD0 + i % 50, WORD0 + i // 50, *PROMPT[:PARK_MIN_TOKENS]] for i in range(1000)]
    for i, prompt in enumerate(prompts):
        run(ex, prompt, lane=i, max_new=1)
    st.flush()
    files = list((tmp_path / "park").glob("*" + SUFFIX))
    on_disk = sum(f.stat().st_size for f in files)
    snap = st.snapshot()
    assert snap["parks"] == 1000 and on_disk <= budget and snap["bytes"] == on_disk
    assert snap["evicted"] == 1000 - len(files) and len(files) > 10
    st.close()
    st2 = store(tmp_path, budget=budget)
    assert len(st2) == len(files)
    _out, cached = run(executor(st2), prompts[-1] + [WORD0 + 9] * 10)
    assert cached > PARK_MIN_TOKENS   # the newest is kept
    _out, cached = run(executor(st2), prompts[0] + [WORD0 + 9] * 10)
    assert cached == 0                # the oldest went first
    st2.close()


# -- through the daemon ------------------------------------------------------------------------------------------

LONG_TEXT = " ".join(["the quick brown fox jumps over the lazy dog and keeps on running"] * 30)


async def chat(c: httpx.AsyncClient, messages: list[dict[str, str]], **extra: Any) -> tuple[str, int]:
    r = await c.post("/v1/chat/completions", json={"model": "mock", "max_tokens": 12, "temperature": 0,
                                                   "messages": messages, **extra})
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["message"]["content"], body["usage"]["prompt_tokens_details"]["cached_tokens"]


async def parked_files(sessions: Path, at_least: int = 1) -> list[Path]:
    with trio.fail_after(10):
        while True:   # (the writer is another process's thread: a file to poll, no event to wait on)
            files = list((sessions / "park").glob("*" + SUFFIX))
            if len(files) >= at_least:
                return files
            await trio.sleep(0.02)


async def test_a_conversation_resumes_from_its_park_after_a_worker_and_a_daemon_restart(tmp_path: Path) -> None:
    first = [{"role": "user", "content": LONG_TEXT}]
    async with trio.open_nursery() as nursery:   # the reference: no --park
        d = await start_daemon(nursery, mock_config(sessions=tmp_path / "cold"))
        reply, _ = await chat(d.client, first)
        second = [*first, {"role": "assistant", "content": reply}, {"role": "user", "content": "and then?"}]
        d.scope.cancel()
    async with trio.open_nursery() as nursery:
        d = await start_daemon(nursery, mock_config(sessions=tmp_path / "cold2"))
        reference, _ = await chat(d.client, second)
        d.scope.cancel()
    config = mock_config(sessions=tmp_path / "s", park=True, park_budget_gb=0.01)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            d = await start_daemon(nursery, config)
            assert (await chat(d.client, first))[0] == reply
            await parked_files(tmp_path / "s")
            with trio.fail_after(10):   # reported when written (Telemetry), though no tick runs after it
                while True:
                    if await metric(d, "superfluid_parks_total") == 1:
                        break
                    await trio.sleep(0.02)
            assert await metric(d, "superfluid_park_export_seconds_total") > 0
            [pid] = worker_pids()
            os.kill(pid, signal.SIGKILL)   # a new worker: its KV is empty, its park index read from disk
            text, cached = await chat(d.client, second)
            assert text == reference and cached > PARK_MIN_TOKENS
            assert await metric(d, "superfluid_resumes_total") == 1
            assert await metric(d, "superfluid_park_bytes") > 0
            d.scope.cancel()
        async with trio.open_nursery() as nursery:   # a daemon restart
            d = await start_daemon(nursery, config)
            text, cached = await chat(d.client, second)
            assert text == reference and cached > PARK_MIN_TOKENS
            assert await metric(d, "superfluid_resumes_total") == 1
            assert await metric(d, "superfluid_park_restore_seconds_total") > 0
            assert await metric(d, "superfluid_park_fallbacks_total") == 0
            d.scope.cancel()


def test_park_flags(capsys: pytest.CaptureFixture[str]) -> None:
    from superfluid.cli._main import main
    from superfluid.nursery._worker import WorkerSpec, worker_argv

    with pytest.raises(SystemExit) as exc:
        main(["serve", "mock", "--park", "--park-budget-gb", "0"])
    assert exc.value.code == 2
    [line] = capsys.readouterr().err.splitlines()
    assert "--park-budget-gb" in line and "must be more than 0" in line
    argv = worker_argv(WorkerSpec(runtime="mock", model="mock", park_dir="/s/park", park_budget_mb=4096))
    assert argv[argv.index("--park-dir"):][:4] == ["--park-dir", "/s/park", "--park-budget-mb", "4096"]
    assert "--park-dir" not in worker_argv(WorkerSpec(runtime="mock", model="mock"))


def test_a_model_directorys_park_identity_changes_with_its_files(tmp_path: Path) -> None:
    """An MLX model is a directory: its park identity names each file's size and mtime, so a
    rewritten weights file makes every park of the old weights foreign."""
    import argparse

    from superfluid.worker._main import park_identity

    model = tmp_path / "model"
    model.mkdir()
    weights = model / "model.safetensors"
    weights.write_bytes(b"a" * 10)
    args = argparse.Namespace(model=str(model), runtime="mock", deterministic=False)
    engine = MockEngine(SPEC, n_seq=1)
    before = park_identity(args, engine)
    assert park_identity(args, engine) == before
    weights.write_bytes(b"b" * 11)   # the directory's own mtime does not change
    assert park_identity(args, engine) != before


@pytest.mark.real
def test_real_model_a_parked_prompt_restores_with_the_cold_text(tmp_path: Path) -> None:
    """SmolLM2 on llama.cpp (exact mode, llama.cpp's default): a turn restored from the park (llama.cpp's
    per-sequence state, read back from disk into an empty KV) gives the tokens a cold prefill gives."""
    from . import test_llamacpp_engine as real

    engine_it = real._engine(real.SMOL, max_context=1024)
    engine = next(engine_it)
    try:
        assert "kv_type" in engine.info.extra
        text = "Here is a long story about a lighthouse keeper and the sea. " * 40
        first = real.prompt(engine, text)[:400]
        nxt = first + real.prompt(engine, " Then what happened to the keeper?")[1:]

        def run_on(park: ParkStore | None, tokens: list[int]) -> tuple[list[int], int]:
            for seq in range(engine.info.n_seq):
                engine.seq_rm(seq, 0, -1)
            ex = Executor(engine, max_lanes=2, park=park)   # exact mode: the cold shape, warm or not
            cached = real.admit(ex, 0, tokens, max_new=8).cached
            return real.tokens_of(real.drain(ex)[0]), cached

        st = store(tmp_path, budget=1 << 30, identity="smol-test")
        run_on(st, first)
        st.flush()
        assert st.snapshot()["parks"] == 1
        reference, cached = run_on(None, nxt)
        assert cached == 0
        got, cached = run_on(st, nxt)
        assert cached >= 256 and got == reference
        assert st.snapshot()["resumes"] == 1 and not st.snapshot()["fallbacks"]
        st.close()
    finally:
        engine_it.close()


def test_a_preempted_lane_is_not_parked(tmp_path: Path) -> None:
    """A preemption publishes the lane's KV for its resume; only a finished generation is parked."""
    st = store(tmp_path)
    ex = executor(st)
    ex.admit(Admit(lane=0, tokens=PROMPT, n_prompt=len(PROMPT), max_new=8, sampling=Sampling(temperature=0.0)))
    while ex.lanes[0].n_past < len(PROMPT):
        ex.step(prefill_budget=512)
    ex.cancel(0, publish=True)
    st.flush()
    assert st.snapshot()["parks"] == 0
    st.close()


_OPS = st.lists(st.one_of(
    st.tuples(st.just("turn"), st.integers(0, 2), st.integers(1, 80), st.booleans()),
    st.tuples(st.just("restart")),
    st.tuples(st.just("damage"), st.sampled_from(["torn", "checksum", "garbage", "missing"]), st.integers(0, 9)),
), min_size=1, max_size=12)
SALTS = ("", "a", "b")


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=_OPS)
def test_turns_restarts_and_damage_never_change_a_reply(tmp_path_factory: pytest.TempPathFactory,
                                                        ops: list[tuple[Any, ...]]) -> None:
    """Three conversations, each under its own salt, take turns; the worker restarts (a new store
    and executor on the same directory) and park files are damaged, at random, in a budget that
    evicts: every reply is the cold run's, a turn sent under another conversation's salt reuses
    nothing, and the directory stays within the budget."""
    root = tmp_path_factory.mktemp("park")
    budget = 12 << 10
    st_ = store(root, budget=budget)
    ex = executor(st_, n_seq=2)
    convs: list[list[int]] = [[WORD0 + 40 + i] + PROMPT[:260] for i in range(3)]
    tag = 0
    crossed: set[int] = set()
    try:
        for op in ops:
            if op[0] == "turn":
                _, i, more, cross = op
                prompt = convs[i] + [WORD0 + (i * 11 + k) % 50 for k in range(more)]
                tag += 1
                out, cached = run(ex, prompt, salt=SALTS[(i + cross) % 3], lane=tag, max_new=6)
                assert out == cold(prompt, 6)
                if cross:
                    assert i in crossed or cached == 0   # (a later one may reuse the first's own KV)
                    crossed.add(i)
                else:
                    convs[i] = prompt + out
            elif op[0] == "restart":
                st_.close()
                st_ = store(root, budget=budget)
                ex = executor(st_, n_seq=2)
            else:
                st_.flush()
                files = sorted((root / "park").glob("*" + SUFFIX))
                if files:
                    _damage(files[op[2] % len(files)], op[1])
        st_.flush()
        assert sum(f.stat().st_size for f in (root / "park").glob("*" + SUFFIX)) <= budget
    finally:
        st_.close()
