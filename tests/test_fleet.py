"""The fleet (SPEC.md §14): a head in this process, nodes as separate processes over TCP.

Each node is ``superfluid node join`` (or ``node serve``) in its own process group, with the
mock runtime; the head is the daemon in-process (so a test can read its registry). Links go
over real TCP on 127.0.0.1, through a relay (``Relay``) where a test must see or cut the
bytes: a partition is the relay holding every byte both ways.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import attrs
import httpx
import pytest
import trio

from superfluid.fleet._channel import new_token, parse_token
from tests.conftest import mock_config, sse_events, start_daemon, stream_text

MODEL = "fm"
SPEC = "mock?step_ms=15&prefill_us=5"
TOKEN = new_token()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def head_config(port: int = 0, *, dial: tuple[tuple[str, int], ...] = (), key: bytes | None = None, **kw: object):
    kw.setdefault("fleet_mdns", False)
    return mock_config(models=(), fleet_listen=("127.0.0.1", port) if port else None, fleet_dial=dial,
                       fleet_key=parse_token(TOKEN) if key is None else key, fleet_lease_s=1.5, **kw)


class Node:
    """A node process (its own process group: killing it kills its worker too)."""

    def __init__(self, *args: str, identity: str, token: str = TOKEN, spec: str = SPEC,
                 options: tuple[str, ...] = ()) -> None:
        env = {**os.environ, "SUPERFLUID_FLEET_TOKEN": token}
        self.log = tempfile.TemporaryFile()   # (a pipe nobody reads would stop the node's logging when full)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "superfluid", "node", *args, spec, "--model-name", MODEL, "--identity", identity,
             "--max-batch", "8", *options],
            env=env, stdout=subprocess.DEVNULL, stderr=self.log, start_new_session=True)

    def stderr(self) -> str:
        self.log.seek(0)
        return self.log.read().decode("utf-8", "replace")

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


def worker_pids_of(node: Node) -> list[int]:
    import psutil

    try:
        return [p.pid for p in psutil.Process(node.proc.pid).children(recursive=True) if p.status() != "zombie"]
    except psutil.NoSuchProcess:
        return []


@asynccontextmanager
async def nodes(*specs: tuple[list[str], str]) -> AsyncIterator[list[Node]]:
    started = [Node(*args, identity=ident) for args, ident in specs]
    try:
        yield started
    finally:
        for node in started:
            node.kill()


@attrs.define
class Relay:
    """A TCP relay from ``port`` to ``target`` that records every byte and can hold them (a partition)."""

    target: int
    port: int = 0
    seen: bytearray = attrs.field(factory=bytearray)
    open: trio.Event = attrs.field(factory=trio.Event)

    def __attrs_post_init__(self) -> None:
        self.open.set()

    async def run(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        await trio.serve_listeners(self._serve, listeners, task_status=_Port(task_status, self.port))

    async def _serve(self, client: trio.SocketStream) -> None:
        try:
            server = await trio.open_tcp_stream("127.0.0.1", self.target)
        except OSError:   # the head is down (restarting): the node dials again
            await client.aclose()
            return

        async def pump(src: trio.SocketStream, dst: trio.SocketStream) -> None:
            try:
                while data := await src.receive_some(65536):
                    self.seen += data
                    await self.open.wait()
                    await dst.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass
            nursery.cancel_scope.cancel()

        async with server, trio.open_nursery() as nursery:
            nursery.start_soon(pump, client, server)
            nursery.start_soon(pump, server, client)

    def partition(self) -> None:
        self.open = trio.Event()

    def heal(self) -> None:
        self.open.set()


class _Port:
    def __init__(self, status: trio.TaskStatus[int], port: int) -> None:
        self.status, self.port = status, port

    def started(self, _v: object = None) -> None:
        self.status.started(self.port)


async def wait_nodes(url: str, n: int) -> list[dict]:
    with trio.fail_after(30):
        async with httpx.AsyncClient(base_url=url) as c:
            while True:
                data = (await c.get("/v1/models")).json()["data"]
                fleet = next((m.get("fleet", []) for m in data if m["id"] == MODEL), [])
                if sum(1 for node in fleet if node["up"]) >= n:
                    return fleet
                await trio.sleep(0.1)


def chat(i: int, max_tokens: int = 120) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": f"question number {i}: tell me a story"}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True}


async def stream(client: httpx.AsyncClient, body: dict) -> tuple[str, int]:
    async with client.stream("POST", "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, await r.aread()
        events = await sse_events(r)
    usage = next(e["usage"] for e in reversed(events) if e.get("usage")) if any(e.get("usage") for e in events) else {}
    assert not any("error" in e for e in events), events
    return stream_text(events), usage.get("completion_tokens", 0)


async def run_streams(url: str, n: int, *, during=None) -> list[tuple[str, int]]:
    out: list[tuple[str, int]] = [("", 0)] * n
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        async with trio.open_nursery() as nursery:
            async def one(i: int) -> None:
                body = chat(i)
                body["stream_options"] = {"include_usage": True}
                out[i] = await stream(client, body)

            for i in range(n):
                nursery.start_soon(one, i)
            if during is not None:
                await during()
    return out


@asynccontextmanager
async def head(port: int = 0, **kw: object) -> AsyncIterator[str]:
    async with trio.open_nursery() as nursery:
        d = await start_daemon(nursery, head_config(port, **kw))
        try:
            yield d.url
        finally:
            await d.client.aclose()
            d.scope.cancel()


async def test_a_head_and_two_nodes_serve_every_dialect() -> None:
    port = free_port()
    async with head(port) as url, nodes((["join", f"127.0.0.1:{port}"], "a"), (["join", f"127.0.0.1:{port}"], "b")):
        fleet = await wait_nodes(url, 2)
        assert {n["node"] for n in fleet} == {"a", "b"} and all(n["n_ctx"] == 4096 for n in fleet)
        import anthropic
        import ollama
        import openai

        oa = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x")
        reply = await oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=8)
        assert reply.choices[0].message.content and reply.usage.completion_tokens == 8
        chunks = [c async for c in await oa.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8, stream=True)]
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        an = anthropic.AsyncAnthropic(base_url=url, api_key="x")
        msg = await an.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "hi"}])
        assert msg.content[0].text
        ol = ollama.AsyncClient(host=url)
        out = await ol.chat(model=MODEL, messages=[{"role": "user", "content": "hi"}], options={"num_predict": 8})
        assert out.message.content
        # 8 streams at once: both nodes take some
        results, loads = await _streams_and_peak_loads(url, 8)
        assert all(n == 120 for _t, n in results)
        assert loads["a"] > 0 and loads["b"] > 0, loads
        async with httpx.AsyncClient(base_url=url) as c:
            text = (await c.get("/metrics")).text
        for node in ("a", "b"):
            assert f'superfluid_fleet_node_up{{model="{MODEL}",node="{node}"}} 1.0' in text
            assert f'superfluid_fleet_node_lanes_total{{model="{MODEL}",node="{node}"}} 8.0' in text
        assert f'superfluid_lanes_total{{model="{MODEL}"}} 16.0' in text
        top = await trio.run_process([sys.executable, "-m", "superfluid", "top", "--once", "--interval", "0.2",
                                      url.removeprefix("http://")], capture_stdout=True)
        shown = top.stdout.decode()
        assert f"{MODEL}@a" in shown and f"{MODEL}@b" in shown and "16" in shown, shown


async def _streams_and_peak_loads(url: str, n: int) -> tuple[list[tuple[str, int]], dict[str, int]]:
    peak: dict[str, int] = {}

    async def watch() -> None:
        async with httpx.AsyncClient(base_url=url) as c:
            for _ in range(20):
                data = (await c.get("/v1/models")).json()["data"]
                for node in next(m["fleet"] for m in data if m["id"] == MODEL):
                    peak[node["node"]] = max(peak.get(node["node"], 0), node["load"])
                await trio.sleep(0.1)

    return await run_streams(url, n, during=watch), peak


async def test_a_node_killed_mid_stream_loses_nothing_and_repeats_nothing() -> None:
    """8 streams over two nodes; one node (process group: node and worker) is SIGKILLed
    mid-stream. Every stream completes with no error, and its text is the reference's
    (the mock is deterministic): no token twice, none dropped."""
    port = free_port()
    async with head(port) as url, nodes((["join", f"127.0.0.1:{port}"], "a"),
                                        (["join", f"127.0.0.1:{port}"], "b")) as (a, _b):
        await wait_nodes(url, 2)
        reference = await run_streams(url, 8)
        assert all(n == 120 for _t, n in reference)

        async def kill_a() -> None:
            await trio.sleep(0.8)
            a.kill()

        with trio.fail_after(20):   # (the reference takes about 2 s)
            results = await run_streams(url, 8, during=kill_a)
        assert results == reference
        fleet = await wait_nodes(url, 1)
        assert [n["node"] for n in fleet if n["up"]] == ["b"]


async def test_a_client_that_leaves_after_its_stream_moved_stops_it_on_the_new_node() -> None:
    """A stop follows its job to the node that holds it now: streams re-placed from a killed
    node, then abandoned by their clients, leave no lane busy on the node that took them."""
    port = free_port()
    async with head(port) as url, nodes((["join", f"127.0.0.1:{port}"], "a"),
                                        (["join", f"127.0.0.1:{port}"], "b")) as (a, _b):
        await wait_nodes(url, 2)
        async with httpx.AsyncClient(base_url=url, timeout=60) as client, trio.open_nursery() as nursery:
            async def abandon(i: int) -> None:
                body = chat(i, max_tokens=3000)
                async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                    async for _chunk in r.aiter_bytes():
                        await trio.sleep(2.5)   # a was killed meanwhile: this stream runs on b now
                        return

            for i in range(6):
                nursery.start_soon(abandon, i)
            await trio.sleep(0.8)
            a.kill()
        with trio.fail_after(5):
            while True:
                fleet = await wait_nodes(url, 1)
                if all(n["load"] == 0 for n in fleet):
                    break
                await trio.sleep(0.1)


PARTITION_S = float(os.environ.get("SUPERFLUID_FLEET_PARTITION_S", "5"))   # 60: the long partition, by hand


async def test_a_partition_ends_with_every_stream_complete_and_nothing_twice() -> None:
    """Node a's link goes through a relay that holds every byte for 5 s (over the 1.5 s lease;
    ``SUPERFLUID_FLEET_PARTITION_S=60`` for the long one):
    the head loses the link and re-places a's streams on b; a's side fences its worker. Healed,
    a joins again. Every stream completes, identical to the reference."""
    port = free_port()
    async with head(port) as url, trio.open_nursery() as nursery:
        relay = Relay(target=port)
        rport = await nursery.start(relay.run)
        async with nodes((["join", f"127.0.0.1:{rport}"], "a"), (["join", f"127.0.0.1:{port}"], "b")) as (a, _b):
            await wait_nodes(url, 2)
            reference = await run_streams(url, 8)

            fenced: list[float] = []

            async def cut() -> None:
                await trio.sleep(0.5)
                before = set(worker_pids_of(a))
                assert before
                relay.partition()
                start = trio.current_time()
                while set(worker_pids_of(a)) & before:    # its own lease runs out: the worker is killed
                    await trio.sleep(0.05)
                fenced.append(trio.current_time() - start)
                await trio.sleep(max(0.0, PARTITION_S - fenced[0]))
                relay.heal()

            with trio.fail_after(PARTITION_S + 30):
                results = await run_streams(url, 8, during=cut)
            assert results == reference
            assert fenced[0] < 6 + 1.0, fenced    # the node's lease (6 s) and a moment, not a grace ladder
            await wait_nodes(url, 2)   # a came back (it dialled again)
        nursery.cancel_scope.cancel()


async def test_a_head_restart_resumes_resumable_streams_on_the_nodes(tmp_path) -> None:
    """The head keeps the write-ahead log: a resumable stream cut by the head's end is resumed
    once its node dials the restarted head again, and the client reads the rest by id."""
    from tests.test_sessions import RESUMABLE, _content, read_sse

    port = free_port()
    sessions = tmp_path / "sessions"
    async with nodes((["join", f"127.0.0.1:{port}"], "a")):
        async with head(port, sessions=sessions) as url:
            await wait_nodes(url, 1)
            reference = (await run_streams(url, 1))[0][0]
            async with httpx.AsyncClient(base_url=url, timeout=60) as c:
                async with c.stream("POST", "/v1/chat/completions", json=chat(0), headers=RESUMABLE) as r:
                    sid = r.headers["x-superfluid-session"]
                    first, done = await read_sse(r, limit=10)
            assert not done
        async with head(port, sessions=sessions) as url:
            async with httpx.AsyncClient(base_url=url, timeout=60) as c:
                last = next(i for i, _e in reversed(first) if i is not None)
                async with c.stream("GET", f"/v1/sessions/{sid}/stream", headers={"Last-Event-ID": last}) as r:
                    rest, done = await read_sse(r)
    assert done
    text = "".join(_content(e) for _i, e in first)
    assert text + "".join(_content(e) for _i, e in rest) == reference


async def test_the_link_is_encrypted_and_a_wrong_token_is_refused() -> None:
    port = free_port()
    async with head(port) as url, trio.open_nursery() as nursery:
        relay = Relay(target=port)
        rport = await nursery.start(relay.run)
        async with nodes((["join", f"127.0.0.1:{rport}"], "a")):
            await wait_nodes(url, 1)
            async with httpx.AsyncClient(base_url=url, timeout=60) as c:
                marker = "zebra-quartz-" * 8
                r = await c.post("/v1/chat/completions", json={
                    "model": MODEL, "messages": [{"role": "user", "content": marker}], "max_tokens": 16})
                assert r.status_code == 200
                text = r.json()["choices"][0]["message"]["content"]
        assert relay.seen and len(relay.seen) > 1000
        for plain in (b"zebra-quartz", text.encode()[:12], TOKEN.encode(), b"superfluid-worker", b"Hello"):
            assert plain not in relay.seen, plain
        # another token: refused at the handshake, never a node
        wrong = Node("join", f"127.0.0.1:{port}", identity="w", token=new_token())
        try:
            await trio.sleep(3)
            async with httpx.AsyncClient(base_url=url) as c:
                data = (await c.get("/v1/models")).json()["data"]
            fleet = next(m["fleet"] for m in data if m["id"] == MODEL)
            assert [n["node"] for n in fleet] == ["a"]
            assert wrong.proc.poll() is None   # it keeps dialling, refused each time
        finally:
            wrong.kill()
        assert "refused the handshake" in wrong.stderr()
        nursery.cancel_scope.cancel()


async def test_a_node_given_no_address_finds_the_head_by_mdns() -> None:
    """``node join`` with no HEAD browses _superfluid-fleet._tcp; the head advertises its
    --fleet-listen (real multicast DNS through python-zeroconf on this machine)."""
    port = free_port()
    async with head(port, fleet_mdns=True) as url, nodes((["join"], "m")):
        fleet = await wait_nodes(url, 1)
        assert [n["node"] for n in fleet] == ["m"]


async def test_a_flood_of_silent_connections_to_the_fleet_port_costs_the_head_nothing() -> None:
    """Links that never authenticate: at most 64 handshakes wait (each for its timeout); the
    rest are closed at once; HTTP goes on, and a node joins once the flood is gone."""
    from superfluid.fleet._head import MAX_HANDSHAKES

    port = free_port()
    async with head(port) as url:
        socks = [await trio.open_tcp_stream("127.0.0.1", port) for _ in range(MAX_HANDSHAKES + 50)]
        closed = 0
        with trio.move_on_after(2):
            for sock in socks[MAX_HANDSHAKES:]:
                if await sock.receive_some(1) == b"":
                    closed += 1
        assert closed == 50
        async with httpx.AsyncClient(base_url=url) as c:
            assert (await c.get("/health")).status_code == 200
        for sock in socks:
            await sock.aclose()
        async with nodes((["join", f"127.0.0.1:{port}"], "a")):
            await wait_nodes(url, 1)


async def test_the_head_dials_a_node_that_listens() -> None:
    nport = free_port()
    async with nodes((["serve", "--listen", f"127.0.0.1:{nport}"], "d")):
        await trio.sleep(1.0)
        async with head(dial=(("127.0.0.1", nport),)) as url:
            await wait_nodes(url, 1)
            results = await run_streams(url, 2)
            assert all(n == 120 for _t, n in results)


@pytest.mark.real
async def test_smollm2_nodes_killed_mid_stream_give_the_reference_text_with_deterministic() -> None:
    """Two SmolLM2 nodes (llama.cpp, --deterministic, one thread each); one is SIGKILLed
    mid-stream: every stream completes on the other, and its text is the one the undisturbed
    fleet gave (greedy): the continuation from the delivered tokens is the same text."""
    from tests.conftest import REAL_GGUF

    port = free_port()
    options = ("--deterministic", "--threads", "1", "--max-context", "1024")
    async with head(port) as url:
        a = Node("join", f"127.0.0.1:{port}", identity="a", spec=str(REAL_GGUF), options=options)
        b = Node("join", f"127.0.0.1:{port}", identity="b", spec=str(REAL_GGUF), options=options)
        try:
            await wait_nodes(url, 2)

            async def four() -> list[tuple[str, int]]:
                async with httpx.AsyncClient(base_url=url, timeout=120) as client:
                    out: list[tuple[str, int]] = [("", 0)] * 4
                    async with trio.open_nursery() as nursery:
                        async def one(i: int) -> None:
                            body = chat(i, max_tokens=64)
                            body["stream_options"] = {"include_usage": True}
                            out[i] = await stream(client, body)

                        for i in range(4):
                            nursery.start_soon(one, i)
                        if killing:
                            await trio.sleep(1.0)
                            fleet = await wait_nodes(url, 2)
                            busy.extend(n["load"] for n in fleet if n["node"] == "a")
                            a.kill()
                    return out

            import anthropic
            import ollama
            import openai

            oa = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x")
            reply = await oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi!"}],
                                                     max_tokens=8, temperature=0)
            assert reply.choices[0].message.content
            msg = await anthropic.AsyncAnthropic(base_url=url, api_key="x").messages.create(
                model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "Hi!"}])
            assert msg.content[0].text
            out = await ollama.AsyncClient(host=url).chat(model=MODEL, messages=[{"role": "user", "content": "Hi!"}],
                                                          options={"num_predict": 8})
            assert out.message.content
            killing = False
            busy: list[int] = []
            reference = await four()
            killing = True
            with trio.fail_after(120):
                results = await four()
            assert all(n == 64 for _t, n in reference)
            assert busy and busy[0] > 0, busy    # a had streams when it died
            assert results == reference
        finally:
            a.kill()
            b.kill()


@pytest.mark.parametrize("argv, message", [
    (["node", "join", "10.1.2.3:9", "mock"], "no fleet token"),
    (["node", "serve", "--listen", "0.0.0.0:0", "mock"], "no fleet token"),
    (["serve", "--fleet-listen", "0.0.0.0:0", "mock"], "no fleet token"),
    (["node", "join", "127.0.0.1:9", "mock", "--token", "abc"], "fleet token"),
])
def test_a_node_or_head_off_loopback_without_a_token_refuses_to_start(argv, message, tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "SUPERFLUID_FLEET_TOKEN"} | {"SUPERFLUID_HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-m", "superfluid", *argv], env=env, capture_output=True, timeout=60)
    assert out.returncode == 2, out
    assert message in out.stderr.decode() and "Traceback" not in out.stderr.decode()


def test_fleet_token_is_made_once_0600(tmp_path) -> None:
    env = {**os.environ, "SUPERFLUID_HOME": str(tmp_path)}
    first = subprocess.run([sys.executable, "-m", "superfluid", "fleet", "token"], env=env, capture_output=True,
                           text=True, check=True).stdout.strip()
    again = subprocess.run([sys.executable, "-m", "superfluid", "fleet", "token"], env=env, capture_output=True,
                           text=True, check=True).stdout.strip()
    assert first == again and len(parse_token(first)) == 32
    assert (tmp_path / "fleet" / "token").stat().st_mode & 0o777 == 0o600


class _Core:
    def __init__(self) -> None:
        self.running: dict = {}
        self.queues: dict = {}
        self.last_tick: dict = {}
        self.link_up = True


class _Sched:
    def __init__(self) -> None:
        self.core = _Core()
        self.closed = None


class _Actor:
    def __init__(self, lanes: int = 8, n_ctx: int = 4096) -> None:
        self.scheduler = _Sched()
        self.ack = attrs.make_class("Ack", {"limits": attrs.field(default={"max_lanes": lanes})})()
        self.info = {"n_ctx_seq": n_ctx}
        self.spec = attrs.make_class("Spec", {"max_batch": attrs.field(default=lanes)})()
        self.stopped = False


def test_requests_placed_together_spread_before_any_reached_a_node() -> None:
    """Placement counts a request on its node as it places it: eight requests placed at once
    (none has reached a node's scheduler yet) go four and four, not all to the first node; a
    prompt only one node's window holds goes there; a node that is down gets none."""
    from superfluid.sched import Job
    from superfluid.serving._placement import FleetGroup
    from superfluid.proto import Sampling

    for policy in ("load-aware", "least-loaded", "round-robin"):
        a, b = _Actor(), _Actor()
        group = FleetGroup(policy=policy, members={"a": a, "b": b})
        jobs = [Job(prompt=[1], sampling=Sampling(), max_new=4) for _ in range(8)]
        chosen = [group.place(2, job=job) for job in jobs]
        assert chosen.count(a) == chosen.count(b) == 4, policy
        assert all(job.scheduler is actor.scheduler for job, actor in zip(jobs, chosen, strict=True))
        for job in jobs[:4]:
            job.finish_with("stop")
        more = [group.place(2, job=Job(prompt=[1], sampling=Sampling(), max_new=4)) for _ in range(2)]
        assert len(set(map(id, more))) == 2 or policy == "round-robin", policy
    small, big = _Actor(n_ctx=512), _Actor(n_ctx=4096)
    group = FleetGroup(members={"s": small, "b": big})
    assert all(group.place(1000) is big for _ in range(5))
    big.scheduler.core.link_up = False
    assert all(group.place(10) is small for _ in range(5))
