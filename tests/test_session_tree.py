"""The session tree (issue #48, SPEC.md §7 "The session tree"): metadata, tree, rebase, trim,
purge, subscribe and the tool ledger, over HTTP, the WebSocket and the unix socket, and
their replay after a daemon restart."""

from __future__ import annotations

import json
import stat
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from trio_websocket import open_websocket_url

from superfluid.journal import SessionStateError, open_journal
from superfluid.proto._sse import SseDecoder
from superfluid.sessions._conversations import Watcher
from superfluid.proto._wal import body_conversation, body_message, body_meta, body_purged, body_turn

from .conftest import Daemon, mock_config, open_daemon

SAMPLING = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}
U1 = {"role": "user", "content": "tell me about rivers"}
U2 = {"role": "user", "content": "and mountains?"}


async def create(c: httpx.AsyncClient, **body: Any) -> str:
    r = await c.post("/v1/sessions", json={"model": "mock", "sampling": SAMPLING, **body})
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


async def events(c: httpx.AsyncClient, cid: str) -> list[dict[str, Any]]:
    r = await c.get(f"/v1/sessions/{cid}/events")
    assert r.status_code == 200, r.text
    return list(r.json()["events"])


async def tree(c: httpx.AsyncClient, **params: Any) -> dict[str, dict[str, Any]]:
    r = await c.get("/v1/sessions", params={"view": "tree", **params})
    assert r.status_code == 200, r.text
    return {n["id"]: n for n in r.json()["data"]}


def err(r: httpx.Response, status: int, code: str | None = None, param: str | None = None) -> None:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    if code is not None:
        assert error["code"] == code, error
    if param is not None:
        assert error["param"] == param, error


async def test_meta_tree_rebase_trim_purge_over_http_survive_a_restart(tmp_path: Path) -> None:
    config = mock_config(sessions=tmp_path)
    async with open_daemon(config) as d:
        c = d.client
        with trio.fail_after(60):
            root = await create(c, messages=[U1])
            r = await c.post(f"/v1/sessions/{root}/generate", json={})
            assert r.status_code == 200, r.text
            await c.post(f"/v1/sessions/{root}/messages", json={"messages": [U2]})
            source = await events(c, root)
            assert [e["type"] for e in source] == ["conversation", "message", "turn", "message", "message"]
            info = (await c.get(f"/v1/sessions/{root}")).json()
            assert (info["title"], info["archived"], info["qos"], info["version"], info["parent"]) == (
                None, False, None, 0, None)
            # meta: each change bumps the version; a stale expected_version is 409
            r = await c.patch(f"/v1/sessions/{root}", json={"title": "rivers", "expected_version": 0})
            assert r.status_code == 200 and r.json()["title"] == "rivers" and r.json()["version"] == 1, r.text
            err(await c.patch(f"/v1/sessions/{root}", json={"title": "x", "expected_version": 0}), 409,
                "version_conflict", "expected_version")
            r = await c.patch(f"/v1/sessions/{root}", json={"qos": "agent"})
            assert r.json()["qos"] == "agent" and r.json()["version"] == 2 and r.json()["title"] == "rivers"
            err(await c.patch(f"/v1/sessions/{root}", json={"qos": "urgent"}), 400, param="qos")
            err(await c.patch(f"/v1/sessions/{root}", json={"archived": "yes"}), 400, param="archived")
            err(await c.patch(f"/v1/sessions/{root}", json={"colour": "red"}), 400, param="colour")
            err(await c.patch(f"/v1/sessions/{root}", content=b'{"title": "\\ud800"}',
                              headers={"content-type": "application/json"}), 400, param="title")
            err(await c.patch("/v1/sessions/c-nope", json={"title": "x"}), 404, "session_not_found")
            # rebase: replace the user message (event 4), drop the first turn's reply and its turn
            r = await c.post(f"/v1/sessions/{root}/rebase", json={"edits": [
                {"drop": {"from": 2, "to": 4}},
                {"replace": {"from": 4, "to": 5, "message": {"role": "user", "content": "and lakes?"}}}]})
            assert r.status_code == 201, r.text
            edited = r.json()["id"]
            assert r.json()["parent"] == root and r.json()["fork_at"] == 1 and r.json()["title"] is None
            got = await events(c, edited)
            assert [e["type"] for e in got] == ["conversation", "message", "message", "fork"]
            assert got[2]["message"] == {"role": "user", "content": "and lakes?"}
            assert got[3]["source"] == root and got[3]["edits"][0] == {"drop": {"from": 2, "to": 4}}
            assert await events(c, root) == [*source, *(await events(c, root))[5:]]  # the parent is never rewritten
            # an edit that keeps the turn but replaces its reply: the turn goes with it, the rest renumbered
            r = await c.post(f"/v1/sessions/{root}/rebase", json={"edits": [
                {"replace": {"from": 3, "to": 4, "message": {"role": "assistant", "content": "short"}}}]})
            assert r.status_code == 201, r.text
            reply_edit = r.json()["id"]
            assert [e["type"] for e in await events(c, reply_edit)] == [
                "conversation", "message", "message", "message", "fork"]
            assert (await c.post(f"/v1/sessions/{reply_edit}/generate", json={})).status_code == 200
            for bad, param in (([], "edits"), ([{"drop": {"from": 0, "to": 1}}], "edits"),
                               ([{"drop": {"from": 3, "to": 2}}], "edits"),
                               ([{"drop": {"from": 1, "to": 3}}, {"drop": {"from": 2, "to": 4}}], "edits"),
                               ([{"drop": {"from": 1, "to": 99}}], "edits[0]"),
                               ([{"replace": {"from": 3, "to": 3, "message": U2}}], "edits"),  # inside turn 2
                               ([{"move": {"from": 1, "to": 2}}], "edits[0]"),
                               ([{"replace": {"from": 1, "to": 2, "message": {"role": "robot"}}}],
                                "messages[0].role")):
                err(await c.post(f"/v1/sessions/{root}/rebase", json={"edits": bad}), 400, param=param)
            # trim: the events before `to`
            r = await c.post(f"/v1/sessions/{root}/trim", json={"to": 2})
            assert r.status_code == 201, r.text
            trimmed = r.json()["id"]
            assert [e["type"] for e in await events(c, trimmed)] == ["conversation", "message", "fork"]
            err(await c.post(f"/v1/sessions/{root}/trim", json={"to": 0}), 400, param="to")
            # a grandchild, and an archived one
            r = await c.post(f"/v1/sessions/{trimmed}/fork", json={})
            grandchild = r.json()["id"]
            await c.patch(f"/v1/sessions/{grandchild}", json={"archived": True})
            nodes = await tree(c)
            assert grandchild not in nodes
            nodes = await tree(c, include_archived=1)
            assert {k: (n["parent"], n["fork_at"]) for k, n in nodes.items()} == {
                root: (None, None), edited: (root, 1), reply_edit: (root, 2), trimmed: (root, 1),
                grandchild: (trimmed, 2)}
            assert nodes[root]["title"] == "rivers" and nodes[root]["version"] == 2 and nodes[root]["model"] == "mock"
            assert nodes[grandchild]["archived"] and nodes[root]["last_event_id"] == (await events(c, root))[-1]["id"]
            before = nodes
    async with open_daemon(config) as d:  # the tree and metadata read back identical
        c = d.client
        with trio.fail_after(60):
            assert await tree(c, include_archived=1) == before
            info = (await c.get(f"/v1/sessions/{root}")).json()
            assert (info["title"], info["qos"], info["version"]) == ("rivers", "agent", 2)
            # purge: stale version 409; reroot keeps the children as roots; cascade takes descendants
            err(await c.delete(f"/v1/sessions/{trimmed}", params={"mode": "reroot", "expected_version": 7}), 409,
                "version_conflict")
            err(await c.delete(f"/v1/sessions/{trimmed}", params={"mode": "sideways"}), 400, param="mode")
            r = await c.delete(f"/v1/sessions/{trimmed}", params={"mode": "reroot", "expected_version": 0})
            assert r.status_code == 200 and r.json()["purged"] == [trimmed] and r.json()["deleted"], r.text
            nodes = await tree(c, include_archived=1)
            assert trimmed not in nodes and nodes[grandchild]["parent"] is None
            r = await c.delete(f"/v1/sessions/{root}", params={"mode": "cascade"})
            assert r.status_code == 200 and sorted(r.json()["purged"]) == sorted([root, edited, reply_edit]), r.text
            assert set(await tree(c, include_archived=1)) == {grandchild}
            for cid in (root, edited, trimmed):
                err(await c.get(f"/v1/sessions/{cid}/events"), 404, "session_not_found")
            listed = {s["id"] for s in (await c.get("/v1/sessions")).json()["data"]}
            assert not listed & {root, edited, trimmed}
    async with open_daemon(config) as d:  # purged ids stay unknown after a restart
        c = d.client
        with trio.fail_after(30):
            for cid in (root, edited, reply_edit, trimmed):
                err(await c.get(f"/v1/sessions/{cid}"), 404)
            assert set(await tree(c, include_archived=1)) == {grandchild}
            assert (await tree(c, include_archived=1))[grandchild]["parent"] is None
            async with subscription("http", d, Path("/none"), grandchild, after=0) as frames:  # a cursor resolves
                assert [(await frames())[1]["type"] for _ in range(3)] == ["message", "fork", "fork"]


async def test_journal_meta_and_purged_events_replay_and_compaction_drops_purged(tmp_path: Path) -> None:
    async with open_journal(tmp_path) as journal:
        await journal.append_many([("c", body_conversation(model="m")), ("c", body_message(message=U1)),
                                   ("d", body_conversation(model="m"))])
        await journal.append("c", body_turn(generation="g", params={}))
        await journal.append("c", body_meta(version=1, title="t"))  # meta is fine while a turn is open
        assert journal.sessions["c"].meta == {"version": 1, "title": "t", "archived": False, "qos": None,
                                              "root": False}
        await journal.append("c", body_purged(mode="cascade"))  # so is purged, which ends it
        with pytest.raises(SessionStateError):
            await journal.append("c", body_message(message=U2))
        with pytest.raises(ValueError):
            body_purged(mode="sideways")
        with pytest.raises(ValueError):
            body_meta(version=1, archived="yes")  # type: ignore[arg-type]
    async with open_journal(tmp_path) as journal:
        assert journal.sessions["c"].finish == "purged" and journal.sessions["c"].meta["title"] == "t"
        assert journal.sessions["c"].open_turn == -1  # (no turn of it is restored)
        with pytest.raises(SessionStateError):
            await journal.append("c", body_meta(version=2))
        await journal.compact()
        assert "c" not in journal.sessions and "d" in journal.sessions


# -- one test per operation over HTTP, the WebSocket and the unix socket --------------------------------------------

CALLS = [{"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}},
         {"id": "call_2", "type": "function", "function": {"name": "time", "arguments": "{}"}}]
ASKED = {"role": "assistant", "content": None, "tool_calls": CALLS}


class Surface:
    """The ops of the API shape over one surface; ``call`` answers ``(ok, body)``: the reply
    (HTTP's JSON, or the op's reply frame), or the error object."""

    name = ""

    async def call(self, op: str, session: str | None = None, **body: Any) -> tuple[bool, dict[str, Any]]:
        raise NotImplementedError

    async def frame(self) -> dict[str, Any]:
        raise NotImplementedError

    async def aclose(self) -> None:
        pass


class HttpSurface(Surface):
    name = "http"
    _ROUTES = {"meta": ("PATCH", ""), "rebase": ("POST", "/rebase"), "trim": ("POST", "/trim"),
               "purge": ("DELETE", ""), "tool_calls": ("GET", "/tool_calls"),
               "tool_result": ("POST", "/tool_results"), "tree": ("GET", None), "events": ("GET", "/events")}

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client

    async def call(self, op: str, session: str | None = None, **body: Any) -> tuple[bool, dict[str, Any]]:
        method, tail = self._ROUTES[op]
        if tail is None:
            r = await self.client.get("/v1/sessions", params={"view": "tree", **(
                {"include_archived": 1} if body.get("include_archived") else {})})
        elif method in ("GET", "DELETE"):
            r = await self.client.request(method, f"/v1/sessions/{session}{tail}", params=body)
        else:
            r = await self.client.request(method, f"/v1/sessions/{session}{tail}", json=body)
        data = r.json()
        return r.status_code < 400, data.get("error", data)


class FrameSurface(Surface):
    """The WebSocket's frames, over a WebSocket or the unix socket."""

    _REPLY = {"meta": "info", "rebase": "info", "trim": "info"}

    def __init__(self) -> None:
        self.ref = 0

    async def put(self, msg: dict[str, Any]) -> None:
        raise NotImplementedError

    async def call(self, op: str, session: str | None = None, **body: Any) -> tuple[bool, dict[str, Any]]:
        self.ref += 1
        msg: dict[str, Any] = {"op": op, "id": self.ref, "body": body}
        if session is not None:
            msg["session"] = session
        await self.put(msg)
        while True:
            reply = await self.frame()
            if reply.get("id") == self.ref:
                break
        if reply["op"] == "error":
            return False, reply["error"]
        if op in self._REPLY:
            return True, reply[self._REPLY[op]]
        if op == "tool_result":
            return True, {"events": reply["events"]}
        if op == "purge":
            return True, {"id": session, "deleted": True, "purged": reply["purged"], "rerooted": reply["rerooted"]}
        return True, {k: v for k, v in reply.items() if k not in ("op", "id", "session")}


class WsSurface(FrameSurface):
    name = "ws"

    def __init__(self, ws: Any) -> None:
        super().__init__()
        self.ws = ws

    async def put(self, msg: dict[str, Any]) -> None:
        await self.ws.send_message(json.dumps(msg))

    async def frame(self) -> dict[str, Any]:
        return dict(json.loads(await self.ws.get_message()))


class UnixSurface(FrameSurface):
    name = "socket"

    def __init__(self, stream: trio.SocketStream) -> None:
        super().__init__()
        self.stream = stream
        self.buffer = b""

    async def put(self, msg: dict[str, Any]) -> None:
        await self.stream.send_all(json.dumps(msg).encode() + b"\n")

    async def frame(self) -> dict[str, Any]:
        while b"\n" not in self.buffer:
            data = await self.stream.receive_some(65536)
            assert data, "the daemon closed the unix socket"
            self.buffer += data
        line, _, self.buffer = self.buffer.partition(b"\n")
        return dict(json.loads(line))

    async def aclose(self) -> None:
        await self.stream.aclose()


def short_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="sf-", dir="/tmp"))  # a unix socket path is at most 107 bytes


@asynccontextmanager
async def surface(kind: str, d: Daemon, sock: Path) -> AsyncIterator[Surface]:
    if kind == "http":
        yield HttpSurface(d.client)
    elif kind == "ws":
        async with open_websocket_url(d.url.replace("http://", "ws://") + "/v1/ws") as ws:
            yield WsSurface(ws)
    else:
        stream = await trio.open_unix_socket(str(sock))
        s = UnixSurface(stream)
        try:
            yield s
        finally:
            await s.aclose()


@pytest.mark.parametrize("kind", ["http", "ws", "socket"])
async def test_every_tree_operation_over_http_ws_and_the_unix_socket_survives_a_restart(kind: str) -> None:
    home = short_dir()
    sock = home / "sf.sock"
    config = mock_config(socket=sock, sessions=home / "sessions")
    async with open_daemon(config) as d:
        assert stat.S_IMODE(sock.stat().st_mode) == 0o600
        c = d.client
        with trio.fail_after(60):
            cid = await create(c, messages=[U1, ASKED])
            async with surface(kind, d, sock) as s:
                # meta, with a stale version refused
                ok, info = await s.call("meta", cid, title="weather", expected_version=0)
                assert ok and info["title"] == "weather" and info["version"] == 1, info
                ok, error = await s.call("meta", cid, title="x", expected_version=0)
                assert not ok and error["code"] == "version_conflict"
                ok, error = await s.call("meta", "c-nope", title="x")
                assert not ok and error["code"] == "session_not_found"
                # the tool ledger
                ok, calls = await s.call("tool_calls", cid)
                assert ok and [(x["id"], x["name"], x["status"]) for x in calls["data"]] == [
                    ("call_1", "weather", "open"), ("call_2", "time", "open")]
                assert calls["data"][0]["arguments"] == '{"city": "Oslo"}'
                ok, done = await s.call("tool_result", cid, tool_call_id="call_1", content="sunny")
                assert ok and done["events"] == [4], done  # (event 3: the meta)
                ok, error = await s.call("tool_result", cid, tool_call_id="call_1", content="again")
                assert not ok and error["code"] == "tool_call_not_found"
                ok, error = await s.call("tool_result", cid, tool_call_id="call_2", outcome="exploded")
                assert not ok and error["param"] == "outcome"
                ok, done = await s.call("tool_result", cid, tool_call_id="call_2", outcome="failed", note="timeout")
                assert ok and done["events"] == [5]
                ok, calls = await s.call("tool_calls", cid)
                assert ok and calls["data"] == []
                tail = (await events(c, cid))[4:]
                assert [e["message"] for e in tail] == [
                    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
                    {"role": "tool", "tool_call_id": "call_2", "content": "The tool call failed: timeout"}]
                # rebase and trim make branches; the tree shows them
                ok, info = await s.call("rebase", cid, edits=[
                    {"replace": {"from": 1, "to": 2, "message": {"role": "user", "content": "and lakes?"}}}])
                assert ok and info["parent"] == cid and info["fork_at"] == 0, info
                rebased = info["id"]
                assert (await events(c, rebased))[1]["message"] == {"role": "user", "content": "and lakes?"}
                ok, error = await s.call("rebase", cid, edits=[{"drop": {"from": 0, "to": 1}}])
                assert not ok and error["param"] == "edits"
                ok, info = await s.call("trim", cid, to=2)
                assert ok and info["parent"] == cid and info["fork_at"] == 1
                trimmed = info["id"]
                ok, tree_ = await s.call("tree")
                assert ok
                nodes = {n["id"]: n for n in tree_["data"]}
                assert {k: n["parent"] for k, n in nodes.items()} == {cid: None, rebased: cid, trimmed: cid}
                assert nodes[cid]["title"] == "weather" and nodes[cid]["version"] == 1
                before = (tree_, await events(c, cid), await events(c, rebased))
    assert not sock.exists()
    async with open_daemon(config) as d:  # a restart reads back the same tree, metadata, ledger and branches
        c = d.client
        with trio.fail_after(60):
            async with surface(kind, d, sock) as s:
                ok, tree_ = await s.call("tree")
                assert ok and (tree_, await events(c, cid), await events(c, rebased)) == before
                ok, calls = await s.call("tool_calls", cid)
                assert ok and calls["data"] == []
                # purge, cascade
                ok, error = await s.call("purge", cid, mode="cascade", expected_version=5)
                assert not ok and error["code"] == "version_conflict"
                ok, done = await s.call("purge", cid, mode="cascade", expected_version=1)
                assert ok and sorted(done["purged"]) == sorted([cid, rebased, trimmed]), done
                ok, tree_ = await s.call("tree")
                assert ok and tree_["data"] == []
                ok, error = await s.call("tool_calls", cid)
                assert not ok and error["code"] == "session_not_found"
    assert not sock.exists()


# -- subscribe ---------------------------------------------------------------------------------------------------------

Frames = Callable[[], Awaitable[tuple[str, dict[str, Any]]]]


@asynccontextmanager
async def subscription(kind: str, d: Daemon, sock: Path, cid: str, after: int = -1) -> AsyncIterator[Frames]:
    """Frames ``(committed|provisional|ended, data)`` of one subscription over ``kind``."""
    if kind == "http":
        async with d.client.stream("GET", f"/v1/sessions/{cid}/subscribe", params={"after": after}) as r:
            assert r.status_code == 200, await r.aread()
            decoder, pending, chunks = SseDecoder(), [], r.aiter_bytes()

            async def next_sse() -> tuple[str, dict[str, Any]]:
                while not pending:
                    pending.extend(decoder.feed(await chunks.__anext__()))
                event = pending.pop(0)
                data = event.json()
                if event.event == "committed":
                    assert event.id == str(data["id"])
                return str(event.event), data

            yield next_sse
        return
    async with surface(kind, d, sock) as s:
        assert isinstance(s, FrameSurface)
        await s.put({"op": "subscribe", "session": cid, "after": after})
        assert (await s.frame())["op"] == "subscribed"

        async def next_frame() -> tuple[str, dict[str, Any]]:
            msg = await s.frame()
            assert msg["session"] == cid, msg
            if msg["op"] == "event":
                return "committed", msg["event"]
            return str(msg["op"]), {k: v for k, v in msg.items() if k not in ("op", "session")}

        yield next_frame


async def read_until(frames: Frames, kind: str, type_: str | None = None) -> list[tuple[str, dict[str, Any]]]:
    out = []
    while True:
        frame = await frames()
        out.append(frame)
        if frame[0] == kind and (type_ is None or frame[1].get("type") == type_):
            return out


@pytest.mark.parametrize("kind", ["http", "ws", "socket"])
async def test_subscribers_see_committed_events_and_the_turns_text_live_then_purge_ends_them(kind: str) -> None:
    sock = short_dir() / "sf.sock"
    async with open_daemon(mock_config("mock?step_ms=5&prefill_us=5", socket=sock)) as d:
        c = d.client
        with trio.fail_after(60):
            cid = await create(c, messages=[U1], sampling={**SAMPLING, "max_tokens": 30})
            async with subscription(kind, d, sock, cid) as one, subscription("http", d, sock, cid, after=0) as two:
                backlog = [await one(), await one()]
                assert [(k, e["id"], e["type"]) for k, e in backlog] == [
                    ("committed", 0, "conversation"), ("committed", 1, "message")]
                assert await two() == backlog[1]  # after=0: from event 1
                reply = (await c.post(f"/v1/sessions/{cid}/generate", json={})).json()
                text = reply["choices"][0]["message"]["content"]
                for frames in (one, two):
                    seen = await read_until(frames, "committed", "message")
                    kinds = [k for k, _d in seen]
                    assert seen[0][0] == "committed" and seen[0][1]["type"] == "turn" and seen[0][1]["id"] == 2
                    assert set(kinds[1:-1]) <= {"provisional"} and seen[-1][1]["id"] == 3
                    assert seen[-1][1]["message"] == {"role": "assistant", "content": text}
                    said = "".join(d_["text"] for k, d_ in seen if k == "provisional")
                    assert all(d_["turn"] == 2 for k, d_ in seen if k == "provisional")
                    assert said == text, (said, text)
                r = await c.patch(f"/v1/sessions/{cid}", json={"title": "t"})
                assert r.status_code == 200
                for frames in (one, two):
                    kind_, event = await frames()
                    assert kind_ == "committed" and event["type"] == "meta" and event["title"] == "t"
                assert (await c.delete(f"/v1/sessions/{cid}", params={"mode": "cascade"})).status_code == 200
                for frames in (one, two):
                    assert (await frames())[1]["type"] == "purged"
                    assert await frames() == ("ended", {"reason": "purged"})
            # a purged conversation cannot be subscribed to
            r = await c.get(f"/v1/sessions/{cid}/subscribe")
            assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found"


async def test_a_provisional_reader_sees_the_running_turns_text() -> None:
    """Subscribed mid-turn: the text so far, then the rest, as provisional deltas, then the reply lands."""
    async with open_daemon(mock_config("mock?step_ms=20&prefill_us=5")) as d:
        c = d.client
        with trio.fail_after(60):
            cid = await create(c, messages=[U1], sampling={**SAMPLING, "max_tokens": 25})
            async with c.stream("POST", f"/v1/sessions/{cid}/generate", json={"stream": True}) as r:
                async for _chunk in r.aiter_bytes():
                    break  # the turn runs
                async with subscription("http", d, Path("/nonexistent"), cid, after=1) as frames:
                    seen = await read_until(frames, "committed", "message")
            said = "".join(x["text"] for k, x in seen if k == "provisional")
            assert seen[0][1]["type"] == "turn" and said and said == seen[-1][1]["message"]["content"]


async def test_a_lagging_subscriber_is_ended_lagged_and_resubscribes_from_its_cursor(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import superfluid.sessions._conversations as conversations

    import gc

    from superfluid.api import App

    monkeypatch.setattr(conversations, "WATCH_QUEUE", 3)
    async with open_daemon(mock_config()) as d:
        c = d.client
        with trio.fail_after(60):
            cid = await create(c, messages=[U1])
            async with subscription("http", d, Path("/none"), cid, after=1) as frames:
                r = await c.post(f"/v1/sessions/{cid}/messages", json={"messages": [U2] * 6})  # one write, 6 events
                assert r.status_code == 200
                seen = await read_until(frames, "ended")
            assert seen[-1] == ("ended", {"reason": "lagged"})
            cursor = max(e["id"] for k, e in seen if k == "committed")
            assert cursor == 4  # the three queued before it filled
            async with subscription("http", d, Path("/none"), cid, after=cursor) as frames:
                rest = [await frames() for _ in range(3)]
            assert [e["id"] for _k, e in rest] == [5, 6, 7]
            [app] = [a for a in gc.get_objects() if isinstance(a, App) and a.conversations.get(cid) is not None]
            for _ in range(500):  # the client left: its watcher goes with its request
                if not app.conversations.watchers(cid):
                    break
                await trio.sleep(0.01)
            assert not app.conversations.watchers(cid)


async def test_shutdown_ends_subscribers_with_ended_shutdown() -> None:
    import gc

    from superfluid.api import App

    async with open_daemon(mock_config()) as d:
        c = d.client
        with trio.fail_after(30):
            cid = await create(c, messages=[U1])
            async with subscription("http", d, Path("/none"), cid, after=1) as frames:
                apps = [a for a in gc.get_objects() if isinstance(a, App) and a.conversations.get(cid) is not None]
                apps[0].stopping.begin()
                assert await frames() == ("ended", {"reason": "shutdown"})


def test_a_watcher_is_bounded() -> None:
    w = Watcher("c", 2)
    w.push("committed", 1)
    w.push("committed", 2)
    assert w.ended is None and not w.roomy
    w.push("committed", 3)
    assert w.ended == "lagged" and list(w.queue) == [("committed", 1), ("committed", 2)]
    w.push("committed", 4)  # ignored once ended
    assert len(w.queue) == 2


# -- tenancy, running turns, the conversation's class, the socket file ---------------------------------------------------

async def test_another_tenant_gets_the_unknown_id_answer_on_every_tree_route() -> None:
    import attrs

    from superfluid.daemon._keypolicy import ApiKey

    keys = (ApiKey.from_secret("a", "ka"), ApiKey.from_secret("b", "kb"))
    async with open_daemon(attrs.evolve(mock_config(), api_keys=keys)) as d:
        a = httpx.AsyncClient(base_url=d.url, timeout=60, headers={"authorization": "Bearer ka"})
        b = httpx.AsyncClient(base_url=d.url, timeout=60, headers={"authorization": "Bearer kb"})
        with trio.fail_after(30):
            cid = await create(a, messages=[U1, ASKED], id="mine")
            assert cid == "mine"
            r = await a.post(f"/v1/sessions/{cid}/trim", json={"to": 2, "id": "branch"})
            assert r.status_code == 201 and r.json()["id"] == "branch" and r.json()["parent"] == "mine", r.text
            for method, tail, kw in (("PATCH", "", {"json": {"title": "x"}}), ("DELETE", "", {}),
                                     ("POST", "/rebase", {"json": {"edits": [{"drop": {"from": 1, "to": 2}}]}}),
                                     ("POST", "/trim", {"json": {"to": 1}}), ("GET", "/subscribe", {}),
                                     ("GET", "/tool_calls", {}),
                                     ("POST", "/tool_results", {"json": {"tool_call_id": "call_1", "content": "x"}})):
                r = await b.request(method, f"/v1/sessions/{cid}{tail}", **kw)
                assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found", (method, tail, r.text)
            assert (await tree(b)) == {}
            r = await a.patch(f"/v1/sessions/{cid}", json={"qos": "interactive"})  # above the key's max_class
            assert r.status_code == 403 and r.json()["error"]["code"] == "qos_class_not_allowed", r.text
            assert (await a.patch(f"/v1/sessions/{cid}", json={"qos": "background"})).json()["qos"] == "background"
            assert set(await tree(a)) == {"mine", "branch"}
            async with open_websocket_url(d.url.replace("http://", "ws://") + "/v1/ws",
                                          extra_headers=[("authorization", "Bearer kb")]) as ws:
                s = WsSurface(ws)
                for op, body in (("meta", {"title": "x"}), ("purge", {}), ("trim", {"to": 1}), ("tool_calls", {}),
                                 ("rebase", {"edits": [{"drop": {"from": 1, "to": 2}}]})):
                    ok, error = await s.call(op, cid, **body)
                    assert not ok and error["code"] == "session_not_found", (op, error)
                await s.put({"op": "subscribe", "session": cid, "id": 99})
                assert (await s.frame())["error"]["code"] == "session_not_found"
                ok, tree_ = await s.call("tree")
                assert ok and tree_["data"] == []
            # the owner's purge (reroot) leaves the branch a root
            r = await a.delete(f"/v1/sessions/{cid}")
            assert r.status_code == 200 and r.json()["purged"] == ["mine"] and r.json()["rerooted"] == ["branch"]
            assert (await tree(a))["branch"]["parent"] is None
        await a.aclose()
        await b.aclose()


async def test_purge_stops_a_running_turn_first_and_a_conversations_qos_runs_its_turns() -> None:
    async with open_daemon(mock_config("mock?step_ms=5&prefill_us=5")) as d:
        c = d.client
        with trio.fail_after(30):
            cid = await create(c, messages=[U1], sampling={**SAMPLING, "max_tokens": 100000})
            r = await c.patch(f"/v1/sessions/{cid}", json={"qos": "background"})
            assert r.status_code == 200
            async with c.stream("POST", f"/v1/sessions/{cid}/generate", json={"stream": True}) as r:
                gen = r.headers["x-superfluid-session"]
                async for _chunk in r.aiter_bytes():
                    break
            turn = [e for e in await events(c, cid) if e["type"] == "turn"][0]
            assert turn["params"]["qos"] == "background"  # the conversation's class
            assert (await c.get(f"/v1/sessions/{cid}")).json()["generating"]
            r = await c.delete(f"/v1/sessions/{cid}", params={"mode": "cascade"})
            assert r.status_code == 200 and r.json()["purged"] == [cid], r.text
            info = (await c.get(f"/v1/sessions/{gen}")).json()
            assert not info["generating"] and info["finish_reason"] == "cancelled", info
            assert (await c.get(f"/v1/sessions/{cid}/events")).status_code == 404


async def test_the_socket_file_is_private_replaces_a_stale_one_and_refuses_a_live_one() -> None:
    from superfluid.daemon._socket import open_socket_listener

    path = short_dir() / "s.sock"
    listener = await open_socket_listener(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    with pytest.raises(OSError, match="another server"):
        await open_socket_listener(path)
    await listener.aclose()  # the file stays: stale
    again = await open_socket_listener(path)
    await again.aclose()
    path.unlink()
    path.write_text("not a socket")
    with pytest.raises(OSError, match="not a socket"):
        await open_socket_listener(path)


def test_serve_takes_a_socket_path() -> None:
    from superfluid.cli._main import build_parser

    args = build_parser().parse_args(["serve", "--runtime", "mock", "--socket", "/tmp/x.sock"])
    assert str(args.socket) == "/tmp/x.sock"


@pytest.mark.parametrize("kind", ["ws", "socket"])
async def test_unsubscribe_ends_a_conversation_subscription(kind: str) -> None:
    sock = short_dir() / "sf.sock"
    async with open_daemon(mock_config(socket=sock)) as d:
        c = d.client
        with trio.fail_after(30):
            cid = await create(c, messages=[U1])
            async with surface(kind, d, sock) as s:
                assert isinstance(s, FrameSurface)
                await s.put({"op": "subscribe", "session": cid, "after": 1})
                assert (await s.frame())["op"] == "subscribed"
                await s.put({"op": "subscribe", "session": cid, "id": 7})
                assert (await s.frame())["error"]["code"] == "already_subscribed"
                await c.post(f"/v1/sessions/{cid}/messages", json={"messages": [U2]})
                assert (await s.frame())["event"]["id"] == 2
                await s.put({"op": "unsubscribe", "session": cid, "id": 8})
                assert (await s.frame()) == {"op": "unsubscribed", "session": cid, "id": 8}
                await c.post(f"/v1/sessions/{cid}/messages", json={"messages": [U2]})
                await s.put({"op": "tree", "id": 9})
                assert (await s.frame())["op"] == "tree"  # the next frame is the reply: no event after unsubscribe


async def test_a_page_patches_only_with_json_after_a_preflight_that_grants_patch() -> None:
    async with open_daemon(mock_config()) as d:
        c = d.client
        with trio.fail_after(30):
            cid = await create(c, messages=[U1])
            page = {"origin": "http://localhost:5173"}
            r = await c.options(f"/v1/sessions/{cid}", headers={**page, "access-control-request-method": "PATCH"})
            assert r.status_code == 204 and "PATCH" in r.headers["access-control-allow-methods"]
            r = await c.patch(f"/v1/sessions/{cid}", content=b'{"title": "x"}',
                              headers={**page, "content-type": "text/plain"})
            assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
            r = await c.patch(f"/v1/sessions/{cid}", json={"title": "x"}, headers=page)
            assert r.status_code == 200 and r.headers["access-control-allow-origin"] == page["origin"]


async def test_a_socket_client_that_ends_its_side_still_gets_its_replies() -> None:
    sock = short_dir() / "sf.sock"
    async with open_daemon(mock_config(socket=sock)) as d:
        with trio.fail_after(30):
            cid = await create(d.client, messages=[U1])
            stream = await trio.open_unix_socket(str(sock))
            await stream.send_all(b'{"op":"tree","id":1}\n\n{"op":"events","session":"%s"}' % cid.encode())
            await stream.send_eof()  # (the last line has no newline)
            data = b""
            while chunk := await stream.receive_some(65536):
                data += chunk
            replies = [json.loads(line) for line in data.splitlines()]
            assert [r["op"] for r in replies] == ["tree", "events"]
            assert replies[0]["data"][0]["id"] == cid and replies[1]["last_event_id"] == 1
            await stream.aclose()


async def test_an_export_without_content_leaves_out_titles_and_edited_messages(tmp_path: Path) -> None:
    import os
    import sys

    async def cli(*args: str) -> tuple[int, str]:
        proc = await trio.run_process([sys.executable, "-m", "superfluid", *args], check=False, capture_stdout=True,
                                      capture_stderr=True, env=dict(os.environ))
        return proc.returncode, proc.stdout.decode()

    async with open_daemon(mock_config(sessions=tmp_path)) as d:
        c = d.client
        with trio.fail_after(30):
            cid = await create(c, messages=[U1])
            await c.patch(f"/v1/sessions/{cid}", json={"title": "my secret plans"})
            r = await c.post(f"/v1/sessions/{cid}/rebase", json={"edits": [
                {"replace": {"from": 1, "to": 2, "message": {"role": "user", "content": "hidden words"}}}]})
            branch = r.json()["id"]
            await c.delete(f"/v1/sessions/{cid}")
    with trio.fail_after(60):
        rc, out = await cli("session", "export", branch, "--sessions", str(tmp_path))
        assert rc == 0 and "hidden words" not in out and "fork" in out
        [marker] = [e for e in map(json.loads, out.splitlines()) if e["type"] == "fork"]
        assert marker["edits"] == [{"replace": {"from": 1, "to": 2}}]
        rc, out = await cli("session", "export", cid, "--sessions", str(tmp_path))
        assert rc == 0 and "secret" not in out and '"type":"purged"' in out
        rc, out = await cli("session", "inspect", cid, "--sessions", str(tmp_path))
        assert rc == 0 and out.startswith(f"session {cid} (conversation): purged"), out
        rc, out = await cli("session", "export", branch, "--include-content", "--sessions", str(tmp_path))
        assert "hidden words" in out
