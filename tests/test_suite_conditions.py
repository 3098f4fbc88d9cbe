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
    ("agents_interactive", "agent failed", _set("passes.plain.agents_failed", 1), "agent request"),
    ("agents_interactive", "stall", _set("passes.plain.max_stall_s", 31.0), "stalled"),
    ("agents_interactive", "chat slow", _set("passes.plain.chat.ttft_s", 1.01), "exceeds"),
    ("agents_interactive", "no chat lane", _set("agents", 4), "no lane for the chat"),
    ("agents_interactive", "no plain pass", lambda n: n["passes"].pop("plain"), "plain pass was not run"),
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


def test_shared_prefix_latency_branch_without_a_prefilled_count() -> None:
    n = fixture("shared_prefix--pass")
    n.update(prefilled_tokens=None, shared_ttft_p50=1.0, cold_ttft_p50=2.5)
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
    assert "| **passes / applicable** (own total) | 3/6 |" in text
    assert "| fail / inconclusive / error / n/a | 3 / 0 / 0 / 2 |" in text
    n = fixture("tool_session--pass")
    n.update(parsed=0, emitted=0)
    res = result("tool_session", n, "no calls")
    res.update(scenario="tool_session", system="peer")
    (tmp_path / "tool_session--peer.json").write_text(json.dumps(res))
    text = compare([tmp_path])
    assert "| **passes / applicable** (own total) | 3/6 |" in text
    assert "| fail / inconclusive / error / n/a | 2 / 1 / 0 / 2 |" in text  # a fail became inconclusive


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
    assert "| **passes on the 8 scenarios both ran** | 8/8 | 0/8 |" in text
    assert "| **passes / applicable** (own total) | 8/8 | 0/8 |" in text
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


# -- issue #16: one judged pass for everyone, feature rows beside, counted prefills, equal memory -------------------


def test_agents_every_system_is_judged_on_the_plain_pass_and_qos_is_a_feature_row() -> None:
    n = fixture("agents_interactive--pass")
    assert n["judged"] == "plain" and n["agents"] < n["lanes"]
    n["passes"]["plain"]["chat"]["ttft_s"] = 1.5  # a great QoS pass must not rescue a slow plain one
    n["passes"]["qos"]["chat"]["ttft_s"] = 0.05
    res = result("agents_interactive", n, "h")
    assert res["verdict"] == "fail" and "[plain]" in res["reason"]
    assert res["features"]["with QoS headers"]["verdict"] == "pass"
    n["passes"]["qos"]["chat"]["ttft_s"] = 1.5
    assert result("agents_interactive", n, "h")["features"]["with QoS headers"]["verdict"] == "fail"
    del n["passes"]["qos"]  # a server without QoS headers: the feature row is n/a, not a fail
    n["passes"]["plain"]["chat"]["ttft_s"] = 0.2
    res = result("agents_interactive", n, "h")
    assert res["verdict"] == "pass" and res["features"]["with QoS headers"]["verdict"] == "unsupported"


def test_daemon_restart_resume_by_id_is_a_separate_row_a_stateless_server_cannot_pass() -> None:
    n = fixture("daemon_restart--pass")
    res = result("daemon_restart", n, "h")
    assert res["verdict"] == "pass" and res["features"]["resume by id"]["verdict"] == "pass"
    broken = copy.deepcopy(n)
    broken["resume"]["text"] = broken["resume"]["text"][:-5]
    assert result("daemon_restart", broken, "h")["features"]["resume by id"]["verdict"] == "fail"
    broken = copy.deepcopy(n)
    broken["resume"].update(outcome="http", error="HTTP 404: unknown session")
    assert "failed" in result("daemon_restart", broken, "h")["features"]["resume by id"]["why"]
    stateless = copy.deepcopy(n)
    del stateless["resume"]  # llama-server: no resumable sessions
    res = result("daemon_restart", stateless, "h")
    assert res["verdict"] == "pass" and res["features"]["resume by id"]["verdict"] == "unsupported"


def test_shared_prefix_prefills_come_from_server_counts_and_are_at_least_one() -> None:
    n = fixture("shared_prefix--pass")
    assert n["prefilled_source"] == "superfluid_prefill_tokens_total"
    assert 1.0 <= n["prefix_prefills"] == judge_prefills(n) < 1.1
    # llama-server shape: 12 requests on 4 slots, each slot prefills the prefix once (timings.prompt_n)
    prefix, tail = 1300, 20
    slots = dict(requests=12, prompt_tokens_per_request=[prefix + tail] * 12, prefix_tokens=prefix,
                 prefilled_tokens=4 * prefix + 12 * tail, prefilled_source="timings.prompt_n",
                 shared_failed=0)
    assert judge_prefills(slots) == 4.0
    assert not judge("shared_prefix", slots).passed and "prefilled 4.00 times" in judge("shared_prefix", slots).why
    # no reuse reported at all: every request prefilled the whole prompt
    assert judge_prefills({**slots, "prefix_tokens": 0, "prefilled_tokens": 12 * (prefix + tail)}) == 12.0
    # one request per burst must be counted: a missing prompt count is no count
    assert judge_prefills({**slots, "prompt_tokens_per_request": [prefix + tail] * 11}) is None


def judge_prefills(n: dict[str, Any]) -> float | None:
    from superfluid.suite._conditions import prefix_prefills

    return prefix_prefills(n)


def test_prefilled_tokens_prefer_server_counters_then_timings_then_token_counts() -> None:
    from superfluid.suite._load import prefilled_tokens as _prefilled

    def reply(prompt: int, cached: int, prompt_n: int | None) -> Reply:
        r = Reply(stream=True, status=200, usage={"prompt_tokens": prompt,
                                                  "prompt_tokens_details": {"cached_tokens": cached}})
        r.timings = None if prompt_n is None else {"prompt_n": prompt_n, "cache_n": cached}
        return r

    hot = [reply(100, 0, 100), reply(100, 90, 12)]
    assert _prefilled(hot, 1000.0, 1111.0) == (111, "superfluid_prefill_tokens_total")
    assert _prefilled(hot, None, None) == (112, "timings.prompt_n")
    assert _prefilled([reply(100, 0, None), reply(100, 90, None)], None, None) == (110, "usage: prompt - cached")
    hot[1].error_kind = "http"
    assert _prefilled(hot, None, None) == (None, None)


def test_compare_shows_feature_rows_and_the_commits_the_cells_ran_on(tmp_path: Path) -> None:
    for scenario, rev in (("agents_interactive", "abc1234"), ("daemon_restart", "abc1234")):
        res = result(scenario, fixture(f"{scenario}--pass"), "h")
        res.update(scenario=scenario, system="ours", rev=rev)
        (tmp_path / f"{scenario}--ours.json").write_text(json.dumps(res))
    res = unsupported("daemon_restart", "stateless")
    res.update(scenario="daemon_restart", system="theirs", rev="abc1234")
    (tmp_path / "daemon_restart--theirs.json").write_text(json.dumps(res))
    text = compare([tmp_path])
    assert "All 3 cells ran at commit `abc1234`." in text
    assert "| agents_interactive: with QoS headers | pass |  |" in text
    assert "| daemon_restart: resume by id | pass | n/a |" in text
    assert "| **passes / applicable** (own total) | 2/2 | 0/0 |" in text  # feature rows are not in the totals
    assert "| fail / inconclusive / error / n/a | 0 / 0 / 0 / 0 | 0 / 0 / 0 / 1 |" in text
    res.update(rev="def5678-dirty")
    (tmp_path / "daemon_restart--theirs.json").write_text(json.dumps(res))
    assert "**Mixed commits**: `abc1234` (2 cells), `def5678-dirty` (1 cell)" in compare([tmp_path])


def test_cells_without_their_own_commit_take_the_manifests(tmp_path: Path) -> None:
    res = result("kv_exhaustion", fixture("kv_exhaustion--pass"), "h")
    res.update(scenario="kv_exhaustion", system="ours")
    (tmp_path / "kv_exhaustion--ours.json").write_text(json.dumps(res))
    (tmp_path / "manifest.json").write_text(json.dumps({"versions": {"superfluid_rev": "245d9af"}}))
    assert "All 1 cells ran at commit `245d9af`." in compare([tmp_path])


def test_sse_event_id_counts_only_once_its_data_was_read() -> None:
    reply = read(b"id: 3\n" + CHUNK % b"a" + b"id: 4\n" + CHUNK % b"b" + b"id: 5\n")
    assert reply.content == "ab" and reply.last_event_id == "4"


def test_every_system_gets_the_kv_cells_a_superfluid_worker_allocates(tmp_path: Path) -> None:
    from superfluid.suite._process import Server
    from superfluid.suite._systems import Box, kv_cells, system_spec

    box = Box(name="t", root=tmp_path, data={"llama_server": "bin/llama-server", "models": {"gguf": "m.gguf"}})
    theirs = Server(system_spec("llama-server", box, mock_spec="mock"), lanes=4, ctx=1024, run_dir=tmp_path).argv()
    assert theirs[theirs.index("-c") + 1] == str(kv_cells(4, 1024)) == str(6 * 1024)
    assert theirs[theirs.index("-np") + 1] == "4" and theirs[theirs.index("--cache-ram") + 1] == "0"
    ours = Server(system_spec("superfluid-mock", box, mock_spec="mock"), lanes=4, ctx=1024, run_dir=tmp_path).argv()
    assert ours[ours.index("--host-cache-mb") + 1] == "0"
    assert ours[ours.index("--max-batch") + 1] == "4"
    # and it is what the worker really allocates: the recorded mock run's KV gauge
    kv = fixture("kv_exhaustion--pass")
    assert kv["kv_tokens"] == kv_cells(kv["lanes"], kv["ctx"]) and kv["kv_tokens_source"] == "superfluid_kv_total_tokens"
    assert kv["demand_ratio"] == round(kv["demand_tokens"] / kv["kv_tokens"], 2)


def test_the_mlx_systems_pair_ours_with_mlx_lm_server_on_equal_lanes(tmp_path: Path) -> None:
    """superfluid-mlx names the runtime for its MLX model only (its GGUF companion keeps llama.cpp);
    mlx-lm-server gets the lanes as decode and prompt concurrency, and the model the box names."""
    from superfluid.suite._process import Server
    from superfluid.suite._systems import Box, system_spec

    (tmp_path / "smol-mlx").mkdir()
    box = Box(name="t", root=tmp_path, data={"models": {"mlx": "smol-mlx", "small_gguf": "small.gguf",
                                                        "mlx_server_model": "smol-f32"},
                                             "mlx_server_env": {"LD_PRELOAD": "/x/libopenblas.so.0"}})
    ours_spec = system_spec("superfluid-mlx", box, mock_spec="mock")
    ours = Server(ours_spec, lanes=4, ctx=1024, run_dir=tmp_path, companion=True).argv()
    assert ours[ours.index("--runtime") + 1] == f"{tmp_path / 'smol-mlx'}=mlx"
    assert ours[ours.index("--model") + 1] == str(tmp_path / "small.gguf")
    assert ours_spec.caps.worker_pattern == "superfluid-worker-mlx"
    theirs_spec = system_spec("mlx-lm-server", box, mock_spec="mock")
    theirs = Server(theirs_spec, lanes=4, ctx=1024, run_dir=tmp_path).argv()
    assert theirs[theirs.index("--model") + 1] == str(tmp_path / "smol-f32")
    assert theirs[theirs.index("--decode-concurrency") + 1] == theirs[theirs.index("--prompt-concurrency") + 1] == "4"
    assert theirs_spec.env == {"LD_PRELOAD": "/x/libopenblas.so.0"} and theirs_spec.model_id == "default_model"


# -- tool_session forces the call: a fake server that calls the tool only when told to --------------------------

def _sse(*objs: dict[str, Any]) -> bytes:
    return b"".join(b"data: " + json.dumps(o).encode() + b"\n\n" for o in objs) + b"data: [DONE]\n\n"


async def _tool_server(stream: trio.SocketStream, seen: list[Any], refuse_forcing: bool) -> None:
    data = b""
    while b"\r\n\r\n" not in data:
        data += await stream.receive_some(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")),
                  0)
    while len(body) < length:
        body += await stream.receive_some(65536)
    if head.startswith(b"GET /v1/models"):
        payload = json.dumps({"data": [{"id": "fake"}]}).encode()
        await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                              % (len(payload), payload))
        await stream.aclose()
        return
    req = json.loads(body)
    choice = req.get("tool_choice")
    seen.append(choice)
    if choice == "required" and refuse_forcing:
        err = b'{"error":{"message":"constrained output is not available","code":"unsupported_parameter"}}'
        await stream.send_all(b"HTTP/1.1 400 Bad Request\r\ncontent-length: %d\r\n\r\n%s" % (len(err), err))
    elif choice == "required":
        account = req["messages"][-1]["content"].split()[-1].rstrip("?")
        call = {"index": 0, "id": "c1", "function": {"name": "lookup_code", "arguments": json.dumps({"account": account})}}
        await stream.send_all(SSE_HEAD + _chunked(_sse({"choices": [{"delta": {"tool_calls": [call]}}]},
                                                       {"choices": [{"delta": {}, "finish_reason": "tool_calls"}]})))
    else:  # unforced: answers in words (with the tool result, when there is one)
        last = req["messages"][-1]
        text = f"The code is {last['content']}." if last["role"] == "tool" else "I cannot look that up."
        await stream.send_all(SSE_HEAD + _chunked(_sse({"choices": [{"delta": {"content": text}}]},
                                                       {"choices": [{"delta": {}, "finish_reason": "stop"}]})))
    await stream.aclose()


@pytest.mark.parametrize("refuse_forcing", [False, True])
async def test_tool_session_forces_the_call_so_calls_are_shown(tmp_path: Path, refuse_forcing: bool) -> None:
    from superfluid.suite._behaviour import tool_session
    from superfluid.suite._corpus import SCALES
    from superfluid.suite._process import Context
    from superfluid.suite._systems import attached_spec

    seen: list[Any] = []
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, lambda s: _tool_server(s, seen, refuse_forcing), 0,
                                                host="127.0.0.1"))
        port = int(listeners[0].socket.getsockname()[1])
        ctx = Context(spec=attached_spec("fake", port), scale=SCALES["quick"], run_dir=tmp_path, url_port=port,
                      note=lambda line: None)
        res = await tool_session(ctx)
        nursery.cancel_scope.cancel()
    n = res["numbers"]
    if refuse_forcing:  # the server refuses to force: asked with auto, no call shown, so no verdict either way
        assert res["verdict"] == "inconclusive" and n["forced"] is False and "constrained" in n["forced_refused"]
        assert n["parsed"] == 0 and "forcing refused" in res["headline"]
    else:
        assert seen[0] == "required" and seen[1] == "auto"
        assert res["verdict"] == "pass", res["reason"]
        assert n["parsed"] == n["turns"] == n["answers_correct"] and n["bad_args"] == 0 and n["leaks"] == 0
