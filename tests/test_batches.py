"""OpenAI's Batches API (SPEC.md §7 "Batches"): the official SDK against the daemon, error
lines, cancel as a cancel scope, the background class, tenancy, and a SIGKILL mid-batch on
SmolLM2 that ends with every line exactly once."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from superfluid.proto._batch import decode, encode, replay
from superfluid.serving import ApiKey

from .conftest import REAL_GGUF, mock_config, open_daemon
from .test_sessions import _free_port, _reap, _wait_ready


def _chat_line(i: int, *, model: str = "mock", max_tokens: int = 8, url: str = "/v1/chat/completions") -> dict[str, Any]:
    return {"custom_id": f"req-{i}", "method": "POST", "url": url,
            "body": {"model": model, "messages": [{"role": "user", "content": f"Say the number {i}."}],
                     "max_tokens": max_tokens, "temperature": 0}}


def _jsonl(lines: list[Any]) -> bytes:
    return b"".join((x if isinstance(x, bytes) else json.dumps(x).encode()) + b"\n" for x in lines)


async def _wait_status(c: httpx.AsyncClient, bid: str, statuses: tuple[str, ...], *, limit_s: float = 60,
                       headers: dict[str, str] | None = None) -> dict[str, Any]:
    with trio.fail_after(limit_s):
        while True:
            r = await c.get(f"/v1/batches/{bid}", headers=headers)
            assert r.status_code == 200, r.text
            if r.json()["status"] in statuses:
                return r.json()
            await trio.sleep(0.05)


def test_a_torn_record_ends_the_log_and_a_line_counts_once() -> None:
    created = {"t": "created", "id": "batch_x", "tenant": "", "at": 1, "expires_at": 2}
    records = [created, {"t": "started", "total": 2, "at": 1},
               {"t": "line", "i": 0, "ok": True, "out": b"{}"}, {"t": "line", "i": 0, "ok": False, "out": b"{}"},
               {"t": "line", "i": 1, "ok": False, "out": b"{}"}]
    data = b"".join(encode(r) for r in records)
    state = replay(decode(data))
    assert state is not None and state.total == 2 and (state.completed, state.failed) == (1, 1)
    torn = decode(data[:-3])
    assert torn.good_end == len(data) - len(encode(records[-1]))
    state = replay(torn)
    assert state is not None and (state.completed, state.failed) == (1, 0)
    flipped = bytearray(data)
    flipped[-1] ^= 0xFF
    assert decode(bytes(flipped)).good_end == torn.good_end
    assert replay(decode(b"")) is None


async def test_the_openai_sdk_runs_a_batch_and_bad_lines_are_error_lines() -> None:
    import openai

    good = [_chat_line(i) for i in range(12)]
    bad = [b"{not json", {"custom_id": "req-0", "method": "POST", "url": "/v1/chat/completions", "body": {}},
           _chat_line(100, url="/v1/embeddings"), {"method": "POST", "url": "/v1/chat/completions", "body": {}},
           _chat_line(101, model="no-such-model"), {**_chat_line(102), "body": {**_chat_line(102)["body"], "stream": True}}]
    async with open_daemon(mock_config()) as d:
        client = openai.AsyncOpenAI(base_url=d.url + "/v1", api_key="x")
        f = await client.files.create(file=("in.jsonl", io.BytesIO(_jsonl(good[:6] + bad + good[6:]))), purpose="batch")
        batch = await client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                            completion_window="24h", metadata={"run": "sdk"})
        assert batch.status in ("validating", "in_progress") and batch.metadata == {"run": "sdk"}
        with trio.fail_after(60):
            while (batch := await client.batches.retrieve(batch.id)).status not in ("completed", "failed"):
                await trio.sleep(0.05)
        assert batch.status == "completed", batch
        assert batch.request_counts is not None
        assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (18, 12, 6)
        out = [json.loads(x) for x in (await client.files.content(batch.output_file_id)).read().splitlines()]
        assert [x["custom_id"] for x in out] == [f"req-{i}" for i in range(12)]   # input order
        assert all(x["response"]["status_code"] == 200 and x["error"] is None for x in out)
        assert all(x["response"]["body"]["object"] == "chat.completion" for x in out)
        errs = [json.loads(x) for x in (await client.files.content(batch.error_file_id)).read().splitlines()]
        codes = [(e["error"] or {}).get("code") or e["response"]["status_code"] for e in errs]
        assert codes == ["invalid_json", "duplicate_custom_id", "invalid_url", "missing_custom_id", 404,
                         "stream_unsupported"], codes
        assert errs[4]["custom_id"] == "req-101" and errs[4]["response"]["body"]["error"]["code"] == "model_not_found"
        listed = await client.batches.list()
        assert [b.id for b in listed.data] == [batch.id]
        out_file = await client.files.retrieve(batch.output_file_id)
        assert out_file.purpose == "batch_output"


async def test_a_batch_is_refused_typed() -> None:
    async with open_daemon(mock_config()) as d:
        c = d.client
        r = await c.post("/v1/batches", json={"input_file_id": "file-nope", "endpoint": "/v1/chat/completions",
                                              "completion_window": "24h"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "file_not_found"
        up = await c.post("/v1/files", files={"file": ("x.jsonl", _jsonl([_chat_line(0)]))}, data={"purpose": "batch"})
        assert up.status_code == 200, up.text
        fid = up.json()["id"]
        for body, param in (({"endpoint": "/v1/messages"}, "endpoint"), ({"completion_window": "1h"}, "completion_window"),
                            ({"metadata": {"k": 1}}, "metadata"), ({"color": "red"}, "color")):
            r = await c.post("/v1/batches", json={"input_file_id": fid, "endpoint": "/v1/chat/completions",
                                                  "completion_window": "24h", **body})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        r = await c.post("/v1/batches", json={"input_file_id": fid, "endpoint": "/v1/chat/completions",
                                              "completion_window": "24h"}, headers={"x-superfluid-qos": "interactive"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "qos_class_not_allowed"
        assert (await c.get("/v1/batches/batch_nope")).status_code == 404
        assert (await c.post("/v1/batches/batch_nope/cancel")).status_code == 404
        empty = (await c.post("/v1/files", files={"file": ("e.jsonl", b"\n\n")}, data={"purpose": "batch"})).json()["id"]
        r = await c.post("/v1/batches", json={"input_file_id": empty, "endpoint": "/v1/chat/completions",
                                              "completion_window": "24h"})
        failed = await _wait_status(c, r.json()["id"], ("failed",))
        assert failed["errors"]["data"][0]["code"] == "empty_file"
        r = await c.post(f"/v1/batches/{failed['id']}/cancel")
        assert r.status_code == 409 and r.json()["error"]["code"] == "batch_not_cancellable"


async def test_cancel_ends_the_running_lines_and_keeps_what_finished() -> None:
    lines = [_chat_line(i, max_tokens=400) for i in range(24)]
    async with open_daemon(mock_config("mock?step_ms=5&prefill_us=5", max_batch=2)) as d:
        c = d.client
        fid = (await c.post("/v1/files", files={"file": ("x.jsonl", _jsonl(lines))}, data={"purpose": "batch"})).json()["id"]
        bid = (await c.post("/v1/batches", json={"input_file_id": fid, "endpoint": "/v1/chat/completions",
                                                 "completion_window": "24h"})).json()["id"]
        with trio.fail_after(60):
            while (await c.get(f"/v1/batches/{bid}")).json()["request_counts"]["completed"] < 2:
                await trio.sleep(0.05)
        import openai

        cancelled = await openai.AsyncOpenAI(base_url=d.url + "/v1", api_key="x").batches.cancel(bid)
        assert cancelled.status in ("cancelling", "cancelled")
        done = await _wait_status(c, bid, ("cancelled",))
        counts = done["request_counts"]
        assert counts["total"] == 24 and 2 <= counts["completed"] < 24 and counts["failed"] == 0
        out = (await c.get(f"/v1/files/{done['output_file_id']}/content")).content.splitlines()
        assert len(out) == counts["completed"]
        # the cancelled lines' jobs ended with the scope: the model's lanes are free at once
        with trio.fail_after(5):
            while 'superfluid_lanes_active{model="mock"} 0.0' not in (await c.get("/metrics")).text:
                await trio.sleep(0.02)


async def test_batch_lines_run_in_the_background_class_and_a_chat_goes_first() -> None:
    lines = [_chat_line(i, max_tokens=300) for i in range(16)]
    async with open_daemon(mock_config("mock?step_ms=5&prefill_us=5", max_batch=2)) as d:
        c = d.client
        fid = (await c.post("/v1/files", files={"file": ("x.jsonl", _jsonl(lines))}, data={"purpose": "batch"})).json()["id"]
        bid = (await c.post("/v1/batches", json={"input_file_id": fid, "endpoint": "/v1/chat/completions",
                                                 "completion_window": "24h"})).json()["id"]
        await _wait_status(c, bid, ("in_progress",))
        with trio.fail_after(30):
            while 'superfluid_lanes_active{model="mock"} 2.0' not in (await c.get("/metrics")).text:
                await trio.sleep(0.02)
        r = await c.post("/v1/chat/completions", headers={"x-superfluid-qos": "interactive"},
                         json={"model": "mock", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5})
        assert r.status_code == 200
        # every lane was the batch's: the chat took one by preempting a background line, and it
        # ended while the batch still ran
        metrics = (await c.get("/metrics")).text
        assert 'superfluid_preemptions_total{model="mock"}' in metrics
        assert 'superfluid_preemptions_total{model="mock"} 0.0' not in metrics
        assert (await c.get(f"/v1/batches/{bid}")).json()["status"] == "in_progress"
        done = await _wait_status(c, bid, ("completed",))
        assert done["request_counts"]["completed"] == 16   # the preempted line came back and finished
        classes = [s["qos"] for s in (await c.get("/v1/sessions?limit=1000")).json()["data"]]
        assert classes.count("background") >= 16 and classes.count("interactive") == 1, classes


async def test_batches_belong_to_their_key() -> None:
    keys = (ApiKey.from_secret("a", "ka"), ApiKey.from_secret("b", "kb"))
    a, b = {"authorization": "Bearer ka"}, {"authorization": "Bearer kb"}
    async with open_daemon(mock_config(api_keys=keys)) as d:
        c = d.client
        fid = (await c.post("/v1/files", files={"file": ("x.jsonl", _jsonl([_chat_line(0)]))},
                            data={"purpose": "batch"}, headers=a)).json()["id"]
        body = {"input_file_id": fid, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
        r = await c.post("/v1/batches", json=body, headers=b)
        assert r.status_code == 404 and r.json()["error"]["code"] == "file_not_found"   # not B's file
        bid = (await c.post("/v1/batches", json=body, headers=a)).json()["id"]
        done = await _wait_status(c, bid, ("completed",), headers=a)
        assert (await c.get(f"/v1/batches/{bid}", headers=b)).status_code == 404
        assert (await c.post(f"/v1/batches/{bid}/cancel", headers=b)).status_code == 404
        assert (await c.get("/v1/batches", headers=b)).json()["data"] == []
        assert (await c.get(f"/v1/files/{done['output_file_id']}/content", headers=b)).status_code == 404
        assert (await c.get(f"/v1/files/{done['output_file_id']}/content", headers=a)).status_code == 200
        # the line's generation is the owner's session (its tenant), as a request of the key's would be
        assert len((await c.get("/v1/sessions", headers=a)).json()["data"]) == 1
        assert (await c.get("/v1/sessions", headers=b)).json()["data"] == []
        # a line runs as the batch's owner: key a may not use a model its policy leaves out
    limited = (ApiKey.from_secret("a", "ka", models=("other",)),)
    async with open_daemon(mock_config(api_keys=limited)) as d:
        c = d.client
        fid = (await c.post("/v1/files", files={"file": ("x.jsonl", _jsonl([_chat_line(0)]))},
                            data={"purpose": "batch"}, headers=a)).json()["id"]
        bid = (await c.post("/v1/batches", json={**body, "input_file_id": fid}, headers=a)).json()["id"]
        done = await _wait_status(c, bid, ("completed",), headers=a)
        err = json.loads((await c.get(f"/v1/files/{done['error_file_id']}/content", headers=a)).content)
        assert err["response"]["status_code"] == 403
        assert err["response"]["body"]["error"]["code"] == "model_not_allowed"


async def test_a_full_queue_is_429(monkeypatch: pytest.MonkeyPatch) -> None:
    from superfluid.api import _batches

    monkeypatch.setattr(_batches, "MAX_PENDING", 1)
    lines = [_chat_line(i, max_tokens=400) for i in range(8)]
    async with open_daemon(mock_config("mock?step_ms=5&prefill_us=5", max_batch=1)) as d:
        c = d.client
        fid = (await c.post("/v1/files", files={"file": ("x.jsonl", _jsonl(lines))}, data={"purpose": "batch"})).json()["id"]
        body = {"input_file_id": fid, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
        first = (await c.post("/v1/batches", json=body)).json()["id"]
        r = await c.post("/v1/batches", json=body)
        assert r.status_code == 429 and r.json()["error"]["code"] == "batch_queue_full"
        await c.post(f"/v1/batches/{first}/cancel")
        await _wait_status(c, first, ("cancelled",))
        assert (await c.post("/v1/batches", json=body)).status_code == 200


def _spawn(port: int, sessions: Path, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "superfluid", "serve", str(REAL_GGUF), "--http", f"127.0.0.1:{port}",
             "--sessions", str(sessions), "--max-batch", "8", "--log-level", "INFO", "--threads", "2"],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _logged_lines(sessions: Path, bid: str) -> dict[int, str]:
    """Each logged line's index and its ``batch_req`` id, read from the batch's own log."""
    state = decode((sessions / "batches" / bid / "log").read_bytes())
    return {int(body["i"]): json.loads(body["out"])["id"] for _o, _n, body in state.records if body["t"] == "line"}


@pytest.mark.real
@pytest.mark.slow
async def test_sigkill_mid_batch_then_restart_gives_every_line_exactly_once(tmp_path: Path) -> None:
    """500 lines on SmolLM2; the daemon's process group is SIGKILLed with the batch part done;
    the restarted daemon finishes it: 500 output lines, each custom_id once, and the lines
    logged before the kill are the ones in the output (not run again)."""
    from superfluid.models._files import model_name

    model = model_name(str(REAL_GGUF), "llamacpp")
    lines = [_chat_line(i, model=model, max_tokens=6) for i in range(500)]
    port, sessions, log = _free_port(), tmp_path / "sessions", tmp_path / "daemon.log"
    url = f"http://127.0.0.1:{port}"
    proc = _spawn(port, sessions, log)
    try:
        await _wait_ready(url, proc)
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:
            fid = (await c.post("/v1/files", files={"file": ("x.jsonl", _jsonl(lines))},
                                data={"purpose": "batch"})).json()["id"]
            bid = (await c.post("/v1/batches", json={"input_file_id": fid, "endpoint": "/v1/chat/completions",
                                                     "completion_window": "24h"})).json()["id"]
            with trio.fail_after(300):
                while (await c.get(f"/v1/batches/{bid}")).json()["request_counts"]["completed"] < 100:
                    await trio.sleep(0.1)
        _reap(proc)
        before = _logged_lines(sessions, bid)
        assert 100 <= len(before) < 500
        proc = _spawn(port, sessions, log)
        await _wait_ready(url, proc)
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:
            done = await _wait_status(c, bid, ("completed", "failed"), limit_s=600)
            assert done["status"] == "completed", done
            assert done["request_counts"] == {"total": 500, "completed": 500, "failed": 0}
            out = [json.loads(x) for x in (await c.get(f"/v1/files/{done['output_file_id']}/content")).content.splitlines()]
        assert [x["custom_id"] for x in out] == [f"req-{i}" for i in range(500)]
        assert all(x["response"]["status_code"] == 200 and x["response"]["body"]["choices"][0]["message"]["content"]
                   for x in out)
        assert all(out[i]["id"] == rid for i, rid in before.items())  # logged before the kill: kept, not re-run
    finally:
        _reap(proc)


async def test_the_cli_submits_follows_and_fetches_results(tmp_path: Path) -> None:
    """``superfluid batch``: bare bodies become lines, ``--model`` fills them, ``--wait`` follows
    the batch to its end, ``results`` writes both files; a daemon that is not there is one line."""
    src = tmp_path / "in.jsonl"
    src.write_bytes(_jsonl([{"messages": [{"role": "user", "content": f"hi {i}"}], "max_tokens": 4}
                            for i in range(5)] + [{"messages": "not a list"}]))
    async with open_daemon(mock_config()) as d:
        server = ["--server", d.url]
        cli = [sys.executable, "-m", "superfluid", "batch"]
        done = await trio.run_process([*cli, "submit", str(src), "--model", "mock", "--wait", *server],
                                      capture_stdout=True, capture_stderr=True, check=False)
        assert done.returncode == 0, done.stderr
        bid = done.stdout.decode().split()[0]
        assert b"completed: 5 completed, 1 failed of 6" in done.stderr
        out, errs = tmp_path / "out.jsonl", tmp_path / "errors.jsonl"
        done = await trio.run_process([*cli, "results", bid, "--out", str(out), "--errors", str(errs), *server],
                                      capture_stdout=True, capture_stderr=True, check=False)
        assert done.returncode == 0, done.stderr
        assert [json.loads(x)["custom_id"] for x in out.read_bytes().splitlines()] == [f"line-{i}" for i in range(1, 6)]
        assert json.loads(errs.read_bytes())["response"]["status_code"] == 400
        listed = await trio.run_process([*cli, "list", *server], capture_stdout=True, check=False)
        assert listed.stdout.decode().startswith(bid)
    gone = await trio.run_process([*cli, "status", bid, "--server", "127.0.0.1:1"], capture_stdout=True,
                                  capture_stderr=True, check=False)
    assert gone.returncode == 1 and len(gone.stderr.decode().strip().splitlines()) == 1, gone.stderr
