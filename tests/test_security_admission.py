"""One admission point per generation, and the limits that go with a key on every path.

Ported from the red-team review (../shared/reviews/red-team.md F1, F4, F6, F7, F11;
scripts concurrency.py, wsrate.py, convmem.py): a key's ``max_concurrent`` counted for as
long as each generation runs (resumable streams, conversation turns over HTTP and
WebSocket), the rate limit charged per WebSocket op, Ollama ``keep_alive`` an admin's,
per-key storage quotas, one rate bucket for all of 127/8, and a conversation's ``qos``
under ``--no-http-qos-header``. Mock runtime, in-process daemons.
"""

from __future__ import annotations

import json
from typing import Any

import attrs
import httpx
import pytest
import trio
import trio.testing
from trio_websocket import ConnectionRejected, open_websocket_url

from superfluid.api._admission import Claim, Slots, granted_keep_alive
from superfluid.api._guard import Guard, peer_of
from superfluid.api._principal import ANONYMOUS, Principal
from superfluid.daemon._keypolicy import DEFAULT_MAX_CONVERSATIONS, DEFAULT_MAX_STORED_BYTES, load_keys
from superfluid.sched import QosClass
from superfluid.serving import ApiKey, ModelSource

from .conftest import Daemon, mock_config
from . import test_security_guard

BOT, OPS = "sk-bot-0123456789", "sk-ops-0123456789"
AS_BOT = {"authorization": f"Bearer {BOT}"}
AS_OPS = {"authorization": f"Bearer {OPS}"}
CHAT = {"model": "mock", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
LONG = {**CHAT, "max_tokens": 400, "ignore_eos": True}
SLOW = "mock?step_ms=20&prefill_us=5"

serve = test_security_guard.serve  # the fixture: ``await serve(spec, **fields)``, a mock daemon stopped at the end
error = test_security_guard.error  # a typed refusal's error object, its status and code checked


def keys(bot: dict[str, Any] | None = None) -> tuple[ApiKey, ...]:
    return (ApiKey.from_secret("bot", BOT, **(bot or {})), ApiKey.from_secret("ops", OPS, admin=True))


async def first_chunk(d: Daemon, path: str, body: dict[str, Any], headers: dict[str, str]) -> httpx.Headers:
    """Open a stream, read its first event, drop the connection: the response's headers."""
    async with d.client.stream("POST", path, json=body, headers=headers) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                break
        return r.headers


async def lanes_active(d: Daemon) -> float:
    text = (await d.client.get("/metrics", headers=AS_OPS)).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("superfluid_lanes_active{"))


# -- max_concurrent: one admission point, held until the generation ends ----------------------------------------------

async def test_a_resumable_stream_whose_client_left_keeps_its_slot_until_it_ends(serve: Any) -> None:
    d = await serve(SLOW, api_keys=keys({"max_concurrent": 2}))
    resumable = {**AS_BOT, "x-superfluid-resumable": "true"}
    with trio.fail_after(30):
        sids = [(await first_chunk(d, "/v1/chat/completions", {**LONG, "stream": True}, resumable))
                ["x-superfluid-session"] for _ in range(2)]
        # both left; their generations run on (resumable), each holding one of the key's two slots
        error(await d.client.post("/v1/chat/completions", json={**LONG, "stream": True}, headers=resumable),
              429, "concurrency_limit_exceeded")
        error(await d.client.post("/v1/chat/completions", json=CHAT, headers=AS_BOT), 429,
              "concurrency_limit_exceeded")
        assert await lanes_active(d) <= 2
        for sid in sids:  # stopped: the slots come back
            assert (await d.client.delete(f"/v1/sessions/{sid}/generation", headers=AS_BOT)).status_code == 200
        while (r := await d.client.post("/v1/chat/completions", json=CHAT, headers=AS_BOT)).status_code == 429:
            await trio.sleep(0.02)
        assert r.status_code == 200, r.text


async def test_conversation_turns_take_the_keys_slot_over_http_and_websocket(serve: Any) -> None:
    d = await serve(SLOW, api_keys=keys({"max_concurrent": 1}))
    c = d.client

    async def conversation() -> str:
        r = await c.post("/v1/sessions", json={"model": "mock", "messages": CHAT["messages"]}, headers=AS_BOT)
        assert r.status_code == 201, r.text
        return str(r.json()["id"])

    first, second, third = [await conversation() for _ in range(3)]
    with trio.fail_after(30):
        # an HTTP turn dropped after its first chunk runs on, and holds the slot
        await first_chunk(d, f"/v1/sessions/{first}/generate", {"stream": True, "max_tokens": 400,
                                                               "ignore_eos": True}, AS_BOT)
        error(await c.post(f"/v1/sessions/{second}/generate", json={"max_tokens": 4}, headers=AS_BOT), 429,
              "concurrency_limit_exceeded")
        url = d.url.replace("http://", "ws://") + "/v1/ws"
        async with open_websocket_url(url, extra_headers=[(b"authorization", AS_BOT["authorization"].encode())]) as ws:
            await ws.send_message(json.dumps({"op": "generate", "id": 1, "session": third, "body": {"max_tokens": 4}}))
            msg = json.loads(await ws.get_message())
            assert msg["op"] == "error" and msg["error"]["code"] == "concurrency_limit_exceeded", msg
            assert (await c.delete(f"/v1/sessions/{first}/generation", headers=AS_BOT)).status_code == 200
            while True:  # the turn ends (its reply lands): the slot is free for the WebSocket's turn
                await ws.send_message(json.dumps({"op": "generate", "id": 2, "session": third,
                                                  "body": {"max_tokens": 400, "ignore_eos": True}}))
                msg = json.loads(await ws.get_message())
                if msg["op"] == "started":
                    break
                assert msg["error"]["code"] in ("concurrency_limit_exceeded", "session_busy"), msg
                await trio.sleep(0.02)
            # now the WebSocket turn holds it: an HTTP turn and a chat are refused
            error(await c.post(f"/v1/sessions/{second}/generate", json={"max_tokens": 4}, headers=AS_BOT), 429,
                  "concurrency_limit_exceeded")
            r = await c.post("/api/chat", json={"model": "mock", "messages": CHAT["messages"], "stream": False},
                             headers=AS_BOT)
            assert r.status_code == 429 and "max_concurrent" in r.json()["error"], r.text  # (Ollama's error shape)
            await c.delete(f"/v1/sessions/{third}/generation", headers=AS_BOT)


def test_a_claim_counts_while_held_or_while_its_job_runs() -> None:
    """The rule itself: no path can leak a slot or free it early."""

    class FakeJob:
        done = False

    slots, key, job = Slots(), ApiKey.from_secret("k", "s", max_concurrent=1), FakeJob()
    with slots.claim(key, job) as claim:  # type: ignore[arg-type]
        assert slots.held("k") == 1
        claim.queued = True
    assert slots.held("k") == 1  # the request left; the job runs on
    job.done = True
    assert slots.held("k") == 0
    with slots.claim(key, FakeJob()):  # type: ignore[arg-type]
        pass
    assert slots.held("k") == 0  # never queued (refused, or the request failed first): freed on leaving
    with slots.claim(None, job) as claim, slots.claim(ApiKey.from_secret("u", "s"), job):  # type: ignore[arg-type]
        assert isinstance(claim, Claim) and slots.held("u") == 0  # no key, or no limit: nothing counted


# -- the rate limit: per request and per WebSocket op ----------------------------------------------------------------

async def test_each_websocket_op_pays_the_rate_limit(serve: Any, mock_clock: trio.testing.MockClock) -> None:
    mock_clock.rate = 1.0
    d = await serve(api_keys=keys({"rate_limit_rpm": 3}))
    url = d.url.replace("http://", "ws://") + "/v1/ws"
    with trio.fail_after(30):
        async with open_websocket_url(url, extra_headers=[(b"authorization", AS_BOT["authorization"].encode())]) as ws:
            # the upgrade took one token; two ops fit, the third is refused typed, with its wait
            await ws.send_message(json.dumps({"op": "create", "id": 1, "body": {"model": "mock"}}))
            assert json.loads(await ws.get_message())["op"] == "created"
            await ws.send_message(json.dumps({"op": "generate", "id": 2, "body": CHAT}))
            while (msg := json.loads(await ws.get_message()))["op"] != "done":
                assert msg["op"] in ("started", "delta"), msg
            for op in ({"op": "generate", "id": 3, "body": CHAT}, {"op": "create", "id": 4, "body": {"model": "mock"}}):
                await ws.send_message(json.dumps(op))
                msg = json.loads(await ws.get_message())
                assert msg["op"] == "error" and msg["id"] == op["id"], msg
                assert msg["error"]["code"] == "rate_limit_exceeded" and msg["retry_after"] >= 1, msg
            mock_clock.jump(20)  # a token a 20 s at 3/min
            await ws.send_message(json.dumps({"op": "create", "id": 5, "body": {"model": "mock"}}))
            assert json.loads(await ws.get_message())["op"] == "created"
        # a refused upgrade is the refusal itself: 429 with Retry-After (not a bare 403)
        with pytest.raises(ConnectionRejected) as refused:
            async with open_websocket_url(url, extra_headers=[(b"authorization", AS_BOT["authorization"].encode())]):
                pass
        assert refused.value.status_code == 429
        assert dict(refused.value.headers or [])[b"retry-after"].isdigit()
        assert json.loads(refused.value.body or b"{}")["error"]["code"] == "rate_limit_exceeded"


def test_the_per_peer_bucket_is_one_for_loopback_and_one_per_ipv6_64() -> None:
    assert {peer_of(f"127.0.0.{i}") for i in range(1, 9)} == {"127.0.0.0/8"} == {peer_of("::ffff:127.0.0.2")}
    assert peer_of("192.0.2.7") == "192.0.2.7" != peer_of("192.0.2.8")
    assert peer_of("2001:db8::1") == peer_of("2001:db8::ffff") == "2001:db8::/64" != peer_of("2001:db8:0:1::1")
    assert peer_of("not an address") == "not an address"
    now = [0.0]
    guard = Guard(attrs.evolve(mock_config(), rate_limit_rpm=2), clock=lambda: now[0], hostname="box")

    def scope(ip: str) -> dict[str, Any]:
        return {"type": "http", "path": "/v1/models", "client": (ip, 40000)}

    assert guard.charge(scope("127.0.0.2"), ANONYMOUS) is None
    assert guard.charge(scope("127.0.0.3"), ANONYMOUS) is None
    refusal = guard.charge(scope("127.0.0.4"), ANONYMOUS)  # a fresh local address is no fresh bucket
    assert refusal is not None and refusal.code == "rate_limit_exceeded"
    assert guard.charge(scope("192.0.2.7"), ANONYMOUS) is None


# -- Ollama keep_alive is an admin's ---------------------------------------------------------------------------------

async def test_a_non_admin_keys_keep_alive_neither_unloads_nor_pins(serve: Any) -> None:
    side = ModelSource(spec="mock?step_ms=1&prefill_us=5", runtime="mock", name="side")
    d = await serve(api_keys=keys(), idle_timeout_s=300.0,
                    models=(*mock_config().models, side))
    c = d.client

    async def expiry() -> str | None:  # side's expires_at; None when it is not loaded
        models = (await c.get("/api/ps", headers=AS_OPS)).json()["models"]
        return next((m["expires_at"] for m in models if m["name"] == "side"), None)

    with trio.fail_after(30):
        assert (await c.post("/api/generate", json={"model": "side", "prompt": ""}, headers=AS_OPS)).status_code == 200
        for value in (0, -1, "0s"):
            r = await c.post("/api/generate", json={"model": "side", "prompt": "", "keep_alive": value}, headers=AS_BOT)
            assert r.status_code == 200 and r.json().get("done_reason") != "unload", r.text
            r = await c.post("/api/chat", json={"model": "side", "messages": [], "keep_alive": value}, headers=AS_BOT)
            assert r.status_code == 200 and r.json().get("done_reason") != "unload", r.text
            r = await c.post("/api/embed", json={"model": "side", "input": "", "keep_alive": value}, headers=AS_BOT)
            assert r.status_code < 500, r.text
        await trio.sleep(0.2)
        expires = await expiry()
        assert expires is not None and not expires.startswith("9999"), expires  # loaded, not pinned
        # an admin's keep_alive pins, and unloads
        await c.post("/api/generate", json={"model": "side", "prompt": "", "keep_alive": -1}, headers=AS_OPS)
        assert (await expiry() or "").startswith("9999")
        r = await c.post("/api/generate", json={"model": "side", "prompt": "", "keep_alive": 0}, headers=AS_OPS)
        assert r.json()["done_reason"] == "unload", r.text
        while await expiry() is not None:
            await trio.sleep(0.02)


def test_keep_alive_is_granted_to_admins_only() -> None:
    assert granted_keep_alive(True, 0.0) == 0.0 and granted_keep_alive(True, None) is None
    assert granted_keep_alive(False, 0.0) is None and granted_keep_alive(False, -1.0) is None
    assert ANONYMOUS.admin  # no keys configured: the local user may do anything


# -- per-key storage quotas -------------------------------------------------------------------------------------------

async def test_a_keys_conversations_are_capped_in_number_and_bytes(serve: Any) -> None:
    d = await serve("mock?step_ms=1&prefill_us=5",
                    api_keys=keys({"max_conversations": 2, "max_stored_bytes": 20_000}))
    c = d.client
    made = []
    for _ in range(2):
        r = await c.post("/v1/sessions", json={"model": "mock"}, headers=AS_BOT)
        assert r.status_code == 201, r.text
        made.append(r.json()["id"])
    error(await c.post("/v1/sessions", json={"model": "mock"}, headers=AS_BOT), 429, "conversation_quota_exceeded")
    error(await c.post(f"/v1/sessions/{made[0]}/fork", json={}, headers=AS_BOT), 429, "conversation_quota_exceeded")
    url = d.url.replace("http://", "ws://") + "/v1/ws"
    async with open_websocket_url(url, extra_headers=[(b"authorization", AS_BOT["authorization"].encode())]) as ws:
        await ws.send_message(json.dumps({"op": "create", "id": 1, "body": {"model": "mock"}}))
        msg = json.loads(await ws.get_message())
        assert msg["op"] == "error" and msg["error"]["code"] == "conversation_quota_exceeded", msg
    assert (await c.post("/v1/sessions", json={"model": "mock"}, headers=AS_OPS)).status_code == 201  # its own quota
    # bytes: 8 KB messages fit twice, the third would pass 20,000
    big = {"messages": [{"role": "user", "content": "x" * 8000}]}
    for _ in range(2):
        assert (await c.post(f"/v1/sessions/{made[0]}/messages", json=big, headers=AS_BOT)).status_code == 200
    error(await c.post(f"/v1/sessions/{made[1]}/messages", json=big, headers=AS_BOT), 413, "storage_quota_exceeded")
    small = {"messages": [{"role": "user", "content": "hi"}]}
    assert (await c.post(f"/v1/sessions/{made[1]}/messages", json=small, headers=AS_BOT)).status_code == 200


def test_a_non_admin_key_gets_a_storage_quota_by_default(tmp_path: Any) -> None:
    path = tmp_path / "policy.json"
    path.write_text(json.dumps({"keys": [{"name": "a", "key": "sk-a"}, {"name": "b", "key": "sk-b", "admin": True},
                                         {"name": "c", "key": "sk-c", "max_conversations": 0,
                                          "max_stored_bytes": 5}]}))
    a, b, c = load_keys(None, path, {})
    assert (a.max_conversations, a.max_stored_bytes) == (DEFAULT_MAX_CONVERSATIONS, DEFAULT_MAX_STORED_BYTES)
    assert (b.max_conversations, b.max_stored_bytes) == (0, 0)  # an admin's is unlimited unless set
    assert (c.max_conversations, c.max_stored_bytes) == (0, 5)


# -- a conversation's qos is the header's, under --no-http-qos-header too ---------------------------------------------

async def test_a_conversations_qos_is_ignored_under_no_http_qos_header(serve: Any) -> None:
    d = await serve(http_qos_header=False, default_qos=QosClass.BACKGROUND,
                    api_keys=keys({"klass": QosClass.BACKGROUND}))
    c = d.client
    cid = (await c.post("/v1/sessions", json={"model": "mock", "messages": CHAT["messages"]}, headers=AS_BOT)).json()["id"]
    # asked above the key's max_class: with the header read this is 403; ignored, it runs at the key's class
    r = await c.post(f"/v1/sessions/{cid}/generate", json={"max_tokens": 2, "qos": "interactive"}, headers=AS_BOT)
    assert r.status_code == 200, r.text
    r = await c.post(f"/v1/sessions/{cid}/generate", json={"qos": 5}, headers=AS_BOT)
    assert r.status_code == 400 and r.json()["error"]["param"] == "qos", r.text  # still a checked field


def test_principal_qos_refuses_above_max_class() -> None:
    key = ApiKey.from_secret("bot", BOT, klass=QosClass.BACKGROUND)
    with pytest.raises(Exception, match="may not ask"):
        Principal(name="bot", tenant="bot", key=key).qos(QosClass.INTERACTIVE, QosClass.AGENT)


# -- smaller items of the review (F11) --------------------------------------------------------------------------------

async def test_health_tells_what_is_loaded_only_to_a_key(serve: Any) -> None:
    d = await serve(api_keys=keys())
    anonymous = (await d.client.get("/health")).json()
    assert anonymous == {"status": "ok"}, anonymous
    keyed = (await d.client.get("/health", headers=AS_BOT)).json()
    assert keyed["status"] == "ok" and keyed["models_loaded"] == 1, keyed
    keyless = await serve()
    assert (await keyless.client.get("/health")).json()["models_known"] == 1  # no keys: the local user sees all


async def test_websocket_get_describes_a_conversation_as_http_does(serve: Any) -> None:
    d = await serve()
    cid = (await d.client.post("/v1/sessions", json={"model": "mock", "messages": CHAT["messages"]})).json()["id"]
    over_http = (await d.client.get(f"/v1/sessions/{cid}")).json()
    async with open_websocket_url(d.url.replace("http://", "ws://") + "/v1/ws") as ws:
        await ws.send_message(json.dumps({"op": "get", "id": 1, "session": cid}))
        msg = json.loads(await ws.get_message())
    assert msg["op"] == "session" and msg["session"] == over_http, (msg, over_http)
    assert over_http["kind"] == "conversation" and over_http["model"] == "mock"
