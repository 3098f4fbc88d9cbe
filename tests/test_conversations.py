"""Conversations: server-side chat histories (SPEC.md §7, "Conversations").

Create, append, generate (streamed and whole), the reply joining the
conversation, busy refusals, forks, typed errors, a daemon SIGKILL mid-turn,
the WebSocket ops, and the journal's rules and retention for conversations."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import trio
from trio_websocket import open_websocket_url

from superfluid.sessions._conversations import ConversationStore, Turn
from superfluid.sessions._resumable import SessionStore
from superfluid.api._turns import serve_turn
from superfluid.chat import ReplyParser, Tool, ToolCallParser, ToolWire
from superfluid.journal import JournalConfig, SessionStateError, open_journal
from superfluid.proto import Sampling
from superfluid.proto._wal import (
    body_conversation, body_created, body_fork, body_message, body_prompt, body_turn, body_turn_end,
)
from superfluid.sched import Job

from .conftest import Daemon, mock_config, start_daemon
from .test_sessions import _free_port, _reap, _spawn, _wait_ready, read_sse
from .test_ws import expect, get, put, ws_url

SAMPLING = {"temperature": 0, "max_tokens": 16, "ignore_eos": True}
U1 = {"role": "user", "content": "tell me about rivers"}
U2 = {"role": "user", "content": "and mountains?"}


def content_of(events: list[tuple[str | None, dict]]) -> str:
    return "".join((c.get("delta") or {}).get("content") or "" for _i, e in events for c in e.get("choices") or [])


async def chat(d: Daemon | httpx.AsyncClient, messages: list[dict[str, Any]], **over: Any) -> str:
    """The reply ``/v1/chat/completions`` gives to ``messages`` (the reference a turn must equal)."""
    client = d.client if isinstance(d, Daemon) else d
    r = await client.post("/v1/chat/completions", json={"model": "mock", "messages": messages, **SAMPLING, **over})
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["message"]["content"])


async def create(client: httpx.AsyncClient, **body: Any) -> str:
    r = await client.post("/v1/sessions", json={"model": "mock", "sampling": SAMPLING, **body})
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


async def generate(client: httpx.AsyncClient, cid: str, **body: Any) -> dict[str, Any]:
    r = await client.post(f"/v1/sessions/{cid}/generate", json=body)
    assert r.status_code == 200, r.text
    return dict(r.json())


async def events(client: httpx.AsyncClient, cid: str, after: int = -1) -> list[dict[str, Any]]:
    r = await client.get(f"/v1/sessions/{cid}/events", params={"after": after})
    assert r.status_code == 200, r.text
    return list(r.json()["events"])


async def test_conversation_turns_join_it_and_the_second_sees_the_first(nursery: trio.Nursery) -> None:
    d = await start_daemon(nursery, mock_config())
    c = d.client
    with trio.fail_after(30):
        cid = await create(c, system="be brief", messages=[U1])
        assert cid.startswith("c-")
        whole = await c.post(f"/v1/sessions/{cid}/generate", json={})
        assert whole.status_code == 200
        gen1 = whole.headers["x-superfluid-session"]
        reply = whole.json()
        a1 = reply["choices"][0]["message"]["content"]
        assert reply["object"] == "chat.completion" and reply["choices"][0]["finish_reason"] == "length"
        assert a1 == await chat(d, [{"role": "system", "content": "be brief"}, U1])
        evs = await events(c, cid)
        assert [e["type"] for e in evs] == ["conversation", "message", "turn", "message"]
        assert [e["id"] for e in evs] == [0, 1, 2, 3]
        assert evs[2]["generation"] == gen1
        assert evs[3]["message"] == {"role": "assistant", "content": a1}
        assert evs[3]["turn"] == 2 and evs[3]["finish"] == "length"
        assert reply["superfluid"] == {"conversation": cid, "turn": 2, "event": 3, "message": evs[3]["message"]}

        r = await c.post(f"/v1/sessions/{cid}/messages", json={"messages": [U2]})
        assert r.status_code == 200 and r.json()["events"] == [4]
        async with c.stream("POST", f"/v1/sessions/{cid}/generate", json={"stream": True, "max_tokens": 20}) as r:
            assert r.status_code == 200
            gen2 = r.headers["x-superfluid-session"]
            streamed, done = await read_sse(r)
        assert done and gen2 != gen1
        a2 = content_of(streamed)
        ids = [int(i) for i, _e in streamed if i is not None]
        assert ids == sorted(ids) and ids[-1] == 20
        final = streamed[-1][1]
        assert final["choices"][0]["finish_reason"] == "length" and final["usage"]["completion_tokens"] == 20
        # the second turn's prompt holds the first turn: the reply equals a chat over the whole history
        history = [{"role": "system", "content": "be brief"}, U1, {"role": "assistant", "content": a1}, U2]
        assert a2 == await chat(d, history, max_tokens=20)
        assert a2 != await chat(d, [{"role": "system", "content": "be brief"}, U2], max_tokens=20)
        last = (await events(c, cid, after=4))
        assert [e["type"] for e in last] == ["turn", "message"]
        assert last[1]["message"]["content"] == a2 and final["superfluid"]["event"] == last[1]["id"] == 6
        info = (await c.get(f"/v1/sessions/{cid}")).json()
        assert info["kind"] == "conversation" and info["messages"] == 4 and info["generation"] == gen2
        assert not info["generating"]
        # the turn's generation is an ordinary session, resumable by its own id
        async with c.stream("GET", f"/v1/sessions/{gen2}/stream?after=0") as r:
            again, done = await read_sse(r)
        assert done and content_of(again) == a2
    d.scope.cancel()


async def test_a_running_turn_refuses_appends_and_turns_and_can_be_forked_and_stopped(nursery: trio.Nursery) -> None:
    d = await start_daemon(nursery, mock_config("mock?step_ms=5&prefill_us=5"))
    c = d.client
    with trio.fail_after(30):
        cid = await create(c, messages=[U1], sampling={**SAMPLING, "max_tokens": 100000})
        async with c.stream("POST", f"/v1/sessions/{cid}/generate", json={"stream": True}) as r:
            gen = r.headers["x-superfluid-session"]
            await read_sse(r, limit=3)
        # the client left; the turn runs on
        for path, body in (("generate", {}), ("messages", {"messages": [U2]})):
            r = await c.post(f"/v1/sessions/{cid}/{path}", json=body)
            assert r.status_code == 409 and r.json()["error"]["code"] == "session_busy", r.text
        assert (await c.get(f"/v1/sessions/{cid}")).json()["generating"]
        assert (await c.get(f"/v1/sessions/{gen}")).json()["generating"]
        # a fork while busy leaves the running turn out; copied events keep their ids
        r = await c.post(f"/v1/sessions/{cid}/fork", json={})
        assert r.status_code == 201
        fork = r.json()["id"]
        source, copied = await events(c, cid), await events(c, fork)
        assert [e["type"] for e in source] == ["conversation", "message", "turn"]
        assert [(e["id"], e["type"]) for e in copied] == [(0, "conversation"), (1, "message"), (2, "fork")]
        assert copied[:2] == [{**e, "ts": copied[i]["ts"]} for i, e in enumerate(source[:2])]
        assert copied[2]["source"] == cid and copied[2]["at"] == 2
        assert not (await c.get(f"/v1/sessions/{fork}")).json()["generating"]
        # stop it: what it said lands, finish "cancelled"
        r = await c.delete(f"/v1/sessions/{cid}/generation")
        assert r.status_code == 200 and r.json()["generation"] == gen
        async with c.stream("GET", f"/v1/sessions/{cid}/stream", params={"after": 0}) as r:
            assert r.headers["x-superfluid-session"] == gen
            followed, done = await read_sse(r)
        assert done
        final = followed[-1][1]
        assert final["choices"][0]["finish_reason"] == "cancelled"
        said = content_of(followed)
        assert said and final["superfluid"]["message"] == {"role": "assistant", "content": said}
        last = (await events(c, cid))[-1]
        assert last["type"] == "message" and last["finish"] == "cancelled" and last["turn"] == 2
        r = await c.delete(f"/v1/sessions/{cid}/generation")
        assert r.status_code == 409 and r.json()["error"]["code"] == "no_generation"
        assert (await c.post(f"/v1/sessions/{cid}/messages", json={"messages": [U2]})).status_code == 200
    d.scope.cancel()


async def test_a_fork_at_an_event_generates_what_the_original_did_there(nursery: trio.Nursery) -> None:
    d = await start_daemon(nursery, mock_config())
    c = d.client
    with trio.fail_after(30):
        cid = await create(c, messages=[U1])
        a1 = (await generate(c, cid))["choices"][0]["message"]["content"]
        await c.post(f"/v1/sessions/{cid}/messages", json={"messages": [U2]})
        a2 = (await generate(c, cid))["choices"][0]["message"]["content"]
        source = await events(c, cid)
        for at, expected in ((4, a2), (1, a1)):
            r = await c.post(f"/v1/sessions/{cid}/fork", json={"at": at})
            assert r.status_code == 201, r.text
            assert r.json()["forked_from"] == {"id": cid, "at": at}
            fork = r.json()["id"]
            copied = await events(c, fork)
            assert [(e["id"], e["type"]) for e in copied[:-1]] == [(e["id"], e["type"]) for e in source[: at + 1]]
            assert copied[-1]["type"] == "fork" and copied[-1]["id"] == at + 1
            assert (await generate(c, fork))["choices"][0]["message"]["content"] == expected
        # the original is untouched by its forks
        assert await events(c, cid) == source
    d.scope.cancel()


async def test_conversation_errors_are_typed(nursery: trio.Nursery) -> None:
    d = await start_daemon(nursery, mock_config())
    c = d.client

    async def fails(method: str, path: str, status: int, *, code: str | None = None, param: str | None = None,
                    **kw: Any) -> None:
        r = await c.request(method, path, **kw)
        assert r.status_code == status, (path, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["type"] == ("invalid_request_error" if status < 500 else "server_error")
        if code is not None:
            assert err["code"] == code, err
        if param is not None:
            assert err["param"] == param, err

    with trio.fail_after(30):
        for method, tail in (("POST", "/messages"), ("POST", "/generate"), ("GET", "/events"), ("POST", "/fork")):
            await fails(method, f"/v1/sessions/nope{tail}", 404, code="session_not_found", json={})
        await fails("GET", "/v1/sessions/nope", 404, code="session_not_found")
        await fails("DELETE", "/v1/sessions", 405)  # (GET lists them: test_operator.py)
        await fails("POST", "/v1/sessions", 400, param="model", json={})
        await fails("POST", "/v1/sessions", 404, code="model_not_found", json={"model": "absent"})
        await fails("POST", "/v1/sessions", 400, content=b"{not json")
        await fails("POST", "/v1/sessions", 400, param="system", json={"model": "mock", "system": 3})
        await fails("POST", "/v1/sessions", 400, param="colour", json={"model": "mock", "colour": "red"})
        await fails("POST", "/v1/sessions", 400, param="sampling.temperature",
                    json={"model": "mock", "sampling": {"temperature": 9}})
        await fails("POST", "/v1/sessions", 400, param="sampling.nucleus", json={"model": "mock", "sampling": {"nucleus": 1}})
        await fails("POST", "/v1/sessions", 400, param="id", json={"model": "mock", "id": "bad id!"})
        await fails("POST", "/v1/sessions", 400, param="messages[0].role",
                    json={"model": "mock", "messages": [{"role": "wizard", "content": "x"}]})
        await fails("POST", "/v1/sessions", 400, param="tools", json={"model": "mock", "tools": {}})
        # ids are server-made (with no keys configured, a client cannot name one)
        await fails("POST", "/v1/sessions", 400, param="id", json={"model": "mock", "id": "named-1"})
        cid = await create(c)
        # a generation session is no conversation
        async with c.stream("POST", "/v1/chat/completions", headers={"x-superfluid-resumable": "true"},
                            json={"model": "mock", "messages": [U1], "max_tokens": 2, "stream": True}) as r:
            gen = r.headers["x-superfluid-session"]
            await r.aread()
        await fails("POST", f"/v1/sessions/{gen}/messages", 404, code="session_not_found", json={"messages": [U1]})
        assert (await c.get(f"/v1/sessions/{gen}")).json()["completion_tokens"] == 2
        await fails("POST", f"/v1/sessions/{cid}/generate", 400, param="messages", json={})
        await fails("POST", f"/v1/sessions/{cid}/messages", 400, param="messages", json={"messages": []})
        await fails("POST", f"/v1/sessions/{cid}/messages", 400, param="messages", json={})
        await fails("POST", f"/v1/sessions/{cid}/messages", 400, param="messages[0].content",
                    json={"messages": [{"role": "user", "content": 5}]})
        assert (await c.post(f"/v1/sessions/{cid}/messages", json={"messages": [U1]})).status_code == 200
        await fails("POST", f"/v1/sessions/{cid}/generate", 400, param="nucleus", json={"nucleus": 1})
        await fails("POST", f"/v1/sessions/{cid}/generate", 400, param="temperature", json={"temperature": "hot"})
        await fails("POST", f"/v1/sessions/{cid}/generate", 400, param="stream", json={"stream": "yes"})
        await fails("POST", f"/v1/sessions/{cid}/generate", 400, param="qos", json={"qos": "urgent"})
        await fails("POST", f"/v1/sessions/{cid}/generate", 400, param="tool_choice",
                    json={"tool_choice": "required"})  # no tools declared
        await fails("GET", f"/v1/sessions/{cid}/events?after=abc", 400, param="after")
        await fails("GET", f"/v1/sessions/{cid}/events?limit=0", 400, param="limit")
        await fails("POST", f"/v1/sessions/{cid}/fork", 400, param="at", json={"at": 99})
        await fails("POST", f"/v1/sessions/{cid}/fork", 400, param="at", json={"at": "1"})
        await fails("GET", f"/v1/sessions/{cid}/generate", 405)
        await fails("GET", f"/v1/sessions/{cid}/stream", 409, code="no_generation")
        await fails("DELETE", f"/v1/sessions/{cid}/generation", 409, code="no_generation")
        # nothing above changed the conversation but the one append
        assert [e["type"] for e in await events(c, cid)] == ["conversation", "message"]
        # a body-less generate is fine
        r = await c.post(f"/v1/sessions/{cid}/generate")
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
    d.scope.cancel()


async def test_a_failed_turn_ends_with_turn_end_and_the_conversation_goes_on(nursery: trio.Nursery) -> None:
    d = await start_daemon(nursery, mock_config())
    c = d.client
    with trio.fail_after(30):
        cid = await create(c, messages=[{"role": "user", "content": "[[mock:fault_after=2]]"}])
        r = await c.post(f"/v1/sessions/{cid}/generate", json={})
        assert r.status_code == 500 and "fault" in r.json()["error"]["message"], r.text
        last = (await events(c, cid))[-1]
        assert last["type"] == "turn_end" and last["turn"] == 2 and last["finish"] == "error"
        assert "fault" in last["error"]["message"]
        assert not (await c.get(f"/v1/sessions/{cid}")).json()["generating"]
        assert (await c.post(f"/v1/sessions/{cid}/messages", json={"messages": [U2]})).status_code == 200
    d.scope.cancel()


async def test_daemon_sigkill_mid_turn_then_the_turn_resumes_and_lands(tmp_path: Path) -> None:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    sessions, log = tmp_path / "sessions", tmp_path / "daemon.log"
    proc = _spawn(port, sessions, log)
    try:
        await _wait_ready(url, proc)
        async with httpx.AsyncClient(base_url=url, timeout=30) as c:
            with trio.fail_after(60):
                ref = await chat(c, [U1], max_tokens=150)
                cid = await create(c, messages=[U1], sampling={**SAMPLING, "max_tokens": 150})
                async with c.stream("POST", f"/v1/sessions/{cid}/generate", json={"stream": True}) as r:
                    gen = r.headers["x-superfluid-session"]
                    head_events, done = await read_sse(r, limit=15)
                assert not done
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        proc = _spawn(port, sessions, log)
        await _wait_ready(url, proc)
        async with httpx.AsyncClient(base_url=url, timeout=30) as c:
            with trio.fail_after(60):
                before = await events(c, cid)
                assert [e["type"] for e in before][:3] == ["conversation", "message", "turn"]
                assert before[2]["generation"] == gen
                last_id = head_events[-1][0]
                async with c.stream("GET", f"/v1/sessions/{cid}/stream", headers={"Last-Event-ID": last_id}) as r:
                    assert r.status_code == 200 and r.headers["x-superfluid-session"] == gen
                    rest, done = await read_sse(r)
                assert done
                assert content_of(head_events) + content_of(rest) == ref
                after = await events(c, cid)
                assert [e["type"] for e in after] == ["conversation", "message", "turn", "message"]
                assert after[3]["message"] == {"role": "assistant", "content": ref} and after[3]["finish"] == "length"
                # the restored conversation takes new turns
                await c.post(f"/v1/sessions/{cid}/messages", json={"messages": [U2]})
                a2 = (await generate(c, cid, max_tokens=12))["choices"][0]["message"]["content"]
                assert a2 == await chat(c, [U1, {"role": "assistant", "content": ref}, U2], max_tokens=12)
    finally:
        _reap(proc)
    async with open_journal(sessions) as journal:
        records = journal.sessions[cid].events
        assert [rec.event_id for rec in records] == list(range(len(records)))
        assert records[3].epoch > records[2].epoch  # the reply landed after the restart
        assert len({rec.epoch for rec in journal.sessions[gen].events}) == 2  # one generation across both runs


async def test_ws_create_append_generate_events_fork(nursery: trio.Nursery) -> None:
    d = await start_daemon(nursery, mock_config())
    with trio.fail_after(30):
        async with open_websocket_url(ws_url(d)) as ws:
            await put(ws, op="create", id=1, body={"model": "mock", "sampling": SAMPLING})
            created = await expect(ws, "created")
            conv = created["session"]
            assert created["id"] == 1 and created["info"]["events"] == 1
            await put(ws, op="append", id=2, session=conv, body={"messages": [U1]})
            assert await expect(ws, "appended") == {"op": "appended", "session": conv, "events": [1], "id": 2}
            await put(ws, op="generate", id=3, session=conv, body={"max_tokens": 10})
            started = await expect(ws, "started")
            assert started["id"] == 3 and started["conversation"] == conv and started["turn"] == 2
            gen, parts = started["session"], []
            while (msg := await get(ws))["op"] == "delta":
                assert msg["session"] == gen
                parts.append(msg["text"])
            assert msg["op"] == "done" and msg["finish_reason"] == "length" and msg["event"] == 3
            text = "".join(parts)
            assert text == await chat(d, [U1], max_tokens=10)
            assert msg["message"] == {"role": "assistant", "content": text}
            await put(ws, op="generate", session=conv, body={"temperature": "hot"})
            assert (await expect(ws, "error"))["error"]["param"] == "temperature"
            await put(ws, op="events", id=4, session=conv, after=1)
            page = await expect(ws, "events")
            assert [e["type"] for e in page["events"]] == ["turn", "message"] and page["last_event_id"] == 3
            await put(ws, op="fork", id=5, session=conv, body={"at": 1})
            forked = await expect(ws, "forked")
            assert forked["source"] == conv and forked["info"]["forked_from"] == {"id": conv, "at": 1}
            await put(ws, op="generate", session=forked["session"], body={"max_tokens": 10})
            await expect(ws, "started")
            parts = []
            while (msg := await get(ws))["op"] == "delta":
                parts.append(msg["text"])
            assert "".join(parts) == text and msg["op"] == "done"
            await put(ws, op="events", session="nope")
            assert (await expect(ws, "error"))["error"]["code"] == "session_not_found"
            await put(ws, op="append", session=conv, body=[1])
            assert (await expect(ws, "error"))["error"]["param"] == "body"
    d.scope.cancel()


async def test_a_reply_with_tool_calls_lands_as_the_chat_route_parses_it(tmp_path: Path) -> None:
    """The owner reads the generation with the chat route's parser: a call becomes ``tool_calls``."""
    tool = Tool("weather", "", {"type": "object", "properties": {"city": {"type": "string"}}})
    async with open_journal(tmp_path) as journal:
        store, sessions = ConversationStore(journal), SessionStore(journal, resume_ttl_s=60)
        app = SimpleNamespace(sessions=sessions, conversations=store)
        await store.create("c", body_conversation(model="mock", tools=[tool.to_openai()]), [U1])
        job = Job(prompt=[1, 2], sampling=Sampling(), max_new=64, session="s")
        turn = Turn(conversation="c", generation="s", model=None, stops=[],
                    parser=ReplyParser(None, ToolCallParser(ToolWire.HERMES, [tool])))
        await store.begin(turn, {"sampling": {}})
        turn.session = await sessions.open(job, model="mock", kind="chat", stops=[], resumable=True)
        text = 'Let me look. <tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
        job.pieces = [text[i:i + 7].encode() for i in range(0, len(text), 7)]
        job.tokens = list(range(len(job.pieces)))
        job.finish_with("stop")
        with trio.fail_after(10):
            await serve_turn(app, turn)  # type: ignore[arg-type]
        assert turn.finish == "tool_calls"
        [call] = turn.message["tool_calls"]  # type: ignore[index]
        assert call["function"] == {"name": "weather", "arguments": '{"city": "Oslo"}'} and call["type"] == "function"
        assert turn.message["content"] == "Let me look."  # type: ignore[index]
        rec = journal.sessions["c"].records()[-1]
        assert rec.body == body_message(message=turn.message, turn=2, finish="tool_calls")  # type: ignore[arg-type]


async def test_journal_conversation_rules(tmp_path: Path) -> None:
    async with open_journal(tmp_path) as journal:
        await journal.append_many([("c", body_conversation(model="m")), ("c", body_message(message=U1))])
        await journal.append("g", body_created(params={}, klass="agent", model="m"))
        refused = [
            ("c", body_prompt(tokens=[1])),                                 # a generation's event
            ("g", body_message(message=U1)),                                # a conversation's event
            ("c", body_conversation(model="m")),                            # created twice
            ("c", body_turn_end(turn=5, finish="error")),                   # no such open turn
            ("n", body_message(message=U1)),                                # unknown session
        ]
        for sid, body in refused:
            with pytest.raises(SessionStateError):
                await journal.append(sid, body)
        await journal.append("c", body_turn(generation="g", params={}))
        for body in (body_turn(generation="g2", params={}), body_message(message=U2),
                     body_message(message={"role": "assistant", "content": "x"}, turn=1, finish="stop")):
            with pytest.raises(SessionStateError):  # a second turn; a message mid-turn; the wrong turn
                await journal.append("c", body)
        await journal.append("c", body_fork(source="x", at=0))  # markers are fine
        await journal.append("c", body_message(message={"role": "assistant", "content": "hi"}, turn=2, finish="stop"))
        await journal.append("c", body_message(message=U2))
        slog = journal.sessions["c"]
        assert slog.open_turn == -1 and not slog.done and slog.conversation is not None
        expected = slog.records()
    async with open_journal(tmp_path) as journal:  # replays whole, and stays appendable
        assert journal.sessions["c"].records() == expected
        assert [s.session for s in journal.interrupted()] == ["g"]  # the generation; never a conversation
        await journal.append("c", body_turn(generation="g3", params={}))
        assert journal.sessions["c"].open_turn == expected[-1].event_id + 1


async def test_journal_compaction_keeps_conversations_by_ttl_count_and_open_turn(tmp_path: Path) -> None:
    config = JournalConfig(keep_conversations=2, conversation_ttl_s=3600)
    async with open_journal(tmp_path, config=config) as journal:
        old = 1_000  # unix ms: long past the TTL
        await journal.append("stale", body_conversation(model="m"), ts=old)
        await journal.append("stale-busy", body_conversation(model="m"), ts=old)
        await journal.append("stale-busy", body_turn(generation="g", params={}), ts=old)
        for name in ("a", "b", "c"):
            await journal.append(name, body_conversation(model="m"))
        await journal.compact()
        assert set(journal.sessions) == {"stale-busy", "b", "c"}  # open turn kept; idle: the newest 2 within the TTL
        await journal.append("b", body_message(message=U1))  # still appendable after the rewrite
    async with open_journal(tmp_path, config=config) as journal:
        assert set(journal.sessions) == {"stale-busy", "b", "c"}
        assert journal.sessions["stale-busy"].open_turn == 1


def test_conversation_bodies_are_validated() -> None:
    from superfluid.proto._wal import validate_body

    bad = [
        {"type": "conversation", "model": "", "sampling": {}},
        {"type": "conversation", "model": "m", "sampling": []},
        {"type": "conversation", "model": "m", "sampling": {}, "tools": [1]},
        {"type": "conversation", "model": "m"},
        {"type": "message", "message": {"role": "wizard"}},
        {"type": "message", "message": {"role": "user", "content": 3}},
        {"type": "message", "message": {"role": "user"}, "turn": 1, "finish": "stop"},
        {"type": "message", "message": {"role": "assistant"}, "turn": 1},
        {"type": "turn", "generation": "", "params": {}},
        {"type": "turn", "generation": "g"},
        {"type": "turn_end", "turn": -1, "finish": "error"},
        {"type": "fork", "source": "s", "at": "1"},
        {"type": "fork", "source": "s", "at": 1, "extra": 1},
    ]
    for body in bad:
        with pytest.raises(ValueError):
            validate_body(body)
    assert validate_body({"type": "message", "message": U1}) == {"type": "message", "message": U1, "turn": None,
                                                                 "finish": None}
    assert json.loads(json.dumps(body_conversation(model="m", tools=({"type": "function"},))))["tools"] == [
        {"type": "function"}]
