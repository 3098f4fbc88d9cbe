"""The live monitor of ``serve`` and ``superfluid top``, driven through tmux as a person would:
start in a real terminal, send load, read the screen (capture-pane), press ``q``, check the
process ended and the terminal came back (cbreak off, normal screen)."""

from __future__ import annotations

import itertools
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import trio

from superfluid._term import sparkline
from superfluid.daemon._keypolicy import load_keys
from superfluid.daemon._monitor import quantile

from .conftest import mock_config, open_daemon
from .test_sessions import _free_port

ROOT = Path(__file__).resolve().parent.parent
_names = itertools.count()


def _tmux(name: str, *args: str, **kw: object) -> subprocess.CompletedProcess[str]:
    """tmux on a server of the session's own (socket ``name``): other tmux sessions on the
    machine are never touched, and a session never meets the previous one's server while
    that server exits (killing its last session ends a server)."""
    return subprocess.run(["tmux", "-L", name, *args], text=True, **kw)  # type: ignore[call-overload]


def test_sparkline_and_quantile() -> None:
    assert sparkline([0, 1, 2, 4], 10) == " ▃▅█"
    assert sparkline([5, 0, 0], 2) == "  "
    assert sparkline([], 5) == ""
    buckets = ((0.1, 0.0), (0.5, 10.0), (1.0, 10.0), (float("inf"), 10.0))
    assert quantile(0.5, buckets) == pytest.approx(0.3)
    assert quantile(0.99, ((0.1, 1.0), (float("inf"), 2.0))) == 0.1
    assert quantile(0.5, ((0.1, 0.0), (float("inf"), 0.0))) is None


@contextmanager
def tmux(command: str, tmp_path: Path) -> Iterator[str]:
    """``command`` in a detached 160x50 tmux session; after it ends the pane shows
    ``EXIT=<code>`` and the terminal's cbreak state (``icanon`` when restored)."""
    if shutil.which("tmux") is None:
        pytest.fail("tmux is not installed (.ci/run installs it)")
    name = f"sf-test-{os.getpid()}-{next(_names)}"
    shell = (f"cd {ROOT} && PYTHONPATH={ROOT} {command}; echo EXIT=$?; "
             f"stty -a | grep -o -- '-\\?icanon' | sed 's/^/TTY=/'; sleep 600")
    env = {**os.environ, "SUPERFLUID_HOME": str(tmp_path / "home")}
    _tmux(name, "new-session", "-d", "-s", name, "-x", "160", "-y", "50", shell, check=True, env=env)
    try:
        yield name
    finally:
        _tmux(name, "kill-server", check=False)


def screen(name: str) -> str:
    return _tmux(name, "capture-pane", "-p", "-t", name, capture_output=True, check=True).stdout


def press(name: str, key: str) -> None:
    _tmux(name, "send-keys", "-t", name, key, check=True)


def alternate_on(name: str) -> bool:
    out = _tmux(name, "display-message", "-p", "-t", name, "#{alternate_on}", capture_output=True, check=True).stdout
    return out.strip() == "1"


async def wait_screen(name: str, pattern: str, seconds: float = 60) -> str:
    """The screen once ``pattern`` (a regex) shows on it."""
    text = ""
    with trio.move_on_after(seconds):
        while not re.search(pattern, text := screen(name), re.M):
            await trio.sleep(0.2)
        return text
    raise AssertionError(f"{pattern!r} never showed; the screen:\n{text}")


async def _stream(url: str, text: str, max_tokens: int) -> None:
    body = {"model": "mock", "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "stream": True, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=60) as client, client.stream("POST", url + "/v1/chat/completions",
                                                                       json=body) as response:
        async for _ in response.aiter_bytes():
            pass


async def test_monitor_shows_lanes_and_tokens_q_drains_and_restores_the_terminal(tmp_path: Path) -> None:
    """Three streams at once: the monitor shows 3/8 lanes busy, each an agent lane decoding with
    its token count, the decode rate, the access-log lines once they end; q drains (the streams
    still finish) and exits 0 with the terminal back to cooked mode on the normal screen."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    command = (f"{sys.executable} -m superfluid serve --runtime mock 'mock?step_ms=25&prefill_us=5' "
               f"--http 127.0.0.1:{port} --sessions {tmp_path / 'sessions'}")
    with tmux(command, tmp_path) as name:
        first = await wait_screen(name, r"lanes 0/8")
        assert "queue: interactive 0  completion 0  agent 0  background 0" in first
        assert "park:" not in first        # no --park: no park line
        assert alternate_on(name)
        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(_stream, url, f"hello {i}", 400)
            busy = await wait_screen(name, r"lanes 3/8[\s\S]*(agent +decode +\d+ +[1-9]\d+[\s\S]*){3}")
            rows = re.findall(r"agent +decode +(\d+) +(\d+)", busy)
            assert len(rows) == 3 and all(int(tokens) > 0 for _prompt, tokens in rows)
            assert re.search(r"decode +[1-9][\d.]* tok/s", busy)
            press(name, "q")
            await wait_screen(name, "draining: no new requests")
        # the streams finished their 400 tokens under the drain, then the daemon exited
        done = await wait_screen(name, r"^TTY=")
        assert "EXIT=0" in done
        assert "TTY=icanon" in done, done          # cbreak undone
        assert not alternate_on(name)              # back on the normal screen
        log = (tmp_path / "sessions" / "logs" / "serve.log").read_text()
        assert log.count("<-- 200 POST /v1/chat/completions") == 3
        assert oct((tmp_path / "sessions" / "logs" / "serve.log").stat().st_mode & 0o777) == "0o600"


async def test_monitor_shows_park_activity_for_a_model_with_park(tmp_path: Path) -> None:
    """--park: the model has a park line. A torn file the worker's index refused shows as a
    fallback before any request; a finished conversation shows parked with its bytes on disk;
    after its worker is killed, the next turn shows resumed with its tokens and restore time."""
    import psutil

    from superfluid._private import make_private_dir
    from superfluid.worker._park import PARK_MIN_TOKENS, SUFFIX

    from .test_park import LONG_TEXT, chat

    park = tmp_path / "sessions" / "park"
    make_private_dir(park)
    (park / ("0" * 64 + SUFFIX)).write_bytes(b"not a park file")
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    command = (f"{sys.executable} -m superfluid serve --runtime mock 'mock?step_ms=1&prefill_us=5&eos_every=0' "
               f"--http 127.0.0.1:{port} --sessions {tmp_path / 'sessions'} --park --park-budget-gb 0.01")
    with tmux(command, tmp_path) as name:
        await wait_screen(name, r"lanes 0/8")
        first = await wait_screen(name, r"park: parked 0 ", seconds=10)   # the worker's report as it starts
        assert re.search(r"park: parked 0  resumed 0 \(0 tokens\)  on disk 0 B  evicted 0  fallbacks: torn 1$",
                         first, re.M), first
        messages = [{"role": "user", "content": LONG_TEXT}]
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            reply, _ = await chat(client, messages)
            await wait_screen(name, r"park: parked 1  resumed 0 \(0 tokens\)  on disk [\d.]+ KiB  evicted 0  "
                                    r"fallbacks: torn 1$")
            [worker] = [p for p in psutil.process_iter(["cmdline"])
                        if any(str(park) == part for part in p.info["cmdline"] or ())]
            worker.kill()   # a new worker: its KV is empty, its park index read from disk
            messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "and then?"}]
            _text, cached = await chat(client, messages)
        assert cached > PARK_MIN_TOKENS
        shown = await wait_screen(name, r"park: parked \d+  resumed 1 \((\d+) tokens\)  restore avg \d+ ms  on disk")
        tokens = re.search(r"resumed 1 \((\d+) tokens\)", shown)
        assert tokens and int(tokens.group(1)) == cached, shown
        assert re.search(r"respawns 1", shown)
        press(name, "q")
        assert "EXIT=0" in await wait_screen(name, r"^TTY=")


async def test_monitor_ctrl_c_restores_the_terminal_and_no_tui_logs_plainly(tmp_path: Path) -> None:
    port = _free_port()
    command = (f"{sys.executable} -m superfluid serve --runtime mock --http 127.0.0.1:{port} "
               f"--sessions {tmp_path / 's1'}")
    with tmux(command, tmp_path) as name:
        await wait_screen(name, r"lanes 0/8")
        press(name, "C-c")
        done = await wait_screen(name, r"^TTY=")
        assert "TTY=icanon" in done and not alternate_on(name)
    command = (f"{sys.executable} -m superfluid serve --runtime mock --http 127.0.0.1:{port} --no-tui "
               f"--sessions {tmp_path / 's2'}")
    with tmux(command, tmp_path) as name:
        text = await wait_screen(name, r"Running on http://127.0.0.1")  # the startup summary
        assert "lanes 0/" not in text and not alternate_on(name)


async def _top(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[bytes]:
    return await trio.run_process([sys.executable, "-m", "superfluid", "top", *args], capture_stdout=True,
                                  capture_stderr=True, check=False, env={**os.environ, **(env or {})})


def _row(text: str, address: str) -> str:
    return next(line for line in text.splitlines() if address in line)


async def test_top_once_over_an_open_daemon_a_keyed_one_and_a_dead_address() -> None:
    keyed = mock_config(api_keys=load_keys("sekrit", None, {}))
    async with open_daemon(mock_config(max_batch=4)) as a, open_daemon(keyed) as b:
        down = f"127.0.0.1:{_free_port()}"
        addr_a, addr_b = a.url.removeprefix("http://"), b.url.removeprefix("http://")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_stream, a.url, "warm up", 2000)
            while (await a.client.get("/metrics")).text.find('superfluid_lanes_active{model="mock"} 1.0') < 0:
                await trio.sleep(0.05)
            done = await _top("--once", "--interval", "0.5", addr_a, addr_b, down)
            nursery.cancel_scope.cancel()
        out = done.stdout.decode()
        assert done.returncode == 0, done.stderr
        assert re.search(r"\bup +1 +1/4 +0 +\S+", _row(out, addr_a)), out
        assert re.search(r"\d+\.\d", _row(out, addr_a).split("1/4", 1)[1])  # a decode rate
        assert " 401 " in _row(out, addr_b) and "needs --api-key" in _row(out, addr_b)
        assert " down " in _row(out, down)
        assert "1/3 up" in out
        with_key = await _top("--once", "--interval", "0.2", addr_b, env={"SUPERFLUID_API_KEY": "sekrit"})
        assert re.search(r"\bup +1 +0/4", _row(with_key.stdout.decode(), addr_b)), with_key.stdout
    nothing = await _top("--once", "--interval", "0.2", down)
    assert nothing.returncode == 1 and " down " in nothing.stdout.decode()


async def test_top_in_a_terminal_over_two_daemons_quits_on_q(tmp_path: Path) -> None:
    async with open_daemon(mock_config()) as a, open_daemon(mock_config(max_batch=2)) as b:
        addr_a, addr_b = a.url.removeprefix("http://"), b.url.removeprefix("http://")
        with tmux(f"{sys.executable} -m superfluid top {addr_a} {addr_b}", tmp_path) as name:
            text = await wait_screen(name, r"2/2 up")
            assert re.search(rf"{addr_a} +up +1 +0/4", text) and re.search(rf"{addr_b} +up +1 +0/2", text)
            press(name, "q")
            done = await wait_screen(name, r"^TTY=", seconds=20)
            assert "EXIT=0" in done and "TTY=icanon" in done and not alternate_on(name)
        with tmux(f"{sys.executable} -m superfluid top {addr_a}", tmp_path) as name:
            await wait_screen(name, r"1/1 up")
            press(name, "Escape")
            done = await wait_screen(name, r"^TTY=", seconds=20)
            assert "EXIT=0" in done


def test_the_screen_writes_only_the_rows_that_changed() -> None:
    """A frame equal to the last writes nothing; a frame with one changed row writes that row
    alone (the terminal parses a few rows a second, not the whole screen); a resize redraws all."""
    import io

    from rich.console import Console
    from rich.text import Text

    from superfluid._term import Screen, ansi_rows

    out = io.StringIO()
    console = Console(file=out, width=30, height=6, force_terminal=True, color_system="standard")
    screen = Screen(console, out=out)

    def frame(tokens: int) -> Text:
        t = Text(no_wrap=True)
        t.append("superfluid ", "bold")
        t.append("127.0.0.1:8453\n", "cyan")
        t.append(f"lane 1  decode  {tokens}\n")
        t.append("log: " + "x" * 60)
        return t

    with screen:
        start = out.tell()
        screen.show(frame(5))
        first = out.getvalue()[start:]
        assert first.count("\x1b[K") == 6 and "\x1b[1msuperfluid \x1b[0m" in first and "\x1b[36m127.0.0.1:8453" in first
        mark = out.tell()
        screen.show(frame(5))
        assert out.getvalue()[mark:] == ""
        screen.show(frame(6))
        changed = out.getvalue()[mark:]
        assert changed.count("\x1b[K") == 1 and "\x1b[2;1H" in changed and "decode  6" in changed
    assert ansi_rows(frame(5), 30, 6, color=False) == ["superfluid 127.0.0.1:8453", "lane 1  decode  5", "log: " + "x" * 24]
    assert out.getvalue().endswith("\x1b[?1049l")
