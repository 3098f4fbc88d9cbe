"""Seeded random scenarios over a fleet (SPEC.md §14): a head in this process, nodes as processes.

One head (``tests/test_fleet.py``'s ``head_config``, in-process, on a fixed fleet port and
sessions dir) and three nodes on the mock runtime (``mock?step_ms=10&prefill_us=5``): ``a``
dials the head directly, ``b`` and ``c`` through a recording, partitionable TCP ``Relay``
each. The setup is kept for the whole run; before each scenario the nodes it names (two or
three, always at least one relayed) are brought up and the others killed.

A scenario (drawn by :func:`draw` from its seed) starts 4-10 streams (one of twelve prompts,
``max_tokens`` 40-200, ``temperature 0``, ``ignore_eos``, ``stream_options.include_usage``,
some ``x-superfluid-resumable: true``) and, while they run, 1-3 events at random times:

- ``kill``: SIGKILL a node's process group (node and worker);
- ``partition``: a relayed node's relay holds every byte both ways for 0.5-4 s, then heals
  (beyond the head's 1.5 s lease the head re-places its jobs and the node fences its worker);
- ``restart``: a killed node comes back (a new process, the same identity);
- ``head``: the head is cancelled and started again on the same sessions dir and fleet port.
  A scenario with a head restart sends every stream resumable; a stream the restart cuts reads
  the rest from the new head with ``GET /v1/sessions/{sid}/stream`` and ``Last-Event-ID``.

A scenario whose events leave no node alive ends with a restart of one of them.

Invariants, per scenario:

- every stream ends either complete (``usage.completion_tokens == max_tokens`` and its text
  (head + resumed tail) equal to the reference: the same request on the undisturbed fleet,
  run once per distinct request before the scenario; a re-placed stream continues with
  exactly the same text, nothing repeated, nothing dropped) or with a typed error (an
  ``error`` event or status whose ``error`` has a ``code``; the text before it a prefix of
  the reference); a connection cut without a head restart is a violation;
- nothing hangs: each scenario runs under ``trio.fail_after`` (``SCENARIO_S``);
- afterwards every node's ``load`` in ``/v1/models`` -> ``fleet`` is back to 0 within
  ``QUIET_S`` seconds (no lane or queue left behind on any node's scheduler).

Budget: ``SUPERFLUID_FUZZ_FLEET_SCENARIOS`` scenarios when set; else 4 (seeds 9-12, the same
every run, so CI is reproducible; between them every kind of event; about 35 s on 2 cores), or
``SUPERFLUID_FUZZ_EXAMPLES // 50`` (at least 4; 100 for 5000, about 15 minutes) from a random
first seed when ``SUPERFLUID_FUZZ_EXAMPLES`` is set. Scenario ``k`` has seed
``SUPERFLUID_FUZZ_FLEET_SEED + k`` (the first seed is printed, and a failure names its own).
Scenarios share the fleet, which each starts from (its nodes up, the others killed, loads 0),
so a seed replays alone as it ran, up to timing::

    SUPERFLUID_FUZZ_FLEET_SEED=N SUPERFLUID_FUZZ_FLEET_SCENARIOS=1 pytest fuzz/test_fuzz_fleet.py
"""

from __future__ import annotations

import collections
import os
import random
import time
from pathlib import Path

import attrs
import httpx
import pytest
import trio

from superfluid.daemon._server import serve
from superfluid.proto import SseDecoder
from tests.test_fleet import MODEL, Node, Relay, chat, head_config
from tests.test_sessions import RESUMABLE

from ._daemon_model import _free_port

pytestmark = pytest.mark.fuzz

SPEC = "mock?step_ms=10&prefill_us=5"
IDENTITIES = ("a", "b", "c")
RELAYED = ("b", "c")
PROMPTS = 12
SCENARIO_S = 60.0       # a scenario longer than this is a hang
QUIET_S = 5.0           # loads back to 0 within this long after the scenario's streams ended
READY_S = 30.0          # nodes (re)started and up

_EXAMPLES = os.environ.get("SUPERFLUID_FUZZ_EXAMPLES")
SCENARIOS = int(os.environ.get("SUPERFLUID_FUZZ_FLEET_SCENARIOS")
                or (max(4, int(_EXAMPLES) // 50) if _EXAMPLES else 4))
# CI's seeds 9-12 hold every kind of event between them (kills, restarts, partitions, a head restart)
SEED = int(os.environ.get("SUPERFLUID_FUZZ_FLEET_SEED")
           or (random.randrange(1, 1_000_000) if _EXAMPLES else 9))


# ---- scenarios -----------------------------------------------------------------------------


@attrs.frozen
class Request:
    prompt: int
    max_tokens: int
    resumable: bool

    def body(self) -> dict:
        return {**chat(self.prompt, self.max_tokens), "stream_options": {"include_usage": True}}

    @property
    def key(self) -> tuple[int, int]:
        return self.prompt, self.max_tokens


@attrs.frozen
class Event:
    at: float           # seconds after the streams started
    kind: str           # kill | partition | restart | head
    node: str = ""
    hold: float = 0.0   # a partition's length

    def __str__(self) -> str:
        what = {"kill": f"kill {self.node}", "restart": f"restart {self.node}", "head": "restart the head",
                "partition": f"partition {self.node} for {self.hold:.2f}s"}[self.kind]
        return f"{self.at:.2f}s {what}"


@attrs.frozen
class Scenario:
    seed: int
    nodes: tuple[str, ...]
    requests: tuple[Request, ...]
    events: tuple[Event, ...]

    def __str__(self) -> str:
        reqs = ", ".join(f"p{r.prompt}/{r.max_tokens}{'/r' if r.resumable else ''}" for r in self.requests)
        return (f"seed {self.seed}: nodes {','.join(self.nodes)}; streams [{reqs}]; "
                f"events [{'; '.join(str(e) for e in self.events)}]")


def draw(seed: int) -> Scenario:
    """The scenario of ``seed``. Each event's kind is drawn among those that apply at its time
    (weights 3 kill, 3 partition, 3 restart, 2 head): a kill needs a node alive, a partition a
    relayed node alive and not partitioned, a restart a node this scenario killed, the head's
    restart (once a scenario) a node alive to resume the streams on."""
    rng = random.Random(seed)
    nodes = tuple(sorted(rng.sample(IDENTITIES, rng.choice((2, 3)))))   # two of three: one is relayed
    lengths = [rng.randint(40, 200) for _ in range(rng.randint(4, 10))]
    # events while the streams run: an undisturbed stream of n tokens takes about n x 10 ms
    latest = 0.1 + 0.009 * max(lengths)
    alive, killed = set(nodes), set[str]()
    healed_at: dict[str, float] = {}
    events: list[Event] = []
    head_done = False
    for at in sorted(round(rng.uniform(0.1, latest), 2) for _ in range(rng.randint(1, 3))):
        free = sorted(n for n in alive if n in RELAYED and healed_at.get(n, 0) <= at)
        kinds = ((["kill"] * 3 if alive else []) + (["partition"] * 3 if free else [])
                 + (["restart"] * 3 if killed else []) + (["head"] * 2 if alive and not head_done else []))
        kind = rng.choice(kinds)
        if kind == "kill":
            node = rng.choice(sorted(alive))
            alive.discard(node)
            killed.add(node)
            events.append(Event(at, "kill", node))
        elif kind == "partition":
            node = rng.choice(free)
            hold = round(rng.uniform(0.5, 4.0), 2)
            healed_at[node] = at + hold
            events.append(Event(at, "partition", node, hold))
        elif kind == "restart":
            node = rng.choice(sorted(killed))
            killed.discard(node)
            alive.add(node)
            events.append(Event(at, "restart", node))
        else:
            head_done = True
            events.append(Event(at, "head"))
    if not alive:   # streams must be able to finish: one node comes back
        events.append(Event(round(events[-1].at + 0.3, 2), "restart", rng.choice(sorted(killed))))
    requests = tuple(Request(prompt=rng.randrange(PROMPTS), max_tokens=n, resumable=head_done or rng.random() < 0.5)
                     for n in lengths)
    return Scenario(seed, nodes, requests, tuple(events))


# ---- the fleet under test ------------------------------------------------------------------


class Head:
    """The head, in-process, on a fixed fleet port and sessions dir: ``kill`` cancels it and
    waits for its end, ``start`` starts it again (its HTTP port is new: ``url``). ``epoch``
    counts kills: a stream cut while it moved on was cut by the head's end."""

    def __init__(self, nursery: trio.Nursery, port: int, sessions: Path) -> None:
        self.nursery, self.port, self.sessions = nursery, port, sessions
        self.url = ""
        self.epoch = 0
        self.up = trio.Event()
        self._scope = trio.CancelScope()
        self._done = trio.Event()

    async def start(self) -> None:
        scope, done = trio.CancelScope(), trio.Event()
        config = head_config(self.port, sessions=self.sessions)

        async def run(*, task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
            try:
                with scope:
                    await serve(config, handle_signals=False, task_status=task_status)
            finally:
                done.set()

        self._scope, self._done = scope, done
        binds = await self.nursery.start(run)
        self.url = binds[0]
        self.up.set()

    async def kill(self) -> None:
        self.epoch += 1
        self.up = trio.Event()
        self._scope.cancel()
        await self._done.wait()

    async def models(self) -> list[dict]:
        async with httpx.AsyncClient(base_url=self.url, timeout=10) as c:
            data = (await c.get("/v1/models")).json()["data"]
        return next((m.get("fleet", []) for m in data if m["id"] == MODEL), [])


class FleetNode:
    """One identity: its process (None while killed), its relay if relayed, its stderr's tail."""

    def __init__(self, identity: str, head_port: int, relay: Relay | None) -> None:
        self.identity, self.relay = identity, relay
        self.target = relay.port if relay is not None else head_port
        self.node: Node | None = None
        self.tail: collections.deque[str] = collections.deque(maxlen=40)

    @property
    def alive(self) -> bool:
        return self.node is not None

    def start(self) -> None:
        assert self.node is None
        self.node = Node("join", f"127.0.0.1:{self.target}", identity=self.identity, spec=SPEC)

    def kill(self) -> None:
        if self.node is not None:
            self.node.kill()
            self.tail.extend(self.node.stderr().splitlines()[-40:])
            self.node = None


class Fleet:
    def __init__(self, head: Head, nodes: dict[str, FleetNode]) -> None:
        self.head, self.nodes = head, nodes

    async def ready(self, want: tuple[str, ...]) -> None:
        """Exactly ``want`` up (the others killed), every partition healed, every load 0."""
        for ident, node in self.nodes.items():
            if node.relay is not None:
                node.relay.heal()
            if ident not in want:
                node.kill()
            elif not node.alive:
                node.start()
        with trio.fail_after(READY_S):
            while True:
                fleet = await self.head.models()
                up = {n["node"] for n in fleet if n["up"]}
                if up == set(want) and all(n["load"] == 0 for n in fleet):
                    return
                await trio.sleep(0.1)

    def tails(self) -> str:
        return "\n".join(f"--- node {i} stderr (last lines):\n" + "\n".join(
            [*n.tail, *(n.node.stderr().splitlines()[-40:] if n.node is not None else [])])
            for i, n in self.nodes.items())


# ---- one stream ---------------------------------------------------------------------------


@attrs.define
class Outcome:
    request: Request
    text: str = ""
    usage: dict | None = None
    error: dict | None = None       # the error object of an error event or status
    status: int | None = None
    done: bool = False              # [DONE] seen (of the last response read)
    cut: str = ""                   # a connection cut by something other than the head's restart
    resumes: int = 0
    sid: str | None = None
    stage: str = "posting"

    def describe(self) -> str:
        r = self.request
        return (f"p{r.prompt}/{r.max_tokens}{' resumable' if r.resumable else ''}: stage {self.stage}, "
                f"{len(self.text)} chars, usage {self.usage}, error {self.error}, status {self.status}, "
                f"done {self.done}, cut {self.cut!r}, resumes {self.resumes}, sid {self.sid}")


async def _read(response: httpx.Response, out: Outcome, last_id: list[str | None]) -> None:
    """Read SSE events into ``out`` as they come (what was read stays there if the read is cut)."""
    decoder = SseDecoder()
    async for chunk in response.aiter_bytes():
        for event in decoder.feed(chunk):
            if event.id is not None:
                last_id[0] = event.id
            if not event.data:
                continue
            if event.data == "[DONE]":
                out.done = True
                continue
            payload = event.json()
            if "error" in payload:
                out.error = payload["error"]
            if payload.get("usage"):
                out.usage = payload["usage"]
            for choice in payload.get("choices") or []:
                out.text += (choice.get("delta") or {}).get("content") or ""


async def _failed(response: httpx.Response, out: Outcome) -> None:
    out.status = response.status_code
    body = await response.aread()
    try:
        out.error = httpx.Response(200, content=body).json().get("error") or {"code": None, "body": body[:200]}
    except ValueError:
        out.error = {"code": None, "body": body[:200]}


async def run_stream(head: Head, out: Outcome) -> None:
    req = out.request
    last_id: list[str | None] = [None]
    epoch = head.epoch
    try:
        async with httpx.AsyncClient(base_url=head.url, timeout=120) as client, \
                client.stream("POST", "/v1/chat/completions", json=req.body(),
                              headers=RESUMABLE if req.resumable else {}) as r:
            if r.status_code != 200:
                await _failed(r, out)
                return
            out.sid = r.headers.get("x-superfluid-session")
            out.stage = "streaming"
            await _read(r, out, last_id)
        out.stage = "ended"
        return
    except httpx.TransportError as exc:
        if head.epoch == epoch or not (req.resumable and out.sid):
            out.cut = f"{type(exc).__name__}: {exc}"
            out.stage = "cut"
            return
    while True:   # the head's restart cut it: read the rest from the new head by id
        out.resumes += 1
        out.stage = "waiting for the head"
        await head.up.wait()
        epoch = head.epoch
        headers = {"Last-Event-ID": last_id[0]} if last_id[0] is not None else {}
        out.done = False
        try:
            async with httpx.AsyncClient(base_url=head.url, timeout=120) as client, \
                    client.stream("GET", f"/v1/sessions/{out.sid}/stream", headers=headers) as r:
                if r.status_code != 200:
                    await _failed(r, out)
                    return
                out.stage = "resumed"
                await _read(r, out, last_id)
            out.stage = "ended"
            return
        except httpx.TransportError as exc:
            if head.epoch == epoch:
                out.cut = f"{type(exc).__name__}: {exc}"
                out.stage = "cut"
                return


def violations(outcomes: list[Outcome], reference: dict[tuple[int, int], str]) -> list[str]:
    bad = []
    for i, out in enumerate(outcomes):
        req, ref = out.request, reference[out.request.key]
        if out.error is not None:
            if not out.error.get("code"):
                bad.append(f"stream {i}: an untyped error: {out.describe()}")
            elif not ref.startswith(out.text):
                bad.append(f"stream {i}: text before its error is not a prefix of the reference: "
                           f"{out.describe()}\n  got  {out.text!r}\n  want {ref!r}")
            continue
        if out.cut or not out.done:
            bad.append(f"stream {i}: neither complete nor a typed error: {out.describe()}")
            continue
        tokens = (out.usage or {}).get("completion_tokens")
        if tokens != req.max_tokens:
            bad.append(f"stream {i}: completion_tokens {tokens} != max_tokens {req.max_tokens}: {out.describe()}")
        if out.text != ref:
            at = len(os.path.commonprefix([out.text, ref]))
            bad.append(f"stream {i}: text differs from the reference at char {at} "
                       f"(got {len(out.text)} chars, want {len(ref)}): {out.describe()}\n"
                       f"  got  ...{out.text[max(0, at - 40):at + 60]!r}\n  want ...{ref[max(0, at - 40):at + 60]!r}")
    return bad


# ---- a scenario ---------------------------------------------------------------------------


async def references(fleet: Fleet, requests: tuple[Request, ...], known: dict[tuple[int, int], str]) -> None:
    """The text of each new distinct request, on the undisturbed fleet (plain streams, at once)."""
    new = list({r.key: Request(r.prompt, r.max_tokens, False) for r in requests if r.key not in known}.values())
    outs = [Outcome(r) for r in new]
    async with trio.open_nursery() as nursery:
        for out in outs:
            nursery.start_soon(run_stream, fleet.head, out)
    for out in outs:
        tokens = (out.usage or {}).get("completion_tokens")
        assert out.done and out.error is None and not out.cut and tokens == out.request.max_tokens, \
            f"a reference stream on the undisturbed fleet failed: {out.describe()}"
        known[out.request.key] = out.text


async def apply(fleet: Fleet, event: Event, outcomes: list[Outcome], nursery: trio.Nursery) -> str:
    """Do ``event``; returns what it hit (the node's load just before, when the head is up)."""
    hit = f"{event.kind} {event.node} (the head is down)"
    if event.node and fleet.head.up.is_set():
        load = {n["node"]: n["load"] for n in await fleet.head.models()}.get(event.node)
        hit = f"{event.kind} {event.node} (load {load})"
    if event.kind == "kill":
        fleet.nodes[event.node].kill()
    elif event.kind == "restart":
        fleet.nodes[event.node].start()
    elif event.kind == "partition":
        relay = fleet.nodes[event.node].relay
        assert relay is not None
        relay.partition()

        async def heal() -> None:
            await trio.sleep(event.hold)
            relay.heal()

        nursery.start_soon(heal)
    else:
        # a client cut before its response's head has no session id to resume by: kill the
        # head once every stream has one (each was admitted; a node is alive, so each will be)
        while any(o.sid is None and o.error is None and not o.cut for o in outcomes):
            await trio.sleep(0.02)
        cut = sum(not o.done for o in outcomes)
        await fleet.head.kill()
        nursery.start_soon(fleet.head.start)   # it waits (--fleet-wait) for a node to dial it again
        hit = f"head ({cut} streams live)"
    return hit


async def run_scenario(fleet: Fleet, scenario: Scenario, known: dict[tuple[int, int], str]) -> dict:
    await fleet.ready(scenario.nodes)
    await references(fleet, scenario.requests, known)
    outcomes = [Outcome(r) for r in scenario.requests]
    hits: list[str] = []
    start = trio.current_time()
    try:
        with trio.fail_after(SCENARIO_S):
            async with trio.open_nursery() as nursery:
                for out in outcomes:
                    nursery.start_soon(run_stream, fleet.head, out)

                async def events() -> None:
                    for event in scenario.events:
                        await trio.sleep_until(start + event.at)
                        hits.append(await apply(fleet, event, outcomes, nursery))

                nursery.start_soon(events)
            await fleet.head.up.wait()
    except trio.TooSlowError:
        raise AssertionError(_report(scenario, fleet, f"a hang: the scenario ran past {SCENARIO_S:g}s",
                                     [f"stream {i}: {o.describe()}" for i, o in enumerate(outcomes)])) from None
    elapsed = trio.current_time() - start
    bad = violations(outcomes, known)
    assert not bad, _report(scenario, fleet, "invariants violated", bad)
    fleet_now: list[dict] = []
    try:
        with trio.fail_after(QUIET_S):
            while True:
                fleet_now = await fleet.head.models()
                if fleet_now and not any(n["load"] for n in fleet_now):
                    break
                await trio.sleep(0.1)
    except trio.TooSlowError:
        raise AssertionError(_report(scenario, fleet, f"loads not back to 0 within {QUIET_S:g}s: {fleet_now}",
                                     [])) from None
    return {"seconds": round(elapsed, 2), "completed": sum(o.error is None for o in outcomes),
            "tokens": sum(o.request.max_tokens for o in outcomes if o.error is None),
            "errors": [o.error.get("code") for o in outcomes if o.error is not None],
            "resumed": sum(o.resumes > 0 for o in outcomes), "hit": hits}


def _report(scenario: Scenario, fleet: Fleet, what: str, lines: list[str]) -> str:
    return "\n".join([f"fleet fuzz: {what}; replay with SUPERFLUID_FUZZ_FLEET_SEED={scenario.seed} "
                      f"SUPERFLUID_FUZZ_FLEET_SCENARIOS=1", str(scenario), *lines, fleet.tails()])


async def test_fleet_streams_survive_random_kills_partitions_and_restarts(tmp_path: Path) -> None:
    began = time.monotonic()
    port = _free_port()   # below the ephemeral range: the head binds it again after each restart
    known: dict[tuple[int, int], str] = {}
    results = []
    nodes: dict[str, FleetNode] = {}
    try:
        async with trio.open_nursery() as nursery:
            head = Head(nursery, port, tmp_path / "sessions")
            await head.start()
            for ident in IDENTITIES:
                relay = None
                if ident in RELAYED:
                    relay = Relay(target=port)
                    await nursery.start(relay.run)
                nodes[ident] = FleetNode(ident, port, relay)
            fleet = Fleet(head, nodes)
            for k in range(SCENARIOS):
                scenario = draw(SEED + k)
                try:
                    results.append((scenario, await run_scenario(fleet, scenario, known)))
                except Exception as exc:   # (a violation's message names the seed already)
                    if "SUPERFLUID_FUZZ_FLEET_SEED" not in str(exc):
                        exc.add_note(_report(scenario, fleet, f"{type(exc).__name__} in the scenario", []))
                    raise
            nursery.cancel_scope.cancel()
    finally:
        for node in nodes.values():
            node.kill()
    totals = {key: sum(r[key] if isinstance(r[key], int) else len(r[key]) for _s, r in results)
              for key in ("completed", "tokens", "resumed", "errors")}
    print(f"\nfleet fuzz: {len(results)} scenarios from seed {SEED} in {time.monotonic() - began:.1f}s: "
          f"{totals['completed']} streams completed ({totals['tokens']} tokens compared, {totals['resumed']} "
          f"resumed after a head restart), {totals['errors']} typed errors")
    for scenario, result in results:
        print(f"  {scenario}\n    -> {result}")
    assert len(results) == SCENARIOS
