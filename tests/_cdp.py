"""A small Chrome DevTools Protocol client for the browser tests: start a
headless Chromium, open a page in it, navigate, evaluate, screenshot, and read
the Network events it saw. Built on trio-websocket; no Playwright, no node.

Lifetimes::

    launch_chromium()            sync context manager: the browser process
    └── open_cdp(url)            async: one DevTools websocket + its reader task
        └── open_page(cdp)       async: one tab (target) on a flat session
"""

from __future__ import annotations

import base64
import collections
import contextlib
import json
import os
import re
import selectors
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import attrs
import trio
from trio_websocket import ConnectionClosed, WebSocketConnection, open_websocket_url

CHROMIUM = "/usr/bin/chromium"
MAX_EVENTS = 10_000  # events kept per connection; a test that sees more is broken
MAX_MESSAGE = 64 * 2**20  # a screenshot arrives as one base64 message

# Flags for a quiet, loopback-only browser: nothing phones home, no QUIC, no GPU.
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--remote-debugging-port=0")

_LISTENING = re.compile(r"DevTools listening on (ws://\S+)")


class CdpError(Exception):
    """A DevTools command answered with an error, or a page script threw."""


@attrs.define
class Chromium:
    process: subprocess.Popen[bytes]
    ws_url: str  # the browser endpoint, ws://127.0.0.1:PORT/devtools/browser/ID


@contextlib.contextmanager
def launch_chromium(*, host_rules: str = "", args: tuple[str, ...] = (),
                    start_timeout: float = 30.0) -> Iterator[Chromium]:
    """Start headless Chromium with a throwaway profile; kill it on exit.

    ``host_rules`` is a ``--host-resolver-rules`` value (``MAP evil.example 127.0.0.1``)
    so pages can live on foreign-looking origins while traffic stays on loopback;
    ``args`` are more command-line flags.
    """
    with tempfile.TemporaryDirectory(prefix="superfluid-chromium-") as profile:
        argv = [CHROMIUM, *FLAGS, f"--user-data-dir={profile}", *args]
        if host_rules:
            argv.append(f"--host-resolver-rules={host_rules}")
        argv.append("about:blank")
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                start_new_session=True)  # its own process group: renderers die with it
        assert proc.stderr is not None
        drain = threading.Thread(target=_drain, args=(proc.stderr,), daemon=True)
        try:
            ws_url = _await_listening(proc, start_timeout)
            drain.start()  # from here on nobody reads stderr: keep the pipe from filling
            yield Chromium(proc, ws_url)
        finally:
            _stop(proc)
            if drain.is_alive():
                drain.join(timeout=5)
            proc.stderr.close()


def _await_listening(proc: subprocess.Popen[bytes], timeout: float) -> str:
    """Read Chromium's stderr up to its ``DevTools listening on`` line."""
    assert proc.stderr is not None
    tail: collections.deque[str] = collections.deque(maxlen=20)  # for the error message
    deadline = time.monotonic() + timeout
    buffered = b""
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stderr, selectors.EVENT_READ)
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(left):
                raise RuntimeError(f"chromium did not open DevTools within {timeout}s: {list(tail)}")
            chunk = os.read(proc.stderr.fileno(), 65536)
            if not chunk:
                raise RuntimeError(f"chromium exited ({proc.wait()}) before DevTools: {list(tail)}")
            buffered += chunk
            *lines, buffered = buffered.split(b"\n")
            for line in lines:
                text = line.decode(errors="replace")
                tail.append(text)
                m = _LISTENING.search(text)
                if m:
                    return m.group(1)


def _drain(stream: Any) -> None:
    """Read stderr to its end so Chromium never blocks on a full pipe."""
    while stream.read(65536):
        pass


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the browser's process group, SIGKILL it if it lingers."""
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


@attrs.define(eq=False)
class Cdp:
    """One DevTools websocket: commands matched to replies by id; every event kept."""

    ws: WebSocketConnection
    events: list[dict[str, Any]] = attrs.Factory(list)  # {"method", "params", "sessionId"?}, in order
    _next_id: int = 0
    _waiting: dict[int, trio.MemorySendChannel[dict[str, Any]]] = attrs.Factory(dict)
    _changed: trio.Event = attrs.Factory(trio.Event)

    async def send(self, method: str, params: dict[str, Any] | None = None, *,
                   session: str | None = None) -> dict[str, Any]:
        """Run one command; its ``result``. Raises CdpError on an error reply."""
        self._next_id += 1
        ident = self._next_id
        message: dict[str, Any] = {"id": ident, "method": method, "params": params or {}}
        if session is not None:
            message["sessionId"] = session
        send, receive = trio.open_memory_channel[dict[str, Any]](1)
        self._waiting[ident] = send
        try:
            await self.ws.send_message(json.dumps(message))
            reply = await receive.receive()
        except trio.EndOfChannel:
            raise CdpError(f"{method}: the DevTools connection closed") from None
        finally:
            del self._waiting[ident]
        if "error" in reply:
            raise CdpError(f"{method}: {reply['error']}")
        return reply["result"]

    async def wait_for(self, match: Callable[[dict[str, Any]], bool], *, since: int = 0) -> dict[str, Any]:
        """The first event at index ``since`` or later that ``match`` accepts, waiting for it."""
        seen = since
        while True:
            for event in self.events[seen:]:
                if match(event):
                    return event
            seen = len(self.events)
            await self._changed.wait()

    async def _read(self) -> None:
        try:
            while True:
                self._dispatch(json.loads(await self.ws.get_message()))
        except ConnectionClosed:
            pass
        finally:
            for waiter in self._waiting.values():
                waiter.close()  # their commands will get no reply

    def _dispatch(self, message: dict[str, Any]) -> None:
        if "id" in message:
            waiter = self._waiting.get(message["id"])
            if waiter is not None:
                waiter.send_nowait(message)  # room for exactly the one reply
            return
        if len(self.events) >= MAX_EVENTS:
            raise RuntimeError(f"more than {MAX_EVENTS} DevTools events")
        self.events.append(message)
        self._changed.set()
        self._changed = trio.Event()


@contextlib.asynccontextmanager
async def open_cdp(url: str) -> AsyncIterator[Cdp]:
    async with open_websocket_url(url, max_message_size=MAX_MESSAGE) as ws, trio.open_nursery() as nursery:
        cdp = Cdp(ws)
        nursery.start_soon(cdp._read)
        try:
            yield cdp
        finally:
            nursery.cancel_scope.cancel()


@attrs.define
class Page:
    """One tab, driven through a flat session of the browser connection."""

    cdp: Cdp
    session: str

    async def send(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        return await self.cdp.send(method, params, session=self.session)

    def events(self, method: str) -> list[dict[str, Any]]:
        """This tab's events named ``method``, their params."""
        return [e["params"] for e in self.cdp.events if e.get("sessionId") == self.session and e["method"] == method]

    async def wait_event(self, method: str, *, since: int = 0) -> dict[str, Any]:
        event = await self.cdp.wait_for(lambda e: e.get("sessionId") == self.session and e["method"] == method,
                                        since=since)
        return event["params"]

    async def navigate(self, url: str) -> None:
        """Load ``url`` and wait for its load event."""
        since = len(self.cdp.events)
        result = await self.send("Page.navigate", {"url": url})
        if result.get("errorText"):
            raise CdpError(f"navigate {url}: {result['errorText']}")
        await self.wait_event("Page.loadEventFired", since=since)

    async def evaluate(self, expression: str) -> Any:
        """The value of a script expression, awaited if it is a promise."""
        result = await self.send("Runtime.evaluate", {"expression": expression, "awaitPromise": True,
                                                      "returnByValue": True})
        if "exceptionDetails" in result:
            raise CdpError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def screenshot(self) -> bytes:
        """The whole page as PNG bytes."""
        size = (await self.send("Page.getLayoutMetrics"))["cssContentSize"]
        clip = {"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1}
        shot = await self.send("Page.captureScreenshot", {"format": "png", "clip": clip, "captureBeyondViewport": True})
        return base64.b64decode(shot["data"])


@contextlib.asynccontextmanager
async def open_page(cdp: Cdp, *, domains: tuple[str, ...] = ("Page", "Network", "Runtime")) -> AsyncIterator[Page]:
    """A new blank tab with ``domains`` enabled; closed on exit."""
    target = (await cdp.send("Target.createTarget", {"url": "about:blank"}))["targetId"]
    try:
        session = (await cdp.send("Target.attachToTarget", {"targetId": target, "flatten": True}))["sessionId"]
        page = Page(cdp, session)
        for domain in domains:
            await page.send(f"{domain}.enable")
        yield page
    finally:
        with trio.move_on_after(5) as cleanup:
            cleanup.shield = True
            await cdp.send("Target.closeTarget", {"targetId": target})
