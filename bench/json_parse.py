"""What one JSON request body costs to parse: time, peak memory, and the event loop's stall (#41, red-team F2).

Usage::

    python bench/json_parse.py [--parsers-only] [--daemon-only] [--cases A,B] [--extra-path DIR]

Part 1, parsers: each (body, parser) runs in a fresh child process. Reported: the parse's
wall time, the growth of peak RSS over the RSS before it (``/proc/self/clear_refs`` resets
the high-water mark), and the longest time a ticking thread waited for the GIL meanwhile
(what a trio loop would stall if the parse ran in a worker thread). Parsers: the stdlib
``json`` as ``decode_json`` called it before #41 (hooks, then the number regex over the
raw bytes), ``orjson`` and ``msgspec`` when importable (``--extra-path`` adds a directory
holding them to the children's ``sys.path``: orjson is not a dependency), and ``decode_json``
as it is now, with msgspec and without (the stdlib fallback), and as it was before long
strings were decoded in pieces (one parse of the whole body). Bodies: 100 MB of
``[{},{},...]`` in an ignored field (red-team F2), a 50 MB and a 100 MB string (one
literal: the GIL wait is what piecewise decoding bounds), 100 MB of one string of
escapes, multi-byte UTF-8 and surrogate pairs (``mixed100``), and a realistic chat body
(60 turns with tool calls and a tool schema, ~100 KB).

Part 2, daemon: ``superfluid serve`` on the mock runtime (its own process); 8 streams
run while one big body is posted to ``/v1/chat/completions``; reported: the answer, its
time, the daemon's peak-RSS growth during it (its ``VmHWM`` reset first) and the longest
gap between two chunks of any of the 8 streams, against the same 8 streams with no body.
Also, measured inside the daemon (by the launcher the bench runs it through), where the
streams' gaps also hold this client's delays and those of a loaded machine: the longest a
thread of the daemon's own waited to wake meanwhile (the GIL held by one call, or the CPUs
taken by others) and the longest single task step of its event loop (and the task's
name). The big body is posted from another process, niced (this one's loop times the
streams). Three times: with msgspec, without it (a directory first on the daemon's
``PYTHONPATH`` holds a ``msgspec`` that fails to import), and with msgspec but each body
parsed whole, as before long strings were decoded in pieces. ``content100`` is the 100 MB string as a message's content (the others put it
in the ignored ``user`` field).

Prints plain tables headed with the commit.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

MB = 1 << 20
ROOT = Path(__file__).resolve().parent.parent


# --- bodies ---------------------------------------------------------------------------------------------------

def body(case: str) -> bytes:
    head = b'{"model":"mock","max_tokens":1,"messages":[{"role":"user","content":"x"}],'
    if case == "dicts100":
        return head + b'"zzz":[' + b"{}," * ((100 * MB - 200) // 3) + b"0]}"  # just under the 100 MiB limit
    if case == "str50":
        return head + b'"user":"' + b"a" * (50 * MB) + b'"}'
    if case == "str100":
        return head + b'"user":"' + b"a" * (100 * MB - 200) + b'"}'
    if case == "content100":
        return b'{"model":"mock","max_tokens":1,"messages":[{"role":"user","content":"' + b"a" * (100 * MB - 200) + b'"}]}'
    if case == "mixed100":
        unit = '\\n \\"é中\U0001f600 \\ud83d\\ude00 \\u00e9 text, '.encode()
        return head + b'"user":"' + unit * ((100 * MB - 200) // len(unit)) + b'"}'
    if case == "chat":
        tool = {"type": "function", "function": {"name": "search", "description": "web search " * 20, "parameters": {
            "type": "object", "properties": {f"p{i}": {"type": "string", "description": "a field " * 8}
                                             for i in range(12)}, "required": ["p0"]}}}
        turns: list[dict[str, Any]] = []
        for i in range(20):
            turns += [{"role": "user", "content": f"question {i}: " + "lorem ipsum, dolor sit amet " * 40},
                      {"role": "assistant", "content": None, "tool_calls": [{"id": f"c{i}", "type": "function", "function": {
                          "name": "search", "arguments": json.dumps({"p0": "x" * 200, "p1": [1, 2, 3]})}}]},
                      {"role": "tool", "tool_call_id": f"c{i}", "content": json.dumps({"hits": [{"t": "é" * 40}] * 8})}]
        tools = [{**tool, "function": {**tool["function"], "name": f"search{i}"}} for i in range(8)]
        return json.dumps({"model": "mock", "messages": turns, "tools": tools, "temperature": 0.7,
                           "max_tokens": 64, "stop": ["\n\n"], "logit_bias": {str(i): 1 for i in range(64)}}).encode()
    raise SystemExit(f"no body {case!r}")


# --- part 1: one parse in a fresh child -----------------------------------------------------------------------

def _status(pid: int | str, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _reset_peak(pid: int | str) -> None:
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM := VmRSS
    except OSError:
        pass


def child(case: str, parser: str) -> None:
    raw = body(case)
    if parser == "json (before #41)":
        from superfluid.api import _http

        maybe_number = re.compile(rb"\d{300}|[eE][+-]?\d{3}|NaN|Infinity")

        def parse() -> Any:
            obj = json.loads(raw, parse_int=_http._parse_int, parse_float=_http._parse_float,
                             parse_constant=_http._Unrepresentable)
            maybe_number.search(raw)
            return obj
    elif parser == "orjson":
        import orjson

        def parse() -> Any:
            return orjson.loads(raw)
    elif parser == "msgspec":
        import msgspec

        def parse() -> Any:
            return msgspec.json.decode(raw)
    else:
        from superfluid.api import _http
        from superfluid.api._http import ApiError, decode_json

        if parser == "decode_json (no msgspec)":
            _http.msgspec = None
        elif parser == "decode_json (whole, before pieces)":
            _http.LONG_STRING = 1 << 62

        def parse() -> Any:
            try:
                return decode_json(raw)
            except ApiError as exc:
                return f"{exc.status} {exc.code}"

    gaps = [0.0]
    done = threading.Event()

    def tick() -> None:
        last = time.perf_counter()
        while not done.is_set():
            time.sleep(0.0005)
            now = time.perf_counter()
            gaps[0] = max(gaps[0], now - last)
            last = now

    ticker = threading.Thread(target=tick, daemon=True)
    ticker.start()
    time.sleep(0.05)
    _reset_peak("self")
    rss0 = _status("self", "VmRSS")
    gaps[0] = 0.0
    t0 = time.perf_counter()
    out = parse()
    dt = time.perf_counter() - t0
    peak = _status("self", "VmHWM")
    done.set()
    ticker.join()
    result = out if isinstance(out, str) else "parsed"
    print(json.dumps({"ms": dt * 1e3, "growth": (peak - rss0) / MB, "gil_ms": gaps[0] * 1e3, "result": result,
                      "size": len(raw) / MB}))


def parsers_table(extra: str | None) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), extra) if p)}
    parsers = ["json (before #41)", "orjson", "msgspec", "decode_json (whole, before pieces)", "decode_json (now)",
               "decode_json (no msgspec)"]
    print("| body | MB | parser | ms | peak RSS growth MB | x body | longest GIL wait ms | result |")
    print("|---|---|---|---|---|---|---|---|")
    for case in ("dicts100", "str50", "str100", "mixed100", "chat"):
        for parser in parsers:
            if case in ("str100", "mixed100") and parser in ("json (before #41)", "orjson"):
                continue
            run = subprocess.run([sys.executable, __file__, "--child", case, parser], env=env,
                                 capture_output=True, text=True, check=False)
            if run.returncode != 0:
                last = (run.stderr.strip().splitlines() or ["?"])[-1]
                print(f"| {case} | | {parser} | n/a: {last[:60]} | | | | |")
                continue
            r = json.loads(run.stdout.strip().splitlines()[-1])
            print(f"| {case} | {r['size']:.2f} | {parser} | {r['ms']:.1f} | {r['growth']:.1f} | "
                  f"{r['growth'] / r['size']:.1f} | {r['gil_ms']:.1f} | {r['result']} |", flush=True)


# --- part 2: a daemon, 8 streams and one big body ---------------------------------------------------------------

_TICKING = """
import os, runpy, sys, threading, time

import trio

LOG = open(os.environ["JSON_PARSE_TICKS"], "a", buffering=1)


def tick():  # a thread of the daemon's own: how late it wakes is how long the GIL (or the CPU) was away
    last = time.monotonic()
    while True:
        time.sleep(0.001)
        now = time.monotonic()
        if now - last > 0.005:
            LOG.write(f"{now:.4f} {(now - last) * 1e3:.1f} tick\\n")
        last = now


class Steps(trio.abc.Instrument):  # how long one task step holds the event loop
    def before_task_step(self, task):
        self.t0 = time.monotonic()

    def after_task_step(self, task):
        now = time.monotonic()
        if now - self.t0 > 0.005:
            LOG.write(f"{now:.4f} {(now - self.t0) * 1e3:.1f} step {task.name}\\n")


threading.Thread(target=tick, daemon=True).start()
real_run = trio.run
trio.run = lambda *a, **k: real_run(*a, **{**k, "instruments": [*k.get("instruments", ()), Steps()]})
if os.environ.get("JSON_PARSE_WHOLE"):  # as before long strings were decoded in pieces: one parse of the body
    import superfluid.api._http
    superfluid.api._http.LONG_STRING = 1 << 62
sys.argv = ["superfluid", *sys.argv[1:]]
runpy.run_module("superfluid", run_name="__main__")
"""


def late_ms(path: str, kind: str, t0: float, t1: float) -> str:
    """The longest ``kind`` (``tick``: a daemon thread's wait to wake; ``step``: one task step
    of its event loop, and the task) that began after monotonic ``t0`` and ended by ``t1``."""
    worst, what = 0.0, ""
    for line in Path(path).read_text().splitlines():
        at, ms, k, *task = line.split()
        if k == kind and t0 <= float(at) - float(ms) / 1e3 and float(at) <= t1 and float(ms) > worst:
            worst, what = float(ms), " ".join(task)
    return f"{worst:.0f}" + (f" ({what.rsplit('.', 1)[-1]})" if what else "")


_POST = """
import json, sys, httpx
with open(sys.argv[2], "rb") as f:
    body = f.read()
r = httpx.post(sys.argv[1], content=body, headers={"content-type": "application/json"}, timeout=300)
print(json.dumps([r.status_code, r.json()]))
"""


async def streams_gap(url: str, n: int, seconds: float, big: bytes | None) -> dict[str, Any]:
    import httpx
    import trio

    from superfluid.client import aiter_sse

    worst = [0.0]
    out: dict[str, Any] = {}
    stop = trio.Event()

    async def stream(c: httpx.AsyncClient) -> None:
        req = {"model": "mock", "messages": [{"role": "user", "content": "go"}], "max_tokens": 100000,
               "ignore_eos": True, "stream": True}
        async with c.stream("POST", "/v1/chat/completions", json=req) as r:
            last = None
            async for event in aiter_sse(r.aiter_bytes()):
                now = trio.current_time()
                if last is not None and event.data:
                    worst[0] = max(worst[0], now - last)
                last = now
                if stop.is_set():
                    return

    async def post(c: httpx.AsyncClient) -> None:
        """Post ``big`` from another process: sending 100 MB from this one would stall the
        loop that times the streams, and the gap measured would be ours, not the daemon's."""
        assert big is not None
        with tempfile.NamedTemporaryFile(prefix="json-parse-body-") as f:
            f.write(big)
            f.flush()
            await trio.sleep(1.0)  # the streams are flowing
            t0, m0 = trio.current_time(), time.monotonic()
            # (niced: on a small machine the poster's CPU is otherwise the streams' gap, not the daemon's)
            run = await trio.run_process(["nice", "-n", "19", sys.executable, "-c", _POST,
                                          url + "/v1/chat/completions", f.name], capture_stdout=True)
            out["s"] = trio.current_time() - t0
            out["during"] = (m0, time.monotonic())
        status, reply = json.loads(run.stdout)
        out["answer"] = f"{status} {(reply.get('error') or {}).get('code') or ''}".strip()

    async with httpx.AsyncClient(base_url=url, timeout=300) as c:
        async with trio.open_nursery() as nursery:
            for _ in range(n):
                nursery.start_soon(stream, c)
            await trio.sleep(0.5)
            worst[0] = 0.0  # the streams' start is not the gap
            if big is not None:
                await post(c)
                await trio.sleep(0.5)
            else:
                await trio.sleep(seconds)
            stop.set()
            nursery.cancel_scope.cancel()
    out["gap_ms"] = worst[0] * 1e3
    return out


def daemon_table(msgspec: bool, cases: list[str], whole: bool = False) -> None:
    import trio

    sys.path.insert(0, str(ROOT / "bench"))
    from _common import Server, free_port, superfluid_argv

    env = {}
    if not msgspec:  # a msgspec that fails to import, first on the daemon's path: the stdlib fallback
        blocker = tempfile.mkdtemp(prefix="no-msgspec-")
        Path(blocker, "msgspec.py").write_text('raise ImportError("blocked by bench/json_parse.py")\n')
        env["PYTHONPATH"] = os.pathsep.join(p for p in (blocker, os.environ.get("PYTHONPATH")) if p)
    ticks = tempfile.mktemp(prefix="json-parse-ticks-")
    if whole:
        env["JSON_PARSE_WHOLE"] = "1"
    env["JSON_PARSE_TICKS"] = ticks
    port = free_port()
    argv = superfluid_argv("mock?step_ms=10&prefill_us=5", port, "--runtime", "mock", "--max-batch", "16",
                           "--stream-interval-ms", "0", "--agent-stream-interval-ms", "0")
    assert argv[1:3] == ["-m", "superfluid"]
    server = Server("json-parse", [argv[0], "-c", _TICKING, *argv[3:]], port, env=env)
    try:
        server.wait_ready(120)
        pid = server.proc.pid
        print("| body | answer | s | daemon peak RSS growth MB | x body | longest gap between chunks, 8 streams ms "
              "| longest wait of a daemon thread ms | longest task step of its event loop ms |")
        print("|---|---|---|---|---|---|---|---|")
        m0 = time.monotonic()
        r = trio.run(streams_gap, server.url, 8, 3.0, None)
        during = (m0 + 0.5, time.monotonic())
        print(f"| none | | | | | {r['gap_ms']:.0f} | {late_ms(ticks, 'tick', *during)} | "
              f"{late_ms(ticks, 'step', *during)} |", flush=True)
        for case in cases:
            big = body(case)
            _reset_peak(pid)
            rss0 = _status(pid, "VmRSS")
            r = trio.run(streams_gap, server.url, 8, 0.0, big)
            growth = (_status(pid, "VmHWM") - rss0) / MB
            print(f"| {case} ({len(big) / MB:.1f} MB) | {r['answer']} | {r['s']:.2f} | {growth:.0f} | "
                  f"{growth / (len(big) / MB):.1f} | {r['gap_ms']:.0f} | {late_ms(ticks, 'tick', *r['during'])} | "
                  f"{late_ms(ticks, 'step', *r['during'])} |", flush=True)
            del big
        print(f"\ndaemon RSS at the end: {_status(pid, 'VmRSS') / MB:.0f} MB")
    finally:
        server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--child", nargs=2, metavar=("BODY", "PARSER"), help=argparse.SUPPRESS)
    ap.add_argument("--parsers-only", action="store_true")
    ap.add_argument("--daemon-only", action="store_true")
    ap.add_argument("--cases", default="dicts100,str50,str100,content100,mixed100,chat",
                    help="the daemon's bodies, comma-separated")
    ap.add_argument("--extra-path", help="a directory holding orjson and msgspec (pip install --target DIR ...)")
    args = ap.parse_args()
    if args.child:
        child(*args.child)
        return
    sys.path.insert(0, str(ROOT / "bench"))
    from _common import commit

    print(f"# bench/json_parse.py at {commit()}, {os.cpu_count()} CPUs, Python {sys.version.split()[0]}\n")
    if not args.daemon_only:
        parsers_table(args.extra_path)
        print()
    if not args.parsers_only:
        for msgspec, whole, title in ((True, False, "with msgspec"), (False, False, "without msgspec (the stdlib fallback)"),
                                      (True, True, "with msgspec, each body parsed whole (as before long strings "
                                                   "were decoded in pieces)")):
            print(f"## daemon {title}")
            daemon_table(msgspec, args.cases.split(","), whole)
            print()


if __name__ == "__main__":
    main()
