"""Issue #17, files and faults: private session files, where models may be loaded from and how
many, credentials kept from workers, and faults (no file descriptors, a full disk) that must not
take the daemon down. Mock runtime throughout."""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import stat
from collections.abc import Iterator
from pathlib import Path

import attrs
import httpx
import psutil
import pytest
import trio
from trio_websocket import open_websocket_url

from superfluid.serving import ModelSource
from superfluid._private import make_private_dir
from superfluid.journal import Journal, JournalConfig, open_journal
from superfluid.journal._files import FaultInjector
from superfluid.proto._wal import body_created, body_finished

from .conftest import Daemon, mock_config, start_daemon, worker_pids

CHAT = {"model": "mock", "messages": [{"role": "user", "content": "tell me a story"}], "temperature": 0}


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.fixture
def open_umask() -> Iterator[None]:
    """A umask that takes nothing away: modes must come from the code, not the umask."""
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


# ---- file modes -------------------------------------------------------------------------------


async def write_session(journal: Journal, sid: str) -> None:
    await journal.append(sid, body_created(params={}, klass="agent", model="m"))
    await journal.append(sid, body_finished(finish="stop"))


async def test_sessions_directory_and_every_journal_file_are_private(tmp_path: Path, open_umask: None) -> None:
    directory = tmp_path / "home" / "sessions"
    async with open_journal(directory, config=JournalConfig(keep_finished=0)) as journal:
        await write_session(journal, "a")
        await journal.compact()  # wal.log.compact renamed over wal.log
    async with open_journal(directory, fresh=True):  # the old log kept as wal.log.prev
        pass
    assert mode(directory) == 0o700 and mode(directory.parent) == 0o700
    names = sorted(os.listdir(directory))
    assert names == ["serve.lock", "wal.log", "wal.log.prev"]
    assert {name: mode(directory / name) for name in names} == dict.fromkeys(names, 0o600)


async def test_looser_modes_are_fixed_at_start_with_one_warning(tmp_path: Path,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    async with open_journal(tmp_path / "s") as journal:
        await write_session(journal, "a")
    directory = tmp_path / "s"
    os.chmod(directory, 0o755)
    os.chmod(directory / "wal.log", 0o644)
    os.chmod(directory / "serve.lock", 0o640)
    (directory / "wal.log.corrupt-1").write_bytes(b"x")
    os.chmod(directory / "wal.log.corrupt-1", 0o666)
    with caplog.at_level(logging.WARNING, logger="superfluid.journal"):
        async with open_journal(directory) as journal:
            assert "a" in journal.sessions
    assert mode(directory) == 0o700
    assert {n: mode(directory / n) for n in os.listdir(directory)} == dict.fromkeys(os.listdir(directory), 0o600)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, warnings
    for fragment in (f"{directory} (0755 -> 0700)", "wal.log (0644 -> 0600)", "serve.lock (0640 -> 0600)",
                     "wal.log.corrupt-1 (0666 -> 0600)"):
        assert fragment in warnings[0]
    # a second start finds nothing to fix and says nothing
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="superfluid.journal"):
        async with open_journal(directory):
            pass
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_models_cache_directory_is_made_private(tmp_path: Path, open_umask: None) -> None:
    target = tmp_path / ".superfluid" / "models"
    make_private_dir(target)
    assert mode(target) == 0o700 and mode(target.parent) == 0o700
    os.chmod(target, 0o755)  # an existing directory is the operator's: left as it is
    make_private_dir(target)
    assert mode(target) == 0o755


# ---- what /v1/models/load may load ----------------------------------------------------------------


@pytest.fixture
def model_tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    """A --model-dir holding one (fake) model, an empty models cache, and files outside both."""
    monkeypatch.setenv("SUPERFLUID_HOME", str(tmp_path / "home"))
    models = tmp_path / "models"
    models.mkdir()
    (models / "fake.gguf").write_bytes(b"GGUF not really")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.gguf").write_bytes(b"GGUF private")
    (models / "link.gguf").symlink_to(outside / "secret.gguf")
    return {"models": models, "outside": outside}


async def load(d: Daemon, ident: str, **extra: object) -> httpx.Response:
    return await d.client.post("/v1/models/load", json={"id": ident, **extra})


async def test_loads_only_from_allowed_places_and_no_oracle(nursery: trio.Nursery,
                                                             model_tree: dict[str, Path]) -> None:
    models, outside = model_tree["models"], model_tree["outside"]
    d = await start_daemon(nursery, mock_config(model_dirs=(models,)))
    refused = [
        "/etc/shadow", "/etc/passwd", "/nonexistent/file.gguf",                  # outside, existing or not
        str(outside / "secret.gguf"), str(outside / "missing.gguf"),
        str(models / ".." / "outside" / "secret.gguf"),                           # `..` out of the model dir
        str(models / "link.gguf"), "link",                                        # a symlink leading out
        str(models / "missing.gguf"), "missing", "../outside/secret", "sec\x00ret",
        "/etc/shadow?x", "mock/../../etc/shadow",
    ]
    bodies = []
    for ident in refused:
        r = await load(d, ident)
        assert r.status_code == 404, (ident, r.text)
        body = r.json()
        assert body["error"]["code"] == "model_not_found" and body["error"]["param"] == "id"
        bodies.append(body["error"]["message"].replace(repr(ident)[1:-1], "ID").replace(ident, "ID"))
    assert len(set(bodies)) == 1, bodies  # one answer for all: nothing tells whether a file exists
    # an explicit runtime changes nothing: a path never reaches a worker as a "mock" spec either
    for ident in ("/etc/shadow", "/nonexistent"):
        r = await load(d, ident, runtime="mock")
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    # the model dir's file is known by name, and loadable by name or path (it is no model: the worker says so)
    listed = {m["id"]: m["loaded"] for m in (await d.client.get("/v1/models")).json()["data"]}
    assert listed == {"mock": True, "fake": False}
    for ident in ("fake", str(models / "fake.gguf"), str(models / "sub" / ".." / "fake.gguf")):
        r = await load(d, ident)
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_load_failed", (ident, r.text)
    d.scope.cancel()


async def test_models_cache_and_startup_models_are_allowed(nursery: trio.Nursery, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from superfluid.serving import Metrics
    from superfluid.daemon._registry import ModelRegistry

    monkeypatch.setenv("SUPERFLUID_HOME", str(tmp_path / "home"))
    cache = tmp_path / "home" / "models"
    cache.mkdir(parents=True)
    (cache / "cached.gguf").write_bytes(b"GGUF not really")
    startup = tmp_path / "elsewhere" / "start.gguf"
    startup.parent.mkdir()
    startup.write_bytes(b"GGUF not really")
    (startup.parent / "sibling.gguf").write_bytes(b"GGUF not really")
    d = await start_daemon(nursery, mock_config())
    for ident in ("cached", "cached.gguf", str(cache / "cached.gguf")):
        r = await load(d, ident)
        assert r.json()["error"]["code"] == "model_load_failed", (ident, r.text)  # it reached a worker
    d.scope.cancel()
    # a model given at startup may be loaded again through its path; its neighbours may not
    cfg = attrs.evolve(mock_config(), models=(ModelSource(spec=str(startup), runtime="llamacpp", name="start"),))
    registry = ModelRegistry(cfg, Metrics())
    for ident in ("start", str(startup), str(startup.parent / "." / "start.gguf")):
        source = registry.lookup(ident)
        assert source is not None and (source.name, source.spec) == ("start", str(startup)), ident
    assert registry.lookup(str(startup.parent / "sibling.gguf")) is None


# ---- how many models ---------------------------------------------------------------------------


async def test_max_models_caps_loads_and_worker_processes(nursery: trio.Nursery) -> None:
    d = await start_daemon(nursery, mock_config(max_models=2))
    assert (await load(d, "mock?name=b")).status_code == 200
    assert len(worker_pids()) == 2
    # a page firing many loads gets the cap, not a worker per load
    results: list[httpx.Response] = []

    async def one(i: int) -> None:
        results.append(await load(d, f"mock?name=m{i}"))

    async with trio.open_nursery() as n:
        for i in range(20):
            n.start_soon(one, i)
    assert {r.status_code for r in results} == {429}
    error = results[0].json()["error"]
    assert error["code"] == "too_many_models"
    assert "at most 2 models" in error["message"] and "loaded: b, mock" in error["message"]
    assert len(worker_pids()) == 2
    # a known model loaded again on demand is held to the cap too (typed, in the dialect's envelope)
    assert (await d.client.post("/v1/models/unload", json={"model": "b"})).status_code == 200
    assert (await load(d, "mock?name=c")).status_code == 200
    r = await d.client.post("/v1/chat/completions", json={**CHAT, "model": "b", "max_tokens": 2})
    assert r.status_code == 429 and r.json()["error"]["code"] == "too_many_models"
    r = await d.client.post("/api/chat", json={"model": "b", "messages": CHAT["messages"], "stream": False})
    assert r.status_code == 429 and "at most 2 models" in r.json()["error"]
    assert len(worker_pids()) == 2
    d.scope.cancel()


async def test_unload_then_load_never_runs_more_workers_than_the_cap(nursery: trio.Nursery) -> None:
    d = await start_daemon(nursery, mock_config(max_models=2))
    (first,) = worker_pids()
    assert (await load(d, "mock?name=x")).status_code == 200
    (slow,) = set(worker_pids()) - {first}
    # a worker that takes its time to go (stopped: it answers nothing until the kill ladder's SIGKILL)
    os.kill(slow, signal.SIGSTOP)
    assert (await d.client.post("/v1/models/unload", json={"model": "x"})).json()["deleted"] is True
    # the next load waits for the unloaded model's worker to be gone, and never runs a third
    assert (await load(d, "mock?name=y")).status_code == 200
    assert slow not in worker_pids() and len(worker_pids()) == 2
    d.scope.cancel()


async def test_concurrent_loads_of_one_model_start_one_worker(nursery: trio.Nursery) -> None:
    d = await start_daemon(nursery, mock_config(max_models=3))
    before = set(worker_pids())
    results: list[httpx.Response] = []

    async def one() -> None:
        results.append(await load(d, "mock?name=twin"))

    async with trio.open_nursery() as n:
        for _ in range(8):
            n.start_soon(one)
    assert [r.status_code for r in results] == [200] * 8
    assert len(set(worker_pids()) - before) == 1
    d.scope.cancel()


# ---- the worker's environment --------------------------------------------------------------------

SECRETS = ["HF_TOKEN", "GITHUB_TOKEN", "OPENAI_API_KEY", "SUPERFLUID_API_KEY", "DB_PASSWORD", "MY_SECRET",
           "AWS_SECRET_ACCESS_KEY", "STRIPE_KEY", "SIGNING_KEY", "SERVICE_CREDENTIALS"]


async def test_credentials_never_reach_a_worker(nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in SECRETS:
        monkeypatch.setenv(name, "s3cret-value")
    monkeypatch.setenv("SUPERFLUID_TEST_MARKER", "plain")
    d = await start_daemon(nursery, mock_config())
    (pid,) = worker_pids()
    environ = psutil.Process(pid).environ()
    assert environ.get("SUPERFLUID_TEST_MARKER") == "plain"  # the worker's real environment was read
    assert [name for name in SECRETS if name in environ] == []
    assert "s3cret-value" not in environ.values()
    d.scope.cancel()


def test_cli_limit_mistakes_are_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from superfluid.cli._main import main

    with pytest.raises(SystemExit) as exc:   # 0 is refused as the flag is parsed (cli/_flags.py)
        main(["serve", "mock", "--max-models", "0"])
    assert exc.value.code == 2
    [line] = capsys.readouterr().err.splitlines()
    assert "--max-models" in line and "must be 1 or more" in line
    assert main(["serve", "mock", "--model", "mock?name=b", "--max-models", "1"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "superfluid: --max-models 1: must be at least 1 and the 2 models given at startup"]
    assert main(["serve", "mock", "--model-dir", str(tmp_path / "nowhere")]) == 2
    assert capsys.readouterr().err.splitlines() == [f"superfluid: --model-dir {tmp_path / 'nowhere'}: not a directory"]


# ---- out of file descriptors -------------------------------------------------------------------


def worker_pipe_fds(pid: int) -> list[int]:
    """Our descriptors of the pipes that are the worker's stdin and stdout."""
    theirs = {os.readlink(f"/proc/{pid}/fd/{n}") for n in (0, 1)}
    return [int(fd) for fd in os.listdir("/proc/self/fd")
            if _readlink_quiet(f"/proc/self/fd/{fd}") in theirs]


def _readlink_quiet(link: str) -> str | None:
    try:
        return os.readlink(link)
    except OSError:
        return None


class FdHog:
    """Take every descriptor the process may still open: RLIMIT_NOFILE lowered to the lowest of
    ``below`` (so what the dying worker frees cannot be reused) and every free number under it
    filled. ``release`` gives everything back."""

    def __init__(self, below: int) -> None:
        import resource

        self.limits = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (below, self.limits[1]))
        self.fds: list[int] = []
        try:
            while True:
                self.fds.append(os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC))
        except OSError as exc:
            assert exc.errno == errno.EMFILE

    def release(self) -> None:
        import resource

        for fd in self.fds:
            os.close(fd)
        self.fds = []
        resource.setrlimit(resource.RLIMIT_NOFILE, self.limits)


async def test_out_of_file_descriptors_a_worker_restart_waits_and_the_daemon_lives(
        nursery: trio.Nursery, caplog: pytest.LogCaptureFixture) -> None:
    d = await start_daemon(nursery, mock_config())
    client = httpx.AsyncClient(base_url=d.url, timeout=60, limits=httpx.Limits(max_connections=1))
    assert (await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2})).status_code == 200
    (pid,) = worker_pids()
    hog = FdHog(below=min(worker_pipe_fds(pid)))  # the client's connection is open above that: it goes on
    try:
        os.kill(pid, signal.SIGKILL)  # the worker must restart, and no pipe can be made for it
        with trio.fail_after(30):  # the owner saw the death and its first spawn failed: no race with it
            while not any("cannot be started" in r.getMessage() for r in caplog.records):
                await trio.sleep(0.01)
        answers = []
        for _ in range(3):  # typed refusals (the connection in hand serves them), while the spawn retries
            r = await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2})
            answers.append((r.status_code, r.json()["error"]["code"]))
        assert answers == [(503, "resources_exhausted")] * 3
        r = await client.post("/v1/messages", json={"model": "mock", "max_tokens": 2, "messages": CHAT["messages"]})
        assert r.status_code == 503 and r.json()["type"] == "error", r.text  # the Anthropic envelope
        assert (await client.get("/health")).status_code == 200
    finally:
        hog.release()
    # descriptors are back: the next spawn attempt (back-off) brings the model back, same daemon
    r = await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert not d.scope.cancel_called
    (new_pid,) = worker_pids()
    assert new_pid != pid
    failures = [r.getMessage() for r in caplog.records if "cannot be started" in r.getMessage()]
    assert failures and "Too many open files" in failures[0]
    await client.aclose()
    d.scope.cancel()



CLIENT = """
import socket, sys
host, port = sys.argv[1], int(sys.argv[2])
sys.stdin.read(1)  # go
s = socket.create_connection((host, port))
s.sendall(b"GET /health HTTP/1.1\\r\\nhost: localhost\\r\\nconnection: close\\r\\n\\r\\n")
print(s.recv(100).split(b"\\r\\n")[0].decode(), flush=True)
"""


async def test_out_of_file_descriptors_accept_waits_and_serves_later(nursery: trio.Nursery,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    import subprocess
    import sys
    from urllib.parse import urlsplit

    d = await start_daemon(nursery, mock_config())
    url = urlsplit(d.url)
    # a client in its own process (its own descriptors), started while we can still make pipes
    client = await trio.lowlevel.open_process([sys.executable, "-c", CLIENT, url.hostname, str(url.port)],
                                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert client.stdin is not None and client.stdout is not None
    hog = FdHog(below=max(int(fd) for fd in os.listdir("/proc/self/fd")) + 1)
    try:
        await client.stdin.send_all(b"g")
        with trio.fail_after(30):  # the listener cannot accept the connection: it says so and retries
            while not any("accept returned EMFILE" in r.getMessage() for r in caplog.records):
                await trio.sleep(0.05)
    finally:
        hog.release()
    with trio.fail_after(30):
        status = await client.stdout.receive_some(100)
    assert status.strip() == b"HTTP/1.1 200", status
    assert not d.scope.cancel_called
    await client.wait()
    await client.stdin.aclose()
    await client.stdout.aclose()
    d.scope.cancel()


# ---- a full disk -------------------------------------------------------------------------------


@pytest.fixture
def disk_faults() -> Iterator[FaultInjector]:
    """The journal's file-layer test hook, reset afterwards."""
    from superfluid.journal._files import faults

    try:
        yield faults
    finally:
        faults.errno = None


async def test_journal_degrades_on_enospc_and_recovers_from_its_committed_state(tmp_path: Path,
                                                                                disk_faults: FaultInjector) -> None:
    from superfluid.journal import JournalWriteError
    from superfluid.proto._wal import body_prompt

    config = JournalConfig(probe_backoff_s=0.01, probe_max_backoff_s=0.05)
    async with open_journal(tmp_path, config=config) as journal:
        await journal.append("a", body_created(params={}, klass="agent", model="m"))
        disk_faults.errno = errno.ENOSPC
        with pytest.raises(JournalWriteError) as failed:
            await journal.append("a", body_prompt(tokens=[1]))
        assert failed.value.out_of_space
        assert journal.degraded is not None and "No space left on device" in journal.degraded
        with pytest.raises(JournalWriteError, match="takes no records until"):
            await journal.append("b", body_created(params={}, klass="agent", model="m"))
        await trio.sleep(0.2)  # the probe keeps failing while the disk is full
        assert journal.degraded is not None
        disk_faults.errno = None
        with trio.fail_after(10):  # the probe's back-off is 10-50 ms here
            while journal.degraded is not None:
                await trio.sleep(0.01)
        # the failed record never happened: the session goes on at the id it had
        assert (await journal.append("a", body_prompt(tokens=[2]))).event_id == 1
        assert (await journal.append("b", body_created(params={}, klass="agent", model="m"))).event_id == 0
    async with open_journal(tmp_path) as journal:
        assert list(journal.sessions["a"].prompt_tokens) == [2] and "b" in journal.sessions


def journal_reason(health: httpx.Response) -> str:
    assert health.status_code == 503, health.text
    body = health.json()
    assert body["status"] == "degraded"
    return str(body["reason"])


async def wait_healthy(client: httpx.AsyncClient) -> None:
    # the daemon's probe is internal: /health is what a client can watch
    with trio.fail_after(30):
        while (await client.get("/health")).status_code != 200:
            await trio.sleep(0.05)


async def test_full_disk_degrades_health_refuses_generations_typed_and_recovers(
        tmp_path: Path, disk_faults: FaultInjector) -> None:
    sessions = tmp_path / "sessions"
    streamed: list[str] = []
    async with trio.open_nursery() as inner:
        d = await start_daemon(inner, mock_config("mock?step_ms=5&prefill_us=5", sessions=sessions))
        assert (await d.client.get("/health")).json()["status"] == "ok"
        r = await d.client.post("/v1/sessions", json={"model": "mock", "messages": CHAT["messages"]})
        cid = r.json()["id"]
        # in flight: the stream ends with a typed error frame and [DONE]
        body = {**CHAT, "max_tokens": 2000, "ignore_eos": True, "stream": True}
        headers = {"x-superfluid-resumable": "1"}
        async with d.client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
            sid = r.headers["x-superfluid-session"]
            frames = []
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                frames.append(line[6:])
                if len(frames) == 3:
                    disk_faults.errno = errno.ENOSPC
        assert frames[-1] == "[DONE]"
        error = json.loads(frames[-2])["error"]
        assert error["code"] == "insufficient_storage" and "full" in error["message"]
        streamed = [json.loads(f)["choices"][0]["delta"].get("content") or "" for f in frames[:-2]]
        assert "No space left on device" in journal_reason(await d.client.get("/health"))
        # new generations: 507 before anything is generated, in each dialect's envelope
        r = await d.client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 4})
        assert r.status_code == 507 and r.json()["error"]["code"] == "insufficient_storage"
        r = await d.client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 4, "stream": True})
        assert r.status_code == 507 and r.json()["error"]["code"] == "insufficient_storage"
        r = await d.client.post("/v1/messages", json={"model": "mock", "max_tokens": 4, "messages": CHAT["messages"]})
        assert r.status_code == 507 and r.json()["type"] == "error"
        r = await d.client.post("/api/chat", json={"model": "mock", "messages": CHAT["messages"], "stream": False})
        assert r.status_code == 507 and "full" in r.json()["error"]
        for path, body in ((f"/v1/sessions/{cid}/generate", {"max_tokens": 4}),  # a conversation's turn,
                           (f"/v1/sessions/{cid}/messages", {"messages": CHAT["messages"]}),  # its other writes
                           ("/v1/sessions", {"model": "mock"}), (f"/v1/sessions/{cid}/fork", {})):
            r = await d.client.post(path, json=body)
            assert r.status_code == 507 and r.json()["error"]["code"] == "insufficient_storage", (path, r.text)
        # the same writes over the WebSocket: typed error replies, the socket stays open
        async with open_websocket_url(d.url.replace("http://", "ws://") + "/v1/ws") as ws:
            for msg in ({"op": "create", "id": 1, "body": {"model": "mock"}},
                        {"op": "append", "id": 2, "session": cid, "body": {"messages": CHAT["messages"]}},
                        {"op": "generate", "id": 3, "body": {**CHAT, "max_tokens": 4}}):
                await ws.send_message(json.dumps(msg))
                reply = json.loads(await ws.get_message())
                assert reply["op"] == "error" and reply["error"]["code"] == "insufficient_storage", (msg, reply)
        # space returns: the daemon recovers by itself
        disk_faults.errno = None
        await wait_healthy(d.client)
        r = await d.client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 4})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
        d.scope.cancel()
    # commit before delivery: every token the client was shown is in the log
    async with open_journal(sessions) as journal:
        logged = journal.sessions[sid].text
    assert "".join(streamed) and logged.startswith("".join(streamed))


@pytest.fixture
def tiny_disk(tmp_path: Path) -> Iterator[Path]:
    """A real 1 MiB tmpfs; skipped where mounting is not permitted."""
    import subprocess

    mountpoint = tmp_path / "disk"
    mountpoint.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0700", "tmpfs", str(mountpoint)],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"mounting a tmpfs is not permitted here ({done.stderr.strip() or done.returncode}); "
                    "test_full_disk_degrades_health_refuses_generations_typed_and_recovers covers it by injection")
    try:
        yield mountpoint
    finally:
        subprocess.run(["umount", "-l", str(mountpoint)], check=False)


def fill(directory: Path) -> Path:
    """Write a file until the disk is full."""
    filler = directory / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    finally:
        os.close(fd)
    return filler


async def test_a_real_full_disk_is_survived_and_recovered_from(tiny_disk: Path) -> None:
    async with trio.open_nursery() as inner:
        d = await start_daemon(inner, mock_config("mock?step_ms=2&prefill_us=5", sessions=tiny_disk / "sessions"))
        body = {**CHAT, "max_tokens": 3000, "ignore_eos": True, "stream": True}
        frames: list[str] = []
        filler = None
        async with d.client.stream("POST", "/v1/chat/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    frames.append(line[6:])
                    if filler is None:
                        filler = fill(tiny_disk)  # the log's next page finds no room
        assert frames[-1] == "[DONE]"
        assert json.loads(frames[-2])["error"]["code"] == "insufficient_storage"
        assert "No space left on device" in journal_reason(await d.client.get("/health"))
        r = await d.client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 4})
        assert r.status_code == 507 and r.json()["error"]["code"] == "insufficient_storage"
        assert filler is not None
        filler.unlink()
        await wait_healthy(d.client)
        r = await d.client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 4})
        assert r.status_code == 200
        d.scope.cancel()
