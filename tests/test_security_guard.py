"""The browser guard and key policy (``api/_guard.py``, ``_keypolicy.py``):
Host and Origin checks, content types, CORS, keys on every dialect, admin
routes, model lists, QoS classes, concurrency and rate limits, exposure."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio
import trio.testing
from trio_websocket import ConnectionRejected, open_websocket_url

from superfluid.cli._main import main
from superfluid.serving import ApiKey
from superfluid.daemon._keypolicy import load_keys
from superfluid.api._admission import Slots
from superfluid.api._guard import Guard, exposure_refusal
from superfluid.api._principal import ANONYMOUS, PRINCIPAL, Principal
from superfluid.sched import QosClass

from .conftest import Daemon, mock_config, start_daemon

CHAT = {"model": "mock", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
OLLAMA_CHAT = {"model": "mock", "messages": CHAT["messages"], "stream": False, "options": {"num_predict": 4}}
ADMIN, AGENT_KEY = "sk-admin-0123456789", "sk-agent-0123456789"


@pytest.fixture
async def serve(nursery: trio.Nursery) -> AsyncIterator[Any]:
    """``await serve(**config_fields)``: a mock daemon; all are stopped at the end."""
    started: list[Daemon] = []

    async def start(spec: str = "mock?step_ms=1&prefill_us=5", **fields: Any) -> Daemon:
        d = await start_daemon(nursery, attrs.evolve(mock_config(spec), **fields))
        started.append(d)
        return d

    yield start
    for d in started:
        await d.client.aclose()
        d.scope.cancel()


def keys(*entries: dict[str, Any]) -> tuple[ApiKey, ...]:
    return tuple(ApiKey.from_secret(e.pop("name"), e.pop("key"), **e) for e in (dict(x) for x in entries))


def error(r: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert err["code"] == code, err
    return err


async def raw_exchange(d: Daemon, request: bytes) -> bytes:
    """Send raw bytes (forms httpx will not send); the whole answer (``Connection: close``)."""
    host, port = d.url.removeprefix("http://").rsplit(":", 1)
    out = b""
    with trio.fail_after(10):
        async with await trio.open_tcp_stream(host, int(port)) as stream:
            await stream.send_all(request)
            while chunk := await stream.receive_some(65536):
                out += chunk
    return out


# -- Host (DNS rebinding) -----------------------------------------------------------------------------------------

REFUSED_HOSTS = ["evil.example", "localhost.evil.example", "localhost@evil.example", "evil.example:8453",
                 "localhost:0", "localhost:99999", "localhost:", "localhost:8a", "127.0.0.1.nip.io", "[::2]",
                 "10.0.0.1", "my-machine"]
ALLOWED_HOSTS = ["localhost", "LocalHost:1234", "app.localhost:5173", "127.0.0.1", "127.9.9.9:80", "[::1]:8453"]


async def test_loopback_listener_answers_only_loopback_hosts(serve: Any) -> None:
    d = await serve(allowed_hosts=("proxy.example",))  # as --allowed-host PROXY.example gives it
    for host in REFUSED_HOSTS:
        err = error(await d.client.get("/v1/models", headers={"host": host}), 403, "host_refused")
        assert err["type"] == "permission_error"
    for host in [*ALLOWED_HOSTS, "proxy.example", "PROXY.example:443"]:
        assert (await d.client.get("/v1/models", headers={"host": host})).status_code == 200, host
    # missing (HTTP/1.0 needs none) and duplicated Host headers
    missing = await raw_exchange(d, b"GET /v1/models HTTP/1.0\r\n\r\n")
    assert missing.startswith(b"HTTP/1.1 403") and b"host_refused" in missing
    twice = await raw_exchange(d, b"GET /v1/models HTTP/1.1\r\nhost: localhost\r\nhost: evil.example\r\n"
                                  b"connection: close\r\n\r\n")
    assert twice.startswith(b"HTTP/1.1 400")  # h11 refuses it first; the guard does too (below)
    s = scope(host="localhost")
    s["headers"].append((b"host", b"localhost"))
    refusal = Guard(mock_config()).admit(s)
    assert refusal is not None and refusal.code == "host_refused"


async def test_keyed_server_answers_any_host(serve: Any) -> None:
    d = await serve(api_keys=keys({"name": "default", "key": ADMIN, "admin": True}))
    r = await d.client.get("/v1/models", headers={"host": "api.example.com", "authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 200


def scope(path: str = "/v1/models", method: str = "GET", **headers: str) -> dict[str, Any]:
    return {"type": "http", "method": method, "path": path, "client": ("192.0.2.7", 5000),
            "headers": [(k.replace("_", "-").encode(), v.encode()) for k, v in headers.items()]}


def test_non_loopback_listener_answers_ips_localhost_and_the_machine_name() -> None:
    guard = Guard(mock_config(host="0.0.0.0", insecure_no_auth=True), hostname="Box.lan")
    for host in ["10.1.2.3:8453", "[fe80::1]", "localhost", "box.lan", "box", "box.local:8453"]:
        assert guard.admit(scope(host=host)) is None, host
    for host in ["evil.example", "box.evil.example", "app.localhost", "localhost@evil.example"]:
        refusal = guard.admit(scope(host=host))
        assert refusal is not None and refusal.code == "host_refused", host


# -- Origin, CORS ---------------------------------------------------------------------------------------------------

async def test_foreign_origins_are_refused_and_local_pages_get_cors(serve: Any) -> None:
    d = await serve(web_origins=("https://app.example",))
    for origin in ["http://evil.example", "null", "http://localhost.evil.example", "http://localhost/x",
                   "http://localhost@evil.example", "file://", "https://app.example:444", "ftp://localhost"]:
        r = await d.client.get("/v1/models", headers={"origin": origin})
        assert error(r, 403, "origin_refused")["type"] == "permission_error", origin
        assert "access-control-allow-origin" not in r.headers
    r = await d.client.get("/v1/models", headers=[("origin", "http://localhost:3000"),
                                                   ("origin", "http://localhost:3000")])
    error(r, 403, "origin_refused")
    for origin in ["http://localhost:3000", "https://127.0.0.1", "http://[::1]:8080", "https://app.example"]:
        r = await d.client.get("/v1/models", headers={"origin": origin})
        assert r.status_code == 200, origin
        assert r.headers["access-control-allow-origin"] == origin
        assert r.headers["vary"] == "Origin"
        assert "x-superfluid-session" in r.headers["access-control-expose-headers"]
    r = await d.client.get("/v1/models")
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


async def test_foreign_origin_cannot_open_the_websocket(serve: Any) -> None:
    d = await serve()
    url = d.url.replace("http://", "ws://") + "/v1/ws"
    with trio.fail_after(10):
        with pytest.raises(ConnectionRejected) as rejected:
            async with open_websocket_url(url, extra_headers=[(b"origin", b"http://evil.example")]):
                pass
        assert rejected.value.status_code == 403
        async with open_websocket_url(url, extra_headers=[(b"origin", b"http://localhost:5173")]) as ws:
            await ws.send_message(json.dumps({"op": "get", "session": "nope"}))
            assert json.loads(await ws.get_message())["op"] == "error"


async def test_preflight_from_an_allowed_origin_only(serve: Any) -> None:
    d = await serve(api_keys=keys({"name": "default", "key": ADMIN, "admin": True}))
    asked = {"origin": "http://localhost:3000", "access-control-request-method": "POST",
             "access-control-request-headers": "authorization, content-type, x-superfluid-qos, x-evil"}
    r = await d.client.options("/v1/chat/completions", headers=asked)  # no key: browsers send none here
    assert r.status_code == 204
    assert r.headers["access-control-allow-origin"] == "http://localhost:3000"
    assert "POST" in r.headers["access-control-allow-methods"]
    granted = {h.strip() for h in r.headers["access-control-allow-headers"].split(",")}
    assert granted == {"authorization", "content-type", "x-superfluid-qos"}
    assert int(r.headers["access-control-max-age"]) > 0 and r.headers["vary"] == "Origin"
    r = await d.client.options("/v1/chat/completions", headers={**asked, "origin": "http://evil.example"})
    error(r, 403, "origin_refused")
    assert "access-control-allow-origin" not in r.headers


# -- content types --------------------------------------------------------------------------------------------------

async def test_browser_simple_bodies_are_refused_and_curl_forms_are_not(serve: Any) -> None:
    d = await serve()
    body = json.dumps(CHAT).encode()
    for kind in ["text/plain", "text/plain;charset=UTF-8", "multipart/form-data; boundary=x", "application/xml"]:
        r = await d.client.post("/v1/chat/completions", content=body, headers={"content-type": kind})
        error(r, 415, "unsupported_media_type")
    form = "application/x-www-form-urlencoded"
    r = await d.client.post("/v1/chat/completions", content=body, headers={"content-type": form})  # curl -d
    assert r.status_code == 200, r.text
    for marker in [{"origin": "http://localhost:3000"}, {"sec-fetch-site": "cross-site"}, {"sec-fetch-mode": "cors"}]:
        r = await d.client.post("/v1/chat/completions", content=body, headers={"content-type": form, **marker})
        error(r, 415, "unsupported_media_type")
    for kind in ["application/json", "application/json; charset=utf-8", "application/vnd.superfluid+json"]:
        r = await d.client.post("/v1/chat/completions", content=body, headers={"content-type": kind})
        assert r.status_code == 200, (kind, r.text)
    assert (await d.client.post("/v1/chat/completions", content=body)).status_code == 200  # none at all


# -- keys -----------------------------------------------------------------------------------------------------------

async def test_every_dialect_needs_the_key(serve: Any) -> None:
    d = await serve(api_keys=keys({"name": "default", "key": ADMIN, "admin": True}))
    c = d.client
    routes = [("/v1/chat/completions", CHAT), ("/v1/messages", {**CHAT, "max_tokens": 4}),
              ("/api/chat", OLLAMA_CHAT)]
    for path, body in routes:
        r = await c.post(path, json=body)
        assert r.status_code == 401, path
        assert json.dumps(r.json()).count("authentication_error") or "API key" in r.json()["error"], r.text
    error(await c.post("/v1/chat/completions", json=CHAT), 401, "invalid_api_key")
    assert (await c.post("/v1/messages", json=CHAT)).json()["error"]["type"] == "authentication_error"
    assert (await c.get("/metrics")).status_code == 401
    assert (await c.get("/health")).status_code == 200
    bad = {"authorization": "Bearer sk-wrong"}
    assert (await c.post("/v1/chat/completions", json=CHAT, headers=bad)).status_code == 401
    good = {"authorization": f"Bearer {ADMIN}"}
    assert (await c.post("/v1/chat/completions", json=CHAT, headers=good)).status_code == 200
    assert (await c.post("/api/chat", json=OLLAMA_CHAT, headers=good)).status_code == 200
    assert (await c.post("/v1/messages", json=CHAT, headers={"x-api-key": ADMIN})).status_code == 200
    assert (await c.get("/metrics", headers=good)).status_code == 200


async def test_admin_routes_need_an_admin_key(serve: Any) -> None:
    d = await serve(api_keys=keys({"name": "ops", "key": ADMIN, "admin": True}, {"name": "bot", "key": AGENT_KEY}))
    c, bot, ops = d.client, {"authorization": f"Bearer {AGENT_KEY}"}, {"authorization": f"Bearer {ADMIN}"}
    for method, path, body in [("POST", "/v1/models/load", {"id": "mock"}), ("POST", "/v1/models/unload", {"id": "x"}),
                               ("DELETE", "/v1/models/mock", None), ("POST", "/api/pull", {"model": "x"}),
                               ("POST", "/api/create", {"model": "x"}), ("POST", "/api/copy", {}),
                               ("DELETE", "/api/delete", {"model": "x"})]:
        r = await c.request(method, path, json=body, headers=bot)
        assert r.status_code == 403, (path, r.text)
        assert "admin" in json.dumps(r.json())
    error(await c.post("/v1/models/load", json={"id": "mock"}, headers=bot), 403, "admin_required")
    assert (await c.post("/v1/models/unload", json={"id": "ghost"}, headers=ops)).status_code == 200
    assert (await c.post("/v1/chat/completions", json=CHAT, headers=bot)).status_code == 200


async def test_a_key_uses_only_its_models(serve: Any) -> None:
    d = await serve(api_keys=keys({"name": "bot", "key": AGENT_KEY, "models": ("other",)},
                                  {"name": "ops", "key": ADMIN, "admin": True}))
    c, bot = d.client, {"authorization": f"Bearer {AGENT_KEY}"}
    err = error(await c.post("/v1/chat/completions", json=CHAT, headers=bot), 403, "model_not_allowed")
    assert err["type"] == "permission_error"
    # a model that does not exist is refused the same way: the answer discloses nothing
    error(await c.post("/v1/chat/completions", json={**CHAT, "model": "ghost"}, headers=bot), 403, "model_not_allowed")
    assert (await c.post("/api/chat", json=OLLAMA_CHAT, headers=bot)).status_code == 403
    error(await c.get("/v1/models/mock", headers=bot), 403, "model_not_allowed")
    assert (await c.get("/v1/models", headers=bot)).json()["data"] == []
    assert (await c.get("/api/tags", headers=bot)).json()["models"] == []
    assert (await c.get("/api/ps", headers=bot)).json()["models"] == []
    assert (await c.post("/api/show", json={"model": "mock"}, headers=bot)).status_code == 403
    ops = {"authorization": f"Bearer {ADMIN}"}
    assert [m["id"] for m in (await c.get("/v1/models", headers=ops)).json()["data"]] == ["mock"]
    assert len((await c.get("/api/tags", headers=ops)).json()["models"]) == 1


async def test_a_key_cannot_ask_a_class_above_its_max(serve: Any) -> None:
    d = await serve(api_keys=keys({"name": "bot", "key": AGENT_KEY, "klass": QosClass.BACKGROUND,
                                   "max_class": QosClass.AGENT}))
    bot = {"authorization": f"Bearer {AGENT_KEY}"}
    r = await d.client.post("/v1/chat/completions", json=CHAT, headers={**bot, "x-superfluid-qos": "interactive"})
    assert error(r, 403, "qos_class_not_allowed")["type"] == "permission_error"
    for klass in ("agent", "background"):
        r = await d.client.post("/v1/chat/completions", json=CHAT, headers={**bot, "x-superfluid-qos": klass})
        assert r.status_code == 200, r.text


def test_a_keys_class_is_its_default_and_max_class_its_ceiling() -> None:
    key = ApiKey.from_secret("bot", "s", klass=QosClass.BACKGROUND, max_class=QosClass.COMPLETION)
    p = Principal(name="bot", tenant="bot", key=key)
    assert p.qos(None, QosClass.INTERACTIVE) is QosClass.BACKGROUND
    assert p.qos(QosClass.COMPLETION, QosClass.AGENT) is QosClass.COMPLETION
    assert ApiKey.from_secret("x", "s", klass=QosClass.BACKGROUND).max_class is QosClass.BACKGROUND
    assert ANONYMOUS.qos(None, QosClass.INTERACTIVE) is QosClass.INTERACTIVE


@pytest.fixture
def released(monkeypatch: pytest.MonkeyPatch) -> Any:
    """``await released("bot")``: wait until key ``bot`` holds no generation slot
    (api/_admission.py: a slot is free once its generation has ended)."""
    made: list[Slots] = []
    init = Slots.__init__

    def record(self: Slots) -> None:
        init(self)
        made.append(self)

    monkeypatch.setattr(Slots, "__init__", record)

    async def wait(key: str) -> None:
        with trio.fail_after(10):
            while any(slots.held(key) for slots in made):
                await trio.sleep(0.01)

    return wait


async def test_a_stream_holds_its_concurrency_slot(serve: Any, released: Any) -> None:
    d = await serve("mock?step_ms=20&prefill_us=5",
                    api_keys=keys({"name": "bot", "key": AGENT_KEY, "max_concurrent": 1},
                                  {"name": "ops", "key": ADMIN, "admin": True}))
    c, bot = d.client, {"authorization": f"Bearer {AGENT_KEY}"}
    long = {**CHAT, "max_tokens": 40, "ignore_eos": True, "stream": True}
    with trio.fail_after(30):
        async with c.stream("POST", "/v1/chat/completions", json=long, headers=bot) as stream:
            lines = stream.aiter_lines()
            assert (await anext(lines)).startswith("data: ")  # generating: the slot is held
            r = await c.post("/v1/chat/completions", json=CHAT, headers=bot)
            assert error(r, 429, "concurrency_limit_exceeded")["type"] == "rate_limit_error"
            assert (await c.post("/v1/chat/completions", json=CHAT,  # another key's slots are its own
                                 headers={"authorization": f"Bearer {ADMIN}"})).status_code == 200
            async for _ in lines:
                pass
        # the slot comes back when the generation has ended: the client may ask first
        await released("bot")
        assert (await c.post("/v1/chat/completions", json=CHAT, headers=bot)).status_code == 200


# -- rate limits (virtual time) -------------------------------------------------------------------------------------

async def test_rate_limit_per_peer_in_virtual_time(serve: Any, mock_clock: trio.testing.MockClock) -> None:
    mock_clock.rate = 1.0  # the daemon runs at wall speed; jump() moves the buckets' clock
    d = await serve(rate_limit_rpm=3)
    c = d.client
    for _ in range(3):
        assert (await c.get("/v1/models")).status_code == 200
    r = await c.get("/v1/models")
    assert error(r, 429, "rate_limit_exceeded")["type"] == "rate_limit_error"
    assert 19 <= int(r.headers["retry-after"]) <= 20  # 3 a minute: one every 20 s
    assert (await c.get("/health")).status_code == 200
    assert (await c.get("/metrics")).status_code == 200
    mock_clock.jump(20)
    assert (await c.get("/v1/models")).status_code == 200
    error(await c.get("/v1/models"), 429, "rate_limit_exceeded")


async def test_a_keys_own_rate_limit_replaces_the_peers(serve: Any, mock_clock: trio.testing.MockClock) -> None:
    mock_clock.rate = 1.0
    d = await serve(rate_limit_rpm=1000, api_keys=keys({"name": "bot", "key": AGENT_KEY, "rate_limit_rpm": 2},
                                                       {"name": "ops", "key": ADMIN, "admin": True}))
    bot, ops = {"authorization": f"Bearer {AGENT_KEY}"}, {"authorization": f"Bearer {ADMIN}"}
    for _ in range(2):
        assert (await d.client.get("/v1/models", headers=bot)).status_code == 200
    r = await d.client.get("/v1/models", headers=bot)
    error(r, 429, "rate_limit_exceeded")
    assert int(r.headers["retry-after"]) == 30
    assert (await d.client.get("/v1/models", headers=ops)).status_code == 200
    mock_clock.jump(30)
    assert (await d.client.get("/v1/models", headers=bot)).status_code == 200


def test_rate_limit_buckets_are_bounded() -> None:
    now = [0.0]
    guard = Guard(mock_config(rate_limit_rpm=1), clock=lambda: now[0], max_buckets=16)
    for i in range(1000):
        s = scope(host="localhost")
        s["client"] = (f"10.0.{i // 256}.{i % 256}", 1)
        assert guard.admit(s) is None
    assert len(guard.buckets) == 16
    s = scope(host="localhost")
    s["client"] = ("10.0.3.231", 1)  # the last peer: still limited
    refusal = guard.admit(s)
    assert refusal is not None and refusal.code == "rate_limit_exceeded"
    assert s[PRINCIPAL] is ANONYMOUS


# -- startup: policy files, exposure --------------------------------------------------------------------------------

POLICY_ERRORS = [
    ({"keys": [{"name": "a", "key": "sk-1", "colour": "red"}]}, "unknown field 'colour'"),
    ({"keys": []}, "non-empty list"),
    ({"keys": [{"name": "a", "key": "sk-1"}, {"name": "b", "key": "sk-1"}]}, "same as that of"),
    ({"keys": [{"name": "a", "key": "sk-1"}, {"name": "a", "key": "sk-2"}]}, "duplicate name 'a'"),
    ({"keys": [{"name": "sk-2", "key": "sk-1"}, {"name": "b", "key": "sk-2"}]}, "name is also a secret"),
    ({"keys": [{"name": "a", "key": "sk-cli"}]}, "--api-key"),
    ({"keys": [{"name": "a", "key_env": "SUPERFLUID_TEST_UNSET_KEY"}]}, "unset or empty"),
    ({"keys": [{"name": "a", "key": "sk-1", "key_env": "X"}]}, "exactly one of"),
    ({"keys": [{"name": "a", "key": "sk-1", "class": "urgent"}]}, "not one of"),
    ({"keys": [{"name": "a", "key": "sk-1", "class": "interactive", "max_class": "agent"}]}, "above"),
    ({"keys": [{"name": "a", "key": "sk-1", "max_concurrent": -1}]}, "max_concurrent"),
    ({"keys": [{"name": "a", "key": "sk-1", "models": "mock"}]}, "models"),
    ({"keys": [{"name": "a", "key": "sk-1"}], "extra": 1}, "only a"),
]


@pytest.fixture
def no_serving(monkeypatch: pytest.MonkeyPatch) -> None:
    """``main`` must refuse before it serves: if it got as far as ``trio.run``, fail (do not hang)."""
    import types

    import superfluid.cli._main

    def refuse(*_: object) -> None:
        raise AssertionError("main() went on to serve")

    monkeypatch.setattr(superfluid.cli._main, "trio", types.SimpleNamespace(run=refuse))


@pytest.mark.parametrize(("doc", "says"), POLICY_ERRORS)
@pytest.mark.usefixtures("no_serving")
def test_a_bad_key_policy_is_one_line_and_exit_2(doc: Any, says: str, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "policy.json"
    path.write_text(json.dumps(doc))
    assert main(["serve", "mock", "--runtime", "mock", "--api-key", "sk-cli", "--key-policy", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err and "sk-" not in err.replace("sk-cli", ""), err


@pytest.mark.usefixtures("no_serving")
def test_policy_files_that_do_not_parse(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "bad.json").write_text("{not json")
    for name in ("bad.json", "missing.json"):
        assert main(["serve", "mock", "--runtime", "mock", "--key-policy", str(tmp_path / name)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "key policy" in err, err


def test_a_policy_entry_becomes_an_api_key(tmp_path: Path) -> None:
    path = tmp_path / "policy.json"
    path.write_text(json.dumps({"keys": [{"name": "ci", "key_env": "CI_KEY", "class": "background",
                                          "max_class": "agent", "models": ["mock"], "rate_limit_rpm": 60,
                                          "max_concurrent": 2}]}))
    default, ci = load_keys("sk-cli", path, {"CI_KEY": "sk-ci"})
    assert default.name == "default" and default.admin
    assert ci == ApiKey.from_secret("ci", "sk-ci", klass=QosClass.BACKGROUND, max_class=QosClass.AGENT,
                                    models=("mock",), rate_limit_rpm=60, max_concurrent=2,
                                    max_conversations=1000, max_stored_bytes=1 << 30)  # a non-admin's quota


@pytest.mark.usefixtures("no_serving")
def test_a_non_loopback_bind_without_a_key_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "mock", "--runtime", "mock", "--http", "0.0.0.0:0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--insecure-no-auth" in err, err
    assert exposure_refusal(mock_config(host="0.0.0.0")) is not None
    assert exposure_refusal(mock_config(host="::")) is not None
    assert exposure_refusal(mock_config(host="0.0.0.0", insecure_no_auth=True)) is None
    assert exposure_refusal(mock_config(host="0.0.0.0", api_keys=keys({"name": "a", "key": "k"}))) is None
    assert exposure_refusal(mock_config(host="localhost")) is None


# -- the official clients -------------------------------------------------------------------------------------------

async def test_the_official_clients_work_with_the_key_only(serve: Any) -> None:
    import anthropic
    import ollama
    import openai

    d = await serve(api_keys=keys({"name": "default", "key": ADMIN, "admin": True}))

    def run() -> None:
        ok = openai.OpenAI(base_url=d.url + "/v1", api_key=ADMIN, max_retries=0)
        assert ok.chat.completions.create(model="mock", messages=CHAT["messages"], max_tokens=4).choices
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=d.url + "/v1", api_key="sk-wrong", max_retries=0).models.list()
        a = anthropic.Anthropic(base_url=d.url, api_key=ADMIN, max_retries=0)
        assert a.messages.create(model="mock", max_tokens=4, messages=CHAT["messages"]).content is not None
        with pytest.raises(anthropic.AuthenticationError):
            anthropic.Anthropic(base_url=d.url, api_key="sk-wrong", max_retries=0).messages.create(
                model="mock", max_tokens=4, messages=CHAT["messages"])
        o = ollama.Client(host=d.url, headers={"Authorization": f"Bearer {ADMIN}"})
        assert o.chat(model="mock", messages=CHAT["messages"], options={"num_predict": 4}).message is not None
        with pytest.raises(ollama.ResponseError) as refused:
            ollama.Client(host=d.url).chat(model="mock", messages=CHAT["messages"])
        assert refused.value.status_code == 401

    with trio.fail_after(60):
        await trio.to_thread.run_sync(run)


async def test_a_websocket_generation_holds_its_keys_slot(serve: Any, released: Any) -> None:
    d = await serve("mock?step_ms=20&prefill_us=5", api_keys=keys({"name": "bot", "key": AGENT_KEY,
                                                                   "max_concurrent": 1}))
    url = d.url.replace("http://", "ws://") + "/v1/ws"
    bot = {"authorization": f"Bearer {AGENT_KEY}"}
    long = {**CHAT, "max_tokens": 40, "ignore_eos": True}
    with trio.fail_after(30):
        async with open_websocket_url(url, extra_headers=[(b"authorization", f"Bearer {AGENT_KEY}".encode())]) as ws:
            await ws.send_message(json.dumps({"op": "generate", "body": long}))
            assert json.loads(await ws.get_message())["op"] == "started"
            await ws.send_message(json.dumps({"op": "generate", "id": 2, "body": long}))
            while (msg := json.loads(await ws.get_message()))["op"] == "delta":
                pass
            assert msg["op"] == "error" and msg["error"]["code"] == "concurrency_limit_exceeded", msg
            error(await d.client.post("/v1/chat/completions", json=CHAT, headers=bot), 429,
                  "concurrency_limit_exceeded")
            while (msg := json.loads(await ws.get_message()))["op"] != "done":
                pass
        # the first one's slot comes back when its generation has ended: the client may ask first
        await released("bot")
        assert (await d.client.post("/v1/chat/completions", json=CHAT, headers=bot)).status_code == 200


def test_web_origins_and_keys_from_flags_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from superfluid.cli._main import _security, build_parser

    monkeypatch.setenv("SUPERFLUID_API_KEY", "sk-env")
    monkeypatch.setenv("SUPERFLUID_ORIGINS", "https://a.example, HTTPS://B.example:8443/")
    fields = _security(build_parser().parse_args(["serve", "--web-origin", "http://c.example"]))
    assert fields["web_origins"] == ("http://c.example", "https://a.example", "https://b.example:8443")
    (key,) = fields["api_keys"]  # type: ignore[misc]
    assert key == ApiKey.from_secret("default", "sk-env", admin=True)
    guard = Guard(mock_config(web_origins=("*",)))
    assert guard.origin_allowed("https://anything.example") and not guard.origin_allowed("null")


@pytest.mark.usefixtures("no_serving")
def test_a_bad_web_origin_or_allowed_host_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "mock", "--runtime", "mock", "--web-origin", "http://app.example/path"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "invalid web origin" in err, err
    assert main(["serve", "mock", "--runtime", "mock", "--allowed-host", "proxy.example:443"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "invalid --allowed-host" in err, err
