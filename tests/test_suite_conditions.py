"""The suite's pass conditions and reply classification, on recorded fixtures.

Every scenario's check must pass its passing fixture and fail its failing
one (plus a few inline mutations), so no scenario can silently become
unfailable. The SSE reader and the h11 client are checked on canned bytes.
"""

from __future__ import annotations

import copy
import json
from functools import partial
from pathlib import Path
from typing import Any, Callable

import pytest
import trio

from superfluid.suite import CHECKS, CONDITIONS, SCENARIOS, Client, Reply, StreamReader, judge, read_whole
from superfluid.suite._compare import compare
from superfluid.suite._conditions import result, unsupported

FIXTURES = Path(__file__).parent / "fixtures" / "suite"


def fixture(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def test_every_scenario_has_a_check_condition_and_fixtures() -> None:
    assert list(CHECKS) == list(SCENARIOS) == list(CONDITIONS)
    for scenario in SCENARIOS:
        assert (FIXTURES / f"{scenario}--pass.json").exists()
        assert (FIXTURES / f"{scenario}--fail.json").exists()


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_pass_fixture_passes(scenario: str) -> None:
    check = judge(scenario, fixture(f"{scenario}--pass"))
    assert check.passed, check.why
    assert check.why


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_fail_fixture_fails_with_a_one_line_reason(scenario: str) -> None:
    check = judge(scenario, fixture(f"{scenario}--fail"))
    assert not check.passed
    assert check.why and "\n" not in check.why


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(n: dict[str, Any]) -> None:
        *head, last = path.split(".")
        target = n
        for key in head:
            target = target[key]
        target[last] = value

    return mutate


MUTATIONS: list[tuple[str, str, Callable[[dict[str, Any]], None], str]] = [
    ("worker_kill", "no kill", _set("workers_killed", 0), "no worker was killed"),
    ("worker_kill", "no recovery", _set("recovery_s", None), "did not serve again"),
    ("worker_kill", "after differs", _set("after.text", "other"), "after recovery differs"),
    ("worker_kill", "duplicated text", lambda n: n["cut"].update(text=n["reference_text"] + " again"),
     "differs from the reference"),
    ("daemon_restart", "no restart", lambda n: n.update(restarted=False, start_error="exit 1"), "did not restart"),
    ("daemon_restart", "first failed", _set("first.outcome", "http"), "failed"),
    ("agents_interactive", "agent failed", _set("passes.qos.agents_failed", 1), "agent request"),
    ("agents_interactive", "stall", _set("passes.qos.max_stall_s", 31.0), "stalled"),
    ("agents_interactive", "chat slow", _set("passes.qos.chat.ttft_s", 1.01), "exceeds"),
    ("kv_exhaustion", "timeout", _set("outcomes", {"ok": 15, "timeout": 1}), "untyped"),
    ("kv_exhaustion", "fresh failed", _set("fresh.outcome", "transport"), "fresh request"),
    ("kv_exhaustion", "missing", _set("outcomes", {"ok": 3}), "recorded"),
    ("unload_reload", "untyped stream", _set("streams", [{"outcome": "truncated"}]), "without a typed error"),
    ("unload_reload", "never back", _set("served_again", False), "did not serve again"),
    ("tool_session", "leak", _set("leaks", 1), "leaked"),
    ("tool_session", "emitted != parsed", _set("emitted", 32), "parsed"),
    ("tool_session", "short", _set("turns_done", 39), "turns done"),
    ("client_disconnect", "slow free", _set("modes.stream.lanes_zero_after_s", 1.5), "reached 0 only"),
    ("client_disconnect", "not dropped", _set("modes.stream.dropped", 3), "ended before"),
    ("client_disconnect", "probes failed", _set("modes.nonstream.probes_failed", 2), "probe"),
    ("shared_prefix", "failures", _set("shared_failed", 1), "failed"),
]


@pytest.mark.parametrize(("scenario", "label", "mutate", "needle"), MUTATIONS,
                         ids=[f"{m[0]}:{m[1]}" for m in MUTATIONS])
def test_mutated_pass_fixture_fails(scenario: str, label: str, mutate: Callable[[dict[str, Any]], None],
                                    needle: str) -> None:
    numbers = copy.deepcopy(fixture(f"{scenario}--pass"))
    mutate(numbers)
    check = judge(scenario, numbers)
    assert not check.passed, label
    assert needle in check.why


def test_worker_kill_typed_error_branch_passes() -> None:
    n = fixture("worker_kill--pass")
    k = n["delivered_at_kill_chars"]
    n["cut"].update(outcome="event", error="worker died", text=n["reference_text"][:k])
    assert judge("worker_kill", n).passed


def test_disconnect_latency_branch_when_lanes_are_unobservable() -> None:
    n = fixture("client_disconnect--pass")
    for m in n["modes"].values():
        m.update(busy_observable=False, lanes_zero_after_s=None, idle_ttft_p50=0.2, probe_ttft_p50=0.85)
    assert judge("client_disconnect", n).passed
    n["modes"]["stream"]["probe_ttft_p50"] = 0.95
    assert not judge("client_disconnect", n).passed


def test_shared_prefix_latency_branch_without_cached_report() -> None:
    n = fixture("shared_prefix--pass")
    n.update(cached_reported=False, shared_ttft_p50=1.0, cold_ttft_p50=2.5)
    assert judge("shared_prefix", n).passed
    n["cold_ttft_p50"] = 1.9
    assert not judge("shared_prefix", n).passed


def test_scores_are_passes_over_applicable_cells(tmp_path: Path) -> None:
    for i, scenario in enumerate(SCENARIOS):
        kind = "pass" if i < 3 else "fail"
        res = result(scenario, fixture(f"{scenario}--{kind}"), kind) if i < 6 else unsupported(scenario, "no")
        res.update(scenario=scenario, system="peer")
        (tmp_path / f"{scenario}--peer.json").write_text(json.dumps(res))
    text = compare([tmp_path])
    assert "| **passes / applicable** | 3/6 (2 n/a) |" in text


def test_a_tool_session_without_a_single_call_is_inconclusive() -> None:
    n = fixture("tool_session--pass")
    assert n["parsed"] > 0 and judge("tool_session", n).passed
    n.update(parsed=0, emitted=0, no_call=n["turns"])
    check = judge("tool_session", n)
    assert not check.passed and check.inconclusive
    assert result("tool_session", n, "h")["verdict"] == "inconclusive"


def test_result_and_compare_render_a_grid(tmp_path: Path) -> None:
    for scenario in SCENARIOS:
        for system, kind in (("ours", "pass"), ("theirs", "fail")):
            res = result(scenario, fixture(f"{scenario}--{kind}"), f"{scenario} {kind}")
            res.update(scenario=scenario, system=system)
            (tmp_path / f"{scenario}--{system}.json").write_text(json.dumps(res))
    (tmp_path / "manifest.json").write_text(json.dumps({"box": "t", "scale": "quick", "systems": ["ours", "theirs"]}))
    text = compare([tmp_path])
    assert "| worker_kill | pass | **FAIL** |" in text
    assert "| **passes / applicable** | 8/8 | 0/8 |" in text
    assert text.count("Pass condition:") == 8
    assert "  - why: " in text


# -- the SSE reader and classification ---------------------------------------------------------------------------

CHUNK = b'data: {"choices":[{"index":0,"delta":{"content":"%s"},"finish_reason":null}]}\n\n'
FINAL = (b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}],'
         b'"usage":{"prompt_tokens":9,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":4}}}\n\n')


def read(data: bytes, *, split: int = 7) -> Reply:
    reply = Reply(stream=True, status=200)
    reader = StreamReader(reply)
    for i in range(0, len(data), split):  # arbitrary read boundaries
        reader.feed(data[i : i + split], now=float(i))
    reader.end(now=1e6)
    return reply


def test_sse_complete_stream_is_ok() -> None:
    reply = read(CHUNK % b"Hel" + CHUNK % b"lo" + FINAL + b"data: [DONE]\n\n")
    assert reply.ok and reply.outcome == "ok"
    assert reply.content == "Hello" and reply.chunks == 2
    assert reply.finish_reason == "stop" and reply.done
    assert reply.cached_tokens == 4 and reply.prompt_tokens == 9


def test_sse_truncated_stream_is_untyped() -> None:
    reply = read(CHUNK % b"Hel" + CHUNK % b"lo")
    assert not reply.ok and reply.error_kind == "truncated" and not reply.typed_error


def test_sse_finish_reason_without_done_is_not_truncated() -> None:
    assert read(CHUNK % b"a" + FINAL).ok


def test_sse_error_frame_is_typed() -> None:
    err = b'data: {"error":{"message":"worker died","type":"server_error"}}\n\ndata: [DONE]\n\n'
    reply = read(CHUNK % b"a" + err)
    assert reply.error_kind == "event" and reply.typed_error and reply.error == "worker died"


def test_sse_error_event_line_is_typed() -> None:
    reply = read(CHUNK % b"a" + b'event: error\ndata: {"message":"kv full"}\n\n')
    assert reply.error_kind == "event" and reply.error == "kv full"


def test_sse_llama_server_error_field_is_typed() -> None:
    reply = read(CHUNK % b"a" + b'error: {"code":500,"message":"context full","type":"server_error"}\n\n')
    assert reply.error_kind == "event" and reply.error == "context full"


def test_sse_malformed_data_line() -> None:
    reply = read(CHUNK % b"a" + b"data: {not json\n\n" + FINAL + b"data: [DONE]\n\n")
    assert reply.error_kind == "malformed" and not reply.typed_error


def test_sse_tool_call_deltas_merge_by_index() -> None:
    parts = [b'{"index":0,"id":"c1","function":{"name":"lookup_","arguments":"{\\"acc"}}',
             b'{"index":0,"function":{"name":"code","arguments":"ount\\": \\"a\\"}"}}']
    body = b"".join(b'data: {"choices":[{"delta":{"tool_calls":[' + p + b"]}}]}\n\n" for p in parts)
    reply = read(body + FINAL + b"data: [DONE]\n\n")
    assert reply.tool_calls == [{"id": "c1", "type": "function",
                                 "function": {"name": "lookup_code", "arguments": '{"account": "a"}'}}]


def test_whole_body_classification() -> None:
    ok = Reply(status=200)
    read_whole(ok, b'{"choices":[{"message":{"content":"hi"},"finish_reason":"stop"}]}', 1.0)
    assert ok.ok and ok.content == "hi"
    http = Reply(status=503)
    read_whole(http, b'{"error":{"message":"busy"}}', 1.0)
    assert http.error_kind == "http" and http.typed_error
    bad = Reply(status=200)
    read_whole(bad, b"<html>", 1.0)
    assert bad.error_kind == "malformed"


# -- the h11 client on canned servers ------------------------------------------------------------------------------

async def _canned(nursery: trio.Nursery, response: bytes) -> int:
    """A one-shot loopback server: read the request head, write ``response``, close."""
    listeners = await nursery.start(partial(trio.serve_tcp, lambda s: _answer(s, response), 0, host="127.0.0.1"))
    return int(listeners[0].socket.getsockname()[1])


async def _answer(stream: trio.SocketStream, response: bytes) -> None:
    data = b""
    while b"\r\n\r\n" not in data:
        data += await stream.receive_some(65536)
    await stream.send_all(response)
    await stream.aclose()


SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def _chunked(*parts: bytes, end: bool = True) -> bytes:
    out = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts)
    return out + (b"0\r\n\r\n" if end else b"")


async def test_client_reads_a_complete_stream() -> None:
    async with trio.open_nursery() as nursery:
        port = await _canned(nursery, SSE_HEAD + _chunked(CHUNK % b"x", FINAL, b"data: [DONE]\n\n"))
        reply = await Client("127.0.0.1", port, model="m").chat("hi", max_tokens=4, timeout=5, limit=5)
        nursery.cancel_scope.cancel()
    assert reply.ok and reply.content == "x" and reply.chunks == 1 and reply.ttft is not None


async def test_client_classifies_a_cut_connection_as_truncated() -> None:
    async with trio.open_nursery() as nursery:
        port = await _canned(nursery, SSE_HEAD + _chunked(CHUNK % b"x", end=False))
        reply = await Client("127.0.0.1", port, model="m").chat("hi", max_tokens=4, timeout=5, limit=5)
        nursery.cancel_scope.cancel()
    assert reply.error_kind == "truncated" and reply.content == "x"


async def test_client_http_error_and_refused_connection() -> None:
    body = b'{"error":{"message":"nope"}}'
    async with trio.open_nursery() as nursery:
        port = await _canned(nursery, b"HTTP/1.1 400 Bad Request\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        reply = await Client("127.0.0.1", port, model="m").chat("hi", max_tokens=4, timeout=5, limit=5)
        nursery.cancel_scope.cancel()
    assert reply.status == 400 and reply.error_kind == "http"
    refused = await Client("127.0.0.1", port, model="m").chat("hi", max_tokens=4, timeout=5, limit=5)
    assert refused.error_kind == "transport"


async def test_client_aborts_after_n_chunks() -> None:
    async with trio.open_nursery() as nursery:
        port = await _canned(nursery, SSE_HEAD + _chunked(*(CHUNK % b"y" for _ in range(5)), end=False))
        reply = await Client("127.0.0.1", port, model="m").chat("hi", max_tokens=4, timeout=5, limit=5,
                                                                 abort_after_chunks=3)
        nursery.cancel_scope.cancel()
    assert reply.aborted and reply.outcome == "aborted" and reply.chunks == 3


def test_client_refuses_non_loopback_hosts() -> None:
    with pytest.raises(ValueError):
        Client("10.1.2.3", 80)
