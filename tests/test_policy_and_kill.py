"""Restart intensity, the worker environment, and the kill ladder.

The kill tests use real child processes (``[sys.executable, "-c", ...]``, as
trio's subprocess tests do) and virtual time: the grace periods are seconds
long on the Trio clock and take no wall time.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
import trio
import trio.testing

from superfluid.nursery import (RestartKind, RestartPolicy, RestartTracker, WorkerSpec, open_worker, scrub_env,
                                worker_env)
from superfluid.nursery._kill import graceful_kill, kill_now

from .conftest import REAL_GGUF

# ---- restart intensity ------------------------------------------------------------


def test_restart_intensity_within_a_window() -> None:
    tracker = RestartTracker(RestartPolicy(max_restarts=3, window_s=60.0))
    assert [tracker.allow(t) for t in (0.0, 1.0, 2.0)] == [True, True, True]
    assert not tracker.allow(3.0)
    assert not tracker.allow(59.9)  # refused attempts are not counted, but the window has not moved
    assert tracker.allow(60.0)      # the restart at t=0 has left the window
    assert not tracker.allow(60.5)
    assert tracker.allow(61.0)
    assert tracker.allow(62.0)
    assert not tracker.allow(62.0)


def test_restart_intensity_spread_out_never_trips() -> None:
    tracker = RestartTracker(RestartPolicy(max_restarts=2, window_s=10.0))
    assert all(tracker.allow(5.0 * i) for i in range(100))


def test_restart_reset_forgets_history() -> None:
    tracker = RestartTracker(RestartPolicy(max_restarts=1, window_s=10.0))
    assert tracker.allow(0.0)
    assert not tracker.allow(1.0)
    tracker.reset()
    assert tracker.allow(1.0)


def test_restart_zero_intensity_never_restarts() -> None:
    assert not RestartTracker(RestartPolicy(max_restarts=0)).allow(0.0)


@pytest.mark.parametrize(
    ("kind", "abnormal", "allowed"),
    [
        (RestartKind.PERMANENT, True, True),
        (RestartKind.PERMANENT, False, True),
        (RestartKind.TRANSIENT, True, True),
        (RestartKind.TRANSIENT, False, False),
        (RestartKind.TEMPORARY, True, False),
        (RestartKind.TEMPORARY, False, False),
    ],
)
def test_restart_kinds(kind: RestartKind, abnormal: bool, allowed: bool) -> None:
    assert RestartTracker(RestartPolicy(kind=kind)).allow(0.0, abnormal=abnormal) is allowed


async def test_restart_storm_on_the_trio_clock(autojump_clock: trio.testing.MockClock) -> None:
    policy = RestartPolicy(max_restarts=3, window_s=60.0, backoff_s=0.25)
    tracker = RestartTracker(policy)
    start = trio.current_time()
    restarts = 0
    while tracker.allow(trio.current_time()):
        restarts += 1
        await trio.sleep(policy.backoff_s)
    assert restarts == 3
    assert trio.current_time() - start == 3 * policy.backoff_s
    # a minute later the supervisor may try again
    await trio.sleep(60.0)
    assert tracker.allow(trio.current_time())


# ---- the worker's environment ----------------------------------------------------------

CREDENTIALS = [
    "HF_TOKEN", "GITHUB_TOKEN", "hf_token", "OPENAI_API_KEY", "ANTHROPIC_API_KEY", "Openai_Api_Key",
    "PASSWORD", "DB_PASSWORD", "PGPASSWORD", "MYSQL_PASSWORD_FILE", "SECRET", "AWS_SECRET_ACCESS_KEY",
    "CLIENT_SECRET", "SECRETS_DIR", "client_secret",
]
KEPT = [
    "PATH", "HOME", "LANG", "PYTHONPATH", "PYTHONUNBUFFERED", "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS",
    "TOKENIZERS_PARALLELISM", "SUPERFLUID_LOG", "TERM", "KEYBOARD_LAYOUT", "API_URL",
]


def test_scrub_env_drops_credentials_and_keeps_the_rest() -> None:
    environ = {name: "x" for name in CREDENTIALS + KEPT}
    assert scrub_env(environ) == {name: "x" for name in KEPT}


@pytest.mark.parametrize("name", CREDENTIALS)
def test_scrub_env_drops(name: str) -> None:
    assert scrub_env({name: "s3cret", "PATH": "/bin"}) == {"PATH": "/bin"}


def test_scrub_env_keeps_values_and_copies() -> None:
    environ = {"PATH": "/usr/bin:/bin", "EMPTY": ""}
    out = scrub_env(environ)
    assert out == environ and out is not environ


def test_worker_env_scrubs_and_asks_malloc_for_huge_pages() -> None:
    env = worker_env({"PATH": "/bin", "HF_TOKEN": "s3cret"})
    assert env == {"PATH": "/bin", "PYTHONUNBUFFERED": "1", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}


def test_worker_env_keeps_the_operators_tunables() -> None:
    # other tunables stay and the huge-page one joins them
    env = worker_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2", "PYTHONUNBUFFERED": "0"})
    assert env == {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1", "PYTHONUNBUFFERED": "0"}
    # an operator's own hugetlb setting wins, =0 included (the way to turn it off)
    for own in ("glibc.malloc.hugetlb=0", "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=2"):
        assert worker_env({"GLIBC_TUNABLES": own})["GLIBC_TUNABLES"] == own


def _thp_mode() -> str:
    """The kernel's THP mode ("always", "madvise", "never"), or "absent"."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "absent"
    return text.split("[", 1)[1].split("]", 1)[0] if "[" in text else "absent"


@pytest.mark.real
@pytest.mark.skipif(_thp_mode() not in ("madvise", "always"), reason="transparent huge pages are off here")
async def test_a_llamacpp_worker_holds_its_buffers_in_huge_pages() -> None:
    """The worker's KV cache and compute buffers sit in 2 MiB pages (SPEC.md section 1: the
    worker's environment). Under THP's "madvise" mode llama.cpp's own allocations get none."""
    inbox, _events = trio.open_memory_channel[object](100)
    spec = WorkerSpec(runtime="llamacpp", model=str(REAL_GGUF), max_batch=1, max_context=4096, threads=1)

    async def deliver(generation: int, event: object) -> None:
        await inbox.send((generation, event))

    with trio.fail_after(120):
        async with open_worker(spec, deliver, generation=1) as handle:
            with open(f"/proc/{handle.pid}/smaps_rollup") as f:  # noqa: ASYNC230 - procfs, no disk
                huge_kb = next(int(line.split()[1]) for line in f if line.startswith("AnonHugePages:"))
    assert huge_kb >= 2048, f"AnonHugePages {huge_kb} kB"


# ---- the kill ladder -----------------------------------------------------------------------

IGNORES_SIGTERM = (
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(60)"
)
DIES_ON_SIGTERM = "import time; print('ready', flush=True); time.sleep(60)"
EXITS_ON_EOF = "import sys; print('ready', flush=True); sys.stdin.read()"


async def wait_ready(proc: trio.Process) -> None:
    """Wait until the child says it is ready (its signal handlers are set)."""
    assert proc.stdout is not None
    seen = b""
    while not seen.endswith(b"ready\n"):
        chunk = await proc.stdout.receive_some()
        assert chunk, f"child exited before it was ready (status {await proc.wait()})"
        seen += chunk


async def open_child(code: str, **kw: object) -> trio.Process:
    proc = await trio.lowlevel.open_process([sys.executable, "-c", code], stdout=subprocess.PIPE, **kw)
    await wait_ready(proc)
    return proc


async def reap(proc: trio.Process) -> None:
    with trio.CancelScope(shield=True):
        kill_now(proc)
        await proc.wait()


async def test_graceful_kill_escalates_to_sigkill(autojump_clock: trio.testing.MockClock) -> None:
    proc = await open_child(IGNORES_SIGTERM)
    try:
        start = trio.current_time()
        await graceful_kill(proc, grace_s=5.0, term_s=3.0)
        assert await proc.wait() == -signal.SIGKILL
        # the whole ladder: the grace period, then the SIGTERM period, then SIGKILL
        assert trio.current_time() - start == 5.0 + 3.0
    finally:
        with trio.move_on_after(10, shield=True):
            await reap(proc)


async def test_graceful_kill_ends_with_sigterm(mock_clock: trio.testing.MockClock) -> None:
    # Manual virtual time: the clock moves only when we jump it, so the child's real
    # (wall-clock) death on SIGTERM cannot race an automatic jump past ``term_s``.
    proc = await open_child(DIES_ON_SIGTERM)
    try:
        start = trio.current_time()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(partial(graceful_kill, proc, grace_s=5.0, term_s=3.0))
            await trio.testing.wait_all_tasks_blocked()
            mock_clock.jump(4.9)
            await trio.testing.wait_all_tasks_blocked()
            assert proc.poll() is None  # no signal inside the grace period
            mock_clock.jump(1.0)  # past the grace period, well short of grace + term
        assert proc.returncode == -signal.SIGTERM
        assert trio.current_time() - start == pytest.approx(5.9)
    finally:
        with trio.move_on_after(10, shield=True):
            await reap(proc)


async def test_graceful_kill_lets_a_clean_exit_finish(mock_clock: trio.testing.MockClock) -> None:
    proc = await open_child(EXITS_ON_EOF, stdin=subprocess.PIPE)
    try:
        assert proc.stdin is not None
        await proc.stdin.aclose()  # the worker's way of being asked to leave
        start = trio.current_time()
        await graceful_kill(proc, grace_s=5.0, term_s=3.0)
        assert proc.returncode == 0
        assert trio.current_time() == start  # no time passed: nobody was signalled
    finally:
        with trio.move_on_after(10, shield=True):
            await reap(proc)


async def test_graceful_kill_of_a_dead_process_returns_at_once(autojump_clock: trio.testing.MockClock) -> None:
    proc = await open_child(DIES_ON_SIGTERM)
    kill_now(proc)
    assert await proc.wait() == -signal.SIGKILL
    start = trio.current_time()
    await graceful_kill(proc, grace_s=5.0, term_s=3.0)
    assert trio.current_time() == start
    kill_now(proc)  # idempotent on a reaped process


async def test_run_process_with_graceful_kill_reaps_on_cancel(autojump_clock: trio.testing.MockClock) -> None:
    # how nursery/_worker.py uses it: deliver_cancel=graceful_kill
    async with trio.open_nursery() as nursery:
        proc: trio.Process = await nursery.start(
            partial(
                trio.run_process, [sys.executable, "-c", IGNORES_SIGTERM], stdout=subprocess.PIPE, check=False,
                deliver_cancel=partial(graceful_kill, grace_s=5.0, term_s=3.0),
            )
        )
        await wait_ready(proc)
        start = trio.current_time()
        nursery.cancel_scope.cancel()
    assert proc.returncode == -signal.SIGKILL
    assert trio.current_time() - start == 8.0
