"""What the daemon itself costs per streamed token, with a runtime that costs nothing.

Usage::

    python bench/overhead.py [--streams 64,256,1024] [--tokens 64] [--requests-per-stream 4]
        [--max-batch N,...] [--quick] [--memory-requests 20000]

The daemon serves the mock runtime with no engine cost (``mock?step_ms=0&prefill_us=0``),
so every microsecond it spends is the serving path's: worker frame, decode, log
commit, stop-string scan, dialect chunk, SSE, hypercorn. For each (streams N,
``--max-batch`` B) a load generator in its own process (raw non-blocking sockets on
epoll, HTTP/1.1 keep-alive, chunked bodies parsed by hand: no client library in the
way) runs N connections, each streaming ``--requests-per-stream`` legacy completions
of M tokens (``ignore_eos``, the ``agent`` class) back to back. Midway it sends a few
interactive chat requests (``x-superfluid-qos: interactive``) and times their first token.

Reported per run: delivered tokens/s (wall, so noisy on a busy machine), the daemon's
CPU per token (``psutil`` user+system of the daemon process only, before/after: the
robust number), the worker's CPU per token, TTFT p50/p99 of the load, the largest gap
between two chunks of one stream, the interactive TTFT, and RSS.

``--memory-requests K``: one daemon, K requests of 16 tokens at 64 concurrent; prints
the daemon's RSS after every 1,000 and checks the last is within 10% of the level after
the first 1,000 (the memory contract of issue 24).

Prints markdown tables headed with the commit. ``--quick`` runs a tiny size in seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import select
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Server, commit, free_port, superfluid_argv  # noqa: E402

MOCK = "mock?step_ms=0&prefill_us=0"
PROMPT = "the daemon writes every token before a client sees it"
_USAGE = re.compile(rb'"completion_tokens":(\d+)')


# --- the load generator (runs in its own process) ------------------------------------------------------------

def _request(port: int, path: str, body: dict[str, Any], headers: dict[str, str]) -> bytes:
    data = json.dumps(body).encode()
    head = [f"POST {path} HTTP/1.1", f"host: 127.0.0.1:{port}", "content-type: application/json",
            f"content-length: {len(data)}", *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + data


class _Conn:
    """One keep-alive connection streaming requests back to back."""

    def __init__(self, sock: socket.socket, request: bytes, remaining: int, probe: bool = False) -> None:
        self.sock = sock
        self.request = request
        self.remaining = remaining
        self.probe = probe
        self.out = b""
        self.start_next()

    def start_next(self) -> None:
        self.remaining -= 1
        self.out = self.request
        self.buf = bytearray()
        self.headers_done = False
        self.chunk_left = -1     # bytes left of the current chunk's data (-1: a size line is next)
        self.sse = bytearray()
        self.t0 = time.perf_counter()
        self.first: float | None = None
        self.last = 0.0
        self.max_gap = 0.0
        self.tokens = 0
        self.chunks = 0
        self.error: str | None = None

    def feed(self, data: bytes, now: float) -> bool:
        """Returns True when the response ended (``data: [DONE]``)."""
        self.buf += data
        if not self.headers_done:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return False
            head = bytes(self.buf[:end])
            del self.buf[: end + 4]
            self.headers_done = True
            if not head.startswith(b"HTTP/1.1 200"):
                self.error = head.split(b"\r\n", 1)[0].decode()
        done = False
        while self.buf:
            if self.chunk_left < 0:
                nl = self.buf.find(b"\r\n")
                if nl < 0:
                    break
                size = int(bytes(self.buf[:nl]).split(b";")[0], 16)
                del self.buf[: nl + 2]
                self.chunk_left = size + 2 if size else 2   # data plus its CRLF
                if size == 0:
                    done = True
                continue
            take = min(self.chunk_left, len(self.buf))
            self.sse += self.buf[:take]
            del self.buf[:take]
            self.chunk_left -= take
            if self.chunk_left == 0:
                self.chunk_left = -1
                del self.sse[-2:]
                self._events(now)
        if self.error is not None and done:
            return True
        return done and self.headers_done

    def _events(self, now: float) -> None:
        while True:
            end = self.sse.find(b"\n\n")
            if end < 0:
                return
            event = bytes(self.sse[:end])
            del self.sse[: end + 2]
            if event == b"data: [DONE]":
                continue
            if b'"error"' in event:
                self.error = event[:200].decode("utf-8", "replace")
                continue
            m = _USAGE.search(event)
            if m and b'"choices":[]' in event:
                self.tokens = int(m.group(1))
                continue
            if b'"text":""' in event or b'"content":""' in event or b'"delta":{}' in event:
                if not (self.probe and m):
                    continue
            self.chunks += 1
            if self.first is None:
                self.first = now
            elif now - self.last > self.max_gap:
                self.max_gap = now - self.last
            self.last = now
            if m and self.probe:
                self.tokens = int(m.group(1))


def loadgen(port: int, streams: int, per_stream: int, tokens: int, probes: int) -> dict[str, Any]:
    """Run the load; returns raw measurements (one process, one thread, epoll)."""
    body = {"model": "mock", "prompt": PROMPT, "max_tokens": tokens, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    request = _request(port, "/v1/completions", body, {"x-superfluid-qos": "agent"})
    probe_body = {"model": "mock", "messages": [{"role": "user", "content": "hello, are you there?"}],
                  "max_tokens": 8, "stream": True, "stream_options": {"include_usage": True}}
    probe_request = _request(port, "/v1/chat/completions", probe_body, {"x-superfluid-qos": "interactive"})
    ep = select.epoll()
    conns: dict[int, _Conn] = {}

    def open_conn(req: bytes, n: int, probe: bool = False) -> None:
        s = socket.create_connection(("127.0.0.1", port))
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.setblocking(False)
        c = _Conn(s, req, n, probe)
        conns[s.fileno()] = c
        ep.register(s.fileno(), select.EPOLLIN | select.EPOLLOUT)

    for _ in range(streams):
        open_conn(request, per_stream)
    total = streams * per_stream
    results: list[tuple[float, float, float, int, str | None, int]] = []  # ttft, wall, max_gap, tokens, error, chunks
    probe_results: list[tuple[float, str | None]] = []
    probe_at = [int(total * (i + 1) / (probes + 1)) for i in range(probes)]
    t_start = time.perf_counter()
    while conns:
        for fd, ev in ep.poll(1.0):
            c = conns.get(fd)
            if c is None:
                continue
            now = time.perf_counter()
            if ev & select.EPOLLOUT and c.out:
                sent = c.sock.send(c.out)
                c.out = c.out[sent:]
                if not c.out:
                    ep.modify(fd, select.EPOLLIN)
            if ev & (select.EPOLLIN | select.EPOLLHUP | select.EPOLLERR):
                try:
                    data = c.sock.recv(1 << 16)
                except BlockingIOError:
                    continue
                ended = not data or c.feed(data, now)
                if not data and c.error is None:
                    c.error = "connection closed"
                if not ended:
                    continue
                ttft = (c.first - c.t0) if c.first else float("nan")
                if c.probe:
                    probe_results.append((ttft, c.error))
                else:
                    results.append((ttft, now - c.t0, c.max_gap, c.tokens, c.error, c.chunks))
                    if probe_at and len(results) >= probe_at[0]:
                        probe_at.pop(0)
                        open_conn(probe_request, 1, probe=True)
                if c.remaining > 0 and data:
                    c.start_next()
                    ep.modify(fd, select.EPOLLIN | select.EPOLLOUT)
                else:
                    ep.unregister(fd)
                    c.sock.close()
                    del conns[fd]
    wall = time.perf_counter() - t_start
    return {"wall": wall, "results": results, "probes": probe_results}


# --- the driver ----------------------------------------------------------------------------------------------

def _pct(xs: list[float], p: float) -> float:
    s = sorted(x for x in xs if x == x)
    if not s:
        return float("nan")
    return s[min(len(s) - 1, int(round(p / 100 * (len(s) - 1))))]


def _cpu(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system


def _worker(proc: psutil.Process) -> psutil.Process | None:
    kids = [k for k in proc.children(recursive=True) if any("superfluid-worker" in a for a in k.cmdline())]
    return kids[0] if kids else None


def _run_loadgen(port: int, streams: int, per_stream: int, tokens: int, probes: int, pin: bool) -> dict[str, Any]:
    argv = [sys.executable, __file__, "--_loadgen", json.dumps([port, streams, per_stream, tokens, probes])]
    env = dict(os.environ)
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, env=env)
    if pin and len(os.sched_getaffinity(0)) > 1:
        try:
            os.sched_setaffinity(proc.pid, {max(os.sched_getaffinity(0))})
        except OSError:
            pass
    out, _ = proc.communicate()
    if proc.returncode:
        raise RuntimeError(f"the load generator failed (exit {proc.returncode})")
    return json.loads(out)


def start_daemon(max_batch: int, streams: int, extra: list[str]) -> Server:
    port = free_port()
    argv = superfluid_argv(MOCK, port, "--runtime", "mock", "--max-batch", str(max_batch),
                           "--max-queue", str(max(256, streams * 2)), *extra)
    server = Server(f"overhead-{max_batch}", argv, port)
    server.wait_ready(120)
    return server


def run_one(streams: int, max_batch: int, tokens: int, per_stream: int, probes: int, pin: bool,
            extra: list[str]) -> dict[str, Any]:
    server = start_daemon(max_batch, streams, extra)
    try:
        daemon = psutil.Process(server.proc.pid)
        # warm up: the worker is spawned on demand, code paths get their first call
        _run_loadgen(server.port, min(streams, 8), 1, 8, 0, pin)
        worker = _worker(daemon)
        rss0 = daemon.memory_info().rss
        c0 = _cpu(daemon)
        w0 = _cpu(worker) if worker else 0.0
        out = _run_loadgen(server.port, streams, per_stream, tokens, probes, pin)
        c1 = _cpu(daemon)
        w1 = _cpu(worker) if worker else 0.0
        rss1 = daemon.memory_info().rss
    finally:
        server.stop()
    res = out["results"]
    errors = [r[4] for r in res if r[4]] + [p[1] for p in out["probes"] if p[1]]
    delivered = sum(r[3] for r in res)
    return {
        "streams": streams, "max_batch": max_batch, "tokens": tokens, "requests": len(res),
        "delivered": delivered, "wall": out["wall"], "tok_s": delivered / out["wall"] if out["wall"] else 0.0,
        "cpu_us_tok": (c1 - c0) / delivered * 1e6 if delivered else float("nan"),
        "worker_us_tok": (w1 - w0) / delivered * 1e6 if delivered else float("nan"),
        "daemon_cores": (c1 - c0) / out["wall"] if out["wall"] else 0.0,
        "ttft_p50": _pct([r[0] for r in res], 50), "ttft_p99": _pct([r[0] for r in res], 99),
        "max_gap": max((r[2] for r in res), default=0.0),
        "tok_chunk": delivered / max(1, sum(r[5] for r in res)),
        "probe_ttft": [p[0] for p in out["probes"]],
        "rss0": rss0, "rss1": rss1, "errors": errors,
    }


def table(rows: list[dict[str, Any]]) -> str:
    head = ("| streams | --max-batch | tokens/req | requests | delivered tok/s (wall, busy machine) | "
            "daemon CPU µs/token | worker CPU µs/token | daemon cores | tokens/chunk | TTFT p50 | TTFT p99 | max chunk gap | "
            "interactive TTFT (max) | RSS before → after | errors |")
    lines = [head, "|" + "---|" * 15]
    for r in rows:
        probe = max(r["probe_ttft"]) if r["probe_ttft"] else float("nan")
        lines.append(
            f"| {r['streams']} | {r['max_batch']} | {r['tokens']} | {r['requests']} | {r['tok_s']:,.0f} | "
            f"{r['cpu_us_tok']:.1f} | {r['worker_us_tok']:.1f} | {r['daemon_cores']:.2f} | {r['tok_chunk']:.1f} | "
            f"{r['ttft_p50'] * 1000:.0f} ms | {r['ttft_p99'] * 1000:.0f} ms | {r['max_gap'] * 1000:.0f} ms | "
            f"{probe * 1000:.0f} ms | {r['rss0'] / 2**20:.0f} → {r['rss1'] / 2**20:.0f} MiB | {len(r['errors'])} |")
    return "\n".join(lines)


def memory(total: int, streams: int, tokens: int, pin: bool, extra: list[str]) -> int:
    server = start_daemon(streams, streams, extra)
    try:
        daemon = psutil.Process(server.proc.pid)
        step = 1000
        per = -(-step // streams)  # at least 1,000 a step: the first sample is the level after 1,000
        samples: list[tuple[int, float]] = []
        done = 0
        print(f"\nMemory: {total:,} requests of {tokens} tokens at {streams} concurrent, commit {commit()}\n")
        print("| requests | daemon RSS (MiB) |\n|---|---|")
        while done < total:
            out = _run_loadgen(server.port, streams, per, tokens, 0, pin)
            bad = [r[4] for r in out["results"] if r[4]]
            if bad:
                print(f"errors: {bad[:3]}", file=sys.stderr)
            done += len(out["results"])
            rss = daemon.memory_info().rss / 2**20
            samples.append((done, rss))
            print(f"| {done:,} | {rss:.1f} |", flush=True)
    finally:
        server.stop()
    base = samples[0][1]
    last = samples[-1][1]
    ok = last <= base * 1.10
    print(f"\nRSS after {samples[0][0]:,}: {base:.1f} MiB; after {samples[-1][0]:,}: {last:.1f} MiB "
          f"({(last / base - 1) * 100:+.1f}%): {'within' if ok else 'OVER'} 10%")
    return 0 if ok else 1


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--_loadgen":
        port, streams, per_stream, tokens, probes = json.loads(sys.argv[2])
        print(json.dumps(loadgen(port, streams, per_stream, tokens, probes)))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", default="64,256,1024", help="concurrent streams, comma-separated")
    ap.add_argument("--max-batch", default="", help="lanes, comma-separated (default: = streams, and 64)")
    ap.add_argument("--tokens", type=int, default=64, help="tokens per request (ignore_eos)")
    ap.add_argument("--requests-per-stream", type=int, default=4)
    ap.add_argument("--probes", type=int, default=3, help="interactive requests sent during each run")
    ap.add_argument("--no-pin", action="store_true", help="do not pin the load generator to the last core")
    ap.add_argument("--quick", action="store_true", help="a tiny size: 16 streams x 16 tokens")
    ap.add_argument("--memory-requests", type=int, default=0, help="memory mode: K requests, RSS per 1,000")
    ap.add_argument("--daemon-arg", action="append", default=[], help="extra argument for superfluid serve")
    args = ap.parse_args()
    pin = not args.no_pin
    if args.memory_requests:
        return memory(args.memory_requests, 64, 16, pin, args.daemon_arg)
    if args.quick:
        plan = [(16, 16), (16, 4)]
        tokens, per_stream = 16, 2
    else:
        streams = [int(s) for s in args.streams.split(",")]
        batches = [int(b) for b in args.max_batch.split(",")] if args.max_batch else []
        plan = []
        for n in streams:
            for b in (batches or sorted({n, min(n, 64)}, reverse=True)):
                plan.append((n, b))
        tokens, per_stream = args.tokens, args.requests_per_stream
    rows = []
    for n, b in plan:
        row = run_one(n, b, tokens, per_stream, args.probes, pin, args.daemon_arg)
        rows.append(row)
        print(f"streams {n} max-batch {b}: {row['tok_s']:,.0f} tok/s, {row['cpu_us_tok']:.1f} µs/token "
              f"({len(row['errors'])} errors{': ' + str(row['errors'][:2]) if row['errors'] else ''})",
              file=sys.stderr, flush=True)
    print(f"\nDaemon overhead, mock runtime at zero cost ({MOCK}), commit {commit()}, "
          f"load {os.getloadavg()[0]:.1f}\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
