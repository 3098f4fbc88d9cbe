"""What a client sends reaches a log or a terminal as text, never as a command (red-team F9),
and ``/metrics`` shows a key only its models (F11): the log formatters (``daemon/_logs.py``),
the live monitor, ``superfluid top`` and the CLI's printing escape control characters
(``_printable.py``); ``Metrics.render`` filters by the key's ``models``."""

from __future__ import annotations

import collections
import io
import json
import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import attrs
import trio
from rich.console import Console

from superfluid._printable import json_printable, printable
from superfluid._term import ansi_rows
from superfluid.cli._top import Node, render
from superfluid.daemon import _logs
from superfluid.daemon._monitor import LogTail, Monitor
from superfluid.serving import ApiKey, Metrics, ModelSource

from .conftest import mock_config, open_daemon

EVIL_PATH = "/v1/sessions/%1b%5b2J%1b%5d0;pwned%07%0aFAKE-LINE%c2%9b31m%e2%80%a8FAKE-2%e2%80%aeevil"
EVIL_DECODED = "/v1/sessions/\x1b[2J\x1b]0;pwned\x07\nFAKE-LINE\x9b31m\u2028FAKE-2\u202eevil"
# what must never be written raw where a person reads: C0, DEL, C1, separators, bidi controls
RAW = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
RECORD_START = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} [A-Z]+ [\w.]+: ")
KEY = "sk-alice-0123456789"


@contextmanager
def daemon_logging(directory: Path) -> Iterator[io.StringIO]:
    """The handlers ``superfluid serve`` installs (stderr lines into the yielded buffer,
    JSON lines into ``directory``), restored after; leaving flushes the file's thread."""
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    stderr = io.StringIO()
    try:
        _logs.configure_logging("INFO", directory, stream=stderr)
        yield stderr
    finally:
        _logs.close_logging()
        root.setLevel(level)
        root.handlers[:] = handlers


def test_printable_escapes_every_control_separator_and_bidi_character() -> None:
    assert printable(EVIL_DECODED) == ("/v1/sessions/\\x1b[2J\\x1b]0;pwned\\x07\\x0aFAKE-LINE\\x9b31m\\u2028FAKE-2"
                                       "\\u202eevil")
    assert printable("é 日本 \\ plain", keep_newlines=True) == "é 日本 \\ plain"
    assert printable("a\nb\x1b\r", keep_newlines=True) == "a\nb\\x1b\\x0d"
    assert not RAW.search(printable("".join(map(chr, range(0x3000)))))
    encoded = json_printable(json.dumps({"s": EVIL_DECODED + "\udc80\x7f"}, ensure_ascii=False))
    assert json.loads(encoded) == {"s": EVIL_DECODED + "\udc80\x7f"} and not RAW.search(encoded)
    assert encoded.splitlines() == [encoded]


async def test_an_injected_path_writes_no_escape_or_forged_line_in_either_log(tmp_path: Path) -> None:
    """Red-team F9: on a keyed daemon, a request with no key and a path of escape sequences
    and a newline is access-logged at INFO. The stderr line shows the escapes as text on one
    line; the JSON log stays one valid object a line, holding the exact path."""
    config = attrs.evolve(mock_config(), api_keys=(ApiKey.from_secret("alice", KEY),))
    with daemon_logging(tmp_path / "logs") as stderr:
        async with open_daemon(config) as d:
            r = await d.client.get(EVIL_PATH)
            assert r.status_code == 401
            r = await d.client.post("/v1/chat/completions", headers={"authorization": f"Bearer {KEY}"}, json={
                "model": "ghost\x1b]0;pwned\x07\nFAKE-MODEL", "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 404
            with trio.fail_after(5):
                while not ("<-- 401 GET" in stderr.getvalue() and "<-- 404 POST" in stderr.getvalue()):
                    await trio.sleep(0.01)
        try:  # any logger, with a traceback quoting a client: the sink escapes it all the same
            raise ValueError(f"bad model {EVIL_DECODED!s}")
        except ValueError:
            logging.getLogger("superfluid.elsewhere").exception("refused %s", EVIL_DECODED)
    text = stderr.getvalue()
    assert not RAW.search(text), repr(text)
    lines = text.splitlines()
    assert text.split("\n")[:-1] == lines  # no separator a reader would split on
    access = [x for x in lines if "<-- 401 GET" in x]
    assert len(access) == 1 and "\\x1b[2J\\x1b]0;pwned\\x07\\x0aFAKE-LINE\\x9b31m\\u2028FAKE-2\\u202eevil" in access[0]
    assert RECORD_START.match(access[0]), access[0]
    # only a record starts at column 0 (the startup summary's lines are bare, its first
    # "superfluid <version>"): a traceback's further lines are indented
    assert all(RECORD_START.match(x) or x.startswith("superfluid ") for x in lines if not x.startswith(" ")), lines
    assert "  Traceback (most recent call last):" in lines and not any(x.startswith("FAKE") for x in lines)
    raw = (tmp_path / "logs" / _logs.LOG_FILE).read_text(encoding="utf-8")
    assert not RAW.search(raw) and raw.splitlines() == raw.split("\n")[:-1]
    records = [json.loads(x) for x in raw.splitlines()]
    assert [r["path"] for r in records if r.get("status") == 401] == [EVIL_DECODED]  # exact, as JSON escapes
    assert any(r.get("exc") and EVIL_DECODED in r["exc"] for r in records)


def test_the_monitor_shows_client_text_as_text() -> None:
    """A log record and a model name with escape sequences and line breaks: the frame
    (rendered without colour, so any ESC would be one the text brought) holds none, and
    each record is one row."""
    tail = LogTail()
    tail.emit(logging.LogRecord("superfluid.access", logging.INFO, __file__, 1, "<-- 401 GET %s total=1ms",
                                (EVIL_DECODED,), None))
    model = SimpleNamespace(runtime="mock", scheduler=SimpleNamespace(running={}, queues={}))
    registry = SimpleNamespace(loaded={"m\x1b[2J\nFAKE-ROW": model}, config=SimpleNamespace(max_batch=4))
    monitor = Monitor(registry, Metrics(), binds=["http://127.0.0.1:1"], tail=tail)  # type: ignore[arg-type]
    rows = ansi_rows(monitor.frame(height=40, width=200), 200, 40, color=False)
    assert not any(RAW.search(row) for row in rows), rows
    assert not any(row.startswith(("FAKE", "\\x0aFAKE")) for row in rows)
    assert any("m\\x1b[2J\\x0aFAKE-ROW" in row for row in rows)
    assert any("<-- 401 GET /v1/sessions/\\x1b[2J" in row and "FAKE-2\\u202eevil" in row for row in rows)


def test_top_shows_a_servers_error_as_text() -> None:
    node = Node(address="127.0.0.1:1", state="bad", detail="bad: \x1b]0;pw\x07\nx")
    console = Console(file=io.StringIO(), width=200, color_system=None, force_terminal=False)
    console.print(render([node], collections.deque(), width=200))
    out = console.file.getvalue()  # type: ignore[attr-defined]
    assert "\x1b" not in out and "bad: \\x1b]0;pw\\x07\\x0ax" in out


def _models(text: str) -> set[str]:
    return set(re.findall(r'model="([^"]*)"', text))


async def test_metrics_show_a_key_only_its_models(tmp_path: Path) -> None:
    """A key limited to ``mock`` sees ``mock``'s series only, none of ``m2``'s; a key
    without a list and a keyless daemon see every model's."""
    spec = "mock?step_ms=1&prefill_us=5"
    two = (ModelSource(spec=spec, runtime="mock", name="mock"), ModelSource(spec=spec, runtime="mock", name="m2"))
    policy = (ApiKey.from_secret("alice", KEY, models=("mock",)), ApiKey.from_secret("ops", "sk-ops-0123456789"),
              ApiKey.from_secret("root", "sk-root-0123456789", admin=True))
    chat: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    async with open_daemon(attrs.evolve(mock_config(), models=two, api_keys=policy)) as d:
        for name, key in (("mock", KEY), ("m2", "sk-ops-0123456789")):
            r = await d.client.post("/v1/chat/completions", json={**chat, "model": name},
                                    headers={"authorization": f"Bearer {key}"})
            assert r.status_code == 200, r.text

        async def scrape(key: str) -> str:
            r = await d.client.get("/metrics", headers={"authorization": f"Bearer {key}"})
            assert r.status_code == 200
            return r.text

        alice = await scrape(KEY)
        assert _models(alice) == {"mock"}
        assert 'superfluid_decode_tokens_total{model="mock"}' in alice
        assert _models(await scrape("sk-ops-0123456789")) == _models(await scrape("sk-root-0123456789")) == {
            "mock", "m2"}
        r = await d.client.get("/v1/metrics", headers={"authorization": f"Bearer {KEY}"})
        assert _models(r.text) == {"mock"}
        assert (await d.client.get("/metrics")).status_code == 401
    async with open_daemon(attrs.evolve(mock_config(), models=two)) as d:
        assert _models((await d.client.get("/metrics")).text) == {"mock", "m2"}


def test_render_with_every_model_allowed_is_the_unfiltered_text() -> None:
    metrics = Metrics()
    metrics.for_model("a").inc("superfluid_decode_tokens_total", 3)
    metrics.for_model("b").observe("superfluid_ttft_seconds", 0.2)
    assert metrics.render(lambda _name: True) == metrics.render()
    assert _models(metrics.render(lambda name: name == "a")) == {"a"}
    assert "# TYPE superfluid_ttft_seconds histogram" in metrics.render(lambda name: name == "a")
