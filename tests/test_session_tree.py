"""The session tree (issue #48, SPEC.md §7 "The session tree"): metadata, tree, rebase, trim,
purge, subscribe and the tool ledger, over HTTP, the WebSocket and the unix socket, and
their replay after a daemon restart."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from superfluid.journal import SessionStateError, open_journal
from superfluid.proto._wal import body_conversation, body_message, body_meta, body_purged, body_turn

from .conftest import mock_config, open_daemon

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
        with pytest.raises(SessionStateError):
            await journal.append("c", body_meta(version=2))
        await journal.compact()
        assert "c" not in journal.sessions and "d" in journal.sessions
