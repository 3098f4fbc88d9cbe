"""The suite's HTTP/1.1 client: h11 over trio sockets.

One TCP connection per request (``Connection: close``), so the client alone
decides when a socket closes: after N content chunks, after S seconds, or
when a chunk callback says so. Every read is stamped with
``trio.current_time()`` before it is parsed, so chunk timestamps are arrival
times. Only loopback hosts are accepted.
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable

import h11
import trio

from ._reply import Reply, StreamReader, read_whole

__all__ = ["Client", "LOOPBACK", "metric_sum"]

LOOPBACK = ("127.0.0.1", "localhost", "::1")
READ_SIZE = 65536
MAX_WHOLE_BODY = 64 * 1024 * 1024


def metric_sum(text: str, name: str, **labels: str) -> float | None:
    """Sum of the samples of ``name`` in Prometheus text whose labels include
    ``labels`` (any others summed over); None if there is none."""
    pattern = re.compile(rf"^{re.escape(name)}(?:\{{([^}}]*)\}})?\s+(\S+)\s*$", re.M)
    want = {f'{k}="{v}"' for k, v in labels.items()}
    values = [float(m.group(2)) for m in pattern.finditer(text)
              if want <= set(_LABEL.findall(m.group(1) or ""))]
    return sum(values) if values else None


_LABEL = re.compile(r'\w+="(?:[^"\\]|\\.)*"')


class Client:
    """Talks to one server. ``qos`` enables the ``x-superfluid-qos`` header;
    ``busy`` is how busy lanes are read (``metrics``, ``slots`` or None)."""

    def __init__(self, host: str, port: int, *, model: str | None = None, qos: bool = False,
                 busy: str | None = None, extra_body: dict[str, Any] | None = None) -> None:
        if host not in LOOPBACK:
            raise ValueError(f"the suite only talks to loopback servers, not {host!r}")
        self.host = host
        self.port = port
        self.authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"  # the Host header (RFC 9110 7.2)
        self.model = model
        self.qos = qos
        self.busy = busy
        self.extra_body = dict(extra_body or {})

    # -- one exchange ---------------------------------------------------------------------------------------------

    async def call(
        self, method: str, path: str, body: Any = None, *, headers: list[tuple[str, str]] | None = None,
        stream: bool = False, timeout: float = 60.0, limit: float | None = None,
        abort_after_chunks: int | None = None, abort_after_s: float | None = None,
        on_chunk: Callable[[Reply], Any] | None = None,
    ) -> Reply:
        """One request. ``timeout`` bounds each read, ``limit`` the whole exchange."""
        reply = Reply(stream=stream)

        def hook(r: Reply) -> Any:
            verdict = on_chunk(r) if on_chunk is not None else None
            if abort_after_chunks is not None and r.chunks >= abort_after_chunks:
                return "abort"
            return verdict

        reader = StreamReader(reply, on_chunk=hook)
        payload = b"" if body is None else json.dumps(body).encode()
        head = [("Host", self.authority), ("Connection", "close"), ("Accept", "*/*"),
                ("User-Agent", "superfluid-suite")]
        if body is not None:
            head += [("Content-Type", "application/json"), ("Content-Length", str(len(payload)))]
        head += list(headers or [])
        reply.sent_at = trio.current_time()
        with trio.move_on_after(abort_after_s if abort_after_s is not None else float("inf")) as abort_scope:
            try:
                with trio.fail_after(limit if limit is not None else float("inf")):
                    await self._exchange(method, path, head, payload, reply, reader, timeout)
            except trio.TooSlowError:
                reply.fail("timeout", f"no reply within {limit if limit is not None else timeout} s")
            except h11.RemoteProtocolError as exc:
                if reply.status == 200 and stream:
                    reply.fail("truncated", f"the connection closed mid-body: {exc}")
                else:
                    reply.fail("transport", f"broken HTTP: {exc}")
            except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                reply.fail("transport", f"{type(exc).__name__}: {exc}")
        now = trio.current_time()
        if abort_scope.cancelled_caught or reader.abort:
            reply.aborted = True
        if not reply.finished_at:
            reply.finished_at = now
        if stream and reply.status == 200 and reply.error_kind is None and not reply.aborted:
            reader.end(now)
        return reply

    async def _exchange(self, method: str, path: str, head: list[tuple[str, str]], payload: bytes, reply: Reply,
                        reader: StreamReader, timeout: float) -> None:
        sock = await trio.open_tcp_stream(self.host, self.port)
        async with sock:
            conn = h11.Connection(h11.CLIENT)
            out = conn.send(h11.Request(method=method, target=path, headers=head))
            if payload:
                out += conn.send(h11.Data(data=payload))
            out += conn.send(h11.EndOfMessage())
            await sock.send_all(out)
            sse = False
            whole: list[bytes] = []
            size = 0
            now = trio.current_time()
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    with trio.fail_after(timeout):
                        data = await sock.receive_some(READ_SIZE)
                    now = trio.current_time()
                    conn.receive_data(data)
                    continue
                if isinstance(event, h11.Response):
                    reply.status = event.status_code
                    reply.headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in event.headers}
                    ctype = dict(event.headers).get(b"content-type", b"")
                    sse = event.status_code == 200 and ctype.startswith(b"text/event-stream")
                elif isinstance(event, h11.Data):
                    if sse:
                        reader.feed(bytes(event.data), now)
                        if reader.abort:
                            reply.finished_at = now
                            return  # leaving ``async with`` closes the socket mid-stream
                    else:
                        size += len(event.data)
                        if size > MAX_WHOLE_BODY:
                            reply.fail("malformed", f"body larger than {MAX_WHOLE_BODY} bytes")
                            return
                        whole.append(bytes(event.data))
                elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                    break
            if sse:
                reader.end(now)
            else:
                read_whole(reply, b"".join(whole), now)

    # -- conveniences -----------------------------------------------------------------------------------------------

    def chat_body(self, messages: list[dict[str, Any]], *, max_tokens: int, stream: bool,
                  **extra: Any) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "messages": messages, "max_tokens": max_tokens,
                                "temperature": 0, "seed": 1, "stream": stream,
                                "chat_template_kwargs": {"enable_thinking": False}}
        if stream:
            body["stream_options"] = {"include_usage": True}
        body.update(self.extra_body)
        body.update(extra)
        return body

    async def chat(self, messages: list[dict[str, Any]] | str, *, max_tokens: int, stream: bool = True,
                   qos: str | None = None, timeout: float = 120.0, limit: float | None = None,
                   abort_after_chunks: int | None = None, abort_after_s: float | None = None,
                   on_chunk: Callable[[Reply], Any] | None = None, headers: list[tuple[str, str]] | None = None,
                   **extra: Any) -> Reply:
        """``POST /v1/chat/completions``, greedy, thinking off. A ``qos`` class
        is sent only to servers that take the header."""
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        headers = [*(headers or []), *([("x-superfluid-qos", qos)] if qos and self.qos else [])]
        body = self.chat_body(messages, max_tokens=max_tokens, stream=stream, **extra)
        return await self.call("POST", "/v1/chat/completions", body, headers=headers, stream=stream,
                               timeout=timeout, limit=limit, abort_after_chunks=abort_after_chunks,
                               abort_after_s=abort_after_s, on_chunk=on_chunk)

    async def get_json(self, path: str, *, timeout: float = 10.0) -> tuple[int | None, Any]:
        reply = await self.call("GET", path, timeout=timeout, limit=timeout)
        return reply.status, reply.body

    async def metric(self, name: str) -> float | None:
        """Summed value of a Prometheus metric from ``/metrics``; None if unavailable."""
        text = await self.raw_get("/metrics")
        return None if text is None else metric_sum(text, name)

    async def raw_get(self, path: str, *, timeout: float = 10.0) -> str | None:
        """GET a non-JSON body (``/metrics``)."""
        chunks: list[bytes] = []
        try:
            with trio.fail_after(timeout):
                sock = await trio.open_tcp_stream(self.host, self.port)
                async with sock:
                    conn = h11.Connection(h11.CLIENT)
                    await sock.send_all(conn.send(h11.Request(method="GET", target=path, headers=[
                        ("Host", self.authority), ("Connection", "close")])) + conn.send(h11.EndOfMessage()))
                    status = None
                    while True:
                        event = conn.next_event()
                        if event is h11.NEED_DATA:
                            conn.receive_data(await sock.receive_some(READ_SIZE))
                        elif isinstance(event, h11.Response):
                            status = event.status_code
                        elif isinstance(event, h11.Data):
                            chunks.append(bytes(event.data))
                        else:
                            break
        except (trio.TooSlowError, OSError, trio.BrokenResourceError, h11.ProtocolError):
            return None
        return b"".join(chunks).decode("utf-8", "replace") if status == 200 else None

    async def busy_lanes(self) -> int | None:
        """Lanes at work: ``superfluid_lanes_active``, or llama-server ``/slots``; None if unknowable."""
        if self.busy == "metrics":
            value = await self.metric("superfluid_lanes_active")
            return None if value is None else int(value)
        if self.busy == "slots":
            status, body = await self.get_json("/slots")
            if status != 200 or not isinstance(body, list):
                return None
            return sum(1 for slot in body if isinstance(slot, dict) and slot.get("is_processing"))
        return None

    async def wait_ok(self, timeout: float = 300.0) -> float | None:
        """Repeat a short non-streamed "Say OK." until one succeeds; seconds taken, or None."""
        start = trio.current_time()
        deadline = start + timeout
        while trio.current_time() < deadline:
            left = deadline - trio.current_time()
            reply = await self.chat("Say OK.", max_tokens=4, stream=False, timeout=min(60.0, left),
                                    limit=min(60.0, left))
            if reply.ok:
                return trio.current_time() - start
            await trio.sleep(0.25)
        return None

    async def wait_idle(self, timeout: float = 600.0) -> bool:
        """Serving again and no lane busy (where that is observable)."""
        deadline = trio.current_time() + timeout
        if await self.wait_ok(timeout) is None:
            return False
        while trio.current_time() < deadline:
            busy = await self.busy_lanes()
            if not busy:
                return True
            await trio.sleep(0.1)
        return False
