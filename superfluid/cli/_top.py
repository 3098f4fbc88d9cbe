"""``superfluid top HOST:PORT [...]``: one row per daemon, from its ``/metrics``.

Every interval (1 s) each server's ``/metrics`` is fetched (all at once, each in
a thread with a deadline under the interval) and parsed with
``prometheus_client.parser``; a row shows its state (``up``, ``401`` when it
wants a key we lack or do not have right, ``down``), its lanes busy/total,
queue depth, KV use and decode/prefill tokens a second (from the counters'
change since the last poll), and under the table a sparkline of the fleet's
decode rate. ``q`` or Esc quits; ``--once`` prints one table (two polls apart,
for the rates) and exits.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time
import urllib.error
import urllib.request
from typing import Any

import attrs
import trio
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from .._printable import printable
from .._term import QUIT_KEYS, Screen, cbreak, read_keys, sparkline
from ._flags import positive_float

__all__ = ["add_top_parser", "poll", "render", "top_main"]

DEFAULT_HTTP = "127.0.0.1:8453"
HISTORY = 120
MAX_BODY = 4 << 20  # bytes of /metrics read at most


def default_server() -> str:
    return os.environ.get("SUPERFLUID_HTTP") or DEFAULT_HTTP


def add_top_parser(sub: Any) -> None:
    t = sub.add_parser("top", help="watch daemons' /metrics live: a row per server (q or Esc quits)",
                       description="Poll each server's /metrics once a second: state (up, 401, down), lanes "
                                   "busy/total, queue depth, KV use, tokens a second, and a throughput sparkline.")
    t.add_argument("servers", nargs="*", metavar="HOST:PORT",
                   help=f"servers to watch (default: $SUPERFLUID_HTTP, else {DEFAULT_HTTP})")
    t.add_argument("--api-key", metavar="KEY",
                   help="sent as a Bearer token to every server (default: $SUPERFLUID_API_KEY, else none)")
    t.add_argument("--once", action="store_true", help="print one table (two polls an interval apart) and exit")
    t.add_argument("--interval", type=positive_float, default=1.0, metavar="SEC", help="seconds between polls (default 1)")
    t.set_defaults(run=top_main)


@attrs.define
class Node:
    """One server as ``top`` last saw it."""

    address: str
    state: str = "…"
    detail: str = ""
    models: int = 0
    lanes: float = 0.0
    lanes_total: float = 0.0
    queue: float = 0.0
    kv_used: float = 0.0
    kv_total: float = 0.0
    decode: float | None = None
    prefill: float | None = None
    _last: tuple[float, float, float] | None = None   # (when, decode counter, prefill counter)
    history: collections.deque[float] = attrs.field(factory=lambda: collections.deque(maxlen=HISTORY))
    fleet: dict[tuple[str, str], dict[str, float]] = attrs.field(factory=dict)   # a head's nodes, by (model, node)

    @property
    def url(self) -> str:
        return f"http://{self.address}/metrics" if "://" not in self.address else f"{self.address}/metrics"


def _fetch(url: str, key: str | None, timeout: float) -> tuple[int | None, str]:
    """(status, body) of a GET; status None when nothing answered (the reason as body)."""
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310 - http only, user-given
            return response.status, response.read(MAX_BODY).decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        return exc.code, ""
    except (OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        return None, str(getattr(reason, "strerror", None) or reason)


def _totals(text: str) -> dict[str, Any]:
    totals: dict[str, Any] = collections.defaultdict(float)
    models = set()
    fleet: dict[tuple[str, str], dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if "model" in sample.labels:
                models.add(sample.labels["model"])
            totals[sample.name] += sample.value
            if sample.name.startswith(FLEET_PREFIX) and "node" in sample.labels:
                key = (sample.labels.get("model", ""), sample.labels["node"])
                fleet.setdefault(key, {})[sample.name[len(FLEET_PREFIX):]] = sample.value
    totals["models"] = len(models)
    totals["fleet"] = fleet
    return totals


def apply(node: Node, status: int | None, body: str, now: float) -> None:
    """Update ``node`` from one poll's answer."""
    if status is None:
        node.state, node.detail, node.decode, node.prefill, node._last = "down", body, None, None, None
        return
    if status in (401, 403):
        node.state, node.detail, node.decode, node.prefill, node._last = "401", "needs --api-key", None, None, None
        return
    if status != 200:
        node.state, node.detail = f"http {status}", ""
        return
    try:
        t = _totals(body)
    except ValueError as exc:
        node.state, node.detail = "bad", f"unreadable /metrics: {exc}"
        return
    node.state, node.detail = "up", ""
    node.models = t["models"]
    node.fleet = t["fleet"]
    node.lanes, node.lanes_total = t["superfluid_lanes_active"], t["superfluid_lanes_total"]
    node.queue = t["superfluid_queue_depth"]
    node.kv_used, node.kv_total = t["superfluid_kv_used_tokens"], t["superfluid_kv_total_tokens"]
    decode, prefill = t["superfluid_decode_tokens_total"], t["superfluid_prefill_tokens_total"]
    if node._last is not None and now > node._last[0]:
        dt = now - node._last[0]
        node.decode = max(0.0, decode - node._last[1]) / dt
        node.prefill = max(0.0, prefill - node._last[2]) / dt
        node.history.append(node.decode)
    node._last = (now, decode, prefill)


async def poll(nodes: list[Node], key: str | None, fetch_s: float) -> None:
    """Fetch every node's /metrics at once and update the nodes."""
    answers: dict[int, tuple[int | None, str]] = {}

    async def one(i: int, node: Node) -> None:
        answers[i] = await trio.to_thread.run_sync(_fetch, node.url, key, fetch_s, abandon_on_cancel=True)

    async with trio.open_nursery() as nursery:
        for i, node in enumerate(nodes):
            nursery.start_soon(one, i, node)
    now = time.monotonic()
    for i, node in enumerate(nodes):
        apply(node, *answers[i], now)


FLEET_PREFIX = "superfluid_fleet_node_"


def _n(v: float) -> str:
    return f"{v / 1000:.1f}k" if v >= 10_000 else f"{v:.0f}"


def render(nodes: list[Node], fleet: collections.deque[float], width: int = 120) -> RenderableType:
    table = Table(header_style="bold", box=None, padding=(0, 1))
    for column, justify in (("server", "left"), ("state", "left"), ("models", "right"), ("lanes", "right"),
                            ("queue", "right"), ("KV", "right"), ("decode/s", "right"), ("prefill/s", "right")):
        table.add_column(column, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    table.add_column("", overflow="ellipsis", no_wrap=True, max_width=max(6, width - 90))  # squeezed first
    styles = {"up": "green", "401": "yellow", "down": "red"}
    for node in nodes:
        state = Text(node.state, style=styles.get(node.state, "magenta"))
        if node.state != "up":
            detail = printable(node.detail)[:50]  # an error may quote what the server sent
            table.add_row(printable(node.address), state, "", "", "", "", "", "", Text(detail, style="dim"))
            continue
        kv = f"{_n(node.kv_used)}/{_n(node.kv_total)}" + (f" {node.kv_used / node.kv_total:.0%}" if node.kv_total
                                                           else "")
        table.add_row(printable(node.address), state, str(node.models), f"{node.lanes:.0f}/{node.lanes_total:.0f}",
                      f"{node.queue:.0f}", kv, "–" if node.decode is None else f"{node.decode:.1f}",
                      "–" if node.prefill is None else f"{node.prefill:.0f}",
                      Text(sparkline(node.history, max(6, min(30, width - 90))), style="green"))
        for (model, ident), v in sorted(node.fleet.items()):   # a head: a row per node of its fleet
            up = v.get("up", 0.0) >= 1
            total = v.get("kv_total_tokens", 0.0)
            kv = f"{_n(v.get('kv_used_tokens', 0.0))}/{_n(total)}"
            table.add_row(Text(f"  └ {printable(model)}@{printable(ident)}", style="dim"),
                          Text("up" if up else "down", style="green" if up else "red"), "",
                          f"{v.get('lanes_active', 0.0):.0f}/{v.get('lanes_total', 0.0):.0f}",
                          f"{v.get('queue_depth', 0.0):.0f}", kv, "", "", "")
    up = sum(1 for n in nodes if n.state == "up")
    total = fleet[-1] if fleet else 0.0
    spark_w = max(10, min(HISTORY, width - 40))
    footer = Text.assemble((f"{up}/{len(nodes)} up", "bold"), f"   fleet decode {total:.1f} tok/s  ",
                           (sparkline(fleet, spark_w), "green"))
    return Group(table, Text(""), footer)


def _fleet_rate(nodes: list[Node]) -> float | None:
    rates = [n.decode for n in nodes if n.decode is not None]
    return sum(rates) if rates else None


async def _run(args: argparse.Namespace, nodes: list[Node], key: str | None) -> int:
    fleet: collections.deque[float] = collections.deque(maxlen=HISTORY)
    fetch_s = max(0.2, min(args.interval * 0.8, 5.0))

    async def tick() -> None:
        await poll(nodes, key, fetch_s)
        rate = _fleet_rate(nodes)
        if rate is not None:
            fleet.append(rate)

    if args.once:
        await tick()
        if any(n.state == "up" for n in nodes):
            await trio.sleep(args.interval)
            await tick()
        console = Console(width=None if sys.stdout.isatty() else 140)
        console.print(render(nodes, fleet, console.width))
        return 0 if any(n.state == "up" for n in nodes) else 1
    if not sys.stdout.isatty():  # a pipe: a table per interval, as vmstat does
        console = Console(width=140)
        while True:
            await tick()
            console.print(render(nodes, fleet, 140))
            await trio.sleep(args.interval)
    with cbreak() as fd, Screen() as screen:
        async with trio.open_nursery() as nursery:
            async def keys() -> None:
                await read_keys(fd, lambda k: k in QUIT_KEYS)
                nursery.cancel_scope.cancel()

            nursery.start_soon(keys)
            while True:
                await tick()
                header = Text.assemble(("superfluid top", "bold"), f"  every {args.interval:g}s",
                                       ("   q/Esc quits", "dim"))
                screen.show(Group(header, Text(""), render(nodes, fleet, screen.size[0])))
                await trio.sleep(args.interval)
    return 0


def top_main(args: argparse.Namespace) -> int:
    if args.interval <= 0:
        print("superfluid: top: --interval must be positive", file=sys.stderr)
        return 2
    key = args.api_key if args.api_key is not None else os.environ.get("SUPERFLUID_API_KEY") or None
    nodes = [Node(address=a) for a in (args.servers or [default_server()])]
    try:
        return trio.run(_run, args, nodes, key)
    except KeyboardInterrupt:
        return 0
