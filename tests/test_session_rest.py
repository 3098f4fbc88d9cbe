"""The rest of the session tree (#48): tool cancel, permissions and pin, each over HTTP, the
WebSocket and the unix socket, each an event replayed after a restart (SPEC.md §7, "The session tree")."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import pytest
import trio

from .conftest import open_daemon, mock_config
from .test_session_tree import (
    ASKED, U1, FrameSurface, HttpSurface, Surface, create, events, short_dir, subscription, surface,
)

# op -> (method, path after /v1/sessions/{id}, the body's field that goes in the path)
_HTTP: dict[str, tuple[str, str, str | None]] = {"tool_cancel": ("POST", "/tool_calls/{tool_call_id}/cancel", "tool_call_id"),
         "permission_request": ("POST", "/permissions", None),
         "permission_response": ("POST", "/permissions/{permission}", "permission"),
         "permissions": ("GET", "/permissions", None),
         "pin": ("POST", "/pin", None)}


async def call(s: Surface, op: str, session: str, **body: Any) -> tuple[bool, dict[str, Any]]:
    """``op`` over ``s``: over HTTP the route, else the op (its reply frame without op, id, session)."""
    if isinstance(s, FrameSurface) or op not in _HTTP:
        ok, reply = await s.call(op, session, **body)
        return ok, reply.get("permission", reply) if ok else reply
    assert isinstance(s, HttpSurface)
    method, tail, field = _HTTP[op]
    if field is not None:
        tail = tail.replace("{" + field + "}", str(body.pop(field)))
    if method == "GET":
        r = await s.client.get(f"/v1/sessions/{session}{tail}")
    else:
        r = await s.client.post(f"/v1/sessions/{session}{tail}", json=body)
    data = r.json()
    return r.status_code < 400, data.get("error", data)


def statuses(calls: dict[str, Any]) -> dict[str, str]:
    return {c["id"]: c["status"] for c in calls["data"]}


@pytest.mark.parametrize("kind", ["http", "ws", "socket"])
async def test_a_tool_cancel_is_an_event_the_call_stays_open_until_answered_and_survives_a_restart(
        kind: str) -> None:
    home = short_dir()
    sock = home / "sf.sock"
    config = mock_config(socket=sock, sessions=home / "sessions")
    async with open_daemon(config) as d:
        c = d.client
        with trio.fail_after(60):
            cid = await create(c, messages=[U1, ASKED])
            async with surface(kind, d, sock) as s, subscription(kind, d, sock, cid, after=2) as watch:
                ok, done = await call(s, "tool_cancel", cid, tool_call_id="call_1")
                assert ok and done["status"] == "cancel_requested" and done["event"] == 3, done
                assert await watch() == ("committed", {**(await events(c, cid))[3]})
                assert (await events(c, cid))[3]["type"] == "tool_cancel"
                assert (await events(c, cid))[3]["call_id"] == "call_1"
                ok, calls = await call(s, "tool_calls", cid)
                assert ok and statuses(calls) == {"call_1": "cancel_requested", "call_2": "open"}
                ok, error = await call(s, "tool_cancel", cid, tool_call_id="call_1")
                assert not ok and error["code"] == "cancel_already_requested", error
                ok, error = await call(s, "tool_cancel", cid, tool_call_id="nope")
                assert not ok and error["code"] == "tool_call_not_found", error
                ok, error = await call(s, "tool_cancel", "c-nope", tool_call_id="call_1")
                assert not ok and error["code"] == "session_not_found", error
                ok, done = await call(s, "tool_cancel", cid, tool_call_id="call_2")
                assert ok and done["event"] == 4
                ok, _ = await call(s, "tool_result", cid, tool_call_id="call_1", outcome="cancelled")
                assert ok
                ok, calls = await call(s, "tool_calls", cid)
                assert ok and statuses(calls) == {"call_2": "cancel_requested"}
                ok, error = await call(s, "tool_cancel", cid, tool_call_id="call_1")  # answered: no longer open
                assert not ok and error["code"] == "tool_call_not_found", error
                before = await events(c, cid)
    async with open_daemon(config) as d:
        c = d.client
        with trio.fail_after(60):
            assert await events(c, cid) == before
            async with surface(kind, d, sock) as s:
                ok, calls = await call(s, "tool_calls", cid)
                assert ok and statuses(calls) == {"call_2": "cancel_requested"}
                ok, _ = await call(s, "tool_result", cid, tool_call_id="call_2", content="12:00")  # a result answers
                assert ok
                ok, calls = await call(s, "tool_calls", cid)
                assert ok and calls["data"] == []


@pytest.mark.parametrize("kind", ["http", "ws", "socket"])
async def test_permissions_are_requested_answered_once_listed_and_survive_a_restart(kind: str) -> None:
    home = short_dir()
    sock = home / "sf.sock"
    config = mock_config(socket=sock, sessions=home / "sessions")
    async with open_daemon(config) as d:
        c = d.client
        with trio.fail_after(60):
            cid = await create(c, messages=[U1, ASKED])
            async with surface(kind, d, sock) as s, subscription(kind, d, sock, cid, after=2) as watch:
                ok, one = await call(s, "permission_request", cid, tool_call_id="call_1", tool="weather",
                                     arguments={"city": "Oslo"}, reason="reads the network")
                assert ok and one["id"].startswith("perm-") and one["status"] == "pending", one
                assert (one["tool_call_id"], one["tool"], one["arguments"], one["reason"]) == (
                    "call_1", "weather", {"city": "Oslo"}, "reads the network")
                kind_, event = await watch()
                assert kind_ == "committed" and event["type"] == "permission_request" and event["id"] == 3
                assert event["permission"] == one["id"] and event["arguments"] == {"city": "Oslo"}
                ok, two = await call(s, "permission_request", cid)  # every field optional
                assert ok and two["status"] == "pending" and two["tool"] is None
                await watch()
                ok, three = await call(s, "permission_request", cid, tool="time")
                assert ok
                await watch()
                ok, error = await call(s, "permission_request", cid, colour="red")
                assert not ok and error["param"] == "colour", error
                ok, answered = await call(s, "permission_response", cid, permission=one["id"], allow=True, note="fine")
                assert ok and answered["status"] == "allowed" and answered["note"] == "fine", answered
                kind_, event = await watch()
                assert event["type"] == "permission_response" and event["allow"] is True and event["id"] == 6
                assert event["permission"] == one["id"]
                ok, error = await call(s, "permission_response", cid, permission=one["id"], allow=False)
                assert not ok and error["code"] == "already_answered", error
                ok, error = await call(s, "permission_response", cid, permission="perm-nope", allow=False)
                assert not ok and error["code"] == "permission_not_found", error
                ok, error = await call(s, "permission_response", cid, permission=two["id"], allow="yes")
                assert not ok and error["param"] == "allow", error
                ok, answered = await call(s, "permission_response", cid, permission=two["id"], allow=False)
                assert ok and answered["status"] == "denied" and answered["note"] is None
                ok, listed = await call(s, "permissions", cid)
                assert ok and [(p["id"], p["status"]) for p in listed["data"]] == [
                    (one["id"], "allowed"), (two["id"], "denied"), (three["id"], "pending")]
                before = listed
    async with open_daemon(config) as d:
        with trio.fail_after(60):
            async with surface(kind, d, sock) as s:
                ok, listed = await call(s, "permissions", cid)
                assert ok and listed == before
                ok, answered = await call(s, "permission_response", cid, permission=three["id"], allow=True)
                assert ok and answered["status"] == "allowed"
                ok, error = await call(s, "permission_response", cid, permission=one["id"], allow=True)
                assert not ok and error["code"] == "already_answered"


async def test_at_most_256_permission_requests_are_pending_per_conversation() -> None:
    import superfluid.api._conversations as conversations

    async with open_daemon(mock_config()) as d:
        c = d.client
        with trio.fail_after(30):
            cid = await create(c, messages=[U1])
            pids = []
            for _ in range(conversations.MAX_PENDING_PERMISSIONS):
                r = await c.post(f"/v1/sessions/{cid}/permissions", json={})
                assert r.status_code == 201, r.text
                pids.append(r.json()["id"])
            r = await c.post(f"/v1/sessions/{cid}/permissions", json={"tool": "x"})
            assert r.status_code == 429 and r.json()["error"]["code"] == "too_many_pending_permissions", r.text
            r = await c.post(f"/v1/sessions/{cid}/permissions/{pids[0]}", json={"allow": False})
            assert r.status_code == 200
            r = await c.post(f"/v1/sessions/{cid}/permissions", json={"tool": "x"})  # one answered: room again
            assert r.status_code == 201, r.text
            r = await c.put(f"/v1/sessions/{cid}/permissions", json={})
            assert r.status_code == 405


def two_models(**kw: Any) -> Any:
    from superfluid.serving import ModelSource

    side = tuple(ModelSource(spec=f"mock?name={n}&step_ms=1", runtime="mock", name=n) for n in ("main", "side"))
    return mock_config(models=side, idle_timeout_s=0.5, **kw)


async def loaded(c: Any) -> set[str]:
    return {m["id"] for m in (await c.get("/v1/models")).json()["data"] if m["loaded"]}


async def until_unloaded(c: Any, name: str, within: float) -> float:
    """Seconds until model ``name`` is unloaded (at most ``within``)."""
    t0 = trio.current_time()
    with trio.fail_after(within):
        while True:  # (polled: the daemon in another task says nothing when it unloads)
            if name not in await loaded(c):
                break
            await trio.sleep(0.05)
    return trio.current_time() - t0


@pytest.mark.parametrize("kind", ["http", "ws", "socket"])
async def test_a_pinned_conversation_holds_its_model_past_the_idle_timeout_and_after_a_restart(kind: str) -> None:
    import time

    home = short_dir()
    sock = home / "sf.sock"
    config = two_models(socket=sock, sessions=home / "sessions")
    async with open_daemon(config) as d:
        c = d.client
        with trio.fail_after(60):
            r = await c.post("/v1/sessions", json={"model": "side", "messages": [U1]})
            assert r.status_code == 201, r.text
            cid = r.json()["id"]
            assert r.json()["pinned_until"] is None and "side" in await loaded(c)
            async with surface(kind, d, sock) as s:
                for bad in (-1, 86_401, "10", True):
                    ok, error = await call(s, "pin", cid, ttl_s=bad)
                    assert not ok and error["param"] == "ttl_s", error
                ok, error = await call(s, "pin", "c-nope", ttl_s=5)
                assert not ok and error["code"] == "session_not_found"
                ok, done = await call(s, "pin", cid, ttl_s=1.0)  # runs out: the idle timeout counts from then
                assert ok and done["pinned_until"] == pytest.approx(time.time() + 1.0, abs=0.5), done
                assert 1.0 <= await until_unloaded(c, "side", 10) + 0.1  # (not before the pin ran out)
                r = await c.post("/v1/chat/completions", json={"model": "side", "max_tokens": 1,
                                                               "messages": [U1]})
                assert r.status_code == 200 and "side" in await loaded(c)
                ok, done = await call(s, "pin", cid, ttl_s=600)
                assert ok and done["pinned_until"] == pytest.approx(time.time() + 600, abs=5)
                until = done["pinned_until"]
                await trio.sleep(1.2)  # past --idle-timeout 0.5
                assert "side" in await loaded(c)
                [ps] = [m for m in (await c.get("/api/ps")).json()["models"] if m["name"] == "side"]
                assert datetime.fromisoformat(ps["expires_at"].replace("Z", "+00:00")).timestamp() >= until
                assert (await c.get(f"/v1/sessions/{cid}")).json()["pinned_until"] == until
                r = await c.post(f"/v1/sessions/{cid}/fork", json={})  # a branch is not pinned by the copies
                assert r.status_code == 201 and r.json()["pinned_until"] is None, r.text
                events_ = await events(c, cid)
                assert events_[-1]["type"] == "pin" and events_[-1]["deadline"] == round(until * 1000)
    async with open_daemon(config) as d:  # an unexpired pin holds after a restart
        c = d.client
        with trio.fail_after(60):
            assert (await c.get(f"/v1/sessions/{cid}")).json()["pinned_until"] == until
            r = await c.post("/v1/chat/completions", json={"model": "side", "max_tokens": 1, "messages": [U1]})
            assert r.status_code == 200
            await trio.sleep(1.2)
            assert "side" in await loaded(c)
            async with surface(kind, d, sock) as s:
                ok, done = await call(s, "pin", cid, ttl_s=0)  # unpins
                assert ok and done["pinned_until"] is None
            await until_unloaded(c, "side", 10)
            assert (await c.get(f"/v1/sessions/{cid}")).json()["pinned_until"] is None


REST_ROUTES = [("POST", "/tool_calls/call_1/cancel", {}), ("POST", "/permissions", {}),
               ("GET", "/permissions", {}), ("POST", "/permissions/perm-x", {"allow": True}),
               ("POST", "/pin", {"ttl_s": 5})]
REST_OPS = [("tool_cancel", {"tool_call_id": "call_1"}), ("permission_request", {}), ("permissions", {}),
            ("permission_response", {"permission": "perm-x", "allow": True}), ("pin", {"ttl_s": 5})]


async def test_another_tenant_gets_the_unknown_id_answer_on_the_rest_of_the_tree() -> None:
    import attrs
    import httpx
    from trio_websocket import open_websocket_url

    from superfluid.daemon._keypolicy import ApiKey

    from .test_session_tree import WsSurface

    keys = (ApiKey.from_secret("a", "ka"), ApiKey.from_secret("b", "kb"))
    async with open_daemon(attrs.evolve(mock_config(), api_keys=keys)) as d:
        a = httpx.AsyncClient(base_url=d.url, timeout=60, headers={"authorization": "Bearer ka"})
        b = httpx.AsyncClient(base_url=d.url, timeout=60, headers={"authorization": "Bearer kb"})
        with trio.fail_after(30):
            cid = await create(a, messages=[U1, ASKED], id="mine")
            for method, tail, body in REST_ROUTES:
                r = await b.request(method, f"/v1/sessions/{cid}{tail}", json=body if method == "POST" else None)
                assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found", (tail, r.text)
            async with open_websocket_url(d.url.replace("http://", "ws://") + "/v1/ws",
                                          extra_headers=[("authorization", "Bearer kb")]) as ws:
                s = WsSurface(ws)
                for op, body in REST_OPS:
                    ok, error = await s.call(op, cid, **body)
                    assert not ok and error["code"] == "session_not_found", (op, error)
            assert len(await events(a, cid)) == 3  # nothing of b's was logged
        await a.aclose()
        await b.aclose()


async def test_an_export_without_content_leaves_out_what_permissions_say(tmp_path: Any) -> None:
    import json
    import os
    import sys

    async with open_daemon(mock_config(sessions=tmp_path)) as d:
        c = d.client
        with trio.fail_after(30):
            cid = await create(c, messages=[U1])
            r = await c.post(f"/v1/sessions/{cid}/permissions", json={
                "tool": "wipe_disk", "arguments": {"path": "/secret/place"}, "reason": "private reasons"})
            r = await c.post(f"/v1/sessions/{cid}/permissions/{r.json()['id']}", json={"allow": False,
                                                                                      "note": "private note"})
            assert r.status_code == 200
    with trio.fail_after(60):
        proc = await trio.run_process([sys.executable, "-m", "superfluid", "session", "export", cid, "--sessions",
                                       str(tmp_path)], check=False, capture_stdout=True, env=dict(os.environ))
        out = proc.stdout.decode()
        assert proc.returncode == 0 and '"type":"permission_response"' in out, out
        assert not any(w in out for w in ("wipe_disk", "secret", "private")), out
        assert [e["type"] for e in map(json.loads, out.splitlines())][-2:] == ["permission_request",
                                                                               "permission_response"]
