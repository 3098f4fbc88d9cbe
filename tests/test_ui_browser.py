"""The built-in page (issue #48), in a real browser.

Debian's headless Chromium (``/usr/bin/chromium``), driven over the DevTools
protocol by ``tests/_cdp.py`` as ``tests/test_security_browser.py`` does, loads
``/ui/`` from an in-process daemon on the mock runtime and uses it as a person
would: it types, clicks, reloads, and reads what the page shows. Each test
checks both sides: what the page shows, and what the daemon holds (its
conversations, events, metrics).

``SUPERFLUID_BROWSER_SCREENSHOT=1`` rewrites ``docs/ui-chat.png`` (a chat with
a branch) and ``docs/ui-live.png`` (the live view).
"""

from __future__ import annotations

import base64
import contextlib
import http.server
import json
import os
import signal
import tempfile
import threading
from collections.abc import AsyncIterator, Iterator
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import urlencode, urlsplit

import pytest
import trio

from superfluid.api._ui import ASSETS
from superfluid.serving import ApiKey

from ._cdp import CHROMIUM, Chromium, Page, launch_chromium, open_cdp, open_page
from .conftest import Daemon, mock_config, start_daemon, worker_pids

pytestmark = pytest.mark.browser

REQUIRE_REAL = os.environ.get("SUPERFLUID_REQUIRE_REAL") == "1"  # CI: a missing Chromium fails, never skips
if not os.access(CHROMIUM, os.X_OK) and not REQUIRE_REAL:
    pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install chromium)", allow_module_level=True)

DOCS = Path(__file__).parent.parent / "docs"
SHOTS = os.environ.get("SUPERFLUID_BROWSER_SCREENSHOT") == "1"
HOST_RULES = "MAP evil.example 127.0.0.1, MAP good.example 127.0.0.1"
FLAGS = ("--disable-features=LocalNetworkAccessChecks", "--window-size=1280,800")
# slow enough to watch a reply stream (about 48 tokens, 25 ms each), fast enough for a test
SLOW_MOCK = "mock?step_ms=25&prefill_us=5"


@pytest.fixture(scope="module")
def chromium() -> Iterator[Chromium]:
    if not os.access(CHROMIUM, os.X_OK):
        pytest.fail(f"no Chromium at {CHROMIUM}; SUPERFLUID_REQUIRE_REAL=1 needs it (apt-get install chromium)")
    with launch_chromium(host_rules=HOST_RULES, args=FLAGS) as browser:
        yield browser


@contextlib.asynccontextmanager
async def serving(spec: str = SLOW_MOCK, **config_kw: Any) -> AsyncIterator[Daemon]:
    sessions = Path(tempfile.mkdtemp(prefix="superfluid-ui-sessions-"))
    async with trio.open_nursery() as nursery:
        d = await start_daemon(nursery, mock_config(spec, sessions=sessions, **config_kw))
        try:
            yield d
        finally:
            await d.client.aclose()
            d.scope.cancel()


@contextlib.asynccontextmanager
async def tab(chromium: Chromium) -> AsyncIterator[Page]:
    async with open_cdp(chromium.ws_url) as cdp, open_page(cdp) as page:
        await page.send("Emulation.setDeviceMetricsOverride",
                        {"width": 1280, "height": 800, "deviceScaleFactor": 1, "mobile": False})
        yield page


async def until(page: Page, expression: str, within: float = 20.0) -> Any:
    """The first truthy value of ``expression`` in the page, polled every 50 ms."""
    with trio.move_on_after(within):
        while True:
            value = await page.evaluate(expression)
            if value:
                return value
            await trio.sleep(0.05)
    status = await page.evaluate("document.getElementById('status').textContent")
    raise AssertionError(f"not true within {within}s: {expression} (the page's status line: {status!r})")


async def open_ui(page: Page, url: str) -> None:
    await page.navigate(url)
    await until(page, "document.body.dataset.ready === '1'")


async def click(page: Page, selector: str) -> None:
    found = await page.evaluate(f"(() => {{ const e = document.querySelector({json.dumps(selector)}); "
                                "if (!e) return false; e.click(); return true; })()")
    assert found, f"nothing matches {selector}"


async def type_and_send(page: Page, text: str) -> None:
    await page.evaluate(f"document.getElementById('input').value = {json.dumps(text)}")
    await click(page, "#send")


WATCH_STREAM = """(() => {
  window.seen = [];
  new MutationObserver(() => {
    const t = document.querySelector('.msg.streaming .text');
    if (t && window.seen[window.seen.length - 1] !== t.textContent) window.seen.push(t.textContent);
  }).observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true});
  return true;
})()"""
SHOWN = "[...document.querySelectorAll('#messages .msg')].map(m => [m.classList[1], m.dataset.event || null, " \
        "m.querySelector('.text') ? m.querySelector('.text').textContent : ''])"
IDLE = "document.body.dataset.generating === '0'"  # a reply ended, and the page shows it as logged


async def events(d: Daemon, cid: str) -> list[dict[str, Any]]:
    r = await d.client.get(f"/v1/sessions/{cid}/events")
    assert r.status_code == 200, r.text
    return r.json()["events"]


async def conversations(d: Daemon) -> list[str]:
    r = await d.client.get("/v1/sessions", params={"limit": 1000})
    return sorted(s["id"] for s in r.json()["data"] if s["kind"] == "conversation")


async def send_and_watch(page: Page, text: str) -> list[str]:
    """Send ``text`` and wait for the reply to end; the texts the streaming reply showed on its way."""
    await page.evaluate(WATCH_STREAM)
    await type_and_send(page, text)
    await until(page, "document.querySelector('.msg.streaming') !== null")
    await until(page, IDLE + " && document.querySelectorAll('#messages .msg.assistant').length > 0")
    return await page.evaluate("window.seen")


async def test_a_message_streams_and_lands_in_the_conversation(chromium: Chromium) -> None:
    """Send a message: the reply grows in place as its SSE chunks arrive, then is shown as
    the conversation's event, the same text the daemon logged."""
    async with serving() as d, tab(chromium) as page:
        await open_ui(page, d.url + "/ui/")
        assert await page.evaluate("[...document.querySelectorAll('#model option')].map(o => o.value)") == ["mock"]
        seen = await send_and_watch(page, "hello there")
        assert len([s for s in seen if s]) >= 3, seen  # several partial texts: it streamed, not one answer
        cid = await page.evaluate("window.superfluid.state.current")
        logged = await events(d, cid)
        reply = [e for e in logged if e["type"] == "message" and e["message"]["role"] == "assistant"]
        assert len(reply) == 1 and reply[0]["message"]["content"], logged
        assert seen[-1] == reply[0]["message"]["content"]
        shown = await page.evaluate(SHOWN)
        assert shown == [["user", "1", "hello there"], ["assistant", str(reply[0]["id"]), reply[0]["message"]["content"]]]
        # the turn ran in the class the QoS picker named
        turn = next(e for e in logged if e["type"] == "turn")
        assert turn["params"].get("qos", "interactive") == "interactive", turn
        # a second message continues the same conversation
        await send_and_watch(page, "and more")
        assert await conversations(d) == [cid]
        assert [e["message"]["role"] for e in await events(d, cid) if e["type"] == "message"] == [
            "user", "assistant", "user", "assistant"]


async def test_stop_ends_the_reply(chromium: Chromium) -> None:
    """The stop button stops the running turn (DELETE …/generation): it lands cancelled."""
    async with serving("mock?step_ms=40&prefill_us=5") as d, tab(chromium) as page:
        await open_ui(page, d.url + "/ui/")
        await page.evaluate("document.getElementById('qos').value = 'agent'")
        await page.evaluate(WATCH_STREAM)
        await type_and_send(page, "a long story please")
        await until(page, "window.seen.length >= 2")
        await click(page, "#stop")
        await until(page, IDLE)
        cid = await page.evaluate("window.superfluid.state.current")
        logged = await events(d, cid)
        turn = next(e for e in logged if e["type"] == "turn")
        assert turn["params"]["qos"] == "agent", turn
        ends = [e for e in logged if e.get("finish") == "cancelled"]
        assert ends, logged


async def test_fork_then_reload_shows_the_conversations_again(chromium: Chromium) -> None:
    """Fork at the first message: a new conversation, selected, beside the first in the
    list; a reload shows both again and the one that was open."""
    async with serving() as d, tab(chromium) as page:
        await open_ui(page, d.url + "/ui/")
        await send_and_watch(page, "first question")
        first = await page.evaluate("window.superfluid.state.current")
        await click(page, ".msg.user .act-fork")
        await until(page, f"window.superfluid.state.current && window.superfluid.state.current !== {json.dumps(first)}")
        branch = await page.evaluate("window.superfluid.state.current")
        assert sorted([first, branch]) == await conversations(d)
        held = await events(d, branch)
        assert [e["type"] for e in held] == ["conversation", "message", "fork"], held
        await until(page, "document.querySelectorAll('#messages .msg.user').length === 1 && "
                          "document.querySelectorAll('#messages .msg.assistant').length === 0")
        tree = await page.evaluate("[...document.querySelectorAll('#tree .node')].map(n => n.dataset.id)")
        assert sorted(tree) == sorted([first, branch])
        # the branch answers on its own
        await send_and_watch(page, "second question")
        assert [e["message"]["content"] for e in await events(d, branch) if e["type"] == "message"][:2] == [
            "first question", "second question"]
        await page.navigate(await page.evaluate("location.href"))
        await until(page, "document.body.dataset.ready === '1'")
        assert await page.evaluate("window.superfluid.state.current") == branch
        tree = await page.evaluate("[...document.querySelectorAll('#tree .node')].map(n => n.dataset.id)")
        assert sorted(tree) == sorted([first, branch])
        shown = await page.evaluate(SHOWN)
        assert [role for role, _, _ in shown] == ["user", "user", "assistant"], shown
        await click(page, f"#tree .node[data-id={json.dumps(first)}]")
        await until(page, f"window.superfluid.state.current === {json.dumps(first)} && "
                          "document.querySelectorAll('#messages .msg').length === 2")


async def test_the_worker_dies_mid_reply_and_the_stream_finishes(chromium: Chromium) -> None:
    """The worker is SIGKILLed while the page streams a reply: the daemon respawns it and
    the page's stream goes on to the end, the text only ever growing, nothing shown twice."""
    async with serving() as d, tab(chromium) as page:
        r = await d.client.post("/v1/sessions", json={"model": "mock", "sampling": {"max_tokens": 100,
                                                                                    "ignore_eos": True}})
        cid = r.json()["id"]
        await open_ui(page, d.url + "/ui/?" + urlencode({"c": cid}))
        assert await page.evaluate("window.superfluid.state.current") == cid
        [pid] = worker_pids()
        await page.evaluate(WATCH_STREAM)
        await type_and_send(page, "go on")
        await until(page, "window.seen.length >= 3")
        os.kill(pid, signal.SIGKILL)
        await until(page, IDLE, within=30)
        reply = [e for e in await events(d, cid) if e["type"] == "message" and e["message"]["role"] == "assistant"]
        assert len(reply) == 1 and reply[0]["finish"] == "length", reply
        seen = await page.evaluate("window.seen")
        assert seen[-1] == reply[0]["message"]["content"]
        assert all(reply[0]["message"]["content"].startswith(s) for s in seen), seen  # it only ever grew
        assert 'superfluid_worker_respawns_total{model="mock"} 1.0' in (await d.client.get("/metrics")).text
        assert worker_pids() != [pid]
        assert not await page.evaluate("document.getElementById('status').classList.contains('err')")
        assert await page.evaluate("document.querySelector('.msg.assistant .finish').textContent") == "finish: length"


async def test_with_keys_the_page_asks_for_one_and_keeps_it_in_the_tab(chromium: Chromium) -> None:
    """With keys set, the page (served without one) asks for a key, keeps it in
    sessionStorage only, and works with it; a wrong key is asked again."""
    keys = (ApiKey.from_secret("me", "sk-ui-test"),)
    async with serving(api_keys=keys) as d, tab(chromium) as page:
        assert (await d.client.get("/v1/models")).status_code == 401
        await page.navigate(d.url + "/ui/")
        await until(page, "!document.getElementById('key-dialog').hidden")
        await page.evaluate("document.getElementById('key-input').value = 'sk-wrong'")
        await click(page, "#key-ok")
        await until(page, "!document.getElementById('key-dialog').hidden && "
                          "document.getElementById('key-error').textContent.includes('refused')")
        await page.evaluate("document.getElementById('key-input').value = 'sk-ui-test'")
        await click(page, "#key-ok")
        await until(page, "document.body.dataset.ready === '1'")
        assert await page.evaluate("sessionStorage.getItem('superfluid.key')") == "sk-ui-test"
        assert await page.evaluate("localStorage.length") == 0
        assert await page.evaluate("document.cookie") == ""
        await send_and_watch(page, "hello with a key")
        # the key's class is agent, and so its highest: the page falls back to it, and says so
        assert await page.evaluate("document.getElementById('qos').value") == ""
        assert "may not ask interactive" in await page.evaluate("document.getElementById('status').textContent")
        cid = await page.evaluate("window.superfluid.state.current")
        r = await d.client.get(f"/v1/sessions/{cid}/events", headers={"authorization": "Bearer sk-ui-test"})
        assert [e["type"] for e in r.json()["events"]][:2] == ["conversation", "message"]
        # a reload in the same tab keeps the key: no question this time
        await page.navigate(await page.evaluate("location.href"))
        await until(page, "document.body.dataset.ready === '1'")
        assert await page.evaluate("document.getElementById('key-dialog').hidden")
        assert await page.evaluate("window.superfluid.state.current") == cid


class _Static(http.server.SimpleHTTPRequestHandler):
    """The page's files, as a web app on another origin would serve a copy of them."""

    timeout = 5

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def static_port() -> Iterator[int]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), partial(_Static, directory=str(ASSETS)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def daemon_requests(page: Page, port: int) -> list[tuple[str, str, str | None, int | None]]:
    """(method, path, Origin, status) of each request the tab sent to the daemon's port."""
    out = []
    answers = {p["requestId"]: p["statusCode"] for p in page.events("Network.responseReceivedExtraInfo")}
    for sent in page.events("Network.requestWillBeSentExtraInfo"):
        request = next((p for p in page.events("Network.requestWillBeSent") if p["requestId"] == sent["requestId"]),
                       None)
        if request is None or urlsplit(request["request"]["url"]).port != port:
            continue
        headers = {k.lower(): v for k, v in sent["headers"].items()}
        out.append((request["request"]["method"], urlsplit(request["request"]["url"]).path, headers.get("origin"),
                    answers.get(sent["requestId"])))
    return out


async def test_a_copy_on_an_allowed_origin_works_and_on_a_foreign_one_is_refused(
        chromium: Chromium, static_port: int) -> None:
    """The page's files served from another origin, pointed at the daemon with ``?api=``:
    from an origin named by --web-origin it chats (CORS); from any other the daemon
    refuses every request (403 ``origin_refused``), and nothing is created."""
    good = f"http://good.example:{static_port}"
    async with serving(web_origins=(good,)) as d, tab(chromium) as page:
        port = urlsplit(d.url).port
        api = urlencode({"api": f"http://127.0.0.1:{port}"})
        await open_ui(page, f"{good}/index.html?{api}")
        await send_and_watch(page, "hello from elsewhere")
        (cid,) = await conversations(d)
        assert await page.evaluate("window.superfluid.state.current") == cid
        sent = daemon_requests(page, port)
        assert sent and all(origin == good for _, _, origin, _ in sent), sent
        assert ("POST", f"/v1/sessions/{cid}/generate", good, 200) in sent
        # the tree operations too: PATCH is preflighted, and granted to an allowed origin
        await click(page, "#rename")
        await until(page, "!document.getElementById('text-dialog').hidden")
        await page.evaluate("document.getElementById('text-input').value = 'from elsewhere'")
        await click(page, "#text-ok")
        await until(page, "document.getElementById('conv-title').textContent === 'from elsewhere'")
        assert (await d.client.get(f"/v1/sessions/{cid}")).json()["title"] == "from elsewhere"
        assert ("OPTIONS", f"/v1/sessions/{cid}", good, 204) in daemon_requests(page, port)

        before = await d.client.get("/metrics")
        evil = f"http://evil.example:{static_port}"
        since = len(page.cdp.events)
        await page.navigate(f"{evil}/index.html?{api}")
        await until(page, "document.body.dataset.ready === 'error'")
        assert "cannot reach" in await page.evaluate("document.getElementById('conn').textContent")
        await page.evaluate("document.getElementById('input').value = 'hi'")
        await click(page, "#send")
        await until(page, "document.getElementById('status').classList.contains('err')")
        refused = [r for r in daemon_requests(page, port) if r[2] == evil]
        assert refused and {status for *_, status in refused} == {403}, refused
        assert len(page.cdp.events) > since
        assert await conversations(d) == [cid]
        after = await d.client.get("/metrics")
        work = [line for line in after.text.splitlines() if line.startswith("superfluid_requests_total")]
        assert work == [line for line in before.text.splitlines() if line.startswith("superfluid_requests_total")]


async def test_the_live_view_shows_each_model_from_metrics(chromium: Chromium) -> None:
    """The live view reads /metrics (and /ui/lanes for each busy lane's class): a card per
    model with its lanes, queues per class, tokens/s, TTFT and KV use, while replies run."""
    async with serving(max_batch=4) as d, tab(chromium) as page:
        await open_ui(page, d.url + "/ui/")
        await send_and_watch(page, "something to count")
        async with trio.open_nursery() as nursery:
            for qos, text in (("background", "a batch line"), ("background", "another line"), ("agent", "a tool")):
                body = {"model": "mock", "messages": [{"role": "user", "content": text}], "max_tokens": 400,
                        "ignore_eos": True}
                nursery.start_soon(partial(d.client.post, "/v1/chat/completions", json=body,
                                           headers={"x-superfluid-qos": qos}))
            await click(page, "#tab-live")
            await until(page, "document.querySelectorAll('.model-card .lane[data-class]').length === 3", within=30)
            await trio.sleep(2.2)  # a few polls: rates and the sparkline
            classes = await page.evaluate(
                "[...document.querySelectorAll('.model-card .lane')].map(l => l.dataset.class || l.textContent)")
            assert classes == ["agent", "background", "background", "idle"], classes
            rows = await page.evaluate(
                "Object.fromEntries([...document.querySelectorAll('.model-card tr')].map(r => "
                "[r.dataset.metric, r.children[1].textContent]))")
            if SHOTS:
                await trio.Path(DOCS / "ui-live.png").write_bytes(await page.screenshot())
            nursery.cancel_scope.cancel()
        assert rows["lanes"] == "3 / 4 busy", rows
        assert "interactive 0" in rows["queued"] and "background 0" in rows["queued"], rows
        assert "p50" in rows["TTFT"] and "–" not in rows["TTFT"], rows  # requests were measured
        assert rows["decode"].startswith(("1", "2", "3", "4", "5", "6", "7", "8", "9")), rows  # tokens/s > 0
        assert "cells" in rows["KV use"], rows
        assert rows["requests"].startswith("ok "), rows
        assert await page.evaluate("new URL(location.href).searchParams.get('view')") == "live"

TOOL_SSE = [
    {"role": "assistant", "content": ""},
    {"tool_calls": [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "weather", "arguments": ""}}]},
    {"tool_calls": [{"index": 0, "function": {"arguments": "{\"city\": "}}]},
    {"tool_calls": [{"index": 0, "function": {"arguments": "\"Oslo\"}"}}]},
]
WATCH_CALLS = """(() => {
  window.calls = [];
  new MutationObserver(() => {
    const c = document.querySelector('.msg.streaming .calls');
    if (c && c.textContent && window.calls[window.calls.length - 1] !== c.textContent) window.calls.push(c.textContent);
  }).observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true});
  return true;
})()"""


async def test_tool_calls_are_shown_as_they_arrive_and_in_the_history(chromium: Chromium) -> None:
    """A streamed reply's tool call shows its name and its arguments, put together from
    their pieces (the stream is answered here with the chunks a tool-calling model sends:
    the mock sends none); a conversation's tool calls and results show in its history."""
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
    async with serving() as d, tab(chromium) as page:
        r = await d.client.post("/v1/sessions", json={"model": "mock", "tools": tools, "messages": [
            {"role": "user", "content": "weather in Bergen?"},
            {"role": "assistant", "content": "", "tool_calls": [{"id": "call_0", "type": "function", "function": {
                "name": "weather", "arguments": "{\"city\": \"Bergen\"}"}}]},
            {"role": "tool", "tool_call_id": "call_0", "content": "rain, 9 C"}]})
        assert r.status_code == 201, r.text
        cid = r.json()["id"]
        await open_ui(page, d.url + "/ui/?" + urlencode({"c": cid}))
        shown = await page.evaluate("[...document.querySelectorAll('#messages .call')].map(c => c.textContent)")
        assert shown == ['⚙ weather{"city": "Bergen"}'], shown
        assert await page.evaluate("document.querySelector('.msg.tool .text').textContent") == "rain, 9 C"

        body = "".join(f"data: {json.dumps({'choices': [{'index': 0, 'delta': delta}]})}\n\n" for delta in TOOL_SSE)
        body += f"data: {json.dumps({'choices': [{'index': 0, 'delta': {}, 'finish_reason': 'tool_calls'}]})}\n\n"
        body += "data: [DONE]\n\n"
        await page.send("Fetch.enable", {"patterns": [{"urlPattern": "*/generate", "requestStage": "Request"}]})
        await page.evaluate(WATCH_CALLS)
        since = len(page.cdp.events)
        await page.evaluate("document.getElementById('input').value = 'and in Oslo?'")
        await click(page, "#send")
        paused = await page.wait_event("Fetch.requestPaused", since=since)
        await page.send("Fetch.fulfillRequest", {
            "requestId": paused["requestId"], "responseCode": 200, "body": base64.b64encode(body.encode()).decode(),
            "responseHeaders": [{"name": "content-type", "value": "text/event-stream"}]})
        await until(page, IDLE)
        await page.send("Fetch.disable")
        # the pieces of the arguments joined under the call's name (this body came in one read, so
        # the page saw it at once; a model's stream comes a chunk at a time, each shown as it comes)
        calls = await page.evaluate("window.calls")
        assert calls and calls[-1] == '⚙ weather{"city": "Oslo"}', calls


@contextlib.asynccontextmanager
async def cuttable_proxy(target_port: int) -> AsyncIterator[tuple[int, Any]]:
    """A TCP proxy on loopback to ``target_port``: (its port, ``cut()``), which drops every
    connection open through it (a network that fails under a page)."""
    open_scopes: set[trio.CancelScope] = set()

    async def pump(src: trio.SocketStream, dst: trio.SocketStream) -> None:
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            while data := await src.receive_some(65536):
                await dst.send_all(data)
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await dst.send_eof()

    async def handle(client: trio.SocketStream) -> None:
        with trio.CancelScope() as scope:
            open_scopes.add(scope)
            try:
                async with client, await trio.open_tcp_stream("127.0.0.1", target_port) as upstream:
                    async with trio.open_nursery() as n:
                        n.start_soon(pump, client, upstream)
                        n.start_soon(pump, upstream, client)
            finally:
                open_scopes.discard(scope)

    def cut() -> None:
        for scope in list(open_scopes):
            scope.cancel()

    async with trio.open_nursery() as nursery:
        [listener] = await nursery.start(partial(trio.serve_tcp, handle, 0, host="127.0.0.1"))
        try:
            yield listener.socket.getsockname()[1], cut
        finally:
            nursery.cancel_scope.cancel()


async def test_a_dropped_connection_resumes_the_reply_from_its_cursor(chromium: Chromium) -> None:
    """The network drops every connection mid-reply: the turn goes on in the daemon, and the
    page follows it again from its last cursor (…/stream?after=N): the text only grows, to the end."""
    async with serving() as d, tab(chromium) as page:
        r = await d.client.post("/v1/sessions", json={"model": "mock", "sampling": {"max_tokens": 100,
                                                                                    "ignore_eos": True}})
        cid = r.json()["id"]
        async with cuttable_proxy(urlsplit(d.url).port) as (port, cut):
            await open_ui(page, f"http://127.0.0.1:{port}/ui/?" + urlencode({"c": cid}))
            await page.evaluate(WATCH_STREAM)
            await type_and_send(page, "go on")
            await until(page, "window.seen.length >= 3")
            cut()
            await until(page, IDLE, within=30)
        reply = [e for e in await events(d, cid) if e["type"] == "message" and e["message"]["role"] == "assistant"]
        assert len(reply) == 1 and reply[0]["finish"] == "length", reply
        seen = await page.evaluate("window.seen")
        assert seen[-1] == reply[0]["message"]["content"]
        assert all(reply[0]["message"]["content"].startswith(s) for s in seen), seen
        resumed = [p["request"]["url"] for p in page.events("Network.requestWillBeSent")
                   if "/stream?after=" in p["request"]["url"]]
        assert resumed, "the page did not follow the reply again"
        assert "resumed" in await page.evaluate("document.getElementById('status').textContent")



async def test_an_open_tool_call_is_answered_from_the_page_and_the_model_goes_on(chromium: Chromium) -> None:
    """The last reply called a tool and no result is in yet: the page shows the open call,
    sends the result typed there, and the model answers on."""
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
    async with serving() as d, tab(chromium) as page:
        r = await d.client.post("/v1/sessions", json={"model": "mock", "tools": tools, "messages": [
            {"role": "user", "content": "weather in Bergen?"},
            {"role": "assistant", "content": "", "tool_calls": [{"id": "call_0", "type": "function", "function": {
                "name": "weather", "arguments": "{\"city\": \"Bergen\"}"}}]}]})
        cid = r.json()["id"]
        await open_ui(page, d.url + "/ui/?" + urlencode({"c": cid}))
        assert await page.evaluate("[...document.querySelectorAll('.ledger-call')].map(c => c.dataset.call)") == [
            "call_0"]
        await page.evaluate("document.querySelector('.ledger-call textarea').value = 'rain, 9 C'")
        await page.evaluate(WATCH_STREAM)
        await click(page, ".ledger-call .act-result")
        await until(page, "window.seen.length > 0")
        await until(page, IDLE)
        held = [e["message"] for e in await events(d, cid) if e["type"] == "message"]
        assert held[2] == {"role": "tool", "tool_call_id": "call_0", "content": "rain, 9 C"}, held
        assert held[3]["role"] == "assistant" and held[3]["content"], held
        assert await page.evaluate("document.querySelector('.ledger')") is None
        # through the tool ledger where the server has it (its check: an open call of that id), else appended
        posted = {urlsplit(p["request"]["url"]).path.rpartition("/")[2] for p in page.events("Network.requestWillBeSent")
                  if p["request"]["method"] == "POST"}
        ledger = await page.evaluate("window.superfluid.state.ops === true")
        assert ("tool_results" in posted) == ledger and ("messages" in posted) != ledger, posted


# ---- the session-tree operations (rebase, trim, meta, purge, tree, subscribe) ----

TREE = """Object.fromEntries([...document.querySelectorAll('#tree .node')].map(n => {
  const up = n.parentElement.parentElement.closest('li');
  return [n.dataset.id, up ? up.querySelector(':scope > .node').dataset.id : null];
}))"""


async def tree(d: Daemon, archived: bool = False) -> dict[str, dict[str, Any]]:
    r = await d.client.get("/v1/sessions", params={"view": "tree", **({"include_archived": 1} if archived else {})})
    assert r.status_code == 200, r.text
    return {c["id"]: c for c in r.json()["data"]}


async def open_conversation(page: Page, cid: str) -> None:
    """Click ``cid`` in the side list and wait until the page has read it."""
    await click(page, f"#tree .node[data-id={json.dumps(cid)}]")
    await until(page, f"window.superfluid.state.info && window.superfluid.state.info.id === {json.dumps(cid)}")


async def edit_message(page: Page, event: int, text: str) -> str:
    """Edit message ``event`` in the page; the id of the branch it opens."""
    before = await page.evaluate("window.superfluid.state.current")
    await click(page, f".msg[data-event='{event}'] .act-edit")
    await page.evaluate(f"document.querySelector('.msg[data-event=\"{event}\"] textarea').value = {json.dumps(text)}")
    await click(page, f".msg[data-event='{event}'] .act-save")
    return await until(page, f"window.superfluid.state.current !== {json.dumps(before)} && "
                             "window.superfluid.state.current")


async def test_edit_is_a_rebase_and_the_branch_is_answered(chromium: Chromium) -> None:
    """Editing a user message makes a branch (a rebase: the message replaced, what followed
    dropped), opens it, and the model answers the edited message there; the parent is unchanged."""
    async with serving() as d, tab(chromium) as page:
        await open_ui(page, d.url + "/ui/")
        await send_and_watch(page, "what is a lane?")
        root = await page.evaluate("window.superfluid.state.current")
        before = await events(d, root)
        await page.evaluate(WATCH_STREAM)
        branch = await edit_message(page, 1, "what is a tick?")
        await until(page, "window.seen.length > 0")  # the branch's reply streamed
        await until(page, IDLE + " && document.querySelectorAll('#messages .msg.assistant').length === 1")
        assert await events(d, root) == before  # the parent is never rewritten
        held = [e for e in await events(d, branch) if e["type"] == "message"]
        assert [(e["message"]["role"], e["message"]["content"]) for e in held][:1] == [("user", "what is a tick?")]
        assert [e["message"]["role"] for e in held] == ["user", "assistant"], held
        t = await tree(d)
        assert t[branch]["parent"] == root and t[root]["parent"] is None
        assert (await page.evaluate(TREE)) == {root: None, branch: root}
        shown = await page.evaluate(SHOWN)
        assert [(role, text) for role, _, text in shown][0] == ("user", "what is a tick?")


async def test_the_tree_rename_archive_trim_and_delete_survive_a_reload(chromium: Chromium) -> None:
    """Fork, trim, rename and archive from the page; after a reload (this tab's own memory
    of its conversations cleared) the tree, titles and the archive read back from the server.
    Deleting a conversation with branches makes them roots."""
    async with serving() as d, tab(chromium) as page:
        await open_ui(page, d.url + "/ui/")
        await send_and_watch(page, "first")
        await send_and_watch(page, "second")
        root = await page.evaluate("window.superfluid.state.current")
        await click(page, ".msg.user .act-fork")  # at event 1
        fork = await until(page, f"window.superfluid.state.current !== {json.dumps(root)} && "
                                 "window.superfluid.state.current")
        await click(page, f"#tree .node[data-id={json.dumps(root)}]")
        await until(page, f"window.superfluid.state.current === {json.dumps(root)} && "
                          "document.querySelectorAll('#messages .msg').length === 4")
        third = await page.evaluate("document.querySelectorAll('#messages .msg.user')[1].dataset.event")
        await click(page, f".msg[data-event='{third}'] .act-trim")
        trimmed = await until(page, f"![{json.dumps(root)}, {json.dumps(fork)}].includes("
                                    "window.superfluid.state.current) && window.superfluid.state.current")
        assert [e["type"] for e in await events(d, trimmed)][-1] == "fork"
        assert len([e for e in await events(d, trimmed) if e["type"] == "message"]) == 2  # before the 2nd question
        # rename the root, archive the trimmed branch
        await open_conversation(page, root)
        await click(page, "#rename")
        await until(page, "!document.getElementById('text-dialog').hidden")
        await page.evaluate("document.getElementById('text-input').value = 'Lanes and ticks'")
        await click(page, "#text-ok")
        await until(page, "document.getElementById('conv-title').textContent === 'Lanes and ticks'")
        await page.evaluate("(() => { const q = document.getElementById('qos'); q.value = 'background'; "
                            "q.dispatchEvent(new Event('change')); return true; })()")
        await until(page, "window.superfluid.state.info.qos === 'background'")
        await open_conversation(page, trimmed)
        await click(page, "#archive")
        await until(page, f"!document.querySelector('#tree .node[data-id={json.dumps(trimmed)}]')")
        t = await tree(d, archived=True)
        assert t[root]["title"] == "Lanes and ticks" and t[trimmed]["archived"] is True
        assert t[root]["qos"] == "background" and t[fork]["qos"] is None
        assert t[fork]["parent"] == root and t[trimmed]["parent"] == root

        await page.evaluate("sessionStorage.removeItem('superfluid.conversations')")
        await page.navigate(d.url + "/ui/")
        await until(page, "document.body.dataset.ready === '1'")
        assert await page.evaluate(TREE) == {root: None, fork: root}
        assert await page.evaluate(f"document.querySelector('#tree .node[data-id={json.dumps(root)}]').textContent"
                                   ) == "Lanes and ticks"
        await click(page, "#show-archived")
        await until(page, "document.querySelectorAll('#tree .node').length === 3")
        assert await page.evaluate(TREE) == {root: None, fork: root, trimmed: root}
        assert await page.evaluate(f"document.querySelector('#tree .node[data-id={json.dumps(trimmed)}]')"
                                   ".classList.contains('archived')")

        # delete the root: it has branches, so they become roots
        await open_conversation(page, root)
        assert await page.evaluate("document.getElementById('qos').value") == "background"  # its own class
        await click(page, "#delete")
        await until(page, "window.superfluid.state.current === null && document.querySelectorAll('#tree .node')"
                          ".length === 2")
        assert await page.evaluate(TREE) == {fork: None, trimmed: None}
        assert (await d.client.get(f"/v1/sessions/{root}")).status_code == 404
        t = await tree(d, archived=True)
        assert set(t) == {fork, trimmed} and t[fork]["parent"] is None


async def test_a_second_tab_follows_the_conversation_live(chromium: Chromium) -> None:
    """Two tabs on one conversation: what one sends and the reply it streams show in the
    other as they happen (its subscription: the running turn's text, then the committed
    events), with no reload."""
    async with serving() as d, tab(chromium) as one, tab(chromium) as two:
        await open_ui(one, d.url + "/ui/")
        await send_and_watch(one, "hello from tab one")
        cid = await one.evaluate("window.superfluid.state.current")
        await open_ui(two, d.url + "/ui/?" + urlencode({"c": cid}))
        await until(two, "document.querySelectorAll('#messages .msg').length === 2")
        await two.evaluate("""(() => {
          window.live = [];
          new MutationObserver(() => {
            const t = document.querySelector('.msg.provisional .text');
            if (t && window.live[window.live.length - 1] !== t.textContent) window.live.push(t.textContent);
          }).observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true});
          return true;
        })()""")
        await send_and_watch(one, "and a second question")
        await until(two, "document.querySelectorAll('#messages .msg').length === 4 && "
                         "!document.querySelector('.msg.provisional')")
        shown_one, shown_two = await one.evaluate(SHOWN), await two.evaluate(SHOWN)
        assert shown_two == shown_one, (shown_one, shown_two)
        live = await two.evaluate("window.live")
        assert len(live) >= 2 and shown_two[-1][2].startswith(live[-1]), live  # it grew as it ran
        # and the other way round
        await send_and_watch(two, "from tab two")
        await until(one, "document.querySelectorAll('#messages .msg').length === 6")
        assert await one.evaluate(SHOWN) == await two.evaluate(SHOWN)
        # deleted in one tab, it is gone from the other (its subscription ends "purged")
        await click(two, "#delete")
        await until(one, "window.superfluid.state.current === null && !document.querySelector('#tree .node')")
        assert "deleted" in await one.evaluate("document.getElementById('status').textContent")


async def test_screenshot_of_a_chat_with_branches(chromium: Chromium) -> None:
    """A chat with two branches, titled (docs/ui.md, docs/ui-chat.png)."""
    async with serving(max_batch=4) as d, tab(chromium) as page:
        await open_ui(page, d.url + "/ui/")
        await send_and_watch(page, "What does a scheduler tick do?")
        await send_and_watch(page, "And when a worker dies?")
        root = await page.evaluate("window.superfluid.state.current")
        await page.evaluate(WATCH_STREAM)
        second = int(await page.evaluate("document.querySelectorAll('#messages .msg.user')[1].dataset.event"))
        edited = await edit_message(page, second, "And when the daemon restarts?")
        await until(page, IDLE + " && document.querySelectorAll('#messages .msg.assistant').length === 2")
        await open_conversation(page, root)
        await click(page, ".msg.user .act-fork")
        fork = await until(page, f"![{json.dumps(root)}, {json.dumps(edited)}].includes("
                                 "window.superfluid.state.current) && window.superfluid.state.current")
        await send_and_watch(page, "Tell me about the prefix cache instead.")
        for cid, title in ((root, "Scheduler questions"), (edited, "…after a restart"), (fork, "Prefix cache")):
            r = await d.client.patch(f"/v1/sessions/{cid}", json={"title": title})
            assert r.status_code == 200, r.text
        await page.navigate(await page.evaluate("location.href"))
        await until(page, "document.body.dataset.ready === '1'")
        assert await page.evaluate(TREE) == {root: None, edited: root, fork: root}
        assert await page.evaluate("document.getElementById('conv-title').textContent") == "Prefix cache"
        if SHOTS:
            await trio.Path(DOCS / "ui-chat.png").write_bytes(await page.screenshot())


async def test_the_daemons_own_page_cannot_be_pointed_elsewhere(chromium: Chromium, static_port: int) -> None:
    """``?api=`` on the page the daemon serves: its CSP (``connect-src 'self'``) blocks every
    request to another origin, so a crafted link cannot make the page send a typed key elsewhere."""
    async with serving() as d, tab(chromium) as page:
        await page.send("Page.addScriptToEvaluateOnNewDocument", {"source": (
            "window.violations = []; document.addEventListener('securitypolicyviolation', "
            "e => window.violations.push([e.effectiveDirective, e.blockedURI]));")})
        elsewhere = f"http://evil.example:{static_port}"
        await page.navigate(d.url + "/ui/?" + urlencode({"api": elsewhere}))
        await until(page, "document.body.dataset.ready === 'error'")
        violations = await page.evaluate("window.violations")
        assert violations and all(v == ["connect-src", f"{elsewhere}/v1/models"] for v in violations), violations
        sent = [p["request"]["url"] for p in page.events("Network.requestWillBeSent")]
        assert not [u for u in sent if u.startswith(elsewhere)], sent  # nothing left the browser
