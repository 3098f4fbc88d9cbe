"""A web page from another origin cannot drive the daemon (issue #17).

A real headless Chromium (Debian's ``/usr/bin/chromium``, driven over the
DevTools protocol by ``tests/_cdp.py``) loads ``fixtures/browser/attack.html``
from foreign-looking origins (``--host-resolver-rules`` maps them to
127.0.0.1). The page tries what any website could: CORS-simple ``text/plain``
POSTs the browser sends without asking, a preflighted JSON POST, model
load/unload, a WebSocket generation, reads of ``/v1/models``, and DNS
rebinding. Each test checks both sides: what the page could read, and what
the daemon answered and did (its metrics, models and sessions).
"""

from __future__ import annotations

import base64
import contextlib
import http.server
import json
import os
import re
import tempfile
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlencode, urlsplit

import attrs
import pytest
import trio

from ._cdp import CHROMIUM, Chromium, Page, launch_chromium, open_cdp, open_page
from .conftest import Daemon, mock_config, start_daemon

pytestmark = pytest.mark.browser

REQUIRE_REAL = os.environ.get("SUPERFLUID_REQUIRE_REAL") == "1"  # CI: a missing Chromium fails, never skips
if not os.access(CHROMIUM, os.X_OK) and not REQUIRE_REAL:
    pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install chromium)", allow_module_level=True)

PAGE = Path(__file__).parent / "fixtures" / "browser" / "attack.html"
SCREENSHOT = Path(__file__).parent.parent / "docs" / "security-browser.png"
HOST_RULES = "MAP evil.example 127.0.0.1, MAP good.example 127.0.0.1"
# Chromium's own Local Network Access checks would stop the rebinding page (a document
# handed out by DevTools counts as public); Firefox and Safari have none, so the daemon
# must refuse on its own: switch them off to test the daemon, not this browser.
FLAGS = ("--disable-features=LocalNetworkAccessChecks",)
WORK = ("superfluid_requests_total", "superfluid_prefill_tokens_total", "superfluid_decode_tokens_total")
REFUSED = {403, 415}


@pytest.fixture(scope="module")
def chromium() -> Iterator[Chromium]:
    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(f"no Chromium at {CHROMIUM}; SUPERFLUID_REQUIRE_REAL=1 needs it (apt-get install chromium)")
    with launch_chromium(host_rules=HOST_RULES, args=FLAGS) as browser:
        yield browser


class _PageHandler(http.server.BaseHTTPRequestHandler):
    timeout = 5  # seconds a connection may idle (Chromium preconnects sockets it may never use)

    def do_GET(self) -> None:
        if urlsplit(self.path).path != "/":
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("content-type", "text/html; charset=utf-8")
        self.send_header("content-length", str(len(_PAGE_BYTES)))
        self.end_headers()
        self.wfile.write(_PAGE_BYTES)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # quiet: pytest shows the failures that matter


_PAGE_BYTES = PAGE.read_bytes()


@pytest.fixture(scope="module")
def page_port() -> Iterator[int]:
    """The port of a tiny server that hands out the attacker page at ``/``, on loopback."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _PageHandler)  # daemon threads: none blocks close
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@attrs.frozen
class Exchange:
    """One request the browser sent to the daemon's port, and the daemon's answer."""

    method: str
    url: str
    headers: dict[str, str]  # as sent on the wire (Host, Origin, Content-Type...)
    status: int | None  # as answered (a WebSocket that opened: 101); None: no answer


@attrs.frozen
class Visit:
    read: dict[str, Any]  # what the page's script could read, per attempt (attack.html)
    exchanges: list[Exchange]


async def visit(chromium: Chromium, url: str, daemon: Daemon, *, rebind: bool = False,
                screenshot: Path | None = None) -> Visit:
    """Load the attacker page at ``url``, wait for its attempts to end, and collect
    every exchange the browser had with ``daemon``. With ``rebind``, ``url`` is on
    the daemon's own port: the page is handed out by DevTools (as a DNS record that
    pointed at the attacker when the page loaded), the rest goes to the daemon."""
    port = urlsplit(daemon.url).port
    async with open_cdp(chromium.ws_url) as cdp, open_page(cdp) as page:
        with trio.fail_after(60):  # a safety net: a visit takes well under a second
            served = None
            if rebind:
                served = await _serve_page(page, url)
            else:
                await page.navigate(url)
            read = await page.evaluate("window.done")
            exchanges = await _exchanges(page, port, skip=served)
            if screenshot is not None:
                answers = [f"{x.method} {x.url} -> {x.status}" for x in exchanges]
                await page.evaluate(f"showAnswers({json.dumps(answers)})")
                await trio.Path(screenshot).write_bytes(await page.screenshot())
    return Visit(read, exchanges)


async def _serve_page(page: Page, url: str) -> str:
    """Navigate to ``url`` answering it with the attacker page from here; the request id."""
    await page.send("Fetch.enable", {"patterns": [{"urlPattern": url, "requestStage": "Request"}]})
    async with trio.open_nursery() as nursery:
        since = len(page.cdp.events)
        nursery.start_soon(page.navigate, url)
        paused = await page.wait_event("Fetch.requestPaused", since=since)
        await page.send("Fetch.fulfillRequest", {
            "requestId": paused["requestId"], "responseCode": 200, "body": base64.b64encode(_PAGE_BYTES).decode(),
            "responseHeaders": [{"name": "content-type", "value": "text/html; charset=utf-8"}]})
    await page.send("Fetch.disable")
    return paused["networkId"]


async def _exchanges(page: Page, port: int | None, *, skip: str | None) -> list[Exchange]:
    """The browser's requests to ``port`` that went on the wire (HTTP, and WebSocket
    handshakes), with the daemon's answers; waits for each request to end."""
    out = []
    for request in page.events("Network.requestWillBeSent"):
        rid, method, url = request["requestId"], request["request"]["method"], request["request"]["url"]
        if rid != skip and urlsplit(url).port == port:
            await _wait(page, rid, ("Network.loadingFinished", "Network.loadingFailed"))
            sent = _by_id(page, "Network.requestWillBeSentExtraInfo", rid)
            if sent is not None:  # else it never left the browser (a preflight failed)
                got = _by_id(page, "Network.responseReceivedExtraInfo", rid)
                out.append(Exchange(method, url, _lower(sent["headers"]), got["statusCode"] if got else None))
    for ws in page.events("Network.webSocketCreated"):
        rid, url = ws["requestId"], ws["url"]
        if urlsplit(url).port == port:
            end = await _wait(page, rid, ("Network.webSocketHandshakeResponseReceived", "Network.webSocketFrameError",
                                          "Network.webSocketClosed"))
            sent = _by_id(page, "Network.webSocketWillSendHandshakeRequest", rid)
            assert sent is not None, ws
            # a refused handshake shows only as "Error during WebSocket handshake: Unexpected response code: 403"
            m = re.search(r"response code: (\d+)", end.get("errorMessage", ""))
            status = end["response"]["status"] if "response" in end else int(m.group(1)) if m else None
            out.append(Exchange("GET", url, _lower(sent["request"]["headers"]), status))
    return out


async def _wait(page: Page, rid: str, methods: tuple[str, ...]) -> dict[str, Any]:
    """The params of the first event of ``methods`` about request ``rid``, waiting for it."""
    event = await page.cdp.wait_for(lambda e: e.get("sessionId") == page.session and e["method"] in methods
                                    and e["params"].get("requestId") == rid)
    return event["params"]


def _by_id(page: Page, method: str, rid: str) -> dict[str, Any] | None:
    return next((p for p in page.events(method) if p["requestId"] == rid), None)


def _lower(headers: dict[str, str]) -> dict[str, str]:
    return {k.lower(): v for k, v in headers.items()}


async def daemon_state(d: Daemon) -> dict[str, Any]:
    """What a page's attempts could change: work counters, models, the session log."""
    metrics = (await d.client.get("/metrics")).text
    models = (await d.client.get("/v1/models")).json()["data"]
    return {
        "work": sorted(line for line in metrics.splitlines() if line.startswith(WORK)),
        "models": sorted((m["id"], m["loaded"], m["created"]) for m in models),
        # a session or conversation made for the page would be written to the session log
        "log_bytes": sum(f.stat().st_size for f in d.sessions_dir.iterdir() if f.is_file()),
    }


def assert_read_nothing(read: dict[str, Any]) -> None:
    """Every attempt of the page ended in an error, an opaque reply, a refusal, or a socket that never opened."""
    for attempt, got in read.items():
        if "opened" in got:
            assert not got["opened"] and not got["messages"], (attempt, got)
        elif "status" in got:
            assert got["type"] == "opaque" or got["status"] in REFUSED, (attempt, got)
        else:
            assert "error" in got, (attempt, got)


@contextlib.asynccontextmanager
async def serving(config_kw: dict[str, Any] | None = None) -> AsyncIterator[Daemon]:
    sessions = Path(tempfile.mkdtemp(prefix="superfluid-browser-sessions-"))
    async with trio.open_nursery() as nursery:
        d = await start_daemon(nursery, mock_config(sessions=sessions, **(config_kw or {})))
        d.sessions_dir = sessions  # type: ignore[attr-defined]
        try:
            yield d
        finally:
            await d.client.aclose()
            d.scope.cancel()


async def test_foreign_page_cannot_drive_the_daemon(chromium: Chromium, page_port: int) -> None:
    """A page on another origin: the browser sends its simple requests regardless;
    the daemon refuses each one, and the page reads nothing."""
    async with serving() as d:
        port = urlsplit(d.url).port
        before = await daemon_state(d)
        query = urlencode({"daemon": f"http://127.0.0.1:{port}", "alias": f"http://evil.example:{port}"})
        shot = SCREENSHOT if os.environ.get("SUPERFLUID_BROWSER_SCREENSHOT") == "1" else None
        v = await visit(chromium, f"http://evil.example:{page_port}/?{query}", d, screenshot=shot)
        assert_read_nothing(v.read)
        assert set(v.read) >= {"plain_chat", "json_chat", "plain_session", "ws_generate", "get_models",
                               "alias_models", "plain_load", "plain_unload"}
        # the daemon heard every attempt (text/plain POSTs need no preflight) and refused each one
        paths = {(x.method, urlsplit(x.url).path) for x in v.exchanges}
        assert paths >= {("POST", "/v1/chat/completions"), ("POST", "/v1/sessions"), ("GET", "/v1/ws"),
                         ("GET", "/v1/models"), ("POST", "/v1/models/load"), ("POST", "/v1/models/unload")}
        assert all(x.headers["origin"] == f"http://evil.example:{page_port}" for x in v.exchanges)
        assert [x for x in v.exchanges if x.status not in REFUSED] == []
        assert await daemon_state(d) == before  # no generation, no model loaded or unloaded, no session


async def test_dns_rebinding_page_cannot_read_the_daemon(chromium: Chromium) -> None:
    """The attacker's name resolves to 127.0.0.1 once its page has loaded: the page
    is then same-origin with the daemon, and only the Host header gives it away."""
    async with serving() as d:
        port = urlsplit(d.url).port
        before = await daemon_state(d)
        v = await visit(chromium, f"http://evil.example:{port}/", d, rebind=True)
        assert_read_nothing(v.read)
        assert v.exchanges and all(x.headers["host"] == f"evil.example:{port}" for x in v.exchanges)
        reads = [x for x in v.exchanges if (x.method, urlsplit(x.url).path) == ("GET", "/v1/models")]
        assert reads and "origin" not in reads[0].headers  # a same-origin GET carries no Origin: only Host tells
        models = v.read["get_models"]  # same-origin, so the page reads the refusal itself
        assert models["status"] == 403 and json.loads(models["body"])["error"]["code"] == "host_refused", models
        assert [x for x in v.exchanges if x.status not in REFUSED] == []
        assert await daemon_state(d) == before


async def test_allowed_origin_page_can_call_the_daemon(chromium: Chromium, page_port: int) -> None:
    """The control: the same page, from an origin the daemon allows, does reach it."""
    origin = f"http://good.example:{page_port}"
    async with serving({"web_origins": (origin,)}) as d:
        port = urlsplit(d.url).port
        before = await daemon_state(d)
        v = await visit(chromium, f"{origin}/?{urlencode({'daemon': f'http://127.0.0.1:{port}'})}", d)
        chat = v.read["json_chat"]
        assert chat["status"] == 200 and chat["type"] == "cors", chat
        assert json.loads(chat["body"])["choices"][0]["message"]["content"]
        ws = v.read["ws_generate"]
        assert ws["opened"] and json.loads(ws["messages"][-1])["op"] == "done", ws
        assert v.read["get_models"]["status"] == 200
        # a JSON route still refuses a text/plain body from an allowed origin
        plain = [x for x in v.exchanges if x.headers.get("content-type") == "text/plain"]
        assert plain and {x.status for x in plain} == {415}
        assert (await daemon_state(d))["work"] != before["work"]
