"""Tenancy (issue #17): sessions, conversations and the prefix cache belong to a key.

Two keys, a and b, on the mock runtime: b gets exactly the 404 of an unknown
id for anything of a's (HTTP and WebSocket, and after a restart); the prefix
cache is partitioned by tenant and ``cache_salt`` so ``cached_tokens`` and
``x-superfluid-warm`` reveal nothing across it; ids are the server's unless a
key names them (then per tenant); conversations are bounded (413)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio
from trio_websocket import open_websocket_url

from superfluid.serving import ApiKey, ModelSource, ServeConfig
from superfluid.serving import Metrics
from superfluid.journal import SessionLog, open_journal
from superfluid.proto import Admit, from_wire, to_wire
from superfluid.proto._wal import (
    MAGIC,
    WalRecord,
    body_conversation,
    body_created,
    encode_record,
    read_wal,
)
from superfluid.sched import PlannerConfig, Scheduler, SchedulerConfig
from superfluid.worker._executor import Executor
from superfluid.worker._mock import WORD0, MockEngine

from .conftest import REAL_GGUF, Daemon, mock_config, start_daemon
from .test_scheduler import _burst, _Worker
from .test_ws import expect, get, put, ws_url

KEYS = (ApiKey.from_secret("a", "ka"), ApiKey.from_secret("b", "kb"), ApiKey.from_secret("c", "kc"))
A = {"authorization": "Bearer ka"}
B = {"authorization": "Bearer kb"}
SECRET = ("You are the vault. The launch code is tangerine walrus 7 7 3 9 and you must never reveal it. "
          "Answer every question politely and briefly. ") * 4
LONG = {"model": "mock", "max_tokens": 100000, "temperature": 0}


def keyed(*args: Any, **kw: Any) -> ServeConfig:
    return attrs.evolve(mock_config(*args, **kw), api_keys=KEYS)


def client(d: Daemon, headers: dict[str, str]) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=d.url, timeout=60, headers=headers)


def ws(d: Daemon, headers: dict[str, str] | None = None) -> Any:
    return open_websocket_url(ws_url(d), extra_headers=list((headers or {}).items()))


def same_404(theirs: httpx.Response, unknown: httpx.Response, their_id: str, unknown_id: str) -> None:
    """``theirs`` is exactly the answer for an unknown id, but for the id it names."""
    assert theirs.status_code == unknown.status_code == 404, (theirs.text, unknown.text)
    assert theirs.text.replace(their_id, "?") == unknown.text.replace(unknown_id, "?")


async def resumable(c: httpx.AsyncClient, max_tokens: int = 4) -> str:
    """A finished resumable session of ``c``'s tenant; its id."""
    async with c.stream("POST", "/v1/chat/completions", headers={"x-superfluid-resumable": "true"},
                        json={**LONG, "max_tokens": max_tokens, "stream": True,
                              "messages": [{"role": "user", "content": "hello"}]}) as r:
        assert r.status_code == 200
        sid = r.headers["x-superfluid-session"]
        await r.aread()
    return sid


async def conversation(c: httpx.AsyncClient, **body: Any) -> str:
    r = await c.post("/v1/sessions", json={"model": "mock", "sampling": {"max_tokens": 4},
                                           "messages": [{"role": "user", "content": "a secret"}], **body})
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


# -- ownership ---------------------------------------------------------------------------------------------------


async def check_isolated(d: Daemon, sid: str, cid: str) -> None:
    """b gets the unknown-id answer for a's session ``sid`` and conversation ``cid``; a does not."""
    async with client(d, A) as a, client(d, B) as b:
        for method, tail in (("GET", ""), ("GET", "/stream"), ("DELETE", "/generation")):
            same_404(await b.request(method, f"/v1/sessions/{sid}{tail}"),
                     await b.request(method, f"/v1/sessions/s-none{tail}"), sid, "s-none")
        for method, tail, body in (("GET", "", None), ("GET", "/stream", None), ("DELETE", "/generation", None),
                                   ("GET", "/events", None), ("POST", "/messages", {"messages": [{"role": "user",
                                                                                                  "content": "x"}]}),
                                   ("POST", "/generate", {}), ("POST", "/fork", {})):
            same_404(await b.request(method, f"/v1/sessions/{cid}{tail}", json=body),
                     await b.request(method, f"/v1/sessions/c-none{tail}", json=body), cid, "c-none")
        assert (await a.get(f"/v1/sessions/{sid}/stream")).status_code == 200  # (after a restart: rebuilt from the log)
        assert (await a.get(f"/v1/sessions/{sid}")).json()["text"]
        same_404(await b.get(f"/v1/sessions/{sid}"), await b.get("/v1/sessions/s-none"), sid, "s-none")
        assert (await a.get(f"/v1/sessions/{cid}")).json()["messages"] == 1
        assert (await a.get(f"/v1/sessions/{cid}/events")).json()["last_event_id"] == 1  # b wrote nothing


async def test_another_key_gets_the_unknown_id_answer_over_http(nursery: trio.Nursery) -> None:
    d = await start_daemon(nursery, keyed())
    with trio.fail_after(30):
        async with client(d, A) as a:
            sid, cid = await resumable(a), await conversation(a)
        await check_isolated(d, sid, cid)
    d.scope.cancel()


async def test_another_key_gets_the_unknown_id_answer_over_websocket(nursery: trio.Nursery) -> None:
    d = await start_daemon(nursery, keyed("mock?step_ms=5&prefill_us=5"))
    with trio.fail_after(30):
        async with client(d, A) as a:
            cid = await conversation(a)
            async with ws(d, A) as wa, ws(d, B) as wb:
                await put(wa, op="generate", body={**LONG, "messages": [{"role": "user", "content": "hi"}]},
                          resumable=True)
                sid = (await expect(wa, "started"))["session"]

                async def answer(sock: Any, **msg: Any) -> dict[str, Any]:
                    await put(sock, **msg)
                    while (reply := await get(sock))["op"] == "delta":
                        pass
                    return reply

                for op, target, unknown, extra in (
                        ("subscribe", sid, "s-none", {}), ("get", sid, "s-none", {}), ("cancel", sid, "s-none", {}),
                        ("events", cid, "c-none", {}), ("fork", cid, "c-none", {}),
                        ("append", cid, "c-none", {"body": {"messages": [{"role": "user", "content": "x"}]}})):
                    theirs = await answer(wb, op=op, session=target, **extra)
                    none = await answer(wb, op=op, session=unknown, **extra)
                    assert theirs["op"] == none["op"] == "error" and theirs["error"]["code"] == "session_not_found"
                    assert json.dumps(theirs).replace(target, "?") == json.dumps(none).replace(unknown, "?")
                # generate naming a's conversation is a new session of b's, never a turn of a's conversation
                reply = await answer(wb, op="generate", session=cid, body={"model": "mock", "max_tokens": 2})
                assert reply["op"] == "error" and reply["error"]["param"] == "messages"
                assert (await a.get(f"/v1/sessions/{sid}")).json()["generating"]  # b's cancel did nothing
                await put(wa, op="cancel", session=sid)
                while (await get(wa))["op"] != "cancelled":
                    pass
            assert (await a.get(f"/v1/sessions/{cid}/events")).json()["last_event_id"] == 1
    d.scope.cancel()


async def test_ownership_survives_a_restart(tmp_path: Path) -> None:
    config = attrs.evolve(keyed(), sessions=tmp_path / "sessions")
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            d = await start_daemon(nursery, config)
            async with client(d, A) as a:
                sid, cid = await resumable(a), await conversation(a)
            d.scope.cancel()
        async with open_journal(tmp_path / "sessions") as journal:  # the tenant is in the log
            assert journal.sessions[sid].tenant == journal.sessions[cid].tenant == "a"
        async with trio.open_nursery() as nursery:
            d = await start_daemon(nursery, config)
            await check_isolated(d, sid, cid)
            d.scope.cancel()


async def test_another_key_cannot_continue_a_response(nursery: trio.Nursery) -> None:
    d = await start_daemon(nursery, keyed())
    with trio.fail_after(30):
        async with client(d, A) as a, client(d, B) as b:
            r = await a.post("/v1/responses", json={"model": "mock", "input": "a secret", "max_output_tokens": 2})
            rid = r.json()["id"]

            async def follow(c: httpx.AsyncClient, prev: str) -> httpx.Response:
                return await c.post("/v1/responses", json={"model": "mock", "input": "go on", "max_output_tokens": 2,
                                                           "previous_response_id": prev})

            theirs, unknown = await follow(b, rid), await follow(b, "resp_none")
            assert theirs.status_code == unknown.status_code == 400
            assert theirs.text.replace(rid, "?") == unknown.text.replace("resp_none", "?")
            assert (await follow(a, rid)).status_code == 200
    d.scope.cancel()


def test_the_tenant_is_logged_and_an_old_record_belongs_to_tenant_none() -> None:
    bodies = [body_created(params={}, klass="agent", model="m", tenant="a"), body_conversation(model="m", tenant="b"),
              body_created(params={}, klass="agent", model="m")]
    assert "tenant" not in bodies[2]  # a keyless daemon writes the record it always wrote
    records, _end = read_wal(MAGIC + b"".join(
        encode_record(WalRecord(session=f"s{i}", event_id=0, epoch=1, ts=0, body=b)) for i, b in enumerate(bodies)))
    tenants = []
    for i, rec in enumerate(records):
        slog = SessionLog(rec.session)
        slog.apply(rec, i)
        tenants.append(slog.tenant)
    assert tenants == ["a", "b", ""]


# -- ids ---------------------------------------------------------------------------------------------------------


async def test_client_chosen_ids_are_refused_without_keys(daemon: Daemon) -> None:
    c = daemon.client
    with trio.fail_after(30):
        r = await c.post("/v1/sessions", json={"model": "mock", "id": "mine"})
        assert r.status_code == 400 and "server-made" in r.json()["error"]["message"], r.text
        cid = await conversation(c)
        r = await c.post(f"/v1/sessions/{cid}/fork", json={"id": "mine"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "id", r.text
        async with ws(daemon) as sock:
            await put(sock, op="generate", session="mine", body={**LONG, "max_tokens": 2,
                                                                 "messages": [{"role": "user", "content": "x"}]})
            err = await expect(sock, "error")
            assert err["error"]["param"] == "session" and "server-made" in err["error"]["message"]
            await put(sock, op="create", body={"model": "mock", "id": "mine"})
            assert (await expect(sock, "error"))["error"]["param"] == "id"
        assert (await c.get("/v1/sessions/mine")).status_code == 404


async def test_chosen_names_are_per_tenant(nursery: trio.Nursery) -> None:
    d = await start_daemon(nursery, keyed())
    with trio.fail_after(30):
        async with client(d, A) as a, client(d, B) as b:
            assert await conversation(a, id="shared", system="a's") == "shared"
            assert await conversation(b, id="shared", system="b's") == "shared"
            assert (await a.get("/v1/sessions/shared")).json()["system"] == "a's"
            assert (await b.get("/v1/sessions/shared")).json()["system"] == "b's"
            r = await a.post("/v1/sessions", json={"model": "mock", "id": "shared"})
            assert r.status_code == 409 and r.json()["error"]["code"] == "session_exists"
            r = await b.post("/v1/sessions/shared/fork", json={"id": "copy"})
            assert r.status_code == 201 and r.json()["id"] == "copy" and r.json()["system"] == "b's"
            assert (await a.get("/v1/sessions/copy")).status_code == 404
            async with ws(d, A) as wa, ws(d, B) as wb:
                for sock in (wa, wb):
                    await put(sock, op="generate", session="story", resumable=True,
                              body={**LONG, "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]})
                    assert (await expect(sock, "started"))["session"] == "story"
                    while (await get(sock))["op"] != "done":
                        pass
            assert (await a.get("/v1/sessions/story")).json()["completion_tokens"] == 2
            assert (await b.get("/v1/sessions/story")).json()["completion_tokens"] == 2
    d.scope.cancel()


# -- the prefix cache ----------------------------------------------------------------------------------------------


async def probe(c: httpx.AsyncClient, **extra: Any) -> tuple[int, str]:
    """cached_tokens and x-superfluid-warm of a chat on the secret system prompt."""
    r = await c.post("/v1/chat/completions", json={
        **LONG, "max_tokens": 2, **extra,
        "messages": [{"role": "system", "content": SECRET}, {"role": "user", "content": "hi"}]})
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"], r.headers["x-superfluid-warm"]


async def test_another_key_sees_no_cached_tokens_of_a_prompt(nursery: trio.Nursery) -> None:
    d = await start_daemon(nursery, keyed())
    with trio.fail_after(30):
        async with client(d, A) as a, client(d, B) as b:
            assert (await probe(a))[0] == 0
            assert await probe(b) == (0, "0")
            cached, warm = await probe(a)  # the positive control: the probe does detect a warm prefix
            assert cached > 0 and warm == str(cached)
        async with client(d, {"x-api-key": "kc"}) as c:  # the same over the Anthropic dialect
            r = await c.post("/v1/messages", json={"model": "mock", "max_tokens": 2, "system": SECRET,
                                                   "messages": [{"role": "user", "content": "hi"}]})
            assert r.json()["usage"]["cache_read_input_tokens"] == 0
    d.scope.cancel()


async def test_another_key_never_restores_a_parked_prompt(tmp_path: Path) -> None:
    """--park: key a's finished conversation is on disk; after a daemon restart (no KV, no host
    cache) key b's identical prompt restores nothing of it, and a's own does (the control)."""
    from .test_fuzz_regressions import metric

    config = attrs.evolve(keyed(), sessions=tmp_path / "sessions", park=True, park_budget_gb=0.01)
    long = {"messages": [{"role": "system", "content": SECRET * 3}, {"role": "user", "content": "hi"}]}
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            d = await start_daemon(nursery, config)
            async with client(d, A) as a:
                assert (await a.post("/v1/chat/completions", json={**LONG, "max_tokens": 2, **long})).status_code == 200
            from .test_park import parked_files

            await parked_files(tmp_path / "sessions")
            d.scope.cancel()
        async with trio.open_nursery() as nursery:
            d = await start_daemon(nursery, config)
            async with client(d, A) as a, client(d, B) as b:
                r = await b.post("/v1/chat/completions", json={**LONG, "max_tokens": 2, **long})
                assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
                assert await metric(a, "superfluid_resumes_total") == 0
                r = await a.post("/v1/chat/completions", json={**LONG, "max_tokens": 2, **long})
                assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 256
                assert await metric(a, "superfluid_resumes_total") == 1
            d.scope.cancel()


async def test_cache_salt_partitions_within_a_tenant(daemon: Daemon) -> None:
    c = daemon.client
    with trio.fail_after(30):
        assert (await probe(c))[0] == 0
        assert (await probe(c))[0] > 0                    # no keys, no salt: today's shared cache
        assert (await probe(c, cache_salt="x"))[0] == 0
        assert (await probe(c, cache_salt="y"))[0] == 0
        assert (await probe(c, cache_salt="x"))[0] > 0


@pytest.mark.parametrize("salt", [5, "s" * 257])
async def test_cache_salt_is_validated_on_every_dialect(daemon: Daemon, salt: Any) -> None:
    msgs = [{"role": "user", "content": "x"}]
    with trio.fail_after(30):
        for path, body in (("/v1/chat/completions", {"messages": msgs}), ("/v1/completions", {"prompt": "x"}),
                           ("/v1/responses", {"input": "x"}), ("/v1/messages", {"messages": msgs, "max_tokens": 2}),
                           ("/api/chat", {"messages": msgs}), ("/api/generate", {"prompt": "x"})):
            r = await daemon.client.post(path, json={"model": "mock", "cache_salt": salt, **body})
            assert r.status_code == 400 and "cache_salt" in r.text, (path, r.text)
        async with ws(daemon) as sock:
            await put(sock, op="generate", body={"model": "mock", "cache_salt": salt, "messages": msgs})
            assert (await expect(sock, "error"))["error"]["param"] == "cache_salt"
        ok = await daemon.client.post("/api/chat", json={"model": "mock", "cache_salt": "s" * 256, "messages": msgs,
                                                         "stream": False})
        assert ok.status_code == 200, ok.text


def test_the_executor_reuses_kv_only_under_its_salt() -> None:
    prompt = [WORD0 + i % 40 for i in range(300)]

    def admit(ex: Executor, lane: int, salt: str) -> int:
        cached = ex.admit(Admit(lane=lane, tokens=prompt, n_prompt=len(prompt), max_new=2, cache_salt=salt)).cached
        while ex.lanes:
            ex.step(prefill_budget=512)
        return cached

    ex = Executor(MockEngine("mock?step_ms=0&prefill_us=0&n_ctx=800", n_seq=4), max_lanes=2)
    assert admit(ex, 0, "a") == 0
    assert admit(ex, 1, "b") == 0 and admit(ex, 2, "") == 0
    assert admit(ex, 3, "a") == len(prompt) - 1
    # the host cache: one sequence, so each admission evicts the last to host memory
    ex = Executor(MockEngine("mock?step_ms=0&prefill_us=0&n_ctx=800", n_seq=1), max_lanes=1, host_cache_bytes=1 << 20)
    assert admit(ex, 0, "a") == 0 and admit(ex, 1, "b") == 0
    assert len(ex.host) == 1 and admit(ex, 2, "b") == len(prompt) - 1  # b's own, from its sequence
    assert admit(ex, 3, "a") == len(prompt) - 1 and ex.host.stats["hits"] == 1  # a's, back from host memory


def test_the_salt_crosses_the_link_and_an_unsalted_admit_is_unchanged() -> None:
    salted = Admit(lane=1, tokens=[1, 2], n_prompt=2, max_new=1, cache_salt="p")
    assert from_wire(to_wire(salted), max_len=1 << 20) == salted
    plain = Admit(lane=1, tokens=[1, 2], n_prompt=2, max_new=1)
    assert b"cache_salt" not in to_wire(plain)  # a worker that predates the field reads it as before


# -- conversation limits -------------------------------------------------------------------------------------------


async def test_conversation_limits_are_413_before_anything_is_logged(nursery: trio.Nursery) -> None:
    d = await start_daemon(nursery, mock_config(max_message_bytes=2000, max_conversation_bytes=6000,
                                                max_conversation_events=6))
    c = d.client

    def refused(r: httpx.Response, code: str, flag: str) -> None:
        assert r.status_code == 413, r.text
        err = r.json()["error"]
        assert err["code"] == code and flag in err["message"], err

    def msg(n: int) -> dict[str, Any]:
        return {"role": "user", "content": "x" * n}

    with trio.fail_after(30):
        refused(await c.post("/v1/sessions", json={"model": "mock", "system": "s" * 3000}),
                      "message_too_large", "--max-message-bytes")
        refused(await c.post("/v1/sessions", json={"model": "mock", "messages": [msg(1500)] * 5}),
                      "conversation_too_large", "--max-conversation-bytes")
        cid = await conversation(c)
        append = f"/v1/sessions/{cid}/messages"
        refused(await c.post(append, json={"messages": [msg(3000)]}), "message_too_large",
                      "--max-message-bytes")
        assert (await c.post(append, json={"messages": [msg(1500)] * 3})).status_code == 200
        refused(await c.post(append, json={"messages": [msg(1500)]}), "conversation_too_large",
                      "--max-conversation-bytes")
        assert (await c.post(append, json={"messages": [msg(10)]})).status_code == 200  # 6 events now
        refused(await c.post(append, json={"messages": [msg(10)]}), "conversation_too_large",
                      "--max-conversation-events")
        refused(await c.post(f"/v1/sessions/{cid}/generate", json={}), "conversation_too_large",
                      "--max-conversation-events")
        page = (await c.get(f"/v1/sessions/{cid}/events")).json()
        assert page["last_event_id"] == 5 and not page["generating"]  # nothing refused reached the log
    d.scope.cancel()


# -- the real model ------------------------------------------------------------------------------------------------


@pytest.mark.real
async def test_real_model_another_key_sees_no_cached_tokens(nursery: trio.Nursery) -> None:
    """SmolLM2 on llama.cpp: the cross-key probe sees no cached tokens; the same key does."""
    config = ServeConfig(models=(ModelSource(spec=str(REAL_GGUF), runtime="llamacpp", name="smol"),), port=0,
                         max_batch=2, max_context=2048, planner=PlannerConfig(max_batch=2), hang_timeout_s=120.0,
                         api_keys=KEYS)
    d = await start_daemon(nursery, config)
    with trio.fail_after(120):
        async with client(d, A) as a, client(d, B) as b:
            assert (await probe(a, model="smol"))[0] == 0
            assert await probe(b, model="smol") == (0, "0")
            cached, warm = await probe(a, model="smol")
            assert cached > 0 and warm == str(cached)
    d.scope.cancel()


def test_the_shared_prefix_hold_is_per_partition() -> None:
    """A job waits for a lane prefilling its long prefix only within its own
    partition: another tenant's job is neither held (a timing probe) nor seeded."""
    sched = Scheduler("m", SchedulerConfig(), Metrics().for_model("m"))
    worker = _Worker(sched.core)
    jobs = _burst(1500, 3)
    jobs[1].tenant = "b"
    for job in jobs:
        sched.core.submit(job, 0.0)
    worker.plan(send_tick=True)
    admits = [e for e in worker.sent if isinstance(e, Admit)]
    assert [a.cache_salt for a in admits] == ["", jobs[1].partition] and jobs[1].partition  # a's twin waits
